//! `rollout-manager agent`: the node agent that hosts engine processes on one node for a manager
//! elsewhere (Ray mode, see docs/ray.md), over gRPC (`rollout-proto`, service `Agent`).
//!
//! Expected flow: the agent binds `--listen` (port 0 picks a free one), writes
//! `{"url": "http://host:port"}` to `--ready-file` (temp file + rename, so a reader never sees a
//! half-written file), and serves Launch / Stop / Status / List / Events until SIGTERM, SIGINT,
//! or the death of its parent process (the Ray host actor); then it stops every engine and exits.
//!
//! Guarantees:
//! - engines are started by [`crate::foundation::host::spawn`]: own process group, PDEATHSIG to the agent,
//!   reaped by their supervisor; so an agent killed by SIGKILL takes its engines with it;
//! - Launch is idempotent per engine id while the engine runs; `{port}` and `{host}` in the
//!   arguments become the engine's port (picked on this node when the hint is 0) and the host the
//!   agent listens on;
//! - every process event is published on the Events stream: STARTED after the fork, READY once
//!   the engine's health path answers 200, EXITED (code, signal, last 4 KiB of its log);
//! - an exited engine stays listed (not running, with its exit) until Stop or a new Launch, so
//!   a manager that reconnects learns of exits it missed.
//!
//! Weight relay: on the first `RelayEndpoint` call the agent starts a `rollout-relay` receiver
//! bound to its listen host (a free port), writing under `--relay-dir` (default
//! `/dev/shm/elastic-rollout`, the manager's default), and answers its address, the directory,
//! an id of that directory on this machine (agents sharing a directory hold one copy of each
//! version, and the manager sends it once) and the staged versions there. `RelayRetain` removes
//! staged versions the manager no longer uses. With a token the receiver requires the relay
//! token derived from it ([`crate::adapters::weights::transport::relay_token`]).
//!
//! Auth: with `--api-token-file` (or `ROLLOUT_MANAGER_API_TOKEN`, the manager's token) every call
//! must carry `authorization: Bearer <token>` (UNAUTHENTICATED otherwise); the token is never
//! passed to engines. Without one, an agent listening beyond loopback warns that anyone who
//! reaches it can start programs.
//!
//! Errors are gRPC statuses: INVALID_ARGUMENT for a bad request (naming the field),
//! NOT_FOUND for an unknown engine, INTERNAL when the process cannot be started.

use crate::foundation::host::{self, EngineProcess, ExitInfo, LaunchSpec};
use crate::foundation::locks::Locked;
use rollout_proto::agent as pb;
use rollout_proto::agent::agent_server::{Agent, AgentServer};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

/// Arguments of `rollout-manager agent`.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// Address to serve gRPC on, HOST:PORT (port 0 picks a free port). Give the node's IP when
    /// the manager runs on another node; HOST is also where engines listen.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Once listening, write `{"url": "http://host:port"}` here.
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
    /// Directory of engine logs (default: a private directory under the system temp dir).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// File (mode 0600) with the manager's API token; then every call needs it. Default: the
    /// environment variable ROLLOUT_MANAGER_API_TOKEN, if set.
    #[arg(long, value_name = "PATH")]
    pub api_token_file: Option<PathBuf>,
    /// Node-local directory where this node's weight relay receiver stages versions (relay
    /// transport). Agents on one machine that share it hold one copy of each version; give
    /// each agent its own only when they must not share (tests simulating several nodes).
    #[arg(long, value_name = "DIR", default_value = "/dev/shm/elastic-rollout")]
    pub relay_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid --listen {0:?}: expected HOST:PORT, e.g. 10.0.0.5:0")]
    Listen(String),
    #[error("--listen {0:?}: give the node's own IP (engines listen there and the manager reaches them by it), not an unspecified address")]
    Unspecified(String),
    #[error("cannot bind --listen {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("cannot create --state-dir {path}: {source}")]
    StateDir { path: String, source: std::io::Error },
    #[error("--relay-dir {0:?}: cannot resolve it to an absolute path: {1}")]
    RelayDir(String, std::io::Error),
    #[error("cannot write --ready-file {path}: {source}")]
    ReadyFile { path: String, source: std::io::Error },
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error(transparent)]
    Token(#[from] crate::foundation::auth::TokenError),
}

/// One engine hosted here.
struct Hosted {
    process: EngineProcess,
    port: u16,
    url: String,
    log_path: PathBuf,
}

struct AgentState {
    /// The host part of `--listen`: where engines listen and how URLs name this node.
    host: String,
    state_dir: PathBuf,
    engines: Mutex<HashMap<String, Hosted>>,
    events: broadcast::Sender<pb::EngineEvent>,
    http: reqwest::Client,
    /// Cancelled when the agent stops: ends every Events stream, so shutdown never waits on a
    /// subscriber.
    stopping: tokio_util::sync::CancellationToken,
    /// `--relay-dir`, absolute.
    relay_dir: PathBuf,
    /// What the relay receiver requires, derived from the API token.
    relay_token: Option<String>,
    /// The relay receiver, started by the first `RelayEndpoint`.
    relay: tokio::sync::Mutex<Option<rollout_relay::ReceiverHandle>>,
}

impl AgentState {
    fn engines(&self) -> std::sync::MutexGuard<'_, HashMap<String, Hosted>> {
        self.engines.locked()
    }

    fn info(engine_id: &str, h: &Hosted) -> pb::EngineInfo {
        let exit = h.process.exit_info();
        pb::EngineInfo {
            engine_id: engine_id.to_string(),
            pid: h.process.pid,
            port: u32::from(h.port),
            start_ticks: h.process.start_ticks.unwrap_or(0),
            url: h.url.clone(),
            running: exit.is_none(),
            exit: exit.map(|e| to_pb(&e)),
            log_path: h.log_path.display().to_string(),
        }
    }
}

fn to_pb(e: &ExitInfo) -> pb::ExitInfo {
    pb::ExitInfo { code: e.code, signal: e.signal, requested: e.requested }
}

/// The last `n` bytes of a file, as text.
fn tail(path: &std::path::Path, n: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(n)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// An engine id becomes a file name: keep it to a safe alphabet.
fn valid_engine_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

#[derive(Clone)]
struct AgentService(Arc<AgentState>);

#[tonic::async_trait]
impl Agent for AgentService {
    async fn launch(&self, request: Request<pb::LaunchRequest>) -> Result<Response<pb::LaunchReply>, Status> {
        let req = request.into_inner();
        let state = &self.0;
        if !valid_engine_id(&req.engine_id) {
            return Err(Status::invalid_argument(format!(
                "engine_id {:?} must be 1-128 characters of [A-Za-z0-9_-]",
                req.engine_id
            )));
        }
        if req.program.is_empty() {
            return Err(Status::invalid_argument("program must not be empty"));
        }
        let port_hint = u16::try_from(req.port_hint)
            .map_err(|_| Status::invalid_argument(format!("port_hint {} is not a TCP port", req.port_hint)))?;
        {
            let engines = state.engines();
            if let Some(h) = engines.get(&req.engine_id).filter(|h| h.process.exit_info().is_none()) {
                return Ok(Response::new(pb::LaunchReply {
                    pid: h.process.pid,
                    port: u32::from(h.port),
                    start_ticks: h.process.start_ticks.unwrap_or(0),
                    url: h.url.clone(),
                    already_running: true,
                    log_path: h.log_path.display().to_string(),
                }));
            }
        }
        let port = if port_hint != 0 {
            port_hint
        } else {
            let taken = state.engines().values().map(|h| h.port).collect();
            crate::adapters::launch::free_port(&state.host, &taken)
                .map_err(|e| Status::internal(format!("no free port on {}: {e}", state.host)))?
        };
        let args: Vec<String> =
            req.args.iter().map(|a| a.replace("{port}", &port.to_string()).replace("{host}", &state.host)).collect();
        let log_path = if req.log_path.is_empty() {
            state.state_dir.join("logs").join(format!("{}.log", req.engine_id))
        } else {
            PathBuf::from(&req.log_path)
        };
        let spec = LaunchSpec {
            program: PathBuf::from(&req.program),
            args,
            env: req.env.into_iter().collect(),
            log_path: log_path.clone(),
        };
        let process = host::spawn(&spec).map_err(|e| Status::internal(e.to_string()))?;
        let url = format!("http://{}:{port}", url_host(&state.host));
        tracing::info!(engine_id = %req.engine_id, pid = process.pid, %url, "engine started");
        let reply = pb::LaunchReply {
            pid: process.pid,
            port: u32::from(port),
            start_ticks: process.start_ticks.unwrap_or(0),
            url: url.clone(),
            already_running: false,
            log_path: log_path.display().to_string(),
        };
        // A previous, exited run of the same engine is replaced.
        state.engines().insert(
            req.engine_id.clone(),
            Hosted { process: process.clone(), port, url: url.clone(), log_path: log_path.clone() },
        );
        let _ = state.events.send(pb::EngineEvent {
            kind: pb::engine_event::Kind::Started as i32,
            engine_id: req.engine_id.clone(),
            pid: process.pid,
            exit: None,
            log_tail: String::new(),
        });
        let health = if req.health_path.is_empty() { "/health".to_string() } else { req.health_path.clone() };
        #[expect(
            clippy::disallowed_methods,
            reason = "ends when the engine's process is reaped, which the agent's shutdown stops and waits for"
        )]
        tokio::spawn(watch_engine(state.clone(), req.engine_id, process, format!("{url}{health}"), log_path));
        Ok(Response::new(reply))
    }

    async fn stop(&self, request: Request<pb::StopRequest>) -> Result<Response<pb::StopReply>, Status> {
        let req = request.into_inner();
        let hosted = self.0.engines().remove(&req.engine_id);
        let Some(h) = hosted else { return Ok(Response::new(pb::StopReply { exit: None, found: false })) };
        let exit = h.process.stop(Duration::from_millis(req.grace_ms)).await;
        tracing::info!(engine_id = %req.engine_id, pid = h.process.pid, %exit, "engine stopped");
        Ok(Response::new(pb::StopReply { exit: Some(to_pb(&exit)), found: true }))
    }

    async fn status(&self, request: Request<pb::StatusRequest>) -> Result<Response<pb::EngineInfo>, Status> {
        let id = request.into_inner().engine_id;
        let engines = self.0.engines();
        let h =
            engines.get(&id).ok_or_else(|| Status::not_found(format!("engine {id} is not hosted by this agent")))?;
        Ok(Response::new(AgentState::info(&id, h)))
    }

    async fn list(&self, _: Request<pb::ListRequest>) -> Result<Response<pb::ListReply>, Status> {
        let engines = self.0.engines();
        let mut list: Vec<pb::EngineInfo> = engines.iter().map(|(id, h)| AgentState::info(id, h)).collect();
        list.sort_by(|a, b| a.engine_id.cmp(&b.engine_id));
        Ok(Response::new(pb::ListReply { engines: list }))
    }

    async fn relay_endpoint(
        &self,
        _: Request<pb::RelayEndpointRequest>,
    ) -> Result<Response<pb::RelayEndpointReply>, Status> {
        let state = &self.0;
        let mut relay = state.relay.lock().await;
        let addr = match relay.as_ref() {
            Some(r) => r.local_addr(),
            None => {
                let failed = |e: std::io::Error| {
                    Status::internal(format!(
                        "cannot start the relay receiver on {} writing to {}: {e}",
                        state.host,
                        state.relay_dir.display()
                    ))
                };
                let options = rollout_relay::ReceiverOptions {
                    token: state.relay_token.clone(),
                    ..rollout_relay::ReceiverOptions::default()
                };
                let receiver = rollout_relay::Receiver::bind((state.host.as_str(), 0), state.relay_dir.clone())
                    .await
                    .map_err(failed)?
                    .with_options(options);
                let handle = receiver.spawn().map_err(failed)?;
                let addr = handle.local_addr();
                tracing::info!(%addr, root = %state.relay_dir.display(), "weight relay receiver started");
                *relay = Some(handle);
                addr
            }
        };
        drop(relay);
        let root = state.relay_dir.clone();
        let (root_id, staged) = tokio::task::spawn_blocking(move || {
            (
                crate::adapters::weights::transport::root_id(&root),
                crate::adapters::weights::transport::staged_names(&root),
            )
        })
        .await
        .map_err(|e| Status::internal(format!("relay directory task failed: {e}")))?;
        let root_id =
            root_id.map_err(|e| Status::internal(format!("cannot read {}: {e}", state.relay_dir.display())))?;
        Ok(Response::new(pb::RelayEndpointReply {
            addr: addr.to_string(),
            root: state.relay_dir.display().to_string(),
            root_id,
            staged,
        }))
    }

    async fn relay_retain(
        &self,
        request: Request<pb::RelayRetainRequest>,
    ) -> Result<Response<pb::RelayRetainReply>, Status> {
        let keep = request.into_inner().keep;
        let root = self.0.relay_dir.clone();
        let removed = tokio::task::spawn_blocking(move || crate::adapters::weights::transport::prune(&root, &keep))
            .await
            .map_err(|e| Status::internal(format!("relay directory task failed: {e}")))?;
        Ok(Response::new(pb::RelayRetainReply { removed }))
    }

    type EventsStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::EngineEvent, Status>> + Send>>;

    async fn events(&self, _: Request<pb::EventsRequest>) -> Result<Response<Self::EventsStream>, Status> {
        let rx = self.0.events.subscribe();
        // A subscriber too slow to keep up misses events; it learns the state again from List.
        let stream = tokio_stream::wrappers::BroadcastStream::new(rx).filter_map(|e| e.ok().map(Ok));
        let stream = futures::StreamExt::take_until(stream, self.0.stopping.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Lets a call through when no token is configured or it carries `authorization: Bearer <token>`.
#[derive(Clone)]
struct RequireToken(Option<Arc<str>>);

impl tonic::service::Interceptor for RequireToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        check_token(self.0.as_deref(), req).map_err(|e| *e)
    }
}

fn check_token(token: Option<&str>, req: Request<()>) -> Result<Request<()>, Box<Status>> {
    let Some(token) = token else { return Ok(req) };
    let given = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if crate::foundation::auth::same(given.as_bytes(), token.as_bytes()) {
        Ok(req)
    } else {
        Err(Box::new(Status::unauthenticated(
            "this agent needs authorization: Bearer <token> (the manager's --api-token-file or ROLLOUT_MANAGER_API_TOKEN)",
        )))
    }
}

/// Publishes READY once the engine's health path answers 200 and EXITED when it ends.
async fn watch_engine(state: Arc<AgentState>, engine_id: String, process: EngineProcess, health: String, log: PathBuf) {
    let probe = async {
        let mut backoff = Duration::from_millis(50);
        loop {
            let ok = state
                .http
                .get(&health)
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                let _ = state.events.send(pb::EngineEvent {
                    kind: pb::engine_event::Kind::Ready as i32,
                    engine_id: engine_id.clone(),
                    pid: process.pid,
                    exit: None,
                    log_tail: String::new(),
                });
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    };
    let exit = tokio::select! {
        e = process.wait() => e,
        () = probe => return,
    };
    tracing::info!(engine_id, pid = process.pid, %exit, "engine exited");
    let _ = state.events.send(pb::EngineEvent {
        kind: pb::engine_event::Kind::Exited as i32,
        engine_id,
        pid: process.pid,
        exit: Some(to_pb(&exit)),
        log_tail: tail(&log, 4096),
    });
}

fn url_host(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Writes `contents` to `path` atomically (temp file beside it, then rename).
fn write_atomic(path: &std::path::Path, contents: &str) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temp = dir.join(format!(".{name}.{}", std::process::id()));
    std::fs::write(&temp, contents)?;
    std::fs::rename(&temp, path)
}

/// Resolves when the process that started the agent is gone (the agent was re-parented).
async fn parent_died() {
    let parent = nix::unistd::getppid();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if nix::unistd::getppid() != parent {
            return;
        }
    }
}

/// Runs the agent until SIGTERM, SIGINT, or its parent's death; then stops every engine.
pub async fn run(args: AgentArgs) -> Result<(), AgentError> {
    let (host, _) = args.listen.rsplit_once(':').ok_or_else(|| AgentError::Listen(args.listen.clone()))?;
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    if host.is_empty() {
        return Err(AgentError::Listen(args.listen.clone()));
    }
    if host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
        return Err(AgentError::Unspecified(args.listen.clone()));
    }
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("rollout-agent-{}", std::process::id())));
    std::fs::create_dir_all(state_dir.join("logs"))
        .map_err(|source| AgentError::StateDir { path: state_dir.display().to_string(), source })?;
    let token = crate::foundation::auth::load(args.api_token_file.as_deref())?;
    let relay_dir = std::path::absolute(&args.relay_dir)
        .map_err(|e| AgentError::RelayDir(args.relay_dir.display().to_string(), e))?;
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if token.is_none() && !loopback {
        tracing::warn!(
            %host,
            "the agent listens beyond loopback without a token: anyone who reaches it can start programs; \
             give it the manager's token (--api-token-file or ROLLOUT_MANAGER_API_TOKEN)"
        );
    }
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|source| AgentError::Bind { addr: args.listen.clone(), source })?;
    let addr = listener.local_addr().map_err(|source| AgentError::Bind { addr: args.listen.clone(), source })?;
    let url = format!("http://{}:{}", url_host(&host), addr.port());
    let state = Arc::new(AgentState {
        host,
        state_dir,
        engines: Mutex::new(HashMap::new()),
        events: broadcast::channel(1024).0,
        http: reqwest::Client::builder().connect_timeout(Duration::from_secs(2)).build().unwrap_or_default(),
        stopping: tokio_util::sync::CancellationToken::new(),
        relay_dir,
        relay_token: token.as_deref().map(crate::adapters::weights::transport::relay_token),
        relay: tokio::sync::Mutex::new(None),
    });
    if let Some(path) = &args.ready_file {
        let body = serde_json::json!({ "url": url, "pid": std::process::id() }).to_string();
        write_atomic(path, &body)
            .map_err(|source| AgentError::ReadyFile { path: path.display().to_string(), source })?;
    }
    tracing::info!(%url, "agent listening");
    let stopping = state.stopping.clone();
    #[expect(clippy::disallowed_methods, reason = "waits for the signal that ends the agent; dies with its runtime")]
    tokio::spawn(async move {
        tokio::select! {
            () = crate::app::server::shutdown_signal() => tracing::info!("agent: shutdown requested"),
            () = parent_died() => tracing::warn!("agent: parent process died; stopping"),
        }
        stopping.cancel();
    });
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let server = tonic::transport::Server::builder()
        .add_service(AgentServer::with_interceptor(AgentService(state.clone()), RequireToken(token)))
        .serve_with_incoming_shutdown(incoming, state.stopping.clone().cancelled_owned());
    // Requests in flight get a bounded time to finish once stopping.
    let served = tokio::select! {
        r = server => r,
        () = async {
            state.stopping.cancelled().await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        } => Ok(()),
    };
    let hosted: Vec<(String, EngineProcess)> = state.engines().drain().map(|(id, h)| (id, h.process)).collect();
    futures::future::join_all(hosted.iter().map(|(id, p)| async move {
        let exit = p.stop(Duration::from_secs(10)).await;
        tracing::info!(engine_id = %id, %exit, "engine stopped at agent exit");
    }))
    .await;
    if let Some(relay) = state.relay.lock().await.take() {
        relay.shutdown().await;
    }
    if let Some(path) = &args.ready_file {
        let _ = std::fs::remove_file(path);
    }
    served?;
    Ok(())
}
