//! Reading a published checkpoint: every `*.safetensors` file of a directory is checked (header
//! length, JSON header, tensors within the file) and hashed with the rule shared with
//! `sglang-sim` ([`rollout_core::weights::Checksum`]: SHA-256 over the files' bytes in sorted
//! file-name order). Blocking IO: call from `spawn_blocking`.
//!
//! Errors name the file and what is wrong, so a publish can be answered 400 with a fix.

use rollout_core::weights::{safetensors_header, safetensors_header_len, Checksum};
use std::io::Read;
use std::path::{Path, PathBuf};

/// What a checkpoint directory holds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckpointInfo {
    pub checksum: String,
    pub files: Vec<String>,
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

/// Validates and checksums a checkpoint directory.
pub fn read(dir: &Path) -> Result<CheckpointInfo, CheckpointError> {
    let mut sum = Checksum::default();
    let mut info = CheckpointInfo { checksum: String::new(), files: Vec::new(), total_bytes: 0, num_tensors: 0 };
    let mut buf = vec![0u8; 1 << 20];
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
        info.num_tensors += safetensors_header(&header, len - 8 - header_len).map_err(invalid)?;
        sum.update(&prefix);
        sum.update(&header);
        loop {
            let n = f.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            sum.update(&buf[..n]);
        }
        info.total_bytes += len;
        info.files.push(file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
    }
    info.checksum = sum.finish();
    Ok(info)
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
        let mut want = Checksum::default();
        want.update(&a);
        want.update(&b);
        assert_eq!(info.checksum, want.finish());
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
