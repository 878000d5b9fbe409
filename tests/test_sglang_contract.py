"""Contract tests: ``sglang-sim`` against facts read from SGLang's released source.

Every fact below was read from the ``sglang`` wheels on PyPI (``pip download sglang==X
--no-deps``) and is cited as ``sglang==X: <path inside the wheel>:<line>``. The tests start the
real ``sglang-sim`` binary (and once, ``rollout-manager serve``) on free loopback ports and hold
it to these facts. A new SGLang release is a one-line change in the data; a simulator that drifts
from a fact fails here.

Where the simulator knowingly disagrees with SGLang, the disagreement is listed in
``KNOWN_GAPS`` with what the simulator does today. Those entries are asserted too: fixing the
simulator makes the test fail until the entry is removed, so the list never goes stale.
"""

from __future__ import annotations

import http.client as http_client
import json
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _checkpoints import write_checkpoint
from _support import (
    ANSI_ESCAPE,
    INITIAL_ENGINES,
    STARTUP_TIMEOUT,
    ManagerHandle,
    freshest_build,
    http,
    sse_events,
    start_manager,
    stop_manager,
    wait_until,
)

from elastic_rollout._find import find_binary

# =============================================================================================
# Facts
# =============================================================================================

NEWEST = "0.5.23"
#: Releases the route table and the per-release shapes cover (RL frameworks pin 0.5.6, 0.5.10.post1
#: and 0.5.15.post1; verl pins 0.5.8 in its setup.py and 0.5.12 in its stable image; 0.5.2 is the
#: oldest with a weight-version; 0.5.23 is the newest).
RELEASES = ("0.5.2", "0.5.6", "0.5.8", "0.5.10.post1", "0.5.12", "0.5.15.post1", "0.5.23")

# -- 1. Routes ---------------------------------------------------------------------------------
# Every route sglang-sim registers (rust/sglang-sim/src/api/mod.rs), with SGLang 0.5.23's methods.
# sglang==0.5.23: sglang/srt/entrypoints/http_server.py (line of the decorator); /v1/loads:
# .../entrypoints/v1_loads.py:96; /metrics: .../utils/common.py:2849 (a Mount, so only GET is
# probed).
SIMULATED: dict[str, tuple[str, ...]] = {
    "/generate": ("POST", "PUT"),  # :928
    "/health": ("GET",),  # :721
    "/health_generate": ("GET",),  # :722
    "/ready": ("GET",),  # :714
    "/ping": ("GET",),  # :2190
    "/model_info": ("GET",),  # :812
    "/get_model_info": ("GET",),  # :802
    "/server_info": ("GET",),  # :863
    "/get_server_info": ("GET",),  # :853
    "/v1/loads": ("GET",),  # v1_loads.py:96
    "/v1/models": ("GET",),  # :1993
    "/v1/models/{model:path}": ("GET",),  # :2025
    "/v1/completions": ("POST",),  # :1860
    "/v1/chat/completions": ("POST",),  # :1870
    "/metrics": ("GET",),  # utils/common.py:2849
    "/flush_cache": ("GET", "POST"),  # :1025
    "/abort_request": ("POST",),  # :1721
    "/pause_generation": ("POST",),  # :1831
    "/continue_generation": ("POST",),  # :1844
    "/update_weight_version": ("POST",),  # :1527
    "/update_weights_from_disk": ("POST",),  # :1300
    "/init_weights_update_group": ("POST",),  # :1404
    "/destroy_weights_update_group": ("POST",),  # :1420
    "/begin_weight_update": ("POST",),  # :1458
    "/end_weight_update": ("POST",),  # :1473
    "/update_weights_from_distributed": ("POST",),  # :1488
    "/init_weights_send_group_for_remote_instance": ("POST",),  # :1329
    "/send_weights_to_remote_instance": ("POST",),  # :1348
    "/release_memory_occupation": ("GET", "POST"),  # :1575
    "/resume_memory_occupation": ("GET", "POST"),  # :1587
}
#: Routes the simulator adds that SGLang does not have (only with --enable-fault-api).
SIM_ONLY_ROUTES = ("/sim/faults",)
#: Mounted ASGI apps answer every method; only the listed ones are probed.
MOUNTS = ("/metrics",)

# SGLang 0.5.23 routes the simulator deliberately does not serve: each must answer 404, so a sim
# that starts serving one makes this list change. sglang==0.5.23: .../entrypoints/http_server.py
# unless noted. (/dumper/{method} exists only with DUMPER_SERVER_PORT=reuse, :907; left out.)
NOT_SIMULATED: dict[str, str] = {
    "/": "GET",  # :2124 (without SGLANG_OLLAMA_ROOT_ROUTE)
    "/set_internal_state": "POST",  # :897
    "/encode": "POST",  # :993
    "/classify": "POST",  # :1006
    "/add_external_corpus": "POST",  # :1043
    "/remove_external_corpus": "POST",  # :1068
    "/list_external_corpora": "GET",  # :1086
    "/hicache/storage-backend/clear": "POST",  # :1103
    "/hicache/storage-backend": "GET",  # :1184
    "/get_hicache_l3_cache_layout": "GET",  # :1204
    "/start_profile": "POST",  # :1221
    "/stop_profile": "POST",  # :1232
    "/set_trace_level": "POST",  # :1243
    "/freeze_gc": "POST",  # :1254
    "/start_expert_distribution_record": "POST",  # :1267
    "/stop_expert_distribution_record": "POST",  # :1278
    "/dump_expert_distribution_record": "POST",  # :1289
    "/get_remote_instance_transfer_engine_info": "GET",  # :1366
    "/remote_instance_transfer_engine_info": "GET",  # :1377
    "/update_weights_from_tensor": "POST",  # :1436
    "/update_weights_from_ipc": "POST",  # :1508
    "/get_weights_by_name": "POST",  # :1559
    "/weights_checker": "POST",  # :1599
    "/slow_down": "POST",  # :1621
    "/pd_role_switch": "POST",  # :1635
    "/load_lora_adapter": "POST",  # :1652
    "/load_lora_adapter_from_tensors": "POST",  # :1663
    "/unload_lora_adapter": "POST",  # :1676
    "/open_session": "POST",  # :1687
    "/close_session": "POST",  # :1701
    "/configure_logging": "POST",  # :1711
    "/parse_function_call": "POST",  # :1734
    "/separate_reasoning": "POST",  # :1774
    "/v1/embeddings": "POST",  # :1882
    "/v1/classify": "POST",  # :1894
    "/v1/tokenize": "POST",  # :1906
    "/tokenize": "POST",  # :1911
    "/v1/detokenize": "POST",  # :1924
    "/detokenize": "POST",  # :1929
    "/v1/audio/transcriptions": "POST",  # :1942
    "/v1/realtime": "GET",  # :1982 (WebSocket)
    "/v1/score": "POST",  # :2050
    "/v1/decisions": "POST",  # :2058
    "/v1/responses": "POST",  # :2066
    "/v1/responses/resp_1": "GET",  # :2085 /v1/responses/{response_id}
    "/v1/responses/resp_1/cancel": "POST",  # :2093
    "/v1/rerank": "POST",  # :2101
    "/api/chat": "POST",  # :2131
    "/api/generate": "POST",  # :2137
    "/api/tags": "GET",  # :2145
    "/api/show": "POST",  # :2151
    "/v1/messages": "POST",  # :2160
    "/v1/messages/count_tokens": "POST",  # :2170
    "/v1/systemone": "POST",  # :2181
    "/invocations": "POST",  # :2202
    "/vertex_generate": "POST",  # :2215
    "/scale_elastic_ep": "POST",  # entrypoints/elastic_ep.py:15
    "/is_scaling_elastic_ep": "GET",  # entrypoints/elastic_ep.py:76
}

# SGLang routes our clients call (all names, old and new). rust/rollout-manager/src/adapters/dialect.rs,
# adapters/engine_api.rs, ops/weight_update.rs, ops/health.rs, interfaces/autoscaler/collector.rs,
# adapters/router/ (proxy and fan-out), rust/rollout-core/src/config.rs (--health-check-endpoint),
# python/elastic_rollout/trainer.py.
USED_BY_CLIENTS = (
    "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/loads", "/get_load",
    "/health", "/health_generate", "/metrics", "/generate", "/v1/completions", "/v1/chat/completions",
    "/abort_request", "/flush_cache", "/pause_generation", "/continue_generation",
    "/update_weights_from_disk", "/init_weights_update_group", "/begin_weight_update",
    "/update_weights_from_distributed", "/end_weight_update", "/destroy_weights_update_group",
)  # fmt: skip

# -- 2. Routes that were added, renamed or removed across 0.5.x -------------------------------
# (route, method); a POST is probed with a body that fails validation, so nothing changes.
CHANGED_ROUTES: dict[str, str] = {
    "/model_info": "GET",
    "/get_model_info": "GET",
    "/server_info": "GET",
    "/get_server_info": "GET",
    "/v1/loads": "GET",
    "/get_load": "GET",
    "/ready": "GET",
    "/begin_weight_update": "POST",
    "/end_weight_update": "POST",
    "/destroy_weights_update_group": "POST",
    "/init_weights_send_group_for_remote_instance": "POST",
    "/send_weights_to_remote_instance": "POST",
    "/get_weight_version": "GET",
    "/weight_version": "GET",
}
# Which of CHANGED_ROUTES each release answers with something other than 404, read from the
# decorators in sglang==<release>: sglang/srt/entrypoints/http_server.py (line) and
# .../entrypoints/v1_loads.py for /v1/loads. /get_weight_version and /weight_version are declared
# from 0.5.8 to 0.5.20 but raise a 404 "use /model_info" (0.5.10.post1 :581-588), so they count
# as absent there. One line per release.
SERVED_BY_RELEASE: dict[str, set[str]] = {
    # :416 :437 :451 :429
    "0.5.2": {"/get_model_info", "/get_server_info", "/get_load", "/get_weight_version"},
    # :497 :487 :540 :530 :560 :827 :780 :796 :512 :522
    "0.5.6": {"/model_info", "/get_model_info", "/server_info", "/get_server_info", "/get_load",
              "/destroy_weights_update_group", "/init_weights_send_group_for_remote_instance",
              "/send_weights_to_remote_instance", "/get_weight_version", "/weight_version"},
    # :541 :531 :581 :571 v1_loads.py:130 :601 :887 :812 :829 (/get_weight_version, /weight_version :561-568
    # raise the "use /model_info" 404)
    "0.5.8": {"/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/loads", "/get_load",
              "/destroy_weights_update_group", "/init_weights_send_group_for_remote_instance",
              "/send_weights_to_remote_instance"},
    # :561 :551 :601 :591 v1_loads.py:130 :621 :1051 :963 :980
    "0.5.10.post1": {"/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/loads",
                     "/get_load", "/destroy_weights_update_group", "/init_weights_send_group_for_remote_instance",
                     "/send_weights_to_remote_instance"},
    # :590 :580 :630 :620 v1_loads.py:135 :647 :1152 :1064 :1081 (/get_weight_version, /weight_version
    # :610-617 raise the "use /model_info" 404)
    "0.5.12": {"/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/loads", "/get_load",
               "/destroy_weights_update_group", "/init_weights_send_group_for_remote_instance",
               "/send_weights_to_remote_instance"},
    # :665 :655 :705 :695 v1_loads.py:72 :730 :1248 :1157 :1176
    "0.5.15.post1": {"/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/loads",
                     "/get_load", "/destroy_weights_update_group", "/init_weights_send_group_for_remote_instance",
                     "/send_weights_to_remote_instance"},
    # :812 :802 :863 :853 v1_loads.py:96 :714 :1458 :1473 :1420 :1329 :1348
    "0.5.23": {"/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/loads", "/ready",
               "/begin_weight_update", "/end_weight_update", "/destroy_weights_update_group",
               "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance"},
}  # fmt: skip

# -- 3. sampling_params ------------------------------------------------------------------------
# sglang==0.5.23: sglang/srt/sampling/sampling_params.py:149-181 (SamplingParams, "API parameters";
# defaults as declared; null means the default, :191-235). A value to send for each.
# top_k's default is TOP_K_ALL = 1 << 30 (:43, :159). The /generate schema
# (sglang/api/v1/api_types.py:177-207, :1256) accepts the same names plus `choice` (see SCHEMA_ONLY).
SAMPLING_PARAMS: dict[str, tuple[Any, Any]] = {
    # name: (default, a valid value to send)
    "max_new_tokens": (128, 4),  # :149
    "stop": (None, "zzz"),  # :150
    "stop_token_ids": (None, [7]),  # :153
    "stop_regex": (None, "zz+"),  # :154
    "temperature": (1.0, 0.5),  # :157
    "top_p": (1.0, 0.9),  # :158
    "top_k": (1 << 30, 5),  # :159
    "min_p": (0.0, 0.1),  # :160
    "frequency_penalty": (0.0, 0.5),  # :161
    "presence_penalty": (0.0, 0.5),  # :162
    "repetition_penalty": (1.0, 1.1),  # :163
    "min_new_tokens": (0, 1),  # :164
    "n": (1, 2),  # :165
    "beam_width": (None, 1),  # :168
    "json_schema": (None, '{"type": "string"}'),  # :169
    "regex": (None, "a+"),  # :170
    "ebnf": (None, 'root ::= "a"'),  # :171
    "structural_tag": (None, "{}"),  # :172
    "ignore_eos": (False, True),  # :173
    "skip_special_tokens": (True, False),  # :174
    "spaces_between_special_tokens": (True, False),  # :175
    "no_stop_trim": (False, True),  # :176
    "stream_interval": (None, 2),  # :177
    "logit_bias": (None, {"5": 1.0}),  # :178
    "sampling_seed": (None, 7),  # :179
    "custom_params": (None, {"k": 1}),  # :180
    "watermark": (None, {"enabled": False}),  # :181
}
#: In the /generate schema's field list (sglang==0.5.23: sglang/api/v1/api_types.py:1256) but
#: not a SamplingParams field, so a request using it fails later; not probed.
SCHEMA_ONLY = ("choice",)
# An unknown key is refused by the JSON contract gate before generation: 400 with the body
# {"error": "unknown field `x`, expected one of `max_new_tokens`, ..."} (sglang==0.5.23:
# .../entrypoints/http_server.py:937-939, .../entrypoints/api_contract.py:12-18,
# sglang/api/v1/api_types.py:97-108,1320).
UNKNOWN_FIELD_MESSAGE = re.compile(r"^unknown field `bogus_param`, expected one of (`\w+`(, )?)+$")

# -- 4. /generate --------------------------------------------------------------------------------
# GenerateReqInput fields that matter, each with a value to send (sglang==0.5.23:
# sglang/srt/managers/io_struct.py line of the field; the schema is api_types.py:236-278).
GENERATE_FIELDS: dict[str, Any] = {
    "text": "hello world",  # :185
    "input_ids": [5, 6, 7],  # :188
    "sampling_params": {"max_new_tokens": 2},  # :227
    "rid": "contract-rid",  # :180
    "return_logprob": True,  # :230
    "logprob_start_len": 0,  # :233
    "top_logprobs_num": 2,  # :235
    "token_ids_logprob": [5, 6],  # :237
    "return_text_in_logprobs": True,  # :247
    "stream": False,  # :256
    "log_metrics": False,  # :258
    "return_hidden_states": False,  # :260
    "session_params": None,  # :274
    "lora_path": None,  # :277
    "custom_logit_processor": None,  # :284
    "bootstrap_host": None,  # :291
    "bootstrap_port": None,  # :292
    "bootstrap_room": None,  # :293
    "routed_dp_rank": 0,  # :298
    "data_parallel_rank": 0,  # :303 (deprecated alias)
    "routing_key": "k",  # :307
    "max_thinking_tokens": 16,  # :320
    "priority": 1,  # :323
    "extra_key": "x",  # :325
    # SGLang 0.5.23 with --enable-metrics and no --tokenizer-metrics-allowed-custom-labels dies on it:
    # the tokenizer manager's loop raises prometheus' "Incorrect label names" (observability/
    # metrics_collector.py:2157) and the server exits; so the real-engine tier does not send it.
    "custom_labels": {"team": "rl"},  # :330
    "return_prompt_token_ids": True,  # :337
    "cache_salt": "s",  # :370
}
# A non-streaming answer: sglang==0.5.23: sglang/srt/managers/tokenizer_manager.py:2665-2669, plus
# prompt_token_ids with return_prompt_token_ids (:2673-2674).
RESPONSE_KEYS = {"text", "output_ids", "meta_info"}
# meta_info of a plain finished request on a server without --enable-metrics (no logprobs, no
# speculative decoding, no multimodal input, nothing cached): tokenizer_manager.py:2507-2513,
# :2553-2558, :2616-2617 (dp_rank: the scheduler always sends dp_ranks,
# .../scheduler_components/output_streamer.py:228,723) and :2753 (e2e_latency once finished);
# weight_versions: every finished request's spans (output_streamer.py:541-548, added by
# tokenizer_manager.py:2560-2568 through utils/weight_versions.py add_weight_versions_to_meta_info).
META_INFO_KEYS = {
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
    "reasoning_tokens", "completion_tokens", "cached_tokens", "dp_rank", "e2e_latency", "weight_versions",
}  # fmt: skip
# finish_reason: sglang==0.5.23: sglang/srt/managers/schedule_batch.py:289-293 (stop), :325-329 (length)
FINISH_LENGTH_KEYS = {"type", "length"}
FINISH_STOP_KEYS = {"type", "matched"}
# Logprob keys, tokenizer_manager.py:2868-2870 (return_logprob), :2938,:2973 (top_logprobs_num > 0),
# :3006-3007 (token_ids_logprob).
LOGPROB_KEYS = {"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"}
TOP_LOGPROB_KEYS = {"input_top_logprobs", "output_top_logprobs"}
TOKEN_IDS_LOGPROB_KEYS = {"input_token_ids_logprobs", "output_token_ids_logprobs"}
#: meta_info keys the simulator adds (none today).
SIM_META_INFO_EXTENSIONS: set[str] = set()

# -- 5. Identity and load routes ------------------------------------------------------------------
# /model_info (or /get_model_info) keys per release: sglang==<release>:
# sglang/srt/entrypoints/http_server.py, the dict the handler returns.
_MI_0_5_2 = {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version"}
MODEL_INFO_KEYS: dict[str, set[str]] = {
    "0.5.2": _MI_0_5_2,  # :416-426
    "0.5.6": _MI_0_5_2 | {"has_image_understanding", "has_audio_understanding"},  # :497-509
    "0.5.8": _MI_0_5_2 | {"has_image_understanding", "has_audio_understanding", "model_type",
                          "architectures"},  # :541-558
    "0.5.10.post1": _MI_0_5_2 | {"has_image_understanding", "has_audio_understanding", "model_type",
                                 "architectures"},  # :561-578
    "0.5.12": _MI_0_5_2 | {"has_image_understanding", "has_audio_understanding", "model_type",
                           "architectures"},  # :590-607
    "0.5.15.post1": _MI_0_5_2 | {"has_image_understanding", "has_audio_understanding", "model_type",
                                 "architectures"},  # :665-682
    # :812-851; "embedding" when the model config has an embedding spec (:843-849), which SGLang
    # 0.5.23 running a Llama generation model showed (tests/sglang/test_engine_contract.py)
    "0.5.23": _MI_0_5_2 | {"has_image_understanding", "has_audio_understanding", "model_type",
                           "architectures", "served_model_name", "load_format", "reasoning_parser",
                           "tool_call_parser", "disaggregation_mode", "embedding"},
}  # fmt: skip
#: /model_info keys the simulator adds (the manager verifies checkpoints with it).
SIM_MODEL_INFO_EXTENSIONS = {"weights_checksum"}

# /server_info top-level keys our clients read, present in every release: server args
# (dataclasses.asdict(server_args): tp_size, dp_size, weight_version) + scheduler_info
# (max_total_num_tokens) + internal_states + version. sglang==0.5.2: .../http_server.py:437-448;
# sglang==0.5.10.post1: :601-618; sglang==0.5.23: :863-891.
SERVER_INFO_READ = {"tp_size", "dp_size", "max_total_num_tokens", "version", "weight_version", "internal_states"}
# Added by 0.5.23: launch_command, kv_events (sglang/srt/utils/common.py:3590,3592), status,
# max_req_input_len, startup_time (.../managers/scheduler.py:1944-1947), frontend (http_server.py:889).
SERVER_INFO_0_5_23 = {"launch_command", "kv_events", "status", "max_req_input_len", "startup_time", "frontend"}
# The literal scheduler handshake status (scheduler.py:1944), not the health status.
SERVER_INFO_STATUS = "ready"

# /v1/loads, sglang==0.5.23: top level .../entrypoints/v1_loads.py:144-150; each load is
# LoadSnapshot.to_dict (.../managers/load_snapshot.py:196-258): every core field, then the
# sections that are not None. Sections: MemoryMetrics :142-148, DisaggregationMetrics :166-176,
# QueueMetrics :179-186; speculative and lora are None unless enabled
# (.../scheduler_components/load_inquirer.py:163-183).
LOADS_TOP_KEYS = {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
LOAD_CORE_KEYS = {
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
    "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
    "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
    "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
}  # fmt: skip
LOAD_SECTIONS: dict[str, set[str]] = {
    "memory": {"weight_gb", "kv_cache_gb", "graph_gb", "token_capacity"},
    "disaggregation": {"mode", "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
                       "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "decode_retracted_queue_reqs",
                       "kv_transfer_speed_gb_s", "kv_transfer_latency_ms"},
    "queues": {"waiting", "grammar", "paused", "retracted", "prealloc_ready"},
}  # fmt: skip
#: Load fields our clients read (rust/rollout-manager/src/interfaces/integrations/loads.rs,
#: autoscaler/collector.rs sample_from_loads).
LOAD_FIELDS_READ = {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_waiting_uncached_tokens",
                    "max_total_num_tokens", "token_usage", "gen_throughput"}  # fmt: skip

# /get_load per release (the manager reads `load` or each rank's num_tokens):
GET_LOAD_KEYS: dict[str, set[str] | None] = {
    # dict {"load": tokens}: sglang==0.5.2: sglang/srt/managers/tokenizer_communicator_mixin.py:485-491
    "0.5.2": {"load"},
    # list of GetLoadReqOutput: sglang==0.5.6: sglang/srt/managers/io_struct.py:1583-1587 + BaseReq :40-42
    "0.5.6": {"rid", "http_worker_ipc", "dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"},
    # sglang==0.5.8: .../io_struct.py:1703-1708 + BaseReq :44-46 (tokenizer_communicator_mixin.py:795-797)
    "0.5.8": {"rid", "http_worker_ipc", "dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"},
    # sglang==0.5.10.post1: .../io_struct.py:1750-1755 (+ts_tic) + BaseReq :50-52
    "0.5.10.post1": {"rid", "http_worker_ipc", "dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"},
    # a shim over /v1/loads: sglang==0.5.12: .../entrypoints/http_server.py:647-671
    "0.5.12": {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"},
    # a shim over /v1/loads: sglang==0.5.15.post1: .../entrypoints/http_server.py:730-753
    "0.5.15.post1": {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"},
    "0.5.23": None,  # removed
}

# -- 6. Metrics the autoscaler reads (rust/rollout-core/src/autoscaler/prom.rs) ------------------
# sglang==0.5.23: sglang/srt/observability/metrics_collector.py. Scheduler metrics carry the
# scheduler labels (:1382-1392: model_name, engine_type, tp_rank, pp_rank, moe_ep_rank; dp_rank only
# with DP ranks, priority only with priority scheduling); tokenizer metrics the tokenizer labels
# (:1804-1811: model_name, engine_type). Histograms add `le` to their _bucket series.
SCHEDULER_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
TOKENIZER_LABELS = {"model_name", "engine_type"}
METRICS: dict[str, tuple[str, set[str]]] = {
    # name: (type, label names)
    "sglang:num_running_reqs": ("gauge", SCHEDULER_LABELS),  # :365
    "sglang:num_queue_reqs": ("gauge", SCHEDULER_LABELS),  # :371
    "sglang:gen_throughput": ("gauge", SCHEDULER_LABELS),  # :383
    "sglang:token_usage": ("gauge", SCHEDULER_LABELS),  # :405
    "sglang:num_used_tokens": ("gauge", SCHEDULER_LABELS),  # :433
    "sglang:max_total_num_tokens": ("gauge", SCHEDULER_LABELS),  # :1290
    "sglang:queue_time_seconds": ("histogram", SCHEDULER_LABELS),  # :838 (SchedulerMetricsCollector)
    "sglang:time_to_first_token_seconds": ("histogram", TOKENIZER_LABELS | {"is_streaming"}),  # :2041-2047
}
ENGINE_TYPE = "unified"  # sglang==0.5.23: sglang/srt/disaggregation/utils.py:156-161 (no PD)

# -- 7. Flags the manager passes to every engine ----------------------------------------------------
# rust/rollout-manager/src/adapters/launch.rs (spec): the fixed flags, and --tokenizer-path when an engine
# starts on a published checkpoint. Where each is declared: sglang==0.5.2 and ==0.5.10.post1:
# sglang/srt/server_args.py (line of the add_argument call); sglang==0.5.23: the field in
# sglang/srt/arg_groups/fields/<file> (flag = "--" + field name, arg_utils.py:288-290,347-417).
MANAGER_FLAGS: dict[str, dict[str, str | None]] = {
    "--model-path": {"0.5.2": ":859", "0.5.10.post1": ":3636", "0.5.23": "model.py:51"},
    "--host": {"0.5.2": ":965", "0.5.10.post1": ":3744", "0.5.23": "serving.py:65"},
    "--port": {"0.5.2": ":971", "0.5.10.post1": ":3750", "0.5.23": "serving.py:66"},
    "--tp-size": {"0.5.2": ":1124", "0.5.10.post1": ":4092", "0.5.23": "parallel.py:45"},
    "--weight-version": {"0.5.2": ":1336", "0.5.10.post1": ":4455", "0.5.23": "serving.py:172"},
    "--enable-metrics": {"0.5.2": ":1239", "0.5.10.post1": ":4298", "0.5.23": "observability.py:70"},
    "--tokenizer-path": {"0.5.2": ":866", "0.5.10.post1": ":3643", "0.5.23": "serving.py:32"},
    "--served-model-name": {"0.5.2": ":1330", "0.5.10.post1": ":4449", "0.5.23": "serving.py:168"},
}
FLAG_RELEASES = ("0.5.2", "0.5.10.post1", "0.5.23")
#: Simulator knobs the tests pass with --engine-arg (tests/_support.py DEFAULT_ARGS); not SGLang's.
SIM_ONLY_FLAGS = {"--time-scale"}

# -- 8. What a running server reports after updates, its /ping and its SIGTERM --------------------
# A successful /update_weights_from_disk sets the tokenizer manager's model_path AND served_model_name
# to the checkpoint's path, whether or not --served-model-name was given (sglang==0.5.23:
# sglang/srt/managers/tokenizer_manager.py:2365-2370, called at :2383,:2390; sglang==0.5.8: same file
# :1375-1379; sglang==0.5.12: :1554-1558), and records the load format it used (0.5.23 :2370; default:
# the one in force, :2295-2296). /model_info reads all of them live (0.5.23 .../entrypoints/http_server.py:812-827);
# /v1/models lists, and /v1/models/{model} accepts, the current served name (:1993-2004, :2025-2030;
# 0.5.8 :1294-1297, 0.5.12 :1601-1604). The OpenAI answers' `model` is the request's, not the served
# name (.../entrypoints/openai/serving_completions.py:641).
MODEL_INFO_AFTER_DISK_UPDATE = ("model_path", "served_model_name", "load_format", "weight_version")
# /server_info's top level after a disk update (with weight_version) per release: the fields that follow
# it; the other ones of these keep their launch values.
SERVER_INFO_ARGS = ("model_path", "served_model_name", "load_format", "weight_version")
SERVER_INFO_FOLLOWS: dict[str, set[str]] = {
    # dataclasses.asdict of the ServerArgs the update edits in place: sglang==0.5.8 tokenizer_manager.py:1375-1379,
    # tokenizer_communicator_mixin.py:848-851, http_server.py:581-598 (served_model_name is only the manager's)
    "0.5.8": {"model_path", "load_format", "weight_version"},
    # sglang==0.5.12: tokenizer_manager.py:1554-1558, tokenizer_control_mixin.py:884-889, http_server.py:630-644
    "0.5.12": {"model_path", "load_format", "weight_version"},
    # sglang==0.5.17: the recorded updates and the manager's identity laid over the launch arguments,
    # tokenizer_manager.py:2066-2078, http_server.py:781-796
    "0.5.17": {"model_path", "served_model_name", "load_format", "weight_version"},
    # sglang==0.5.23: "the startup configuration" (http_server.py:863-891, utils/common.py:3584-3593,
    # server_args.py:316-333); the live values are /model_info's
    "0.5.23": set(),
}
# internal_states (one per DP rank, each the scheduler's resolved arguments): model_path and load_format
# follow a disk update in every release (the model runner writes them: sglang==0.5.8
# model_executor/model_runner.py:1076-1077; 0.5.23 :2590-2606); weight_version only once schedulers
# learn it, from 0.5.19 (0.5.23 managers/scheduler.py:5636-5641, scheduler_components/internal_state.py:45-48,
# runtime_context.py:1163-1174; no scheduler code mentions it in 0.5.8, 0.5.12 or 0.5.18).
INTERNAL_STATE_VERSION_FOLLOWS = {"0.5.8": False, "0.5.12": False, "0.5.17": False, "0.5.23": True}
# /ping: sglang==0.5.23 http_server.py:2190-2199 answers 200 when is_healthy() (tokenizer_manager.py:728-730:
# not shutting down and status Up), else 503; a paused server is still Up. A health check that times out
# sets UnHealthy (http_server.py:798), one that passes sets Up again (:784). Before 0.5.23 /ping is always
# 200 (sglang==0.5.8 http_server.py:1442-1445; 0.5.12 :1782-1785; 0.5.22 :2123-2126).
PING_REPORTS_HEALTH = {"0.5.8": False, "0.5.12": False, "0.5.23": True}
# return_prompt_token_ids: a GenerateReqInput field in sglang==0.5.15.post1 (managers/io_struct.py:281)
# and 0.5.23 (:337); the answer then has `prompt_token_ids` in every stream chunk and the final answer
# (0.5.23 tokenizer_manager.py:2673-2674, 2712-2713) and in an aborted request's answer (:3636-3637).
# sglang==0.5.12 has no such field (io_struct.py GenerateReqInput at :135), and unknown keys are ignored.
RETURNS_PROMPT_TOKEN_IDS = {"0.5.12": False, "0.5.15.post1": True, "0.5.23": True}
# SIGTERM sets gracefully_exit (sglang==0.5.23 tokenizer_manager.py:4066-4070); the watchdog then drains,
# unless the server is UnHealthy or SGL_FORCE_SHUTDOWN is true: it exits at once, logging this
# (:3508-3531; sglang==0.5.8 :2091-2105; 0.5.12 :2384-2398). SGL_FORCE_SHUTDOWN is read by
# get_bool_env_var ("true"/"1", any case; utils/common.py:1424-1440).
FORCE_EXIT_LOG = {
    "unhealthy": "Signal SIGTERM received while health check failed. Force exiting.",
    "force": "Signal SIGTERM received while force shutdown flag set. Force exiting.",
}

# =============================================================================================
# Known disagreements: what the simulator does today where it differs from the facts above.
# Each is asserted; fixing the simulator fails its test until the entry is deleted.
# =============================================================================================
KNOWN_GAPS: dict[str, Any] = {
    # sampling_params the sim refuses with a 400 (sampling_params.py:168,181; api_types.py:205-206).
    "sampling_params refused": {"beam_width", "watermark"},
    # Names missing from the sim's "expected one of" list (api_types.py:1256 lists 28).
    "sampling_params missing from the unknown-field message": {"beam_width", "watermark", "choice"},
    # Body of the unknown-key 400: SGLang {"error": "<message>"} (http_server.py:937-939); the sim
    # answers FastAPI's validation shape. Value: the sim's top-level keys.
    "unknown sampling_params key body": {"object", "message", "type", "param", "code"},
    # GenerateReqInput fields SGLang 0.5.23 refuses on a server like ours and the sim accepts:
    # max_thinking_tokens needs --enable-strict-thinking (managers/tokenizer_manager.py:906-913).
    "generate fields refused by SGLang": {"max_thinking_tokens"},
    # meta_info keys SGLang sends and the sim does not (tokenizer_manager.py:2617, :2870, :3006-3007).
    "meta_info missing": {"dp_rank"},
    "meta_info missing with return_logprob": {"output_token_logprobs_length"},
    "meta_info missing with token_ids_logprob": {"input_token_ids_logprobs", "output_token_ids_logprobs"},
    # /server_info status: SGLang the literal "ready" (scheduler.py:1944); the sim its health status.
    "server_info status": "Up",
    # /model_info keys the sim never sends (the embedding plan, http_server.py:843-849).
    "model_info keys missing": {"embedding"},
    # /model_info on older profiles: the sim reports 0.5.23's keys everywhere. Value: extra keys.
    "model_info keys of later releases": {
        "0.5.2": MODEL_INFO_KEYS[NEWEST] - MODEL_INFO_KEYS["0.5.2"] - {"embedding"},
        "0.5.6": MODEL_INFO_KEYS[NEWEST] - MODEL_INFO_KEYS["0.5.6"] - {"embedding"},
        "0.5.8": MODEL_INFO_KEYS[NEWEST] - MODEL_INFO_KEYS["0.5.8"] - {"embedding"},
        "0.5.10.post1": MODEL_INFO_KEYS[NEWEST] - MODEL_INFO_KEYS["0.5.10.post1"] - {"embedding"},
        "0.5.12": MODEL_INFO_KEYS[NEWEST] - MODEL_INFO_KEYS["0.5.12"] - {"embedding"},
        "0.5.15.post1": MODEL_INFO_KEYS[NEWEST] - MODEL_INFO_KEYS["0.5.15.post1"] - {"embedding"},
    },
    # /get_weight_version answers {"weight_version"} up to 0.5.7 (0.5.2 http_server.py:429-434;
    # 0.5.6 :512-526 with /weight_version); the sim answers 404 on every profile.
    "routes served by SGLang, 404 in the sim": {
        ("0.5.2", "/get_weight_version"), ("0.5.6", "/get_weight_version"), ("0.5.6", "/weight_version"),
    },
    # /v1/loads per-load core keys the sim leaves out (load_snapshot.py:196-220, to_dict :232-233).
    "loads core keys missing": {"timestamp", "num_active_tokens", "num_prealloc_ready_tokens",
                                "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments"},
    # Sections: SGLang leaves out None sections (load_snapshot.py:254-255); the sim sends
    # speculative/lora as null. Value: section -> (keys the sim adds, keys it lacks).
    "loads sections": {
        "speculative": "null",
        "lora": "null",
        "memory": ({"cached_tokens", "evictable_tokens"}, set()),
        "disaggregation": ({"prefill_prealloc_queue_reqs"},
                           {"prefill_bootstrap_queue_reqs", "decode_retracted_queue_reqs", "kv_transfer_speed_gb_s",
                            "kv_transfer_latency_ms"}),
    },
    # ?dp_rank out of range: SGLang 200 with "loads": [] (tokenizer_control_mixin.py:1016-1020);
    # the sim 400.
    "loads dp_rank out of range status": 400,
    # /get_load entries: keys SGLang sends that the sim leaves out, per release.
    "get_load keys missing": {
        "0.5.6": {"rid", "http_worker_ipc"},
        "0.5.8": {"rid", "http_worker_ipc", "ts_tic"},
        "0.5.10.post1": {"rid", "http_worker_ipc", "ts_tic"},
        "0.5.12": {"num_pending_tokens", "ts_tic"},
        "0.5.15.post1": {"num_pending_tokens", "ts_tic"},
    },
    # sglang:queue_time_seconds is a scheduler metric (metrics_collector.py:837-840); the sim
    # labels it like a tokenizer metric. Value: scheduler labels the sim leaves out.
    "queue_time_seconds labels missing": {"tp_rank", "pp_rank", "moe_ep_rank"},
}  # fmt: skip

# =============================================================================================
# Simulators and the manager
# =============================================================================================

MODEL = "contract-model"
LISTENING = re.compile(r"sglang-sim listening on (http://127\.0\.0\.1:\d+)")


@dataclass
class Sim:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str) -> Any:
        resp = http("GET", self.url + path)
        assert resp.status == 200, (path, resp.status, resp.body[:300])
        return resp.json()

    def generate(self, body: dict[str, Any]) -> Any:
        resp = http("POST", self.url + "/generate", body)
        assert resp.status == 200, (body, resp.status, resp.body[:300])
        return resp.json()


def _start_sim(binary: Path, log: Path, args: tuple[str, ...], env: dict[str, str] | None = None) -> Sim:
    argv = [str(binary), "--model-path", MODEL, "--host", "127.0.0.1", "--port", "0",
            "--skip-server-warmup", "--time-scale", "0", *args]  # fmt: skip
    with open(log, "wb") as out:
        environ = {**os.environ, "NO_COLOR": "1", **(env or {})}
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=environ)
    sim = Sim("", process, log)

    def listening() -> str | None:
        match = LISTENING.search(ANSI_ESCAPE.sub("", log.read_text(errors="replace")))
        if match:
            return match[1]
        if process.poll() is not None:
            raise AssertionError(f"{argv} exited with {process.returncode}:\n{log.read_text(errors='replace')}")
        return None

    try:
        sim.url = wait_until(listening, 20, f"{argv} to listen")
        wait_until(lambda: http("GET", sim.url + "/health").status == 200, 20, f"{sim.url}/health")
    except BaseException:
        _stop_sim(sim)
        raise
    return sim


def _stop_sim(sim: Sim) -> None:
    if sim.process.poll() is None:
        sim.process.send_signal(signal.SIGTERM)
        try:
            sim.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sim.process.kill()
            sim.process.wait()


@pytest.fixture(scope="module")
def start_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Sim]]:
    """``start_sim(*args)``: one sglang-sim per distinct argument list, shared by the module."""
    binary = freshest_build(find_binary("sglang-sim"))
    logs = tmp_path_factory.mktemp("sims")
    sims: dict[tuple[str, ...], Sim] = {}

    def start(*args: str) -> Sim:
        if args not in sims:
            sims[args] = _start_sim(binary, logs / f"sim{len(sims)}.log", args)
        return sims[args]

    try:
        yield start
    finally:
        for sim in sims.values():
            _stop_sim(sim)


@pytest.fixture
def own_sim(tmp_path: Path) -> Iterator[Callable[..., Sim]]:
    """``own_sim(*args, env=...)``: a simulator of this test's alone (its state changes, or it is
    stopped); stopped at the end of the test if still running."""
    binary = freshest_build(find_binary("sglang-sim"))
    sims: list[Sim] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Sim:
        sims.append(_start_sim(binary, tmp_path / f"own{len(sims)}.log", args, env))
        return sims[-1]

    try:
        yield start
    finally:
        for sim in sims:
            _stop_sim(sim)


@pytest.fixture(scope="module")
def sim(start_sim: Callable[..., Sim]) -> Sim:
    """The newest release, with metrics (the default profile)."""
    return start_sim("--enable-metrics")


@pytest.fixture(scope="module")
def plain_sim(start_sim: Callable[..., Sim]) -> Sim:
    """No --enable-metrics (so meta_info has no timing keys); every token may end the request
    with EOS unless ignore_eos."""
    return start_sim("--eos-prob", "1")


def release_sim(start_sim: Callable[..., Sim], release: str) -> Sim:
    return start_sim("--sglang-api", release)


def status_of(sim: Sim, path: str, method: str) -> int:
    """A request that cannot change anything: POST/PUT bodies fail validation."""
    if path == "/v1/models/{model:path}":
        path = f"/v1/models/{MODEL}"
    body = None if method == "GET" else "not an object"
    return http(method, sim.url + path, body).status


def gap(name: str) -> Any:
    return KNOWN_GAPS[name]


def check_gap(name: str, observed: Any) -> None:
    assert observed == KNOWN_GAPS[name], (
        f"KNOWN_GAPS[{name!r}] no longer matches the simulator (fixed?): it is {observed!r}, "
        f"the entry says {KNOWN_GAPS[name]!r}; update the entry"
    )


# =============================================================================================
# 1. Routes and methods
# =============================================================================================


def test_every_simulated_route_is_an_sglang_route_with_its_methods(sim: Sim) -> None:
    served = {}
    for path, methods in SIMULATED.items():
        probed = methods if path in MOUNTS else ("GET", "POST", "PUT")
        served[path] = tuple(m for m in probed if status_of(sim, path, m) not in (404, 405))
    assert served == SIMULATED


def test_sim_only_routes_are_absent_by_default(sim: Sim) -> None:
    assert {r: http("POST", sim.url + r, {}).status for r in SIM_ONLY_ROUTES} == dict.fromkeys(SIM_ONLY_ROUTES, 404)
    assert not set(SIM_ONLY_ROUTES) & set(SIMULATED)


def test_routes_sglang_has_and_the_sim_does_not_answer_404(sim: Sim) -> None:
    statuses = {
        path: http(method, sim.url + path, {} if method != "GET" else None) for path, method in NOT_SIMULATED.items()
    }
    assert {p: r.status for p, r in statuses.items()} == dict.fromkeys(NOT_SIMULATED, 404)
    assert all(r.json() == {"detail": "Not Found"} for r in statuses.values())
    assert not set(NOT_SIMULATED) & set(SIMULATED)


def test_every_route_our_clients_use_is_simulated() -> None:
    legacy = set().union(*SERVED_BY_RELEASE.values())
    assert set(USED_BY_CLIENTS) - set(SIMULATED) - legacy == set()


# =============================================================================================
# 2. Routes per release
# =============================================================================================


@pytest.mark.parametrize("release", RELEASES)
def test_changed_routes_per_release(start_sim: Callable[..., Sim], release: str) -> None:
    engine = release_sim(start_sim, release)
    assert engine.get("/get_server_info")["version"] == f"{release}-sim"
    served = {route for route, method in CHANGED_ROUTES.items() if status_of(engine, route, method) != 404}
    missing_in_sim = {route for r, route in gap("routes served by SGLang, 404 in the sim") if r == release}
    assert served == SERVED_BY_RELEASE[release] - missing_in_sim
    for route in missing_in_sim:  # still a gap
        assert status_of(engine, route, CHANGED_ROUTES[route]) == 404


def test_route_table_covers_every_release() -> None:
    assert set(SERVED_BY_RELEASE) == set(RELEASES)
    assert set().union(*SERVED_BY_RELEASE.values()) <= set(CHANGED_ROUTES)


# =============================================================================================
# 3. sampling_params
# =============================================================================================


# Moved to tests/sglang/test_engine_contract.py, which checks it on the simulator and on SGLang
# 0.5.23 itself: every sampling_params key accepted, the unknown-key 400.


def test_observable_sampling_defaults(plain_sim: Sim) -> None:
    # max_new_tokens defaults to 128.
    out = plain_sim.generate({"text": "hi", "sampling_params": {"ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == SAMPLING_PARAMS["max_new_tokens"][0]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": SAMPLING_PARAMS["max_new_tokens"][0]}
    # ignore_eos defaults to False and min_new_tokens to 0: EOS may end the request at once.
    assert SAMPLING_PARAMS["ignore_eos"][0] is False and SAMPLING_PARAMS["min_new_tokens"][0] == 0
    out = plain_sim.generate({"text": "hi"})
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and out["meta_info"]["completion_tokens"] == 1
    # n defaults to 1 (one answer, not a list), also when sent as null.
    assert SAMPLING_PARAMS["n"][0] == 1
    for params in ({"max_new_tokens": 1}, {"max_new_tokens": 1, "n": None}):
        assert isinstance(plain_sim.generate({"text": "hi", "sampling_params": params}), dict)
    assert len(plain_sim.generate({"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 2}})) == 2
    # null means the default for every key (sampling_params.py:191-235): accepted all at once.
    nulls = {name: None for name in SAMPLING_PARAMS if name not in gap("sampling_params refused")}
    out = plain_sim.generate({"text": "hi", "sampling_params": {**nulls, "max_new_tokens": 3, "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 3


# =============================================================================================
# 4. /generate request and response fields
# =============================================================================================


# Moved to tests/sglang/test_engine_contract.py, which checks it on the simulator and on SGLang
# 0.5.23 itself: every GenerateReqInput field accepted.


def test_plain_response_keys(plain_sim: Sim) -> None:
    out = plain_sim.generate({"text": "hello world", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert set(out) == RESPONSE_KEYS
    expected = META_INFO_KEYS - gap("meta_info missing")
    assert set(out["meta_info"]) == expected | SIM_META_INFO_EXTENSIONS
    check_gap("meta_info missing", META_INFO_KEYS - set(out["meta_info"]))
    assert set(out["meta_info"]["finish_reason"]) == FINISH_LENGTH_KEYS
    stop = plain_sim.generate({"text": "hello world"})["meta_info"]["finish_reason"]
    assert set(stop) == FINISH_STOP_KEYS


def test_request_fields_shape_the_response(plain_sim: Sim) -> None:
    base = {"text": "hello world", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    plain = set(plain_sim.generate(base)["meta_info"])

    assert plain_sim.generate({**base, "rid": "r-1"})["meta_info"]["id"] == "r-1"
    out = plain_sim.generate({"input_ids": GENERATE_FIELDS["input_ids"], "sampling_params": {"max_new_tokens": 1}})
    assert out["meta_info"]["prompt_tokens"] == len(GENERATE_FIELDS["input_ids"])
    out = plain_sim.generate({**base, "return_prompt_token_ids": True})
    assert set(out) == RESPONSE_KEYS | {"prompt_token_ids"}
    batch = plain_sim.generate({**base, "text": ["a", "b"]})
    assert isinstance(batch, list) and len(batch) == 2

    added = set(plain_sim.generate({**base, "return_logprob": True})["meta_info"]) - plain
    check_gap("meta_info missing with return_logprob", LOGPROB_KEYS - added)
    assert added == LOGPROB_KEYS - gap("meta_info missing with return_logprob")
    added = set(plain_sim.generate({**base, "return_logprob": True, "top_logprobs_num": 2})["meta_info"]) - plain
    assert added == (LOGPROB_KEYS | TOP_LOGPROB_KEYS) - gap("meta_info missing with return_logprob")
    added = set(plain_sim.generate({**base, "return_logprob": True, "token_ids_logprob": [5]})["meta_info"]) - plain
    check_gap("meta_info missing with token_ids_logprob", TOKEN_IDS_LOGPROB_KEYS - added)

    out = plain_sim.generate({**base, "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True})
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]
    assert all(isinstance(e[2], str) for e in out["meta_info"]["output_token_logprobs"])

    events = list(sse_events(plain_sim.url + "/generate", {**base, "stream": True}))
    assert events[-1] == "[DONE]" and len(events) >= 2


# =============================================================================================
# 5. /model_info, /server_info, /v1/loads, /get_load
# =============================================================================================


@pytest.mark.parametrize("release", RELEASES)
def test_model_info_keys_per_release(start_sim: Callable[..., Sim], release: str) -> None:
    info = release_sim(start_sim, release).get("/get_model_info")
    extra = gap("model_info keys of later releases").get(release, set())
    assert set(info) == (MODEL_INFO_KEYS[release] | SIM_MODEL_INFO_EXTENSIONS | extra) - gap("model_info keys missing")
    check_gap("model_info keys missing", MODEL_INFO_KEYS[NEWEST] - set(info))


@pytest.mark.parametrize("release", RELEASES)
def test_server_info_keys_our_clients_read(start_sim: Callable[..., Sim], release: str) -> None:
    info = release_sim(start_sim, release).get("/get_server_info")
    assert SERVER_INFO_READ <= set(info)
    assert str(info["version"]).startswith(release)
    assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == info["dp_size"]


# Moved to tests/sglang/test_engine_contract.py, which checks it on the simulator and on SGLang
# 0.5.23 itself: /server_info and /v1/loads of the newest release.


@pytest.mark.parametrize("release", [r for r in RELEASES if GET_LOAD_KEYS[r] is not None])
def test_get_load_shape_per_release(start_sim: Callable[..., Sim], release: str) -> None:
    load = release_sim(start_sim, release).get("/get_load")
    expected = GET_LOAD_KEYS[release]
    assert expected is not None
    missing = gap("get_load keys missing").get(release, set())
    if expected == {"load"}:
        assert isinstance(load, dict) and set(load) == expected
        return
    assert isinstance(load, list) and len(load) == 1
    assert set(load[0]) == expected - missing
    assert missing <= expected


# =============================================================================================
# 6. Metrics
# =============================================================================================


# Moved to tests/sglang/test_engine_contract.py, which checks it on the simulator and on SGLang
# 0.5.23 itself: metric names and labels.


def test_metrics_only_with_enable_metrics(plain_sim: Sim) -> None:
    # sglang==0.5.23: .../entrypoints/http_server.py:314-315 mounts /metrics only with --enable-metrics.
    assert http("GET", plain_sim.url + "/metrics").status == 404


# =============================================================================================
# 7. Flags the manager passes to engines
# =============================================================================================


@pytest.fixture(scope="module")
def manager_launch_flags(manager_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Every --flag in the launch commands of a fleet's engines: the initial ones, and one started
    on a published checkpoint (which gets --tokenizer-path)."""
    handle: ManagerHandle = start_manager(manager_bin, tmp_path_factory.mktemp("contract_fleet"))
    try:
        handle.wait_engines(INITIAL_ENGINES, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        checkpoint = tmp_path_factory.mktemp("contract_ckpt") / "v2"
        write_checkpoint(checkpoint, seed=2)
        update = handle.client.publish_weights("v2", str(checkpoint))
        assert handle.client.wait_for_weight_update(update["update_id"], timeout=60)["status"] == "COMPLETED"
        handle.client.scale_out(num_replicas=INITIAL_ENGINES + 1)
        view = handle.wait_engines(INITIAL_ENGINES + 1, "ACTIVE", STARTUP_TIMEOUT, fail_on_failed=True)
        flags: set[str] = set()
        for engine in view.with_status("ACTIVE"):
            command = http("GET", f"{engine.url}/server_info").json()["launch_command"]
            flags |= {token.split("=", 1)[0] for token in command.split() if token.startswith("--")}
        yield flags
    finally:
        stop_manager(handle)


def test_manager_flags_are_sglang_flags_in_every_release(manager_launch_flags: set[str]) -> None:
    assert manager_launch_flags - SIM_ONLY_FLAGS == set(MANAGER_FLAGS)
    for flag, where in MANAGER_FLAGS.items():
        assert set(where) == set(FLAG_RELEASES) and all(where.values()), flag


# =============================================================================================
# 8. A running server: identity after a disk update, /ping, SIGTERM
# =============================================================================================


@pytest.mark.parametrize("release", sorted(SERVER_INFO_FOLLOWS, key=lambda r: tuple(map(int, r.split(".")))))
def test_a_disk_update_renames_the_served_model(own_sim: Callable[..., Sim], tmp_path: Path, release: str) -> None:
    engine = own_sim("--sglang-api", release, "--served-model-name", "pinned", "--weight-version", "v0")
    checkpoint = tmp_path / "ckpt-v1"
    write_checkpoint(checkpoint, seed=1)
    path = str(checkpoint)
    resp = http("POST", engine.url + "/update_weights_from_disk", {"model_path": path, "weight_version": "v1"})
    assert resp.status == 200 and resp.json()["success"], resp.body[:300]

    # /model_info and /v1/models: the checkpoint, even though --served-model-name was given.
    info = engine.get("/get_model_info")
    after = {"model_path": path, "served_model_name": path, "load_format": "auto", "weight_version": "v1"}
    assert {k: info[k] for k in MODEL_INFO_AFTER_DISK_UPDATE} == after
    assert [card["id"] for card in engine.get("/v1/models")["data"]] == [path]
    assert engine.get(f"/v1/models/{path}")["id"] == path
    assert http("GET", engine.url + "/v1/models/pinned").status == 404
    # The OpenAI answers name the model the request named.
    body = {"model": "pinned", "prompt": "hi", "max_tokens": 2}
    assert http("POST", engine.url + "/v1/completions", body).json()["model"] == "pinned"

    # /server_info's top level: what this release lets follow the update; the rest is the launch's.
    launch = {"model_path": MODEL, "served_model_name": "pinned", "load_format": "auto", "weight_version": "v0"}
    top = engine.get("/get_server_info")
    follows = SERVER_INFO_FOLLOWS[release]
    expected = {k: (after if k in follows else launch)[k] for k in SERVER_INFO_ARGS}
    assert {k: top[k] for k in SERVER_INFO_ARGS} == expected
    (state,) = top["internal_states"]
    assert (state["model_path"], state["load_format"]) == (path, "auto")
    assert state["weight_version"] == ("v1" if INTERNAL_STATE_VERSION_FOLLOWS[release] else "v0")

    # A weight-version change alone moves /model_info's version and nothing of the identity.
    assert http("POST", engine.url + "/update_weight_version", {"new_version": "v2"}).status == 200
    info = engine.get("/get_model_info")
    assert (info["weight_version"], info["model_path"]) == ("v2", path)
    assert engine.get("/get_server_info")["weight_version"] == ("v2" if "weight_version" in follows else "v0")


def test_a_failed_disk_update_keeps_the_name(own_sim: Callable[..., Sim], tmp_path: Path) -> None:
    engine = own_sim("--served-model-name", "pinned")
    missing = str(tmp_path / "no-such-checkpoint")
    resp = http("POST", engine.url + "/update_weights_from_disk", {"model_path": missing})
    assert resp.status == 400 and resp.json()["success"] is False
    info = engine.get("/model_info")
    assert (info["model_path"], info["served_model_name"]) == (MODEL, "pinned")
    assert [card["id"] for card in engine.get("/v1/models")["data"]] == ["pinned"]


# /health stays a plain 200 (no generation) so the simulator starts; /health_generate runs the check,
# which fails at once with a timeout of 0 and leaves the server UnHealthy.
FAILING_CHECKS = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false", "SGLANG_HEALTH_CHECK_TIMEOUT": "0"}


def make_unhealthy(engine: Sim) -> None:
    assert http("GET", engine.url + "/health_generate").status == 503


@pytest.mark.parametrize("release", sorted(PING_REPORTS_HEALTH, key=lambda r: tuple(map(int, r.split(".")))))
def test_ping_reports_the_health_flag(own_sim: Callable[..., Sim], release: str) -> None:
    engine = own_sim("--sglang-api", release, env=FAILING_CHECKS)
    assert http("GET", engine.url + "/ping").status == 200
    # Paused is still healthy.
    assert http("POST", engine.url + "/pause_generation", {"mode": "in_place"}).status == 200
    assert http("GET", engine.url + "/ping").status == 200
    assert http("POST", engine.url + "/continue_generation", {}).status == 200
    make_unhealthy(engine)
    ping = http("GET", engine.url + "/ping")
    assert ping.status == (503 if PING_REPORTS_HEALTH[release] else 200)
    assert ping.body == b""


@pytest.mark.parametrize("release", sorted(RETURNS_PROMPT_TOKEN_IDS))
def test_prompt_token_ids_per_release(start_sim: Callable[..., Sim], release: str) -> None:
    sim = start_sim("--sglang-api", release)
    body = {"text": "hello world", "return_prompt_token_ids": True, "sampling_params": {"max_new_tokens": 3}}
    out = sim.generate(body)
    chunks = [json.loads(e) for e in sse_events(sim.url + "/generate", {**body, "stream": True}) if e != "[DONE]"]
    if RETURNS_PROMPT_TOKEN_IDS[release]:
        assert len(out["prompt_token_ids"]) == out["meta_info"]["prompt_tokens"]
        assert all(c["prompt_token_ids"] == out["prompt_token_ids"] for c in chunks)
    else:
        assert "prompt_token_ids" not in out and all("prompt_token_ids" not in c for c in chunks)


def _events_until_cut(events: Iterator[str]) -> list[str]:
    """The remaining ``data:`` payloads of a stream, until it ends or its connection is cut."""
    seen: list[str] = []
    try:
        for event in events:
            seen.append(event)
    except (OSError, http_client.HTTPException):
        pass
    return seen


def _finish_reason(event: str) -> Any:
    """A stream chunk's finish_reason (None for [DONE] and for a line the cut left incomplete)."""
    try:
        return json.loads(event)["meta_info"]["finish_reason"]
    except ValueError:
        return None


@pytest.mark.parametrize("case", ["healthy", "unhealthy", "force"])
def test_sigterm_drains_unless_unhealthy_or_forced(own_sim: Callable[..., Sim], case: str) -> None:
    env = {**FAILING_CHECKS, **({"SGL_FORCE_SHUTDOWN": "1"} if case == "force" else {})}
    # Slow enough that the request is still running at the signal.
    engine = own_sim("--time-scale", "1", "--decode-tokens-per-sec", "20", env=env)
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}
    events = sse_events(engine.url + "/generate", body, timeout=60)
    assert next(events) != "[DONE]"
    if case == "unhealthy":
        make_unhealthy(engine)
    engine.process.send_signal(signal.SIGTERM)
    rest = _events_until_cut(events)
    assert engine.process.wait(timeout=30) == 0
    log = ANSI_ESCAPE.sub("", engine.log.read_text(errors="replace"))
    finishes = [f for f in map(_finish_reason, rest) if f is not None]
    if case == "healthy":
        # Never aborted (SGLang's drain waits for it): it streamed on until the grace ended and
        # the process cut its connection.
        outputs = [len(json.loads(e)["output_ids"]) for e in rest[:-1]]
        assert finishes == [] and "[DONE]" not in rest
        assert len(outputs) >= 2 and outputs == sorted(outputs) and outputs[0] < outputs[-1]
        assert not any(message in log for message in FORCE_EXIT_LOG.values())
    else:
        # Nothing aborted: the connection was cut when the process exited.
        assert finishes == [] and "[DONE]" not in rest
        assert FORCE_EXIT_LOG[case] in log
