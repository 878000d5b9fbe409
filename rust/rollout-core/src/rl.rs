//! The RL control plane's pure parts (SMG's `/v1/rl/*`, served on the router port): which
//! engines a fan-out selector names, and what a call to an engine path becomes.
//!
//! A selector is `all` (or `*`), or terms `key=value` joined by `,`, every one of which must
//! hold (AND). Keys: `id`, `engine`, `model_id`, `worker_type`, `connection_mode`, `health`,
//! `status`, `weight_version`, and `label.<name>`. A value may not be empty.
//!
//! An engine path is forwarded as it is when it only reads (`model_info`, `server_info`,
//! `health`, `v1/loads`, ...) or acts on requests only (`flush_cache`, `abort_request`);
//! `pause_generation` and `continue_generation` are the manager's own steps (it knows the
//! pause, keeps the engine out of routing while it lasts, and does not take it for a hang);
//! every other path changes what the fleet serves and belongs to the manager's API, which the
//! refusal names.

use std::collections::BTreeMap;

/// Keys a selector term may name (besides `label.<name>`).
pub const SELECTOR_KEYS: [&str; 8] =
    ["id", "engine", "model_id", "worker_type", "connection_mode", "health", "status", "weight_version"];

/// A parsed fan-out selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    All,
    /// Every term must hold: (key, value); a label's key is `label.<name>`.
    Terms(Vec<(String, String)>),
}

/// What an engine offers a selector: its fields and labels by name.
pub trait Selectable {
    /// The value of `key` (one of [`SELECTOR_KEYS`]), None when it has none.
    fn field(&self, key: &str) -> Option<String>;
    fn labels(&self) -> &BTreeMap<String, String>;
}

impl Selector {
    /// Parses `text`; Err says what is wrong and gives the grammar.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text == "all" || text == "*" {
            return Ok(Self::All);
        }
        let grammar = format!(
            "a selector is `all`, or key=value terms joined by `,` (all must hold); keys: {}, label.<name>",
            SELECTOR_KEYS.join(", ")
        );
        if text.is_empty() {
            return Err(format!("the selector is empty; {grammar}"));
        }
        let mut terms = Vec::new();
        for term in text.split(',') {
            let Some((key, value)) = term.split_once('=') else {
                return Err(format!("term {term:?} has no `=`; {grammar}"));
            };
            let (key, value) = (key.trim(), value.trim());
            let known = SELECTOR_KEYS.contains(&key) || key.strip_prefix("label.").is_some_and(|n| !n.is_empty());
            if !known {
                return Err(format!("unknown key {key:?}; {grammar}"));
            }
            if value.is_empty() {
                return Err(format!("term {term:?} has no value; {grammar}"));
            }
            terms.push((key.to_string(), value.to_string()));
        }
        Ok(Self::Terms(terms))
    }

    /// Whether `engine` is selected.
    pub fn matches(&self, engine: &impl Selectable) -> bool {
        match self {
            Self::All => true,
            Self::Terms(terms) => terms.iter().all(|(key, value)| match key.strip_prefix("label.") {
                Some(name) => engine.labels().get(name) == Some(value),
                None => engine.field(key).as_deref() == Some(value.as_str()),
            }),
        }
    }
}

/// What a call to an engine path through the control plane becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineCall {
    /// Sent to the engine as it is.
    Forward,
    /// The manager pauses the engine's generation (and knows it).
    Pause,
    /// The manager resumes it.
    Continue,
    /// Not through this door: a code and a message that names the manager's API for it.
    Refused { code: &'static str, message: String },
}

/// Paths that only read an engine's state (GET or POST).
const READS: [&str; 12] = [
    "model_info",
    "get_model_info",
    "server_info",
    "get_server_info",
    "health",
    "health_generate",
    "ping",
    "ready",
    "v1/loads",
    "get_load",
    "v1/models",
    "metrics",
];

/// Paths that act on requests only, never on weights or versions.
const REQUEST_ACTIONS: [&str; 2] = ["flush_cache", "abort_request"];

/// What `path` (without the leading `/`) becomes when `method` calls it.
pub fn classify(method: &str, path: &str) -> EngineCall {
    let path = path.trim_start_matches('/');
    if READS.contains(&path) || REQUEST_ACTIONS.contains(&path) {
        return EngineCall::Forward;
    }
    if method != "POST" {
        return refused_route(path);
    }
    match path {
        "pause_generation" => EngineCall::Pause,
        "continue_generation" => EngineCall::Continue,
        _ => refused_route(path),
    }
}

fn refused_route(path: &str) -> EngineCall {
    let weights = [
        "update_weights_from_disk",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
        "update_weight_version",
    ];
    if weights.contains(&path) {
        return EngineCall::Refused {
            code: "weights_managed",
            message: format!(
                "{path} changes the fleet's weights, which the manager versions: publish a checkpoint with \
                 POST /rollout/weights/publish, or run a trainer broadcast with POST /rollout/weights/trainer_updates \
                 (elastic_rollout.trainer.DistributedWeightSync), on the control port"
            ),
        };
    }
    EngineCall::Refused {
        code: "path_not_allowed",
        message: format!(
            "{path} is not an engine path the control plane calls; it forwards reads ({}), {}, and \
             pause_generation / continue_generation",
            READS.join(", "),
            REQUEST_ACTIONS.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct E {
        fields: BTreeMap<String, String>,
        labels: BTreeMap<String, String>,
    }

    impl Selectable for E {
        fn field(&self, key: &str) -> Option<String> {
            self.fields.get(key).cloned()
        }
        fn labels(&self) -> &BTreeMap<String, String> {
            &self.labels
        }
    }

    fn engine(id: &str, health: &str, label: Option<(&str, &str)>) -> E {
        let fields = [("id", id), ("engine", "sglang"), ("health", health)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let labels = label.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        E { fields, labels }
    }

    #[test]
    fn selectors_parse_and_match_as_documented() {
        let a = engine("engine_0", "healthy", Some(("origin", "managed")));
        let b = engine("engine_1", "unhealthy", None);
        let table: [(&str, bool, bool); 7] = [
            ("all", true, true),
            ("*", true, true),
            ("engine=sglang", true, true),
            ("engine=sglang,health=healthy", true, false),
            (" id = engine_1 ", false, true),
            ("label.origin=managed", true, false),
            ("engine=vllm", false, false),
        ];
        for (text, on_a, on_b) in table {
            let s = Selector::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((s.matches(&a), s.matches(&b)), (on_a, on_b), "{text}");
        }
    }

    #[test]
    fn a_bad_selector_says_what_is_wrong_and_gives_the_grammar() {
        for (text, says) in [
            ("", "empty"),
            ("engine", "no `=`"),
            ("colour=red", "unknown key \"colour\""),
            ("label.=x", "unknown key"),
            ("engine=", "no value"),
            ("engine=sglang,", "no `=`"),
        ] {
            let err = Selector::parse(text).expect_err(text);
            assert!(err.contains(says) && err.contains("key=value"), "{text}: {err}");
        }
    }

    #[test]
    fn reads_are_forwarded_pauses_are_the_managers_and_weights_are_refused() {
        assert_eq!(classify("GET", "model_info"), EngineCall::Forward);
        assert_eq!(classify("GET", "/server_info"), EngineCall::Forward);
        assert_eq!(classify("POST", "flush_cache"), EngineCall::Forward);
        assert_eq!(classify("POST", "pause_generation"), EngineCall::Pause);
        assert_eq!(classify("POST", "continue_generation"), EngineCall::Continue);
        assert!(matches!(classify("GET", "pause_generation"), EngineCall::Refused { code: "path_not_allowed", .. }));
        for path in ["update_weights_from_disk", "init_weights_update_group", "update_weight_version"] {
            match classify("POST", path) {
                EngineCall::Refused { code, message } => {
                    assert_eq!(code, "weights_managed");
                    assert!(message.contains("/rollout/weights/publish"), "{message}");
                }
                other => panic!("{path}: {other:?}"),
            }
        }
        assert!(matches!(classify("POST", "generate"), EngineCall::Refused { code: "path_not_allowed", .. }));
    }
}
