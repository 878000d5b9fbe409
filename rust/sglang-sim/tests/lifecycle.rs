//! Process lifecycle: startup delay and warmup, instances, faults, signals, CLI errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{free_port, free_ports, gen_body, url, wait_healthy, within, Sim, BIN, DEADLINE};
use serde_json::json;
use std::time::Duration;

#[tokio::test]
async fn port_opens_after_startup_delay_then_health_turns_200_after_warmup() {
    let mut sim = Sim::spawn(&["--startup-delay", "1", "--warmup-delay", "2", "--time-scale", "0.01"]);
    // Not bound yet: connections are refused.
    let early = sim.client.get(sim.url("/model_info")).send().await;
    assert!(early.is_err(), "port must not be bound during the startup delay");

    // Wait for the port, then /model_info answers while /health is still 503.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let info = loop {
        if let Ok(r) = sim.client.get(sim.url("/model_info")).send().await {
            break r;
        }
        assert!(tokio::time::Instant::now() < deadline, "port never opened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(info.status(), 200);
    assert_eq!(sim.get("/health").await.status(), 503);
    assert_eq!(sim.get_json("/server_info").await["status"], "Starting");
    sim.wait_healthy().await;
    assert_eq!(sim.get_json("/server_info").await["status"], "Up");
    assert!(sim.logs().contains("The server is fired up and ready to roll!"));
}

#[tokio::test]
async fn instances_are_independent_engines_on_consecutive_ports() {
    let base = free_ports(3);
    let sim = Sim::spawn_on(base, &["--instances", "3", "--time-scale", "0.01"]);
    for i in 0..3 {
        wait_healthy(&sim.client, base + i, &sim.log).await;
    }
    let r = sim
        .client
        .post(url(base + 1, "/update_weight_version"))
        .json(&json!({"new_version": "only-one"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let version = |port: u16| {
        let c = sim.client.clone();
        async move {
            let v: serde_json::Value = c.get(url(port, "/model_info")).send().await.unwrap().json().await.unwrap();
            v["weight_version"].as_str().unwrap().to_string()
        }
    };
    assert_eq!(version(base).await, "default");
    assert_eq!(version(base + 1).await, "only-one");
    assert_eq!(version(base + 2).await, "default");
    let ports: Vec<u64> = futures::future::join_all((0..3).map(|i| {
        let c = sim.client.clone();
        async move {
            let v: serde_json::Value = c.get(url(base + i, "/server_info")).send().await.unwrap().json().await.unwrap();
            v["port"].as_u64().unwrap()
        }
    }))
    .await;
    assert_eq!(ports, vec![u64::from(base), u64::from(base) + 1, u64::from(base) + 2]);
}

#[tokio::test]
async fn crash_after_requests_exits_nonzero() {
    let mut sim = Sim::start(&["--crash-after-requests", "2"]).await;
    for _ in 0..2 {
        let (status, _) = sim.generate(gen_body("x", 2)).await;
        assert_eq!(status, 200);
    }
    let code = sim.wait_exit().await;
    assert_eq!(code, Some(3));
    assert!(sim.client.get(sim.url("/health")).send().await.is_err());
}

#[tokio::test]
async fn hang_after_requests_stops_answering() {
    let sim = Sim::start(&["--hang-after-requests", "1"]).await;
    let (status, _) = sim.generate(gen_body("x", 2)).await;
    assert_eq!(status, 200);
    let quick = reqwest::Client::builder().timeout(Duration::from_millis(700)).build().unwrap();
    let r = quick.get(sim.url("/health")).send().await;
    assert!(r.unwrap_err().is_timeout(), "a hung engine must not answer /health");
    let r = quick.get(sim.url("/model_info")).send().await;
    assert!(r.is_err());
}

#[tokio::test]
async fn fail_startup_exits_1_with_a_message() {
    let mut sim = Sim::spawn(&["--fail-startup", "--startup-delay", "0.2"]);
    assert_eq!(sim.wait_exit().await, Some(1));
    assert!(sim.logs().contains("--fail-startup"), "{}", sim.logs());
}

#[tokio::test]
async fn sigterm_shuts_down_cleanly() {
    let mut sim = Sim::start(&[]).await;
    let pid = sim.child.id().unwrap();
    let status = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    assert!(status.success());
    assert_eq!(sim.wait_exit().await, Some(0));
}

#[tokio::test]
async fn unknown_flag_is_rejected_by_name() {
    let out = within(
        "sglang-sim with a bad flag",
        tokio::process::Command::new(BIN)
            .args(["--model-path", "m", "--port", &free_port().to_string(), "--frobnicate"])
            .output(),
    )
    .await
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--frobnicate"), "{err}");

    let out = tokio::process::Command::new(BIN).output().await.unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model-path"));
}

#[tokio::test]
async fn slow_health_delays_health_only() {
    let sim = Sim::spawn(&["--slow-health", "1.5", "--time-scale", "0.01", "--skip-server-warmup"]);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while sim.client.get(sim.url("/model_info")).send().await.is_err() {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let quick = reqwest::Client::builder().timeout(Duration::from_millis(500)).build().unwrap();
    assert!(quick.get(sim.url("/health")).send().await.is_err(), "health is slow");
    assert_eq!(quick.get(sim.url("/model_info")).send().await.unwrap().status(), 200);
    assert_eq!(sim.get("/health").await.status(), 200);
}

#[tokio::test]
async fn zero_cost_mode_answers_without_the_scheduler() {
    let sim = Sim::start(&["--zero-cost"]).await;
    let (status, out) = sim.generate(gen_body("fast", 8)).await;
    assert_eq!(status, 200);
    assert_eq!(out["output_ids"].as_array().unwrap().len(), 8);
    // Same tokens as the timed engine would give.
    let timed = Sim::start(&[]).await;
    let (_, t) = timed.generate(gen_body("fast", 8)).await;
    assert_eq!(out["output_ids"], t["output_ids"]);
    let r = sim.post("/generate", json!({"text": "s", "stream": true, "sampling_params": {"max_new_tokens": 2}})).await;
    assert!(r.text().await.unwrap().ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn fault_api_slows_health_then_hangs_the_engine() {
    let plain = Sim::start(&[]).await;
    assert_eq!(plain.post("/sim/faults", json!({"hang": true})).await.status(), 404, "off without the flag");
    assert_eq!(plain.get("/health").await.status(), 200);

    let sim = Sim::start(&["--enable-fault-api"]).await;
    let (status, out) = sim.post_json("/sim/faults", json!({"slow_health": 1.5})).await;
    assert_eq!((status, out), (200, json!({"slow_health": 1.5, "hung": false, "scheduler_hung": false})));
    let quick = reqwest::Client::builder().timeout(Duration::from_millis(500)).build().unwrap();
    assert!(quick.get(sim.url("/health")).send().await.is_err(), "health is slow");
    assert_eq!(quick.get(sim.url("/model_info")).send().await.unwrap().status(), 200);
    // Bad values and unknown fields are refused and change nothing.
    let (status, _) = sim.post_json("/sim/faults", json!({"slow_health": -1})).await;
    assert_eq!(status, 400);
    let (status, _) = sim.post_json("/sim/faults", json!({"slow": 1})).await;
    assert_eq!(status, 400);
    let (status, out) = sim.post_json("/sim/faults", json!({"slow_health": 0})).await;
    assert_eq!((status, out), (200, json!({"slow_health": null, "hung": false, "scheduler_hung": false})));
    assert_eq!(quick.get(sim.url("/health")).send().await.unwrap().status(), 200);

    let (status, out) = sim.post_json("/sim/faults", json!({"hang": true})).await;
    assert_eq!((status, out["hung"].clone()), (200, json!(true)));
    assert!(quick.get(sim.url("/health")).send().await.unwrap_err().is_timeout(), "a hung engine answers nothing");
    assert!(quick.post(sim.url("/generate")).json(&gen_body("x", 2)).send().await.is_err());
}

#[tokio::test]
async fn a_hung_scheduler_still_answers_what_the_http_process_serves_alone() {
    let sim = Sim::start(&["--enable-fault-api"]).await;
    let (status, out) = sim.post_json("/sim/faults", json!({"hang_scheduler": true})).await;
    assert_eq!((status, out["scheduler_hung"].clone()), (200, json!(true)));
    // The load snapshot and the model info come from the HTTP process.
    assert_eq!(sim.get("/v1/loads").await.status(), 200);
    assert_eq!(sim.get("/model_info").await.status(), 200);
    // Whatever needs the scheduler never answers.
    let quick = reqwest::Client::builder().timeout(Duration::from_millis(500)).build().unwrap();
    for path in ["/server_info", "/health_generate"] {
        assert!(quick.get(sim.url(path)).send().await.is_err(), "{path} should hang");
    }
    let gen = quick.post(sim.url("/generate")).json(&json!({"text": "hi"})).send().await;
    assert!(gen.is_err(), "/generate should hang");
}
