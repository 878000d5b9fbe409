//! The deterministic "model": which token comes next, when generation stops, and fake
//! logprobs.
//!
//! Output token `p` is a pure function of (hash of the prompt ids, sampling seed, the weight
//! version in force when the token is produced, `p`, the previous token). So the same prompt,
//! seed and weight version always give the same tokens, and a different weight version gives
//! different ones: tests can tell which weights served a request.

use crate::sampling::SamplingParams;
use crate::tokenizer::{self, EOS_ID, FIRST_WORD_ID, VOCAB_SIZE};
use serde_json::{json, Value};
use std::sync::Arc;

/// splitmix64's finaliser: a cheap, well-mixing 64-bit hash step.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Hash of a token sequence.
pub fn hash_ids(ids: &[u32]) -> u64 {
    ids.iter().fold(0x51_7cc1_b727_220a, |h, id| mix64(h ^ u64::from(*id)))
}

/// A weight version and its hash (computed once per version change).
#[derive(Debug, Clone)]
pub struct VersionInfo {
    pub name: Arc<str>,
    pub hash: u64,
}

impl VersionInfo {
    pub fn new(name: &str) -> Self {
        Self { name: Arc::from(name), hash: tokenizer::fnv1a(name.as_bytes()) }
    }
}

/// Output-token span `[start, end)` generated under one weight version.
#[derive(Debug, Clone, PartialEq)]
pub struct VersionSpan {
    pub version: Arc<str>,
    pub start: u32,
    pub end: u32,
}

/// Why a request finished, rendered as SGLang's `meta_info.finish_reason`.
#[derive(Debug, Clone, PartialEq)]
pub enum FinishReason {
    Length(u32),
    StopToken(u32),
    StopStr(String),
    Abort(String),
}

impl FinishReason {
    pub fn to_json(&self) -> Value {
        match self {
            FinishReason::Length(n) => json!({"type": "length", "length": n}),
            FinishReason::StopToken(id) => json!({"type": "stop", "matched": id}),
            FinishReason::StopStr(s) => json!({"type": "stop", "matched": s}),
            FinishReason::Abort(msg) => json!({
                "type": "abort", "message": msg, "status_code": null, "err_type": null
            }),
        }
    }

    pub fn is_abort(&self) -> bool {
        matches!(self, FinishReason::Abort(_))
    }
}

/// Per-request generation state: the output so far and the stop rules.
#[derive(Debug, Clone)]
pub struct GenState {
    prompt_hash: u64,
    last_prompt_id: u32,
    seed: u64,
    eos_prob: f64,
    pub max_new: u32,
    min_new: u32,
    ignore_eos: bool,
    stop_ids: Vec<u32>,
    stop_strs: Vec<String>,
    no_stop_trim: bool,
    skip_special: bool,
    /// Decoded output, kept only when there are stop strings to match.
    stop_text: String,
    max_stop_len: usize,
    pub output: Vec<u32>,
    pub spans: Vec<VersionSpan>,
    /// When a stop string matched (and `no_stop_trim` is off): bytes of decoded text to keep.
    pub trim_at: Option<usize>,
}

impl GenState {
    /// `max_new` is the already clipped completion budget; `sample_index` separates the `n`
    /// parallel samples of one prompt.
    pub fn new(prompt: &[u32], params: &SamplingParams, sample_index: u32, max_new: u32, eos_prob: f64) -> Self {
        Self {
            prompt_hash: hash_ids(prompt),
            last_prompt_id: prompt.last().copied().unwrap_or(0),
            seed: params.seed.wrapping_add(u64::from(sample_index)),
            eos_prob,
            max_new,
            min_new: params.min_new_tokens,
            ignore_eos: params.ignore_eos,
            stop_ids: params.stop_token_ids.clone(),
            stop_strs: params.stop_strs.clone(),
            no_stop_trim: params.no_stop_trim,
            skip_special: params.skip_special_tokens,
            stop_text: String::new(),
            max_stop_len: params.stop_strs.iter().map(String::len).max().unwrap_or(0),
            output: Vec::new(),
            spans: Vec::new(),
            trim_at: None,
        }
    }

    /// A request with `max_new_tokens: 0` finishes without generating anything.
    pub fn finished_before_start(&self) -> Option<FinishReason> {
        (self.max_new == 0).then_some(FinishReason::Length(0))
    }

    /// Produces the next token under `version`; returns why the request finished, if it did.
    pub fn step(&mut self, version: &VersionInfo) -> Option<FinishReason> {
        let pos = u32::try_from(self.output.len()).unwrap_or(u32::MAX);
        let prev = self.output.last().copied().unwrap_or(self.last_prompt_id);
        let h =
            mix64(self.prompt_hash ^ mix64(self.seed ^ mix64(version.hash ^ (u64::from(pos) << 32) ^ u64::from(prev))));
        let past_min = pos >= self.min_new;
        let eos_draw = (mix64(h ^ 0x00e0_5e05) >> 11) as f64 / (1u64 << 53) as f64;
        let token = if !self.ignore_eos && past_min && eos_draw < self.eos_prob {
            EOS_ID
        } else {
            let span = u64::from(VOCAB_SIZE - FIRST_WORD_ID);
            FIRST_WORD_ID + u32::try_from(h % span).unwrap_or(0)
        };
        self.output.push(token);
        match self.spans.last_mut() {
            Some(s) if *s.version == *version.name => s.end = pos + 1,
            _ => self.spans.push(VersionSpan { version: version.name.clone(), start: pos, end: pos + 1 }),
        }

        if token == EOS_ID {
            return Some(FinishReason::StopToken(EOS_ID));
        }
        if past_min && self.stop_ids.contains(&token) {
            return Some(FinishReason::StopToken(token));
        }
        if !self.stop_strs.is_empty() {
            let before = self.stop_text.len();
            tokenizer::push_token_text(&mut self.stop_text, token, self.skip_special);
            if past_min {
                // Only the region that the new token can complete needs searching.
                let mut from = before.saturating_sub(self.max_stop_len);
                while !self.stop_text.is_char_boundary(from) {
                    from -= 1;
                }
                let region = &self.stop_text[from..];
                let hit = self
                    .stop_strs
                    .iter()
                    .filter_map(|s| region.find(s.as_str()).map(|i| (i, s)))
                    .min_by_key(|(i, _)| *i);
                if let Some((i, s)) = hit {
                    if !self.no_stop_trim {
                        self.trim_at = Some(from + i);
                    }
                    return Some(FinishReason::StopStr(s.clone()));
                }
            }
        }
        if self.output.len() >= self.max_new as usize {
            return Some(FinishReason::Length(self.max_new));
        }
        None
    }

    /// The text clients see: decoded output, cut at a matched stop string.
    pub fn text(&self) -> String {
        let mut text = tokenizer::decode(&self.output, self.skip_special);
        if let Some(cut) = self.trim_at {
            text.truncate(cut);
        }
        text
    }
}

/// Fake logprob of `token` at output position `pos` of a prompt: deterministic, in (-4, 0).
pub fn output_logprob(prompt_hash: u64, pos: usize, token: u32) -> f64 {
    let h = mix64(prompt_hash ^ ((pos as u64) << 32) ^ u64::from(token));
    -((h % 40_000) as f64 / 10_000.0) - 1e-4
}

/// Fake logprob of prompt token `i` given the one before it.
pub fn input_logprob(prev: u32, pos: usize, token: u32) -> f64 {
    let h = mix64((u64::from(prev) << 32) ^ (pos as u64) ^ (u64::from(token) << 7));
    -((h % 80_000) as f64 / 10_000.0) - 1e-4
}

/// `k` fake top alternatives at one position: the given token first, then others with lower
/// logprobs.
pub fn top_logprobs(seed: u64, token: u32, lp: f64, k: usize) -> Vec<(f64, u32)> {
    let mut out = Vec::with_capacity(k);
    if k == 0 {
        return out;
    }
    out.push((lp, token));
    let span = u64::from(VOCAB_SIZE - FIRST_WORD_ID);
    let mut cur = lp;
    for i in 1..k {
        let h = mix64(seed ^ (i as u64) ^ (u64::from(token) << 20));
        cur -= 0.1 + (h % 1000) as f64 / 1000.0;
        out.push((cur, FIRST_WORD_ID + u32::try_from(h % span).unwrap_or(0)));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::sampling::RawSamplingParams;
    use serde_json::json;

    fn params(v: Value) -> SamplingParams {
        RawSamplingParams::from_value(v).unwrap().validate().unwrap()
    }

    fn run(prompt: &[u32], p: &SamplingParams, v: &VersionInfo, max_new: u32) -> GenState {
        let mut g = GenState::new(prompt, p, 0, max_new, 0.002);
        while g.step(v).is_none() {}
        g
    }

    #[test]
    fn same_inputs_same_tokens_and_version_changes_them() {
        let p = params(json!({"ignore_eos": true}));
        let v1 = VersionInfo::new("v1");
        let a = run(&[5, 6, 7], &p, &v1, 50);
        let b = run(&[5, 6, 7], &p, &v1, 50);
        assert_eq!(a.output, b.output);
        assert_eq!(a.output.len(), 50);
        let c = run(&[5, 6, 7], &p, &VersionInfo::new("v2"), 50);
        assert_ne!(a.output, c.output);
        let d = run(&[5, 6, 7], &params(json!({"ignore_eos": true, "sampling_seed": 3})), &v1, 50);
        assert_ne!(a.output, d.output);
    }

    #[test]
    fn eos_comes_early_sometimes_but_never_with_ignore_eos() {
        let v = VersionInfo::new("default");
        let p = params(json!({}));
        let mut early = 0;
        for i in 0..200u32 {
            let g = run(&[i, i + 1], &p, &v, 2000);
            if g.output.last() == Some(&EOS_ID) {
                early += 1;
            }
        }
        // eos_prob 0.002 over up to 2000 tokens: most requests stop early, not all.
        assert!(early > 100 && early < 200, "{early}");
        let p = params(json!({"ignore_eos": true}));
        assert_eq!(run(&[1, 2], &p, &v, 3000).output.len(), 3000);
    }

    #[test]
    fn stop_token_and_stop_string() {
        let v = VersionInfo::new("default");
        let base = run(&[9, 9], &params(json!({"ignore_eos": true})), &v, 10);
        let third = base.output[2];
        let g = run(&[9, 9], &params(json!({"ignore_eos": true, "stop_token_ids": [third]})), &v, 10);
        assert_eq!(g.output.len(), 3);
        let word = tokenizer::token_text(base.output[4]);
        let g = run(&[9, 9], &params(json!({"ignore_eos": true, "stop": word.clone()})), &v, 10);
        assert_eq!(g.output.len(), 5);
        assert!(!g.text().contains(&word));
        assert_eq!(g.text(), tokenizer::decode(&base.output[..4], true) + " ");
        let g = run(&[9, 9], &params(json!({"ignore_eos": true, "stop": word.clone(), "no_stop_trim": true})), &v, 10);
        assert!(g.text().ends_with(&word));
    }

    #[test]
    fn spans_follow_version_changes() {
        let p = params(json!({"ignore_eos": true}));
        let mut g = GenState::new(&[1], &p, 0, 4, 0.0);
        let (a, b) = (VersionInfo::new("a"), VersionInfo::new("b"));
        g.step(&a);
        g.step(&a);
        g.step(&b);
        assert_eq!(g.step(&b), Some(FinishReason::Length(4)));
        assert_eq!(g.spans.len(), 2);
        assert_eq!((g.spans[1].start, g.spans[1].end), (2, 4));
    }
}
