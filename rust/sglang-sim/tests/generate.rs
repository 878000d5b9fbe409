//! `/generate` and the read-only endpoints, against the real binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{gen_body, within, Sim};
use serde_json::{json, Value};

#[tokio::test]
async fn generate_response_has_sglang_shape() {
    let sim = Sim::start(&[]).await;
    let (status, out) = sim.generate(gen_body("The capital of France is", 16)).await;
    assert_eq!(status, 200, "{out}");
    assert!(out["text"].is_string());
    assert_eq!(out["output_ids"].as_array().unwrap().len(), 16);
    let meta = &out["meta_info"];
    assert_eq!(meta["finish_reason"], json!({"type": "length", "length": 16}));
    assert_eq!(meta["prompt_tokens"], 5);
    assert_eq!(meta["completion_tokens"], 16);
    assert_eq!(meta["cached_tokens"], 0);
    assert_eq!(meta["weight_version"], "default");
    assert!(meta["id"].as_str().unwrap().len() >= 32);
    assert!(meta["e2e_latency"].as_f64().unwrap() >= 0.0);

    // Default max_new_tokens is 128 (EOS may come earlier without ignore_eos).
    let (_, out) = sim.generate(json!({"text": "x", "sampling_params": {"ignore_eos": true}})).await;
    assert_eq!(out["meta_info"]["completion_tokens"], 128);

    // PUT works too, and input_ids is accepted; unknown top-level keys are ignored.
    let r = sim
        .client
        .put(sim.url("/generate"))
        .json(&json!({"input_ids": [5, 6, 7], "rid": "mine", "lora_path": null, "whatever": 1,
                      "sampling_params": {"max_new_tokens": 2}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let out: Value = r.json().await.unwrap();
    assert_eq!(out["meta_info"]["id"], "mine");
    assert_eq!(out["meta_info"]["prompt_tokens"], 3);
}

#[tokio::test]
async fn batches_return_lists() {
    let sim = Sim::start(&[]).await;
    let (status, out) = sim
        .generate(json!({"text": ["a b c", "d e", "f"], "rid": "batch",
                         "sampling_params": {"max_new_tokens": 4, "ignore_eos": true}}))
        .await;
    assert_eq!(status, 200, "{out}");
    let list = out.as_array().unwrap();
    assert_eq!(list.len(), 3);
    for (i, o) in list.iter().enumerate() {
        assert_eq!(o["meta_info"]["id"], format!("batch_{i}"));
        assert_eq!(o["output_ids"].as_array().unwrap().len(), 4);
    }
    assert_eq!(list[0]["meta_info"]["prompt_tokens"], 3);

    // input_ids batch with per-item sampling params.
    let (status, out) = sim
        .generate(json!({"input_ids": [[1, 2], [3, 4, 5]],
                         "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3, "ignore_eos": true}]}))
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out[1]["meta_info"]["completion_tokens"], 3);

    // n > 1 on one prompt gives n outputs.
    let (_, out) =
        sim.generate(json!({"text": "q", "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": true}})).await;
    let list = out.as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_ne!(list[0]["output_ids"], list[1]["output_ids"]);

    // With n > 1 every sample runs under a fresh rid, whatever the client sent (SGLang 0.5.23
    // managers/tokenizer_manager.py:2160-2180); a list must still have one rid per prompt.
    let (_, out) =
        sim.generate(json!({"text": "q", "rid": "mine", "sampling_params": {"max_new_tokens": 1, "n": 2}})).await;
    let ids: Vec<&str> = out.as_array().unwrap().iter().map(|o| o["meta_info"]["id"].as_str().unwrap()).collect();
    assert!(ids.iter().all(|id| id.len() == 32 && !id.starts_with("mine")), "{ids:?}");
    assert_ne!(ids[0], ids[1]);
    let (status, _) =
        sim.generate(json!({"text": ["a", "b"], "rid": ["x", "y", "z", "w"], "sampling_params": {"n": 2}})).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn streaming_sends_whole_output_so_far_then_done() {
    let sim = Sim::start(&[]).await;
    let body = json!({"text": "stream me", "stream": true, "return_logprob": true,
                      "sampling_params": {"max_new_tokens": 5, "ignore_eos": true, "temperature": 0}});
    let r = sim.post("/generate", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter(|c| !c.is_empty() && *c != "data: [DONE]")
        .map(|c| serde_json::from_str(c.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(chunks.len(), 5);
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c["output_ids"].as_array().unwrap().len(), i + 1, "cumulative ids");
        assert_eq!(c["meta_info"]["output_token_logprobs"].as_array().unwrap().len(), i + 1);
    }
    assert!(chunks[3]["meta_info"]["finish_reason"].is_null());
    assert_eq!(chunks[4]["meta_info"]["finish_reason"]["type"], "length");
    // The last chunk equals a non-streaming answer for the same request (greedy: sampled
    // tokens would be random).
    let (_, plain) = sim
        .generate(json!({"text": "stream me", "sampling_params": {"max_new_tokens": 5, "ignore_eos": true, "temperature": 0}}))
        .await;
    assert_eq!(chunks[4]["output_ids"], plain["output_ids"]);
    assert_eq!(chunks[4]["text"], plain["text"]);
}

#[tokio::test]
async fn unknown_sampling_key_is_a_400_listing_allowed_keys() {
    let sim = Sim::start(&[]).await;
    let (status, out) =
        sim.generate(json!({"text": "x", "sampling_params": {"max_new_tokens": 4, "bogus_key": 1}})).await;
    assert_eq!(status, 400);
    assert_eq!(out["object"], "error");
    assert_eq!(out["code"], 400);
    let msg = out["message"].as_str().unwrap();
    assert!(msg.contains("bogus_key") && msg.contains("`sampling_seed`"), "{msg}");

    // Range errors come back as handler errors.
    let (status, out) = sim.generate(json!({"text": "x", "sampling_params": {"top_p": 0}})).await;
    assert_eq!(status, 400);
    assert!(out["error"]["message"].as_str().unwrap().contains("top_p"));

    // No prompt at all.
    let (status, _) = sim.generate(json!({"sampling_params": {}})).await;
    assert_eq!(status, 400);
    // Not JSON.
    let r = sim.client.post(sim.url("/generate")).body("{nope").send().await.unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn slime_style_sampling_params_are_accepted() {
    let sim = Sim::start(&[]).await;
    let (status, out) = sim
        .generate(json!({
            "text": "slime prompt",
            "sampling_params": {
                "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8,
                "stop": null, "stop_token_ids": null, "skip_special_tokens": false,
                "no_stop_trim": true, "spaces_between_special_tokens": false,
                "custom_params": {"turn": 1}, "sampling_seed": 1234, "min_new_tokens": 0,
                "ignore_eos": false, "min_p": 0.0, "repetition_penalty": 1.0,
                "frequency_penalty": 0.0, "presence_penalty": 0.0, "n": 1,
                "json_schema": null, "regex": null, "ebnf": null, "logit_bias": null,
                "stop_regex": null
            },
            "return_logprob": true,
        }))
        .await;
    assert_eq!(status, 200, "{out}");
    let lps = out["meta_info"]["output_token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), out["output_ids"].as_array().unwrap().len());
    assert!(lps[0][0].as_f64().unwrap() < 0.0);
    assert_eq!(lps[0][1], out["output_ids"][0]);
}

#[tokio::test]
async fn outputs_are_deterministic_per_prompt_seed_and_weight_version() {
    // sampling_seed counts only with --enable-deterministic-inference (SGLang 0.5.23
    // sampling/sampling_batch_info.py:157-170); without it sampled outputs are random.
    let random = Sim::start(&[]).await;
    let seeded = json!({"text": "determinism check", "sampling_params":
                        {"max_new_tokens": 12, "ignore_eos": true, "sampling_seed": 1}});
    let (_, x) = random.generate(seeded.clone()).await;
    let (_, y) = random.generate(seeded).await;
    assert_ne!(x["output_ids"], y["output_ids"], "no flag: the seed does not count");
    let sim = Sim::start(&["--enable-deterministic-inference"]).await;
    let body = |seed: u64| {
        json!({"text": "determinism check", "sampling_params":
               {"max_new_tokens": 12, "ignore_eos": true, "sampling_seed": seed}})
    };
    let (_, a) = sim.generate(body(1)).await;
    let (_, b) = sim.generate(body(1)).await;
    let (_, c) = sim.generate(body(2)).await;
    assert_eq!(a["output_ids"], b["output_ids"]);
    assert_eq!(a["text"], b["text"]);
    assert_ne!(a["output_ids"], c["output_ids"]);

    let (status, out) = sim.post_json("/update_weight_version", json!({"new_version": "step-7"})).await;
    assert_eq!(status, 200);
    assert_eq!(out, json!({"success": true, "message": "Weight version updated to step-7", "new_version": "step-7"}));
    let (_, d) = sim.generate(body(1)).await;
    assert_eq!(d["meta_info"]["weight_version"], "step-7");
    assert_ne!(a["output_ids"], d["output_ids"], "new weights, new tokens");
    assert_eq!(sim.get_json("/model_info").await["weight_version"], "step-7");

    // Back to the old version: the old tokens come back.
    sim.post_json("/update_weight_version", json!({"new_version": "default"})).await;
    let (_, e) = sim.generate(body(1)).await;
    assert_eq!(a["output_ids"], e["output_ids"]);

    // Missing new_version is a validation error.
    let (status, out) = sim.post_json("/update_weight_version", json!({})).await;
    assert_eq!(status, 400, "{out}");
}

#[tokio::test]
async fn stop_token_ids_and_stop_strings_end_generation() {
    let sim = Sim::start(&[]).await;
    let (_, base) = sim.generate(gen_body("stop test", 10)).await;
    let third = base["output_ids"][2].clone();
    let (_, out) = sim
        .generate(json!({"text": "stop test", "sampling_params":
                         {"max_new_tokens": 10, "ignore_eos": true, "stop_token_ids": [third], "temperature": 0}}))
        .await;
    assert_eq!(out["output_ids"].as_array().unwrap().len(), 3);
    assert_eq!(out["meta_info"]["finish_reason"], json!({"type": "stop", "matched": third}));

    let words: Vec<&str> = base["text"].as_str().unwrap().split_whitespace().collect();
    let (_, out) = sim
        .generate(json!({"text": "stop test", "sampling_params":
                         {"max_new_tokens": 10, "ignore_eos": true, "stop": [words[5]], "temperature": 0}}))
        .await;
    assert_eq!(out["meta_info"]["finish_reason"], json!({"type": "stop", "matched": words[5]}));
    assert!(!out["text"].as_str().unwrap().contains(words[5]));
}

#[tokio::test]
async fn identical_long_prompts_hit_the_prefix_cache() {
    let sim = Sim::start(&[]).await;
    let prompt: String = (0..300).map(|i| format!("w{i} ")).collect();
    let (_, first) = sim.generate(gen_body(&prompt, 4)).await;
    assert_eq!(first["meta_info"]["cached_tokens"], 0);
    let (_, second) = sim.generate(gen_body(&prompt, 4)).await;
    let cached = second["meta_info"]["cached_tokens"].as_u64().unwrap();
    assert!((256..300).contains(&cached), "cached {cached}");
    // A multi-turn follow-up (prompt + previous answer + more) reuses the cache too.
    let follow = format!("{prompt}{} and then", first["text"].as_str().unwrap());
    let (_, third) = sim.generate(gen_body(&follow, 4)).await;
    assert!(third["meta_info"]["cached_tokens"].as_u64().unwrap() >= 288);
    let load = sim.load().await;
    assert!(load["cache_hit_rate"].as_f64().unwrap() > 0.0, "{load}");
}

#[tokio::test]
async fn info_endpoints_have_the_sglang_fields() {
    let sim = Sim::start(&["--served-model-name", "sim-model", "--weight-version", "v0"]).await;
    let info = sim.get_json("/model_info").await;
    for key in ["model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version"] {
        assert!(info.get(key).is_some(), "missing {key}");
    }
    assert_eq!(info["weight_version"], "v0");
    assert_eq!(sim.get_json("/get_model_info").await, info);

    let server = sim.get_json("/server_info").await;
    assert_eq!(server["status"], "Up");
    assert_eq!(server["max_total_num_tokens"], 65536);
    assert_eq!(server["tp_size"], 1);
    assert_eq!(server["internal_states"].as_array().unwrap().len(), 1);
    assert!(server["version"].as_str().unwrap().ends_with("-sim"));
    assert!(sim.get_json("/get_server_info").await.get("internal_states").is_some());

    let models = sim.get_json("/v1/models").await;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "sim-model");
    assert_eq!(models["data"][0]["owned_by"], "sglang");
    assert_eq!(sim.get("/v1/models/other").await.status(), 404);
    assert_eq!(sim.get_json("/v1/models/sim-model").await["id"], "sim-model");

    let loads = sim.get_json("/v1/loads").await;
    assert!(loads["timestamp"].is_string());
    let l = &loads["loads"][0];
    for key in [
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "queues",
    ] {
        assert!(l.get(key).is_some(), "missing {key} in {l}");
    }
    let core_only = sim.get_json("/v1/loads?include=core").await;
    assert!(core_only["loads"][0].get("queues").is_none());
    let prom = sim.get("/v1/loads?format=prometheus").await.text().await.unwrap();
    assert!(prom.contains("sglang_num_running_reqs{dp_rank=\"0\"} 0"), "{prom}");

    let nf = sim.get("/no/such/route").await;
    assert_eq!(nf.status(), 404);
    assert_eq!(nf.json::<Value>().await.unwrap(), json!({"detail": "Not Found"}));
    // The weight-update-group routes exist (tests/weight_sync.rs); their fields are required.
    let (status, out) = sim.post_json("/init_weights_update_group", json!({})).await;
    assert_eq!((status, out["object"].as_str()), (400, Some("error")), "{out}");
    assert_eq!(sim.get("/get_weight_version").await.status(), 404);
}

#[tokio::test]
async fn metrics_only_with_enable_metrics() {
    let sim = Sim::start(&["--enable-metrics"]).await;
    sim.generate(gen_body("count me", 3)).await;
    let r = sim.get("/metrics").await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    for name in [
        "sglang:token_usage{",
        "sglang:num_used_tokens{",
        "sglang:max_total_num_tokens{",
        "sglang:num_running_reqs{",
        "sglang:num_queue_reqs{",
        "sglang:gen_throughput{",
        "sglang:cache_hit_rate{",
        "sglang:queue_time_seconds_bucket{",
        "sglang:time_to_first_token_seconds_bucket{",
        "sglang:e2e_request_latency_seconds_sum{",
        "sglang:prompt_tokens_total{",
        "sglang:generation_tokens_total{",
        "sglang:num_requests_total{",
        "sglang:num_aborted_requests_total{",
    ] {
        assert!(text.contains(name), "missing {name}");
    }
    assert!(text.contains("engine_type=\"unified\""));
    assert!(text.contains("tp_rank=\"0\""));
    assert!(text.contains("sglang:generation_tokens_total{engine_type=\"unified\",model_name=\"test-model\",is_streaming=\"false\"} 3.0"), "{text}");

    let plain = Sim::start(&[]).await;
    assert_eq!(plain.get("/metrics").await.status(), 404);
}

#[tokio::test]
async fn api_key_guards_everything_but_health_ready_metrics() {
    let sim = Sim::start(&["--api-key", "sekret", "--enable-metrics"]).await;
    let (status, out) = sim.generate(gen_body("x", 2)).await;
    assert_eq!(status, 401);
    assert_eq!(out, json!({"error": "Unauthorized"}));
    assert_eq!(sim.get("/model_info").await.status(), 401);
    assert_eq!(sim.get("/health").await.status(), 200);
    assert_eq!(sim.get("/ready").await.status(), 200);
    assert_eq!(sim.get("/metrics").await.status(), 200);
    let r = sim.client.post(sim.url("/generate")).bearer_auth("sekret").json(&gen_body("x", 2)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let wrong = sim.client.get(sim.url("/model_info")).bearer_auth("nope").send().await.unwrap();
    assert_eq!(wrong.status(), 401);

    // With an admin key, admin routes take only that key.
    let sim = Sim::start(&["--api-key", "user", "--admin-api-key", "admin"]).await;
    let flush = |key: &'static str| sim.client.post(sim.url("/flush_cache")).bearer_auth(key).send();
    assert_eq!(flush("user").await.unwrap().status(), 401);
    assert_eq!(flush("admin").await.unwrap().status(), 200);
}

#[tokio::test]
async fn dp_ranks_have_their_own_pools_and_routed_dp_rank_picks_one() {
    let sim = Sim::start(&["--dp-size", "2"]).await;
    let prompt: String = (0..64).map(|i| format!("p{i} ")).collect();
    let body = json!({"text": prompt, "routed_dp_rank": 1,
                      "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}});
    let (status, _) = sim.generate(body).await;
    assert_eq!(status, 200);
    let loads = sim.get_json("/v1/loads").await["loads"].clone();
    assert_eq!(loads.as_array().unwrap().len(), 2);
    assert_eq!(loads[0]["memory"]["cached_tokens"], 0);
    assert!(loads[1]["memory"]["cached_tokens"].as_u64().unwrap() >= 48, "{loads}");
    let one = sim.get_json("/v1/loads?dp_rank=1").await;
    assert_eq!(one["loads"].as_array().unwrap().len(), 1);
    assert_eq!(sim.get("/v1/loads?dp_rank=5").await.status(), 400);

    // A large batch body (over axum's default 2 MB limit) is accepted.
    let big: Vec<Vec<u32>> = (0..60).map(|i| vec![10_000 + i; 8000]).collect();
    let (status, out) = sim.generate(json!({"input_ids": big, "sampling_params": {"max_new_tokens": 1}})).await;
    assert_eq!(status, 200);
    assert_eq!(out.as_array().unwrap().len(), 60);
}

/// The `data:` chunks of a finished stream (without `[DONE]`).
fn sse_chunks(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter(|c| !c.is_empty() && *c != "data: [DONE]")
        .map(|c| serde_json::from_str(c.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

/// With `--incremental-streaming-output` each chunk holds what is new since the last; the stream
/// interval spaces them as it does the whole-output chunks (SGLang 0.5.23
/// managers/scheduler_components/output_streamer.py:455-472), and `--stream-interval` is the
/// default a request's `stream_interval` overrides.
#[tokio::test]
async fn incremental_streams_follow_the_stream_interval() {
    let sim = Sim::start(&["--incremental-streaming-output", "--stream-interval", "3"]).await;
    let body = |interval: Option<u64>| {
        let mut params = json!({"max_new_tokens": 11, "ignore_eos": true, "temperature": 0});
        if let Some(i) = interval {
            params["stream_interval"] = json!(i);
        }
        json!({"text": "deltas", "stream": true, "sampling_params": params})
    };
    let lens = |chunks: &[Value]| -> Vec<usize> {
        chunks.iter().map(|c| c["output_ids"].as_array().unwrap().len()).collect::<Vec<_>>()
    };
    let by_default = sse_chunks(&sim.post("/generate", body(None)).await.text().await.unwrap());
    assert_eq!(lens(&by_default), [1, 3, 3, 3, 1], "sent at 1, 4, 7, 10, then the end");
    let chunks = sse_chunks(&sim.post("/generate", body(Some(4))).await.text().await.unwrap());
    assert_eq!(lens(&chunks), [1, 4, 4, 2]);
    let ids: Vec<Value> = chunks.iter().flat_map(|c| c["output_ids"].as_array().unwrap().clone()).collect();
    let (_, plain) = sim
        .generate(json!({"text": "deltas", "sampling_params":
                                         {"max_new_tokens": 11, "ignore_eos": true, "temperature": 0}}))
        .await;
    assert_eq!(Value::Array(ids), plain["output_ids"]);
}

/// An incremental stream aborted in the waiting queue gets, from SGLang's front end, its last
/// token again and the whole text (0.5.23 managers/tokenizer_manager.py:3627-3635): a client
/// joining the deltas would count that token twice.
#[tokio::test]
async fn an_incremental_stream_aborted_while_waiting_repeats_its_last_token() {
    let sim = Sim::start(&["--incremental-streaming-output", "--time-scale", "1"]).await;
    let body = json!({"text": "retract me", "rid": "inc-1", "stream": true,
                      "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true, "temperature": 0}});
    let mut response = sim.post("/generate", body).await;
    let mut text = String::new();
    while !text.contains("\n\n") {
        text.push_str(&String::from_utf8_lossy(&within("a first chunk", response.chunk()).await.unwrap().unwrap()));
    }
    assert_eq!(sim.post_json("/pause_generation", json!({"mode": "retract"})).await.0, 200);
    assert_eq!(sim.post_json("/abort_request", json!({"rid": "inc-1"})).await.0, 200);
    while let Some(bytes) = within("the rest of the stream", response.chunk()).await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&bytes));
    }
    let chunks = sse_chunks(&text);
    let (last, sent) = chunks.split_last().unwrap();
    assert_eq!(last["meta_info"]["finish_reason"], json!({"type": "abort", "message": "Abort in waiting queue"}));
    let ids: Vec<Value> = sent.iter().flat_map(|c| c["output_ids"].as_array().unwrap().clone()).collect();
    assert_eq!(last["output_ids"], json!([ids.last().unwrap()]));
    let streamed: String = sent.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(last["text"], streamed, "the whole text again");
    assert_eq!(last["meta_info"]["completion_tokens"], ids.len());
    assert!(last["meta_info"].get("prompt_tokens").is_none());
    sim.post_json("/continue_generation", json!({})).await;
}
