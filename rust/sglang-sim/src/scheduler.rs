//! One DP rank's scheduler: a continuous-batching loop over a FIFO waiting queue and a
//! running batch, on top of the KV pool.
//!
//! Expected flow of a request: `submit` puts it in the waiting queue; a *prefill step* admits
//! queued requests whose prompts (minus cached prefix) and reserved completion tokens fit in
//! the pool, and gives each its first token; *decode steps* then give every running request
//! one token each. A finished request's KV moves into the prefix cache. When decoding runs
//! out of KV slots, the newest running requests are retracted to the front of the queue and
//! re-prefilled later (as SGLang does).
//!
//! Output reaches the request's owner as SGLang's scheduler sends it (0.5.23
//! `managers/scheduler_components/output_streamer.py:440-476`): a stream's new tokens by the
//! release's [`StreamRule`], a non-streaming request's progress every 50 tokens
//! (`SGLANG_FORCE_STREAM_INTERVAL`), and everything at the end. What was sent matters when a
//! request is aborted in the waiting queue: its answer is made from the sent tokens alone.
//!
//! Aborts follow `Scheduler.abort_request` (`managers/scheduler.py:5675-5815`): a waiting
//! request ends at once ("Abort in waiting queue"); a running one is marked and ends after one
//! more step, whose token it keeps ("Aborted"), so while the scheduler is paused in place it
//! does not end until generation continues.
//!
//! Step costs (see `docs/sglang-sim.md`): prefill = base + per-1k-uncached-tokens; decode =
//! base + per-running-request * n + per-1k-context-tokens. Every cost is multiplied by
//! `--time-scale`. The loop sleeps until an absolute deadline so that tokio's 1 ms timer
//! granularity does not distort the average rate at tiny time scales.
//!
//! All state sits behind one std `Mutex`: it is never held across an `.await`.

use crate::api_profile::StreamRule;
use crate::engine::Shared;
use crate::generator::{FinishReason, GenState, VersionInfo, ABORTED, ABORTED_WAITING};
use crate::kv::{extend_block_hashes, KvPool, BLOCK};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch, Notify};

/// Timing model and limits of one rank, copied from the config.
#[derive(Debug, Clone)]
pub struct RankConfig {
    pub capacity: usize,
    pub max_running: usize,
    pub chunked_prefill_size: usize,
    pub cache_enabled: bool,
    pub time_scale: f64,
    pub prefill_base_ms: f64,
    pub prefill_ms_per_1k_tokens: f64,
    pub decode_step_base_ms: f64,
    pub decode_step_ms_per_req: f64,
    pub decode_step_ms_per_1k_ctx: f64,
    /// When a stream's tokens are sent (the release's rule) and `--stream-interval`.
    pub stream_rule: StreamRule,
    pub stream_interval: i64,
}

impl RankConfig {
    pub fn from_config(c: &crate::cli::Config) -> Self {
        Self {
            capacity: c.max_total_tokens,
            max_running: c.max_running_requests,
            chunked_prefill_size: c.chunked_prefill_size,
            cache_enabled: !c.disable_radix_cache,
            time_scale: c.time_scale,
            prefill_base_ms: c.prefill_base_ms,
            prefill_ms_per_1k_tokens: c.prefill_ms_per_1k_tokens,
            decode_step_base_ms: c.decode_step_base_ms,
            decode_step_ms_per_req: c.decode_step_ms_per_req,
            decode_step_ms_per_1k_ctx: c.decode_step_ms_per_1k_ctx,
            stream_rule: c.sglang_api.stream_rule(),
            stream_interval: c.stream_interval,
        }
    }
}

/// Share of a request's remaining completion budget reserved at admission: starts high,
/// decays per decode step, resets on retraction (SGLang's `new_token_ratio`).
const INIT_NEW_TOKEN_RATIO: f64 = 0.7;
const MIN_NEW_TOKEN_RATIO: f64 = 0.1;
const NEW_TOKEN_RATIO_DECAY: f64 = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600.0;
/// gen_throughput is recomputed after this many decode steps or this much wall time.
const THROUGHPUT_WINDOW_STEPS: u32 = 40;
const THROUGHPUT_WINDOW: Duration = Duration::from_millis(500);
/// SGLang's `SGLANG_FORCE_STREAM_INTERVAL`: a non-streaming request's output goes to the
/// tokenizer every this many tokens.
const FORCE_STREAM_INTERVAL: usize = 50;
/// How far behind its deadline the step loop may run before it stops catching up.
const MAX_LAG: Duration = Duration::from_millis(20);

/// A request handed to [`Rank::submit`].
pub struct NewRequest {
    pub rid: String,
    pub prompt: Vec<u32>,
    pub gen: GenState,
    /// Send `Tokens` updates as a stream sends them; otherwise only `Finished`.
    pub stream: bool,
    /// The request's `stream_interval` (`None`: `--stream-interval`).
    pub stream_interval: Option<i64>,
    pub tx: mpsc::UnboundedSender<Update>,
}

/// What a request's owner hears from the scheduler.
#[derive(Debug)]
pub enum Update {
    /// New output tokens (streaming requests only, as the stream interval lets them out), with
    /// the prompt tokens found cached.
    Tokens {
        ids: Vec<u32>,
        /// For each of `ids`: the context hash it was produced from and its logprob.
        trace: Vec<(u64, f64)>,
        cached_tokens: usize,
    },
    Finished(Box<Finished>),
}

/// Final state of a request.
#[derive(Debug)]
pub struct Finished {
    pub reason: FinishReason,
    pub gen: GenState,
    pub cached_tokens: usize,
    pub queue_time: Option<Duration>,
    pub time_to_first_token: Option<Duration>,
    pub retractions: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Prefill,
    Decode,
}

struct Req {
    rid: String,
    /// Prompt followed by the output so far.
    seq: Vec<u32>,
    gen: GenState,
    /// Chained block hashes of `seq` (extended lazily).
    hashes: Vec<u64>,
    locked_blocks: usize,
    private: usize,
    cached_tokens: Option<usize>,
    /// Bumped on retraction so a step planned before it ignores this request.
    epoch: u32,
    phase: Phase,
    stream: bool,
    stream_interval: i64,
    /// Output tokens sent to the owner so far (SGLang's `send_token_offset`).
    sent: usize,
    /// Set by an abort while the request runs: it ends with this after its next step.
    to_finish: Option<FinishReason>,
    tx: mpsc::UnboundedSender<Update>,
    arrived: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    retractions: u32,
}

impl Req {
    fn remaining_new(&self) -> usize {
        (self.gen.max_new as usize).saturating_sub(self.gen.output.len())
    }
    fn kv_len(&self) -> usize {
        (self.locked_blocks * BLOCK + self.private).min(self.seq.len())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Prefill,
    Decode,
}

/// One request in a planned step.
#[derive(Debug, Clone, Copy)]
struct Slot {
    key: u64,
    /// The request's retraction epoch when planned (a retraction since voids the slot).
    epoch: u32,
    /// It was marked for abort before the step began: it ends after this step.
    finishing: bool,
}

/// One planned step: which requests it serves and how long it takes (unscaled).
#[derive(Debug)]
pub struct StepPlan {
    pub kind: StepKind,
    batch: Vec<Slot>,
    pub cost: Duration,
}

#[derive(Debug, Default)]
struct Stats {
    gen_throughput: f64,
    cache_hit_rate: f64,
    window_start: Option<Instant>,
    window_steps: u32,
    window_tokens: u64,
}

/// Point-in-time load of one rank (`/v1/loads`, metrics).
#[derive(Debug, Clone, Default)]
pub struct RankLoad {
    pub dp_rank: usize,
    pub num_running_reqs: usize,
    pub num_waiting_reqs: usize,
    pub num_retracted_reqs: usize,
    pub num_waiting_uncached_tokens: usize,
    pub num_used_tokens: usize,
    pub num_total_tokens: usize,
    pub max_total_num_tokens: usize,
    pub max_running_requests: usize,
    pub token_usage: f64,
    pub gen_throughput: f64,
    pub cache_hit_rate: f64,
    pub cached_tokens: usize,
    pub evictable_tokens: usize,
}

struct Core {
    pool: KvPool,
    cache_enabled: bool,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    reqs: HashMap<u64, Req>,
    new_token_ratio: f64,
    stats: Stats,
    next_key: u64,
    /// Set when output went to a request's owner, as SGLang's scheduler would send it (every
    /// token of a streaming request, every 50th of another, the end); the rank then calls
    /// [`Shared::note_output`] (the health check's signal).
    sent_output: bool,
}

/// One DP rank: its queue, batch and KV pool, driven by [`Rank::run`].
pub struct Rank {
    pub dp_rank: usize,
    cfg: RankConfig,
    core: Mutex<Core>,
    /// Woken on new work, aborts that may unblock admission, and continue_generation.
    wake: Notify,
    shared: Arc<Shared>,
}

impl Rank {
    pub fn new(dp_rank: usize, cfg: RankConfig, shared: Arc<Shared>) -> Self {
        Self { dp_rank, core: Mutex::new(Core::new(&cfg)), cfg, wake: Notify::new(), shared }
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the health check about output sent under this lock (see `Core::sent_output`).
    fn note_output(&self, c: &mut Core) {
        if std::mem::take(&mut c.sent_output) {
            self.shared.note_output();
        }
    }

    /// Queues a request; returns the key the scheduler keeps it under.
    pub fn submit(&self, r: NewRequest) -> u64 {
        let key = self.lock().enqueue(r, self.cfg.stream_interval);
        self.wake.notify_one();
        key
    }

    /// Aborts every request whose rid `matches` (SGLang's scheduler: rid prefix, or all):
    /// waiting ones end now, running ones after their next step. Returns how many it reached.
    pub fn abort_where(&self, matches: impl Fn(&str) -> bool) -> usize {
        let (n, idle) = {
            let mut c = self.lock();
            let keys: Vec<u64> = c.reqs.iter().filter(|(_, r)| matches(&r.rid)).map(|(k, _)| *k).collect();
            for k in &keys {
                c.abort(*k);
            }
            self.note_output(&mut c);
            (keys.len(), c.is_fully_idle(self.shared.is_scheduler_paused()))
        };
        self.after_abort(idle);
        n
    }

    fn after_abort(&self, flushable: bool) {
        self.wake.notify_one();
        if flushable {
            self.shared.idle.notify_waiters();
        }
    }

    /// Moves every running request back to the front of the queue, freeing its KV
    /// (`pause_generation` mode `retract`). Returns how many.
    pub fn retract_all(&self) -> usize {
        let mut c = self.lock();
        let running = std::mem::take(&mut c.running);
        for key in running.iter().rev() {
            c.retract(*key);
            c.waiting.push_front(*key);
        }
        if !running.is_empty() {
            c.new_token_ratio = INIT_NEW_TOKEN_RATIO;
        }
        running.len()
    }

    /// Empties the prefix cache; false (nothing flushed) unless the rank is fully idle (see
    /// [`Rank::is_fully_idle`]).
    pub fn flush_cache(&self, ignore_waiting: bool) -> bool {
        let mut c = self.lock();
        c.is_fully_idle(ignore_waiting) && c.pool.flush()
    }

    /// SGLang 0.5.23's `is_fully_idle` (`managers/scheduler.py:5337-5380`): nothing running
    /// and nothing waiting; with `ignore_waiting` (the scheduler is paused, `:5520`) waiting
    /// requests do not count, since none holds KV (retracted ones gave theirs back).
    pub fn is_fully_idle(&self, ignore_waiting: bool) -> bool {
        self.lock().is_fully_idle(ignore_waiting)
    }

    /// Wakes the step loop (after continue_generation).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub fn load(&self) -> RankLoad {
        let c = self.lock();
        let used = c.pool.used();
        let mut waiting_tokens = 0;
        let mut uncached = 0;
        let mut retracted = 0;
        for key in &c.waiting {
            if let Some(r) = c.reqs.get(key) {
                waiting_tokens += r.seq.len();
                let max_blocks = r.seq.len().saturating_sub(1) / BLOCK;
                let (m, _) = c.pool.peek_match(&r.hashes, max_blocks);
                uncached += r.seq.len() - m * BLOCK;
                if r.retractions > 0 {
                    retracted += 1;
                }
            }
        }
        let usage = used as f64 / c.pool.capacity().max(1) as f64;
        RankLoad {
            dp_rank: self.dp_rank,
            num_running_reqs: c.running.len(),
            num_waiting_reqs: c.waiting.len(),
            num_retracted_reqs: retracted,
            num_waiting_uncached_tokens: uncached,
            num_used_tokens: used,
            num_total_tokens: used + waiting_tokens,
            max_total_num_tokens: c.pool.capacity(),
            max_running_requests: self.cfg.max_running,
            token_usage: usage,
            gen_throughput: if c.running.is_empty() { 0.0 } else { c.stats.gen_throughput },
            cache_hit_rate: c.stats.cache_hit_rate,
            cached_tokens: c.pool.cached_tokens(),
            evictable_tokens: c.pool.evictable_tokens(),
        }
    }

    /// The step loop. Returns when `shutdown` becomes true.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut deadline = Instant::now();
        let mut blocked = self.shared.watch_blocked();
        loop {
            if *shutdown.borrow() {
                return;
            }
            let plan = if self.shared.is_scheduler_paused() || self.shared.is_hung() || self.shared.is_blocked() {
                None
            } else {
                let mut c = self.lock();
                let plan = c.plan(&self.cfg);
                self.note_output(&mut c);
                plan
            };
            let Some(plan) = plan else {
                if self.shared.is_blocked() {
                    // Until the block ends (a wake does not end it).
                    tokio::select! {
                        _ = blocked.wait_for(|n| *n == 0) => {}
                        _ = shutdown.changed() => {}
                    }
                } else {
                    tokio::select! {
                        _ = self.wake.notified() => {}
                        _ = shutdown.changed() => {}
                    }
                }
                deadline = Instant::now();
                continue;
            };
            let now = Instant::now();
            let floor = now.checked_sub(MAX_LAG).unwrap_or(now);
            deadline = deadline.max(floor) + plan.cost.mul_f64(self.cfg.time_scale);
            if deadline > now {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline.into()) => {}
                    _ = shutdown.changed() => return,
                }
            } else {
                tokio::task::yield_now().await;
            }
            if self.shared.is_hung() {
                continue;
            }
            let version = self.shared.version();
            let idle = {
                let mut c = self.lock();
                c.complete(&plan, &version, Instant::now(), &self.cfg);
                self.note_output(&mut c);
                c.is_fully_idle(false)
            };
            if idle {
                self.shared.idle.notify_waiters();
            }
        }
    }
}

impl Core {
    fn new(cfg: &RankConfig) -> Self {
        Self {
            pool: KvPool::new(cfg.capacity, cfg.cache_enabled),
            cache_enabled: cfg.cache_enabled,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reqs: HashMap::new(),
            new_token_ratio: INIT_NEW_TOKEN_RATIO,
            stats: Stats::default(),
            next_key: 1,
            sent_output: false,
        }
    }

    fn enqueue(&mut self, r: NewRequest, cfg_stream_interval: i64) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        let mut hashes = Vec::new();
        if self.cache_enabled {
            extend_block_hashes(&mut hashes, &r.prompt);
        }
        self.reqs.insert(
            key,
            Req {
                rid: r.rid,
                seq: r.prompt,
                gen: r.gen,
                hashes,
                locked_blocks: 0,
                private: 0,
                cached_tokens: None,
                epoch: 0,
                phase: Phase::Waiting,
                stream: r.stream,
                stream_interval: r.stream_interval.unwrap_or(cfg_stream_interval),
                sent: 0,
                to_finish: None,
                tx: r.tx,
                arrived: Instant::now(),
                admitted: None,
                first_token: None,
                retractions: 0,
            },
        );
        self.waiting.push_back(key);
        key
    }

    fn is_fully_idle(&self, ignore_waiting: bool) -> bool {
        self.running.is_empty() && (ignore_waiting || self.waiting.is_empty())
    }

    /// An abort reaching one request (see the module docs).
    fn abort(&mut self, key: u64) {
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        match r.phase {
            Phase::Waiting => {
                let sent = r.sent;
                r.gen.truncate(sent);
                self.finish(key, FinishReason::WaitingAbort(ABORTED_WAITING.into()));
            }
            Phase::Prefill | Phase::Decode => {
                r.to_finish.get_or_insert_with(|| FinishReason::Abort(ABORTED.into()));
            }
        }
    }

    fn reserve(&self, r: &Req) -> usize {
        (r.remaining_new() as f64 * self.new_token_ratio).ceil() as usize
    }

    /// Decides the next step, admitting requests (prefill) or growing the batch (decode).
    fn plan(&mut self, cfg: &RankConfig) -> Option<StepPlan> {
        if let Some(p) = self.plan_prefill(cfg) {
            return Some(p);
        }
        self.plan_decode(cfg)
    }

    fn plan_prefill(&mut self, cfg: &RankConfig) -> Option<StepPlan> {
        let mut reserved: usize = self.running.iter().filter_map(|k| self.reqs.get(k)).map(|r| self.reserve(r)).sum();
        let mut batch = Vec::new();
        let mut budget = cfg.chunked_prefill_size;
        let (mut total, mut hit, mut uncached_total) = (0usize, 0usize, 0usize);
        while let Some(&key) = self.waiting.front() {
            if self.running.len() >= cfg.max_running {
                break;
            }
            let Some(r) = self.reqs.get_mut(&key) else {
                self.waiting.pop_front();
                continue;
            };
            if cfg.cache_enabled {
                extend_block_hashes(&mut r.hashes, &r.seq);
            }
            let len = r.seq.len();
            let max_blocks = len.saturating_sub(1) / BLOCK;
            let (matched, matched_evictable) = self.pool.peek_match(&r.hashes, max_blocks);
            let uncached = len - matched * BLOCK;
            if !batch.is_empty() && uncached > budget {
                break;
            }
            let avail = self.pool.available().saturating_sub(matched_evictable * BLOCK);
            let reserve = (r.remaining_new() as f64 * self.new_token_ratio).ceil() as usize;
            let fits = if self.running.is_empty() { uncached <= avail } else { uncached + reserve + reserved <= avail };
            if !fits {
                break;
            }
            let hashes: Vec<u64> = r.hashes[..matched].to_vec();
            self.pool.lock(&hashes);
            if !self.pool.alloc(uncached) {
                self.pool.unlock(&hashes);
                break;
            }
            r.locked_blocks = matched;
            r.private = uncached;
            r.cached_tokens.get_or_insert(matched * BLOCK);
            r.phase = Phase::Prefill;
            r.admitted.get_or_insert_with(Instant::now);
            batch.push(Slot { key, epoch: r.epoch, finishing: r.to_finish.is_some() });
            self.waiting.pop_front();
            self.running.push(key);
            reserved += reserve;
            budget = budget.saturating_sub(uncached);
            total += len;
            hit += matched * BLOCK;
            uncached_total += uncached;
        }
        if batch.is_empty() {
            return None;
        }
        self.stats.cache_hit_rate = if total == 0 { 0.0 } else { hit as f64 / total as f64 };
        let ms = cfg.prefill_base_ms + cfg.prefill_ms_per_1k_tokens * uncached_total as f64 / 1000.0;
        Some(StepPlan { kind: StepKind::Prefill, batch, cost: Duration::from_secs_f64(ms / 1000.0) })
    }

    fn plan_decode(&mut self, cfg: &RankConfig) -> Option<StepPlan> {
        // Make room for one new token per running request, retracting the newest if needed.
        let mut retracted_any = false;
        while self.running.len() > 1 && self.pool.available() < self.running.len() {
            if let Some(key) = self.running.pop() {
                self.retract(key);
                self.waiting.push_front(key);
                retracted_any = true;
            }
        }
        if retracted_any {
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO;
        }
        if self.running.is_empty() {
            return None;
        }
        let n = self.running.len();
        if !self.pool.alloc(n) {
            // Only possible for one request that outgrew the pool; end it like a full context.
            if let Some(&key) = self.running.first() {
                let len = self.reqs.get(&key).map_or(0, |r| r.gen.output.len());
                let len = u32::try_from(len).unwrap_or(u32::MAX);
                self.finish(key, FinishReason::Length(len));
            }
            return None;
        }
        let mut ctx = 0usize;
        let mut batch = Vec::with_capacity(n);
        for key in &self.running {
            if let Some(r) = self.reqs.get_mut(key) {
                r.private += 1;
                ctx += r.kv_len();
                batch.push(Slot { key: *key, epoch: r.epoch, finishing: r.to_finish.is_some() });
            }
        }
        self.new_token_ratio = (self.new_token_ratio - NEW_TOKEN_RATIO_DECAY).max(MIN_NEW_TOKEN_RATIO);
        let ms = cfg.decode_step_base_ms
            + cfg.decode_step_ms_per_req * n as f64
            + cfg.decode_step_ms_per_1k_ctx * ctx as f64 / 1000.0;
        Some(StepPlan { kind: StepKind::Decode, batch, cost: Duration::from_secs_f64(ms / 1000.0) })
    }

    /// Applies a finished step: every request still in it gets one token. One marked for
    /// abort before the step ends with it (the abort wins over any other reason, as SGLang's
    /// `update_finish_state` checks `to_finish` first, `managers/schedule_batch.py:2007-2013`).
    fn complete(&mut self, plan: &StepPlan, version: &VersionInfo, now: Instant, cfg: &RankConfig) {
        let mut emitted = 0u64;
        for slot in &plan.batch {
            let key = slot.key;
            let Some(r) = self.reqs.get_mut(&key) else {
                continue;
            };
            if r.epoch != slot.epoch || r.phase == Phase::Waiting {
                continue;
            }
            r.phase = Phase::Decode;
            if let Some(reason) = r.gen.finished_before_start() {
                self.finish(key, reason);
                continue;
            }
            r.first_token.get_or_insert(now);
            let mut finished = r.gen.step(version);
            let token = r.gen.output.last().copied().unwrap_or(0);
            r.seq.push(token);
            emitted += 1;
            if slot.finishing {
                finished = r.to_finish.take().or(finished);
            }
            if let Some(reason) = finished {
                self.finish(key, reason);
                continue;
            }
            let len = r.gen.output.len();
            if r.stream {
                let send = cfg.stream_rule.should_send(len, r.sent, r.stream_interval) && !r.gen.holds_stop_prefix();
                if send {
                    // A closed channel means the client left; its handle aborts the request.
                    let ids = r.gen.output[r.sent..].to_vec();
                    let trace = r.gen.trace[r.sent..].to_vec();
                    let _ = r.tx.send(Update::Tokens { ids, trace, cached_tokens: r.cached_tokens.unwrap_or(0) });
                    r.sent = len;
                    self.sent_output = true;
                }
            } else if len % FORCE_STREAM_INTERVAL == 0 {
                // SGLang sends a non-streaming request's progress every
                // SGLANG_FORCE_STREAM_INTERVAL (50) tokens: the owner keeps it (an abort in the
                // waiting queue answers with it) and the health check hears it.
                r.sent = len;
                self.sent_output = true;
            }
        }
        if plan.kind == StepKind::Decode {
            let s = &mut self.stats;
            let start = *s.window_start.get_or_insert(now);
            s.window_steps += 1;
            s.window_tokens += emitted;
            let elapsed = now.saturating_duration_since(start);
            if s.window_steps >= THROUGHPUT_WINDOW_STEPS || elapsed >= THROUGHPUT_WINDOW {
                if elapsed > Duration::ZERO {
                    s.gen_throughput = s.window_tokens as f64 / elapsed.as_secs_f64();
                }
                s.window_start = Some(now);
                s.window_steps = 0;
                s.window_tokens = 0;
            }
        }
        if self.running.is_empty() {
            self.stats.window_start = None;
            self.stats.window_steps = 0;
            self.stats.window_tokens = 0;
        }
    }

    /// Gives back a request's KV (its blocks go to the prefix cache) and resets it to waiting.
    fn release_kv(&mut self, key: u64) {
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        let kv_len = r.kv_len();
        if self.cache_enabled {
            extend_block_hashes(&mut r.hashes, &r.seq[..kv_len]);
        }
        let full = (kv_len / BLOCK).min(r.hashes.len());
        let (locked, private) = (r.locked_blocks, r.private);
        let hashes = r.hashes[..full].to_vec();
        r.locked_blocks = 0;
        r.private = 0;
        self.pool.finish_request(&hashes, locked, private);
    }

    fn retract(&mut self, key: u64) {
        self.release_kv(key);
        if let Some(r) = self.reqs.get_mut(&key) {
            r.phase = Phase::Waiting;
            r.epoch += 1;
            r.retractions += 1;
        }
    }

    /// Ends a request wherever it is and tells its owner. False if unknown.
    fn finish(&mut self, key: u64, reason: FinishReason) -> bool {
        if !self.reqs.contains_key(&key) {
            return false;
        }
        self.release_kv(key);
        let Some(r) = self.reqs.remove(&key) else {
            return false;
        };
        match r.phase {
            Phase::Waiting => self.waiting.retain(|k| *k != key),
            Phase::Prefill | Phase::Decode => self.running.retain(|k| *k != key),
        }
        let finished = Finished {
            reason,
            cached_tokens: r.cached_tokens.unwrap_or(0),
            queue_time: r.admitted.map(|a| a.saturating_duration_since(r.arrived)),
            time_to_first_token: r.first_token.map(|t| t.saturating_duration_since(r.arrived)),
            retractions: r.retractions,
            gen: r.gen,
        };
        // A closed channel means the client left; nothing more to do.
        let _ = r.tx.send(Update::Finished(Box::new(finished)));
        self.sent_output = true;
        true
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
