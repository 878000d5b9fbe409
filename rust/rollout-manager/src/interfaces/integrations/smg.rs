//! Registration of the fleet's engines with an external SGLang router (`--router smg=URL`).
//!
//! A reconciler keeps smg's worker list equal to the fleet's ACTIVE engines: it registers each
//! engine that becomes ACTIVE (`POST /workers {"url"}`) and unregisters every other one it had
//! registered (`DELETE /workers/{id}`), on every fleet change and every few seconds (so a
//! restarted smg is repopulated). Scale-in also unregisters its victims explicitly before it
//! waits for their drain, so smg stops sending them work first. Errors are logged and retried
//! on the next pass; they never block the fleet.

use crate::foundation::locks::Locked;
use crate::ops::manager::{ExternalRouter, Manager};
use futures::future::BoxFuture;
use rollout_core::EngineStatus;
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Largest answer read from smg (its worker list, for up to thousands of workers).
const MAX_ANSWER_BYTES: usize = 8 << 20;

/// One smg, at `base`, and the engines this manager registered with it.
pub struct Smg {
    base: String,
    http: reqwest::Client,
    /// Engine URL -> smg worker id, for what this manager registered.
    registered: Mutex<HashMap<String, String>>,
}

#[derive(Deserialize)]
struct Accepted {
    worker_id: String,
}

#[derive(Deserialize)]
struct WorkerList {
    #[serde(default)]
    workers: Vec<WorkerInfo>,
}

#[derive(Deserialize)]
struct WorkerInfo {
    id: String,
    url: String,
}

impl Smg {
    pub fn new(base: &str, http: reqwest::Client) -> Self {
        Self { base: base.trim_end_matches('/').to_string(), http, registered: Mutex::default() }
    }

    fn ids(&self) -> HashMap<String, String> {
        self.registered.locked().clone()
    }

    fn set(&self, url: &str, id: Option<String>) {
        let mut map = self.registered.locked();
        match id {
            Some(id) => map.insert(url.to_string(), id),
            None => map.remove(url),
        };
    }

    /// smg's current workers: URL -> id.
    async fn list(&self) -> Option<HashMap<String, String>> {
        let timeout = Duration::from_secs(5);
        let url = format!("{}/workers", self.base);
        let body = crate::foundation::engine_http::get(&self.http, &url, timeout, MAX_ANSWER_BYTES).await.ok()?;
        let list: WorkerList = serde_json::from_slice(&body).ok()?;
        Some(list.workers.into_iter().map(|w| (w.url.trim_end_matches('/').to_string(), w.id)).collect())
    }

    async fn register(&self, url: &str) -> Option<String> {
        let body = serde_json::json!({ "url": url, "worker_type": "regular" });
        let resp =
            self.http.post(format!("{}/workers", self.base)).json(&body).timeout(Duration::from_secs(10)).send().await;
        match resp {
            Ok(r) if r.status().is_success() => {
                let body = crate::foundation::engine_http::read_capped(r, MAX_ANSWER_BYTES, Duration::from_secs(10))
                    .await
                    .ok()?;
                serde_json::from_slice::<Accepted>(&body).ok().map(|a| a.worker_id)
            }
            // Already registered (by us before a restart, or by someone else): adopt its id.
            Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => self.list().await?.remove(url),
            Ok(r) => {
                tracing::warn!(url, status = %r.status(), "smg refused to register the engine");
                None
            }
            Err(e) => {
                tracing::warn!(url, error = %e, "cannot reach smg to register the engine");
                None
            }
        }
    }

    async fn unregister(&self, id: &str) -> bool {
        let resp =
            self.http.delete(format!("{}/workers/{id}", self.base)).timeout(Duration::from_secs(10)).send().await;
        matches!(resp, Ok(r) if r.status().is_success() || r.status() == reqwest::StatusCode::NOT_FOUND)
    }

    /// Unregisters these engine URLs now.
    async fn unregister_urls(&self, urls: &[String]) {
        let ids = self.ids();
        for url in urls {
            if let Some(id) = ids.get(url) {
                if self.unregister(id).await {
                    self.set(url, None);
                    tracing::info!(url, "unregistered from smg before draining");
                }
            }
        }
    }

    /// Makes smg's workers (those this manager registered) the `active` engine URLs.
    async fn reconcile(&self, active: &HashSet<String>) {
        let registered = self.ids();
        // smg may have restarted and forgotten our workers.
        let present = self.list().await;
        for url in active {
            let known = registered.contains_key(url) && present.as_ref().is_none_or(|p| p.contains_key(url));
            if !known {
                if let Some(id) = self.register(url).await {
                    tracing::info!(url, worker_id = %id, "registered engine with smg");
                    self.set(url, Some(id));
                }
            }
        }
        for (url, id) in registered {
            if !active.contains(&url) && self.unregister(&id).await {
                tracing::info!(url, "unregistered engine from smg");
                self.set(&url, None);
            }
        }
    }
}

impl ExternalRouter for Smg {
    fn forget<'a>(&'a self, urls: &'a [String]) -> BoxFuture<'a, ()> {
        Box::pin(self.unregister_urls(urls))
    }
}

/// Keeps `smg`'s workers equal to the fleet's ACTIVE engines until the manager shuts down,
/// then unregisters them all.
pub fn spawn_reconciler(manager: &Arc<Manager>, smg: Arc<Smg>) {
    let m = manager.clone();
    manager.tasks.spawn(async move {
        let mut changes = m.fleet.subscribe();
        let mut ticker = tokio::time::interval(Duration::from_secs(5));
        loop {
            let active: HashSet<String> = m
                .fleet
                .lock()
                .engines
                .values()
                .filter(|e| e.status() == EngineStatus::Active)
                .map(|e| e.record().url().clone())
                .collect();
            smg.reconcile(&active).await;
            tokio::select! {
                _ = changes.changed() => {}
                _ = ticker.tick() => {}
                _ = m.shutdown.cancelled() => break,
            }
        }
        // Leave smg without engines that are about to stop.
        let urls: Vec<String> = smg.ids().into_keys().collect();
        smg.unregister_urls(&urls).await;
    });
}
