//! Which engine routes the router forwards: an allow-list, so it fails closed.
//!
//! The router sends a client's request to one engine the routing policy picks. That is right
//! for the data plane (generation, the OpenAI and other compatible APIs, tokenization, read-only
//! information) and wrong for everything else: a route that changes one engine's weights,
//! memory, cache, logging or role, sent to a random engine, changes that engine behind the
//! fleet's back (the version pins would not know), and engine-local state (sessions, stored
//! responses) would be looked for on an engine that does not have it. Every SGLang release adds
//! routes, so the list names what is forwarded and everything else is refused, new routes
//! included, until someone decides.
//!
//! The lists follow SGLang 0.5.23's `sglang/srt/entrypoints/http_server.py`: every route it marks
//! `@auth_level(AuthLevel.ADMIN_OPTIONAL)` is refused (the two the router fans out to every
//! engine, `/abort_request` and `/flush_cache`, are served by the router itself before this
//! is asked), and so are the unmarked routes that keep state on one engine.

/// What the router does with a request for an engine route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Intent {
    /// Sent to one engine chosen by the routing policy.
    Forward,
    /// A data-plane path asked with a method it does not take: 405, with the ones it does.
    WrongMethod(&'static [&'static str]),
    /// Refused with 403 and this reason.
    Refuse(Refusal),
}

/// Why a route is not forwarded; each names what to use instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Changes an engine's weights, memory, cache, profiling, logging or role: the manager owns
    /// the fleet's state.
    Admin,
    /// Keeps state on the engine it reaches (a session, a stored response, a socket): a
    /// random engine would not have it.
    EngineLocal,
    /// Not a route the router knows.
    Unknown,
}

impl Refusal {
    /// The error code of the router's 403 answer.
    pub fn code(self) -> &'static str {
        match self {
            Refusal::Admin => "admin_route",
            Refusal::EngineLocal => "engine_local_route",
            Refusal::Unknown => "unknown_route",
        }
    }

    /// The message of the 403 answer for `path`: what is wrong and what to use instead.
    pub fn message(self, path: &str) -> String {
        match self {
            Refusal::Admin => format!(
                "{path} changes an engine's weights or state, which the manager owns; the router does not forward it. \
                 Use the manager's API instead (weights: POST /rollout/weights/publish or \
                 /rollout/weights/trainer_updates; fleet: /rollout/scale_out, /rollout/scale_in), or call one \
                 engine directly at its URL from GET /rollout/engines"
            ),
            Refusal::EngineLocal => format!(
                "{path} keeps state on the engine that serves it, and the router would send it to any engine. \
                 Call one engine directly at its URL from GET /rollout/engines"
            ),
            Refusal::Unknown => format!(
                "{path} is not a route the router forwards: it forwards generation (/generate, the OpenAI and \
                 other compatible APIs), tokenization and read-only information routes (docs/api.md, \"Router\"). \
                 Engines' other routes go through the manager's API, or directly to an engine from GET /rollout/engines"
            ),
        }
    }
}

const POST: &[&str] = &["POST"];
const POST_PUT: &[&str] = &["POST", "PUT"];
const GET: &[&str] = &["GET"];

/// Data-plane routes and their methods (SGLang 0.5.23 `http_server.py` line of the decorator;
/// older names as older releases declare them).
const FORWARDED: &[(&str, &[&str])] = &[
    // Generation and scoring.
    ("/generate", POST_PUT),             // :928
    ("/encode", POST_PUT),               // :993
    ("/classify", POST_PUT),             // :1006
    ("/v1/completions", POST),           // :1860
    ("/v1/chat/completions", POST),      // :1870
    ("/v1/embeddings", POST),            // :1882
    ("/v1/classify", POST),              // :1894
    ("/v1/audio/transcriptions", POST),  // :1942
    ("/v1/score", POST),                 // :2050
    ("/v1/decisions", POST),             // :2058
    ("/v1/responses", POST),             // :2066
    ("/v1/rerank", POST_PUT),            // :2101
    ("/api/chat", POST),                 // :2131 (Ollama)
    ("/api/generate", POST),             // :2137
    ("/api/show", POST),                 // :2151
    ("/api/tags", GET),                  // :2145
    ("/v1/messages", POST),              // :2160 (Anthropic)
    ("/v1/messages/count_tokens", POST), // :2170
    ("/v1/systemone", POST),             // :2181
    ("/invocations", POST),              // :2202 (SageMaker)
    ("/vertex_generate", POST),          // :2215 (Vertex AI)
    // Tokenization and parsing.
    ("/tokenize", POST),            // :1911
    ("/v1/tokenize", POST),         // :1906
    ("/detokenize", POST),          // :1929
    ("/v1/detokenize", POST),       // :1924
    ("/parse_function_call", POST), // :1734
    ("/separate_reasoning", POST),  // :1774
    // Read-only information.
    ("/", GET),                            // :2124
    ("/ready", GET),                       // :714
    ("/ping", GET),                        // :2190
    ("/health_generate", GET),             // :722 (the router answers it itself)
    ("/model_info", GET),                  // :812
    ("/get_model_info", GET),              // :802
    ("/server_info", GET),                 // :863
    ("/get_server_info", GET),             // :853
    ("/v1/loads", GET),                    // v1_loads.py:96
    ("/get_load", GET),                    // 0.5.2-0.5.15.post1
    ("/get_weight_version", GET),          // 0.5.2-0.5.20
    ("/weight_version", GET),              // 0.5.8-0.5.20
    ("/v1/models", GET),                   // :1993
    ("/get_hicache_l3_cache_layout", GET), // :1204
];

/// Data-plane routes with a path parameter: (prefix, methods); the rest of the path is the
/// parameter.
const FORWARDED_PREFIXES: &[(&str, &[&str])] = &[
    ("/v1/models/", GET), // :2025 /v1/models/{model:path}
];

/// Routes SGLang does not mark admin but that keep state on one engine.
const ENGINE_LOCAL: &[&str] = &[
    "/open_session",  // :1687
    "/close_session", // :1701
    "/v1/realtime",   // :1982 (a WebSocket)
];

/// Prefixes of engine-local routes with a parameter.
const ENGINE_LOCAL_PREFIXES: &[&str] = &[
    "/v1/responses/", // :2085 GET /v1/responses/{id}, :2093 POST .../{id}/cancel
];

/// SGLang's admin routes (`@auth_level(AuthLevel.ADMIN_OPTIONAL)` in 0.5.23, and the ones
/// older releases have), named so the refusal says why; any route not forwarded is refused
/// anyway.
const ADMIN: &[&str] = &[
    "/set_internal_state",
    "/add_external_corpus",
    "/remove_external_corpus",
    "/list_external_corpora",
    "/hicache/storage-backend",
    "/hicache/storage-backend/clear",
    "/start_profile",
    "/stop_profile",
    "/set_trace_level",
    "/freeze_gc",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/update_weights_from_disk",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_tensor",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/update_weight_version",
    "/get_weights_by_name",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/weights_checker",
    "/slow_down",
    "/pd_role_switch",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
    "/configure_logging",
    "/pause_generation",
    "/continue_generation",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/abort_request",
    "/flush_cache",
];

/// Prefixes of admin routes with a parameter.
const ADMIN_PREFIXES: &[&str] = &["/dumper/"];

/// What the router does with `method path` (the path without its query).
pub fn intent(method: &str, path: &str) -> Intent {
    let forwarded = FORWARDED
        .iter()
        .find(|(p, _)| *p == path)
        .or_else(|| FORWARDED_PREFIXES.iter().find(|(p, _)| path.len() > p.len() && path.starts_with(p)));
    if let Some((_, methods)) = forwarded {
        return if methods.contains(&method) { Intent::Forward } else { Intent::WrongMethod(methods) };
    }
    let prefixed = |prefixes: &[&str]| prefixes.iter().any(|p| path.len() > p.len() && path.starts_with(p));
    if ENGINE_LOCAL.contains(&path) || prefixed(ENGINE_LOCAL_PREFIXES) {
        return Intent::Refuse(Refusal::EngineLocal);
    }
    if ADMIN.contains(&path) || prefixed(ADMIN_PREFIXES) {
        return Intent::Refuse(Refusal::Admin);
    }
    Intent::Refuse(Refusal::Unknown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn data_plane_routes_are_forwarded_with_their_methods() {
        let rows: &[(&str, &str, Intent)] = &[
            ("POST", "/generate", Intent::Forward),
            ("PUT", "/generate", Intent::Forward),
            ("GET", "/generate", Intent::WrongMethod(POST_PUT)),
            ("POST", "/v1/chat/completions", Intent::Forward),
            ("GET", "/v1/models", Intent::Forward),
            ("GET", "/v1/models/org/model-name", Intent::Forward),
            ("POST", "/v1/models/x", Intent::WrongMethod(GET)),
            ("GET", "/model_info", Intent::Forward),
            ("POST", "/model_info", Intent::WrongMethod(GET)),
            ("POST", "/tokenize", Intent::Forward),
            ("GET", "/", Intent::Forward),
            ("POST", "/v1/responses", Intent::Forward),
        ];
        for (method, path, want) in rows {
            assert_eq!(intent(method, path), *want, "{method} {path}");
        }
    }

    #[test]
    fn routes_that_change_an_engine_or_keep_state_on_it_are_refused() {
        let rows: &[(&str, &str, Refusal)] = &[
            ("POST", "/update_weights_from_disk", Refusal::Admin),
            ("POST", "/weights_checker", Refusal::Admin),
            ("PUT", "/hicache/storage-backend", Refusal::Admin),
            ("DELETE", "/hicache/storage-backend", Refusal::Admin),
            ("GET", "/hicache/storage-backend", Refusal::Admin),
            ("POST", "/dumper/start", Refusal::Admin),
            ("POST", "/scale_elastic_ep", Refusal::Admin),
            ("POST", "/pause_generation", Refusal::Admin),
            ("POST", "/open_session", Refusal::EngineLocal),
            ("GET", "/v1/responses/resp_1", Refusal::EngineLocal),
            ("POST", "/v1/responses/resp_1/cancel", Refusal::EngineLocal),
            ("GET", "/v1/realtime", Refusal::EngineLocal),
            ("POST", "/a_route_from_a_future_release", Refusal::Unknown),
            ("GET", "/v1/models/", Refusal::Unknown),
            ("GET", "/dumper/", Refusal::Unknown),
        ];
        for (method, path, want) in rows {
            assert_eq!(intent(method, path), Intent::Refuse(*want), "{method} {path}");
        }
    }

    #[test]
    fn no_route_is_both_forwarded_and_refused() {
        for (path, _) in FORWARDED {
            assert!(!ADMIN.contains(path) && !ENGINE_LOCAL.contains(path), "{path}");
        }
    }

    proptest! {
        /// Fail closed: a path outside the forwarded list is never forwarded, whatever its
        /// method.
        #[test]
        fn an_unlisted_path_is_never_forwarded(path in "/[a-z_/]{0,24}", method in "(GET|POST|PUT|DELETE|PATCH)") {
            let listed = FORWARDED.iter().any(|(p, _)| *p == path)
                || FORWARDED_PREFIXES.iter().any(|(p, _)| path.len() > p.len() && path.starts_with(p));
            prop_assert!(listed || matches!(intent(&method, &path), Intent::Refuse(_)));
        }
    }
}
