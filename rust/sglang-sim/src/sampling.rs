//! `sampling_params`: the exact set of keys SGLang 0.5.x accepts (an unknown key is a 400,
//! as with SGLang's generated request schema), the same defaults, and the same range checks
//! as SGLang's `SamplingParams.verify()`.

use serde::Deserialize;
use std::collections::HashMap;

/// Either one string or a list of strings (`stop`, `stop_regex`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// `sampling_params` as sent. Every key is optional and may be `null` (meaning "default").
/// The field order is the order SGLang lists them in; serde names them in the
/// "unknown field `x`, expected one of ..." error.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[expect(
    dead_code,
    reason = "stop_regex, structural_tag, spaces_between_special_tokens and custom_params are \
              accepted for compatibility but do not change the simulation"
)]
pub struct RawSamplingParams {
    /// Absent: `None`; explicit `null`: `Some(None)` (no limit below the context length).
    #[serde(default, deserialize_with = "present")]
    pub max_new_tokens: Option<Option<i64>>,
    pub stop: Option<OneOrMany>,
    pub stop_token_ids: Option<Vec<Option<i64>>>,
    pub stop_regex: Option<OneOrMany>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub min_new_tokens: Option<i64>,
    pub n: Option<i64>,
    pub json_schema: Option<String>,
    pub regex: Option<String>,
    pub ebnf: Option<String>,
    pub structural_tag: Option<String>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub no_stop_trim: Option<bool>,
    pub custom_params: Option<serde_json::Map<String, serde_json::Value>>,
    pub stream_interval: Option<i64>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub sampling_seed: Option<i64>,
}

/// Keeps "present but null" apart from "absent" for an `Option<Option<T>>` field.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// Default `max_new_tokens` when the key is absent.
pub const DEFAULT_MAX_NEW_TOKENS: u32 = 128;

/// Validated sampling parameters: what the generator and scheduler need.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// `None` means "up to the context length" (an explicit `null`).
    pub max_new_tokens: Option<u32>,
    pub min_new_tokens: u32,
    pub stop_strs: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    pub no_stop_trim: bool,
    /// Number of parallel samples for one prompt.
    pub n: u32,
    /// Temperature 0: greedy decoding, which no seed changes.
    pub greedy: bool,
    /// The request's `sampling_seed` (used only under `--enable-deterministic-inference`).
    pub sampling_seed: Option<i64>,
    /// The request's `stream_interval`; `None` (absent, null or 0) means the server's
    /// `--stream-interval`, as SGLang's `stream_interval or default` does.
    pub stream_interval: Option<i64>,
}

/// The seed SGLang's sampler uses for a request without `sampling_seed` under
/// `--enable-deterministic-inference` (0.5.23 `sampling/sampling_batch_info.py:157-170`).
pub const DEFAULT_SAMPLING_SEED: i64 = 42;

impl SamplingParams {
    /// The seed one output is sampled with. Greedy decoding needs none
    /// ([`crate::generator::GREEDY`]). Sampled decoding uses `sampling_seed` (default 42) only
    /// under `--enable-deterministic-inference`; otherwise SGLang samples with torch's random
    /// generator (0.5.23 `sampling/sampling_batch_info.py:157-170`, `layers/sampler.py:791-848`),
    /// so each output gets a fresh random seed. Every sample of an `n > 1` request shares the
    /// request's sampling parameters, so under the flag they share the seed too.
    pub fn seed_for(&self, deterministic: bool) -> u64 {
        if self.greedy {
            crate::generator::GREEDY
        } else if deterministic {
            // Negative seeds are allowed; reinterpret the bits.
            self.sampling_seed.unwrap_or(DEFAULT_SAMPLING_SEED) as u64
        } else {
            let (hi, lo) = uuid::Uuid::new_v4().as_u64_pair();
            hi ^ lo.rotate_left(32)
        }
    }
}

const SAMPLING_EPS: f64 = 1e-6;
const VOCAB_FOR_BIAS: i64 = crate::tokenizer::VOCAB_SIZE as i64;

impl RawSamplingParams {
    /// Parses one `sampling_params` object. Errors carry serde's message (unknown field, bad
    /// type) for the caller to wrap in a validation error.
    pub fn from_value(v: serde_json::Value) -> Result<Self, String> {
        if v.is_null() {
            return Ok(Self::default());
        }
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    /// Applies defaults and SGLang's range checks.
    pub fn validate(self) -> Result<SamplingParams, String> {
        let temperature = self.temperature.unwrap_or(1.0);
        let top_p = self.top_p.unwrap_or(1.0);
        let min_p = self.min_p.unwrap_or(0.0);
        let top_k = self.top_k.unwrap_or(-1);
        let frequency_penalty = self.frequency_penalty.unwrap_or(0.0);
        let presence_penalty = self.presence_penalty.unwrap_or(0.0);
        let repetition_penalty = self.repetition_penalty.unwrap_or(1.0);
        let min_new_tokens = self.min_new_tokens.unwrap_or(0);
        let n = self.n.unwrap_or(1);

        if !temperature.is_finite() || temperature < 0.0 {
            return Err(format!("temperature must be a non-negative finite number, got {temperature}."));
        }
        let greedy = temperature < SAMPLING_EPS;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {top_p}."));
        }
        if !(0.0..=1.0).contains(&min_p) {
            return Err(format!("min_p must be in [0, 1], got {min_p}."));
        }
        if top_k != -1 && top_k < 1 {
            return Err(format!("top_k must be -1 (disable) or at least 1, got {top_k}."));
        }
        if !(-2.0..=2.0).contains(&frequency_penalty) {
            return Err(format!("frequency_penalty must be in [-2, 2], got {frequency_penalty}."));
        }
        if !(-2.0..=2.0).contains(&presence_penalty) {
            return Err(format!("presence_penalty must be in [-2, 2], got {presence_penalty}."));
        }
        if !(repetition_penalty > 0.0 && repetition_penalty <= 2.0) {
            return Err(format!("repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}."));
        }
        if min_new_tokens < 0 {
            return Err(format!("min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}."));
        }
        let max_new_tokens = match self.max_new_tokens {
            None => Some(i64::from(DEFAULT_MAX_NEW_TOKENS)),
            Some(m) => m,
        };
        if let Some(m) = max_new_tokens {
            if m < 0 {
                return Err(format!("max_new_tokens must be at least 0, got {m}."));
            }
            if min_new_tokens > m {
                return Err(format!("min_new_tokens must be in [0, max_new_tokens({m})], got {min_new_tokens}."));
            }
        }
        if let Some(bias) = &self.logit_bias {
            for key in bias.keys() {
                let ok = key.parse::<i64>().map(|id| (0..VOCAB_FOR_BIAS).contains(&id)).unwrap_or(false);
                if !ok {
                    return Err(format!(
                        "logit_bias key {key} is not a token id between 0 and {}.",
                        VOCAB_FOR_BIAS - 1
                    ));
                }
            }
        }
        let grammars = [&self.json_schema, &self.regex, &self.ebnf].iter().filter(|g| g.is_some()).count();
        if grammars > 1 {
            return Err("set at most one of regex, json_schema and ebnf.".into());
        }
        if n < 1 {
            return Err(format!("n must be at least 1, got {n}."));
        }
        let n = u32::try_from(n).map_err(|_| format!("n is too large: {n}."))?;
        let stop_token_ids = self
            .stop_token_ids
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .filter_map(|id| u32::try_from(id).ok())
            .collect();
        Ok(SamplingParams {
            max_new_tokens: max_new_tokens.map(|m| u32::try_from(m).unwrap_or(u32::MAX)),
            min_new_tokens: u32::try_from(min_new_tokens).unwrap_or(u32::MAX),
            stop_strs: self
                .stop
                .map(OneOrMany::into_vec)
                .unwrap_or_default()
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect(),
            stop_token_ids,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            no_stop_trim: self.no_stop_trim.unwrap_or(false),
            n,
            greedy,
            sampling_seed: self.sampling_seed,
            stream_interval: self.stream_interval.filter(|i| *i != 0),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<SamplingParams, String> {
        RawSamplingParams::from_value(v)?.validate()
    }

    #[test]
    fn defaults() {
        let p = parse(json!({})).unwrap();
        assert_eq!(p.max_new_tokens, Some(128));
        assert!(!p.ignore_eos);
        assert!(p.skip_special_tokens);
        assert_eq!(p.n, 1);
        assert_eq!(parse(serde_json::Value::Null).unwrap(), p);
        assert_eq!(parse(json!({"max_new_tokens": null})).unwrap().max_new_tokens, None);
    }

    #[test]
    fn slime_style_params_are_accepted() {
        let p = parse(json!({
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 64,
            "stop": null, "stop_token_ids": null, "skip_special_tokens": false,
            "no_stop_trim": true, "spaces_between_special_tokens": false,
            "custom_params": {"a": 1}, "sampling_seed": 7, "min_new_tokens": 0,
            "ignore_eos": false, "min_p": 0.0, "repetition_penalty": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "n": 1,
            "logit_bias": {"5": 1.0}, "json_schema": null, "regex": null, "ebnf": null,
            "stop_regex": null, "stream_interval": 1, "structural_tag": null
        }))
        .unwrap();
        assert_eq!(p.max_new_tokens, Some(64));
        assert_eq!((p.sampling_seed, p.stream_interval), (Some(7), Some(1)));
        assert!(p.no_stop_trim);
    }

    /// `sampling_seed` counts only with `--enable-deterministic-inference` (default 42);
    /// without it every sampled output draws fresh randomness.
    #[test]
    fn sampling_seed_counts_only_when_deterministic() {
        let seeded = parse(json!({"sampling_seed": 9})).unwrap();
        assert_eq!(seeded.seed_for(true), 9);
        assert_eq!(parse(json!({})).unwrap().seed_for(true), 42);
        assert_ne!(seeded.seed_for(false), seeded.seed_for(false));
        assert_eq!(parse(json!({"stream_interval": 0})).unwrap().stream_interval, None);
    }

    #[test]
    fn unknown_key_lists_allowed_keys() {
        let err = parse(json!({"max_new_tokens": 4, "foo": 1})).unwrap_err();
        assert!(err.contains("unknown field `foo`"), "{err}");
        assert!(err.contains("`sampling_seed`"), "{err}");
    }

    #[test]
    fn range_checks() {
        assert!(parse(json!({"top_p": 0})).is_err());
        assert!(parse(json!({"top_k": 0})).is_err());
        assert!(parse(json!({"temperature": -1})).is_err());
        assert!(parse(json!({"max_new_tokens": -1})).is_err());
        assert!(parse(json!({"max_new_tokens": 2, "min_new_tokens": 3})).is_err());
        assert!(parse(json!({"regex": "a", "ebnf": "b"})).is_err());
        assert!(parse(json!({"logit_bias": {"99999999": 1.0}})).is_err());
    }

    #[test]
    fn greedy_ignores_seed_and_stop_lists_normalise() {
        let p = parse(json!({"temperature": 0, "sampling_seed": 9, "stop": "x",
                             "stop_token_ids": [5, null]}))
        .unwrap();
        assert_eq!(p.seed_for(true), crate::generator::GREEDY);
        assert_eq!(p.seed_for(false), crate::generator::GREEDY);
        assert_eq!(p.stop_strs, vec!["x".to_string()]);
        assert_eq!(p.stop_token_ids, vec![5]);
    }
}
