//! Engine keepers: engines that survive a crashed manager long enough to be re-adopted.
//!
//! With `--reattach-grace-secs N` (N > 0) every local engine runs under a small keeper process
//! (`rollout-manager keeper`, in its own session, so it outlives the manager). The keeper starts
//! the engine as its own child (own process group, PDEATHSIG to the keeper), owns and reaps it,
//! and talks to the manager over a Unix socket (0600) with one JSON object per line:
//!
//! - keeper -> manager, on connect: `{"hello": {"pid", "start_ticks"}}`;
//! - keeper -> manager, when the engine ends: `{"exited": {"code", "signal", "requested"}}`;
//! - manager -> keeper: `{"stop": {"grace_secs"}}` (SIGINT to the engine, SIGKILL to its group
//!   after the grace: `foundation::host` says why).
//!
//! Guarantees: while a manager is connected the keeper only follows orders. When the connection
//! drops without a stop (the manager died), the keeper waits `grace` for a manager to connect
//! again; if none does, it kills the engine's group, reaps it, and exits. So no engine outlives
//! its manager by more than the grace period, and a manager restarted within it re-adopts the
//! engine (same pid, verified by start time) without restarting it.

use crate::foundation::host::{process_start_ticks, EngineProcess, ExitInfo, HostError, LaunchSpec};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum FromKeeper {
    Hello { pid: u32, start_ticks: Option<u64> },
    Exited { code: Option<i32>, signal: Option<i32>, requested: bool },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
enum ToKeeper {
    Stop { grace_secs: f64 },
}

/// Arguments of `rollout-manager keeper` (internal: started by the manager).
#[derive(Debug, Clone, clap::Args)]
pub struct KeeperArgs {
    /// Unix socket the manager connects to.
    #[arg(long)]
    pub socket: PathBuf,
    /// How long to wait for a manager to reconnect before killing the engine.
    #[arg(long)]
    pub grace_secs: f64,
    /// The engine's program and arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

fn line<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec(msg).unwrap_or_default();
    v.push(b'\n');
    v
}

/// The keeper process: runs until the engine has ended and that was reported (or nobody came
/// to hear it within the grace period).
pub async fn run_keeper(args: KeeperArgs) -> io::Result<i32> {
    let (program, engine_args) = args.command.split_first().ok_or_else(|| io::Error::other("no engine command"))?;
    let grace = Duration::from_secs_f64(args.grace_secs.max(0.0));
    let _ = std::fs::remove_file(&args.socket);
    let listener = UnixListener::bind(&args.socket)?;
    restrict(&args.socket)?;

    let mut cmd = tokio::process::Command::new(program);
    cmd.args(engine_args).stdin(Stdio::null()).process_group(0).kill_on_drop(true);
    crate::foundation::host::die_with_parent(&mut cmd);
    let mut child = cmd.spawn()?;
    let pid = child.id().ok_or_else(|| io::Error::other("engine exited at once"))?;
    let hello = FromKeeper::Hello { pid, start_ticks: process_start_ticks(pid) };
    let group = Pid::from_raw(pid as i32);

    let mut conn: Option<(
        tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
        tokio::net::unix::OwnedWriteHalf,
    )> = None;
    let mut exit: Option<FromKeeper> = None;
    let mut stop_requested = false;
    // Nobody is connected yet: the spawning manager connects right away.
    let mut alone_since = tokio::time::Instant::now();
    loop {
        if let (Some(e), Some((_, w))) = (&exit, conn.as_mut()) {
            let _ = w.write_all(&line(e)).await;
            let _ = w.flush().await;
            break;
        }
        let deadline = alone_since + grace;
        tokio::select! {
            status = child.wait(), if exit.is_none() => {
                use std::os::unix::process::ExitStatusExt;
                let _ = killpg(group, Signal::SIGKILL);
                let (code, signal) = status.map(|s| (s.code(), s.signal())).unwrap_or((None, None));
                exit = Some(FromKeeper::Exited { code, signal, requested: stop_requested });
                if conn.is_none() {
                    // Keep the news for a manager that may still come.
                    alone_since = tokio::time::Instant::now();
                }
            }
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    let (r, mut w) = stream.into_split();
                    if w.write_all(&line(&hello)).await.is_ok() {
                        conn = Some((BufReader::new(r).lines(), w));
                    }
                }
            }
            msg = async { match conn.as_mut() { Some((r, _)) => r.next_line().await, None => std::future::pending().await } } => {
                match msg {
                    Ok(Some(text)) => {
                        if let Ok(ToKeeper::Stop { grace_secs }) = serde_json::from_str(&text) {
                            stop_requested = true;
                            let _ = kill(group, Signal::SIGINT);
                            let grace = Duration::from_secs_f64(grace_secs.max(0.0));
                            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                                let _ = killpg(group, Signal::SIGKILL);
                            }
                        }
                    }
                    _ => {
                        // The manager went away without stopping us: wait for another.
                        conn = None;
                        alone_since = tokio::time::Instant::now();
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline), if conn.is_none() => {
                if exit.is_none() {
                    let _ = killpg(group, Signal::SIGKILL);
                    let _ = child.wait().await;
                }
                break;
            }
        }
    }
    let _ = std::fs::remove_file(&args.socket);
    Ok(0)
}

/// Makes the socket owner-only, before anyone can use it.
fn restrict(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

/// Starts an engine under a keeper and connects to it.
pub async fn spawn_kept(spec: &LaunchSpec, socket: &Path, grace: Duration) -> Result<EngineProcess, HostError> {
    let keeper_exe =
        std::env::current_exe().map_err(|source| HostError::Spawn { program: "rollout-manager".into(), source })?;
    let mut keeper_args = vec![
        "keeper".to_string(),
        "--socket".into(),
        socket.display().to_string(),
        "--grace-secs".into(),
        grace.as_secs_f64().to_string(),
        "--".into(),
        spec.program.display().to_string(),
    ];
    keeper_args.extend(spec.args.iter().cloned());
    let keeper_spec =
        LaunchSpec { program: keeper_exe, args: keeper_args, env: spec.env.clone(), log_path: spec.log_path.clone() };
    let keeper = crate::foundation::host::spawn_detached(&keeper_spec)?;
    // The keeper binds its socket right after starting.
    let mut waited = Duration::ZERO;
    let stream = loop {
        match UnixStream::connect(socket).await {
            Ok(s) => break s,
            Err(e) if waited < Duration::from_secs(10) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
                waited += Duration::from_millis(20);
            }
            Err(source) => return Err(HostError::Spawn { program: spec.program.clone(), source }),
        }
    };
    attach_stream(stream, Some(keeper))
        .await
        .map_err(|source| HostError::Spawn { program: spec.program.clone(), source })
}

/// Connects to the keeper of an engine started by an earlier manager.
pub async fn attach(socket: &Path) -> io::Result<EngineProcess> {
    let stream = UnixStream::connect(socket).await?;
    attach_stream(stream, None).await
}

/// Reads the keeper's hello and starts the task that relays stop and exit. `keeper` is the
/// keeper's process when this manager spawned it (so it is reaped here).
async fn attach_stream(stream: UnixStream, keeper: Option<tokio::process::Child>) -> io::Result<EngineProcess> {
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r).lines();
    let hello = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .map_err(|_| io::Error::other("keeper did not say hello"))??
        .ok_or_else(|| io::Error::other("keeper closed the connection"))?;
    let FromKeeper::Hello { pid, start_ticks } = serde_json::from_str(&hello).map_err(io::Error::other)? else {
        return Err(io::Error::other("keeper's first message was not hello"));
    };
    let (stop_tx, mut stop_rx) = mpsc::channel::<Duration>(1);
    let (exit_tx, exit_rx) = watch::channel(None);
    #[expect(
        clippy::disallowed_methods,
        reason = "owned by the EngineProcess handle: it ends when the keeper reports the exit or hangs up"
    )]
    tokio::spawn(async move {
        let mut requested = false;
        let info = loop {
            tokio::select! {
                msg = lines.next_line() => match msg {
                    Ok(Some(text)) => {
                        if let Ok(FromKeeper::Exited { code, signal, requested: r }) = serde_json::from_str(&text) {
                            break ExitInfo { code, signal, requested: r || requested };
                        }
                    }
                    // The keeper died (it never does before reporting, unless killed).
                    _ => break ExitInfo { code: None, signal: None, requested },
                },
                grace = stop_rx.recv() => {
                    let grace = grace.unwrap_or(Duration::ZERO);
                    requested = true;
                    let _ = w.write_all(&line(&ToKeeper::Stop { grace_secs: grace.as_secs_f64() })).await;
                }
            }
        };
        if let Some(mut k) = keeper {
            let _ = k.wait().await;
        }
        let _ = exit_tx.send(Some(info));
    });
    Ok(EngineProcess::from_parts(pid, start_ticks, stop_tx, exit_rx))
}
