//! SGLang routes that changed name across the 0.5.x line, and which one each engine serves.
//!
//! The newest SGLang serves `/model_info`, `/server_info` and `/v1/loads`; the older 0.5.x
//! releases that RL frameworks pin serve only `/get_model_info`, `/get_server_info` and
//! `/get_load` (with another shape; see [`crate::interfaces::integrations::loads`]). An engine's answer is
//! the only reliable guide (forks patch routes in and out whatever their version string says),
//! so the manager asks for the newest name first and, on a 404, for the older ones, and
//! remembers per engine URL the name that answered: each engine is detected once, and a URL
//! that later serves another release (an external engine replaced in place) is detected again
//! on its first 404.

use crate::foundation::engine_http::{self, ReadError};
use crate::foundation::locks::Locked;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// A route known by more than one name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// The model, and the weight version it serves.
    ModelInfo,
    /// Server arguments, the SGLang version, the KV pool size.
    ServerInfo,
    /// The scheduler's load per DP rank.
    Loads,
}

impl Route {
    /// Its names, newest first.
    pub fn names(self) -> &'static [&'static str] {
        match self {
            Route::ModelInfo => &["/model_info", "/get_model_info"],
            Route::ServerInfo => &["/server_info", "/get_server_info"],
            Route::Loads => &["/v1/loads?include=core", "/get_load"],
        }
    }

    /// The route `path` names, if it is one of them.
    pub fn of(path: &str) -> Option<Route> {
        [Route::ModelInfo, Route::ServerInfo, Route::Loads].into_iter().find(|r| r.names().contains(&path))
    }
}

/// Bound on the remembered engines: far above any fleet; past it the oldest are forgotten and
/// detected again (one extra 404 each).
const MAX_REMEMBERED: usize = 4096;

/// Which name each engine answered to, by engine base URL.
#[derive(Default)]
pub struct EngineRoutes {
    learned: Mutex<HashMap<(String, Route), usize>>,
}

impl EngineRoutes {
    pub fn new() -> Self {
        Self::default()
    }

    fn learned(&self) -> std::sync::MutexGuard<'_, HashMap<(String, Route), usize>> {
        self.learned.locked()
    }

    /// The name this engine answered to last, or the newest if it was never asked.
    pub fn name(&self, url: &str, route: Route) -> &'static str {
        let index = self.learned().get(&(url.to_string(), route)).copied().unwrap_or(0);
        route.names()[index.min(route.names().len() - 1)]
    }

    /// `GET` of `route` on the engine at `url`: the body (at most `limit` bytes, all within
    /// `timeout`) and the name that answered. The name this engine answered to before is
    /// asked first; a 404 moves on to the next name, and the one that answers is remembered.
    /// When none answers, the error is the first name's.
    pub async fn get(
        &self,
        http: &reqwest::Client,
        url: &str,
        route: Route,
        timeout: Duration,
        limit: usize,
    ) -> Result<(&'static str, Bytes), (&'static str, ReadError)> {
        let names = route.names();
        let first = self.learned().get(&(url.to_string(), route)).copied().unwrap_or(0).min(names.len() - 1);
        let mut first_error = None;
        for index in (first..names.len()).chain(0..first) {
            let name = names[index];
            match engine_http::get(http, &format!("{url}{name}"), timeout, limit).await {
                Ok(body) => {
                    self.remember(url, route, index);
                    return Ok((name, body));
                }
                Err(ReadError::Status(404)) => {
                    first_error.get_or_insert((name, ReadError::Status(404)));
                }
                // Not a route question (down, slow, garbage): the next name would fare no better.
                Err(e) => return Err((name, e)),
            }
        }
        Err(first_error.unwrap_or((names[first], ReadError::Status(404))))
    }

    fn remember(&self, url: &str, route: Route, index: usize) {
        let mut learned = self.learned();
        if learned.len() >= MAX_REMEMBERED && !learned.contains_key(&(url.to_string(), route)) {
            learned.clear();
        }
        if index == 0 {
            learned.remove(&(url.to_string(), route));
        } else {
            learned.insert((url.to_string(), route), index);
        }
    }
}

#[cfg(test)]
mod tests {
    #![expect(clippy::disallowed_methods, reason = "test servers live as long as their test")]
    use super::*;
    use axum::routing::get;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// An engine on a free loopback port serving `paths` (each answers its own name), counting
    /// every request it gets.
    async fn engine(paths: &'static [&'static str]) -> (String, Arc<AtomicUsize>) {
        let hits = Arc::new(AtomicUsize::new(0));
        let mut app = axum::Router::new();
        for p in paths {
            app = app.route(p, get(move || async move { *p }));
        }
        let counted = hits.clone();
        let app = app.layer(axum::middleware::from_fn(move |req, next: axum::middleware::Next| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move { next.run(req).await }
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, hits)
    }

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn an_older_engine_is_detected_once() {
        let (url, hits) = engine(&["/get_model_info"]).await;
        let routes = EngineRoutes::new();
        let http = reqwest::Client::new();
        assert_eq!(routes.name(&url, Route::ModelInfo), "/model_info");
        let (name, body) = routes.get(&http, &url, Route::ModelInfo, T, 1024).await.unwrap();
        assert_eq!((name, &body[..]), ("/get_model_info", &b"/get_model_info"[..]));
        assert_eq!(hits.load(Ordering::SeqCst), 2, "the newest name first, then the older one");
        routes.get(&http, &url, Route::ModelInfo, T, 1024).await.unwrap();
        assert_eq!(hits.load(Ordering::SeqCst), 3, "then straight to the name that answered");
        assert_eq!(routes.name(&url, Route::ModelInfo), "/get_model_info");
        // Another route of the same engine is detected on its own.
        assert_eq!(routes.name(&url, Route::ServerInfo), "/server_info");
    }

    #[tokio::test]
    async fn a_newer_engine_never_sees_the_old_names() {
        let (url, hits) = engine(&["/model_info", "/get_model_info"]).await;
        let routes = EngineRoutes::new();
        let http = reqwest::Client::new();
        for _ in 0..3 {
            let (name, _) = routes.get(&http, &url, Route::ModelInfo, T, 1024).await.unwrap();
            assert_eq!(name, "/model_info");
        }
        assert_eq!(hits.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn an_engine_replaced_by_a_newer_release_is_detected_again() {
        let (old, _) = engine(&["/get_model_info"]).await;
        let routes = EngineRoutes::new();
        let http = reqwest::Client::new();
        routes.get(&http, &old, Route::ModelInfo, T, 1024).await.unwrap();
        // Same URL key, a server that only has the new name (as if upgraded in place).
        let (new, _) = engine(&["/model_info"]).await;
        routes.learned().insert((new.clone(), Route::ModelInfo), 1);
        let (name, _) = routes.get(&http, &new, Route::ModelInfo, T, 1024).await.unwrap();
        assert_eq!(name, "/model_info");
        assert_eq!(routes.name(&new, Route::ModelInfo), "/model_info");
    }

    #[tokio::test]
    async fn no_name_answering_is_the_newest_names_404_and_other_errors_stop_at_once() {
        let (url, hits) = engine(&["/health"]).await;
        let routes = EngineRoutes::new();
        let http = reqwest::Client::new();
        let (name, e) = routes.get(&http, &url, Route::Loads, T, 1024).await.unwrap_err();
        assert_eq!(name, "/v1/loads?include=core");
        assert!(matches!(e, ReadError::Status(404)), "{e}");
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        let (name, e) = routes.get(&http, "http://127.0.0.1:9", Route::ModelInfo, T, 1024).await.unwrap_err();
        assert_eq!(name, "/model_info");
        assert!(matches!(e, ReadError::Request(_)), "{e}");
    }

    #[test]
    fn every_name_maps_back_to_its_route() {
        for route in [Route::ModelInfo, Route::ServerInfo, Route::Loads] {
            for name in route.names() {
                assert_eq!(Route::of(name), Some(route));
            }
        }
        assert_eq!(Route::of("/health"), None);
    }
}
