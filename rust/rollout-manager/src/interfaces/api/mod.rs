//! The control API: `/rollout/*` on the control port. Every error is JSON
//! `{"error": {"code", "message"}}` (see [`crate::foundation::error`]).

pub mod placements;
pub mod weights;

use crate::foundation::error::{ApiError, ErrorBody};
use crate::ops::manager::Manager;
use crate::ops::scale_in::{self, ScaleInAnswer};
use crate::ops::scaling::{self, Accepted, ScaleInRequest, ScaleOutRequest};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

#[derive(Clone)]
pub struct ApiState {
    pub manager: Arc<Manager>,
    /// The data plane's counters, served on the control port's `/metrics` too.
    pub router_metrics: Arc<crate::adapters::router::metrics::RouterMetrics>,
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/rollout/prometheus/targets", get(prometheus_targets))
        .route("/rollout/engines", get(engines))
        .route("/rollout/engines/{id}", get(get_engine))
        .route("/rollout/scale_out", post(scale_out).get(list_scale_outs))
        .route("/rollout/scale_out/{id}", get(get_scale_out))
        .route("/rollout/scale_out/{id}/cancel", post(cancel_scale_out))
        .route("/rollout/scale_out_cancel", post(cancel_many))
        .route("/rollout/scale_in", post(scale_in).get(list_scale_ins))
        .route("/rollout/scale_in/{id}", get(get_scale_in))
        .merge(weights::routes())
        .merge(placements::routes())
        .fallback(|| async {
            ApiError::not_found("no_such_route", "no such route; see docs/api.md for the control API")
        })
        .with_state(state)
}

/// A known route asked with a method it does not take: 405 with the usual JSON error (the
/// `allow` header lists the methods it takes).
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        code: "method_not_allowed",
        message: format!(
            "{} does not take {method}; the allow header lists the methods it takes (docs/api.md)",
            uri.path()
        ),
    }
}

/// The control API's body limit (axum's default, which its handlers apply too).
pub const BODY_LIMIT: usize = 2 * 1024 * 1024;

/// Parses a JSON body strictly: unknown fields and wrong types are 400 with serde's message,
/// which names the field; the body must be a JSON object (serde would also fill a struct from
/// an array, by position); a body over the 2 MB limit is 413. An empty body means `{}`. The
/// content type is not checked, so `curl -d '{...}'` (which sends form encoding) works as
/// people expect.
pub(crate) fn parse_body<T: DeserializeOwned>(body: &Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return Err(ApiError::TooLarge { code: "body_too_large", message: format!("{e}; the limit is 2 MB") })
        }
        Err(e) => return Err(ApiError::bad_request("invalid_body", e.to_string())),
    };
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) { b"{}" } else { body };
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad_request(
            "invalid_body",
            "the request body must be a JSON object, e.g. {\"num_replicas\": 4}",
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("invalid_body", format!("invalid request body: {e}")))
}

/// `GET /rollout/engines`, serialised straight from the records: building a `serde_json::Value`
/// tree first cost more than the serialisation itself with a thousand engines.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = EnginesView)]
pub(crate) struct EnginesAnswer {
    /// The served model's engines (one model per manager).
    models: std::collections::BTreeMap<String, ModelEngines>,
    total_engines: usize,
}

/// One model's engines and the fleet's weight version.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ModelEngines {
    engines: Vec<crate::registry::fleet::EngineRecord>,
    weight_version: String,
    weights_checksum: Option<String>,
}

/// `{"status": "ok"}`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct Status {
    status: &'static str,
}

/// The manager answers.
#[utoipa::path(get, path = "/health", operation_id = "health",
    responses((status = 200, description = "The manager is up", body = Status)))]
pub(crate) async fn health() -> Json<Status> {
    Json(Status { status: "ok" })
}

/// Every engine of the fleet with its status, health, weight version and load.
#[utoipa::path(get, path = "/rollout/engines", operation_id = "listEngines",
    responses((status = 200, description = "The fleet", body = EnginesAnswer)))]
pub(crate) async fn engines(State(s): State<ApiState>) -> Json<EnginesAnswer> {
    let engines = s.manager.fleet.engine_records();
    let total_engines = engines.len();
    let (weight_version, weights_checksum) = {
        let inner = s.manager.fleet.lock();
        (inner.weights.current().version.clone(), inner.weights.current().checksum.clone())
    };
    let model = s.manager.config.model_name.clone();
    Json(EnginesAnswer {
        models: [(model, ModelEngines { engines, weight_version, weights_checksum })].into(),
        total_engines,
    })
}

/// Prometheus HTTP service discovery (`http_sd_configs`), one target group per engine.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct PrometheusTargets(Vec<TargetGroup>);

/// One engine as a Prometheus target.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct TargetGroup {
    /// `host:port` of the engine.
    #[schema(min_items = 1, max_items = 1)]
    targets: Vec<String>,
    labels: TargetLabels,
}

/// The target's labels: `engine_id` is kept on every series; the `__meta_rollout_*` ones are
/// for relabelling.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct TargetLabels {
    engine_id: rollout_core::ids::EngineId,
    #[serde(rename = "__meta_rollout_model_name")]
    model_name: String,
    #[serde(rename = "__meta_rollout_status")]
    status: rollout_core::EngineStatus,
    #[serde(rename = "__meta_rollout_origin")]
    origin: rollout_core::EngineOrigin,
    /// The engine's URL scheme, when it is not `http`.
    #[serde(rename = "__scheme__", skip_serializing_if = "Option::is_none")]
    scheme: Option<String>,
}

/// Prometheus HTTP service discovery: one target group per engine whose process is up.
///
/// Prometheus then scrapes each engine's own `/metrics` (SGLang's `sglang:*`) and follows the
/// fleet as it grows and shrinks. Label: `engine_id` (SGLang's series carry `model_name`
/// themselves); the model name, status and origin as `__meta_rollout_*` for relabelling.
#[utoipa::path(get, path = "/rollout/prometheus/targets", operation_id = "prometheusTargets",
    responses((status = 200, description = "The target groups (http_sd_configs)", body = PrometheusTargets)))]
pub(crate) async fn prometheus_targets(State(s): State<ApiState>) -> Json<PrometheusTargets> {
    use rollout_core::EngineStatus as S;
    let groups = s
        .manager
        .fleet
        .engine_records()
        .into_iter()
        .filter(|e| {
            matches!(
                e.status(),
                S::HealthChecking | S::WeightSyncing | S::Ready | S::Active | S::Unhealthy | S::Draining
            )
        })
        .filter_map(|e| {
            let url = reqwest::Url::parse(e.url()).ok()?;
            let target = format!("{}:{}", url.host_str()?, url.port_or_known_default()?);
            let labels = TargetLabels {
                engine_id: e.engine_id().clone(),
                model_name: e.model_name().clone(),
                status: e.status(),
                origin: e.origin(),
                scheme: (url.scheme() != "http").then(|| url.scheme().to_string()),
            };
            Some(TargetGroup { targets: vec![target], labels })
        })
        .collect();
    Json(PrometheusTargets(groups))
}

/// One engine.
#[utoipa::path(get, path = "/rollout/engines/{id}", operation_id = "getEngine",
    params(("id" = String, Path, description = "the engine's id")),
    responses((status = 200, description = "The engine", body = crate::registry::fleet::EngineRecord),
              (status = 404, description = "No such engine", body = ErrorBody)))]
pub(crate) async fn get_engine(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<crate::registry::fleet::EngineRecord>, ApiError> {
    let record = s.manager.fleet.engine_records().into_iter().find(|e| *e.engine_id() == id).ok_or_else(|| {
        ApiError::not_found("unknown_engine", format!("no engine with id {id}; list them with GET /rollout/engines"))
    })?;
    Ok(Json(record))
}

/// Add engines: to `num_replicas` in all, or attach the engines at `engine_urls`.
///
/// Answers at once with the operation's id; follow it with `GET /rollout/scale_out/{id}`.
#[utoipa::path(post, path = "/rollout/scale_out", operation_id = "scaleOut", request_body = ScaleOutRequest,
    responses((status = 200, description = "Accepted (PENDING) or nothing to do (NOOP)", body = Accepted),
              (status = 400, description = "Bad body or target", body = ErrorBody),
              (status = 409, description = "Another operation runs", body = ErrorBody),
              (status = 500, description = "The GPUs could not be reserved", body = ErrorBody)))]
pub(crate) async fn scale_out(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Accepted>, ApiError> {
    let req: ScaleOutRequest = parse_body(&body)?;
    if req.num_replicas <= 0 {
        scaling::check_external_allowed(&s.manager, &req.engine_urls).await?;
    }
    Ok(Json(scaling::scale_out(&s.manager, req)?))
}

/// Remove engines: down to `num_replicas` in all, or the engines at `engine_urls`.
///
/// Draining engines finish their requests first (up to the drain timeout) unless `force`;
/// `dry_run` answers which engines would go and removes nothing.
#[utoipa::path(post, path = "/rollout/scale_in", operation_id = "scaleIn", request_body = ScaleInRequest,
    responses((status = 200, description = "Accepted, nothing to do (NOOP), or the dry run's answer", body = ScaleInAnswer),
              (status = 400, description = "Bad body or target", body = ErrorBody),
              (status = 409, description = "Another operation runs", body = ErrorBody)))]
pub(crate) async fn scale_in(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<ScaleInAnswer>, ApiError> {
    let req: ScaleInRequest = parse_body(&body)?;
    Ok(Json(scale_in::scale_in(&s.manager, req)?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListFilter {
    /// Only operations in this status (any case).
    status: Option<String>,
    /// Only operations on this model.
    model_name: Option<String>,
}

impl ListFilter {
    /// Whether `?model_name=` (if given) is `model_name`.
    fn wants(&self, model_name: &str) -> bool {
        self.model_name.as_deref().is_none_or(|m| m == model_name)
    }
}

/// Parses a `?status=` filter into the operation's status type; unknown names are 400.
pub(crate) fn status_filter<S: DeserializeOwned>(raw: Option<&str>) -> Result<Option<S>, ApiError> {
    raw.map(|st| {
        serde_json::from_value(Value::String(st.to_ascii_uppercase())).map_err(|_| {
            ApiError::bad_request(
                "invalid_status_filter",
                format!("status {st:?} is not a status of this operation kind"),
            )
        })
    })
    .transpose()
}

/// Scale-outs the manager remembers, oldest first.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ScaleOutList {
    requests: Vec<crate::registry::fleet::ScaleOutRecord>,
    total: usize,
}

/// Scale-ins the manager remembers, oldest first.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ScaleInList {
    requests: Vec<crate::registry::fleet::ScaleInRecord>,
    total: usize,
}

/// Scale-outs, oldest first.
#[utoipa::path(get, path = "/rollout/scale_out", operation_id = "listScaleOuts", params(ListFilter),
    responses((status = 200, description = "The scale-outs", body = ScaleOutList),
              (status = 400, description = "Unknown status", body = ErrorBody)))]
pub(crate) async fn list_scale_outs(
    State(s): State<ApiState>,
    Query(f): Query<ListFilter>,
) -> Result<Json<ScaleOutList>, ApiError> {
    let wanted: Option<rollout_core::ScaleOutStatus> = status_filter(f.status.as_deref())?;
    let inner = s.manager.fleet.lock();
    let keep =
        |r: &crate::registry::fleet::ScaleOutRecord| wanted.is_none_or(|w| r.status() == w) && f.wants(r.model_name());
    let requests = oldest_first(inner.ops.scale_outs().filter(|r| keep(r)), |r| r.created_at());
    Ok(Json(ScaleOutList { total: requests.len(), requests }))
}

/// Scale-ins, oldest first.
#[utoipa::path(get, path = "/rollout/scale_in", operation_id = "listScaleIns", params(ListFilter),
    responses((status = 200, description = "The scale-ins", body = ScaleInList),
              (status = 400, description = "Unknown status", body = ErrorBody)))]
pub(crate) async fn list_scale_ins(
    State(s): State<ApiState>,
    Query(f): Query<ListFilter>,
) -> Result<Json<ScaleInList>, ApiError> {
    let wanted: Option<rollout_core::ScaleInStatus> = status_filter(f.status.as_deref())?;
    let inner = s.manager.fleet.lock();
    let keep =
        |r: &crate::registry::fleet::ScaleInRecord| wanted.is_none_or(|w| r.status() == w) && f.wants(r.model_name());
    let requests = oldest_first(inner.ops.scale_ins().filter(|r| keep(r)), |r| r.created_at());
    Ok(Json(ScaleInList { total: requests.len(), requests }))
}

/// The records, oldest first.
fn oldest_first<'a, R: Clone + 'a>(records: impl Iterator<Item = &'a R>, created_at: fn(&R) -> f64) -> Vec<R> {
    let mut requests: Vec<R> = records.cloned().collect();
    requests.sort_by(|a, b| created_at(a).total_cmp(&created_at(b)));
    requests
}

/// A scale-out and how far each of its engines got.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ScaleOutProgress {
    #[serde(flatten)]
    record: crate::registry::fleet::ScaleOutRecord,
    engines: Vec<EngineProgress>,
}

/// One engine of a scale-out.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct EngineProgress {
    engine_id: rollout_core::ids::EngineId,
    /// The engine's status, or `REMOVED` once it left the fleet.
    status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    is_healthy: Option<bool>,
    /// What the engine waits for, when its status does not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<Option<String>>,
}

/// One scale-out, with each engine's progress.
#[utoipa::path(get, path = "/rollout/scale_out/{id}", operation_id = "getScaleOut",
    params(("id" = String, Path, description = "the scale-out's request_id")),
    responses((status = 200, description = "The scale-out", body = ScaleOutProgress),
              (status = 404, description = "No such scale-out", body = ErrorBody)))]
pub(crate) async fn get_scale_out(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<ScaleOutProgress>, ApiError> {
    let inner = s.manager.fleet.lock();
    let record = inner.ops.scale_out(&id).ok_or_else(|| {
        ApiError::not_found(
            "unknown_request",
            format!("no scale-out request with id {id}; list them with GET /rollout/scale_out"),
        )
    })?;
    // Per-engine progress, for engines still in the fleet.
    let engines = record
        .engine_ids()
        .iter()
        .map(|eid| match inner.engines.get(eid) {
            Some(e) => EngineProgress {
                engine_id: eid.clone(),
                status: e.status().to_string(),
                url: Some(e.record().url().clone()),
                is_healthy: Some(e.record().is_healthy()),
                detail: Some(e.record().detail().clone()),
            },
            None => EngineProgress {
                engine_id: eid.clone(),
                status: "REMOVED".into(),
                url: None,
                is_healthy: None,
                detail: None,
            },
        })
        .collect();
    Ok(Json(ScaleOutProgress { record: record.clone(), engines }))
}

/// One scale-in.
#[utoipa::path(get, path = "/rollout/scale_in/{id}", operation_id = "getScaleIn",
    params(("id" = String, Path, description = "the scale-in's request_id")),
    responses((status = 200, description = "The scale-in", body = crate::registry::fleet::ScaleInRecord),
              (status = 404, description = "No such scale-in", body = ErrorBody)))]
pub(crate) async fn get_scale_in(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<crate::registry::fleet::ScaleInRecord>, ApiError> {
    let inner = s.manager.fleet.lock();
    let record = inner.ops.scale_in(&id).ok_or_else(|| {
        ApiError::not_found(
            "unknown_request",
            format!("no scale-in request with id {id}; list them with GET /rollout/scale_in"),
        )
    })?;
    Ok(Json(record.clone()))
}

/// Cancel a running scale-out: the engines it created are stopped.
#[utoipa::path(post, path = "/rollout/scale_out/{id}/cancel", operation_id = "cancelScaleOut",
    params(("id" = String, Path, description = "the scale-out's request_id")),
    responses((status = 200, description = "Cancellation requested", body = crate::registry::fleet::ScaleOutRecord),
              (status = 404, description = "No such scale-out", body = ErrorBody),
              (status = 409, description = "The scale-out already ended", body = ErrorBody)))]
pub(crate) async fn cancel_scale_out(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<crate::registry::fleet::ScaleOutRecord>, ApiError> {
    let id = rollout_core::ids::OpId::parse(&id).map_err(|_| scaling::unknown_scale_out(&id))?;
    let record = scaling::cancel_scale_out(&s.manager, &id)?;
    Ok(Json(record.answering("cancellation requested; created engines are being stopped")))
}

/// What `POST /rollout/scale_out_cancel` cancelled (or would, for a dry run).
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct BatchCancelResult {
    dry_run: bool,
    /// The scale-outs' request ids.
    cancelled: Vec<rollout_core::ids::OpId>,
    total: usize,
}

/// Cancel every running scale-out (or those in `status_filter`).
#[utoipa::path(post, path = "/rollout/scale_out_cancel", operation_id = "cancelScaleOuts",
    request_body = scaling::BatchCancelRequest,
    responses((status = 200, description = "The scale-outs cancelled", body = BatchCancelResult),
              (status = 400, description = "Bad body or status", body = ErrorBody)))]
pub(crate) async fn cancel_many(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<BatchCancelResult>, ApiError> {
    let req: scaling::BatchCancelRequest = parse_body(&body)?;
    let cancelled = scaling::cancel_many(&s.manager, &req)?;
    Ok(Json(BatchCancelResult { dry_run: req.dry_run, total: cancelled.len(), cancelled }))
}

/// The manager's Prometheus metrics: the process, the fleet, the router and each routable
/// engine's load (the same text on the router port's `/metrics`).
async fn metrics(State(s): State<ApiState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let text = crate::adapters::router::metrics::render(&s.manager.fleet, &s.router_metrics);
    ([("content-type", crate::foundation::telemetry::CONTENT_TYPE)], text).into_response()
}

/// A use case's refusal as HTTP: invalid 400, unknown 404, conflict 409, internal 500.
impl From<crate::ops::op_error::OpError> for ApiError {
    fn from(e: crate::ops::op_error::OpError) -> Self {
        use crate::ops::op_error::OpError as O;
        match e {
            O::Invalid { code, message } => Self::BadRequest { code, message },
            O::Unknown { code, message } => Self::NotFound { code, message },
            O::Conflict { code, message } => Self::Conflict { code, message },
            O::Internal { code, message } => Self::Internal { code, message },
        }
    }
}
