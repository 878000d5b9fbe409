//! The local copy of a version on one receiver: written under `<dest>/<version>.partial/`,
//! renamed to `<dest>/<version>/` only after every file's size and SHA-256 match the manifest.
//!
//! Guarantees: a `<version>` directory this receiver publishes is complete and verified, and
//! holds a marker ([`MARKER`]: the manifest it was verified against); a failed, cancelled or
//! abandoned transfer leaves nothing behind (the partial directory is removed when the sink is
//! dropped unfinished). Versions are immutable by name: an existing `<version>` directory is
//! reused, without being rewritten, only when its marker equals the incoming manifest and its
//! files have the manifest's names and sizes; anything else (no marker, another manifest, a
//! file missing, added or of another size) is discarded and the version received again.
//!
//! One SHA-256 pass per byte. The version checksum follows from the per-file SHA-256s (the
//! SHA-256 of their `sha256sum` listing, [`crate::manifest::version_checksum`]), and
//! [`Manifest::validate`] checks that the manifest's checksum is the one its file hashes give;
//! so once every file's SHA-256 matches the manifest, the bytes here have the manifest's
//! version checksum without hashing them a second time. The checksum stays the version's
//! identity: the sender reports the manifest's, the manager compares it with the published
//! one, and the engines' loaders report the checksum of what they actually loaded, which the
//! manager checks against it.

use crate::manifest::{hex, Manifest, MARKER};
use crate::protocol::HopResult;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::mpsc;

/// Chunks queued between the network and the disk writer.
const WRITE_QUEUE: usize = 8;

/// Largest marker read back (a manifest of 10,000 files is about 1.5 MB).
const MAX_MARKER_BYTES: u64 = 16 << 20;

/// Versions being received right now, shared by every connection of one receiver (two
/// transfers of one version to one directory would write the same partial directory).
#[derive(Debug, Clone, Default)]
pub struct InProgress(Arc<Mutex<HashSet<String>>>);

impl InProgress {
    fn claim(&self, version: &str) -> bool {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).insert(version.to_string())
    }

    fn release(&self, version: &str) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).remove(version);
    }
}

/// Tracks which byte must come next, so chunks out of order, overlapping, past the end of a
/// file or missing are refused.
#[derive(Debug)]
pub struct Sequencer {
    sizes: Vec<u64>,
    file: usize,
    offset: u64,
}

impl Sequencer {
    pub fn new(manifest: &Manifest) -> Sequencer {
        Sequencer { sizes: manifest.files.iter().map(|f| f.size).collect(), file: 0, offset: 0 }
    }

    fn skip_complete(&mut self) {
        while self.file < self.sizes.len() && self.offset == self.sizes[self.file] {
            self.file += 1;
            self.offset = 0;
        }
    }

    /// Accepts the next chunk or says what was expected instead.
    pub fn accept(&mut self, file: u32, offset: u64, len: usize) -> Result<(), String> {
        self.skip_complete();
        let len = len as u64;
        if self.file >= self.sizes.len() {
            return Err(format!("chunk for file {file} at offset {offset} after the last byte of the version"));
        }
        if file as usize != self.file || offset != self.offset {
            return Err(format!(
                "chunk for file {file} at offset {offset}, expected file {} at offset {}",
                self.file, self.offset
            ));
        }
        if len == 0 || offset + len > self.sizes[self.file] {
            return Err(format!(
                "chunk of {len} bytes at offset {offset} does not fit file {file} of {} bytes",
                self.sizes[self.file]
            ));
        }
        self.offset += len;
        Ok(())
    }

    /// Whether every byte of every file arrived.
    pub fn complete(&mut self) -> bool {
        self.skip_complete();
        self.file == self.sizes.len()
    }
}

/// Where a version goes on this receiver.
pub fn final_dir(dest: &Path, version: &str) -> PathBuf {
    dest.join(version)
}

pub fn partial_dir(dest: &Path, version: &str) -> PathBuf {
    dest.join(format!("{version}.partial"))
}

/// The local copy being written (or skipped, when the version is already present).
pub struct Sink {
    version: String,
    dest: PathBuf,
    already_present: bool,
    in_progress: InProgress,
    tx: Option<mpsc::Sender<(u32, Bytes)>>,
    writer: Option<tokio::task::JoinHandle<Result<u64, String>>>,
    /// True once the partial directory was renamed (or never created).
    done: bool,
}

impl Sink {
    /// Starts the local copy. Errors name what is wrong (already being received, cannot create
    /// the directory).
    pub fn open(dest: &Path, manifest: &Manifest, in_progress: &InProgress) -> Result<Sink, String> {
        let version = manifest.version.clone();
        let present = |version: String| Sink {
            version,
            dest: dest.to_path_buf(),
            already_present: true,
            in_progress: in_progress.clone(),
            tx: None,
            writer: None,
            done: true,
        };
        let fin = final_dir(dest, &version);
        if verify_existing(&fin, manifest).is_ok() {
            return Ok(present(version));
        }
        let need = manifest.total_bytes();
        if let Ok(st) = nix::sys::statvfs::statvfs(dest) {
            let free = st.blocks_available().saturating_mul(st.fragment_size());
            if need > free {
                return Err(format!(
                    "not enough space in {}: version {version} needs {need} bytes, {free} are free",
                    dest.display()
                ));
            }
        }
        if !in_progress.claim(&version) {
            return Err(format!("version {version} is being received by another transfer on this receiver"));
        }
        // Every writer of `fin` holds the claim, so from here on it cannot change under us; a
        // transfer that finished between the check above and the claim published a verified
        // copy, which is reused, not removed.
        if fin.exists() {
            match verify_existing(&fin, manifest) {
                Ok(()) => {
                    in_progress.release(&version);
                    return Ok(present(version));
                }
                Err(why) => {
                    tracing::warn!(path = %fin.display(), reason = why, "discarding an unverified copy of the version");
                    let gone = if fin.is_dir() { std::fs::remove_dir_all(&fin) } else { std::fs::remove_file(&fin) };
                    if let Err(e) = gone {
                        in_progress.release(&version);
                        return Err(format!("cannot remove the unverified {}: {e}", fin.display()));
                    }
                }
            }
        }
        let partial = partial_dir(dest, &version);
        let _ = std::fs::remove_dir_all(&partial);
        if let Err(e) = std::fs::create_dir_all(&partial) {
            in_progress.release(&version);
            return Err(format!("cannot create {}: {e}", partial.display()));
        }
        let (tx, rx) = mpsc::channel(WRITE_QUEUE);
        let m = manifest.clone();
        let dir = partial.clone();
        let writer = tokio::task::spawn_blocking(move || write_files(&m, &dir, rx));
        Ok(Sink {
            version,
            dest: dest.to_path_buf(),
            already_present: false,
            in_progress: in_progress.clone(),
            tx: Some(tx),
            writer: Some(writer),
            done: false,
        })
    }

    pub fn already_present(&self) -> bool {
        self.already_present
    }

    /// Queues one chunk (in manifest order); false if the writer already stopped (its error
    /// comes out of [`Sink::finish`]).
    pub async fn write(&mut self, file: u32, data: Bytes) -> bool {
        match &self.tx {
            Some(tx) => tx.send((file, data)).await.is_ok(),
            None => true,
        }
    }

    /// Waits for the writer, verifies, and publishes the version. The result's `addr` is left
    /// empty for the upstream hop to fill in.
    pub async fn finish(mut self) -> HopResult {
        if self.already_present {
            return HopResult { addr: String::new(), ok: true, bytes: 0, already_present: true, error: None };
        }
        self.tx = None;
        let written = match self.writer.take() {
            Some(w) => w.await.unwrap_or_else(|e| Err(format!("writer task failed: {e}"))),
            None => Err("no writer".into()),
        };
        let outcome = written.and_then(|bytes| {
            let from = partial_dir(&self.dest, &self.version);
            let to = final_dir(&self.dest, &self.version);
            std::fs::rename(&from, &to)
                .map(|()| bytes)
                .map_err(|e| format!("cannot rename {} to {}: {e}", from.display(), to.display()))
        });
        match outcome {
            Ok(bytes) => {
                self.done = true;
                tracing::info!(version = self.version, bytes, "version received and verified");
                HopResult { addr: String::new(), ok: true, bytes, already_present: false, error: None }
            }
            Err(e) => {
                tracing::warn!(version = self.version, error = e, "version rejected");
                HopResult::failed("", e)
            }
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        if !self.already_present {
            if !self.done {
                // Unfinished (failed, abandoned or cancelled): nothing partial may stay visible.
                let _ = std::fs::remove_dir_all(partial_dir(&self.dest, &self.version));
            }
            self.in_progress.release(&self.version);
        }
    }
}

/// The writer thread: files in manifest order, each hashed as written (one SHA-256 pass: see
/// the module docs for why the version checksum is not recomputed), then the marker.
fn write_files(manifest: &Manifest, dir: &Path, mut rx: mpsc::Receiver<(u32, Bytes)>) -> Result<u64, String> {
    let total = write_and_hash(manifest, dir, &mut rx)?;
    let marker = dir.join(MARKER);
    let json = serde_json::to_vec(manifest).map_err(|e| format!("cannot encode the marker: {e}"))?;
    std::fs::write(&marker, json).map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    Ok(total)
}

fn write_and_hash(manifest: &Manifest, dir: &Path, rx: &mut mpsc::Receiver<(u32, Bytes)>) -> Result<u64, String> {
    let mut total = 0u64;
    for (i, entry) in manifest.files.iter().enumerate() {
        let path = dir.join(&entry.name);
        let file = std::fs::File::create(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let mut file_hash = Sha256::new();
        let mut written = 0u64;
        while written < entry.size {
            let Some((idx, data)) = rx.blocking_recv() else {
                return Err(format!("transfer ended after {written} of {} bytes of {}", entry.size, entry.name));
            };
            if idx as usize != i {
                return Err(format!("chunk for file {idx} while writing file {i}"));
            }
            out.write_all(&data).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            file_hash.update(&data);
            written += data.len() as u64;
        }
        out.flush().map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let got = hex(&file_hash.finalize());
        if got != entry.sha256 {
            return Err(format!("{} has SHA-256 {got}, the manifest says {}", entry.name, entry.sha256));
        }
        total += written;
    }
    if rx.blocking_recv().is_some() {
        return Err("data after the last byte of the version".into());
    }
    Ok(total)
}

/// Whether `dir` is a copy of `manifest` this receiver published: its marker holds the same
/// manifest, and its files are exactly the manifest's names (plus the marker) with the
/// manifest's sizes. Costs a `stat` per file, not a read: the bytes were hashed when they were
/// received. (A file rewritten in place with the same size is not detected here; the engines'
/// loaders report the checksum of what they load, and the manager checks it.)
pub fn verify_existing(dir: &Path, manifest: &Manifest) -> Result<(), String> {
    let marker = dir.join(MARKER);
    let meta = std::fs::metadata(&marker).map_err(|e| format!("no marker {}: {e}", marker.display()))?;
    if !meta.is_file() || meta.len() > MAX_MARKER_BYTES {
        return Err(format!("{} is not a marker file", marker.display()));
    }
    let text = std::fs::read(&marker).map_err(|e| format!("cannot read {}: {e}", marker.display()))?;
    let recorded: Manifest =
        serde_json::from_slice(&text).map_err(|e| format!("unreadable marker {}: {e}", marker.display()))?;
    if recorded.version != manifest.version
        || recorded.checksum != manifest.checksum
        || recorded.files != manifest.files
    {
        return Err(format!(
            "the copy was published from another manifest (checksum {}, incoming {})",
            recorded.checksum, manifest.checksum
        ));
    }
    let mut seen = 0usize;
    for e in std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))? {
        let e = e.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name == MARKER {
            continue;
        }
        let Ok(i) = manifest.files.binary_search_by(|f| f.name.as_str().cmp(&name)) else {
            return Err(format!("{name} is not part of the version"));
        };
        // No symlink following: the receiver writes regular files only.
        let m = std::fs::symlink_metadata(e.path()).map_err(|err| format!("cannot stat {name}: {err}"))?;
        if !m.is_file() || m.len() != manifest.files[i].size {
            return Err(format!("{name} is not a regular file of {} bytes", manifest.files[i].size));
        }
        seen += 1;
    }
    if seen != manifest.files.len() {
        return Err(format!(
            "{} of the version's {} files are missing",
            manifest.files.len() - seen,
            manifest.files.len()
        ));
    }
    Ok(())
}

/// Removes partial directories left by a crashed receiver (at startup, before serving).
pub fn remove_stale_partials(dest: &Path) {
    let Ok(entries) = std::fs::read_dir(dest) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().ends_with(".partial") {
            tracing::info!(path = %e.path().display(), "removing a partial version left by an earlier run");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::manifest::FileEntry;

    fn manifest(sizes: &[u64]) -> Manifest {
        Manifest {
            version: "v".into(),
            files: sizes
                .iter()
                .enumerate()
                .map(|(i, s)| FileEntry { name: format!("f{i}"), size: *s, sha256: "0".repeat(64) })
                .collect(),
            checksum: "0".repeat(64),
            skipped: vec![],
        }
    }

    #[test]
    fn sequencer_accepts_only_the_next_byte() {
        let mut s = Sequencer::new(&manifest(&[4, 0, 2]));
        assert!(s.accept(0, 0, 2).is_ok());
        assert!(s.accept(0, 0, 2).is_err(), "a repeated chunk");
        assert!(s.accept(0, 2, 3).is_err(), "past the end of the file");
        assert!(s.accept(0, 2, 2).is_ok());
        assert!(!s.complete());
        assert!(s.accept(1, 0, 1).is_err(), "an empty file takes no chunk");
        assert!(s.accept(2, 0, 2).is_ok());
        assert!(s.complete());
        assert!(s.accept(2, 2, 1).is_err());
    }
}
