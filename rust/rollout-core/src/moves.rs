//! Moving a running generation to another engine: which requests can move, the request that
//! continues one elsewhere, and the single answer the client sees. Pure; the router does the I/O.
//!
//! SGLang makes a move possible with unmodified engines: `/abort_request {"rid"}` ends the
//! request on its engine with the output so far (`output_ids`, `text`, `completion_tokens`,
//! finish reason `abort`), and `/generate` continues from `input_ids` = the prompt's ids plus
//! those output ids, with the rest of the budget. RL trains on token ids, so a prompt is never
//! tokenized again from text: a text prompt moves with the ids its first engine made of it
//! (`return_prompt_token_ids`, which the router asks for; SGLang 0.5.15 and later return them
//! in every answer and stream chunk), and an engine that does not return them cannot have its
//! text requests continued, only started again.

use crate::routing::VersionPin;
use serde_json::{json, Map, Value};

/// SGLang's `max_new_tokens` when a request gives none (`sampling_params.py`).
pub const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// A `/generate` request the router follows part by part: one prompt (ids, or text whose ids the
/// engine returns), one sample. Only a [`continuable`] one moves or runs in chunks; the others
/// stay where they run, and the router ends one whose engine is lost with the output so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Movable {
    /// The prompt's ids; empty for a text prompt (see [`Produced::prompt_ids`]).
    pub prompt_ids: Vec<u64>,
    /// The prompt is text: its ids are learned from the first engine's answer.
    pub text: bool,
    /// The client asked for `prompt_token_ids` itself (else the router's own request for them
    /// is not shown to it).
    pub client_prompt_ids: bool,
    pub max_new_tokens: u64,
    pub min_new_tokens: u64,
    pub stream: bool,
    /// The client's own `rid`, if it gave one (the router gives one otherwise, to abort by).
    pub rid: Option<String>,
    /// It asked for logprobs (`return_logprob`).
    pub logprobs: bool,
    /// A continuation from its output would generate what it would have ([`continuable`]).
    pub continuable: bool,
}

/// `meta_info` fields with one entry per output token: concatenated over a moved request's parts.
const OUTPUT_LOGPROBS: [&str; 3] = ["output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"];
/// `meta_info` fields of the prompt's logprobs: the first part's (a continuation's prompt holds
/// output tokens, whose logprobs are already in the output's).
const INPUT_LOGPROBS: [&str; 3] = ["input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"];

impl Movable {
    /// The request, if it can move: a JSON object with `input_ids` a flat list of token ids,
    /// no `text`/`input_embeds`, at most one sample (`n`), and no hidden states (those are
    /// not joined). Logprobs are: the output's are concatenated over the parts, the prompt's
    /// come from the first part.
    pub fn of(body: &Value) -> Option<Movable> {
        let obj = body.as_object()?;
        if ["input_embeds", "image_data", "audio_data", "video_data"].iter().any(|k| present(obj, k)) {
            return None;
        }
        let text = match (obj.get("text"), present(obj, "input_ids")) {
            (None | Some(Value::Null), true) => false,
            (Some(Value::String(t)), false) if !t.is_empty() => true,
            _ => return None, // a batch, both, or neither
        };
        if obj.get("return_hidden_states").is_some_and(|v| v.as_bool() != Some(false)) {
            return None;
        }
        // One flag for one prompt (a list belongs to a batch).
        if ["return_logprob", "return_text_in_logprobs", "return_prompt_token_ids"]
            .iter()
            .any(|k| obj.get(*k).is_some_and(|v| !v.is_boolean()))
        {
            return None;
        }
        let prompt_ids: Vec<u64> = if text {
            Vec::new()
        } else {
            let ids = obj.get("input_ids")?.as_array()?.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>()?;
            if ids.is_empty() {
                return None;
            }
            ids
        };
        let params = match obj.get("sampling_params") {
            None | Some(Value::Null) => None,
            Some(Value::Object(p)) => Some(p),
            Some(_) => return None,
        };
        let param = |k: &str| params.and_then(|p| p.get(k));
        if param("n").is_some_and(|n| n.as_u64() != Some(1)) {
            return None;
        }
        // Beam search (SGLang 0.5.23) answers with several sequences.
        if param("beam_width").is_some_and(|w| !w.is_null() && w.as_u64() != Some(1)) {
            return None;
        }
        let number = |k: &str, default: u64| match param(k) {
            None | Some(Value::Null) => Some(default),
            Some(v) => v.as_u64(),
        };
        let stream = match obj.get("stream") {
            None | Some(Value::Null) => false,
            Some(v) => v.as_bool()?,
        };
        let rid = match obj.get("rid") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return None,
        };
        Some(Movable {
            logprobs: obj.get("return_logprob").and_then(Value::as_bool).unwrap_or(false),
            client_prompt_ids: obj.get("return_prompt_token_ids").and_then(Value::as_bool).unwrap_or(false),
            text,
            prompt_ids,
            max_new_tokens: number("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)?,
            min_new_tokens: number("min_new_tokens", 0)?,
            stream,
            rid,
            continuable: continuable(body),
        })
    }
}

impl Movable {
    /// What the router adds to the request it sends: a text prompt asks for the ids the engine
    /// makes of it, so that a move continues from exactly those.
    pub fn prepare(&self, body: &mut Value) {
        if self.text {
            if let Some(obj) = body.as_object_mut() {
                obj.insert("return_prompt_token_ids".into(), json!(true));
            }
        }
    }
}

fn present(obj: &Map<String, Value>, key: &str) -> bool {
    obj.get(key).is_some_and(|v| !v.is_null())
}

/// What the engines produced so far, over every part of a moved request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Produced {
    pub text: String,
    pub output_ids: Vec<u64>,
    /// `meta_info.weight_versions` spans, positions in the joined output.
    pub spans: Vec<Value>,
    /// Each move: `{"from", "to", "at_token", "reason"}`.
    pub moves: Vec<Value>,
    /// The engines it ran on, in order.
    pub engines: Vec<String>,
    /// The output's logprob fields (`OUTPUT_LOGPROBS`), concatenated over the parts.
    pub logprobs: Map<String, Value>,
    /// The prompt's logprob fields (`INPUT_LOGPROBS`), from the first part that had output.
    pub input_logprobs: Option<Map<String, Value>>,
    /// A text prompt's ids, as its first engine made them (`prompt_token_ids`).
    pub prompt_ids: Option<Vec<u64>>,
    /// Whether its engines stream incrementally (each event only the new output), once an
    /// earlier part's events told (a first event of one token cannot).
    pub stream_incremental: Option<bool>,
}

impl Produced {
    /// Learns a text prompt's ids from the first answer or chunk that carries them.
    pub fn learn_prompt(&mut self, answer: &Value) {
        if self.prompt_ids.is_none() {
            let ids = answer.get("prompt_token_ids").and_then(Value::as_array);
            self.prompt_ids = ids.and_then(|ids| ids.iter().map(Value::as_u64).collect());
        }
    }

    /// The prompt's ids, if known: the request's own, or those learned for its text.
    pub fn prompt<'a>(&'a self, movable: &'a Movable) -> Option<&'a [u64]> {
        if movable.text {
            self.prompt_ids.as_deref()
        } else {
            Some(&movable.prompt_ids)
        }
    }

    /// Appends one part's (or one incremental stream chunk's) output logprobs, and keeps the
    /// prompt's from the first part.
    pub fn add_logprobs(&mut self, answer: &Value) {
        let Some(meta) = answer.get("meta_info").and_then(Value::as_object) else { return };
        if self.input_logprobs.is_none() && self.output_ids.is_empty() {
            let input: Map<String, Value> =
                INPUT_LOGPROBS.iter().filter_map(|k| Some((k.to_string(), meta.get(*k)?.clone()))).collect();
            if !input.is_empty() {
                self.input_logprobs = Some(input);
            }
        }
        for key in OUTPUT_LOGPROBS {
            if let Some(entries) = meta.get(key).and_then(Value::as_array) {
                let all = self.logprobs.entry(key).or_insert_with(|| json!([]));
                if let Some(all) = all.as_array_mut() {
                    all.extend(entries.iter().cloned());
                }
            }
        }
    }

    /// Adds the output of one finished part (`answer`: an engine's final `/generate` object).
    pub fn add_part(&mut self, answer: &Value) {
        if self.output_ids.is_empty() {
            self.learn_prompt(answer);
        }
        self.add_logprobs(answer);
        let start = self.output_ids.len() as u64;
        if let Some(t) = answer.get("text").and_then(Value::as_str) {
            self.text.push_str(t);
        }
        if let Some(ids) = answer.get("output_ids").and_then(Value::as_array) {
            self.output_ids.extend(ids.iter().filter_map(Value::as_u64));
        }
        let spans = answer.pointer("/meta_info/weight_versions").and_then(Value::as_array);
        let end = self.output_ids.len() as u64;
        if spans.is_none_or(|s| s.is_empty()) && end > start {
            // A stream's events before the last carry no spans: the part ran on the version
            // its events name.
            if let Some(v) = answer.pointer("/meta_info/weight_version").and_then(Value::as_str) {
                self.spans.push(json!({"start": start, "end": end, "version": v}));
            }
            return;
        }
        for span in spans.into_iter().flatten() {
            let mut span = span.clone();
            for k in ["start", "end"] {
                if let Some(v) = span.get(k).and_then(Value::as_u64) {
                    span[k] = json!(v + start);
                }
            }
            self.spans.push(span);
        }
    }
}

/// The request that continues `original` (a [`Movable`] body) after `produced` output tokens
/// of a prompt whose ids are `prompt`: the same fields and sampling parameters, `input_ids` the
/// prompt's ids extended by the output so far (a text prompt's `text` replaced by them), the
/// rest of the budget, and a fresh `rid` (`new_rid`). None when nothing is left to generate.
pub fn continuation(
    original: &Value,
    movable: &Movable,
    prompt: &[u64],
    produced: &[u64],
    new_rid: &str,
) -> Option<Value> {
    let done = produced.len() as u64;
    if done >= movable.max_new_tokens {
        return None;
    }
    let mut body = original.clone();
    let obj = body.as_object_mut()?;
    let ids: Vec<Value> = prompt.iter().chain(produced).map(|&i| json!(i)).collect();
    obj.remove("text");
    if !movable.client_prompt_ids {
        obj.remove("return_prompt_token_ids");
    }
    obj.insert("input_ids".into(), Value::Array(ids));
    obj.insert("rid".into(), json!(new_rid));
    if movable.logprobs {
        // The continuation's prompt logprobs would be the output's again: not asked for.
        obj.insert("logprob_start_len".into(), json!(-1));
    }
    let params = obj.entry("sampling_params").or_insert_with(|| json!({}));
    if params.is_null() {
        *params = json!({});
    }
    let params = params.as_object_mut()?;
    params.insert("max_new_tokens".into(), json!(movable.max_new_tokens - done));
    if movable.min_new_tokens > 0 {
        params.insert("min_new_tokens".into(), json!(movable.min_new_tokens.saturating_sub(done)));
    }
    Some(body)
}

/// The budget of a request's next part when it is generated in chunks of `chunk` tokens
/// (`--chunk-tokens`, 0: off) after `done` output tokens: `Some(chunk)` when more than one
/// chunk of the request's budget is left (the part stops there and the request continues from
/// the router's queue), None when the rest fits in one part (it runs to the request's end).
pub fn chunk_cap(movable: &Movable, done: u64, chunk: u64) -> Option<u64> {
    (chunk > 0 && movable.max_new_tokens.saturating_sub(done) > chunk).then_some(chunk)
}

/// Whether a request may continue from its output on another engine (a move) or in another
/// part (a chunk): nothing in it depends on the output generated so far in a way a continuation
/// would lose. A continuation's engine sees that output as prompt (SGLang 0.5.23), so a stop
/// string could straddle the boundary (its check decodes the output ids only), a grammar
/// (`regex`, `json_schema`, `ebnf`, `structural_tag`) would start again, output penalties
/// (`frequency_penalty`, `presence_penalty`, `repetition_penalty`, which count output tokens)
/// would forget what they counted, and so would a custom logit processor, a watermark and
/// `max_thinking_tokens` (which counts from the request's start). Such requests never move and
/// run in one part: a drain waits for them, and a lost engine ends them with their output.
pub fn continuable(body: &Value) -> bool {
    if ["custom_logit_processor", "max_thinking_tokens"].iter().any(|k| body.get(*k).is_some_and(|v| !v.is_null())) {
        return false;
    }
    let Some(params) = body.get("sampling_params").and_then(Value::as_object) else { return true };
    let set = |k: &str| match params.get(k) {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    let number_is = |k: &str, neutral: f64| params.get(k).and_then(Value::as_f64).is_none_or(|v| v == neutral);
    !["stop", "stop_regex", "regex", "json_schema", "ebnf", "structural_tag", "watermark"].iter().any(|k| set(k))
        && number_is("frequency_penalty", 0.0)
        && number_is("presence_penalty", 0.0)
        && number_is("repetition_penalty", 1.0)
}

/// Limits a part's request (`body`, the client's or a [`continuation`]) to `cap` new tokens:
/// `max_new_tokens` becomes `cap`, and a `min_new_tokens` left above it is lowered to it (the
/// rest of it goes with the next part). False when the body has no object to change.
pub fn cap_part(body: &mut Value, cap: u64) -> bool {
    let Some(obj) = body.as_object_mut() else { return false };
    let params = obj.entry("sampling_params").or_insert_with(|| json!({}));
    if params.is_null() {
        *params = json!({});
    }
    let Some(params) = params.as_object_mut() else { return false };
    params.insert("max_new_tokens".into(), json!(cap));
    if let Some(min) = params.get("min_new_tokens").and_then(Value::as_u64) {
        params.insert("min_new_tokens".into(), json!(min.min(cap)));
    }
    true
}

/// Whether a part limited to `cap` tokens ([`chunk_cap`]) stopped at that limit, so that the
/// request goes on (rather than at a stop token, a stop string or an abort, which end it or
/// move it): its finish reason is `length` and it produced `cap` tokens (`completion_tokens`,
/// which an incremental stream's events count from the part's start too).
pub fn chunk_ended(answer: &Value, cap: u64) -> bool {
    answer.pointer("/meta_info/finish_reason/type").and_then(Value::as_str) == Some("length")
        && answer.pointer("/meta_info/completion_tokens").and_then(Value::as_u64) == Some(cap)
}

/// The answer the client sees for a moved, non-streamed request: `last` (the final part's
/// answer) with the joined text and ids, the original prompt's token count, the total output
/// count, the spans of every part, and the moves (`meta_info.moves`, `meta_info.engines`).
/// `before` holds the parts before the last one.
pub fn joined(before: &Produced, movable: &Movable, last: &Value) -> Value {
    let mut all = before.clone();
    all.add_part(last);
    let mut out = last.clone();
    rewrite(&mut out, before, &all, movable, false);
    out
}

/// One stream chunk of the part running now, as the client sees it: cumulative fields
/// (`text`, `output_ids`) prefixed with the output of the earlier parts (`before`) unless the
/// engine streams incrementally, and the counts and spans of the whole request.
pub fn joined_chunk(before: &Produced, movable: &Movable, chunk: &Value, incremental: bool) -> Value {
    let mut now = before.clone();
    if !incremental {
        now.add_part(chunk);
    } else {
        // Counts only: the chunk's ids are the new ones.
        let n = chunk.get("output_ids").and_then(Value::as_array).map_or(0, Vec::len);
        now.output_ids.extend(std::iter::repeat_n(0, n));
    }
    let mut out = chunk.clone();
    rewrite(&mut out, before, &now, movable, incremental);
    out
}

/// The request sent again from the start (`original` with a fresh `rid`): a text prompt whose
/// ids its engine did not return cannot be continued.
pub fn restart(original: &Value, new_rid: &str) -> Value {
    let mut body = original.clone();
    if let Some(obj) = body.as_object_mut() {
        obj.insert("rid".into(), json!(new_rid));
    }
    body
}

fn rewrite(out: &mut Value, before: &Produced, all: &Produced, movable: &Movable, incremental: bool) {
    if movable.text {
        // The ids the router asked for: the first engine's, and only if the client asked too.
        if let Some(obj) = out.as_object_mut() {
            match (movable.client_prompt_ids, &all.prompt_ids) {
                (true, Some(ids)) if !(before.moves.is_empty() && before.output_ids.is_empty()) => {
                    obj.insert("prompt_token_ids".into(), json!(ids));
                }
                (true, _) => {}
                (false, _) => {
                    obj.remove("prompt_token_ids");
                }
            }
        }
    }
    if before.moves.is_empty() && before.output_ids.is_empty() {
        return; // one part: the engine's answer as it is
    }
    if !incremental {
        out["text"] = json!(all.text);
        out["output_ids"] = json!(all.output_ids);
    }
    let Some(meta) = out.get_mut("meta_info").and_then(Value::as_object_mut) else { return };
    if let Some(prompt) = all.prompt(movable) {
        meta.insert("prompt_tokens".into(), json!(prompt.len()));
    }
    let part = meta.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0);
    let total = part + before.output_ids.len() as u64;
    meta.insert("completion_tokens".into(), json!(total));
    // A length finish counts the whole output, not the last part's.
    if let Some(finish) = meta.get_mut("finish_reason").and_then(Value::as_object_mut) {
        if finish.get("type").and_then(Value::as_str) == Some("length") {
            finish.insert("length".into(), json!(total));
        }
    }
    if !incremental {
        // Every part's spans, the last one's from its own or from the version it names.
        meta.insert("weight_versions".into(), Value::Array(all.spans.clone()));
    } else if !all.spans.is_empty() {
        let mut spans = before.spans.clone();
        let start = before.output_ids.len() as u64;
        for span in meta.get("weight_versions").and_then(Value::as_array).into_iter().flatten() {
            let mut span = span.clone();
            for k in ["start", "end"] {
                if let Some(v) = span.get(k).and_then(Value::as_u64) {
                    span[k] = json!(v + start);
                }
            }
            spans.push(span);
        }
        meta.insert("weight_versions".into(), Value::Array(spans));
    }
    if movable.logprobs {
        for key in OUTPUT_LOGPROBS {
            if !incremental && meta.contains_key(key) {
                meta.insert(key.into(), all.logprobs.get(key).cloned().unwrap_or_else(|| json!([])));
            }
        }
        for key in INPUT_LOGPROBS {
            if meta.contains_key(key) {
                let first = before.input_logprobs.as_ref().and_then(|m| m.get(key));
                // Incremental chunks sent the prompt's logprobs with the first part already.
                let value = if incremental { None } else { first.cloned() };
                meta.insert(key.into(), value.unwrap_or_else(|| json!([])));
            }
        }
    }
    meta.insert("moves".into(), Value::Array(all.moves.clone()));
    meta.insert("engines".into(), json!(all.engines));
}

/// Whether an engine's final answer (or last stream chunk) ended because it was aborted.
pub fn aborted(answer: &Value) -> bool {
    answer.pointer("/meta_info/finish_reason/type").and_then(Value::as_str) == Some("abort")
}

/// Whether an engine's answer or stream event, as bytes, may have ended aborted: false only
/// when it surely did not (no `"abort"` string in it), so that an answer that did not is passed
/// on without being parsed. JSON writes the finish reason's type as a plain string, and the
/// word inside another string has its quotes escaped.
pub fn may_be_aborted(raw: &[u8]) -> bool {
    memchr::memmem::find(raw, b"\"abort\"").is_some()
}

/// `raw` (a JSON object's bytes) without its top-level member `key`, whose value it skips
/// whatever it is; None when `raw` is not an object or has no such member. A byte scan, not a
/// parse: the router takes the `prompt_token_ids` it asked for out of every answer and event of
/// a text prompt this way. Keys are compared as written (engines do not escape ASCII).
pub fn without_member(raw: &[u8], key: &str) -> Option<Vec<u8>> {
    let key = key.as_bytes();
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    // Within the top-level object: where the current member starts, the comma before it (None
    // for the first), whether its key is still to come, and where its key's string started.
    let mut member_start = 0usize;
    let mut comma: Option<usize> = None;
    let mut expect_key = false;
    let mut key_start = 0usize;
    let mut found = false;
    let mut i = 0usize;
    while i < raw.len() {
        let b = raw[i];
        i += 1;
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
                if depth == 1 && expect_key {
                    expect_key = false;
                    found = &raw[key_start..i - 1] == key;
                }
            } else {
                // The rest of a string up to its next quote or backslash is skipped at once.
                i = memchr::memchr2(b'"', b'\\', &raw[i..]).map_or(raw.len(), |n| i + n);
            }
            continue;
        }
        let i = i - 1;
        match b {
            b'"' => {
                in_string = true;
                key_start = i + 1;
            }
            b'{' | b'[' => {
                if depth == 0 {
                    if b != b'{' {
                        return None;
                    }
                    member_start = i + 1;
                    expect_key = true;
                }
                depth += 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return found.then(|| cut(raw, comma.unwrap_or(member_start), i));
                }
            }
            b',' if depth == 1 => {
                if found {
                    // The first member takes the comma after it; any other, the one before it.
                    return Some(match comma {
                        Some(c) => cut(raw, c, i),
                        None => cut(raw, member_start, i + 1),
                    });
                }
                comma = Some(i);
                member_start = i + 1;
                expect_key = true;
            }
            _ if depth == 0 && !b.is_ascii_whitespace() => return None,
            _ => {}
        }
    }
    None
}

fn cut(raw: &[u8], from: usize, to: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() - (to - from));
    out.extend_from_slice(&raw[..from]);
    out.extend_from_slice(&raw[to..]);
    out
}

/// The engines a moving request may continue on: by default only those on the version its
/// last part ran on (`from`), so one answer never mixes two policies' tokens; the request's own
/// pin already holds for that version. A request that allows crossing versions (partial
/// rollout) keeps its own pin, if any. A part whose engine's version is unknown keeps the pin.
pub fn target_pin(request: Option<&VersionPin>, from: Option<&str>, may_cross: bool) -> Option<VersionPin> {
    match (may_cross, from) {
        (false, Some(v)) => Some(VersionPin::Exact(v.to_string())),
        _ => request.cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_move_stays_on_its_version_unless_it_may_cross() {
        let exact = |v: &str| Some(VersionPin::Exact(v.into()));
        let min = VersionPin::AtLeast("v2".into());
        type Case<'a> = (Option<&'a VersionPin>, Option<&'a str>, bool, Option<VersionPin>);
        let cases: [Case; 6] = [
            (None, Some("v3"), false, exact("v3")),
            (Some(&min), Some("v3"), false, exact("v3")),
            (None, Some("v3"), true, None),
            (Some(&min), Some("v3"), true, Some(min.clone())),
            (None, None, false, None),
            (Some(&min), None, false, Some(min.clone())),
        ];
        for (request, from, cross, want) in cases {
            assert_eq!(target_pin(request, from, cross), want, "{request:?} {from:?} {cross}");
        }
    }

    fn part(text: &str, ids: &[u64], version: &str) -> Value {
        json!({
            "text": text, "output_ids": ids,
            "meta_info": {"prompt_tokens": 99, "completion_tokens": ids.len(),
                          "finish_reason": {"type": "length", "length": ids.len()},
                          "weight_versions": [{"start": 0, "end": ids.len(), "version": version}]}
        })
    }

    #[test]
    fn only_one_prompt_of_ids_and_one_sample_moves() {
        let table = [
            (json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}}), true),
            (json!({"input_ids": [1, 2]}), true),
            (json!({"input_ids": [1, 2], "stream": true, "rid": "a"}), true),
            (json!({"input_ids": [1, 2], "sampling_params": {"n": 1}}), true),
            (json!({"text": "hi"}), true),
            (json!({"text": ""}), false),
            (json!({"text": ["a", "b"]}), false),
            (json!({"text": "hi", "input_ids": [1]}), false),
            (json!({"text": "hi", "return_prompt_token_ids": "yes"}), false),
            (json!({"input_ids": [[1], [2]]}), false),
            (json!({"input_ids": []}), false),
            (json!({"input_ids": [1], "sampling_params": {"n": 2}}), false),
            (json!({"input_ids": [1], "sampling_params": {"beam_width": 4}}), false),
            (json!({"input_ids": [1], "sampling_params": {"beam_width": null}}), true),
            (json!({"input_ids": [1], "return_logprob": true}), true),
            (json!({"input_ids": [1], "return_logprob": [true]}), false),
            (json!({"input_ids": [1], "return_hidden_states": true}), false),
            (json!({"input_ids": [1], "return_logprob": false}), true),
            (json!({"input_ids": [1], "rid": ["a", "b"]}), false),
            (json!({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}), false),
            (json!([1, 2]), false),
        ];
        for (body, want) in table {
            assert_eq!(Movable::of(&body).is_some(), want, "{body}");
        }
        let m = Movable::of(&json!({"input_ids": [5], "stream": true})).unwrap();
        assert_eq!((m.max_new_tokens, m.min_new_tokens, m.stream), (DEFAULT_MAX_NEW_TOKENS, 0, true));
    }

    #[test]
    fn a_continuation_carries_the_output_so_far_and_the_rest_of_the_budget() {
        let body = json!({"input_ids": [1, 2], "rid": "r", "stream": true,
                          "sampling_params": {"max_new_tokens": 10, "min_new_tokens": 4, "temperature": 0.7}});
        let m = Movable::of(&body).unwrap();
        let next = continuation(&body, &m, &m.prompt_ids, &[7, 8, 9], "r-m1").unwrap();
        assert_eq!(next["input_ids"], json!([1, 2, 7, 8, 9]));
        assert_eq!(next["rid"], "r-m1");
        assert_eq!(next["stream"], true);
        assert_eq!(next["sampling_params"], json!({"max_new_tokens": 7, "min_new_tokens": 1, "temperature": 0.7}));
        assert_eq!(continuation(&body, &m, &m.prompt_ids, &[0; 10], "x"), None, "nothing left to generate");
    }

    #[test]
    fn a_moved_answer_reads_as_one() {
        let m = Movable::of(&json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}})).unwrap();
        let mut before = Produced::default();
        before.add_part(&part("ab", &[10, 11], "v1"));
        before.engines = vec!["engine_0".into()];
        before.moves = vec![json!({"from": "engine_0", "to": "engine_1", "at_token": 2, "reason": "drain"})];
        let mut last = part("cde", &[12, 13, 14], "v1");
        last["meta_info"]["prompt_tokens"] = json!(5);
        let mut engines = before.clone();
        engines.engines.push("engine_1".into());
        let out = joined(&engines, &m, &last);
        assert_eq!(out["text"], "abcde");
        assert_eq!(out["output_ids"], json!([10, 11, 12, 13, 14]));
        let meta = &out["meta_info"];
        assert_eq!(meta["prompt_tokens"], 3, "the original prompt, not the continuation's");
        assert_eq!(meta["completion_tokens"], 5);
        assert_eq!(
            meta["weight_versions"],
            json!([{"start": 0, "end": 2, "version": "v1"}, {"start": 2, "end": 5, "version": "v1"}])
        );
        assert_eq!(meta["engines"], json!(["engine_0", "engine_1"]));
        assert_eq!(meta["moves"][0]["at_token"], 2);
        assert_eq!(meta["finish_reason"], json!({"type": "length", "length": 5}), "the whole output's length");
    }

    #[test]
    fn logprobs_are_joined_output_over_the_parts_and_the_prompts_from_the_first() {
        let m = Movable::of(&json!({"input_ids": [1, 2], "return_logprob": true})).unwrap();
        let lp = |ids: &[u64]| -> Vec<Value> { ids.iter().map(|&i| json!([-0.5, i, null])).collect() };
        let with_lp = |text: &str, ids: &[u64], input: &[u64]| {
            let mut p = part(text, ids, "v1");
            p["meta_info"]["output_token_logprobs"] = json!(lp(ids));
            p["meta_info"]["input_token_logprobs"] = json!(lp(input));
            p
        };
        let mut before = Produced::default();
        before.add_part(&with_lp("ab", &[10, 11], &[1, 2]));
        before.engines = vec!["engine_0".into(), "engine_1".into()];
        before.moves = vec![json!({"at_token": 2})];
        let out = joined(&before, &m, &with_lp("c", &[12], &[11]));
        assert_eq!(out["meta_info"]["output_token_logprobs"], json!(lp(&[10, 11, 12])));
        assert_eq!(out["meta_info"]["input_token_logprobs"], json!(lp(&[1, 2])), "the original prompt's");
        let chunk = joined_chunk(&before, &m, &with_lp("c", &[12], &[11]), true);
        assert_eq!(chunk["meta_info"]["output_token_logprobs"], json!(lp(&[12])), "incremental: the new ones");
        assert_eq!(chunk["meta_info"]["input_token_logprobs"], json!([]), "sent with the first part");
        let body = json!({"input_ids": [1, 2], "return_logprob": true, "logprob_start_len": 0});
        let next = continuation(&body, &m, &m.prompt_ids, &[10, 11], "r-m1").unwrap();
        assert_eq!(next["logprob_start_len"], -1, "the continuation's prompt logprobs are not asked for");
    }

    #[test]
    fn a_text_prompt_moves_with_the_ids_its_first_engine_made() {
        let body = json!({"text": "hello there", "sampling_params": {"max_new_tokens": 6}});
        let m = Movable::of(&body).unwrap();
        assert!(m.text && m.prompt_ids.is_empty() && !m.client_prompt_ids);
        let mut sent = body.clone();
        m.prepare(&mut sent);
        assert_eq!(sent["return_prompt_token_ids"], true);
        let mut first = part("ab", &[10, 11], "v1");
        first["prompt_token_ids"] = json!([7, 8, 9]);
        let mut before = Produced::default();
        before.add_part(&first);
        assert_eq!(before.prompt(&m), Some(&[7u64, 8, 9][..]));
        let next = continuation(&sent, &m, before.prompt(&m).unwrap(), &before.output_ids, "r-m1").unwrap();
        assert_eq!(next["input_ids"], json!([7, 8, 9, 10, 11]));
        assert!(next.get("text").is_none() && next.get("return_prompt_token_ids").is_none(), "{next}");
        before.engines = vec!["engine_0".into(), "engine_1".into()];
        before.moves = vec![json!({"at_token": 2})];
        let mut last = part("cd", &[12, 13], "v1");
        last["meta_info"]["prompt_tokens"] = json!(5);
        let out = joined(&before, &m, &last);
        assert_eq!(out["meta_info"]["prompt_tokens"], 3, "the text's ids, not the continuation's");
        assert!(out.get("prompt_token_ids").is_none(), "the client did not ask for them");
        // Unmoved, the ids the router asked for are not shown either; a client that asked sees
        // the first engine's.
        assert!(joined(&Produced::default(), &m, &first).get("prompt_token_ids").is_none());
        let asked = Movable::of(&json!({"text": "hello there", "return_prompt_token_ids": true})).unwrap();
        assert_eq!(joined(&before, &asked, &last)["prompt_token_ids"], json!([7, 8, 9]));
        // Ids never learned (an engine before 0.5.15): the request can only start again.
        assert_eq!(Produced::default().prompt(&m), None);
        assert_eq!(restart(&sent, "r-m1")["text"], "hello there");
    }

    #[test]
    fn a_part_without_spans_is_covered_by_its_version() {
        let mut p = Produced::default();
        p.add_part(&json!({"text": "a", "output_ids": [1, 2], "meta_info": {"weight_version": "v3"}}));
        p.add_part(&part("b", &[3], "v4"));
        assert_eq!(
            p.spans,
            vec![json!({"start": 0, "end": 2, "version": "v3"}), json!({"start": 2, "end": 3, "version": "v4"})]
        );
    }

    #[test]
    fn an_unmoved_answer_is_left_as_it_is() {
        let m = Movable::of(&json!({"input_ids": [1]})).unwrap();
        let last = part("x", &[4], "v1");
        assert_eq!(joined(&Produced::default(), &m, &last), last);
        assert_eq!(joined_chunk(&Produced::default(), &m, &last, false), last);
    }

    #[test]
    fn stream_chunks_of_the_second_part_continue_the_first() {
        let m = Movable::of(&json!({"input_ids": [1, 2], "stream": true})).unwrap();
        let mut before = Produced::default();
        before.add_part(&part("ab", &[10, 11], "v1"));
        before.engines = vec!["engine_0".into(), "engine_1".into()];
        before.moves = vec![json!({"from": "engine_0", "to": "engine_1", "at_token": 2, "reason": "drain"})];
        let chunk = part("c", &[12], "v1");
        let cumulative = joined_chunk(&before, &m, &chunk, false);
        assert_eq!(cumulative["text"], "abc");
        assert_eq!(cumulative["output_ids"], json!([10, 11, 12]));
        assert_eq!(cumulative["meta_info"]["completion_tokens"], 3);
        let incremental = joined_chunk(&before, &m, &chunk, true);
        assert_eq!(incremental["text"], "c");
        assert_eq!(incremental["output_ids"], json!([12]));
        assert_eq!(incremental["meta_info"]["completion_tokens"], 3);
    }

    #[test]
    fn a_member_is_cut_out_of_an_object_without_parsing_it() {
        let cases: [(&str, Option<&str>); 9] = [
            (r#"{"a":1,"prompt_token_ids":[1,2],"b":2}"#, Some(r#"{"a":1,"b":2}"#)),
            (r#"{"prompt_token_ids":[1,2],"b":2}"#, Some(r#"{"b":2}"#)),
            (r#"{"a":1,"prompt_token_ids":[1,2]}"#, Some(r#"{"a":1}"#)),
            (r#"{"prompt_token_ids":[]}"#, Some("{}")),
            (
                r#"{ "a" : "x\"prompt_token_ids\"", "prompt_token_ids" : [ 3 ] }"#,
                Some(r#"{ "a" : "x\"prompt_token_ids\""}"#),
            ),
            // Only a top-level member goes.
            (r#"{"m":{"prompt_token_ids":[1]}}"#, None),
            (r#"{"a":"prompt_token_ids"}"#, None),
            (r#"[{"prompt_token_ids":[1]}]"#, None),
            ("not json", None),
        ];
        for (raw, want) in cases {
            let got = without_member(raw.as_bytes(), "prompt_token_ids");
            assert_eq!(got.as_deref().map(|b| std::str::from_utf8(b).unwrap()), want, "{raw}");
        }
    }

    #[test]
    fn an_abort_is_never_missed_by_the_byte_check() {
        let aborted_answer = json!({"text": "x", "meta_info": {"finish_reason": {"type": "abort", "message": "m"}}});
        for raw in [aborted_answer.to_string(), serde_json::to_string_pretty(&aborted_answer).unwrap()] {
            assert!(may_be_aborted(raw.as_bytes()) && aborted(&serde_json::from_str(&raw).unwrap()));
        }
        let quoted = json!({"text": "say \"abort\"", "meta_info": {"finish_reason": {"type": "length"}}});
        assert!(!may_be_aborted(quoted.to_string().as_bytes()), "the word inside a string is escaped");
    }

    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z\"\\\\{}\\[\\],: ]{0,12}".prop_map(Value::from),
            Just(Value::from("prompt_token_ids")),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec(
                    (prop_oneof!["[a-z{},\"]{1,5}", Just("prompt_token_ids".to_string())], inner),
                    0..4
                )
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Cutting a member out of the bytes gives what removing it from the parsed object
        /// gives, wherever it is and whatever surrounds it, compact or pretty.
        #[test]
        fn cutting_a_member_equals_removing_it(
            members in proptest::collection::vec(("[a-z\"{}]{1,6}", any_json()), 0..5),
            ids in proptest::option::of(any_json()),
            pretty in any::<bool>(),
        ) {
            let mut object: Map<String, Value> = members.into_iter().collect();
            if let Some(ids) = ids {
                object.insert("prompt_token_ids".into(), ids);
            }
            let value = Value::Object(object.clone());
            let raw = if pretty { serde_json::to_string_pretty(&value).unwrap() } else { value.to_string() };
            let got = without_member(raw.as_bytes(), "prompt_token_ids");
            match object.remove("prompt_token_ids") {
                Some(_) => {
                    let parsed: Value = serde_json::from_slice(&got.expect("present, so cut")).unwrap();
                    prop_assert_eq!(parsed, Value::Object(object));
                }
                None => prop_assert!(got.is_none()),
            }
        }

        /// However a request's output is split over parts, the joined answer has every id once,
        /// in order, and counts them all.
        #[test]
        fn joining_parts_loses_and_repeats_nothing(ids in proptest::collection::vec(0u64..50_000, 1..60), cuts in proptest::collection::vec(0usize..60, 0..4)) {
            let m = Movable::of(&json!({"input_ids": [1], "sampling_params": {"max_new_tokens": 1000}})).unwrap();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % ids.len()).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let mut before = Produced::default();
            let mut from = 0;
            for (i, &c) in cuts.iter().enumerate() {
                before.add_part(&part("", &ids[from..c], "v"));
                before.engines.push(format!("e{i}"));
                before.moves.push(json!({"at_token": c}));
                from = c;
            }
            before.engines.push("last".into());
            let out = joined(&before, &m, &part("", &ids[from..], "v"));
            let joined_ids: Vec<u64> = out["output_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
            prop_assert_eq!(&joined_ids, &ids);
            prop_assert_eq!(out["meta_info"]["completion_tokens"].as_u64(), Some(ids.len() as u64));
        }
    }

    #[test]
    fn chunks_cap_every_part_but_the_one_the_rest_fits_in() {
        let m = |max: u64| Movable::of(&json!({"input_ids": [1], "sampling_params": {"max_new_tokens": max}})).unwrap();
        // (budget, done, chunk, cap)
        let cases = [
            (1000, 0, 256, Some(256)),
            (1000, 744, 256, None), // exactly one chunk left: the last part
            (1000, 743, 256, Some(256)),
            (256, 0, 256, None),
            (1000, 0, 0, None), // off
            (100, 200, 16, None),
        ];
        for (budget, done, chunk, cap) in cases {
            assert_eq!(chunk_cap(&m(budget), done, chunk), cap, "budget {budget} done {done} chunk {chunk}");
        }
    }

    #[test]
    fn a_capped_part_keeps_everything_but_its_budget() {
        let mut body = json!({"input_ids": [1], "rid": "r",
                              "sampling_params": {"max_new_tokens": 4096, "min_new_tokens": 900, "temperature": 0.7}});
        assert!(cap_part(&mut body, 256));
        assert_eq!(
            body,
            json!({"input_ids": [1], "rid": "r",
                   "sampling_params": {"max_new_tokens": 256, "min_new_tokens": 256, "temperature": 0.7}})
        );
        let mut low = json!({"input_ids": [1], "sampling_params": {"max_new_tokens": 4096, "min_new_tokens": 9}});
        assert!(cap_part(&mut low, 256));
        assert_eq!(low["sampling_params"], json!({"max_new_tokens": 256, "min_new_tokens": 9}));
        let mut bare = json!({"input_ids": [1], "sampling_params": null});
        assert!(cap_part(&mut bare, 64));
        assert_eq!(bare["sampling_params"], json!({"max_new_tokens": 64}));
        assert!(!cap_part(&mut json!([1]), 64));
        // A continuation's budget is the rest; capped again, the next part is one chunk.
        let m =
            Movable::of(&json!({"input_ids": [1], "sampling_params": {"max_new_tokens": 1000, "min_new_tokens": 900}}))
                .unwrap();
        let mut next = continuation(&body, &m, &[1], &[5; 256], "r-m1").unwrap();
        assert!(cap_part(&mut next, 256));
        assert_eq!(next["sampling_params"]["max_new_tokens"], json!(256));
        assert_eq!(next["sampling_params"]["min_new_tokens"], json!(256)); // 900 - 256 left, capped
        assert_eq!(next["input_ids"].as_array().map(Vec::len), Some(257));
    }

    #[test]
    fn a_chunk_ends_only_at_its_own_limit() {
        let end = |kind: &str, n: u64| json!({"meta_info": {"completion_tokens": n, "finish_reason": {"type": kind}}});
        assert!(chunk_ended(&end("length", 256), 256));
        assert!(!chunk_ended(&end("stop", 256), 256)); // a stop token on the chunk's last step ends it
        assert!(!chunk_ended(&end("abort", 256), 256));
        assert!(!chunk_ended(&end("length", 100), 256)); // the context's limit, not the chunk's
        assert!(!chunk_ended(&json!({"meta_info": {"completion_tokens": 256, "finish_reason": null}}), 256));
    }

    #[test]
    fn only_requests_a_continuation_cannot_change_move_or_run_in_chunks() {
        let with = |params: Value| json!({"input_ids": [1], "sampling_params": params});
        let table = [
            (json!({"input_ids": [1]}), true),
            (with(json!({"max_new_tokens": 9, "temperature": 1.0, "stop_token_ids": [2], "ignore_eos": false})), true),
            (with(json!({"stop": ""})), true),
            (with(json!({"stop": []})), true),
            (with(json!({"frequency_penalty": 0.0, "repetition_penalty": 1.0})), true),
            (with(json!({"stop": "</answer>"})), false),
            (with(json!({"stop": ["a"]})), false),
            (with(json!({"regex": "[0-9]+"})), false),
            (with(json!({"json_schema": "{}"})), false),
            (with(json!({"ebnf": "root ::= x"})), false),
            (with(json!({"presence_penalty": 0.5})), false),
            (with(json!({"repetition_penalty": 1.1})), false),
            (json!({"input_ids": [1], "custom_logit_processor": "x"}), false),
            (json!({"input_ids": [1], "custom_logit_processor": null}), true),
            (json!({"input_ids": [1], "max_thinking_tokens": 64}), false),
            (with(json!({"stop_regex": "\\d"})), false),
            (with(json!({"structural_tag": "{}"})), false),
            (with(json!({"watermark": {"key": 1}})), false),
        ];
        for (body, want) in table {
            assert_eq!(continuable(&body), want, "{body}");
            assert_eq!(Movable::of(&body).map(|m| m.continuable), Some(want), "{body}");
        }
    }

    #[test]
    fn an_answer_ended_by_the_router_after_one_part_holds_that_part() {
        // A request that could not go on after its first part (no move made yet) ends with that
        // part's output, joined with the router's own last (empty) part.
        let m = Movable::of(&json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}})).unwrap();
        let mut before = Produced { engines: vec!["engine_0".into()], ..Produced::default() };
        before.add_part(&part("abc", &[5, 6, 7], "v1"));
        let last = json!({"text": "", "output_ids": [],
                          "meta_info": {"completion_tokens": 0, "weight_versions": [],
                                        "finish_reason": {"type": "abort", "message": "gone"}}});
        let out = joined(&before, &m, &last);
        assert_eq!(out["output_ids"], json!([5, 6, 7]));
        assert_eq!(out["text"], json!("abc"));
        assert_eq!(out["meta_info"]["completion_tokens"], json!(3));
        assert_eq!(out["meta_info"]["prompt_tokens"], json!(2));
        assert_eq!(out["meta_info"]["finish_reason"]["type"], json!("abort"));
        assert_eq!(out["meta_info"]["weight_versions"], json!([{"start": 0, "end": 3, "version": "v1"}]));
        assert_eq!(out["meta_info"]["moves"], json!([]));
    }

    proptest::proptest! {
        #[test]
        fn chunks_add_up_to_the_budget(budget in 1u64..6000, chunk in 16u64..700) {
            let m = Movable::of(&json!({"input_ids": [1], "sampling_params": {"max_new_tokens": budget}})).unwrap();
            let (mut done, mut parts) = (0u64, Vec::new());
            loop {
                let cap = chunk_cap(&m, done, chunk);
                let part = cap.unwrap_or(budget - done);
                parts.push(part);
                done += part;
                if cap.is_none() {
                    break;
                }
            }
            proptest::prop_assert_eq!(done, budget);
            proptest::prop_assert!(parts.iter().all(|p| *p >= 1 && *p <= chunk));
            proptest::prop_assert_eq!(parts.len() as u64, budget.div_ceil(chunk));
        }
    }
}
