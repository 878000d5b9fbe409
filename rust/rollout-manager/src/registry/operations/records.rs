//! The scale-out and scale-in records: what the API shows and the store keeps. Their fields are
//! visible only to the operations part, which changes them through its named steps; everyone
//! else reads them through the getters. A new record is made whole ([`ScaleOutRecord::new`],
//! [`ScaleInRecord::new`]) before the part takes it.

use crate::foundation::clock::unix_now;
use crate::foundation::records::{checked, FailedEngine, Transition, Trigger};
use rollout_core::ids::{EngineId, OpId};
use rollout_core::{IllegalTransition, ScaleInEvent, ScaleInStatus, ScaleOutEvent, ScaleOutStatus};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScaleOutRecord {
    pub(super) request_id: OpId,
    pub(super) status: ScaleOutStatus,
    pub(super) model_name: String,
    pub(super) num_replicas: u32,
    pub(super) engine_urls: Vec<String>,
    pub(super) engine_ids: Vec<EngineId>,
    pub(super) failed_engines: Vec<FailedEngine>,
    pub(super) created_at: f64,
    pub(super) updated_at: f64,
    pub(super) error_message: Option<String>,
    pub(super) weight_version: Option<String>,
    pub(super) message: String,
    /// `initial` for the boot-time bring-up, `user` for API requests.
    pub(super) trigger: Trigger,
    pub(super) history: Vec<Transition>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScaleInRecord {
    pub(super) request_id: OpId,
    pub(super) status: ScaleInStatus,
    pub(super) model_name: String,
    pub(super) num_replicas: u32,
    pub(super) engine_urls: Vec<String>,
    pub(super) force: bool,
    pub(super) engine_ids: Vec<EngineId>,
    pub(super) removed_engines: Vec<EngineId>,
    pub(super) failed_engines: Vec<FailedEngine>,
    pub(super) created_at: f64,
    pub(super) updated_at: f64,
    pub(super) error_message: Option<String>,
    pub(super) message: String,
    pub(super) history: Vec<Transition>,
}

impl ScaleOutRecord {
    /// The record as an answer that says `message` (the record itself keeps its own).
    pub fn answering(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    /// A PENDING scale-out as it is accepted (`weight_version`: the fleet's version then).
    pub fn new(
        request_id: OpId,
        model_name: String,
        num_replicas: u32,
        engine_urls: Vec<String>,
        trigger: Trigger,
        weight_version: String,
    ) -> Self {
        let now = unix_now();
        Self {
            request_id,
            status: ScaleOutStatus::Pending,
            model_name,
            num_replicas,
            engine_urls,
            engine_ids: Vec::new(),
            failed_engines: Vec::new(),
            created_at: now,
            updated_at: now,
            error_message: None,
            weight_version: Some(weight_version),
            message: String::new(),
            trigger,
            history: vec![Transition { status: ScaleOutStatus::Pending.to_string(), at: now }],
        }
    }

    /// The scale-out has nothing to do: NOOP, saying why.
    pub fn noop(mut self, message: String) -> Self {
        checked(self.apply(ScaleOutEvent::Noop));
        self.message = message;
        self
    }

    /// The scale-out adds `engine_ids` (reserved for it), saying so.
    pub fn adding(mut self, engine_ids: Vec<EngineId>, message: String) -> Self {
        self.engine_ids = engine_ids;
        self.message = message;
        self
    }

    pub(super) fn apply(&mut self, event: ScaleOutEvent) -> Result<(), IllegalTransition> {
        let next = self.status.on(event)?;
        tracing::info!(request_id = %self.request_id, from = %self.status, to = %next, "scale_out");
        self.status = next;
        self.updated_at = unix_now();
        self.history.push(Transition { status: next.to_string(), at: self.updated_at });
        if next.is_terminal() {
            observe_finished("scale_out", &next.to_string(), self.updated_at - self.created_at);
        }
        Ok(())
    }

    /// Applies the operation's forward events until it has reached `phase` (see
    /// [`ScaleOutStatus::events_to`]).
    pub(super) fn advance_to(&mut self, phase: rollout_core::Phase) {
        for event in self.status.events_to(phase) {
            checked(self.apply(event));
        }
    }
}

impl ScaleInRecord {
    /// A PENDING scale-in of `engine_ids` as it is accepted.
    pub fn new(
        request_id: OpId,
        model_name: String,
        num_replicas: u32,
        engine_urls: Vec<String>,
        force: bool,
        engine_ids: Vec<EngineId>,
    ) -> Self {
        let now = unix_now();
        Self {
            request_id,
            status: ScaleInStatus::Pending,
            model_name,
            num_replicas,
            engine_urls,
            force,
            engine_ids,
            removed_engines: Vec::new(),
            failed_engines: Vec::new(),
            created_at: now,
            updated_at: now,
            error_message: None,
            message: String::new(),
            history: vec![Transition { status: ScaleInStatus::Pending.to_string(), at: now }],
        }
    }

    /// The scale-in has nothing to remove: NOOP, saying why.
    pub fn noop(mut self, message: String) -> Self {
        checked(self.apply(ScaleInEvent::Noop));
        self.message = message;
        self
    }

    /// The scale-in's victims start draining, and it says so.
    pub fn draining(mut self, message: String) -> Self {
        checked(self.apply(ScaleInEvent::StartDraining));
        self.message = message;
        self
    }

    pub(super) fn apply(&mut self, event: ScaleInEvent) -> Result<(), IllegalTransition> {
        let next = self.status.on(event)?;
        tracing::info!(request_id = %self.request_id, from = %self.status, to = %next, "scale_in");
        self.status = next;
        self.updated_at = unix_now();
        self.history.push(Transition { status: next.to_string(), at: self.updated_at });
        if next.is_terminal() {
            observe_finished("scale_in", &next.to_string(), self.updated_at - self.created_at);
        }
        Ok(())
    }
}

/// Counts a scale operation that reached a final status, with how long it took.
fn observe_finished(kind: &str, status: &str, secs: f64) {
    crate::foundation::telemetry::events()
        .scale_seconds
        .with_label_values(&[kind, &status.to_lowercase()])
        .observe(secs.max(0.0));
}

impl ScaleOutRecord {
    pub fn request_id(&self) -> &OpId {
        &self.request_id
    }

    pub fn status(&self) -> ScaleOutStatus {
        self.status
    }

    pub fn model_name(&self) -> &String {
        &self.model_name
    }

    pub fn num_replicas(&self) -> u32 {
        self.num_replicas
    }

    pub fn engine_urls(&self) -> &Vec<String> {
        &self.engine_urls
    }

    pub fn engine_ids(&self) -> &Vec<EngineId> {
        &self.engine_ids
    }

    pub fn failed_engines(&self) -> &Vec<FailedEngine> {
        &self.failed_engines
    }

    pub fn created_at(&self) -> f64 {
        self.created_at
    }

    pub fn updated_at(&self) -> f64 {
        self.updated_at
    }

    pub fn error_message(&self) -> &Option<String> {
        &self.error_message
    }

    pub fn weight_version(&self) -> &Option<String> {
        &self.weight_version
    }

    pub fn message(&self) -> &String {
        &self.message
    }

    /// `initial` for the boot-time bring-up, `user` for API requests.
    pub fn trigger(&self) -> Trigger {
        self.trigger
    }

    pub fn history(&self) -> &Vec<Transition> {
        &self.history
    }
}

impl ScaleInRecord {
    pub fn request_id(&self) -> &OpId {
        &self.request_id
    }

    pub fn status(&self) -> ScaleInStatus {
        self.status
    }

    pub fn model_name(&self) -> &String {
        &self.model_name
    }

    pub fn num_replicas(&self) -> u32 {
        self.num_replicas
    }

    pub fn engine_urls(&self) -> &Vec<String> {
        &self.engine_urls
    }

    pub fn force(&self) -> bool {
        self.force
    }

    pub fn engine_ids(&self) -> &Vec<EngineId> {
        &self.engine_ids
    }

    pub fn removed_engines(&self) -> &Vec<EngineId> {
        &self.removed_engines
    }

    pub fn failed_engines(&self) -> &Vec<FailedEngine> {
        &self.failed_engines
    }

    pub fn created_at(&self) -> f64 {
        self.created_at
    }

    pub fn updated_at(&self) -> f64 {
        self.updated_at
    }

    pub fn error_message(&self) -> &Option<String> {
        &self.error_message
    }

    pub fn message(&self) -> &String {
        &self.message
    }

    pub fn history(&self) -> &Vec<Transition> {
        &self.history
    }
}
