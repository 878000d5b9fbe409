//! The manager: configuration, the fleet registry, and the effects that move engines through
//! their lifecycle, one file per step: `launch.rs` (reserve, start, record the process),
//! `readiness.rs` (health, the weights an engine serves checked and caught up), `recovery.rs`
//! (exits watched, restarts within the budget, lost agents), `stop.rs` (removal, shutdown). This
//! file holds the manager itself and where weights live on each node.
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
use crate::foundation::host::{EngineProcess, ExitInfo};
use crate::registry::fleet::{Fleet, Held, LaunchFacts};
use rollout_core::ids::{EngineId, OpId};
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

/// Why a new engine cannot be reserved on this machine: what the pool lacks, and which host.
#[derive(Debug, thiserror::Error)]
#[error("{pool} on {host}")]
pub struct ReserveError {
    pub host: String,
    #[source]
    pub pool: crate::registry::fleet::PoolError,
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

mod launch;
mod readiness;
mod recovery;
mod stop;

impl Manager {
    /// Looks again after every change of the fleet until `look` says it is done, or `limit`
    /// passes; answers what it saw last. `look` answers (what it sees, whether that is the end)
    /// or a refusal, which ends the wait. Err `shutting_down` when the manager stops meanwhile.
    pub async fn watch<T>(
        &self,
        limit: Duration,
        mut look: impl FnMut() -> Result<(T, bool), crate::ops::op_error::OpError>,
    ) -> Result<T, crate::ops::op_error::OpError> {
        let mut changes = self.fleet.subscribe();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let (seen, done) = look()?;
            if done {
                return Ok(seen);
            }
            tokio::select! {
                _ = changes.changed() => {}
                () = tokio::time::sleep_until(deadline) => return Ok(seen),
                () = self.shutdown.cancelled() => {
                    return Err(crate::ops::op_error::OpError::conflict("shutting_down", "the manager is shutting down"))
                }
            }
        }
    }

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
    pub fn weight_node(&self, engine_id: &EngineId) -> Result<Node, EngineError> {
        let inner = self.fleet.lock();
        let external = inner.engines.get(engine_id).is_some_and(|e| e.record().origin() == EngineOrigin::External);
        if !self.ray() || external {
            return Ok(Node::Local);
        }
        match inner.placements.get(engine_id).and_then(|p| p.agent.as_ref()) {
            Some(agent) => Ok(Node::Agent(agent.url.clone())),
            None => Err(EngineError::Left(format!("{engine_id} has no agent bound to its placement"))),
        }
    }

    /// Every node that hosts an engine now, for staging a published version: this machine in
    /// local mode (or when external engines exist), and in Ray mode the agent of every wanted
    /// placement whose engine is not FAILED (a failed engine's agent may be gone; it gets the
    /// version when the engine starts again). Nodes added later get it when an engine loads it.
    pub fn weight_nodes(&self) -> Vec<Node> {
        let inner = self.fleet.lock();
        let mut nodes = Vec::new();
        let external = inner.engines.values().any(|e| e.record().origin() == EngineOrigin::External);
        if !self.ray() || external {
            nodes.push(Node::Local);
        }
        if self.ray() {
            for (engine_id, p) in inner.placements.iter() {
                let failed = inner.engines.get(engine_id).is_none_or(|e| e.status() == EngineStatus::Failed);
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
        engine_id: &EngineId,
        version: &rollout_core::weights::WeightVersion,
        staged: &str,
    ) -> Result<String, EngineError> {
        let node = self.weight_node(engine_id)?;
        self.weights_path_on(&node, version, staged).await
    }

    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs_f64(self.config.scale_in_shutdown_timeout)
    }

    pub(crate) fn url_of(&self, engine_id: &EngineId) -> Option<String> {
        self.fleet.lock().engines.get(engine_id).map(|e| e.record().url().clone())
    }
}

/// Where an engine's keeper listens: a short path (Unix socket paths are limited to ~107
/// bytes) in a private directory under the system temp dir, named after the state directory.
///
/// The directory is ours alone (mode 0700, owned by this user, not a symlink: a name in a
/// shared temp dir could have been planted by someone else), so nobody else can reach or
/// replace a keeper's socket, which is itself 0600.
pub fn keeper_socket_path(state_dir: &std::path::Path, engine_id: &EngineId) -> std::io::Result<std::path::PathBuf> {
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
