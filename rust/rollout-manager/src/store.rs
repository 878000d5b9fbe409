//! Durable state in `--state-dir/fleet.redb`: every engine, every scale operation, and the
//! fleet's metadata, so a manager killed at any point restarts knowing what existed.
//!
//! redb was chosen over SQLite because the data is a handful of JSON records looked up by id,
//! with no queries: an embedded, pure-Rust, ACID key-value store fits exactly, needs no C
//! toolchain, and its copy-on-write commits survive `kill -9` at any instant (a commit is either
//! fully on disk or not at all).
//!
//! Writes are incremental: [`Store::sync`] compares each record with a copy of what was last
//! written (field by field, no serialisation) and serialises and commits only the differences,
//! in one transaction. (Comparing JSON made every registry change serialise every engine and
//! every kept operation under the registry lock: O(fleet) work per change, O(fleet^2) to attach
//! a fleet.)

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
/// Every table maps an id to a JSON record.
type Table = TableDefinition<'static, &'static str, &'static str>;
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
    pub weights: Option<crate::weights::WeightsState>,
}

impl Snapshot {
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty() && self.scale_outs.is_empty() && self.scale_ins.is_empty() && self.placements.is_empty()
    }
}

pub struct Store {
    db: redb::Database,
    path: PathBuf,
    /// What was last committed, to write only changes.
    written: Mutex<Written>,
}

/// A copy of every record as last committed, by table and key.
#[derive(Default)]
struct Written {
    engines: HashMap<String, StoredEngine>,
    scale_outs: HashMap<String, ScaleOutRecord>,
    scale_ins: HashMap<String, ScaleInRecord>,
    placements: HashMap<String, rollout_core::Placement>,
    meta: Option<Meta>,
    weights: Option<crate::weights::WeightsState>,
}

/// The keys of `written` that `current` no longer has.
fn gone<V, W>(written: &HashMap<String, V>, current: &std::collections::BTreeMap<String, W>) -> Vec<String> {
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
        Ok(Self { db, path, written: Mutex::new(Written::default()) })
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
        let weights = decode::<crate::weights::WeightsState>(&self.path, pick("weights"))?.pop();
        // Remember it as written. (A record stored under another key than its id is rewritten
        // under its id by the next sync, and the stray key stays: harmless, never read.)
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        written.engines = engines.iter().map(|e| (e.record.engine_id.clone(), e.clone())).collect();
        written.scale_outs = scale_outs.iter().map(|r| (r.request_id.clone(), r.clone())).collect();
        written.scale_ins = scale_ins.iter().map(|r| (r.request_id.clone(), r.clone())).collect();
        written.placements = placements.iter().map(|p| (p.engine_id.clone(), p.clone())).collect();
        written.meta = meta.clone();
        written.weights = weights.clone();
        Ok(Snapshot { engines, scale_outs, scale_ins, placements, meta, weights })
    }

    /// Commits the registry's current contents, writing only what changed since the last sync.
    pub fn sync(&self, inner: &FleetInner) -> Result<(), StoreError> {
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        let engines: Vec<StoredEngine> = inner
            .engines
            .values()
            .filter(|e| {
                written.engines.get(e.record.engine_id.as_str()).is_none_or(|w| {
                    w.seq != e.seq
                        || w.pid_start_ticks != e.pid_start_ticks
                        || w.keeper_socket != e.keeper_socket
                        || w.record != e.record
                })
            })
            .map(|e| StoredEngine {
                seq: e.seq,
                record: e.record.clone(),
                pid_start_ticks: e.pid_start_ticks,
                keeper_socket: e.keeper_socket.clone(),
            })
            .collect();
        let scale_outs: Vec<&ScaleOutRecord> =
            inner.scale_outs.values().filter(|r| written.scale_outs.get(r.request_id.as_str()) != Some(*r)).collect();
        let scale_ins: Vec<&ScaleInRecord> =
            inner.scale_ins.values().filter(|r| written.scale_ins.get(r.request_id.as_str()) != Some(*r)).collect();
        let placements: Vec<&rollout_core::Placement> =
            inner.placements.values().filter(|p| written.placements.get(p.engine_id.as_str()) != Some(*p)).collect();
        let meta = Meta {
            next_seq: inner.next_seq,
            weight_version: inner.weight_version.clone(),
            placement_revision: inner.placement_revision,
        };
        let meta_changed = written.meta.as_ref() != Some(&meta);
        let weights_changed = written.weights.as_ref() != Some(&inner.weights);
        let deletes = [
            ("engines", gone(&written.engines, &inner.engines)),
            ("scale_outs", gone(&written.scale_outs, &inner.scale_outs)),
            ("scale_ins", gone(&written.scale_ins, &inner.scale_ins)),
            ("placements", gone(&written.placements, &inner.placements)),
        ];
        let nothing_deleted = deletes.iter().all(|(_, keys)| keys.is_empty());
        if engines.is_empty()
            && scale_outs.is_empty()
            && scale_ins.is_empty()
            && placements.is_empty()
            && !meta_changed
            && !weights_changed
            && nothing_deleted
        {
            return Ok(());
        }
        let txn = self.db.begin_write().map_err(|e| self.err(e))?;
        // One table open at a time (redb refuses a second handle on an open table).
        let upserts: [(Table, Vec<(&str, String)>); 5] = [
            (ENGINES, engines.iter().map(|e| (e.record.engine_id.as_str(), to_json(e))).collect()),
            (SCALE_OUTS, scale_outs.iter().map(|r| (r.request_id.as_str(), to_json(r))).collect()),
            (SCALE_INS, scale_ins.iter().map(|r| (r.request_id.as_str(), to_json(r))).collect()),
            (PLACEMENTS, placements.iter().map(|p| (p.engine_id.as_str(), to_json(p))).collect()),
            (
                META,
                [
                    meta_changed.then(|| ("fleet", to_json(&meta))),
                    weights_changed.then(|| ("weights", to_json(&inner.weights))),
                ]
                .into_iter()
                .flatten()
                .collect(),
            ),
        ];
        for (t, rows) in &upserts {
            if rows.is_empty() {
                continue;
            }
            let mut table = txn.open_table(*t).map_err(|e| self.err(e))?;
            for (k, v) in rows {
                table.insert(*k, v.as_str()).map_err(|e| self.err(e))?;
            }
        }
        for (name, keys) in &deletes {
            let Some((_, t)) = TABLES.iter().find(|(n, _)| n == name) else { continue };
            if keys.is_empty() {
                continue;
            }
            let mut table = txn.open_table(*t).map_err(|e| self.err(e))?;
            for k in keys {
                table.remove(k.as_str()).map_err(|e| self.err(e))?;
            }
        }
        drop(upserts);
        txn.commit().map_err(|e| self.err(e))?;
        for e in engines {
            written.engines.insert(e.record.engine_id.clone(), e);
        }
        for r in scale_outs {
            written.scale_outs.insert(r.request_id.clone(), r.clone());
        }
        for r in scale_ins {
            written.scale_ins.insert(r.request_id.clone(), r.clone());
        }
        for p in placements {
            written.placements.insert(p.engine_id.clone(), p.clone());
        }
        if meta_changed {
            written.meta = Some(meta);
        }
        if weights_changed {
            written.weights = Some(inner.weights.clone());
        }
        let [(_, e), (_, o), (_, i), (_, p)] = deletes;
        for k in e {
            written.engines.remove(&k);
        }
        for k in o {
            written.scale_outs.remove(&k);
        }
        for k in i {
            written.scale_ins.remove(&k);
        }
        for k in p {
            written.placements.remove(&k);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
