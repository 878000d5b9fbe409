//! SGLang's distributed weight paths against the real binary: the trainer broadcast order
//! (group, pause, begin, update, end, continue, destroy), its failures when called out of order,
//! and the seed side of remote-instance loading.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{gen_body, within, Sim};
use serde_json::{json, Value};
use tokio::io::AsyncBufReadExt;

/// The tensors [`update_body`] names, which the stand-in rank 0 broadcasts.
const NAMES: [&str; 2] = ["model.embed_tokens.weight", "lm_head.weight"];

/// A stand-in trainer rank 0: accepts the engines' rendezvous and hands back their lines; to
/// an engine that waits for the broadcast (its line has no `tp_size`) it sends [`NAMES`].
async fn rank0() -> (u16, tokio::sync::mpsc::UnboundedReceiver<Value>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let (read, mut write) = s.into_split();
            let mut lines = tokio::io::BufReader::new(read).lines();
            if let Ok(Some(l)) = lines.next_line().await {
                let line: Value = serde_json::from_str(&l).unwrap();
                if line.get("tp_size").is_none() {
                    let reply = format!("{}\n", json!({"names": NAMES}));
                    let _ = write.write_all(reply.as_bytes()).await;
                    continue;
                }
                let _ = tx.send(line);
            }
        }
    });
    (port, rx)
}

fn init_body(port: u16, rank_offset: u32, world_size: u32) -> Value {
    json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": rank_offset,
           "world_size": world_size, "group_name": "g1", "backend": "nccl"})
}

fn update_body(version: &str) -> Value {
    json!({"names": NAMES, "dtypes": ["bfloat16", "bfloat16"],
           "shapes": [[128, 64], [128, 64]], "group_name": "g1", "weight_version": version})
}

async fn assert_refused(sim: &Sim, path: &str, body: Value, needle: &str) {
    let (status, out) = sim.post_json(path, body).await;
    assert_eq!(status, 400, "{path}: {out}");
    assert_eq!(out["success"], false, "{path}: {out}");
    let msg = out["message"].as_str().unwrap();
    assert!(msg.contains(needle), "{path}: {msg:?} should mention {needle:?}");
}

#[tokio::test]
async fn the_documented_order_updates_the_version() {
    let sim = Sim::start(&[]).await;
    let (port, mut joined) = rank0().await;
    let (status, out) = sim.post_json("/init_weights_update_group", init_body(port, 1, 2)).await;
    assert_eq!((status, &out["success"]), (200, &json!(true)), "{out}");
    let line = within("the rendezvous line", joined.recv()).await.unwrap();
    assert_eq!((line["group_name"].as_str(), line["rank_offset"].as_u64()), (Some("g1"), Some(1)));
    assert_eq!((line["tp_size"].as_u64(), line["world_size"].as_u64()), (Some(1), Some(2)));
    let info = sim.get_json("/server_info").await;
    assert_eq!(info["weight_sync"]["weight_update_groups"]["g1"]["rank_offset"], 1);

    assert_eq!(sim.post_json("/pause_generation", json!({"mode": "abort"})).await.0, 200);
    assert_eq!(sim.post_json("/begin_weight_update", json!({})).await.0, 200);
    let (status, out) = sim.post_json("/update_weights_from_distributed", update_body("step-7")).await;
    assert_eq!(status, 200, "{out}");
    assert!(out["message"].as_str().unwrap().contains("step-7"));
    assert_eq!(sim.post_json("/end_weight_update", json!({})).await.0, 200);
    assert_eq!(sim.post_json("/continue_generation", json!({})).await.0, 200);
    assert_eq!(sim.get_json("/model_info").await["weight_version"], "step-7");
    let (_, g) = sim.generate(gen_body("after the broadcast", 2)).await;
    assert_eq!(g["meta_info"]["weight_version"], "step-7");
    assert_eq!(sim.get_json("/server_info").await["weights"]["num_tensors"], 2);

    assert_eq!(sim.post_json("/destroy_weights_update_group", json!({"group_name": "g1"})).await.0, 200);
    assert_refused(&sim, "/destroy_weights_update_group", json!({"group_name": "g1"}), "does not exist").await;
    // A rebuilt group (new port, new name) works again.
    let (port2, _j) = rank0().await;
    let mut b = init_body(port2, 1, 2);
    b["group_name"] = json!("g2");
    assert_eq!(sim.post_json("/init_weights_update_group", b).await.0, 200);
}

#[tokio::test]
async fn calls_out_of_order_fail_as_sglang_does() {
    let sim = Sim::start(&[]).await;
    // SGLang 0.5.23 checks the session first, then (receiving) the group; the messages are its
    // own (managers/scheduler_components/weight_updater.py:187-197, :306-336).
    let outside = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()";
    let (status, out) = sim.post_json("/update_weights_from_distributed", update_body("x")).await;
    assert_eq!((status, out), (400, json!({"success": false, "message": outside})));
    let (status, out) = sim.post_json("/end_weight_update", json!({})).await;
    let none_open = "no weight-update session is open; call begin_weight_update() first";
    assert_eq!((status, out), (400, json!({"success": false, "message": none_open})));
    let (port, _j) = rank0().await;
    assert_eq!(sim.post_json("/init_weights_update_group", init_body(port, 1, 2)).await.0, 200);
    assert_refused(&sim, "/init_weights_update_group", init_body(port, 1, 2), "already exists").await;
    assert_refused(&sim, "/update_weights_from_distributed", update_body("x"), "begin_weight_update").await;
    assert_eq!(
        sim.post_json("/begin_weight_update", json!({})).await,
        (200, json!({"success": true, "message": "Success"}))
    );
    let (status, out) = sim.post_json("/begin_weight_update", json!({})).await;
    let open = "a weight-update session is already open; call end_weight_update() first";
    assert_eq!((status, out), (400, json!({"success": false, "message": open})));
    let mut other = update_body("x");
    other["group_name"] = json!("nope");
    let (status, out) = sim.post_json("/update_weights_from_distributed", other).await;
    let unknown = "Failed to receive weights: Group nope not in ['g1']. Please call `init_weights_update_group` first.";
    assert_eq!((status, out), (400, json!({"success": false, "message": unknown})));
    let mut uneven = update_body("x");
    uneven["dtypes"] = json!(["bfloat16"]);
    assert_refused(&sim, "/update_weights_from_distributed", uneven, "equal length").await;
    assert_eq!(sim.get_json("/model_info").await["weight_version"], "default", "nothing was applied");

    // Bodies that do not match the schema are validation errors; an empty body too.
    let r = sim.client.post(sim.url("/begin_weight_update")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let (status, out) = sim.post_json("/update_weights_from_distributed", json!({"names": ["a"]})).await;
    assert_eq!((status, out["object"].as_str()), (400, Some("error")), "{out}");
    let (status, out) = sim.post_json("/end_weight_update", json!([])).await;
    assert_eq!(status, 400, "{out}");
}

#[tokio::test]
async fn group_layout_and_rank_zero_are_checked() {
    let sim = Sim::start(&["--tp-size", "2"]).await;
    let (port, mut joined) = rank0().await;
    assert_refused(&sim, "/init_weights_update_group", init_body(port, 0, 3), "rank_offset").await;
    assert_refused(&sim, "/init_weights_update_group", init_body(port, 2, 3), "world_size").await;
    assert_eq!(sim.post_json("/init_weights_update_group", init_body(port, 1, 3)).await.0, 200);
    assert_eq!(within("rendezvous", joined.recv()).await.unwrap()["tp_size"], 2);
    // Nobody listening at the master address: the init fails (SGLang would block, then fail).
    let closed = common::free_port();
    let mut b = init_body(closed, 1, 3);
    b["group_name"] = json!("g9");
    assert_refused(&sim, "/init_weights_update_group", b, "did not accept").await;
}

#[tokio::test]
async fn an_unflushable_cache_fails_the_update_but_keeps_the_weights() {
    let sim = Sim::start(&["--time-scale", "1"]).await;
    let (port, _j) = rank0().await;
    assert_eq!(sim.post_json("/init_weights_update_group", init_body(port, 1, 2)).await.0, 200);
    let client = sim.client.clone();
    let url = sim.url("/generate");
    let long = tokio::spawn(async move {
        let body = json!({"text": "long", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true}});
        client.post(url).json(&body).send().await.unwrap().json::<Value>().await.unwrap()
    });
    sim.wait_load("a running request", |l| l["num_running_reqs"] == 1).await;
    // Paused in place: the request keeps its KV, so the cache cannot be flushed.
    assert_eq!(sim.post_json("/pause_generation", json!({"mode": "in_place"})).await.0, 200);
    assert_eq!(sim.post_json("/begin_weight_update", json!({})).await.0, 200);
    assert_refused(&sim, "/update_weights_from_distributed", update_body("v2"), "the cache was not flushed").await;
    assert_eq!(sim.get_json("/model_info").await["weight_version"], "v2");
    assert_eq!(sim.post_json("/end_weight_update", json!({})).await.0, 200);
    sim.post_json("/abort_request", json!({"abort_all": true})).await;
    sim.post_json("/continue_generation", json!({})).await;
    within("the aborted request", long).await.unwrap();
}

#[tokio::test]
async fn remote_instance_send_needs_its_group() {
    let sim = Sim::start(&["--tp-size", "2"]).await;
    let send = json!({"master_address": "127.0.0.1", "ports": "4000,4001", "group_name": "send_weights_10.0.0.2"});
    assert_refused(&sim, "/send_weights_to_remote_instance", send.clone(), "not initialized").await;
    let mut init = json!({"master_address": "127.0.0.1", "ports": "4000", "group_rank": 0, "world_size": 2,
                          "group_name": "send_weights_10.0.0.2"});
    assert_refused(&sim, "/init_weights_send_group_for_remote_instance", init.clone(), "one port per TP rank").await;
    init["ports"] = json!("4000,4001");
    init["world_size"] = json!(3);
    assert_refused(&sim, "/init_weights_send_group_for_remote_instance", init.clone(), "world of 2").await;
    init["world_size"] = json!(2);
    assert_eq!(sim.post_json("/init_weights_send_group_for_remote_instance", init).await.0, 200);
    let mut wrong = send.clone();
    wrong["ports"] = json!("4000,4002");
    assert_refused(&sim, "/send_weights_to_remote_instance", wrong, "not initialized").await;
    let mut elsewhere = send.clone();
    elsewhere["master_address"] = json!("127.0.0.9");
    assert_refused(&sim, "/send_weights_to_remote_instance", elsewhere, "was initialized for").await;
    let (status, out) = sim.post_json("/send_weights_to_remote_instance", send).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["weight_version"], "default");
    let info = sim.get_json("/server_info").await;
    // Named as SGLang's seed names its groups: the name, then the ports.
    assert_eq!(info["weight_sync"]["weight_send_groups"]["send_weights_10.0.0.2_4000_4001"]["sends"], 1);
}

#[tokio::test]
async fn weight_sync_routes_take_the_admin_key() {
    let sim = Sim::start(&["--api-key", "k", "--admin-api-key", "a"]).await;
    for path in ["/begin_weight_update", "/init_weights_send_group_for_remote_instance"] {
        let r = sim.client.post(sim.url(path)).bearer_auth("k").json(&json!({})).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path} must refuse the plain key");
    }
    let r = sim.client.post(sim.url("/begin_weight_update")).bearer_auth("a").json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn a_new_instance_loads_the_seeds_weights_through_the_remote_instance_routes() {
    let dir = common::scratch_dir("seed-ckpt");
    std::fs::write(dir.join("model.safetensors"), common::safetensors_bytes(8, 3)).unwrap();
    let seed = Sim::start(&["--model-path", dir.to_str().unwrap(), "--tp-size", "2"]).await;
    let seed_sum = seed.get_json("/server_info").await["weights_checksum"].clone();
    assert!(seed_sum.is_string());
    let seed_port = seed.port.to_string();
    let args = |ports: &'static str| {
        vec![
            "--tp-size".to_string(),
            "2".into(),
            "--load-format".into(),
            "remote_instance".into(),
            "--remote-instance-weight-loader-seed-instance-ip".into(),
            "127.0.0.1".into(),
            "--remote-instance-weight-loader-seed-instance-service-port".into(),
            seed_port.clone(),
            "--remote-instance-weight-loader-send-weights-group-ports".into(),
            ports.into(),
            "--weight-version".into(),
            "v4".into(),
        ]
    };
    let a = args("[5000, 5001]");
    let fresh = Sim::start(&a.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let info = fresh.get_json("/server_info").await;
    assert_eq!(info["weights_checksum"], seed_sum, "the new instance holds the seed's weights");
    assert_eq!(info["weight_version"], "v4");
    let sent = seed.get_json("/server_info").await;
    assert_eq!(sent["weight_sync"]["weight_send_groups"]["send_weights_127.0.0.1_5000_5001"]["sends"], 1);

    // A port list that does not match tp_size is a usage error naming the flag.
    let mut bad = Sim::spawn(&a.iter().map(String::as_str).chain(["--tp-size", "1"]).collect::<Vec<_>>());
    assert_eq!(bad.wait_exit().await, Some(2));
    assert!(bad.logs().contains("--remote-instance-weight-loader-send-weights-group-ports"), "{}", bad.logs());
    // A seed that refuses (it has tp_size 2, this instance asks with one port) fails startup.
    let one = args("[5000]");
    let mut refused = Sim::spawn(
        &one.iter().map(String::as_str).chain(["--tp-size", "1", "--time-scale", "0.01"]).collect::<Vec<_>>(),
    );
    assert_eq!(refused.wait_exit().await, Some(1));
    assert!(refused.logs().contains("one port per TP rank"), "{}", refused.logs());
}

#[tokio::test]
async fn finished_answers_carry_their_version_spans_from_0_5_23() {
    let sim = Sim::start(&[]).await;
    let (_, g) = sim.generate(gen_body("spans", 3)).await;
    assert_eq!(g["meta_info"]["weight_versions"], json!([{"version": "default", "start": 0, "end": 3}]));
    let older = Sim::start(&["--sglang-api", "0.5.10.post1"]).await;
    let (_, g) = older.generate(gen_body("spans", 3)).await;
    assert!(g["meta_info"].get("weight_versions").is_none(), "{g}");
}

/// A seed sends its weights from inside its scheduler's event loop (SGLang 0.5.23
/// managers/scheduler.py:6095-6100, model_executor/model_runner_components/weight_exporter.py:96-140):
/// while it sends, what the scheduler answers (`/server_info`'s internal state) waits, while what
/// the HTTP process answers alone (`/model_info`) does not.
#[tokio::test]
async fn a_seed_answers_no_server_info_while_it_sends() {
    // 2 GB over 8 Gbit/s: two seconds of sending.
    let seed = Sim::start(&["--weight-bytes", "2000000000", "--transfer-gbps", "8"]).await;
    let init = json!({"master_address": "127.0.0.1", "ports": "4100", "group_rank": 0, "world_size": 2,
                      "group_name": "send_weights_10.0.0.3"});
    assert_eq!(seed.post_json("/init_weights_send_group_for_remote_instance", init).await.0, 200);
    let (client, url) = (seed.client.clone(), seed.url("/send_weights_to_remote_instance"));
    let send = tokio::spawn(async move {
        let body = json!({"master_address": "127.0.0.1", "ports": "4100", "group_name": "send_weights_10.0.0.3"});
        client.post(url).json(&body).send().await.unwrap().status().as_u16()
    });
    let quick = reqwest::Client::builder().timeout(std::time::Duration::from_millis(300)).build().unwrap();
    within("/server_info to stop answering during the send", async {
        while quick.get(seed.url("/server_info")).send().await.is_ok() {}
    })
    .await;
    assert!(!send.is_finished(), "the send is still running");
    assert_eq!(quick.get(seed.url("/model_info")).send().await.unwrap().status(), 200);
    assert_eq!(within("the send", send).await.unwrap(), 200);
    let info = seed.get_json("/server_info").await;
    assert_eq!(info["weight_sync"]["weight_send_groups"]["send_weights_10.0.0.3_4100"]["sends"], 1);
}
