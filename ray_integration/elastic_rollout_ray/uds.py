"""HTTP to the manager's control API over its Unix socket (``rollout-manager serve --api-socket``).

The socket is created by the manager with mode 0600, so only this user's processes on this node
reach it; the Serve ingress and the reconciler are the only callers. A token, when configured, is
sent as ``Authorization: Bearer`` on mutating requests and never logged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

__all__ = ["AsyncUdsClient", "ManagerApiError", "UdsClient", "load_token"]

#: Host part of URLs sent over the socket (only the path matters to the manager).
BASE_URL = "http://rollout-manager"


class ManagerApiError(RuntimeError):
    """The manager answered with an error status (or could not be reached)."""

    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{method} {path} -> {status}: {body}")


def load_token(api_token_file: str | None) -> str | None:
    """The manager's API token as the manager itself reads it: the file, else the environment."""
    if api_token_file:
        token = Path(api_token_file).read_text().strip()
        return token or None
    return os.environ.get("ROLLOUT_MANAGER_API_TOKEN", "").strip() or None


def _build(
    client: httpx.Client | httpx.AsyncClient, method: str, path: str, body: object, token: str | None, timeout: float
) -> httpx.Request:
    """The request both clients send: a JSON body, and the token on mutating requests only."""
    headers = {"Authorization": f"Bearer {token}"} if token and method not in ("GET", "HEAD") else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    content = None if body is None else json.dumps(body).encode()
    return client.build_request(method, path, content=content, headers=headers, timeout=timeout)


def _answer(method: str, path: str, resp: httpx.Response) -> Any:
    try:
        payload: Any = resp.json()
    except ValueError:
        payload = resp.text
    if not 200 <= resp.status_code < 300:
        raise ManagerApiError(method, path, resp.status_code, payload)
    return payload


@dataclass
class UdsClient:
    """A small synchronous client of the control API on a Unix socket."""

    socket_path: str
    token: str | None = None
    timeout: float = 10.0

    def __post_init__(self) -> None:
        self._client = httpx.Client(
            transport=httpx.HTTPTransport(uds=self.socket_path), base_url=BASE_URL, timeout=self.timeout
        )

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """One request; returns the decoded JSON body of a 2xx answer.

        Raises:
            ManagerApiError: a non-2xx answer (status and body kept), or status 0 when the socket
                cannot be reached.
        """
        request = _build(self._client, method, path, body, self.token, self.timeout if timeout is None else timeout)
        try:
            resp = self._client.send(request)
        except httpx.HTTPError as err:
            raise ManagerApiError(method, path, 0, f"cannot reach the manager on {self.socket_path}: {err}") from err
        return _answer(method, path, resp)

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body if body is not None else {})


@dataclass
class AsyncUdsClient:
    """The same client for asyncio code (the reconciler actor): one connection pool, no threads."""

    socket_path: str
    token: str | None = None
    timeout: float = 10.0

    def __post_init__(self) -> None:
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket_path), base_url=BASE_URL, timeout=self.timeout
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """As :meth:`UdsClient.request`."""
        request = _build(self._client, method, path, body, self.token, self.timeout if timeout is None else timeout)
        try:
            resp = await self._client.send(request)
        except httpx.HTTPError as err:
            raise ManagerApiError(method, path, 0, f"cannot reach the manager on {self.socket_path}: {err}") from err
        return _answer(method, path, resp)

    async def get(self, path: str, timeout: float | None = None) -> Any:
        return await self.request("GET", path, timeout=timeout)

    async def post(self, path: str, body: Any = None) -> Any:
        return await self.request("POST", path, body if body is not None else {})
