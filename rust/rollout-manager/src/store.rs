//! Durable state in `--state-dir/fleet.redb`: every engine, every scale operation, and the
//! fleet's metadata, so a manager killed at any point restarts knowing what existed.
//!
//! redb was chosen over SQLite because the data is a handful of JSON records looked up by id,
//! with no queries: an embedded, pure-Rust, ACID key-value store fits exactly, needs no C
//! toolchain, and its copy-on-write commits survive `kill -9` at any instant (a commit is either
//! fully on disk or not at all).
//!
//! Writes are incremental: [`Store::sync`] compares each record's JSON with what was last
//! written and commits only the differences, in one transaction.

use crate::fleet::{EngineRecord, FleetInner, ScaleInRecord, ScaleOutRecord};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const ENGINES: TableDefinition<&str, &str> = TableDefinition::new("engines");
const SCALE_OUTS: TableDefinition<&str, &str> = TableDefinition::new("scale_outs");
const SCALE_INS: TableDefinition<&str, &str> = TableDefinition::new("scale_ins");
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
/// Ray mode: each engine's placement, with the agent bound to it.
const PLACEMENTS: TableDefinition<&str, &str> = TableDefinition::new("placements");
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
#[derive(Debug, Clone, Serialize, Deserialize)]
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

#[derive(Debug, Clone, Serialize, Deserialize)]
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
}

impl Snapshot {
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty() && self.scale_outs.is_empty() && self.scale_ins.is_empty() && self.placements.is_empty()
    }
}

pub struct Store {
    db: redb::Database,
    path: PathBuf,
    /// What was last committed, per table and key, to write only changes.
    written: Mutex<HashMap<(&'static str, String), String>>,
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
        Ok(Self { db, path, written: Mutex::new(HashMap::new()) })
    }

    fn err(&self, source: impl Into<redb::Error>) -> StoreError {
        StoreError::Db { path: self.path.clone(), source: source.into() }
    }

    /// Reads everything, and remembers it as written.
    pub fn load(&self) -> Result<Snapshot, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows =
            |name: &'static str, t: TableDefinition<&str, &str>| -> Result<Vec<(String, String)>, StoreError> {
                let table = txn.open_table(t).map_err(|e| self.err(e))?;
                let mut out = Vec::new();
                for row in table.iter().map_err(|e| self.err(e))? {
                    let (k, v) = row.map_err(|e| self.err(e))?;
                    let (k, v) = (k.value().to_string(), v.value().to_string());
                    written.insert((name, k.clone()), v.clone());
                    out.push((k, v));
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
        let engines = decode(&self.path, rows("engines", ENGINES)?)?;
        let scale_outs = decode(&self.path, rows("scale_outs", SCALE_OUTS)?)?;
        let scale_ins = decode(&self.path, rows("scale_ins", SCALE_INS)?)?;
        let placements = decode(&self.path, rows("placements", PLACEMENTS)?)?;
        let meta =
            decode::<Meta>(&self.path, rows("meta", META)?.into_iter().filter(|(k, _)| k == "fleet").collect())?.pop();
        Ok(Snapshot { engines, scale_outs, scale_ins, placements, meta })
    }

    /// Commits the registry's current contents, writing only what changed since the last sync.
    pub fn sync(&self, inner: &FleetInner) -> Result<(), StoreError> {
        let mut desired: HashMap<(&'static str, String), String> = HashMap::new();
        for e in inner.engines.values() {
            let stored = StoredEngine {
                seq: e.seq,
                record: e.record.clone(),
                pid_start_ticks: e.pid_start_ticks,
                keeper_socket: e.keeper_socket.clone(),
            };
            desired.insert(("engines", e.record.engine_id.clone()), to_json(&stored));
        }
        for r in inner.scale_outs.values() {
            desired.insert(("scale_outs", r.request_id.clone()), to_json(r));
        }
        for r in inner.scale_ins.values() {
            desired.insert(("scale_ins", r.request_id.clone()), to_json(r));
        }
        for p in inner.placements.values() {
            desired.insert(("placements", p.engine_id.clone()), to_json(p));
        }
        let meta = Meta {
            next_seq: inner.next_seq,
            weight_version: inner.weight_version.clone(),
            placement_revision: inner.placement_revision,
        };
        desired.insert(("meta", "fleet".to_string()), to_json(&meta));

        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        let upserts: Vec<_> = desired.iter().filter(|(k, v)| written.get(*k) != Some(*v)).collect();
        let deletes: Vec<_> = written.keys().filter(|k| !desired.contains_key(*k)).cloned().collect();
        if upserts.is_empty() && deletes.is_empty() {
            return Ok(());
        }
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        for (name, t) in TABLES {
            let mut table = txn.open_table(t).map_err(|e| self.err(e))?;
            for ((_, k), v) in upserts.iter().filter(|((tn, _), _)| *tn == name) {
                table.insert(k.as_str(), v.as_str()).map_err(|e| self.err(e))?;
            }
            for (_, k) in deletes.iter().filter(|(tn, _)| *tn == name) {
                table.remove(k.as_str()).map_err(|e| self.err(e))?;
            }
        }
        txn.commit().map_err(|e| self.err(e))?;
        for (k, v) in upserts {
            written.insert(k.clone(), v.clone());
        }
        for k in deletes {
            written.remove(&k);
        }
        Ok(())
    }
}
