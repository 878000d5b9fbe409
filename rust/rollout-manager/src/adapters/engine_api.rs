//! The SGLang HTTP calls the manager makes to its engines, behind one small trait: the
//! production implementation ([`HttpEngineApi`]) speaks HTTP with short timeouts; tests of the
//! use cases put a fake behind it.
//!
//! The router's data plane does not go through here (it forwards bytes and has its own
//! pooled connections); this is the control side: probes, `/model_info`, weight loads,
//! pause/continue, abort. Routes that older SGLang releases serve under another name
//! (`/get_model_info`) are found through [`EngineRoutes`].

use crate::adapters::dialect::{EngineRoutes, Route};
use crate::foundation::engine_http::{parse_json_object, ReadError, MAX_JSON_BYTES};
use futures::future::BoxFuture;
use rollout_core::weights::WeightVersion;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Why bringing up, checking or updating one engine failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The host could not start the engine's process (the local host, a keeper, an agent).
    #[error("could not start the engine: {0}")]
    Start(String),
    /// The engine left the fleet, or its placement is no longer wanted, while it was brought up.
    #[error("{0}")]
    Left(String),
    /// Its record had moved on meanwhile (removed, failed): the step no longer applies.
    #[error("the engine moved on meanwhile: {0}")]
    Moved(#[from] rollout_core::IllegalTransition),
    /// It cannot be brought to the fleet's weights now (the version kept moving, a turn that
    /// cannot resume): the caller restarts it or retries.
    #[error("{0}")]
    NotSynced(String),
    #[error("engine exited before it became healthy ({0}); see its log")]
    Exited(String),
    #[error("engine was not healthy within {0:?}")]
    StartupTimeout(Duration),
    #[error("engine serves weight version {found:?}, the fleet is on {expected:?}")]
    WrongVersion { expected: String, found: String },
    #[error("engine serves version {version:?} with checksum {found:?}, the published checksum is {expected:?}")]
    WrongChecksum { version: String, expected: String, found: String },
    #[error("engine could not load weights {path}: {detail}")]
    WeightLoad { path: String, detail: String },
    #[error(
        "engine serves model {found:?}, the fleet serves {expected:?} (--model-path) or a checkpoint it published"
    )]
    WrongModel { expected: String, found: String },
    #[error("engine did not answer {path}: {detail}")]
    Unreachable { path: &'static str, detail: String },
    /// Its HTTP server stopped answering while it was out of routing for a weight update.
    #[error("engine stopped answering during its weight update: {0}")]
    Unresponsive(String),
    /// It answered, but not with what SGLang answers (garbage, too large, wrong shape).
    #[error("engine gave an unusable answer to {path}: {detail}")]
    BadAnswer { path: &'static str, detail: String },
    /// It answered a weight-update call with an error (SGLang's `{success: false, message}`).
    #[error("engine refused {path}: {detail}")]
    Refused { path: &'static str, detail: String },
    /// The weight update it took part in stopped before its end (the trainer gave up between
    /// two buckets, say); what it loaded so far is part of a version.
    #[error("the update stopped before this engine had all of it: {0}")]
    UpdateStopped(String),
    #[error("cancelled")]
    Cancelled,
}

/// The calls, by engine base URL (`http://host:port`).
pub trait EngineApi: Send + Sync {
    /// One GET of `endpoint` (`/health`, `/model_info`): None when it answered 2xx within
    /// `timeout`, else why not, in words. A route older releases name differently
    /// (`/model_info`) is asked under the name the engine serves.
    fn probe<'a>(&'a self, url: &'a str, endpoint: &'a str, timeout: Duration) -> BoxFuture<'a, Option<String>>;

    /// `GET /model_info` (`/get_model_info` on older releases): a JSON object of at most
    /// 1 MiB, read within 10 s.
    fn model_info<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<serde_json::Value, EngineError>>;

    /// `POST /update_weights_from_disk` (SGLang 0.5: `model_path`, `weight_version`,
    /// `abort_all_requests`; it answers `{success, message}`, 400 on failure).
    fn load_from_disk<'a>(&'a self, url: &'a str, load: &'a DiskLoad) -> BoxFuture<'a, Result<(), EngineError>>;

    /// A control call with a JSON body (`/pause_generation`, `/continue_generation`).
    fn control<'a>(
        &'a self,
        url: &'a str,
        path: &'static str,
        body: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), EngineError>>;

    /// `POST /abort_request {"abort_all": true}`, best effort (a drain that timed out).
    fn abort_all<'a>(&'a self, url: &'a str) -> BoxFuture<'a, ()>;

    /// One of SGLang's distributed weight-update routes (`/init_weights_update_group`,
    /// `/begin_weight_update`, `/update_weights_from_distributed`, `/end_weight_update`,
    /// `/destroy_weights_update_group`), answered within `timeout`. Ok(true): done; Ok(false):
    /// the engine does not serve the route (404, as `/begin_weight_update` before 0.5.21);
    /// [`EngineError::Refused`] with SGLang's message when it answers an error.
    fn weights_call<'a>(
        &'a self,
        url: &'a str,
        path: &'static str,
        body: serde_json::Value,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<bool, EngineError>>;

    /// Whether the engine's scheduler answers a control request within `timeout`:
    /// `/server_info` (`/get_server_info` before 0.5.6) asks it for its internal state, which a
    /// paused scheduler gives and a hung one does not. (`/v1/loads` would not tell: SGLang 0.5.23
    /// answers it from the last load snapshot in the HTTP process, also when the scheduler hangs.)
    fn scheduler_answers<'a>(&'a self, url: &'a str, timeout: Duration) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.probe(url, "/server_info", timeout).await.is_none() })
    }

    /// Whether the engine serves the POST route `path` at all, asked without calling it: a GET
    /// is answered 405 by a route that exists and 404 by one the release does not have
    /// (`/send_weights_to_remote_instance` before 0.5.3). Unreachable counts as not served.
    fn serves<'a>(&'a self, url: &'a str, path: &'static str) -> BoxFuture<'a, bool> {
        let _ = (url, path);
        Box::pin(async { true })
    }

    /// Whether the engine can send its weights to a new engine (SGLang's remote-instance
    /// loading): it serves `/send_weights_to_remote_instance`, and it does not run on CPU, where
    /// SGLang 0.5.23's sender builds its group on a CUDA device (`weight_exporter.py`: "Found no
    /// NVIDIA driver"), so the new engine would wait for a group that never forms.
    fn can_send_weights<'a>(&'a self, url: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.serves(url, "/send_weights_to_remote_instance").await })
    }

    /// What the engine's `/server_info` says that the manager keeps (all None when it does not
    /// answer).
    fn server_facts<'a>(&'a self, url: &'a str) -> BoxFuture<'a, ServerFacts> {
        let _ = url;
        Box::pin(async { ServerFacts::default() })
    }
}

/// What an engine's `/server_info` says that the manager keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerFacts {
    /// It streams only each event's new output (`incremental_streaming_output`).
    pub streams_increments: Option<bool>,
    /// The ranks it takes in a weight-update group: `tp_size x pp_size`.
    pub ranks: Option<u32>,
}

impl ServerFacts {
    /// Reads them from a `/server_info` answer.
    pub fn of(info: &serde_json::Value) -> Self {
        let size = |key: &str| info.get(key).and_then(serde_json::Value::as_u64).filter(|n| *n > 0);
        let ranks = size("tp_size").map(|tp| tp.saturating_mul(size("pp_size").unwrap_or(1)));
        Self {
            streams_increments: info.get("incremental_streaming_output").and_then(serde_json::Value::as_bool),
            ranks: ranks.and_then(|r| u32::try_from(r).ok()),
        }
    }
}

/// What [`EngineApi::load_from_disk`] asks an engine to load.
#[derive(Debug, Clone)]
pub struct DiskLoad {
    pub path: String,
    pub version: String,
    pub abort_all: bool,
    /// Flush the engine's prefix cache with the load. SGLang refuses the flush while any request
    /// runs or waits (a health check's one-token generation, a stream whose client just left, an
    /// `in_place` pause's batch) and then answers 400 "Weights were updated, but the cache was
    /// not flushed": the manager loads without it and flushes on its own
    /// (`Manager::load_checkpoint`).
    pub flush_cache: bool,
    pub timeout: Duration,
}

/// Checks what an engine reports serving against the version it must serve.
pub fn verify(want: &WeightVersion, found: Option<&str>, checksum: Option<&str>) -> Result<(), EngineError> {
    if found != Some(want.version.as_str()) {
        return Err(EngineError::WrongVersion { expected: want.version.clone(), found: found.unwrap_or("").into() });
    }
    match (want.checksum.as_deref(), checksum) {
        (Some(expected), Some(got)) if expected != got => Err(EngineError::WrongChecksum {
            version: want.version.clone(),
            expected: expected.into(),
            found: got.into(),
        }),
        _ => Ok(()),
    }
}

/// [`EngineApi`] over HTTP.
pub struct HttpEngineApi {
    http: reqwest::Client,
    routes: Arc<EngineRoutes>,
}

impl HttpEngineApi {
    pub fn new(http: reqwest::Client, routes: Arc<EngineRoutes>) -> Self {
        Self { http, routes }
    }
}

impl EngineApi for HttpEngineApi {
    fn probe<'a>(&'a self, url: &'a str, endpoint: &'a str, timeout: Duration) -> BoxFuture<'a, Option<String>> {
        Box::pin(async move {
            if let Some(route) = Route::of(endpoint) {
                return match self.routes.get(&self.http, url, route, timeout, MAX_JSON_BYTES).await {
                    Ok(_) => None,
                    // Worded as for any other endpoint: "{name} timed out after ..", "{name} answered HTTP ..".
                    Err((name, e @ (ReadError::Timeout(_) | ReadError::Status(_)))) => Some(format!("{name} {e}")),
                    Err((name, e)) => Some(format!("{name}: {e}")),
                };
            }
            match self.http.get(format!("{url}{endpoint}")).timeout(timeout).send().await {
                Ok(r) if r.status().is_success() => None,
                Ok(r) => Some(format!("{endpoint} answered HTTP {}", r.status().as_u16())),
                Err(e) if e.is_timeout() => Some(format!("{endpoint} timed out after {timeout:?}")),
                Err(e) => Some(format!("{endpoint}: {}", crate::foundation::engine_http::describe(e))),
            }
        })
    }

    fn model_info<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<serde_json::Value, EngineError>> {
        Box::pin(async move {
            let timeout = Duration::from_secs(10);
            let read = self.routes.get(&self.http, url, Route::ModelInfo, timeout, MAX_JSON_BYTES).await;
            let (path, e) = match read {
                Ok((path, body)) => match parse_json_object(&body) {
                    Ok(info) => return Ok(info),
                    Err(e) => (path, e),
                },
                Err(failed) => failed,
            };
            Err(match e {
                ReadError::Request(_) | ReadError::Timeout(_) => {
                    EngineError::Unreachable { path, detail: e.to_string() }
                }
                ReadError::Status(_) | ReadError::TooLarge { .. } | ReadError::Invalid(_) => {
                    EngineError::BadAnswer { path, detail: e.to_string() }
                }
            })
        })
    }

    fn load_from_disk<'a>(&'a self, url: &'a str, load: &'a DiskLoad) -> BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            let failed = |detail: String| EngineError::WeightLoad { path: load.path.clone(), detail };
            let body = json!({"model_path": load.path, "weight_version": load.version,
                              "abort_all_requests": load.abort_all, "flush_cache": load.flush_cache});
            let response = self
                .http
                .post(format!("{url}/update_weights_from_disk"))
                .json(&body)
                .timeout(load.timeout)
                .send()
                .await
                .map_err(|e| failed(e.to_string()))?;
            let status = response.status();
            let answer: serde_json::Value = response.json().await.unwrap_or_default();
            let message = answer.get("message").and_then(|m| m.as_str()).unwrap_or("").to_string();
            if !status.is_success() || answer.get("success").and_then(|s| s.as_bool()) != Some(true) {
                return Err(failed(format!("HTTP {status}: {message}")));
            }
            Ok(())
        })
    }

    fn control<'a>(
        &'a self,
        url: &'a str,
        path: &'static str,
        body: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            self.http
                .post(format!("{url}{path}"))
                .json(&body)
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .map(|_| ())
                .map_err(|e| EngineError::Unreachable { path, detail: e.to_string() })
        })
    }

    fn weights_call<'a>(
        &'a self,
        url: &'a str,
        path: &'static str,
        body: serde_json::Value,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<bool, EngineError>> {
        Box::pin(async move {
            let response =
                self.http.post(format!("{url}{path}")).json(&body).timeout(timeout).send().await.map_err(|e| {
                    EngineError::Unreachable { path, detail: crate::foundation::engine_http::describe(e) }
                })?;
            let status = response.status();
            if status == reqwest::StatusCode::NOT_FOUND {
                return Ok(false);
            }
            let raw = crate::foundation::engine_http::read_capped(response, MAX_JSON_BYTES, Duration::from_secs(10))
                .await
                .unwrap_or_default();
            let answer = parse_json_object(&raw).unwrap_or_default();
            let message = answer
                .get("message")
                .and_then(|m| m.as_str())
                .map(crate::foundation::engine_http::shorten)
                .unwrap_or_else(|| crate::foundation::engine_http::shorten(&String::from_utf8_lossy(&raw)));
            if !status.is_success() || answer.get("success").and_then(|s| s.as_bool()) == Some(false) {
                return Err(EngineError::Refused { path, detail: format!("HTTP {}: {message}", status.as_u16()) });
            }
            Ok(true)
        })
    }

    fn serves<'a>(&'a self, url: &'a str, path: &'static str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            match self.http.get(format!("{url}{path}")).timeout(Duration::from_secs(10)).send().await {
                Ok(r) => r.status() != reqwest::StatusCode::NOT_FOUND,
                Err(_) => false,
            }
        })
    }

    fn server_facts<'a>(&'a self, url: &'a str) -> BoxFuture<'a, ServerFacts> {
        Box::pin(async move {
            let info = self.http.get(format!("{url}/server_info")).timeout(Duration::from_secs(10)).send().await;
            let info = match info {
                Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().await.ok(),
                _ => None,
            };
            info.as_ref().map(ServerFacts::of).unwrap_or_default()
        })
    }

    fn can_send_weights<'a>(&'a self, url: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            if !self.serves(url, "/send_weights_to_remote_instance").await {
                return false;
            }
            let info = self.http.get(format!("{url}/server_info")).timeout(Duration::from_secs(10)).send().await;
            let device = match info {
                Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().await.ok(),
                _ => None,
            };
            let device = device.as_ref().and_then(|i| i.get("device")).and_then(serde_json::Value::as_str);
            device != Some("cpu")
        })
    }

    fn abort_all<'a>(&'a self, url: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let _ = self
                .http
                .post(format!("{url}/abort_request"))
                .json(&json!({"abort_all": true}))
                .timeout(Duration::from_secs(10))
                .send()
                .await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::ServerFacts;
    use serde_json::json;

    #[test]
    fn server_facts_count_every_rank_of_every_stage() {
        let cases = [
            (json!({"tp_size": 2, "pp_size": 2, "incremental_streaming_output": true}), Some(4), Some(true)),
            (json!({"tp_size": 2, "incremental_streaming_output": false}), Some(2), Some(false)),
            (json!({"tp_size": 1, "pp_size": 1}), Some(1), None),
            // Nothing usable: not known (the engine counts as its GPUs, or 1).
            (json!({"tp_size": 0}), None, None),
            (json!({"tp_size": "2"}), None, None),
            (json!({}), None, None),
        ];
        for (info, ranks, increments) in cases {
            let facts = ServerFacts::of(&info);
            assert_eq!((facts.ranks, facts.streams_increments), (ranks, increments), "{info}");
        }
    }
}
