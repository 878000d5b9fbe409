//! Forwarding one data-plane request, in four steps: [`admit`] checks it and reads what routing
//! needs from it, once; then, up to [`MAX_ATTEMPTS`] times, [`pick`] chooses an engine and
//! counts the request on it (waiting in the router's queue while every engine is at its cap)
//! and [`send_once`] sends it there; [`proxy`] retries on another engine while no answer came.
//!
//! Guarantees: a request is counted on exactly one engine at a time; nothing is sent again once
//! an answer's headers were forwarded; every way out answers the client (a JSON error names
//! the cause). What is retried and what is not, and the time bounds, are in the module docs of
//! `router`.

use super::answer::{Learn, Tracked};
use super::headers::{strip_hop_by_hop, to_engine, OwnHeaders};
use super::metrics::ErrorKind;
use super::rids::RidEntry;
use super::send::{send, EngineBody};
use super::table::Route;
use super::{
    affinity, candidates, engine_cap, error, models, moving, path_and_query, peek, tail, QueuedGuard, RouterState,
    ENGINE_ID_HEADER, MAX_ATTEMPTS, MAX_BODY_BYTES, VERSION_HEADER,
};
use crate::foundation::slots::{Joining, Ticket};
use crate::registry::fleet::{EngineLoad, InFlightGuard};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::uri::PathAndQuery;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use rollout_core::moves::Movable;
use rollout_core::rids::{take_client_rids, IdSwap};
use rollout_core::routes::Intent;
use rollout_core::routing::{choose, InflightCap, Policy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A request the router will forward, with what it read from it once.
struct Admitted {
    method: Method,
    path: PathAndQuery,
    /// End-to-end headers only, without the manager's token.
    headers: HeaderMap,
    body: Bytes,
    info: peek::RequestInfo,
    policy: Policy,
    partial_rollout: bool,
    /// A `/generate` that may move while it runs (`router::moving`): its body as JSON, what
    /// moves, and the `rid` it is aborted by. Taken by the attempt that hands it over.
    movable: Option<MovableParts>,
    /// The client's rids, each with the router's that replaced it (`router::rids`).
    rid_pairs: Vec<(String, String)>,
    /// Its places among the requests a client may abort by rid: one per client rid (a batch
    /// has several), or for a movable request without one, the router's rid. Taken with it.
    entries: Vec<RidEntry>,
    /// What learned lengths are keyed by: the session, else the prompt (GRPO siblings).
    class: Option<u64>,
    budget: u64,
    /// KV tokens it is expected to hold (prompt and expected output).
    tokens: u64,
    /// capacity: the session key, else the prompt's hash; session: the session key only.
    affinity_key: Option<u64>,
    timeout: Duration,
}

/// An engine chosen for one attempt, with the request counted on it.
struct Picked {
    routes: Arc<Vec<Route>>,
    index: usize,
    /// The affinity table named an engine that could take the request.
    had_affine: bool,
    /// It was chosen (the policy kept the affinity).
    kept: bool,
    guard: InFlightGuard,
}

/// How one attempt ended.
enum Attempt {
    /// The client's answer (an engine's, or an error not worth another engine).
    Answered(Response),
    /// No answer worth forwarding came; why, for the last error. Another engine may be tried.
    Failed(String),
}

pub(super) async fn proxy(State(state): State<Arc<RouterState>>, request: Request) -> Response {
    state.metrics.request();
    let mut request = match admit(&state, request).await {
        Ok(request) => request,
        Err(answer) => return answer,
    };
    // Engines already tried, by the address of their load (as in `Arc::ptr_eq`).
    let mut tried = [0usize; MAX_ATTEMPTS];
    let mut last_error = String::new();
    let queue_deadline = tokio::time::Instant::now() + request.timeout;
    for attempt in 0..MAX_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(5 << attempt)).await;
        }
        let picked = match pick(&state, &request, &tried[..attempt], queue_deadline).await {
            Ok(Some(picked)) => picked,
            Ok(None) => break,
            Err(answer) => return answer,
        };
        tried[attempt] = load_addr(&picked.routes[picked.index].load);
        if attempt > 0 {
            state.metrics.retry();
        }
        match send_once(&state, &mut request, picked, attempt).await {
            Attempt::Answered(answer) => return answer,
            Attempt::Failed(why) => last_error = why,
        }
    }
    state.metrics.error(ErrorKind::NoAnswer);
    let msg = format!("no engine answered this request (last: {last_error}); see GET /rollout/engines");
    error(StatusCode::BAD_GATEWAY, "no_engine_answered", &msg)
}

/// Checks a request and reads it once: the path is data plane, the body within its limit, the
/// router's own headers and the version pin valid. `Err` is the answer to give at once (a
/// refusal, or `/v1/models`, which the router answers itself).
async fn admit(state: &Arc<RouterState>, request: Request) -> Result<Admitted, Response> {
    let metrics = &state.metrics;
    if let Some(refusal) = outside_data_plane(state, &request) {
        return Err(refusal);
    }
    if models::is_models_path(request.uri().path()) {
        return Err(models::answer(state, request).await);
    }
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, MAX_BODY_BYTES).await.map_err(|e| {
        metrics.error(ErrorKind::BadRequest);
        let msg = format!("request body rejected: {e}; the limit is {MAX_BODY_BYTES} bytes");
        error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", &msg)
    })?;
    let bad = |code: &str, msg: &str| {
        metrics.error(ErrorKind::BadRequest);
        error(StatusCode::BAD_REQUEST, code, msg)
    };
    let own = OwnHeaders::of(&parts.headers);
    let policy = match own.routing_policy.map(str::parse::<Policy>) {
        None => state.config.routing_policy,
        Some(Ok(p)) => p,
        Some(Err(e)) => return Err(bad("invalid_routing_policy", &format!("x-routing-policy: {e}"))),
    };
    let partial_rollout = match own.partial_rollout.map(str::trim) {
        None => state.config.partial_rollout,
        Some(v) if v.eq_ignore_ascii_case("true") => true,
        Some(v) if v.eq_ignore_ascii_case("false") => false,
        Some(v) => {
            return Err(bad("invalid_partial_rollout", &format!("x-partial-rollout: {v:?} is not true or false")))
        }
    };
    // A version the request names (body, then headers) comes first; then its SMG version
    // policy, then the fleet's default (`--rl-version-policy`).
    let policy_pin = match own.smg_version_policy {
        None => state.version_policy.clone(),
        Some(text) => rollout_core::routing::VersionPolicy::parse(text)
            .map(|p| p.pin())
            .map_err(|e| bad("invalid_version_policy", &format!("x-smg-version-policy: {e}")))?,
    };
    let pin_header = peek::pin_from_headers(own.weight_version, own.min_weight_version).or(policy_pin);
    let session_header = own.session_id.or(own.smg_routing_key);
    let info = peek::peek(&body, session_header, pin_header).map_err(|e| bad("invalid_weight_version", &e.0))?;
    let body = if info.pin_in_body { peek::strip_pin(&body).map(Bytes::from).unwrap_or(body) } else { body };
    // A client's own rids become the router's (an engine sees no rid that is a prefix of
    // another), and a `/generate` request that can move to another engine while it runs
    // (router::moving) gets one to be aborted by.
    let prepared = prepare(state, &parts.method, parts.uri.path(), body, partial_rollout);
    let (body, movable, rid_pairs) = (prepared.body, prepared.movable, prepared.rid_pairs);
    let entries = match (&movable, rid_pairs.as_slice()) {
        (Some((_, _, ours, _)), []) => vec![state.rids.enter(ours, ours)],
        _ => rid_pairs.iter().map(|(client, ours)| state.rids.enter(client, ours)).collect(),
    };
    let session_key = info.session.as_deref().map(affinity::session_key);
    let class = session_key.or(info.prompt_hash);
    let budget = info.output_budget;
    let tokens = info.tokens_expecting(state.fleet.slot_queue().lengths(|l| l.expected(class, budget)));
    let affinity_key = match policy {
        Policy::Capacity => session_key.or(info.prompt_hash),
        Policy::Session => session_key,
        _ => None,
    };
    Ok(Admitted {
        path: path_and_query(&parts.uri),
        method: parts.method,
        headers: to_engine(parts.headers, state.token.as_deref()),
        body,
        info,
        policy,
        partial_rollout,
        movable,
        rid_pairs,
        entries,
        class,
        budget,
        tokens,
        affinity_key,
        timeout: Duration::from_secs_f64(state.config.request_timeout_secs),
    })
}

/// Fail closed: only the data plane is forwarded (`rollout_core::routes`); the refusal of any
/// other request.
fn outside_data_plane(state: &RouterState, request: &Request) -> Option<Response> {
    let path = request.uri().path();
    match rollout_core::routes::intent(request.method().as_str(), path) {
        Intent::Forward => None,
        Intent::WrongMethod(allowed) => {
            state.metrics.error(ErrorKind::BadRequest);
            let msg = format!("{path} takes {}, not {}", allowed.join(" or "), request.method());
            let mut resp = error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", &msg);
            if let Ok(v) = axum::http::HeaderValue::from_str(&allowed.join(", ")) {
                resp.headers_mut().insert(axum::http::header::ALLOW, v);
            }
            Some(resp)
        }
        Intent::Refuse(why) => {
            state.metrics.error(ErrorKind::BadRequest);
            Some(error(StatusCode::FORBIDDEN, why.code(), &why.message(path)))
        }
    }
}

/// Chooses an engine for the next attempt and counts the request on it (with a cap, only on one
/// under it, waiting in the router's queue until one is). A retry goes to an engine not in
/// `tried` while there is one. `Ok(None)`: no engine left to try; `Err`: the answer to give
/// (no engine at all, or the queue wait or version wait ran out).
async fn pick(
    state: &RouterState,
    request: &Admitted,
    tried: &[usize],
    queue_deadline: tokio::time::Instant,
) -> Result<Option<Picked>, Response> {
    let cap_mode = state.config.max_inflight_per_engine;
    let capped = cap_mode.enabled();
    let queue = state.fleet.slot_queue();
    // This request's place in the router's queue while every engine is at its cap.
    let mut queued: Option<(Ticket, QueuedGuard)> = None;
    loop {
        // Each attempt reads the current table: engines may have left routing meanwhile.
        let routes = candidates(state, request.info.pin.as_ref()).await?;
        // Once every candidate has been tried (a pinned request may have only one), any of them
        // again: it may have recovered.
        let all_tried = routes.iter().all(|b| tried.contains(&load_addr(&b.load)));
        let skip = if all_tried { &[][..] } else { tried };
        let Some(open) = open_engines(&routes, skip, capped.then_some(cap_mode)) else { return Ok(None) };
        // A new request queues behind waiting ones rather than take a slot freed for them.
        if capped && (open.is_empty() || (queued.is_none() && state.metrics.queued.get() > 0)) {
            let (ticket, _) = queued.get_or_insert_with(|| {
                let joining = Joining {
                    class: request.class,
                    budget: request.budget,
                    session: request.info.session.is_some(),
                    so_far: None,
                };
                (queue.join(joining), QueuedGuard::new(state.metrics.clone()))
            });
            if !open.is_empty() {
                // Room, but others wait: the head of the queue (maybe this request) takes it.
                queue.wake_next();
            } else if (request.info.pin.is_some() || !tried.is_empty()) && room_elsewhere(state, cap_mode) {
                // The free slot is on an engine this request may not use: pass it on.
                ticket.pass_on();
            }
            wait_for_slot(state, ticket, queue_deadline, request.timeout).await?;
            continue;
        }
        let loads: Vec<_> = open.iter().map(|&i| routes[i].load.snapshot()).collect();
        let affine = request
            .affinity_key
            .and_then(|k| state.affinity.get(k))
            .and_then(|id| open.iter().position(|&i| routes[i].engine_id.as_str() == &*id));
        let rotor = state.rotor.fetch_add(1, Ordering::Relaxed);
        let Some((pos, kept)) = choose(request.policy, &loads, request.tokens, affine, rotor, &state.gate) else {
            return Ok(None);
        };
        let index = open[pos];
        let load = &routes[index].load;
        let guard = if capped {
            // Another request may have taken the last slot since the check: look again.
            let Some(guard) = load.try_enter(request.tokens, engine_cap(cap_mode, load)) else { continue };
            guard
        } else {
            load.enter(request.tokens)
        };
        // Counted first, then checked: a scale-in or weight update that took the engine out
        // of routing before this request was counted sees it in its drain; one that did
        // after, we see here, and pick again from the new table (not a failed attempt).
        if !state.fleet.routes().is_routable(load) {
            drop(guard);
            continue;
        }
        if capped && queued.take().is_some() && (open.len() > 1 || load.get() < engine_cap(cap_mode, load)) {
            // More than one slot was free (an engine joined): the next in line takes one.
            queue.wake_next();
        }
        return Ok(Some(Picked { routes, index, had_affine: affine.is_some(), kept, guard }));
    }
}

/// Of `routes`, the indexes of those not in `skip` and (with a cap) under it; None when every
/// route is in `skip`.
fn open_engines(routes: &[Route], skip: &[usize], cap: Option<InflightCap>) -> Option<Vec<usize>> {
    let mut untried = 0;
    let mut open: Vec<usize> = Vec::with_capacity(routes.len());
    for (i, b) in routes.iter().enumerate() {
        if !skip.contains(&load_addr(&b.load)) {
            untried += 1;
            if cap.is_none_or(|cap| b.load.get() < engine_cap(cap, &b.load)) {
                open.push(i);
            }
        }
    }
    (untried > 0).then_some(open)
}

/// Waits for a slot (this request's turn), or, at the head of the queue, for a new engine or the
/// 50 ms tick, in case a wake-up went astray; `Err` (503) once `deadline` passed.
async fn wait_for_slot(
    state: &RouterState,
    ticket: &Ticket,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Result<(), Response> {
    let mut changes = state.fleet.subscribe();
    loop {
        tokio::select! {
            () = ticket.woken() => return Ok(()),
            changed = changes.changed() => if changed.is_err() || ticket.is_head() { return Ok(()) },
            () = tokio::time::sleep(Duration::from_millis(50)) => if ticket.is_head() { return Ok(()) },
            () = tokio::time::sleep_until(deadline) => {
                state.metrics.error(ErrorKind::QueueTimeout);
                let cap = state.config.max_inflight_per_engine;
                let msg = format!(
                    "every engine had its --max-inflight-per-engine ({cap}) requests in flight for \
                     --request-timeout-secs ({timeout:?}); retry later, add engines, or raise the limit"
                );
                return Err(error(StatusCode::SERVICE_UNAVAILABLE, "router_queue_timeout", &msg));
            }
        }
    }
}

/// Sends the request to the picked engine once and waits for its answer's head (for a request
/// that cannot move, its first body frame too). A 503 while another engine may be tried, or no
/// answer, fails the attempt; any other answer is handed to the client.
async fn send_once(state: &Arc<RouterState>, request: &mut Admitted, picked: Picked, attempt: usize) -> Attempt {
    let Picked { routes, index, had_affine, kept, guard } = picked;
    let backend = &routes[index];
    let metrics = &state.metrics;
    let learn = Learn::start(state.fleet.slot_queue(), request.class, request.budget, request.info.prompt_tokens);
    if had_affine {
        metrics.affinity(kept);
    }
    if let (Some(k), false) = (request.affinity_key, kept) {
        state.affinity.put(k, &backend.engine_id);
    }
    let started = Instant::now();
    // One timer bounds the whole answer: it first bounds the wait for the headers, then
    // goes with the body (Tracked) to bound the rest.
    let mut deadline = Box::pin(tokio::time::sleep(request.timeout));
    // A successful answer is held until its first body frame: an engine that dies between
    // its headers and its first byte (SGLang sends a stream's headers before the prefill)
    // gave the client nothing yet, so the request is retried like one that got no answer.
    // A movable request's answer is followed by router::moving, which continues it on
    // another engine if its engine dies at any point: its headers are not held.
    let hold = request.movable.is_none();
    let renamed = models::renamed_for(state, &request.path, &request.body, backend);
    let sent = async {
        let body = renamed.as_ref().unwrap_or(&request.body);
        let resp = send(state, backend, &request.method, &request.path, &request.headers, body).await?;
        if !hold || !resp.status().is_success() {
            return Ok((resp, None));
        }
        let (parts, mut body) = resp.into_parts();
        match http_body_util::BodyExt::frame(&mut body).await {
            Some(Err(e)) => Err(format!("the engine's answer broke before its first byte: {e}")),
            first => Ok((hyper::Response::from_parts(parts, body), first.and_then(Result::ok))),
        }
    };
    let sent = state.fleet.unless_lost(&backend.load, sent);
    let on_board = board_entry(state, request, backend);
    // A movable request whose engine is asked to shed its requests before it answered is
    // aborted there (router::moving continues it elsewhere); so is one its client aborted.
    let aborted = AtomicBool::new(false);
    let abort_when_asked = async {
        match &request.movable {
            // A streamed text prompt cannot move before its ids came back (with its first event).
            Some((_, m, rid, _)) => {
                let asked = moving::Asked {
                    movable: m.continuable && moving::ready(m, &Default::default()),
                    may_cross: request.partial_rollout,
                    tail: on_board.as_ref(),
                    client: request.entries.first().map(|e| &*e.live),
                };
                moving::abort_when_asked(state, backend, &request.headers, rid, asked, &aborted).await
            }
            _ => std::future::pending().await,
        }
    };
    let answer = tokio::select! {
        biased;
        answer = sent => answer,
        () = abort_when_asked => unreachable!("never resolves"),
        () = deadline.as_mut() => {
            metrics.error(ErrorKind::Timeout);
            tracing::warn!(engine_id = %backend.engine_id, timeout = ?request.timeout, "engine sent no response headers in time");
            let msg = format!(
                "engine {} did not answer within --request-timeout-secs ({:?}); the request was not retried \
                 because the engine may still be working on it",
                backend.engine_id, request.timeout
            );
            return Attempt::Answered(error(StatusCode::GATEWAY_TIMEOUT, "engine_timeout", &msg));
        }
    };
    match answer {
        Ok((resp, _))
            if resp.status() == StatusCode::SERVICE_UNAVAILABLE && attempt + 1 < MAX_ATTEMPTS.min(routes.len()) =>
        {
            tracing::debug!(engine_id = %backend.engine_id, "engine answered 503; trying another");
            Attempt::Failed(format!("{}: 503", backend.engine_id))
        }
        Ok((resp, first)) => {
            metrics.first_byte.observe(started.elapsed());
            let answered = Answered {
                resp,
                first,
                backend,
                guard,
                learn,
                started,
                deadline,
                on_board,
                aborted: aborted.load(Ordering::Acquire),
                rename: renamed.as_ref().and_then(|body| models::answer_rename(&request.body, body)),
            };
            Attempt::Answered(hand_over(state, request, answered).await)
        }
        Err(e) => {
            tracing::warn!(engine_id = %backend.engine_id, error = %e, "engine gave no response; trying another");
            Attempt::Failed(format!("{}: {e}", backend.engine_id))
        }
    }
}

/// A movable request's place on the tail planner's board while it runs (`--move-tail`, one a
/// continuation would not change: `router::tail`).
fn board_entry(state: &RouterState, request: &Admitted, backend: &Route) -> Option<tail::Entry> {
    let (_, m, _, _) = request.movable.as_ref().filter(|(_, m, _, _)| state.config.move_tail && m.continuable)?;
    let entry = tail::Request {
        class: request.class,
        budget: request.budget,
        prompt: request.info.prompt_tokens,
        session: request.info.session.is_some(),
        ready: moving::ready(m, &Default::default()),
    };
    Some(state.tail.enter(backend.load.clone(), entry))
}

/// An engine's answer, head read, and what goes with it to the client.
struct Answered<'a> {
    resp: hyper::Response<EngineBody>,
    /// Its first body frame, when it was held for it.
    first: Option<http_body::Frame<Bytes>>,
    backend: &'a Route,
    guard: InFlightGuard,
    learn: Learn,
    started: Instant,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    on_board: Option<tail::Entry>,
    /// The engine was asked to abort it before it answered (router::moving continues it).
    aborted: bool,
    /// What the answer says that the client should read otherwise (the engine's model name
    /// for the one the client named: [`models::answer_rename`]).
    rename: Option<(Vec<u8>, Vec<u8>)>,
}

/// The client's answer from an engine's: a successful movable request's goes on through
/// `router::moving` (which may continue it elsewhere); any other streams back as it came.
async fn hand_over(state: &Arc<RouterState>, request: &mut Admitted, answered: Answered<'_>) -> Response {
    let Answered { resp, first, backend, guard, learn, started, deadline, on_board, aborted, rename } = answered;
    let metrics = &state.metrics;
    let (mut head, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut head.headers);
    if let Some(v) = &backend.id_header {
        head.headers.insert(ENGINE_ID_HEADER, v.clone());
    }
    if let Some(v) = &backend.version_header {
        head.headers.insert(VERSION_HEADER, v.clone());
    }
    // Only a successful answer's length is learned (the others just end).
    let learn = (head.status == StatusCode::OK).then_some(learn);
    // (The attempt ends here whatever the status: the request is not needed again.)
    let mut swap = IdSwap::default();
    for (client, ours) in &request.rid_pairs {
        swap.add(ours, client);
    }
    if let Some((engine, client)) = &rename {
        swap.rename(engine, client);
    }
    let entries = std::mem::take(&mut request.entries);
    if let (Some(movable), StatusCode::OK) = (request.movable.take(), head.status) {
        let Some(entry) = entries.into_iter().next() else {
            unreachable!("a movable request has its place among the rids (admit)")
        };
        let part = moving::Part {
            engine_id: backend.engine_id.clone(),
            route: backend.clone(),
            guard: Some(guard),
            body: incoming,
            first,
            aborted,
        };
        let follow = Follow { movable, learn, started, on_board, entry, swap };
        return follow_moving(state, request, head, part, follow).await;
    }
    metrics.response(head.status.as_u16());
    let sse = head
        .headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !swap.is_empty() {
        // The client's ids are put back: the length may change.
        head.headers.remove(axum::http::header::CONTENT_LENGTH);
    }
    let tracked = Tracked {
        swap: (!swap.is_empty()).then_some(swap),
        _entries: entries,
        learn,
        inner: incoming,
        first,
        sse,
        partial: bytes::BytesMut::new(),
        engine_id: backend.engine_id.clone(),
        closed: false,
        ended: false,
        _guard: guard,
        started,
        metrics: state.metrics.clone(),
        deadline,
        timeout: request.timeout,
    };
    Response::from_parts(head, Body::new(tracked))
}

/// What goes with a movable request's answer into `router::moving`.
struct Follow {
    movable: MovableParts,
    learn: Option<Learn>,
    started: Instant,
    on_board: Option<tail::Entry>,
    entry: RidEntry,
    swap: IdSwap,
}

/// The client's answer of a movable request, followed part by part by `router::moving`: a
/// stream as it comes, a whole answer once complete (its status that of its end).
async fn follow_moving(
    state: &Arc<RouterState>,
    request: &Admitted,
    mut head: axum::http::response::Parts,
    part: moving::Part,
    follow: Follow,
) -> Response {
    let Follow { movable: (value, m, rid, chunk), learn, started, on_board, entry, swap } = follow;
    let metrics = &state.metrics;
    // The body may change (joined after a move).
    head.headers.remove(axum::http::header::CONTENT_LENGTH);
    let chunk =
        chunk.map(|tokens| moving::Chunking { tokens, class: request.class, session: request.info.session.is_some() });
    if !m.stream {
        // Read from the engine as a stream (see `prepare`), answered whole.
        head.headers.insert(axum::http::header::CONTENT_TYPE, axum::http::HeaderValue::from_static("application/json"));
    }
    let moving_request = moving::Request {
        learn,
        started,
        state: state.clone(),
        headers: request.headers.clone(),
        path: request.path.clone(),
        body: value,
        movable: m,
        rid,
        pin: request.info.pin.clone(),
        may_cross: request.partial_rollout,
        tokens: request.tokens,
        timeout: request.timeout,
        tail: on_board,
        entry,
        swap,
        chunk,
    };
    if moving_request.movable.stream {
        metrics.response(head.status.as_u16());
        return Response::from_parts(head, moving::body(moving_request, part));
    }
    let answer = match moving::whole(moving_request, part).await {
        // (Its length goes with it: hyper writes it from the body's exact size.)
        Ok(whole) => {
            head.status = whole.status;
            // Its headers name the engine it ended on.
            if let Some(route) = whole.ended_on {
                for (name, value) in [(ENGINE_ID_HEADER, route.id_header), (VERSION_HEADER, route.version_header)] {
                    match value {
                        Some(v) => head.headers.insert(name, v),
                        None => head.headers.remove(name),
                    };
                }
            }
            Response::from_parts(head, Body::from(whole.body))
        }
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            metrics.error(ErrorKind::Timeout);
            error(StatusCode::GATEWAY_TIMEOUT, "engine_timeout", &e.to_string())
        }
        Err(e) => error(StatusCode::BAD_GATEWAY, "engine_lost", &e.to_string()),
    };
    metrics.response(answer.status().as_u16());
    answer
}

fn load_addr(load: &Arc<EngineLoad>) -> usize {
    Arc::as_ptr(load) as usize
}

/// A movable request: the body to continue from, what it asks, its `rid`, and the chunk size
/// it is generated in (`--chunk-tokens`, decided once at admission).
type MovableParts = (serde_json::Value, Movable, String, Option<u64>);

/// A request's body as the router sends it.
struct Prepared {
    body: Bytes,
    movable: Option<MovableParts>,
    /// The client's rids and the router's that replaced them.
    rid_pairs: Vec<(String, String)>,
}

/// A request's body as the router sends it: a client's own `rid` (a string, or a batch's list)
/// replaced by the router's ([`super::rids`]); a `/generate` request that may move while it runs
/// (`--move-on-drain` and the other moves, a prompt of ids or text: see
/// `rollout_core::moves::Movable`) given a `rid` if it had none, its text prompt asking for the
/// prompt's ids, and when the client asked for one body, asking the engine for a stream (the
/// output so far every [`moving::WHOLE_STREAM_INTERVAL`] tokens, which the router answers
/// whole). Other requests as they are. A body is parsed only when it names a `rid` or may move.
fn prepare(state: &RouterState, method: &Method, path: &str, body: Bytes, partial_rollout: bool) -> Prepared {
    let as_is = |body| Prepared { body, movable: None, rid_pairs: Vec::new() };
    if method != Method::POST && method != Method::PUT {
        return as_is(body);
    }
    let moves =
        state.config.move_on_drain || state.config.move_tail || state.config.chunk_tokens > 0 || partial_rollout;
    let may_move = moves
        && method == Method::POST
        && path == "/generate"
        && (memchr::memmem::find(&body, b"\"input_ids\"").is_some()
            || memchr::memmem::find(&body, b"\"text\"").is_some());
    let names_rid = memchr::memmem::find(&body, b"\"rid\"").is_some();
    if !may_move && !names_rid {
        return as_is(body);
    }
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&body) else { return as_is(body) };
    let rid_pairs = take_client_rids(&mut value, || state.rids.next()).unwrap_or_default();
    let movable = may_move.then(|| Movable::of(&value)).flatten();
    let Some(movable) = movable else {
        if rid_pairs.is_empty() {
            return as_is(body);
        }
        return match serde_json::to_vec(&value) {
            Ok(b) => Prepared { body: Bytes::from(b), movable: None, rid_pairs },
            Err(_) => as_is(body),
        };
    };
    movable.prepare(&mut value);
    let rid = match rid_pairs.first() {
        Some((_, ours)) => ours.clone(),
        None => {
            let rid = state.rids.next();
            value["rid"] = serde_json::json!(rid);
            rid
        }
    };
    if !movable.stream {
        // Read as a stream, answered whole (router::moving): a lost engine's output is known.
        value["stream"] = serde_json::json!(true);
        let params = value.as_object_mut().map(|o| o.entry("sampling_params").or_insert_with(|| serde_json::json!({})));
        if let Some(params) = params {
            if params.is_null() {
                *params = serde_json::json!({});
            }
            if let Some(params) = params.as_object_mut() {
                params.insert("stream_interval".into(), serde_json::json!(moving::WHOLE_STREAM_INTERVAL));
            }
        }
    }
    // The first part of a request generated in chunks asks for one chunk (the body kept, to
    // continue from, asks for the whole budget).
    let chunk = chunking(state, &value);
    let first_cap = chunk.and_then(|chunk| rollout_core::moves::chunk_cap(&movable, 0, chunk));
    let sent = match first_cap {
        Some(cap) => {
            let mut part = value.clone();
            rollout_core::moves::cap_part(&mut part, cap);
            serde_json::to_vec(&part)
        }
        None => serde_json::to_vec(&value),
    };
    match sent {
        Ok(b) => Prepared { body: Bytes::from(b), movable: Some((value, movable, rid, chunk)), rid_pairs },
        Err(_) => as_is(body),
    }
}

/// The chunk size a movable request (`body`, as sent) is generated in (`--chunk-tokens`);
/// None when chunks are off, the request may not be cut (`rollout_core::moves::continuable`), or
/// the budgets the router sees are the lengths (chunks are for lengths it cannot tell, and with
/// informative budgets longest-first already orders the work: 1.22x the bound with chunks
/// against 1.03x without on the bench's exact budgets).
fn chunking(state: &RouterState, body: &serde_json::Value) -> Option<u64> {
    let tokens = state.config.chunk_tokens;
    let chunked = tokens > 0
        && rollout_core::moves::continuable(body)
        && !state.fleet.slot_queue().lengths(rollout_core::lengths::LengthEstimator::budgets_are_lengths);
    chunked.then_some(tokens)
}

/// Whether some routable engine is under its cap (one a pinned or retried request may not use).
fn room_elsewhere(state: &RouterState, cap: InflightCap) -> bool {
    state.fleet.routes().backends.iter().any(|b| b.load.get() < engine_cap(cap, &b.load))
}
