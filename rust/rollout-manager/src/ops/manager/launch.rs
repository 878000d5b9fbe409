//! Launch: an engine reserved in the registry (GPUs and a port, or a Ray placement) and its
//! process started on the right host with the weights it must load, or an external engine
//! connected to; the started process recorded on its engine and watched.

use super::*;

impl Manager {
    /// Registers a new managed engine in CREATING, with GPUs and a port reserved.
    /// Nothing is started yet; the caller launches it with [`Manager::launch`].
    pub fn reserve_engine(
        &self,
        inner: &mut crate::registry::fleet::FleetInner,
        origin: EngineOrigin,
        created_by: &OpId,
    ) -> Result<EngineId, ReserveError> {
        let per_engine = self.config.rollout_num_gpus_per_engine;
        if self.ray() {
            // Ray finds the GPUs; the engine waits in PENDING until an agent is bound.
            let id = self.register(inner, EngineStatus::Pending, String::new(), origin, Held::default(), created_by);
            if let Some(e) = inner.engines.get_mut(&id) {
                e.set_detail(Some(PENDING_DETAIL.into()));
            }
            inner.placements.set(Placement::plan(&id, per_engine, origin == EngineOrigin::Initial));
            return Ok(id);
        }
        let host = &self.config.engine_host;
        let held = inner
            .engines
            .reserve_local(per_engine, |taken| free_port(host, taken))
            .map_err(|pool| ReserveError { host: host.clone(), pool })?;
        let url = held.port.map(|port| format!("http://{}:{port}", url_host(host))).unwrap_or_default();
        Ok(self.register(inner, EngineStatus::Creating, url, origin, held, created_by))
    }

    /// Registers an external engine (started by someone else) in CREATING. Nothing is contacted
    /// yet; [`Manager::connect`] does that.
    pub fn reserve_external(
        &self,
        inner: &mut crate::registry::fleet::FleetInner,
        url: &str,
        created_by: &OpId,
    ) -> EngineId {
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
    pub(super) fn register(
        &self,
        inner: &mut crate::registry::fleet::FleetInner,
        status: EngineStatus,
        url: String,
        origin: EngineOrigin,
        held: Held,
        created_by: &OpId,
    ) -> EngineId {
        debug_assert!(matches!(status, EngineStatus::Creating | EngineStatus::Pending));
        let log_dir = (origin != EngineOrigin::External).then(|| self.config.state_dir.join("logs"));
        let new = crate::registry::fleet::Registration {
            status,
            url,
            origin,
            model_name: self.config.model_name.clone(),
            log_dir,
            created_by: Some(created_by.clone()),
        };
        inner.engines.add(held, new)
    }

    /// Connects to an external engine: its `/model_info` must answer and name the fleet's model
    /// (the startup `--model-path` or a checkpoint the fleet published). Moves it to
    /// HEALTH_CHECKING.
    pub async fn connect(&self, engine_id: &EngineId) -> Result<(), EngineError> {
        let info = self.model_info(engine_id).await?;
        let (model, _) = crate::foundation::engine_http::model_info_fields(&info);
        if !self.fleet.lock().weights.is_fleet_model(&self.config.model_path, model) {
            let found = crate::foundation::engine_http::shorten(model);
            return Err(EngineError::WrongModel { expected: self.config.model_path.clone(), found });
        }
        self.fleet.update(|inner| inner.engines.event(engine_id, EngineEvent::Launched)).map_err(EngineError::Moved)?;
        Ok(())
    }

    /// Starts the process of a reserved engine and moves it to HEALTH_CHECKING.
    ///
    /// Cancel-safe: the work runs in its own task, so a caller that stops waiting (a cancelled
    /// scale-out) cannot leave a started process unregistered; a process whose engine left the
    /// fleet meanwhile is stopped.
    pub async fn launch(self: &Arc<Self>, engine_id: &EngineId) -> Result<(), EngineError> {
        self.launch_avoiding(engine_id, &[]).await.map(|_| ())
    }

    /// [`Manager::launch`] not copying from the seeds in `tried`; answers the seed it copies
    /// from, if any.
    pub(super) async fn launch_avoiding(
        self: &Arc<Self>,
        engine_id: &EngineId,
        tried: &[EngineId],
    ) -> Result<Option<EngineId>, EngineError> {
        let m = self.clone();
        let id = engine_id.clone();
        let tried = tried.to_vec();
        self.tasks
            .spawn(async move { m.launch_now(&id, tried).await })
            .await
            .unwrap_or_else(|e| Err(EngineError::Start(format!("the launch task failed: {e}"))))
    }

    pub(super) async fn launch_now(
        self: &Arc<Self>,
        engine_id: &EngineId,
        mut tried: Vec<EngineId>,
    ) -> Result<Option<EngineId>, EngineError> {
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
        engine_id: &EngineId,
        cancel: &CancellationToken,
    ) -> Result<(), EngineError> {
        let mut tried: Vec<EngineId> = Vec::new();
        loop {
            let seed = self.launch_avoiding(engine_id, &tried).await?;
            let healthy = self.wait_healthy(engine_id, cancel).await;
            if healthy.is_ok() && !tried.is_empty() {
                self.fleet.update(|inner| {
                    if let Some(e) = inner.engines.get_mut(engine_id) {
                        e.set_detail(None);
                    }
                });
            }
            let (Err(EngineError::Exited(why)), Some(seed)) = (&healthy, seed) else { return healthy };
            tried.push(seed.clone());
            if tried.len() >= SEED_ATTEMPTS {
                return healthy;
            }
            let again = self.fleet.update(|inner| {
                if inner.engines.event(engine_id, EngineEvent::Restart).is_err() {
                    return false;
                }
                if !self.ray() {
                    self.move_to_fresh_port(inner, engine_id);
                }
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.set_detail(Some(format!("the copy from {seed} failed ({why}); copying from another seed")));
                }
                true
            });
            if !again {
                return healthy;
            }
            tracing::warn!(engine_id = %engine_id, seed = %seed, error = %why, "copy from the seed failed at startup; starting again from another seed");
        }
    }

    /// What a starting engine loads: the newest version (an update's target, else the current
    /// one) from its checkpoint, staged on the engine's node first when the node does not hold
    /// it; a version the trainer broadcast (no checkpoint) from `seed`, an engine that serves
    /// it; without a seed, the startup `--model-path` under the startup `--weight-version`, so
    /// the engine never claims a version it does not hold (it catches up before it is routable,
    /// see [`Manager::sync_weights`]). Returns the model path, the weight version, and the
    /// seed's flags.
    pub(super) async fn launch_weights(
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
    pub(super) async fn start_process(
        self: &Arc<Self>,
        engine_id: &EngineId,
        seed: Option<crate::adapters::launch::Seed>,
    ) -> Result<crate::adapters::engine_host::Hosted, EngineError> {
        let (spec, at) = if self.ray() {
            let binding = self.wait_bound(engine_id).await?;
            self.fleet.update(|inner| {
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.launching_on(&binding.url);
                }
            });
            let (model_path, weight_version, seed_args) =
                self.launch_weights(Node::Agent(binding.url.clone()), seed.as_ref()).await?;
            let log_path = self.config.state_dir.join("logs").join(format!("{engine_id}.log"));
            let mut spec =
                self.launcher.spec_on_agent(&self.config, &model_path, &binding.gpu_ids, &weight_version, log_path);
            spec.args.extend(seed_args);
            (spec, Location::Agent { agent_url: binding.url })
        } else {
            let (model_path, weight_version, seed_args) = self.launch_weights(Node::Local, seed.as_ref()).await?;
            let facts = self
                .fleet
                .lock()
                .engines
                .get(engine_id)
                .map(crate::registry::fleet::Engine::launch_facts)
                .ok_or_else(|| EngineError::Left(format!("{engine_id} left the fleet while starting")))?;
            let LaunchFacts { port, gpu_ids, log_path, url } = facts;
            let mut spec = self.launcher.spec(&self.config, &model_path, port, &gpu_ids, &weight_version, log_path);
            spec.args.extend(seed_args);
            let keeper_socket = if self.config.reattach_grace_secs > 0.0 {
                Some(
                    keeper_socket_path(&self.config.state_dir, engine_id)
                        .map_err(|e| EngineError::Start(format!("no keeper socket: {e}")))?,
                )
            } else {
                None
            };
            (spec, Location::Local { url, keeper_socket })
        };
        let args = crate::adapters::launch::redacted(&spec.args);
        tracing::info!(engine_id = %engine_id, program = %spec.program.display(), ?args, at = ?at, "launching engine");
        self.host().launch(engine_id, &spec, &at).await.map_err(|e| EngineError::Start(e.to_string()))
    }

    /// Records a started process on its engine, moved by `event` (None: the engine keeps its
    /// state, as for a restart in place), and watches it. A process whose engine left the
    /// fleet meanwhile is stopped.
    pub(super) fn register_process(
        self: &Arc<Self>,
        engine_id: &EngineId,
        hosted: crate::adapters::engine_host::Hosted,
        event: Option<EngineEvent>,
    ) -> Result<(), EngineError> {
        let (process, keeper_socket) = (hosted.process, hosted.keeper_socket);
        let registered = self.fleet.update(|inner| {
            // The engine may have been removed (scale-in, cancel) while we were forking.
            let moved = match event {
                Some(event) => inner.engines.event(engine_id, event).map(|_| ()),
                None => match inner.engines.get(engine_id).map(|e| e.status()) {
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
                    e.started(process.clone(), keeper_socket.clone(), hosted.url.clone(), hosted.log_path.clone());
                }
            }
            moved
        });
        if let Err(e) = registered {
            let grace = self.shutdown_grace();
            let orphan = process.clone();
            self.tasks.spawn(async move { orphan.stop(grace).await });
            return Err(EngineError::Left(format!("engine left the fleet while starting ({e})")));
        }
        self.watch_exit(engine_id.clone(), process);
        Ok(())
    }

    /// Ray mode: waits until the engine's placement has an agent (the engine is then past
    /// PENDING), and returns the binding. Fails when the engine leaves the fleet or its placement
    /// is no longer wanted, and on shutdown.
    pub(super) async fn wait_bound(&self, engine_id: &EngineId) -> Result<rollout_core::AgentBinding, EngineError> {
        let mut changes = self.fleet.subscribe();
        loop {
            let (bound, detail_stale) = {
                let inner = self.fleet.lock();
                let Some(engine) = inner.engines.get(engine_id) else {
                    return Err(EngineError::Left(format!("{engine_id} left the fleet before an agent was bound")));
                };
                let placement = inner.placements.get(engine_id).filter(|p| p.desired == rollout_core::Desired::Present);
                let Some(placement) = placement else {
                    return Err(EngineError::Left(format!("the placement of {engine_id} is no longer wanted")));
                };
                let binding = placement.agent.clone();
                let detail = binding.is_none().then(|| PENDING_DETAIL.to_string());
                (binding, (*engine.record().detail() != detail).then_some(detail))
            };
            if let Some(detail) = detail_stale {
                // Shown while waiting (after a restart of the manager, for instance).
                self.fleet.update(|inner| {
                    if let Some(e) = inner.engines.get_mut(engine_id) {
                        e.set_detail(detail);
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
}
