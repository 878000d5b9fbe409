"""The router fails closed: every route of every SGLang release the contract knows is either
forwarded to an engine or refused, by intent, and a route nobody classified is refused.

The routes come from the decorator lists in test_sglang_contract.py (read from the wheels); the
intent is written here, route by route, and the router's answer is checked against it through a
real manager and sglang-sim engines. A new SGLang route added to the contract's lists fails
`test_every_known_route_has_an_intent` until someone decides which side it is on.
"""

from __future__ import annotations

import pytest
import test_sglang_contract as contract
from _support import ManagerHandle, http

#: Data-plane routes, forwarded to one engine (rust/rollout-core/src/routes.rs, FORWARDED).
FORWARDED: dict[str, tuple[str, ...]] = {
    "/generate": ("POST", "PUT"),
    "/encode": ("POST", "PUT"),
    "/classify": ("POST", "PUT"),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/embeddings": ("POST",),
    "/v1/classify": ("POST",),
    "/v1/audio/transcriptions": ("POST",),
    "/v1/score": ("POST",),
    "/v1/decisions": ("POST",),
    "/v1/responses": ("POST",),
    "/v1/rerank": ("POST", "PUT"),
    "/api/chat": ("POST",),
    "/api/generate": ("POST",),
    "/api/show": ("POST",),
    "/api/tags": ("GET",),
    "/v1/messages": ("POST",),
    "/v1/messages/count_tokens": ("POST",),
    "/v1/systemone": ("POST",),
    "/invocations": ("POST",),
    "/vertex_generate": ("POST",),
    "/tokenize": ("POST",),
    "/v1/tokenize": ("POST",),
    "/detokenize": ("POST",),
    "/v1/detokenize": ("POST",),
    "/parse_function_call": ("POST",),
    "/separate_reasoning": ("POST",),
    "/": ("GET",),
    "/ready": ("GET",),
    "/ping": ("GET",),
    "/model_info": ("GET",),
    "/get_model_info": ("GET",),
    "/server_info": ("GET",),
    "/get_server_info": ("GET",),
    "/v1/loads": ("GET",),
    "/get_load": ("GET",),
    "/get_weight_version": ("GET",),
    "/weight_version": ("GET",),
    "/v1/models": ("GET",),
    "/v1/models/{model:path}": ("GET",),
    "/get_hicache_l3_cache_layout": ("GET",),
}
#: Served by the router itself: its readiness, its metrics, and the fan-outs to every engine.
OWN = {
    "/health": ("GET",),
    "/health_generate": ("GET",),
    "/metrics": ("GET",),
    "/abort_request": ("POST",),
    "/flush_cache": ("GET", "POST"),
}
#: Routes that keep state on one engine: refused, `engine_local_route`.
ENGINE_LOCAL = {
    "/open_session",
    "/close_session",
    "/v1/realtime",
    "/v1/responses/resp_1",
    "/v1/responses/resp_1/cancel",
}
#: Everything else a release declares changes an engine (weights, memory, cache, profiling,
#: logging, role): refused, `admin_route`: SGLang's admin routes (marked
#: `@auth_level(AuthLevel.ADMIN_OPTIONAL)` in 0.5.23) the contract lists, the fan-outs excepted.
ADMIN = {
    "/set_internal_state", "/add_external_corpus", "/remove_external_corpus", "/list_external_corpora",
    "/hicache/storage-backend", "/hicache/storage-backend/clear", "/start_profile", "/stop_profile",
    "/set_trace_level", "/freeze_gc", "/start_expert_distribution_record", "/stop_expert_distribution_record",
    "/dump_expert_distribution_record", "/update_weights_from_disk", "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance", "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
    "/update_weights_from_ipc", "/update_weight_version", "/get_weights_by_name", "/release_memory_occupation",
    "/resume_memory_occupation", "/weights_checker", "/slow_down", "/pd_role_switch", "/load_lora_adapter",
    "/load_lora_adapter_from_tensors", "/unload_lora_adapter", "/configure_logging", "/pause_generation",
    "/continue_generation", "/scale_elastic_ep", "/is_scaling_elastic_ep",
}  # fmt: skip
#: Methods a route takes beside the one the contract's lists probe (sglang==0.5.23:
#: sglang/srt/entrypoints/http_server.py:1123 PUT and :1157 DELETE /hicache/storage-backend;
#: :909 /dumper/{method}, declared only with DUMPER_SERVER_PORT=reuse).
MORE_METHODS = (
    ("/hicache/storage-backend", "PUT"),
    ("/hicache/storage-backend", "DELETE"),
    ("/dumper/start", "POST"),
)


def known_routes() -> list[tuple[str, str]]:
    """Every (route, method) of every release the contract knows."""
    out: set[tuple[str, str]] = set()
    for route, methods in contract.SIMULATED.items():
        out.update((route, m) for m in methods)
    out.update(contract.NOT_SIMULATED.items())
    out.update(contract.CHANGED_ROUTES.items())
    out.update(MORE_METHODS)
    return sorted(out)


def concrete(route: str) -> str:
    # The fleet's served name (the router answers any other with 404 model_not_found).
    return route.replace("{model:path}", "sim-model")


def test_every_known_route_has_an_intent() -> None:
    unclassified = [
        (route, method)
        for route, method in known_routes()
        if route not in FORWARDED
        and route not in OWN
        and route not in ENGINE_LOCAL
        # The rest is refused as admin on purpose: it must be one of SGLang's admin routes.
        and not route.startswith("/dumper/")
        and route not in ADMIN
    ]
    assert not unclassified, f"decide whether the router forwards these: {unclassified}"


@pytest.fixture
def fleet(shared_fleet: ManagerHandle) -> ManagerHandle:
    """Nothing here changes the fleet: a refused route never reaches an engine, and a forwarded
    one carries a body that fails validation."""
    return shared_fleet


def test_the_router_forwards_or_refuses_every_known_route_by_intent(
    fleet: ManagerHandle,
) -> None:
    wrong: list[str] = []
    for route, method in known_routes():
        if route in OWN:
            continue
        # A body that fails validation where one is read, so nothing changes on an engine.
        resp = http(
            method,
            fleet.router_url + concrete(route),
            {"bogus_param": 1} if method != "GET" else None,
        )
        code = resp.json().get("error", {}).get("code") if resp.body.startswith(b"{") else None
        forwarded = "x-rollout-engine-id" in resp.headers
        if route in FORWARDED:
            expected = "forwarded" if method in FORWARDED[route] else "405 method_not_allowed"
        elif route in ENGINE_LOCAL:
            expected = "403 engine_local_route"
        else:
            expected = "403 admin_route"
        got = "forwarded" if forwarded else f"{resp.status} {code}"
        if got != expected:
            wrong.append(f"{method} {route}: expected {expected}, got {got}")
    assert not wrong, "\n".join(wrong)


def test_the_fleets_health_generate_is_the_routers_own(fleet: ManagerHandle) -> None:
    """SGLang's /health_generate waits on its scheduler: sent to an engine paused meanwhile (a
    trainer's update) it times out and marks that engine UnHealthy. The router answers it from
    the engines in routing (which pass the manager's own probes), as /health."""
    resp = http("GET", f"{fleet.router_url}/health_generate")
    assert resp.status == 200 and "x-rollout-engine-id" not in resp.headers, resp.headers
    assert resp.json() == http("GET", f"{fleet.router_url}/health").json()
    assert resp.json()["routable_engines"] == 2


def test_a_route_no_release_has_is_refused_and_says_what_is_forwarded(
    fleet: ManagerHandle,
) -> None:
    for method in ("GET", "POST", "PUT", "DELETE"):
        resp = http(
            method,
            f"{fleet.router_url}/a_route_from_a_future_release",
            {} if method != "GET" else None,
        )
        assert resp.status == 403, (method, resp.status)
        error = resp.json()["error"]
        assert error["code"] == "unknown_route"
        assert "/generate" in error["message"] and "/rollout/engines" in error["message"]
    resp = http("POST", f"{fleet.router_url}/weights_checker", {"action": "reset_tensors"})
    assert resp.status == 403 and "/rollout/weights/publish" in resp.json()["error"]["message"]
    resp = http("GET", f"{fleet.router_url}/generate")
    assert resp.status == 405 and resp.headers["allow"] == "POST, PUT"
