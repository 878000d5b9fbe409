//! `POST /v1/completions` and `POST /v1/chat/completions`: SGLang 0.5.23's OpenAI layer
//! (`entrypoints/openai/{protocol,serving_completions,serving_chat}.py`).
//!
//! Like SGLang, each handler turns the OpenAI request into a native `GenerateReqInput` body and
//! runs it through the `/generate` handler (fault accounting, pause, scheduler, weight
//! version, metrics and abort-on-disconnect included), then reshapes the answer: a JSON
//! response, or an SSE stream converted chunk by chunk.
//!
//! Chat prompts are rendered by a ChatML-like stand-in template (see [`render_chat`]).

use super::{generate, ApiError, AppState};
use crate::tokenizer;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Which OpenAI route a request came in on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// `sampling_params` keys copied from the OpenAI body (OpenAI name, native name), as in
/// SGLang's `_build_sampling_params` / `to_sampling_params`. `max_new_tokens` is set apart.
const SAMPLING_KEYS: &[(&str, &str)] = &[
    ("temperature", "temperature"),
    ("min_tokens", "min_new_tokens"),
    ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"),
    ("stop_regex", "stop_regex"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("regex", "regex"),
    ("json_schema", "json_schema"),
    ("ebnf", "ebnf"),
    ("n", "n"),
    ("no_stop_trim", "no_stop_trim"),
    ("ignore_eos", "ignore_eos"),
    ("skip_special_tokens", "skip_special_tokens"),
    ("logit_bias", "logit_bias"),
    ("custom_params", "custom_params"),
    ("seed", "sampling_seed"),
];

/// The request body as a JSON object, with typed access in pydantic's spirit: unknown keys are
/// ignored, a wrong type is a validation error (400 "Bad Request").
struct Fields(Map<String, Value>);

impl Fields {
    fn raw(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, ApiError> {
        match self.raw(key) {
            None => Ok(None),
            Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| invalid(key, &e.to_string())),
        }
    }
}

fn invalid(key: &str, msg: &str) -> ApiError {
    ApiError::Validation(format!("[{{'type': 'value_error', 'loc': ('body', '{key}'), 'msg': {msg:?}}}]"))
}

fn missing(key: &str) -> ApiError {
    ApiError::Validation(format!("[{{'type': 'missing', 'loc': ('body', '{key}'), 'msg': 'Field required'}}]"))
}

/// An error from the serving layer: SGLang's `create_error_response` (`ErrorResponse`).
fn openai_error(status: StatusCode, err_type: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "object": "error",
        "message": message.into(),
        "type": err_type,
        "param": null,
        "code": status.as_u16(),
    });
    (status, axum::Json(body)).into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    openai_error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// What the reshaping needs to remember about the request.
struct Ctx {
    kind: Kind,
    model: Value,
    n: u64,
    logprobs: bool,
    include_usage: bool,
    continuous_usage: bool,
    incremental: bool,
    /// Completions `echo`: the text to put before each prompt's output.
    echo: Option<Vec<String>>,
}

pub async fn completions(State(engine): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    serve(engine, Kind::Completion, &headers, &body).await
}

pub async fn chat_completions(State(engine): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    serve(engine, Kind::Chat, &headers, &body).await
}

async fn serve(engine: AppState, kind: Kind, headers: &HeaderMap, body: &Bytes) -> Response {
    let (native, ctx) = match build(&engine, kind, headers, body) {
        Ok(Ok(v)) => v,
        Ok(Err(resp)) => return resp,
        Err(e) => return e.into_response(),
    };
    let bytes = match serde_json::to_vec(&native) {
        Ok(b) => Bytes::from(b),
        Err(e) => return openai_error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", e.to_string()),
    };
    let resp = generate::generate(State(engine), bytes).await;
    let status = resp.status();
    let is_stream =
        resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if status == StatusCode::OK && is_stream {
        return stream(ctx, resp.into_body());
    }
    let Ok(raw) = axum::body::to_bytes(resp.into_body(), usize::MAX).await else {
        return openai_error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", "engine answer was cut");
    };
    let value: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
    if status != StatusCode::OK {
        return native_error(status, value);
    }
    let outs = match value {
        Value::Array(a) => a,
        v => vec![v],
    };
    let Some(first) = outs.first() else {
        return openai_error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", "no output");
    };
    let meta = &first["meta_info"];
    let mut metadata = Map::new();
    metadata.insert("weight_version".into(), meta["weight_version"].clone());
    if let Some(spans) = meta.get("weight_versions") {
        metadata.insert("weight_versions".into(), spans.clone());
    }
    let choices: Vec<Value> = outs.iter().enumerate().map(|(i, o)| choice(&ctx, i, o)).collect();
    let completion: u64 = outs.iter().map(|o| o["meta_info"]["completion_tokens"].as_u64().unwrap_or(0)).sum();
    let prompt: u64 = outs
        .iter()
        .step_by(usize::try_from(ctx.n).unwrap_or(1).max(1))
        .map(|o| o["meta_info"]["prompt_tokens"].as_u64().unwrap_or(0))
        .sum();
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    axum::Json(json!({
        "id": meta["id"],
        "object": object,
        "created": now(),
        "model": ctx.model,
        "choices": choices,
        "usage": usage(prompt, completion, true),
        "metadata": metadata,
    }))
    .into_response()
}

/// A native error answer in the OpenAI layer's shape: schema errors keep theirs, handler errors
/// (`{"error":{"message"}}`, SGLang's `ValueError`s) become `ErrorResponse`s.
fn native_error(status: StatusCode, value: Value) -> Response {
    if value.get("object").and_then(Value::as_str) == Some("error") {
        return (status, axum::Json(value)).into_response();
    }
    let message = value["error"]["message"].as_str().map_or_else(|| value.to_string(), str::to_string);
    let err_type = if status == StatusCode::BAD_REQUEST {
        "BadRequestError".to_string()
    } else {
        status.canonical_reason().unwrap_or("Error").replace(' ', "")
    };
    openai_error(status, &err_type, message)
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// `UsageInfo`. `full`: as `model_dump_json()` writes it (null details included); otherwise
/// as `model_dump_json(exclude_none=True)` (the completions stream's final usage chunk).
fn usage(prompt: u64, completion: u64, full: bool) -> Value {
    let mut u = json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "reasoning_tokens": 0,
    });
    if full {
        u["prompt_tokens_details"] = Value::Null;
        u["completion_tokens_details"] = Value::Null;
    }
    u
}

/// Validates the OpenAI body and builds the native `/generate` body. `Ok(Err(resp))` is an
/// error answered by the serving layer (`ErrorResponse`, 400 "BadRequestError").
#[expect(clippy::too_many_lines, reason = "one linear mapping of SGLang's request conversion")]
fn build(
    engine: &AppState,
    kind: Kind,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Result<(Value, Ctx), Response>, ApiError> {
    // SGLang's `validate_json_request` dependency.
    let media = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let media = media.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if media != "application/json" {
        return Err(ApiError::Validation(
            "[{'loc': ('header', 'content-type'), 'msg': \"Unsupported Media Type: Only 'application/json' is \
             allowed\", 'type': 'value_error'}]"
                .into(),
        ));
    }
    let map: Map<String, Value> = super::parse_body(body, true)?;
    let f = Fields(map);
    let model = f.raw("model").cloned().unwrap_or_else(|| Value::from("default"));
    if !model.is_string() {
        return Err(invalid("model", "Input should be a valid string"));
    }
    let n: i64 = f.get("n")?.unwrap_or(1);
    let stream: bool = f.get("stream")?.unwrap_or(false);
    let stream_options: Option<Map<String, Value>> = f.get("stream_options")?;
    let opt = |k: &str| stream_options.as_ref().and_then(|o| o.get(k)).and_then(Value::as_bool).unwrap_or(false);
    let mut sampling = Map::new();
    for (from, to) in SAMPLING_KEYS {
        if let Some(v) = f.raw(from) {
            sampling.insert((*to).to_string(), v.clone());
        }
    }
    let mut native = Map::new();
    let mut echo = None;
    let (return_logprob, top_logprobs) = match kind {
        Kind::Completion => {
            let prompt = f.raw("prompt").ok_or_else(|| missing("prompt"))?;
            let empty = match prompt {
                Value::String(s) => s.is_empty(),
                Value::Array(a) => a.iter().all(|p| match p {
                    Value::String(s) => s.is_empty(),
                    Value::Array(a) => a.is_empty(),
                    _ => false,
                }),
                _ => return Err(invalid("prompt", "Input should be a string, a list of strings or token ids")),
            };
            if empty {
                return Ok(Err(bad_request("Prompt cannot be empty")));
            }
            let ids = matches!(prompt, Value::Array(a) if !a.first().is_some_and(Value::is_string));
            native.insert(if ids { "input_ids" } else { "text" }.into(), prompt.clone());
            // `max_tokens: int = 16`, validated positive.
            let max_tokens = match f.0.get("max_tokens") {
                None => 16,
                Some(Value::Null) => return Err(invalid("max_tokens", "Input should be a valid integer")),
                Some(_) => f.get::<i64>("max_tokens")?.unwrap_or(16),
            };
            if max_tokens <= 0 {
                return Err(invalid("max_tokens", "Value error, max_tokens must be positive"));
            }
            sampling.insert("max_new_tokens".into(), Value::from(max_tokens));
            if f.get::<bool>("echo")?.unwrap_or(false) {
                let texts: Vec<String> = match prompt {
                    Value::String(s) => vec![s.clone()],
                    Value::Array(a) => match a.first() {
                        Some(Value::String(_)) => a.iter().map(|s| s.as_str().unwrap_or("").to_string()).collect(),
                        Some(Value::Array(_)) => a.iter().map(decode_ids).collect(),
                        _ => vec![decode_ids(prompt)],
                    },
                    _ => Vec::new(),
                };
                echo = Some(texts);
            }
            let logprobs: Option<i64> = f.get("logprobs")?;
            (logprobs.is_some(), logprobs.unwrap_or(0))
        }
        Kind::Chat => {
            let messages = f.raw("messages").ok_or_else(|| missing("messages"))?;
            let Value::Array(messages) = messages else {
                return Err(invalid("messages", "Input should be a valid list"));
            };
            if messages.is_empty() {
                return Ok(Err(bad_request("Messages cannot be empty.")));
            }
            // `max_completion_tokens or max_tokens` (a 0 falls through, as in Python).
            let mct: Option<i64> = f.get("max_completion_tokens")?;
            let mt: Option<i64> = f.get("max_tokens")?;
            let max_new = mct.filter(|m| *m != 0).or(mt);
            if let Some(m) = max_new.filter(|m| *m != 0) {
                let ctx_len = engine.cfg.context_length;
                if usize::try_from(m).is_ok_and(|m| m > ctx_len) {
                    return Ok(Err(bad_request(format!(
                        "max_completion_tokens is too large: {m}.This model supports at most {ctx_len} completion \
                         tokens."
                    ))));
                }
            }
            sampling.insert("max_new_tokens".into(), max_new.map_or(Value::Null, Value::from));
            let continue_final: bool = f.get("continue_final_message")?.unwrap_or(false);
            if let Some(ids) = f.raw("input_ids") {
                native.insert("input_ids".into(), ids.clone());
            } else {
                match render_chat(messages, continue_final) {
                    Ok(text) => native.insert("text".into(), Value::from(text)),
                    Err(e) => return Ok(Err(bad_request(e))),
                };
            }
            let logprobs: bool = f.get("logprobs")?.unwrap_or(false);
            (logprobs, f.get::<i64>("top_logprobs")?.unwrap_or(0))
        }
    };
    native.insert("sampling_params".into(), Value::Object(sampling));
    native.insert("stream".into(), Value::from(stream));
    native.insert("return_logprob".into(), Value::from(return_logprob));
    native.insert("top_logprobs_num".into(), Value::from(top_logprobs.max(0)));
    native.insert("logprob_start_len".into(), Value::from(-1));
    native.insert("return_text_in_logprobs".into(), Value::from(true));
    if let Some(rid) = f.raw("rid") {
        native.insert("rid".into(), rid.clone());
    }
    // The `X-Data-Parallel-Rank` header wins over the body, as in SGLang.
    let header_rank = headers.get("x-data-parallel-rank").and_then(|v| v.to_str().ok());
    let rank = match header_rank {
        Some(h) => match h.trim().parse::<i64>() {
            Ok(r) => Some(Value::from(r)),
            Err(_) => {
                return Ok(Err(bad_request(format!(
                    "Invalid X-Data-Parallel-Rank header: must be an integer, got '{h}'"
                ))))
            }
        },
        None => f.raw("routed_dp_rank").or_else(|| f.raw("data_parallel_rank")).cloned(),
    };
    if let Some(r) = rank {
        native.insert("routed_dp_rank".into(), r);
    }
    let ctx = Ctx {
        kind,
        model,
        n: u64::try_from(n).unwrap_or(1).max(1),
        logprobs: return_logprob,
        include_usage: opt("include_usage"),
        continuous_usage: opt("continuous_usage_stats"),
        incremental: engine.cfg.incremental_streaming_output,
        echo,
    };
    Ok(Ok((Value::Object(native), ctx)))
}

fn decode_ids(v: &Value) -> String {
    let ids: Vec<u32> = v
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect())
        .unwrap_or_default();
    tokenizer::decode(&ids, true)
}

/// The chat-template stand-in: ChatML with the markers as separate whitespace tokens.
///
/// Each message renders as `<|im_start|> {role}\n{content} <|im_end|>\n` and the generation
/// prompt `<|im_start|> assistant\n` follows. So a conversation's prompt is a prefix of the
/// next turn's (previous prompt + answer + ` <|im_end|>` ...), as with a real template. As in
/// SGLang, a final assistant message is rendered as a user message unless
/// `continue_final_message`, which leaves it open (no `<|im_end|>`, no new generation prompt).
fn render_chat(messages: &[Value], continue_final: bool) -> Result<String, String> {
    let mut out = String::new();
    let last = messages.len().saturating_sub(1);
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or("Each message needs a string role.")?;
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => texts.push(t),
                        (t, _) => {
                            return Err(format!(
                                "Content part type {} is not supported: sglang-sim serves a text-only model.",
                                t.unwrap_or("(missing)")
                            ))
                        }
                    }
                }
                texts.join("\n")
            }
            Some(_) => return Err("Message content must be a string or a list of content parts.".into()),
        };
        if i == last && role == "assistant" && m.get("content").is_some_and(Value::is_string) {
            if continue_final {
                out.push_str("<|im_start|> assistant\n");
                out.push_str(&content);
                return Ok(out);
            }
            out.push_str(&format!("<|im_start|> user\n{content} <|im_end|>\n"));
            continue;
        }
        out.push_str(&format!("<|im_start|> {role}\n{content} <|im_end|>\n"));
    }
    out.push_str("<|im_start|> assistant\n");
    Ok(out)
}

/// Native `[logprob, id, text]` entries in the OpenAI shapes.
fn completion_logprobs(tokens: &[Value], tops: &[Value]) -> Value {
    let text = |e: &Value| e[2].as_str().unwrap_or("").to_string();
    json!({
        "text_offset": tokens.iter().map(|_| -1).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|e| e[0].clone()).collect::<Vec<_>>(),
        "tokens": tokens.iter().map(text).collect::<Vec<_>>(),
        "top_logprobs": tops.iter().map(|row| match row.as_array() {
            Some(row) => Value::Object(row.iter().map(|e| (text(e), e[0].clone())).collect()),
            None => Value::Null,
        }).collect::<Vec<_>>(),
    })
}

fn chat_logprobs(tokens: &[Value], tops: &[Value]) -> Value {
    let entry = |e: &Value| {
        let text = e[2].as_str().unwrap_or("");
        json!({"token": text, "bytes": text.as_bytes(), "logprob": e[0]})
    };
    let content: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mut v = entry(e);
            let top: Vec<Value> =
                tops.get(i).and_then(Value::as_array).map(|row| row.iter().map(entry).collect()).unwrap_or_default();
            v["top_logprobs"] = Value::from(top);
            v
        })
        .collect();
    json!({"content": content})
}

fn slice(v: &Value, from: usize) -> &[Value] {
    v.as_array().map_or(&[][..], |a| a.get(from..).unwrap_or(&[]))
}

fn finish_parts(meta: &Value) -> (Value, Value) {
    let fr = &meta["finish_reason"];
    let reason = fr.get("type").cloned().unwrap_or(Value::Null);
    let matched = fr.get("matched").cloned().unwrap_or(Value::Null);
    (reason, matched)
}

/// One non-streaming choice.
fn choice(ctx: &Ctx, i: usize, out: &Value) -> Value {
    let meta = &out["meta_info"];
    let (reason, matched) = finish_parts(meta);
    let text = out["text"].as_str().unwrap_or("");
    let logprobs = if ctx.logprobs {
        let (toks, tops) = (slice(&meta["output_token_logprobs"], 0), slice(&meta["output_top_logprobs"], 0));
        match ctx.kind {
            Kind::Completion => completion_logprobs(toks, tops),
            Kind::Chat => chat_logprobs(toks, tops),
        }
    } else {
        Value::Null
    };
    match ctx.kind {
        Kind::Completion => {
            let text = match &ctx.echo {
                Some(p) => {
                    format!("{}{text}", p.get(i / usize::try_from(ctx.n).unwrap_or(1)).map_or("", String::as_str))
                }
                None => text.to_string(),
            };
            json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched})
        }
        Kind::Chat => json!({
            "index": i,
            "message": {"role": "assistant", "content": text, "reasoning_content": null},
            "logprobs": logprobs,
            "finish_reason": reason,
            "matched_stop": matched,
        }),
    }
}

/// Per-choice state while converting a stream.
#[derive(Default)]
struct Choice {
    started: bool,
    text_offset: usize,
    logprobs_sent: usize,
    prompt_tokens: u64,
    completion_tokens: u64,
}

struct Converter {
    ctx: Ctx,
    created: u64,
    id: Value,
    choices: BTreeMap<usize, Choice>,
    /// Chat: finish reasons in the order the choices finished (sent after all of them).
    finished: Vec<(usize, Value, Value)>,
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

impl Converter {
    fn chat_chunk(&self, index: usize, delta: Value, logprobs: Value, reason: Value, matched: Value) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ctx.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": reason, "matched_stop": matched}],
        })
    }

    /// One native chunk in, OpenAI chunks out.
    fn on_content(&mut self, content: &Value) -> Vec<Bytes> {
        let index = content.get("index").and_then(Value::as_u64).and_then(|i| usize::try_from(i).ok()).unwrap_or(0);
        let meta = &content["meta_info"];
        self.id = meta["id"].clone();
        let text = content["text"].as_str().unwrap_or("");
        let st = self.choices.entry(index).or_default();
        st.prompt_tokens = meta["prompt_tokens"].as_u64().unwrap_or(0);
        st.completion_tokens = meta["completion_tokens"].as_u64().unwrap_or(0);
        let first = !st.started;
        st.started = true;
        let delta = if self.ctx.incremental { text } else { text.get(st.text_offset..).unwrap_or("") };
        st.text_offset = text.len();
        let delta = delta.to_string();
        // Logprobs of the tokens not sent yet (the native list ends at the current token).
        let logprobs = if self.ctx.logprobs {
            let toks = meta["output_token_logprobs"].as_array().map_or(&[][..], Vec::as_slice);
            let tops = meta["output_top_logprobs"].as_array().map_or(&[][..], Vec::as_slice);
            let total = usize::try_from(st.completion_tokens).unwrap_or(0);
            let new = total.saturating_sub(st.logprobs_sent);
            st.logprobs_sent = total;
            let from = toks.len().saturating_sub(new);
            let top_from = tops.len().saturating_sub(new);
            (new > 0).then(|| match self.ctx.kind {
                Kind::Completion => completion_logprobs(&toks[from..], &tops[top_from..]),
                Kind::Chat => chat_logprobs(&toks[from..], &tops[top_from..]),
            })
        } else {
            None
        };
        let (pt, ct) = (st.prompt_tokens, st.completion_tokens);
        let (reason, matched) = finish_parts(meta);
        let mut out = Vec::new();
        match self.ctx.kind {
            Kind::Completion => {
                let mut text = delta;
                if first {
                    if let Some(p) = &self.ctx.echo {
                        let prompt = p.get(index / usize::try_from(self.ctx.n).unwrap_or(1)).map_or("", String::as_str);
                        text = format!("{prompt}{text}");
                    }
                }
                let mut chunk = json!({
                    "id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": reason, "matched_stop": matched}],
                    "usage": null,
                });
                if self.ctx.continuous_usage {
                    chunk["usage"] = usage(pt, ct, true);
                }
                out.push(sse(&chunk));
            }
            Kind::Chat => {
                if !reason.is_null() {
                    self.finished.push((index, reason, matched));
                }
                if first {
                    let delta = json!({"reasoning_content": null, "role": "assistant", "content": ""});
                    out.push(sse(&self.chat_chunk(index, delta, Value::Null, Value::Null, Value::Null)));
                }
                if !delta.is_empty() {
                    let d = json!({"reasoning_content": null, "content": delta});
                    let mut chunk =
                        self.chat_chunk(index, d, logprobs.unwrap_or(Value::Null), Value::Null, Value::Null);
                    if self.ctx.continuous_usage {
                        chunk["usage"] = usage(pt, ct, true);
                    }
                    out.push(sse(&chunk));
                }
            }
        }
        out
    }

    /// The chunks after the engine's last one: chat finish reasons, then usage.
    fn finish(&mut self) -> Vec<Bytes> {
        let mut out = Vec::new();
        if self.ctx.kind == Kind::Chat {
            for (index, reason, matched) in std::mem::take(&mut self.finished) {
                let delta = json!({"reasoning_content": null});
                out.push(sse(&self.chat_chunk(index, delta, Value::Null, reason, matched)));
            }
        }
        if self.ctx.include_usage {
            let n = self.ctx.n.max(1);
            let prompt: u64 = self
                .choices
                .iter()
                .filter(|(i, _)| u64::try_from(**i).unwrap_or(0) % n == 0)
                .map(|(_, c)| c.prompt_tokens)
                .sum();
            let completion: u64 = self.choices.values().map(|c| c.completion_tokens).sum();
            let (object, full) = match self.ctx.kind {
                Kind::Completion => ("text_completion", false),
                Kind::Chat => ("chat.completion.chunk", true),
            };
            out.push(sse(&json!({
                "id": self.id, "object": object, "created": self.created, "model": self.ctx.model,
                "choices": [], "usage": usage(prompt, completion, full),
            })));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }
}

/// Converts the native SSE stream. The work runs in its own task; if the client goes away the
/// channel closes, the task ends and drops the native stream, which aborts the requests.
fn stream(ctx: Ctx, native: Body) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    let mut conv = Converter { ctx, created: now(), id: Value::Null, choices: BTreeMap::new(), finished: Vec::new() };
    tokio::spawn(async move {
        let mut frames = native.into_data_stream();
        let mut buf: Vec<u8> = Vec::new();
        while let Some(Ok(bytes)) = frames.next().await {
            buf.extend_from_slice(&bytes);
            while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                let frame: Vec<u8> = buf.drain(..pos + 2).collect();
                let Some(data) = frame[..pos].strip_prefix(b"data: ") else { continue };
                let Ok(content) = serde_json::from_slice::<Value>(data) else { continue };
                for chunk in conv.on_content(&content) {
                    if tx.send(Ok(chunk)).await.is_err() {
                        return;
                    }
                }
            }
        }
        for chunk in conv.finish() {
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
    });
    let mut r = Response::new(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn chat_prompts_extend_across_turns() {
        let turn1 = vec![json!({"role": "system", "content": "be brief"}), json!({"role": "user", "content": "hi"})];
        let p1 = render_chat(&turn1, false).unwrap();
        assert_eq!(
            p1,
            "<|im_start|> system\nbe brief <|im_end|>\n<|im_start|> user\nhi <|im_end|>\n<|im_start|> assistant\n"
        );
        let mut turn2 = turn1.clone();
        turn2.push(json!({"role": "assistant", "content": " bepesi koli"}));
        turn2.push(json!({"role": "user", "content": [{"type": "text", "text": "more"}]}));
        let p2 = render_chat(&turn2, false).unwrap();
        let (t1, t2) = (tokenizer::encode(&format!("{p1} bepesi koli")), tokenizer::encode(&p2));
        assert_eq!(&t2[..t1.len()], &t1[..], "turn 1 + answer is a prefix of turn 2");
        assert!(render_chat(&[json!({"role": "user", "content": [{"type": "image_url"}]})], false).is_err());
    }

    #[test]
    fn a_final_assistant_message_is_a_user_turn_unless_continued() {
        let msgs = vec![json!({"role": "user", "content": "a"}), json!({"role": "assistant", "content": "b"})];
        assert!(render_chat(&msgs, false)
            .unwrap()
            .ends_with("<|im_start|> user\nb <|im_end|>\n<|im_start|> assistant\n"));
        assert!(render_chat(&msgs, true).unwrap().ends_with("<|im_start|> assistant\nb"));
    }
}
