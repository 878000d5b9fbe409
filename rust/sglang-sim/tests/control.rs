//! Control endpoints (pause/continue, abort, flush, weight updates) against the real binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{gen_body, safetensors_bytes, scratch_dir, within, Sim};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// Starts a long generation in the background (about 24 s of engine time at scale 1).
fn spawn_long(sim: &Sim, rid: &str) -> tokio::task::JoinHandle<(u16, Value)> {
    let client = sim.client.clone();
    let url = sim.url("/generate");
    let body = json!({"text": "a long one", "rid": rid,
                      "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true}});
    tokio::spawn(async move {
        let r = client.post(url).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    })
}

#[tokio::test]
async fn flush_cache_refuses_while_running_and_abort_ends_the_request() {
    let sim = Sim::start(&["--time-scale", "1"]).await;
    assert_eq!(sim.get("/flush_cache").await.status(), 200);
    let long = spawn_long(&sim, "long-1");
    sim.wait_load("a running request", |l| l["num_running_reqs"] == 1).await;

    // SGLang 0.5.23 refuses with plain text (entrypoints/http_server.py:1025-1040).
    let r = sim.client.post(sim.url("/flush_cache")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.headers().get("content-type").is_none());
    assert_eq!(r.text().await.unwrap(), "Flush cache failed.\n");

    // abort_request needs a body.
    let r = sim.client.post(sim.url("/abort_request")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let (status, _) = sim.post_json("/abort_request", json!({"rid": "long-1"})).await;
    assert_eq!(status, 200);
    let (status, out) = within("aborted request", long).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        out["meta_info"]["finish_reason"],
        json!({"type": "abort", "message": "Aborted", "status_code": null, "err_type": null})
    );
    assert!(out["meta_info"]["completion_tokens"].as_u64().unwrap() < 3000);

    sim.wait_load("idle", |l| l["num_running_reqs"] == 0).await;
    assert_eq!(sim.get("/flush_cache").await.status(), 200);
}

#[tokio::test]
async fn pause_in_place_holds_new_requests_until_continue() {
    let sim = Sim::start(&[]).await;
    let r = sim.client.post(sim.url("/pause_generation")).send().await.unwrap();
    assert_eq!(r.status(), 400, "an empty body is a validation error");
    let (status, out) = sim.post_json("/pause_generation", json!({"mode": "in_place"})).await;
    assert_eq!(status, 200);
    assert_eq!(out, json!({"message": "Generation paused successfully.", "status": "ok"}));
    assert_eq!(sim.get("/ready").await.status(), 503);
    // (`/health` on a paused engine times out with 503, as in SGLang: see tests/health.rs.)

    let client = sim.client.clone();
    let url = sim.url("/generate");
    let waiting = tokio::spawn(async move {
        let r = client.post(url).json(&gen_body("paused", 4)).send().await.unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    });
    let l = sim.wait_load("the request to be held", |l| l["queues"]["paused"] == 1).await;
    assert_eq!(l["num_running_reqs"], 0);
    assert!(!waiting.is_finished(), "a paused engine must not answer");

    let (status, out) = sim.post_json("/continue_generation", json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(out, json!({"message": "Generation continued successfully.", "status": "ok"}));
    let (status, out) = within("request after continue", waiting).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(out["meta_info"]["completion_tokens"], 4);
    assert_eq!(sim.get("/ready").await.status(), 200);
}

#[tokio::test]
async fn pause_abort_mode_aborts_running_requests() {
    let sim = Sim::start(&["--time-scale", "1"]).await;
    let long = spawn_long(&sim, "long-2");
    sim.wait_load("a running request", |l| l["num_running_reqs"] == 1).await;
    let (status, _) = sim.post_json("/pause_generation", json!({"mode": "abort"})).await;
    assert_eq!(status, 200);
    let (_, out) = within("aborted by pause", long).await.unwrap();
    assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort");
    sim.post_json("/continue_generation", json!({})).await;
}

#[tokio::test]
async fn pause_retract_mode_requeues_and_resumes() {
    let sim = Sim::start(&["--time-scale", "0.05"]).await;
    let client = sim.client.clone();
    let url = sim.url("/generate");
    let req = tokio::spawn(async move {
        let body = json!({"text": "retract me", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": true}});
        client.post(url).json(&body).send().await.unwrap().json::<Value>().await.unwrap()
    });
    sim.wait_load("a running request", |l| l["num_running_reqs"] == 1).await;
    sim.post_json("/pause_generation", json!({"mode": "retract"})).await;
    let l = sim.wait_load("the request to be retracted", |l| l["num_waiting_reqs"] == 1).await;
    assert_eq!(l["num_running_reqs"], 0);
    assert_eq!(l["queues"]["retracted"], 1);
    assert_eq!(l["num_used_tokens"], 0, "retracted requests hold no KV");
    // Retracted requests do not block a flush (the slime flow: pause, update, continue).
    assert_eq!(sim.get("/flush_cache").await.status(), 200);
    sim.post_json("/continue_generation", json!({})).await;
    let out = within("retracted request", req).await.unwrap();
    assert_eq!(out["meta_info"]["completion_tokens"], 2000);
    assert_eq!(out["meta_info"]["num_retractions"], 1);
}

#[tokio::test]
async fn update_weights_from_disk_reads_and_checks_files() {
    let sim = Sim::start(&[]).await;
    let dir = scratch_dir("ckpt");
    let a = safetensors_bytes(4, 1);
    let b = safetensors_bytes(2, 7);
    std::fs::write(dir.join("model-00002.safetensors"), &b).unwrap();
    std::fs::write(dir.join("model-00001.safetensors"), &a).unwrap();
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    // The shared rule: SHA-256 of the shards' `sha256sum` listing in name order.
    let hex = |bytes: &[u8]| -> String { bytes.iter().map(|x| format!("{x:02x}")).collect() };
    let listing = format!(
        "{}  model-00001.safetensors\n{}  model-00002.safetensors\n",
        hex(&Sha256::digest(&a)),
        hex(&Sha256::digest(&b))
    );
    let expected = hex(&Sha256::digest(listing.as_bytes()));

    let (status, out) = sim
        .post_json(
            "/update_weights_from_disk",
            json!({"model_path": dir.to_str().unwrap(), "weight_version": "disk-1"}),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["success"], true);
    assert_eq!(out["num_paused_requests"], 0);
    assert!(out["message"].as_str().unwrap().contains("disk-1"));
    let info = sim.get_json("/server_info").await;
    assert_eq!(info["weights_checksum"], expected);
    // The top level of /server_info is the startup configuration (SGLang 0.5.18 on); the live
    // version and identity are /model_info's.
    assert_eq!(info["weight_version"], "default");
    assert_eq!(info["model_path"], "test-model");
    assert_eq!(info["internal_states"][0]["weight_version"], "disk-1");
    let model = sim.get_json("/model_info").await;
    let path = dir.to_str().unwrap();
    assert_eq!((model["weight_version"].as_str(), model["model_path"].as_str()), (Some("disk-1"), Some(path)));
    assert_eq!(model["served_model_name"], path);
    let (_, g) = sim.generate(gen_body("after update", 2)).await;
    assert_eq!(g["meta_info"]["weight_version"], "disk-1");

    // Garbage is rejected and nothing changes.
    let bad = scratch_dir("garbage");
    std::fs::write(bad.join("model.safetensors"), b"definitely not safetensors").unwrap();
    let (status, out) = sim
        .post_json(
            "/update_weights_from_disk",
            json!({"model_path": bad.to_str().unwrap(), "weight_version": "disk-2"}),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(out["success"], false);
    assert!(out["message"].as_str().unwrap().contains("Invalid safetensors"), "{out}");
    let info = sim.get_json("/server_info").await;
    assert_eq!(info["weights_checksum"], expected);
    let model = sim.get_json("/model_info").await;
    assert_eq!((model["weight_version"].as_str(), model["model_path"].as_str()), (Some("disk-1"), Some(path)));

    // A missing path fails; a missing model_path is a validation error.
    let (status, out) = sim.post_json("/update_weights_from_disk", json!({"model_path": "/no/such/ckpt"})).await;
    assert_eq!((status, out["success"].clone()), (400, json!(false)));
    let (status, out) = sim.post_json("/update_weights_from_disk", json!({})).await;
    assert_eq!(status, 400);
    assert_eq!(out["object"], "error");
}

#[tokio::test]
async fn weight_update_waits_for_in_flight_requests() {
    let sim = Sim::start(&["--time-scale", "0.05"]).await;
    let dir = scratch_dir("ckpt-wait");
    std::fs::write(dir.join("m.safetensors"), safetensors_bytes(1, 0)).unwrap();
    let client = sim.client.clone();
    let url = sim.url("/generate");
    let req = tokio::spawn(async move {
        let body = json!({"text": "in flight", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": true}});
        client.post(url).json(&body).send().await.unwrap().json::<Value>().await.unwrap()
    });
    sim.wait_load("a running request", |l| l["num_running_reqs"] == 1).await;
    let (status, out) = sim
        .post_json("/update_weights_from_disk", json!({"model_path": dir.to_str().unwrap(), "weight_version": "w2"}))
        .await;
    assert_eq!(status, 200, "{out}");
    // The update waited: the in-flight request finished entirely under the old version.
    let out = within("in-flight request", req).await.unwrap();
    assert_eq!(out["meta_info"]["completion_tokens"], 2000);
    assert_eq!(out["meta_info"]["weight_version"], "default");
}

/// SGLang renames the served model to the checkpoint after a disk update, even when
/// `--served-model-name` was given; what `/server_info` says depends on the release.
#[tokio::test]
async fn a_disk_update_renames_the_served_model() {
    let dir = scratch_dir("ckpt-rename");
    std::fs::write(dir.join("m.safetensors"), safetensors_bytes(2, 5)).unwrap();
    let path = dir.to_str().unwrap();
    for (release, server_info_follows) in [("0.5.12", true), ("0.5.23", false)] {
        let sim =
            Sim::start(&["--sglang-api", release, "--served-model-name", "pinned", "--weight-version", "v0"]).await;
        let (status, out) = sim
            .post_json(
                "/update_weights_from_disk",
                json!({"model_path": path, "weight_version": "v1", "load_format": "auto"}),
            )
            .await;
        assert_eq!(status, 200, "{out}");
        let model = sim.get_json("/get_model_info").await;
        assert_eq!(model["model_path"], path);
        assert_eq!(model["served_model_name"], path);
        assert_eq!(sim.get_json("/v1/models").await["data"][0]["id"], path);
        assert_eq!(sim.get("/v1/models/pinned").await.status(), 404);
        let info = sim.get_json("/get_server_info").await;
        assert_eq!(info["served_model_name"], "pinned", "{release}");
        let (model_path, version) = if server_info_follows { (path, "v1") } else { ("test-model", "v0") };
        assert_eq!((info["model_path"].as_str(), info["weight_version"].as_str()), (Some(model_path), Some(version)));
        // Schedulers learn the version from 0.5.19 on.
        let scheduler_version = if server_info_follows { "v0" } else { "v1" };
        assert_eq!(info["internal_states"][0]["weight_version"], scheduler_version, "{release}");
        assert_eq!(info["internal_states"][0]["model_path"], path);
    }
}
