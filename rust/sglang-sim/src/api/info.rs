//! Health, identity and load endpoints.

use super::{handler_error, json_ok, validation_error, AppState};
use crate::api_profile::ServerArgsView;
use crate::engine::{Engine, Identity, Status};
use crate::scheduler::RankLoad;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use std::time::UNIX_EPOCH;

/// `/health` and `/health_generate` (one handler, as in SGLang): after the `--slow-health`
/// delay, an empty 503 while starting or shutting down; `/health` is 200 at once when
/// `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is false; otherwise 200 when a 1-token
/// generation gets any scheduler output within `SGLANG_HEALTH_CHECK_TIMEOUT`, else an empty
/// 503 (see [`Engine::health_generate`]). A hung engine never gets here (the hang gate holds
/// every request); one that hangs during the check never answers it.
pub async fn health(State(engine): State<AppState>, uri: axum::http::Uri) -> Response {
    if let Some(delay) = engine.faults.slow_health() {
        tokio::time::sleep(delay).await;
    }
    let unavailable = || StatusCode::SERVICE_UNAVAILABLE.into_response();
    if matches!(engine.shared.status(), Status::Starting | Status::ShuttingDown) {
        return unavailable();
    }
    if !engine.health.generation && uri.path() == "/health" {
        return StatusCode::OK.into_response();
    }
    let passed = engine.health_generate().await;
    if engine.shared.is_hung() {
        std::future::pending::<()>().await;
    }
    if passed {
        StatusCode::OK.into_response()
    } else {
        unavailable()
    }
}

/// `/ready`: 200 only when up and not paused.
pub async fn ready(State(engine): State<AppState>) -> Response {
    match engine.shared.status() {
        Status::Up if !engine.shared.is_paused() => StatusCode::OK.into_response(),
        Status::Up => handler_error(StatusCode::SERVICE_UNAVAILABLE, "Generation is paused."),
        s => {
            handler_error(StatusCode::SERVICE_UNAVAILABLE, format!("The server is not ready (status {}).", s.as_str()))
        }
    }
}

/// SageMaker's `/ping`, an empty answer from the health flag alone (no generation): from 0.5.23
/// 200 only while the server is up (a paused one still is), 503 while starting, after a failed
/// health check (`UnHealthy`) and once shutting down; in earlier releases always 200 (see
/// [`crate::api_profile::Release::ping_reports_health`]).
pub async fn ping(State(engine): State<AppState>) -> Response {
    if !engine.cfg.sglang_api.ping_reports_health() || engine.shared.status() == Status::Up {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

/// `/model_info` (and `/get_model_info`): the live identity, version and load format; after a
/// disk update they are the checkpoint's.
pub async fn model_info(State(engine): State<AppState>) -> Response {
    let cfg = &engine.cfg;
    let w = engine.weights();
    let id = engine.identity();
    json_ok(json!({
        "model_path": id.model_path,
        "served_model_name": id.served_model_name,
        "tokenizer_path": cfg.tokenizer_path(),
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": &*engine.shared.version().name,
        "load_format": id.load_format,
        "reasoning_parser": null,
        "tool_call_parser": null,
        "disaggregation_mode": "null",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": engine.model_meta.model_type,
        "architectures": engine.model_meta.architectures,
        "weights_checksum": w.checksum,
    }))
}

fn unix_now() -> f64 {
    crate::engine::unix_now()
}

/// One DP rank's scheduler state. The scheduler's own copy of the arguments: the model runner
/// records the model path and load format of each disk update (0.5.23
/// `model_executor/model_runner.py:2590-2606`, 0.5.8 :1076-1077); the weight version only from
/// 0.5.19 on (see [`crate::api_profile::Release::scheduler_tracks_weight_version`]).
fn internal_state(engine: &Engine, id: &Identity, l: &RankLoad) -> Value {
    // Made-up but plausible memory figures for a small model, in GB.
    let kv_gb = l.max_total_num_tokens as f64 * 131_072.0 / 1e9;
    let version = if engine.cfg.sglang_api.scheduler_tracks_weight_version() {
        engine.shared.version().name.to_string()
    } else {
        engine.cfg.weight_version.clone()
    };
    json!({
        "dp_rank": l.dp_rank,
        "last_gen_throughput": l.gen_throughput,
        "memory_usage": {"weight": 15.0, "kvcache": kv_gb, "graph": 0.5, "token_capacity": l.max_total_num_tokens},
        "max_total_num_tokens": l.max_total_num_tokens,
        "num_running_reqs": l.num_running_reqs,
        "num_waiting_reqs": l.num_waiting_reqs,
        "model_path": id.model_path,
        "load_format": id.load_format,
        "weight_version": version,
    })
}

/// The top level of `/server_info` as the release reports it after updates (see
/// [`ServerArgsView`]).
fn server_args_now(engine: &Engine, id: &Identity) -> Identity {
    let cfg = &engine.cfg;
    let launch = Identity::at_launch(cfg);
    match cfg.sglang_api.server_args_view() {
        ServerArgsView::Startup => launch,
        ServerArgsView::LiveRenamed => id.clone(),
        ServerArgsView::Live => Identity { served_model_name: launch.served_model_name, ..id.clone() },
    }
}

pub async fn server_info(State(engine): State<AppState>) -> Response {
    if engine.shared.is_scheduler_hung() {
        // Its internal state comes from the scheduler, which never answers.
        return std::future::pending().await;
    }
    // ... and comes once the scheduler is free (a remote-instance send holds it); the reply is
    // a scheduler message, which the health check hears.
    engine.shared.wait_unblocked().await;
    engine.shared.note_output();
    let cfg = &engine.cfg;
    let loads = engine.loads();
    let w = engine.weights();
    let id = engine.identity();
    let top = server_args_now(&engine, &id);
    let version = match cfg.sglang_api.server_args_view() {
        ServerArgsView::Startup => cfg.weight_version.clone(),
        ServerArgsView::Live | ServerArgsView::LiveRenamed => engine.shared.version().name.to_string(),
    };
    let mut m = Map::new();
    let args = json!({
        "model_path": top.model_path,
        "tokenizer_path": cfg.tokenizer_path(),
        "served_model_name": top.served_model_name,
        "host": cfg.host,
        "port": engine.port,
        "tp_size": cfg.tp_size,
        "dp_size": cfg.dp_size,
        "pp_size": cfg.pp_size,
        "nnodes": cfg.nnodes,
        "node_rank": cfg.node_rank,
        "weight_version": version,
        "enable_metrics": cfg.enable_metrics,
        "max_total_tokens": cfg.max_total_tokens,
        "max_running_requests": cfg.max_running_requests,
        "context_length": cfg.context_length,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "mem_fraction_static": cfg.mem_fraction_static,
        "skip_server_warmup": cfg.skip_server_warmup,
        "load_format": top.load_format,
        "base_gpu_id": cfg.base_gpu_id,
        "gpu_id_step": cfg.gpu_id_step,
        "disable_radix_cache": cfg.disable_radix_cache,
        "incremental_streaming_output": cfg.incremental_streaming_output,
        "stream_interval": cfg.stream_interval,
        "enable_deterministic_inference": cfg.enable_deterministic_inference,
        "random_seed": cfg.random_seed,
        "api_key": cfg.api_key.as_ref().map(|_| "<redacted>"),
        "admin_api_key": cfg.admin_api_key.as_ref().map(|_| "<redacted>"),
        "page_size": cfg.page_size.unwrap_or(1),
        "schedule_policy": cfg.schedule_policy.clone().unwrap_or_else(|| "fcfs".into()),
        // SGLang lists every server argument; slime checks this one of an external engine.
        "enable_memory_saver": false,
    });
    if let Value::Object(a) = args {
        m.extend(a);
    }
    m.insert("launch_command".into(), Value::from(std::env::args().collect::<Vec<_>>().join(" ")));
    m.insert("status".into(), Value::from(engine.shared.status().as_str()));
    m.insert("max_total_num_tokens".into(), Value::from(cfg.max_total_tokens));
    m.insert("max_req_input_len".into(), Value::from(cfg.max_req_input_len()));
    m.insert("startup_time".into(), Value::from(engine.startup_secs()));
    m.insert("kv_events".into(), Value::Null);
    m.insert("internal_states".into(), loads.iter().map(|l| internal_state(&engine, &id, l)).collect());
    m.insert("version".into(), Value::from(cfg.version()));
    m.insert("frontend".into(), Value::from("python"));
    m.insert("weights_checksum".into(), json!(w.checksum));
    m.insert("weights".into(), json!(w));
    m.insert("weight_sync".into(), engine.weight_sync.snapshot());
    m.insert(
        "simulator".into(),
        json!({
            "instance": engine.instance,
            "zero_cost": cfg.zero_cost,
            "time_scale": cfg.time_scale,
            "prefill_base_ms": cfg.prefill_base_ms,
            "prefill_ms_per_1k_tokens": cfg.prefill_ms_per_1k_tokens,
            "decode_step_base_ms": cfg.decode_step_base_ms,
            "decode_step_ms_per_req": cfg.decode_step_ms_per_req,
            "decode_step_ms_per_1k_ctx": cfg.decode_step_ms_per_1k_ctx,
            "eos_prob": cfg.eos_prob,
            "vocab_size": crate::tokenizer::VOCAB_SIZE,
            "pid": std::process::id(),
        }),
    );
    json_ok(Value::Object(m))
}

#[derive(Debug, Default, Deserialize)]
pub struct LoadsQuery {
    dp_rank: Option<usize>,
    include: Option<String>,
    format: Option<String>,
}

const SECTIONS: &[&str] = &["core", "memory", "spec", "lora", "disagg", "queues", "all"];

fn load_json(l: &RankLoad, include: &[&str], paused: usize) -> Map<String, Value> {
    let want = |s: &str| include.is_empty() || include.contains(&"all") || include.contains(&s);
    let mut m = Map::new();
    m.insert("dp_rank".into(), json!(l.dp_rank));
    m.insert("num_running_reqs".into(), json!(l.num_running_reqs));
    m.insert("num_waiting_reqs".into(), json!(l.num_waiting_reqs));
    m.insert("num_waiting_uncached_tokens".into(), json!(l.num_waiting_uncached_tokens));
    m.insert("num_used_tokens".into(), json!(l.num_used_tokens));
    m.insert("num_total_tokens".into(), json!(l.num_total_tokens));
    m.insert("max_total_num_tokens".into(), json!(l.max_total_num_tokens));
    m.insert("max_running_requests".into(), json!(l.max_running_requests));
    m.insert("token_usage".into(), json!((l.token_usage * 1e4).round() / 1e4));
    m.insert("gen_throughput".into(), json!((l.gen_throughput * 100.0).round() / 100.0));
    m.insert("cache_hit_rate".into(), json!((l.cache_hit_rate * 1e4).round() / 1e4));
    m.insert("utilization".into(), json!(0.0));
    if want("memory") {
        let kv_gb = l.max_total_num_tokens as f64 * 131_072.0 / 1e9;
        m.insert(
            "memory".into(),
            json!({"weight_gb": 15.0, "kv_cache_gb": kv_gb, "graph_gb": 0.5,
                   "token_capacity": l.max_total_num_tokens,
                   "cached_tokens": l.cached_tokens, "evictable_tokens": l.evictable_tokens}),
        );
    }
    if want("spec") {
        m.insert("speculative".into(), Value::Null);
    }
    if want("lora") {
        m.insert("lora".into(), Value::Null);
    }
    if want("disagg") {
        m.insert(
            "disaggregation".into(),
            json!({"mode": "null", "prefill_prealloc_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                   "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0}),
        );
    }
    if want("queues") {
        m.insert(
            "queues".into(),
            json!({"waiting": l.num_waiting_reqs, "grammar": 0, "paused": paused,
                   "retracted": l.num_retracted_reqs, "prealloc_ready": 0}),
        );
    }
    m
}

/// `/get_load` (releases before 0.5.21): one `{dp_rank, num_reqs, num_waiting_reqs,
/// num_tokens}` per DP rank from 0.5.6 on, `{"load": tokens}` of DP rank 0 before. The tokens
/// are those held in the KV pool plus the waiting prompts' (SGLang's scheduler `get_load`).
pub async fn get_load(State(engine): State<AppState>) -> Response {
    let loads = engine.loads();
    let tokens = |l: &RankLoad| l.num_total_tokens;
    if !engine.cfg.sglang_api.load_per_rank() {
        return json_ok(json!({"load": loads.first().map_or(0, tokens)}));
    }
    let ranks: Vec<Value> = loads
        .iter()
        .map(|l| {
            json!({"dp_rank": l.dp_rank, "num_reqs": l.num_running_reqs + l.num_waiting_reqs,
                   "num_waiting_reqs": l.num_waiting_reqs, "num_tokens": tokens(l)})
        })
        .collect();
    json_ok(Value::Array(ranks))
}

/// `/v1/loads`.
pub async fn loads(State(engine): State<AppState>, q: Result<Query<LoadsQuery>, QueryRejection>) -> Response {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return validation_error(format!("Invalid query parameters: {e}")),
    };
    let include: Vec<&str> = q
        .include
        .as_deref()
        .map(|s| s.split(',').map(str::trim).filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    if let Some(bad) = include.iter().find(|s| !SECTIONS.contains(s)) {
        return handler_error(
            StatusCode::BAD_REQUEST,
            format!("Unknown include section {bad:?}; expected one of {}.", SECTIONS.join(", ")),
        );
    }
    let mut loads = engine.loads();
    if let Some(r) = q.dp_rank {
        if r >= loads.len() {
            return handler_error(
                StatusCode::BAD_REQUEST,
                format!("dp_rank {r} is out of range (dp_size {}).", loads.len()),
            );
        }
        loads.retain(|l| l.dp_rank == r);
    }
    let paused = engine.paused_waiters.load(Ordering::Acquire);
    // SGLang 0.5.23 answers from the load snapshot in the HTTP process, without the scheduler:
    // a hung scheduler's last loads still come back.
    let rows: Vec<Map<String, Value>> = loads.iter().map(|l| load_json(l, &include, paused)).collect();
    if q.format.as_deref() == Some("prometheus") {
        let mut out = String::new();
        let mut samples: Vec<(String, Vec<(usize, f64)>)> = Vec::new();
        for row in &rows {
            let rank = row.get("dp_rank").and_then(Value::as_u64).unwrap_or(0) as usize;
            for (k, v) in row {
                let mut push = |name: String, x: f64| match samples.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, s)) => s.push((rank, x)),
                    None => samples.push((name, vec![(rank, x)])),
                };
                match v {
                    Value::Number(n) if k != "dp_rank" => push(format!("sglang_{k}"), n.as_f64().unwrap_or(0.0)),
                    Value::Object(sub) => {
                        let prefix = match k.as_str() {
                            "speculative" => "spec",
                            "disaggregation" => "disagg",
                            other => other,
                        };
                        for (sk, sv) in sub {
                            if let Some(x) = sv.as_f64() {
                                push(format!("sglang_{prefix}_{sk}"), x);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        for (name, s) in samples {
            out.push_str(&format!("# TYPE {name} gauge\n"));
            for (rank, x) in s {
                out.push_str(&format!("{name}{{dp_rank=\"{rank}\"}} {x}\n"));
            }
        }
        let mut r = out.into_response();
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
        return r;
    }
    json_ok(json!({
        "timestamp": iso8601_now(),
        "version": engine.cfg.version(),
        "accelerator": "sglang-sim",
        "num_accelerators": engine.cfg.tp_size * engine.cfg.pp_size,
        "loads": rows,
    }))
}

/// UTC time as `YYYY-MM-DDTHH:MM:SS.ffffff+00:00` (Python's `isoformat()`), without a date
/// library: civil-from-days after Howard Hinnant.
fn iso8601_now() -> String {
    let now = unix_now();
    let secs = now.floor() as i64;
    let micros = ((now - now.floor()) * 1e6) as i64;
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}+00:00", sod / 3600, (sod / 60) % 60, sod % 60)
}

fn model_card(engine: &Engine, id: &str) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": engine.started_at.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "owned_by": "sglang",
        "root": id,
        "parent": null,
        "max_model_len": engine.cfg.context_length,
    })
}

/// `/v1/models`: the served model name now in force (the checkpoint's path after a disk update).
pub async fn models(State(engine): State<AppState>) -> Response {
    let name = engine.identity().served_model_name;
    json_ok(json!({"object": "list", "data": [model_card(&engine, &name)]}))
}

/// `/v1/models/{model}`.
pub async fn model_card_route(State(engine): State<AppState>, Path(model): Path<String>) -> Response {
    if model != engine.identity().served_model_name {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": {
                "message": format!("The model '{model}' does not exist"),
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"
            }})),
        )
            .into_response();
    }
    json_ok(model_card(&engine, &model))
}

/// `/metrics` (404 unless `--enable-metrics`).
pub async fn metrics(State(engine): State<AppState>) -> Response {
    if !engine.cfg.enable_metrics {
        return (StatusCode::NOT_FOUND, axum::Json(json!({"detail": "Not Found"}))).into_response();
    }
    let text = engine.metrics.render(&engine.loads(), engine.paused_waiters.load(Ordering::Acquire));
    let mut r = text.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn iso_timestamp_shape() {
        let s = super::iso8601_now();
        assert_eq!(s.len(), "2026-08-06T09:15:23.481920+00:00".len(), "{s}");
        assert!(s.ends_with("+00:00"));
    }
}
