//! The deterministic "model": which token comes next, when generation stops, and fake
//! logprobs.
//!
//! The token at each position is a function of the whole sequence before it (prompt and output
//! so far, through a rolling hash), the sampling seed and the weight version in force when it is
//! produced; its logprob is a function of that sequence, the version and the token. So a
//! request continued elsewhere (a new prompt made of the old prompt plus the first k output
//! tokens, the same seed) produces exactly the tokens and logprobs the original would have
//! produced after k, which is what SGLang gives for greedy decoding and, under
//! `--enable-deterministic-inference`, for seeded sampling (its sampler's noise is a hash of the
//! seed and the token's position: sglang 0.5.23 `layers/sampler.py:934-974`). Each step costs
//! O(1): the context hash is extended by one token.

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

/// The context hash of the empty sequence.
const CTX_EMPTY: u64 = 0x51_7cc1_b727_220a;

/// The context hash of a sequence extended by one token (a rolling hash: extending token by
/// token gives the same value as hashing the whole sequence at once).
pub fn extend_ctx(ctx: u64, id: u32) -> u64 {
    mix64(ctx ^ u64::from(id))
}

/// Context hash of a token sequence.
pub fn hash_ids(ids: &[u32]) -> u64 {
    ids.iter().fold(CTX_EMPTY, |h, id| extend_ctx(h, *id))
}

/// The sampler of greedy decoding: no seed, the same token for the same context.
pub const GREEDY: u64 = 0x6772_6565_6479_0000;

/// The model's logprob of `token` after a context (hash `ctx`) under a weight version: the
/// same function for prompt tokens (input logprobs) and generated ones, so a continued
/// request's prompt logprobs equal the original's output logprobs. Deterministic, in (-4, 0).
pub fn token_logprob(ctx: u64, version_hash: u64, token: u32) -> f64 {
    let h = mix64(ctx ^ version_hash.rotate_left(29) ^ (u64::from(token) << 32) ^ 0x10b9_7c0b);
    -((h % 40_000) as f64 / 10_000.0) - 1e-4
}

/// Logprobs of prompt tokens `from..` (each given the tokens before it). The first one
/// returned has none, as in SGLang, which shifts the prefill's logprobs by one
/// (`managers/scheduler_components/logprob_result_processor.py:26-39`).
pub fn input_logprobs(prompt: &[u32], from: usize, version_hash: u64) -> Vec<(usize, u32, Option<f64>, u64)> {
    let mut ctx = CTX_EMPTY;
    let mut out = Vec::with_capacity(prompt.len().saturating_sub(from));
    for (i, id) in prompt.iter().enumerate() {
        if i >= from {
            let lp = (i > from).then(|| token_logprob(ctx, version_hash, *id));
            out.push((i, *id, lp, ctx));
        }
        ctx = extend_ctx(ctx, *id);
    }
    out
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

/// SGLang 0.5.23's message for a request aborted while it ran (`FINISH_ABORT()`'s default,
/// `managers/schedule_batch.py:332-345`).
pub const ABORTED: &str = "Aborted";
/// ... and for one aborted in the waiting queue (`managers/tokenizer_manager.py:3596`).
pub const ABORTED_WAITING: &str = "Abort in waiting queue";

/// Why a request finished, rendered as SGLang's `meta_info.finish_reason`.
#[derive(Debug, Clone, PartialEq)]
pub enum FinishReason {
    Length(u32),
    StopToken(u32),
    StopStr(String),
    /// Aborted while it ran: the scheduler's `FINISH_ABORT` (four keys).
    Abort(String),
    /// Aborted in the waiting queue: the tokenizer manager's own answer (two keys), made from
    /// what it had received, not from the scheduler's state.
    WaitingAbort(String),
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
            FinishReason::WaitingAbort(msg) => json!({"type": "abort", "message": msg}),
        }
    }

    #[cfg(test)]
    pub fn is_abort(&self) -> bool {
        matches!(self, FinishReason::Abort(_) | FinishReason::WaitingAbort(_))
    }
}

/// Per-request generation state: the output so far and the stop rules.
#[derive(Debug, Clone)]
pub struct GenState {
    /// Context hash of the prompt and the output so far: the next token depends on it.
    ctx: u64,
    seed: u64,
    eos_prob: f64,
    pub max_new: u32,
    min_new: u32,
    ignore_eos: bool,
    stop_ids: Vec<u32>,
    stop_strs: Vec<String>,
    /// The longest stop string in tokens (SGLang's `stop_str_max_len`).
    stop_tokens: usize,
    no_stop_trim: bool,
    skip_special: bool,
    /// Decoded output, kept only when there are stop strings to match.
    stop_text: String,
    max_stop_len: usize,
    pub output: Vec<u32>,
    /// For each output token: the context hash it was produced from and its logprob.
    pub trace: Vec<(u64, f64)>,
    pub spans: Vec<VersionSpan>,
    /// When a stop string matched (and `no_stop_trim` is off): bytes of decoded text to keep.
    pub trim_at: Option<usize>,
}

impl GenState {
    /// `max_new` is the already clipped completion budget; `seed` is the sampler's (see
    /// [`SamplingParams::seed_for`]).
    pub fn new(prompt: &[u32], params: &SamplingParams, seed: u64, max_new: u32, eos_prob: f64) -> Self {
        Self {
            ctx: hash_ids(prompt),
            seed,
            eos_prob,
            max_new,
            min_new: params.min_new_tokens,
            ignore_eos: params.ignore_eos,
            stop_ids: params.stop_token_ids.clone(),
            stop_strs: params.stop_strs.clone(),
            stop_tokens: params.stop_strs.iter().map(|s| tokenizer::encode(s).len()).max().unwrap_or(0),
            no_stop_trim: params.no_stop_trim,
            skip_special: params.skip_special_tokens,
            stop_text: String::new(),
            max_stop_len: params.stop_strs.iter().map(String::len).max().unwrap_or(0),
            output: Vec::new(),
            trace: Vec::new(),
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
        let h = mix64(self.ctx ^ mix64(self.seed ^ version.hash));
        let past_min = pos >= self.min_new;
        let eos_draw = (mix64(h ^ 0x00e0_5e05) >> 11) as f64 / (1u64 << 53) as f64;
        let token = if !self.ignore_eos && past_min && eos_draw < self.eos_prob {
            EOS_ID
        } else {
            let span = u64::from(VOCAB_SIZE - FIRST_WORD_ID);
            FIRST_WORD_ID + u32::try_from(h % span).unwrap_or(0)
        };
        self.trace.push((self.ctx, token_logprob(self.ctx, version.hash, token)));
        self.ctx = extend_ctx(self.ctx, token);
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

    /// Whether a stream must hold back its new tokens because the end of the output could be
    /// the start of a stop string (SGLang's `check_match_stop_str_prefix`,
    /// `managers/schedule_batch.py:1808-1854`): the text of the last `stop_str_max_len + 1`
    /// tokens contains a stop string, or ends with a prefix of one.
    pub fn holds_stop_prefix(&self) -> bool {
        if self.stop_strs.is_empty() || self.output.is_empty() {
            return false;
        }
        let tail_len = (self.stop_tokens + 1).min(self.output.len());
        let tail = tokenizer::decode(&self.output[self.output.len() - tail_len..], false);
        self.stop_strs.iter().any(|stop| {
            tail.contains(stop.as_str())
                || (1..=stop.len().min(tail.len())).any(|i| stop.is_char_boundary(i) && tail.ends_with(&stop[..i]))
        })
    }

    /// The text clients see: decoded output, cut at a matched stop string.
    pub fn text(&self) -> String {
        let mut text = tokenizer::decode(&self.output, self.skip_special);
        if let Some(cut) = self.trim_at {
            text.truncate(cut);
        }
        text
    }

    /// Keeps only the first `n` output tokens (what the tokenizer manager had received when
    /// the request was aborted in the waiting queue); the spans are clipped to them.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.output.len() {
            return;
        }
        self.output.truncate(n);
        self.trace.truncate(n);
        self.trim_at = None;
        let end = u32::try_from(n).unwrap_or(u32::MAX);
        self.spans.retain(|s| s.start < end || s.start == 0);
        for s in &mut self.spans {
            s.end = s.end.min(end);
        }
    }
}

/// `k` fake top alternatives at one position (`seed`: the context hash there): the given
/// token first, then others with lower logprobs.
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

    fn run_seeded(prompt: &[u32], p: &SamplingParams, seed: u64, v: &VersionInfo, max_new: u32, eos: f64) -> GenState {
        let mut g = GenState::new(prompt, p, seed, max_new, eos);
        while g.step(v).is_none() {}
        g
    }

    fn run(prompt: &[u32], p: &SamplingParams, v: &VersionInfo, max_new: u32) -> GenState {
        run_seeded(prompt, p, GREEDY, v, max_new, 0.002)
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
        let d = run_seeded(&[5, 6, 7], &p, 3, &v1, 50, 0.0);
        assert_ne!(a.output, d.output);
    }

    /// The next token depends on the whole context, not on a hash of the prompt plus the output
    /// index: a request continued with its prompt plus its first k tokens produces exactly the
    /// rest of the original output, logprobs included, greedy or seeded.
    #[test]
    fn a_continuation_produces_what_the_original_produced() {
        let p = params(json!({"ignore_eos": true}));
        let v = VersionInfo::new("v1");
        let prompt = [11, 12, 13, 14];
        for seed in [GREEDY, 42, 7] {
            let whole = run_seeded(&prompt, &p, seed, &v, 60, 0.0);
            for k in [1usize, 2, 17, 59] {
                let mut moved: Vec<u32> = prompt.to_vec();
                moved.extend_from_slice(&whole.output[..k]);
                let rest = run_seeded(&moved, &p, seed, &v, 60 - k as u32, 0.0);
                assert_eq!(rest.output, whole.output[k..], "seed {seed} k {k}");
                assert_eq!(rest.trace, whole.trace[k..], "seed {seed} k {k}");
                // The moved prompt's logprobs are the original's output logprobs.
                // (The first prompt logprob returned is always None.)
                let input = input_logprobs(&moved, prompt.len(), v.hash);
                assert_eq!(input[0].2, None);
                let lps: Vec<f64> = input[1..].iter().map(|(_, _, lp, _)| lp.unwrap()).collect();
                let original: Vec<f64> = whole.trace[1..k].iter().map(|(_, lp)| *lp).collect();
                assert_eq!(lps, original, "seed {seed} k {k}");
            }
        }
    }

    #[test]
    fn earlier_tokens_change_the_next_one() {
        let p = params(json!({"ignore_eos": true}));
        let v = VersionInfo::new("v1");
        // Same length, same last token, different start.
        let a = run(&[5, 6, 7], &p, &v, 20);
        let b = run(&[9, 6, 7], &p, &v, 20);
        assert_ne!(a.output, b.output);
    }

    /// EOS is drawn from the context too, so a continuation stops where the original stopped;
    /// min_new_tokens still counts the request's own output.
    #[test]
    fn eos_follows_the_context_and_min_new_counts_own_output() {
        let p = params(json!({}));
        let v = VersionInfo::new("default");
        let (start, whole) = (0..100u32)
            .map(|i| {
                let prompt = vec![i, i + 1];
                let g = run_seeded(&prompt, &p, GREEDY, &v, 400, 0.05);
                (prompt, g)
            })
            .find(|(_, g)| g.output.last() == Some(&EOS_ID) && g.output.len() > 10)
            .expect("an early EOS");
        let k = whole.output.len() - 5;
        let mut moved = start.clone();
        moved.extend_from_slice(&whole.output[..k]);
        let rest = run_seeded(&moved, &p, GREEDY, &v, 400, 0.05);
        assert_eq!(rest.output, whole.output[k..]);
        // With min_new_tokens beyond the EOS position, the continuation runs past it.
        let held = params(json!({"min_new_tokens": 6}));
        let longer = run_seeded(&moved, &held, GREEDY, &v, 400, 0.05);
        assert_ne!(longer.output[4], EOS_ID);
        assert_eq!(longer.output[..4], whole.output[k..k + 4]);
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
    fn the_end_of_the_output_holds_a_stream_when_it_may_start_a_stop_string() {
        let v = VersionInfo::new("default");
        let free = params(json!({"ignore_eos": true}));
        let base = run(&[9, 9], &free, &v, 3);
        let last = tokenizer::token_text(base.output[2]);
        let mut g =
            GenState::new(&[9, 9], &params(json!({"ignore_eos": true, "stop": format!("{last} zzz")})), GREEDY, 3, 0.0);
        g.step(&v);
        g.step(&v);
        assert!(!g.holds_stop_prefix());
        g.step(&v);
        // " <last>" ends with "<last>", the start of the stop string.
        assert!(g.holds_stop_prefix());
        let mut g = GenState::new(&[9, 9], &free, GREEDY, 3, 0.0);
        g.step(&v);
        assert!(!g.holds_stop_prefix(), "no stop strings, no hold");
    }

    #[test]
    fn spans_follow_version_changes() {
        let p = params(json!({"ignore_eos": true}));
        let mut g = GenState::new(&[1], &p, GREEDY, 4, 0.0);
        let (a, b) = (VersionInfo::new("a"), VersionInfo::new("b"));
        g.step(&a);
        g.step(&a);
        g.step(&b);
        assert_eq!(g.step(&b), Some(FinishReason::Length(4)));
        assert_eq!(g.spans.len(), 2);
        assert_eq!((g.spans[1].start, g.spans[1].end), (2, 4));
        let mut cut = g.clone();
        cut.truncate(3);
        assert_eq!(cut.output.len(), 3);
        assert_eq!((cut.spans[1].start, cut.spans[1].end), (2, 3));
        cut.truncate(2);
        assert_eq!(cut.spans.len(), 1);
        g.truncate(0);
        assert_eq!((g.spans.len(), g.spans[0].end), (1, 0));
    }
}
