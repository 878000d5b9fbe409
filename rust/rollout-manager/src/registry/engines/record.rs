//! An engine's record: what `GET /rollout/engines` shows and the store keeps. Its fields are
//! visible only to the engines part, which changes them through an `Engine`'s named steps;
//! everyone else reads them through the getters.

use rollout_core::ids::{EngineId, OpId};
use rollout_core::{EngineOrigin, EngineStatus};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One engine as reported by `GET /rollout/engines`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = Engine)]
pub struct EngineRecord {
    pub(super) engine_id: EngineId,
    pub(super) url: String,
    pub(super) status: EngineStatus,
    pub(super) is_healthy: bool,
    pub(super) origin: EngineOrigin,
    pub(super) model_name: String,
    pub(super) weight_version: Option<String>,
    /// SHA-256 of the weights the engine reports it loaded (`sglang-sim`'s `weights_checksum`),
    /// when known; checked against the published checksum before the engine is routable.
    #[serde(default)]
    pub(super) weights_checksum: Option<String>,
    pub(super) gpu_ids: Vec<u32>,
    pub(super) pid: Option<u32>,
    pub(super) started_at: f64,
    pub(super) updated_at: f64,
    #[schema(value_type = Option<String>)]
    pub(super) log_path: Option<PathBuf>,
    /// Requests the router has in flight to this engine.
    pub(super) in_flight: usize,
    /// How the process ended, or why the engine failed.
    pub(super) last_error: Option<String>,
    /// The operation that created this engine.
    pub(super) created_by: Option<OpId>,
    /// How many times recovery restarted this engine.
    pub(super) restarts: u32,
    /// What the engine waits for, when that is not obvious from its status (Ray mode:
    /// `PENDING_RESOURCES: ...` while its placement has no agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) detail: Option<String>,
    /// The last lines of the engine's log, kept when the manager gave up restarting it (its
    /// restart budget spent), so the reason is readable from the API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) log_tail: Option<Vec<String>>,
}

impl EngineRecord {
    /// A new engine's record, made by [`super::Engines::add`] under the id it hands out.
    pub(super) fn new(engine_id: EngineId, new: super::Registration, gpu_ids: Vec<u32>) -> Self {
        let now = crate::foundation::clock::unix_now();
        let log_path = new.log_dir.map(|dir| dir.join(format!("{engine_id}.log")));
        Self {
            engine_id,
            url: new.url,
            status: new.status,
            is_healthy: false,
            origin: new.origin,
            model_name: new.model_name,
            weight_version: None,
            weights_checksum: None,
            gpu_ids,
            pid: None,
            started_at: now,
            updated_at: now,
            log_path,
            in_flight: 0,
            last_error: None,
            created_by: new.created_by,
            restarts: 0,
            detail: None,
            log_tail: None,
        }
    }

    /// A record read back from the store after a manager restart, as the restore takes it up:
    /// nothing in flight, not known healthy until probed, in `status` when given, its pid kept
    /// only for an engine adopted as it runs, and `last_error` saying what happens next.
    pub fn restored(mut self, status: Option<EngineStatus>, keep_pid: bool, last_error: Option<String>) -> Self {
        self.in_flight = 0;
        self.is_healthy = false;
        if let Some(status) = status {
            self.status = status;
        }
        if !keep_pid {
            self.pid = None;
        }
        self.last_error = last_error;
        self
    }

    pub fn engine_id(&self) -> &EngineId {
        &self.engine_id
    }

    pub fn url(&self) -> &String {
        &self.url
    }

    pub fn status(&self) -> EngineStatus {
        self.status
    }

    pub fn is_healthy(&self) -> bool {
        self.is_healthy
    }

    pub fn origin(&self) -> EngineOrigin {
        self.origin
    }

    pub fn model_name(&self) -> &String {
        &self.model_name
    }

    pub fn weight_version(&self) -> &Option<String> {
        &self.weight_version
    }

    /// SHA-256 of the weights the engine reports it loaded (`sglang-sim`'s `weights_checksum`),
    /// when known; checked against the published checksum before the engine is routable.
    pub fn weights_checksum(&self) -> &Option<String> {
        &self.weights_checksum
    }

    pub fn gpu_ids(&self) -> &Vec<u32> {
        &self.gpu_ids
    }

    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    pub fn started_at(&self) -> f64 {
        self.started_at
    }

    pub fn updated_at(&self) -> f64 {
        self.updated_at
    }

    pub fn log_path(&self) -> &Option<PathBuf> {
        &self.log_path
    }

    /// Requests the router has in flight to this engine.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// How the process ended, or why the engine failed.
    pub fn last_error(&self) -> &Option<String> {
        &self.last_error
    }

    /// The operation that created this engine.
    pub fn created_by(&self) -> &Option<OpId> {
        &self.created_by
    }

    /// How many times recovery restarted this engine.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// What the engine waits for, when that is not obvious from its status (Ray mode:
    /// `PENDING_RESOURCES: ...` while its placement has no agent).
    pub fn detail(&self) -> &Option<String> {
        &self.detail
    }

    /// The last lines of the engine's log, kept when the manager gave up restarting it (its
    /// restart budget spent), so the reason is readable from the API.
    pub fn log_tail(&self) -> &Option<Vec<String>> {
        &self.log_tail
    }
}

/// An engine's record for tests, as the store would hold it: `id` in `status`.
#[cfg(test)]
pub(crate) fn test_record(id: &str, status: &str) -> EngineRecord {
    let record = serde_json::json!({
        "engine_id": id, "url": "http://127.0.0.1:30000/", "status": status, "is_healthy": true,
        "origin": "initial", "model_name": "m", "weight_version": "v0", "gpu_ids": [0], "pid": null,
        "started_at": 1.0, "updated_at": 1.0, "log_path": null, "in_flight": 0, "last_error": null,
        "created_by": null, "restarts": 0,
    });
    serde_json::from_value(record).unwrap()
}
