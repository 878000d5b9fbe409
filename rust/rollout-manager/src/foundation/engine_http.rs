//! Reading what engines answer, without trusting them.
//!
//! An engine is a separate program (external ones are run by someone else) and may lie: answer
//! garbage, a body of any size, or a body that trickles in a byte at a time. Every read of an
//! engine's response body by the control plane (`/model_info`, `/v1/loads`, `/metrics`) goes
//! through [`read_capped`]:
//!
//! - a body larger than its limit is refused as soon as the limit is passed (or at once when
//!   `Content-Length` announces it), so memory per read is bounded by the limit;
//! - time is bounded by the caller's `reqwest` timeout, which covers the whole body, so a
//!   trickling body ends in a timeout;
//! - the error says which of the two happened, for the engine's `last_error`.
//!
//! The data plane (the router) streams response bodies to its clients without buffering them;
//! its bound is `--request-timeout-secs` (see `router/mod.rs`).

use bytes::{Bytes, BytesMut};
use std::time::Duration;

/// Largest JSON answer read from an engine (`/model_info`, `/v1/loads`): real ones are a few KB.
pub const MAX_JSON_BYTES: usize = 1 << 20;

/// Largest `/metrics` text read from an engine: SGLang's is tens of KB per DP rank.
pub const MAX_METRICS_BYTES: usize = 16 << 20;

/// Why an engine's answer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Connection refused or reset, DNS, TLS: the engine gave no HTTP answer.
    #[error("{0}")]
    Request(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("answer larger than the {limit}-byte limit")]
    TooLarge { limit: usize },
    #[error("invalid answer: {0}")]
    Invalid(String),
}

impl ReadError {
    fn from_reqwest(e: reqwest::Error, timeout: Duration) -> Self {
        if e.is_timeout() {
            return Self::Timeout(timeout);
        }
        Self::Request(describe(e))
    }
}

/// A `reqwest` error as one line: without the URL (the caller names the engine and the
/// path), with its causes (`connection refused` is in a cause, not in the top error).
pub fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Reads a response body of at most `limit` bytes.
pub async fn read_capped(mut resp: reqwest::Response, limit: usize, timeout: Duration) -> Result<Bytes, ReadError> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(ReadError::TooLarge { limit });
    }
    let mut body = BytesMut::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| ReadError::from_reqwest(e, timeout))? {
        if body.len() + chunk.len() > limit {
            return Err(ReadError::TooLarge { limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// `GET url`: a success status and a body of at most `limit` bytes, all within `timeout`.
pub async fn get(http: &reqwest::Client, url: &str, timeout: Duration, limit: usize) -> Result<Bytes, ReadError> {
    let resp = http.get(url).timeout(timeout).send().await.map_err(|e| ReadError::from_reqwest(e, timeout))?;
    if !resp.status().is_success() {
        return Err(ReadError::Status(resp.status().as_u16()));
    }
    read_capped(resp, limit, timeout).await
}

/// `GET url` as a JSON object (at most [`MAX_JSON_BYTES`]).
pub async fn get_json(http: &reqwest::Client, url: &str, timeout: Duration) -> Result<serde_json::Value, ReadError> {
    let body = get(http, url, timeout, MAX_JSON_BYTES).await?;
    parse_json_object(&body)
}

/// A JSON object, or why the bytes are not one.
pub fn parse_json_object(body: &[u8]) -> Result<serde_json::Value, ReadError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ReadError::Invalid(format!("not JSON ({e})")))?;
    if !value.is_object() {
        return Err(ReadError::Invalid("not a JSON object".into()));
    }
    Ok(value)
}

/// `GET url` as UTF-8 text (at most `limit` bytes).
pub async fn get_text(http: &reqwest::Client, url: &str, timeout: Duration, limit: usize) -> Result<String, ReadError> {
    let body = get(http, url, timeout, limit).await?;
    String::from_utf8(body.into()).map_err(|_| ReadError::Invalid("not UTF-8 text".into()))
}

/// Most characters of engine-supplied text kept in an error (`last_error`, logs, the
/// autoscaler's health): a lying engine must not make every log line a megabyte.
pub const MAX_QUOTED_CHARS: usize = 200;

/// `text` cut to [`MAX_QUOTED_CHARS`] characters, with a marker when it was cut.
pub fn shorten(text: &str) -> String {
    match text.char_indices().nth(MAX_QUOTED_CHARS) {
        None => text.to_string(),
        Some((at, _)) => format!("{}… ({} bytes)", &text[..at], text.len()),
    }
}

/// What the control plane reads from an engine's `/model_info`: the model path and the weight
/// version it serves. Fields that are missing or not strings read as empty, so a lying engine
/// fails the comparison with the fleet instead of passing it.
pub fn model_info_fields(info: &serde_json::Value) -> (&str, &str) {
    let field = |k: &str| info.get(k).and_then(|v| v.as_str()).unwrap_or("");
    (field("model_path"), field("weight_version"))
}

#[cfg(test)]
mod tests {
    #![expect(clippy::disallowed_methods, reason = "test servers and tasks live as long as their test")]
    use super::*;
    use axum::body::Body;
    use axum::routing::get as route_get;
    use axum::Router;
    use proptest::prelude::*;

    /// A lying engine on a free loopback port.
    async fn liar() -> String {
        let app = Router::new()
            .route("/huge", route_get(|| async { vec![b'x'; 3 * MAX_JSON_BYTES] }))
            .route(
                "/huge_chunked",
                route_get(|| async {
                    // No Content-Length: the cap must stop the read part-way.
                    let chunks = futures::stream::iter(
                        (0..1000).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'y'; 64 * 1024]))),
                    );
                    Body::from_stream(chunks)
                }),
            )
            .route(
                "/trickle",
                route_get(|| async {
                    let chunks = futures::stream::unfold((), |()| async {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Some((Ok::<_, std::io::Error>(Bytes::from_static(b"{")), ()))
                    });
                    Body::from_stream(chunks)
                }),
            )
            .route("/garbage", route_get(|| async { "{\"model_path\": [1, 2" }))
            .route("/array", route_get(|| async { "[1, 2]" }))
            .route("/fail", route_get(|| async { (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "no") }))
            .route("/ok", route_get(|| async { "{\"model_path\": \"m\", \"weight_version\": \"v1\"}" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn lies_are_bounded_and_named() {
        let base = liar().await;
        let http = reqwest::Client::new();
        let t = Duration::from_secs(5);
        let info = get_json(&http, &format!("{base}/ok"), t).await.unwrap();
        assert_eq!(model_info_fields(&info), ("m", "v1"));
        for path in ["/huge", "/huge_chunked"] {
            let e = get_json(&http, &format!("{base}{path}"), t).await.unwrap_err();
            assert!(matches!(e, ReadError::TooLarge { limit } if limit == MAX_JSON_BYTES), "{path}: {e}");
        }
        let e = get_json(&http, &format!("{base}/trickle"), Duration::from_millis(300)).await.unwrap_err();
        assert!(matches!(e, ReadError::Timeout(_)), "{e}");
        let e = get_json(&http, &format!("{base}/garbage"), t).await.unwrap_err();
        assert!(e.to_string().starts_with("invalid answer: not JSON"), "{e}");
        let e = get_json(&http, &format!("{base}/array"), t).await.unwrap_err();
        assert!(e.to_string().contains("not a JSON object"), "{e}");
        let e = get_json(&http, &format!("{base}/fail"), t).await.unwrap_err();
        assert!(matches!(e, ReadError::Status(500)), "{e}");
        let e = get_json(&http, "http://127.0.0.1:9/model_info", t).await.unwrap_err();
        assert!(matches!(e, ReadError::Request(_)), "{e}");
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_map(serde_json::Value::from),
            ".{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(
                    prop_oneof![Just("model_path".to_string()), Just("weight_version".to_string()), "[a-z]{1,4}"],
                    inner,
                    0..4
                )
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any bytes: an object or an error, never a panic.
        #[test]
        fn model_info_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(v) = parse_json_object(&body) {
                let _ = model_info_fields(&v);
            }
        }

        /// Any JSON: the fields read are exactly the string fields, or empty.
        #[test]
        fn model_info_fields_are_strings_or_empty(info in json_value()) {
            let (path, version) = model_info_fields(&info);
            let expect = |k: &str| info.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string();
            prop_assert_eq!(path.to_string(), expect("model_path"));
            prop_assert_eq!(version.to_string(), expect("weight_version"));
        }
    }

    #[test]
    fn quoted_text_is_short() {
        assert_eq!(shorten("v7"), "v7");
        let long = "é".repeat(10_000);
        let short = shorten(&long);
        assert!(short.chars().count() < MAX_QUOTED_CHARS + 20 && short.ends_with("(20000 bytes)"), "{short}");
    }

    /// Deeply nested JSON is refused by serde's recursion limit, not by a stack overflow.
    #[test]
    fn deep_nesting_is_an_error() {
        let deep = "[".repeat(100_000);
        assert!(parse_json_object(deep.as_bytes()).is_err());
        let deep = format!("{}1{}", "{\"a\":".repeat(50_000), "}".repeat(50_000));
        assert!(parse_json_object(deep.as_bytes()).is_err());
    }
}
