//! Reading a published checkpoint, in two steps so a publish can answer before the slow one:
//! [`inspect`] lists every `*.safetensors` file of a directory and checks each header (header
//! length, JSON header, tensors within the file) without reading the tensors; [`hash`] then
//! hashes the files, several at once, with the rule shared with `sglang-sim` and the relay
//! ([`rollout_core::weights::checkpoint_checksum`]). Blocking IO: call from `spawn_blocking`.
//!
//! Errors name the file and what is wrong, so a publish can be answered 400 with a fix, or an
//! update end FAILED with a reason.

use crate::foundation::locks::Locked;
use rollout_core::weights::{checkpoint_checksum, safetensors_header, safetensors_header_len, FileHash};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// At most this many files are hashed at once (storage rarely reads faster with more).
const MAX_HASH_THREADS: usize = 8;
/// Read size while hashing.
const CHUNK: usize = 4 << 20;

/// What a checkpoint directory holds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckpointInfo {
    pub checksum: String,
    pub files: Vec<String>,
    pub total_bytes: u64,
    pub num_tensors: usize,
}

/// A checkpoint whose headers were checked: its files in name order, not yet hashed.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// `(file name, path, size in bytes)`, sorted by name (byte-wise).
    pub files: Vec<(String, PathBuf, u64)>,
    pub total_bytes: u64,
    pub num_tensors: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("path {0} does not exist")]
    NotFound(String),
    #[error("path {0} is not a directory; publish the directory that holds the *.safetensors files")]
    NotADirectory(String),
    #[error("directory {0} holds no *.safetensors files")]
    Empty(String),
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path} is not a valid safetensors file: {reason}")]
    Invalid { path: String, reason: String },
    #[error("{path} changed while it was hashed ({expected} bytes when the publish was checked, {found} read); write the checkpoint completely before publishing it")]
    Changed { path: String, expected: u64, found: u64 },
    #[error("hashing was stopped (the manager is shutting down)")]
    Stopped,
}

/// The `*.safetensors` files of `dir`, sorted by file name (byte-wise).
fn files(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let shown = dir.display().to_string();
    if !dir.exists() {
        return Err(CheckpointError::NotFound(shown));
    }
    if !dir.is_dir() {
        return Err(CheckpointError::NotADirectory(shown));
    }
    let io = |source| CheckpointError::Io { path: shown.clone(), source };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let p = entry.map_err(io)?.path();
        if p.is_file() && p.extension().is_some_and(|e| e == "safetensors") {
            out.push(p);
        }
    }
    out.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    if out.is_empty() {
        return Err(CheckpointError::Empty(shown));
    }
    Ok(out)
}

/// Lists a checkpoint directory and checks every file's header; reads only the headers.
pub fn inspect(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let mut out = Checkpoint { files: Vec::new(), total_bytes: 0, num_tensors: 0 };
    for file in files(dir)? {
        let shown = file.display().to_string();
        let io = |source| CheckpointError::Io { path: shown.clone(), source };
        let invalid = |reason: String| CheckpointError::Invalid { path: shown.clone(), reason };
        let mut f = std::fs::File::open(&file).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        let mut prefix = [0u8; 8];
        if len >= 8 {
            f.read_exact(&mut prefix).map_err(io)?;
        }
        let header_len = safetensors_header_len(prefix, len).map_err(invalid)?;
        let mut header = vec![0u8; usize::try_from(header_len).map_err(|_| invalid("header too large".into()))?];
        f.read_exact(&mut header).map_err(io)?;
        out.num_tensors += safetensors_header(&header, len - 8 - header_len).map_err(invalid)?;
        out.total_bytes += len;
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        out.files.push((name, file, len));
    }
    Ok(out)
}

/// One file's SHA-256; adds what it reads to `progress`. The file must still have the size
/// [`inspect`] saw. Stops early when either flag is set.
fn hash_file(path: &Path, len: u64, progress: &AtomicU64, stop: [&AtomicBool; 2]) -> Result<String, CheckpointError> {
    let shown = path.display().to_string();
    let io = |source| CheckpointError::Io { path: shown.clone(), source };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut sum = FileHash::default();
    let mut buf = vec![0u8; CHUNK];
    let mut read = 0u64;
    loop {
        if stop.iter().any(|s| s.load(Ordering::Relaxed)) {
            return Err(CheckpointError::Stopped);
        }
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        sum.update(&buf[..n]);
        read += n as u64;
        progress.fetch_add(n as u64, Ordering::Relaxed);
    }
    if read != len {
        return Err(CheckpointError::Changed { path: shown, expected: len, found: read });
    }
    Ok(sum.finish())
}

/// Hashes the checkpoint's files, up to `MAX_HASH_THREADS` (and the machine's cores) at once,
/// largest first; returns its checksum. `progress` counts the bytes read; setting `stop` ends the
/// hashing early with [`CheckpointError::Stopped`]. The first error stops the other threads.
pub fn hash(ckpt: &Checkpoint, progress: &AtomicU64, stop: &AtomicBool) -> Result<String, CheckpointError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.clamp(1, MAX_HASH_THREADS).min(ckpt.files.len()).max(1);
    // Largest first, so one big file does not start last and leave the other threads idle.
    let mut order: Vec<usize> = (0..ckpt.files.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(ckpt.files[i].2));
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let digests: Mutex<Vec<Option<String>>> = Mutex::new(vec![None; ckpt.files.len()]);
    let first_error: Mutex<Option<CheckpointError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&i) = order.get(k) else { return };
                let (_, path, len) = &ckpt.files[i];
                match hash_file(path, *len, progress, [stop, &failed]) {
                    Ok(digest) => {
                        digests.locked()[i] = Some(digest);
                    }
                    Err(e) => {
                        failed.store(true, Ordering::Relaxed);
                        let mut slot = first_error.locked();
                        // A Stopped error caused by another thread's failure is not the cause.
                        if slot.is_none() || matches!(slot.as_ref(), Some(CheckpointError::Stopped)) {
                            *slot = Some(e);
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
        return Err(e);
    }
    if stop.load(Ordering::Relaxed) {
        return Err(CheckpointError::Stopped);
    }
    let digests = digests.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut listed = Vec::with_capacity(digests.len());
    for ((name, _, _), digest) in ckpt.files.iter().zip(&digests) {
        listed.push((name.as_str(), digest.as_deref().ok_or(CheckpointError::Stopped)?));
    }
    Ok(checkpoint_checksum(listed))
}

/// Validates and checksums a checkpoint directory in one call.
pub fn read(dir: &Path) -> Result<CheckpointInfo, CheckpointError> {
    let ckpt = inspect(dir)?;
    let checksum = hash(&ckpt, &AtomicU64::new(0), &AtomicBool::new(false))?;
    Ok(CheckpointInfo {
        checksum,
        files: ckpt.files.iter().map(|(name, _, _)| name.clone()).collect(),
        total_bytes: ckpt.total_bytes,
        num_tensors: ckpt.num_tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rollout-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn safetensors(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn checksum_covers_every_file_in_name_order() {
        let d = tmpdir("ok");
        let a = safetensors(r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &[1; 8]);
        let b = safetensors(r#"{"v":{"dtype":"BF16","shape":[],"data_offsets":[0,2]}}"#, &[2; 2]);
        std::fs::write(d.join("b.safetensors"), &b).unwrap();
        std::fs::write(d.join("a.safetensors"), &a).unwrap();
        std::fs::write(d.join("config.json"), "{}").unwrap();
        let info = read(&d).unwrap();
        assert_eq!(info.files, vec!["a.safetensors", "b.safetensors"]);
        assert_eq!(info.num_tensors, 2);
        assert_eq!(info.total_bytes, (a.len() + b.len()) as u64);
        let digest = |bytes: &[u8]| {
            let mut h = FileHash::default();
            h.update(bytes);
            h.finish()
        };
        let (da, db) = (digest(&a), digest(&b));
        assert_eq!(
            info.checksum,
            checkpoint_checksum([("a.safetensors", da.as_str()), ("b.safetensors", db.as_str())])
        );
        let progress = AtomicU64::new(0);
        assert_eq!(hash(&inspect(&d).unwrap(), &progress, &AtomicBool::new(false)).unwrap(), info.checksum);
        assert_eq!(progress.load(Ordering::Relaxed), info.total_bytes, "every byte counted once");
    }

    #[test]
    fn many_files_hash_in_parallel_to_the_same_checksum() {
        let d = tmpdir("many");
        let mut listed = Vec::new();
        for i in 0..13u8 {
            let data = vec![i; 1000 * usize::from(i) + 3];
            let header =
                format!(r#"{{"w":{{"dtype":"U8","shape":[{}],"data_offsets":[0,{}]}}}}"#, data.len(), data.len());
            let bytes = safetensors(&header, &data);
            let mut h = FileHash::default();
            h.update(&bytes);
            listed.push((format!("model-{i:05}.safetensors"), h.finish()));
            std::fs::write(d.join(&listed.last().unwrap().0), &bytes).unwrap();
        }
        let want = checkpoint_checksum(listed.iter().map(|(n, h)| (n.as_str(), h.as_str())));
        assert_eq!(read(&d).unwrap().checksum, want);
    }

    #[test]
    fn a_file_that_changes_after_inspect_or_a_stop_is_an_error() {
        let d = tmpdir("changed");
        let bytes = safetensors(r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, &[7; 4]);
        std::fs::write(d.join("a.safetensors"), &bytes).unwrap();
        let ckpt = inspect(&d).unwrap();
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 16]);
        std::fs::write(d.join("a.safetensors"), &longer).unwrap();
        let err = hash(&ckpt, &AtomicU64::new(0), &AtomicBool::new(false)).unwrap_err();
        assert!(matches!(err, CheckpointError::Changed { .. }) && err.to_string().contains("a.safetensors"), "{err}");
        let stopped = hash(&inspect(&d).unwrap(), &AtomicU64::new(0), &AtomicBool::new(true)).unwrap_err();
        assert!(matches!(stopped, CheckpointError::Stopped), "{stopped}");
        std::fs::remove_file(d.join("a.safetensors")).unwrap();
        let gone = hash(&ckpt, &AtomicU64::new(0), &AtomicBool::new(false)).unwrap_err();
        assert!(matches!(gone, CheckpointError::Io { .. }), "{gone}");
    }

    #[test]
    fn bad_checkpoints_are_named() {
        assert!(matches!(read(Path::new("/no/such/dir")), Err(CheckpointError::NotFound(_))));
        let empty = tmpdir("empty");
        assert!(matches!(read(&empty), Err(CheckpointError::Empty(_))));
        let bad = tmpdir("bad");
        std::fs::write(bad.join("x.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\xffjunk").unwrap();
        let err = read(&bad).unwrap_err();
        assert!(matches!(err, CheckpointError::Invalid { .. }) && err.to_string().contains("x.safetensors"), "{err}");
        let file = bad.join("x.safetensors");
        assert!(matches!(read(&file), Err(CheckpointError::NotADirectory(_))));
    }
}
