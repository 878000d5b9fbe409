//! Decision tables and property tests of [`super::decide`].

use super::config::AutoscalerConfig;
use super::decide::{decide, pipeline_delta, rate_delta, seed_delta, Action, FleetState, Memory, Signal};
use super::metrics::{EngineSample, Histogram, MetricsWindow, Observation, Tick};
use super::pipeline::{PipelineReport, PipelineWindow};
use super::state::{parse_trace, replay};
use proptest::prelude::*;

fn sample(usage: f64, queue: f64, throughput: f64) -> Observation {
    Observation::Sample(EngineSample {
        token_usage: usage,
        num_queue_reqs: queue,
        gen_throughput: throughput,
        ..EngineSample::default()
    })
}

/// `engines` engines reporting `obs(i)` at 0, 10, ..., `until` seconds.
fn window(engines: usize, until: u32, obs: impl Fn(u32, usize) -> Observation) -> MetricsWindow {
    let mut w = MetricsWindow::default();
    for t in (0..=until).step_by(10) {
        let tick = Tick {
            at: f64::from(t),
            engines: (0..engines).map(|e| (format!("engine_{e}"), obs(t, e))).collect(),
            router_queued: 0.0,
        };
        w.push(tick, 1e9);
    }
    w
}

fn fleet(live: u32) -> FleetState {
    FleetState {
        live_engines: live,
        active_engines: live,
        starting_engines: 0,
        protected_engines: 0,
        capacity_engines: 8,
        operation_in_progress: None,
    }
}

fn cfg() -> AutoscalerConfig {
    AutoscalerConfig { max_engines: 8, ..AutoscalerConfig::default() }
}

fn report(step: u64, wait: f64, throttled: f64) -> PipelineReport {
    PipelineReport {
        step,
        trainer_wait_secs: wait,
        rollout_throttled_secs: throttled,
        step_secs: 10.0,
        rollout_samples: None,
        next_step_samples: None,
    }
}

/// A 10 s step with rates: rollout made `made` samples, the next step takes `next`.
fn rated(step: u64, wait: f64, throttled: f64, made: u64, next: u64) -> PipelineReport {
    PipelineReport { rollout_samples: Some(made), next_step_samples: Some(next), ..report(step, wait, throttled) }
}

fn pipeline(reports: &[(f64, PipelineReport)]) -> PipelineWindow {
    let mut p = PipelineWindow::default();
    for (at, r) in reports {
        p.push(*at, r.clone());
    }
    p
}

struct Case {
    name: &'static str,
    window: MetricsWindow,
    pipeline: PipelineWindow,
    fleet: FleetState,
    memory: Memory,
    config: AutoscalerConfig,
    now: f64,
    /// The action's name, and its target engine count for scale actions.
    want: (&'static str, Option<u32>),
    /// A word the reason must contain.
    reason: &'static str,
}

fn case(
    name: &'static str,
    window: MetricsWindow,
    now: f64,
    want: (&'static str, Option<u32>),
    reason: &'static str,
) -> Case {
    Case {
        name,
        window,
        pipeline: PipelineWindow::default(),
        fleet: fleet(2),
        memory: Memory::default(),
        config: cfg(),
        now,
        want,
        reason,
    }
}

fn idle(_: u32, _: usize) -> Observation {
    sample(0.05, 0.0, 0.0)
}

/// Work queued at every tick before 200 s, none at 200 s (a scale-in needs an empty queue now).
fn queued_until_now(t: u32, _: usize) -> Observation {
    sample(0.6, if t < 200 { 1.0 } else { 0.0 }, 500.0)
}

fn busy(_: u32, _: usize) -> Observation {
    sample(0.95, 2.0, 1000.0)
}

#[test]
fn decision_table() {
    let hist = |count: f64| Histogram { le: vec![1.0, 10.0], cumulative: vec![0.0, count], count };
    let cases = vec![
        case(
            "usage high for 30s scales out by the seed delta",
            window(2, 30, busy),
            30.0,
            ("scale_out", Some(4)),
            "token_usage_high",
        ),
        case("usage high for only 20s waits", window(2, 20, busy), 20.0, ("none", None), "not yet long enough"),
        case(
            "queue backlog: (50 - 2*5) / 20 = 2 engines",
            window(2, 30, |_, _| sample(0.5, 25.0, 100.0)),
            30.0,
            ("scale_out", Some(4)),
            "queue_backlog",
        ),
        case(
            "a missing engine in the middle resets the timer",
            window(2, 40, |t, e| {
                if t == 20 && e == 1 {
                    Observation::Missing { missing: "timeout".into() }
                } else {
                    busy(t, e)
                }
            }),
            40.0,
            ("none", None),
            "not yet long enough",
        ),
        case(
            "missing data now is never idle",
            window(2, 200, |t, e| {
                if t == 200 && e == 0 {
                    Observation::Missing { missing: "refused".into() }
                } else {
                    idle(t, e)
                }
            }),
            200.0,
            ("none", None),
            "did not answer",
        ),
        case("stale data is no data", window(2, 200, idle), 300.0, ("none", None), "waiting for metrics"),
        case(
            "queue latency P95 from histogram deltas",
            // The first tick has no earlier one to subtract: P95 from t=10 on.
            window(2, 40, |t, _| {
                Observation::Sample(EngineSample {
                    token_usage: 0.5,
                    queue_time: Some(hist(f64::from(t))),
                    ..EngineSample::default()
                })
            }),
            40.0,
            ("scale_out", Some(3)),
            "queue_latency_high",
        ),
        case(
            "unstable throughput blocks scale-in",
            window(3, 200, |t, _| sample(0.05, 0.0, if t % 20 == 0 { 10.0 } else { 100.0 })),
            200.0,
            ("none", None),
            "no condition met",
        ),
    ];
    let mut cases = cases;
    cases.push(Case {
        fleet: fleet(3),
        ..case("idle for 120s scales in by one", window(3, 200, idle), 200.0, ("scale_in", Some(2)), "token_usage_low")
    });
    cases.push(Case {
        fleet: fleet(3),
        ..case(
            "traffic stopped entirely still scales in",
            window(3, 200, |_, _| sample(0.0, 0.0, 0.0)),
            200.0,
            ("scale_in", Some(2)),
            "no_queue",
        )
    });
    cases.push(Case {
        fleet: fleet(3),
        ..case(
            "a queued request blocks scale-in",
            window(3, 200, |t, e| if t == 200 && e == 0 { sample(0.05, 1.0, 0.0) } else { idle(t, e) }),
            200.0,
            ("none", None),
            "",
        )
    });
    cases.push(Case {
        fleet: fleet(2),
        ..case(
            "projected usage after removal too high: 0.29 * 2 / 1 > 0.5",
            window(2, 200, |_, _| sample(0.29, 0.0, 50.0)),
            200.0,
            ("none", None),
            "",
        )
    });
    cases.push(Case {
        config: AutoscalerConfig { min_engines: 2, ..cfg() },
        ..case("at min_engines nothing is removed", window(2, 200, idle), 200.0, ("none", None), "minimum of 2")
    });
    cases.push(Case {
        fleet: FleetState { protected_engines: 2, ..fleet(2) },
        ..case("initial engines are protected", window(2, 200, idle), 200.0, ("none", None), "minimum of 2")
    });
    cases.push(Case {
        memory: Memory { last_scale_out_at: Some(20.0), ..Memory::default() },
        ..case("cooldown after a scale-out", window(2, 60, busy), 60.0, ("none", None), "cooldown after scale-out")
    });
    cases.push(Case {
        fleet: FleetState { operation_in_progress: Some("scale_out abc".into()), ..fleet(2) },
        ..case("an operation in progress blocks everything", window(2, 30, busy), 30.0, ("none", None), "scale_out abc")
    });
    cases.push(Case {
        fleet: FleetState { starting_engines: 2, live_engines: 4, ..fleet(2) },
        memory: Memory { time_to_ready: [40.0, 60.0, 50.0].into(), ..Memory::default() },
        ..case(
            "no cascading scale-out while engines start",
            window(2, 30, busy),
            30.0,
            ("none", None),
            "usually take 50s",
        )
    });
    cases.push(Case {
        config: AutoscalerConfig { min_engines: 3, ..cfg() },
        ..case(
            "below min_engines scales out to it",
            window(2, 10, idle),
            10.0,
            ("scale_out", Some(3)),
            "below min_engines",
        )
    });
    cases.push(Case {
        fleet: FleetState { capacity_engines: 2, ..fleet(2) },
        ..case("at the maximum nothing is added", window(2, 30, busy), 30.0, ("none", None), "maximum of 2")
    });
    cases.push(Case {
        memory: Memory { last_scale_in_at: Some(150.0), ..Memory::default() },
        config: AutoscalerConfig { scale_in_cooldown_secs: 0.0, ..cfg() },
        fleet: fleet(3),
        ..case(
            "evidence from before the last scale event does not count",
            window(3, 200, idle),
            200.0,
            ("none", None),
            "",
        )
    });
    cases.push(Case {
        pipeline: pipeline(&[(170.0, report(1, 5.0, 0.0)), (180.0, report(2, 5.0, 0.0)), (190.0, report(3, 5.0, 0.0))]),
        ..case(
            "a starving trainer scales out: wait 50% -> 2x engines",
            window(2, 200, idle),
            200.0,
            ("scale_out", Some(4)),
            "trainer_starved",
        )
    });
    cases.push(Case {
        pipeline: pipeline(&[(170.0, report(1, 0.0, 5.0)), (180.0, report(2, 0.0, 5.0)), (190.0, report(3, 0.0, 5.0))]),
        fleet: fleet(3),
        ..case(
            "throttled rollout scales in",
            window(3, 200, |_, _| sample(0.6, 0.0, 500.0)),
            200.0,
            ("scale_in", Some(2)),
            "rollout_throttled",
        )
    });
    cases.push(Case {
        pipeline: pipeline(&[(180.0, report(1, 0.0, 0.0)), (190.0, report(2, 0.0, 0.0)), (200.0, report(3, 0.0, 0.0))]),
        ..case("a balanced pipeline overrides busy engines", window(2, 200, busy), 200.0, ("none", None), "pipeline")
    });
    cases.push(Case {
        pipeline: pipeline(&[(180.0, report(1, 3.0, 0.0)), (190.0, report(2, 3.0, 0.0))]),
        ..case("two starving steps are not enough", window(2, 200, idle), 200.0, ("none", None), "")
    });
    cases.push(Case {
        pipeline: pipeline(&[(190.0, report(1, 7.5, 0.0))]),
        ..case(
            "one severely starving step is enough: wait 75% -> 4x engines, capped by max_delta",
            window(2, 200, idle),
            200.0,
            ("scale_out", Some(2 + cfg().scale_out_policy.max_delta)),
            "trainer_starved",
        )
    });
    cases.push(Case {
        pipeline: pipeline(&[(150.0, report(1, 7.5, 0.0)), (190.0, report(2, 0.0, 0.0))]),
        ..case("only the newest step counts as severe", window(2, 200, idle), 200.0, ("none", None), "")
    });
    cases.push(Case {
        // Rollout made 100 samples in 10 s unthrottled (10/s with 2 engines); the trainer, which
        // trained 10 s and did not wait, will take 400 next step (40/s): 2 * 40 * 1.2 / 10 = 9.6
        // engines wanted, 4 more at most (max_delta).
        pipeline: pipeline(&[(190.0, rated(1, 0.0, 0.0, 100, 400))]),
        ..case(
            "a demand jump scales out before the trainer waits",
            window(2, 200, idle),
            200.0,
            ("scale_out", Some(6)),
            "rollout_short",
        )
    });
    cases.push(Case {
        // 2 engines make 10/s, the trainer will take 15/s: 2 * 15 * 1.2 / 10 = 3.6 -> 4 engines.
        pipeline: pipeline(&[(190.0, rated(1, 0.0, 0.0, 100, 150))]),
        ..case(
            "the rate delta keeps the headroom",
            window(2, 200, idle),
            200.0,
            ("scale_out", Some(4)),
            "rollout_short",
        )
    });
    cases.push(Case {
        // Supply 9/s against demand 10/s: a projected wait of 10%, under the 20% threshold.
        pipeline: pipeline(&[(190.0, rated(1, 0.0, 0.0, 90, 100))]),
        ..case("supply just under demand is not short", window(2, 200, idle), 200.0, ("none", None), "")
    });
    cases.push(Case {
        // Supply 12/s against demand 10/s: short of the 20% headroom, but not short: no action.
        pipeline: pipeline(&[(190.0, rated(1, 0.0, 0.0, 120, 100))]),
        ..case("supply above demand does not scale out", window(2, 200, idle), 200.0, ("none", None), "")
    });
    cases.push(Case {
        // Throttled 50% of every step, but 3 engines make 10/s over the 5 s they ran (20/s),
        // so 2 would make 13.3/s against a demand of 12/s: less than 1.2x, so no scale-in.
        pipeline: pipeline(&[
            (170.0, rated(1, 0.0, 5.0, 100, 120)),
            (180.0, rated(2, 0.0, 5.0, 100, 120)),
            (190.0, rated(3, 0.0, 5.0, 100, 120)),
        ]),
        fleet: fleet(3),
        ..case(
            "throttled rollout keeps the engines the next steps need",
            window(3, 200, queued_until_now),
            200.0,
            ("none", None),
            "",
        )
    });
    cases.push(Case {
        // The same with a demand of 10/s: 13.3 >= 12, one engine goes.
        pipeline: pipeline(&[
            (170.0, rated(1, 0.0, 5.0, 100, 100)),
            (180.0, rated(2, 0.0, 5.0, 100, 100)),
            (190.0, rated(3, 0.0, 5.0, 100, 100)),
        ]),
        fleet: fleet(3),
        ..case(
            "throttled rollout with supply to spare scales in",
            window(3, 200, queued_until_now),
            200.0,
            ("scale_in", Some(2)),
            "supply_after_removal",
        )
    });
    cases.push(Case {
        // As two cases above, but nothing was queued while rollout ran: its 20/s is a lower
        // bound on what 3 engines can do, so the rates do not hold the engine back.
        pipeline: pipeline(&[
            (170.0, rated(1, 0.0, 5.0, 100, 120)),
            (180.0, rated(2, 0.0, 5.0, 100, 120)),
            (190.0, rated(3, 0.0, 5.0, 100, 120)),
        ]),
        fleet: fleet(3),
        ..case(
            "rates from an idle fleet do not block a scale-in",
            window(3, 200, |_, _| sample(0.6, 0.0, 500.0)),
            200.0,
            ("scale_in", Some(2)),
            "rollout_throttled",
        )
    });
    cases.push(Case {
        // The step reported at 195 began at 185, before the scale-out finished at 190.
        pipeline: pipeline(&[(195.0, report(1, 7.5, 0.0))]),
        memory: Memory { last_scale_out_at: Some(190.0), ..Memory::default() },
        config: AutoscalerConfig { scale_out_cooldown_secs: 0.0, ..cfg() },
        ..case(
            "a step that straddled the last scale event does not count",
            window(2, 200, idle),
            200.0,
            ("none", None),
            "",
        )
    });
    for c in cases {
        let ev = decide(&c.window, &c.pipeline, &c.fleet, &c.memory, &c.config, c.now);
        let target = match &ev.action {
            Action::ScaleOut { to_engines, .. } | Action::ScaleIn { to_engines, .. } => Some(*to_engines),
            Action::None { .. } => None,
        };
        assert_eq!((ev.action.name(), target), c.want, "{}: {:?}", c.name, ev.action);
        assert!(
            ev.action.reason().contains(c.reason),
            "{}: reason {:?} lacks {:?}",
            c.name,
            ev.action.reason(),
            c.reason
        );
        // The metric label: a word of the fixed list, or the triggered conditions.
        let code = ev.action.reason_code();
        match &ev.action {
            Action::None { .. } => assert!(
                [
                    "operation_in_progress",
                    "engines_starting",
                    "cooldown",
                    "at_maximum",
                    "waiting_for_metrics",
                    "at_minimum",
                    "holding",
                    "no_condition"
                ]
                .contains(&code.as_str()),
                "{}: reason code {code:?}",
                c.name
            ),
            Action::ScaleOut { triggered_conditions, .. } | Action::ScaleIn { triggered_conditions, .. } => {
                assert!(!code.is_empty() && code == triggered_conditions.join("+"), "{}: reason code {code:?}", c.name);
                assert!(code.chars().all(|ch| ch.is_ascii_lowercase() || ch == '_' || ch == '+'), "{code}");
            }
        }
    }
}

#[test]
fn seed_delta_formula() {
    // (usage, queue, engines, max_delta) -> delta
    let cases = [
        ((0.5, 0.0, 4, 4), 1),
        ((0.91, 0.0, 4, 4), 2),
        ((0.95, 0.0, 4, 4), 2),
        ((1.0, 0.0, 4, 4), 3),
        ((0.5, 45.0, 4, 4), 1),
        ((0.5, 100.0, 4, 4), 4),
        ((0.5, 1000.0, 4, 4), 4),
        ((0.99, 0.0, 4, 1), 1),
    ];
    for ((u, q, n, m), want) in cases {
        assert_eq!(seed_delta(u, q, n, m), want, "{u} {q} {n} {m}");
    }
    assert_eq!(pipeline_delta(0.5, 2, 4), 2);
    assert_eq!(pipeline_delta(0.25, 3, 4), 1);
    assert_eq!(pipeline_delta(0.99, 4, 3), 3);
    // (demand, supply, headroom, active, max_delta) -> delta
    assert_eq!(rate_delta(64.0, 32.0, 0.2, 2, 4), 3); // 4.8 -> 5 engines
    assert_eq!(rate_delta(64.0, 32.0, 0.0, 2, 4), 2); // exactly 4, not 5
    assert_eq!(rate_delta(10.0, 9.9, 0.0, 4, 4), 1); // at least 1
    assert_eq!(rate_delta(10.0, 0.0, 0.2, 4, 3), 3); // nothing made: max_delta
}

#[test]
fn the_signal_is_pipeline_while_reports_are_fresh() {
    let p = pipeline(&[(0.0, report(1, 0.0, 0.0))]);
    let w = window(2, 30, idle);
    let c = cfg();
    assert_eq!(decide(&w, &p, &fleet(2), &Memory::default(), &c, 30.0).signal, Signal::Pipeline);
    assert_eq!(decide(&w, &p, &fleet(2), &Memory::default(), &c, 1000.0).signal, Signal::Serving);
}

#[test]
fn replay_follows_the_cadence_and_cooldowns() {
    let mut text = String::from("# a trace\n");
    for t in (0..=300).step_by(10) {
        let usage = if t < 150 { 0.95 } else { 0.05 };
        text.push_str(&format!(
            "{{\"at\": {t}, \"fleet\": {{\"live_engines\": 2, \"active_engines\": 2, \"capacity_engines\": 8}}, \"engines\": {{\"a\": {{\"token_usage\": {usage}}}, \"b\": {{\"token_usage\": {usage}}}}}}}\n"
        ));
    }
    let lines = parse_trace(&text).unwrap();
    let evaluations = replay(cfg(), &lines);
    // Every 30 s from t=30.
    assert_eq!(
        evaluations.iter().map(|e| e.at).collect::<Vec<_>>(),
        (1..=10).map(|i| f64::from(i * 30)).collect::<Vec<_>>()
    );
    let actions: Vec<&str> = evaluations.iter().map(|e| e.action.name()).collect();
    assert_eq!(actions[0], "scale_out");
    assert_eq!(actions[1], "none", "cooldown");
    assert!(parse_trace("{\"at\": 1, \"bogus\": 2}").unwrap_err().contains("line 1"));
    assert!(parse_trace("{\"at\": 1, \"pipeline\": {\"step\": 1, \"trainer_wait_secs\": 5, \"rollout_throttled_secs\": 0, \"step_secs\": 1}}")
        .unwrap_err()
        .contains("trainer_wait_secs"));
}

fn arb_observation() -> impl Strategy<Value = Observation> {
    prop_oneof![
        1 => Just(Observation::Missing { missing: "x".into() }),
        9 => (0.0..1.0f64, prop_oneof![Just(0.0), 0.0..60.0f64], 0.0..500.0f64).prop_map(|(u, q, t)| sample(u, q.floor(), t)),
    ]
}

fn arb_window() -> impl Strategy<Value = MetricsWindow> {
    (1usize..4, proptest::collection::vec(proptest::collection::vec(arb_observation(), 4), 0..20)).prop_map(
        |(n, ticks)| {
            let mut w = MetricsWindow::default();
            for (i, obs) in ticks.into_iter().enumerate() {
                let engines = obs.into_iter().take(n).enumerate().map(|(e, o)| (format!("engine_{e}"), o)).collect();
                w.push(Tick { at: 10.0 * i as f64, engines, router_queued: 0.0 }, 1e9);
            }
            w
        },
    )
}

fn arb_fleet() -> impl Strategy<Value = FleetState> {
    (1u32..10, 0u32..3, 0u32..4, 1u32..12, prop::bool::weighted(0.1)).prop_map(
        |(live, starting, protected, cap, busy)| FleetState {
            live_engines: live,
            active_engines: live.saturating_sub(starting),
            starting_engines: starting.min(live),
            protected_engines: protected.min(live),
            capacity_engines: cap,
            operation_in_progress: busy.then(|| "scale_out x".into()),
        },
    )
}

fn arb_config() -> impl Strategy<Value = AutoscalerConfig> {
    (1u32..4, 0u32..6, 0.0..100.0f64, 0.0..100.0f64, 1u32..5, 0.0..60.0f64).prop_map(|(min, extra, co, ci, md, dur)| {
        let mut c = AutoscalerConfig { min_engines: min, max_engines: min + extra, ..AutoscalerConfig::default() };
        c.scale_out_cooldown_secs = co;
        c.scale_in_cooldown_secs = ci;
        c.scale_out_policy.max_delta = md;
        c.scale_out_policy.condition_duration_secs = dur;
        c.scale_in_policy.condition_duration_secs = dur;
        c.condition_window_secs = 30.0;
        c
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn invariants(window in arb_window(), fleet in arb_fleet(), config in arb_config(),
                  last_out in proptest::option::of(0.0..200.0f64), last_in in proptest::option::of(0.0..200.0f64),
                  reports in proptest::collection::vec((0.0..10.0f64, 0.0..10.0f64), 0..5),
                  now_offset in 0.0..30.0f64) {
        let now = window.latest().map_or(0.0, |m| m.at) + now_offset;
        let memory = Memory { last_scale_out_at: last_out, last_scale_in_at: last_in, ..Memory::default() };
        let mut p = PipelineWindow::default();
        for (i, (w, t)) in reports.iter().enumerate() {
            p.push(now - 5.0 * (reports.len() - i) as f64, report(i as u64, *w, *t));
        }
        let ev = decide(&window, &p, &fleet, &memory, &config, now);
        let ceiling = config.max_engines.min(fleet.capacity_engines);
        let floor = config.min_engines.max(fleet.protected_engines);
        let bounds = |triggered: &Vec<String>| triggered.iter().any(|t| t.ends_with("_engines"));
        match &ev.action {
            Action::ScaleOut { delta, from_engines, to_engines, triggered_conditions, .. } => {
                prop_assert_eq!(*from_engines, fleet.live_engines);
                prop_assert!(*to_engines <= ceiling);
                prop_assert!(*delta >= 1 && to_engines - from_engines == *delta);
                prop_assert!(fleet.operation_in_progress.is_none() && fleet.starting_engines == 0);
                if !bounds(triggered_conditions) {
                    prop_assert!(*delta <= config.scale_out_policy.max_delta);
                    prop_assert!(last_out.is_none_or(|t| now >= t + config.scale_out_cooldown_secs));
                    prop_assert!(last_in.is_none_or(|t| now >= t + config.scale_in_cooldown_secs));
                }
            }
            Action::ScaleIn { delta, from_engines, to_engines, triggered_conditions, .. } => {
                prop_assert_eq!(*delta, 1);
                prop_assert_eq!(*from_engines, fleet.live_engines);
                prop_assert!(*to_engines >= floor);
                prop_assert!(fleet.operation_in_progress.is_none() && fleet.starting_engines == 0);
                let m = ev.metrics.as_ref();
                prop_assert!(m.is_some_and(|m| m.total_queue_reqs <= f64::from(config.scale_in_policy.queue_depth_threshold)));
                prop_assert!(window.latest_tick().is_some_and(Tick::complete));
                if !bounds(triggered_conditions) {
                    prop_assert!(last_out.is_none_or(|t| now >= t + config.scale_out_cooldown_secs));
                    prop_assert!(last_in.is_none_or(|t| now >= t + config.scale_in_cooldown_secs));
                }
            }
            Action::None { .. } => {}
        }
    }
}

#[test]
fn a_pipeline_report_is_decided_on_when_it_arrives() {
    let mut state = super::state::AutoscalerState::new(cfg());
    // A balanced step: nothing to do, and nothing returned (the cadence decides as usual).
    assert!(state.on_report(100.0, report(1, 0.0, 0.0), &fleet(2)).is_none());
    // A step spent 75% waiting: scale out now, without waiting for the next evaluation.
    let decided = state.on_report(101.0, report(2, 7.5, 0.0), &fleet(2)).expect("an action at once");
    assert_eq!(decided.action.name(), "scale_out");
    assert_eq!(state.next_evaluation_in(101.0), Some(cfg().evaluation_interval_secs));
}
