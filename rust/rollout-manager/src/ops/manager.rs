//! The manager: configuration, the fleet registry, and the effects that move engines through
//! their lifecycle (launch, readiness, weight check, activation, stop).
//!
//! Scale operations ([`crate::ops::scaling`]) compose these steps; the health monitor
//! ([`crate::ops::health`]) watches what they produced.
//!
//! Processes are started through an [`EngineHost`]: the local one, or in Ray mode
//! (`--placement ray`) the node agent bound to the engine's placement. In Ray mode an engine is
//! reserved in PENDING with a placement in PENDING_RESOURCES; its launch waits until the shim
//! binds an agent (PENDING -> CREATING), and its removal marks the placement desired absent.

use crate::adapters::engine_host::{AgentHost, EngineHost, LocalHost, Location};
use crate::adapters::launch::{free_port, EngineLauncher};
use crate::adapters::weights::transport::Node;
use crate::foundation::clock::unix_now;
use crate::foundation::host::{EngineProcess, ExitInfo};
use crate::foundation::records::EngineRecord;
use crate::registry::fleet::{Fleet, Held};
use rollout_core::{EngineEvent, EngineOrigin, EngineStatus, Placement, PlacementMode, ServeConfig};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub struct Manager {
    pub config: ServeConfig,
    pub fleet: Arc<Fleet>,
    pub launcher: EngineLauncher,
    /// Client for HTTP calls that are not engine calls (the external router's API).
    pub http: reqwest::Client,
    /// The control calls to engines: probes, `/model_info`, weight loads, pause, abort.
    pub engine_api: Arc<dyn crate::adapters::engine_api::EngineApi>,
    /// Which name of a renamed SGLang route each engine serves (`/v1/loads` or `/get_load`).
    pub routes: Arc<crate::adapters::dialect::EngineRoutes>,
    /// Every background task the manager starts, joined at shutdown.
    pub tasks: TaskTracker,
    /// Cancelled when the manager shuts down.
    pub shutdown: CancellationToken,
    /// The external router engines are registered with (`--router smg=URL`), if any.
    pub external_router: Option<Arc<dyn ExternalRouter>>,
    /// How published weight versions reach the engines (`--weight-transport`).
    pub transport: Arc<dyn crate::adapters::weights::transport::WeightTransport>,
    /// Engines on this machine (`--placement local`).
    pub local: Arc<dyn EngineHost>,
    /// Engines on node agents (`--placement ray`).
    pub agents: AgentHost,
}

/// Seeds a starting engine tries before its launch counts as failed ([`Manager::launch_healthy`]).
pub const SEED_ATTEMPTS: usize = 3;

/// Lines of an engine's log kept on its record when the manager gives up restarting it.
const LOG_TAIL_LINES: usize = 20;

/// What an engine shows while its placement waits for an agent.
pub const PENDING_DETAIL: &str = "PENDING_RESOURCES: waiting for the Ray shim to place the engine and bind its agent";

use crate::adapters::engine_api::EngineError;

/// A router outside the manager that engines are registered with (smg): told which engines
/// to stop sending work to before they drain or stop.
pub trait ExternalRouter: Send + Sync {
    /// Unregisters these engine URLs now; errors are logged, never returned.
    fn forget<'a>(&'a self, urls: &'a [String]) -> futures::future::BoxFuture<'a, ()>;
}

impl Manager {
    pub fn new(
        config: ServeConfig,
        launcher: EngineLauncher,
        store: Option<crate::registry::store::Store>,
        token: Option<&str>,
        external_router: Option<Arc<dyn ExternalRouter>>,
    ) -> Result<Arc<Self>, reqwest::Error> {
        Self::with_seams(config, launcher, store, token, external_router, None)
    }

    /// [`Manager::new`] with the engines' control calls and the local host given instead of
    /// the HTTP and process ones (unit tests of the use cases put fakes here).
    pub fn with_seams(
        config: ServeConfig,
        launcher: EngineLauncher,
        store: Option<crate::registry::store::Store>,
        token: Option<&str>,
        external_router: Option<Arc<dyn ExternalRouter>>,
        seams: Option<(Arc<dyn crate::adapters::engine_api::EngineApi>, Arc<dyn EngineHost>)>,
    ) -> Result<Arc<Self>, reqwest::Error> {
        // Redirects are not followed: an engine (external ones are run by someone else) must
        // not be able to point the manager's probes at another address.
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .pool_idle_timeout(Duration::from_secs(30))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let fleet = Arc::new(Fleet::new(
            config.gpus,
            config.weight_version.clone(),
            config.restart_failed_engines,
            store,
            config.queue_order,
            config.max_inflight_per_engine.enabled(),
        ));
        let (tasks, shutdown) = (TaskTracker::new(), CancellationToken::new());
        let routes = Arc::new(crate::adapters::dialect::EngineRoutes::new());
        let (engine_api, local) = seams.unwrap_or_else(|| {
            let local = LocalHost { reattach_grace: Duration::from_secs_f64(config.reattach_grace_secs.max(0.0)) };
            (Arc::new(crate::adapters::engine_api::HttpEngineApi::new(http.clone(), routes.clone())), Arc::new(local))
        });
        let agents = AgentHost::new(shutdown.clone(), tasks.clone(), token);
        let transport: Arc<dyn crate::adapters::weights::transport::WeightTransport> = match config.weight_transport {
            rollout_core::WeightTransportKind::Disk => Arc::new(crate::adapters::weights::transport::Disk),
            rollout_core::WeightTransportKind::Relay => Arc::new(crate::adapters::weights::transport::Relay::new(
                config.relay_dir.clone(),
                token.map(crate::adapters::weights::transport::relay_token),
                Some(Arc::new(agents.clone())),
            )),
        };
        Ok(Arc::new(Self {
            config,
            fleet,
            launcher,
            engine_api,
            routes,
            http,
            tasks,
            shutdown,
            external_router,
            transport,
            local,
            agents,
        }))
    }

    /// Whether engines run on node agents placed by Ray.
    pub fn ray(&self) -> bool {
        self.config.placement == PlacementMode::Ray
    }

    /// The host of this fleet's managed engines.
    pub fn host(&self) -> &dyn EngineHost {
        if self.ray() {
            &self.agents
        } else {
            self.local.as_ref()
        }
    }

    /// Where `engine_id` loads weights: its agent's node in Ray mode, else this machine
    /// (external engines included: they are given the manager's path).
    pub fn weight_node(&self, engine_id: &str) -> Result<Node, EngineError> {
        let inner = self.fleet.lock();
        let external = inner.engines.get(engine_id).is_some_and(|e| e.record.origin == EngineOrigin::External);
        if !self.ray() || external {
            return Ok(Node::Local);
        }
        match inner.placements.get(engine_id).and_then(|p| p.agent.as_ref()) {
            Some(agent) => Ok(Node::Agent(agent.url.clone())),
            None => Err(EngineError::Launch(format!("{engine_id} has no agent bound to its placement"))),
        }
    }

    /// Every node that hosts an engine now, for staging a published version: this machine in
    /// local mode (or when external engines exist), and in Ray mode the agent of every wanted
    /// placement whose engine is not FAILED (a failed engine's agent may be gone; it gets the
    /// version when the engine starts again). Nodes added later get it when an engine loads it.
    pub fn weight_nodes(&self) -> Vec<Node> {
        let inner = self.fleet.lock();
        let mut nodes = Vec::new();
        let external = inner.engines.values().any(|e| e.record.origin == EngineOrigin::External);
        if !self.ray() || external {
            nodes.push(Node::Local);
        }
        if self.ray() {
            for (engine_id, p) in &inner.placements {
                let failed = inner.engines.get(engine_id).is_none_or(|e| e.record.status == EngineStatus::Failed);
                let Some(agent) = p.agent.as_ref().filter(|_| p.desired == rollout_core::Desired::Present) else {
                    continue;
                };
                let node = Node::Agent(agent.url.clone());
                if !failed && !nodes.contains(&node) {
                    nodes.push(node);
                }
            }
        }
        nodes
    }

    /// The path an engine on `node` loads `version` from (staged there first if the node lacks
    /// it); `staged` is the path recorded for the version.
    pub async fn weights_path_on(
        &self,
        node: &Node,
        version: &rollout_core::weights::WeightVersion,
        staged: &str,
    ) -> Result<String, EngineError> {
        self.transport
            .path_on(version, staged, node)
            .await
            .map_err(|e| EngineError::WeightLoad { path: staged.to_string(), detail: e.to_string() })
    }

    /// [`Manager::weights_path_on`] the node of `engine_id`.
    pub async fn weights_path_for(
        &self,
        engine_id: &str,
        version: &rollout_core::weights::WeightVersion,
        staged: &str,
    ) -> Result<String, EngineError> {
        let node = self.weight_node(engine_id)?;
        self.weights_path_on(&node, version, staged).await
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs_f64(self.config.scale_in_shutdown_timeout)
    }

    /// Registers a new managed engine in CREATING, with GPUs and a port reserved.
    /// Nothing is started yet; the caller launches it with [`Manager::launch`].
    pub fn reserve_engine(
        &self,
        inner: &mut crate::registry::fleet::FleetInner,
        origin: EngineOrigin,
        created_by: &str,
    ) -> Result<String, String> {
        let per_engine = self.config.rollout_num_gpus_per_engine;
        if self.ray() {
            // Ray finds the GPUs; the engine waits in PENDING until an agent is bound.
            let id = self.register(inner, EngineStatus::Pending, String::new(), origin, Held::default(), created_by);
            if let Some(e) = inner.engines.get_mut(&id) {
                e.record.detail = Some(PENDING_DETAIL.into());
            }
            inner.placements.insert(id.clone(), Placement::plan(&id, per_engine, origin == EngineOrigin::Initial));
            inner.placements_changed();
            return Ok(id);
        }
        let host = &self.config.engine_host;
        let held =
            inner.reserve_local(per_engine, |taken| free_port(host, taken)).map_err(|e| format!("{e} on {host}"))?;
        let url = held.port.map(|port| format!("http://{}:{port}", url_host(host))).unwrap_or_default();
        Ok(self.register(inner, EngineStatus::Creating, url, origin, held, created_by))
    }

    /// Registers an external engine (started by someone else) in CREATING. Nothing is contacted
    /// yet; [`Manager::connect`] does that.
    pub fn reserve_external(
        &self,
        inner: &mut crate::registry::fleet::FleetInner,
        url: &str,
        created_by: &str,
    ) -> String {
        self.register(
            inner,
            EngineStatus::Creating,
            url.to_string(),
            EngineOrigin::External,
            Held::default(),
            created_by,
        )
    }

    /// Adds a new engine record under the next id, in its first state (CREATING, or PENDING
    /// while Ray places it).
    fn register(
        &self,
        inner: &mut crate::registry::fleet::FleetInner,
        status: EngineStatus,
        url: String,
        origin: EngineOrigin,
        held: Held,
        created_by: &str,
    ) -> String {
        debug_assert!(matches!(status, EngineStatus::Creating | EngineStatus::Pending));
        let now = unix_now();
        let logs = (origin != EngineOrigin::External).then(|| self.config.state_dir.join("logs"));
        let gpu_ids = held.gpus.clone();
        inner.add_engine(held, |new| EngineRecord {
            engine_id: new.engine_id.clone(),
            url,
            status,
            is_healthy: false,
            origin,
            model_name: self.config.model_name.clone(),
            weight_version: None,
            weights_checksum: None,
            gpu_ids,
            pid: None,
            started_at: now,
            updated_at: now,
            log_path: logs.map(|dir| dir.join(format!("{}.log", new.engine_id))),
            in_flight: 0,
            last_error: None,
            created_by: Some(created_by.to_string()),
            restarts: 0,
            detail: None,
            log_tail: None,
        })
    }

    /// Connects to an external engine: its `/model_info` must answer and name the fleet's model
    /// (the startup `--model-path` or a checkpoint the fleet published). Moves it to
    /// HEALTH_CHECKING.
    pub async fn connect(&self, engine_id: &str) -> Result<(), EngineError> {
        let info = self.model_info(engine_id).await?;
        let (model, _) = crate::foundation::engine_http::model_info_fields(&info);
        if !self.fleet.lock().weights.is_fleet_model(&self.config.model_path, model) {
            let found = crate::foundation::engine_http::shorten(model);
            return Err(EngineError::WrongModel { expected: self.config.model_path.clone(), found });
        }
        self.fleet
            .update(|inner| inner.engine_event(engine_id, EngineEvent::Launched))
            .map_err(|e| EngineError::Launch(e.to_string()))?;
        Ok(())
    }

    /// Starts the process of a reserved engine and moves it to HEALTH_CHECKING.
    ///
    /// Cancel-safe: the work runs in its own task, so a caller that stops waiting (a cancelled
    /// scale-out) cannot leave a started process unregistered; a process whose engine left the
    /// fleet meanwhile is stopped.
    pub async fn launch(self: &Arc<Self>, engine_id: &str) -> Result<(), EngineError> {
        self.launch_avoiding(engine_id, &[]).await.map(|_| ())
    }

    /// [`Manager::launch`] not copying from the seeds in `tried`; answers the seed it copies
    /// from, if any.
    async fn launch_avoiding(
        self: &Arc<Self>,
        engine_id: &str,
        tried: &[String],
    ) -> Result<Option<String>, EngineError> {
        let m = self.clone();
        let id = engine_id.to_string();
        let tried = tried.to_vec();
        self.tasks
            .spawn(async move { m.launch_now(&id, tried).await })
            .await
            .unwrap_or_else(|e| Err(EngineError::Launch(format!("launch task failed: {e}"))))
    }

    async fn launch_now(
        self: &Arc<Self>,
        engine_id: &str,
        mut tried: Vec<String>,
    ) -> Result<Option<String>, EngineError> {
        let seed = self.usable_seed(engine_id, &mut tried).await;
        let copying = seed.as_ref().map(|s| s.engine_id.clone());
        let hosted = self.start_process(engine_id, seed).await?;
        self.register_process(engine_id, hosted, Some(EngineEvent::Launched))?;
        Ok(copying)
    }

    /// Launches a reserved engine and waits until it is healthy. An engine that copies the
    /// fleet's version from a seed and exits before it is healthy (the seed died or refused
    /// mid-copy: SGLang's loader then fails the start) is started again copying from another
    /// seed, up to [`SEED_ATTEMPTS`] seeds; any other failure is returned as it is.
    pub async fn launch_healthy(
        self: &Arc<Self>,
        engine_id: &str,
        cancel: &CancellationToken,
    ) -> Result<(), EngineError> {
        let mut tried: Vec<String> = Vec::new();
        loop {
            let seed = self.launch_avoiding(engine_id, &tried).await?;
            let healthy = self.wait_healthy(engine_id, cancel).await;
            if healthy.is_ok() && !tried.is_empty() {
                self.fleet.update(|inner| {
                    if let Some(e) = inner.engines.get_mut(engine_id) {
                        e.record.detail = None;
                    }
                });
            }
            let (Err(EngineError::Exited(why)), Some(seed)) = (&healthy, seed) else { return healthy };
            tried.push(seed.clone());
            if tried.len() >= SEED_ATTEMPTS {
                return healthy;
            }
            let again = self.fleet.update(|inner| {
                if inner.engine_event(engine_id, EngineEvent::Restart).is_err() {
                    return false;
                }
                if !self.ray() {
                    self.move_to_fresh_port(inner, engine_id);
                }
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.record.pid = None;
                    e.record.detail = Some(format!("the copy from {seed} failed ({why}); copying from another seed"));
                }
                true
            });
            if !again {
                return healthy;
            }
            tracing::warn!(engine_id, seed = %seed, error = %why, "copy from the seed failed at startup; starting again from another seed");
        }
    }

    /// What a starting engine loads: the newest version (an update's target, else the current
    /// one) from its checkpoint, staged on the engine's node first when the node does not hold
    /// it; a version the trainer broadcast (no checkpoint) from `seed`, an engine that serves
    /// it; without a seed, the startup `--model-path` under the startup `--weight-version`, so
    /// the engine never claims a version it does not hold (it catches up before it is routable,
    /// see [`Manager::sync_weights`]). Returns the model path, the weight version, and the
    /// seed's flags.
    async fn launch_weights(
        &self,
        node: Node,
        seed: Option<&crate::adapters::launch::Seed>,
    ) -> Result<(String, String, Vec<String>), EngineError> {
        let (version, engine_path, from_trainer) = {
            let inner = self.fleet.lock();
            let (version, path) = inner.weights.desired();
            (version, path, inner.weights.desired_from_trainer())
        };
        Ok(match (engine_path, from_trainer, seed) {
            (Some(p), _, _) => (self.weights_path_on(&node, &version, &p).await?, version.version, Vec::new()),
            (None, true, Some(seed)) => (self.config.model_path.clone(), version.version, seed.args()),
            (None, true, None) => (self.config.model_path.clone(), self.config.weight_version.clone(), Vec::new()),
            (None, false, _) => (self.config.model_path.clone(), version.version, Vec::new()),
        })
    }

    /// Starts the engine's process (see [`Manager::launch_weights`] for what it loads).
    async fn start_process(
        self: &Arc<Self>,
        engine_id: &str,
        seed: Option<crate::adapters::launch::Seed>,
    ) -> Result<crate::adapters::engine_host::Hosted, EngineError> {
        let (spec, at) = if self.ray() {
            let binding = self.wait_bound(engine_id).await?;
            let (model_path, weight_version, seed_args) =
                self.launch_weights(Node::Agent(binding.url.clone()), seed.as_ref()).await?;
            let log_path = self.config.state_dir.join("logs").join(format!("{engine_id}.log"));
            let mut spec =
                self.launcher.spec_on_agent(&self.config, &model_path, &binding.gpu_ids, &weight_version, log_path);
            spec.args.extend(seed_args);
            (spec, Location::Agent { agent_url: binding.url })
        } else {
            let (model_path, weight_version, seed_args) = self.launch_weights(Node::Local, seed.as_ref()).await?;
            let (port, gpu_ids, log_path, url) = {
                let inner = self.fleet.lock();
                let e =
                    inner.engines.get(engine_id).ok_or_else(|| EngineError::Launch(format!("{engine_id} vanished")))?;
                let port = rollout_core::EngineAddr::port_of(&e.record.url).unwrap_or(0);
                (port, e.record.gpu_ids.clone(), e.record.log_path.clone().unwrap_or_default(), e.record.url.clone())
            };
            let mut spec = self.launcher.spec(&self.config, &model_path, port, &gpu_ids, &weight_version, log_path);
            spec.args.extend(seed_args);
            let keeper_socket = if self.config.reattach_grace_secs > 0.0 {
                Some(
                    keeper_socket_path(&self.config.state_dir, engine_id)
                        .map_err(|e| EngineError::Launch(e.to_string()))?,
                )
            } else {
                None
            };
            (spec, Location::Local { url, keeper_socket })
        };
        let args = crate::adapters::launch::redacted(&spec.args);
        tracing::info!(engine_id, program = %spec.program.display(), ?args, at = ?at, "launching engine");
        self.host().launch(engine_id, &spec, &at).await.map_err(|e| EngineError::Launch(e.to_string()))
    }

    /// Records a started process on its engine, moved by `event` (None: the engine keeps its
    /// state, as for a restart in place), and watches it. A process whose engine left the
    /// fleet meanwhile is stopped.
    fn register_process(
        self: &Arc<Self>,
        engine_id: &str,
        hosted: crate::adapters::engine_host::Hosted,
        event: Option<EngineEvent>,
    ) -> Result<(), EngineError> {
        let (process, keeper_socket) = (hosted.process, hosted.keeper_socket);
        let pid = process.pid;
        let registered = self.fleet.update(|inner| {
            // The engine may have been removed (scale-in, cancel) while we were forking.
            let moved = match event {
                Some(event) => inner.engine_event(engine_id, event).map(|_| ()),
                None => match inner.engines.get(engine_id).map(|e| e.record.status) {
                    Some(EngineStatus::WeightSyncing) => Ok(()),
                    other => Err(rollout_core::IllegalTransition {
                        machine: "engine",
                        state: format!("{other:?}"),
                        event: "restart in place".into(),
                    }),
                },
            };
            if moved.is_ok() {
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.record.pid = Some(pid);
                    e.pid_start_ticks = process.start_ticks;
                    e.process = Some(process.clone());
                    e.keeper_socket = keeper_socket.clone();
                    e.record.url = hosted.url.clone();
                    if hosted.log_path.is_some() {
                        e.record.log_path = hosted.log_path.clone();
                    }
                }
            }
            moved
        });
        if let Err(e) = registered {
            let grace = self.shutdown_grace();
            let orphan = process.clone();
            self.tasks.spawn(async move { orphan.stop(grace).await });
            return Err(EngineError::Launch(format!("engine left the fleet while starting ({e})")));
        }
        self.watch_exit(engine_id.to_string(), process);
        Ok(())
    }

    /// Ray mode: waits until the engine's placement has an agent (the engine is then past
    /// PENDING), and returns the binding. Fails when the engine leaves the fleet or its placement
    /// is no longer wanted, and on shutdown.
    async fn wait_bound(&self, engine_id: &str) -> Result<rollout_core::AgentBinding, EngineError> {
        let mut changes = self.fleet.subscribe();
        loop {
            let (bound, detail_stale) = {
                let inner = self.fleet.lock();
                let Some(engine) = inner.engines.get(engine_id) else {
                    return Err(EngineError::Launch(format!("{engine_id} left the fleet before an agent was bound")));
                };
                let placement = inner.placements.get(engine_id).filter(|p| p.desired == rollout_core::Desired::Present);
                let Some(placement) = placement else {
                    return Err(EngineError::Launch(format!("the placement of {engine_id} is no longer wanted")));
                };
                let binding = placement.agent.clone();
                let detail = binding.is_none().then(|| PENDING_DETAIL.to_string());
                (binding, (engine.record.detail != detail).then_some(detail))
            };
            if let Some(detail) = detail_stale {
                // Shown while waiting (after a restart of the manager, for instance).
                self.fleet.update(|inner| {
                    if let Some(e) = inner.engines.get_mut(engine_id) {
                        e.record.detail = detail;
                    }
                });
            }
            if let Some(binding) = bound {
                return Ok(binding);
            }
            tokio::select! {
                r = changes.changed() => if r.is_err() { return Err(EngineError::Cancelled) },
                () = self.shutdown.cancelled() => return Err(EngineError::Cancelled),
            }
        }
    }

    /// Marks the engine FAILED when its process exits without being asked to, and schedules
    /// its recovery if it had been serving.
    pub fn watch_exit(self: &Arc<Self>, engine_id: String, process: EngineProcess) {
        let manager = self.clone();
        self.tasks.spawn(async move {
            let info = process.wait().await;
            if info.requested {
                return;
            }
            tracing::warn!(engine_id, exit = %info, "engine process exited unexpectedly");
            let was = manager.fleet.update(|inner| {
                let was = inner.engines.get(&engine_id).map(|e| e.record.status);
                // Ray mode: a placement unbound by an agent loss already says why (the loss).
                let lost = inner.placements.get(&engine_id).is_some_and(|p| p.agent.is_none());
                if let Some(e) = inner.engines.get_mut(&engine_id) {
                    if !lost {
                        e.record.last_error = Some(format!("process {info}"));
                    }
                    e.process = None;
                }
                // Fails only from live states; an engine being removed is expected to exit.
                inner.fail_engine(&engine_id, None);
                was
            });
            // Engines still being created are the scale-out's to handle; removed ones stay gone.
            if matches!(was, Some(EngineStatus::Active | EngineStatus::Unhealthy))
                && manager.config.restart_failed_engines
            {
                let m = manager.clone();
                manager.tasks.spawn(async move { m.recover(&engine_id, Duration::from_secs(1)).await });
            }
        });
    }

    /// Restarts a FAILED managed engine on its GPUs with the fleet's current weights, retrying
    /// with exponential backoff (1 s doubling to 60 s) until it is ACTIVE again, it is removed
    /// on purpose, or the manager shuts down.
    pub async fn recover(self: &Arc<Self>, engine_id: &str, first_delay: Duration) {
        let mut delay = first_delay;
        loop {
            // The restart budget decides the wait (backoff within a crash loop) or gives up.
            let Some(wait) = self.restart_wait(engine_id) else { return };
            tokio::select! {
                _ = tokio::time::sleep(delay.max(wait)) => {}
                _ = self.shutdown.cancelled() => return,
            }
            delay = Duration::ZERO;
            let restarted = self.fleet.update(|inner| {
                let origin = inner.engines.get(engine_id).map(|e| e.record.origin);
                if origin == Some(EngineOrigin::External) {
                    return false;
                }
                if inner.engines.get(engine_id).is_none_or(|e| e.record.status != EngineStatus::Failed) {
                    return false; // removed, or no longer FAILED
                }
                let budget = self.restart_budget();
                let Some(e) = inner.engines.get_mut(engine_id) else { return false };
                match rollout_core::health::restart_decision(e.crash_streak, e.stayed_up_secs, budget) {
                    rollout_core::health::RestartDecision::After { streak, .. } => {
                        e.crash_streak = streak;
                        e.stayed_up_secs = None;
                    }
                    rollout_core::health::RestartDecision::GiveUp { .. } => return false,
                }
                if inner.engine_event(engine_id, EngineEvent::Restart).is_err() {
                    return false;
                }
                if self.ray() {
                    // The agent picks the port; the placement keeps its agent.
                    if let Some(e) = inner.engines.get_mut(engine_id) {
                        e.record.restarts += 1;
                        e.record.pid = None;
                        e.probe_failures = 0;
                    }
                    return true;
                }
                self.move_to_fresh_port(inner, engine_id);
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.record.restarts += 1;
                    e.record.pid = None;
                    e.probe_failures = 0;
                }
                true
            });
            if !restarted {
                return;
            }
            tracing::info!(engine_id, "restarting failed engine");
            let result = async {
                self.launch_healthy(engine_id, &self.shutdown).await?;
                self.fleet
                    .update(|inner| inner.engine_event(engine_id, EngineEvent::Healthy))
                    .map_err(|e| EngineError::Launch(e.to_string()))?;
                self.sync_weights(engine_id, &[EngineEvent::WeightsSynced, EngineEvent::Activated]).await?;
                Ok::<(), EngineError>(())
            }
            .await;
            match result {
                Ok(()) => {
                    tracing::info!(engine_id, "engine recovered");
                    return;
                }
                Err(e) => {
                    let process = self.fleet.update(|inner| {
                        inner.fail_engine(engine_id, Some(format!("recovery failed: {e}")));
                        inner.engines.get(engine_id).and_then(|en| en.process.clone())
                    });
                    if let Some(p) = process {
                        p.stop(self.shutdown_grace()).await;
                    }
                    // Ray mode: never back off against a dead agent, nor count it against the
                    // engine's restart budget. Its placement goes back to PENDING_RESOURCES and
                    // the next attempt waits for the shim's new agent.
                    if let Some(url) = self.bound_agent(engine_id) {
                        if !self.agents.is_live(&url).await
                            && !self.agent_lost(&url, Some(engine_id), "unreachable while recovering").is_empty()
                        {
                            self.fleet.update(|inner| {
                                if let Some(e) = inner.engines.get_mut(engine_id) {
                                    e.crash_streak = e.crash_streak.saturating_sub(1);
                                }
                            });
                        }
                    }
                    tracing::warn!(engine_id, error = %e, "engine recovery failed; will retry within its restart budget");
                }
            }
        }
    }

    fn restart_budget(&self) -> rollout_core::health::RestartBudget {
        rollout_core::health::RestartBudget {
            max_restarts: self.config.restart_budget,
            window_secs: self.config.restart_window_secs,
        }
    }

    /// How long to wait before the next restart of the FAILED engine `engine_id` (its backoff
    /// within a crash loop), or None when there is nothing to restart: the engine is gone, no
    /// longer FAILED, or its restart budget is spent. Then it stays FAILED, its `detail` says
    /// why and its record keeps the last lines of its log.
    fn restart_wait(&self, engine_id: &str) -> Option<Duration> {
        let budget = self.restart_budget();
        let (decision, log_path) = {
            let inner = self.fleet.lock();
            let e = inner.engines.get(engine_id).filter(|e| e.record.status == EngineStatus::Failed)?;
            (
                rollout_core::health::restart_decision(e.crash_streak, e.stayed_up_secs, budget),
                e.record.log_path.clone().filter(|_| !self.ray()),
            )
        };
        let restarts = match decision {
            rollout_core::health::RestartDecision::After { secs, .. } => return Some(Duration::from_secs_f64(secs)),
            rollout_core::health::RestartDecision::GiveUp { restarts } => restarts,
        };
        let tail = log_path.map(|p| crate::adapters::launch::log_tail(&p, LOG_TAIL_LINES));
        let gave_up = self.fleet.update(|inner| {
            let Some(e) = inner.engines.get_mut(engine_id).filter(|e| e.record.status == EngineStatus::Failed) else {
                return false;
            };
            let first = e.record.log_tail.is_none();
            e.record.detail = Some(format!(
                "crash loop: restarted {restarts} times in a row without serving for --restart-window-secs ({} s); \
                 the manager gave up (--restart-budget {}). Fix the cause (last_error, log_tail), then scale in to \
                 remove it (FAILED engines go first) and scale out again",
                budget.window_secs, budget.max_restarts
            ));
            e.record.log_tail = Some(tail.clone().unwrap_or_default());
            first
        });
        if gave_up {
            tracing::error!(engine_id, restarts, "engine crash-loops: restart budget spent, it stays FAILED");
        }
        None
    }

    /// A local engine about to start again moves to a free port (the old one may linger in
    /// TIME_WAIT or be taken); if none can be had it keeps the old one, and a launch that finds
    /// it taken fails and is retried.
    fn move_to_fresh_port(&self, inner: &mut crate::registry::fleet::FleetInner, engine_id: &str) {
        let host = &self.config.engine_host;
        if let Err(e) = inner.move_port(
            engine_id,
            |taken| free_port(host, taken),
            |port| format!("http://{}:{port}", url_host(host)),
        ) {
            tracing::warn!(engine_id, error = %e, "no new port for the restart; keeping the old one");
        }
    }

    /// Ray mode: the agent bound to the engine's placement.
    fn bound_agent(&self, engine_id: &str) -> Option<String> {
        let inner = self.fleet.lock();
        inner.placements.get(engine_id).and_then(|p| p.agent.as_ref()).map(|a| a.url.clone())
    }

    /// Ray mode: the agent at `agent_url` is gone (reported by the shim when its host actor or
    /// node died, or found refusing connections by the manager). Every placement bound to it
    /// (only `only`'s, if given) goes back to PENDING_RESOURCES so the shim places it again, and
    /// its engine is taken as exited: a serving engine is recovered on the fleet's current
    /// weights once a new agent is bound, one being created is left to its scale-out.
    /// Returns the engines unbound; a stale report (not bound to that agent) unbinds nothing.
    pub fn agent_lost(&self, agent_url: &str, only: Option<&str>, reason: &str) -> Vec<String> {
        let unbound = self.fleet.update(|inner| {
            let mut unbound = Vec::new();
            for (engine_id, placement) in inner.placements.iter_mut() {
                if only.is_some_and(|o| o != engine_id) {
                    continue;
                }
                if let rollout_core::LoseOutcome::Unbound { .. } = placement.lose(agent_url) {
                    unbound.push(engine_id.clone());
                }
            }
            for engine_id in &unbound {
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.record.last_error = Some(format!("agent {agent_url} lost: {reason}"));
                }
            }
            if !unbound.is_empty() {
                inner.placements_changed();
            }
            unbound
        });
        for engine_id in &unbound {
            tracing::warn!(engine_id, agent = %agent_url, reason, "agent lost; its placement waits for a new agent");
            // An unrequested exit, so a serving engine is recovered. Its process went with the
            // agent (agents stop their engines when their host actor dies).
            self.agents.forget(agent_url, engine_id);
        }
        unbound
    }

    /// Ray mode: unbinds the placements of every agent the connections find gone, until shutdown.
    pub fn spawn_agent_loss_watch(self: &Arc<Self>) {
        let (m, mut lost) = (self.clone(), self.agents.lost_agents());
        self.tasks.spawn(async move {
            loop {
                let (url, why) = tokio::select! {
                    r = lost.recv() => match r {
                        Ok(found) => found,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                            tracing::warn!(missed = n, "agent-loss notices dropped");
                            continue;
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    },
                    () = m.shutdown.cancelled() => return,
                };
                m.agent_lost(&url, None, &format!("the agent {why}"));
            }
        });
    }

    pub(crate) fn url_of(&self, engine_id: &str) -> Option<String> {
        self.fleet.lock().engines.get(engine_id).map(|e| e.record.url.clone())
    }

    /// Waits until the engine's `/health` answers 200, the engine fails (its process exits),
    /// the startup deadline passes, or `cancel` fires. Probes back off from 50 ms to 250 ms
    /// (readiness noticed late is time added to every scale-out); a change of the fleet (such as
    /// the process exiting) wakes the wait at once.
    pub async fn wait_healthy(&self, engine_id: &str, cancel: &CancellationToken) -> Result<(), EngineError> {
        let url = self.url_of(engine_id).ok_or(EngineError::Cancelled)?;
        let deadline = Duration::from_secs_f64(self.config.engine_startup_timeout);
        let mut changes = self.fleet.subscribe();
        let probe = async {
            let mut backoff = Duration::from_millis(50);
            loop {
                let failed = {
                    let inner = self.fleet.lock();
                    match inner.engines.get(engine_id) {
                        None => Some("the engine left the fleet".to_string()),
                        Some(e) if e.record.status == EngineStatus::Failed => {
                            Some(e.record.last_error.clone().unwrap_or_else(|| "failed".into()))
                        }
                        Some(_) => None,
                    }
                };
                if let Some(why) = failed {
                    return Err(EngineError::Exited(why));
                }
                if self.engine_api.probe(&url, "/health", Duration::from_secs(5)).await.is_none() {
                    return Ok(());
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = changes.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_millis(250));
            }
        };
        tokio::select! {
            r = tokio::time::timeout(deadline, probe) => r.map_err(|_| EngineError::StartupTimeout(deadline))?,
            _ = cancel.cancelled() => Err(EngineError::Cancelled),
        }
    }

    /// The engine's `/model_info`.
    async fn model_info(&self, engine_id: &str) -> Result<serde_json::Value, EngineError> {
        let url = self.url_of(engine_id).ok_or(EngineError::Cancelled)?;
        self.engine_api.model_info(&url).await
    }

    /// The weight version and checksum an engine reports in `/model_info` (the checksum is
    /// `sglang-sim`'s `weights_checksum`; real SGLang reports none).
    pub async fn served_weights(&self, engine_id: &str) -> Result<(Option<String>, Option<String>), EngineError> {
        let info = self.model_info(engine_id).await?;
        let text = |k: &str| info.get(k).and_then(|v| v.as_str()).map(String::from);
        Ok((text("weight_version"), text("weights_checksum")))
    }

    /// WEIGHT_SYNCING: makes sure the engine serves the version it must serve to be routable
    /// (the running update's target, else the fleet's current version), loading it with
    /// `/update_weights_from_disk` if it does not, then records the verified version and
    /// checksum and applies `events` in one registry update, against the target at that instant:
    /// if a publish moved the target meanwhile, the engine is synced again.
    pub async fn sync_weights(
        self: &Arc<Self>,
        engine_id: &str,
        events: &[EngineEvent],
    ) -> Result<String, EngineError> {
        self.sync_weights_inner(engine_id, events, false).await
    }

    /// [`Manager::sync_weights`] for an engine re-adopted after a restart while an update runs:
    /// an engine that serves the fleet's current version (the update's previous one) is taken
    /// back on it as it is, and the update's waves move it later, so a resumed `rolling`
    /// update keeps its waves instead of reloading every re-adopted engine at once.
    pub async fn sync_weights_keeping_current(
        self: &Arc<Self>,
        engine_id: &str,
        events: &[EngineEvent],
    ) -> Result<String, EngineError> {
        self.sync_weights_inner(engine_id, events, true).await
    }

    async fn sync_weights_inner(
        self: &Arc<Self>,
        engine_id: &str,
        events: &[EngineEvent],
        keep_current: bool,
    ) -> Result<String, EngineError> {
        let mut last = None;
        for _ in 0..5 {
            let (desired, engine_path, current, from_trainer) = {
                let inner = self.fleet.lock();
                let (desired, path) = inner.weights.desired();
                (desired, path, inner.weights.current.clone(), inner.weights.desired_from_trainer())
            };
            let (mut found, mut checksum) = self.served_weights(engine_id).await?;
            // The version this engine is recorded on: the desired one, or (re-adoption) the
            // current one when that is what it serves.
            let want = if keep_current
                && !desired.served_by(found.as_deref(), checksum.as_deref())
                && current.served_by(found.as_deref(), checksum.as_deref())
            {
                current.clone()
            } else {
                desired.clone()
            };
            if !want.served_by(found.as_deref(), checksum.as_deref()) {
                let Some(path) = engine_path else {
                    if from_trainer && want == desired {
                        // The trainer's version: copied from a peer (or from the trainer's
                        // next update), then checked again.
                        self.catch_up(engine_id, &want).await?;
                        last = Some(want.version);
                        continue;
                    }
                    // The startup version has no checkpoint to load: the engine must come with it.
                    return Err(EngineError::WrongVersion {
                        expected: want.version.clone(),
                        found: crate::foundation::engine_http::shorten(&found.unwrap_or_default()),
                    });
                };
                let url = self.url_of(engine_id).ok_or(EngineError::Cancelled)?;
                let path = self.weights_path_for(engine_id, &want, &path).await?;
                let load = crate::adapters::engine_api::DiskLoad {
                    path,
                    version: want.version.clone(),
                    abort_all: false,
                    timeout: Duration::from_secs_f64(self.config.weight_update_timeout_secs),
                };
                self.engine_api.load_from_disk(&url, &load).await?;
                (found, checksum) = self.served_weights(engine_id).await?;
                crate::adapters::engine_api::verify(&want, found.as_deref(), checksum.as_deref())?;
            }
            let synced = self.fleet.update(|inner| {
                if inner.weights.desired().0 != desired || inner.weights.current != current {
                    return Ok(false);
                }
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.record.weight_version = found.clone();
                    e.record.weights_checksum = checksum.clone();
                    e.record.last_error = None;
                }
                if want == desired {
                    if let Some(u) = inner.weights.running_update_mut() {
                        u.engine(engine_id, rollout_core::weights::EngineUpdateEvent::Verified, None);
                    }
                }
                for event in events {
                    inner.engine_event(engine_id, *event).map_err(|e| EngineError::Launch(e.to_string()))?;
                }
                Ok(true)
            })?;
            if synced {
                return Ok(want.version);
            }
            last = Some(want.version);
        }
        Err(EngineError::Launch(format!(
            "the fleet's weight version kept changing while this engine synced (last {:?}); retry",
            last.unwrap_or_default()
        )))
    }

    /// Picks the engine `engine_id` copies the fleet's version from when that version came from
    /// the trainer and no update is moving it ([`rollout_core::catchup::pick_seed`]: a serving
    /// engine on it, the least busy, none of `tried`), and notes the copy on the engine so the
    /// next pick spreads. None: the version has a checkpoint, an update is under way (its
    /// target has no engine on it yet), or no engine serves it.
    pub fn choose_seed(&self, engine_id: &str, tried: &[String]) -> Option<crate::adapters::launch::Seed> {
        let chosen = self.fleet.update(|inner| {
            let (want, path) = inner.weights.desired();
            if path.is_some() || !inner.weights.desired_from_trainer() || inner.weights.loading_update().is_some() {
                return None;
            }
            let tp = self.config.rollout_num_gpus_per_engine.max(1);
            let mut engines: Vec<&crate::registry::fleet::Engine> =
                inner.engines.values().filter(|e| e.record.engine_id != engine_id).collect();
            engines.sort_by_key(|e| e.seq);
            // Copies in progress per seed, counted once (this runs under the registry lock).
            let mut copies: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
            for seed in inner.engines.values().filter_map(|e| e.copying_from.as_deref()) {
                *copies.entry(seed).or_default() += 1;
            }
            let sending = |id: &str| copies.get(id).copied().unwrap_or(0);
            let candidates: Vec<rollout_core::catchup::SeedCandidate<'_>> = engines
                .iter()
                .map(|e| rollout_core::catchup::SeedCandidate {
                    engine_id: &e.record.engine_id,
                    serving: e.record.status == EngineStatus::Active,
                    version: e.record.weight_version.as_deref(),
                    tp_size: u32::try_from(e.record.gpu_ids.len()).unwrap_or(1).max(1),
                    sending: sending(&e.record.engine_id),
                })
                .collect();
            let seed_id = rollout_core::catchup::pick_seed(&candidates, &want.version, tp, tried)?.to_string();
            let url = inner.engines.get(&seed_id)?.record.url.clone();
            let addr = rollout_core::EngineAddr::parse(&url)?;
            let port = addr.port?;
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.copying_from = Some(seed_id.clone());
            }
            Some((seed_id, url_host_ip(&addr.host), port))
        })?;
        let (seed_id, host, port) = chosen;
        // One port per TP rank for the seed's send groups, free on this machine now (on an
        // agent's node, a port the seed's node happens to use makes that copy fail; the engine
        // is then restarted and copies from another seed).
        let group_ports = (0..self.config.rollout_num_gpus_per_engine.max(1))
            .map(|_| std::net::TcpListener::bind((host.as_str(), 0)).and_then(|l| l.local_addr()).map(|a| a.port()))
            .collect::<Result<Vec<u16>, _>>()
            .ok()?;
        Some(crate::adapters::launch::Seed { engine_id: seed_id, host, port, group_ports })
    }

    /// [`Manager::choose_seed`], skipping (and adding to `tried`) seeds whose SGLang release
    /// cannot send weights to a new instance (no `/send_weights_to_remote_instance`: 0.5.2
    /// and older).
    async fn usable_seed(&self, engine_id: &str, tried: &mut Vec<String>) -> Option<crate::adapters::launch::Seed> {
        loop {
            let seed = self.choose_seed(engine_id, tried)?;
            let url = self.url_of(&seed.engine_id).unwrap_or_default();
            if self.engine_api.serves(&url, "/send_weights_to_remote_instance").await {
                return Some(seed);
            }
            tracing::info!(engine_id, seed = %seed.engine_id, "the seed's SGLang cannot send weights to a new instance");
            self.fleet.update(|inner| {
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.copying_from = None;
                }
            });
            tried.push(seed.engine_id);
        }
    }

    /// WEIGHT_SYNCING for a version the trainer broadcast that the engine does not serve: the
    /// engine is restarted in place copying it from a peer that serves it (spread over the
    /// peers; a seed that fails the copy is not asked again for this engine). While an update
    /// runs, or no peer serves the version, the engine waits out of routing, marked
    /// `awaiting_trainer` (the next trainer update includes it). Returns when the engine was
    /// restarted on a seed's copy, the trainer's update reached it, or the version it must
    /// serve changed; the caller checks what it serves again.
    async fn catch_up(
        self: &Arc<Self>,
        engine_id: &str,
        want: &rollout_core::weights::WeightVersion,
    ) -> Result<(), EngineError> {
        let mut changes = self.fleet.subscribe();
        let mut tried: Vec<String> = Vec::new();
        let mut parked = false;
        loop {
            if self.shutdown.is_cancelled() {
                return Err(EngineError::Cancelled);
            }
            let (still, reached) = {
                let inner = self.fleet.lock();
                let Some(e) = inner.engines.get(engine_id) else { return Err(EngineError::Cancelled) };
                if e.record.status != EngineStatus::WeightSyncing {
                    return Err(EngineError::Launch(format!("{engine_id} is {} while catching up", e.record.status)));
                }
                let still = inner.weights.desired().0 == *want && inner.weights.desired_from_trainer();
                (still, parked && !e.awaiting_trainer)
            };
            if !still || reached {
                self.set_awaiting(engine_id, false, None);
                return Ok(());
            }
            if let Some(seed) = self.usable_seed(engine_id, &mut tried).await {
                let detail =
                    format!("copying weight version {} from {} (remote instance)", want.version, seed.engine_id);
                self.set_awaiting(engine_id, false, Some(detail));
                tracing::info!(engine_id, seed = %seed.engine_id, version = %want.version, "restarting the engine on a copy from a seed");
                let seed_id = seed.engine_id.clone();
                match self.restart_in_place(engine_id, seed).await {
                    Ok(()) => {
                        self.set_awaiting(engine_id, false, None);
                        return Ok(());
                    }
                    Err(EngineError::Cancelled) => return Err(EngineError::Cancelled),
                    Err(e) => {
                        tracing::warn!(engine_id, seed = %seed_id, error = %e, "copy from the seed failed; trying another");
                        tried.push(seed_id);
                        continue;
                    }
                }
            }
            if !parked {
                let detail = format!(
                    "waiting for weight version {}: it came from the trainer, has no checkpoint, and no serving engine \
                     can send it yet; the engine joins the next trainer update, or copies it once an engine serves it",
                    want.version
                );
                tracing::info!(engine_id, version = %want.version, "engine waits for the trainer's version");
                self.set_awaiting(engine_id, true, Some(detail));
                parked = true;
            }
            tokio::select! {
                r = changes.changed() => if r.is_err() { return Err(EngineError::Cancelled) },
                // Seeds that failed may serve again; ask them again now and then.
                () = tokio::time::sleep(Duration::from_secs(5)) => tried.clear(),
                () = self.shutdown.cancelled() => return Err(EngineError::Cancelled),
            }
        }
    }

    fn set_awaiting(&self, engine_id: &str, awaiting: bool, detail: Option<String>) {
        self.fleet.update(|inner| {
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.awaiting_trainer = awaiting;
                e.record.detail = detail;
            }
        });
    }

    /// Stops the engine's process and starts it again on a copy from `seed`, keeping its
    /// state (WEIGHT_SYNCING) and its GPUs; on this machine it moves to a fresh port. Returns
    /// once it is healthy.
    async fn restart_in_place(
        self: &Arc<Self>,
        engine_id: &str,
        seed: crate::adapters::launch::Seed,
    ) -> Result<(), EngineError> {
        let process = self.fleet.update(|inner| {
            if !self.ray() {
                self.move_to_fresh_port(inner, engine_id);
            }
            inner.engines.get_mut(engine_id).and_then(|e| {
                e.copying_from = Some(seed.engine_id.clone());
                e.process.take()
            })
        });
        if let Some(p) = process {
            p.stop(self.shutdown_grace()).await;
        }
        let started = async {
            let hosted = self.start_process(engine_id, Some(seed)).await?;
            self.register_process(engine_id, hosted, None)?;
            self.wait_healthy(engine_id, &self.shutdown).await
        }
        .await;
        self.fleet.update(|inner| {
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.copying_from = None;
            }
        });
        started
    }

    /// Stops an engine's process (SIGTERM, then SIGKILL after the shutdown grace), releases
    /// its GPUs and port, and marks it REMOVED.
    pub async fn remove_engine(&self, engine_id: &str) -> Option<ExitInfo> {
        let process = self.fleet.update(|inner| {
            if let Err(e) = inner.engine_event(engine_id, EngineEvent::Remove) {
                // Already on its way out: whoever moved it there finishes the removal too.
                tracing::debug!(engine_id, error = %e, "remove");
            }
            inner.engines.get(engine_id).and_then(|e| e.process.clone())
        });
        let exit = match process {
            Some(p) => Some(p.stop(self.shutdown_grace()).await),
            None => None,
        };
        let ray = self.ray();
        self.fleet.update(|inner| {
            if ray {
                // The shim removes the placement group now, then says released.
                if let Some(p) = inner.placements.get_mut(engine_id) {
                    p.unwant();
                    inner.placements_changed();
                }
            }
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.process = None;
            }
            if inner.engine_event(engine_id, EngineEvent::Removed).is_ok() {
                // Forget removed engines entirely; their operation records keep their ids.
                inner.forget_engine(engine_id);
            }
        });
        exit
    }

    /// Stops an engine but keeps it listed as FAILED (used when an initial engine cannot start,
    /// so the operator sees it).
    pub async fn fail_engine(&self, engine_id: &str, error: &str) {
        let process = self.fleet.update(|inner| {
            inner.fail_engine(engine_id, Some(error.to_string()));
            inner.engines.get(engine_id).and_then(|e| e.process.clone())
        });
        if let Some(p) = process {
            p.stop(self.shutdown_grace()).await;
        }
    }

    /// Stops every engine process, in parallel, each with the shutdown grace. Used at exit.
    pub async fn stop_all(&self) {
        let processes: Vec<EngineProcess> =
            self.fleet.lock().engines.values().filter_map(|e| e.process.clone()).collect();
        let grace = self.shutdown_grace();
        futures::future::join_all(processes.iter().map(|p| p.stop(grace))).await;
    }
}

/// Where an engine's keeper listens: a short path (Unix socket paths are limited to ~107
/// bytes) in a private directory under the system temp dir, named after the state directory.
///
/// The directory is ours alone (mode 0700, owned by this user, not a symlink: a name in a
/// shared temp dir could have been planted by someone else), so nobody else can reach or
/// replace a keeper's socket, which is itself 0600.
pub fn keeper_socket_path(state_dir: &std::path::Path, engine_id: &str) -> std::io::Result<std::path::PathBuf> {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf()).hash(&mut h);
    let dir = std::env::temp_dir().join(format!("rollout-{:016x}", h.finish()));
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.file_type().is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{} is not a directory owned by this user; remove it and retry", dir.display()),
        ));
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(dir.join(format!("{engine_id}.sock")))
}

/// The host part of an engine URL: IPv6 literals need brackets.
/// The address to bind on `host` (a URL host: brackets around IPv6 removed).
fn url_host_ip(host: &str) -> String {
    host.trim_start_matches('[').trim_end_matches(']').to_string()
}

fn url_host(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}
