//! Command line: SGLang's own launch flags (the ones a fleet manager passes) plus the
//! simulator's knobs (timing model, fault injection). Parsed once by clap, validated once by
//! [`Config::validate`], then shared read-only as `Arc<Config>`.

use clap::Parser;

/// Everything `sglang-sim` is launched with. Field names follow SGLang's `ServerArgs` where a
/// flag exists there, so `/server_info` can report them under the same keys.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "sglang-sim",
    version,
    about = "An engine simulator faithful to SGLang 0.5.x's HTTP API (no GPU needed).",
    // Like Python's argparse: a repeated flag overrides the earlier value.
    args_override_self = true
)]
pub struct Config {
    // ---------------------------------------------------------------- SGLang launch flags
    /// Model path or Hugging Face id. A local directory (or file) holding `*.safetensors` is
    /// read and checksummed at startup, like a real weight load.
    #[arg(long = "model-path", visible_alias = "model")]
    pub model_path: String,
    /// Tokenizer path (reported only; the simulator has its own fake tokenizer).
    #[arg(long)]
    pub tokenizer_path: Option<String>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (with `--instances N`, instance i binds `port + i`).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Tensor parallel size (reported; does not change the timing model).
    #[arg(long, visible_alias = "tensor-parallel-size", default_value_t = 1)]
    pub tp_size: u32,
    /// Data parallel size: number of independent scheduler ranks, each with its own KV pool.
    #[arg(long, visible_alias = "data-parallel-size", default_value_t = 1)]
    pub dp_size: u32,
    /// Pipeline parallel size (reported only).
    #[arg(long, visible_alias = "pipeline-parallel-size", default_value_t = 1)]
    pub pp_size: u32,
    /// Initial weight version, as reported in `/model_info` and `meta_info.weight_version`.
    #[arg(long, default_value = "default")]
    pub weight_version: String,
    /// Serve Prometheus metrics on `/metrics` (404 otherwise).
    #[arg(long)]
    pub enable_metrics: bool,
    /// Accepted for compatibility (metrics come from the single scheduler anyway).
    #[arg(long)]
    pub enable_metrics_for_all_schedulers: bool,
    /// KV pool capacity in tokens, per DP rank (SGLang's `max_total_num_tokens`).
    #[arg(long, default_value_t = 65536)]
    pub max_total_tokens: usize,
    /// Cap on concurrently running requests per DP rank.
    #[arg(long, default_value_t = 1024)]
    pub max_running_requests: usize,
    /// Model context length (prompt + completion), reported as `max_model_len`.
    #[arg(long, default_value_t = 32768)]
    pub context_length: usize,
    /// Most uncached prompt tokens prefilled in one step (a longer single prompt still goes
    /// through in one step; see the docs).
    #[arg(long, default_value_t = 8192)]
    pub chunked_prefill_size: usize,
    /// Required as `Authorization: Bearer <key>` on every route except `/health*`, `/ready*`,
    /// `/metrics*`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// When set, admin routes (weights, pause, abort, flush...) require this key instead.
    #[arg(long)]
    pub admin_api_key: Option<String>,
    /// Model name reported by `/v1/models` and metrics labels (default: the model path). A
    /// successful `/update_weights_from_disk` renames the served model to the checkpoint's
    /// path anyway, as SGLang does (metrics keep this name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Accepted and ignored.
    #[arg(long)]
    pub mem_fraction_static: Option<f64>,
    /// Become ready right after the port opens (ignores `--warmup-delay`).
    #[arg(long)]
    pub skip_server_warmup: bool,
    /// Weight format. `dummy` skips reading weight files; `remote_instance` loads from the seed
    /// engine named by the `--remote-instance-weight-loader-*` flags.
    #[arg(long, default_value = "auto")]
    pub load_format: String,
    /// Seed engine's address for `--load-format remote_instance`.
    #[arg(long)]
    pub remote_instance_weight_loader_seed_instance_ip: Option<String>,
    /// Seed engine's HTTP port for `--load-format remote_instance`.
    #[arg(long)]
    pub remote_instance_weight_loader_seed_instance_service_port: Option<u16>,
    /// One port per TP rank for the send groups (`[p0,p1]` or `p0,p1`).
    #[arg(long)]
    pub remote_instance_weight_loader_send_weights_group_ports: Option<String>,
    /// `nccl` (default), `transfer_engine` or `modelexpress`; only `nccl` is simulated.
    #[arg(long, default_value = "nccl")]
    pub remote_instance_weight_loader_backend: String,
    /// Accepted and reported.
    #[arg(long, default_value_t = 0)]
    pub base_gpu_id: u32,
    /// Accepted and reported.
    #[arg(long, default_value_t = 1)]
    pub gpu_id_step: u32,
    /// Disable the prefix cache (every prompt token is prefilled).
    #[arg(long)]
    pub disable_radix_cache: bool,
    /// Stream only the new part of the output in each chunk instead of the whole text.
    #[arg(long)]
    pub incremental_streaming_output: bool,
    /// A stream's default interval in tokens (a request's `sampling_params.stream_interval`
    /// overrides it): the first token goes out at once, then whenever this many are unsent.
    #[arg(long, default_value_t = 1)]
    pub stream_interval: i64,
    /// Sample with each request's `sampling_params.sampling_seed` (default 42), so equal
    /// requests give equal answers; without it `sampling_seed` is ignored and sampled
    /// (temperature > 0) outputs are random, as in SGLang.
    #[arg(long)]
    pub enable_deterministic_inference: bool,
    /// Accepted and ignored.
    #[arg(long)]
    pub trust_remote_code: bool,
    /// Log level for the simulator's own logs (overridden by `RUST_LOG`).
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Accepted and reported.
    #[arg(long)]
    pub random_seed: Option<u64>,
    /// Accepted and ignored.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Accepted and ignored.
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// Accepted and ignored.
    #[arg(long)]
    pub quantization: Option<String>,
    /// Accepted and ignored (the prefix cache always works on 16-token blocks).
    #[arg(long)]
    pub page_size: Option<u32>,
    /// Accepted and ignored (the simulator schedules first-come first-served).
    #[arg(long)]
    pub schedule_policy: Option<String>,
    /// Accepted and ignored.
    #[arg(long)]
    pub watchdog_timeout: Option<f64>,
    /// Accepted and ignored.
    #[arg(long)]
    pub dist_init_addr: Option<String>,
    /// Accepted and ignored.
    #[arg(long, default_value_t = 1)]
    pub nnodes: u32,
    /// Accepted and ignored.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u32,
    /// Accepted and ignored.
    #[arg(long)]
    pub enable_memory_saver: bool,
    /// Accepted and ignored.
    #[arg(long)]
    pub disable_cuda_graph: bool,
    /// Accepted and ignored.
    #[arg(long)]
    pub cuda_graph_max_bs: Option<u32>,

    // ---------------------------------------------------------------- simulator knobs
    /// The SGLang release whose HTTP surface to serve (0.5.1 to 0.5.23): routes it lacks
    /// answer 404, and `/get_load`, `/pause_generation`, `/ping`, `/server_info`'s `version` and
    /// what `/server_info` reports after weight updates behave as in that release. See
    /// docs/sglang-sim.md, "API profiles".
    #[arg(long = "sglang-api", default_value = "0.5.23", value_parser = crate::api_profile::Release::parse, help_heading = "Simulation")]
    pub sglang_api: crate::api_profile::Release,

    /// Seconds of simulated weight loading before the TCP port is even bound (wall clock).
    #[arg(long, default_value_t = 0.0, help_heading = "Simulation")]
    pub startup_delay: f64,
    /// Seconds after the port opens during which `/health` answers 503 (wall clock).
    #[arg(long, default_value_t = 0.0, help_heading = "Simulation")]
    pub warmup_delay: f64,
    /// Multiplies every simulated engine duration: 0.01 runs the engine 100x faster than the
    /// modelled GPU. 0 makes steps free but keeps the scheduler.
    #[arg(long, default_value_t = 1.0, help_heading = "Simulation")]
    pub time_scale: f64,
    /// Shortcut for single-request decode speed: sets `--decode-step-base-ms` to 1000/X.
    #[arg(long, help_heading = "Simulation")]
    pub decode_tokens_per_sec: Option<f64>,
    /// Fixed cost of one prefill step, in milliseconds.
    #[arg(long, default_value_t = 5.0, help_heading = "Simulation")]
    pub prefill_base_ms: f64,
    /// Prefill cost per 1000 uncached prompt tokens, in milliseconds.
    #[arg(long, default_value_t = 60.0, help_heading = "Simulation")]
    pub prefill_ms_per_1k_tokens: f64,
    /// Fixed cost of one decode step, in milliseconds.
    #[arg(long, default_value_t = 8.0, help_heading = "Simulation")]
    pub decode_step_base_ms: f64,
    /// Extra decode-step cost per running request, in milliseconds.
    #[arg(long, default_value_t = 0.05, help_heading = "Simulation")]
    pub decode_step_ms_per_req: f64,
    /// Extra decode-step cost per 1000 tokens of context held by the running batch, in ms.
    #[arg(long, default_value_t = 0.002, help_heading = "Simulation")]
    pub decode_step_ms_per_1k_ctx: f64,
    /// Chance that the generator emits EOS at each step (when `ignore_eos` is false).
    #[arg(long, default_value_t = 0.002, help_heading = "Simulation")]
    pub eos_prob: f64,
    /// Answer `/generate` at once with no timing model or scheduler (router benchmarks).
    #[arg(long, help_heading = "Simulation")]
    pub zero_cost: bool,
    /// Host N independent engines in this process on ports port..port+N-1.
    #[arg(long, default_value_t = 1, help_heading = "Simulation")]
    pub instances: u16,
    /// Extra wall-clock seconds a successful `/update_weights_from_disk` takes.
    #[arg(long, default_value_t = 0.0, help_heading = "Simulation")]
    pub weight_load_delay: f64,
    /// Bytes of weights the transfer model moves (with `--transfer-gbps`).
    #[arg(long, default_value_t = 0, help_heading = "Simulation")]
    pub weight_bytes: u64,
    /// Link rate of the transfer model, in Gbit/s (0: transfers take no time). A seed sends
    /// `--weight-bytes` to one new instance at a time (`/send_weights_to_remote_instance`, a
    /// 2-rank group each: a queue); a rank of the trainer's broadcast receives the tensors one
    /// `/update_weights_from_distributed` names (their shapes and dtypes) in the time their
    /// bytes take on one link, whatever the group's size.
    #[arg(long, default_value_t = 0.0, help_heading = "Simulation")]
    pub transfer_gbps: f64,

    // ---------------------------------------------------------------- fault injection
    /// The process exits (code 3) right after answering its N-th `/generate` request.
    #[arg(long, help_heading = "Fault injection")]
    pub crash_after_requests: Option<u64>,
    /// After answering its N-th `/generate` request the engine stops answering anything.
    #[arg(long, help_heading = "Fault injection")]
    pub hang_after_requests: Option<u64>,
    /// `/health` and `/health_generate` sleep this many seconds before answering.
    #[arg(long, help_heading = "Fault injection")]
    pub slow_health: Option<f64>,
    /// Exit with code 1 and a message on stderr once the startup delay has passed.
    #[arg(long, help_heading = "Fault injection")]
    pub fail_startup: bool,
    /// Exit with code 1 and a message on stderr at startup while this file exists: a fault
    /// that outlives the process (out of memory at load, a broken disk), so every restart of
    /// the engine fails until the file is removed.
    #[arg(long, value_name = "PATH", help_heading = "Fault injection")]
    pub fail_startup_while: Option<std::path::PathBuf>,
    /// Stay in the startup's weight loading (the port not yet bound) while this file exists:
    /// a slow load that a test ends when it chooses, e.g. to lose the engine's node while it
    /// starts.
    #[arg(long, value_name = "PATH", help_heading = "Fault injection")]
    pub hold_startup_while: Option<std::path::PathBuf>,
    /// Serve `POST /sim/faults` (slow health checks, hang) to break this engine while it runs.
    #[arg(long, help_heading = "Fault injection")]
    pub enable_fault_api: bool,
}

impl Config {
    /// How long moving `--weight-bytes` over one `--transfer-gbps` link takes.
    pub fn transfer_time(&self) -> std::time::Duration {
        self.transfer_time_of(self.weight_bytes)
    }

    /// How long moving `bytes` over one `--transfer-gbps` link takes.
    pub fn transfer_time_of(&self, bytes: u64) -> std::time::Duration {
        if self.transfer_gbps <= 0.0 || bytes == 0 {
            return std::time::Duration::ZERO;
        }
        std::time::Duration::from_secs_f64(bytes as f64 * 8.0 / (self.transfer_gbps * 1e9))
    }

    /// The version string reported where SGLang reports `__version__`: the release of
    /// `--sglang-api`, marked as simulated.
    pub fn version(&self) -> String {
        format!("{}-sim", self.sglang_api)
    }

    /// Checks the values clap cannot check on its own.
    pub fn validate(mut self) -> Result<Self, String> {
        fn non_negative(name: &str, v: f64) -> Result<(), String> {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("--{name} must be a finite number >= 0, got {v}"))
            }
        }
        non_negative("startup-delay", self.startup_delay)?;
        non_negative("warmup-delay", self.warmup_delay)?;
        non_negative("time-scale", self.time_scale)?;
        non_negative("prefill-base-ms", self.prefill_base_ms)?;
        non_negative("prefill-ms-per-1k-tokens", self.prefill_ms_per_1k_tokens)?;
        non_negative("decode-step-base-ms", self.decode_step_base_ms)?;
        non_negative("decode-step-ms-per-req", self.decode_step_ms_per_req)?;
        non_negative("decode-step-ms-per-1k-ctx", self.decode_step_ms_per_1k_ctx)?;
        non_negative("weight-load-delay", self.weight_load_delay)?;
        non_negative("transfer-gbps", self.transfer_gbps)?;
        if let Some(s) = self.slow_health {
            non_negative("slow-health", s)?;
        }
        if !(0.0..=1.0).contains(&self.eos_prob) {
            return Err(format!("--eos-prob must be in [0, 1], got {}", self.eos_prob));
        }
        if let Some(tps) = self.decode_tokens_per_sec {
            if !(tps.is_finite() && tps > 0.0) {
                return Err(format!("--decode-tokens-per-sec must be > 0, got {tps}"));
            }
            self.decode_step_base_ms = 1000.0 / tps;
        }
        if self.instances == 0 {
            return Err("--instances must be at least 1".into());
        }
        if u32::from(self.port) + u32::from(self.instances) - 1 > u32::from(u16::MAX) {
            return Err(format!("--port {} with --instances {} runs past port 65535", self.port, self.instances));
        }
        if self.port == 0 && self.instances > 1 {
            return Err("--port 0 cannot be combined with --instances > 1".into());
        }
        if self.load_format == "remote_instance" {
            crate::remote_instance::check_flags(&self)?;
        }
        if self.dp_size == 0 || self.tp_size == 0 || self.pp_size == 0 {
            return Err("--tp-size, --dp-size and --pp-size must be at least 1".into());
        }
        if self.max_total_tokens < 64 {
            return Err(format!("--max-total-tokens must be at least 64, got {}", self.max_total_tokens));
        }
        if self.max_running_requests == 0 {
            return Err("--max-running-requests must be at least 1".into());
        }
        if self.context_length < 2 {
            return Err("--context-length must be at least 2".into());
        }
        if self.chunked_prefill_size == 0 {
            return Err("--chunked-prefill-size must be at least 1".into());
        }
        if self.crash_after_requests == Some(0) || self.hang_after_requests == Some(0) {
            return Err("--crash-after-requests / --hang-after-requests must be at least 1".into());
        }
        Ok(self)
    }

    /// The name clients see in `/v1/models` and metric labels.
    pub fn served_model_name(&self) -> &str {
        self.served_model_name.as_deref().unwrap_or(&self.model_path)
    }

    /// The tokenizer path reported by `/model_info` (defaults to the model path, as in SGLang).
    pub fn tokenizer_path(&self) -> &str {
        self.tokenizer_path.as_deref().unwrap_or(&self.model_path)
    }

    /// Longest request (prompt + completion) one DP rank accepts, as SGLang computes it.
    pub fn max_req_len(&self) -> usize {
        self.context_length.min(self.max_total_tokens).saturating_sub(1)
    }

    /// Longest prompt one DP rank accepts.
    pub fn max_req_input_len(&self) -> usize {
        self.max_req_len().saturating_sub(5).max(1)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        let mut full = vec!["sglang-sim"];
        full.extend_from_slice(args);
        Config::try_parse_from(full).map_err(|e| e.to_string())?.validate()
    }

    #[test]
    fn defaults_follow_sglang() {
        let c = parse(&["--model-path", "m"]).unwrap();
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!(c.port, 30000);
        assert_eq!(c.weight_version, "default");
        assert_eq!(c.served_model_name(), "m");
    }

    #[test]
    fn model_alias_and_parallel_aliases() {
        let c = parse(&["--model", "m", "--tensor-parallel-size", "2", "--data-parallel-size", "3"]).unwrap();
        assert_eq!(c.model_path, "m");
        assert_eq!(c.tp_size, 2);
        assert_eq!(c.dp_size, 3);
    }

    #[test]
    fn unknown_flag_is_named() {
        let err = parse(&["--model-path", "m", "--no-such-flag"]).unwrap_err();
        assert!(err.contains("--no-such-flag"), "{err}");
    }

    #[test]
    fn repeated_flag_overrides_like_argparse() {
        let c = parse(&["--model-path", "m", "--time-scale", "0.5", "--time-scale", "2"]).unwrap();
        assert_eq!(c.time_scale, 2.0);
    }

    #[test]
    fn decode_tokens_per_sec_sets_base_step() {
        let c = parse(&["--model-path", "m", "--decode-tokens-per-sec", "50"]).unwrap();
        assert!((c.decode_step_base_ms - 20.0).abs() < 1e-9);
    }

    #[test]
    fn rejects_bad_values() {
        assert!(parse(&["--model-path", "m", "--time-scale", "-1"]).is_err());
        assert!(parse(&["--model-path", "m", "--instances", "0"]).is_err());
        assert!(parse(&["--model-path", "m", "--port", "65535", "--instances", "2"]).is_err());
        assert!(parse(&["--model-path", "m", "--eos-prob", "2"]).is_err());
    }
}
