//! Weight versions of the fleet: what it serves, what it is moving to, and how.
//!
//! Expected flow of a publish (`POST /rollout/weights/publish`, [`api`]): the manager reads and
//! checksums the checkpoint directory ([`checkpoint`]), stages it through the configured
//! [`transport::WeightTransport`], records an update (PENDING) with the new version as the
//! fleet's *target*, and runs it in the background ([`update`]): waves of ACTIVE engines leave
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
//!   resumes under the same id ([`update::resume`]): its checkpoint is checked again (gone or
//!   changed: the update ends FAILED with the reason, the fleet stays), engines already on the
//!   target count as done, engines caught mid-turn finish their turn, and the rest follow the
//!   strategy. The record counts the restarts it went through (`resumed`, and a `RESUMED`
//!   entry in its history).

pub mod api;
pub mod checkpoint;
pub mod transport;
pub mod update;

/// After a restart, before any engine is re-adopted: checks that the running update's target can
/// still be loaded, and stages it again where its staged copy is gone. Err: why not (the
/// checkpoint directory vanished or changed, or staging failed); the caller fails the update.
pub async fn check_resumable(manager: &crate::manager::Manager) -> Result<(), String> {
    let Some((update_id, want, engine_path)) = ({
        let inner = manager.fleet.lock();
        inner.weights.running_update().map(|u| (u.update_id.clone(), u.version_record(), u.engine_path.clone()))
    }) else {
        return Ok(());
    };
    let path = want.path.clone().unwrap_or_default();
    let dir = std::path::PathBuf::from(&path);
    let info = tokio::task::spawn_blocking(move || checkpoint::read(&dir))
        .await
        .map_err(|e| format!("cannot check the checkpoint after the restart: {e}"))?
        .map_err(|e| format!("cannot resume after a manager restart: the checkpoint is no longer usable ({e})"))?;
    if want.checksum.as_deref() != Some(info.checksum.as_str()) {
        return Err(format!(
            "cannot resume after a manager restart: the checkpoint at {path} changed (SHA-256 {} now, {} published)",
            info.checksum,
            want.checksum.as_deref().unwrap_or("-")
        ));
    }
    if manager.ray() || std::path::Path::new(&engine_path).exists() {
        // On agents' nodes the copy is checked (and staged if missing) before each load.
        return Ok(());
    }
    tracing::warn!(update_id, version = %want.version, path = %engine_path, "the update's staged copy is gone; staging it again");
    let staged = manager
        .transport
        .stage(&want, &[transport::Node::Local])
        .await
        .map_err(|e| format!("cannot resume after a manager restart: {e}"))?;
    manager.fleet.update(|inner| {
        if let Some(u) = inner.weights.updates.get_mut(&update_id) {
            u.engine_path = staged;
        }
    });
    Ok(())
}

/// After a restart in local mode: when the current version's engine copy is gone (a reboot
/// emptied the relay's `/dev/shm`), stages it again from the published directory before any
/// engine launches on it. (Engines on agents check their own node when they load it, as every
/// engine does: [`crate::manager::Manager::weights_path_for`].)
pub async fn restage_if_missing(manager: &crate::manager::Manager) {
    if manager.ray() {
        return;
    }
    let (current, engine_path) = {
        let inner = manager.fleet.lock();
        (inner.weights.current.clone(), inner.weights.current_engine_path.clone())
    };
    let Some(engine_path) = engine_path else { return };
    if current.path.is_none() || std::path::Path::new(&engine_path).exists() {
        return;
    }
    tracing::warn!(version = %current.version, path = %engine_path, "the current version's engine copy is gone; staging it again");
    match manager.transport.stage(&current, &[transport::Node::Local]).await {
        Ok(path) => manager.fleet.update(|inner| {
            if inner.weights.current.version == current.version {
                inner.weights.current_engine_path = Some(path);
            }
        }),
        Err(e) => tracing::error!(error = %e, "cannot stage the current version again; engines cannot start on it"),
    }
}
