//! State machines of engines and scale operations.
//!
//! Each machine is an enum plus one pure transition function `on(self, event)` that either
//! returns the next state or an [`IllegalTransition`] naming both the state and the event. The
//! async service performs the effects and feeds their outcomes back in as events, so every edge
//! the system can take is listed here and nowhere else.
//!
//! On the wire every state is spelled in SCREAMING_SNAKE_CASE, as in the seed API.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A transition that the machine does not allow. Carries both names so the log says exactly
/// which edge was attempted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("illegal {machine} transition: {event} in state {state}")]
pub struct IllegalTransition {
    pub machine: &'static str,
    pub state: String,
    pub event: String,
}

fn illegal(machine: &'static str, state: impl fmt::Debug, event: impl fmt::Debug) -> IllegalTransition {
    IllegalTransition { machine, state: format!("{state:?}"), event: format!("{event:?}") }
}

/// Where an engine came from. Initial engines are protected from scale-in; external engines are
/// detached, never killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineOrigin {
    /// Started from the manager's own startup flags (`--rollout-num-gpus`).
    Initial,
    /// Added by a scale-out on the manager's own placement.
    Dynamic,
    /// Started by someone else and attached by URL.
    External,
}

/// Lifecycle of one engine.
///
/// Expected flow: `CREATING -> HEALTH_CHECKING -> WEIGHT_SYNCING -> READY -> ACTIVE`, then on
/// scale-in `DRAINING -> REMOVING -> REMOVED`. An ACTIVE engine that fails health probes becomes
/// `UNHEALTHY` (out of routing) and returns to ACTIVE when probes pass again. A fleet weight
/// update takes an ACTIVE engine back to `WEIGHT_SYNCING` (out of routing) until it is verified
/// on the new version, then `READY -> ACTIVE` again. A process that
/// exits unexpectedly makes the engine `FAILED` from any live state; recovery restarts a FAILED
/// engine from `CREATING`. In Ray mode an engine starts in `PENDING` (its placement waits for
/// resources, PENDING_RESOURCES) and moves to `CREATING` when an agent is bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EngineStatus {
    Pending,
    Creating,
    HealthChecking,
    WeightSyncing,
    Ready,
    Active,
    Unhealthy,
    Draining,
    Removing,
    Removed,
    Failed,
}

/// Something that happened to an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineEvent {
    /// Ray mode: an agent was bound to the engine's placement.
    Bound,
    /// The process was started (or the external URL answered).
    Launched,
    /// The engine passed its readiness health check.
    Healthy,
    /// The engine reports the fleet's weight version.
    WeightsSynced,
    /// The engine was added to routing.
    Activated,
    /// Health probes failed past the threshold.
    ProbeFailed,
    /// Health probes pass again.
    ProbeRecovered,
    /// Scale-in selected this engine: stop routing new requests to it.
    Drain,
    /// Stop the engine (after draining, or as a rollback of a creation).
    Remove,
    /// The process is gone and its resources are released.
    Removed,
    /// The process exited unexpectedly, or a creation step failed.
    Fail,
    /// Start a failed engine again (recovery), on the same GPUs.
    Restart,
    /// A fleet weight update takes this engine out of routing to load a new version; it comes
    /// back through WEIGHT_SYNCING -> READY -> ACTIVE once the version is verified.
    UpdateWeights,
}

impl EngineStatus {
    /// Every state, in lifecycle order.
    pub const ALL: [EngineStatus; 11] = [
        EngineStatus::Pending,
        EngineStatus::Creating,
        EngineStatus::HealthChecking,
        EngineStatus::WeightSyncing,
        EngineStatus::Ready,
        EngineStatus::Active,
        EngineStatus::Unhealthy,
        EngineStatus::Draining,
        EngineStatus::Removing,
        EngineStatus::Removed,
        EngineStatus::Failed,
    ];

    /// The one predicate that decides whether the router may send new requests here.
    pub fn is_routable(self) -> bool {
        self == EngineStatus::Active
    }

    /// For an engine out of routing: whether the requests the router already sent it still get
    /// their answer there. Yes when it left to drain (DRAINING, REMOVING, REMOVED: scale-in
    /// waits for them) or for a rolling weight update (WEIGHT_SYNCING, READY: the update waits
    /// for them before loading); no when it failed its probes, exited, or is being started
    /// again: those requests are lost and the router retries them elsewhere.
    pub fn keeps_its_requests(self) -> bool {
        match self {
            EngineStatus::Draining
            | EngineStatus::Removing
            | EngineStatus::Removed
            | EngineStatus::WeightSyncing
            | EngineStatus::Ready
            | EngineStatus::Active => true,
            EngineStatus::Pending
            | EngineStatus::Creating
            | EngineStatus::HealthChecking
            | EngineStatus::Unhealthy
            | EngineStatus::Failed => false,
        }
    }

    /// Whether the engine still exists as far as the fleet is concerned.
    pub fn is_terminal(self) -> bool {
        self == EngineStatus::Removed
    }

    /// Whether the engine is still being brought up.
    pub fn is_starting(self) -> bool {
        matches!(
            self,
            EngineStatus::Pending
                | EngineStatus::Creating
                | EngineStatus::HealthChecking
                | EngineStatus::WeightSyncing
                | EngineStatus::Ready
        )
    }

    pub fn on(self, event: EngineEvent) -> Result<EngineStatus, IllegalTransition> {
        use EngineEvent as E;
        use EngineStatus as S;
        let next = match (self, event) {
            (S::Pending, E::Bound) => S::Creating,
            (S::Creating, E::Launched) => S::HealthChecking,
            (S::HealthChecking, E::Healthy) => S::WeightSyncing,
            (S::WeightSyncing, E::WeightsSynced) => S::Ready,
            (S::Ready, E::Activated) => S::Active,
            (S::Active, E::ProbeFailed) => S::Unhealthy,
            (S::Unhealthy, E::ProbeRecovered) => S::Active,
            (S::Active | S::Unhealthy, E::Drain) => S::Draining,
            (s, E::Remove) if s != S::Removing && s != S::Removed => S::Removing,
            (S::Removing, E::Removed) => S::Removed,
            (S::Failed, E::Restart) => S::Creating,
            (S::Active, E::UpdateWeights) => S::WeightSyncing,
            (s, E::Fail) if s != S::Removing && s != S::Removed && s != S::Failed => S::Failed,
            (s, e) => return Err(illegal("engine", s, e)),
        };
        Ok(next)
    }
}

/// Status of a scale-out request.
///
/// Expected flow: `PENDING -> CREATING (managed) | CONNECTING (external) -> HEALTH_CHECKING ->
/// WEIGHT_SYNCING -> READY -> ACTIVE`. Any non-terminal state can end in `FAILED` or
/// `CANCELLED`. A request whose target is already met ends at once in `NOOP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ScaleOutStatus {
    Pending,
    Creating,
    Connecting,
    HealthChecking,
    WeightSyncing,
    Ready,
    Active,
    Failed,
    Cancelled,
    Noop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleOutEvent {
    /// Start launching managed engines.
    StartCreating,
    /// Start connecting to external engines.
    StartConnecting,
    /// Every engine of the request is launched or connected.
    Launched,
    /// Every engine passed its health check.
    Healthy,
    /// Every engine serves the fleet's weight version.
    WeightsSynced,
    /// Every engine is registered with the router.
    Activated,
    /// Nothing to do: the target is already met.
    Noop,
    Fail,
    Cancel,
}

impl ScaleOutStatus {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            ScaleOutStatus::Active | ScaleOutStatus::Failed | ScaleOutStatus::Cancelled | ScaleOutStatus::Noop
        )
    }

    pub fn on(self, event: ScaleOutEvent) -> Result<ScaleOutStatus, IllegalTransition> {
        use ScaleOutEvent as E;
        use ScaleOutStatus as S;
        let next = match (self, event) {
            (S::Pending, E::StartCreating) => S::Creating,
            (S::Pending, E::StartConnecting) => S::Connecting,
            (S::Pending, E::Noop) => S::Noop,
            (S::Creating | S::Connecting, E::Launched) => S::HealthChecking,
            (S::HealthChecking, E::Healthy) => S::WeightSyncing,
            (S::WeightSyncing, E::WeightsSynced) => S::Ready,
            (S::Ready, E::Activated) => S::Active,
            (s, E::Fail) if !s.is_terminal() => S::Failed,
            (s, E::Cancel) if !s.is_terminal() => S::Cancelled,
            (s, e) => return Err(illegal("scale_out", s, e)),
        };
        Ok(next)
    }
}

/// Status of a scale-in request.
///
/// Expected flow: `PENDING -> DRAINING -> REMOVING -> COMPLETED`; any non-terminal state can end
/// in `FAILED`, and a request with nothing to remove ends at once in `NOOP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ScaleInStatus {
    Pending,
    Draining,
    Removing,
    Completed,
    Failed,
    Noop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleInEvent {
    StartDraining,
    Drained,
    Removed,
    Noop,
    Fail,
}

impl ScaleInStatus {
    pub fn is_terminal(self) -> bool {
        matches!(self, ScaleInStatus::Completed | ScaleInStatus::Failed | ScaleInStatus::Noop)
    }

    pub fn on(self, event: ScaleInEvent) -> Result<ScaleInStatus, IllegalTransition> {
        use ScaleInEvent as E;
        use ScaleInStatus as S;
        let next = match (self, event) {
            (S::Pending, E::StartDraining) => S::Draining,
            (S::Pending, E::Noop) => S::Noop,
            (S::Draining, E::Drained) => S::Removing,
            (S::Removing, E::Removed) => S::Completed,
            (s, E::Fail) if !s.is_terminal() => S::Failed,
            (s, e) => return Err(illegal("scale_in", s, e)),
        };
        Ok(next)
    }
}

macro_rules! wire_name {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // The serde name is the one wire spelling; Display reuses it.
                match serde_json::to_value(self) {
                    Ok(serde_json::Value::String(s)) => f.write_str(&s),
                    _ => write!(f, "{self:?}"),
                }
            }
        }
    )*};
}
wire_name!(EngineStatus, ScaleOutStatus, ScaleInStatus, EngineOrigin);

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
