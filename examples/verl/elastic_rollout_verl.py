"""verl agent-loop manager that generates on an Elastic Rollout fleet (checked against
volcengine/verl b178a3cd).

verl's agent loop calls its rollout servers through Ray handles
(``await server.generate.remote(request_id=, prompt_ids=, sampling_params=, ...)``). This module
gives the agent-loop workers handles of the same shape that send SGLang ``/generate`` to the
manager's router instead, and, before each step's generation, publishes the HF weights verl saved
for the previous step. Select it with

    ++actor_rollout_ref.rollout.agent.agent_loop_manager_class=elastic_rollout_verl.ElasticAgentLoopManager

Environment: ``ELASTIC_ROLLOUT_MANAGER`` (default ``http://127.0.0.1:8000``),
``ELASTIC_ROLLOUT_ROUTER`` (default ``http://127.0.0.1:30000``), ``ROLLOUT_MANAGER_API_TOKEN``,
``ELASTIC_ROLLOUT_HANDLES`` (handles given to the workers, default 8),
``ELASTIC_ROLLOUT_CONCURRENCY`` (requests in flight per agent-loop worker, default 256),
``ELASTIC_ROLLOUT_REPORT_STEPS`` (``1``: report steps; leave it off for verl's synchronous loop).

verl's own modules are imported only inside verl's processes (``importlib``), so this file needs
nothing but the stdlib and ``elastic_rollout`` to be imported and type-checked.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import threading
import time
import urllib.request
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elastic_rollout import RolloutClient

__all__ = ["ElasticAgentLoopManager", "RouterServerHandle", "publish_step"]

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _client() -> RolloutClient:
    url = os.environ.get("ELASTIC_ROLLOUT_MANAGER", "http://127.0.0.1:8000")
    return RolloutClient(url, token=os.environ.get("ROLLOUT_MANAGER_API_TOKEN"), timeout=60.0)


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            workers = int(os.environ.get("ELASTIC_ROLLOUT_CONCURRENCY", "256"))
            _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="elastic-rollout")
        return _executor


class _RemoteMethod:
    """What ``handle.generate.remote(**kwargs)`` needs to be: a call that returns an awaitable."""

    def __init__(self, handle: RouterServerHandle) -> None:
        self._handle = handle

    def remote(self, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        return self._handle.generate_async(**kwargs)


class RouterServerHandle:
    """Stands in for one verl rollout server handle; picklable (it travels to the agent-loop
    workers). Requests carry ``weight_version: {"min_version": <fleet version>}``."""

    def __init__(self, router_url: str, manager_url: str, prompt_length: int, response_length: int) -> None:
        self.router_url = router_url.rstrip("/")
        self.manager_url = manager_url.rstrip("/")
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.generate = _RemoteMethod(self)
        self._pin: tuple[float, str | None] = (0.0, None)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("generate")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.generate = _RemoteMethod(self)

    def _min_version(self) -> str | None:
        """The fleet's committed version, read at most once a second."""
        read_at, version = self._pin
        if time.monotonic() - read_at > 1.0:
            token = os.environ.get("ROLLOUT_MANAGER_API_TOKEN")
            found = RolloutClient(self.manager_url, token=token, timeout=10.0).weights().get("version")
            version = None if found is None else str(found)
            self._pin = (time.monotonic(), version)
        return version

    async def generate_async(self, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_pool(), lambda: self._generate(**kwargs))

    def _generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
    ) -> Any:
        if image_data or video_data:
            raise NotImplementedError("multimodal inputs are not forwarded by this example")
        params = dict(sampling_params)
        return_logprob = bool(params.pop("logprobs", False))
        budget = params.pop("max_new_tokens", params.pop("max_tokens", None))
        if budget is None:  # verl's default: the rest of prompt + response length
            budget = self.prompt_length + self.response_length - len(prompt_ids)
        params["max_new_tokens"] = max(0, int(budget))
        body: dict[str, Any] = {
            "rid": request_id,
            "input_ids": list(prompt_ids),
            "sampling_params": params,
            "return_logprob": return_logprob,
        }
        pin = self._min_version()
        if pin is not None:
            body["weight_version"] = {"min_version": pin}
        req = urllib.request.Request(
            self.router_url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=3600) as resp:
            out = json.loads(resp.read())
        meta = out.get("meta_info", {})
        if return_logprob:
            pairs = meta.get("output_token_logprobs") or []
            token_ids, log_probs = [int(p[1]) for p in pairs], [float(p[0]) for p in pairs]
        else:
            token_ids, log_probs = list(out.get("output_ids") or []), None
        finish = (meta.get("finish_reason") or {}).get("type")
        token_output = importlib.import_module("verl.workers.rollout.replica").TokenOutput
        return token_output(
            token_ids=token_ids, log_probs=log_probs, stop_reason="aborted" if finish == "abort" else "completed"
        )


def publish_step(client: RolloutClient, checkpoint_root: str, step: int, timeout: float = 1800.0) -> bool:
    """Publishes ``<root>/global_step_<step>/actor/huggingface`` as version ``step<step>`` and
    waits for the fleet; False when verl saved no HF weights for that step."""
    path = Path(checkpoint_root) / f"global_step_{step}" / "actor" / "huggingface"
    if not any(path.glob("*.safetensors")):
        return False
    update = client.publish_weights(f"step{step}", str(path.resolve()))
    record = client.wait_for_weight_update(str(update["update_id"]), timeout=timeout)
    if record.get("status") != "COMPLETED":
        raise RuntimeError(f"publishing step{step} failed: {record.get('error_message')}")
    return True


def _base_manager() -> Any:
    try:
        return importlib.import_module("verl.experimental.agent_loop").AgentLoopManager
    except ImportError:  # not inside verl: the class below is still importable for reading
        return object


class ElasticAgentLoopManager(_base_manager()):  # type: ignore[misc]
    """verl's AgentLoopManager with generation sent to the fleet. verl's own replicas are still
    built (its trainer wakes, syncs and sleeps them every step) but receive no requests."""

    def _init_agent_loop_workers(self) -> None:
        rollout = self.config.actor_rollout_ref.rollout
        self.server_handles = [
            RouterServerHandle(
                os.environ.get("ELASTIC_ROLLOUT_ROUTER", "http://127.0.0.1:30000"),
                os.environ.get("ELASTIC_ROLLOUT_MANAGER", "http://127.0.0.1:8000"),
                int(rollout.prompt_length),
                int(rollout.response_length),
            )
            for _ in range(int(os.environ.get("ELASTIC_ROLLOUT_HANDLES", "8")))
        ]
        self._elastic_client = _client()
        self._elastic_last: tuple[int, float, float] | None = None  # step, start, generation secs
        super()._init_agent_loop_workers()

    def generate_sequences(self, prompts: Any) -> Any:
        step = int(prompts.meta_info.get("global_steps", 0))
        client = self._elastic_client
        if step > 1:
            publish_step(client, str(self.config.trainer.default_local_dir), step - 1)
        started = time.monotonic()
        if os.environ.get("ELASTIC_ROLLOUT_REPORT_STEPS") == "1" and self._elastic_last is not None:
            last_step, last_start, last_gen = self._elastic_last
            if last_step == step - 1:
                client.report_step(last_step, last_gen, 0.0, started - last_start)
        output = super().generate_sequences(prompts)
        self._elastic_last = (step, started, time.monotonic() - started)
        return output
