//! Scale-out and scale-in operations.
//!
//! Expected flow of a scale-out: the request is checked and recorded under the registry lock
//! (PENDING, engines reserved in CREATING), then a task launches every engine (CREATING),
//! waits until all answer `/health` (HEALTH_CHECKING), checks that all serve the fleet's weight
//! version (WEIGHT_SYNCING), and adds them to routing (READY -> ACTIVE).
//!
//! Expected flow of a scale-in: victims are chosen LIFO among dynamic engines and leave routing
//! at once (DRAINING); the task waits for their in-flight requests up to the drain timeout
//! (skipped with `force`), aborts what is left, stops the processes and releases their GPUs
//! (REMOVING), then COMPLETED.
//!
//! Guarantees: at most one scale operation runs at a time (others get 409 naming it); a target
//! already met is a NOOP with its own GET-able record; a failed or cancelled scale-out leaves no
//! process, GPU or route behind (with the default `rollback_all` policy); initial engines are
//! never scaled in.

use crate::foundation::records::{RunningOp, Trigger};
use crate::ops::manager::{Manager, ReserveError};
use crate::ops::op_error::OpError;
use crate::registry::fleet::FleetInner;
use crate::registry::fleet::ScaleOutRecord;
use rollout_core::ids::{EngineId, OpId};
use rollout_core::{EngineOrigin, EngineStatus, PartialSuccessPolicy, ScaleOutStatus};
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;

/// Body of `POST /rollout/scale_out`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScaleOutRequest {
    #[serde(default = "default_model")]
    #[schema(default = "default")]
    pub model_name: String,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 100000)]
    pub num_replicas: i64,
    #[serde(default)]
    pub engine_urls: Vec<String>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 2592000)]
    pub timeout_secs: Option<f64>,
    /// Who asked: `user` for the API, `autoscaler` for the autoscaler (not part of the body).
    #[serde(skip, default = "user_trigger")]
    pub trigger: Trigger,
}

fn user_trigger() -> Trigger {
    Trigger::User
}

/// Body of `POST /rollout/scale_in`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScaleInRequest {
    #[serde(default = "default_model")]
    #[schema(default = "default")]
    pub model_name: String,
    #[serde(default)]
    #[schema(minimum = 0)]
    pub num_replicas: i64,
    #[serde(default)]
    pub engine_urls: Vec<String>,
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 2592000)]
    pub timeout_secs: Option<f64>,
    #[serde(default)]
    pub dry_run: bool,
}

fn default_model() -> String {
    "default".into()
}

/// What `POST` answers for an accepted (or NOOP) operation.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct Accepted {
    pub request_id: OpId,
    pub status: AcceptedStatus,
    pub message: String,
}

/// How a scale request was taken: it runs (PENDING), or there was nothing to do (NOOP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AcceptedStatus {
    Pending,
    Noop,
}

impl std::fmt::Display for AcceptedStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AcceptedStatus::Pending => "PENDING",
            AcceptedStatus::Noop => "NOOP",
        })
    }
}

fn check_model(manager: &Manager, model_name: &str) -> Result<(), OpError> {
    if model_name != manager.config.model_name {
        return Err(OpError::invalid(
            "unknown_model",
            format!("model_name {model_name:?} is not served here; this fleet serves {:?}", manager.config.model_name),
        ));
    }
    Ok(())
}

/// Longest `timeout_secs` accepted: 30 days.
pub const MAX_TIMEOUT_SECS: f64 = 30.0 * 24.0 * 3600.0;

/// The operation's deadline: `timeout_secs` if given (a positive number of seconds, at most
/// [`MAX_TIMEOUT_SECS`]), else the flag's default. Checked before anything is reserved.
pub fn timeout(requested: Option<f64>, default: f64) -> Result<Duration, OpError> {
    let secs = requested.unwrap_or(default);
    if !(secs.is_finite() && secs > 0.0 && secs <= MAX_TIMEOUT_SECS) {
        return Err(OpError::invalid(
            "invalid_timeout",
            format!("timeout_secs {secs} must be a positive number of seconds, at most {MAX_TIMEOUT_SECS}"),
        ));
    }
    Duration::try_from_secs_f64(secs)
        .map_err(|e| OpError::invalid("invalid_timeout", format!("timeout_secs {secs}: {e}")))
}

/// `num_replicas` as a count: not negative, not beyond `--max-engines`.
pub fn replicas(n: i64, max_engines: u32) -> Result<u32, OpError> {
    if n < 0 {
        return Err(OpError::invalid("invalid_num_replicas", format!("num_replicas {n} must be >= 0")));
    }
    u32::try_from(n).ok().filter(|v| *v <= max_engines).ok_or_else(|| {
        OpError::invalid(
            "above_max_engines",
            format!("num_replicas {n} is above --max-engines {max_engines}; ask for at most {max_engines}"),
        )
    })
}

fn busy(running: &RunningOp) -> OpError {
    OpError::conflict(
        "operation_in_progress",
        format!(
            "a {} operation is in progress (request_id {}); wait for it to finish or cancel it, then retry",
            running.kind, running.request_id
        ),
    )
}

fn new_scale_out_record(id: &OpId, req: &ScaleOutRequest, trigger: Trigger, version: &str) -> ScaleOutRecord {
    let num_replicas = u32::try_from(req.num_replicas.max(0)).unwrap_or(u32::MAX);
    ScaleOutRecord::new(
        id.clone(),
        req.model_name.clone(),
        num_replicas,
        req.engine_urls.clone(),
        trigger,
        version.into(),
    )
}

/// Validates and records a scale-out, then starts it in the background.
pub fn scale_out(manager: &Arc<Manager>, req: ScaleOutRequest) -> Result<Accepted, OpError> {
    check_model(manager, &req.model_name)?;
    let deadline = timeout(req.timeout_secs, manager.config.scale_out_timeout)?;
    let target = replicas(req.num_replicas, manager.config.max_engines)?;
    if target == 0 {
        if req.engine_urls.is_empty() {
            return Err(OpError::invalid(
                "missing_target",
                "give num_replicas > 0 (target engine count) or engine_urls (external engines to attach)",
            ));
        }
        return attach_external(manager, req, deadline);
    }
    let request_id: OpId = uuid::Uuid::new_v4().into();
    let ignored = if req.engine_urls.is_empty() { "" } else { " (engine_urls ignored: num_replicas takes priority)" };
    let (accepted, plan) = manager.fleet.update(|inner| -> Result<_, OpError> {
        if let Some(running) = inner.ops.running() {
            return Err(busy(running));
        }
        let version = inner.weights.current().version.clone();
        let record = new_scale_out_record(&request_id, &req, req.trigger, &version);
        let current = inner.engines.live_count();
        if target <= current {
            let record =
                record.noop(format!("fleet already has {current} engines (target {target}); nothing to do{ignored}"));
            let accepted = Accepted { request_id: request_id.clone(), status: crate::ops::scaling::AcceptedStatus::Noop, message: record.message().clone() };
            crate::foundation::records::checked_op(inner.ops.start_scale_out(record));
            return Ok((accepted, None));
        }
        let needed = (target - current).saturating_mul(manager.config.rollout_num_gpus_per_engine);
        // In Ray mode the cluster's capacity decides: engines wait in PENDING_RESOURCES.
        if !manager.ray() && needed > inner.engines.free_gpus() {
            return Err(OpError::invalid(
                "insufficient_gpus",
                format!(
                    "scaling to {target} engines needs {needed} more GPUs but {} of {} are free; ask for fewer replicas or start the manager with a larger --gpus",
                    inner.engines.free_gpus(),
                    inner.engines.total_gpus()
                ),
            ));
        }
        let ids = reserve(manager, inner, target - current, EngineOrigin::Dynamic, &request_id)
            .map_err(|e| OpError::internal("reserve_failed", e.to_string()))?;
        let adding = format!("scale-out to {target} engines accepted: adding {}{ignored}", ids.len());
        let record = record.adding(ids.clone(), adding);
        let accepted = Accepted { request_id: request_id.clone(), status: crate::ops::scaling::AcceptedStatus::Pending, message: record.message().clone() };
        crate::foundation::records::checked_op(inner.ops.start_scale_out(record));
        Ok((accepted, Some(ids)))
    })?;
    if let Some(ids) = plan {
        spawn_scale_out(manager, request_id, ids, deadline, manager.config.scale_out_partial_success_policy);
    }
    Ok(accepted)
}

/// Checks an external engine URL: http(s), a host, no credentials, no path beyond `/`, no
/// query. Returns it normalised (no trailing slash).
pub fn validate_engine_url(raw: &str) -> Result<String, OpError> {
    let bad = |why: &str| OpError::invalid("invalid_engine_url", format!("engine url {raw:?} {why}"));
    let url = reqwest::Url::parse(raw.trim()).map_err(|e| bad(&format!("is not a URL ({e})")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad("must use http or https"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("must not carry credentials; engines are reached without them"));
    }
    let Some(host) = url.host_str() else { return Err(bad("has no host")) };
    if url.path() != "/" && !url.path().is_empty() {
        return Err(bad("must be the engine's base URL, without a path"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("must not have a query or fragment"));
    }
    let port = url.port_or_known_default().unwrap_or(80);
    // `host_str` writes IPv6 addresses in brackets already.
    Ok(format!("{}://{host}:{port}", url.scheme()))
}

/// With `--external-allow-cidr`, every external engine URL must point into an allowed network:
/// an IP literal directly, a host name through every address it resolves to now (within 5 s).
/// The engine is contacted later by name again, so a name whose records change after this
/// check (DNS rebinding) is not covered; allow-list IP literals where that matters.
pub async fn check_external_allowed(manager: &Manager, raw_urls: &[String]) -> Result<(), OpError> {
    let allowed = manager.config.external_allow_list().map_err(|e| OpError::internal("config", e.to_string()))?;
    if allowed.is_empty() {
        return Ok(());
    }
    let shown: Vec<String> = allowed.iter().map(ToString::to_string).collect();
    for raw in raw_urls {
        let url = validate_engine_url(raw)?;
        let parsed = reqwest::Url::parse(&url).map_err(|e| OpError::invalid("invalid_engine_url", e.to_string()))?;
        let port = parsed.port_or_known_default().unwrap_or(80);
        let host = parsed.host_str().unwrap_or("");
        let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>();
        let addrs: Vec<std::net::IpAddr> = match literal {
            Ok(ip) => vec![ip],
            Err(_) => {
                let lookup = tokio::net::lookup_host((host, port));
                match tokio::time::timeout(Duration::from_secs(5), lookup).await {
                    Ok(Ok(found)) => found.map(|a| a.ip()).collect(),
                    Ok(Err(e)) => {
                        return Err(OpError::invalid(
                            "invalid_engine_url",
                            format!("engine url {raw:?}: cannot resolve {host:?} ({e}) to check it against --external-allow-cidr"),
                        ))
                    }
                    Err(_) => {
                        return Err(OpError::invalid(
                            "invalid_engine_url",
                            format!("engine url {raw:?}: resolving {host:?} took over 5 s"),
                        ))
                    }
                }
            }
        };
        let outside: Vec<String> =
            addrs.iter().filter(|ip| !allowed.iter().any(|net| net.contains(**ip))).map(ToString::to_string).collect();
        if addrs.is_empty() || !outside.is_empty() {
            return Err(OpError::invalid(
                "engine_url_not_allowed",
                format!(
                    "engine url {raw:?} points to {} outside the networks of --external-allow-cidr ({}); attach engines \
                     inside them, or ask the operator to allow the network",
                    if outside.is_empty() { "no address".to_string() } else { outside.join(", ") },
                    shown.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// External mode: attach engines someone else started. URLs already in the fleet (or being
/// attached) are filtered out; if none is left the request is a NOOP.
fn attach_external(manager: &Arc<Manager>, req: ScaleOutRequest, deadline: Duration) -> Result<Accepted, OpError> {
    let mut urls: Vec<String> = Vec::new();
    for raw in &req.engine_urls {
        let url = validate_engine_url(raw)?;
        if !urls.contains(&url) {
            urls.push(url);
        }
    }
    let request_id: OpId = uuid::Uuid::new_v4().into();
    let (accepted, ids) = manager.fleet.update(|inner| -> Result<_, OpError> {
        if let Some(running) = inner.ops.running() {
            return Err(busy(running));
        }
        let version = inner.weights.current().version.clone();
        let record = new_scale_out_record(&request_id, &req, req.trigger, &version);
        let known: Vec<&str> = inner
            .engines
            .values()
            .filter(|e| {
                !matches!(e.status(), rollout_core::EngineStatus::Removing | rollout_core::EngineStatus::Removed)
            })
            .map(|e| e.record().url().as_str())
            .collect();
        let fresh: Vec<String> = urls.iter().filter(|u| !known.contains(&u.as_str())).cloned().collect();
        let skipped = urls.len() - fresh.len();
        if fresh.is_empty() {
            let record = record.noop(format!("all {} engine urls are already in the fleet; nothing to do", urls.len()));
            let accepted = Accepted {
                request_id: request_id.clone(),
                status: crate::ops::scaling::AcceptedStatus::Noop,
                message: record.message().clone(),
            };
            crate::foundation::records::checked_op(inner.ops.start_scale_out(record));
            return Ok((accepted, None));
        }
        let max = manager.config.max_engines;
        if inner.engines.live_count() + fresh.len() as u32 > max {
            return Err(OpError::invalid(
                "above_max_engines",
                format!(
                    "attaching {} engines would exceed --max-engines {max} (the fleet has {})",
                    fresh.len(),
                    inner.engines.live_count()
                ),
            ));
        }
        let ids: Vec<EngineId> = fresh.iter().map(|u| manager.reserve_external(inner, u, &request_id)).collect();
        let adding = format!(
            "attaching {} external engines{}",
            ids.len(),
            if skipped > 0 { format!(" ({skipped} already in the fleet, skipped)") } else { String::new() }
        );
        let record = record.adding(ids.clone(), adding);
        let accepted = Accepted {
            request_id: request_id.clone(),
            status: crate::ops::scaling::AcceptedStatus::Pending,
            message: record.message().clone(),
        };
        crate::foundation::records::checked_op(inner.ops.start_scale_out(record));
        Ok((accepted, Some(ids)))
    })?;
    if let Some(ids) = ids {
        spawn_scale_out(manager, request_id, ids, deadline, manager.config.scale_out_partial_success_policy);
    }
    Ok(accepted)
}

/// Reserves `n` engines; on a failure part-way, releases what it reserved.
fn reserve(
    manager: &Manager,
    inner: &mut FleetInner,
    n: u32,
    origin: EngineOrigin,
    op: &OpId,
) -> Result<Vec<EngineId>, ReserveError> {
    let mut ids = Vec::new();
    for _ in 0..n {
        match manager.reserve_engine(inner, origin, op) {
            Ok(id) => ids.push(id),
            Err(e) => {
                for id in &ids {
                    inner.engines.forget(id);
                    inner.placements.remove(id);
                }
                return Err(e);
            }
        }
    }
    Ok(ids)
}

/// Starts the boot-time bring-up of the initial engines, as a scale-out with trigger `initial`.
/// Why the initial engines cannot be started.
#[derive(Debug, thiserror::Error)]
pub enum InitialError {
    #[error("{} {} is already running", .0.kind, .0.request_id)]
    Busy(RunningOp),
    #[error(transparent)]
    Reserve(#[from] ReserveError),
}

pub fn start_initial(manager: &Arc<Manager>) -> Result<Option<OpId>, InitialError> {
    let n = manager.config.initial_engines();
    if n == 0 {
        return Ok(None);
    }
    let request_id: OpId = uuid::Uuid::new_v4().into();
    let req = ScaleOutRequest {
        model_name: manager.config.model_name.clone(),
        num_replicas: i64::from(n),
        engine_urls: vec![],
        timeout_secs: None,
        trigger: Trigger::Initial,
    };
    let ids = manager.fleet.update(|inner| -> Result<_, InitialError> {
        let version = inner.weights.current().version.clone();
        let record = new_scale_out_record(&request_id, &req, Trigger::Initial, &version);
        if let Some(held) = inner.ops.running() {
            return Err(InitialError::Busy(held.clone()));
        }
        let ids = reserve(manager, inner, n, EngineOrigin::Initial, &request_id)?;
        let record = record.adding(ids.clone(), format!("initial fleet of {n} engines"));
        crate::foundation::records::checked_op(inner.ops.start_scale_out(record));
        Ok(ids)
    })?;
    let timeout = Duration::from_secs_f64(manager.config.scale_out_timeout);
    // Initial engines that fail stay listed as FAILED rather than disappearing.
    spawn_scale_out(manager, request_id.clone(), ids, timeout, PartialSuccessPolicy::KeepPartial);
    Ok(Some(request_id))
}

fn spawn_scale_out(
    manager: &Arc<Manager>,
    request_id: OpId,
    ids: Vec<EngineId>,
    timeout: Duration,
    policy: PartialSuccessPolicy,
) {
    let cancel = manager.fleet.lock().ops.cancel_token(&request_id).unwrap_or_default();
    let m = manager.clone();
    manager.tasks.spawn(async move {
        let _guard = OpGuard { manager: m.clone(), kind: "scale_out", request_id: request_id.clone() };
        crate::ops::scale_out::run(&m, &request_id, ids, timeout, policy, cancel).await;
    });
}

/// Ends an operation its task left unfinished (a bug that panicked), in one registry update:
/// the operation FAILED, the one-operation lock freed, and the engines it had not activated
/// moved to REMOVING (out of routing, on their way out), so one failure never wedges the fleet
/// and the operation never reads ended while its engines look alive. Their processes are then
/// stopped by a task of the manager's tracker (shutdown waits for it). A no-op when the
/// operation finished normally.
pub struct OpGuard {
    pub manager: Arc<Manager>,
    pub kind: &'static str,
    pub request_id: OpId,
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        let id = self.request_id.clone();
        let leftovers = self.manager.fleet.update(|inner| {
            let why = "internal error: the operation stopped unexpectedly; see the manager's log";
            let engines: Vec<EngineId> = inner
                .ops
                .abandon(&id, why)?
                .into_iter()
                .filter(|e| inner.engines.get(e).is_some_and(|en| en.status() != EngineStatus::Active))
                .collect();
            for e in &engines {
                if let Err(err) = inner.engines.event(e, rollout_core::EngineEvent::Remove) {
                    tracing::debug!(engine_id = %e, error = %err, "already on its way out");
                }
            }
            Some(engines)
        });
        // The operation had ended (its lock, if still held under its id, was freed above).
        let Some(leftovers) = leftovers else { return };
        tracing::error!(kind = self.kind, request_id = %id, "operation task ended unexpectedly; cleaning up");
        if leftovers.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let m = self.manager.clone();
        self.manager.tasks.spawn(async move {
            for e in leftovers {
                m.remove_engine(&e).await;
            }
        });
    }
}

/// The answer for a scale-out id nobody knows (or a text that cannot be one).
pub fn unknown_scale_out(request_id: &str) -> OpError {
    OpError::unknown("unknown_request", format!("no scale-out request with id {request_id}"))
}

/// Cancels a running scale-out. Its task rolls back what it created.
pub fn cancel_scale_out(manager: &Manager, request_id: &OpId) -> Result<ScaleOutRecord, OpError> {
    let record =
        manager.fleet.lock().ops.scale_out(request_id).cloned().ok_or_else(|| unknown_scale_out(request_id))?;
    if record.status().is_terminal() {
        return Err(OpError::conflict(
            "already_finished",
            format!("scale-out {request_id} already finished with status {}; nothing to cancel", record.status()),
        ));
    }
    if record.trigger() == Trigger::Initial {
        return Err(OpError::conflict(
            "initial_bring_up",
            format!("{request_id} starts the initial engines, which the fleet needs; it cannot be cancelled"),
        ));
    }
    if !manager.fleet.lock().ops.cancel(request_id) {
        return Err(OpError::conflict(
            "already_finished",
            format!("scale-out {request_id} is finishing; nothing to cancel"),
        ));
    }
    Ok(record)
}

/// Body of `POST /rollout/scale_out_cancel`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchCancelRequest {
    /// Only cancel requests in this status (e.g. `PENDING`); default: every non-terminal one.
    #[serde(default)]
    pub status_filter: Option<String>,
    #[serde(default)]
    pub model_name: Option<String>,
    /// Answer what would be cancelled, cancel nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// Cancels every running scale-out that matches the filter (none with `dry_run`). The request
/// ids of those cancelled (or that would be).
pub fn cancel_many(manager: &Manager, req: &BatchCancelRequest) -> Result<Vec<OpId>, OpError> {
    let filter = match req.status_filter.as_deref() {
        None => None,
        Some(raw) => {
            let status: ScaleOutStatus = serde_json::from_value(serde_json::Value::String(raw.to_ascii_uppercase()))
                .map_err(|_| {
                    OpError::invalid(
                        "invalid_status_filter",
                        format!(
                            "status_filter {raw:?} is not a scale-out status (e.g. PENDING, CREATING, HEALTH_CHECKING)"
                        ),
                    )
                })?;
            if status.is_terminal() {
                return Err(OpError::invalid(
                    "invalid_status_filter",
                    format!("status_filter {raw:?} is a terminal status; nothing in it can be cancelled"),
                ));
            }
            Some(status)
        }
    };
    let ids: Vec<OpId> = manager
        .fleet
        .lock()
        .ops
        .scale_outs()
        .filter(|r| !r.status().is_terminal() && r.trigger() != Trigger::Initial)
        .filter(|r| filter.is_none_or(|f| r.status() == f))
        .filter(|r| req.model_name.as_deref().is_none_or(|m| r.model_name() == m))
        .map(|r| r.request_id().clone())
        .collect();
    // A dry run names what a cancel would take; a cancel takes what still runs.
    let inner = manager.fleet.lock();
    Ok(ids.into_iter().filter(|id| req.dry_run || inner.ops.cancel(id)).collect())
}

#[cfg(test)]
mod tests {
    use super::validate_engine_url;

    #[test]
    fn engine_urls_are_normalised_or_refused() {
        assert_eq!(validate_engine_url("http://127.0.0.1:30000/").unwrap(), "http://127.0.0.1:30000");
        assert_eq!(validate_engine_url("https://e.example").unwrap(), "https://e.example:443");
        assert_eq!(validate_engine_url("http://[::1]:9").unwrap(), "http://[::1]:9");
        assert_eq!(validate_engine_url("http://[::ffff:127.0.0.1]:9").unwrap(), "http://[::ffff:7f00:1]:9");
        for bad in ["ftp://h:1", "http://u:p@h:1", "http://h:1/generate", "http://h:1/?a=1", "http://h:1/#f", "h:1", ""]
        {
            assert_eq!(validate_engine_url(bad).unwrap_err().code(), "invalid_engine_url", "{bad}");
        }
    }
}
