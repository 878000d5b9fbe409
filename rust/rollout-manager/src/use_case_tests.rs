//! Unit tests of the use cases (scale-out, scale-in, recovery) on fake engines
//! ([`crate::testing`]): the real manager, registry and state machines, with the engines'
//! processes and HTTP calls behind the seams. Each test waits on registry changes, not sleeps.

use crate::ops::scaling::{self, ScaleInRequest, ScaleOutRequest};
use crate::testing::{crash_copy, manager, manager_on_store, one_life, wait_for, FakeEngines};
use rollout_core::ids::UpdateId;
use rollout_core::{EngineStatus, ScaleInStatus, ScaleOutStatus};
use std::sync::Arc;

/// A directory removed when the test ends.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("rollout-unit-store-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ignored = std::fs::remove_dir_all(&self.0);
    }
}

fn scale_out_request(n: i64) -> ScaleOutRequest {
    serde_json::from_value(serde_json::json!({ "num_replicas": n })).expect("a valid request")
}

fn scale_in_request(n: i64) -> ScaleInRequest {
    serde_json::from_value(serde_json::json!({ "num_replicas": n })).expect("a valid request")
}

fn op_status(m: &crate::ops::manager::Manager, id: &str) -> Option<ScaleOutStatus> {
    m.fleet.lock().ops.scale_out(id).map(|op| op.status())
}

fn count(inner: &crate::registry::fleet::FleetInner, status: EngineStatus) -> usize {
    inner.engines.values().filter(|e| e.status() == status).count()
}

#[tokio::test]
async fn scale_out_brings_every_engine_to_active_and_into_routing() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let accepted = scaling::scale_out(&m, scale_out_request(2)).expect("accepted");
    let id = accepted.request_id;
    wait_for(&m, "the scale-out to end", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    assert_eq!(op_status(&m, &id), Some(ScaleOutStatus::Active));
    let table = m.fleet.routes();
    assert_eq!(table.backends.len(), 2);
    assert!(table.backends.iter().all(|b| b.weight_version.as_deref() == Some("default")), "{table:?}");
    assert_eq!(m.fleet.lock().engines.free_gpus(), 0);
    assert_eq!(engines.running(), 2);
    // The operation went through every phase, in order.
    let history: Vec<String> =
        m.fleet.lock().ops.scale_out(&id).unwrap().history().iter().map(|t| t.status.clone()).collect::<Vec<_>>();
    assert_eq!(history, ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "READY", "ACTIVE"]);
}

#[tokio::test]
async fn a_failing_launch_rolls_back_the_whole_scale_out_by_default() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    engines.fail_launch("engine_1");
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out to end", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    assert_eq!(op_status(&m, &id), Some(ScaleOutStatus::Failed));
    {
        let inner = m.fleet.lock();
        let op = &inner.ops.scale_out(&id).unwrap();
        assert_eq!(op.failed_engines().len(), 1, "{op:?}");
        assert!(op.failed_engines()[0].error.contains("refused"), "{op:?}");
        // Nothing is left: no routable engine, every GPU and process given back.
        assert!(m.fleet.routes().backends.is_empty());
        assert_eq!(inner.engines.free_gpus(), 2);
        assert_eq!(inner.engines.live_count(), 0);
    }
    wait_for(&m, "the other engine's process to stop", |_| engines.running() == 0).await;
}

#[tokio::test]
async fn keep_partial_activates_the_engines_that_came_up() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 3, &["--scale-out-partial-success-policy=keep_partial"]);
    engines.fail_launch("engine_0");
    let id = scaling::scale_out(&m, scale_out_request(3)).expect("accepted").request_id;
    wait_for(&m, "the scale-out to end", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    assert_eq!(op_status(&m, &id), Some(ScaleOutStatus::Active));
    let inner = m.fleet.lock();
    let op = &inner.ops.scale_out(&id).unwrap();
    assert_eq!(op.failed_engines().iter().map(|f| f.engine_id.as_str()).collect::<Vec<_>>(), ["engine_0"]);
    assert!(op.error_message().is_some(), "{op:?}");
    assert_eq!(count(&inner, EngineStatus::Active), 2);
    assert_eq!(inner.engines.free_gpus(), 1, "the failed engine's GPU is returned");
}

#[tokio::test]
async fn cancel_during_the_health_check_rolls_everything_back() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    // Engines that never answer their health check: the scale-out waits in HEALTH_CHECKING.
    wait_for(&m, "both engines launched", |i| {
        let urls: Vec<String> = i.engines.values().map(|e| e.record().url().clone()).collect();
        for url in &urls {
            engines.set_down(url, true);
        }
        i.engines.len() == 2
    })
    .await;
    wait_for(&m, "the health check", |i| {
        i.ops.scale_out(&id).is_some_and(|op| op.status() == ScaleOutStatus::HealthChecking)
    })
    .await;
    let cancelled = scaling::cancel_scale_out(&m, &id).expect("cancellable");
    assert!(!cancelled.status().is_terminal() || cancelled.status() == ScaleOutStatus::Cancelled);
    wait_for(&m, "the cancel", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    assert_eq!(op_status(&m, &id), Some(ScaleOutStatus::Cancelled));
    wait_for(&m, "every process stopped", |_| engines.running() == 0).await;
    let inner = m.fleet.lock();
    assert_eq!(inner.engines.free_gpus(), 2);
    assert_eq!(inner.engines.live_count(), 0);
    assert!(inner.ops.running().is_none(), "the one-operation lock is released");
}

#[tokio::test]
async fn scale_in_waits_for_requests_in_flight_then_removes_the_engine() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &["--scale-in-drain-timeout=600"]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    // A request in flight on the engine scale-in removes first (the newest, engine_1).
    let load = m.fleet.lock().engines.get("engine_1").unwrap().load().clone();
    let request = load.enter(100);
    let answer = crate::ops::scale_in::scale_in(&m, scale_in_request(1)).expect("accepted");
    let crate::ops::scale_in::ScaleInAnswer::Accepted(accepted) = answer else { panic!("not a dry run") };
    let op = accepted.request_id;
    wait_for(&m, "the drain", |i| i.ops.scale_in(&op).is_some_and(|r| r.status() == ScaleInStatus::Draining)).await;
    {
        let inner = m.fleet.lock();
        assert_eq!(inner.engines.get("engine_1").unwrap().status(), EngineStatus::Draining);
        assert!(!m.fleet.routes().is_lost(&load), "a draining engine keeps its requests");
        assert_eq!(m.fleet.routes().backends.len(), 1);
    }
    drop(request);
    wait_for(&m, "the scale-in to end", |i| i.ops.scale_in(&op).is_some_and(|r| r.status().is_terminal())).await;
    {
        let inner = m.fleet.lock();
        assert_eq!(inner.ops.scale_in(&op).unwrap().status(), ScaleInStatus::Completed);
        let gone = inner.engines.get("engine_1").is_none_or(|e| e.status() == EngineStatus::Removed);
        assert!(gone, "engine_1 is removed");
        assert_eq!(inner.engines.free_gpus(), 1);
    }
    assert!(!engines.calls().iter().any(|c| c.starts_with("abort")), "drained, so nothing aborted");
    wait_for(&m, "the process to stop", |_| engines.running() == 1).await;
}

#[tokio::test]
async fn a_crashed_engine_is_restarted_on_the_fleet_version() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 1, &[]);
    let id = scaling::scale_out(&m, scale_out_request(1)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    engines.crash("engine_0");
    wait_for(&m, "the engine back after a restart", |i| {
        i.engines.get("engine_0").unwrap().record().restarts() == 1
            && i.engines.get("engine_0").unwrap().status() == EngineStatus::Active
    })
    .await;
    assert_eq!(m.fleet.routes().backends.len(), 1);
    let launches = engines.calls().iter().filter(|c| *c == "launch engine_0").count();
    assert_eq!(launches, 2);
    assert_eq!(m.fleet.lock().engines.free_gpus(), 0, "the restart keeps its GPU");
}

/// Starts a `rolling` update of every ACTIVE engine to `version` (what a publish records once
/// the checkpoint is read and staged; the disk transport loads it from `path` as it is).
/// An update whose checkpoint is already hashed and staged (PENDING), running.
fn start_rolling_update(m: &Arc<crate::ops::manager::Manager>, version: &str, path: &str) -> UpdateId {
    let update_id = start_publish_record(m, version, std::path::Path::new(path), None);
    m.fleet.update(|inner| {
        let engines = inner
            .engines
            .values()
            .filter(|e| e.status().is_routable())
            .map(|e| e.record().engine_id().clone())
            .collect();
        let staged = crate::registry::weights::Staged {
            checksum: "0".repeat(64),
            engine_path: path.into(),
            total_bytes: 0,
            files: 0,
            engines,
        };
        assert!(inner.weights.checksummed(&update_id, staged));
    });
    m.tasks.spawn(crate::ops::weight_update::run(m.clone(), update_id.clone()));
    update_id
}

/// A publish as the API records it: CHECKSUMMING, hashed in the background.
fn start_publish(
    m: &Arc<crate::ops::manager::Manager>,
    version: &str,
    dir: &std::path::Path,
    expected: Option<String>,
) -> UpdateId {
    let update_id = start_publish_record(m, version, dir, expected);
    m.tasks.spawn(crate::ops::weight_update::checksum_then_run(m.clone(), update_id.clone()));
    update_id
}

/// The record of a publish, CHECKSUMMING, as the API writes it (nothing hashes it yet).
fn start_publish_record(
    m: &Arc<crate::ops::manager::Manager>,
    version: &str,
    dir: &std::path::Path,
    expected: Option<String>,
) -> UpdateId {
    use crate::registry::weights::{NewUpdate, UpdateRecord};
    use rollout_core::weights::UpdateStrategy;
    let update_id = UpdateId::parse(&format!("update-{version}")).unwrap();
    m.fleet.update(|inner| {
        let new = NewUpdate {
            update_id: update_id.clone(),
            version: version.into(),
            previous_version: inner.weights.current().version.clone(),
            pause_mode: "abort".into(),
            message: String::new(),
        };
        let path = dir.display().to_string();
        let record =
            UpdateRecord::from_publish(new, path, expected, 0, UpdateStrategy::Rolling, Some(1), "disk".into());
        inner.weights.start(record).unwrap();
    });
    update_id
}

#[tokio::test]
async fn an_update_interrupted_while_checksumming_is_hashed_again_when_resumed() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 1, &[]);
    let id = scaling::scale_out(&m, scale_out_request(1)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    let dir = TempDir::new();
    let checksum = write_checkpoint(&dir.0);
    // As a restarted manager finds it in its store: CHECKSUMMING, half hashed, nothing staged.
    let update = start_publish_record(&m, "v1", &dir.0, None);
    m.fleet.lock().weights.updates()[&update].hashed_bytes().set(7);
    crate::ops::weight_update::resume(m.clone(), update.clone(), Vec::new(), Vec::new()).await;
    let inner = m.fleet.lock();
    let record = &inner.weights.updates()[&update];
    assert_eq!(record.status().to_string(), "COMPLETED", "{record:?}");
    assert_eq!(record.checksum().as_deref(), Some(checksum.as_str()));
    assert_eq!(record.hashed_bytes().get(), record.total_bytes(), "hashed again from the start");
    assert_eq!(inner.weights.current().version, "v1");
}

/// A two-shard checkpoint; returns its checksum.
fn write_checkpoint(dir: &std::path::Path) -> String {
    let mut listed = Vec::new();
    for (name, byte) in [("b.safetensors", 2u8), ("a.safetensors", 1u8)] {
        let header = r#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[byte; 8]);
        std::fs::write(dir.join(name), &bytes).expect("written");
        let mut h = rollout_core::weights::FileHash::default();
        h.update(&bytes);
        listed.push((name, h.finish()));
    }
    rollout_core::weights::checkpoint_checksum(listed.iter().map(|(n, h)| (*n, h.as_str())))
}

#[tokio::test]
async fn a_publish_is_hashed_in_the_background_then_rolled_out() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    let dir = TempDir::new();
    let checksum = write_checkpoint(&dir.0);
    let update = start_publish(&m, "v1", &dir.0, Some(checksum.clone()));
    wait_for(&m, "the update to end", |i| i.weights.updates()[&update].status().is_terminal()).await;
    let inner = m.fleet.lock();
    let record = &inner.weights.updates()[&update];
    assert_eq!(record.status().to_string(), "COMPLETED", "{record:?}");
    assert_eq!(record.checksum().as_deref(), Some(checksum.as_str()));
    let size = |n: &str| std::fs::metadata(dir.0.join(n)).map(|m| m.len()).unwrap_or_default();
    let total = size("a.safetensors") + size("b.safetensors");
    assert_eq!((record.hashed_bytes().get(), record.total_bytes()), (total, total));
    let statuses: Vec<&str> = record.history().iter().map(|t| t.status.as_str()).collect();
    assert_eq!(statuses, ["CHECKSUMMING", "PENDING", "UPDATING", "COMPLETED"]);
    assert_eq!(record.engines().len(), 2, "the engines serving when the checksum was known take part");
    assert_eq!(inner.weights.current().checksum.as_deref(), Some(checksum.as_str()));
}

#[tokio::test]
async fn a_publish_whose_files_lack_the_given_checksum_fails_before_any_load() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    let dir = TempDir::new();
    write_checkpoint(&dir.0);
    let update = start_publish(&m, "v1", &dir.0, Some("0".repeat(64)));
    wait_for(&m, "the update to end", |i| i.weights.updates()[&update].status().is_terminal()).await;
    {
        let inner = m.fleet.lock();
        let record = &inner.weights.updates()[&update];
        assert_eq!(record.status().to_string(), "FAILED");
        let why = record.error_message().as_deref().unwrap_or_default();
        assert!(why.contains("does not match") && why.contains("nothing was loaded"), "{why}");
        assert!(inner.weights.running().is_none() && inner.weights.current().version == "default");
    }
    // A checkpoint that vanished fails the same way.
    std::fs::remove_dir_all(&dir.0).expect("removed");
    let gone = start_publish(&m, "v2", &dir.0, None);
    wait_for(&m, "the second update to end", |i| i.weights.updates()[&gone].status().is_terminal()).await;
    let why = m.fleet.lock().weights.updates()[&gone].error_message().clone().unwrap_or_default();
    assert!(why.contains("does not exist") && why.contains("nothing was loaded"), "{why}");
    assert!(
        engines.calls().iter().all(|c| !c.starts_with("load ")),
        "no engine loaded anything: {:?}",
        engines.calls()
    );
}

#[tokio::test]
async fn a_rolling_update_commits_when_every_engine_serves_the_new_version() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    let update = start_rolling_update(&m, "v1", "/ckpt/v1");
    wait_for(&m, "the update to end", |i| i.weights.updates()[&update].status().is_terminal()).await;
    let inner = m.fleet.lock();
    assert_eq!(inner.weights.updates()[&update].status().to_string(), "COMPLETED");
    assert_eq!(inner.weights.current().version, "v1");
    assert_eq!(count(&inner, EngineStatus::Active), 2);
    assert!(inner.engines.values().all(|e| e.record().weight_version().as_deref() == Some("v1")));
    assert_eq!(m.fleet.routes().version_order.last().map(String::as_str), Some("v1"));
    // One wave at a time (max_unavailable 1): the two loads never overlap in the log.
    let loads: Vec<String> = engines.calls().into_iter().filter(|c| c.starts_with("load ")).collect();
    assert_eq!(loads.len(), 2, "{loads:?}");
}

/// A health round asks both engines for their version, then a rolling update moves them to
/// v1 before the answers (from before the update) arrive. Those answers are stale: the records
/// stay on v1 and the fleet does not go back to the startup version (CI caught the health round
/// taking `default` as a trainer's new version, and new engines then started on it).
#[tokio::test]
async fn a_version_reading_from_before_an_update_does_not_undo_it() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    let (open, mut held) = engines.hold_model_info(2);
    let rejoining = crate::ops::health::Rejoining::default();
    let probing = {
        let (m2, rejoining) = (m.clone(), rejoining.clone());
        m.tasks.spawn(async move { crate::ops::health::probe_all(&m2, &rejoining).await })
    };
    held.wait_for(|n| *n == 2).await.expect("both readings are held");
    let update = start_rolling_update(&m, "v1", "/ckpt/v1");
    wait_for(&m, "the update to end", |i| i.weights.updates()[&update].status().is_terminal()).await;
    open.send_replace(true);
    probing.await.expect("the probe pass ends");
    let inner = m.fleet.lock();
    assert_eq!(inner.weights.current().version, "v1");
    assert!(inner.engines.values().all(|e| e.record().weight_version().as_deref() == Some("v1")));
    assert_eq!(inner.weights.updates().len(), 1, "no update observed from the engines");
}

/// Every serving engine reports a version the fleet served before (an update's previous one):
/// that is never taken as a trainer's new version, so the fleet does not go back by observation.
#[tokio::test]
async fn the_fleet_never_goes_back_to_an_older_version_by_observation() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    let update = start_rolling_update(&m, "v1", "/ckpt/v1");
    wait_for(&m, "the update to end", |i| i.weights.updates()[&update].status().is_terminal()).await;
    // Both engines are put back on the startup weights behind the manager's back.
    let urls: Vec<String> = m.fleet.lock().engines.values().map(|e| e.record().url().clone()).collect();
    for url in urls {
        let load = crate::adapters::engine_api::DiskLoad {
            path: "/base".into(),
            version: "default".into(),
            abort_all: false,
            flush_cache: true,
            timeout: std::time::Duration::from_secs(1),
        };
        crate::adapters::engine_api::EngineApi::load_from_disk(engines.as_ref(), &url, &load).await.expect("loaded");
    }
    crate::ops::health::probe_all(&m, &crate::ops::health::Rejoining::default()).await;
    let inner = m.fleet.lock();
    // The registry says what the engines serve; the fleet's version stays.
    assert!(inner.engines.values().all(|e| e.record().weight_version().as_deref() == Some("default")));
    assert_eq!(inner.weights.current().version, "v1");
}

#[tokio::test]
async fn a_rolling_update_with_a_failing_engine_fails_and_the_fleet_stays_on_its_version() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    let url = m.fleet.lock().engines.get("engine_1").unwrap().record().url().clone();
    engines.refuse_loads(&url);
    let update = start_rolling_update(&m, "v1", "/ckpt/v1");
    wait_for(&m, "the update to end", |i| i.weights.updates()[&update].status().is_terminal()).await;
    {
        let inner = m.fleet.lock();
        let record = &inner.weights.updates()[&update];
        assert_eq!(record.status().to_string(), "FAILED");
        assert!(record.error_message().as_deref().is_some_and(|e| e.contains("refused")), "{record:?}");
        assert_eq!(inner.weights.current().version, "default", "the fleet version did not move");
    }
    // Every engine comes back on the fleet's version, the one that had moved to v1 included.
    wait_for(&m, "the fleet back on its version", |i| {
        count(i, EngineStatus::Active) == 2
            && i.engines.values().all(|e| e.record().weight_version().as_deref() == Some("default"))
    })
    .await;
    assert!(m.fleet.routes().backends.iter().all(|b| b.weight_version.as_deref() == Some("default")));
}

#[tokio::test]
async fn a_probe_sent_before_a_restart_does_not_count_against_the_engine_that_came_back() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 1, &[]);
    let id = scaling::scale_out(&m, scale_out_request(1)).expect("accepted").request_id;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    // A probe of the first process hangs; meanwhile the process crashes and is restarted.
    let (open, waiting) = engines.hold_next_probe();
    let rejoining = crate::ops::health::Rejoining::default();
    let probing = {
        let (m2, rejoining) = (m.clone(), rejoining.clone());
        m.tasks.spawn(async move { crate::ops::health::probe_all(&m2, &rejoining).await })
    };
    waiting.notified().await;
    engines.crash("engine_0");
    wait_for(&m, "the restart", |i| {
        let e = &i.engines.get("engine_0").unwrap();
        e.record().restarts() == 1 && e.status() == EngineStatus::Active
    })
    .await;
    // The hung probe now fails: it was about the old process, so it counts for nothing.
    open.send_replace(true);
    probing.await.expect("the probe pass ends");
    let inner = m.fleet.lock();
    assert_eq!(inner.engines.get("engine_0").unwrap().probe_failures(), 0);
    assert_eq!(inner.engines.get("engine_0").unwrap().status(), EngineStatus::Active);
}

/// The manager is killed with two engines serving; a new one on the same `--state-dir` finds
/// their processes gone (a fresh host) and starts both again on their GPUs, on the fleet's
/// version, under the same ids; the finished scale-out keeps its history.
#[test]
fn a_restarted_manager_restarts_the_engines_it_finds_dead() {
    let dir = TempDir::new();
    let before = Arc::new(FakeEngines::default());
    let id = one_life().block_on(async {
        let m = manager_on_store(&before, 2, &[], &dir.0).await;
        let id = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
        wait_for(&m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
        id
    });
    let crashed = TempDir::new();
    crash_copy(&dir.0, &crashed.0);

    let after = Arc::new(FakeEngines::default());
    one_life().block_on(async {
        let m = manager_on_store(&after, 2, &[], &crashed.0).await;
        wait_for(&m, "both engines ACTIVE again", |i| count(i, EngineStatus::Active) == 2).await;
        let inner = m.fleet.lock();
        assert_eq!(inner.ops.scale_out(&id).unwrap().status(), ScaleOutStatus::Active);
        assert_eq!(inner.engines.free_gpus(), 0, "the restarted engines hold their GPUs again");
        let mut launched = after.calls().into_iter().filter(|c| c.starts_with("launch")).collect::<Vec<_>>();
        launched.sort();
        assert_eq!(launched, ["launch engine_0", "launch engine_1"]);
        assert_eq!(m.fleet.routes().backends.len(), 2);
    });
}

/// The manager is killed while a scale-out waits for an engine's health check. The new
/// manager ends that operation FAILED, rolls its engine back (GPU returned, nothing launched)
/// and keeps the engine an earlier operation had activated.
#[test]
fn a_scale_out_interrupted_by_a_restart_ends_failed_and_is_rolled_back() {
    let (dir, crashed) = (TempDir::new(), TempDir::new());
    let before = Arc::new(FakeEngines::default());
    let second = one_life().block_on(async {
        let m = manager_on_store(&before, 2, &[], &dir.0).await;
        let first = scaling::scale_out(&m, scale_out_request(1)).expect("accepted").request_id;
        wait_for(&m, "the first scale-out", |i| i.ops.scale_out(&first).is_some_and(|op| op.status().is_terminal()))
            .await;
        let (open, held) = before.hold_next_probe();
        let waiting = held.notified();
        let second = scaling::scale_out(&m, scale_out_request(2)).expect("accepted").request_id;
        waiting.await;
        assert_eq!(m.fleet.lock().ops.scale_out(&second).unwrap().status(), ScaleOutStatus::HealthChecking);
        crash_copy(&dir.0, &crashed.0);
        drop(open);
        second
    });

    let after = Arc::new(FakeEngines::default());
    one_life().block_on(async {
        let m = manager_on_store(&after, 2, &[], &crashed.0).await;
        wait_for(&m, "the kept engine ACTIVE again", |i| count(i, EngineStatus::Active) == 1).await;
        let inner = m.fleet.lock();
        let op = &inner.ops.scale_out(&second).unwrap();
        assert_eq!(op.status(), ScaleOutStatus::Failed);
        assert!(op.error_message().as_deref().is_some_and(|e| e.contains("rolled back")), "{op:?}");
        assert!(!inner.engines.contains_key("engine_1"), "the interrupted engine is rolled back");
        assert_eq!(inner.engines.free_gpus(), 1, "its GPU is free again");
        let launched: Vec<String> = after.calls().into_iter().filter(|c| c.starts_with("launch")).collect();
        assert_eq!(launched, ["launch engine_0"]);
    });
}

/// Opens a trainer update to `version` with `tensors` (empty: sent in buckets), over NCCL.
fn open_update_with(
    m: &Arc<crate::ops::manager::Manager>,
    version: &str,
    tensors: crate::foundation::records::Bucket,
) -> UpdateId {
    open_update_over(m, version, tensors, rollout_core::weights::GroupBackend::Nccl)
}

/// Opens a trainer update to `version` with `tensors` whose new group is built over `backend`.
fn open_update_over(
    m: &Arc<crate::ops::manager::Manager>,
    version: &str,
    tensors: crate::foundation::records::Bucket,
    backend: rollout_core::weights::GroupBackend,
) -> UpdateId {
    let req = crate::ops::trainer_update::OpenRequest {
        version: rollout_core::ids::VersionName::parse(version).expect("a valid version name"),
        tensors,
        pause_mode: "retract".into(),
        flush_cache: true,
        master_address: "127.0.0.1".into(),
        master_port: 29500,
        group_name: None,
        group_prefix: "g".into(),
        backend,
    };
    crate::ops::trainer_update::open(m, req).expect("opened").update_id().clone()
}

/// Opens a trainer update to `version` (one tensor; the fake engines take any).
fn open_trainer_update(m: &Arc<crate::ops::manager::Manager>, version: &str) -> UpdateId {
    let one = crate::foundation::records::Bucket {
        names: vec!["w".into()],
        dtypes: vec!["bfloat16".into()],
        shapes: vec![vec![2]],
    };
    open_update_with(m, version, one)
}

async fn scale_to(m: &Arc<crate::ops::manager::Manager>, n: i64) {
    let id = scaling::scale_out(m, scale_out_request(n)).expect("accepted").request_id;
    wait_for(m, "the scale-out", |i| i.ops.scale_out(&id).is_some_and(|op| op.status().is_terminal())).await;
    assert_eq!(op_status(m, &id), Some(ScaleOutStatus::Active));
}

async fn finish_trainer_update(m: &Arc<crate::ops::manager::Manager>, id: &UpdateId) {
    crate::ops::trainer_update::start_broadcast(m, id, None).await.expect("the broadcast starts");
    wait_for(m, "the trainer update to end", |i| i.weights.updates()[id.as_str()].status().is_terminal()).await;
}

#[tokio::test]
async fn a_trainer_group_is_built_over_the_backend_the_trainer_names_and_never_reused_over_another() {
    use rollout_core::weights::GroupBackend;
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    scale_to(&m, 2).await;
    let open = |version: &str, holds: Option<String>, backend| {
        let req = crate::ops::trainer_update::OpenRequest {
            version: rollout_core::ids::VersionName::parse(version).expect("a valid version name"),
            tensors: crate::foundation::records::Bucket {
                names: vec!["w".into()],
                dtypes: vec!["float32".into()],
                shapes: vec![vec![2]],
            },
            pause_mode: "retract".into(),
            flush_cache: true,
            master_address: "127.0.0.1".into(),
            master_port: 29500,
            group_name: holds,
            group_prefix: "g".into(),
            backend,
        };
        crate::ops::trainer_update::open(&m, req).expect("opened").update_id().clone()
    };
    let held = || m.fleet.lock().weights.group().as_ref().map(|g| g.group_name.clone());
    finish_trainer_update(&m, &open("cpu-1", None, GroupBackend::Gloo)).await;
    assert_eq!(engines.group_backends(), ["gloo", "gloo"]);
    // The same members and master, the group named: kept over the same backend...
    finish_trainer_update(&m, &open("cpu-2", held(), GroupBackend::Gloo)).await;
    assert_eq!(engines.group_backends(), ["gloo", "gloo"]);
    // ...and built anew over another.
    finish_trainer_update(&m, &open("gpu-1", held(), GroupBackend::Nccl)).await;
    assert_eq!(engines.group_backends(), ["gloo", "gloo", "nccl", "nccl"]);
    assert_eq!(m.fleet.lock().weights.group().as_ref().map(|g| g.backend), Some(GroupBackend::Nccl));
}

fn copies(engines: &FakeEngines) -> Vec<String> {
    engines.calls().into_iter().filter(|c| c.starts_with("copy ")).collect()
}

#[tokio::test]
async fn a_trainer_update_is_the_fleet_version_and_new_engines_copy_it_from_seeds() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 4, &[]);
    scale_to(&m, 2).await;
    let id = open_trainer_update(&m, "step-1");
    finish_trainer_update(&m, &id).await;
    {
        let inner = m.fleet.lock();
        let u = &inner.weights.updates()[&id];
        assert_eq!(u.status(), rollout_core::weights::WeightUpdateStatus::Completed, "{u:?}");
        assert_eq!(inner.weights.current().version, "step-1");
        assert_eq!(inner.weights.source(), crate::foundation::records::VersionSource::Trainer);
        assert!(inner.weights.group().as_ref().is_some_and(|g| g.members.len() == 2));
    }
    let calls = engines.calls();
    let order: Vec<&str> = ["/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed"]
        .iter()
        .map(|route| {
            let at = calls.iter().position(|c| c.ends_with(route)).expect("every route was called");
            &calls[at][..]
        })
        .collect();
    assert_eq!(order.len(), 3);
    assert!(m.fleet.routes().backends.iter().all(|b| b.weight_version.as_deref() == Some("step-1")));

    // Two new engines: each copies step-1 from a different running engine.
    scale_to(&m, 4).await;
    let copied = copies(&engines);
    assert_eq!(copied.len(), 2, "{copied:?}");
    assert_ne!(copied[0].rsplit(' ').next(), copied[1].rsplit(' ').next(), "spread over the seeds: {copied:?}");
    let table = m.fleet.routes();
    assert_eq!(table.backends.len(), 4);
    assert!(table.backends.iter().all(|b| b.weight_version.as_deref() == Some("step-1")), "{table:?}");
}

/// Opens a trainer update to `version` whose tensors come in buckets.
fn open_bucketed_update(m: &Arc<crate::ops::manager::Manager>, version: &str) -> UpdateId {
    open_update_with(m, version, crate::foundation::records::Bucket::default())
}

fn bucket(name: &str, last: bool) -> Option<crate::foundation::records::BroadcastStep> {
    let bucket = crate::foundation::records::Bucket {
        names: vec![name.into()],
        dtypes: vec!["bfloat16".into()],
        shapes: vec![vec![2]],
    };
    Some(crate::foundation::records::BroadcastStep { bucket: Some(bucket), last })
}

fn calls_to(engines: &FakeEngines, route: &str) -> usize {
    engines.calls().iter().filter(|c| c.ends_with(route)).count()
}

#[tokio::test]
async fn a_bucketed_trainer_update_receives_every_bucket_then_tells_the_version() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    scale_to(&m, 2).await;
    let id = open_bucketed_update(&m, "step-1");
    use crate::ops::trainer_update::start_broadcast;
    let refused = start_broadcast(&m, &id, None).await.expect_err("a bucketed update takes buckets");
    assert_eq!(refused.code(), "bucket_expected");
    start_broadcast(&m, &id, bucket("a", false)).await.expect("the first bucket");
    start_broadcast(&m, &id, bucket("b", false)).await.expect("the second, once the first was received");
    wait_for(&m, "the second bucket received", |i| {
        i.weights.updates()[id.as_str()].trainer().as_ref().is_some_and(|t| t.buckets_received == 2)
    })
    .await;
    assert_eq!(calls_to(&engines, "/update_weights_from_distributed"), 4, "two buckets, two members");
    assert_eq!(calls_to(&engines, "/update_weight_version"), 0, "no version before the last step");
    {
        let inner = m.fleet.lock();
        assert!(inner.engines.values().all(|e| e.status() == EngineStatus::WeightSyncing));
        assert_eq!(inner.weights.current().version, "default");
    }
    let end = crate::foundation::records::BroadcastStep { bucket: None, last: true };
    start_broadcast(&m, &id, Some(end)).await.expect("the end");
    wait_for(&m, "the update to end", |i| i.weights.updates()[id.as_str()].status().is_terminal()).await;
    let inner = m.fleet.lock();
    let u = &inner.weights.updates()[&id];
    assert_eq!(u.status(), rollout_core::weights::WeightUpdateStatus::Completed, "{u:?}");
    assert_eq!(inner.weights.current().version, "step-1");
    assert_eq!(calls_to(&engines, "/update_weight_version"), 2);
    assert_eq!(calls_to(&engines, "/flush_cache"), 2);
    assert!(m.fleet.routes().backends.iter().all(|b| b.weight_version.as_deref() == Some("step-1")));
    let t = u.trainer().clone().expect("a trainer part");
    assert_eq!((t.buckets_sent, t.buckets_received, t.last_sent), (2, 2, true));
}

#[tokio::test]
async fn a_trainer_that_gives_up_between_buckets_leaves_no_member_holding_part_of_a_version() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    scale_to(&m, 2).await;
    let id = open_bucketed_update(&m, "step-1");
    crate::ops::trainer_update::start_broadcast(&m, &id, bucket("a", false)).await.expect("the first bucket");
    let launched_before = calls_to(&engines, "launch engine_0") + calls_to(&engines, "launch engine_1");
    let continued_before = calls_to(&engines, "/continue_generation");
    let ended = crate::ops::trainer_update::abort(&m, &id, "out of memory").await.expect("aborted between buckets");
    assert_eq!(ended.status(), rollout_core::weights::WeightUpdateStatus::Failed);
    let why = ended.error_message().clone().unwrap_or_default();
    assert!(why.contains("aborted after 1 bucket(s): out of memory"), "{why}");
    // Both members loaded the first bucket: neither returns to routing as it is; both are
    // started again on the fleet's version.
    wait_for(&m, "both members restarted and ACTIVE", |i| {
        i.engines.values().filter(|e| e.status() == EngineStatus::Active).count() == 2
    })
    .await;
    let launched = calls_to(&engines, "launch engine_0") + calls_to(&engines, "launch engine_1");
    assert_eq!(launched, launched_before + 2, "{:?}", engines.calls());
    assert_eq!(m.fleet.lock().weights.current().version, "default");
    assert_eq!(calls_to(&engines, "/update_weight_version"), 0);
    assert_eq!(
        calls_to(&engines, "/continue_generation"),
        continued_before,
        "a member holding part of a version never generates again: {:?}",
        engines.calls()
    );
}

#[tokio::test]
async fn an_engine_started_during_a_trainer_update_waits_then_copies_the_new_version() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 3, &[]);
    scale_to(&m, 2).await;
    let first = open_trainer_update(&m, "step-1");
    finish_trainer_update(&m, &first).await;
    let second = open_trainer_update(&m, "step-2");
    // Started while step-2 is the target: no engine serves step-2 yet, so it waits out of routing.
    let op = scaling::scale_out(&m, scale_out_request(3)).expect("accepted").request_id;
    wait_for(&m, "the new engine to wait for the trainer", |i| {
        i.engines.get("engine_2").is_some_and(|e| e.awaiting_trainer())
    })
    .await;
    assert_eq!(m.fleet.routes().backends.len(), 2, "the waiting engine is not routable");
    assert!(copies(&engines).is_empty(), "nothing to copy step-2 from yet");
    finish_trainer_update(&m, &second).await;
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&op).is_some_and(|o| o.status().is_terminal())).await;
    assert_eq!(op_status(&m, &op), Some(ScaleOutStatus::Active));
    assert_eq!(copies(&engines).len(), 1, "restarted in place on a copy of step-2");
    let table = m.fleet.routes();
    assert_eq!(table.backends.len(), 3);
    assert!(table.backends.iter().all(|b| b.weight_version.as_deref() == Some("step-2")), "{table:?}");
    assert_eq!(m.fleet.lock().weights.current().version, "step-2");
}

/// A scale-out of two engines: one is READY (on step-1) while the other still starts, and a
/// trainer update to step-2 opens and completes meanwhile (the READY engine is no member: it
/// was not serving). The update commits without it, and the scale-out activates it only after
/// it copied step-2 from a peer: no engine ever serves step-1 after the commit. CI caught the
/// READY engine activated on step-1, which blocked the update's commit until it failed.
#[tokio::test]
async fn an_engine_ready_when_a_trainer_update_opens_catches_up_before_it_is_activated() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 4, &[]);
    scale_to(&m, 2).await;
    let first = open_trainer_update(&m, "step-1");
    finish_trainer_update(&m, &first).await;
    // One new engine's health check hangs; the other gets READY and waits for it.
    let (open, waiting) = engines.hold_next_probe();
    let op = scaling::scale_out(&m, scale_out_request(4)).expect("accepted").request_id;
    waiting.notified().await;
    wait_for(&m, "one new engine READY", |i| i.engines.values().any(|e| e.status() == EngineStatus::Ready)).await;
    let second = open_trainer_update(&m, "step-2");
    finish_trainer_update(&m, &second).await;
    {
        let inner = m.fleet.lock();
        let u = &inner.weights.updates()[&second];
        assert_eq!(u.status(), rollout_core::weights::WeightUpdateStatus::Completed, "{u:?}");
        assert_eq!(u.engines().len(), 2, "the READY engine was not serving, so no member");
    }
    open.send_replace(true);
    wait_for(&m, "the scale-out", |i| i.ops.scale_out(&op).is_some_and(|o| o.status().is_terminal())).await;
    assert_eq!(op_status(&m, &op), Some(ScaleOutStatus::Active));
    let table = m.fleet.routes();
    assert_eq!(table.backends.len(), 4);
    assert!(table.backends.iter().all(|b| b.weight_version.as_deref() == Some("step-2")), "{table:?}");
    assert!(copies(&engines).len() >= 2, "both new engines copied step-2: {:?}", copies(&engines));
}

#[tokio::test]
async fn a_trainer_update_no_member_received_leaves_them_serving_the_fleet_version() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 2, &[]);
    scale_to(&m, 2).await;
    let first = open_trainer_update(&m, "step-1");
    finish_trainer_update(&m, &first).await;
    let urls: Vec<String> = m.fleet.lock().engines.values().map(|e| e.record().url().clone()).collect();
    for url in &urls {
        engines.refuse_loads(url);
    }
    let second = open_trainer_update(&m, "step-2");
    finish_trainer_update(&m, &second).await;
    let inner = m.fleet.lock();
    let u = &inner.weights.updates()[&second];
    assert_eq!(u.status(), rollout_core::weights::WeightUpdateStatus::Failed, "{u:?}");
    assert_eq!(inner.weights.current().version, "step-1");
    // Not restarted: the only copies of step-1 are in these engines.
    for e in inner.engines.values() {
        assert_eq!((e.status(), e.record().restarts()), (EngineStatus::Active, 0), "{:?}", e.record());
        assert_eq!(e.record().weight_version().as_deref(), Some("step-1"));
    }
    assert_eq!(m.fleet.routes().backends.len(), 2);
}

/// A group whose world the trainer fixed (AReaL's layout): the first engines that fill it are
/// the members, updates naming it keep it, the engine beyond it copies each new version from a
/// member, and scale-in leaves the members alone.
#[tokio::test]
async fn a_group_the_trainer_fixed_keeps_its_members_and_the_rest_copy_from_them() {
    let engines = Arc::new(FakeEngines::default());
    let m = manager(&engines, 3, &[]);
    scale_to(&m, 3).await;
    let fixed = |world_size| crate::ops::trainer_group::BuildRequest {
        group_name: "areal".into(),
        master_address: "127.0.0.1".into(),
        master_port: 29500,
        world_size,
        backend: rollout_core::weights::GroupBackend::Nccl,
    };
    let too_big = crate::ops::trainer_group::build(&m, fixed(5)).expect_err("three engines hold three ranks");
    assert_eq!(too_big.code(), "group_does_not_fit");
    assert!(too_big.to_string().contains("world_size 4"), "{too_big}");
    let group = crate::ops::trainer_group::build(&m, fixed(3)).expect("built");
    let members: Vec<&str> = group.members.iter().map(|g| g.engine_id.as_str()).collect();
    assert_eq!(members, ["engine_0", "engine_1"]);
    use crate::foundation::records::FixedJoin;
    wait_for(&m, "the members to join", |i| {
        i.weights.group().as_ref().is_some_and(|g| g.fixed == Some(FixedJoin::Joined))
    })
    .await;
    assert_eq!(calls_to(&engines, "/init_weights_update_group"), 2);

    for version in ["step-1", "step-2"] {
        let one = crate::foundation::records::Bucket {
            names: vec!["w".into()],
            dtypes: vec!["bfloat16".into()],
            shapes: vec![vec![2]],
        };
        let req = crate::ops::trainer_update::OpenRequest {
            version: rollout_core::ids::VersionName::parse(version).expect("a valid version name"),
            tensors: one,
            pause_mode: "retract".into(),
            flush_cache: true,
            master_address: "127.0.0.1".into(),
            master_port: 29500,
            group_name: Some("areal".into()),
            group_prefix: "g".into(),
            backend: rollout_core::weights::GroupBackend::Nccl,
        };
        let opened = crate::ops::trainer_update::open(&m, req).expect("opened");
        let t = opened.trainer().clone().expect("a trainer part");
        assert!(!t.group.new && t.group.world_size == 3, "the fixed group is kept: {:?}", t.group);
        let id = opened.update_id().clone();
        finish_trainer_update(&m, &id).await;
        let u = m.fleet.lock().weights.updates()[&id].clone();
        assert_eq!(u.status(), rollout_core::weights::WeightUpdateStatus::Completed, "{u:?}");
        wait_for(&m, "every engine back in routing", |_| m.fleet.routes().backends.len() == 3).await;
        let table = m.fleet.routes();
        assert!(table.backends.iter().all(|b| b.weight_version.as_deref() == Some(version)), "{table:?}");
    }
    assert_eq!(calls_to(&engines, "/init_weights_update_group"), 2, "never rebuilt");
    assert_eq!(calls_to(&engines, "/update_weights_from_distributed"), 4, "members only, twice");
    let copied = copies(&engines);
    assert_eq!(copied.len(), 2, "engine_2 copied each version from a member: {copied:?}");
    assert!(copied.iter().all(|c| c.contains("engine_2")), "{copied:?}");

    // Scale-in: a member named by URL is refused; to one engine, only the one beyond the group goes.
    let member_url = m.fleet.lock().engines.get("engine_1").map(|e| e.url().to_string()).expect("engine_1");
    let by_url: ScaleInRequest =
        serde_json::from_value(serde_json::json!({ "engine_urls": [member_url] })).expect("valid");
    let refused = crate::ops::scale_in::scale_in(&m, by_url).expect_err("a member is held");
    assert_eq!(refused.code(), "trainer_group_member");
    let answer = crate::ops::scale_in::scale_in(&m, scale_in_request(1)).expect("accepted");
    let crate::ops::scale_in::ScaleInAnswer::Accepted(accepted) = answer else { panic!("not a dry run") };
    let op = accepted.request_id;
    wait_for(&m, "the scale-in to end", |i| i.ops.scale_in(&op).is_some_and(|r| r.status().is_terminal())).await;
    let inner = m.fleet.lock();
    assert!(inner.engines.get("engine_2").is_none_or(|e| e.status() == EngineStatus::Removed));
    assert_eq!(count(&inner, EngineStatus::Active), 2, "the members stay");
}
