//! Startup and shutdown of `rollout-manager serve`.
//!
//! [`Server::build`] does everything that can fail (validate config, find the engine program,
//! bind both listeners) before anything starts. [`Server::run`] then starts the initial engines,
//! the health monitor and both HTTP servers, and on the shutdown signal tears them down in one
//! order: stop accepting requests, cancel background work, stop every engine (SIGINT to each, then
//! SIGKILL to its group after `--scale-in-shutdown-timeout`), join every task.

use crate::adapters::launch::EngineLauncher;
use crate::foundation::allowed_peers::AllowedPeers;
use crate::interfaces::api::{self, ApiState};
use crate::ops::manager::Manager;
use rollout_core::ServeConfig;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] rollout_core::ConfigError),
    #[error(transparent)]
    Launcher(#[from] crate::adapters::launch::LaunchError),
    #[error("cannot bind {flag} {addr}: {source}")]
    Bind { flag: &'static str, addr: String, source: std::io::Error },
    #[error("cannot create --state-dir {path}: {source}")]
    StateDir { path: String, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] crate::registry::store::StoreError),
    #[error(transparent)]
    Token(#[from] crate::foundation::auth::TokenError),
    #[error("cannot build the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    #[error("--api-socket {path}: {message}")]
    Socket { path: String, message: String },
    #[error("{0}")]
    Runtime(String),
}

pub struct Server {
    manager: Arc<Manager>,
    control: TcpListener,
    data: TcpListener,
    /// `--trainer-port`: the fleet as one SGLang engine for a trainer's weight sync.
    trainer: Option<TcpListener>,
    /// `--api-socket`: the control API again, on a Unix socket (mode 0600).
    socket: Option<(tokio::net::UnixListener, std::path::PathBuf)>,
    /// What `--state-dir` held at startup; empty on a first start.
    snapshot: crate::registry::store::Snapshot,
    /// The API token, if configured.
    token: Option<Arc<str>>,
    /// `--autoscaler-config`, read and validated (None without the flag).
    autoscaler: Option<(std::path::PathBuf, rollout_core::autoscaler::AutoscalerConfig)>,
    /// `--router smg=URL`: the external router engines are registered with.
    smg: Option<Arc<crate::interfaces::integrations::smg::Smg>>,
}

impl Server {
    pub async fn build(config: ServeConfig) -> Result<Self, StartError> {
        config.validate()?;
        let launcher = EngineLauncher::resolve(config.engine, config.engine_program.as_deref())?;
        std::fs::create_dir_all(config.state_dir.join("logs"))
            .map_err(|source| StartError::StateDir { path: config.state_dir.display().to_string(), source })?;
        let bind = |flag: &'static str, port: u16| {
            let addr = format!("{}:{}", config.host, port);
            async move { TcpListener::bind(&addr).await.map_err(|source| StartError::Bind { flag, addr, source }) }
        };
        let control = bind("--port", config.port).await?;
        let data = bind("--router-port", config.router_port).await?;
        let trainer = match config.trainer_port {
            Some(port) => Some(bind("--trainer-port", port).await?),
            None => None,
        };
        let socket = match &config.api_socket {
            Some(path) => Some((bind_private_socket(path)?, path.clone())),
            None => None,
        };
        let token = crate::foundation::auth::load(config.api_token_file.as_deref())?;
        if !is_loopback(&config.host) && token.is_none() {
            tracing::warn!(
                host = %config.host,
                "the control API listens beyond loopback without a token: anyone who reaches it can scale the fleet; \
                 set --api-token-file"
            );
        }
        if !is_loopback(&config.engine_host) {
            tracing::warn!(
                engine_host = %config.engine_host,
                "engines listen beyond loopback: SGLang's own API (weight updates, pause, abort) has no \
                 authentication of ours, so anyone who reaches an engine's port can change it; keep them on a \
                 private network"
            );
        }
        let store = crate::registry::store::Store::open(&config.state_dir)?;
        let snapshot = store.load()?;
        let autoscaler = crate::interfaces::autoscaler::load_config(config.autoscaler_config.as_deref())?;
        let smg = match config.external_router_url() {
            // Redirects are not followed, as for engines.
            Some(base) => Some(Arc::new(crate::interfaces::integrations::smg::Smg::new(
                base,
                reqwest::Client::builder()
                    .connect_timeout(Duration::from_secs(2))
                    .redirect(reqwest::redirect::Policy::none())
                    .build()?,
            ))),
            None => None,
        };
        let external = smg.clone().map(|s| s as Arc<dyn crate::ops::manager::ExternalRouter>);
        let manager = Manager::new(config, launcher, Some(store), token.as_deref(), external)?;
        Ok(Self { manager, control, data, trainer, socket, snapshot, autoscaler, token, smg })
    }

    pub fn control_addr(&self) -> std::io::Result<SocketAddr> {
        self.control.local_addr()
    }

    pub fn router_addr(&self) -> std::io::Result<SocketAddr> {
        self.data.local_addr()
    }

    /// Where `--trainer-port` listens; None without the flag.
    pub fn trainer_addr(&self) -> Option<std::io::Result<SocketAddr>> {
        self.trainer.as_ref().map(TcpListener::local_addr)
    }

    /// Runs until `signal` resolves, then shuts down in order.
    pub async fn run(self, signal: impl Future<Output = ()> + Send + 'static) -> Result<(), StartError> {
        let Self { manager, control, data, trainer, socket, snapshot, autoscaler, token, smg } = self;
        let router_metrics =
            Arc::new(crate::adapters::router::metrics::RouterMetrics::new(manager.config.request_timeout_secs));
        let autoscaler =
            crate::interfaces::autoscaler::Autoscaler::new(manager.clone(), router_metrics.clone(), autoscaler);
        let api = api::router(ApiState { manager: manager.clone(), router_metrics: router_metrics.clone() })
            .merge(crate::interfaces::autoscaler::routes(autoscaler.clone()))
            .merge(crate::interfaces::openapi::routes())
            .method_not_allowed_fallback(api::method_not_allowed)
            .layer(axum::middleware::from_fn_with_state(token.clone(), crate::foundation::auth::require_token))
            .layer(axum::middleware::from_fn_with_state(
                api::BODY_LIMIT,
                crate::foundation::http_serve::read_body_first,
            ));
        let router = crate::adapters::router::router(
            manager.fleet.clone(),
            manager.config.clone(),
            router_metrics,
            token.clone(),
        )
        .with_control_plane(crate::interfaces::rl::routes(manager.clone(), token.clone()));
        if let Some(port) = trainer.as_ref().and_then(|t| t.local_addr().ok()).map(|a| a.port()) {
            router.trainer_port(port);
        }
        manager.tasks.spawn(router.tail_planner(manager.shutdown.clone()));

        let stop = manager.shutdown.clone();
        manager.tasks.spawn(async move {
            signal.await;
            tracing::info!("shutdown requested");
            stop.cancel();
        });
        if manager.ray() {
            // Before the restore, which may find agents gone.
            manager.spawn_agent_loss_watch();
        }
        // The registry is rebuilt (or the initial bring-up reserved) before any request is
        // served, so no API call can race with it. Connections wait in the listen backlog.
        crate::ops::restore::start(&manager, snapshot).await;
        let servers = tokio_util::task::TaskTracker::new();
        let header_timeout = Duration::from_secs_f64(manager.config.header_read_timeout_secs);
        if let Some((listener, path)) = socket {
            let stop = manager.shutdown.clone();
            let app = api.clone();
            servers.spawn(async move {
                crate::foundation::http_serve::serve(listener, app, stop, header_timeout).await;
                let _ = std::fs::remove_file(&path);
            });
        }
        let stop = manager.shutdown.clone();
        servers.spawn(crate::foundation::http_serve::serve(control, api, stop, header_timeout));
        if let Some(listener) = trainer {
            let stop = manager.shutdown.clone();
            // The allow-list is the port's own credential: with it, no token is asked for.
            let allowed = manager.config.trainer_allow_list().unwrap_or_default();
            if allowed.is_empty() {
                let app = crate::interfaces::trainer_port::routes(manager.clone(), token);
                servers.spawn(crate::foundation::http_serve::serve(listener, app, stop, header_timeout));
            } else {
                let app = crate::interfaces::trainer_port::routes(manager.clone(), None);
                let listener = AllowedPeers::new(listener, allowed, "--trainer-allow-cidr");
                servers.spawn(crate::foundation::http_serve::serve(listener, app, stop, header_timeout));
            }
        }
        let stop = manager.shutdown.clone();
        let done = serve_data_plane(data, router, stop, header_timeout, manager.config.router_threads)?;
        servers.spawn(async move {
            for thread in done {
                let _ = thread.await;
            }
        });
        servers.close();

        crate::ops::health::spawn_monitor(&manager);
        autoscaler.spawn();
        crate::interfaces::integrations::loads::spawn_poller(&manager);
        if let Some(smg) = smg {
            crate::interfaces::integrations::smg::spawn_reconciler(&manager, smg);
        }

        manager.shutdown.cancelled().await;
        shut_down(&manager, servers).await;
        tracing::info!("shutdown complete");
        Ok(())
    }
}

/// Shuts down in order once the manager's token is cancelled: the HTTP servers (streams get
/// 5 s to finish), the external router's registrations, the engines, then the background tasks.
async fn shut_down(manager: &Arc<Manager>, servers: tokio_util::task::TaskTracker) {
    // Streams still open get a bounded time to finish before their servers are dropped.
    if tokio::time::timeout(Duration::from_secs(5), servers.wait()).await.is_err() {
        tracing::warn!("HTTP connections still open after 5 s; closing them");
    }
    // An external router stops sending work to the engines before they stop.
    let urls: Vec<String> = manager.fleet.routes().backends.iter().map(|b| b.url.clone()).collect();
    if let Some(router) = &manager.external_router {
        router.forget(&urls).await;
    }
    manager.stop_all().await;
    manager.tasks.close();
    let grace = manager.shutdown_grace() + Duration::from_secs(5);
    if tokio::time::timeout(grace, manager.tasks.wait()).await.is_err() {
        tracing::warn!("background tasks did not finish within {grace:?}");
    }
    // Operation tasks may have been stopped between launching and recording a process.
    manager.stop_all().await;
}

/// Runs the data plane on threads of its own (`--router-threads`), each with a single-thread
/// runtime: a client's connection, its requests and the engine connections they use stay on
/// one thread, never waking another. With one thread it accepts from the router port itself;
/// with more, the first thread also runs [`hand_out`], which accepts every connection and
/// hands it to the threads in turn (one wake-up per connection, none per request, and no
/// thundering herd of every thread on each accept). The receivers resolve when their thread
/// has stopped (after `stop`, once its connections have finished their request in flight).
fn serve_data_plane(
    listener: TcpListener,
    router: crate::adapters::router::DataPlane,
    stop: tokio_util::sync::CancellationToken,
    header_timeout: Duration,
    threads: usize,
) -> Result<Vec<tokio::sync::oneshot::Receiver<()>>, StartError> {
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        n => n,
    };
    let addr = listener.local_addr().map_err(|e| StartError::Runtime(format!("router listener: {e}")))?;
    // A tokio listener belongs to the runtime that created it: the accepting thread gets a std one.
    let mut listener = Some(listener.into_std().map_err(|e| StartError::Runtime(format!("router listener: {e}")))?);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| tokio::sync::mpsc::unbounded_channel::<Handed>()).unzip();
    let mut senders = Some(senders);
    let mut finished = Vec::with_capacity(threads);
    for (slot, connections) in receivers.into_iter().enumerate() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StartError::Runtime(format!("cannot start the router's runtime {slot}: {e}")))?;
        // The first thread accepts: from the port itself when alone, else for every thread.
        let accept = if slot == 0 { listener.take().zip(senders.take()) } else { None };
        let (router, stop) = (router.clone(), stop.clone());
        let (done, stopped) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("router-{slot}"))
            .spawn(move || {
                crate::adapters::router::set_thread_slot(slot);
                runtime.block_on(async move {
                    match accept {
                        Some((listener, _)) if threads == 1 => {
                            let listener = match TcpListener::from_std(listener) {
                                Ok(l) => l,
                                Err(e) => {
                                    tracing::error!(error = %e, "cannot serve the router port");
                                    return;
                                }
                            };
                            // Answers (server-sent events included) go out as soon as written,
                            // never held back by Nagle's algorithm.
                            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                                let _ = tcp.set_nodelay(true);
                            });
                            crate::foundation::http_serve::serve(listener, router, stop, header_timeout).await;
                            return;
                        }
                        Some((listener, senders)) => match TcpListener::from_std(listener) {
                            Ok(l) => {
                                #[expect(
                                    clippy::disallowed_methods,
                                    reason = "the acceptor of this data-plane thread's runtime; ends with `stop`"
                                )]
                                drop(tokio::spawn(hand_out(l, senders, stop.clone())));
                            }
                            Err(e) => tracing::error!(error = %e, "cannot serve the router port"),
                        },
                        None => {}
                    }
                    let listener = HandedListener { connections, addr };
                    crate::foundation::http_serve::serve(listener, router, stop, header_timeout).await;
                });
                // Dropping the runtime here ends the engine connections' tasks.
                drop(runtime);
                let _ = done.send(());
            })
            .map_err(|e| StartError::Runtime(format!("cannot start the router's thread {slot}: {e}")))?;
        finished.push(stopped);
    }
    tracing::info!(threads, "router data plane started");
    Ok(finished)
}

/// A client connection accepted on the router port, on its way to the thread that serves it.
type Handed = (std::net::TcpStream, SocketAddr);

/// Accepts connections on the router port and hands them to the data-plane threads in turn,
/// until `stop`.
async fn hand_out(
    listener: TcpListener,
    threads: Vec<tokio::sync::mpsc::UnboundedSender<Handed>>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut next = 0usize;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stop.cancelled() => return,
        };
        let (stream, peer) = match accepted {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors or memory: wait a little rather than spin (as axum does).
                tracing::warn!(error = %e, "cannot accept a router connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Answers (server-sent events included) go out as soon as written.
        let _ = stream.set_nodelay(true);
        match stream.into_std() {
            Ok(stream) => {
                let _ = threads[next % threads.len()].send((stream, peer));
                next = next.wrapping_add(1);
            }
            Err(e) => tracing::warn!(error = %e, "cannot hand a router connection to its thread"),
        }
    }
}

/// The connections [`hand_out`] gives one data-plane thread, as a listener to serve.
struct HandedListener {
    connections: tokio::sync::mpsc::UnboundedReceiver<Handed>,
    addr: SocketAddr,
}

impl axum::serve::Listener for HandedListener {
    type Io = tokio::net::TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // Once the acceptor has stopped, nothing more comes: wait for the stop signal.
            let Some((stream, peer)) = self.connections.recv().await else { std::future::pending().await };
            match tokio::net::TcpStream::from_std(stream) {
                Ok(stream) => return (stream, peer),
                Err(e) => tracing::warn!(error = %e, "cannot serve a handed router connection"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

/// Binds the control API's Unix socket so that it is never reachable with wider permissions
/// than 0600: it is bound under a temporary name beside the final path, restricted, then
/// renamed into place. A socket file left by a dead manager is removed; one that answers (a
/// live manager) or a path that is not a socket is refused.
fn bind_private_socket(path: &std::path::Path) -> Result<tokio::net::UnixListener, StartError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let fail = |message: String| StartError::Socket { path: path.display().to_string(), message };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(fail("another process is listening on it; stop it or pick another path".into()));
            }
            std::fs::remove_file(path).map_err(|e| fail(format!("cannot remove the stale socket: {e}")))?;
            tracing::info!(path = %path.display(), "removed a stale --api-socket left by an earlier run");
        }
        Ok(_) => return Err(fail("exists and is not a socket; remove it or pick another path".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e.to_string())),
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temp = dir.join(format!(".{name}.{}", &uuid::Uuid::new_v4().simple().to_string()[..8]));
    let listener = tokio::net::UnixListener::bind(&temp).map_err(|e| fail(format!("cannot bind: {e}")))?;
    let placed = std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&temp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&temp);
        return Err(fail(format!("cannot make it private: {e}")));
    }
    Ok(listener)
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
