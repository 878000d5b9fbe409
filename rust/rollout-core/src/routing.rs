//! Routing decisions of the data plane, as pure functions over a snapshot of each engine's load.
//!
//! The router keeps, per engine, its own exact count of requests and of estimated KV tokens in
//! flight (prompt + expected output of every request it forwarded and that has not finished),
//! and the engine's last reported KV pool size and usage. From these:
//!
//! - `round_robin` cycles;
//! - `least_requests` takes the engine with the fewest requests in flight;
//! - `capacity` (default) takes the engine with the fewest committed tokens relative to its pool:
//!   the router's exact account of what it sent and is unfinished (prompt + output budget), or
//!   the engine's own report when larger (see [`Load::used`]), so a burst between two reports is
//!   still spread correctly; a request
//!   whose prompt prefix was recently sent to an engine goes back there (GRPO siblings share a
//!   prompt, so its KV is cached) unless that engine fails the imbalance gate;
//!   A session key (header `x-session-id`, or the body's `session_params.id` / `routing_key`)
//!   takes the place of the prompt when the request has one;
//! - `session`: like `capacity` but affine by session key only (no prompt affinity): requests
//!   with the same key stay on one engine while it passes the gate, and are re-pinned to the
//!   most-free engine when it does not.
//!
//! The imbalance gate: an engine may keep affine traffic while, after taking the request, (1) its
//! committed tokens relative to its pool stay within `spill_slack` of the least-loaded other
//! engine's (balance first: a cached prefix saves a prefill, a long tail on one engine costs the
//! whole batch), and (2) its requests in flight stay at most `spill_factor` times the fleet's
//! mean plus `spill_requests` (tokens alone miss engines that queue on compute while their pool
//! is mostly free). The gate is relative: a busy fleet keeps its affinity as long as it is
//! balanced. This is what keeps a hot session or prompt from piling a whole batch onto one
//! engine.

use serde::{Deserialize, Serialize};

/// A routing policy, chosen by `--routing-policy` or per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Policy {
    RoundRobin,
    LeastRequests,
    Capacity,
    Session,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round_robin" => Ok(Self::RoundRobin),
            "least_requests" => Ok(Self::LeastRequests),
            "capacity" => Ok(Self::Capacity),
            "session" => Ok(Self::Session),
            other => {
                Err(format!("unknown routing policy {other:?}; use round_robin, least_requests, capacity or session"))
            }
        }
    }
}

/// The order in which requests waiting in the router for an engine slot
/// (`--max-inflight-per-engine`) get one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum QueueOrder {
    /// Arrival order (interactive traffic: no request waits behind a longer one).
    Fifo,
    /// Turns of multi-turn sessions first, then the largest expected output (the output budget,
    /// or what answers of the same prompt or session showed: `crate::lengths`), then arrival.
    #[default]
    LongestFirst,
}

/// `--max-inflight-per-engine`: how many of the router's requests one engine may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InflightCap {
    /// Each engine its own cap, from its reports and the requests' learned sizes
    /// (`crate::lengths::auto_inflight_cap`).
    #[default]
    Auto,
    /// The same cap for every engine; 0: no cap (no late binding).
    Fixed(usize),
}

impl InflightCap {
    /// Whether requests beyond a cap wait in the router (late binding).
    pub fn enabled(self) -> bool {
        self != Self::Fixed(0)
    }
}

impl std::str::FromStr for InflightCap {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Fixed(0)),
            n => n.parse().map(Self::Fixed).map_err(|_| {
                format!("{s:?} is not a cap: use auto (each engine its own), a number of requests, or 0 (no cap)")
            }),
        }
    }
}

impl std::fmt::Display for InflightCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Fixed(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for InflightCap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Fixed(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for InflightCap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(usize),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(Self::Fixed(n)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// What the router knows about one engine at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Requests the router has in flight there.
    pub in_flight: u64,
    /// The router's estimate of KV tokens its in-flight requests hold or will hold.
    pub est_tokens: u64,
    /// KV pool size reported by the engine; 0 when not known yet.
    pub capacity: u64,
    /// KV tokens in use plus queued prompt tokens, as last reported by the engine.
    pub reported_tokens: u64,
}

/// Pool size assumed for an engine that has not reported one yet.
pub const UNKNOWN_CAPACITY: u64 = 1 << 20;

impl Load {
    pub fn capacity(&self) -> u64 {
        if self.capacity == 0 {
            UNKNOWN_CAPACITY
        } else {
            self.capacity
        }
    }

    /// Tokens committed on the engine: the router's own exact account of its in-flight requests
    /// (prompt + output budget, until they finish), or the engine's report when that is larger
    /// (work the router did not send, or a budget it under-estimated).
    pub fn used(&self) -> u64 {
        self.est_tokens.max(self.reported_tokens)
    }

    /// Free KV tokens (negative when over-committed: the engine will queue). Saturates, so an
    /// engine reporting absurd numbers looks full or empty, never wraps around.
    pub fn free(&self) -> i64 {
        let signed = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        signed(self.capacity()).saturating_sub(signed(self.used()))
    }

    /// Utilisation after taking `need` more tokens.
    pub fn utilisation_with(&self, need: u64) -> f64 {
        self.used().saturating_add(need) as f64 / self.capacity() as f64
    }
}

/// Knobs of the imbalance gate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gate {
    pub spill_factor: f64,
    pub spill_slack: f64,
    pub spill_requests: f64,
}

impl Default for Gate {
    fn default() -> Self {
        Self { spill_factor: 1.5, spill_slack: 0.05, spill_requests: 2.0 }
    }
}

/// Mean utilisation of the fleet.
pub fn mean_utilisation(loads: &[Load]) -> f64 {
    if loads.is_empty() {
        return 0.0;
    }
    loads.iter().map(|l| l.utilisation_with(0)).sum::<f64>() / loads.len() as f64
}

/// Whether engine `i` may take an affine request of `need` tokens: after taking it, its
/// utilisation must stay within `spill_slack` of what the least-loaded other engine would have
/// with the same request (balance first; the cache hit is the tie-breaker), and its requests in
/// flight within `spill_factor` times the fleet's mean plus `spill_requests`.
pub fn passes_gate(loads: &[Load], i: usize, need: u64, gate: &Gate) -> bool {
    let Some(l) = loads.get(i) else { return false };
    let after = l.utilisation_with(need);
    let best_other = loads
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(_, o)| o.utilisation_with(need))
        .fold(f64::INFINITY, f64::min);
    let kv_ok = after <= best_other + gate.spill_slack;
    let mean_requests = loads.iter().map(|l| l.in_flight as f64).sum::<f64>() / loads.len() as f64;
    let requests_ok = l.in_flight.saturating_add(1) as f64 <= gate.spill_factor * mean_requests + gate.spill_requests;
    kv_ok && requests_ok
}

/// Index with the most free KV tokens; ties go to fewer requests in flight, then to the first
/// index at or after `rotor` (so equal engines share work).
pub fn most_free(loads: &[Load], rotor: usize) -> Option<usize> {
    let n = loads.len();
    (0..n).map(|k| (rotor % n + k) % n).max_by(|&a, &b| {
        let (la, lb) = (&loads[a], &loads[b]);
        la.free().cmp(&lb.free()).then(lb.in_flight.cmp(&la.in_flight)).then_with(|| {
            // Earlier in rotation order wins: reverse positional order for max_by.
            let pa = (a + n - rotor % n) % n;
            let pb = (b + n - rotor % n) % n;
            pb.cmp(&pa)
        })
    })
}

/// Index with the fewest requests in flight; ties rotate.
pub fn least_requests(loads: &[Load], rotor: usize) -> Option<usize> {
    let n = loads.len();
    (0..n).map(|k| (rotor % n + k) % n).min_by_key(|&i| loads[i].in_flight)
}

/// The choice for one request.
///
/// `affine` is the engine the request's session or prompt prefix was last sent to, if any and
/// still routable. Returns the index and whether the affine engine was kept.
pub fn choose(
    policy: Policy,
    loads: &[Load],
    need: u64,
    affine: Option<usize>,
    rotor: usize,
    gate: &Gate,
) -> Option<(usize, bool)> {
    if loads.is_empty() {
        return None;
    }
    match policy {
        Policy::RoundRobin => Some((rotor % loads.len(), false)),
        Policy::LeastRequests => least_requests(loads, rotor).map(|i| (i, false)),
        Policy::Capacity | Policy::Session => {
            if let Some(a) = affine {
                if passes_gate(loads, a, need, gate) {
                    return Some((a, true));
                }
            }
            most_free(loads, rotor).map(|i| (i, false))
        }
    }
}

/// Estimated KV tokens of a request: its prompt plus the output it may produce. Without a
/// tokenizer, text is counted at 4 bytes a token (a common average for English BPE vocabularies);
/// `input_ids` are exact. Expected output is `max_new_tokens` (SGLang's default 128), capped by
/// `output_cap` when the router has learned typical lengths.
pub fn estimate_tokens(
    prompt_bytes: usize,
    prompt_ids: Option<usize>,
    max_new_tokens: Option<u64>,
    output_cap: Option<u64>,
) -> u64 {
    let prompt = prompt_ids.map(|n| n as u64).unwrap_or_else(|| (prompt_bytes as u64).div_ceil(4));
    let output = max_new_tokens.unwrap_or(128);
    let output = output_cap.map_or(output, |cap| output.min(cap));
    // A client may ask for any max_new_tokens; the engine will refuse absurd ones, and the
    // router's sums of estimates must not overflow meanwhile.
    prompt.saturating_add(output).min(MAX_ESTIMATE_TOKENS)
}

/// Largest estimate of one request (2^40 tokens): far above any context window, and small
/// enough that millions of them in flight sum without overflow.
pub const MAX_ESTIMATE_TOKENS: u64 = 1 << 40;

/// Weight-version requirement of a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum VersionPin {
    Exact(String),
    AtLeast(String),
    /// The newest version the fleet has (the last of the history: the target of an update in
    /// flight, else the fleet's version).
    Latest,
    /// One of the newest `k + 1` versions of the history (0: the newest only).
    WithinLast(u32),
}

/// SMG's version policy (`--rl-version-policy`, header `x-smg-version-policy`): which versions a
/// request that names none may run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionPolicy {
    Any,
    LatestOnly,
    MinVersion(String),
    MaxStaleness(u32),
}

/// SMG's policy grammar, for messages.
pub const VERSION_POLICY_GRAMMAR: &str = "any | latest-only | min-version:<version> | max-staleness:<k>";

impl VersionPolicy {
    /// Parses SMG's grammar; Err names it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let bad = |why: &str| Err(format!("{text:?} {why}; a version policy is {VERSION_POLICY_GRAMMAR}"));
        match text {
            "any" => return Ok(Self::Any),
            "latest-only" => return Ok(Self::LatestOnly),
            _ => {}
        }
        if let Some(v) = text.strip_prefix("min-version:") {
            if v.is_empty() || v.len() > 128 || v.chars().any(char::is_whitespace) {
                return bad("names no version");
            }
            return Ok(Self::MinVersion(v.to_string()));
        }
        if let Some(k) = text.strip_prefix("max-staleness:") {
            return match k.parse::<u32>() {
                Ok(k) => Ok(Self::MaxStaleness(k)),
                Err(_) => bad("needs a whole number of versions (0 or more)"),
            };
        }
        bad("is not a version policy")
    }

    /// The pin a request under this policy carries (None: any version).
    pub fn pin(&self) -> Option<VersionPin> {
        match self {
            Self::Any => None,
            Self::LatestOnly => Some(VersionPin::Latest),
            Self::MinVersion(v) => Some(VersionPin::AtLeast(v.clone())),
            Self::MaxStaleness(k) => Some(VersionPin::WithinLast(*k)),
        }
    }
}

/// Orders weight versions: integers (optionally with a `v` or `step` prefix, e.g. `v12`,
/// `step_40`) numerically, otherwise by position in `history` (oldest first). Unknown, unordered
/// versions compare as `None`.
pub fn version_cmp(a: &str, b: &str, history: &[String]) -> Option<std::cmp::Ordering> {
    fn number(v: &str) -> Option<u64> {
        let digits = v.trim_start_matches(|c: char| !c.is_ascii_digit());
        let prefix = &v[..v.len() - digits.len()];
        if !matches!(prefix, "" | "v" | "V" | "step" | "step_" | "step-") {
            return None;
        }
        digits.parse().ok()
    }
    if a == b {
        return Some(std::cmp::Ordering::Equal);
    }
    if let (Some(x), Some(y)) = (number(a), number(b)) {
        return Some(x.cmp(&y));
    }
    let pos = |v: &str| history.iter().position(|h| h == v);
    Some(pos(a)?.cmp(&pos(b)?))
}

impl VersionPin {
    /// Whether an engine serving `version` satisfies the pin.
    pub fn allows(&self, version: Option<&str>, history: &[String]) -> bool {
        let Some(v) = version else { return false };
        match self {
            VersionPin::Exact(want) => v == want,
            VersionPin::AtLeast(min) => version_cmp(v, min, history).is_some_and(|o| o != std::cmp::Ordering::Less),
            VersionPin::Latest => history.last().is_some_and(|last| last == v),
            VersionPin::WithinLast(k) => history.iter().rposition(|h| h == v).is_some_and(|at| {
                let newest = history.len() - 1;
                newest - at <= usize::try_from(*k).unwrap_or(usize::MAX)
            }),
        }
    }
}

#[cfg(test)]
#[path = "routing_tests.rs"]
mod tests;
