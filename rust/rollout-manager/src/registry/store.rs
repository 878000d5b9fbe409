//! Durable state in `--state-dir/fleet.redb`: every engine, every scale operation, and the
//! fleet's metadata, so a manager killed at any point restarts knowing what existed.
//!
//! redb was chosen over SQLite because the data is a handful of JSON records looked up by id,
//! with no queries: an embedded, pure-Rust, ACID key-value store fits exactly, needs no C
//! toolchain, and its copy-on-write commits survive `kill -9` at any instant (a commit is either
//! fully on disk or not at all).
//!
//! Writes are incremental and happen outside the registry lock: under the lock, [`Store::stage`]
//! compares each record with a copy of what was last staged (field by field, no serialisation)
//! and adds only the differences, serialised, to the pending rows; after releasing the lock the
//! registry calls [`Store::commit_through`], which writes everything pending in one
//! transaction (changes staged meanwhile by other updates included: a group commit) unless an
//! earlier writer already did. Nobody waits for the disk while holding the registry lock. (Comparing JSON made every registry change serialise every engine and
//! every kept operation under the registry lock: O(fleet) work per change, O(fleet^2) to attach
//! a fleet; committing under the lock made every reader wait for an fsync.)

use crate::foundation::locks::Locked;
use crate::registry::engines::EngineRecord;
use crate::registry::operations::{ScaleInRecord, ScaleOutRecord};
use crate::registry::weights::WeightsState;
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use rollout_core::ids::EngineId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const ENGINES: TableDefinition<&str, &str> = TableDefinition::new("engines");
const SCALE_OUTS: TableDefinition<&str, &str> = TableDefinition::new("scale_outs");
const SCALE_INS: TableDefinition<&str, &str> = TableDefinition::new("scale_ins");
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
/// Ray mode: each engine's placement, with the agent bound to it.
const PLACEMENTS: TableDefinition<&str, &str> = TableDefinition::new("placements");
const ENGINES_AT: usize = 0;
const SCALE_OUTS_AT: usize = 1;
const SCALE_INS_AT: usize = 2;
const META_AT: usize = 3;
const PLACEMENTS_AT: usize = 4;
const TABLES: [(&str, TableDefinition<&str, &str>); 5] = [
    ("engines", ENGINES),
    ("scale_outs", SCALE_OUTS),
    ("scale_ins", SCALE_INS),
    ("meta", META),
    ("placements", PLACEMENTS),
];

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store {path}: {source}")]
    Db { path: PathBuf, source: redb::Error },
    #[error("state store {path}: record {key} is unreadable: {source}")]
    Decode { path: PathBuf, key: String, source: serde_json::Error },
}

/// An engine as persisted: its record plus what the registry needs to rebuild it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEngine {
    pub seq: u64,
    pub record: EngineRecord,
    /// Start time of its process in clock ticks since boot (`/proc/<pid>/stat` field 22), so a
    /// restarted manager can tell the recorded process from a later one with the same pid.
    pub pid_start_ticks: Option<u64>,
    /// Socket of the engine's keeper (`--reattach-grace-secs`), to re-adopt it.
    #[serde(default)]
    pub keeper_socket: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub next_seq: u64,
    pub weight_version: String,
    #[serde(default)]
    pub placement_revision: u64,
}

/// Everything the store held at startup.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub engines: Vec<StoredEngine>,
    pub scale_outs: Vec<ScaleOutRecord>,
    pub scale_ins: Vec<ScaleInRecord>,
    pub placements: Vec<rollout_core::Placement>,
    pub meta: Option<Meta>,
    /// Published versions and updates (`meta` key `weights`).
    pub weights: Option<WeightsState>,
}

impl Snapshot {
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty() && self.scale_outs.is_empty() && self.scale_ins.is_empty() && self.placements.is_empty()
    }
}

pub struct Store {
    db: redb::Database,
    path: PathBuf,
    /// What was last staged, to write only changes.
    written: Mutex<Written>,
    /// Staged rows not yet committed (a failed commit puts them back), and the sequence number
    /// of the last change staged.
    pending: Mutex<(Batch, u64)>,
    /// Held by the one writer at a time: the sequence number of the last change on disk.
    durable: Mutex<u64>,
}

/// A copy of every record as last committed, by table and key.
#[derive(Default)]
struct Written {
    engines: HashMap<String, StoredEngine>,
    scale_outs: HashMap<String, ScaleOutRecord>,
    scale_ins: HashMap<String, ScaleInRecord>,
    placements: HashMap<String, rollout_core::Placement>,
    meta: Option<Meta>,
    weights: Option<WeightsState>,
}

/// The keys of `written` that `current` no longer has.
fn gone<K: std::borrow::Borrow<str> + Ord, V, W>(
    written: &HashMap<String, V>,
    current: &BTreeMap<K, W>,
) -> Vec<String> {
    written.keys().filter(|k| !current.contains_key(k.as_str())).cloned().collect()
}

fn to_json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let path = dir.join("fleet.redb");
        let db_err = |source: redb::Error| StoreError::Db { path: path.clone(), source };
        let db = redb::Database::create(&path).map_err(|e| db_err(e.into()))?;
        // Create the tables so reads of a fresh store find them.
        let txn = db.begin_write().map_err(|e| db_err(e.into()))?;
        for (_, t) in TABLES {
            txn.open_table(t).map_err(|e| db_err(e.into()))?;
        }
        txn.commit().map_err(|e| db_err(e.into()))?;
        Ok(Self {
            db,
            path,
            written: Mutex::new(Written::default()),
            pending: Mutex::new((Batch::default(), 0)),
            durable: Mutex::new(0),
        })
    }

    fn err(&self, source: impl Into<redb::Error>) -> StoreError {
        StoreError::Db { path: self.path.clone(), source: source.into() }
    }

    /// Reads everything, and remembers it as written.
    pub fn load(&self) -> Result<Snapshot, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let rows = |t: TableDefinition<&str, &str>| -> Result<Vec<(String, String)>, StoreError> {
            let table = txn.open_table(t).map_err(|e| self.err(e))?;
            let mut out = Vec::new();
            for row in table.iter().map_err(|e| self.err(e))? {
                let (k, v) = row.map_err(|e| self.err(e))?;
                out.push((k.value().to_string(), v.value().to_string()));
            }
            Ok(out)
        };
        fn decode<T: serde::de::DeserializeOwned>(
            path: &Path,
            rows: Vec<(String, String)>,
        ) -> Result<Vec<T>, StoreError> {
            rows.into_iter()
                .map(|(k, v)| {
                    serde_json::from_str(&v).map_err(|source| StoreError::Decode {
                        path: path.to_path_buf(),
                        key: k,
                        source,
                    })
                })
                .collect()
        }
        let engines: Vec<StoredEngine> = decode(&self.path, rows(ENGINES)?)?;
        let scale_outs: Vec<ScaleOutRecord> = decode(&self.path, rows(SCALE_OUTS)?)?;
        let scale_ins: Vec<ScaleInRecord> = decode(&self.path, rows(SCALE_INS)?)?;
        let placements: Vec<rollout_core::Placement> = decode(&self.path, rows(PLACEMENTS)?)?;
        let meta_rows = rows(META)?;
        let pick = |key: &str| meta_rows.iter().filter(|(k, _)| k == key).cloned().collect::<Vec<_>>();
        let meta = decode::<Meta>(&self.path, pick("fleet"))?.pop();
        let weights = decode::<WeightsState>(&self.path, pick("weights"))?.pop();
        // Remember it as written. (A record stored under another key than its id is rewritten
        // under its id by the next sync, and the stray key stays: harmless, never read.)
        let mut written = self.written.locked();
        written.engines = engines.iter().map(|e| (e.record.engine_id().to_string(), e.clone())).collect();
        written.scale_outs = scale_outs.iter().map(|r| (r.request_id().to_string(), r.clone())).collect();
        written.scale_ins = scale_ins.iter().map(|r| (r.request_id().to_string(), r.clone())).collect();
        written.placements = placements.iter().map(|p| (p.engine_id.to_string(), p.clone())).collect();
        written.meta = meta.clone();
        written.weights = weights.clone();
        Ok(Snapshot { engines, scale_outs, scale_ins, placements, meta, weights })
    }

    /// Compares the registry's contents with what was last staged and adds the changed rows,
    /// serialised, to the pending ones; returns the change's sequence number, or None when
    /// nothing changed. Cheap (field comparisons, and only the changed records serialised): the
    /// registry calls it under its lock, then [`Store::commit_through`] after releasing it.
    pub fn stage<E: EngineRow>(&self, now: Current<'_, E>) -> Option<u64> {
        let mut written = self.written.locked();
        let mut batch = Batch::default();
        for (id, e) in now.engines {
            if written.engines.get(id.as_str()).is_none_or(|w| !e.same_as(w)) {
                let stored = e.to_stored();
                batch.rows[ENGINES_AT].insert(id.to_string(), Some(to_json(&stored)));
                written.engines.insert(id.to_string(), stored);
            }
        }
        for r in now.scale_outs.values() {
            if written.scale_outs.get(r.request_id().as_str()) != Some(r) {
                batch.rows[SCALE_OUTS_AT].insert(r.request_id().to_string(), Some(to_json(r)));
                written.scale_outs.insert(r.request_id().to_string(), r.clone());
            }
        }
        for r in now.scale_ins.values() {
            if written.scale_ins.get(r.request_id().as_str()) != Some(r) {
                batch.rows[SCALE_INS_AT].insert(r.request_id().to_string(), Some(to_json(r)));
                written.scale_ins.insert(r.request_id().to_string(), r.clone());
            }
        }
        for p in now.placements.values() {
            if written.placements.get(p.engine_id.as_str()) != Some(p) {
                batch.rows[PLACEMENTS_AT].insert(p.engine_id.to_string(), Some(to_json(p)));
                written.placements.insert(p.engine_id.to_string(), p.clone());
            }
        }
        if written.meta.as_ref() != Some(&now.meta) {
            batch.rows[META_AT].insert("fleet".into(), Some(to_json(&now.meta)));
            written.meta = Some(now.meta);
        }
        if written.weights.as_ref() != Some(now.weights) {
            batch.rows[META_AT].insert("weights".into(), Some(to_json(now.weights)));
            written.weights = Some(now.weights.clone());
        }
        for k in gone(&written.engines, now.engines) {
            written.engines.remove(&k);
            batch.rows[ENGINES_AT].insert(k, None);
        }
        for k in gone(&written.scale_outs, now.scale_outs) {
            written.scale_outs.remove(&k);
            batch.rows[SCALE_OUTS_AT].insert(k, None);
        }
        for k in gone(&written.scale_ins, now.scale_ins) {
            written.scale_ins.remove(&k);
            batch.rows[SCALE_INS_AT].insert(k, None);
        }
        for k in gone(&written.placements, now.placements) {
            written.placements.remove(&k);
            batch.rows[PLACEMENTS_AT].insert(k, None);
        }
        if batch.is_empty() {
            return None;
        }
        let mut pending = self.pending.locked();
        pending.0.merge(batch);
        pending.1 += 1;
        Some(pending.1)
    }

    /// Makes every change staged up to `seq` durable: writes all the pending rows in one
    /// transaction, unless a writer before us already wrote them. A failed write puts its rows
    /// back under any staged since, so the next commit writes them (a registry change is never
    /// lost to one failed write while the manager runs).
    pub fn commit_through(&self, seq: u64) -> Result<(), StoreError> {
        let mut durable = self.durable.locked();
        if *durable >= seq {
            return Ok(());
        }
        let (batch, upto) = {
            let mut pending = self.pending.locked();
            (std::mem::take(&mut pending.0), pending.1)
        };
        match self.write(&batch) {
            Ok(()) => {
                *durable = upto;
                Ok(())
            }
            Err(e) => {
                let mut pending = self.pending.locked();
                let newer = std::mem::replace(&mut pending.0, batch);
                pending.0.merge(newer);
                Err(e)
            }
        }
    }

    fn write(&self, batch: &Batch) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        // One table open at a time (redb refuses a second handle on an open table).
        for ((_, t), rows) in TABLES.iter().zip(&batch.rows) {
            if rows.is_empty() {
                continue;
            }
            let mut table = txn.open_table(*t).map_err(|e| self.err(e))?;
            for (k, v) in rows {
                match v {
                    Some(v) => table.insert(k.as_str(), v.as_str()).map(drop),
                    None => table.remove(k.as_str()).map(drop),
                }
                .map_err(|e| self.err(e))?;
            }
        }
        txn.commit().map_err(|e| self.err(e))
    }
}

/// An engine as the registry holds it, as the store sees it.
pub trait EngineRow {
    /// Whether `written` is this engine's current durable state.
    fn same_as(&self, written: &StoredEngine) -> bool;
    fn to_stored(&self) -> StoredEngine;
}

/// The registry's durable contents, by id, as [`Store::stage`] reads them.
pub struct Current<'a, E> {
    pub engines: &'a BTreeMap<EngineId, E>,
    pub scale_outs: &'a BTreeMap<rollout_core::ids::OpId, ScaleOutRecord>,
    pub scale_ins: &'a BTreeMap<rollout_core::ids::OpId, ScaleInRecord>,
    pub placements: &'a BTreeMap<EngineId, rollout_core::Placement>,
    pub meta: Meta,
    pub weights: &'a WeightsState,
}

/// Changed rows by table (in `TABLES` order): `Some(json)` writes the row, `None` deletes it.
#[derive(Debug, Default)]
pub struct Batch {
    rows: [BTreeMap<String, Option<String>>; 5],
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.rows.iter().all(BTreeMap::is_empty)
    }

    /// Adds `later` on top: its rows replace this batch's rows of the same key.
    fn merge(&mut self, later: Batch) {
        for (mine, theirs) in self.rows.iter_mut().zip(later.rows) {
            mine.extend(theirs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl EngineRow for StoredEngine {
        fn same_as(&self, written: &StoredEngine) -> bool {
            self == written
        }
        fn to_stored(&self) -> StoredEngine {
            self.clone()
        }
    }

    fn engine(id: &str, restarts: u32) -> StoredEngine {
        let record = serde_json::json!({
            "engine_id": id, "url": "http://127.0.0.1:1", "status": "ACTIVE", "is_healthy": true,
            "origin": "initial", "model_name": "m", "weight_version": "v0", "gpu_ids": [0], "pid": null,
            "started_at": 1.0, "updated_at": 1.0, "log_path": null, "in_flight": 0, "last_error": null,
            "created_by": null, "restarts": restarts,
        });
        StoredEngine {
            seq: 0,
            record: serde_json::from_value(record).unwrap(),
            pid_start_ticks: None,
            keeper_socket: None,
        }
    }

    fn stage_and_commit(store: &Store, engines: &BTreeMap<EngineId, StoredEngine>, weights: &WeightsState) -> bool {
        let meta = Meta { next_seq: 3, weight_version: weights.current().version.clone(), placement_revision: 0 };
        let none = BTreeMap::new();
        let (outs, ins) = (BTreeMap::new(), BTreeMap::new());
        let staged =
            store.stage(Current { engines, scale_outs: &outs, scale_ins: &ins, placements: &none, meta, weights });
        if let Some(seq) = staged {
            store.commit_through(seq).unwrap();
        }
        staged.is_some()
    }

    #[test]
    fn one_commit_writes_every_change_staged_before_it() {
        let dir = std::env::temp_dir().join(format!("rollout-store-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let weights = WeightsState::new("v0");
        let meta = || Meta { next_seq: 1, weight_version: "v0".into(), placement_revision: 0 };
        let (outs, ins, none) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        {
            let store = Store::open(&dir).unwrap();
            let one: BTreeMap<EngineId, StoredEngine> = [(EngineId::parse("e1").unwrap(), engine("e1", 0))].into();
            let mut two = one.clone();
            two.insert(EngineId::parse("e2").unwrap(), engine("e2", 0));
            let stage = |engines: &BTreeMap<EngineId, StoredEngine>| {
                let current = Current {
                    engines,
                    scale_outs: &outs,
                    scale_ins: &ins,
                    placements: &none,
                    meta: meta(),
                    weights: &weights,
                };
                store.stage(current).unwrap()
            };
            let first = stage(&one);
            let second = stage(&two);
            assert!(second > first);
            // The later update commits first (it got to the disk first): both changes go.
            store.commit_through(second).unwrap();
            // The earlier one then finds its change durable already.
            store.commit_through(first).unwrap();
        }
        let snapshot = Store::open(&dir).unwrap().load().unwrap();
        let ids: Vec<_> = snapshot.engines.iter().map(|e| e.record.engine_id().clone()).collect();
        assert_eq!(ids, ["e1", "e2"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_changes_are_staged_and_every_commit_reaches_the_disk() {
        let dir = std::env::temp_dir().join(format!("rollout-store-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let weights = WeightsState::new("v0");
        let mut engines: BTreeMap<EngineId, StoredEngine> =
            ["e1", "e2"].iter().map(|id| (EngineId::parse(id).unwrap(), engine(id, 0))).collect();
        {
            let store = Store::open(&dir).unwrap();
            assert!(stage_and_commit(&store, &engines, &weights), "a fresh store stages everything");
            assert!(!stage_and_commit(&store, &engines, &weights), "no change, nothing staged");
            engines.remove("e1");
            engines.insert(EngineId::parse("e2").unwrap(), engine("e2", 1));
            assert!(stage_and_commit(&store, &engines, &weights), "a delete and a change are staged");
        }
        let store = Store::open(&dir).unwrap();
        let snapshot = store.load().unwrap();
        assert_eq!(snapshot.engines, vec![engine("e2", 1)]);
        assert_eq!(snapshot.meta.map(|m| m.weight_version), Some("v0".to_string()));
        assert_eq!(snapshot.weights, Some(weights.clone()));
        // What was loaded counts as written: staging the same contents writes nothing.
        assert!(!stage_and_commit(&store, &engines, &weights));
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_later_row_replaces_an_earlier_one_when_batches_merge() {
        let mut first = Batch::default();
        first.rows[ENGINES_AT].insert("e1".into(), Some("old".into()));
        first.rows[ENGINES_AT].insert("e2".into(), Some("kept".into()));
        let mut later = Batch::default();
        later.rows[ENGINES_AT].insert("e1".into(), None);
        first.merge(later);
        let rows: Vec<_> = first.rows[ENGINES_AT].iter().map(|(k, v)| (k.as_str(), v.as_deref())).collect();
        assert_eq!(rows, vec![("e1", None), ("e2", Some("kept"))]);
    }

    #[test]
    fn timestamps_come_back_from_the_store_bit_for_bit() {
        // Records carry unix times as f64; a restarted manager compares them (e.g. an engine's
        // update started_at) with what it served before, so the JSON must round-trip exactly.
        let mut t = 1_795_425_860.548_680_3_f64;
        for _ in 0..10_000 {
            let back: f64 = serde_json::from_str(&to_json(&t)).unwrap();
            assert_eq!(back.to_bits(), t.to_bits(), "{t} came back as {back}");
            t = f64::from_bits(t.to_bits() + 7_919);
        }
    }
}
