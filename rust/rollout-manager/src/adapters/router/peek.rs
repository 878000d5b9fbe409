//! What the router reads from a request body before choosing an engine, without copying it:
//! the size of the prompt (to estimate KV tokens), the output budget, the session key, a hash
//! of the prompt (GRPO siblings share one, so their KV is cached on the same engine), and a
//! weight-version pin.
//!
//! Borrowed `RawValue`s point into the body; only the small fields are decoded.

use memchr::memmem;
use rollout_core::routing::{estimate_tokens, VersionPin};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::hash::{Hash, Hasher};
use std::sync::LazyLock;

#[derive(Deserialize, Default)]
struct Body<'a> {
    #[serde(borrow, default)]
    text: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input_ids: Option<&'a RawValue>,
    /// OpenAI completions.
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    /// OpenAI chat.
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    sampling_params: Option<&'a RawValue>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    /// OpenAI: samples per prompt (each holds its own output KV).
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    routing_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    session_params: Option<Session<'a>>,
    #[serde(borrow, default)]
    weight_version: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Session<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Sampling<'a> {
    #[serde(default)]
    max_new_tokens: Option<u64>,
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
}

/// A sample count (`n`), read leniently: anything but a positive integer counts as 1.
fn samples(n: Option<&RawValue>) -> Option<u64> {
    n.and_then(|r| r.get().parse::<u64>().ok()).filter(|n| *n >= 1)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Pin<'a> {
    Exact(#[serde(borrow)] Cow<'a, str>),
    Spec {
        #[serde(borrow, default)]
        exact_version: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        min_version: Option<Cow<'a, str>>,
    },
}

/// What routing needs to know about one request.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RequestInfo {
    /// Estimated KV tokens (prompt + output budget of every sample: `n` multiplies it).
    pub tokens: u64,
    /// The output budget (`max_new_tokens`, `max_completion_tokens` or `max_tokens`; 128 when
    /// absent): what orders the router's queue with `--queue-order longest_first`.
    pub output_budget: u64,
    /// Estimated prompt tokens (all prompts of a batch).
    pub prompt_tokens: u64,
    /// Output KV of every sample at its full budget (`tokens` less the prompt).
    pub output_kv: u64,
    pub session: Option<String>,
    /// Hash of the prompt, for prefix affinity.
    pub prompt_hash: Option<u64>,
    pub pin: Option<VersionPin>,
    /// Whether the body carried a `weight_version` field (stripped before forwarding).
    pub pin_in_body: bool,
}

/// Why a request was refused before routing.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PeekError(pub String);

fn hash_bytes(b: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

/// Reads a request body. Bodies that are not JSON objects get defaults (routed by load only).
pub fn peek(
    body: &[u8],
    session_header: Option<&str>,
    pin_header: Option<VersionPin>,
) -> Result<RequestInfo, PeekError> {
    let parsed: Body<'_> = match body.first() {
        Some(b'{') => serde_json::from_slice(body).unwrap_or_default(),
        _ => Body::default(),
    };
    let (prompt_raw, ids) = match (parsed.input_ids, parsed.text.or(parsed.prompt).or(parsed.messages)) {
        (Some(ids), _) => (Some(ids.get()), true),
        (None, Some(t)) => (Some(t.get()), false),
        (None, None) => (None, false),
    };
    let prompt_bytes = prompt_raw.map_or(0, str::len);
    let prompt_ids = ids.then(|| prompt_raw.map_or(0, |r| r.bytes().filter(|b| *b == b',').count() + 1));
    // The output budget (per sample) and the output KV of all samples (`n` of each prompt).
    let openai_max = parsed.max_completion_tokens.or(parsed.max_tokens);
    let top_n = samples(parsed.n).unwrap_or(1);
    let (max_new, output_kv) = match parsed.sampling_params.map(RawValue::get) {
        Some(raw) if raw.starts_with('[') => match serde_json::from_str::<Vec<Sampling<'_>>>(raw) {
            Ok(v) => {
                let each = |s: &Sampling<'_>| s.max_new_tokens.unwrap_or(128);
                let kv = v.iter().map(|s| each(s).saturating_mul(samples(s.n).unwrap_or(1))).sum();
                (Some(v.iter().map(each).sum()), kv)
            }
            Err(_) => (openai_max, openai_max.unwrap_or(128).saturating_mul(top_n)),
        },
        raw => {
            let s = raw.filter(|r| r.starts_with('{')).and_then(|r| serde_json::from_str::<Sampling<'_>>(r).ok());
            let max_new = s.as_ref().and_then(|s| s.max_new_tokens).or(openai_max);
            let n = s.and_then(|s| samples(s.n)).unwrap_or(top_n);
            (max_new, max_new.unwrap_or(128).saturating_mul(n))
        }
    };
    let pin = match parsed.weight_version {
        None => pin_header,
        Some(raw) => Some(parse_pin(raw.get())?),
    };
    let session = session_header
        .map(str::to_string)
        .or_else(|| parsed.session_params.and_then(|s| s.id).map(Cow::into_owned))
        .or_else(|| parsed.routing_key.map(Cow::into_owned));
    let tokens = estimate_tokens(prompt_bytes, prompt_ids, Some(output_kv), None);
    let prompt_tokens = estimate_tokens(prompt_bytes, prompt_ids, Some(0), None);
    Ok(RequestInfo {
        tokens,
        output_budget: max_new.unwrap_or(128).min(rollout_core::routing::MAX_ESTIMATE_TOKENS),
        prompt_tokens,
        output_kv: tokens.saturating_sub(prompt_tokens),
        session,
        prompt_hash: prompt_raw.map(|r| hash_bytes(r.as_bytes())),
        pin,
        pin_in_body: parsed.weight_version.is_some(),
    })
}

impl RequestInfo {
    /// The KV estimate with each sample's output at `expected` tokens instead of its budget
    /// (never more than at the budget).
    pub fn tokens_expecting(&self, expected: u64) -> u64 {
        if expected >= self.output_budget || self.output_budget == 0 {
            return self.tokens;
        }
        let scaled = u128::from(self.output_kv) * u128::from(expected) / u128::from(self.output_budget);
        self.prompt_tokens.saturating_add(u64::try_from(scaled).unwrap_or(u64::MAX))
    }
}

/// Token counts an engine's answer reports (`meta_info` of SGLang's `/generate`, `usage` of the
/// OpenAI routes), read from the body as it streams by: the last value seen wins (a stream
/// repeats them, growing, in every chunk).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

impl Usage {
    /// Reads one chunk of a response body. A number split across two chunks is missed (the
    /// next chunk, or the next answer, brings another).
    pub fn scan(&mut self, chunk: &[u8]) {
        // Searched from the end with a SIMD prefilter (`memchr::memmem`): the counts sit at the
        // end of an answer or of a stream chunk, and every proxied answer is scanned.
        static COMPLETION: LazyLock<memmem::FinderRev<'static>> =
            LazyLock::new(|| memmem::FinderRev::new(b"\"completion_tokens\""));
        static PROMPT: LazyLock<memmem::FinderRev<'static>> =
            LazyLock::new(|| memmem::FinderRev::new(b"\"prompt_tokens\""));
        if let Some(v) = last_number_after(chunk, &COMPLETION) {
            self.completion_tokens = Some(v);
        }
        if let Some(v) = last_number_after(chunk, &PROMPT) {
            self.prompt_tokens = Some(v);
        }
    }
}

/// The integer after the last occurrence of the finder's key (then optional blanks, a colon,
/// blanks) in `hay`.
fn last_number_after(hay: &[u8], key: &memmem::FinderRev<'_>) -> Option<u64> {
    let at = key.rfind(hay)?;
    let rest = &hay[at + key.needle().len()..];
    let rest = rest.strip_prefix(b" ").unwrap_or(rest);
    let rest = rest.strip_prefix(b":")?;
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits: &[u8] = &rest[start..];
    let end = digits.iter().position(|b| !b.is_ascii_digit()).unwrap_or(digits.len());
    if end == 0 || end == digits.len() {
        // No digits, or the number may go on in the next chunk.
        return None;
    }
    std::str::from_utf8(&digits[..end]).ok()?.parse().ok()
}

fn parse_pin(raw: &str) -> Result<VersionPin, PeekError> {
    let bad = || {
        PeekError(format!(
            "weight_version {raw} is not understood: send \"v3\", {{\"exact_version\": \"v3\"}} or {{\"min_version\": \"v3\"}}"
        ))
    };
    match serde_json::from_str::<Pin<'_>>(raw).map_err(|_| bad())? {
        Pin::Exact(v) => Ok(VersionPin::Exact(v.into_owned())),
        Pin::Spec { exact_version: Some(v), min_version: None } => Ok(VersionPin::Exact(v.into_owned())),
        Pin::Spec { exact_version: None, min_version: Some(v) } => Ok(VersionPin::AtLeast(v.into_owned())),
        Pin::Spec { .. } => Err(bad()),
    }
}

/// A pin from the `x-weight-version` (exact) or `x-min-weight-version` headers.
pub fn pin_from_headers(exact: Option<&str>, min: Option<&str>) -> Option<VersionPin> {
    exact.map(|v| VersionPin::Exact(v.to_string())).or_else(|| min.map(|v| VersionPin::AtLeast(v.to_string())))
}

/// The body without its `weight_version` field (SGLang's engines do not know it).
pub fn strip_pin(body: &[u8]) -> Option<Vec<u8>> {
    let mut map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body).ok()?;
    map.remove("weight_version")?;
    serde_json::to_vec(&map).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_body() {
        let body =
            br#"{"text": "0123456789abcdef", "sampling_params": {"max_new_tokens": 10, "top_k": -1}, "rid": "g1-3"}"#;
        let info = peek(body, None, None).unwrap();
        // "0123456789abcdef" with quotes is 18 bytes -> 5 tokens, plus 10.
        assert_eq!(info.tokens, 15);
        assert_eq!(info.output_budget, 10);
        assert!(info.prompt_hash.is_some() && info.session.is_none() && info.pin.is_none());
    }

    #[test]
    fn ids_batches_and_openai() {
        let info = peek(br#"{"input_ids": [1,2,3,4], "sampling_params": {"max_new_tokens": 1}}"#, None, None).unwrap();
        assert_eq!(info.tokens, 5);
        let info =
            peek(br#"{"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 3}, {}]}"#, None, None).unwrap();
        assert_eq!(info.tokens, (r#"["a", "b"]"#.len() as u64).div_ceil(4) + 3 + 128);
        let info = peek(br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}"#, None, None).unwrap();
        assert!(info.tokens > 7);
    }

    #[test]
    fn n_samples_multiply_the_output_kv_but_not_the_budget() {
        // OpenAI chat: max_completion_tokens wins over max_tokens (SGLang's `or`), times n.
        let body = br#"{"messages": "0123456789abcdef", "n": 4, "max_tokens": 9, "max_completion_tokens": 10}"#;
        let info = peek(body, None, None).unwrap();
        assert_eq!((info.tokens, info.output_budget), (5 + 40, 10));
        let info = peek(br#"{"prompt": "0123456789abcdef", "n": 2}"#, None, None).unwrap();
        assert_eq!(info.tokens, 5 + 256);
        // Native: sampling_params.n (it wins over a top-level n), per batch item too.
        let info =
            peek(br#"{"text": "0123456789abcdef", "sampling_params": {"max_new_tokens": 10, "n": 3}}"#, None, None)
                .unwrap();
        assert_eq!((info.tokens, info.output_budget), (5 + 30, 10));
        let body =
            br#"{"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 1}]}"#;
        assert_eq!(peek(body, None, None).unwrap().tokens, 2 + 4 + 1);
        // A malformed n counts as 1 and does not hide the other fields.
        let info = peek(br#"{"prompt": "0123456789abcdef", "n": "x", "max_tokens": 7}"#, None, None).unwrap();
        assert_eq!((info.tokens, info.output_budget), (5 + 7, 7));
    }

    #[test]
    fn siblings_share_a_prompt_hash() {
        let a = peek(br#"{"text": "same prompt", "sampling_params": {"sampling_seed": 1}}"#, None, None).unwrap();
        let b = peek(br#"{"text": "same prompt", "sampling_params": {"sampling_seed": 2}}"#, None, None).unwrap();
        let c = peek(br#"{"text": "other prompt"}"#, None, None).unwrap();
        assert_eq!(a.prompt_hash, b.prompt_hash);
        assert_ne!(a.prompt_hash, c.prompt_hash);
    }

    #[test]
    fn session_keys_in_order_of_precedence() {
        let body = br#"{"text": "x", "session_params": {"id": "s-body"}, "routing_key": "rk"}"#;
        assert_eq!(peek(body, Some("s-header"), None).unwrap().session.as_deref(), Some("s-header"));
        assert_eq!(peek(body, None, None).unwrap().session.as_deref(), Some("s-body"));
        assert_eq!(peek(br#"{"routing_key": "rk"}"#, None, None).unwrap().session.as_deref(), Some("rk"));
    }

    #[test]
    fn pins() {
        let exact = peek(br#"{"text": "x", "weight_version": "v3"}"#, None, None).unwrap();
        assert_eq!(exact.pin, Some(VersionPin::Exact("v3".into())));
        assert!(exact.pin_in_body);
        let min = peek(br#"{"weight_version": {"min_version": "v2"}}"#, None, None).unwrap();
        assert_eq!(min.pin, Some(VersionPin::AtLeast("v2".into())));
        let slime = peek(br#"{"weight_version": {"exact_version": "7"}}"#, None, None).unwrap();
        assert_eq!(slime.pin, Some(VersionPin::Exact("7".into())));
        let err = peek(br#"{"weight_version": {"exact_version": "1", "min_version": "2"}}"#, None, None).unwrap_err();
        assert!(err.0.contains("min_version"));
        assert!(peek(br#"{"weight_version": 5}"#, None, None).is_err());
        let header = peek(b"{}", None, pin_from_headers(None, Some("v1"))).unwrap();
        assert_eq!(header.pin, Some(VersionPin::AtLeast("v1".into())));
        let stripped = strip_pin(br#"{"text": "x", "weight_version": "v3"}"#).unwrap();
        assert_eq!(stripped, br#"{"text":"x"}"#);
    }

    #[test]
    fn usage_is_read_from_answers_and_stream_chunks() {
        let mut u = Usage::default();
        u.scan(br#"{"text": "x", "meta_info": {"prompt_tokens": 12, "completion_tokens": 340, "id": "a"}}"#);
        assert_eq!(u, Usage { prompt_tokens: Some(12), completion_tokens: Some(340) });
        // Streams: the last chunk's count wins; compact JSON too.
        let mut u = Usage::default();
        u.scan(
            b"data: {\"meta_info\":{\"completion_tokens\":1}}\n\ndata: {\"meta_info\":{\"completion_tokens\":2}}\n\n",
        );
        u.scan(br#"data: {"usage": {"prompt_tokens": 5, "completion_tokens": 9}}"#);
        assert_eq!(u, Usage { prompt_tokens: Some(5), completion_tokens: Some(9) });
        // Nothing to read, or a number cut at the chunk's end: unchanged.
        u.scan(br#"{"completion_tokens": "many"}"#);
        u.scan(br#"{"completion_tokens": 12"#);
        u.scan(b"completion_tokens");
        assert_eq!(u.completion_tokens, Some(9));
    }

    #[test]
    fn the_kv_estimate_follows_the_expected_output() {
        let info =
            peek(br#"{"text": "0123456789abcdef", "sampling_params": {"max_new_tokens": 100, "n": 2}}"#, None, None)
                .unwrap();
        assert_eq!((info.prompt_tokens, info.output_kv, info.tokens), (5, 200, 205));
        assert_eq!(info.tokens_expecting(25), 5 + 50);
        assert_eq!(info.tokens_expecting(1000), 205, "never above the budget");
    }

    #[test]
    fn non_json_bodies_route_by_load() {
        assert_eq!(peek(b"", None, None).unwrap().tokens, 128);
        assert_eq!(peek(b"not json", None, None).unwrap().prompt_hash, None);
    }
}
