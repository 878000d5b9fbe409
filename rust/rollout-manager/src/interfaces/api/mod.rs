//! The control API: `/rollout/*` on the control port. Every error is JSON
//! `{"error": {"code", "message"}}` (see [`crate::foundation::error`]).

pub mod placements;
pub mod weights;

use crate::foundation::error::ApiError;
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
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Clone)]
pub struct ApiState {
    pub manager: Arc<Manager>,
    /// The data plane's counters, served on the control port's `/metrics` too.
    pub router_metrics: Arc<crate::adapters::router::metrics::RouterMetrics>,
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/openapi.json", get(openapi))
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
#[derive(serde::Serialize)]
struct EnginesAnswer {
    models: std::collections::BTreeMap<String, ModelEngines>,
    total_engines: usize,
}

#[derive(serde::Serialize)]
struct ModelEngines {
    engines: Vec<crate::registry::fleet::EngineRecord>,
    weight_version: String,
    weights_checksum: Option<String>,
}

async fn engines(State(s): State<ApiState>) -> Json<EnginesAnswer> {
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

/// Prometheus HTTP service discovery (`http_sd_configs`): one target group per engine whose
/// process is up, so Prometheus scrapes each engine's own `/metrics` (SGLang's `sglang:*`) and
/// follows the fleet as it grows and shrinks. Label: `engine_id` (SGLang's series carry
/// `model_name` themselves); the model name, status and origin as `__meta_rollout_*` for
/// relabelling.
async fn prometheus_targets(State(s): State<ApiState>) -> Json<Value> {
    use rollout_core::EngineStatus as S;
    let groups: Vec<Value> = s
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
            let origin = serde_json::to_value(e.origin()).ok()?;
            let mut labels = json!({
                "engine_id": e.engine_id(),
                "__meta_rollout_model_name": e.model_name(),
                "__meta_rollout_status": e.status().to_string(),
                "__meta_rollout_origin": origin,
            });
            if url.scheme() != "http" {
                labels["__scheme__"] = json!(url.scheme());
            }
            Some(json!({"targets": [target], "labels": labels}))
        })
        .collect();
    Json(Value::Array(groups))
}

async fn get_engine(State(s): State<ApiState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let record = s.manager.fleet.engine_records().into_iter().find(|e| *e.engine_id() == id).ok_or_else(|| {
        ApiError::not_found("unknown_engine", format!("no engine with id {id}; list them with GET /rollout/engines"))
    })?;
    serde_json::to_value(record).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}

async fn scale_out(State(s): State<ApiState>, body: Result<Bytes, BytesRejection>) -> Result<Json<Accepted>, ApiError> {
    let req: ScaleOutRequest = parse_body(&body)?;
    if req.num_replicas <= 0 {
        scaling::check_external_allowed(&s.manager, &req.engine_urls).await?;
    }
    Ok(Json(scaling::scale_out(&s.manager, req)?))
}

async fn scale_in(
    State(s): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<ScaleInAnswer>, ApiError> {
    let req: ScaleInRequest = parse_body(&body)?;
    Ok(Json(scale_in::scale_in(&s.manager, req)?))
}

#[derive(Deserialize)]
struct ListFilter {
    status: Option<String>,
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

async fn list_scale_outs(State(s): State<ApiState>, Query(f): Query<ListFilter>) -> Result<Json<Value>, ApiError> {
    let wanted: Option<rollout_core::ScaleOutStatus> = status_filter(f.status.as_deref())?;
    let inner = s.manager.fleet.lock();
    let keep =
        |r: &crate::registry::fleet::ScaleOutRecord| wanted.is_none_or(|w| r.status() == w) && f.wants(r.model_name());
    Ok(Json(listing(inner.ops.scale_outs().filter(|r| keep(r)), |r| r.created_at())))
}

async fn list_scale_ins(State(s): State<ApiState>, Query(f): Query<ListFilter>) -> Result<Json<Value>, ApiError> {
    let wanted: Option<rollout_core::ScaleInStatus> = status_filter(f.status.as_deref())?;
    let inner = s.manager.fleet.lock();
    let keep =
        |r: &crate::registry::fleet::ScaleInRecord| wanted.is_none_or(|w| r.status() == w) && f.wants(r.model_name());
    Ok(Json(listing(inner.ops.scale_ins().filter(|r| keep(r)), |r| r.created_at())))
}

/// `{"requests": [...], "total": n}`, oldest first.
fn listing<'a, R: Clone + serde::Serialize + 'a>(
    records: impl Iterator<Item = &'a R>,
    created_at: fn(&R) -> f64,
) -> Value {
    let mut requests: Vec<R> = records.cloned().collect();
    requests.sort_by(|a, b| created_at(a).total_cmp(&created_at(b)));
    json!({ "requests": requests, "total": requests.len() })
}

async fn get_scale_out(State(s): State<ApiState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let inner = s.manager.fleet.lock();
    let record = inner.ops.scale_out(&id).ok_or_else(|| {
        ApiError::not_found(
            "unknown_request",
            format!("no scale-out request with id {id}; list them with GET /rollout/scale_out"),
        )
    })?;
    let mut value = serde_json::to_value(record).map_err(|e| ApiError::internal("serialize", e.to_string()))?;
    // Per-engine progress, for engines still in the fleet.
    let engines: Vec<Value> = record
        .engine_ids()
        .iter()
        .map(|eid| match inner.engines.get(eid) {
            Some(e) => json!({"engine_id": eid, "url": e.record().url(), "status": e.status(), "is_healthy": e.record().is_healthy(), "detail": e.record().detail()}),
            None => json!({"engine_id": eid, "status": "REMOVED"}),
        })
        .collect();
    value["engines"] = Value::Array(engines);
    Ok(Json(value))
}

async fn get_scale_in(State(s): State<ApiState>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let inner = s.manager.fleet.lock();
    let record = inner.ops.scale_in(&id).ok_or_else(|| {
        ApiError::not_found(
            "unknown_request",
            format!("no scale-in request with id {id}; list them with GET /rollout/scale_in"),
        )
    })?;
    serde_json::to_value(record).map(Json).map_err(|e| ApiError::internal("serialize", e.to_string()))
}

async fn cancel_scale_out(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let id = rollout_core::ids::OpId::parse(&id).map_err(|_| scaling::unknown_scale_out(&id))?;
    let record = scaling::cancel_scale_out(&s.manager, &id)?;
    let mut value = serde_json::to_value(record).map_err(|e| ApiError::internal("serialize", e.to_string()))?;
    value["message"] = json!("cancellation requested; created engines are being stopped");
    Ok((StatusCode::OK, Json(value)))
}

async fn cancel_many(State(s): State<ApiState>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, ApiError> {
    let req: scaling::BatchCancelRequest = parse_body(&body)?;
    let cancelled = scaling::cancel_many(&s.manager, &req)?;
    Ok(Json(json!({ "dry_run": req.dry_run, "total": cancelled.len(), "cancelled": cancelled })))
}

/// The OpenAPI document of this API, kept beside the docs and checked by the tests.
const OPENAPI: &str = include_str!("../../../../../docs/openapi.json");

async fn openapi() -> axum::response::Response {
    use axum::response::IntoResponse;
    ([("content-type", "application/json")], OPENAPI).into_response()
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
