//! Expected output lengths, learned from the answers the router forwards.
//!
//! RL frameworks give every rollout request the same output budget (the run's longest
//! response), so `max_new_tokens` does not tell a long request from a short one. What does:
//! GRPO siblings share a prompt and their lengths correlate (the prompt's difficulty), and a
//! multi-turn session's turns resemble each other. The router therefore keys each request by a
//! *class* (its session key, else a hash of its prompt) and records the output length of every
//! answer it forwards (`completion_tokens`). A waiting request of a class with finished members
//! is expected to be about as long as they were; one of a class never seen is unknown.
//!
//! [`LengthEstimator`] is that memory: per class the count and sum of observed lengths and the
//! members still generating (how many, since when), plus fleet-wide running means (output
//! length, prompt + output footprint, generation rate of one request, and how often answers
//! used their whole budget). Memory is bounded: classes live in two generations of at most
//! `capacity` entries each; a class unseen for two generations is forgotten.
//!
//! The members of a class that finish first are its short ones, so the finished answers alone
//! underestimate the rest. Members still generating correct that: one that has run `t` seconds
//! has at least about `t` times the fleet's per-request generation rate tokens, so it counts at
//! that lower bound when it is above the finished members' mean. The clock is an input
//! ([`LengthEstimator::set_now`]): a class's prediction grows while its members keep running.
//!
//! When budgets are informative (most answers end at their budget, as when a client sends each
//! request's real length), the budget is the better prediction and is used as is.

use std::collections::HashMap;

/// What is known about one class (GRPO group or session).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClassStats {
    /// Answers observed.
    pub count: u32,
    /// Sum of their output lengths (tokens).
    pub sum: u64,
    /// The longest of them.
    pub max: u64,
    /// Members generating now (sent to an engine, not ended).
    pub running: u32,
    /// Sum of their start times (seconds on the estimator's clock).
    pub started_sum: f64,
}

impl ClassStats {
    fn add(&mut self, output: u64) {
        self.count = self.count.saturating_add(1);
        self.sum = self.sum.saturating_add(output);
        self.max = self.max.max(output);
    }
}

/// Observations after which the fleet-wide means become moving averages (they are plain means
/// before, so the first answers count fully).
pub const MEAN_WINDOW: f64 = 256.0;

/// A running mean that turns into an exponential moving average after [`MEAN_WINDOW`] samples.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Mean {
    n: f64,
    value: f64,
}

impl Mean {
    fn add(&mut self, x: f64) {
        self.n = (self.n + 1.0).min(MEAN_WINDOW);
        self.value += (x - self.value) / self.n;
    }

    fn get(&self) -> Option<f64> {
        (self.n > 0.0).then_some(self.value)
    }
}

/// Learned output lengths (see the module docs).
#[derive(Debug, Clone)]
pub struct LengthEstimator {
    capacity: usize,
    current: HashMap<u64, ClassStats>,
    previous: HashMap<u64, ClassStats>,
    output: Mean,
    footprint: Mean,
    /// Share of answers that used their whole budget.
    at_budget: Mean,
    /// Output tokens per second of one request, from start to end.
    rate: Mean,
    /// The clock (seconds), set by the caller.
    now: f64,
}

impl LengthEstimator {
    /// Remembers up to `capacity` classes per generation (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            current: HashMap::new(),
            previous: HashMap::new(),
            output: Mean::default(),
            footprint: Mean::default(),
            at_budget: Mean::default(),
            rate: Mean::default(),
            now: 0.0,
        }
    }

    /// Sets the clock (seconds, any origin, never going back).
    pub fn set_now(&mut self, now: f64) {
        if now.is_finite() {
            self.now = self.now.max(now);
        }
    }

    /// The class's entry, carried from the previous generation or new.
    fn entry(&mut self, class: u64) -> &mut ClassStats {
        if !self.current.contains_key(&class) {
            // Seen in the previous generation: carried over, so a live class is never forgotten.
            let stats = self.previous.remove(&class).unwrap_or_default();
            if self.current.len() >= self.capacity {
                self.previous = std::mem::take(&mut self.current);
            }
            self.current.insert(class, stats);
        }
        self.current.entry(class).or_default()
    }

    /// A member of `class` was sent to an engine at `at` (seconds on the clock).
    pub fn started(&mut self, class: Option<u64>, at: f64) {
        let Some(class) = class else { return };
        let stats = self.entry(class);
        stats.running = stats.running.saturating_add(1);
        stats.started_sum += at;
    }

    /// A member of `class` that started at `at` ended (answered or not). `answer`: its output
    /// tokens, when it answered, for the generation rate.
    pub fn ended(&mut self, class: Option<u64>, at: f64, answer: Option<u64>) {
        if let Some(output) = answer {
            let secs = self.now - at;
            if secs > 0.01 && output > 0 {
                self.rate.add(output as f64 / secs);
            }
        }
        let Some(class) = class else { return };
        let found = self.current.get_mut(&class).or_else(|| self.previous.get_mut(&class));
        if let Some(stats) = found.filter(|s| s.running > 0) {
            stats.running -= 1;
            stats.started_sum = if stats.running == 0 { 0.0 } else { (stats.started_sum - at).max(0.0) };
        }
    }

    /// Records one answer: its class (if any), the budget it was given, its prompt and output
    /// sizes in tokens.
    pub fn observe(&mut self, class: Option<u64>, budget: u64, prompt: u64, output: u64) {
        self.output.add(output as f64);
        self.footprint.add(prompt.saturating_add(output) as f64);
        self.at_budget.add(if budget > 0 && output >= budget { 1.0 } else { 0.0 });
        let Some(class) = class else { return };
        self.entry(class).add(output);
    }

    /// What was observed of `class`.
    pub fn class(&self, class: u64) -> Option<ClassStats> {
        self.current.get(&class).or_else(|| self.previous.get(&class)).copied()
    }

    /// Classes remembered (both generations).
    pub fn classes(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Mean output length of recent answers, fleet-wide.
    pub fn mean_output(&self) -> Option<u64> {
        self.output.get().map(|v| v.round() as u64)
    }

    /// Output tokens per second of one request (start to end), fleet-wide; None before any
    /// answer.
    pub fn rate(&self) -> Option<f64> {
        self.rate.get()
    }

    /// Mean KV footprint (prompt + output tokens) of recent answers, fleet-wide.
    pub fn mean_footprint(&self) -> Option<u64> {
        self.footprint.get().map(|v| v.round() as u64)
    }

    /// Whether budgets look informative: most recent answers used their whole budget.
    pub fn budgets_are_lengths(&self) -> bool {
        self.at_budget.get().is_some_and(|share| share > 0.5)
    }

    /// The expected output of a request of `class` with output budget `budget`, from its class:
    /// the mean of its finished members, with the fleet-wide mean counted as one more (one
    /// sibling is weak evidence), raised by its members still generating (each counted at what
    /// it has generated at least by now, if more than that mean); never above the budget. A
    /// class with members generating and none finished is predicted from them and the fleet
    /// mean alone. None when the router knows nothing of the class (no member sent, or nothing
    /// finished anywhere yet), or when budgets are informative (the budget is then the better
    /// guess).
    pub fn predict(&self, class: Option<u64>, budget: u64) -> Option<u64> {
        if self.budgets_are_lengths() {
            return None;
        }
        let stats = self.class(class?)?;
        let (prior_n, prior) = self.output.get().map_or((0.0, 0.0), |m| (1.0, m));
        let (sum, n) = (stats.sum as f64 + prior, f64::from(stats.count) + prior_n);
        if n == 0.0 {
            return None;
        }
        let finished = sum / n;
        let mean = match self.rate.get() {
            Some(rate) if stats.running > 0 => {
                let running = f64::from(stats.running);
                let elapsed = (self.now - stats.started_sum / running).max(0.0);
                let each = (elapsed * rate).min(budget as f64).max(finished);
                (sum + running * each) / (n + running)
            }
            _ => finished,
        };
        Some((mean.round() as u64).min(budget))
    }

    /// The output a request is expected to hold in KV: its class's prediction, else the
    /// fleet-wide mean, else (nothing observed yet, or budgets are informative) its budget.
    pub fn expected(&self, class: Option<u64>, budget: u64) -> u64 {
        if self.budgets_are_lengths() {
            return budget;
        }
        self.predict(class, budget).or_else(|| self.mean_output().map(|m| m.min(budget))).unwrap_or(budget)
    }
}

impl LengthEstimator {
    /// A waiting request's place under `--queue-order longest_first` (larger first): turns of
    /// multi-turn sessions above everything (the session's next turn waits on this one); then
    /// requests of classes with no finished member yet, by budget: any of them may be the
    /// longest, and the first answer teaches the router the length of the waiting siblings
    /// (the queue sends one request per class before a second: the sibling rank); then the
    /// classes known from finished members, by their prediction. When budgets are
    /// informative, the budget alone.
    pub fn queue_priority(&self, class: Option<u64>, budget: u64, session: bool) -> u64 {
        let known = class.and_then(|c| self.class(c)).is_some_and(|s| s.count > 0);
        let len = if self.budgets_are_lengths() {
            budget
        } else if known {
            self.predict(class, budget).unwrap_or(budget)
        } else {
            budget.min(crate::routing::MAX_ESTIMATE_TOKENS) | UNKNOWN_TIER
        };
        len.min(UNKNOWN_TIER | crate::routing::MAX_ESTIMATE_TOKENS) | (u64::from(session) << 63)
    }

    /// The place of a request that waits to continue after `so_far` of its `budget` output
    /// tokens (the next chunk of a request generated in chunks, `--chunk-tokens`). With
    /// informative budgets, the rest of its budget, ordered with the budgets of requests not yet
    /// started (longest remaining work first). Otherwise above every request that has not
    /// started yet ([`CONTINUING_TIER`]; only session turns go before it), and among continuing
    /// requests by the output it is expected to have left: its class's prediction less what it
    /// produced, and for a request already past it as much again as it produced (a generation
    /// that ran long is expected to go on long); at least one token and never more than the rest
    /// of its budget. So a started generation is not held up behind the batch at every chunk, and
    /// the longest ones go on first.
    pub fn continuation_priority(&self, class: Option<u64>, budget: u64, so_far: u64, session: bool) -> u64 {
        let rest = budget.saturating_sub(so_far).max(1);
        if self.budgets_are_lengths() {
            // Every request's work is known: the rest of its budget against the others' budgets
            // (longest remaining first), not above them.
            return rest.min(crate::routing::MAX_ESTIMATE_TOKENS) | (u64::from(session) << 63);
        }
        let left = {
            match self.predict(class, budget) {
                Some(e) if e > so_far => e - so_far,
                _ => so_far,
            }
            .clamp(1, rest)
        };
        left.min(crate::routing::MAX_ESTIMATE_TOKENS) | CONTINUING_TIER | (u64::from(session) << 63)
    }
}

/// The bit that puts requests of classes without a finished member above the known ones in
/// [`LengthEstimator::queue_priority`] (lengths are at most 2^40).
pub const UNKNOWN_TIER: u64 = 1 << 62;

/// The bits that put requests continuing after a chunk above those that have not started, in
/// either tier ([`LengthEstimator::continuation_priority`]).
pub const CONTINUING_TIER: u64 = UNKNOWN_TIER | 1 << 61;

/// Footprint (prompt + output tokens) assumed for a request before any answer was observed.
pub const PRIOR_FOOTPRINT: u64 = 512;

/// The automatic cap of an engine that has not reported its pool yet (or never does: it does
/// not answer `/v1/loads`, or is not SGLang).
pub const AUTO_CAP_UNREPORTED: usize = 32;

/// Fewest requests an engine is allowed in flight by the automatic cap.
pub const MIN_AUTO_CAP: usize = 4;

/// What one engine reported, for its automatic in-flight cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineReport {
    /// KV pool size in tokens (0: not known yet).
    pub pool_tokens: u64,
    /// Requests it is running.
    pub running: u64,
    /// Its `--max-running-requests` (0: not reported).
    pub max_running: u64,
}

/// The automatic per-engine in-flight cap (`--max-inflight-per-engine auto`): as many requests
/// as the engine's KV pool holds at the mean footprint of recent requests (`footprint`, or
/// [`PRIOR_FOOTPRINT`] before any was observed), and never fewer than the engine is running
/// plus a quarter more (at least 2): the engine keeps a short queue of its own to admit from
/// between two reports, and an engine that runs more than the footprint suggests gets more.
/// At most the engine's own running limit plus that margin; at least [`MIN_AUTO_CAP`]. An
/// engine that has not reported its pool yet gets `fallback`.
pub fn auto_inflight_cap(report: EngineReport, footprint: Option<u64>, fallback: usize) -> usize {
    if report.pool_tokens == 0 {
        return fallback.max(MIN_AUTO_CAP);
    }
    let footprint = footprint.unwrap_or(PRIOR_FOOTPRINT).max(1);
    let fits = usize::try_from(report.pool_tokens / footprint).unwrap_or(usize::MAX);
    let running = usize::try_from(report.running).unwrap_or(usize::MAX);
    let margin = (running / 4).max(2);
    let mut cap = fits.max(running.saturating_add(margin));
    if report.max_running > 0 {
        let limit = usize::try_from(report.max_running).unwrap_or(usize::MAX);
        cap = cap.min(limit.saturating_add(margin));
    }
    cap.max(MIN_AUTO_CAP)
}

#[cfg(test)]
#[path = "lengths_tests.rs"]
mod tests;
