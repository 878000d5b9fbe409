//! `--sglang-api VERSION`: which SGLang 0.5.x release's HTTP surface the simulator serves.
//!
//! Routes were added, renamed and removed across the 0.5.x line, and clients (our manager, the
//! RL frameworks that pin an older release) must cope with each. The facts below were read
//! from the `sglang/srt/entrypoints/` and `managers/io_struct.py` of every 0.5.x wheel on
//! PyPI (0.5.1 to 0.5.23); the first and last release serving each route are data, so a new
//! release is a one-line change. Routes not listed are served by every profile.

use std::fmt;

/// A 0.5.x release, compared by patch then post number (`0.5.10.post1` > `0.5.10`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Release {
    patch: u32,
    post: u32,
}

/// The oldest and newest releases the simulator can imitate.
pub const OLDEST: Release = Release { patch: 1, post: 0 };
pub const NEWEST: Release = Release { patch: 23, post: 0 };

const fn r(patch: u32) -> Release {
    Release { patch, post: 0 }
}

/// `(route, first release serving it, first release without it)`; `None`: still served.
const ROUTES: &[(&str, Release, Option<Release>)] = &[
    ("/model_info", r(6), None),
    ("/server_info", r(6), None),
    ("/v1/loads", r(8), None),
    ("/get_load", OLDEST, Some(r(21))),
    ("/ready", r(20), None),
    ("/begin_weight_update", r(21), None),
    ("/end_weight_update", r(21), None),
    ("/destroy_weights_update_group", r(3), None),
    ("/init_weights_send_group_for_remote_instance", r(3), None),
    ("/send_weights_to_remote_instance", r(3), None),
];

impl Release {
    /// Parses `0.5.N` or `0.5.N.postM` within the simulated range.
    pub fn parse(s: &str) -> Result<Release, String> {
        let bad = || {
            format!(
                "expected an SGLang release 0.5.N or 0.5.N.postM with N from {} to {} (e.g. 0.5.23), got {s:?}",
                OLDEST.patch, NEWEST.patch
            )
        };
        let rest = s.strip_prefix("0.5.").ok_or_else(bad)?;
        let (patch, post) = match rest.split_once(".post") {
            Some((p, q)) => (p, Some(q)),
            None => (rest, None),
        };
        let digits = |t: &str| -> Result<u32, String> {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            t.parse().map_err(|_| bad())
        };
        let release = Release { patch: digits(patch)?, post: post.map(digits).transpose()?.unwrap_or(0) };
        if release < OLDEST || release.patch > NEWEST.patch {
            return Err(bad());
        }
        Ok(release)
    }

    /// Whether this release serves `path` (exact route path, no query).
    pub fn serves(self, path: &str) -> bool {
        ROUTES
            .iter()
            .find(|(route, _, _)| *route == path)
            .is_none_or(|(_, first, gone)| self >= *first && gone.is_none_or(|g| self < g))
    }

    /// `/get_load`'s shape: one entry per DP rank from 0.5.6 on, `{"load": tokens}` of DP
    /// rank 0 before.
    pub fn load_per_rank(self) -> bool {
        self >= r(6)
    }

    /// Every finished request's `meta_info` has `weight_versions` (one span per version its
    /// output was generated on), as in 0.5.23 (`utils/weight_versions.py`, read in that
    /// release; the earlier releases were not read for it, so they keep the spans only when the
    /// version changed mid-request).
    pub fn reports_version_spans_on_finish(self) -> bool {
        self >= r(23)
    }

    /// `/generate` takes `return_prompt_token_ids` and answers with `prompt_token_ids` (every
    /// stream chunk, the final answer, an aborted request's answer) in 0.5.15.post1 and later
    /// (`managers/io_struct.py` `GenerateReqInput`, `managers/tokenizer_manager.py`
    /// `_handle_batch_output` and `_handle_abort_req`, read in 0.5.15.post1 to 0.5.23); 0.5.12
    /// has no such field and ignores it as it ignores any unknown key.
    pub fn returns_prompt_token_ids(self) -> bool {
        self >= r(15)
    }

    /// `/pause_generation` takes a `mode` from 0.5.6 on; before, it ignores its body and
    /// aborts every request.
    pub fn pause_has_modes(self) -> bool {
        self >= r(6)
    }

    /// `/ping` answers from the server's health flag (503 unless up, not unhealthy and not
    /// shutting down; a paused server is still up) in 0.5.23 (`entrypoints/http_server.py:2190-2199`,
    /// `managers/tokenizer_manager.py:728-730`); every earlier release read answers 200 whatever
    /// the state (0.5.2 :1086, 0.5.8 :1442-1445, 0.5.12 :1782-1785, 0.5.22 :2126).
    pub fn ping_reports_health(self) -> bool {
        self >= r(23)
    }

    /// When a stream sends the tokens it has not sent yet (see [`StreamRule`]): from 0.5.22 on
    /// whenever enough are unsent, before that at fixed output lengths.
    pub fn stream_rule(self) -> StreamRule {
        if self >= r(22) {
            StreamRule::Unsent
        } else {
            StreamRule::Lengths
        }
    }

    /// What the top level of `/server_info` says after a weight update or a weight-version
    /// change (see [`ServerArgsView`]).
    pub fn server_args_view(self) -> ServerArgsView {
        match self.patch {
            ..=16 => ServerArgsView::Live,
            17 => ServerArgsView::LiveRenamed,
            _ => ServerArgsView::Startup,
        }
    }

    /// The scheduler learns the weight version (so `/server_info`'s `internal_states` report the
    /// current one) from 0.5.19 on (`managers/scheduler.py` `record_weight_version_change`,
    /// read in 0.5.19, 0.5.20, 0.5.22, 0.5.23); before, no scheduler code reads or writes it
    /// (0.5.8, 0.5.12, 0.5.15.post1 to 0.5.18) and each rank keeps the launch value.
    pub fn scheduler_tracks_weight_version(self) -> bool {
        self >= r(19)
    }
}

/// When the scheduler sends a streaming request's new tokens, for a stream interval `i` (the
/// request's `sampling_params.stream_interval`, else `--stream-interval`; every 0.5.x release
/// accepts the parameter: 0.5.2 `sampling/sampling_params.py:54`, 0.5.6 :59, 0.5.10.post1 :64,
/// 0.5.15.post1 :111, 0.5.21 :151, 0.5.23 :177). A finished request always sends the rest.
/// Both rules skip a send while the output's end may begin a stop string, and they differ only
/// in what follows such a skip (or a step that adds several tokens, which the simulator never
/// makes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRule {
    /// Up to 0.5.21: send when the output length is 1 modulo `i` (for `i > 1`), or a multiple
    /// of `i` (0.5.2 `managers/scheduler_output_processor_mixin.py:541-548`, 0.5.6 :808-817,
    /// 0.5.10.post1 :998-1006, 0.5.15.post1 `managers/scheduler_components/output_streamer.py:332-340`,
    /// 0.5.21 :428-436). A skipped send waits for the next such length.
    Lengths,
    /// From 0.5.22: send the first token at once, then whenever at least `i` tokens are unsent
    /// (0.5.22 `output_streamer.py:436-449`, 0.5.23 :455-472). A skipped send goes out at the
    /// next step that is not held.
    Unsent,
}

impl StreamRule {
    /// Whether a step that leaves the output `len` tokens long, `sent` of them already sent,
    /// sends the rest (before the stop-string check). `interval` is never 0 (0 means the
    /// default); negative values behave as in Python's arithmetic.
    pub fn should_send(self, len: usize, sent: usize, interval: i64) -> bool {
        let len = i64::try_from(len).unwrap_or(i64::MAX);
        let sent = i64::try_from(sent).unwrap_or(i64::MAX);
        match self {
            StreamRule::Lengths if interval > 1 => len % interval == 1,
            // Python's `len % interval == 0`: for a negative interval too, a multiple.
            StreamRule::Lengths => interval == 0 || len % interval == 0,
            StreamRule::Unsent => {
                let unsent = len - sent;
                interval == 1 || unsent >= interval || (sent == 0 && unsent > 0)
            }
        }
    }
}

/// Where the top-level fields of `/server_info` come from once the server is running.
///
/// Every release renames the served model to the checkpoint after a successful
/// `/update_weights_from_disk` (the tokenizer manager's `model_path` and `served_model_name`,
/// which `/model_info` and `/v1/models` read), whether or not `--served-model-name` was given.
/// What differs is `/server_info`:
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerArgsView {
    /// Up to 0.5.16 the answer is the live `ServerArgs` object, which weight updates edit in
    /// place: `model_path`, `load_format` and `weight_version` follow the updates,
    /// `served_model_name` keeps its launch value (0.5.8 `managers/tokenizer_manager.py:1375-1379`,
    /// `tokenizer_communicator_mixin.py:848-851`, `entrypoints/http_server.py:581-598`; the same
    /// in 0.5.2, 0.5.10.post1, 0.5.12, 0.5.15.post1 and 0.5.16).
    Live,
    /// 0.5.17 reports the launch arguments with the recorded updates laid over them, the
    /// served model name included (`managers/tokenizer_manager.py:2066-2078`,
    /// `entrypoints/http_server.py:781-796`).
    LiveRenamed,
    /// From 0.5.18 on the top level is the startup configuration and never changes; the live
    /// values are `/model_info`'s (0.5.23 `entrypoints/http_server.py:863-891`,
    /// `utils/common.py:3584-3593`, `runtime_context.py:1163-1174`).
    Startup,
}

impl fmt::Display for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0.5.{}", self.patch)?;
        if self.post > 0 {
            write!(f, ".post{}", self.post)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_releases_and_names_the_flag_when_it_cannot() {
        assert_eq!(Release::parse("0.5.23").unwrap(), NEWEST);
        assert_eq!(Release::parse("0.5.10.post1").unwrap().to_string(), "0.5.10.post1");
        assert!(Release::parse("0.5.10.post1").unwrap() > Release::parse("0.5.10").unwrap());
        assert!(Release::parse("0.5.9").unwrap() < Release::parse("0.5.10").unwrap());
        for bad in ["", "0.5", "0.5.", "0.4.9", "0.5.0", "0.5.24", "0.5.x", "0.5.6.post", "0.5.6rc1", "1.0.0", " 0.5.6"]
        {
            let e = Release::parse(bad).unwrap_err();
            assert!(e.starts_with("expected an SGLang release 0.5.N"), "{bad}: {e}");
        }
    }

    /// The table as SGLang's wheels have it: (route, release, served?).
    #[test]
    fn routes_per_release() {
        let cases = [
            ("/model_info", "0.5.5.post3", false),
            ("/model_info", "0.5.6", true),
            ("/get_model_info", "0.5.2", true),
            ("/get_model_info", "0.5.23", true),
            ("/server_info", "0.5.2", false),
            ("/get_server_info", "0.5.23", true),
            ("/v1/loads", "0.5.7", false),
            ("/v1/loads", "0.5.8", true),
            ("/get_load", "0.5.20", true),
            ("/get_load", "0.5.21", false),
            ("/begin_weight_update", "0.5.20", false),
            ("/begin_weight_update", "0.5.21", true),
            ("/end_weight_update", "0.5.15.post1", false),
            ("/ready", "0.5.19", false),
            ("/ready", "0.5.20", true),
            ("/destroy_weights_update_group", "0.5.2", false),
            ("/destroy_weights_update_group", "0.5.3", true),
            ("/generate", "0.5.1", true),
            ("/v1/chat/completions", "0.5.1", true),
        ];
        for (route, release, served) in cases {
            assert_eq!(Release::parse(release).unwrap().serves(route), served, "{route} on {release}");
        }
        assert!(!Release::parse("0.5.5").unwrap().load_per_rank());
        assert!(Release::parse("0.5.6").unwrap().load_per_rank());
    }

    /// The releases verl pins (0.5.8 in its setup.py, 0.5.12 in its stable image), as their
    /// wheels' `entrypoints/http_server.py` have them: the `get_` and plain identity routes,
    /// `/v1/loads` and `/get_load`, the weight routes since 0.5.3; no `/ready`, no update
    /// session.
    #[test]
    fn verl_releases() {
        for release in ["0.5.8", "0.5.12"] {
            let r = Release::parse(release).unwrap();
            for route in [
                "/model_info",
                "/get_model_info",
                "/server_info",
                "/get_server_info",
                "/v1/loads",
                "/get_load",
                "/destroy_weights_update_group",
                "/init_weights_send_group_for_remote_instance",
                "/send_weights_to_remote_instance",
            ] {
                assert!(r.serves(route), "{route} on {release}");
            }
            for route in ["/ready", "/begin_weight_update", "/end_weight_update"] {
                assert!(!r.serves(route), "{route} on {release}");
            }
            assert!(r.load_per_rank() && r.pause_has_modes() && !r.ping_reports_health());
            assert_eq!(r.server_args_view(), ServerArgsView::Live);
            assert!(!r.scheduler_tracks_weight_version());
        }
    }

    #[test]
    fn stream_sends_per_release() {
        let sends = |rule: StreamRule, interval: i64, held: &[usize]| -> Vec<usize> {
            let mut sent = 0;
            let mut out = Vec::new();
            for len in 1..=12 {
                if rule.should_send(len, sent, interval) && !held.contains(&len) {
                    out.push(len);
                    sent = len;
                }
            }
            out
        };
        for rule in [StreamRule::Lengths, StreamRule::Unsent] {
            assert_eq!(sends(rule, 1, &[]), (1..=12).collect::<Vec<_>>());
            assert_eq!(sends(rule, 4, &[]), vec![1, 5, 9]);
            assert_eq!(sends(rule, 100, &[]), vec![1]);
        }
        // A held send: the old rule waits for the next length 1 mod 4, the new one sends at
        // the next step.
        assert_eq!(sends(StreamRule::Lengths, 4, &[5]), vec![1, 9]);
        assert_eq!(sends(StreamRule::Unsent, 4, &[5]), vec![1, 6, 10]);
        assert_eq!(Release::parse("0.5.21").unwrap().stream_rule(), StreamRule::Lengths);
        assert_eq!(Release::parse("0.5.22").unwrap().stream_rule(), StreamRule::Unsent);
        assert_eq!(NEWEST.stream_rule(), StreamRule::Unsent);
    }

    #[test]
    fn state_reporting_per_release() {
        let at = |s: &str| Release::parse(s).unwrap();
        assert_eq!(at("0.5.16").server_args_view(), ServerArgsView::Live);
        assert_eq!(at("0.5.17").server_args_view(), ServerArgsView::LiveRenamed);
        assert_eq!(at("0.5.18").server_args_view(), ServerArgsView::Startup);
        assert_eq!(at("0.5.23").server_args_view(), ServerArgsView::Startup);
        assert!(!at("0.5.18").scheduler_tracks_weight_version());
        assert!(at("0.5.19").scheduler_tracks_weight_version());
        assert!(!at("0.5.22").ping_reports_health());
        assert!(at("0.5.23").ping_reports_health());
    }
}
