//! The OpenAI routes (`/v1/completions`, `/v1/chat/completions`) against the real binary:
//! response shapes as SGLang 0.5.23's OpenAI layer writes them, streaming, `n`, usage, errors.

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected shapes")]

mod common;

use common::Sim;
use serde_json::{json, Value};

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// The JSON chunks of an SSE answer, checking that it ends with `[DONE]`.
async fn sse(sim: &Sim, path: &str, body: Value) -> Vec<Value> {
    let r = sim.post(path, body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    text.split("\n\n")
        .filter(|c| !c.is_empty() && *c != "data: [DONE]")
        .map(|c| serde_json::from_str(c.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

#[tokio::test]
async fn chat_completion_has_sglang_shape() {
    let sim = Sim::start(&[]).await;
    let (status, body) = sim
        .post_json(
            "/v1/chat/completions",
            chat("hello there", json!({"max_tokens": 9, "max_completion_tokens": 5, "ignore_eos": true})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "m");
    assert!(body["id"].as_str().unwrap().len() >= 32);
    assert!(body["created"].as_u64().unwrap() > 1_600_000_000);
    // 0.5.23 (the default profile) reports the version spans of every finished answer.
    assert_eq!(
        body["metadata"],
        json!({"weight_version": "default", "weight_versions": [{"version": "default", "start": 0, "end": 5}]})
    );
    let c = &body["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], "length");
    assert!(c["matched_stop"].is_null() && c["logprobs"].is_null());
    let msg = c["message"].as_object().unwrap();
    assert_eq!(msg.keys().collect::<Vec<_>>(), ["content", "reasoning_content", "role"]);
    assert_eq!(msg["role"], "assistant");
    assert!(msg["reasoning_content"].is_null());
    // max_completion_tokens wins over max_tokens; the template adds 5 marker tokens.
    assert_eq!(msg["content"].as_str().unwrap().split_whitespace().count(), 5);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12, "reasoning_tokens": 0,
               "prompt_tokens_details": null, "completion_tokens_details": null})
    );
    // Without a budget a chat request may use the whole context; a rid names the response.
    let (_, body) = sim
        .post_json(
            "/v1/chat/completions",
            chat("x", json!({"rid": "my-rid", "stop": "zzz", "weight_version": {"min_version": "1"}})),
        )
        .await;
    assert_eq!(body["id"], "my-rid");
    assert_eq!(body["model"], "m");
}

#[tokio::test]
async fn completions_take_strings_lists_and_token_ids_with_n_samples() {
    let sim = Sim::start(&[]).await;
    // Default max_tokens is 16.
    let (status, one) = sim.post_json("/v1/completions", json!({"prompt": "a b c", "ignore_eos": true})).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["object"], "text_completion");
    assert_eq!(one["model"], "default");
    assert_eq!(one["usage"]["completion_tokens"], 16);
    assert_eq!(one["usage"]["prompt_tokens"], 3);
    let keys: Vec<_> = one["choices"][0].as_object().unwrap().keys().cloned().collect();
    assert_eq!(keys, ["finish_reason", "index", "logprobs", "matched_stop", "text"]);
    // Two prompts x n=2: four choices, prompt tokens counted once per prompt.
    let (_, two) = sim
        .post_json(
            "/v1/completions",
            json!({"prompt": ["a b c", "d e"], "n": 2, "max_tokens": 4, "ignore_eos": true, "seed": 3}),
        )
        .await;
    let choices = two["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_ne!(choices[0]["text"], choices[1]["text"], "samples of one prompt differ");
    assert_eq!(two["usage"]["prompt_tokens"], 5);
    assert_eq!(two["usage"]["completion_tokens"], 16);
    assert_eq!(two["usage"]["total_tokens"], 21);
    // Token ids; logprobs is an int (the legacy LogProbs shape); echo puts the decoded prompt first.
    // Greedy, so the echoed request continues the same way (sampled tokens would be random).
    let ids = json!({"prompt": [[100, 200]], "max_tokens": 3, "temperature": 0, "logprobs": 2});
    let (_, plain) = sim.post_json("/v1/completions", ids.clone()).await;
    assert_eq!(plain["usage"]["prompt_tokens"], 2);
    let mut echo = ids;
    echo["echo"] = json!(true);
    let (_, by_ids) = sim.post_json("/v1/completions", echo).await;
    let (echoed, text) =
        (by_ids["choices"][0]["text"].as_str().unwrap(), plain["choices"][0]["text"].as_str().unwrap());
    assert!(echoed.ends_with(text) && echoed.split_whitespace().count() == text.split_whitespace().count() + 2);
    let lp = &by_ids["choices"][0]["logprobs"];
    let n = by_ids["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["text_offset"], json!(vec![-1; n]));
    let top = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), n);
    assert!(top.iter().all(|t| t.as_object().unwrap().len() <= 2));
}

#[tokio::test]
async fn chat_logprobs_stop_strings_and_content_parts() {
    let sim = Sim::start(&[]).await;
    // Greedy: the stop-string request below must produce the same words.
    let body = chat(
        "count for me",
        json!({"max_tokens": 6, "ignore_eos": true, "logprobs": true, "top_logprobs": 2, "temperature": 0}),
    );
    let (_, full) = sim.post_json("/v1/chat/completions", body).await;
    let content = full["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6);
    let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let words: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(content[1]["token"], words[1]);
    assert_eq!(content[1]["bytes"], json!(words[1].as_bytes()));
    assert_eq!(content[1]["top_logprobs"].as_array().unwrap().len(), 2);
    // A stop string ends the answer: finish_reason "stop", matched_stop names it, text trimmed.
    // Content given as a list of text parts renders like the plain string.
    let parts = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "count for me"}]}],
                       "max_tokens": 6, "ignore_eos": true, "stop": [words[2]], "temperature": 0});
    let (_, stopped) = sim.post_json("/v1/chat/completions", parts).await;
    let c = &stopped["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["matched_stop"], words[2]);
    assert!(!c["message"]["content"].as_str().unwrap().contains(words[2]), "{stopped}");
}

#[tokio::test]
async fn chat_streaming_sends_role_then_deltas_then_finish_then_usage() {
    let sim = Sim::start(&[]).await;
    // Greedy, so the streamed answers equal the plain ones.
    let extra = json!({"max_tokens": 4, "ignore_eos": true, "n": 2, "temperature": 0});
    let (_, plain) = sim.post_json("/v1/chat/completions", chat("stream me", extra.clone())).await;
    let mut body = chat("stream me", extra);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let chunks = sse(&sim, "/v1/chat/completions", body).await;
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["model"] == "m"));
    for index in 0..2u64 {
        let mine: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["index"] == index).collect();
        let first = &mine[0]["choices"][0];
        assert_eq!(first["delta"], json!({"role": "assistant", "content": "", "reasoning_content": null}));
        let text: String =
            mine[1..mine.len() - 1].iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap()).collect();
        assert_eq!(text, plain["choices"][index as usize]["message"]["content"].as_str().unwrap());
        let last = &mine[mine.len() - 1]["choices"][0];
        assert_eq!(last["finish_reason"], "length");
        assert_eq!(last["delta"], json!({"reasoning_content": null}));
        assert!(mine[..mine.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    }
    // Finish chunks come after every content chunk, then the usage chunk.
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    assert_eq!(usage["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"]);
    assert!(usage["usage"]["prompt_tokens_details"].is_null());
    let n = chunks.len();
    assert!(
        chunks[n - 3]["choices"][0]["finish_reason"].is_string()
            && chunks[n - 2]["choices"][0]["finish_reason"].is_string()
    );
    assert!(chunks[..n - 1].iter().all(|c| c.get("usage").is_none()), "no usage key without continuous stats");
    // Without include_usage there is no usage chunk.
    let mut body = chat("stream me", json!({"max_tokens": 2, "stream": true}));
    body["stream_options"] = json!({"include_usage": false});
    let chunks = sse(&sim, "/v1/chat/completions", body).await;
    assert!(chunks.iter().all(|c| !c["choices"].as_array().unwrap().is_empty()));
}

#[tokio::test]
async fn completion_streaming_sends_text_chunks_and_an_exclude_none_usage_chunk() {
    let sim = Sim::start(&[]).await;
    let body = json!({"prompt": "go on", "max_tokens": 3, "ignore_eos": true, "logprobs": 0, "temperature": 0});
    let (_, plain) = sim.post_json("/v1/completions", body.clone()).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = sse(&sim, "/v1/completions", streamed).await;
    assert_eq!(chunks.len(), 4);
    let text: String = chunks[..3].iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, plain["choices"][0]["text"].as_str().unwrap());
    assert!(chunks[..3].iter().all(|c| c["object"] == "text_completion" && c["usage"].is_null()));
    assert!(chunks[..3].iter().all(|c| c["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len() == 1));
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[3]["choices"], json!([]));
    assert_eq!(
        chunks[3]["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "reasoning_tokens": 0})
    );
}

#[tokio::test]
async fn errors_have_the_openai_layers_shapes() {
    let sim = Sim::start(&["--context-length", "1000"]).await;
    let cases = [
        ("/v1/chat/completions", json!({"model": "m"}), "Bad Request", "messages"),
        ("/v1/chat/completions", json!({"messages": []}), "BadRequestError", "Messages cannot be empty."),
        ("/v1/chat/completions", chat("x", json!({"n": 0})), "BadRequestError", "n must be at least 1"),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 2000})),
            "BadRequestError",
            "max_completion_tokens is too large: 2000.",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 999})),
            "BadRequestError",
            "maximum context length of 1000",
        ),
        ("/v1/chat/completions", chat("x", json!({"n": "many"})), "Bad Request", "'n'"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
            "BadRequestError",
            "image_url",
        ),
        ("/v1/completions", json!({"max_tokens": 3}), "Bad Request", "prompt"),
        ("/v1/completions", json!({"prompt": ""}), "BadRequestError", "Prompt cannot be empty"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0}), "Bad Request", "max_tokens must be positive"),
        ("/v1/completions", json!({"prompt": "x", "temperature": -1}), "BadRequestError", "temperature"),
    ];
    for (path, body, err_type, needle) in cases {
        let (status, err) = sim.post_json(path, body.clone()).await;
        assert_eq!(status, 400, "{path} {body} -> {err}");
        assert_eq!(err["object"], "error", "{err}");
        assert_eq!(err["type"], err_type, "{body} -> {err}");
        assert_eq!(err["code"], 400);
        assert!(err["param"].is_null());
        assert!(err["message"].as_str().unwrap().contains(needle), "{body} -> {err}");
    }
    // A streaming request that fails validation is a plain JSON 400, not a stream.
    let (status, err) =
        sim.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 5000, "stream": true})).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["type"], "BadRequestError");
    // SGLang's routes take JSON only.
    let r = sim.client.post(sim.url("/v1/completions")).body(r#"{"prompt":"x"}"#).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    assert!(err["message"].as_str().unwrap().contains("application/json"), "{err}");
}

#[tokio::test]
async fn responses_report_the_weight_version_and_models_lists_the_model() {
    let sim = Sim::start(&["--weight-version", "v1", "--served-model-name", "served"]).await;
    let (_, body) = sim.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(body["metadata"]["weight_version"], "v1");
    let (status, _) = sim.post_json("/update_weight_version", json!({"new_version": "v2"})).await;
    assert_eq!(status, 200);
    let (_, body) = sim.post_json("/v1/chat/completions", chat("x", json!({"max_tokens": 1}))).await;
    assert_eq!(body["metadata"]["weight_version"], "v2");
    let models = sim.get_json("/v1/models").await;
    assert_eq!(models["object"], "list");
    let card = &models["data"][0];
    assert_eq!(card["id"], "served");
    assert_eq!(card["root"], "served");
    assert_eq!(card["object"], "model");
    assert_eq!(card["owned_by"], "sglang");
    assert!(card["parent"].is_null());
    assert_eq!(card["max_model_len"], 32768);
}
