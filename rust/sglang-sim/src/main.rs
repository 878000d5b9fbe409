//! `sglang-sim`: an engine simulator faithful to SGLang 0.5.x's HTTP API, so the rollout
//! fleet manager can be run and tested without GPUs. See `docs/sglang-sim.md`.
//!
//! Exit codes: 0 after a shutdown signal, 1 startup failure, 2 bad usage,
//! 3 simulated crash (`--crash-after-requests`).

mod api;
mod api_profile;
mod cli;
mod engine;
mod faults;
mod generator;
mod health;
mod kv;
mod metrics;
mod remote_instance;
mod sampling;
mod scheduler;
mod server;
mod tokenizer;
mod weight_sync;
mod weights;

use clap::Parser;
use std::sync::Arc;
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    let cfg = match cli::Config::parse().validate() {
        Ok(c) => c,
        Err(msg) => {
            eprintln!("error: {msg}");
            return std::process::ExitCode::from(2);
        }
    };
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let result = runtime.block_on(server::run(Arc::new(cfg)));
    // Tasks parked forever by the hang fault must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("sglang-sim: startup failed: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
