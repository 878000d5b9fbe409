//! Moving a running `/generate` request to another engine (`rollout_core::moves`): when its
//! engine drains for a scale-in, the request is aborted there and continues on an engine that
//! stays, from the prompt's ids plus the output so far; when its engine dies in the middle of a
//! stream, the stream continues elsewhere from the tokens the router has seen. The client gets
//! one answer: a stream without a repeated or missing token, or one body, with
//! `meta_info.moves` and `meta_info.engines` saying where it ran.
//!
//! A movable request's answer is produced by a future that owns the engine's response: a
//! stream's writes the client's body into a channel and runs as that body is polled; a whole
//! answer's runs in the request's own task and is sent, with its length, once complete. Neither
//! has a task of its own (no extra wake-up per answer). The in-flight count moves with the
//! request, so a draining engine is idle once its requests have moved. An answer that does not
//! move is passed on as the engine wrote it, parsed only where it may have been aborted (and a
//! text prompt's `prompt_token_ids`, asked for by the router, cut out of its bytes).
//!
//! A non-streamed request is read from its engine as a stream too (`stream: true` with
//! [`WHOLE_STREAM_INTERVAL`]: an event with the output so far every that many tokens), and the
//! client gets the last event's answer as one body: so a request whose engine is lost continues
//! from the output its last event showed instead of starting again. Each part runs under a rid
//! of the router's (`router::rids`); the client sees the rid it knows the request by throughout,
//! and its `/abort_request` by that rid ends the request wherever it runs. A request a
//! continuation would change (`rollout_core::moves::continuable`) never moves: a drain waits for
//! it, and a lost engine ends it with the output so far (finish `abort`, saying why).

use super::rids::RidEntry;
use super::send::EngineBody;
use super::RouterState;
use crate::foundation::slots::Joining;
use crate::registry::fleet::InFlightGuard;
use axum::body::Body;
use axum::http::uri::PathAndQuery;
use axum::http::{HeaderMap, Method, StatusCode};
use bytes::Bytes;
use http_body_util::BodyExt;
use rollout_core::moves::{self, Movable, Produced};
use rollout_core::rids::IdSwap;
use rollout_core::routing::VersionPin;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Largest event of an answer the router follows (it is parsed to be joined).
const MAX_ANSWER_BYTES: usize = 64 << 20;
/// How many tokens apart a non-streamed request's engine sends its output so far (SGLang's
/// `stream_interval` sampling parameter, in every release since 0.5.2): an engine lost in the
/// middle of the answer costs at most this many tokens generated again. SGLang itself moves a
/// non-streamed request's output from its scheduler every 50 tokens
/// (`SGLANG_FORCE_STREAM_INTERVAL`).
pub(super) const WHOLE_STREAM_INTERVAL: u64 = 50;
/// Why a continuation found no engine: none serves the weight version its part ran on.
const NO_ENGINE_OF_ITS_VERSION: &str = "no engine serves the weight version it ran on to continue on";
/// Most moves of one request (a chunk's continuation is not one: see [`moves_left`]).
const MAX_MOVES: usize = 4;
/// How long the abort of a moving request may take on its engine.
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an abort is sent again while the aborted request's answer has not ended: SGLang
/// ignores an abort for a request it has not registered yet (`_handle_abort_req`: "not found
/// in rid_to_state"), which a request that just arrived may not be.
const ABORT_AGAIN: Duration = Duration::from_millis(250);

/// One movable request, as the router sent it.
pub(super) struct Request {
    /// The answer's lengths, learned from what the client is sent (as for any answer).
    pub learn: Option<super::answer::Learn>,
    /// When the router got it (the answer's duration is observed when its body ends).
    pub started: tokio::time::Instant,
    pub state: Arc<RouterState>,
    pub headers: HeaderMap,
    pub path: PathAndQuery,
    /// The body sent (with its `rid`; a non-streamed request's asks for a stream).
    pub body: Value,
    pub movable: Movable,
    /// The router's rid its first part was sent with.
    pub rid: String,
    pub pin: Option<VersionPin>,
    /// Whether it may continue on another weight version than its part ran on
    /// (`rollout_core::moves::target_pin`).
    pub may_cross: bool,
    pub tokens: u64,
    pub timeout: Duration,
    /// Its place on the tail planner's board (`--move-tail`).
    pub tail: Option<super::tail::Entry>,
    /// How it is generated in chunks (`--chunk-tokens`); None: in one part.
    pub chunk: Option<Chunking>,
    /// Its place among the requests a client may abort by rid (`router::rids`).
    pub entry: RidEntry,
    /// The ids its answer shows instead of the router's rids (the client's own rid).
    pub swap: IdSwap,
}

/// Resolves when the client aborted the request by its rid (or with `abort_all`).
async fn client_aborted(request: &Request) {
    request.entry.live.aborted().await;
}

/// Generation in chunks (`--chunk-tokens`): each part of a request asks for at most `tokens`
/// output tokens (`rollout_core::moves::chunk_cap`), and a part that stopped there continues
/// from the router's queue, where its class and session flag place it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Chunking {
    pub tokens: u64,
    pub class: Option<u64>,
    pub session: bool,
}

/// The engine a part runs on, with the request counted on it.
pub(super) struct Part {
    pub engine_id: rollout_core::ids::EngineId,
    pub route: super::table::Route,
    /// The request counted on this engine while the part runs (released once it ended, before
    /// the next part is sent: a draining engine is idle as soon as its answers came back).
    pub guard: Option<InFlightGuard>,
    pub body: EngineBody,
    pub first: Option<http_body::Frame<Bytes>>,
    /// The router already aborted it on this engine to move it (before its headers came).
    pub aborted: bool,
}

/// The client's body for a movable streamed request whose first part answered 200.
pub(super) fn body(request: Request, part: Part) -> Body {
    Body::from_stream(to_client(request, part))
}

/// The answer of a movable non-streamed request whose first part answered 200, read whole
/// (moves included) before the client gets its head: the client gets its length, and a request
/// that could not be continued gets an error status instead of a cut body. The error's kind is
/// `TimedOut` when the answer did not end within `--request-timeout-secs`.
pub(super) async fn whole(mut request: Request, part: Part) -> Result<Whole, std::io::Error> {
    let mut learn = request.learn.take();
    let (started, metrics, timeout) = (request.started, request.state.metrics.clone(), request.timeout);
    let mut out = Out::new(Sink::Whole(None), std::mem::take(&mut request.swap));
    let ran = tokio::time::timeout(timeout, run(request, part, &mut out)).await;
    metrics.duration.observe(started.elapsed());
    if ran.is_err() {
        let why = format!("the answer did not end within --request-timeout-secs ({timeout:?})");
        return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why));
    }
    let (status, ended_on) = (out.status, out.ended_on.take());
    let Sink::Whole(answer) = out.finish() else { unreachable!("a whole answer's output") };
    let body = answer.unwrap_or_else(|| Ok(Bytes::new()))?;
    if let Some(learn) = learn.as_mut().filter(|_| status == StatusCode::OK) {
        learn.usage.scan(&body);
        learn.answered = true;
    }
    Ok(Whole { status, body, ended_on })
}

/// A non-streamed request's answer, once complete.
pub(super) struct Whole {
    pub status: StatusCode,
    pub body: Bytes,
    /// The engine its last part ran on (its headers name it).
    pub ended_on: Option<super::table::Route>,
}

/// Where a movable request's answer goes, with the ids it shows instead of the router's rids.
struct Out {
    sink: Sink,
    swap: IdSwap,
    /// The engine the answer's last part ran on, once it ended there.
    ended_on: Option<super::table::Route>,
    /// A whole answer's status (an engine's error event becomes the error status SGLang gives a
    /// non-streamed request).
    status: StatusCode,
}

/// The channel its client's streamed body reads, or one buffer for a whole answer.
enum Sink {
    Stream(mpsc::Sender<Result<Bytes, std::io::Error>>),
    Whole(Option<Result<Bytes, std::io::Error>>),
}

impl Out {
    fn new(sink: Sink, swap: IdSwap) -> Self {
        Self { sink, swap, status: StatusCode::OK, ended_on: None }
    }

    /// Whether the client reads one body (a non-streamed request).
    fn whole(&self) -> bool {
        matches!(self.sink, Sink::Whole(_))
    }

    /// Writes on (the router's rids replaced by the ids the client knows); Err when the
    /// client went away.
    async fn send(&mut self, item: Result<Bytes, std::io::Error>) -> Result<(), ()> {
        let item = match item {
            Ok(bytes) if !self.swap.is_empty() => {
                let mut out = Vec::with_capacity(bytes.len());
                self.swap.feed(&bytes, &mut out);
                if matches!(self.sink, Sink::Whole(_)) {
                    self.swap.finish(&mut out);
                }
                Ok(Bytes::from(out))
            }
            item => item,
        };
        match &mut self.sink {
            Sink::Stream(tx) => tx.send(item).await.map_err(|_| ()),
            Sink::Whole(answer) => {
                *answer = Some(match (answer.take(), item) {
                    (None, item) => item,
                    (Some(Ok(before)), Ok(more)) => Ok([before, more].concat().into()),
                    (Some(Err(e)), _) | (Some(Ok(_)), Err(e)) => Err(e),
                });
                Ok(())
            }
        }
    }

    /// The sink, once the answer is written.
    fn finish(self) -> Sink {
        self.sink
    }
}

fn to_client(mut request: Request, part: Part) -> ToClient {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let timeout = request.timeout;
    let learn = request.learn.take();
    let (started, metrics) = (request.started, request.state.metrics.clone());
    let swap = std::mem::take(&mut request.swap);
    let answer = async move {
        // As for any answer: the whole of it, every part, within --request-timeout-secs.
        let mut client = Out::new(Sink::Stream(tx), swap);
        if tokio::time::timeout(timeout, run(request, part, &mut client)).await.is_err() {
            let why = format!("the answer did not end within --request-timeout-secs ({timeout:?})");
            let event = json!({"error": {"message": why, "type": "engine_timeout", "code": 504, "retryable": true}});
            let _ = client.send(Ok(Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n")))).await;
        }
        // (Whole events hold no part of a rid at their end; anything held back goes now.)
        let mut rest = Vec::new();
        client.swap.finish(&mut rest);
        if let (false, Sink::Stream(tx)) = (rest.is_empty(), &client.sink) {
            let _ = tx.send(Ok(Bytes::from(rest))).await;
        }
    };
    ToClient {
        rx: tokio_stream::wrappers::ReceiverStream::new(rx),
        answer: Some(Box::pin(answer)),
        learn,
        started,
        metrics,
    }
}

/// What the client reads of a movable request: the answer as `answer` writes it, which runs as
/// the client's body is polled (and stops if the client goes away); its token counts are
/// learned from it (as for any answer) and its duration observed when it ends.
struct ToClient {
    rx: tokio_stream::wrappers::ReceiverStream<Result<Bytes, std::io::Error>>,
    answer: Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    learn: Option<super::answer::Learn>,
    started: tokio::time::Instant,
    metrics: Arc<super::metrics::RouterMetrics>,
}

impl ToClient {
    fn learn(&mut self, polled: &std::task::Poll<Option<Result<Bytes, std::io::Error>>>) {
        let Some(learn) = self.learn.as_mut() else { return };
        match polled {
            std::task::Poll::Ready(Some(Ok(data))) => learn.usage.scan(data),
            // Written whole: the answer counts as answered (a cut one ends with an error).
            std::task::Poll::Ready(None) => learn.answered = true,
            _ => {}
        }
    }
}

impl futures::Stream for ToClient {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        loop {
            let polled = std::pin::Pin::new(&mut self.rx).poll_next(cx);
            if polled.is_ready() {
                self.learn(&polled);
                return polled;
            }
            // Nothing written yet: the answer goes on (once it is done, its sender is dropped
            // and what it wrote is read to the end).
            let Some(answer) = self.answer.as_mut() else { return std::task::Poll::Pending };
            if answer.as_mut().poll(cx).is_ready() {
                self.answer = None;
                continue;
            }
            let polled = std::pin::Pin::new(&mut self.rx).poll_next(cx);
            self.learn(&polled);
            return polled;
        }
    }
}

impl Drop for ToClient {
    fn drop(&mut self) {
        self.metrics.duration.observe(self.started.elapsed());
    }
}

/// Why a part ended.
enum Ended {
    /// The answer is complete (sent to the client).
    Done,
    /// The router aborted it to move it (drain); what it produced is in `Produced`.
    Moved(&'static str),
    /// The engine died; what the router saw of it is in `Produced`.
    Lost(String),
    /// The client went away.
    Gone,
}

async fn run(request: Request, first: Part, client: &mut Out) {
    let mut produced = Produced { engines: vec![first.engine_id.to_string()], ..Produced::default() };
    let mut part = first;
    let mut rid = request.rid.clone();
    loop {
        let ended = stream_part(&request, &mut part, &rid, &mut produced, client).await;
        let done = matches!(ended, Ended::Done);
        let Some(reason) = goes_on(&request, &part, ended, &produced, client).await else {
            if done {
                client.ended_on = Some(part.route.clone());
            }
            return;
        };
        if request.entry.live.is_aborted() {
            finish_aborted(&request, &produced, client, "aborted by the client's /abort_request").await;
            return;
        }
        if reason == "chunk" && ended_at_chunk(&request, &produced, client).await {
            return;
        }
        let next_rid = request.state.rids.next();
        let over = starts_over(&request, &part, reason, &produced);
        if over {
            tracing::info!(engine_id = %part.engine_id, reason, "no engine serves the version the request ran on; starting it again");
            produced =
                Produced { engines: produced.engines.clone(), moves: produced.moves.clone(), ..Produced::default() };
        }
        let mut body = match produced.prompt(&request.movable) {
            _ if over => moves::restart(&request.body, &next_rid),
            Some(prompt) => {
                match moves::continuation(&request.body, &request.movable, prompt, &produced.output_ids, &next_rid) {
                    Some(body) => body,
                    None => {
                        // Aborted right at its last token: the answer is complete as it is.
                        finish_at_budget(&request, &produced, client).await;
                        return;
                    }
                }
            }
            None if request.movable.stream && !produced.output_ids.is_empty() => {
                // The client has events already; without the prompt's ids nothing can follow them.
                let why = "its engine did not return the text prompt's ids (SGLang before 0.5.15)";
                fail(&request, client, &format!("could not continue the request after a move: {why}")).await;
                return;
            }
            None => {
                // A text prompt whose ids its engine did not return (or that lost its engine
                // before any output): sent again from the start.
                tracing::warn!(engine_id = %part.engine_id, "text prompt without its ids; starting the request again");
                produced = Produced {
                    engines: produced.engines.clone(),
                    moves: produced.moves.clone(),
                    ..Produced::default()
                };
                moves::restart(&request.body, &next_rid)
            }
        };
        if let Some(cap) = part_cap(&request, &produced) {
            moves::cap_part(&mut body, cap);
        }
        // The part ended: its engine no longer holds the request (a non-streamed continuation
        // answers only when it is done, and a drain must not wait for that). A chunk's slot is
        // given up once its continuation has its place in the queue.
        if reason != "chunk" {
            drop(part.guard.take());
        }
        if let Some(entry) = &request.tail {
            entry.between_parts();
        }
        let ended_on = produced.spans.last().and_then(|s| s["version"].as_str()).map(str::to_owned);
        let ended_on = ended_on.or_else(|| part.route.weight_version.clone());
        // The client knows the request by one id, whatever rid its next part runs under.
        client.swap.add(&next_rid, request.entry.shown());
        request.entry.live.runs_as(&next_rid);
        let next = if over {
            fresh_part(&request, &part, body, reason).await
        } else {
            next_part(&request, &mut part, body, reason, produced.output_ids.len() as u64, ended_on).await
        };
        match next {
            Ok(next) => {
                record_move(&request, &mut produced, &part, &next, reason);
                part = next;
                rid = next_rid;
            }
            Err(why) if reason == "chunk" && why.starts_with(NO_ENGINE_OF_ITS_VERSION) => {
                // No engine of its weight version took it back (the fleet moved on while it
                // waited between chunks): it ends as an update's abort ends a running request.
                finish_aborted(&request, &produced, client, &format!("could not continue after a chunk: {why}")).await;
                return;
            }
            Err(why) => {
                fail(&request, client, &format!("could not continue the request after a move: {why}")).await;
                return;
            }
        }
    }
}

/// Why the request goes on after its part ended (`ended`), if it does; else its answer was
/// ended (complete, the client gone, or written here: a request a continuation would change
/// ends with its output when its engine is lost, and one out of moves gets an error).
async fn goes_on(
    request: &Request,
    part: &Part,
    ended: Ended,
    produced: &Produced,
    client: &mut Out,
) -> Option<&'static str> {
    match ended {
        Ended::Done | Ended::Gone => None,
        Ended::Moved(reason) => Some(reason),
        Ended::Lost(why) if !request.movable.continuable => {
            let why = format!(
                "engine {} was lost in the middle of the answer ({why}); the output is what it generated \
                 before, and the request did not continue elsewhere because a continuation would change it \
                 (stop strings, a grammar, penalties or a logit processor)",
                part.engine_id
            );
            request.state.metrics.ended_on_loss();
            finish_aborted(request, produced, client, &why).await;
            None
        }
        Ended::Lost(why) if moves_left(produced) => {
            // It continues from the output the router saw (its last event's).
            tracing::warn!(engine_id = %part.engine_id, error = %why, "engine lost mid-answer; continuing elsewhere");
            Some("lost")
        }
        Ended::Lost(why) => {
            let why = format!("engine {} stopped in the middle of its answer ({why})", part.engine_id);
            fail(request, client, &why).await;
            None
        }
    }
}

/// Ends the answer at the end of a chunk when it cannot go on, and says so: the ids of its text
/// prompt are unknown (its first chunk is all the engine was asked for, and a text prompt is
/// never tokenized again: an error).
async fn ended_at_chunk(request: &Request, produced: &Produced, client: &mut Out) -> bool {
    if produced.prompt(&request.movable).is_none() {
        let why = "its engine did not return the text prompt's ids (SGLang before 0.5.15), which \
                   --chunk-tokens needs for text prompts; send input_ids, or set --chunk-tokens 0";
        fail(request, client, &format!("could not continue the request after its first chunk: {why}")).await;
        return true;
    }
    false
}

/// Counts and records a move (or a chunk's continuation) from `from` to `next`, after the
/// output `produced` holds.
fn record_move(request: &Request, produced: &mut Produced, from: &Part, next: &Part, reason: &'static str) {
    let prompt = produced.prompt(&request.movable).map_or(0, <[u64]>::len);
    let at_token = produced.output_ids.len();
    // A chunk that continues where it ran finds its tokens in that engine's prefix cache: it
    // prefills (almost) nothing again.
    let stays = reason == "chunk" && next.engine_id == from.engine_id;
    request.state.metrics.moved(reason, if stays { 0 } else { prompt + at_token });
    produced.moves.push(json!({"from": from.engine_id, "to": next.engine_id, "at_token": at_token, "reason": reason}));
    produced.engines.push(next.engine_id.to_string());
    if let Some(entry) = &request.tail {
        entry.moved(next.route.load.clone(), at_token, matches!(reason, "tail" | "preempt"));
    }
    if reason == "chunk" {
        tracing::debug!(from = %from.engine_id, to = %next.engine_id, at_token, "request continues with its next chunk");
    } else {
        tracing::info!(from = %from.engine_id, to = %next.engine_id, at_token, reason, "request moved");
    }
}

/// Sends the continuation to the least loaded other engine the request may use (on the
/// version `from` ran on, unless it may cross), waiting up to `--version-wait-secs` for one;
/// the request is counted there from now on. After a weight update's abort, `from`'s own
/// engine (back on the new version) may take it too, and after a tail move (planned for a less
/// loaded engine, which may have filled meanwhile) as well.
/// `ended_on` is the weight version the part's output ended on (a part an update kept running,
/// `retract` or `in_place`, ends on the new one, which its next chunk then continues on).
async fn next_part(
    request: &Request,
    from: &mut Part,
    body: Value,
    reason: &str,
    so_far: u64,
    ended_on: Option<String>,
) -> Result<Part, String> {
    if reason == "preempt" {
        let entry = request.tail.as_ref().ok_or("a preempted request without its place on the board")?;
        let ran_on = from.route.weight_version.clone();
        return queued_part(request, from, body, entry.joining(), ran_on, false).await;
    }
    if let ("chunk", Some(chunk)) = (reason, request.chunk) {
        let joining = Joining {
            class: chunk.class,
            budget: request.movable.max_new_tokens,
            session: chunk.session,
            so_far: Some(so_far),
        };
        return queued_part(request, from, body, joining, ended_on, true).await;
    }
    let pin = moves::target_pin(request.pin.as_ref(), from.route.weight_version.as_deref(), request.may_cross);
    let none = match &pin {
        Some(VersionPin::Exact(v)) => format!("no other engine serves weight version {v:?} to continue on"),
        _ => "no other engine to continue on".to_string(),
    };
    send_least_loaded(request, from, body, reason, pin.as_ref(), none).await
}

/// Sends `body` to the least loaded engine `pin` allows, other than `from`'s unless the move is
/// an update's or a tail move's, waiting up to `--version-wait-secs` for one; `none` is the
/// error when there is none.
async fn send_least_loaded(
    request: &Request,
    from: &Part,
    body: Value,
    reason: &str,
    pin: Option<&VersionPin>,
    none: String,
) -> Result<Part, String> {
    let Ok(routes) = super::candidates(&request.state, pin).await else { return Err(none) };
    let other = |r: &&super::table::Route| {
        matches!(reason, "weight_update" | "tail") || !Arc::ptr_eq(&r.load, &from.route.load)
    };
    let Some(route) = routes.iter().filter(other).min_by_key(|r| r.load.get()).cloned() else { return Err(none) };
    let guard = route.load.enter(request.tokens);
    send_part(request, route, guard, body).await
}

/// Whether the request starts over from nothing instead of continuing after its part ended:
/// nothing of it reached the client yet (a whole answer, or a stream before its first token),
/// it stays on one weight version, and no engine serves the version it ran on any more (an
/// update went by while its engine was lost or drained). Its output so far is dropped, and it
/// runs again on what its own pin allows, as if it had just arrived.
fn starts_over(request: &Request, part: &Part, reason: &str, produced: &Produced) -> bool {
    if matches!(reason, "chunk" | "preempt") || request.may_cross {
        return false;
    }
    if request.movable.stream && !produced.output_ids.is_empty() {
        return false;
    }
    let Some(ran_on) = part.route.weight_version.as_deref() else {
        return false;
    };
    super::candidates_now(&request.state, Some(&VersionPin::Exact(ran_on.to_string()))).is_empty()
}

/// Sends a request that starts over ([`starts_over`]) to the least loaded engine its own pin
/// allows, other than the one it left (unless an update or a tail move, as [`next_part`]).
async fn fresh_part(request: &Request, from: &Part, body: Value, reason: &str) -> Result<Part, String> {
    let none = "no engine to start it again on".to_string();
    send_least_loaded(request, from, body, reason, request.pin.as_ref(), none).await
}

/// Sends a continuation to `route` (counted there by `guard`).
async fn send_part(
    request: &Request,
    route: super::table::Route,
    guard: InFlightGuard,
    body: Value,
) -> Result<Part, String> {
    let state = &request.state;
    let bytes = Bytes::from(serde_json::to_vec(&body).map_err(|e| e.to_string())?);
    let resp = send(state, &route, &Method::POST, &request.path, &request.headers, bytes, request.timeout).await?;
    if resp.status() != StatusCode::OK {
        return Err(format!("engine {} answered {}", route.engine_id, resp.status()));
    }
    Ok(Part {
        engine_id: route.engine_id.clone(),
        route,
        guard: Some(guard),
        body: resp.into_body(),
        first: None,
        aborted: false,
    })
}

/// Sends one request to an engine (the router's pooled connections where it can).
async fn send(
    state: &RouterState,
    route: &super::table::Route,
    method: &Method,
    path: &PathAndQuery,
    headers: &HeaderMap,
    body: Bytes,
    timeout: Duration,
) -> Result<hyper::Response<EngineBody>, String> {
    let sent = super::send::send(state, route, method, path, headers, &body);
    tokio::time::timeout(timeout, sent).await.map_err(|_| format!("no answer within {timeout:?}"))?
}

/// Asks the part's engine to abort the request (its answer then ends with the output so far).
async fn abort(request: &Request, part: &Part, rid: &str) {
    abort_rid(&request.state, &part.route, &request.headers, rid).await;
}

/// Asks `route`'s engine to abort request `rid`.
async fn abort_rid(state: &RouterState, route: &super::table::Route, headers: &HeaderMap, rid: &str) {
    let body = Bytes::from(json!({ "rid": rid }).to_string());
    let path = PathAndQuery::from_static("/abort_request");
    match send(state, route, &Method::POST, &path, headers, body, ABORT_TIMEOUT).await {
        Ok(resp) => {
            let _ = resp.into_body().collect().await;
        }
        Err(e) => tracing::debug!(engine_id = %route.engine_id, error = %e, "abort to move a request failed"),
    }
}

/// Whether `route`'s engine asks its requests to move, and another engine could take them: one
/// on the same weight version unless the request may cross versions.
fn may_move(state: &RouterState, route: &super::table::Route, may_cross: bool) -> bool {
    let load = &route.load;
    load.moves_requested()
        && state.fleet.routes().backends.iter().any(|b| {
            !Arc::ptr_eq(&b.load, load)
                && (may_cross || route.weight_version.is_none() || b.weight_version == route.weight_version)
        })
}

/// Whether a request can be moved now: a streamed text prompt only once its ids are known
/// (its events went to the client, so it can only be continued, not started again).
pub(super) fn ready(movable: &Movable, produced: &Produced) -> bool {
    !(movable.text && movable.stream && produced.prompt(movable).is_none())
}

/// Whether the request may still move ([`MAX_MOVES`]; a chunk's continuation does not count).
fn moves_left(produced: &Produced) -> bool {
    produced.moves.iter().filter(|m| m["reason"] != "chunk").count() < MAX_MOVES
}

/// The output budget of the request's next part when it is generated in chunks and more than
/// one chunk is left (`rollout_core::moves::chunk_cap`); None: the part runs to its end.
fn part_cap(request: &Request, produced: &Produced) -> Option<u64> {
    let chunk = request.chunk?;
    moves::chunk_cap(&request.movable, produced.output_ids.len() as u64, chunk.tokens)
}

fn should_move(request: &Request, part: &Part, produced: &Produced) -> bool {
    request.movable.continuable
        && !request.entry.live.is_aborted()
        && moves_left(produced)
        && ready(&request.movable, produced)
        && may_move(&request.state, &part.route, request.may_cross)
}

/// Why the planner asked this request to move (`tail`, `preempt`), if it did.
fn planned_move(request: &Request) -> Option<&'static str> {
    request.tail.as_ref().and_then(super::tail::Entry::asked)
}

fn should_move_for_plan(request: &Request, produced: &Produced) -> Option<&'static str> {
    let may = request.movable.continuable && !request.entry.live.is_aborted();
    planned_move(request).filter(|_| may && moves_left(produced) && ready(&request.movable, produced))
}

/// Sends the continuation of a preempted request, or the next chunk of one generated in
/// chunks, once the router's queue gives it a slot: it waits there as `joining` places it (a
/// preempted request under its own expected length, so the slot it gave up goes to a longer
/// one; a chunk under the output it is expected to have left), then takes the least loaded
/// engine with a free slot that serves the version its part ran on; with `stay`, the engine
/// it ran on when that one has a free slot (its prefix cache holds the request's tokens),
/// unless another engine is idle. The part's own slot, if it still holds one, is kept when the
/// request is first in the queue (it goes on at once where it ran, or on an idle engine), else
/// given up once the request has its place.
async fn queued_part(
    request: &Request,
    from: &mut Part,
    body: Value,
    joining: Joining,
    ran_on: Option<String>,
    stay: bool,
) -> Result<Part, String> {
    let state = &request.state;
    let pin = moves::target_pin(request.pin.as_ref(), ran_on.as_deref(), request.may_cross);
    let cap_mode = state.config.max_inflight_per_engine;
    // Without a cap (`--max-inflight-per-engine 0`) every engine has room.
    let cap = |load: &crate::registry::fleet::EngineLoad| match cap_mode {
        rollout_core::routing::InflightCap::Fixed(0) => usize::MAX,
        _ => super::engine_cap(cap_mode, load),
    };
    let queue = state.fleet.slot_queue().clone();
    let ticket = queue.join(joining);
    if let (true, true, Some(guard)) = (stay, ticket.is_head(), from.guard.take()) {
        // Nothing waiting goes before it: it keeps its slot and goes on where it ran, if that
        // engine still takes requests of its version, unless another engine is idle.
        let routes = super::candidates_now(state, pin.as_ref());
        let own = routes.iter().find(|r| Arc::ptr_eq(&r.load, &from.route.load));
        let idle = routes.iter().find(|r| r.load.get() == 0 && cap(&r.load) > 0);
        if let Some(own) = own {
            // (Its own engine counts it: `> 1` when another request runs there too.)
            let idle = idle.filter(|_| own.load.get() > 1);
            if let Some((idle, there)) = idle.and_then(|r| Some((r, r.load.try_enter(request.tokens, cap(&r.load))?))) {
                drop((ticket, guard));
                return send_part(request, idle.clone(), there, body).await;
            }
            drop(ticket);
            return send_part(request, own.clone(), guard, body).await;
        }
        drop(guard);
    }
    drop(from.guard.take());
    let _queued = super::QueuedGuard::new(state.metrics.clone());
    let mut changes = state.fleet.subscribe();
    let mut turn = ticket.is_head();
    loop {
        if turn {
            let routes = super::candidates(state, pin.as_ref())
                .await
                .map_err(|_| format!("{NO_ENGINE_OF_ITS_VERSION} within --version-wait-secs"))?;
            let free = |r: &&super::table::Route| r.load.get() < cap(&r.load);
            let least = routes.iter().filter(free).min_by_key(|r| r.load.get());
            let own = routes.iter().filter(free).find(|r| stay && Arc::ptr_eq(&r.load, &from.route.load));
            // Its own engine, unless another is idle while its own is not.
            let own = own.filter(|o| o.load.get() == 0 || least.is_none_or(|l| l.load.get() > 0));
            if let Some(route) = own.or(least) {
                if let Some(guard) = route.load.try_enter(request.tokens, cap(&route.load)) {
                    drop(ticket);
                    if routes.iter().any(|r| free(&r)) {
                        // Another slot is free: the next in line takes it.
                        queue.wake_next();
                    }
                    return send_part(request, route.clone(), guard, body).await;
                }
            } else if super::candidates_now(state, None).iter().any(|r| free(&r)) {
                // A slot is free on an engine of another version: the next in line may use it.
                ticket.pass_on();
            }
        }
        tokio::select! {
            () = ticket.woken() => turn = true,
            changed = changes.changed() => match changed {
                Ok(()) => turn = ticket.is_head(),
                Err(_) => return Err("the manager is shutting down".into()),
            },
            () = tokio::time::sleep(Duration::from_millis(50)) => turn = ticket.is_head(),
        }
    }
}

/// While a movable request waits for its engine's response headers (a non-streamed answer
/// sends them with its end): once the engine is asked to shed its requests, aborts this one
/// there, so its answer comes at once with the output so far, and never resolves. `aborted`
/// tells the caller it happened (the answer's part then starts as moving).
pub(super) async fn abort_when_asked(
    state: &RouterState,
    route: &super::table::Route,
    headers: &HeaderMap,
    rid: &str,
    asked: Asked<'_>,
    aborted: &std::sync::atomic::AtomicBool,
) {
    let mut signal = route.load.move_signal();
    loop {
        let client = asked.client.is_some_and(super::rids::Live::is_aborted);
        let moves = asked.movable
            && (may_move(state, route, asked.may_cross) || asked.tail.is_some_and(|e| e.asked().is_some()));
        if client || moves {
            aborted.store(true, std::sync::atomic::Ordering::Release);
            loop {
                abort_rid(state, route, headers, rid).await;
                tokio::time::sleep(ABORT_AGAIN).await;
            }
        }
        tokio::select! {
            changed = signal.changed() => if changed.is_err() {
                // (The engine's load is gone; a tail move may still be asked.)
                tail_asked(asked.tail).await;
            },
            () = tail_asked(asked.tail) => {}
            () = async { match asked.client { Some(live) => live.aborted().await, None => std::future::pending().await } } => {}
        }
    }
}

/// What may ask a request to move while it waits for its engine's response headers.
#[derive(Clone, Copy)]
pub(super) struct Asked<'a> {
    /// The request may move now (a continuation would not change it, and its prompt's ids are
    /// known).
    pub movable: bool,
    /// The request may continue on another weight version (partial rollout).
    pub may_cross: bool,
    /// Its place on the tail planner's board.
    pub tail: Option<&'a super::tail::Entry>,
    /// Whether its client aborted it by its rid (the abort is sent again until it ends).
    pub client: Option<&'a super::rids::Live>,
}

/// Resolves when the tail planner asks the request to move (never without a board entry).
async fn tail_asked(entry: Option<&super::tail::Entry>) {
    match entry {
        Some(e) => e.notified().await,
        None => std::future::pending().await,
    }
}

/// Why an aborted part moves, if it does: the router aborted it to move it (`drain`), or a
/// weight update did and the request allows partial rollout (`weight_update`: its engine left
/// routing for the update, which a client's abort through the router never reaches).
fn move_reason(request: &Request, part: &Part, mover: &Mover) -> Option<&'static str> {
    if request.entry.live.is_aborted() || !request.movable.continuable {
        // The client asked for the abort (it ends the answer), or it may not move.
        return None;
    }
    if mover.moving {
        return Some(mover.reason);
    }
    let table = request.state.fleet.routes();
    let left_for_update =
        table.weights_updating && !table.backends.iter().any(|b| Arc::ptr_eq(&b.load, &part.route.load));
    (request.may_cross && left_for_update).then_some("weight_update")
}

/// Whether a part is being moved, why, and when its abort was last sent.
struct Mover {
    moving: bool,
    /// `drain` (its engine sheds its requests) or `tail` (the tail planner asked).
    reason: &'static str,
    aborted_at: tokio::time::Instant,
}

impl Mover {
    fn new(request: &Request, part: &Part) -> Self {
        let reason = match planned_move(request) {
            Some(why) if !part.route.load.moves_requested() => why,
            _ => "drain",
        };
        Self { moving: part.aborted, reason, aborted_at: tokio::time::Instant::now() }
    }

    /// Starts the move when the part's engine asks for it or the tail planner does, and sends
    /// the abort again while the aborted answer has not ended ([`ABORT_AGAIN`]).
    async fn step(&mut self, request: &Request, part: &Part, rid: &str, produced: &Produced) {
        let mut start = false;
        if !self.moving && should_move(request, part, produced) {
            (start, self.reason) = (true, "drain");
        } else if let Some(why) = should_move_for_plan(request, produced).filter(|_| !self.moving) {
            (start, self.reason) = (true, why);
        }
        if start || (self.moving && self.aborted_at.elapsed() >= ABORT_AGAIN) {
            self.moving = true;
            abort(request, part, rid).await;
            self.aborted_at = tokio::time::Instant::now();
        }
    }

    /// When the abort is due again.
    fn again(&self) -> tokio::time::Instant {
        self.aborted_at + ABORT_AGAIN
    }
}

/// One part, read as a stream: its events are passed on as they come (joined with the earlier
/// parts'), the output so far is followed; an abort if its engine drains, after which its last
/// (aborted) event and its `[DONE]` are held back and the request moves. For a whole answer
/// (the client did not ask for a stream) the last event is kept instead, and it is the answer.
///
/// Events of a part that has not moved are passed on as the engine wrote them (a text
/// prompt's `prompt_token_ids` cut out), parsed only for the first one (the prompt's ids, and
/// whether the engine streams incrementally) and where one may be aborted or be an error.
async fn stream_part(
    request: &Request,
    part: &mut Part,
    rid: &str,
    produced: &mut Produced,
    client: &mut Out,
) -> Ended {
    // How the engine streams, when an earlier part's events or the engine itself told.
    let incremental = produced.stream_incremental.or_else(|| part.route.load.streams_increments());
    // A streamed text prompt's first event is parsed for the prompt's ids (it cannot move
    // before they are known).
    let incremental = incremental.filter(|_| ready(&request.movable, produced));
    let seen = Seen { before: produced.clone(), incremental, ..Seen::default() };
    let cap = part_cap(request, produced);
    let mut stream = Streamed {
        unmoved: seen.before.moves.is_empty() && cap.is_none(),
        seen,
        strip: request.movable.text && !request.movable.client_prompt_ids,
        held: None,
        cap,
        whole: client.whole(),
        saw_event: false,
        last: None,
        error: None,
    };
    let mut pending: Vec<u8> = Vec::new();
    let mut mover = Mover::new(request, part);
    let mut signal = part.route.load.move_signal();
    let mut first = part.first.take();
    let mut client_abort_sent = false;
    loop {
        mover.step(request, part, rid, produced).await;
        let frame = match first.take() {
            Some(f) => Some(Ok(f)),
            None => tokio::select! {
                frame = part.body.frame() => frame,
                _ = signal.changed() => continue,
                () = client_aborted(request), if !client_abort_sent => {
                    client_abort_sent = true;
                    abort(request, part, rid).await;
                    continue;
                }
                () = tokio::time::sleep_until(mover.again()), if mover.moving => continue,
                () = tail_asked(request.tail.as_ref()), if !mover.moving => continue,
            },
        };
        let data = match frame {
            None if stream.whole && !stream.saw_event && !pending.is_empty() => {
                // One body instead of the stream asked for: the answer as it is.
                return whole_body(request, part, &mover, produced, client, pending).await;
            }
            None => {
                // Ended without [DONE]: what was seen counts as produced.
                stream.seen.keep(produced);
                return Ended::Lost("the stream ended without [DONE]".into());
            }
            Some(Err(e)) => {
                stream.seen.keep(produced);
                return Ended::Lost(e.to_string());
            }
            Some(Ok(f)) => match f.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
        };
        pending.extend_from_slice(&data);
        if pending.len() > MAX_ANSWER_BYTES {
            stream.seen.keep(produced);
            return Ended::Lost(format!("an event of the answer is larger than {MAX_ANSWER_BYTES} bytes"));
        }
        let mut out = Vec::new();
        while let Some(end) = find(&pending, b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            match on_event(&mut stream, request, part, &mover, produced, event, &mut out) {
                None => {}
                Some(Stop::Moved(reason)) => {
                    stream.seen.keep(produced);
                    return Ended::Moved(reason);
                }
                Some(Stop::Done) => {
                    send_end(stream, out, client).await;
                    finish_body(part).await;
                    return Ended::Done;
                }
            }
        }
        if !out.is_empty() && client.send(Ok(Bytes::from(out))).await.is_err() {
            return Ended::Gone;
        }
    }
}

/// The answer of an engine that sent one body where the router asked for a stream (SGLang
/// always streams when asked; a compatible server may not): passed on as it is when it did not
/// move and was not aborted, else parsed, and either the joined answer goes to the client or
/// what it produced is kept and the request moves.
async fn whole_body(
    request: &Request,
    part: &Part,
    mover: &Mover,
    produced: &mut Produced,
    client: &mut Out,
    buf: Vec<u8>,
) -> Ended {
    let strip = request.movable.text && !request.movable.client_prompt_ids;
    let cap = part_cap(request, produced);
    if produced.moves.is_empty() && cap.is_none() && !moves::may_be_aborted(&buf) {
        let bytes = match strip.then(|| moves::without_member(&buf, "prompt_token_ids")).flatten() {
            Some(cut) => Bytes::from(cut),
            None => Bytes::from(buf),
        };
        return if client.send(Ok(bytes)).await.is_err() { Ended::Gone } else { Ended::Done };
    }
    let Ok(answer) = serde_json::from_slice::<Value>(&buf) else {
        // Not JSON (an engine's own error page): passed on as it is.
        let _ = client.send(Ok(Bytes::from(buf))).await;
        return Ended::Done;
    };
    if moves::aborted(&answer) {
        if let Some(reason) = move_reason(request, part, mover) {
            produced.add_part(&answer);
            return Ended::Moved(reason);
        }
    }
    if cap.is_some_and(|cap| moves::chunk_ended(&answer, cap)) {
        produced.add_part(&answer);
        return Ended::Moved("chunk");
    }
    let out = moves::joined(produced, &request.movable, &answer);
    let as_is = produced.moves.is_empty() && !strip;
    let bytes = if as_is { Bytes::from(buf) } else { Bytes::from(out.to_string()) };
    if client.send(Ok(bytes)).await.is_err() {
        return Ended::Gone;
    }
    Ended::Done
}

/// The end of an answer: a stream's last events and `[DONE]`; a whole answer's last event (or
/// its error, with the status SGLang gives a non-streamed request that fails).
async fn send_end(stream: Streamed, mut out: Vec<u8>, client: &mut Out) {
    if !stream.whole {
        out.extend_from_slice(b"data: [DONE]\n\n");
        let _ = client.send(Ok(Bytes::from(out))).await;
        return;
    }
    let Streamed { error, last, seen, strip, .. } = stream;
    // The last event's payload as the engine wrote it, when it was passed over unparsed.
    let raw = || {
        let json = seen.last_raw.as_deref().and_then(payload)?;
        let cut = strip.then(|| moves::without_member(json, "prompt_token_ids")).flatten();
        Some(cut.unwrap_or_else(|| json.to_vec()))
    };
    let body = match (error, last.or_else(raw)) {
        (Some((status, body)), _) => {
            client.status = status;
            body
        }
        (None, Some(last)) => last,
        (None, None) => {
            let why = "the engine's answer ended without any output or error";
            let _ = client.send(Err(std::io::Error::other(why))).await;
            return;
        }
    };
    let _ = client.send(Ok(Bytes::from(body))).await;
}

/// An engine's error event (`{"error": {"message", "code", ...}}`, what SGLang streams where a
/// non-streamed request gets an error status) as the status and body of a whole answer.
fn error_answer(event: &Value) -> Option<(StatusCode, Vec<u8>)> {
    let error = event.get("error")?;
    if event.get("meta_info").is_some() {
        return None;
    }
    let code = error.get("code").and_then(Value::as_u64).and_then(|c| u16::try_from(c).ok());
    let status = code.and_then(|c| StatusCode::from_u16(c).ok()).filter(|s| s.is_client_error() || s.is_server_error());
    let message = error.get("message").cloned().unwrap_or_else(|| error.clone());
    let body = serde_json::to_vec(&json!({"error": {"message": message}})).unwrap_or_default();
    Some((status.unwrap_or(StatusCode::BAD_GATEWAY), body))
}

/// What a streamed part's reading keeps between events.
struct Streamed {
    seen: Seen,
    /// No earlier part moved: events go out as the engine wrote them.
    unmoved: bool,
    /// A text prompt's `prompt_token_ids` are cut out of the events (the client sent no ids).
    strip: bool,
    /// Why the request moves, once its abort's own event was held back (or, `chunk`, its
    /// chunk's last event was passed on without its finish).
    held: Option<&'static str>,
    /// The part's budget when it is one chunk of the request's ([`part_cap`]).
    cap: Option<u64>,
    /// The client reads one body: events are not sent, the last one is kept.
    whole: bool,
    /// An event with a payload came (else a body that ends is one whole answer).
    saw_event: bool,
    /// Of a whole answer, the last event's payload as the client would get it.
    last: Option<Vec<u8>>,
    /// Of a whole answer, an error event, as a status and body.
    error: Option<(StatusCode, Vec<u8>)>,
}

impl Streamed {
    /// Writes one event's payload: into `out` for a stream, as the answer so far for a whole one.
    fn emit(&mut self, out: &mut Vec<u8>, payload: &[u8]) {
        if self.whole {
            self.last = Some(payload.to_vec());
        } else {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(payload);
            out.extend_from_slice(b"\n\n");
        }
    }
}

/// Where an event ends a streamed part.
enum Stop {
    /// `[DONE]` after a whole answer: it goes to the client and the request ends.
    Done,
    /// `[DONE]` after the event of an abort that moves the request, for this reason.
    Moved(&'static str),
}

/// Passes one whole event of a streamed part on into `out` (joined with the earlier parts'),
/// following the output so far; an aborted one that moves the request is held back.
fn on_event(
    stream: &mut Streamed,
    request: &Request,
    part: &Part,
    mover: &Mover,
    produced: &mut Produced,
    event: Vec<u8>,
    out: &mut Vec<u8>,
) -> Option<Stop> {
    let Some(json) = payload(&event) else {
        if !stream.whole {
            out.extend_from_slice(&event);
        }
        return None;
    };
    stream.saw_event = true;
    if json == b"[DONE]" {
        return Some(on_done(stream, request));
    }
    let error = json.starts_with(b"{\"error\"");
    if stream.unmoved && stream.seen.incremental == Some(false) && !error && !moves::may_be_aborted(json) {
        stream.seen.last = None;
        if stream.whole {
            // The answer so far is this event's: taken from `last_raw` once the stream ends.
            stream.last = None;
        } else {
            let cut = stream.strip.then(|| moves::without_member(json, "prompt_token_ids")).flatten();
            stream.emit(out, cut.as_deref().unwrap_or(json));
        }
        stream.seen.last_raw = Some(event);
        return None;
    }
    let Ok(chunk) = serde_json::from_slice::<Value>(json) else {
        if !stream.whole {
            out.extend_from_slice(&event);
        }
        return None;
    };
    if let Some(answer) = error_answer(&chunk) {
        // Passed on as it is; a whole answer gets it as its status and body.
        if stream.whole {
            stream.error = Some(answer);
        } else {
            out.extend_from_slice(&event);
        }
        return None;
    }
    let seen = &mut stream.seen;
    if seen.before.output_ids.is_empty() {
        produced.learn_prompt(&chunk);
        if let Some(entry) = request.tail.as_ref().filter(|_| ready(&request.movable, produced)) {
            entry.set_ready();
        }
    }
    let ids = chunk.get("output_ids").and_then(Value::as_array).map(|ids| ids.len() as u64);
    let count = chunk.pointer("/meta_info/completion_tokens").and_then(Value::as_u64);
    if seen.incremental.is_none() {
        // An event of one token (the first) reads the same either way; the next one tells.
        // Without output ids nothing tells (SGLang always sends them): the output so far.
        seen.incremental = match (count, ids) {
            (None, _) | (_, None) => Some(false),
            (Some(c), Some(ids)) if c > ids => Some(true),
            (Some(c), _) if c > 1 => Some(false),
            (Some(_), _) => None,
        };
    }
    if seen.incremental != Some(false) {
        seen.gather(&chunk, count);
    }
    let inc = seen.incremental.unwrap_or(false);
    seen.last_raw = None;
    if moves::aborted(&chunk) {
        if let Some(reason) = move_reason(request, part, mover) {
            // The abort's own event: held back, the request continues elsewhere.
            stream.held = Some(reason);
            seen.last = Some(chunk);
            return None;
        }
    }
    let mut joined = moves::joined_chunk(&seen.before, &request.movable, &chunk, inc);
    if stream.cap.is_some_and(|cap| moves::chunk_ended(&chunk, cap)) {
        // The chunk's last event: its output goes to the client, its finish does not (the
        // request continues with its next chunk).
        if let Some(meta) = joined.get_mut("meta_info").and_then(Value::as_object_mut) {
            meta.insert("finish_reason".into(), Value::Null);
        }
        stream.held = Some("chunk");
    }
    stream.seen.last = Some(chunk);
    stream.emit(out, joined.to_string().as_bytes());
    None
}

/// How a streamed part's `[DONE]` ends it: a move held back, or the answer.
fn on_done(stream: &mut Streamed, request: &Request) -> Stop {
    let seen = &stream.seen;
    let moved = |reason: &&str| *reason == "chunk" || seen.last.as_ref().is_some_and(moves::aborted);
    if let Some(reason) = stream.held.filter(moved) {
        return Stop::Moved(reason);
    }
    if stream.whole && seen.incremental == Some(true) {
        // Each event held only its new output: the answer is all of it.
        if let Some(last) = seen.last.as_ref() {
            let answer = moves::joined(&seen.before, &request.movable, &seen.whole_part(last));
            stream.last = Some(answer.to_string().into_bytes());
        }
    }
    Stop::Done
}

/// An SSE event's data (`data: ...`), trimmed.
fn payload(event: &[u8]) -> Option<&[u8]> {
    event.trim_ascii().strip_prefix(b"data:").map(<[u8]>::trim_ascii)
}

/// What the router saw of a streamed part.
#[derive(Default)]
struct Seen {
    /// The request's output before this part.
    before: Produced,
    /// The part's last event, parsed, or as it came (`last_raw`) when it was passed on unparsed.
    last: Option<Value>,
    last_raw: Option<Vec<u8>>,
    /// Whether the engine's events hold only the new output (`--incremental-streaming-output`),
    /// known from an earlier part or from the first event with more than one token; until it is
    /// known to be false, the ids, text and logprobs of every event are gathered here.
    incremental: Option<bool>,
    ids: Vec<u64>,
    text: String,
    lp: Produced,
}

impl Seen {
    /// Adds one event's output (ids, text, logprobs) to what the part produced, while the
    /// events may hold only their new output. SGLang's answer to a request aborted in its
    /// waiting queue repeats the last token and holds the whole text, even when streaming
    /// increments (`tokenizer_manager.py`, 0.5.23): its `count` (`completion_tokens`) says how
    /// many tokens there are.
    fn gather(&mut self, chunk: &Value, count: Option<u64>) {
        let new: Vec<u64> = chunk["output_ids"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
        let text = chunk.get("text").and_then(Value::as_str).unwrap_or("");
        let repeats = self.incremental == Some(true)
            && moves::aborted(chunk)
            && count.is_some_and(|c| (self.ids.len() + new.len()) as u64 > c);
        if repeats {
            let keep = count.map_or(0, |c| usize::try_from(c).unwrap_or(usize::MAX)).saturating_sub(self.ids.len());
            self.ids.extend(new.into_iter().take(keep));
            text.clone_into(&mut self.text);
        } else {
            self.ids.extend(new);
            self.lp.add_logprobs(chunk);
            self.text.push_str(text);
        }
    }

    /// The part's whole answer from an incremental stream: its last event with the output,
    /// text and logprobs of every event.
    fn whole_part(&self, last: &Value) -> Value {
        let mut part = last.clone();
        part["text"] = json!(self.text);
        part["output_ids"] = json!(self.ids);
        if let Some(meta) = part.get_mut("meta_info").and_then(Value::as_object_mut) {
            for (key, entries) in &self.lp.logprobs {
                meta.insert(key.clone(), entries.clone());
            }
            for (key, entries) in self.lp.input_logprobs.iter().flatten() {
                meta.insert(key.clone(), entries.clone());
            }
        }
        part
    }

    /// Records what the part produced: its last event's output (cumulative events), or the ids
    /// and logprobs gathered from every event (incremental ones).
    fn keep(&self, produced: &mut Produced) {
        let parsed = match (&self.last, &self.last_raw) {
            (None, Some(raw)) => payload(raw).and_then(|json| serde_json::from_slice::<Value>(json).ok()),
            _ => None,
        };
        let last = self.last.as_ref().or(parsed.as_ref());
        let mut now = self.before.clone();
        match (last, self.incremental.unwrap_or(false)) {
            (Some(chunk), false) => now.add_part(chunk),
            (_, true) => {
                if now.output_ids.is_empty() && now.input_logprobs.is_none() {
                    now.input_logprobs.clone_from(&self.lp.input_logprobs);
                }
                for (key, entries) in &self.lp.logprobs {
                    let all = now.logprobs.entry(key.clone()).or_insert_with(|| serde_json::json!([]));
                    if let (Some(all), Some(entries)) = (all.as_array_mut(), entries.as_array()) {
                        all.extend(entries.iter().cloned());
                    }
                }
                // The part's whole output, with the version(s) its last event names.
                let mut meta = serde_json::Map::new();
                if let Some(m) = last.and_then(|chunk| chunk.get("meta_info")).and_then(Value::as_object) {
                    for key in ["weight_version", "weight_versions"] {
                        if let Some(v) = m.get(key) {
                            meta.insert(key.into(), v.clone());
                        }
                    }
                }
                now.add_part(&json!({"text": self.text, "output_ids": self.ids, "meta_info": meta}));
            }
            (None, false) => {}
        }
        now.moves = produced.moves.clone();
        now.engines = produced.engines.clone();
        now.stream_incremental = self.incremental.or(self.before.stream_incremental);
        if now.prompt_ids.is_none() {
            now.prompt_ids.clone_from(&produced.prompt_ids);
        }
        *produced = now;
    }
}

/// Reads what follows a stream's `[DONE]` (the end of its chunked body), so that the
/// connection goes back to the router's pool instead of being closed.
async fn finish_body(part: &mut Part) {
    let rest = async { while let Some(Ok(_)) = part.body.frame().await {} };
    let _ = tokio::time::timeout(Duration::from_secs(1), rest).await;
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

/// The request was aborted right at its last token: its answer is complete.
async fn finish_at_budget(request: &Request, produced: &Produced, client: &mut Out) {
    let n = produced.output_ids.len();
    let last = json!({
        "text": "", "output_ids": [],
        "meta_info": {"completion_tokens": 0, "finish_reason": {"type": "length", "length": n}, "weight_versions": []},
    });
    let _ = client.send(Ok(last_answer(request, produced, &last))).await;
}

/// The end of an answer the router writes itself (`last`: an empty final part): the joined
/// body, or for a stream the last event (only the counts and finish for an incremental one,
/// whose events carried the tokens already) and `[DONE]`.
fn last_answer(request: &Request, produced: &Produced, last: &Value) -> Bytes {
    if !request.movable.stream {
        return Bytes::from(moves::joined(produced, &request.movable, last).to_string());
    }
    let out = if produced.stream_incremental == Some(true) {
        moves::joined_chunk(produced, &request.movable, last, true)
    } else {
        moves::joined(produced, &request.movable, last)
    };
    Bytes::from(format!("data: {out}\n\ndata: [DONE]\n\n"))
}

/// Ends the answer of a request generated in chunks that could not go on between two chunks:
/// the output so far with finish reason `abort` (SGLang's shape), as a weight update's abort
/// would have ended it.
async fn finish_aborted(request: &Request, produced: &Produced, client: &mut Out, why: &str) {
    tracing::warn!(error = why, "a request generated in chunks ends between two chunks");
    let last = json!({
        "text": "", "output_ids": [],
        "meta_info": {"completion_tokens": 0, "weight_versions": [],
                      "finish_reason": {"type": "abort", "message": why}},
    });
    let _ = client.send(Ok(last_answer(request, produced, &last))).await;
}

/// Ends the client's answer with an error: an error event and `[DONE]` for a stream (SGLang's
/// in-stream shape); otherwise the error becomes the answer's status (see [`whole`]).
async fn fail(request: &Request, client: &mut Out, why: &str) {
    tracing::warn!(error = why, "moving request failed");
    if request.movable.stream {
        let event = json!({"error": {"message": format!("{why}; the output so far is incomplete, send the request again"),
                                     "type": "engine_lost", "code": 502, "retryable": true}});
        let _ = client.send(Ok(Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n")))).await;
    } else {
        let why = format!("{why}; send the request again");
        let _ = client.send(Err(std::io::Error::other(why))).await;
    }
}
