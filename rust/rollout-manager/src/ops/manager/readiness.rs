//! Readiness: health waited for, the weights an engine serves checked against the fleet's and
//! loaded or copied from a seed when they differ, before the engine may be activated.

use super::*;

impl Manager {
    /// Waits until the engine's `/health` answers 200, the engine fails (its process exits),
    /// the startup deadline passes, or `cancel` fires. Probes back off from 50 ms to 250 ms
    /// (readiness noticed late is time added to every scale-out); a change of the fleet (such as
    /// the process exiting) wakes the wait at once.
    pub async fn wait_healthy(&self, engine_id: &EngineId, cancel: &CancellationToken) -> Result<(), EngineError> {
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
                        Some(e) if e.status() == EngineStatus::Failed => {
                            Some(e.record().last_error().clone().unwrap_or_else(|| "failed".into()))
                        }
                        Some(_) => None,
                    }
                };
                if let Some(why) = failed {
                    return Err(EngineError::Exited(why));
                }
                if self.engine_api.probe(&url, "/health", Duration::from_secs(5)).await.is_none() {
                    // How its streams come (so the router need not parse events to tell), and
                    // its ranks (a trainer's group counts them for an engine it did not launch).
                    let facts = self.engine_api.server_facts(&url).await;
                    if let Some(e) = self.fleet.lock().engines.get(engine_id) {
                        e.load().set_streams_increments(facts.streams_increments);
                        e.load().set_ranks(facts.ranks);
                    }
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
    pub(super) async fn model_info(&self, engine_id: &EngineId) -> Result<serde_json::Value, EngineError> {
        let url = self.url_of(engine_id).ok_or(EngineError::Cancelled)?;
        self.engine_api.model_info(&url).await
    }

    /// The weight version and checksum an engine reports in `/model_info` (the checksum is
    /// `sglang-sim`'s `weights_checksum`; real SGLang reports none).
    pub async fn served_weights(&self, engine_id: &EngineId) -> Result<(Option<String>, Option<String>), EngineError> {
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
        engine_id: &EngineId,
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
        engine_id: &EngineId,
        events: &[EngineEvent],
    ) -> Result<String, EngineError> {
        self.sync_weights_inner(engine_id, events, true).await
    }

    pub(super) async fn sync_weights_inner(
        self: &Arc<Self>,
        engine_id: &EngineId,
        events: &[EngineEvent],
        keep_current: bool,
    ) -> Result<String, EngineError> {
        let mut last = None;
        for _ in 0..5 {
            let (desired, engine_path, current, from_trainer) = {
                let inner = self.fleet.lock();
                let (desired, path) = inner.weights.desired();
                (desired, path, inner.weights.current().clone(), inner.weights.desired_from_trainer())
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
                    flush_cache: false,
                    timeout: Duration::from_secs_f64(self.config.weight_update_timeout_secs),
                };
                self.load_checkpoint(&url, &load, true).await?;
                (found, checksum) = self.served_weights(engine_id).await?;
                crate::adapters::engine_api::verify(&want, found.as_deref(), checksum.as_deref())?;
            }
            let synced = self.fleet.update(|inner| -> Result<bool, EngineError> {
                if inner.weights.desired().0 != desired || *inner.weights.current() != current {
                    return Ok(false);
                }
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.set_weights(found.clone(), checksum.clone());
                    e.set_last_error(None);
                }
                if want == desired {
                    if let Some(running) = inner.weights.running().clone() {
                        let verified = rollout_core::weights::EngineUpdateEvent::Verified;
                        inner.weights.engine_turn(&running, engine_id, verified, None);
                    }
                }
                for event in events {
                    inner.engines.event(engine_id, *event)?;
                }
                Ok(true)
            })?;
            if synced {
                return Ok(want.version);
            }
            last = Some(want.version);
        }
        Err(EngineError::NotSynced(format!(
            "the fleet's weight version kept changing while this engine synced (last {:?}); retry",
            last.unwrap_or_default()
        )))
    }

    /// Picks the engine `engine_id` copies the fleet's version from when that version came from
    /// the trainer and no update is moving it ([`rollout_core::catchup::pick_seed`]: a serving
    /// engine on it, the least busy, none of `tried`), and notes the copy on the engine so the
    /// next pick spreads. None: the version has a checkpoint, an update is under way (its
    /// target has no engine on it yet), or no engine serves it.
    pub fn choose_seed(&self, engine_id: &EngineId, tried: &[EngineId]) -> Option<crate::adapters::launch::Seed> {
        let chosen = self.fleet.update(|inner| {
            let (want, path) = inner.weights.desired();
            if path.is_some() || !inner.weights.desired_from_trainer() || inner.weights.loading_update().is_some() {
                return None;
            }
            let tp = self.config.rollout_num_gpus_per_engine.max(1);
            let mut engines: Vec<&crate::registry::fleet::Engine> =
                inner.engines.values().filter(|e| e.id() != engine_id).collect();
            engines.sort_by_key(|e| e.seq());
            // Copies in progress per seed, counted once (this runs under the registry lock).
            let mut copies: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
            for seed in inner.engines.values().filter_map(|e| e.copying_from()) {
                *copies.entry(seed).or_default() += 1;
            }
            let sending = |id: &str| copies.get(id).copied().unwrap_or(0);
            let candidates: Vec<rollout_core::catchup::SeedCandidate<'_>> = engines
                .iter()
                .map(|e| rollout_core::catchup::SeedCandidate {
                    engine_id: e.record().engine_id(),
                    serving: e.status() == EngineStatus::Active,
                    version: e.record().weight_version().as_deref(),
                    tp_size: e.ranks(),
                    sending: sending(e.record().engine_id()),
                })
                .collect();
            let tried: Vec<&str> = tried.iter().map(|t| t.as_str()).collect();
            let picked = rollout_core::catchup::pick_seed(&candidates, &want.version, tp, &tried)?;
            let seed = inner.engines.get(picked)?;
            let (seed_id, url) = (seed.id().clone(), seed.url().to_string());
            let addr = rollout_core::EngineAddr::parse(&url)?;
            let port = addr.port?;
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.copy_from(&seed_id);
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

    /// Loads a checkpoint into the engine at `url`, then, with `flush`, empties its prefix cache
    /// (whose entries were computed with the old weights) before anything else runs there. The
    /// flush is asked on its own and again every 100 ms while the engine refuses it, up to
    /// `--scale-in-drain-timeout-secs`: SGLang refuses it while any request runs or waits, and
    /// an engine out of routing still finishes a health check's one-token generation or a
    /// stream whose client just left. A load that asked SGLang to flush would fail whole on that.
    pub(crate) async fn load_checkpoint(
        &self,
        url: &str,
        load: &crate::adapters::engine_api::DiskLoad,
        flush: bool,
    ) -> Result<(), EngineError> {
        let load = crate::adapters::engine_api::DiskLoad { flush_cache: false, ..load.clone() };
        self.engine_api.load_from_disk(url, &load).await?;
        // SGLang serves the model under the checkpoint's path from now on.
        let engine = self.fleet.lock().engines.values().find(|e| e.record().url() == url).map(|e| e.load().clone());
        if let Some(engine) = engine {
            engine.serves_as(&load.path);
        }
        if !flush {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(self.config.scale_in_drain_timeout);
        loop {
            match self.engine_api.control(url, "/flush_cache", serde_json::json!({})).await {
                Ok(()) => return Ok(()),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(EngineError::WeightLoad {
                        path: load.path.clone(),
                        detail: format!(
                            "loaded, but its prefix cache could not be flushed within --scale-in-drain-timeout-secs, \
                             requests kept running there: {e}"
                        ),
                    })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// [`Manager::choose_seed`], skipping (and adding to `tried`) seeds whose SGLang release
    /// cannot send weights to a new instance (no `/send_weights_to_remote_instance`: 0.5.2
    /// and older).
    pub(super) async fn usable_seed(
        &self,
        engine_id: &EngineId,
        tried: &mut Vec<EngineId>,
    ) -> Option<crate::adapters::launch::Seed> {
        loop {
            let seed = self.choose_seed(engine_id, tried)?;
            let url = self.url_of(&seed.engine_id).unwrap_or_default();
            if self.engine_api.can_send_weights(&url).await {
                return Some(seed);
            }
            tracing::info!(engine_id = %engine_id, seed = %seed.engine_id, "the seed cannot send weights to a new instance (its SGLang has no such route, or it runs on CPU)");
            self.fleet.update(|inner| {
                if let Some(e) = inner.engines.get_mut(engine_id) {
                    e.copy_over();
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
    pub(super) async fn catch_up(
        self: &Arc<Self>,
        engine_id: &EngineId,
        want: &rollout_core::weights::WeightVersion,
    ) -> Result<(), EngineError> {
        let mut changes = self.fleet.subscribe();
        let mut tried: Vec<EngineId> = Vec::new();
        let mut parked = false;
        loop {
            if self.shutdown.is_cancelled() {
                return Err(EngineError::Cancelled);
            }
            let (still, reached) = {
                let inner = self.fleet.lock();
                let Some(e) = inner.engines.get(engine_id) else { return Err(EngineError::Cancelled) };
                if e.status() != EngineStatus::WeightSyncing {
                    return Err(EngineError::Left(format!("{engine_id} is {} while catching up", e.status())));
                }
                let still = inner.weights.desired().0 == *want && inner.weights.desired_from_trainer();
                (still, parked && !e.awaiting_trainer())
            };
            if !still || reached {
                self.set_awaiting(engine_id, false, None);
                return Ok(());
            }
            if let Some(seed) = self.usable_seed(engine_id, &mut tried).await {
                let detail =
                    format!("copying weight version {} from {} (remote instance)", want.version, seed.engine_id);
                self.set_awaiting(engine_id, false, Some(detail));
                tracing::info!(engine_id = %engine_id, seed = %seed.engine_id, version = %want.version, "restarting the engine on a copy from a seed");
                let seed_id = seed.engine_id.clone();
                match self.restart_in_place(engine_id, seed).await {
                    Ok(()) => {
                        self.set_awaiting(engine_id, false, None);
                        return Ok(());
                    }
                    Err(EngineError::Cancelled) => return Err(EngineError::Cancelled),
                    Err(e) => {
                        tracing::warn!(engine_id = %engine_id, seed = %seed_id, error = %e, "copy from the seed failed; trying another");
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
                tracing::info!(engine_id = %engine_id, version = %want.version, "engine waits for the trainer's version");
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

    pub(super) fn set_awaiting(&self, engine_id: &EngineId, awaiting: bool, detail: Option<String>) {
        self.fleet.update(|inner| {
            if let Some(e) = inner.engines.get_mut(engine_id) {
                e.wait_for_trainer(awaiting, detail);
            }
        });
    }

    /// Stops the engine's process and starts it again on a copy from `seed`, keeping its
    /// state (WEIGHT_SYNCING) and its GPUs; on this machine it moves to a fresh port. Returns
    /// once it is healthy.
    pub(super) async fn restart_in_place(
        self: &Arc<Self>,
        engine_id: &EngineId,
        seed: crate::adapters::launch::Seed,
    ) -> Result<(), EngineError> {
        let process = self.fleet.update(|inner| {
            if !self.ray() {
                self.move_to_fresh_port(inner, engine_id);
            }
            inner.engines.get_mut(engine_id).and_then(|e| {
                e.copy_from(&seed.engine_id);
                e.take_process()
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
                e.copy_over();
            }
        });
        started
    }
}
