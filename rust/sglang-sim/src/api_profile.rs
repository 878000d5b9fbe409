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

    /// `/pause_generation` takes a `mode` from 0.5.6 on; before, it ignores its body and
    /// aborts every request.
    pub fn pause_has_modes(self) -> bool {
        self >= r(6)
    }
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
}
