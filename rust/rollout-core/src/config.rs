//! Configuration of `rollout-manager serve`: one struct, filled by clap from the command line
//! (or by serde from JSON), validated once by [`ServeConfig::validate`].
//!
//! Every validation error names the flag to fix, so the same message serves the binary and any
//! other front end that reuses this parser.

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What the manager launches as an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// `sglang-sim`, the engine simulator (no GPU needed).
    Sim,
    /// Real SGLang: `python -m sglang.launch_server`.
    Sglang,
}

/// How published weight versions reach the engines (`--weight-transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum WeightTransportKind {
    /// Engines load the published directory itself (shared storage, or one node).
    Disk,
    /// The version is relayed once to node-local storage (`--relay-dir`) and loaded from there.
    Relay,
}

/// Where engines run: on this machine, or on node agents placed by Ray.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
pub enum PlacementMode {
    /// Local child processes on the `--gpus` pool of this machine.
    #[default]
    Local,
    /// Node agents (`rollout-manager agent`) that the Ray shim starts in placement groups and
    /// binds through `/rollout/placements` (see docs/ray.md).
    Ray,
}

/// What to keep when some engines of a scale-out fail. Spelled as in the seed's flag
/// (`rollback_all`, `keep_partial`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PartialSuccessPolicy {
    /// Stop every engine the request created.
    RollbackAll,
    /// Keep the engines that became healthy.
    KeepPartial,
}

/// The `--help` headings of `serve`'s flags (the order of their first flag is the order shown).
pub mod heading {
    pub const NETWORK: &str = "Network & security";
    pub const ENGINES: &str = "Engines";
    pub const PLACEMENT: &str = "Placement (GPUs, Ray)";
    pub const SCALING: &str = "Scaling & lifecycle";
    pub const HEALTH: &str = "Health & recovery";
    pub const WEIGHTS: &str = "Weights";
    pub const ROUTER: &str = "Router";
    pub const AUTOSCALER: &str = "Autoscaler";
    pub const STATE: &str = "State, config & logging";
}

/// Every setting of `rollout-manager serve`. Each field is one flag; its doc comment is the flag's
/// help: the first paragraph is what `-h` shows, the whole comment what `--help` shows.
///
/// Flags whose value may hold a secret (`--engine-arg=--api-key=...`, a URL with credentials)
/// have `hide_env_values` and `hide_default_value`: `--help` names their environment variable
/// without printing its value, nor a value the `--config` file gave them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
pub struct ServeConfig {
    /// Address of the control API (and of the router). Loopback unless told otherwise.
    #[arg(long, default_value = "127.0.0.1", help_heading = heading::NETWORK)]
    pub host: String,
    /// Port of the control API (`/rollout/*`); 0 picks a free port.
    #[arg(long, default_value_t = 8000, help_heading = heading::NETWORK)]
    pub port: u16,
    /// Port of the data plane (SGLang-compatible `/generate`); 0 picks a free port.
    #[arg(long, default_value_t = 30000, help_heading = heading::NETWORK)]
    pub router_port: u16,
    /// Serve the fleet as one SGLang engine on this port, for trainers that drive SGLang's
    /// weight-sync routes themselves; off unless given (0 picks a free port).
    ///
    /// The port answers SGLang's `/server_info`, `/init_weights_update_group`,
    /// `/update_weights_from_distributed`, `/pause_generation`, `/continue_generation`,
    /// `/flush_cache` and `/destroy_weights_update_group` for the whole fleet, and runs each
    /// update as the manager's own (docs/api.md, "The fleet as one SGLang engine"): slime's
    /// `--rollout-external-engine-addrs` takes it as its one engine. Same address and token
    /// rules as the router, unless `--trainer-allow-cidr` is given.
    #[arg(long, value_name = "PORT", help_heading = heading::NETWORK)]
    #[serde(default)]
    pub trainer_port: Option<u16>,
    /// Networks the trainer port takes calls from (repeatable), e.g. `10.0.0.0/8`: its own
    /// credential, for trainers that send none (slime).
    ///
    /// With it, a caller from elsewhere gets 403 `peer_not_allowed` and the port does not ask
    /// for `--api-token-file`'s token (the control API and the router still do). Needs
    /// `--trainer-port`.
    #[arg(long = "trainer-allow-cidr", value_name = "CIDR", help_heading = heading::NETWORK)]
    #[serde(default)]
    pub trainer_allow_cidr: Vec<String>,
    /// What to launch as an engine.
    #[arg(long, value_enum, default_value_t = EngineKind::Sim, help_heading = heading::ENGINES)]
    pub engine: EngineKind,
    /// Program to launch as an engine, overriding the lookup.
    ///
    /// By default: `sglang-sim` beside the manager or on PATH for `--engine sim`; `python3` on
    /// PATH for `--engine sglang`.
    #[arg(long, value_name = "PATH", help_heading = heading::ENGINES)]
    pub engine_program: Option<PathBuf>,
    /// Model path passed to every engine (`--model-path`).
    #[arg(long, default_value = "sim-model", help_heading = heading::ENGINES)]
    pub model_path: String,
    /// Name under which the fleet's model is listed in `/rollout/engines`.
    #[arg(long, default_value = "default", help_heading = heading::ENGINES)]
    pub model_name: String,
    /// Size of the local GPU pool (logical GPUs for `--engine sim`).
    #[arg(long, default_value_t = 8, help_heading = heading::PLACEMENT)]
    pub gpus: u32,
    /// GPUs used by the initial engines at startup.
    #[arg(long, default_value_t = 2, help_heading = heading::PLACEMENT)]
    pub rollout_num_gpus: u32,
    /// GPUs per engine (its tensor-parallel size).
    #[arg(long, default_value_t = 1, help_heading = heading::PLACEMENT)]
    pub rollout_num_gpus_per_engine: u32,
    /// Extra argument appended to every engine's command line (repeatable).
    ///
    /// E.g. `--engine-arg=--startup-delay=10`. Values of engine flags named like a key, token,
    /// secret or password are redacted in the manager's log.
    #[arg(
        long = "engine-arg",
        value_name = "ARG",
        allow_hyphen_values = true,
        hide_env_values = true,
        hide_default_value = true,
        help_heading = heading::ENGINES
    )]
    pub engine_args: Vec<String>,
    /// Address engines listen on.
    #[arg(long, default_value = "127.0.0.1", help_heading = heading::ENGINES)]
    pub engine_host: String,
    /// Weight version the fleet starts from (passed as `--weight-version`).
    #[arg(long, default_value = "default", help_heading = heading::WEIGHTS)]
    pub weight_version: String,
    /// How long one engine may take to load a published version, in seconds.
    ///
    /// Bounds each engine's `/update_weights_from_disk` call.
    #[arg(long, default_value_t = 600.0, value_name = "SECS", help_heading = heading::WEIGHTS)]
    pub weight_update_timeout_secs: f64,
    /// How published versions reach the engines: `disk` or `relay`.
    ///
    /// `disk`: engines read the published directory (shared storage, or one node). `relay`: the
    /// version is copied once to node-local `--relay-dir` and loaded from there.
    #[arg(long, value_enum, default_value_t = WeightTransportKind::Disk, help_heading = heading::WEIGHTS)]
    pub weight_transport: WeightTransportKind,
    /// Node-local directory where the relay transport stages versions.
    #[arg(long, default_value = "/dev/shm/elastic-rollout", help_heading = heading::WEIGHTS)]
    pub relay_dir: PathBuf,
    /// Accepted for compatibility with fully-async trainers' launch lines.
    #[arg(long, help_heading = heading::SCALING)]
    pub fully_async: bool,
    /// Upper bound on the number of engines in the fleet.
    #[arg(long, default_value_t = 256, help_heading = heading::SCALING)]
    pub max_engines: u32,
    /// Total time allowed for a scale-out (startup, health check, weight sync), in seconds.
    #[arg(
        long = "scale-out-timeout-secs",
        visible_alias = "scale-out-timeout",
        default_value_t = 1800.0,
        value_name = "SECS",
        help_heading = heading::SCALING
    )]
    pub scale_out_timeout: f64,
    /// What to keep when some engines of a scale-out fail.
    #[arg(long, value_enum, default_value_t = PartialSuccessPolicy::RollbackAll, help_heading = heading::SCALING)]
    pub scale_out_partial_success_policy: PartialSuccessPolicy,
    /// How long scale-in waits for in-flight requests before aborting them, in seconds.
    #[arg(
        long = "scale-in-drain-timeout-secs",
        visible_alias = "scale-in-drain-timeout",
        default_value_t = 30.0,
        value_name = "SECS",
        help_heading = heading::SCALING
    )]
    pub scale_in_drain_timeout: f64,
    /// Move a draining engine's running `/generate` requests to the engines that stay.
    ///
    /// A request of one prompt (token ids, or text whose ids its engine returns) and one sample,
    /// logprobs included, is aborted on the draining engine and continues elsewhere from its
    /// prompt's ids plus the output so far, so a scale-in ends in about one prefill instead of
    /// waiting for the longest request; the client sees one answer, under its own rid, with the
    /// move in `meta_info.moves`. A request a continuation would change (stop strings, a grammar,
    /// output penalties, a custom logit processor, `max_thinking_tokens`), a batch and `n` > 1
    /// finish where they are, up to the drain timeout. The same requests also continue elsewhere
    /// when their engine is lost (read as streams, so a non-streamed one keeps its output).
    #[arg(
        long,
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL",
        help_heading = heading::SCALING
    )]
    pub move_on_drain: bool,
    /// Partial rollout across weight updates, for every request (a request sets it for itself
    /// with the `x-partial-rollout: true|false` header).
    ///
    /// A `/generate` request that moves (see `--move-on-drain`) and is aborted
    /// by a weight update (`all_at_once` with `pause_mode` `abort`, or a rolling drain past its
    /// timeout) continues on the new version from its output so far, instead of ending with
    /// finish reason `abort`; its `weight_versions` spans name both versions. Off: an answer
    /// never mixes versions through a move.
    #[arg(
        long,
        default_value_t = false,
        action = clap::ArgAction::Set,
        value_name = "BOOL",
        help_heading = heading::SCALING
    )]
    pub partial_rollout: bool,
    /// How long a stopped engine gets to exit before its process group is killed, in seconds
    /// (it is sent SIGINT, as Ctrl-C: SGLang's server stops its own subprocesses).
    #[arg(
        long = "scale-in-shutdown-timeout-secs",
        visible_alias = "scale-in-shutdown-timeout",
        default_value_t = 20.0,
        value_name = "SECS",
        help_heading = heading::SCALING
    )]
    pub scale_in_shutdown_timeout: f64,
    /// How long an engine may take from launch to healthy, in seconds.
    #[arg(
        long = "engine-startup-timeout-secs",
        visible_alias = "engine-startup-timeout",
        default_value_t = 1800.0,
        value_name = "SECS",
        help_heading = heading::SCALING
    )]
    pub engine_startup_timeout: f64,
    /// Interval between health probes of each engine, in seconds.
    #[arg(long, default_value_t = 5.0, value_name = "SECS", help_heading = heading::HEALTH)]
    pub health_check_interval_secs: f64,
    /// Timeout of one health probe, in seconds.
    #[arg(long, default_value_t = 20.0, value_name = "SECS", help_heading = heading::HEALTH)]
    pub health_check_timeout_secs: f64,
    /// Consecutive failed probes after which an engine is taken out of routing.
    #[arg(long, default_value_t = 3, value_name = "N", help_heading = heading::HEALTH)]
    pub health_failure_threshold: u32,
    /// How long a paused engine is not counted as failing its probes, in seconds.
    ///
    /// SGLang's health check generates a token, which waits while generation is paused (a
    /// trainer updating weights); a failed probe whose engine's scheduler still answers a
    /// control request (`/server_info`) is taken for such a pause; a hung scheduler does not
    /// answer it. 0: pauses count as failures.
    #[arg(long, default_value_t = 600.0, value_name = "SECS", help_heading = heading::HEALTH)]
    pub health_pause_grace_secs: f64,
    /// Restart managed engines whose process exits unexpectedly.
    ///
    /// A restarted engine gets the fleet's current weights and the same GPUs, with exponential
    /// backoff between attempts.
    #[arg(
        long,
        default_value_t = true,
        action = clap::ArgAction::Set,
        value_name = "BOOL",
        help_heading = heading::HEALTH
    )]
    pub restart_failed_engines: bool,
    /// Restarts of one engine in a row before the manager gives up on it (a crash loop).
    ///
    /// A restart counts toward the budget unless the engine then served for
    /// `--restart-window-secs`; backoff between restarts in a row is 0, 1, 2, 4 ... 60 s. Past
    /// the budget the engine stays FAILED, with the reason and the last lines of its log in
    /// `GET /rollout/engines`; a scale-in removes it first.
    #[arg(long, default_value_t = 5, value_name = "N", help_heading = heading::HEALTH)]
    pub restart_budget: u32,
    /// How long a restarted engine must serve for its next failure to start a new restart
    /// budget, in seconds.
    #[arg(long, default_value_t = 600.0, value_name = "SECS", help_heading = heading::HEALTH)]
    pub restart_window_secs: f64,
    /// The largest share of serving engines health probes may take out of routing at once.
    ///
    /// When more fail their probes together (a network blip, a shared storage stall), the
    /// rest stay in routing and are probed again; never fewer than one can leave. 1: no bound.
    #[arg(long, default_value_t = 0.5, value_name = "FRACTION", help_heading = heading::HEALTH)]
    pub health_max_unhealthy_fraction: f64,
    /// How long local engines outlive a dead manager, waiting to be re-adopted, in seconds.
    ///
    /// When the manager dies without stopping its engines, a restarted manager may re-adopt them
    /// within this time (each engine then runs under a small keeper process). 0: engines die
    /// with the manager.
    #[arg(long, default_value_t = 0.0, value_name = "SECS", help_heading = heading::SCALING)]
    pub reattach_grace_secs: f64,
    /// How the router picks an engine (a request can override it with `x-routing-policy`).
    #[arg(long, value_enum, default_value_t = crate::routing::Policy::Capacity, help_heading = heading::ROUTER)]
    pub routing_policy: crate::routing::Policy,
    /// How long a request pinned to a weight version waits for an engine serving it, in seconds.
    #[arg(long, default_value_t = 30.0, value_name = "SECS", help_heading = heading::ROUTER)]
    pub version_wait_secs: f64,
    /// SMG's version policy for requests that name no version: any, latest-only,
    /// min-version:VERSION or max-staleness:K.
    ///
    /// latest-only: only the newest version the fleet has (an update's target while it runs);
    /// max-staleness:K: one of the newest K+1 versions of the fleet's history. A request's
    /// own pin (body `weight_version`, `x-weight-version` headers) comes first, then its
    /// `x-smg-version-policy` header, then this. Requests wait up to --version-wait-secs for an
    /// engine the policy allows.
    #[arg(long, default_value = "any", value_name = "POLICY", help_heading = heading::ROUTER)]
    pub rl_version_policy: String,
    /// How long a client may take to send a request's headers, in seconds.
    ///
    /// Applies on the control port, the router port and --api-socket; a slow-header client's
    /// connection is then closed (it holds nothing).
    #[arg(long, default_value_t = 30.0, value_name = "SECS", help_heading = heading::NETWORK)]
    pub header_read_timeout_secs: f64,
    /// Requests one engine may hold at once: `auto` (each engine its own cap), N, or 0 (no cap).
    ///
    /// Requests beyond it wait in the router and go to the first engine with a free slot, a new
    /// engine included, instead of queueing inside one engine (late binding), in the order of
    /// --queue-order. `auto`: the engine's KV pool (`/v1/loads`) over the mean size (prompt +
    /// output) of recent answers, and at least what the engine runs plus a quarter, at most its
    /// own --max-running-requests plus that margin: engines of every size, external ones
    /// included, get their own. A number sets the same cap for every engine; 0 turns late
    /// binding off (each request goes to an engine at once). A request waits at most
    /// --request-timeout-secs for a slot.
    #[arg(long, default_value = "auto", value_name = "auto|N", help_heading = heading::ROUTER)]
    #[serde(default)]
    pub max_inflight_per_engine: crate::routing::InflightCap,
    /// Which waiting request gets a freed slot under --max-inflight-per-engine.
    ///
    /// `longest_first` (default, for rollout batches): session turns, then the largest expected
    /// output first (max_new_tokens, or the lengths the router saw for the same prompt or
    /// session when every request asks for the same budget), so long generations start first
    /// instead of last; short requests may wait behind long ones, at most
    /// --request-timeout-secs. `fifo`: arrival order, for interactive traffic.
    #[arg(long, value_enum, default_value_t = crate::routing::QueueOrder::LongestFirst, help_heading = heading::ROUTER)]
    #[serde(default)]
    pub queue_order: crate::routing::QueueOrder,
    /// Move running requests for the long tail of a batch (`/generate` requests that can move,
    /// see --move-on-drain).
    ///
    /// When no request waits in the router and one engine runs at least two requests more than
    /// another of the same weight version, the requests with the most expected output left
    /// (learned lengths, output so far) are aborted there and continue on the less loaded
    /// engine from their prompt and output so far, where that is worth the prefill
    /// (`rollout_core::tail`). While requests wait and every engine is at its cap, a running
    /// request with at most half a waiting one's expected output left gives it its slot and
    /// continues later from its output so far (preemption). The client sees one answer. Off
    /// by default: on the simulator's GRPO bench it did not shorten batches reliably and
    /// re-prefilled 5-50% of the output tokens (benches/README.md); with it off requests
    /// finish where they started (moves for a drain, a lost engine and partial rollout are
    /// unaffected).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL", help_heading = heading::ROUTER)]
    #[serde(default)]
    pub move_tail: bool,
    /// Generate movable `/generate` requests in chunks of this many output tokens (0: off).
    ///
    /// A request whose budget is more than one chunk runs one chunk at a time: each part asks
    /// its engine for at most N tokens, and when it stops there the request goes back to the
    /// router's queue and continues from its prompt and output so far, on the engine it ran on
    /// (whose prefix cache holds it) when that engine has a free slot, else on the least loaded
    /// one. In the queue it goes before every request that has not started (only session turns
    /// go first), and continuing requests by the output they are expected to have left, so the
    /// ones that run long go on first. The client sees
    /// one answer (`meta_info.moves` lists each chunk's start, reason `chunk`). Requests with
    /// stop strings, a grammar, output penalties or a custom logit processor run in one part.
    /// Not while the budgets the router sees are the lengths (most answers end at their budget:
    /// longest-first by budget already orders the work). Off by default (benches/README.md,
    /// "Chunks").
    #[arg(long, default_value_t = 0, value_name = "N", help_heading = heading::ROUTER)]
    #[serde(default)]
    pub chunk_tokens: u64,
    /// Threads of the data plane (the router port); 0: one per available core.
    ///
    /// Each runs a single-thread runtime of its own, and client connections are handed to them
    /// in turn: a connection, its requests and the engine connections they use stay on one
    /// thread, never waking another. Idle threads cost nothing.
    #[arg(long, default_value_t = 0, value_name = "N", help_heading = heading::ROUTER)]
    #[serde(default)]
    pub router_threads: usize,
    /// Interval of the router's reads of each engine's `/v1/loads` (KV pool and usage), in seconds.
    #[arg(long, default_value_t = 1.0, value_name = "SECS", help_heading = heading::ROUTER)]
    pub load_poll_interval_secs: f64,
    /// Also register every ACTIVE engine with an external SGLang router.
    ///
    /// E.g. `smg=http://127.0.0.1:30100` (its `/workers` API); each engine is unregistered there
    /// before it drains.
    #[arg(
        long = "router",
        value_name = "KIND=URL",
        hide_env_values = true,
        hide_default_value = true,
        help_heading = heading::ROUTER
    )]
    pub external_router: Option<String>,
    /// YAML file of the autoscaler (see docs/autoscaler.md).
    ///
    /// Without it the autoscaler still collects metrics and serves `/autoscaler/*`, but is
    /// disabled until `POST /autoscaler/enable`.
    #[arg(long, value_name = "PATH", help_heading = heading::AUTOSCALER)]
    #[serde(default)]
    pub autoscaler_config: Option<PathBuf>,
    /// File holding the API token (mode 0600); or set ROLLOUT_MANAGER_API_TOKEN.
    ///
    /// With a token (from this file, else from the environment variable
    /// ROLLOUT_MANAGER_API_TOKEN; never a command-line value), every mutating control request
    /// needs `Authorization: Bearer <token>`.
    #[arg(long, value_name = "PATH", help_heading = heading::NETWORK)]
    #[serde(default)]
    pub api_token_file: Option<PathBuf>,
    /// Engine endpoint used by health probes.
    #[arg(long, default_value = "/health_generate", help_heading = heading::HEALTH)]
    pub health_check_endpoint: String,
    /// Networks external engines may be attached from (repeatable), e.g. `10.0.0.0/8`.
    ///
    /// A scale-out naming an engine elsewhere is refused with 400. Host names must resolve to
    /// allowed addresses only. Without the flag any address is accepted.
    #[arg(long = "external-allow-cidr", value_name = "CIDR", help_heading = heading::NETWORK)]
    #[serde(default)]
    pub external_allow_cidr: Vec<String>,
    /// Longest wait for an engine's whole answer (headers and body, streams included), in seconds.
    ///
    /// Past it the router gives up on the engine: 504 before the headers, a cut stream after.
    #[arg(long, default_value_t = 1800.0, value_name = "SECS", help_heading = heading::ROUTER)]
    #[serde(default = "default_request_timeout")]
    pub request_timeout_secs: f64,
    /// Where engines run: `local` (child processes on `--gpus`) or `ray` (node agents).
    ///
    /// `ray`: node agents that the Ray shim starts and binds through `/rollout/placements`;
    /// `--gpus` is then not used.
    #[arg(long, value_enum, default_value_t = PlacementMode::Local, help_heading = heading::PLACEMENT)]
    #[serde(default)]
    pub placement: PlacementMode,
    /// Also serve the control API on this Unix socket (mode 0600, same token rules).
    ///
    /// Serves `/rollout/*`, `/autoscaler/*` and `/metrics`, as the TCP port does.
    #[arg(long, value_name = "PATH", help_heading = heading::NETWORK)]
    #[serde(default)]
    pub api_socket: Option<PathBuf>,
    /// Directory for engine logs and the manager's state (`fleet.redb`).
    ///
    /// A manager started again on the same directory resumes the fleet it holds.
    // Last, so that its heading comes last in --help.
    #[arg(long, default_value = ".rollout-state", value_name = "DIR", help_heading = heading::STATE)]
    pub state_dir: PathBuf,
}

fn default_request_timeout() -> f64 {
    1800.0
}

/// A configuration error, naming the flag to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {flag}: {message}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub message: String,
}

fn bad(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError { flag, message: message.into() }
}

/// Largest `--gpus` (a pool larger than any machine; the bound keeps placement's work small).
pub const MAX_GPUS: u32 = 100_000;

/// Longest duration any flag accepts: 30 days (longer ones are typos, and would overflow
/// deadlines).
pub const MAX_SECS: f64 = 30.0 * 24.0 * 3600.0;

fn positive_secs(flag: &'static str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 && v <= MAX_SECS {
        Ok(())
    } else {
        Err(bad(flag, format!("{v} is not a number of seconds in (0, {MAX_SECS}]")))
    }
}

fn secs_or_zero(flag: &'static str, v: f64) -> Result<(), ConfigError> {
    if v == 0.0 {
        Ok(())
    } else {
        positive_secs(flag, v)
    }
}

/// The smallest `--chunk-tokens` (other than 0, off).
pub const MIN_CHUNK_TOKENS: u64 = 16;

impl ServeConfig {
    /// Checks every cross-field rule. Called once, before anything starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.host.trim().is_empty() {
            return Err(bad("--host", "must not be empty"));
        }
        if self.port != 0 && self.port == self.router_port {
            return Err(bad("--router-port", format!("{} is also the control --port; pick another", self.port)));
        }
        if let Some(p) = self.trainer_port.filter(|p| *p != 0) {
            if p == self.port || p == self.router_port {
                return Err(bad(
                    "--trainer-port",
                    format!("{p} is also the control --port or the --router-port; pick another"),
                ));
            }
        }
        if self.chunk_tokens > 0 && self.chunk_tokens < MIN_CHUNK_TOKENS {
            return Err(bad(
                "--chunk-tokens",
                format!(
                    "{} is below {MIN_CHUNK_TOKENS}; every chunk costs the request a trip through the router's \
                     queue, so use at least {MIN_CHUNK_TOKENS} (or 0 to generate in one part)",
                    self.chunk_tokens
                ),
            ));
        }
        if self.model_path.trim().is_empty() {
            return Err(bad("--model-path", "must not be empty"));
        }
        if self.model_name.trim().is_empty() {
            return Err(bad("--model-name", "must not be empty"));
        }
        // Every engine serves the fleet under this name (`--served-model-name`), and SGLang
        // 0.5.23 refuses one with a colon at startup: it reads `name:adapter` as a LoRA adapter.
        if self.model_name.contains(':') {
            return Err(bad(
                "--model-name",
                format!(
                    "{:?} has a ':', which SGLang reads as base model:LoRA adapter and refuses as a served model name; \
                     name the fleet without one",
                    self.model_name
                ),
            ));
        }
        if self.model_name == "default" && self.model_path.contains(':') {
            return Err(bad(
                "--model-name",
                format!(
                    "the fleet would be named after --model-path {:?}, whose ':' SGLang reads as base model:LoRA \
                     adapter and refuses as a served model name; give --model-name without one",
                    self.model_path
                ),
            ));
        }
        if self.gpus > MAX_GPUS {
            return Err(bad("--gpus", format!("{} is above the supported {MAX_GPUS}", self.gpus)));
        }
        if self.rollout_num_gpus_per_engine == 0 {
            return Err(bad("--rollout-num-gpus-per-engine", "must be at least 1"));
        }
        if !self.rollout_num_gpus.is_multiple_of(self.rollout_num_gpus_per_engine) {
            return Err(bad(
                "--rollout-num-gpus-per-engine",
                format!(
                    "{} does not divide --rollout-num-gpus {}; the initial engines need a whole number of engines",
                    self.rollout_num_gpus_per_engine, self.rollout_num_gpus
                ),
            ));
        }
        if let Some(path) = &self.api_socket {
            if path.as_os_str().is_empty() {
                return Err(bad("--api-socket", "must not be empty"));
            }
            // sockaddr_un holds 108 bytes, the last one a NUL.
            if path.as_os_str().len() > 107 {
                return Err(bad(
                    "--api-socket",
                    format!("{} is longer than the 107 bytes a Unix socket path may have", path.display()),
                ));
            }
        }
        // In ray mode the capacity comes from the Ray cluster, not from a local pool.
        let local = self.placement == PlacementMode::Local;
        if local && self.rollout_num_gpus > self.gpus {
            return Err(bad(
                "--gpus",
                format!(
                    "the pool has {} GPUs but --rollout-num-gpus asks for {}; raise --gpus",
                    self.gpus, self.rollout_num_gpus
                ),
            ));
        }
        if local && self.rollout_num_gpus_per_engine > self.gpus {
            return Err(bad(
                "--gpus",
                format!(
                    "the pool has {} GPUs, fewer than one engine needs ({})",
                    self.gpus, self.rollout_num_gpus_per_engine
                ),
            ));
        }
        if self.initial_engines() > self.max_engines {
            return Err(bad(
                "--max-engines",
                format!("{} is below the {} initial engines", self.max_engines, self.initial_engines()),
            ));
        }
        if self.weight_version.trim().is_empty() {
            return Err(bad("--weight-version", "must not be empty"));
        }
        if !self.health_check_endpoint.starts_with('/') {
            return Err(bad("--health-check-endpoint", "must be a path starting with '/'"));
        }
        if self.health_failure_threshold == 0 {
            return Err(bad("--health-failure-threshold", "must be at least 1"));
        }
        if self.restart_budget == 0 {
            return Err(bad(
                "--restart-budget",
                "must be at least 1 (--restart-failed-engines false turns restarts off)",
            ));
        }
        positive_secs("--restart-window-secs", self.restart_window_secs)?;
        if !(self.health_max_unhealthy_fraction > 0.0 && self.health_max_unhealthy_fraction <= 1.0) {
            return Err(bad(
                "--health-max-unhealthy-fraction",
                format!("{} is not in (0, 1], e.g. 0.5", self.health_max_unhealthy_fraction),
            ));
        }
        if self.engine_args.iter().any(|a| a.contains('\0')) {
            return Err(bad("--engine-arg", "must not contain NUL bytes"));
        }
        secs_or_zero("--reattach-grace-secs", self.reattach_grace_secs)?;
        if self.max_engines > 100_000 {
            return Err(bad("--max-engines", format!("{} is above the supported 100000", self.max_engines)));
        }
        positive_secs("--scale-out-timeout-secs", self.scale_out_timeout)?;
        positive_secs("--load-poll-interval-secs", self.load_poll_interval_secs)?;
        secs_or_zero("--version-wait-secs", self.version_wait_secs)?;
        crate::routing::VersionPolicy::parse(&self.rl_version_policy).map_err(|e| bad("--rl-version-policy", e))?;
        positive_secs("--weight-update-timeout-secs", self.weight_update_timeout_secs)?;
        if let Some(spec) = &self.external_router {
            self.external_router_url().ok_or_else(|| {
                bad(
                    "--router",
                    format!(
                        "{spec:?} is not KIND=URL with KIND smg and an http(s) URL, e.g. smg=http://127.0.0.1:30100"
                    ),
                )
            })?;
        }
        positive_secs("--scale-in-drain-timeout-secs", self.scale_in_drain_timeout)?;
        positive_secs("--scale-in-shutdown-timeout-secs", self.scale_in_shutdown_timeout)?;
        positive_secs("--engine-startup-timeout-secs", self.engine_startup_timeout)?;
        positive_secs("--health-check-interval-secs", self.health_check_interval_secs)?;
        positive_secs("--health-check-timeout-secs", self.health_check_timeout_secs)?;
        secs_or_zero("--health-pause-grace-secs", self.health_pause_grace_secs)?;
        positive_secs("--request-timeout-secs", self.request_timeout_secs)?;
        positive_secs("--header-read-timeout-secs", self.header_read_timeout_secs)?;
        self.external_allow_list()?;
        if !self.trainer_allow_list()?.is_empty() && self.trainer_port.is_none() {
            return Err(bad("--trainer-allow-cidr", "is for the trainer port; give --trainer-port too"));
        }
        Ok(())
    }

    /// The networks of `--trainer-allow-cidr`, parsed (empty: the port takes the token rules).
    pub fn trainer_allow_list(&self) -> Result<Vec<crate::cidr::Cidr>, ConfigError> {
        self.trainer_allow_cidr
            .iter()
            .map(|c| c.parse().map_err(|e| bad("--trainer-allow-cidr", format!("{e}; e.g. 10.0.0.0/8 or fd00::/8"))))
            .collect()
    }

    /// The networks of `--external-allow-cidr`, parsed (empty: no restriction).
    pub fn external_allow_list(&self) -> Result<Vec<crate::cidr::Cidr>, ConfigError> {
        self.external_allow_cidr
            .iter()
            .map(|c| c.parse().map_err(|e| bad("--external-allow-cidr", format!("{e}; e.g. 10.0.0.0/8 or fd00::/8"))))
            .collect()
    }

    /// The base URL of the external router given with `--router smg=URL`.
    pub fn external_router_url(&self) -> Option<&str> {
        let (kind, url) = self.external_router.as_deref()?.split_once('=')?;
        let ok = kind == "smg" && (url.starts_with("http://") || url.starts_with("https://")) && url.len() > 8;
        ok.then(|| url.trim_end_matches('/'))
    }

    /// Number of engines started at boot.
    pub fn initial_engines(&self) -> u32 {
        self.rollout_num_gpus.checked_div(self.rollout_num_gpus_per_engine).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeConfig,
    }

    fn parse(args: &[&str]) -> ServeConfig {
        let mut argv = vec!["rollout-manager"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().serve
    }

    #[test]
    fn defaults_are_valid_and_loopback() {
        let c = parse(&[]);
        c.validate().unwrap();
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!((c.port, c.router_port), (8000, 30000));
        assert_eq!(c.initial_engines(), 2);
    }

    #[test]
    fn errors_name_the_flag() {
        let long = format!("/tmp/{}", "s".repeat(120));
        let cases: [(&[&str], &str); 18] = [
            (&["--gpus", "4000000000"], "--gpus"),
            (&["--trainer-port", "0", "--trainer-allow-cidr", "10.0.0.0/33"], "--trainer-allow-cidr"),
            (&["--trainer-allow-cidr", "10.0.0.0/8"], "--trainer-allow-cidr"),
            (&["--external-allow-cidr", "10.0.0.0/40"], "--external-allow-cidr"),
            (&["--request-timeout-secs", "0"], "--request-timeout-secs"),
            (&["--api-socket", long.as_str()], "--api-socket"),
            (&["--scale-out-timeout", "1e20"], "--scale-out-timeout-secs"),
            (&["--reattach-grace-secs=-1"], "--reattach-grace-secs"),
            (&["--router", "nginx=http://x"], "--router"),
            (&["--load-poll-interval-secs", "0"], "--load-poll-interval-secs"),
            (&["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "3"], "--rollout-num-gpus-per-engine"),
            (&["--rollout-num-gpus", "8", "--gpus", "4"], "--gpus"),
            (&["--rollout-num-gpus-per-engine", "0"], "--rollout-num-gpus-per-engine"),
            (&["--port", "9000", "--router-port", "9000"], "--router-port"),
            (&["--trainer-port", "30000"], "--trainer-port"),
            (&["--port", "9000", "--trainer-port", "9000"], "--trainer-port"),
            (&["--scale-in-drain-timeout-secs=-1"], "--scale-in-drain-timeout-secs"),
            (&["--max-engines", "1"], "--max-engines"),
        ];
        for (args, flag) in cases {
            let err = parse(args).validate().unwrap_err();
            assert_eq!(err.flag, flag, "{args:?}");
            assert!(err.to_string().contains(flag));
        }
    }

    #[test]
    fn ray_placement_needs_no_local_gpu_pool() {
        let args = ["--rollout-num-gpus", "8", "--gpus", "0", "--rollout-num-gpus-per-engine", "2"];
        assert_eq!(parse(&args).validate().unwrap_err().flag, "--gpus");
        let mut ray = args.to_vec();
        ray.extend(["--placement", "ray"]);
        let c = parse(&ray);
        c.validate().unwrap();
        assert_eq!(c.placement, PlacementMode::Ray);
        assert_eq!(c.initial_engines(), 4);
    }

    #[test]
    fn partial_success_policy_is_spelled_as_in_the_seed() {
        let c = parse(&["--scale-out-partial-success-policy", "keep_partial"]);
        assert_eq!(c.scale_out_partial_success_policy, PartialSuccessPolicy::KeepPartial);
        let c = parse(&["--scale-out-partial-success-policy", "rollback_all"]);
        assert_eq!(c.scale_out_partial_success_policy, PartialSuccessPolicy::RollbackAll);
    }

    #[test]
    fn engine_args_keep_leading_dashes() {
        let c = parse(&["--engine-arg=--startup-delay=10", "--engine-arg", "--time-scale=0.1"]);
        assert_eq!(c.engine_args, vec!["--startup-delay=10", "--time-scale=0.1"]);
    }

    #[test]
    fn serde_round_trip() {
        let c = parse(&["--engine", "sglang", "--gpus", "4"]);
        let json = serde_json::to_string(&c).unwrap();
        let back: ServeConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(c, back);
    }
}
