//! SGLang's distributed weight routes: the trainer broadcast path
//! (`/init_weights_update_group`, `/begin_weight_update`, `/update_weights_from_distributed`,
//! `/end_weight_update`, `/destroy_weights_update_group`) and the seed side of remote-instance
//! loading (`/init_weights_send_group_for_remote_instance`, `/send_weights_to_remote_instance`).
//!
//! Order SGLang 0.5.x expects (see `crate::weight_sync` for what is checked): init the group
//! on every engine while rank 0 joins -> `pause_generation` -> `begin_weight_update` ->
//! `update_weights_from_distributed` (while rank 0 broadcasts) -> `end_weight_update` ->
//! `continue_generation`; destroy the group when the engine set changes.
//!
//! Responses are `{success, message}`: 200 on success, 400 with `success: false` when the call
//! is out of order or its fields are inconsistent. A body that does not match the schema is a
//! validation error (400, SGLang's validation shape).

use super::{json_ok, parse_body, AppState};
use crate::weight_sync::{receive_broadcast, rendezvous, SendGroup, UpdateGroup};
use crate::weights::WeightsInfo;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use std::time::{Duration, Instant};

/// Bytes of the tensors a distributed update names: each shape's element count times its
/// dtype's size.
fn tensor_bytes(dtypes: &[String], shapes: &[Vec<u64>]) -> u64 {
    let size = |dtype: &str| -> u64 {
        match dtype {
            "float64" | "int64" => 8,
            "float32" | "int32" => 4,
            "bfloat16" | "float16" | "int16" => 2,
            _ => 1, // float8_*, int8, uint8, bool
        }
    };
    dtypes.iter().zip(shapes).map(|(d, s)| s.iter().product::<u64>().saturating_mul(size(d))).sum()
}

/// Default group names, as in SGLang's request models.
const UPDATE_GROUP: &str = "weight_update_group";
const SEND_GROUP: &str = "weight_send_group";
/// Torch dtype names a distributed update may name.
const DTYPES: &[&str] = &[
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
];

fn ok(message: impl Into<String>) -> Response {
    json_ok(json!({"success": true, "message": message.into()}))
}

fn fail(message: impl Into<String>) -> Response {
    (StatusCode::BAD_REQUEST, axum::Json(json!({"success": false, "message": message.into()}))).into_response()
}

/// Parses a body (required, as in SGLang); schema errors become SGLang's validation 400.
fn body<T: serde::de::DeserializeOwned + Default>(b: &Bytes) -> Result<T, super::ApiError> {
    parse_body(b, true)
}

#[derive(Debug, Default, Deserialize)]
struct InitGroupReq {
    master_address: String,
    master_port: u16,
    rank_offset: u32,
    world_size: u32,
    #[serde(default)]
    group_name: Option<String>,
    #[serde(default)]
    backend: Option<String>,
}

/// `/init_weights_update_group`: joins the trainer's group as ranks
/// `rank_offset..rank_offset + tp_size` of `world_size` (rank 0 is the trainer).
pub async fn init_weights_update_group(State(engine): State<AppState>, b: Bytes) -> Response {
    let req: InitGroupReq = match body(&b) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let name = req.group_name.unwrap_or_else(|| UPDATE_GROUP.into());
    let backend = req.backend.unwrap_or_else(|| "nccl".into());
    let tp = engine.cfg.tp_size;
    if !matches!(backend.as_str(), "nccl" | "gloo") {
        return fail(format!("Unsupported backend {backend:?}: use nccl or gloo."));
    }
    if engine.cfg.dp_size != 1 {
        return fail(format!("Distributed weight updates need dp_size 1; this engine has {}.", engine.cfg.dp_size));
    }
    if req.rank_offset == 0 || req.rank_offset.saturating_add(tp) > req.world_size {
        return fail(format!(
            "Failed to init group: ranks {}..{} of this engine (tp_size {tp}) do not fit world_size {} \
             with the trainer as rank 0 (rank_offset must be >= 1 and rank_offset + tp_size <= world_size).",
            req.rank_offset,
            req.rank_offset.saturating_add(tp),
            req.world_size
        ));
    }
    if engine.weight_sync.group(&name).is_some() {
        return fail(format!("Weight update group {name:?} already exists on this engine; destroy it first."));
    }
    let line = json!({"group_name": name, "rank_offset": req.rank_offset, "tp_size": tp,
                      "world_size": req.world_size, "engine_port": engine.port});
    if let Err(e) = rendezvous(&req.master_address, req.master_port, &line).await {
        tracing::warn!(port = engine.port, group = name, error = e, "weight update group init failed");
        return fail(format!("Failed to init group: {e}"));
    }
    let g = UpdateGroup {
        master_address: req.master_address,
        master_port: req.master_port,
        rank_offset: req.rank_offset,
        world_size: req.world_size,
        backend,
    };
    if let Err(e) = engine.weight_sync.add_group(&name, g) {
        return fail(e);
    }
    tracing::info!(port = engine.port, group = name, rank_offset = req.rank_offset, "joined weight update group");
    ok(format!("Succeeded to initialize weight update group {name}."))
}

#[derive(Debug, Default, Deserialize)]
struct GroupNameReq {
    #[serde(default)]
    group_name: Option<String>,
}

/// `/destroy_weights_update_group`.
pub async fn destroy_weights_update_group(State(engine): State<AppState>, b: Bytes) -> Response {
    let req: GroupNameReq = match body(&b) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let name = req.group_name.unwrap_or_else(|| UPDATE_GROUP.into());
    match engine.weight_sync.remove_group(&name) {
        Ok(_) => {
            tracing::info!(port = engine.port, group = name, "weight update group destroyed");
            ok(format!("Succeeded to destroy weight update group {name}."))
        }
        Err(e) => fail(e),
    }
}

#[derive(Debug, Default, Deserialize)]
struct SessionReq {
    #[serde(default)]
    selector: Option<String>,
}

fn selector(s: Option<String>) -> Result<String, super::ApiError> {
    let s = s.unwrap_or_else(|| "all".into());
    if matches!(s.as_str(), "target" | "draft" | "all") {
        Ok(s)
    } else {
        Err(super::ApiError::Validation(format!("selector: Input should be 'target', 'draft' or 'all', got {s:?}")))
    }
}

/// `/begin_weight_update`: opens the session distributed and tensor updates need.
pub async fn begin_weight_update(State(engine): State<AppState>, b: Bytes) -> Response {
    let req: SessionReq = match body(&b) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let sel = match selector(req.selector) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    match engine.weight_sync.begin(&sel) {
        Ok(()) => ok("Success"),
        Err(e) => fail(e),
    }
}

/// `/end_weight_update`.
pub async fn end_weight_update(State(engine): State<AppState>, b: Bytes) -> Response {
    if let Err(e) = body::<serde_json::Map<String, serde_json::Value>>(&b) {
        return e.into_response();
    }
    match engine.weight_sync.end() {
        Ok(()) => ok("Success"),
        Err(e) => fail(e),
    }
}

#[derive(Debug, Default, Deserialize)]
struct DistributedReq {
    names: Vec<String>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<u64>>,
    #[serde(default)]
    group_name: Option<String>,
    #[serde(default)]
    flush_cache: Option<bool>,
    #[serde(default)]
    abort_all_requests: Option<bool>,
    #[serde(default)]
    weight_version: Option<String>,
    #[serde(default)]
    load_format: Option<String>,
    #[serde(default)]
    selector: Option<String>,
}

/// SGLang 0.5.23's answer when a weight update cannot flush the cache the old weights made:
/// the update call fails though the weights changed (`managers/scheduler_components/weight_updater.py:120-133`).
pub const NOT_FLUSHED: &str = "Weights were updated, but the cache was not flushed because requests are still \
                               running or queued. Retract or finish them, then call /flush_cache.";

/// `/update_weights_from_distributed`: "receives" the named tensors from rank 0 of the group
/// (the simulator records their count; no bytes move) and sets `weight_version`, in SGLang
/// 0.5.23's order (`managers/tokenizer_control_mixin.py:503-533`,
/// `managers/scheduler_components/weight_updater.py:187-230`): abort if asked; unless paused,
/// wait for in-flight requests; outside a begin/end session (0.5.21 on) fail; receive (an
/// unknown group fails there); load; flush.
pub async fn update_weights_from_distributed(State(engine): State<AppState>, b: Bytes) -> Response {
    let req: DistributedReq = match body(&b) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = selector(req.selector.clone()) {
        return e.into_response();
    }
    let started = Instant::now();
    let name = req.group_name.clone().unwrap_or_else(|| UPDATE_GROUP.into());
    if req.abort_all_requests.unwrap_or(false) {
        engine.abort_all();
    }
    // Unless paused, the update waits for in-flight requests (and holds new ones) like SGLang.
    let _exclusive = if engine.shared.is_paused() { None } else { Some(engine.model_update_lock.write().await) };
    engine.shared.wait_unblocked().await;
    // The session exists from 0.5.21 on; older releases update without one.
    if engine.cfg.sglang_api.serves("/begin_weight_update") && engine.weight_sync.session().is_none() {
        engine.shared.note_output();
        return fail(crate::weight_sync::OUTSIDE_SESSION);
    }
    if let Err(e) = check_tensors(&req) {
        return fail(format!("Failed to receive weights: {e}"));
    }
    let Some(group) = engine.weight_sync.group(&name) else {
        let known: Vec<String> = engine.weight_sync.group_names().iter().map(|g| format!("'{g}'")).collect();
        return fail(format!(
            "Failed to receive weights: Group {name} not in [{}]. Please call `init_weights_update_group` first.",
            known.join(", ")
        ));
    };
    // The tensors come from rank 0's broadcast: wait for it, as SGLang's receiving ranks do.
    let line = json!({"group_name": name, "rank_offset": group.rank_offset, "engine_port": engine.port});
    if let Err(e) = receive_broadcast(&group.master_address, group.master_port, &line, &req.names).await {
        tracing::warn!(port = engine.port, group = name, error = e, "distributed weight update failed");
        return fail(format!("Failed to receive weights: group {name}: {e}"));
    }
    // The transfer model: every rank of a broadcast receives this call's tensors in the time
    // their bytes take on one link, whatever the group's size.
    let transfer = engine.cfg.transfer_time_of(tensor_bytes(&req.dtypes, &req.shapes));
    if !transfer.is_zero() {
        tokio::time::sleep(transfer).await;
    }
    if engine.cfg.weight_load_delay > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(engine.cfg.weight_load_delay)).await;
    }
    engine.set_weights(WeightsInfo { num_tensors: req.names.len(), ..WeightsInfo::default() });
    if let Some(v) = &req.weight_version {
        engine.shared.set_version(v);
    }
    engine.metrics.set_weight_load_duration(started.elapsed());
    tracing::info!(port = engine.port, group = name, tensors = req.names.len(), "weights updated from distributed");
    if req.flush_cache.unwrap_or(true) && !engine.flush_cache() {
        return fail(NOT_FLUSHED);
    }
    engine.shared.note_output();
    let mut message = String::from("Succeeded to update parameter online.");
    if let Some(v) = &req.weight_version {
        message.push_str(&format!(" Weight version updated to {v}."));
    }
    ok(message)
}

/// The simulator's own checks of what a broadcast would carry.
fn check_tensors(req: &DistributedReq) -> Result<(), String> {
    if req.names.is_empty() || req.names.len() != req.dtypes.len() || req.names.len() != req.shapes.len() {
        return Err(format!(
            "names, dtypes and shapes must be non-empty and of equal length (got {}, {}, {}).",
            req.names.len(),
            req.dtypes.len(),
            req.shapes.len()
        ));
    }
    if let Some(bad) = req.dtypes.iter().find(|d| !DTYPES.contains(&d.as_str())) {
        return Err(format!("Unknown dtype {bad:?}; expected a torch dtype name such as bfloat16."));
    }
    if let Some(f) = req.load_format.as_deref().filter(|f| *f != "flattened_bucket") {
        return Err(format!(
            "Unsupported load_format {f:?} for distributed updates (use flattened_bucket or omit it)."
        ));
    }
    Ok(())
}

#[derive(Debug, Default, Deserialize)]
struct InitSendGroupReq {
    master_address: String,
    ports: String,
    group_rank: u32,
    world_size: u32,
    #[serde(default)]
    group_name: Option<String>,
    #[serde(default)]
    backend: Option<String>,
}

fn parse_ports(s: &str) -> Result<Vec<u16>, String> {
    s.split(',').map(|p| p.trim().parse::<u16>().map_err(|e| format!("ports: {p:?} is not a port ({e})"))).collect()
}

/// `/init_weights_send_group_for_remote_instance` (this engine is the seed): one group per TP
/// rank, on `ports[tp_rank]`.
pub async fn init_weights_send_group_for_remote_instance(State(engine): State<AppState>, b: Bytes) -> Response {
    let req: InitSendGroupReq = match body(&b) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let name = req.group_name.unwrap_or_else(|| SEND_GROUP.into());
    let ports = match parse_ports(&req.ports) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    if ports.len() != engine.cfg.tp_size as usize {
        return fail(format!(
            "Got {} ports for a seed with tp_size {}: pass one port per TP rank.",
            ports.len(),
            engine.cfg.tp_size
        ));
    }
    if engine.cfg.dp_size != 1 {
        return fail("The seed instance of a remote-instance load must have a single DP rank.");
    }
    if req.group_rank != 0 || req.world_size != 2 {
        return fail(format!(
            "The seed is group_rank 0 of a world of 2 (seed and new instance); got rank {} of {}.",
            req.group_rank, req.world_size
        ));
    }
    let g = SendGroup {
        master_address: req.master_address,
        ports,
        group_rank: req.group_rank,
        world_size: req.world_size,
        backend: req.backend.unwrap_or_else(|| "nccl".into()),
        sends: 0,
    };
    {
        // SGLang's scheduler joins the group (a barrier with the receiver) in its event loop:
        // one remote-instance call at a time, the scheduler busy meanwhile. The receiver here is
        // the caller, so the join is immediate.
        let _one_at_a_time = engine.send_lock.lock().await;
        let _busy = engine.shared.block();
        engine.weight_sync.set_send_group(&name, g);
    }
    engine.shared.note_output();
    tracing::info!(port = engine.port, group = name, "send group for a remote instance initialized");
    ok(format!("Succeeded to init send group {name}."))
}

#[derive(Debug, Default, Deserialize)]
struct SendWeightsReq {
    master_address: String,
    ports: String,
    #[serde(default)]
    group_name: Option<String>,
}

/// `/send_weights_to_remote_instance`: "broadcasts" every parameter to the new instance. The
/// response carries what was sent (checksum and version) so a simulated new instance can
/// record the seed's weights as its own.
pub async fn send_weights_to_remote_instance(State(engine): State<AppState>, b: Bytes) -> Response {
    let req: SendWeightsReq = match body(&b) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let name = req.group_name.unwrap_or_else(|| SEND_GROUP.into());
    let ports = match parse_ports(&req.ports) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    // One at a time; SGLang broadcasts every parameter from inside the scheduler's event loop
    // (0.5.23 `managers/scheduler.py:6095-6100`,
    // `model_executor/model_runner_components/weight_exporter.py:96-140`), so for the transfer
    // time (the transfer model) the seed makes no step and answers nothing its scheduler must
    // answer (`/server_info`, `/flush_cache`, aborts, the health check's output).
    let sending = engine.send_lock.lock().await;
    let busy = engine.shared.block();
    let recorded = engine.weight_sync.record_send(&name, &req.master_address, &ports);
    if recorded.is_ok() {
        let transfer = engine.cfg.transfer_time();
        if !transfer.is_zero() {
            tokio::time::sleep(transfer).await;
        }
    }
    drop(busy);
    drop(sending);
    engine.shared.note_output();
    match recorded {
        Ok(g) => {
            let w = engine.weights();
            tracing::info!(port = engine.port, group = name, sends = g.sends, "weights sent to a remote instance");
            json_ok(json!({
                "success": true,
                "message": format!("Succeeded to send weights through group {name}."),
                "weights_checksum": w.checksum,
                "weight_version": &*engine.shared.version().name,
            }))
        }
        Err(e) => fail(e),
    }
}

#[cfg(test)]
mod tests {
    use super::tensor_bytes;

    #[test]
    fn a_calls_bytes_are_its_elements_times_their_dtype_size() {
        let dtypes = ["bfloat16", "float32", "int8", "float64"].map(String::from);
        let shapes = vec![vec![1024, 8], vec![3], vec![2, 2, 2], vec![]];
        // 8192 x 2 + 3 x 4 + 8 x 1 + 1 x 8 (a scalar has one element).
        assert_eq!(tensor_bytes(&dtypes, &shapes), 16_384 + 12 + 8 + 8);
        assert_eq!(tensor_bytes(&[], &[]), 0);
    }
}
