//! `/generate` (POST or PUT): SGLang's native generation endpoint.

use super::generate_input::{plan, Item, Plan};
use super::{handler_error, json_bytes, AppState};
use crate::engine::{Engine, NewRequestParts};
use crate::faults::{self, Admission, FaultKind};
use crate::generator::{self, FinishReason, GenState, VersionInfo, VersionSpan};
use crate::metrics::RequestRecord;
use crate::scheduler::{Finished, Update};
use crate::tokenizer;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one output looks like at some point of its life.
struct OutputView<'a> {
    item: &'a Item,
    /// Output ids to put in this chunk, starting at output position `offset`.
    ids: &'a [u32],
    /// For each of `ids`: the context hash it was produced from and its logprob.
    trace: &'a [(u64, f64)],
    offset: usize,
    text: &'a str,
    finish: Option<&'a FinishReason>,
    cached_tokens: usize,
    retractions: u32,
    version: &'a str,
    spans: &'a [VersionSpan],
    e2e: Option<f64>,
    index: Option<usize>,
}

impl<'a> OutputView<'a> {
    /// An unfinished output (a stream chunk) with nothing cached.
    fn partial(
        item: &'a Item,
        (ids, trace): (&'a [u32], &'a [(u64, f64)]),
        offset: usize,
        text: &'a str,
        version: &'a str,
        index: Option<usize>,
    ) -> Self {
        Self {
            item,
            ids,
            trace,
            offset,
            text,
            finish: None,
            cached_tokens: 0,
            retractions: 0,
            version,
            spans: &[],
            e2e: None,
            index,
        }
    }
}

fn logprob_entry(lp: Option<f64>, id: u32, with_text: bool) -> Value {
    let text = if with_text { Value::from(tokenizer::token_text(id)) } else { Value::Null };
    json!([lp, id, text])
}

fn render(v: &OutputView<'_>, plan: &Plan, version: &VersionInfo) -> Value {
    let item = v.item;
    let completion = v.offset + v.ids.len();
    let waiting_abort = matches!(v.finish, Some(FinishReason::WaitingAbort(_)));
    let mut meta = Map::new();
    meta.insert("id".into(), Value::from(item.rid.as_str()));
    meta.insert("finish_reason".into(), v.finish.map_or(Value::Null, FinishReason::to_json));
    if !waiting_abort {
        meta.insert("prompt_tokens".into(), Value::from(item.prompt.len()));
        meta.insert("completion_tokens".into(), Value::from(completion));
        meta.insert("cached_tokens".into(), Value::from(v.cached_tokens));
        meta.insert("reasoning_tokens".into(), Value::from(0));
        meta.insert("num_retractions".into(), Value::from(v.retractions));
    }
    meta.insert("weight_version".into(), Value::from(v.version));
    if let Some(e2e) = v.e2e {
        meta.insert("e2e_latency".into(), Value::from(e2e));
    }
    if v.spans.len() > 1 || (plan.spans_on_finish && v.finish.is_some()) {
        let mut spans: Vec<Value> =
            v.spans.iter().map(|s| json!({"version": &*s.version, "start": s.start, "end": s.end})).collect();
        if spans.is_empty() {
            spans.push(json!({"version": v.version, "start": 0, "end": completion}));
        }
        meta.insert("weight_versions".into(), Value::Array(spans));
    }
    if waiting_abort {
        // The front end's own answer to an abort in the waiting queue (0.5.23
        // `managers/tokenizer_manager.py:3577-3640`): no scheduler counts.
        meta.insert("completion_tokens".into(), Value::from(completion));
    }
    if item.return_logprob {
        let with_text = plan.text_in_logprobs;
        let out_lps: Vec<(u64, u32, f64)> = v.ids.iter().zip(v.trace).map(|(id, (ctx, lp))| (*ctx, *id, *lp)).collect();
        meta.insert(
            "output_token_logprobs".into(),
            out_lps.iter().map(|(_, id, lp)| logprob_entry(Some(*lp), *id, with_text)).collect(),
        );
        let input = match usize::try_from(item.logprob_start_len) {
            Ok(start) if v.offset == 0 => generator::input_logprobs(&item.prompt, start, version.hash),
            _ => Vec::new(),
        };
        meta.insert(
            "input_token_logprobs".into(),
            input.iter().map(|(_, id, lp, _)| logprob_entry(*lp, *id, with_text)).collect(),
        );
        if item.top_logprobs_num > 0 {
            let k = item.top_logprobs_num;
            let top = |ctx: u64, id: u32, lp: f64| -> Value {
                generator::top_logprobs(ctx, id, lp, k)
                    .into_iter()
                    .map(|(lp, id)| logprob_entry(Some(lp), id, with_text))
                    .collect()
            };
            meta.insert(
                "output_top_logprobs".into(),
                out_lps.iter().map(|(ctx, id, lp)| top(*ctx, *id, *lp)).collect(),
            );
            meta.insert(
                "input_top_logprobs".into(),
                input.iter().map(|(_, id, lp, ctx)| lp.map_or(Value::Null, |lp| top(*ctx, *id, lp))).collect(),
            );
        }
    }
    let mut out = Map::new();
    out.insert("text".into(), Value::from(v.text));
    out.insert("output_ids".into(), Value::from(v.ids.to_vec()));
    if plan.return_prompt_ids {
        out.insert("prompt_token_ids".into(), Value::from(item.prompt.to_vec()));
    }
    out.insert("meta_info".into(), Value::Object(meta));
    if let Some(i) = v.index {
        out.insert("index".into(), Value::from(i));
    }
    Value::Object(out)
}

/// The handler: fault accounting around [`serve`].
pub async fn generate(State(engine): State<AppState>, body: Bytes) -> Response {
    if engine.shared.is_scheduler_hung() {
        // The tokenizer manager waits for a scheduler that never answers.
        return std::future::pending().await;
    }
    match engine.faults.admit() {
        Admission::Normal => serve(engine, body, None).await,
        Admission::Doomed => std::future::pending().await,
        Admission::ServeThenFire(kind) => {
            let slot = Arc::new(FaultSlot(std::sync::Mutex::new(Some(kind))));
            let resp = serve(engine.clone(), body, Some(slot.clone())).await;
            // A streaming answer still being produced holds the slot and fires when it ends;
            // otherwise the answer is complete and the fault fires now.
            if Arc::strong_count(&slot) == 1 {
                slot.fire(&engine);
            }
            resp
        }
    }
}

/// A fault waiting for its answer to be complete; fires at most once.
struct FaultSlot(std::sync::Mutex<Option<FaultKind>>);

impl FaultSlot {
    fn fire(&self, engine: &Engine) {
        let kind = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(kind) = kind {
            fire(engine, kind);
        }
    }
}

fn fire(engine: &Engine, kind: FaultKind) {
    match kind {
        FaultKind::Crash => faults::crash_soon(engine.port),
        FaultKind::Hang => {
            tracing::warn!(port = engine.port, "simulated hang (--hang-after-requests)");
            engine.shared.set_hung();
        }
    }
}

/// Decrements the paused-waiter count even if the client goes away while waiting.
struct PausedWaiter<'a>(&'a Engine);

impl Drop for PausedWaiter<'_> {
    fn drop(&mut self) {
        self.0.paused_waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn serve(engine: Arc<Engine>, body: Bytes, fault: Option<Arc<FaultSlot>>) -> Response {
    let started = Instant::now();
    let plan = match plan(&engine, &body) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // Open from here (before any pause wait), as SGLang's `rid_to_state` entries are.
    let mut live: Vec<_> = plan.items.iter().map(|it| engine.register_rid(&it.rid)).collect();
    if engine.shared.is_paused() {
        engine.paused_waiters.fetch_add(1, Ordering::AcqRel);
        let _waiter = PausedWaiter(&engine);
        engine.shared.wait_unpaused().await;
    }
    if engine.shared.status() == crate::engine::Status::ShuttingDown {
        return handler_error(StatusCode::SERVICE_UNAVAILABLE, "The server is shutting down.");
    }
    if engine.cfg.zero_cost {
        return serve_zero_cost(&engine, &plan, started);
    }
    let guard = engine.model_update_lock.clone().read_owned().await;
    let rank = engine.pick_rank(plan.dp_rank);
    let handles: Vec<_> = plan
        .items
        .iter()
        .zip(live.drain(..))
        .map(|(it, live)| {
            let gen = GenState::new(&it.prompt, &it.params, it.seed, it.max_new, engine.cfg.eos_prob);
            let parts = NewRequestParts {
                rid: it.rid.clone(),
                prompt: it.prompt.to_vec(),
                gen,
                stream: plan.stream,
                stream_interval: it.params.stream_interval,
            };
            engine.submit(rank.clone(), parts, live)
        })
        .collect();
    if plan.stream {
        return stream(engine, plan, handles, started, guard, fault);
    }
    let finals = futures::future::join_all(handles.into_iter().map(|h| h.finish())).await;
    drop(guard);
    let version = engine.shared.version();
    let mut outs = Vec::with_capacity(finals.len());
    for (item, f) in plan.items.iter().zip(finals) {
        let Some(f) = f else {
            return handler_error(StatusCode::SERVICE_UNAVAILABLE, "The server is shutting down.");
        };
        let e2e = started.elapsed();
        record(&engine, &plan, item, &f, false, e2e);
        let text = f.gen.text();
        let spans = &f.gen.spans;
        let v = spans.last().map_or(&*version.name, |s| &*s.version);
        outs.push(render(
            &OutputView {
                item,
                ids: &f.gen.output,
                trace: &f.gen.trace,
                offset: 0,
                text: &text,
                finish: Some(&f.reason),
                cached_tokens: f.cached_tokens,
                retractions: f.retractions,
                version: v,
                spans,
                e2e: Some(e2e.as_secs_f64()),
                index: None,
            },
            &plan,
            &version,
        ));
    }
    respond(&plan, outs)
}

fn respond(plan: &Plan, mut outs: Vec<Value>) -> Response {
    let value = if plan.batch { Value::Array(outs) } else { outs.pop().unwrap_or(Value::Null) };
    match serde_json::to_vec(&value) {
        Ok(b) => json_bytes(StatusCode::OK, b),
        Err(e) => handler_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Metrics for one finished output (unless the request opted out with `log_metrics`).
fn record(engine: &Engine, plan: &Plan, item: &Item, f: &Finished, streaming: bool, e2e: Duration) {
    if !plan.log_metrics {
        return;
    }
    engine.metrics.record(&RequestRecord {
        prompt_tokens: item.prompt.len(),
        completion_tokens: f.gen.output.len(),
        cached_tokens: f.cached_tokens,
        streaming,
        e2e,
        queue_time: f.queue_time,
        ttft: f.time_to_first_token,
    });
}

/// `--zero-cost`: generate inline, no scheduler, no timing.
fn serve_zero_cost(engine: &Engine, plan: &Plan, started: Instant) -> Response {
    let version = engine.shared.version();
    let incremental = engine.cfg.incremental_streaming_output;
    let mut outs = Vec::with_capacity(plan.items.len());
    let mut sse = String::new();
    let rule = engine.cfg.sglang_api.stream_rule();
    for (i, item) in plan.items.iter().enumerate() {
        let mut gen = GenState::new(&item.prompt, &item.params, item.seed, item.max_new, engine.cfg.eos_prob);
        let index = plan.batch.then_some(i);
        let interval = item.params.stream_interval.unwrap_or(engine.cfg.stream_interval);
        // Streaming: the chunks the scheduled engine sends (see `scheduler.rs`).
        let mut text_so_far = String::new();
        let (mut sent_ids, mut sent_text) = (0, 0);
        let reason = match gen.finished_before_start() {
            Some(r) => r,
            None => loop {
                if let Some(r) = gen.step(&version) {
                    break r;
                }
                if plan.stream {
                    let id = gen.output.last().copied().unwrap_or(0);
                    tokenizer::push_token_text(&mut text_so_far, id, item.params.skip_special_tokens);
                    if !rule.should_send(gen.output.len(), sent_ids, interval) || gen.holds_stop_prefix() {
                        continue;
                    }
                    let (fi, ft) = if incremental { (sent_ids, sent_text) } else { (0, 0) };
                    let chunk = render(
                        &OutputView::partial(
                            item,
                            (&gen.output[fi..], &gen.trace[fi..]),
                            fi,
                            &text_so_far[ft..],
                            &version.name,
                            index,
                        ),
                        plan,
                        &version,
                    );
                    push_sse(&mut sse, &chunk);
                    (sent_ids, sent_text) = (gen.output.len(), text_so_far.len());
                }
            },
        };
        let e2e = started.elapsed();
        let text = gen.text();
        let (fi, mut ft) = if incremental && plan.stream {
            (sent_ids.min(gen.output.len()), sent_text.min(text.len()))
        } else {
            (0, 0)
        };
        if !text.is_char_boundary(ft) {
            ft = 0;
        }
        let out = render(
            &OutputView {
                finish: Some(&reason),
                spans: &gen.spans,
                e2e: Some(e2e.as_secs_f64()),
                ..OutputView::partial(
                    item,
                    (&gen.output[fi..], &gen.trace[fi..]),
                    fi,
                    &text[ft..],
                    &version.name,
                    index,
                )
            },
            plan,
            &version,
        );
        let f = Finished {
            reason,
            gen,
            cached_tokens: 0,
            queue_time: Some(Duration::ZERO),
            time_to_first_token: Some(e2e),
            retractions: 0,
        };
        record(engine, plan, item, &f, plan.stream, e2e);
        if plan.stream {
            push_sse(&mut sse, &out);
        } else {
            outs.push(out);
        }
    }
    if plan.stream {
        sse.push_str("data: [DONE]\n\n");
        return sse_response(Body::from(sse));
    }
    respond(plan, outs)
}

fn push_sse(out: &mut String, chunk: &Value) {
    out.push_str("data: ");
    out.push_str(&chunk.to_string());
    out.push_str("\n\n");
}

fn sse_response(body: Body) -> Response {
    let mut r = Response::new(body);
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r
}

/// Per-output streaming state.
struct StreamState {
    ids: Vec<u32>,
    trace: Vec<(u64, f64)>,
    text: String,
    sent_ids: usize,
    sent_text: usize,
}

/// Streams chunks as the scheduler produces tokens. The work runs in its own task that owns
/// the request handles; if the client goes away the channel closes, the task ends, and the
/// dropped handles abort the requests.
fn stream(
    engine: Arc<Engine>,
    plan: Plan,
    handles: Vec<crate::engine::ReqHandle>,
    started: Instant,
    guard: tokio::sync::OwnedRwLockReadGuard<()>,
    fault: Option<Arc<FaultSlot>>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let _guard = guard;
        let incremental = engine.cfg.incremental_streaming_output;
        let mut states: Vec<StreamState> = plan
            .items
            .iter()
            .map(|_| StreamState { ids: Vec::new(), trace: Vec::new(), text: String::new(), sent_ids: 0, sent_text: 0 })
            .collect();
        let mut cached = vec![0usize; plan.items.len()];
        let mut updates = futures::stream::select_all(handles.into_iter().enumerate().map(|(i, h)| {
            futures::stream::unfold(h, |mut h| async move { h.recv().await.map(|u| (u, h)) })
                .map(move |u| (i, u))
                .boxed()
        }));
        while let Some((i, update)) = updates.next().await {
            let item = &plan.items[i];
            let st = &mut states[i];
            let version = engine.shared.version();
            let (chunk, finished) = match update {
                Update::Tokens { ids, trace, cached_tokens } => {
                    cached[i] = cached_tokens;
                    for id in &ids {
                        tokenizer::push_token_text(&mut st.text, *id, item.params.skip_special_tokens);
                    }
                    st.ids.extend_from_slice(&ids);
                    st.trace.extend_from_slice(&trace);
                    (None, None)
                }
                Update::Finished(f) => {
                    cached[i] = f.cached_tokens;
                    let e2e = started.elapsed();
                    record(&engine, &plan, item, &f, true, e2e);
                    st.ids = f.gen.output.clone();
                    st.trace = f.gen.trace.clone();
                    st.text = f.gen.text();
                    (Some(e2e.as_secs_f64()), Some(f))
                }
            };
            let waiting_abort = finished.as_ref().is_some_and(|f| matches!(f.reason, FinishReason::WaitingAbort(_)));
            let (from_ids, from_text) = if incremental && waiting_abort {
                // SGLang's front end answers an incremental stream's abort in the waiting queue
                // with the last token it had again and the whole text (0.5.23
                // `managers/tokenizer_manager.py:3629-3635`).
                (st.ids.len().saturating_sub(1), 0)
            } else if incremental {
                (st.sent_ids.min(st.ids.len()), st.sent_text.min(st.text.len()))
            } else {
                (0, 0)
            };
            let text_from = if st.text.is_char_boundary(from_text) { from_text } else { 0 };
            let spans = finished.as_ref().map_or(&[][..], |f| &f.gen.spans[..]);
            let v = spans.last().map_or(&*version.name, |s| &*s.version);
            let out = render(
                &OutputView {
                    item,
                    ids: &st.ids[from_ids..],
                    trace: &st.trace[from_ids.min(st.trace.len())..],
                    offset: from_ids,
                    text: &st.text[text_from..],
                    finish: finished.as_ref().map(|f| &f.reason),
                    cached_tokens: cached[i],
                    retractions: finished.as_ref().map_or(0, |f| f.retractions),
                    version: v,
                    spans,
                    e2e: chunk,
                    index: plan.batch.then_some(i),
                },
                &plan,
                &version,
            );
            st.sent_ids = st.ids.len();
            st.sent_text = st.text.len();
            let bytes = Bytes::from(format!("data: {out}\n\n"));
            if tx.send(Ok(bytes)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        drop(tx);
        if let Some(slot) = fault {
            slot.fire(&engine);
        }
    });
    sse_response(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
}
