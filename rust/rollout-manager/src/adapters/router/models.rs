//! `/v1/models` and `/v1/models/{model}` under the fleet's one served name.
//!
//! Every engine the manager launches gets `--served-model-name`, but SGLang renames the served
//! model to the checkpoint's path on each `/update_weights_from_disk`, whatever the flag (0.5.23
//! `managers/tokenizer_manager.py:2368`, `_update_model_path_info`). Forwarded unchanged, the
//! model list would then name a different model after every publish, and differ between engines
//! during a rolling one. The router asks one routable engine for its list (the context length
//! and any LoRA adapters are the engine's to say) and presents its base model under the fleet's
//! name, so a weight update changes nothing a client sees but the version.

use super::headers::to_engine;
use super::{error, RouterState};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::Value;
use std::time::Duration;

/// How long the router waits for an engine's model list.
const MODELS_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest model list read from an engine (one card per LoRA adapter).
const MODELS_BODY_BYTES: usize = 1 << 20;
/// Engines asked before giving up.
const MODELS_ATTEMPTS: usize = 2;

/// True for the paths this module answers.
pub fn is_models_path(path: &str) -> bool {
    path == "/v1/models" || path.starts_with("/v1/models/")
}

/// The model list `list` (an engine's `/v1/models` answer) with its base model, whatever the
/// engine calls it now, named `served`: base cards (no `parent`) get `id` and `root`, adapter
/// cards get `parent`. Anything that is not a list of cards is left as it is.
pub fn present(list: &mut Value, served: &str) {
    let Some(cards) = list.get_mut("data").and_then(Value::as_array_mut) else { return };
    for card in cards.iter_mut().filter_map(Value::as_object_mut) {
        if card.get("parent").is_none_or(Value::is_null) {
            card.insert("id".into(), served.into());
            card.insert("root".into(), served.into());
        } else {
            card.insert("parent".into(), served.into());
        }
    }
}

/// The base card of a presented list.
fn base_card(list: &Value) -> Option<Value> {
    let cards = list.get("data")?.as_array()?;
    cards.iter().find(|c| c.get("parent").is_none_or(Value::is_null)).cloned()
}

/// OpenAI's answer for an unknown model (SGLang's `/v1/models/{model}` gives the same).
fn model_not_found(model: &str, served: &str) -> Response {
    let body = serde_json::json!({"error": {
        "message": format!("The model '{model}' does not exist; this fleet serves '{served}'"),
        "type": "invalid_request_error", "param": "model", "code": "model_not_found",
    }});
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

/// Answers `GET /v1/models` or `GET /v1/models/{model}` (the method was checked by the route
/// allow-list).
pub async fn answer(state: &RouterState, request: Request) -> Response {
    let served = crate::adapters::launch::served_model_name(&state.config);
    let path = request.uri().path().to_string();
    let asked = path.strip_prefix("/v1/models/").map(str::to_string);
    if let Some(model) = &asked {
        if *model != served {
            return model_not_found(model, &served);
        }
    }
    let headers = to_engine(request.headers().clone(), state.token.as_deref());
    let (mut list, engine) = match engine_list(state, &headers).await {
        Ok(answer) => answer,
        Err(resp) => return resp,
    };
    present(&mut list, &served);
    let mut resp = match asked {
        None => Json(list).into_response(),
        Some(model) => match base_card(&list) {
            Some(card) => Json(card).into_response(),
            None => model_not_found(&model, &served),
        },
    };
    if let Some(id) = engine {
        resp.headers_mut().insert(super::ENGINE_ID_HEADER, id);
    }
    resp
}

/// One routable engine's `/v1/models` answer, parsed, with the engine's id as a header value.
/// An engine's own error (its `--api-key` refusing the caller) is passed on as it is.
async fn engine_list(state: &RouterState, headers: &HeaderMap) -> Result<(Value, Option<HeaderValue>), Response> {
    let routes = state.routes.current(&state.fleet, &state.pools).all.clone();
    if routes.is_empty() {
        state.metrics.error(super::ErrorKind::NoEngine);
        let msg = "no engine is routable to give the model list; see GET /rollout/engines";
        return Err(error(StatusCode::SERVICE_UNAVAILABLE, "no_engine_available", msg));
    }
    let start = state.rotor.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut last = String::new();
    for i in 0..routes.len().min(MODELS_ATTEMPTS) {
        let route = &routes[(start + i) % routes.len()];
        let uri = match super::engine_uri(route, &axum::http::uri::PathAndQuery::from_static("/v1/models")) {
            Ok(u) => u,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        let mut req = hyper::Request::new(Full::new(Bytes::new()));
        *req.uri_mut() = uri;
        *req.headers_mut() = headers.clone();
        let resp = match tokio::time::timeout(MODELS_TIMEOUT, state.client.request(req)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                last = format!("engine {}: {e}", route.engine_id);
                continue;
            }
            Err(_) => {
                last = format!("engine {} did not answer within {MODELS_TIMEOUT:?}", route.engine_id);
                continue;
            }
        };
        let status = resp.status();
        let body =
            match tokio::time::timeout(MODELS_TIMEOUT, Limited::new(resp.into_body(), MODELS_BODY_BYTES).collect())
                .await
            {
                Ok(Ok(b)) => b.to_bytes(),
                _ => {
                    last = format!("engine {}: the model list could not be read", route.engine_id);
                    continue;
                }
            };
        if status.is_client_error() {
            // The engine refused the caller (its --api-key): that is the caller's answer.
            let mut out = Response::new(axum::body::Body::from(body));
            *out.status_mut() = status;
            out.headers_mut().insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return Err(out);
        }
        match serde_json::from_slice::<Value>(&body) {
            Ok(list) if status.is_success() => return Ok((list, route.id_header.clone())),
            _ => last = format!("engine {} answered {status} without a model list", route.engine_id),
        }
    }
    state.metrics.error(super::ErrorKind::NoAnswer);
    let msg = format!("no engine gave its model list (last: {last}); see GET /rollout/engines");
    Err(error(StatusCode::BAD_GATEWAY, "no_engine_answered", &msg))
}

/// An OpenAI request's body (`path` under `/v1/`) as `route`'s engine takes it, when it must
/// change ([`for_engine`]).
pub fn renamed_for(
    state: &RouterState,
    path: &axum::http::uri::PathAndQuery,
    body: &[u8],
    route: &super::table::Route,
) -> Option<Bytes> {
    let name = route.load.served_as()?;
    if !path.path().starts_with("/v1/") {
        return None;
    }
    for_engine(body, &state.served_name, &name)
}

/// For a request whose body [`renamed_for`] changed (`original` into `renamed`): the bytes its
/// answer names the engine's model by, and what the client should read instead. SGLang's
/// OpenAI answers (whole and each streamed chunk) give `"model"` as the request named it.
pub fn answer_rename(original: &[u8], renamed: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let model = |b: &[u8]| serde_json::from_slice::<Value>(b).ok()?.get("model")?.as_str().map(str::to_owned);
    let (client, engine) = (model(original)?, model(renamed)?);
    let quoted = |m: &str| format!("\"model\":{}", serde_json::to_string(m).unwrap_or_default()).into_bytes();
    Some((quoted(&engine), quoted(&client)))
}

/// The body of an OpenAI request for an engine that serves the fleet's model under `engine_name`
/// (the checkpoint path SGLang renamed it to on a disk update; see
/// `crate::registry::fleet::EngineLoad::served_as`): a top-level `model` naming the fleet (`served`,
/// or `served:adapter`) names the engine's model instead. None when nothing changes (no such
/// `model`, or not JSON). SGLang's `/v1/responses` answers 404 for any other name, and its
/// OpenAI routes read a name with `:` that is not the served one as base model and LoRA adapter.
pub fn for_engine(body: &[u8], served: &str, engine_name: &str) -> Option<Bytes> {
    if served == engine_name || memchr::memmem::find(body, served.as_bytes()).is_none() {
        return None;
    }
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let model = value.get_mut("model")?;
    let named = model.as_str()?;
    let renamed = if named == served {
        engine_name.to_string()
    } else {
        let adapter = named.strip_prefix(served)?.strip_prefix(':')?;
        format!("{engine_name}:{adapter}")
    };
    *model = Value::String(renamed);
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_openai_request_names_the_model_as_its_engine_serves_it() {
        let fleet = "qwen3:8b";
        let body = |model: &str| format!(r#"{{"model": "{model}", "messages": [], "note": "qwen3:8b"}}"#);
        let renamed = |model: &str| super::for_engine(body(model).as_bytes(), fleet, "/ckpt/step_3");
        let model = |b: Option<bytes::Bytes>| {
            b.map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap()["model"].clone())
        };
        assert_eq!(model(renamed("qwen3:8b")), Some(serde_json::json!("/ckpt/step_3")));
        assert_eq!(model(renamed("qwen3:8b:my-lora")), Some(serde_json::json!("/ckpt/step_3:my-lora")));
        // Another model, or an engine that serves under the fleet's name: unchanged.
        assert_eq!(renamed("other"), None);
        assert_eq!(renamed("qwen3:8bx"), None);
        assert_eq!(super::for_engine(body("qwen3:8b").as_bytes(), fleet, fleet), None);
        assert_eq!(super::for_engine(b"not json qwen3:8b", fleet, "/ckpt"), None);
        assert_eq!(super::for_engine(br#"{"model": 3, "x": "qwen3:8b"}"#, fleet, "/ckpt"), None);
    }

    use super::*;
    use serde_json::json;

    #[test]
    fn an_answer_names_the_model_as_the_client_did() {
        let original = br#"{"model": "qwen3:8b:my-lora", "messages": []}"#;
        let renamed = for_engine(original, "qwen3:8b", "/ckpt/step \"3\"").unwrap();
        let (engine, client) = answer_rename(original, &renamed).unwrap();
        assert_eq!(engine, br#""model":"/ckpt/step \"3\":my-lora""#.to_vec());
        assert_eq!(client, br#""model":"qwen3:8b:my-lora""#.to_vec());
        assert_eq!(answer_rename(b"not json", &renamed), None);
    }

    #[test]
    fn the_base_model_takes_the_fleets_name_and_adapters_follow() {
        let mut list = json!({"object": "list", "data": [
            {"id": "/ckpt/step-3", "root": "/ckpt/step-3", "parent": null, "max_model_len": 4096},
            {"id": "math-lora", "root": "/loras/math", "parent": "/ckpt/step-3"},
        ]});
        present(&mut list, "qwen");
        assert_eq!(list["data"][0]["id"], "qwen");
        assert_eq!(list["data"][0]["root"], "qwen");
        assert_eq!(list["data"][0]["max_model_len"], 4096);
        assert_eq!(list["data"][1]["id"], "math-lora");
        assert_eq!(list["data"][1]["parent"], "qwen");
        assert_eq!(base_card(&list).unwrap()["id"], "qwen");
    }

    #[test]
    fn what_is_not_a_card_list_is_left_alone() {
        for mut odd in [json!({"data": "x"}), json!([1, 2]), json!({"data": [1, "a", null]}), json!(null)] {
            let before = odd.clone();
            present(&mut odd, "qwen");
            assert_eq!(odd, before);
        }
        assert!(base_card(&json!({"data": []})).is_none());
    }

    #[test]
    fn only_model_paths_are_answered_here() {
        assert!(is_models_path("/v1/models"));
        assert!(is_models_path("/v1/models/org/name"));
        assert!(!is_models_path("/v1/modelsx"));
        assert!(!is_models_path("/v1/chat/completions"));
    }
}
