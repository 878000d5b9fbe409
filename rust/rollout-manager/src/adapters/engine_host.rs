//! Where engine processes live: one [`EngineHost`] interface, two implementations.
//!
//! - [`LocalHost`] (`--placement local`): child processes of the manager ([`crate::foundation::host`]), or,
//!   with `--reattach-grace-secs`, of a keeper ([`crate::adapters::keeper`]).
//! - [`AgentHost`] (`--placement ray`): processes of a node agent (`rollout-manager agent`,
//!   [`crate::app::agent`]) reached over gRPC at the URL the Ray shim bound to the placement.
//!
//! Both hand back an [`EngineProcess`]: `stop` (SIGINT to the engine, SIGKILL to its group after a grace; for an
//! agent, its Stop RPC) and `wait` (how the process ended; for an agent, its EXITED event). So
//! launch, stop, status and events have one shape, and the manager's lifecycle code (crash
//! watch, recovery, scale-in, shutdown) is the same in both modes.
//!
//! Agent connections: one lazily connected gRPC channel per agent URL (connect timeout 3 s;
//! tonic reconnects it). A task per agent follows its Events stream; after every (re)subscribe
//! it reads `List` to learn exits it missed while disconnected. An agent unreachable for
//! [`AGENT_LOST`] is taken for dead: every engine it hosted is reported exited (agents take their
//! engines with them), so crash recovery starts them again once an agent is bound. With an API
//! token (`--api-token-file` / `ROLLOUT_MANAGER_API_TOKEN`) every call carries it as
//! `authorization: Bearer <token>`; agents started with the same token refuse calls without it.

use crate::foundation::host::{EngineProcess, ExitInfo, HostError, LaunchSpec};
use crate::foundation::locks::Locked;
use rollout_proto::agent as pb;
use rollout_proto::agent::agent_client::AgentClient;
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// Adds the manager's API token to every agent call.
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Bearer {
    pub fn new(token: Option<&str>) -> Self {
        Self(token.and_then(|t| format!("Bearer {t}").parse().ok()))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

type Client = AgentClient<InterceptedService<Channel, Bearer>>;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How long an agent may be unreachable before its engines are taken for dead.
pub const AGENT_LOST: Duration = Duration::from_secs(10);

/// Where an engine runs (or is to run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// On this machine at `url`; under a keeper listening on `keeper_socket` if set.
    Local { url: String, keeper_socket: Option<PathBuf> },
    /// On the node agent at `agent_url`.
    Agent { agent_url: String },
}

/// A started (or re-adopted) engine.
#[derive(Debug, Clone)]
pub struct Hosted {
    pub process: EngineProcess,
    /// The engine's base URL (chosen by the agent in Ray mode).
    pub url: String,
    pub keeper_socket: Option<PathBuf>,
    /// Where its log is (on the engine's node).
    pub log_path: Option<PathBuf>,
}

/// Launch, stop, status and events of engine processes (stop and events through the returned
/// [`EngineProcess`]).
pub trait EngineHost: Send + Sync {
    /// Starts the engine described by `spec` at `at`.
    fn launch<'a>(
        &'a self,
        engine_id: &'a str,
        spec: &'a LaunchSpec,
        at: &'a Location,
    ) -> BoxFuture<'a, Result<Hosted, HostError>>;

    /// The engine's process if it still runs at `at` and is the recorded one (same pid and
    /// process start time): how a restarted manager re-adopts engines.
    fn status<'a>(
        &'a self,
        engine_id: &'a str,
        at: &'a Location,
        pid: Option<u32>,
        start_ticks: Option<u64>,
    ) -> BoxFuture<'a, Option<EngineProcess>>;
}

/// Child processes on this machine.
pub struct LocalHost {
    /// `--reattach-grace-secs`: > 0 runs each engine under a keeper.
    pub reattach_grace: Duration,
}

impl EngineHost for LocalHost {
    fn launch<'a>(
        &'a self,
        _engine_id: &'a str,
        spec: &'a LaunchSpec,
        at: &'a Location,
    ) -> BoxFuture<'a, Result<Hosted, HostError>> {
        Box::pin(async move {
            let Location::Local { url, keeper_socket } = at else {
                return Err(HostError::Spawn {
                    program: spec.program.clone(),
                    source: std::io::Error::other("the local host cannot launch on an agent"),
                });
            };
            let process = match keeper_socket {
                Some(socket) if !self.reattach_grace.is_zero() => {
                    crate::adapters::keeper::spawn_kept(spec, socket, self.reattach_grace).await?
                }
                _ => crate::foundation::host::spawn(spec)?,
            };
            Ok(Hosted {
                process,
                url: url.clone(),
                keeper_socket: keeper_socket.clone(),
                log_path: Some(spec.log_path.clone()),
            })
        })
    }

    fn status<'a>(
        &'a self,
        engine_id: &'a str,
        at: &'a Location,
        pid: Option<u32>,
        start_ticks: Option<u64>,
    ) -> BoxFuture<'a, Option<EngineProcess>> {
        Box::pin(async move {
            let Location::Local { keeper_socket: Some(socket), .. } = at else { return None };
            let process = crate::adapters::keeper::attach(socket).await.ok()?;
            if Some(process.pid) == pid && process.start_ticks.is_some() && process.start_ticks == start_ticks {
                return Some(process);
            }
            tracing::warn!(engine_id, pid = process.pid, "keeper's engine is not the recorded process; stopping it");
            process.stop(Duration::from_secs(5)).await;
            None
        })
    }
}

/// One agent: its channel and the exit watches of the engines it hosts for us.
struct AgentConn {
    client: Client,
    exits: Mutex<HashMap<String, watch::Sender<Option<ExitInfo>>>>,
    /// Engines whose Stop is in flight: the agent already forgot them, so their absence from
    /// `List` is that stop, not a crash (their exit comes from Stop's answer).
    stopping: Mutex<std::collections::HashSet<String>>,
}

impl AgentConn {
    fn watched(&self) -> Vec<String> {
        self.exits.locked().keys().cloned().collect()
    }

    fn stopping(&self, engine_id: &str) -> bool {
        self.stopping.locked().contains(engine_id)
    }

    /// Reports how an engine ended (once; later reports are ignored) and stops watching it.
    fn publish(&self, engine_id: &str, info: ExitInfo) {
        let tx = self.exits.locked().remove(engine_id);
        if let Some(tx) = tx {
            tx.send_if_modified(|v| {
                if v.is_none() {
                    *v = Some(info);
                    true
                } else {
                    false
                }
            });
        }
    }
}

fn from_pb(e: Option<pb::ExitInfo>, requested: bool) -> ExitInfo {
    match e {
        Some(e) => ExitInfo { code: e.code, signal: e.signal, requested: e.requested || requested },
        None => ExitInfo { code: None, signal: None, requested },
    }
}

/// Engines on node agents, over gRPC.
type Conns = Arc<Mutex<HashMap<String, Arc<AgentConn>>>>;

/// Clones share the connections.
#[derive(Clone)]
pub struct AgentHost {
    conns: Conns,
    /// Ends the per-agent event tasks.
    shutdown: CancellationToken,
    tasks: tokio_util::task::TaskTracker,
    bearer: Bearer,
    /// Every agent found gone with engines of ours on it, and why (see [`Self::lost_agents`]).
    lost: tokio::sync::broadcast::Sender<(String, String)>,
}

fn agent_error(url: &str, what: &str, e: impl std::fmt::Display) -> HostError {
    HostError::Spawn {
        program: PathBuf::from(format!("agent {url}")),
        source: std::io::Error::other(format!("{what}: {e}")),
    }
}

impl AgentHost {
    pub fn new(shutdown: CancellationToken, tasks: tokio_util::task::TaskTracker, token: Option<&str>) -> Self {
        let (lost, _) = tokio::sync::broadcast::channel(64);
        Self { conns: Arc::default(), shutdown, tasks, bearer: Bearer::new(token), lost }
    }

    /// Agents found gone while hosting engines of ours: refusing connections (nothing listens
    /// on their port any more, so their engines went with them) or unreachable for
    /// [`AGENT_LOST`]. Their engines are reported exited before the URL is sent here.
    pub fn lost_agents(&self) -> tokio::sync::broadcast::Receiver<(String, String)> {
        self.lost.subscribe()
    }

    fn endpoint(url: &str) -> Result<tonic::transport::Endpoint, HostError> {
        tonic::transport::Endpoint::from_shared(url.to_string())
            .map(|e| e.connect_timeout(Duration::from_secs(3)).tcp_nodelay(true))
            .map_err(|e| agent_error(url, "invalid agent URL", e))
    }

    /// The connection to the agent at `url`, created (with its event task) on first use.
    fn conn(&self, url: &str) -> Result<Arc<AgentConn>, HostError> {
        let mut conns = self.conns.locked();
        if let Some(c) = conns.get(url) {
            return Ok(c.clone());
        }
        let channel = Self::endpoint(url)?.connect_lazy();
        let client = AgentClient::with_interceptor(channel, self.bearer.clone());
        let conn = Arc::new(AgentConn { client, exits: Mutex::new(HashMap::new()), stopping: Mutex::default() });
        conns.insert(url.to_string(), conn.clone());
        let lost = self.lost.clone();
        self.tasks.spawn(follow_events(url.to_string(), conn.clone(), self.conns.clone(), lost, self.shutdown.clone()));
        Ok(conn)
    }

    /// Whether an agent answers at `url` within 2 s (a fresh connection, not the cached one).
    pub async fn is_live(&self, url: &str) -> bool {
        let Ok(endpoint) = Self::endpoint(url) else { return false };
        let check = async {
            let channel = endpoint.connect().await.ok()?;
            AgentClient::with_interceptor(channel, self.bearer.clone()).list(pb::ListRequest {}).await.ok()
        };
        matches!(tokio::time::timeout(Duration::from_secs(2), check).await, Ok(Some(_)))
    }

    /// Reports the engine as exited (not on request) and forgets its watch: used when its
    /// placement is re-bound to a new agent because the old one is gone.
    pub fn forget(&self, url: &str, engine_id: &str) {
        let conn = self.conns.locked().get(url).cloned();
        if let Some(conn) = conn {
            conn.publish(engine_id, ExitInfo { code: None, signal: None, requested: false });
        }
    }

    /// A process handle for an engine on `conn`: stop goes to the agent's Stop; the exit comes
    /// from its events (or from Stop's answer).
    fn handle(&self, conn: &Arc<AgentConn>, engine_id: &str, pid: u32, start_ticks: Option<u64>) -> EngineProcess {
        let (exit_tx, exit_rx) = watch::channel(None);
        conn.exits.locked().insert(engine_id.to_string(), exit_tx);
        let (stop_tx, mut stop_rx) = mpsc::channel::<Duration>(1);
        let (conn, id, mut ended) = (conn.clone(), engine_id.to_string(), exit_rx.clone());
        self.tasks.spawn(async move {
            tokio::select! {
                grace = stop_rx.recv() => {
                    // Every handle dropped: the engine is left to its agent.
                    let Some(grace) = grace else { return };
                    conn.stopping.locked().insert(id.clone());
                    let mut client = conn.client.clone();
                    let request = pb::StopRequest { engine_id: id.clone(), grace_ms: grace.as_millis() as u64 };
                    let info = match tokio::time::timeout(grace + Duration::from_secs(15), client.stop(request)).await {
                        Ok(Ok(reply)) => from_pb(reply.into_inner().exit, true),
                        Ok(Err(e)) => {
                            tracing::warn!(engine_id = %id, error = %e, "agent Stop failed; taking the engine as gone");
                            ExitInfo { code: None, signal: None, requested: true }
                        }
                        Err(_) => {
                            tracing::warn!(engine_id = %id, "agent Stop timed out; taking the engine as gone");
                            ExitInfo { code: None, signal: None, requested: true }
                        }
                    };
                    conn.publish(&id, info);
                    conn.stopping.locked().remove(&id);
                }
                () = async { let _ = ended.wait_for(Option::is_some).await; } => {}
            }
        });
        EngineProcess::from_parts(pid, start_ticks, stop_tx, exit_rx)
    }
}

/// Whether connecting to the agent at `url` is refused: its host answers but nothing listens on
/// the port, so the agent process is gone (and its engines, which die with it).
async fn refused(url: &str) -> bool {
    let Ok(parsed) = reqwest::Url::parse(url) else { return false };
    let (Some(host), Some(port)) = (parsed.host_str(), parsed.port_or_known_default()) else { return false };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let connect = tokio::net::TcpStream::connect((host, port));
    matches!(
        tokio::time::timeout(Duration::from_secs(1), connect).await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// Follows one agent's Events stream until shutdown, or until the agent has been unreachable for
/// [`AGENT_LOST`] with no engine of ours on it (a released agent): then the connection is
/// dropped, and made again if the URL is used later. An agent that refuses connections is gone
/// at once; one that does not answer is given [`AGENT_LOST`] (a network blip is not a loss).
/// Either way its engines are reported exited and its URL is sent to `lost`. See the module docs.
async fn follow_events(
    url: String,
    conn: Arc<AgentConn>,
    conns: Conns,
    lost: tokio::sync::broadcast::Sender<(String, String)>,
    shutdown: CancellationToken,
) {
    let mut lost_since: Option<tokio::time::Instant> = None;
    loop {
        let mut client = conn.client.clone();
        let subscribed = tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(5), client.events(pb::EventsRequest {})) => r,
            () = shutdown.cancelled() => return,
        };
        match subscribed {
            Ok(Ok(response)) => {
                if lost_since.take().is_some() {
                    tracing::info!(agent = %url, "agent reachable again");
                }
                let mut stream = response.into_inner();
                // Exits that happened while we were not listening. Only engines watched before
                // the List was sent are checked: one launched meanwhile (its Launch answered
                // after the agent built the list) is missing from it without having exited.
                let watched = conn.watched();
                if let Ok(Ok(list)) =
                    tokio::time::timeout(Duration::from_secs(5), client.list(pb::ListRequest {})).await
                {
                    let list = list.into_inner().engines;
                    for id in watched.into_iter().filter(|id| !conn.stopping(id)) {
                        match list.iter().find(|e| e.engine_id == id) {
                            Some(e) if e.running => {}
                            Some(e) => conn.publish(&id, from_pb(e.exit, false)),
                            None => conn.publish(&id, ExitInfo { code: None, signal: None, requested: false }),
                        }
                    }
                }
                loop {
                    let msg = tokio::select! {
                        m = stream.message() => m,
                        () = shutdown.cancelled() => return,
                    };
                    match msg {
                        Ok(Some(ev)) if ev.kind == pb::engine_event::Kind::Exited as i32 => {
                            if conn.watched().contains(&ev.engine_id) {
                                let info = from_pb(ev.exit, false);
                                if !info.requested {
                                    let tail: String = ev
                                        .log_tail
                                        .lines()
                                        .rev()
                                        .take(10)
                                        .collect::<Vec<_>>()
                                        .into_iter()
                                        .rev()
                                        .collect::<Vec<_>>()
                                        .join("\n");
                                    tracing::warn!(agent = %url, engine_id = %ev.engine_id, exit = %info, log_tail = %tail, "engine exited on its agent");
                                }
                                conn.publish(&ev.engine_id, info);
                            }
                        }
                        Ok(Some(ev)) => {
                            tracing::debug!(agent = %url, engine_id = %ev.engine_id, kind = ev.kind, "agent event")
                        }
                        Ok(None) | Err(_) => break,
                    }
                }
                tracing::warn!(agent = %url, "agent event stream ended; reconnecting");
            }
            _ => {
                let since = *lost_since.get_or_insert_with(tokio::time::Instant::now);
                if gone_for_good(&url, &conn, &conns, &lost, since).await {
                    return;
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// After a failed subscription: when the agent refuses connections, or has been unreachable
/// since `since` for [`AGENT_LOST`], its engines are reported exited and its URL sent to `lost`;
/// true when its connection was dropped too (nothing was launched through it meanwhile).
async fn gone_for_good(
    url: &str,
    conn: &Arc<AgentConn>,
    conns: &Conns,
    lost: &tokio::sync::broadcast::Sender<(String, String)>,
    since: tokio::time::Instant,
) -> bool {
    let gone = refused(url).await;
    if gone || since.elapsed() >= AGENT_LOST {
        let watched = conn.watched();
        let why = if gone { "refuses connections".to_string() } else { format!("unreachable for {AGENT_LOST:?}") };
        for id in &watched {
            tracing::warn!(agent = %url, engine_id = %id, "agent {why}; taking its engine as exited");
            conn.publish(id, ExitInfo { code: None, signal: None, requested: false });
        }
        if !watched.is_empty() {
            let _ = lost.send((url.to_string(), why.clone())); // no receiver: nobody to tell
        }
        let mut map = conns.locked();
        // Only this connection, and only while nothing new was launched through it.
        if map.get(url).is_some_and(|c| Arc::ptr_eq(c, conn)) && conn.watched().is_empty() {
            map.remove(url);
            tracing::info!(agent = %url, "agent gone; connection dropped");
            return true;
        }
    }
    false
}

impl crate::adapters::weights::transport::AgentRelays for AgentHost {
    fn relay_endpoint<'a>(
        &'a self,
        agent_url: &'a str,
    ) -> BoxFuture<'a, Result<crate::adapters::weights::transport::RemoteRelay, String>> {
        Box::pin(async move {
            let mut client = self.conn(agent_url).map_err(|e| e.to_string())?.client.clone();
            let reply =
                tokio::time::timeout(Duration::from_secs(15), client.relay_endpoint(pb::RelayEndpointRequest {}))
                    .await
                    .map_err(|_| "RelayEndpoint: no answer within 15 s".to_string())?
                    .map_err(|e| relay_status("RelayEndpoint", &e))?
                    .into_inner();
            Ok(crate::adapters::weights::transport::RemoteRelay {
                addr: reply.addr,
                root: reply.root,
                root_id: reply.root_id,
                staged: reply.staged,
            })
        })
    }

    fn relay_retain<'a>(&'a self, agent_url: &'a str, keep: Vec<String>) -> BoxFuture<'a, Result<Vec<String>, String>> {
        Box::pin(async move {
            let mut client = self.conn(agent_url).map_err(|e| e.to_string())?.client.clone();
            let reply =
                tokio::time::timeout(Duration::from_secs(60), client.relay_retain(pb::RelayRetainRequest { keep }))
                    .await
                    .map_err(|_| "RelayRetain: no answer within 60 s".to_string())?
                    .map_err(|e| relay_status("RelayRetain", &e))?
                    .into_inner();
            Ok(reply.removed)
        })
    }
}

/// An agent's relay call failed: its message, with a hint for agents built before the relay.
fn relay_status(call: &str, status: &tonic::Status) -> String {
    if status.code() == tonic::Code::Unimplemented {
        return format!("{call}: the agent has no weight relay (an older rollout-manager agent; upgrade it)");
    }
    // A connection failure says only "transport error"; its cause is in the source chain.
    let mut text = format!("{call}: {}", status.message());
    let mut cause = std::error::Error::source(status);
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text.push_str(&format!(": {c_text}"));
        }
        cause = c.source();
    }
    text
}

impl EngineHost for AgentHost {
    fn launch<'a>(
        &'a self,
        engine_id: &'a str,
        spec: &'a LaunchSpec,
        at: &'a Location,
    ) -> BoxFuture<'a, Result<Hosted, HostError>> {
        Box::pin(async move {
            let Location::Agent { agent_url } = at else {
                return Err(agent_error("?", "launch", "an agent engine needs an agent URL"));
            };
            let conn = self.conn(agent_url)?;
            let request = pb::LaunchRequest {
                engine_id: engine_id.to_string(),
                program: spec.program.display().to_string(),
                args: spec.args.clone(),
                env: spec.env.iter().cloned().collect(),
                port_hint: 0,
                log_path: String::new(),
                health_path: String::new(),
            };
            let mut client = conn.client.clone();
            let reply = tokio::time::timeout(Duration::from_secs(30), client.launch(request))
                .await
                .map_err(|_| agent_error(agent_url, "Launch", "no answer within 30 s"))?
                .map_err(|e| agent_error(agent_url, "Launch", e.message()))?
                .into_inner();
            let ticks = (reply.start_ticks != 0).then_some(reply.start_ticks);
            let process = self.handle(&conn, engine_id, reply.pid, ticks);
            // It may have exited before we watched it: ask once.
            if let Ok(Ok(info)) = tokio::time::timeout(
                Duration::from_secs(5),
                client.status(pb::StatusRequest { engine_id: engine_id.to_string() }),
            )
            .await
            {
                let info = info.into_inner();
                if !info.running && info.pid == reply.pid {
                    conn.publish(engine_id, from_pb(info.exit, false));
                }
            }
            let log_path = (!reply.log_path.is_empty()).then(|| PathBuf::from(&reply.log_path));
            Ok(Hosted { process, url: reply.url, keeper_socket: None, log_path })
        })
    }

    fn status<'a>(
        &'a self,
        engine_id: &'a str,
        at: &'a Location,
        pid: Option<u32>,
        start_ticks: Option<u64>,
    ) -> BoxFuture<'a, Option<EngineProcess>> {
        Box::pin(async move {
            let Location::Agent { agent_url } = at else { return None };
            let conn = self.conn(agent_url).ok()?;
            let mut client = conn.client.clone();
            let request = pb::StatusRequest { engine_id: engine_id.to_string() };
            let info =
                tokio::time::timeout(Duration::from_secs(5), client.status(request)).await.ok()?.ok()?.into_inner();
            let ticks = (info.start_ticks != 0).then_some(info.start_ticks);
            if !info.running || Some(info.pid) != pid || (start_ticks.is_some() && ticks != start_ticks) {
                tracing::warn!(engine_id, agent = %agent_url, running = info.running, pid = info.pid, "the agent's engine is not the recorded, running process");
                return None;
            }
            Some(self.handle(&conn, engine_id, info.pid, ticks))
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![expect(clippy::disallowed_methods, reason = "test servers and tasks live as long as their test")]
    use super::*;

    async fn start_agent(dir: &std::path::Path, token_file: Option<PathBuf>) -> String {
        start_agent_at(dir, token_file, dir.join("relay")).await
    }

    /// Runs `rollout-manager agent` in this process (files under `dir`, weight relay directory
    /// `relay_dir`); returns its URL once it listens.
    pub(crate) async fn start_agent_at(
        dir: &std::path::Path,
        token_file: Option<PathBuf>,
        relay_dir: PathBuf,
    ) -> String {
        std::fs::create_dir_all(dir).unwrap();
        let args = crate::app::agent::AgentArgs {
            listen: "127.0.0.1:0".into(),
            ready_file: Some(dir.join("ready.json")),
            state_dir: Some(dir.join("state")),
            api_token_file: token_file,
            relay_dir,
        };
        tokio::spawn(crate::app::agent::run(args));
        for _ in 0..500 {
            if let Ok(text) = std::fs::read_to_string(dir.join("ready.json")) {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                return v["url"].as_str().unwrap().to_string();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("agent never wrote its ready file");
    }

    fn alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
            .unwrap_or(false)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn agent_host_launches_reports_exits_readopts_and_stops() {
        let dir = std::env::temp_dir().join(format!("rm-agent-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = start_agent(&dir, None).await;
        let host = AgentHost::new(CancellationToken::new(), tokio_util::task::TaskTracker::new(), None);
        let spec = LaunchSpec {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "echo port={port} host={host}; exec sleep 1000".into()],
            env: vec![],
            log_path: PathBuf::new(),
        };
        let at = Location::Agent { agent_url: url.clone() };
        let hosted = host.launch("engine_7", &spec, &at).await.unwrap();
        let port = hosted.url.rsplit(':').next().unwrap().to_string();
        assert!(hosted.url.starts_with("http://127.0.0.1:"), "{}", hosted.url);
        let log = hosted.log_path.clone().unwrap();
        let mut text = String::new();
        for _ in 0..200 {
            text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains('\n') {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(text.trim(), format!("port={port} host=127.0.0.1"));

        // A crash reaches the manager through the Events stream, not on request.
        let pid = hosted.process.pid;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), hosted.process.wait()).await.unwrap();
        assert_eq!(exit, ExitInfo { code: None, signal: Some(9), requested: false });

        // Launch again; a second host (a restarted manager) re-adopts it by Status, checking the
        // identity; stop goes through the agent and the engine is gone afterwards.
        let again = host.launch("engine_7", &spec, &at).await.unwrap();
        assert_ne!(again.process.pid, pid);
        let restarted = AgentHost::new(CancellationToken::new(), tokio_util::task::TaskTracker::new(), None);
        let pid2 = again.process.pid;
        assert!(restarted.status("engine_7", &at, Some(pid2), Some(pid2 as u64 + 1)).await.is_none());
        let adopted = restarted.status("engine_7", &at, Some(pid2), again.process.start_ticks).await.unwrap();
        assert_eq!(adopted.pid, pid2);
        let stopped = tokio::time::timeout(Duration::from_secs(10), adopted.stop(Duration::from_millis(500))).await;
        assert!(stopped.unwrap().requested);
        assert!(!alive(pid2));
        assert!(restarted.status("engine_7", &at, Some(pid2), None).await.is_none());
        assert!(host.is_live(&url).await);
        assert!(!host.is_live("http://127.0.0.1:1").await);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_agent_with_a_token_refuses_calls_without_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rm-agent-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "agent-s3cret\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        let url = start_agent(&dir, Some(token)).await;
        let spec = LaunchSpec { program: "/bin/true".into(), args: vec![], env: vec![], log_path: PathBuf::new() };
        let at = Location::Agent { agent_url: url.clone() };
        let (stop, tasks) = (CancellationToken::new(), tokio_util::task::TaskTracker::new());
        let anonymous = AgentHost::new(stop.clone(), tasks.clone(), None);
        assert!(!anonymous.is_live(&url).await);
        let err = anonymous.launch("engine_1", &spec, &at).await.unwrap_err().to_string();
        assert!(err.contains("authorization"), "{err}");
        let wrong = AgentHost::new(stop.clone(), tasks.clone(), Some("nope"));
        assert!(!wrong.is_live(&url).await);
        let manager = AgentHost::new(stop.clone(), tasks.clone(), Some("agent-s3cret"));
        assert!(manager.is_live(&url).await);
        let hosted = manager.launch("engine_1", &spec, &at).await.unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), hosted.process.wait()).await.unwrap();
        assert_eq!(exit.code, Some(0));
        stop.cancel();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
