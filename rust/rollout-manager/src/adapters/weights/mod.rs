//! Weight versions of the fleet: what it serves, what it is moving to, and how.
//!
//! Expected flow of a publish (`POST /rollout/weights/publish`, `interfaces::api`): the manager reads and
//! checksums the checkpoint directory ([`checkpoint`]), stages it through the configured
//! [`transport::WeightTransport`], records an update (PENDING) with the new version as the
//! fleet's *target*, and runs it in the background (`ops::weight_update`): waves of ACTIVE engines leave
//! routing (WEIGHT_SYNCING), drain or pause, load the version with `/update_weights_from_disk`,
//! and come back (READY -> ACTIVE) only once `/model_info` reports the new version and checksum.
//!
//! Guarantees:
//! - **The fleet version moves when the update commits**: when every READY or ACTIVE engine
//!   serves the target (for `rolling` that is the last wave; the router's version pins keep
//!   requests on one version meanwhile). Until then `GET /rollout/weights` shows the old version
//!   as current and the new one as the update's target.
//! - **New engines start on the newest version**: a launch uses the target (or current)
//!   checkpoint as `--model-path` with its `--weight-version`, and WEIGHT_SYNCING checks (and if
//!   needed loads) that version before the engine is routable. The check and the engine's state
//!   change happen under the registry lock against the target at that instant, so a publish that
//!   races a scale-out either reaches the new engine at WEIGHT_SYNCING or finds it READY/ACTIVE on
//!   the old version and updates it in a later wave; the update commits only after that.
//! - **An engine never serves a wrong version silently**: an engine that fails to load or verify
//!   leaves routing (FAILED) and is restarted on the fleet's current checkpoint; the update is
//!   FAILED with the reason, and engines that already moved to the failed version are restarted
//!   on the current one too.
//! - One update runs at a time (409 otherwise); publishing the same version, path and checksum
//!   again is answered with the existing update; a version name never changes its bytes (409).
//! - The state is persisted in the store, so a restarted manager knows the version and its
//!   checkpoint, and an update in flight when the manager stopped (crash, SIGKILL, SIGTERM)
//!   resumes under the same id (`ops::weight_update::resume`): its checkpoint is checked again (gone or
//!   changed: the update ends FAILED with the reason, the fleet stays), engines already on the
//!   target count as done, engines caught mid-turn finish their turn, and the rest follow the
//!   strategy. The record counts the restarts it went through (`resumed`, and a `RESUMED`
//!   entry in its history).

pub mod checkpoint;
pub mod transport;
