//! Engine processes on this machine.
//!
//! Expected flow: [`spawn`] starts the program in its own process group with
//! `PR_SET_PDEATHSIG`, its output appended to a per-engine log file, and hands ownership of the
//! child to a supervisor task. [`EngineProcess::stop`] asks the supervisor to send SIGINT to
//! the process itself (not its group), wait up to a grace period for it to exit, then SIGKILL
//! the group, and returns how it exited.
//!
//! Why SIGINT to the leader only: an SGLang server is a tree (the HTTP server and tokenizer
//! manager, with scheduler and detokenizer subprocesses) that its main process stops itself.
//! A signal to the whole group reaches the scheduler directly, so the main process logs
//! "Subprocess scheduler_0 crashed", waits 5 s for crash diagnostics and kills itself. SIGTERM
//! to the main process alone is SGLang's drain, which looks for a signal only every 5 s (4.5-11
//! s to exit, idle, on SGLang 0.5.23 here); SIGINT (Ctrl-C) stops its HTTP server, which then
//! stops its subprocesses: 1.2-1.7 s, idle. The engine's requests were drained or moved before
//! the manager stops it; whatever is left is cut either way, at the latest after the grace.
//!
//! Guarantees:
//! - every child is reaped by its supervisor, whether it exits alone or is stopped;
//! - a signal goes to the group only while its leader is not yet reaped, so the pid is still
//!   ours (never a recycled one);
//! - if the manager dies, even by SIGKILL, the kernel kills the child (PDEATHSIG), and the
//!   runtime's `kill_on_drop` covers an orderly drop of the supervisor.
//!
//! Errors: [`spawn`] fails when the program cannot be executed or the log cannot be opened; the
//! error names the program and the log path.

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

/// Everything needed to start one engine process. argv, never a shell string.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub log_path: PathBuf,
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit code, when it exited on its own.
    pub code: Option<i32>,
    /// Signal number, when a signal ended it.
    pub signal: Option<i32>,
    /// Whether the manager asked it to stop.
    pub requested: bool,
}

impl std::fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}"),
            (None, Some(s)) => write!(f, "killed by signal {s}"),
            (None, None) => write!(f, "exited"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("cannot open engine log {path}: {source}")]
    Log { path: PathBuf, source: io::Error },
    #[error("cannot start {program}: {source}")]
    Spawn { program: PathBuf, source: io::Error },
    #[error("the process of {program} has no pid (it exited at once)")]
    NoPid { program: PathBuf },
}

/// A running (or exited, not yet forgotten) engine process. Cloning shares the same process.
#[derive(Debug, Clone)]
pub struct EngineProcess {
    pub pid: u32,
    /// Start time of the process (see [`process_start_ticks`]), its identity beside the pid.
    pub start_ticks: Option<u64>,
    /// Ask the supervisor to stop the process with this grace period.
    stop_tx: mpsc::Sender<Duration>,
    /// `None` while running, then how it ended.
    exit_rx: watch::Receiver<Option<ExitInfo>>,
}

impl EngineProcess {
    /// A process supervised elsewhere (by a keeper): stop requests go to `stop_tx`, and
    /// `exit_rx` says when it ended.
    pub fn from_parts(
        pid: u32,
        start_ticks: Option<u64>,
        stop_tx: mpsc::Sender<Duration>,
        exit_rx: watch::Receiver<Option<ExitInfo>>,
    ) -> Self {
        Self { pid, start_ticks, stop_tx, exit_rx }
    }

    /// Stops the process (SIGINT to it, then SIGKILL to its group after `grace`) and waits
    /// until it is reaped. Returns at once if it already exited.
    pub async fn stop(&self, grace: Duration) -> ExitInfo {
        // A closed channel means the supervisor already finished: the process is reaped.
        let _ = self.stop_tx.send(grace).await;
        self.wait().await
    }

    /// Waits until the process has exited and been reaped.
    pub async fn wait(&self) -> ExitInfo {
        let mut rx = self.exit_rx.clone();
        loop {
            if let Some(info) = rx.borrow_and_update().clone() {
                return info;
            }
            if rx.changed().await.is_err() {
                // The supervisor is gone without publishing: treat as exited.
                return rx.borrow().clone().unwrap_or(ExitInfo { code: None, signal: None, requested: false });
            }
        }
    }

    /// How the process ended, if it has.
    pub fn exit_info(&self) -> Option<ExitInfo> {
        self.exit_rx.borrow().clone()
    }
}

fn open_log(path: &Path) -> Result<std::fs::File, HostError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| HostError::Log { path: path.to_path_buf(), source })?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|source| HostError::Log { path: path.to_path_buf(), source })
}

/// Starts an engine process and its supervisor task.
///
/// Must be called from a tokio worker thread, which lives as long as the runtime: the kernel
/// delivers PDEATHSIG when the *thread* that forked the child exits, so forking from a
/// short-lived blocking thread would kill engines early.
pub fn spawn(spec: &LaunchSpec) -> Result<EngineProcess, HostError> {
    let mut cmd = command(spec)?;
    cmd.process_group(0).kill_on_drop(true);
    die_with_parent(&mut cmd);
    let child = cmd.spawn().map_err(|source| HostError::Spawn { program: spec.program.clone(), source })?;
    let pid = child.id().ok_or_else(|| HostError::NoPid { program: spec.program.clone() })?;
    let (stop_tx, stop_rx) = mpsc::channel(1);
    let (exit_tx, exit_rx) = watch::channel(None);
    #[expect(
        clippy::disallowed_methods,
        reason = "owned by the EngineProcess handle: it ends when the child is reaped, which stop() and wait() await"
    )]
    tokio::spawn(supervise(child, pid, stop_rx, exit_tx));
    Ok(EngineProcess { pid, start_ticks: process_start_ticks(pid), stop_tx, exit_rx })
}

/// The environment variable of `--parent-pid` (whose process to die with).
pub const PARENT_PID_ENV: &str = "ROLLOUT_MANAGER_PARENT_PID";

/// Whether a variable of this process's environment stays out of its children's: every
/// `ROLLOUT_MANAGER_*` is a setting of this process (its flags, its token, its parent's pid),
/// which an engine, or a keeper or agent reading the same names, must not take for its own.
pub fn withheld_from_children(name: &std::ffi::OsStr) -> bool {
    name.as_encoded_bytes().starts_with(rollout_core::cli::ENV_PREFIX.as_bytes())
}

/// The command of a spec: argv, this process's environment without its own settings
/// ([`withheld_from_children`]) plus the spec's (but never the API token or parent pid), no
/// stdin, stdout and stderr appended to the log file.
fn command(spec: &LaunchSpec) -> Result<Command, HostError> {
    let log = open_log(&spec.log_path)?;
    let log_err = log.try_clone().map_err(|source| HostError::Log { path: spec.log_path.clone(), source })?;
    let mut cmd = Command::new(&spec.program);
    for (name, _) in std::env::vars_os().filter(|(name, _)| withheld_from_children(name)) {
        cmd.env_remove(name);
    }
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        // The API token is the manager's secret, not the engines'.
        .env_remove(crate::foundation::auth::TOKEN_ENV)
        // Whose process to die with is this process's business, not its children's.
        .env_remove(PARENT_PID_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err));
    Ok(cmd)
}

/// Makes the child get SIGKILL when its parent thread exits (PR_SET_PDEATHSIG).
pub fn die_with_parent(cmd: &mut Command) {
    let parent = nix::unistd::getpid();
    #[expect(unsafe_code, reason = "pre_exec runs between fork and exec to set PDEATHSIG")]
    // SAFETY: the closure only calls async-signal-safe functions (prctl, getppid) and does not
    // allocate.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
            // The parent may have died between fork and prctl; then no signal would come.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::from(nix::errno::Errno::ESRCH));
            }
            Ok(())
        });
    }
}

/// Starts a process in a session of its own that outlives the manager (an engine keeper).
/// The caller owns the returned child and must reap it.
pub fn spawn_detached(spec: &LaunchSpec) -> Result<Child, HostError> {
    let mut cmd = command(spec)?;
    #[expect(unsafe_code, reason = "pre_exec runs between fork and exec to start a new session")]
    // SAFETY: setsid is async-signal-safe and nothing is allocated.
    unsafe {
        cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(io::Error::from));
    }
    cmd.spawn().map_err(|source| HostError::Spawn { program: spec.program.clone(), source })
}

/// Start time of a process in clock ticks since boot (`/proc/<pid>/stat` field 22): with the
/// pid, it identifies one process across pid reuse.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn exit_info(status: io::Result<std::process::ExitStatus>, requested: bool) -> ExitInfo {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => ExitInfo { code: s.code(), signal: s.signal(), requested },
        Err(_) => ExitInfo { code: None, signal: None, requested },
    }
}

/// Owns the child until it is reaped. Signals go to the group only before the leader is reaped.
async fn supervise(
    mut child: Child,
    pid: u32,
    mut stop_rx: mpsc::Receiver<Duration>,
    exit_tx: watch::Sender<Option<ExitInfo>>,
) {
    let group = Pid::from_raw(pid as i32);
    let info = tokio::select! {
        status = child.wait() => {
            // The leader exited alone. Members of its group (if any) still hold the group id,
            // so it cannot have been reused; make sure none outlives it.
            let _ = killpg(group, Signal::SIGKILL);
            exit_info(status, false)
        }
        grace = stop_rx.recv() => {
            let grace = grace.unwrap_or(Duration::ZERO);
            // Not reaped yet: the pid and group are still ours. The process stops its own
            // children (see the module's docs); the group is killed once it exited.
            let _ = kill(group, Signal::SIGINT);
            let status = match tokio::time::timeout(grace, child.wait()).await {
                Ok(status) => {
                    let _ = killpg(group, Signal::SIGKILL);
                    status
                }
                Err(_) => {
                    tracing::warn!(pid, ?grace, "engine did not exit after SIGINT; sending SIGKILL");
                    let _ = killpg(group, Signal::SIGKILL);
                    child.wait().await
                }
            };
            exit_info(status, true)
        }
    };
    let _ = exit_tx.send(Some(info));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path, script: &str) -> LaunchSpec {
        LaunchSpec {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("ENGINE_TEST_VAR".into(), "hello".into())],
            log_path: dir.join("logs/e.log"),
        }
    }

    /// Alive and not a zombie (a reparented zombie may wait for a slow init to reap it).
    fn alive(pid: u32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
            Err(_) => false,
        }
    }

    #[tokio::test]
    async fn logs_env_and_exit_code() {
        let dir = tempdir();
        let p = spawn(&spec(&dir, "echo $ENGINE_TEST_VAR; exit 3")).unwrap();
        let info = p.wait().await;
        assert_eq!(info, ExitInfo { code: Some(3), signal: None, requested: false });
        let log = std::fs::read_to_string(dir.join("logs/e.log")).unwrap();
        assert_eq!(log.trim(), "hello");
        assert!(!alive(p.pid));
    }

    #[test]
    fn the_managers_own_settings_are_withheld_from_children() {
        use std::ffi::OsStr;
        for name in
            ["ROLLOUT_MANAGER_PORT", "ROLLOUT_MANAGER_API_TOKEN", "ROLLOUT_MANAGER_PARENT_PID", "ROLLOUT_MANAGER_"]
        {
            assert!(withheld_from_children(OsStr::new(name)), "{name}");
        }
        for name in ["CUDA_VISIBLE_DEVICES", "PATH", "ELASTIC_ROLLOUT_MANAGER_BIN", "rollout_manager_port"] {
            assert!(!withheld_from_children(OsStr::new(name)), "{name}");
        }
    }

    #[tokio::test]
    async fn children_do_not_inherit_rollout_manager_variables() {
        let dir = tempdir();
        // A name of this test only, so no other test's child can be affected by it.
        let name = format!("ROLLOUT_MANAGER_TEST_WITHHELD_{}", std::process::id());
        std::env::set_var(&name, "parent-only");
        let p = spawn(&spec(&dir, "env")).unwrap();
        let info = p.wait().await;
        std::env::remove_var(&name);
        assert_eq!(info.code, Some(0));
        let log = std::fs::read_to_string(dir.join("logs/e.log")).unwrap();
        assert!(log.contains("ENGINE_TEST_VAR=hello"), "{log}");
        assert!(!log.contains(&name), "{log}");
    }

    #[tokio::test]
    async fn stop_asks_the_process_itself_then_kills_what_is_left_of_its_group() {
        let dir = tempdir();
        let (pidfile, asked) = (dir.join("grandchild"), dir.join("asked"));
        // The leader stops on SIGINT (saying so); its child in the same group does not hear it
        // (a background job of a script ignores SIGINT) and is killed with the group.
        let script = format!(
            "trap 'echo int > {}; exit 0' INT; sleep 1000 & echo $! > {}; wait",
            asked.display(),
            pidfile.display()
        );
        let p = spawn(&spec(&dir, &script)).unwrap();
        let grandchild: u32 = wait_for_file(&pidfile).await.trim().parse().unwrap();
        let info = tokio::time::timeout(Duration::from_secs(10), p.stop(Duration::from_secs(5))).await.unwrap();
        assert_eq!(info, ExitInfo { code: Some(0), signal: None, requested: true });
        assert_eq!(std::fs::read_to_string(&asked).unwrap().trim(), "int");
        for _ in 0..200 {
            if !alive(grandchild) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!alive(grandchild), "grandchild {grandchild} survived its leader's stop");
    }

    #[tokio::test]
    async fn stop_kills_the_whole_group_even_if_sigint_and_sigterm_are_ignored() {
        let dir = tempdir();
        let pidfile = dir.join("grandchild");
        // The shell ignores SIGINT and SIGTERM and has a grandchild in the same group.
        let script = format!("trap '' INT TERM; sleep 1000 & echo $! > {}; wait", pidfile.display());
        let p = spawn(&spec(&dir, &script)).unwrap();
        let grandchild: u32 = wait_for_file(&pidfile).await.trim().parse().unwrap();
        assert!(alive(grandchild));
        let info = tokio::time::timeout(Duration::from_secs(10), p.stop(Duration::from_millis(200))).await.unwrap();
        assert!(info.requested);
        assert_eq!(info.signal, Some(9));
        assert!(!alive(p.pid));
        for _ in 0..200 {
            if !alive(grandchild) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!alive(grandchild), "grandchild {grandchild} survived the group kill");
        // A second stop returns at once with the same answer.
        assert_eq!(p.stop(Duration::ZERO).await, info);
    }

    async fn wait_for_file(path: &Path) -> String {
        for _ in 0..500 {
            if let Ok(s) = std::fs::read_to_string(path) {
                if s.ends_with('\n') {
                    return s;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{} never appeared", path.display());
    }

    #[tokio::test]
    async fn spawn_error_names_program() {
        let dir = tempdir();
        let mut s = spec(&dir, "");
        s.program = "/nonexistent/engine".into();
        let err = spawn(&s).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/engine"), "{err}");
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("rm-host-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
