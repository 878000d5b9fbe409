//! Property tests of every parser that reads input the manager does not control: the `serve`
//! command line, the autoscaler's YAML file, and what engines report (`/v1/loads` JSON and
//! `/metrics` text) down to the autoscaler's decision. The property is the same everywhere:
//! any input gives a value or an error that names what to fix; never a panic, never an
//! overflow, never unbounded work.

use crate::autoscaler::metrics::sample_from_loads;
use crate::autoscaler::{
    decide, prom, AutoscalerConfig, EngineSample, FleetState, Histogram, Memory, MetricsWindow, Observation,
    PipelineWindow, Tick,
};
use crate::config::ServeConfig;
use clap::Parser;
use proptest::prelude::*;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    serve: ServeConfig,
}

/// Every long flag of `serve`, so generated command lines hit real flags most of the time.
fn flags() -> Vec<String> {
    use clap::CommandFactory;
    Cli::command().get_arguments().filter_map(|a| a.get_long().map(|l| format!("--{l}"))).collect()
}

/// Values that stress numeric, path and enum flags.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1e308".to_string()),
        Just("NaN".to_string()),
        Just("inf".to_string()),
        Just("4294967296".to_string()),
        Just("18446744073709551616".to_string()),
        Just(String::new()),
        Just("smg=".to_string()),
        Just("/".to_string()),
        any::<u32>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| v.to_string()),
        ".{0,12}",
    ]
}

fn argv() -> impl Strategy<Value = Vec<String>> {
    let names = flags();
    let arg = prop_oneof![
        3 => (proptest::sample::select(names.clone()), value()).prop_map(|(f, v)| format!("{f}={v}")),
        2 => proptest::sample::select(names).prop_map(|f| f),
        2 => value(),
    ];
    proptest::collection::vec(arg, 0..10)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Any command line parses or fails with clap's error; what parses validates or fails
    /// naming a flag that exists.
    #[test]
    fn serve_argv_never_panics(args in argv()) {
        let known = flags();
        let mut full = vec!["rollout-manager".to_string()];
        full.extend(args);
        match Cli::try_parse_from(&full) {
            Ok(cli) => {
                if let Err(e) = cli.serve.validate() {
                    prop_assert!(known.iter().any(|f| f == e.flag), "unknown flag in {e}");
                    prop_assert!(e.to_string().contains(e.flag));
                } else {
                    // What validates is usable: the sizes that drive allocations are bounded.
                    prop_assert!(cli.serve.gpus <= crate::config::MAX_GPUS);
                    prop_assert!(cli.serve.max_engines <= 100_000);
                    let _ = cli.serve.external_allow_list().unwrap();
                }
            }
            Err(e) => {
                let text = e.to_string();
                if e.kind() == clap::error::ErrorKind::InvalidValue || e.kind() == clap::error::ErrorKind::ValueValidation {
                    prop_assert!(text.contains("--"), "clap error names no flag: {text}");
                }
            }
        }
    }
}

/// YAML documents shaped like the autoscaler file, with wrong types, unknown keys and extremes.
fn yaml_doc() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        Just("min_engines"),
        Just("max_engines"),
        Just("enabled"),
        Just("metrics_interval_secs"),
        Just("condition_window_secs"),
        Just("trace_file"),
        Just("scale_out_policy"),
        Just("scale_in_policy"),
        Just("pipeline_policy"),
        Just("max_delta"),
        Just("token_usage_threshold"),
        Just("bogus"),
    ];
    let scalar = prop_oneof![
        Just("0".to_string()),
        Just("-5".to_string()),
        Just(".nan".to_string()),
        Just(".inf".to_string()),
        Just("1e400".to_string()),
        Just("99999999999999999999".to_string()),
        Just("true".to_string()),
        Just("~".to_string()),
        Just("[1, 2]".to_string()),
        Just("{a: 1}".to_string()),
        Just("&a 1".to_string()),
        Just("*a".to_string()),
        Just("!!binary aGk=".to_string()),
        any::<f64>().prop_map(|v| format!("{v}")),
        "[ -~]{0,10}",
    ];
    proptest::collection::vec((0usize..3, key, scalar), 0..8).prop_map(|lines| {
        lines
            .into_iter()
            .map(|(indent, k, v)| format!("{}{k}: {v}", "  ".repeat(indent)))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary text: a valid config or an error naming a field or a line.
    #[test]
    fn autoscaler_yaml_never_panics(text in "(?s).{0,200}") {
        if let Err(e) = AutoscalerConfig::from_yaml(&text) {
            prop_assert!(!e.field.is_empty());
        }
    }

    /// Near-misses of the real file: every accepted config validates, every error names a field.
    #[test]
    fn autoscaler_yaml_near_misses(text in yaml_doc()) {
        match AutoscalerConfig::from_yaml(&text) {
            Ok(c) => prop_assert!(c.validate().is_ok()),
            Err(e) => {
                prop_assert!(!e.field.is_empty());
                prop_assert!(e.to_string().starts_with("invalid autoscaler config: "));
            }
        }
    }
}

#[test]
fn autoscaler_yaml_bombs_are_refused() {
    // Billion laughs: aliases that would expand to 10^9 nodes.
    let mut bomb = String::from("a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n");
    for (prev, next) in ["a", "b", "c", "d", "e", "f", "g", "h"].iter().zip(["b", "c", "d", "e", "f", "g", "h", "i"]) {
        let refs = vec![format!("*{prev}"); 9].join(",");
        bomb.push_str(&format!("{next}: &{next} [{refs}]\n"));
    }
    // The file's fields are scalars and closed structs (unknown fields are errors), so the
    // aliases are refused before anything expands them.
    let e = AutoscalerConfig::from_yaml(&bomb).unwrap_err();
    assert!(!e.field.is_empty(), "{e}");
    let e = AutoscalerConfig::from_yaml(&bomb.replace("i: &i", "trace_file: &i")).unwrap_err();
    assert!(!e.field.is_empty(), "{e}");
    // Deep nesting is an error (the parser's recursion limit), not a stack overflow.
    for deep in ["[".repeat(3_000), "a:\n ".repeat(3_000) + "1", "{a: ".repeat(3_000)] {
        assert!(AutoscalerConfig::from_yaml(&deep).is_err());
    }
}

/// JSON values shaped like a `/v1/loads` answer, numbers anywhere in f64 and u64.
fn loads_body() -> impl Strategy<Value = Value> {
    let number = prop_oneof![
        any::<f64>().prop_filter("JSON numbers are finite", |v| v.is_finite()).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        Just(Value::Null),
        Just(json!("3")),
        Just(json!([1])),
    ];
    let field = prop_oneof![
        Just("num_running_reqs"),
        Just("num_waiting_reqs"),
        Just("num_used_tokens"),
        Just("max_total_num_tokens"),
        Just("gen_throughput"),
        Just("token_usage"),
        Just("dp_rank"),
    ];
    let rank = proptest::collection::btree_map(field, number, 0..8)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()));
    prop_oneof![
        8 => proptest::collection::vec(rank, 0..5).prop_map(|r| json!({"loads": r})),
        1 => Just(json!({"loads": "many"})),
        1 => Just(json!([])),
    ]
}

fn finite(s: &EngineSample) -> bool {
    [s.num_running_reqs, s.num_queue_reqs, s.num_used_tokens, s.max_total_num_tokens, s.token_usage, s.gen_throughput]
        .iter()
        .all(|v| v.is_finite())
}

/// A `/metrics` text with SGLang's gauge and histogram names and hostile values.
fn metrics_text() -> impl Strategy<Value = String> {
    let name = prop_oneof![
        Just("sglang:num_running_reqs"),
        Just("sglang:num_queue_reqs"),
        Just("sglang:token_usage"),
        Just("sglang:gen_throughput"),
        Just("sglang:max_total_num_tokens"),
        Just("sglang:queue_time_seconds_bucket"),
        Just("sglang:time_to_first_token_seconds_bucket"),
    ];
    let num = prop_oneof![
        Just("+Inf".to_string()),
        Just("-Inf".to_string()),
        Just("NaN".to_string()),
        Just("1e308".to_string()),
        Just("-0".to_string()),
        any::<f64>().prop_map(|v| format!("{v:e}")),
    ];
    let line = (name, num.clone(), num, 0u8..3)
        .prop_map(|(n, le, v, rank)| format!("{n}{{le=\"{le}\",dp_rank=\"{rank}\"}} {v}"));
    proptest::collection::vec(line, 0..12).prop_map(|l| l.join("\n"))
}

fn fleet() -> FleetState {
    FleetState {
        live_engines: 2,
        active_engines: 2,
        starting_engines: 0,
        protected_engines: 0,
        capacity_engines: 8,
        operation_in_progress: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// `/v1/loads` from an engine that lies: a sample of finite numbers, or an error.
    #[test]
    fn loads_answers_give_finite_samples_or_errors(body in loads_body()) {
        if let Ok(s) = sample_from_loads(&body) {
            prop_assert!(finite(&s), "{s:?}");
        }
    }

    /// `/metrics` from an engine that lies: parsed, read into a sample and histograms, and
    /// quantiles taken, without panics; and whatever comes out, decide() takes it.
    #[test]
    fn metrics_answers_flow_to_decide_without_panic(text in metrics_text(), loads in loads_body(), q in any::<f64>()) {
        let mut observations = Vec::new();
        if let Ok(samples) = prom::parse(&text) {
            if let Ok(s) = prom::sample_from_metrics(&samples) {
                observations.push(Observation::Sample(s));
            }
            for name in ["sglang:queue_time_seconds", "sglang:time_to_first_token_seconds"] {
                if let Some(h) = prom::histogram(&samples, name) {
                    let _ = h.quantile(q);
                    let _ = h.since(&Histogram::default()).quantile(q);
                }
            }
        }
        if let Ok(s) = sample_from_loads(&loads) {
            observations.push(Observation::Sample(s));
        }
        observations.push(Observation::Missing { missing: "refused".into() });
        let mut window = MetricsWindow::default();
        let config = AutoscalerConfig::default();
        for t in 0..8u32 {
            let at = f64::from(t) * config.metrics_interval_secs;
            let engines = observations.iter().enumerate().map(|(i, o)| (format!("engine_{i}"), o.clone())).collect();
            window.push(Tick { at, engines, router_queued: 0.0 }, config.retention_secs());
        }
        let now = 8.0 * config.metrics_interval_secs;
        let _ = decide(&window, &PipelineWindow::default(), &fleet(), &Memory::default(), &config, now);
    }
}

#[test]
fn loads_sums_that_overflow_f64_are_errors() {
    let big = json!({"num_running_reqs": 1e308, "num_waiting_reqs": 1e308, "token_usage": 1e308});
    let e = sample_from_loads(&json!({"loads": [big.clone(), big]})).unwrap_err();
    assert!(e.contains("out of range"), "{e}");
}
