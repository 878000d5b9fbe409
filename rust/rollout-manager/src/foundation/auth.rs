//! Token authentication of mutating requests.
//!
//! When a token is configured (`--api-token-file PATH`, or the environment variable
//! `ROLLOUT_MANAGER_API_TOKEN`; never a command-line value, which other users could read in
//! `ps`), every request that changes something (any method but GET and HEAD) on the control API,
//! and the router's fan-out routes, must carry `Authorization: Bearer <token>`; others get 401
//! with a JSON error. The comparison takes the same time whatever the bytes. The token is never
//! logged and never passed to engines.

use crate::foundation::error::error_body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::path::Path;
use std::sync::Arc;

/// Environment variable that may hold the token.
pub const TOKEN_ENV: &str = "ROLLOUT_MANAGER_API_TOKEN";

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read --api-token-file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("--api-token-file {path} is empty")]
    Empty { path: String },
    #[error("--api-token-file {path} is readable by other users (mode {mode:o}); chmod 600 it")]
    Exposed { path: String, mode: u32 },
}

/// The configured token: from the file if given, else from the environment, else none.
pub fn load(file: Option<&Path>) -> Result<Option<Arc<str>>, TokenError> {
    if let Some(path) = file {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|source| TokenError::Read { path: shown.clone(), source })?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(TokenError::Exposed { path: shown, mode });
        }
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read { path: shown.clone(), source })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(TokenError::Empty { path: shown });
        }
        return Ok(Some(Arc::from(token)));
    }
    Ok(std::env::var(TOKEN_ENV).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).map(Arc::from))
}

/// Whether `headers` carry this manager's own token (`Authorization: Bearer <token>`). The
/// router uses it to keep the token from engines: external ones are run by someone else.
pub fn carries_token(headers: &axum::http::HeaderMap, token: Option<&str>) -> bool {
    let Some(token) = token else { return false };
    headers
        .get_all("authorization")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.strip_prefix("Bearer "))
        .any(|given| same(given.as_bytes(), token.as_bytes()))
}

/// Equality in time independent of where the bytes differ.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Middleware: mutating requests need the bearer token when one is configured.
pub async fn require_token(State(token): State<Option<Arc<str>>>, request: Request, next: Next) -> Response {
    let Some(token) = token else { return next.run(request).await };
    // Fan-out routes act on every engine whatever the method (SGLang takes GET /flush_cache).
    let fan_out = matches!(request.uri().path(), "/abort_request" | "/flush_cache");
    if matches!(*request.method(), Method::GET | Method::HEAD) && !fan_out {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if same(given.as_bytes(), token.as_bytes()) {
        return next.run(request).await;
    }
    let message = "this request changes the fleet and needs Authorization: Bearer <token> (the manager's --api-token-file or ROLLOUT_MANAGER_API_TOKEN)";
    (StatusCode::UNAUTHORIZED, [("www-authenticate", "Bearer")], Json(error_body("unauthorized", message)))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_whole_tokens() {
        assert!(same(b"secret", b"secret"));
        assert!(!same(b"secret", b"secreT"));
        assert!(!same(b"secret", b"secret2"));
        assert!(!same(b"", b"x"));
    }

    #[test]
    fn finds_only_this_token() {
        let mut h = axum::http::HeaderMap::new();
        assert!(!carries_token(&h, Some("t0k")));
        h.append("authorization", "Bearer engine-key".parse().unwrap());
        assert!(!carries_token(&h, Some("t0k")));
        assert!(!carries_token(&h, None));
        h.append("authorization", "Bearer t0k".parse().unwrap());
        assert!(carries_token(&h, Some("t0k")));
    }

    #[test]
    fn token_file_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir().join(format!("rm-token-{}", uuid::Uuid::new_v4()));
        std::fs::write(&path, "t0k3n\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(load(Some(&path)), Err(TokenError::Exposed { .. })));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load(Some(&path)).unwrap().as_deref(), Some("t0k3n"));
        std::fs::write(&path, "  \n").unwrap();
        assert!(matches!(load(Some(&path)), Err(TokenError::Empty { .. })));
        let _ = std::fs::remove_file(path);
    }
}
