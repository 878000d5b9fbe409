//! The manager as a library, in-process: build a `Server` on port 0 with real `sglang-sim`
//! engines, drive it over HTTP, and shut it down through its signal future.
#![expect(
    clippy::disallowed_methods,
    clippy::unwrap_used,
    reason = "a test's helpers unwrap and its servers live as long as the test"
)]

use clap::Parser;
use rollout_core::ServeConfig;
use rollout_manager::app::server::Server;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeConfig,
}

/// `sglang-sim` from the same cargo target directory (built by `cargo build --workspace`).
fn sim_binary() -> PathBuf {
    let manager = PathBuf::from(env!("CARGO_BIN_EXE_rollout-manager"));
    let sim = manager.with_file_name("sglang-sim");
    assert!(sim.is_file(), "{} is missing: run `cargo build --workspace --bins` first", sim.display());
    sim
}

fn config(state_dir: &std::path::Path) -> ServeConfig {
    let sim = sim_binary();
    let args = [
        "rollout-manager",
        "--port=0",
        "--router-port=0",
        "--gpus=2",
        "--rollout-num-gpus=2",
        "--engine-arg=--time-scale=0.01",
        "--health-check-interval-secs=0.5",
    ];
    let mut cfg = Cli::try_parse_from(args).unwrap().serve;
    cfg.engine_program = Some(sim);
    cfg.state_dir = state_dir.to_path_buf();
    cfg
}

async fn get(url: &str) -> Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// Polls `f` until it returns `Some`, failing after `secs`.
async fn wait_for<T, F, Fut>(secs: u64, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_a_fleet_and_shuts_down_in_order() {
    let dir = std::env::temp_dir().join(format!("rm-serve-{}", uuid::Uuid::new_v4()));
    let server = Server::build(config(&dir)).await.unwrap();
    let control = format!("http://{}", server.control_addr().unwrap());
    let router = format!("http://{}", server.router_addr().unwrap());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async move {
        let _ = stop_rx.await;
    }));

    let engines = wait_for(60, "2 ACTIVE engines", || async {
        let v = get(&format!("{control}/rollout/engines")).await;
        let list = v["models"]["default"]["engines"].as_array().cloned().unwrap_or_default();
        (list.len() == 2 && list.iter().all(|e| e["status"] == "ACTIVE")).then_some(list)
    })
    .await;
    let pids: Vec<u64> = engines.iter().map(|e| e["pid"].as_u64().unwrap()).collect();
    assert!(pids.iter().all(|p| alive(*p)));

    let client = reqwest::Client::new();
    // ignore_eos: the simulated model samples its end-of-text token now and then, as a model does.
    let body = json!({"text": "hello fleet", "sampling_params": {"max_new_tokens": 4, "ignore_eos": true}});
    let mut served_by = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let resp = client
            .post(format!("{router}/generate"))
            .header("x-routing-policy", "round_robin")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        served_by.insert(resp.headers()["x-rollout-engine-id"].to_str().unwrap().to_string());
        let out: Value = resp.json().await.unwrap();
        assert_eq!(out["meta_info"]["completion_tokens"], 4);
        assert_eq!(out["meta_info"]["weight_version"], "default");
    }
    assert_eq!(served_by.len(), 2, "round robin must use both engines: {served_by:?}");

    // The GPU pool is full: a third engine is refused with a message naming the flag.
    let resp =
        client.post(format!("{control}/rollout/scale_out")).json(&json!({"num_replicas": 3})).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "insufficient_gpus");
    assert!(err["error"]["message"].as_str().unwrap().contains("--gpus"));

    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), running).await.unwrap().unwrap().unwrap();
    for pid in pids {
        assert!(!alive(pid), "engine {pid} outlived the manager's shutdown");
    }
    let _ = std::fs::remove_dir_all(dir);
}
