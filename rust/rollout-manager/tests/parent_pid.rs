//! `--parent-pid`: the binary sets its own parent-death signal, so an agent (or manager) never
//! outlives the process that started it, and refuses to start when that process is gone.
#![expect(clippy::unwrap_used, reason = "a test fails loudly on a broken fixture")]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio::time::Instant;

const BIN: &str = env!("CARGO_BIN_EXE_rollout-manager");

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rm-parent-pid-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits (up to `timeout`) until `f` returns something.
fn wait_for<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alive(pid: u32) -> bool {
    // A zombie is gone for our purpose: it runs nothing.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

fn agent_pid(ready: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(ready).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    value.get("pid")?.as_u64().map(|p| p as u32)
}

#[test]
fn an_agent_exits_when_the_process_named_by_parent_pid_is_killed() {
    let dir = temp_dir("agent");
    let ready = dir.join("ready.json");
    // A shell plays the host actor: it starts the agent with its own pid as --parent-pid (here
    // from the environment, as the Ray shim passes it) and waits.
    let script = format!(
        "ROLLOUT_MANAGER_PARENT_PID=$$ '{BIN}' agent --listen 127.0.0.1:0 --ready-file '{}' --state-dir '{}' & wait",
        ready.display(),
        dir.join("state").display()
    );
    let mut shell = Command::new("sh").arg("-c").arg(script).stdin(Stdio::null()).spawn().unwrap();
    let agent = wait_for(Duration::from_secs(30), "the agent's ready file", || agent_pid(&ready));
    assert!(alive(agent));
    shell.kill().unwrap(); // SIGKILL: the shell has no chance to pass anything on
    shell.wait().unwrap();
    wait_for(Duration::from_secs(30), "the agent to exit with its parent", || (!alive(agent)).then_some(()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_parent_pid_that_is_not_the_parent_is_refused_naming_the_flag() {
    let dir = temp_dir("wrong");
    let out = Command::new(BIN)
        .args(["agent", "--listen", "127.0.0.1:0", "--parent-pid", "1", "--state-dir"])
        .arg(dir.join("state"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--parent-pid 1") && stderr.contains("gone"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
