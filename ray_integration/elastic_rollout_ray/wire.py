"""The placements API's objects as the shim sees them (docs/ray.md), typed, and their one parser.

The manager is the source of truth; the shim reads ``GET /rollout/placements`` through
:func:`parse_placement_list`, which checks every field it relies on and names the one that is
wrong, so a manager of another version fails loudly instead of half-working.
"""

from __future__ import annotations

from typing import Literal, TypedDict, TypeVar, cast

__all__ = [
    "AgentBinding",
    "AgentInfo",
    "BindRequest",
    "BundleBinding",
    "LostRequest",
    "Placement",
    "PlacementList",
    "WireError",
    "parse_placement_list",
]

T = TypeVar("T")

Desired = Literal["present", "absent"]
PlacementStatus = Literal["PENDING_RESOURCES", "BOUND", "RELEASING"]


class WireError(ValueError):
    """An answer of the manager that does not have the documented shape."""


class AgentBinding(TypedDict):
    url: str
    node_id: str
    gpu_ids: list[str]


class Placement(TypedDict):
    engine_id: str
    #: one resource map per bundle, e.g. ``{"GPU": 1, "CPU": 1}``
    bundles: list[dict[str, float]]
    strategy: str
    initial: bool
    desired: Desired
    status: PlacementStatus
    agent: AgentBinding | None
    labels: dict[str, str]


class PlacementList(TypedDict):
    revision: int
    placements: list[Placement]


class BindRequest(TypedDict):
    agent_url: str
    node_id: str
    gpu_ids: list[str]


class LostRequest(TypedDict):
    agent_url: str
    reason: str


class AgentInfo(TypedDict):
    """What a node agent actor (``er-agent-<node_id>``) reports about its agent process."""

    url: str
    node_id: str
    pid: int | None
    running: bool
    restarts: int
    log: str


class BundleBinding(TypedDict):
    """Which agent hosts which bundle: the engine of placement ``engine_id`` runs on the GPUs
    ``gpu_ids`` of bundle ``bundle_index`` of its group, launched through the agent at
    ``agent_url`` on node ``node_id`` (one agent per node, shared by the engines there)."""

    engine_id: str
    bundle_index: int
    node_id: str
    gpu_ids: list[str]
    agent_url: str


def _field(obj: dict[str, object], key: str, kind: type[T], where: str) -> T:
    if key not in obj:
        raise WireError(f"{where}: missing {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"{where}: {key!r} is {value!r}, not {kind}")
    return value


def _placement(raw: object, index: int) -> Placement:
    where = f"placements[{index}]"
    if not isinstance(raw, dict):
        raise WireError(f"{where} is not an object")
    obj = cast(dict[str, object], raw)
    engine_id = _field(obj, "engine_id", str, where)
    where = f"placement {engine_id}"
    bundles: list[dict[str, float]] = []
    raw_bundles: list[object] = _field(obj, "bundles", list, where)
    for b in raw_bundles:
        if not isinstance(b, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in b.items()
        ):
            raise WireError(f"{where}: bundle {b!r} is not a map of resource name to amount")
        bundles.append({str(k): float(v) for k, v in b.items()})
    if not bundles:
        raise WireError(f"{where}: no bundles")
    # Typed `object` so that the `not in` checks narrow them to their Literal types.
    desired: object = _field(obj, "desired", str, where)
    if desired not in ("present", "absent"):
        raise WireError(f"{where}: desired {desired!r} is not present/absent")
    status: object = _field(obj, "status", str, where)
    if status not in ("PENDING_RESOURCES", "BOUND", "RELEASING"):
        raise WireError(f"{where}: unknown status {status!r}")
    agent: AgentBinding | None = None
    raw_agent = obj.get("agent")
    if raw_agent is not None:
        if not isinstance(raw_agent, dict):
            raise WireError(f"{where}: agent {raw_agent!r} is not an object")
        a = cast(dict[str, object], raw_agent)
        gpu_ids: list[object] = _field(a, "gpu_ids", list, f"{where} agent")
        agent = AgentBinding(
            url=_field(a, "url", str, f"{where} agent"),
            node_id=_field(a, "node_id", str, f"{where} agent"),
            gpu_ids=[str(g) for g in gpu_ids],
        )
    labels = obj.get("labels") or {}
    if not isinstance(labels, dict):
        raise WireError(f"{where}: labels {labels!r} is not an object")
    return Placement(
        engine_id=engine_id,
        bundles=bundles,
        strategy=_field(obj, "strategy", str, where),
        initial=_field(obj, "initial", bool, where),
        desired=desired,
        status=status,
        agent=agent,
        labels={str(k): str(v) for k, v in labels.items()},
    )


def parse_placement_list(raw: object) -> PlacementList:
    """``GET /rollout/placements``'s answer, checked.

    Raises:
        WireError: a field is missing or of the wrong type (the message names it).
    """
    if not isinstance(raw, dict):
        raise WireError(f"the placements answer is not an object: {raw!r:.200}")
    obj = cast(dict[str, object], raw)
    revision = _field(obj, "revision", int, "placements answer")
    items: list[object] = _field(obj, "placements", list, "placements answer")
    return PlacementList(revision=revision, placements=[_placement(p, i) for i, p in enumerate(items)])
