//! Fakes behind the manager's seams ([`EngineApi`], [`EngineHost`]) and a manager built on
//! them, for unit tests of the use cases: engines that start, answer, load weights, crash or
//! refuse as a test says, with no process and no network. Tests wait on the registry's change
//! signal ([`wait_for`]), never on a sleep.

use crate::adapters::engine_api::{DiskLoad, EngineApi, EngineError};
use crate::adapters::engine_host::{EngineHost, Hosted, Location};
use crate::adapters::launch::EngineLauncher;
use crate::foundation::host::{EngineProcess, ExitInfo, HostError, LaunchSpec};
use crate::foundation::locks::Locked;
use crate::ops::manager::Manager;
use crate::registry::fleet::FleetInner;
use clap::Parser;
use futures::future::BoxFuture;
use rollout_core::{EngineKind, ServeConfig};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::task::TaskTracker;

/// The model every fake engine serves (the manager's `--model-path` in [`manager`]).
pub const MODEL: &str = "/models/fake";

#[derive(Default)]
struct State {
    /// Engine ids whose launch fails.
    fail_launch: HashSet<String>,
    /// URLs whose probes fail (a hung or dead HTTP server).
    down: HashSet<String>,
    /// URLs whose weight loads fail.
    refuse_loads: HashSet<String>,
    /// The weight version each URL serves.
    serving: HashMap<String, String>,
    /// Running processes by engine id, with what ends them.
    running: HashMap<String, watch::Sender<Option<ExitInfo>>>,
    /// What the manager asked, in order: `launch <id>`, `stop <id>`, `load <url> <version>`,
    /// `abort <url>`, `control <url><path>`.
    calls: Vec<String>,
    /// The `backend` of every `/init_weights_update_group` call, in order.
    group_backends: Vec<String>,
    next_pid: u32,
    /// The next probe waits for this to open, then fails (see [`FakeEngines::hold_next_probe`]).
    held_probe: Option<watch::Receiver<bool>>,
    /// The next `/model_info` calls to hold: each reads what the engine serves when asked,
    /// waits for the gate, then answers that (see [`FakeEngines::hold_model_info`]).
    held_info: Option<(usize, watch::Receiver<bool>, watch::Sender<usize>)>,
}

/// Engines that do what a test tells them.
#[derive(Default)]
pub struct FakeEngines {
    state: Arc<Mutex<State>>,
    /// Fires when a held probe starts waiting.
    probe_held: Arc<tokio::sync::Notify>,
    /// The fake processes' supervisors (one per launch, ending when the process ends).
    tasks: TaskTracker,
}

impl FakeEngines {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    /// The next launch of `engine_id` fails.
    pub fn fail_launch(&self, engine_id: &str) {
        self.state().fail_launch.insert(engine_id.to_string());
    }

    /// Whether the engine at `url` answers probes.
    pub fn set_down(&self, url: &str, down: bool) {
        let mut s = self.state();
        if down {
            s.down.insert(url.to_string());
        } else {
            s.down.remove(url);
        }
    }

    /// The engine at `url` refuses every weight load.
    pub fn refuse_loads(&self, url: &str) {
        self.state().refuse_loads.insert(url.to_string());
    }

    /// The process of `engine_id` exits on its own with code 1.
    pub fn crash(&self, engine_id: &str) {
        if let Some(exit) = self.state().running.remove(engine_id) {
            exit.send_replace(Some(ExitInfo { code: Some(1), signal: None, requested: false }));
        }
    }

    /// The next probe waits until the returned sender sends `true`, then fails; the
    /// `Notify` fires once it is waiting.
    pub fn hold_next_probe(&self) -> (watch::Sender<bool>, Arc<tokio::sync::Notify>) {
        let (open, gate) = watch::channel(false);
        self.state().held_probe = Some(gate);
        (open, self.probe_held.clone())
    }

    /// The next `count` `/model_info` calls read what the engine serves at once but answer
    /// only when the returned gate sends `true`: a reading that arrives late. The receiver
    /// counts the calls held so far.
    pub fn hold_model_info(&self, count: usize) -> (watch::Sender<bool>, watch::Receiver<usize>) {
        let (open, gate) = watch::channel(false);
        let (held, holding) = watch::channel(0);
        self.state().held_info = Some((count, gate, held));
        (open, holding)
    }

    pub fn calls(&self) -> Vec<String> {
        self.state().calls.clone()
    }

    /// The `backend` each `/init_weights_update_group` call named, in order.
    pub fn group_backends(&self) -> Vec<String> {
        self.state().group_backends.clone()
    }

    /// Engines whose process runs.
    pub fn running(&self) -> usize {
        self.state().running.len()
    }

    fn record(&self, call: String) {
        self.state().calls.push(call);
    }
}

fn arg_after<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).map(String::as_str)
}

impl EngineHost for FakeEngines {
    fn launch<'a>(
        &'a self,
        engine_id: &'a str,
        spec: &'a LaunchSpec,
        at: &'a Location,
    ) -> BoxFuture<'a, Result<Hosted, HostError>> {
        Box::pin(async move {
            self.record(format!("launch {engine_id}"));
            let Location::Local { url, .. } = at else {
                return Err(HostError::NoPid { program: spec.program.clone() });
            };
            let mut s = self.state();
            if s.fail_launch.remove(engine_id) {
                return Err(HostError::Spawn {
                    program: spec.program.clone(),
                    source: std::io::Error::other("refused"),
                });
            }
            s.next_pid += 1;
            let pid = 10_000 + s.next_pid;
            let version = arg_after(&spec.args, "--weight-version").unwrap_or_default().to_string();
            if let Some(seed) = arg_after(&spec.args, "--remote-instance-weight-loader-seed-instance-service-port") {
                s.calls.push(format!("copy {engine_id} from port {seed}"));
            }
            s.serving.insert(url.clone(), version);
            let (stop_tx, mut stop_rx) = mpsc::channel::<Duration>(1);
            let (exit_tx, exit_rx) = watch::channel(None);
            s.running.insert(engine_id.to_string(), exit_tx.clone());
            drop(s);
            // The supervisor: a stop request ends the process (requested); a crash ends it too.
            let (id, state) = (engine_id.to_string(), self.state.clone());
            self.tasks.spawn(async move {
                tokio::select! {
                    asked = stop_rx.recv() => if asked.is_some() {
                        let mut s = state.locked();
                        s.calls.push(format!("stop {id}"));
                        s.running.remove(&id);
                        exit_tx.send_replace(Some(ExitInfo { code: None, signal: Some(15), requested: true }));
                    },
                    () = exit_tx.closed() => {}
                }
            });
            Ok(Hosted {
                process: EngineProcess::from_parts(pid, None, stop_tx, exit_rx),
                url: url.clone(),
                keeper_socket: None,
                log_path: None,
            })
        })
    }

    fn status<'a>(
        &'a self,
        _engine_id: &'a str,
        _at: &'a Location,
        _pid: Option<u32>,
        _start_ticks: Option<u64>,
    ) -> BoxFuture<'a, Option<EngineProcess>> {
        Box::pin(async { None })
    }
}

impl EngineApi for FakeEngines {
    fn probe<'a>(&'a self, url: &'a str, endpoint: &'a str, _timeout: Duration) -> BoxFuture<'a, Option<String>> {
        Box::pin(async move {
            let held = self.state().held_probe.take();
            if let Some(mut gate) = held {
                self.probe_held.notify_one();
                let _ = gate.wait_for(|open| *open).await;
                return Some(format!("{endpoint}: held, then failed"));
            }
            let s = self.state();
            let alive = s.serving.contains_key(url) && !s.down.contains(url);
            (!alive).then(|| format!("{endpoint}: connection refused"))
        })
    }

    fn model_info<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<serde_json::Value, EngineError>> {
        Box::pin(async move {
            let (answer, gate) = {
                let mut s = self.state();
                let answer = match s.serving.get(url).filter(|_| !s.down.contains(url)) {
                    Some(v) => Ok(serde_json::json!({"model_path": MODEL, "weight_version": v})),
                    None => Err(EngineError::Unreachable { path: "/model_info", detail: "connection refused".into() }),
                };
                let gate = match s.held_info.as_mut() {
                    Some((left, gate, held)) if *left > 0 => {
                        *left -= 1;
                        held.send_modify(|n| *n += 1);
                        Some(gate.clone())
                    }
                    _ => None,
                };
                (answer, gate)
            };
            if let Some(mut gate) = gate {
                let _ = gate.wait_for(|open| *open).await;
            }
            answer
        })
    }

    fn load_from_disk<'a>(&'a self, url: &'a str, load: &'a DiskLoad) -> BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            self.record(format!("load {url} {}", load.version));
            let mut s = self.state();
            if s.refuse_loads.contains(url) {
                return Err(EngineError::WeightLoad { path: load.path.clone(), detail: "HTTP 400: refused".into() });
            }
            s.serving.insert(url.to_string(), load.version.clone());
            Ok(())
        })
    }

    fn control<'a>(
        &'a self,
        url: &'a str,
        path: &'static str,
        _body: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            self.record(format!("control {url}{path}"));
            Ok(())
        })
    }

    fn abort_all<'a>(&'a self, url: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move { self.record(format!("abort {url}")) })
    }

    fn weights_call<'a>(
        &'a self,
        url: &'a str,
        path: &'static str,
        body: serde_json::Value,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<bool, EngineError>> {
        Box::pin(async move {
            self.record(format!("weights {url}{path}"));
            let mut s = self.state();
            if !s.serving.contains_key(url) || s.down.contains(url) {
                return Err(EngineError::Unreachable { path, detail: "connection refused".into() });
            }
            if s.refuse_loads.contains(url) && path == "/update_weights_from_distributed" {
                // SGLang 0.5.23's answer when the broadcast never arrived (nothing loaded).
                let detail = "HTTP 400: Failed to receive weights: refused".into();
                return Err(EngineError::Refused { path, detail });
            }
            if path == "/init_weights_update_group" {
                let backend = body.get("backend").and_then(|b| b.as_str()).unwrap_or("(none)").to_string();
                s.group_backends.push(backend);
            }
            let told = match path {
                "/update_weights_from_distributed" => body.get("weight_version"),
                "/update_weight_version" => body.get("new_version"),
                _ => None,
            };
            if let Some(v) = told.and_then(|v| v.as_str()) {
                s.serving.insert(url.to_string(), v.to_string());
            }
            Ok(true)
        })
    }
}

/// A manager on `engines` with `gpus` GPUs, one per engine, and `flags` on top (as on the
/// command line). No store, no ports served.
pub fn manager(engines: &Arc<FakeEngines>, gpus: u32, flags: &[&str]) -> Arc<Manager> {
    let mut config = config(gpus, flags);
    config.state_dir = std::env::temp_dir().join(format!("rollout-unit-{}", uuid::Uuid::new_v4()));
    build(engines, config, None)
}

/// A manager with its registry in a store under `state_dir`, as with `--state-dir`: a fresh
/// store starts empty; one a previous manager left is restored from, as the server does at
/// start-up ([`crate::ops::restore::restore`]).
pub async fn manager_on_store(engines: &Arc<FakeEngines>, gpus: u32, flags: &[&str], state_dir: &Path) -> Arc<Manager> {
    let mut config = config(gpus, flags);
    config.state_dir = state_dir.to_path_buf();
    let store = crate::registry::store::Store::open(state_dir).expect("the store opens");
    let snapshot = store.load().expect("the store reads");
    let m = build(engines, config, Some(store));
    if !snapshot.is_empty() {
        crate::ops::restore::restore(&m, snapshot).await;
    }
    m
}

/// A runtime of its own for one life of a manager; dropping it ends every task the manager had
/// and lets go of the manager and its store.
pub fn one_life() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime")
}

/// What a `kill -9` of the manager leaves in its `--state-dir` right now: a copy of the store
/// (every registry change is durable once its update returns), in `into`. Unlike ending the
/// manager's runtime, no destructor or shutdown path gets to write anything more.
pub fn crash_copy(state_dir: &Path, into: &Path) {
    std::fs::copy(state_dir.join("fleet.redb"), into.join("fleet.redb")).expect("the store copies");
}

fn config(gpus: u32, flags: &[&str]) -> ServeConfig {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeConfig,
    }
    let gpus = format!("--gpus={gpus}");
    let mut argv = vec!["rollout-manager", "--model-path", MODEL, gpus.as_str(), "--rollout-num-gpus=0"];
    argv.extend_from_slice(flags);
    Cli::try_parse_from(argv).expect("test flags parse").serve
}

fn build(
    engines: &Arc<FakeEngines>,
    config: ServeConfig,
    store: Option<crate::registry::store::Store>,
) -> Arc<Manager> {
    let launcher = EngineLauncher::resolve(EngineKind::Sim, Some(Path::new("/bin/true"))).expect("/bin/true runs");
    let seams: (Arc<dyn EngineApi>, Arc<dyn EngineHost>) = (engines.clone(), engines.clone());
    Manager::with_seams(config, launcher, store, None, None, Some(seams)).expect("the manager builds")
}

/// Waits (up to 10 s, on the registry's change signal) until `done` holds for the registry.
/// `done` runs under the registry lock: it must not lock the registry again.
pub async fn wait_for(manager: &Manager, what: &str, done: impl Fn(&FleetInner) -> bool) {
    let mut changes = manager.fleet.subscribe();
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if done(&manager.fleet.lock()) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting for {what}; fleet: {:?}", manager.fleet.engine_records());
}
