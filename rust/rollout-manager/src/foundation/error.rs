//! The HTTP error model: every failure is JSON `{"error": {"code", "message"}}` with a status
//! that tells the caller whose fault it was (400 bad input, 404 unknown id, 409 conflicting
//! state, 500 our fault). Messages say what was wrong and what to do about it.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    #[error("{message}")]
    NotFound { code: &'static str, message: String },
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    #[error("{message}")]
    Unavailable { code: &'static str, message: String },
    #[error("{message}")]
    TooLarge { code: &'static str, message: String },
    #[error("{message}")]
    MethodNotAllowed { code: &'static str, message: String },
    #[error("{message}")]
    Internal { code: &'static str, message: String },
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::BadRequest { code, message: message.into() }
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::NotFound { code, message: message.into() }
    }
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::Conflict { code, message: message.into() }
    }
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::Unavailable { code, message: message.into() }
    }
    pub fn internal(code: &'static str, message: impl Into<String>) -> Self {
        Self::Internal { code, message: message.into() }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::NotFound { .. } => StatusCode::NOT_FOUND,
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::BadRequest { code, .. }
            | Self::NotFound { code, .. }
            | Self::Conflict { code, .. }
            | Self::Unavailable { code, .. }
            | Self::TooLarge { code, .. }
            | Self::MethodNotAllowed { code, .. }
            | Self::Internal { code, .. } => code,
        }
    }
}

/// The body of every error answer.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong: a stable code to branch on and a message for people.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: &str, message: &str) -> Self {
        Self { error: ErrorDetail { code: code.to_string(), message: message.to_string() } }
    }
}

/// The JSON body of an error ([`ErrorBody`]), for handlers that build responses by hand.
pub fn error_body(code: &str, message: &str) -> serde_json::Value {
    json!(ErrorBody::new(code, message))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status(), Json(ErrorBody::new(self.code(), &self.to_string()))).into_response()
    }
}
