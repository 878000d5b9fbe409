"""The control API on the manager's Unix socket (``rollout-manager serve --api-socket``).

The shim talks to the manager with the package's one client, over the socket:
``RolloutClient(uds=path)`` (the supervisor's readiness probe) and ``AsyncRolloutClient(uds=path)``
(the reconciler); errors are :class:`~elastic_rollout.RolloutApiError` (status 0, the subclass
:class:`~elastic_rollout.RolloutConnectionError`, when the socket does not answer). The socket is
created by the manager with mode 0600, so only this user's processes on this node reach it. A
token, when configured, is sent as ``Authorization: Bearer`` and never logged.

This module keeps what is specific to the shim: :func:`load_token`, the host part of URLs sent over
the socket (:data:`BASE_URL`, for the Serve ingress), and :data:`ManagerApiError`, the earlier
name of the error type.
"""

from __future__ import annotations

import os
from pathlib import Path

from elastic_rollout.client import TOKEN_ENV, UDS_BASE_URL, RolloutApiError

__all__ = ["BASE_URL", "ManagerApiError", "load_token"]

#: Host part of URLs sent over the socket (only the path matters to the manager).
BASE_URL = UDS_BASE_URL

#: The earlier name of :class:`elastic_rollout.RolloutApiError` (the shim had its own error type).
ManagerApiError = RolloutApiError


def load_token(api_token_file: str | None) -> str | None:
    """The manager's API token as the manager itself reads it: the file, else the environment
    (``ROLLOUT_MANAGER_API_TOKEN``)."""
    if api_token_file:
        token = Path(api_token_file).read_text().strip()
        return token or None
    return os.environ.get(TOKEN_ENV, "").strip() or None
