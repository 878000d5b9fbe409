//! A small parser of the Prometheus text exposition format (what SGLang's `/metrics` serves),
//! and the reading of SGLang's scheduler gauges and latency histograms out of it.
//!
//! Only what the autoscaler needs: `name{label="value",...} number [timestamp]` lines, with
//! `#` comments skipped. Label values may hold `\\`, `\"` and `\n` escapes. Numbers are
//! floats, `+Inf`, `-Inf` or `NaN`. It never panics (fuzzed by the property tests below).

use super::metrics::{EngineSample, Histogram};
use std::collections::BTreeMap;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct PromSample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl PromSample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A line that is not valid exposition text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct PromError {
    pub line: usize,
    pub message: String,
}

/// Parses a whole exposition; the first bad line is an error naming its number.
pub fn parse(text: &str) -> Result<Vec<PromSample>, PromError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(parse_line(line).map_err(|message| PromError { line: i + 1, message })?);
    }
    Ok(out)
}

fn is_name_char(c: char, first: bool) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':' || (!first && c.is_ascii_digit())
}

fn parse_line(line: &str) -> Result<PromSample, String> {
    let name_end = line.char_indices().find(|(i, c)| !is_name_char(*c, *i == 0)).map_or(line.len(), |(i, _)| i);
    if name_end == 0 {
        return Err("expected a metric name".into());
    }
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, remaining) = parse_labels(after)?;
        labels = parsed;
        rest = remaining;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = fields.next().ok_or("expected a value after the name")?;
    let value = parse_number(value)?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err("unexpected text after the timestamp".into());
    }
    Ok(PromSample { name: name.to_string(), labels, value })
}

/// Parses `k="v",...}` (after the opening brace); returns the labels and the text after `}`.
/// Label pairs in the order written.
type Labels = Vec<(String, String)>;

fn parse_labels(mut s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let key_end =
            s.char_indices().find(|(i, c)| !is_name_char(*c, *i == 0) || *c == ':').map_or(s.len(), |(i, _)| i);
        if key_end == 0 {
            return Err("expected a label name".into());
        }
        let key = s[..key_end].to_string();
        s = s[key_end..].trim_start();
        s = s.strip_prefix('=').ok_or_else(|| format!("expected '=' after label {key}"))?.trim_start();
        s = s.strip_prefix('"').ok_or_else(|| format!("expected '\"' to open the value of label {key}"))?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let Some((i, c)) = chars.next() else { return Err(format!("unterminated value of label {key}")) };
            match c {
                '"' => break i,
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, other)) => return Err(format!("unknown escape \\{other} in label {key}")),
                    None => return Err(format!("unterminated value of label {key}")),
                },
                other => value.push(other),
            }
        };
        labels.push((key, value));
        s = s[end + 1..].trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return Err("expected ',' or '}' after a label".into());
        }
    }
}

fn parse_number(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse::<f64>().map_err(|_| format!("value {s:?} is not a number")),
    }
}

/// Reads SGLang's scheduler gauges and latency histograms. Gauges are grouped by `dp_rank`;
/// within a rank the tensor-parallel copies (`--enable-metrics-for-all-schedulers`) count
/// once (their maximum); ranks are summed, and `token_usage` is their mean. Histogram series
/// (every label set, e.g. `is_streaming`) are summed bucket by bucket.
pub fn sample_from_metrics(samples: &[PromSample]) -> Result<EngineSample, String> {
    // gauge name -> dp_rank -> value
    let mut gauges: BTreeMap<&str, BTreeMap<&str, f64>> = BTreeMap::new();
    for s in samples {
        let Some(gauge) = s.name.strip_prefix("sglang:") else { continue };
        if matches!(
            gauge,
            "num_running_reqs"
                | "num_queue_reqs"
                | "num_used_tokens"
                | "max_total_num_tokens"
                | "token_usage"
                | "gen_throughput"
        ) && s.value.is_finite()
        {
            let rank = s.label("dp_rank").unwrap_or("0");
            let slot = gauges.entry(gauge).or_default().entry(rank).or_insert(f64::NEG_INFINITY);
            *slot = slot.max(s.value);
        }
    }
    let sum = |g: &str| gauges.get(g).map_or(0.0, |r| r.values().sum::<f64>());
    let usage = gauges.get("token_usage").filter(|r| !r.is_empty());
    let (Some(usage), Some(_)) = (usage, gauges.get("num_queue_reqs")) else {
        return Err(
            "no sglang:token_usage / sglang:num_queue_reqs gauges (is the engine started with --enable-metrics?)"
                .into(),
        );
    };
    Ok(EngineSample {
        num_running_reqs: sum("num_running_reqs"),
        num_queue_reqs: sum("num_queue_reqs"),
        num_used_tokens: sum("num_used_tokens"),
        max_total_num_tokens: sum("max_total_num_tokens"),
        token_usage: usage.values().sum::<f64>() / usage.len() as f64,
        gen_throughput: sum("gen_throughput"),
        queue_time: histogram(samples, "sglang:queue_time_seconds"),
        ttft: histogram(samples, "sglang:time_to_first_token_seconds"),
    })
}

/// Sums every series of histogram `name` into one. None when it is absent or malformed.
pub fn histogram(samples: &[PromSample], name: &str) -> Option<Histogram> {
    let bucket = format!("{name}_bucket");
    let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    let mut count = 0.0;
    let mut seen = false;
    for s in samples.iter().filter(|s| s.name == bucket) {
        let le = parse_number(s.label("le")?).ok()?;
        if !s.value.is_finite() || s.value < 0.0 {
            return None;
        }
        seen = true;
        if le.is_infinite() {
            count += s.value;
        } else if le.is_finite() {
            let slot = by_le.entry(ordered_key(le)).or_insert((le, 0.0));
            slot.1 += s.value;
        }
    }
    if !seen {
        return None;
    }
    let (le, cumulative): (Vec<f64>, Vec<f64>) = by_le.into_values().unzip();
    Some(Histogram { le, cumulative, count })
}

/// A key that sorts non-negative finite floats in numeric order.
fn ordered_key(v: f64) -> u64 {
    if v < 0.0 {
        0
    } else {
        v.to_bits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SGLANG_TEXT: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0",dp_rank="0"} 3.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="1",dp_rank="0"} 3.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0",dp_rank="1"} 2.0
sglang:num_queue_reqs{tp_rank="0",dp_rank="0"} 4.0
sglang:num_queue_reqs{tp_rank="0",dp_rank="1"} 1.0
sglang:token_usage{tp_rank="0",dp_rank="0"} 0.5
sglang:token_usage{tp_rank="1",dp_rank="0"} 0.5
sglang:token_usage{tp_rank="0",dp_rank="1"} 0.3
sglang:gen_throughput{dp_rank="0"} 100.0
sglang:gen_throughput{dp_rank="1"} 50.5
sglang:queue_time_seconds_bucket{model_name="m",le="0.1"} 1.0
sglang:queue_time_seconds_bucket{model_name="m",le="1.0"} 3.0
sglang:queue_time_seconds_bucket{model_name="m",le="+Inf"} 4.0
sglang:queue_time_seconds_count{model_name="m"} 4.0
sglang:time_to_first_token_seconds_bucket{is_streaming="false",le="0.5"} 2.0
sglang:time_to_first_token_seconds_bucket{is_streaming="false",le="+Inf"} 2.0
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="0.5"} 1.0
sglang:time_to_first_token_seconds_bucket{is_streaming="true",le="+Inf"} 3.0
"#;

    #[test]
    fn reads_sglang_text_across_tp_and_dp_ranks() {
        let samples = parse(SGLANG_TEXT).unwrap();
        let s = sample_from_metrics(&samples).unwrap();
        // TP copies of rank 0 count once; ranks 0 and 1 are summed.
        assert_eq!(s.num_running_reqs, 5.0);
        assert_eq!(s.num_queue_reqs, 5.0);
        assert!((s.token_usage - 0.4).abs() < 1e-9);
        assert_eq!(s.gen_throughput, 150.5);
        let q = s.queue_time.unwrap();
        assert_eq!((q.le.clone(), q.cumulative.clone(), q.count), (vec![0.1, 1.0], vec![1.0, 3.0], 4.0));
        let t = s.ttft.unwrap();
        assert_eq!((t.cumulative.clone(), t.count), (vec![3.0], 5.0));
    }

    #[test]
    fn labels_with_escapes_and_timestamps() {
        let s = parse(r#"x{a="q\"uo\\te\n",b="{,}"} -1.5e3 1700000000"#).unwrap();
        assert_eq!(s[0].labels, vec![("a".into(), "q\"uo\\te\n".into()), ("b".into(), "{,}".into())]);
        assert_eq!(s[0].value, -1500.0);
        assert_eq!(parse("y +Inf").unwrap()[0].value, f64::INFINITY);
        assert!(parse("z NaN").unwrap()[0].value.is_nan());
        assert_eq!(parse("w{} 2").unwrap()[0].labels, vec![]);
    }

    #[test]
    fn bad_lines_name_their_number() {
        for bad in ["ok 1\nx{a=1} 2", "ok 1\n{a=\"1\"} 2", "ok 1\nx 1 2 3", "ok 1\nx{a=\"1} 2", "ok 1\nx abc"] {
            assert_eq!(parse(bad).unwrap_err().line, 2, "{bad}");
        }
    }

    #[test]
    fn metrics_without_scheduler_gauges_are_an_error() {
        let samples = parse("sglang:num_requests_total 4\n").unwrap();
        assert!(sample_from_metrics(&samples).unwrap_err().contains("--enable-metrics"));
    }

    fn label_value() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![Just('"'), Just('\\'), Just('\n'), Just(','), Just('}'), any::<char>()],
            0..8,
        )
        .prop_map(|v| v.into_iter().collect())
    }

    fn escape(v: &str) -> String {
        v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
    }

    proptest! {
        /// Arbitrary input never panics.
        #[test]
        fn never_panics(text in ".{0,200}") {
            let _ = parse(&text);
        }

        /// Arbitrary bytes shaped like metric lines never panic either.
        #[test]
        fn never_panics_on_near_misses(lines in proptest::collection::vec("[a-z:_]{1,6}(\\{[a-z]{1,3}=\"[^\"]{0,4}\"?,?\\}?)? ?[-+0-9.eInfNa]{0,6}", 0..8)) {
            if let Ok(samples) = parse(&lines.join("\n")) {
                let _ = sample_from_metrics(&samples);
            }
        }

        /// What we render, we read back.
        #[test]
        fn round_trips(name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}",
                       labels in proptest::collection::vec(("[a-zA-Z_][a-zA-Z0-9_]{0,8}", label_value()), 0..4),
                       value in proptest::num::f64::NORMAL | proptest::num::f64::ZERO) {
            let rendered: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
            let line = format!("{name}{{{}}} {value:?}", rendered.join(","));
            let parsed = parse(&line).unwrap();
            prop_assert_eq!(parsed.len(), 1);
            prop_assert_eq!(&parsed[0].name, &name);
            prop_assert_eq!(&parsed[0].labels, &labels);
            prop_assert_eq!(parsed[0].value, value);
        }
    }
}
