//! Test harness: starts the real `sglang-sim` binary on free loopback ports and talks to it
//! over HTTP. Every wait has a deadline; nothing asserts on timing.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use serde_json::{json, Value};
use std::future::Future;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

pub const BIN: &str = env!("CARGO_BIN_EXE_sglang-sim");
/// Generous upper bound for anything a test waits on.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `n` consecutive free ports; returns the first.
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let base = free_port();
        if u32::from(base) + u32::from(n) > 65535 {
            continue;
        }
        let all_free = (0..n).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no {n} consecutive free ports");
}

/// A unique scratch directory.
pub fn scratch_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "sglang-sim-test-{name}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A running simulator process (killed on drop).
pub struct Sim {
    pub child: Child,
    pub port: u16,
    pub client: reqwest::Client,
    pub log: PathBuf,
}

impl Sim {
    /// Starts `sglang-sim --model-path test-model --port <free> <args>` without waiting.
    pub fn spawn(args: &[&str]) -> Sim {
        Self::spawn_on(free_port(), args)
    }

    pub fn spawn_on(port: u16, args: &[&str]) -> Sim {
        let log = scratch_dir("log").join("sim.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(BIN)
            .args(["--model-path", "test-model", "--port", &port.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Sim { child, port, client: reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap(), log }
    }

    /// Starts the simulator (fast time scale unless `args` set one) and waits for /health 200.
    pub async fn start(args: &[&str]) -> Sim {
        let mut full = vec!["--time-scale", "0.01"];
        full.extend_from_slice(args);
        let mut sim = Self::spawn(&full);
        sim.wait_healthy().await;
        sim
    }

    pub fn url(&self, path: &str) -> String {
        url(self.port, path)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for /health 200; fails early if the process exits.
    pub async fn wait_healthy(&mut self) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            if let Ok(r) = self.client.get(self.url("/health")).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("sglang-sim exited ({status}) before becoming healthy; log:\n{}", self.logs());
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "port {} never became healthy; log:\n{}",
                self.port,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(self.url(path)).send().await.unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.client.post(self.url(path)).json(&body).send().await.unwrap()
    }

    pub async fn get_json(&self, path: &str) -> Value {
        let r = self.get(path).await;
        assert_eq!(r.status(), 200, "GET {path}");
        r.json().await.unwrap()
    }

    pub async fn post_json(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.post(path, body).await;
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// POST /generate and return (status, body).
    pub async fn generate(&self, body: Value) -> (u16, Value) {
        self.post_json("/generate", body).await
    }

    /// The first DP rank's load.
    pub async fn load(&self) -> Value {
        self.get_json("/v1/loads").await["loads"][0].clone()
    }

    /// Waits until the first rank's load satisfies `pred`.
    pub async fn wait_load(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let l = self.load().await;
            if pred(&l) {
                return l;
            }
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}: {l}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits for the process to exit; returns its exit code.
    pub async fn wait_exit(&mut self) -> Option<i32> {
        let status = tokio::time::timeout(DEADLINE, self.child.wait()).await.expect("process did not exit").unwrap();
        status.code()
    }
}

pub fn url(port: u16, path: &str) -> String {
    format!("http://127.0.0.1:{port}{path}")
}

pub async fn wait_healthy(client: &reqwest::Client, port: u16, log: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Ok(r) = client.get(url(port, "/health")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "port {port} never became healthy; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Awaits `f` with the test deadline.
pub async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, f).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// A generate body with `ignore_eos` so the output length is exactly `max_new_tokens`.
/// A greedy request (so equal requests give equal tokens; sampled ones are random unless the
/// engine runs with `--enable-deterministic-inference`).
pub fn gen_body(text: &str, max_new_tokens: u64) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": true, "temperature": 0}})
}

/// A minimal valid safetensors file with one F32 tensor of `n` elements.
pub fn safetensors_bytes(n: usize, fill: u8) -> Vec<u8> {
    let header = format!(r#"{{"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#, n * 4);
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend(std::iter::repeat_n(fill, n * 4));
    out
}
