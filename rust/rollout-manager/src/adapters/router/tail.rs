//! Moves for the long tail of a batch (`--move-tail`; the decisions are
//! `rollout_core::tail::plan` and `rollout_core::tail::preempt`).
//!
//! Every movable request running on an engine holds an [`Entry`] on the router's [`Board`]:
//! which engine runs its current part and since when, how much it produced before (and, for a
//! stream, so far), and a flag the planner sets to ask it to move. [`run`] looks at the board
//! every [`PLAN_EVERY`]: when no weight update is in flight and no earlier move is still under
//! way, it takes a snapshot (the engines' in-flight counts and caps, each request's expected
//! output from the router's learned lengths). With nothing waiting in the router, it asks the
//! requests `plan` picked to move (reason `tail`): each is aborted on its engine by its own
//! answer's future (`router::moving`, as for a drain) and continues on the least loaded engine
//! it may use. With requests waiting and every engine full, it asks the requests `preempt`
//! picked to give their slot to a waiting request expected to be much longer (reason
//! `preempt`): each is aborted the same way and its continuation waits in the router's queue
//! under its own expected length. A moved answer's `meta_info.moves` names the reason.
//!
//! Output so far: what earlier parts produced, plus an estimate for the current part from how
//! long it has run at the fleet's per-request generation rate (a whole answer shows nothing
//! until its end, and a stream's events are passed on unparsed), so it is a guess until the
//! abort returns the real output.
//!
//! Cost on the hot path: one lock of the board's map to enter a request and one to leave it.

use super::RouterState;
use crate::foundation::locks::Locked;
use crate::registry::fleet::EngineLoad;
use rollout_core::routing::InflightCap;
use rollout_core::tail::{self, Engine, Running};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often the planner looks at the board.
pub const PLAN_EVERY: Duration = Duration::from_millis(100);

/// A move asked for longer ago than this no longer holds the next plan back (its request may
/// be unable to move yet, e.g. a streamed text prompt before its ids came back).
const MOVE_SETTLES: Duration = Duration::from_secs(1);

/// The movable requests running now.
#[derive(Debug, Default)]
pub struct Board {
    next: AtomicU64,
    tickets: Mutex<HashMap<u64, Arc<Ticket>>>,
}

/// What the board knows of one movable request.
#[derive(Debug)]
pub struct Ticket {
    key: u64,
    class: Option<u64>,
    budget: u64,
    prompt: u64,
    session: bool,
    part: Mutex<Part>,
    /// Output tokens of its earlier parts.
    produced: AtomicU64,
    /// Whether it can move now (a streamed text prompt only once its ids came back).
    ready: AtomicBool,
    tail_moves: AtomicU32,
    /// The output it was expected to have left when it was preempted (0: not preempted): it
    /// waits in the queue under that, not under its class's whole length, so it neither takes
    /// back the slot it gave up nor counts as a long waiting request for the next preemption.
    left: AtomicU64,
    notify: Notify,
}

/// The engine running a request's current part.
#[derive(Debug)]
struct Part {
    /// None between two parts (a preempted request waiting in the queue).
    load: Option<Arc<EngineLoad>>,
    since: Instant,
    /// When and why (`tail`, `preempt`) the planner asked it to move; None when it was not.
    asked: Option<(Instant, &'static str)>,
}

impl Board {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<Ticket>>> {
        self.tickets.locked()
    }

    /// Puts a request on the board while the returned entry lives: `load` is the engine its
    /// first part runs on.
    pub fn enter(self: &Arc<Self>, load: Arc<EngineLoad>, request: Request) -> Entry {
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        let ticket = Arc::new(Ticket {
            key,
            class: request.class,
            budget: request.budget,
            prompt: request.prompt,
            session: request.session,
            part: Mutex::new(Part { load: Some(load), since: Instant::now(), asked: None }),
            produced: AtomicU64::new(0),
            ready: AtomicBool::new(request.ready),
            tail_moves: AtomicU32::new(0),
            left: AtomicU64::new(0),
            notify: Notify::new(),
        });
        self.lock().insert(key, ticket.clone());
        Entry { board: self.clone(), ticket }
    }

    fn tickets(&self) -> Vec<Arc<Ticket>> {
        self.lock().values().cloned().collect()
    }
}

/// A request as it enters the board.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// Its class for learned lengths (prompt hash or session).
    pub class: Option<u64>,
    /// Its output budget.
    pub budget: u64,
    /// Its prompt tokens (estimated for a text prompt).
    pub prompt: u64,
    /// Whether it is a turn of a multi-turn session.
    pub session: bool,
    /// Whether it can move from the start.
    pub ready: bool,
}

/// A request's place on the board; it leaves when this drops.
#[derive(Debug)]
pub struct Entry {
    board: Arc<Board>,
    ticket: Arc<Ticket>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.board.lock().remove(&self.ticket.key);
    }
}

impl Entry {
    fn part(&self) -> MutexGuard<'_, Part> {
        self.ticket.part.locked()
    }

    /// Why the planner asked it to move (`tail`, `preempt`), if it did.
    pub fn asked(&self) -> Option<&'static str> {
        self.part().asked.map(|(_, why)| why)
    }

    /// How it waits in the router's queue when it is preempted.
    pub fn joining(&self) -> crate::foundation::slots::Joining {
        let t = &self.ticket;
        let left = t.left.load(Ordering::Relaxed);
        let budget = if left > 0 { left.min(t.budget) } else { t.budget };
        crate::foundation::slots::Joining { class: t.class, budget, session: false, so_far: None }
    }

    /// Resolves when the planner asks it to move (at once if it already did and nobody
    /// waited for it).
    pub async fn notified(&self) {
        self.ticket.notify.notified().await;
    }

    /// It can move from now on (a streamed text prompt whose ids came back).
    pub fn set_ready(&self) {
        self.ticket.ready.store(true, Ordering::Relaxed);
    }

    /// Its next part runs on `load`, after `produced` output tokens; `planned` when the
    /// planner moved it (for the tail or a preemption).
    pub fn moved(&self, load: Arc<EngineLoad>, produced: usize, planned: bool) {
        self.ticket.produced.store(produced as u64, Ordering::Relaxed);
        self.ticket.ready.store(true, Ordering::Relaxed);
        if planned {
            self.ticket.tail_moves.fetch_add(1, Ordering::Relaxed);
        }
        *self.part() = Part { load: Some(load), since: Instant::now(), asked: None };
    }

    /// Its part ended and it moves: the planner leaves it alone until its next part runs.
    pub fn between_parts(&self) {
        *self.part() = Part { load: None, since: Instant::now(), asked: None };
    }
}

/// The planner (see the module docs), until `stop`.
pub async fn run(state: Arc<RouterState>, stop: CancellationToken) {
    if !state.config.move_tail {
        return;
    }
    let mut ticker = tokio::time::interval(PLAN_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = stop.cancelled() => return,
        }
        plan_once(&state);
    }
}

/// One look at the board; asks the requests the plan picked to move.
fn plan_once(state: &RouterState) {
    let tickets = state.tail.tickets();
    if tickets.is_empty() {
        return;
    }
    let queue = state.fleet.slot_queue();
    let waiting = queue.len();
    let table = state.fleet.routes();
    if table.weights_updating || (waiting == 0 && table.backends.len() < 2) {
        return;
    }
    let now = Instant::now();
    // Each ticket's engine and part, read once (a ticket asked recently holds the plan back).
    let mut parts = Vec::with_capacity(tickets.len());
    for t in &tickets {
        let part = t.part.locked();
        if part.asked.is_some_and(|(at, _)| now.duration_since(at) < MOVE_SETTLES) {
            return;
        }
        if let Some(load) = &part.load {
            parts.push((t, load.clone(), part.since, part.asked.is_some()));
        }
    }
    let versions: Vec<&Option<String>> = table.backends.iter().map(|b| &b.weight_version).collect();
    let mut engines: Vec<Engine> = table
        .backends
        .iter()
        .map(|b| Engine {
            in_flight: b.load.get(),
            cap: engine_cap(state.config.max_inflight_per_engine, &b.load),
            group: versions.iter().position(|v| *v == &b.weight_version).unwrap_or(0) as u64,
            running: Vec::new(),
        })
        .collect();
    queue.lengths(|lengths| {
        let rate = lengths.rate().unwrap_or(0.0);
        for (t, load, since, asked) in &parts {
            // Session turns go first in the queue: never preempted (they would come straight back).
            if *asked || !t.ready.load(Ordering::Relaxed) || (waiting > 0 && t.session) {
                continue;
            }
            let Some(i) = table.backends.iter().position(|b| Arc::ptr_eq(&b.load, load)) else { continue };
            let so_far = t.produced.load(Ordering::Relaxed) + (now.duration_since(*since).as_secs_f64() * rate) as u64;
            engines[i].running.push(Running {
                key: t.key,
                so_far: so_far.min(t.budget),
                expected: lengths.predict(t.class, t.budget),
                known: t.class.and_then(|c| lengths.class(c)).is_some_and(|s| s.count > 0),
                budget: t.budget,
                prompt: t.prompt,
                tail_moves: t.tail_moves.load(Ordering::Relaxed),
            });
        }
    });
    let (chosen, why): (Vec<(usize, u64)>, &'static str) = if waiting > 0 {
        let first = queue.waiting_expected(PREEMPT_LOOKAHEAD);
        (tail::preempt(&engines, &first), "preempt")
    } else {
        (tail::plan(&engines, 0).into_iter().map(|m| (m.from, m.key)).collect(), "tail")
    };
    if chosen.is_empty() {
        return;
    }
    let by_key: HashMap<u64, &Arc<Ticket>> = tickets.iter().map(|t| (t.key, t)).collect();
    let lefts: HashMap<u64, u64> =
        engines.iter().flat_map(|e| &e.running).map(|r| (r.key, tail::expected_left(r))).collect();
    for (from, key) in chosen {
        let Some(t) = by_key.get(&key) else { continue };
        if why == "preempt" {
            let left = lefts.get(&key).copied().unwrap_or(0).max(1);
            t.left.store(left, Ordering::Relaxed);
        }
        tracing::debug!(engine_id = %table.backends[from].engine_id, why, "the planner moves a running request");
        t.part.locked().asked = Some((now, why));
        t.notify.notify_one();
    }
}

/// How many of the first waiting requests preemption looks at.
const PREEMPT_LOOKAHEAD: usize = 16;

/// An engine's in-flight cap for the plan (no cap: as many as the engine could ever hold).
fn engine_cap(cap: InflightCap, load: &EngineLoad) -> usize {
    match cap {
        InflightCap::Fixed(0) => usize::MAX,
        _ => super::engine_cap(cap, load),
    }
}
