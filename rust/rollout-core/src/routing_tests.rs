use super::*;
use proptest::prelude::*;

fn load(in_flight: u64, est: u64, cap: u64) -> Load {
    Load { in_flight, est_tokens: est, capacity: cap, reported_tokens: 0 }
}

#[test]
fn capacity_takes_the_most_free_engine() {
    let loads = [load(1, 9000, 10000), load(5, 2000, 10000), load(0, 0, 4000)];
    // 1: 8000 free; 2: 4000 free.
    assert_eq!(choose(Policy::Capacity, &loads, 100, None, 0, &Gate::default()), Some((1, false)));
}

#[test]
fn engine_reports_correct_the_estimate() {
    // The router thinks engine 0 is empty, but the engine reports it nearly full.
    let mut a = load(0, 0, 10000);
    a.reported_tokens = 9500;
    let b = load(2, 3000, 10000);
    assert_eq!(most_free(&[a, b], 0), Some(1));
    // The engine reporting less than the router's account changes nothing: budgets not yet
    // generated still count.
    let c = Load { in_flight: 4, est_tokens: 9000, capacity: 10000, reported_tokens: 1000 };
    assert_eq!(c.used(), 9000);
}

#[test]
fn ties_rotate() {
    let loads = [load(0, 0, 100), load(0, 0, 100), load(0, 0, 100)];
    let picks: Vec<_> = (0..3).map(|r| most_free(&loads, r).unwrap()).collect();
    assert_eq!(picks, vec![0, 1, 2]);
    let picks: Vec<_> = (0..3).map(|r| least_requests(&loads, r).unwrap()).collect();
    assert_eq!(picks, vec![0, 1, 2]);
}

#[test]
fn affinity_holds_until_the_gate_trips() {
    let gate = Gate::default();
    let idle = [load(0, 0, 10000), load(0, 0, 10000)];
    assert_eq!(choose(Policy::Session, &idle, 500, Some(1), 0, &gate), Some((1, true)));
    // Engine 1 holds 80% while engine 0 is empty: taking more would exceed 1.5x the mean + 0.1.
    let skewed = [load(0, 0, 10000), load(8, 8000, 10000)];
    assert_eq!(choose(Policy::Session, &skewed, 500, Some(1), 0, &gate), Some((0, false)));
    // A busy but balanced fleet keeps its affinity.
    let full = [load(9, 8900, 10000), load(9, 8900, 10000)];
    assert!(passes_gate(&full, 0, 500, &gate));
    // Requests queue on an engine whose KV pool is nearly empty: spill on request count too.
    let queued = [load(20, 2000, 65536), load(0, 0, 65536), load(0, 0, 65536), load(0, 0, 65536)];
    assert!(!passes_gate(&queued, 0, 100, &gate));
    let even = [load(6, 2000, 65536), load(5, 2000, 65536), load(5, 0, 65536), load(6, 0, 65536)];
    assert!(passes_gate(&even, 0, 100, &gate));
}

#[test]
fn round_robin_and_least_requests() {
    let loads = [load(3, 0, 0), load(1, 0, 0), load(2, 0, 0)];
    assert_eq!(choose(Policy::RoundRobin, &loads, 1, Some(0), 4, &Gate::default()), Some((1, false)));
    assert_eq!(choose(Policy::LeastRequests, &loads, 1, None, 0, &Gate::default()), Some((1, false)));
    assert_eq!(choose(Policy::Capacity, &[], 1, None, 0, &Gate::default()), None);
}

#[test]
fn estimates() {
    assert_eq!(estimate_tokens(400, None, Some(50), None), 150);
    assert_eq!(estimate_tokens(400, Some(7), None, None), 7 + 128);
    assert_eq!(estimate_tokens(0, Some(7), Some(4096), Some(300)), 307);
}

#[test]
fn version_ordering() {
    let history = vec!["alpha".to_string(), "beta".to_string()];
    assert_eq!(version_cmp("v2", "v10", &history), Some(std::cmp::Ordering::Less));
    assert_eq!(version_cmp("12", "step_3", &history), Some(std::cmp::Ordering::Greater));
    assert_eq!(version_cmp("beta", "alpha", &history), Some(std::cmp::Ordering::Greater));
    assert_eq!(version_cmp("gamma", "alpha", &history), None);
    let pin = VersionPin::AtLeast("v3".into());
    assert!(pin.allows(Some("v3"), &[]) && pin.allows(Some("v4"), &[]) && !pin.allows(Some("v2"), &[]));
    assert!(!pin.allows(None, &[]));
    assert!(VersionPin::Exact("x".into()).allows(Some("x"), &[]));
    assert!(!VersionPin::Exact("x".into()).allows(Some("y"), &[]));
}

#[test]
fn policy_names() {
    assert_eq!("capacity".parse::<Policy>(), Ok(Policy::Capacity));
    assert!("cache_aware".parse::<Policy>().unwrap_err().contains("round_robin"));
}

proptest! {
    /// The capacity choice is never an engine with strictly less free space than another.
    #[test]
    fn capacity_is_maximal(raw in proptest::collection::vec((0u64..50, 0u64..20000, 1u64..20000, 0u64..20000), 1..12), rotor in 0usize..100) {
        let loads: Vec<Load> = raw.iter().map(|&(f, e, c, r)| Load { in_flight: f, est_tokens: e, capacity: c, reported_tokens: r }).collect();
        let (i, _) = choose(Policy::Capacity, &loads, 10, None, rotor, &Gate::default()).unwrap();
        prop_assert!(loads.iter().all(|l| l.free() <= loads[i].free()));
    }

    /// An affine engine is kept only when it passes the gate.
    #[test]
    fn affinity_respects_gate(raw in proptest::collection::vec((0u64..20000, 1u64..20000), 1..8), a in 0usize..8, need in 0u64..4000) {
        let loads: Vec<Load> = raw.iter().map(|&(e, c)| Load { in_flight: 0, est_tokens: e, capacity: c, reported_tokens: 0 }).collect();
        let a = a % loads.len();
        let gate = Gate::default();
        let (i, kept) = choose(Policy::Session, &loads, need, Some(a), 0, &gate).unwrap();
        if kept { prop_assert_eq!(i, a); prop_assert!(passes_gate(&loads, a, need, &gate)); }
        else { prop_assert!(!passes_gate(&loads, a, need, &gate)); }
    }
}

proptest! {
    /// Engines report whatever they like (`/v1/loads` numbers up to u64::MAX) and clients ask for
    /// any budget: every policy still picks an index in range, without overflow panics, and an
    /// engine reporting itself fuller than another with the same pool is never preferred by
    /// `capacity`.
    #[test]
    fn extreme_reports_never_panic(
        raw in proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()), 1..6),
        need in any::<u64>(), rotor in any::<usize>(), affine in proptest::option::of(0usize..6),
        prompt_bytes in any::<usize>(), ids in proptest::option::of(any::<usize>()),
        max_new in proptest::option::of(any::<u64>()), cap in proptest::option::of(any::<u64>()),
    ) {
        let loads: Vec<Load> = raw.iter()
            .map(|&(in_flight, est_tokens, capacity, reported_tokens)| Load { in_flight, est_tokens, capacity, reported_tokens })
            .collect();
        let estimate = estimate_tokens(prompt_bytes, ids, max_new, cap);
        prop_assert!(estimate <= MAX_ESTIMATE_TOKENS);
        let affine = affine.filter(|a| *a < loads.len());
        for policy in [Policy::Capacity, Policy::Session, Policy::LeastRequests, Policy::RoundRobin] {
            let (i, _) = choose(policy, &loads, need, affine, rotor, &Gate::default()).unwrap();
            prop_assert!(i < loads.len());
        }
        let _ = mean_utilisation(&loads);
        let full = Load { in_flight: 0, est_tokens: 0, capacity: 1000, reported_tokens: u64::MAX };
        let empty = Load { in_flight: 0, est_tokens: 0, capacity: 1000, reported_tokens: 0 };
        prop_assert_eq!(most_free(&[full, empty], rotor), Some(1));
    }
}

#[test]
fn smg_version_policies_parse_and_pin_as_documented() {
    let history: Vec<String> = ["default", "step-1", "step-2", "step-3"].iter().map(|v| v.to_string()).collect();
    let allowed = |policy: &str| -> Vec<&str> {
        let pin = VersionPolicy::parse(policy).unwrap_or_else(|e| panic!("{policy}: {e}")).pin();
        history
            .iter()
            .map(String::as_str)
            .filter(|v| pin.as_ref().is_none_or(|p| p.allows(Some(v), &history)))
            .collect()
    };
    assert_eq!(allowed("any"), ["default", "step-1", "step-2", "step-3"]);
    assert_eq!(allowed("latest-only"), ["step-3"]);
    assert_eq!(allowed(" max-staleness:0 "), ["step-3"]);
    assert_eq!(allowed("max-staleness:1"), ["step-2", "step-3"]);
    assert_eq!(allowed("max-staleness:99"), ["default", "step-1", "step-2", "step-3"]);
    assert_eq!(allowed("min-version:step-2"), ["step-2", "step-3"]);
    assert!(
        !VersionPin::WithinLast(5).allows(Some("unknown"), &history),
        "a version outside the history is not recent"
    );
    assert!(!VersionPin::Latest.allows(Some("x"), &[]), "no history, no latest");
    for bad in ["", "latest", "min-version:", "max-staleness:-1", "max-staleness:x", "min-version:a b", "ANY"] {
        let err = VersionPolicy::parse(bad).expect_err(bad);
        assert!(err.contains(VERSION_POLICY_GRAMMAR), "{bad}: {err}");
    }
}
