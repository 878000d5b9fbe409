//! The HTTP surface: SGLang's routes, auth and error shapes.
//!
//! Error bodies follow SGLang:
//! - request validation (bad JSON, unknown `sampling_params` key, missing field): 400
//!   `{"object":"error","message","type":"Bad Request","param":null,"code":400}`;
//! - handler errors: `{"error":{"message"}}` (400 unless stated);
//! - auth: 401 `{"error":"Unauthorized"}`; unknown route: 404 `{"detail":"Not Found"}`.

mod control;
mod generate;
mod generate_input;
mod info;
mod openai;
mod weight_sync;

use crate::engine::Engine;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde_json::json;
use std::sync::Arc;

/// Largest request body accepted (axum's default of 2 MB is too small for batches).
const MAX_BODY_BYTES: usize = 1 << 30;

/// Shared handler state.
pub type AppState = Arc<Engine>;

/// Builds the router of one engine.
pub fn router(engine: Arc<Engine>) -> Router {
    let admin = Router::new()
        .route("/flush_cache", get(control::flush_cache).post(control::flush_cache))
        .route("/abort_request", post(control::abort_request))
        .route("/pause_generation", post(control::pause_generation))
        .route("/continue_generation", post(control::continue_generation))
        .route("/update_weight_version", post(control::update_weight_version))
        .route("/update_weights_from_disk", post(control::update_weights_from_disk))
        .route("/init_weights_update_group", post(weight_sync::init_weights_update_group))
        .route("/destroy_weights_update_group", post(weight_sync::destroy_weights_update_group))
        .route("/begin_weight_update", post(weight_sync::begin_weight_update))
        .route("/end_weight_update", post(weight_sync::end_weight_update))
        .route("/update_weights_from_distributed", post(weight_sync::update_weights_from_distributed))
        .route(
            "/init_weights_send_group_for_remote_instance",
            post(weight_sync::init_weights_send_group_for_remote_instance),
        )
        .route("/send_weights_to_remote_instance", post(weight_sync::send_weights_to_remote_instance))
        .route("/release_memory_occupation", get(control::memory_occupation).post(control::memory_occupation))
        .route("/resume_memory_occupation", get(control::memory_occupation).post(control::memory_occupation));
    // Only with --enable-fault-api: otherwise the route does not exist (404 like any other).
    let admin = if engine.cfg.enable_fault_api { admin.route("/sim/faults", post(control::set_faults)) } else { admin };
    Router::new()
        .route("/generate", post(generate::generate).put(generate::generate))
        .route("/health", get(info::health))
        .route("/health_generate", get(info::health))
        .route("/ready", get(info::ready))
        .route("/ping", get(info::ping))
        .route("/model_info", get(info::model_info))
        .route("/get_model_info", get(info::model_info))
        .route("/server_info", get(info::server_info))
        .route("/get_server_info", get(info::server_info))
        .route("/v1/loads", get(info::loads))
        .route("/get_load", get(info::get_load))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(info::models))
        .route("/v1/models/{*model}", get(info::model_card_route))
        .route("/metrics", get(info::metrics))
        .merge(admin)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // SGLang has no request size limit; batches of long prompts are large.
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(engine.clone(), release_gate))
        .layer(middleware::from_fn_with_state(engine.clone(), auth))
        .layer(middleware::from_fn_with_state(engine.clone(), hang_gate))
        .with_state(engine)
}

/// The hang fault: once fired, no request on this engine is ever answered.
async fn hang_gate(State(engine): State<AppState>, req: Request, next: Next) -> Response {
    if engine.shared.is_hung() {
        std::future::pending::<()>().await;
    }
    next.run(req).await
}

/// `--sglang-api`: a route the imitated release does not serve is an unknown route.
async fn release_gate(State(engine): State<AppState>, req: Request, next: Next) -> Response {
    if !engine.cfg.sglang_api.serves(req.uri().path()) {
        return not_found().await;
    }
    next.run(req).await
}

/// Routes that take the admin key when `--admin-api-key` is set.
fn is_admin_path(path: &str) -> bool {
    matches!(
        path,
        "/flush_cache"
            | "/abort_request"
            | "/pause_generation"
            | "/continue_generation"
            | "/update_weight_version"
            | "/update_weights_from_disk"
            | "/release_memory_occupation"
            | "/resume_memory_occupation"
            | "/sim/faults"
    ) || path.starts_with("/update_weights")
        || path.ends_with("weights_update_group")
        || path.ends_with("_weight_update")
        || path.ends_with("_remote_instance")
}

/// SGLang's API-key middleware.
async fn auth(State(engine): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let open = req.method() == Method::OPTIONS
        || path.starts_with("/health")
        || path.starts_with("/ready")
        || path.starts_with("/metrics");
    if open {
        return next.run(req).await;
    }
    let required = if is_admin_path(path) {
        engine.cfg.admin_api_key.as_deref().or(engine.cfg.api_key.as_deref())
    } else {
        engine.cfg.api_key.as_deref()
    };
    if let Some(key) = required {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key) {
            return (StatusCode::UNAUTHORIZED, axum::Json(json!({"error": "Unauthorized"}))).into_response();
        }
    }
    next.run(req).await
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, axum::Json(json!({"detail": "Not Found"}))).into_response()
}

async fn method_not_allowed() -> Response {
    (StatusCode::METHOD_NOT_ALLOWED, axum::Json(json!({"detail": "Method Not Allowed"}))).into_response()
}

/// A request that cannot be served, rendered in one of SGLang's error shapes.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body does not match the schema (FastAPI's validation error, as a 400).
    #[error("{0}")]
    Validation(String),
    /// The handler rejected the request (`{"error":{"message"}}`).
    #[error("{1}")]
    Handler(StatusCode, String),
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::Handler(StatusCode::BAD_REQUEST, message.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Validation(m) => validation_error(m),
            ApiError::Handler(status, m) => handler_error(status, m),
        }
    }
}

/// 400 in the shape of SGLang's request-validation handler.
pub fn validation_error(message: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({
            "object": "error",
            "message": message.into(),
            "type": "Bad Request",
            "param": null,
            "code": 400,
        })),
    )
        .into_response()
}

/// An error raised inside a handler, in SGLang's `{"error":{"message"}}` shape.
pub fn handler_error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({"error": {"message": message.into()}}))).into_response()
}

/// 200 with a JSON body.
pub fn json_ok(v: serde_json::Value) -> Response {
    (StatusCode::OK, axum::Json(v)).into_response()
}

/// A JSON response built from pre-serialised bytes.
pub fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// Parses a JSON request body. SGLang's body models need a body even when every field has a
/// default, so an empty body is a validation error when `required`.
pub fn parse_body<T: DeserializeOwned + Default>(body: &Bytes, required: bool) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        if required {
            return Err(ApiError::Validation(
                "[{'type': 'missing', 'loc': ('body',), 'msg': 'Field required', 'input': None}]".into(),
            ));
        }
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ApiError::Validation(format!("Invalid request body: {e}")))
}
