//! Lifecycle of the process and of each engine instance.
//!
//! Expected flow of one instance (like `sglang.launch_server`):
//! 1. "load weights" for `--startup-delay` seconds; the port is not bound yet. A local
//!    `--model-path` holding `*.safetensors` is validated and checksummed here.
//! 2. bind the port; `/model_info` and `/server_info` answer, `/health` is 503 (Starting).
//! 3. warm up for `--warmup-delay` seconds and run one 8-token generation through the
//!    scheduler (skipped with `--skip-server-warmup`); then status Up, "The server is fired
//!    up and ready to roll!" is logged and `/health` is 200.
//! 4. on SIGTERM/SIGINT: status ShuttingDown (health 503, new requests refused with "The
//!    server is shutting down."), requests in flight run on (SGLang's drain waits for them;
//!    none is aborted), connections still open after [`SHUTDOWN_GRACE`] are cut, and the
//!    process exits 0. An engine that is
//!    `UnHealthy` at that moment (its last health check failed), or any engine under
//!    `SGL_FORCE_SHUTDOWN`, skips all of that, as SGLang does: it stops at once, nothing
//!    aborted, and its open connections are cut when the process exits (0).
//!
//! Errors: `--fail-startup`, an unreadable checkpoint or a port that cannot be bound end
//! the process with exit code 1 and a message on stderr.

use crate::api;
use crate::cli::Config;
use crate::engine::{Engine, NewRequestParts, Status};
use crate::generator::GenState;
use crate::sampling::RawSamplingParams;
use crate::weights::{self, WeightsError, WeightsInfo};
use axum::serve::ListenerExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long in-flight HTTP connections get to finish after a shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// Why an instance could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("simulated startup failure (--fail-startup or --fail-startup-while) on port {0}")]
    Simulated(u16),
    #[error("failed to load weights from {path}: {source}")]
    Weights { path: String, source: WeightsError },
    #[error("failed to load weights from the seed instance: {0}")]
    RemoteInstance(String),
    #[error("failed to bind {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("internal error: {0}")]
    Internal(String),
}

/// Runs every instance until a shutdown signal; the first startup failure is returned.
pub async fn run(cfg: Arc<Config>) -> Result<(), StartupError> {
    let process_start = Instant::now();
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received");
        let _ = shutdown_tx.send(true);
    });
    let mut set = tokio::task::JoinSet::new();
    for i in 0..cfg.instances {
        set.spawn(run_instance(cfg.clone(), i, process_start, shutdown_rx.clone()));
    }
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(e) => return Err(StartupError::Internal(e.to_string())),
        }
    }
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Resolves once `shutdown` turns true (or its sender is gone).
async fn shutdown_requested(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|v| *v).await;
}

async fn load_initial_weights(cfg: &Config, port: u16) -> Result<WeightsInfo, StartupError> {
    if cfg.load_format == "remote_instance" {
        return crate::remote_instance::load_from_seed(cfg, port).await.map_err(StartupError::RemoteInstance);
    }
    if cfg.load_format == "dummy" || !weights::is_local(&cfg.model_path) {
        return Ok(WeightsInfo::default());
    }
    let path = cfg.model_path.clone();
    let loaded = tokio::task::spawn_blocking(move || weights::load_checkpoint(&path))
        .await
        .map_err(|e| StartupError::Internal(e.to_string()))?;
    match loaded {
        Ok(info) => {
            tracing::info!(
                path = cfg.model_path,
                files = info.files.len(),
                checksum = info.checksum.as_deref().unwrap_or("-"),
                "weights loaded"
            );
            Ok(info)
        }
        // A local directory without weights (e.g. only a config.json) is fine for a simulator.
        Err(WeightsError::NoFiles(_)) => {
            Ok(WeightsInfo { path: Some(cfg.model_path.clone()), ..WeightsInfo::default() })
        }
        Err(source) => Err(StartupError::Weights { path: cfg.model_path.clone(), source }),
    }
}

async fn run_instance(
    cfg: Arc<Config>,
    index: u16,
    process_start: Instant,
    shutdown: watch::Receiver<bool>,
) -> Result<(), StartupError> {
    let port = if cfg.port == 0 { 0 } else { cfg.port + index };
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs_f64(cfg.startup_delay)) => {}
        _ = shutdown_requested(shutdown.clone()) => return Ok(()),
    }
    while cfg.hold_startup_while.as_ref().is_some_and(|p| p.exists()) {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            _ = shutdown_requested(shutdown.clone()) => return Ok(()),
        }
    }
    if cfg.fail_startup || cfg.fail_startup_while.as_ref().is_some_and(|p| p.exists()) {
        return Err(StartupError::Simulated(port));
    }
    let weights = load_initial_weights(&cfg, port).await?;
    let meta = weights::read_model_config(&cfg.model_path);
    let addr = format!("{}:{port}", cfg.host);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| StartupError::Bind { addr: addr.clone(), source })?;
    let port = listener.local_addr().map_err(|e| StartupError::Internal(e.to_string()))?.port();
    let engine = Arc::new(Engine::new(cfg.clone(), usize::from(index), port, weights, meta, process_start));
    // The ranks step on through the drain (in-flight requests finish, as SGLang's drain waits
    // for them) and stop when this instance returns, whichever way it does.
    let (ranks_stop, ranks_run) = watch::channel(false);
    let _stop_ranks = StopRanks(ranks_stop);
    for rank in &engine.ranks {
        tokio::spawn(rank.clone().run(ranks_run.clone()));
    }
    tracing::info!("sglang-sim listening on http://{}:{port}", cfg.host);
    tokio::spawn(warm_up(engine.clone(), shutdown.clone()));

    let drain_engine = engine.clone();
    let drain_signal = shutdown.clone();
    let (force_tx, force_rx) = tokio::sync::oneshot::channel::<()>();
    let listener = listener.tap_io(|tcp| {
        // Small request/response pairs: do not wait for Nagle.
        let _ = tcp.set_nodelay(true);
    });
    let server = axum::serve(listener, api::router(engine.clone())).with_graceful_shutdown(async move {
        shutdown_requested(drain_signal).await;
        // Decided once, when the signal arrives, before the status turns ShuttingDown.
        if let Some(reason) = drain_engine.force_exit_reason() {
            tracing::error!(port = drain_engine.port, "{reason}");
            let _ = force_tx.send(());
            // The drain never starts: the engine is dropped below.
            return std::future::pending().await;
        }
        drain_engine.shared.set_status(Status::ShuttingDown);
        drain_engine.shared.set_paused(false);
    });
    let deadline = async {
        shutdown_requested(shutdown.clone()).await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    let forced = async {
        if force_rx.await.is_err() {
            // The drain began instead: only the server or the deadline ends this engine.
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = server => r.map_err(|e| StartupError::Internal(e.to_string()))?,
        _ = deadline => tracing::warn!(port, "connections still open after the grace period"),
        () = forced => {
            engine.shared.set_status(Status::ShuttingDown);
            tracing::info!(port, "engine stopped without draining");
            return Ok(());
        }
    }
    tracing::info!(port, "engine stopped");
    Ok(())
}

/// Stops an instance's ranks when dropped.
struct StopRanks(watch::Sender<bool>);

impl Drop for StopRanks {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}

/// Step 3 of the lifecycle: wait, run one small generation, become ready.
async fn warm_up(engine: Arc<Engine>, shutdown: watch::Receiver<bool>) {
    if engine.cfg.skip_server_warmup {
        engine.mark_up();
        return;
    }
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs_f64(engine.cfg.warmup_delay)) => {}
        _ = shutdown_requested(shutdown.clone()) => return,
    }
    if !engine.cfg.zero_cost {
        let params = RawSamplingParams {
            max_new_tokens: Some(Some(8)),
            temperature: Some(0.0),
            ignore_eos: Some(true),
            ..RawSamplingParams::default()
        }
        .validate();
        if let Ok(params) = params {
            let prompt = crate::tokenizer::encode("The capital city of France is");
            let gen = GenState::new(&prompt, &params, crate::generator::GREEDY, 8, 0.0);
            let rid = format!("WARMUP_{}", uuid::Uuid::new_v4().simple());
            let live = engine.register_rid(&rid);
            let parts = NewRequestParts { rid, prompt, gen, stream: false, stream_interval: None };
            let handle = engine.submit(engine.pick_rank(Some(0)), parts, live);
            tokio::select! {
                _ = handle.finish() => {}
                _ = shutdown_requested(shutdown) => return,
            }
        }
    }
    engine.mark_up();
}
