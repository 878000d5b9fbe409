//! How a published version reaches the engines, behind one trait.
//!
//! [`WeightTransport::stage`] makes a version loadable on every node that hosts engines and
//! returns the path recorded for it (`engine_path` of the update, `current_engine_path` of the
//! fleet). It runs once per publish, before any engine is touched; a failure fails the publish
//! with nothing changed. [`WeightTransport::path_on`] turns that path into the one an engine on
//! a given node passes to `/update_weights_from_disk` (and to `--model-path` when it is
//! launched), first staging the version on that node if the node does not hold it yet.
//!
//! - [`Disk`]: engines read the published directory directly (shared storage, or one node).
//! - [`Relay`]: the version is read once and broadcast with `rollout-relay` (pipelined chain,
//!   per-chunk and whole-file checksums, atomic rename) to one receiver per node that hosts
//!   engines, which writes it to node-local fast storage; engines load it from there.
//!
//! Relay nodes ([`Node`]): the manager's own machine runs an in-process receiver (started with
//! the first send) writing under `--relay-dir` (default `/dev/shm/elastic-rollout`); it hosts
//! the local engines and the external ones (they are given the manager's path, as before). In
//! Ray mode every node agent (`rollout-manager agent`) runs a receiver writing under its own
//! `--relay-dir` (started on the first `RelayEndpoint` call, see [`AgentRelays`]). The chain of
//! a publish is every such node that hosts an engine now, one receiver per relay directory (two
//! receivers reporting the same `root_id`, i.e. the same directory on the same machine, get the
//! version once). Each version is staged as `<version>-<first 16 hex of its checksum>` under
//! each node's root, so a name published again with other bytes (after a failed update) never
//! reuses an old copy; the recorded path is the manager's `<relay-dir>/<name>`, and an engine on
//! an agent loads `<the agent's relay-dir>/<name>`. An engine placed on a node after the publish
//! (a scale-out onto a new agent, a restart) gets the version staged there before it loads it.
//! After an update ends, copies other than the fleet's current one are removed on the manager's
//! node at once and on the agents' nodes in the background ([`WeightTransport::retain`]).
//!
//! Errors: a node whose receiver cannot be reached or fails the transfer fails the publish (or
//! the engine's load) with a message that names the node; copies the failed send wrote on the
//! other nodes are removed again, so nothing is left half-applied. Sends (and the removals on
//! agents) run one at a time.
//!
//! Auth: when the manager has an API token, every receiver requires the relay token derived
//! from it ([`relay_token`]), which agents started with the same token derive alike.

use crate::foundation::locks::Locked;
use futures::future::BoxFuture;
use rollout_core::weights::WeightVersion;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{transport} transport cannot stage version {version}: {reason}")]
    Stage { transport: &'static str, version: String, reason: String },
}

/// Where engines load weights, as the transport sees it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Node {
    /// The manager's own machine: local engines, and external engines.
    Local,
    /// The node of the agent at this gRPC URL (Ray mode).
    Agent(String),
}

impl std::fmt::Display for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Node::Local => f.write_str("the manager's node"),
            Node::Agent(url) => write!(f, "agent {url}"),
        }
    }
}

pub trait WeightTransport: Send + Sync {
    /// The name shown in `GET /rollout/weights` (`disk`, `relay`).
    fn name(&self) -> &'static str;

    /// Makes `version` (read from `version.path`) loadable on every node of `nodes`; returns
    /// the path recorded for it (see [`WeightTransport::path_on`]).
    fn stage<'a>(
        &'a self,
        version: &'a WeightVersion,
        nodes: &'a [Node],
    ) -> BoxFuture<'a, Result<String, TransportError>>;

    /// The path an engine on `node` loads `version` from, given the path [`stage`] returned;
    /// stages the version on `node` first if the node does not hold it.
    ///
    /// [`stage`]: WeightTransport::stage
    fn path_on<'a>(
        &'a self,
        _version: &'a WeightVersion,
        staged: &'a str,
        _node: &'a Node,
    ) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move { Ok(staged.to_string()) })
    }

    /// Drops staged copies other than `keep` (paths [`stage`] returned, still in use): on the
    /// manager's node before returning, on the agents of `nodes` when the returned future runs
    /// (spawn it). Best effort.
    ///
    /// [`stage`]: WeightTransport::stage
    fn retain(&self, _keep: &[String], _nodes: &[Node]) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
}

/// Engines load the published directory itself.
pub struct Disk;

impl WeightTransport for Disk {
    fn name(&self) -> &'static str {
        "disk"
    }

    fn stage<'a>(
        &'a self,
        version: &'a WeightVersion,
        _nodes: &'a [Node],
    ) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            version.path.clone().ok_or_else(|| TransportError::Stage {
                transport: "disk",
                version: version.version.clone(),
                reason: "the version has no checkpoint path".into(),
            })
        })
    }
}

/// An agent's relay receiver, as its `RelayEndpoint` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRelay {
    /// `host:port` of the receiver.
    pub addr: String,
    /// Its relay directory on the agent's node.
    pub root: String,
    /// Same for every receiver writing into the same directory of the same machine.
    pub root_id: String,
    /// Complete staged versions in `root`.
    pub staged: Vec<String>,
}

/// The relay calls of the node agents (implemented over gRPC by
/// [`crate::adapters::engine_host::AgentHost`]). Errors are messages for the operator.
pub trait AgentRelays: Send + Sync {
    fn relay_endpoint<'a>(&'a self, agent_url: &'a str) -> BoxFuture<'a, Result<RemoteRelay, String>>;
    /// Removes staged versions not in `keep`; returns the names removed.
    fn relay_retain<'a>(&'a self, agent_url: &'a str, keep: Vec<String>) -> BoxFuture<'a, Result<Vec<String>, String>>;
}

/// The token relay receivers require when the manager has API token `api_token`: a SHA-256 of
/// it (so relay connections, which every hop of a chain sees, never carry the API token).
pub fn relay_token(api_token: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"elastic-rollout weight relay v1\0");
    h.update(api_token.as_bytes());
    rollout_relay::manifest::hex(&h.finalize())
}

/// Names of the complete staged versions in `root` (directories carrying the relay's marker).
pub fn staged_names(root: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut names: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().join(rollout_relay::manifest::MARKER).is_file())
        .filter_map(|e| e.file_name().to_str().map(String::from))
        .filter(|n| !n.ends_with(".partial"))
        .collect();
    names.sort();
    names
}

/// Identifies the directory `root` on this machine: the kernel's boot id with the directory's
/// device and inode (created if missing). Two processes writing into the same directory report
/// the same id; containers with their own `/dev/shm` do not.
pub fn root_id(root: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::MetadataExt;
    std::fs::create_dir_all(root)?;
    let meta = std::fs::metadata(root)?;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        // Without a boot id the machine cannot be told apart: never share (a send too many).
        .unwrap_or_else(|_| format!("unknown-{}", uuid::Uuid::new_v4()));
    Ok(format!("{boot}:{}:{}", meta.dev(), meta.ino()))
}

/// Removes every directory of `root` that is neither in `keep` nor being received
/// (`*.partial`); returns the names removed. Best effort: failures are logged.
pub fn prune(root: &Path, keep: &[String]) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(name) = entry.file_name().to_str().map(String::from) else { continue };
        if !path.is_dir() || name.ends_with(".partial") || keep.contains(&name) {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                tracing::info!(path = %path.display(), "removed a staged weight version no longer in use");
                removed.push(name);
            }
            // Another process sharing the directory removed it first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove a staged weight version"),
        }
    }
    removed
}

/// Node-local relay through `rollout-relay` (see the module docs).
pub struct Relay {
    inner: Arc<RelayInner>,
}

struct RelayInner {
    root: PathBuf,
    /// What receivers require (see [`relay_token`]).
    token: Option<String>,
    receiver: tokio::sync::OnceCell<rollout_relay::ReceiverHandle>,
    agents: Option<Arc<dyn AgentRelays>>,
    /// Held while sending, and while removing copies on agents: one at a time, so a removal
    /// never races a send and two engines never receive the same version at once.
    sending: tokio::sync::Mutex<()>,
    staging: Mutex<Staging>,
}

/// Names [`WeightTransport::retain`] must not remove although they are not (yet) in use.
#[derive(Default)]
struct Staging {
    /// Bumped by every send that completes.
    generation: u64,
    /// Names being sent now, with how many sends.
    in_flight: HashMap<String, usize>,
    /// The last completed send: (generation, name).
    last: Option<(u64, String)>,
}

/// One receiver of a send.
struct Target {
    node: Node,
    addr: SocketAddr,
    root: PathBuf,
    root_id: String,
    staged: Vec<String>,
}

impl Target {
    fn shown(&self) -> String {
        format!("{} (relay receiver {}, {})", self.node, self.addr, self.root.display())
    }
}

impl Relay {
    /// `root`: the manager's `--relay-dir`; `token`: [`relay_token`] of the API token, if any;
    /// `agents`: how to reach agents' receivers (Ray mode).
    pub fn new(root: PathBuf, token: Option<String>, agents: Option<Arc<dyn AgentRelays>>) -> Self {
        Self {
            inner: Arc::new(RelayInner {
                root,
                token,
                receiver: tokio::sync::OnceCell::new(),
                agents,
                sending: tokio::sync::Mutex::new(()),
                staging: Mutex::default(),
            }),
        }
    }

    /// The directory name a version is staged under.
    pub fn staged_name(version: &WeightVersion) -> String {
        let sum = version.checksum.as_deref().unwrap_or("unchecked");
        format!("{}-{}", version.version, &sum[..sum.len().min(16)])
    }
}

impl RelayInner {
    fn staging(&self) -> std::sync::MutexGuard<'_, Staging> {
        self.staging.locked()
    }

    /// The staged name of a recorded path (None: not a path under our root, e.g. a path
    /// recorded by a manager with another `--relay-dir`: used as it is).
    fn name_of(&self, staged: &str) -> Option<String> {
        let path = Path::new(staged);
        (path.parent() == Some(self.root.as_path())).then(|| path.file_name()?.to_str().map(String::from)).flatten()
    }

    /// Names that a removal decided at `generation` must keep besides what is in use.
    fn protected(&self, generation: u64) -> Vec<String> {
        let s = self.staging();
        let mut out: Vec<String> = s.in_flight.keys().cloned().collect();
        if let Some((g, name)) = &s.last {
            if *g > generation {
                out.push(name.clone());
            }
        }
        out
    }

    /// The receiver of `node` (the local one is started on first use).
    async fn target(&self, node: &Node) -> Result<Target, String> {
        match node {
            Node::Local => {
                let receiver = self
                    .receiver
                    .get_or_try_init(|| async {
                        let options = rollout_relay::ReceiverOptions {
                            token: self.token.clone(),
                            ..rollout_relay::ReceiverOptions::default()
                        };
                        let r = rollout_relay::Receiver::bind("127.0.0.1:0", self.root.clone()).await?.with_options(options);
                        tracing::info!(addr = %r.local_addr()?, root = %self.root.display(), "weight relay receiver started");
                        r.spawn()
                    })
                    .await
                    .map_err(|e| format!("cannot start the receiver on {}: {e}", self.root.display()))?;
                let root = self.root.clone();
                let (root_id, staged) = tokio::task::spawn_blocking(move || (root_id(&root), staged_names(&root)))
                    .await
                    .map_err(|e| format!("relay directory task failed: {e}"))?;
                let root_id = root_id.map_err(|e| format!("cannot read {}: {e}", self.root.display()))?;
                Ok(Target { node: node.clone(), addr: receiver.local_addr(), root: self.root.clone(), root_id, staged })
            }
            Node::Agent(url) => {
                let agents = self.agents.as_ref().ok_or("this manager does not reach node agents")?;
                let r = agents.relay_endpoint(url).await?;
                let addr = r
                    .addr
                    .parse::<SocketAddr>()
                    .map_err(|e| format!("the agent reported a bad relay address {:?}: {e}", r.addr))?;
                if !Path::new(&r.root).is_absolute() {
                    return Err(format!("the agent reported a relay directory {:?} that is not absolute", r.root));
                }
                Ok(Target {
                    node: node.clone(),
                    addr,
                    root: PathBuf::from(r.root),
                    root_id: r.root_id,
                    staged: r.staged,
                })
            }
        }
    }

    /// Receivers of `nodes`, one per relay directory. Err: every node that cannot be reached.
    async fn targets(&self, nodes: &[Node]) -> Result<Vec<Target>, String> {
        let found = futures::future::join_all(nodes.iter().map(|n| self.target(n))).await;
        let mut out: Vec<Target> = Vec::new();
        let mut errors = Vec::new();
        for (node, t) in nodes.iter().zip(found) {
            match t {
                Ok(t) => {
                    if !out.iter().any(|o| o.root_id == t.root_id || o.addr == t.addr) {
                        out.push(t);
                    }
                }
                Err(e) => errors.push(format!("{node}: {e}")),
            }
        }
        if errors.is_empty() {
            Ok(out)
        } else {
            Err(errors.join("; "))
        }
    }

    /// Sends `version` as `name` to `targets` (the caller holds `sending`). On any failure,
    /// the copies this send created are removed again and the error names the failed nodes.
    async fn send(&self, version: &WeightVersion, name: &str, targets: &[Target]) -> Result<(), String> {
        let source = version.path.as_deref().ok_or("the version has no checkpoint path")?;
        let chain: Vec<SocketAddr> = targets.iter().map(|t| t.addr).collect();
        let options = rollout_relay::SendOptions { token: self.token.clone(), ..rollout_relay::SendOptions::default() };
        *self.staging().in_flight.entry(name.to_string()).or_default() += 1;
        let sent = rollout_relay::send(name, Path::new(source), &chain, &options).await;
        {
            let mut s = self.staging();
            if let Some(n) = s.in_flight.get_mut(name) {
                *n -= 1;
                if *n == 0 {
                    s.in_flight.remove(name);
                }
            }
            s.generation += 1;
            let generation = s.generation;
            s.last = Some((generation, name.to_string()));
        }
        let report = sent.map_err(|e| e.to_string())?;
        let mut problem = None;
        if !report.all_ok() {
            let errors: Vec<String> = targets
                .iter()
                .zip(&report.receivers)
                .filter_map(|(t, r)| r.error.as_ref().map(|e| format!("{}: {e}", t.shown())))
                .collect();
            problem = Some(errors.join("; "));
        } else if version.checksum.as_deref().is_some_and(|c| c != report.checksum) {
            problem = Some(format!(
                "the relayed copy's checksum {} differs from the published {:?}; the source changed while it was sent",
                report.checksum, version.checksum
            ));
        }
        let Some(problem) = problem else {
            let nodes: Vec<String> = targets.iter().map(Target::shown).collect();
            tracing::info!(version = %version.version, name, bytes = report.bytes, seconds = report.seconds, ?nodes, "weights staged by the relay");
            return Ok(());
        };
        // Undo what this send added (copies that were there before stay).
        for (t, r) in targets.iter().zip(&report.receivers) {
            if !r.ok || r.already_present || t.staged.iter().any(|s| s == name) {
                continue;
            }
            match &t.node {
                Node::Local => {
                    let dir = t.root.join(name);
                    if let Err(e) = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await {
                        tracing::warn!(error = %e, "cannot remove a copy of a failed send");
                    }
                }
                Node::Agent(url) => {
                    if let Some(agents) = &self.agents {
                        if let Err(e) = agents.relay_retain(url, t.staged.clone()).await {
                            tracing::warn!(agent = %url, error = %e, "cannot remove a copy of a failed send");
                        }
                    }
                }
            }
        }
        Err(problem)
    }
}

impl WeightTransport for Relay {
    fn name(&self) -> &'static str {
        "relay"
    }

    fn stage<'a>(
        &'a self,
        version: &'a WeightVersion,
        nodes: &'a [Node],
    ) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            let fail =
                |reason: String| TransportError::Stage { transport: "relay", version: version.version.clone(), reason };
            if version.path.is_none() {
                return Err(fail("the version has no checkpoint path".into()));
            }
            let inner = &self.inner;
            let name = Relay::staged_name(version);
            let path = inner.root.join(&name).display().to_string();
            if nodes.is_empty() {
                tracing::info!(version = %version.version, "no node hosts engines yet; each node gets the version when an engine there loads it");
                return Ok(path);
            }
            let _sending = inner.sending.lock().await;
            let targets =
                inner.targets(nodes).await.map_err(|e| fail(format!("cannot reach a relay receiver: {e}")))?;
            inner.send(version, &name, &targets).await.map_err(fail)?;
            Ok(path)
        })
    }

    fn path_on<'a>(
        &'a self,
        version: &'a WeightVersion,
        staged: &'a str,
        node: &'a Node,
    ) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            let inner = &self.inner;
            let Some(name) = inner.name_of(staged) else { return Ok(staged.to_string()) };
            let fail = |reason: String| TransportError::Stage {
                transport: "relay",
                version: version.version.clone(),
                reason: format!("on {node}: {reason}"),
            };
            let _sending = inner.sending.lock().await;
            let target = inner.target(node).await.map_err(fail)?;
            if !target.staged.contains(&name) {
                tracing::info!(version = %version.version, %node, "the node does not hold the version; staging it there");
                inner.send(version, &name, std::slice::from_ref(&target)).await.map_err(fail)?;
            }
            Ok(target.root.join(&name).display().to_string())
        })
    }

    fn retain(&self, keep: &[String], nodes: &[Node]) -> BoxFuture<'static, ()> {
        let inner = self.inner.clone();
        let mut keep: Vec<String> = keep.iter().filter_map(|p| inner.name_of(p)).collect();
        let generation = inner.staging().generation;
        let mut local_keep = keep.clone();
        local_keep.extend(inner.protected(generation));
        prune(&inner.root, &local_keep);
        let mut agents: Vec<String> = Vec::new();
        for node in nodes {
            if let Node::Agent(url) = node {
                if !agents.contains(url) {
                    agents.push(url.clone());
                }
            }
        }
        Box::pin(async move {
            let Some(relays) = inner.agents.clone() else { return };
            if agents.is_empty() {
                return;
            }
            let _sending = inner.sending.lock().await;
            keep.extend(inner.protected(generation));
            for url in agents {
                match relays.relay_retain(&url, keep.clone()).await {
                    Ok(removed) if !removed.is_empty() => {
                        tracing::info!(agent = %url, ?removed, "removed staged weight versions no longer in use")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(agent = %url, error = %e, "cannot remove staged weight versions"),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::engine_host::tests::start_agent_at;
    use crate::adapters::engine_host::AgentHost;

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rm-relay-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A checkpoint directory of `version` and its record (checksum from the relay's manifest).
    fn checkpoint(dir: &Path, version: &str, seed: u8) -> WeightVersion {
        let src = dir.join(format!("ckpt-{version}"));
        std::fs::create_dir_all(&src).unwrap();
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        std::fs::write(src.join("model.safetensors"), bytes).unwrap();
        std::fs::write(src.join("config.json"), b"{}").unwrap();
        let checksum = rollout_relay::Manifest::build(version, &src).unwrap().checksum;
        WeightVersion {
            version: version.into(),
            path: Some(src.display().to_string()),
            checksum: Some(checksum),
            published_seq: 0,
        }
    }

    fn token_file(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("token");
        std::fs::write(&path, "relay-s3cret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    }

    fn relay(dir: &Path) -> Relay {
        let agents = AgentHost::new(
            tokio_util::sync::CancellationToken::new(),
            tokio_util::task::TaskTracker::new(),
            Some("relay-s3cret"),
        );
        Relay::new(dir.join("local"), Some(relay_token("relay-s3cret")), Some(Arc::new(agents)))
    }

    fn holds(root: &Path, name: &str) -> bool {
        root.join(name).join("model.safetensors").is_file() && staged_names(root).contains(&name.to_string())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relay_stages_on_every_node_once_per_directory_and_retains_everywhere() {
        let dir = temp_dir();
        let token = token_file(&dir);
        let (root_a, root_b, root_d) = (dir.join("node-a"), dir.join("node-b"), dir.join("node-d"));
        let a = start_agent_at(&dir.join("a"), Some(token.clone()), root_a.clone()).await;
        let b = start_agent_at(&dir.join("b"), Some(token.clone()), root_b.clone()).await;
        // A second agent on node a, sharing its relay directory.
        let c = start_agent_at(&dir.join("c"), Some(token.clone()), root_a.clone()).await;
        let relay = relay(&dir);
        let v1 = checkpoint(&dir, "v1", 1);
        let name1 = Relay::staged_name(&v1);
        let nodes = [Node::Local, Node::Agent(a.clone()), Node::Agent(b.clone()), Node::Agent(c.clone())];
        // a and c share a directory: one receiver of the two is in the chain.
        let chain = relay.inner.targets(&nodes).await.unwrap();
        assert_eq!(
            chain.iter().map(|t| t.root.clone()).collect::<Vec<_>>(),
            vec![dir.join("local"), root_a.clone(), root_b.clone()]
        );
        let path = relay.stage(&v1, &nodes).await.unwrap();
        assert_eq!(path, dir.join("local").join(&name1).display().to_string());
        for root in [&dir.join("local"), &root_a, &root_b] {
            assert!(holds(root, &name1), "{} lacks {name1}", root.display());
        }
        // Each engine's path is under its own node's directory.
        let on = |node: Node| {
            let (relay, v1, path) = (&relay, &v1, &path);
            async move { relay.path_on(v1, path, &node).await.unwrap() }
        };
        assert_eq!(on(Node::Agent(b.clone())).await, root_b.join(&name1).display().to_string());
        assert_eq!(on(Node::Agent(c.clone())).await, root_a.join(&name1).display().to_string());
        assert_eq!(on(Node::Local).await, path);
        // A node that joined after the publish gets the version when an engine there needs it.
        let d = start_agent_at(&dir.join("d"), Some(token.clone()), root_d.clone()).await;
        assert!(!holds(&root_d, &name1));
        assert_eq!(on(Node::Agent(d.clone())).await, root_d.join(&name1).display().to_string());
        assert!(holds(&root_d, &name1));
        // A path recorded outside the relay directory is used as it is.
        assert_eq!(relay.path_on(&v1, "/models/base", &Node::Agent(d.clone())).await.unwrap(), "/models/base");

        // v2 on a, b and here; keeping only v2 removes v1 everywhere (d held only v1).
        let v2 = checkpoint(&dir, "v2", 2);
        let name2 = Relay::staged_name(&v2);
        let path2 = relay.stage(&v2, &nodes[..3]).await.unwrap();
        let all = [Node::Local, Node::Agent(a.clone()), Node::Agent(b.clone()), Node::Agent(d.clone())];
        let on_agents = relay.retain(std::slice::from_ref(&path2), &all);
        assert_eq!(staged_names(&dir.join("local")), vec![name2.clone()], "the local copy goes at once");
        on_agents.await;
        assert_eq!(staged_names(&root_a), vec![name2.clone()]);
        assert_eq!(staged_names(&root_b), vec![name2.clone()]);
        assert!(staged_names(&root_d).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_that_fails_fails_the_stage_by_name_and_nothing_stays_staged() {
        let dir = temp_dir();
        let token = token_file(&dir);
        let root_a = dir.join("node-a");
        let a = start_agent_at(&dir.join("a"), Some(token.clone()), root_a.clone()).await;
        let relay = relay(&dir);
        let v1 = checkpoint(&dir, "v1", 1);
        let name = Relay::staged_name(&v1);

        // An agent that does not answer: nothing is sent anywhere.
        let gone = "http://127.0.0.1:1".to_string();
        let nodes = [Node::Local, Node::Agent(a.clone()), Node::Agent(gone.clone())];
        let err = relay.stage(&v1, &nodes).await.unwrap_err().to_string();
        assert!(err.contains(&format!("agent {gone}")) && err.contains("v1"), "{err}");
        assert!(staged_names(&root_a).is_empty() && staged_names(&dir.join("local")).is_empty());

        // A receiver that refuses the transfer (another token) after the others took it: the
        // copies this send made are removed again, and the error names the refusing node.
        let stranger = rollout_relay::Receiver::bind("127.0.0.1:0", dir.join("stranger"))
            .await
            .unwrap()
            .with_options(rollout_relay::ReceiverOptions {
                token: Some("another".into()),
                ..rollout_relay::ReceiverOptions::default()
            })
            .spawn()
            .unwrap();
        let inner = &relay.inner;
        let _sending = inner.sending.lock().await;
        let mut targets = inner.targets(&[Node::Local, Node::Agent(a.clone())]).await.unwrap();
        targets.push(Target {
            node: Node::Agent("http://node-x:1".into()),
            addr: stranger.local_addr(),
            root: dir.join("stranger"),
            root_id: "x".into(),
            staged: vec![],
        });
        let err = inner.send(&v1, &name, &targets).await.unwrap_err();
        assert!(err.contains("agent http://node-x:1") && err.contains("unauthorized"), "{err}");
        assert!(staged_names(&root_a).is_empty(), "{:?}", staged_names(&root_a));
        assert!(staged_names(&dir.join("local")).is_empty());
        assert!(staged_names(&dir.join("stranger")).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_relay_token_is_derived_and_root_ids_name_directories() {
        assert_eq!(relay_token("t"), relay_token("t"));
        assert_ne!(relay_token("t"), relay_token("u"));
        let token = relay_token("s3cret-api-token");
        assert_eq!(token.len(), 64);
        assert!(!token.contains("s3cret"));
        let dir = temp_dir();
        let (x, y) = (dir.join("x"), dir.join("y"));
        assert_eq!(root_id(&x).unwrap(), root_id(&x).unwrap());
        assert_ne!(root_id(&x).unwrap(), root_id(&y).unwrap());
        std::os::unix::fs::symlink(&x, dir.join("x-link")).unwrap();
        assert_eq!(root_id(&dir.join("x-link")).unwrap(), root_id(&x).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
