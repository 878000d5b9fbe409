use super::*;
use proptest::prelude::*;

const ENGINE_STATES: [EngineStatus; 11] = EngineStatus::ALL;
const ENGINE_EVENTS: [EngineEvent; 13] = [
    EngineEvent::Bound,
    EngineEvent::Launched,
    EngineEvent::Healthy,
    EngineEvent::WeightsSynced,
    EngineEvent::Activated,
    EngineEvent::ProbeFailed,
    EngineEvent::ProbeRecovered,
    EngineEvent::Drain,
    EngineEvent::Remove,
    EngineEvent::Removed,
    EngineEvent::Fail,
    EngineEvent::Restart,
    EngineEvent::UpdateWeights,
];
const OUT_STATES: [ScaleOutStatus; 10] = [
    ScaleOutStatus::Pending,
    ScaleOutStatus::Creating,
    ScaleOutStatus::Connecting,
    ScaleOutStatus::HealthChecking,
    ScaleOutStatus::WeightSyncing,
    ScaleOutStatus::Ready,
    ScaleOutStatus::Active,
    ScaleOutStatus::Failed,
    ScaleOutStatus::Cancelled,
    ScaleOutStatus::Noop,
];
const OUT_EVENTS: [ScaleOutEvent; 9] = [
    ScaleOutEvent::StartCreating,
    ScaleOutEvent::StartConnecting,
    ScaleOutEvent::Launched,
    ScaleOutEvent::Healthy,
    ScaleOutEvent::WeightsSynced,
    ScaleOutEvent::Activated,
    ScaleOutEvent::Noop,
    ScaleOutEvent::Fail,
    ScaleOutEvent::Cancel,
];
const IN_STATES: [ScaleInStatus; 6] = [
    ScaleInStatus::Pending,
    ScaleInStatus::Draining,
    ScaleInStatus::Removing,
    ScaleInStatus::Completed,
    ScaleInStatus::Failed,
    ScaleInStatus::Noop,
];
const IN_EVENTS: [ScaleInEvent; 5] =
    [ScaleInEvent::StartDraining, ScaleInEvent::Drained, ScaleInEvent::Removed, ScaleInEvent::Noop, ScaleInEvent::Fail];

#[test]
fn engine_happy_path_and_scale_in() {
    use EngineEvent as E;
    let mut s = EngineStatus::Creating;
    for e in [E::Launched, E::Healthy, E::WeightsSynced, E::Activated] {
        s = s.on(e).unwrap();
    }
    assert_eq!(s, EngineStatus::Active);
    assert!(s.is_routable());
    let s = s.on(E::Drain).unwrap();
    assert!(!s.is_routable());
    let s = s.on(E::Remove).unwrap().on(E::Removed).unwrap();
    assert!(s.is_terminal());
}

#[test]
fn engine_edge_table() {
    use EngineEvent as E;
    use EngineStatus as S;
    // (from, event, expected) — every legal edge that is not a Fail/Remove wildcard.
    let table = [
        (S::Creating, E::Launched, Some(S::HealthChecking)),
        (S::HealthChecking, E::Healthy, Some(S::WeightSyncing)),
        (S::WeightSyncing, E::WeightsSynced, Some(S::Ready)),
        (S::Ready, E::Activated, Some(S::Active)),
        (S::Active, E::ProbeFailed, Some(S::Unhealthy)),
        (S::Active, E::UpdateWeights, Some(S::WeightSyncing)),
        (S::Unhealthy, E::ProbeRecovered, Some(S::Active)),
        (S::Unhealthy, E::Drain, Some(S::Draining)),
        (S::Draining, E::Remove, Some(S::Removing)),
        (S::Failed, E::Remove, Some(S::Removing)),
        (S::Removing, E::Removed, Some(S::Removed)),
        (S::Failed, E::Restart, Some(S::Creating)),
        // Illegal ones, loudly rejected.
        (S::Creating, E::Activated, None),
        (S::HealthChecking, E::Drain, None),
        (S::Removed, E::Fail, None),
        (S::Removed, E::Remove, None),
        (S::Removing, E::Fail, None),
        (S::Failed, E::Fail, None),
        (S::Active, E::Healthy, None),
        (S::Draining, E::Activated, None),
        (S::Active, E::Restart, None),
        (S::Removed, E::Restart, None),
        (S::Unhealthy, E::UpdateWeights, Some(S::WeightSyncing)),
        (S::WeightSyncing, E::UpdateWeights, None),
        (S::Ready, E::UpdateWeights, Some(S::WeightSyncing)),
    ];
    for (from, event, expected) in table {
        let got = from.on(event).ok();
        assert_eq!(got, expected, "{from:?} --{event:?}-->");
    }
}

#[test]
fn which_engines_out_of_routing_keep_their_requests() {
    use EngineStatus as S;
    let table = [
        (S::Pending, false),
        (S::Creating, false),
        (S::HealthChecking, false),
        (S::WeightSyncing, true),
        (S::Ready, true),
        (S::Active, true),
        (S::Unhealthy, false),
        (S::Draining, true),
        (S::Removing, true),
        (S::Removed, true),
        (S::Failed, false),
    ];
    assert_eq!(table.len(), ENGINE_STATES.len());
    for (status, keeps) in table {
        assert_eq!(status.keeps_its_requests(), keeps, "{status}");
    }
}

#[test]
fn illegal_transition_names_both_sides() {
    let err = EngineStatus::Removed.on(EngineEvent::Activated).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("Removed") && text.contains("Activated"), "{text}");
}

#[test]
fn scale_out_flows() {
    use ScaleOutEvent as E;
    let managed = [E::StartCreating, E::Launched, E::Healthy, E::WeightsSynced, E::Activated];
    let s = managed.iter().try_fold(ScaleOutStatus::Pending, |s, e| s.on(*e)).unwrap();
    assert_eq!(s, ScaleOutStatus::Active);
    let external = [E::StartConnecting, E::Launched, E::Healthy, E::WeightsSynced, E::Activated];
    let s = external.iter().try_fold(ScaleOutStatus::Pending, |s, e| s.on(*e)).unwrap();
    assert_eq!(s, ScaleOutStatus::Active);
    assert_eq!(ScaleOutStatus::Pending.on(E::Noop).unwrap(), ScaleOutStatus::Noop);
    // Cancellation works in every non-terminal state.
    for s in OUT_STATES.iter().filter(|s| !s.is_terminal()) {
        assert_eq!(s.on(E::Cancel).unwrap(), ScaleOutStatus::Cancelled, "{s:?}");
        assert_eq!(s.on(E::Fail).unwrap(), ScaleOutStatus::Failed, "{s:?}");
    }
    for s in OUT_STATES.iter().filter(|s| s.is_terminal()) {
        assert!(s.on(E::Cancel).is_err(), "{s:?}");
    }
}

#[test]
fn scale_in_flows() {
    use ScaleInEvent as E;
    let s =
        [E::StartDraining, E::Drained, E::Removed].iter().try_fold(ScaleInStatus::Pending, |s, e| s.on(*e)).unwrap();
    assert_eq!(s, ScaleInStatus::Completed);
    assert!(ScaleInStatus::Completed.on(E::Fail).is_err());
    assert!(ScaleInStatus::Pending.on(E::Drained).is_err());
}

#[test]
fn a_scale_out_catches_up_to_the_phase_of_its_slowest_engine() {
    use ScaleOutEvent as E;
    use ScaleOutStatus as S;
    let table: [(ScaleOutStatus, Phase, &[ScaleOutEvent]); 8] = [
        (S::Creating, Phase::Launching, &[]),
        (S::Creating, Phase::HealthChecking, &[E::Launched]),
        (S::Connecting, Phase::Ready, &[E::Launched, E::Healthy, E::WeightsSynced]),
        (S::HealthChecking, Phase::WeightSyncing, &[E::Healthy]),
        (S::WeightSyncing, Phase::HealthChecking, &[]),
        (S::Ready, Phase::Ready, &[]),
        // Not started (still waiting for resources) or already ended: nothing to catch up.
        (S::Pending, Phase::Ready, &[]),
        (S::Cancelled, Phase::Ready, &[]),
    ];
    for (from, phase, want) in table {
        assert_eq!(from.events_to(phase), want.to_vec(), "{from:?} -> {phase:?}");
    }
    assert_eq!(Phase::of_engine(EngineStatus::Pending), Some(Phase::Launching));
    assert_eq!(Phase::of_engine(EngineStatus::Active), Some(Phase::Ready));
    assert_eq!(Phase::of_engine(EngineStatus::Failed), None);
}

#[test]
fn an_interrupted_scale_in_completes_from_any_live_state() {
    for s in IN_STATES {
        let end = s.events_to_complete().into_iter().try_fold(s, |s, e| s.on(e)).unwrap();
        assert_eq!(end, if s.is_terminal() { s } else { ScaleInStatus::Completed }, "{s:?}");
    }
}

#[test]
fn every_edge_of_the_engine_machine() {
    // The whole table, so a changed edge shows up here as well as in the match.
    use EngineEvent as E;
    use EngineStatus as S;
    let legal: &[(EngineStatus, EngineEvent, EngineStatus)] = &[
        (S::Pending, E::Bound, S::Creating),
        (S::Creating, E::Launched, S::HealthChecking),
        (S::HealthChecking, E::Healthy, S::WeightSyncing),
        (S::WeightSyncing, E::WeightsSynced, S::Ready),
        (S::Ready, E::Activated, S::Active),
        (S::Active, E::ProbeFailed, S::Unhealthy),
        (S::Unhealthy, E::ProbeRecovered, S::Active),
        (S::Active, E::Drain, S::Draining),
        (S::Unhealthy, E::Drain, S::Draining),
        (S::Active, E::UpdateWeights, S::WeightSyncing),
        (S::Ready, E::UpdateWeights, S::WeightSyncing),
        (S::Unhealthy, E::UpdateWeights, S::WeightSyncing),
        (S::Removing, E::Removed, S::Removed),
        (S::Failed, E::Restart, S::Creating),
    ];
    for from in ENGINE_STATES {
        for event in ENGINE_EVENTS {
            let want = match event {
                E::Remove if !matches!(from, S::Removing | S::Removed) => Some(S::Removing),
                E::Fail if !matches!(from, S::Removing | S::Removed | S::Failed) => Some(S::Failed),
                _ => legal.iter().find(|(f, e, _)| *f == from && *e == event).map(|(_, _, to)| *to),
            };
            assert_eq!(from.on(event).ok(), want, "{from:?} on {event:?}");
        }
    }
}

#[test]
fn wire_names_are_screaming_snake_case() {
    assert_eq!(EngineStatus::HealthChecking.to_string(), "HEALTH_CHECKING");
    assert_eq!(ScaleOutStatus::WeightSyncing.to_string(), "WEIGHT_SYNCING");
    assert_eq!(ScaleInStatus::Completed.to_string(), "COMPLETED");
    assert_eq!(EngineOrigin::External.to_string(), "external");
    let parsed: ScaleOutStatus = serde_json::from_str("\"CANCELLED\"").unwrap();
    assert_eq!(parsed, ScaleOutStatus::Cancelled);
}

proptest! {
    /// Whatever sequence of events arrives, from either first state (PENDING in Ray mode,
    /// CREATING otherwise), the engine machine never leaves REMOVED, never makes an engine
    /// routable without passing READY -> ACTIVE or UNHEALTHY -> ACTIVE, and a routable engine
    /// always keeps its requests.
    #[test]
    fn engine_machine_invariants(
        ray in any::<bool>(),
        events in proptest::collection::vec(0usize..ENGINE_EVENTS.len(), 0..64),
    ) {
        let mut s = if ray { EngineStatus::Pending } else { EngineStatus::Creating };
        for i in events {
            prop_assert!(!s.is_routable() || s.keeps_its_requests());
            let e = ENGINE_EVENTS[i];
            match s.on(e) {
                Ok(next) => {
                    prop_assert!(ENGINE_STATES.contains(&next));
                    prop_assert!(s != EngineStatus::Removed, "left REMOVED via {:?}", e);
                    if next == EngineStatus::Active && s != EngineStatus::Active {
                        prop_assert!(matches!(s, EngineStatus::Ready | EngineStatus::Unhealthy));
                    }
                    s = next;
                }
                Err(err) => prop_assert_eq!(err.machine, "engine"),
            }
        }
    }

    /// Terminal scale-out states accept no event; non-terminal ones always accept Fail and Cancel;
    /// catching up to any phase never makes an illegal edge and never goes backwards.
    #[test]
    fn scale_out_terminal_is_absorbing(events in proptest::collection::vec(0usize..OUT_EVENTS.len(), 0..32), p in 0usize..4) {
        let mut s = ScaleOutStatus::Pending;
        let phase = [Phase::Launching, Phase::HealthChecking, Phase::WeightSyncing, Phase::Ready][p];
        for i in events {
            let caught_up = s.events_to(phase).into_iter().try_fold(s, |s, e| s.on(e));
            prop_assert!(caught_up.is_ok());
            if let (Ok(c), Some(before)) = (caught_up, s.phase()) {
                prop_assert_eq!(c.phase(), Some(before.max(phase)));
            }
            let e = OUT_EVENTS[i];
            let r = s.on(e);
            if s.is_terminal() {
                prop_assert!(r.is_err());
            } else if matches!(e, ScaleOutEvent::Fail | ScaleOutEvent::Cancel) {
                prop_assert!(r.is_ok());
            }
            if let Ok(next) = r { s = next; }
        }
    }

    #[test]
    fn scale_in_terminal_is_absorbing(events in proptest::collection::vec(0usize..IN_EVENTS.len(), 0..32)) {
        let mut s = ScaleInStatus::Pending;
        for i in events {
            let r = s.on(IN_EVENTS[i]);
            if s.is_terminal() { prop_assert!(r.is_err()); }
            if let Ok(next) = r { prop_assert!(IN_STATES.contains(&next)); s = next; }
        }
    }
}
