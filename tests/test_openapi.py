"""The served OpenAPI document is true: every path answers, and real responses match its schemas."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from _support import STARTUP_TIMEOUT, ManagerHandle, StartManager, http, wait_until
from _trainer import SPECS, StandInRank0

from elastic_rollout.trainer import DistributedWeightSync, GroupLayout


def schema_of(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}


def check(spec: dict[str, Any], name: str, value: Any) -> None:
    jsonschema.Draft202012Validator(schema_of(spec, name)).validate(value)


@pytest.fixture
def spec(shared_fleet: ManagerHandle) -> dict[str, Any]:
    resp = http("GET", f"{shared_fleet.control_url}/openapi.json")
    assert resp.status == 200 and resp.headers["content-type"].startswith("application/json")
    document: dict[str, Any] = resp.json()
    jsonschema.Draft202012Validator.check_schema(schema_of(document, "Engine"))
    return document


def test_the_served_document_is_the_generated_one(shared_fleet: ManagerHandle, manager_bin: Path) -> None:
    """The manager serves the document its handlers generate, and docs/openapi.json is that
    document (`make openapi` writes it with `rollout-manager openapi`)."""
    served = http("GET", f"{shared_fleet.control_url}/openapi.json").body
    printed = subprocess.run([str(manager_bin), "openapi"], capture_output=True, check=True, timeout=60).stdout
    committed = (Path(__file__).resolve().parents[1] / "docs" / "openapi.json").read_bytes()
    assert served == printed, "GET /openapi.json differs from `rollout-manager openapi`"
    assert committed == printed, "docs/openapi.json is out of date: run `make openapi` and commit it"
    # Every operation documents its answers, each body with a schema from the handler's types.
    operations = [(p, m, op) for p, ops in json.loads(served)["paths"].items() for m, op in ops.items()]
    assert len(operations) >= 34, len(operations)
    for path, method, op in operations:
        assert op["operationId"] and op["responses"], (method, path)
        for status, answer in op["responses"].items():
            assert answer["content"]["application/json"]["schema"], (method, path, status)


def test_every_documented_path_exists(shared_fleet: ManagerHandle, spec: dict[str, Any]) -> None:
    for path, methods in spec["paths"].items():
        concrete = path.replace("{id}", "no-such-id")
        for method in methods:
            resp = http(method.upper(), f"{shared_fleet.control_url}{concrete}", {} if method == "post" else None)
            if resp.status == 404:
                # The route exists: the 404 names the unknown id, it is not the fallback's no_such_route.
                expected = "unknown_engine" if path.startswith("/rollout/engines/") else "unknown_request"
                if path == "/rollout/weights/trainer_group":
                    expected = "no_trainer_group"  # the engines hold no group yet
                assert resp.json()["error"]["code"] == expected, (method, path, resp.body)
        # A method the route does not take: 405, the usual JSON error, and the methods it takes.
        resp = http("DELETE", f"{shared_fleet.control_url}{concrete}")
        assert resp.status == 405, (path, resp.status, resp.body)
        assert resp.json()["error"]["code"] == "method_not_allowed", (path, resp.body)
        allowed = {m.strip().lower() for m in resp.headers["allow"].split(",")}
        assert set(methods) <= allowed, (path, methods, resp.headers["allow"])


def test_responses_match_the_schemas(start_fleet: StartManager) -> None:
    fleet = start_fleet()
    spec = http("GET", f"{fleet.control_url}/openapi.json").json()
    check(spec, "EnginesView", http("GET", f"{fleet.control_url}/rollout/engines").json())
    accepted = http("POST", f"{fleet.control_url}/rollout/scale_out", {"num_replicas": 3}).json()
    check(spec, "Accepted", accepted)
    fleet.client.wait_for_operation("scale_out", accepted["request_id"], STARTUP_TIMEOUT)
    check(spec, "ScaleOutRecord", http("GET", f"{fleet.control_url}/rollout/scale_out/{accepted['request_id']}").json())
    check(spec, "ScaleOutList", http("GET", f"{fleet.control_url}/rollout/scale_out").json())
    check(
        spec,
        "DryRun",
        http("POST", f"{fleet.control_url}/rollout/scale_in", {"num_replicas": 2, "dry_run": True}).json(),
    )
    removal = http("POST", f"{fleet.control_url}/rollout/scale_in", {"num_replicas": 2}).json()
    check(spec, "Accepted", removal)
    fleet.client.wait_for_operation("scale_in", removal["request_id"], STARTUP_TIMEOUT)
    check(spec, "ScaleInRecord", http("GET", f"{fleet.control_url}/rollout/scale_in/{removal['request_id']}").json())
    check(spec, "ScaleInList", http("GET", f"{fleet.control_url}/rollout/scale_in").json())
    check(
        spec,
        "BatchCancelResult",
        http("POST", f"{fleet.control_url}/rollout/scale_out_cancel", {"dry_run": True}).json(),
    )
    for bad in ({"num_replicas": -1}, {"bogus": 1}, {"num_replicas": 1}):
        resp = http("POST", f"{fleet.control_url}/rollout/scale_in", bad)
        assert resp.status == 400
        check(spec, "Error", resp.json())
    # The request schemas reject what the server rejects.
    with pytest.raises(jsonschema.ValidationError):
        check(spec, "ScaleOutRequest", {"num_replica": 3})


def test_trainer_update_answers_match_the_schemas(start_fleet: StartManager) -> None:
    fleet = start_fleet()
    spec = http("GET", f"{fleet.control_url}/openapi.json").json()
    rank0 = StandInRank0()
    seen: list[dict[str, Any]] = []

    def join(layout: Any) -> None:
        # Mid-update: the update in flight, as GET /rollout/weights shows it.
        seen.append(http("GET", f"{fleet.control_url}/rollout/weights").json())
        rank0.join_group(layout)

    sync = DistributedWeightSync(fleet.client, join_group=join, broadcast=rank0.broadcast, timeout=60)
    done = sync.update("step-1", SPECS)
    assert done.update is not None
    check(spec, "Weights", seen[0])
    assert seen[0]["update"]["source"] == "trainer" and seen[0]["update"]["status"] == "PENDING"
    check(spec, "WeightUpdate", done.update.raw)
    check(spec, "Weights", http("GET", f"{fleet.control_url}/rollout/weights").json())
    bad = {"version": "v9", "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[1]], "master_address": "127.0.0.1"}
    resp = http("POST", f"{fleet.control_url}/rollout/weights/trainer_updates", bad)
    assert resp.status == 400 and "master_port" in resp.json()["error"]["message"]
    check(spec, "Error", resp.json())
    with pytest.raises(jsonschema.ValidationError):
        check(spec, "TrainerUpdateRequest", bad)
    check(spec, "GroupDestroyed", http("POST", f"{fleet.control_url}/rollout/weights/trainer_group/destroy", {}).json())

    # A group the trainer fixes: the request, the answer while its members join, and once joined.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    body = {"group_name": "fixed", "master_address": "127.0.0.1", "master_port": port, "world_size": 3}
    check(spec, "BuildGroupRequest", body)
    built = http("POST", f"{fleet.control_url}/rollout/weights/trainer_group", body)
    assert built.status == 202 and built.json()["fixed"] == {"state": "joining"}, built.body
    check(spec, "TrainerGroup", built.json())
    rank0.join_group(GroupLayout.from_json(built.json()))

    def joined() -> bool:
        group = http("GET", f"{fleet.control_url}/rollout/weights/trainer_group").json()
        return bool(group["fixed"]["state"] == "joined")

    wait_until(joined, 30, "the fixed group joined")
    check(spec, "TrainerGroup", http("GET", f"{fleet.control_url}/rollout/weights/trainer_group").json())
    bad = dict(body, world_size=1)
    resp = http("POST", f"{fleet.control_url}/rollout/weights/trainer_group", bad)
    assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_world_size", resp.body
    check(spec, "Error", resp.json())
    with pytest.raises(jsonschema.ValidationError):
        check(spec, "BuildGroupRequest", bad)
