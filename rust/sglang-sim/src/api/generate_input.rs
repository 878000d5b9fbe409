//! `/generate` request parsing and validation: SGLang's `GenerateReqInput`, normalised into
//! one [`Item`] per output (a prompt, or one of its `n` samples).

use super::ApiError;
use crate::engine::Engine;
use crate::sampling::{RawSamplingParams, SamplingParams};
use crate::tokenizer;
use axum::body::Bytes;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TextInput {
    One(String),
    Batch(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IdsInput {
    One(Vec<i64>),
    Batch(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrList<T> {
    One(T),
    List(Vec<T>),
}

impl<T: Clone> OneOrList<T> {
    fn get(&self, i: usize) -> Option<T> {
        match self {
            OneOrList::One(v) => Some(v.clone()),
            OneOrList::List(v) => v.get(i).cloned(),
        }
    }
}

/// The request body. Unknown top-level keys are ignored, as in SGLang.
#[derive(Debug, Default, Deserialize)]
struct GenerateReqInput {
    text: Option<TextInput>,
    input_ids: Option<IdsInput>,
    input_embeds: Option<Value>,
    sampling_params: Option<Value>,
    rid: Option<OneOrList<String>>,
    stream: Option<bool>,
    return_logprob: Option<OneOrList<bool>>,
    logprob_start_len: Option<OneOrList<i64>>,
    top_logprobs_num: Option<OneOrList<i64>>,
    return_text_in_logprobs: Option<bool>,
    routed_dp_rank: Option<i64>,
    data_parallel_rank: Option<i64>,
    return_prompt_token_ids: Option<bool>,
    log_metrics: Option<bool>,
}

/// One output the request will produce (a prompt, or one of its `n` samples).
pub(super) struct Item {
    pub(super) rid: String,
    pub(super) prompt: Arc<Vec<u32>>,
    pub(super) params: SamplingParams,
    /// The sampler's seed for this output ([`SamplingParams::seed_for`]).
    pub(super) seed: u64,
    pub(super) max_new: u32,
    pub(super) return_logprob: bool,
    pub(super) logprob_start_len: i64,
    pub(super) top_logprobs_num: usize,
}

/// A validated request.
pub(super) struct Plan {
    pub(super) items: Vec<Item>,
    pub(super) batch: bool,
    pub(super) stream: bool,
    pub(super) text_in_logprobs: bool,
    pub(super) return_prompt_ids: bool,
    pub(super) log_metrics: bool,
    pub(super) dp_rank: Option<i64>,
    /// A finished answer carries `meta_info.weight_versions` even when the version never
    /// changed (one span), as SGLang 0.5.23 does; older profiles only when it changed.
    pub(super) spans_on_finish: bool,
}

fn to_ids(raw: Vec<i64>) -> Result<Vec<u32>, String> {
    raw.into_iter().map(|id| u32::try_from(id).map_err(|_| format!("Invalid token id {id} in input_ids."))).collect()
}

/// Validates the body; `Err` is the error response to send.
pub(super) fn plan(engine: &Engine, body: &Bytes) -> Result<Plan, ApiError> {
    let req: GenerateReqInput = super::parse_body(body, true)?;
    let bad = ApiError::bad_request;
    if req.input_embeds.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad("input_embeds is not supported by sglang-sim.".into()));
    }
    let (prompts, batch): (Vec<Vec<u32>>, bool) = match (req.text, req.input_ids) {
        (Some(_), Some(_)) => return Err(bad("Either text or input_ids should be provided.".into())),
        (None, None) => return Err(bad("Either text, input_ids or input_embeds should be provided.".into())),
        (Some(TextInput::One(t)), None) => (vec![tokenizer::encode(&t)], false),
        (Some(TextInput::Batch(ts)), None) => (ts.iter().map(|t| tokenizer::encode(t)).collect(), true),
        (None, Some(IdsInput::One(ids))) => (vec![to_ids(ids).map_err(bad)?], false),
        (None, Some(IdsInput::Batch(b))) => (b.into_iter().map(to_ids).collect::<Result<_, _>>().map_err(bad)?, true),
    };
    if batch && prompts.is_empty() {
        return Err(bad("The batch is empty.".into()));
    }
    if prompts.iter().any(|p| p.is_empty()) {
        return Err(bad("input_ids cannot be empty.".into()));
    }
    let raw_params: Vec<Value> = match req.sampling_params {
        None | Some(Value::Null) => vec![Value::Null; prompts.len()],
        Some(Value::Array(list)) => {
            if list.len() != prompts.len() {
                return Err(bad(format!(
                    "The number of sampling_params ({}) does not match the batch size ({}).",
                    list.len(),
                    prompts.len()
                )));
            }
            list
        }
        Some(obj) => vec![obj; prompts.len()],
    };
    let mut params = Vec::with_capacity(prompts.len());
    for v in raw_params {
        let raw = RawSamplingParams::from_value(v).map_err(ApiError::Validation)?;
        params.push(raw.validate().map_err(bad)?);
    }

    let cfg = &engine.cfg;
    let total: usize = params.iter().map(|p| p.n as usize).sum();
    let fresh = |n: usize| (0..n).map(|_| uuid::Uuid::new_v4().simple().to_string()).collect::<Vec<_>>();
    let rids: Vec<String> = match &req.rid {
        // Parallel sampling: every sample is sent under a fresh rid, whatever the client sent
        // (a list still needs one rid per prompt); the client's rid names none of them, so an
        // abort by it reaches nothing (sglang 0.5.23 managers/tokenizer_manager.py:2160-2180,
        // managers/io_struct.py:382-388, :759-772).
        Some(OneOrList::List(list)) if total > prompts.len() && list.len() != prompts.len() => {
            return Err(bad(format!(
                "The number of rids ({}) does not match the batch size ({}).",
                list.len(),
                prompts.len()
            )));
        }
        _ if total > prompts.len() => fresh(total),
        None => fresh(total),
        Some(OneOrList::One(r)) if !batch && total == 1 => vec![r.clone()],
        Some(OneOrList::One(r)) => (0..total).map(|i| format!("{r}_{i}")).collect(),
        Some(OneOrList::List(list)) => {
            if list.len() != total {
                return Err(bad(format!(
                    "The number of rids ({}) does not match the batch size ({total}).",
                    list.len()
                )));
            }
            list.clone()
        }
    };
    let mut items = Vec::with_capacity(total);
    let mut rid_iter = rids.into_iter();
    for (i, (prompt, p)) in prompts.into_iter().zip(params).enumerate() {
        let len = prompt.len();
        if len > cfg.max_req_input_len() {
            return Err(bad(format!(
                "Input length ({len} tokens) exceeds the maximum allowed length ({} tokens). \
                 Use a shorter input or enable --allow-auto-truncate.",
                cfg.max_req_input_len()
            )));
        }
        if let Some(m) = p.max_new_tokens {
            if m as usize + len >= cfg.context_length {
                return Err(bad(format!(
                    "Requested token count exceeds the model's maximum context length of {} \
                     tokens. You requested a total of {} tokens: {len} tokens from the input \
                     messages and {m} tokens for the completion. Please reduce the number of \
                     tokens in the input messages or the completion to fit within the limit.",
                    cfg.context_length,
                    m as usize + len
                )));
            }
        }
        let room = cfg.max_req_len().saturating_sub(len + 1);
        let max_new = p.max_new_tokens.map_or(room, |m| (m as usize).min(room));
        let max_new = u32::try_from(max_new).unwrap_or(u32::MAX);
        let prompt = Arc::new(prompt);
        for _ in 0..p.n {
            items.push(Item {
                rid: rid_iter.next().unwrap_or_default(),
                prompt: prompt.clone(),
                seed: p.seed_for(cfg.enable_deterministic_inference),
                params: p.clone(),
                max_new,
                return_logprob: req.return_logprob.as_ref().and_then(|r| r.get(i)).unwrap_or(false),
                logprob_start_len: req.logprob_start_len.as_ref().and_then(|r| r.get(i)).unwrap_or(-1),
                top_logprobs_num: req
                    .top_logprobs_num
                    .as_ref()
                    .and_then(|r| r.get(i))
                    .and_then(|k| usize::try_from(k).ok())
                    .unwrap_or(0),
            });
        }
    }
    let batch = batch || items.len() > 1;
    Ok(Plan {
        items,
        batch,
        stream: req.stream.unwrap_or(false),
        text_in_logprobs: req.return_text_in_logprobs.unwrap_or(false),
        return_prompt_ids: req.return_prompt_token_ids.unwrap_or(false)
            && engine.cfg.sglang_api.returns_prompt_token_ids(),
        log_metrics: req.log_metrics.unwrap_or(true),
        dp_rank: req.routed_dp_rank.or(req.data_parallel_rank),
        spans_on_finish: engine.cfg.sglang_api.reports_version_spans_on_finish(),
    })
}
