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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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
    /// back through WEIGHT_SYNCING -> READY -> ACTIVE once the version is verified. Also an
    /// UNHEALTHY engine that answers again but must copy the fleet's version (the trainer's,
    /// which has no checkpoint) before it rejoins.
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

    /// The next state after `event`. Every (state, event) pair is written out: a new state or
    /// event does not compile until each of its edges has been decided.
    pub fn on(self, event: EngineEvent) -> Result<EngineStatus, IllegalTransition> {
        use EngineEvent as E;
        use EngineStatus as S;
        let next = match self {
            S::Pending => match event {
                E::Bound => S::Creating,
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Removed
                | E::Restart
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
            S::Creating => match event {
                E::Launched => S::HealthChecking,
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Bound
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Removed
                | E::Restart
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
            S::HealthChecking => match event {
                E::Healthy => S::WeightSyncing,
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Bound
                | E::Launched
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Removed
                | E::Restart
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
            S::WeightSyncing => match event {
                E::WeightsSynced => S::Ready,
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Bound
                | E::Launched
                | E::Healthy
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Removed
                | E::Restart
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
            S::Ready => match event {
                E::Activated => S::Active,
                // The fleet's version moved while it waited to be activated: it syncs again.
                E::UpdateWeights => S::WeightSyncing,
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Bound
                | E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Removed
                | E::Restart => return Err(illegal("engine", self, event)),
            },
            S::Active => match event {
                E::ProbeFailed => S::Unhealthy,
                E::Drain => S::Draining,
                E::UpdateWeights => S::WeightSyncing,
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Bound
                | E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeRecovered
                | E::Removed
                | E::Restart => return Err(illegal("engine", self, event)),
            },
            S::Unhealthy => match event {
                E::ProbeRecovered => S::Active,
                // It answers again but missed a version it cannot load (the trainer's): it
                // copies it out of routing before it rejoins.
                E::UpdateWeights => S::WeightSyncing,
                E::Drain => S::Draining,
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Bound
                | E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::Removed
                | E::Restart => return Err(illegal("engine", self, event)),
            },
            S::Draining => match event {
                E::Remove => S::Removing,
                E::Fail => S::Failed,
                E::Bound
                | E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Removed
                | E::Restart
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
            S::Removing => match event {
                E::Removed => S::Removed,
                E::Bound
                | E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Remove
                | E::Fail
                | E::Restart
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
            S::Removed => match event {
                E::Bound
                | E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Remove
                | E::Removed
                | E::Fail
                | E::Restart
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
            S::Failed => match event {
                E::Restart => S::Creating,
                E::Remove => S::Removing,
                E::Bound
                | E::Launched
                | E::Healthy
                | E::WeightsSynced
                | E::Activated
                | E::ProbeFailed
                | E::ProbeRecovered
                | E::Drain
                | E::Removed
                | E::Fail
                | E::UpdateWeights => return Err(illegal("engine", self, event)),
            },
        };
        Ok(next)
    }
}

/// Status of a scale-out request.
///
/// Expected flow: `PENDING -> CREATING (managed) | CONNECTING (external) -> HEALTH_CHECKING ->
/// WEIGHT_SYNCING -> READY -> ACTIVE`. Any non-terminal state can end in `FAILED` or
/// `CANCELLED`. A request whose target is already met ends at once in `NOOP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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

    /// The next status after `event`; every pair is decided explicitly (see [`EngineStatus::on`]).
    pub fn on(self, event: ScaleOutEvent) -> Result<ScaleOutStatus, IllegalTransition> {
        use ScaleOutEvent as E;
        use ScaleOutStatus as S;
        let next = match (self, event) {
            (S::Active | S::Failed | S::Cancelled | S::Noop, _) => return Err(illegal("scale_out", self, event)),
            (_, E::Fail) => S::Failed,
            (_, E::Cancel) => S::Cancelled,
            (S::Pending, E::StartCreating) => S::Creating,
            (S::Pending, E::StartConnecting) => S::Connecting,
            (S::Pending, E::Noop) => S::Noop,
            (S::Creating | S::Connecting, E::Launched) => S::HealthChecking,
            (S::HealthChecking, E::Healthy) => S::WeightSyncing,
            (S::WeightSyncing, E::WeightsSynced) => S::Ready,
            (S::Ready, E::Activated) => S::Active,
            (S::Pending, E::Launched | E::Healthy | E::WeightsSynced | E::Activated)
            | (S::Creating | S::Connecting, E::StartCreating | E::StartConnecting | E::Noop | E::Healthy)
            | (S::Creating | S::Connecting, E::WeightsSynced | E::Activated)
            | (S::HealthChecking, E::StartCreating | E::StartConnecting | E::Noop | E::Launched)
            | (S::HealthChecking, E::WeightsSynced | E::Activated)
            | (S::WeightSyncing, E::StartCreating | E::StartConnecting | E::Noop | E::Launched | E::Healthy)
            | (S::WeightSyncing, E::Activated)
            | (S::Ready, E::StartCreating | E::StartConnecting | E::Noop | E::Launched | E::Healthy)
            | (S::Ready, E::WeightsSynced) => return Err(illegal("scale_out", self, event)),
        };
        Ok(next)
    }

    /// The phase a running operation is in, or `None` before it starts (PENDING) and once it
    /// ended. An operation follows the slowest of its engines through these phases.
    pub fn phase(self) -> Option<Phase> {
        match self {
            ScaleOutStatus::Creating | ScaleOutStatus::Connecting => Some(Phase::Launching),
            ScaleOutStatus::HealthChecking => Some(Phase::HealthChecking),
            ScaleOutStatus::WeightSyncing => Some(Phase::WeightSyncing),
            ScaleOutStatus::Ready => Some(Phase::Ready),
            ScaleOutStatus::Pending
            | ScaleOutStatus::Active
            | ScaleOutStatus::Failed
            | ScaleOutStatus::Cancelled
            | ScaleOutStatus::Noop => None,
        }
    }

    /// The events that take a running operation forward to `phase` (none when it is there,
    /// past it, not started or ended). Applying them in order never makes an illegal edge.
    pub fn events_to(self, phase: Phase) -> Vec<ScaleOutEvent> {
        let mut events = Vec::new();
        let mut at = self;
        while let Some(now) = at.phase().filter(|p| *p < phase) {
            let event = match now {
                Phase::Launching => ScaleOutEvent::Launched,
                Phase::HealthChecking => ScaleOutEvent::Healthy,
                Phase::WeightSyncing | Phase::Ready => ScaleOutEvent::WeightsSynced,
            };
            match at.on(event) {
                Ok(next) => {
                    events.push(event);
                    at = next;
                }
                Err(_) => break,
            }
        }
        events
    }
}

/// How far a scale-out (or one of its engines) has come, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Launching,
    HealthChecking,
    WeightSyncing,
    Ready,
}

impl Phase {
    /// The phase of an engine still in a scale-out's race (PENDING counts as launching: it
    /// waits for its placement); `None` for an engine that left the race (failed, removed...).
    pub fn of_engine(status: EngineStatus) -> Option<Phase> {
        match status {
            EngineStatus::Pending | EngineStatus::Creating => Some(Phase::Launching),
            EngineStatus::HealthChecking => Some(Phase::HealthChecking),
            EngineStatus::WeightSyncing => Some(Phase::WeightSyncing),
            EngineStatus::Ready | EngineStatus::Active => Some(Phase::Ready),
            EngineStatus::Unhealthy
            | EngineStatus::Draining
            | EngineStatus::Removing
            | EngineStatus::Removed
            | EngineStatus::Failed => None,
        }
    }
}

/// Status of a scale-in request.
///
/// Expected flow: `PENDING -> DRAINING -> REMOVING -> COMPLETED`; any non-terminal state can end
/// in `FAILED`, and a request with nothing to remove ends at once in `NOOP`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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

    /// The next status after `event`; every pair is decided explicitly (see [`EngineStatus::on`]).
    pub fn on(self, event: ScaleInEvent) -> Result<ScaleInStatus, IllegalTransition> {
        use ScaleInEvent as E;
        use ScaleInStatus as S;
        let next = match (self, event) {
            (S::Completed | S::Failed | S::Noop, _) => return Err(illegal("scale_in", self, event)),
            (_, E::Fail) => S::Failed,
            (S::Pending, E::StartDraining) => S::Draining,
            (S::Pending, E::Noop) => S::Noop,
            (S::Draining, E::Drained) => S::Removing,
            (S::Removing, E::Removed) => S::Completed,
            (S::Pending, E::Drained | E::Removed)
            | (S::Draining, E::StartDraining | E::Removed | E::Noop)
            | (S::Removing, E::StartDraining | E::Drained | E::Noop) => return Err(illegal("scale_in", self, event)),
        };
        Ok(next)
    }

    /// The events that finish an interrupted scale-in from where it stopped (the manager
    /// restarted mid-operation: its victims are removed, so it ends COMPLETED).
    pub fn events_to_complete(self) -> Vec<ScaleInEvent> {
        match self {
            ScaleInStatus::Pending => vec![ScaleInEvent::StartDraining, ScaleInEvent::Drained, ScaleInEvent::Removed],
            ScaleInStatus::Draining => vec![ScaleInEvent::Drained, ScaleInEvent::Removed],
            ScaleInStatus::Removing => vec![ScaleInEvent::Removed],
            ScaleInStatus::Completed | ScaleInStatus::Failed | ScaleInStatus::Noop => Vec::new(),
        }
    }
}

macro_rules! wire_name {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // The serde name is the one wire spelling; Display reuses it.
                if let Ok(serde_json::Value::String(s)) = serde_json::to_value(self) {
                    f.write_str(&s)
                } else {
                    write!(f, "{self:?}")
                }
            }
        }
    )*};
}
wire_name!(EngineStatus, ScaleOutStatus, ScaleInStatus, EngineOrigin);

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
