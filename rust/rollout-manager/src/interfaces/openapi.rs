//! The control API's OpenAPI document, derived from the handlers themselves: each handler's
//! `#[utoipa::path]` names its route, parameters and answers, and the schemas come from the
//! types it parses and answers (their serde attributes and doc comments). Served at
//! `GET /openapi.json`; `rollout-manager openapi` prints the same document, which
//! `make openapi` writes to `docs/openapi.json` (a test keeps the two equal).

use crate::interfaces::api::{self, placements, weights};
use crate::interfaces::autoscaler::api as autoscaler;
use axum::routing::get;
use axum::Router;
use std::sync::OnceLock;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Elastic Rollout control API",
        description = "Control API of rollout-manager. Every error is {\"error\": {\"code\", \"message\"}}. \
                       See docs/api.md.",
    ),
    paths(
        api::health,
        api::prometheus_targets,
        api::engines,
        api::get_engine,
        api::scale_out,
        api::list_scale_outs,
        api::get_scale_out,
        api::cancel_scale_out,
        api::cancel_many,
        api::scale_in,
        api::list_scale_ins,
        api::get_scale_in,
        openapi,
        autoscaler::status,
        autoscaler::enable,
        autoscaler::conditions,
        autoscaler::health,
        autoscaler::history,
        autoscaler::pipeline_report,
        autoscaler::pipeline_reports,
        placements::list,
        placements::bind,
        placements::lost,
        placements::released,
        weights::weights,
        weights::publish,
        weights::open_trainer_update,
        weights::trainer_group,
        weights::build_group,
        weights::destroy_group,
        weights::list_updates,
        weights::get_update,
        weights::start_broadcast,
        weights::abort_update,
    )
)]
struct ControlApi;

/// The document as JSON, pretty-printed, with a final newline (as `docs/openapi.json` holds it).
pub fn document() -> String {
    let mut text = ControlApi::openapi().to_pretty_json().unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

/// The document, built once.
fn served() -> &'static str {
    static DOCUMENT: OnceLock<String> = OnceLock::new();
    DOCUMENT.get_or_init(document)
}

/// `GET /openapi.json`, merged into the control API's router.
pub fn routes() -> Router {
    Router::new().route("/openapi.json", get(openapi))
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", operation_id = "openapi",
    responses((status = 200, description = "The control API's OpenAPI document", body = Object)))]
async fn openapi() -> axum::response::Response {
    use axum::response::IntoResponse;
    ([("content-type", "application/json")], served()).into_response()
}

#[cfg(test)]
mod tests {
    /// `docs/openapi.json` is this document: after changing a handler or a type it answers,
    /// run `make openapi` and commit the result.
    #[test]
    fn docs_openapi_json_is_generated() {
        let committed = include_str!("../../../../docs/openapi.json");
        assert!(committed == super::document(), "docs/openapi.json is out of date: run `make openapi`");
    }

    /// Every `$ref` names a schema the document holds (utoipa registers a parameter's or a
    /// body's type only when it is reached from a handler or listed).
    #[test]
    fn every_reference_resolves() {
        let document = super::document();
        let value: serde_json::Value = serde_json::from_str(&document).unwrap_or_default();
        let schemas = value["components"]["schemas"].as_object().cloned().unwrap_or_default();
        assert!(schemas.len() > 40, "{} schemas", schemas.len());
        for (at, _) in document.match_indices("\"#/components/schemas/") {
            let name: String = document[at + 22..].chars().take_while(|c| *c != '"').collect();
            assert!(schemas.contains_key(&name), "a $ref names {name}, which the document does not hold");
        }
    }
}
