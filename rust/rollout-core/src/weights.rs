//! Weight versions and fleet-wide weight updates: the pure model.
//!
//! A [`WeightVersion`] is one published policy: a version name, the checkpoint directory it was
//! published from, and the checksum of that directory ([`checkpoint_checksum`]). A fleet update moves every
//! serving engine to a new version, by one of two [`UpdateStrategy`]s:
//! - `all_at_once`: every engine leaves routing, pauses, loads, is verified and comes back;
//! - `rolling`: waves of at most `max_unavailable` engines ([`wave_size`]) leave routing, drain,
//!   load and come back verified, so the rest of the fleet keeps serving.
//!
//! Each engine's part of an update moves through [`EngineUpdateStatus`]
//! (`PENDING -> UPDATING -> VERIFIED | FAILED`, or `SKIPPED` when it leaves the fleet first); the
//! update itself through [`WeightUpdateStatus`]
//! (`CHECKSUMMING -> PENDING -> UPDATING -> COMPLETED | FAILED`; a publish answers while the
//! checkpoint is still being hashed, in `CHECKSUMMING`).
//! Both are moved by one pure `on(state, event)` like the machines in [`crate::state`].
//!
//! Checksum rule (shared with `sglang-sim` and `rollout-relay`): every `*.safetensors` file of
//! the directory is hashed on its own (SHA-256), so files can be hashed in parallel; the
//! checkpoint's checksum is the lowercase hex SHA-256 of the listing `sha256sum` prints for those
//! files in byte-wise sorted name order, one line `<file hex digest>  <file name>\n` per file.
//! From a shell: `cd DIR && LC_ALL=C sha256sum -- *.safetensors | sha256sum`.
//! [`FileHash`] hashes one file's bytes, [`checkpoint_checksum`] combines the files' digests;
//! [`safetensors_header`] checks one file's header; the manager does the reading.

use crate::state::IllegalTransition;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One published weight version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightVersion {
    pub version: String,
    /// Checkpoint directory of `*.safetensors` files; `None` for the version the engines were
    /// started with (`--weight-version`), which was never published.
    pub path: Option<String>,
    /// SHA-256 of the checkpoint (see the module docs); `None` when unknown.
    pub checksum: Option<String>,
    /// Order of publication (0 for the startup version).
    pub published_seq: u64,
}

impl WeightVersion {
    /// The version the fleet starts on before anything is published.
    pub fn startup(version: &str) -> Self {
        Self { version: version.to_string(), path: None, checksum: None, published_seq: 0 }
    }

    /// Whether an engine reporting `version` and `checksum` serves this version. A missing
    /// checksum on either side is not a mismatch (real SGLang does not report one).
    pub fn served_by(&self, version: Option<&str>, checksum: Option<&str>) -> bool {
        version == Some(self.version.as_str())
            && match (self.checksum.as_deref(), checksum) {
                (Some(want), Some(got)) => want == got,
                _ => true,
            }
    }
}

/// How a fleet moves to a new version.
/// SGLang's `/pause_generation` modes. Request bodies carry the name as a string, so that an
/// unknown one is refused as `invalid_pause_mode` (checked with [`PauseMode::known`]) rather
/// than as a body that cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum PauseMode {
    Abort,
    Retract,
    InPlace,
}

impl PauseMode {
    pub const ALL: [Self; 3] = [Self::Abort, Self::Retract, Self::InPlace];

    pub fn name(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Retract => "retract",
            Self::InPlace => "in_place",
        }
    }

    /// Whether `name` is one of the modes.
    pub fn known(name: &str) -> bool {
        Self::ALL.into_iter().any(|m| m.name() == name)
    }
}

/// The collective backend of a trainer's weight-update group (SGLang's
/// `/init_weights_update_group` `backend`): `nccl` between GPUs, `gloo` where the engines run on
/// CPU (SGLang's CPU platform, the real-engine tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum GroupBackend {
    #[default]
    Nccl,
    Gloo,
}

impl GroupBackend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Nccl => "nccl",
            Self::Gloo => "gloo",
        }
    }

    /// The backend named `name`, or why not (the message lists the ones there are).
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "nccl" => Ok(Self::Nccl),
            "gloo" => Ok(Self::Gloo),
            other => Err(format!(
                "backend {other:?} is not one the engines join weight-update groups over: use \"nccl\" (GPUs) or \"gloo\" (engines on CPU)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum UpdateStrategy {
    AllAtOnce,
    Rolling,
}

impl std::fmt::Display for UpdateStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AllAtOnce => "all_at_once",
            Self::Rolling => "rolling",
        })
    }
}

/// Engines updated together: the whole fleet for `all_at_once`; for `rolling`, `max_unavailable`
/// if given, else 25% of the fleet, never less than 1 and never more than the fleet.
pub fn wave_size(strategy: UpdateStrategy, max_unavailable: Option<u32>, fleet: usize) -> usize {
    let fleet = fleet.max(1);
    match strategy {
        UpdateStrategy::AllAtOnce => fleet,
        UpdateStrategy::Rolling => {
            let n = max_unavailable.map_or(fleet / 4, |m| m as usize);
            n.clamp(1, fleet)
        }
    }
}

/// One engine as the update planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineView {
    pub engine_id: crate::ids::EngineId,
    /// Whether it serves requests now (ACTIVE).
    pub serving: bool,
    /// Whether it already serves the target version.
    pub on_target: bool,
}

/// The next wave: up to `wave` serving engines not yet on the target, in the given order.
pub fn next_wave(engines: &[EngineView], wave: usize) -> Vec<crate::ids::EngineId> {
    engines.iter().filter(|e| e.serving && !e.on_target).take(wave).map(|e| e.engine_id.clone()).collect()
}

/// Progress of one engine within one update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EngineUpdateStatus {
    Pending,
    Updating,
    Verified,
    Failed,
    Skipped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineUpdateEvent {
    /// Taken out of routing; loading starts.
    Start,
    /// Reports the target version and checksum.
    Verified,
    /// Loading or verification failed.
    Fail,
    /// Left the fleet (or was synced by another path) before its turn.
    Skip,
}

impl EngineUpdateStatus {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Verified | Self::Failed | Self::Skipped)
    }

    pub fn on(self, event: EngineUpdateEvent) -> Result<Self, IllegalTransition> {
        use EngineUpdateEvent as E;
        use EngineUpdateStatus as S;
        let illegal = || IllegalTransition {
            machine: "engine weight update",
            state: format!("{self:?}"),
            event: format!("{event:?}"),
        };
        // Every (state, event) pair is decided here: a new state or event does not compile
        // until each of its edges is.
        Ok(match (self, event) {
            (S::Pending, E::Start) => S::Updating,
            // An engine synced to the target while starting counts as verified without a turn.
            (S::Pending | S::Updating, E::Verified) => S::Verified,
            (S::Pending | S::Updating, E::Fail) => S::Failed,
            (S::Pending, E::Skip) => S::Skipped,
            // A turn starts once; an engine in its turn finishes it (verified or failed).
            (S::Updating, E::Start | E::Skip) => return Err(illegal()),
            // Ended: nothing moves it again.
            (S::Verified | S::Failed | S::Skipped, E::Start | E::Verified | E::Fail | E::Skip) => return Err(illegal()),
        })
    }
}

/// Status of one fleet update.
///
/// Expected flow: `PENDING -> UPDATING -> COMPLETED` (the fleet version moved). `FAILED`: an
/// engine could not load or verify the version; the fleet stays on (is rolled back to) the
/// version it had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum WeightUpdateStatus {
    /// Published; the checkpoint is being checked and hashed. Nothing is loaded yet.
    Checksumming,
    Pending,
    Updating,
    Completed,
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightUpdateEvent {
    /// The checkpoint was hashed (and matched what the publish expected).
    Checksummed,
    Start,
    Commit,
    Fail,
}

impl WeightUpdateStatus {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed)
    }

    pub fn on(self, event: WeightUpdateEvent) -> Result<Self, IllegalTransition> {
        use WeightUpdateEvent as E;
        use WeightUpdateStatus as S;
        let illegal =
            || IllegalTransition { machine: "weight update", state: format!("{self:?}"), event: format!("{event:?}") };
        // Every (state, event) pair is decided here, as for the engine's machine.
        Ok(match (self, event) {
            (S::Checksumming, E::Checksummed) => S::Pending,
            (S::Pending, E::Start) => S::Updating,
            (S::Updating, E::Commit) => S::Completed,
            (S::Checksumming | S::Pending | S::Updating, E::Fail) => S::Failed,
            // Nothing is loaded before the files were hashed, and an update commits only once it ran.
            (S::Checksumming, E::Start | E::Commit) | (S::Pending, E::Checksummed | E::Commit) => return Err(illegal()),
            (S::Updating, E::Checksummed | E::Start) => return Err(illegal()),
            // Ended: nothing moves it again.
            (S::Completed | S::Failed, E::Checksummed | E::Start | E::Commit | E::Fail) => return Err(illegal()),
        })
    }
}

impl std::fmt::Display for WeightUpdateStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Checksumming => "CHECKSUMMING",
            Self::Pending => "PENDING",
            Self::Updating => "UPDATING",
            Self::Completed => "COMPLETED",
            Self::Failed => "FAILED",
        })
    }
}

/// What a publish of `version` from `path` (expecting `checksum`, when given) means given what
/// is already known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishCheck {
    /// A new version: start an update.
    New,
    /// The same version from the same path (and the same checksum, when both are known): nothing
    /// to do.
    Same,
    /// The version name is taken by a different path, or by different bytes.
    Conflict(String),
}

/// Compares a publish with the versions already known (current, in flight, history). A version
/// name stands for one path and one checksum for good; a publish that repeats both (or the path,
/// when it gives no checksum) is the same publish again.
pub fn check_publish<'a>(
    known: impl IntoIterator<Item = &'a WeightVersion>,
    version: &str,
    path: &str,
    checksum: Option<&str>,
) -> PublishCheck {
    for k in known {
        if k.version != version {
            continue;
        }
        return match (k.path.as_deref(), k.checksum.as_deref(), checksum) {
            (None, _, _) => PublishCheck::Conflict(format!(
                "version {version:?} is the fleet's startup version (--weight-version); publish under a new name"
            )),
            (Some(p), _, _) if p != path => PublishCheck::Conflict(format!(
                "version {version:?} was already published from {p:?}; publish under a new name"
            )),
            (_, Some(c), Some(given)) if c != given => PublishCheck::Conflict(format!(
                "version {version:?} was already published with checksum {c}; this publish expects {given}"
            )),
            _ => PublishCheck::Same,
        };
    }
    PublishCheck::New
}

/// SHA-256 of one file's bytes, fed in order (see the module docs for the rule).
#[derive(Default, Clone)]
pub struct FileHash(Sha256);

impl FileHash {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// Lowercase hex digest.
    pub fn finish(self) -> String {
        hex(&self.0.finalize())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A checkpoint's checksum from its files' digests: `(file name, lowercase hex SHA-256)` for
/// every `*.safetensors` file. Sorts by name itself (byte-wise), so callers may hash in any order.
pub fn checkpoint_checksum<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut files: Vec<(&str, &str)> = files.into_iter().collect();
    files.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut listing = Sha256::new();
    for (name, digest) in files {
        listing.update(digest.as_bytes());
        listing.update(b"  ");
        listing.update(name.as_bytes());
        listing.update(b"\n");
    }
    hex(&listing.finalize())
}

/// Safetensors headers larger than this are rejected (the format's own limit is 100 MB).
pub const MAX_HEADER: u64 = 100 * 1024 * 1024;

/// Checks the header length prefix of a safetensors file of `file_len` bytes; returns the
/// header's length in bytes.
pub fn safetensors_header_len(prefix: [u8; 8], file_len: u64) -> Result<u64, String> {
    if file_len < 8 {
        return Err(format!("file is {file_len} bytes, shorter than the 8-byte header length"));
    }
    let header_len = u64::from_le_bytes(prefix);
    if header_len == 0 || header_len > MAX_HEADER || header_len > file_len - 8 {
        return Err(format!("header length {header_len} does not fit in a {file_len}-byte file"));
    }
    Ok(header_len)
}

/// Checks a safetensors JSON header: every tensor has a dtype, a shape and data offsets within
/// the `data_len` bytes that follow the header. Returns the number of tensors.
pub fn safetensors_header(header: &[u8], data_len: u64) -> Result<usize, String> {
    let json: serde_json::Value = serde_json::from_slice(header).map_err(|e| format!("header is not JSON: {e}"))?;
    let obj = json.as_object().ok_or_else(|| "header is not a JSON object".to_string())?;
    let mut tensors = 0;
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype_ok = t.get("dtype").is_some_and(|d| d.is_string());
        let shape_ok = t.get("shape").and_then(|s| s.as_array()).is_some_and(|s| s.iter().all(|d| d.is_u64()));
        let offsets = t.get("data_offsets").and_then(|o| o.as_array()).and_then(|o| match o.as_slice() {
            [a, b] => Some((a.as_u64()?, b.as_u64()?)),
            _ => None,
        });
        match (dtype_ok, shape_ok, offsets) {
            (true, true, Some((begin, end))) if begin <= end && end <= data_len => tensors += 1,
            _ => {
                return Err(format!("tensor {name:?} needs dtype, shape and data_offsets within {data_len} data bytes"))
            }
        }
    }
    Ok(tensors)
}

#[cfg(test)]
#[path = "weights_tests.rs"]
mod tests;
