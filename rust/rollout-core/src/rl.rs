//! The RL control plane's pure parts (SMG's `/v1/rl/*`, served on the router port): which
//! engines a fan-out selector names, and what a call to an engine path becomes.
//!
//! A selector is SMG's: terms joined by `,`, every one of which must hold (AND): `k=v`, `k!=v`,
//! `k in (a,b)`, `k notin (a,b)`. A key is a built-in field (`id`, `url`, `base_url`, `engine`,
//! `model` or `model_id`, `worker_type`, `connection_mode`, `health`, `weight_version`, `role`)
//! or else a label. A missing key fails `=` and `in` and passes `!=` and `notin`. We also take
//! `all` (or `*`) for every engine, which SMG does not.
//!
//! An engine path is forwarded as it is when it only reads (`model_info`, `server_info`,
//! `health`, `v1/loads`, ...) or acts on requests only (`flush_cache`, `abort_request`, POST);
//! `pause_generation` and `continue_generation` are the manager's own steps (it knows the
//! pause, keeps the engine out of routing while it lasts, and does not take it for a hang);
//! every other path changes what the fleet serves and belongs to the manager's API, which the
//! refusal names.

/// A parsed fan-out selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    All,
    /// Every term must hold.
    Terms(Vec<Term>),
}

/// One term of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    pub key: String,
    /// `=` / `in` (true) or `!=` / `notin` (false).
    pub positive: bool,
    pub values: Vec<String>,
}

/// What an engine offers a selector: the value of a key (a built-in field, else a label).
pub trait Selectable {
    fn value(&self, key: &str) -> Option<String>;
}

/// The grammar, for messages.
pub const SELECTOR_GRAMMAR: &str =
    "terms joined by `,`, all of which must hold: k=v, k!=v, k in (a,b), k notin (a,b); keys are id, url, base_url, engine, model, worker_type, connection_mode, health, weight_version, role or a label (or `all`)";

fn key_ok(key: &str) -> bool {
    !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
}

/// Splits on `,` outside parentheses.
fn split_terms(text: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

fn parse_term(term: &str) -> Result<Term, String> {
    let term = term.trim();
    let set = |rest: &str| -> Option<Vec<String>> {
        let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
        let values: Vec<String> = inner.split(',').map(|v| v.trim().trim_matches('"').to_string()).collect();
        values.iter().all(|v| !v.is_empty()).then_some(values)
    };
    let (key, positive, values) = if let Some((k, v)) = term.split_once("!=") {
        (k, false, Some(vec![v.trim().trim_matches('"').to_string()]))
    } else if let Some((k, v)) = term.split_once('=') {
        (k, true, Some(vec![v.trim().trim_matches('"').to_string()]))
    } else if let Some((k, rest)) = term.split_once(" notin ") {
        (k, false, set(rest))
    } else if let Some((k, rest)) = term.split_once(" in ") {
        (k, true, set(rest))
    } else {
        return Err(format!("term {term:?} has no =, !=, in or notin"));
    };
    let key = key.trim();
    if !key_ok(key) {
        return Err(format!("term {term:?}: the key must be letters, digits or _ . / -"));
    }
    match values {
        Some(values) if values.iter().all(|v| !v.is_empty()) => Ok(Term { key: key.to_string(), positive, values }),
        _ => Err(format!("term {term:?} has no value")),
    }
}

impl Selector {
    /// Parses `text`; Err says what is wrong and gives the grammar.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text == "all" || text == "*" {
            return Ok(Self::All);
        }
        if text.is_empty() {
            return Err(format!("the selector is empty; a selector is {SELECTOR_GRAMMAR}"));
        }
        let terms: Result<Vec<Term>, String> = split_terms(text).into_iter().map(parse_term).collect();
        terms.map(Self::Terms).map_err(|e| format!("{e}; a selector is {SELECTOR_GRAMMAR}"))
    }

    /// Whether `engine` is selected.
    pub fn matches(&self, engine: &impl Selectable) -> bool {
        match self {
            Self::All => true,
            Self::Terms(terms) => terms.iter().all(|t| {
                let key = if t.key == "model" { "model_id" } else { t.key.as_str() };
                let found = engine.value(key).is_some_and(|v| t.values.contains(&v));
                found == t.positive
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
    /// A new weight version from a checkpoint (`update_weights_from_disk`): fanned out to every
    /// engine, the manager's publish of it to the fleet; to one engine, refused (a version is
    /// the fleet's).
    FleetPublish,
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
    if READS.contains(&path) {
        return EngineCall::Forward;
    }
    if method != "POST" {
        return refused_route(path);
    }
    if REQUEST_ACTIONS.contains(&path) {
        return EngineCall::Forward;
    }
    match path {
        "pause_generation" => EngineCall::Pause,
        "continue_generation" => EngineCall::Continue,
        "update_weights_from_disk" => EngineCall::FleetPublish,
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
                "{path} changes the fleet's weights, which the manager versions: fan out update_weights_from_disk to \
                 every worker (POST /v1/rl/engine/update_weights_from_disk?selector=all), publish a checkpoint with \
                 POST /rollout/weights/publish, or run a trainer broadcast with POST /rollout/weights/trainer_updates \
                 (elastic_rollout.trainer.DistributedWeightSync) on the control port or through --trainer-port"
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
    use std::collections::BTreeMap;

    struct E(BTreeMap<String, String>);

    impl Selectable for E {
        fn value(&self, key: &str) -> Option<String> {
            self.0.get(key).cloned()
        }
    }

    fn engine(id: &str, health: &str, label: Option<(&str, &str)>) -> E {
        let mut fields: BTreeMap<String, String> =
            [("id", id), ("engine", "sglang"), ("health", health), ("model_id", "m")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        fields.extend(label.map(|(k, v)| (k.to_string(), v.to_string())));
        E(fields)
    }

    #[test]
    fn selectors_parse_and_match_as_smg_documents_them() {
        let a = engine("engine_0", "ready", Some(("origin", "managed")));
        let b = engine("engine_1", "not_ready", None);
        let table: [(&str, bool, bool); 11] = [
            ("all", true, true),
            ("engine=sglang", true, true),
            ("engine=sglang,health=ready", true, false),
            (" id = engine_1 ", false, true),
            ("origin=managed", true, false),
            ("origin!=managed", false, true),
            ("health in (ready, draining)", true, false),
            ("id notin (engine_0,engine_9)", false, true),
            ("model=m,engine in (sglang,vllm)", true, true),
            ("engine=vllm", false, false),
            ("engine=\"sglang\"", true, true),
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
            ("engine", "no =, !=, in or notin"),
            ("col our=red", "the key must be"),
            ("engine=", "no value"),
            ("engine=sglang,", "no =, !="),
            ("health in ready", "no value"),
            ("health in (ready,)", "no value"),
        ] {
            let err = Selector::parse(text).expect_err(text);
            assert!(err.contains(says) && err.contains("k notin (a,b)"), "{text}: {err}");
        }
    }

    #[test]
    fn reads_are_forwarded_pauses_are_the_managers_and_weights_are_refused() {
        assert_eq!(classify("GET", "model_info"), EngineCall::Forward);
        assert_eq!(classify("GET", "/server_info"), EngineCall::Forward);
        assert_eq!(classify("POST", "flush_cache"), EngineCall::Forward);
        assert!(
            matches!(classify("GET", "flush_cache"), EngineCall::Refused { .. }),
            "request actions are POSTs: a GET changes nothing"
        );
        assert_eq!(classify("POST", "pause_generation"), EngineCall::Pause);
        assert_eq!(classify("POST", "continue_generation"), EngineCall::Continue);
        assert!(matches!(classify("GET", "pause_generation"), EngineCall::Refused { code: "path_not_allowed", .. }));
        assert_eq!(classify("POST", "update_weights_from_disk"), EngineCall::FleetPublish);
        assert!(matches!(
            classify("GET", "update_weights_from_disk"),
            EngineCall::Refused { code: "weights_managed", .. }
        ));
        for path in ["update_weights_from_distributed", "init_weights_update_group", "update_weight_version"] {
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
