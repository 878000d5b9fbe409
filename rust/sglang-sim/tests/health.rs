//! `/health` and `/health_generate` as in SGLang 0.5.x: a 1-token generation that passes on
//! any scheduler output, fails (empty 503) after `SGLANG_HEALTH_CHECK_TIMEOUT`, and the two
//! environment variables. Outcomes only: no durations are asserted.

#![expect(clippy::unwrap_used, reason = "tests fail loudly")]

mod common;

use common::{free_port, gen_body, scratch_dir, within, Sim, BIN};
use serde_json::json;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::Command;

/// Starts the simulator with extra environment variables and waits for it to be up (read from
/// `/server_info`, which does not run a health check).
async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Sim {
    let port = free_port();
    let log = scratch_dir("log").join("sim.log");
    let child = Command::new(BIN)
        .args(["--model-path", "test-model", "--port", &port.to_string(), "--skip-server-warmup"])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let sim = Sim { child, port, client, log };
    within("the server to be up", async {
        loop {
            if let Ok(r) = sim.client.get(sim.url("/server_info")).send().await {
                if r.status() == 200 && r.json::<serde_json::Value>().await.unwrap()["status"] == "Up" {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    sim
}

async fn status_of(sim: &Sim) -> String {
    sim.get_json("/server_info").await["status"].as_str().unwrap().to_string()
}

/// (status code, body) of a GET.
async fn probe(sim: &Sim, path: &str) -> (u16, String) {
    let r = sim.get(path).await;
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn idle_engine_is_healthy_and_health_checks_are_not_counted() {
    let sim = start_with_env(&["--time-scale", "0.01", "--enable-metrics"], &[]).await;
    assert_eq!(probe(&sim, "/health").await.0, 200);
    assert_eq!(probe(&sim, "/health_generate").await.0, 200);
    assert_eq!(status_of(&sim).await, "Up");
    let metrics = sim.get("/metrics").await.text().await.unwrap();
    let served: Vec<&str> = metrics.lines().filter(|l| l.starts_with("sglang:num_requests_total")).collect();
    assert!(served.iter().all(|l| l.ends_with(" 0") || l.ends_with(" 0.0")), "health checks counted: {served:?}");
    sim.wait_load("the health requests to end", |l| l["num_running_reqs"] == 0 && l["num_waiting_reqs"] == 0).await;
}

#[tokio::test]
async fn paused_engine_fails_health_after_the_timeout_and_passes_after_continue() {
    let sim = start_with_env(&["--time-scale", "0.01"], &[("SGLANG_HEALTH_CHECK_TIMEOUT", "1")]).await;
    for mode in ["abort", "retract", "in_place"] {
        let (status, _) = sim.post_json("/pause_generation", json!({"mode": mode})).await;
        assert_eq!(status, 200);
        assert_eq!(probe(&sim, "/health").await, (503, String::new()), "paused ({mode})");
        assert_eq!(status_of(&sim).await, "UnHealthy", "a failed check marks the server ({mode})");
        assert_eq!(sim.get("/ready").await.status(), 503);
        assert_eq!(probe(&sim, "/health_generate").await.0, 503, "still paused ({mode})");
        let (status, _) = sim.post_json("/continue_generation", json!({})).await;
        assert_eq!(status, 200);
        assert_eq!(probe(&sim, "/health").await.0, 200, "after continue ({mode})");
        assert_eq!(status_of(&sim).await, "Up", "a passing check marks it up again ({mode})");
        assert_eq!(sim.get("/ready").await.status(), 200);
    }
}

#[tokio::test]
async fn busy_engine_is_healthy_without_waiting_for_the_long_request() {
    // One running slot, held by a long non-streaming generation: the health request queues
    // behind it and the check passes on the long request's periodic output.
    let sim = start_with_env(&["--time-scale", "1", "--max-running-requests", "1"], &[]).await;
    let (client, url) = (sim.client.clone(), sim.url("/generate"));
    let long = tokio::spawn(async move {
        let r = client.post(url).json(&gen_body("a long rollout", 20_000)).send().await.unwrap();
        r.json::<serde_json::Value>().await.unwrap()
    });
    sim.wait_load("the long request to run", |l| l["num_running_reqs"] == 1).await;
    assert_eq!(probe(&sim, "/health").await.0, 200);
    assert!(!long.is_finished(), "health must not wait for the long request");
    assert_eq!(sim.load().await["num_running_reqs"], 1, "the long request is still running");

    let (status, _) = sim.post_json("/abort_request", json!({"abort_all": true})).await;
    assert_eq!(status, 200);
    let out = within("the aborted request", long).await.unwrap();
    assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort");
}

#[tokio::test]
async fn disabled_generation_makes_health_answer_at_once_but_not_health_generate() {
    let sim = start_with_env(
        &["--time-scale", "0.01"],
        &[("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false"), ("SGLANG_HEALTH_CHECK_TIMEOUT", "1")],
    )
    .await;
    let (status, _) = sim.post_json("/pause_generation", json!({"mode": "abort"})).await;
    assert_eq!(status, 200);
    assert_eq!(probe(&sim, "/health").await.0, 200, "no generation: the pause is not seen");
    assert_eq!(probe(&sim, "/health_generate").await.0, 503, "/health_generate always generates");
}

#[tokio::test]
async fn zero_timeout_fails_at_once_and_starting_is_503() {
    let sim = start_with_env(&["--time-scale", "0.01"], &[("SGLANG_HEALTH_CHECK_TIMEOUT", "0")]).await;
    assert_eq!(probe(&sim, "/health").await, (503, String::new()));
    assert_eq!(status_of(&sim).await, "UnHealthy");

    let starting = Sim::spawn(&["--warmup-delay", "60"]);
    within("the port to open", async {
        while starting.client.get(starting.url("/model_info")).send().await.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(probe(&starting, "/health").await, (503, String::new()), "starting");
}

/// `/ping` answers from the health flag in 0.5.23 (paused is still up) and always 200 before.
#[tokio::test]
async fn ping_follows_the_health_flag_from_0_5_23() {
    let env = [("SGLANG_HEALTH_CHECK_TIMEOUT", "0")];
    for (release, reports) in [("0.5.23", true), ("0.5.12", false)] {
        let sim = start_with_env(&["--time-scale", "0.01", "--sglang-api", release], &env).await;
        assert_eq!(probe(&sim, "/ping").await, (200, String::new()));
        assert_eq!(sim.post_json("/pause_generation", json!({"mode": "in_place"})).await.0, 200);
        assert_eq!(probe(&sim, "/ping").await.0, 200, "paused ({release})");
        assert_eq!(sim.post_json("/continue_generation", json!({})).await.0, 200);
        assert_eq!(probe(&sim, "/health_generate").await.0, 503);
        assert_eq!(status_of(&sim).await, "UnHealthy");
        let expected = if reports { 503 } else { 200 };
        assert_eq!(probe(&sim, "/ping").await, (expected, String::new()), "unhealthy ({release})");
    }
    let starting = Sim::spawn(&["--warmup-delay", "60"]);
    within("the port to open", async {
        while starting.client.get(starting.url("/model_info")).send().await.is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(probe(&starting, "/ping").await, (503, String::new()), "starting");
}

/// SIGTERM to an engine whose last health check failed ends it at once: the running request
/// is not aborted (its connection is cut when the process exits), as in SGLang.
#[tokio::test]
async fn sigterm_while_unhealthy_exits_without_draining() {
    let mut sim = start_with_env(&["--time-scale", "1"], &[("SGLANG_HEALTH_CHECK_TIMEOUT", "0")]).await;
    let (client, url) = (sim.client.clone(), sim.url("/generate"));
    let long = tokio::spawn(async move {
        let r = client.post(url).json(&gen_body("a long rollout", 20_000)).send().await?;
        r.json::<serde_json::Value>().await
    });
    sim.wait_load("the long request to run", |l| l["num_running_reqs"] == 1).await;
    assert_eq!(probe(&sim, "/health").await.0, 503);
    let pid = sim.child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert_eq!(sim.wait_exit().await, Some(0));
    assert!(within("the cut request", long).await.unwrap().is_err(), "the request must not be answered");
    assert!(sim.logs().contains("Signal SIGTERM received while health check failed. Force exiting."));
}
