//! Control endpoints: cache, abort, pause/continue, weight version and weight updates.

use super::{handler_error, json_ok, parse_body, validation_error, AppState};
use crate::engine::PauseMode;
use crate::weights::{self, WeightsInfo};
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use std::time::{Duration, Instant};

#[derive(Debug, Default, Deserialize)]
pub struct FlushQuery {
    timeout: Option<f64>,
}

/// SGLang's answer to a flush that happened (0.5.23 `entrypoints/http_server.py:1025-1040`).
const FLUSHED: &str = "Cache flushed.\nPlease check backend logs for more details. (When there are running or \
                       waiting requests, the operation will not be performed.)\n";

/// `/flush_cache` (0.5.23 `entrypoints/http_server.py:1025-1040`,
/// `managers/scheduler_components/flush_wrapper.py:22-64`, `managers/scheduler.py:5518-5548`):
/// empties the prefix cache when the schedulers are fully idle. Refused (400) while a request
/// runs, or waits unless the schedulers are paused: `Flush cache failed.` With `?timeout=S`, a
/// busy engine is given up to S seconds to become idle (waiting requests counted), else `Timed
/// out waiting for idle state.`; a second such flush meanwhile is refused at once. The answers
/// are plain text without a content type, as SGLang's `Response(content=...)`.
pub async fn flush_cache(State(engine): State<AppState>, q: Result<Query<FlushQuery>, QueryRejection>) -> Response {
    let timeout = match q {
        Ok(Query(q)) => q.timeout.unwrap_or(0.0),
        Err(e) => return validation_error(format!("Invalid query parameters: {e}")),
    };
    if !(timeout.is_finite() && timeout >= 0.0) {
        return validation_error(format!("timeout: Input should be greater than or equal to 0, got {timeout}"));
    }
    // The scheduler answers once it is free (a remote-instance send holds it).
    engine.shared.wait_unblocked().await;
    if engine.flush_pending.load(std::sync::atomic::Ordering::Acquire) {
        return plain(StatusCode::BAD_REQUEST, "Another flush_cache is already in progress.");
    }
    if timeout > 0.0 && !engine.is_fully_idle(false) {
        engine.flush_pending.store(true, std::sync::atomic::Ordering::Release);
        let idle = engine.wait_fully_idle(Duration::from_secs_f64(timeout)).await;
        engine.flush_pending.store(false, std::sync::atomic::Ordering::Release);
        if !idle {
            engine.shared.note_output();
            return plain(StatusCode::BAD_REQUEST, "Timed out waiting for idle state.");
        }
    }
    if engine.flush_cache() {
        plain(StatusCode::OK, FLUSHED)
    } else {
        plain(StatusCode::BAD_REQUEST, "Flush cache failed.\n")
    }
}

/// A text body without a content type.
fn plain(status: StatusCode, body: &'static str) -> Response {
    let mut r = Response::new(axum::body::Body::from(body));
    *r.status_mut() = status;
    r
}

#[derive(Debug, Default, Deserialize)]
struct AbortReq {
    #[serde(default)]
    rid: Option<String>,
    #[serde(default)]
    abort_all: Option<bool>,
}

/// `/abort_request` (0.5.23 `entrypoints/http_server.py:1721-1731`): `{"rid"}` is forwarded only
/// when it is exactly an open request's rid, and then aborts every request whose rid starts
/// with it; `{"abort_all": true}` aborts everything (see [`crate::engine::Engine::abort_request`]).
/// Other keys (`abort_message` among them) are ignored. 200 with an empty body in every case.
pub async fn abort_request(State(engine): State<AppState>, body: Bytes) -> Response {
    let req: AbortReq = match parse_body(&body, true) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    engine.shared.wait_unblocked().await;
    if req.abort_all.unwrap_or(false) {
        engine.abort_all();
    } else {
        engine.abort_request(req.rid.as_deref().unwrap_or(""));
    }
    StatusCode::OK.into_response()
}

#[derive(Debug, Default, Deserialize)]
struct PauseReq {
    #[serde(default)]
    mode: Option<String>,
}

/// `/pause_generation`: new `/generate` calls wait until `/continue_generation`.
pub async fn pause_generation(State(engine): State<AppState>, body: Bytes) -> Response {
    // Before 0.5.6 the route reads no body: it always aborts every request.
    let req: PauseReq = if engine.cfg.sglang_api.pause_has_modes() {
        match parse_body(&body, true) {
            Ok(r) => r,
            Err(e) => return e.into_response(),
        }
    } else {
        PauseReq::default()
    };
    let mode_name = req.mode.unwrap_or_else(|| "abort".into());
    let Some(mode) = PauseMode::parse(&mode_name) else {
        return validation_error(format!("Input should be 'abort', 'retract' or 'in_place', got {mode_name:?}"));
    };
    if mode != PauseMode::Abort {
        // The schedulers take the pause when they are free.
        engine.shared.wait_unblocked().await;
    }
    engine.pause(mode).await;
    tracing::info!(port = engine.port, mode = mode_name, "generation paused");
    json_ok(json!({"message": "Generation paused successfully.", "status": "ok"}))
}

/// `/continue_generation`.
pub async fn continue_generation(State(engine): State<AppState>, body: Bytes) -> Response {
    if let Err(e) = parse_body::<serde_json::Map<String, serde_json::Value>>(&body, true) {
        return e.into_response();
    }
    engine.resume();
    tracing::info!(port = engine.port, "generation continued");
    json_ok(json!({"message": "Generation continued successfully.", "status": "ok"}))
}

#[derive(Debug, Default, Deserialize)]
struct UpdateWeightVersionReq {
    new_version: String,
    #[serde(default)]
    abort_all_requests: Option<bool>,
}

/// `/update_weight_version`.
pub async fn update_weight_version(State(engine): State<AppState>, body: Bytes) -> Response {
    let req: UpdateWeightVersionReq = match parse_body(&body, true) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if req.abort_all_requests.unwrap_or(true) {
        engine.abort_all();
    }
    engine.shared.set_version(&req.new_version);
    tracing::info!(port = engine.port, version = req.new_version, "weight version updated");
    json_ok(json!({
        "success": true,
        "message": format!("Weight version updated to {}", req.new_version),
        "new_version": req.new_version,
    }))
}

#[derive(Debug, Default, Deserialize)]
struct UpdateFromDiskReq {
    model_path: String,
    #[serde(default)]
    load_format: Option<String>,
    #[serde(default)]
    abort_all_requests: Option<bool>,
    #[serde(default)]
    weight_version: Option<String>,
    #[serde(default)]
    flush_cache: Option<bool>,
}

/// `/update_weights_from_disk`: reads, validates and hashes the checkpoint at `model_path`.
/// Unless generation is paused, it first waits for in-flight requests (and holds new ones).
/// On success the server's `model_path` and served model name become `model_path` (see
/// [`crate::engine::Identity`]).
pub async fn update_weights_from_disk(State(engine): State<AppState>, body: Bytes) -> Response {
    let req: UpdateFromDiskReq = match parse_body(&body, true) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let started = Instant::now();
    if req.abort_all_requests.unwrap_or(false) {
        engine.abort_all();
    }
    let paused = engine.shared.is_paused();
    let num_paused_requests =
        if paused { engine.loads().iter().map(|l| l.num_running_reqs + l.num_waiting_reqs).sum::<usize>() } else { 0 };
    let _exclusive = if paused { None } else { Some(engine.model_update_lock.write().await) };
    // No load_format: the one in force (SGLang reads its current config value).
    let load_format = req.load_format.clone().unwrap_or_else(|| engine.identity().load_format);
    let result = if load_format == "dummy" {
        Ok(WeightsInfo { path: Some(req.model_path.clone()), ..WeightsInfo::default() })
    } else {
        let path = req.model_path.clone();
        match tokio::task::spawn_blocking(move || weights::load_checkpoint(&path)).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(format!("weight loading task failed: {e}")),
        }
    };
    let info = match result {
        Ok(info) => info,
        Err(reason) => {
            tracing::warn!(port = engine.port, path = req.model_path, reason, "weight update failed");
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({
                    "success": false,
                    "message": format!("Failed to update weights: {reason}. Rolling back to the old weights."),
                    "num_paused_requests": num_paused_requests,
                })),
            )
                .into_response();
        }
    };
    if engine.cfg.weight_load_delay > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(engine.cfg.weight_load_delay)).await;
    }
    let checksum = info.checksum.clone();
    engine.set_weights(info);
    if let Some(v) = &req.weight_version {
        engine.shared.set_version(v);
    }
    // A flush the schedulers refuse (a request still running, e.g. paused in place) fails the
    // call though the weights changed; the server is then not renamed (SGLang 0.5.23
    // `managers/scheduler_components/weight_updater.py:120-160`,
    // `managers/tokenizer_manager.py:2375-2392`).
    if req.flush_cache.unwrap_or(true) && !engine.flush_cache() {
        tracing::warn!(port = engine.port, path = req.model_path, "weights updated from disk, cache not flushed");
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({
                "success": false,
                "message": super::weight_sync::NOT_FLUSHED,
                "num_paused_requests": num_paused_requests,
            })),
        )
            .into_response();
    }
    // The server now answers under the checkpoint's path, whatever --served-model-name said.
    engine.set_loaded_from(&req.model_path, &load_format);
    let mut message = String::from("Succeeded to update model weights.");
    if let Some(v) = &req.weight_version {
        message.push_str(&format!(" Weight version updated to {v}."));
    }
    engine.metrics.set_weight_load_duration(started.elapsed());
    tracing::info!(
        port = engine.port,
        path = req.model_path,
        checksum = checksum.as_deref().unwrap_or("-"),
        "weights updated from disk"
    );
    json_ok(json!({
        "success": true,
        "message": message,
        "num_paused_requests": num_paused_requests,
    }))
}

/// `/release_memory_occupation`, `/resume_memory_occupation`: accepted, no effect; 200 `null`.
pub async fn memory_occupation() -> Response {
    json_ok(serde_json::Value::Null)
}

/// `POST /sim/faults` (only with `--enable-fault-api`): changes this engine's faults while it
/// runs (see [`crate::faults::FaultRequest`]) and answers the faults now in force.
pub async fn set_faults(State(engine): State<AppState>, body: Bytes) -> Response {
    let req: crate::faults::FaultRequest = match parse_body(&body, true) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Some(secs) = req.slow_health {
        if !(secs.is_finite() && secs >= 0.0) {
            return handler_error(
                StatusCode::BAD_REQUEST,
                format!("slow_health must be a finite number >= 0, got {secs}"),
            );
        }
        engine.faults.set_slow_health(Some(secs));
    }
    if req.hang == Some(true) {
        tracing::warn!(port = engine.port, "simulated hang (POST /sim/faults)");
        engine.shared.set_hung();
    }
    if req.hang_scheduler == Some(true) {
        tracing::warn!(port = engine.port, "simulated scheduler hang (POST /sim/faults)");
        engine.shared.set_scheduler_hung();
    }
    let slow = engine.faults.slow_health().map(|d| d.as_secs_f64());
    // This answer still goes out: the hang gate holds only requests that arrive after it.
    json_ok(json!({"slow_health": slow, "hung": engine.shared.is_hung(),
                   "scheduler_hung": engine.shared.is_scheduler_hung()}))
}
