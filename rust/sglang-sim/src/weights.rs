//! Reading "weights" from disk: every `*.safetensors` file of a checkpoint is validated
//! (8-byte little-endian header length, a JSON header whose tensors fit in the file) and
//! hashed, so a test can prove which bytes an engine loaded.
//!
//! Checksum (the rule the manager and the relay use): lowercase hex SHA-256 of the listing
//! `sha256sum` prints for every `*.safetensors` file in byte-wise sorted name order, one line
//! `<file hex digest>  <file name>\n` per file (for a single-file path, that file alone):
//! `cd DIR && LC_ALL=C sha256sum -- *.safetensors | sha256sum`.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Safetensors headers larger than this are rejected (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 * 1024 * 1024;

/// What the engine loaded, reported by `/server_info` (and `/model_info`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct WeightsInfo {
    /// Path the weights came from (`None` for a model id that is not a local path).
    pub path: Option<String>,
    /// SHA-256 over the files (see the module docs); `None` when nothing was read.
    pub checksum: Option<String>,
    pub files: Vec<String>,
    pub total_bytes: u64,
    pub num_tensors: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("Model path {0} does not exist.")]
    NotFound(String),
    #[error("No *.safetensors files found in {0}.")]
    NoFiles(String),
    #[error("Failed to read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("Invalid safetensors file {path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// Whether a model path names local weights (a directory or a file that exists).
pub fn is_local(path: &str) -> bool {
    Path::new(path).exists()
}

/// The `*.safetensors` files of a checkpoint path, sorted by name.
fn checkpoint_files(path: &Path) -> Result<Vec<PathBuf>, WeightsError> {
    let shown = path.display().to_string();
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !path.is_dir() {
        return Err(WeightsError::NotFound(shown));
    }
    let io = |source| WeightsError::Io { path: shown.clone(), source };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let p = entry.map_err(io)?.path();
        if p.is_file() && p.extension().is_some_and(|e| e == "safetensors") {
            files.push(p);
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    if files.is_empty() {
        return Err(WeightsError::NoFiles(shown));
    }
    Ok(files)
}

/// Checks one safetensors file's header; returns its tensor count.
fn validate_header(path: &Path, file_len: u64, f: &mut std::fs::File) -> Result<usize, WeightsError> {
    let shown = path.display().to_string();
    let invalid = |reason: String| WeightsError::Invalid { path: shown.clone(), reason };
    if file_len < 8 {
        return Err(invalid(format!("file is {file_len} bytes, shorter than the 8-byte header length")));
    }
    let mut len_bytes = [0u8; 8];
    f.read_exact(&mut len_bytes).map_err(|source| WeightsError::Io { path: shown.clone(), source })?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len == 0 || header_len > MAX_HEADER || header_len > file_len - 8 {
        return Err(invalid(format!("header length {header_len} does not fit in a {file_len}-byte file")));
    }
    let mut header = vec![0u8; usize::try_from(header_len).map_err(|_| invalid("header too large".into()))?];
    f.read_exact(&mut header).map_err(|source| WeightsError::Io { path: shown.clone(), source })?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| invalid(format!("header is not JSON: {e}")))?;
    let obj = json.as_object().ok_or_else(|| invalid("header is not a JSON object".into()))?;
    let data_len = file_len - 8 - header_len;
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
                return Err(invalid(format!(
                    "tensor {name:?} needs dtype, shape and data_offsets within {data_len} data bytes"
                )))
            }
        }
    }
    Ok(tensors)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Validates and hashes a checkpoint (blocking IO: call from `spawn_blocking`).
pub fn load_checkpoint(path: &str) -> Result<WeightsInfo, WeightsError> {
    let root = Path::new(path);
    if !root.exists() {
        return Err(WeightsError::NotFound(path.to_string()));
    }
    let files = checkpoint_files(root)?;
    // The checksum rule shared with the manager and the relay: each file's SHA-256, then the
    // SHA-256 of their `sha256sum` listing in name order (`files` is sorted).
    let mut listing = Sha256::new();
    let mut info = WeightsInfo { path: Some(path.to_string()), ..WeightsInfo::default() };
    let mut buf = vec![0u8; 1 << 20];
    for file in &files {
        let shown = file.display().to_string();
        let io = |source| WeightsError::Io { path: shown.clone(), source };
        let mut f = std::fs::File::open(file).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        info.num_tensors += validate_header(file, len, &mut f)?;
        let mut f = std::fs::File::open(file).map_err(io)?;
        let mut hasher = Sha256::new();
        loop {
            let n = f.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        listing.update(hex(&hasher.finalize()).as_bytes());
        listing.update(b"  ");
        listing.update(name.as_bytes());
        listing.update(b"\n");
        info.total_bytes += len;
        info.files.push(name);
    }
    info.checksum = Some(hex(&listing.finalize()));
    Ok(info)
}

/// Reads `model_type` and `architectures` from a local `config.json`, if there is one.
pub fn read_model_config(path: &str) -> crate::engine::ModelMeta {
    let p = Path::new(path);
    let cfg = if p.is_dir() {
        p.join("config.json")
    } else {
        return crate::engine::ModelMeta::default();
    };
    let Ok(text) = std::fs::read_to_string(cfg) else {
        return crate::engine::ModelMeta::default();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return crate::engine::ModelMeta::default();
    };
    crate::engine::ModelMeta {
        model_type: v.get("model_type").and_then(|m| m.as_str()).map(String::from),
        architectures: v
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sglang-sim-w-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn safetensors(tensors: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (tensors.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(tensors.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn valid_directory_is_hashed_in_name_order() {
        let d = tmpdir("ok");
        let a = safetensors(r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &[1; 8]);
        let b =
            safetensors(r#"{"__metadata__":{"x":"y"},"v":{"dtype":"BF16","shape":[],"data_offsets":[0,2]}}"#, &[2; 2]);
        std::fs::write(d.join("b.safetensors"), &b).unwrap();
        std::fs::write(d.join("a.safetensors"), &a).unwrap();
        std::fs::write(d.join("config.json"), r#"{"model_type":"llama","architectures":["LlamaForCausalLM"]}"#)
            .unwrap();
        let info = load_checkpoint(d.to_str().unwrap()).unwrap();
        assert_eq!(info.files, vec!["a.safetensors", "b.safetensors"]);
        assert_eq!(info.num_tensors, 2);
        let listing =
            format!("{}  a.safetensors\n{}  b.safetensors\n", hex(&Sha256::digest(&a)), hex(&Sha256::digest(&b)));
        let expect = hex(&Sha256::digest(listing.as_bytes()));
        assert_eq!(info.checksum.as_deref(), Some(expect.as_str()));
        let meta = read_model_config(d.to_str().unwrap());
        assert_eq!(meta.model_type.as_deref(), Some("llama"));
    }

    #[test]
    fn garbage_is_rejected() {
        let d = tmpdir("bad");
        std::fs::write(d.join("x.safetensors"), b"this is not a safetensors file").unwrap();
        let err = load_checkpoint(d.to_str().unwrap()).unwrap_err();
        assert!(matches!(err, WeightsError::Invalid { .. }), "{err}");
        let d2 = tmpdir("offsets");
        let bad = safetensors(r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,80]}}"#, &[0; 8]);
        std::fs::write(d2.join("x.safetensors"), bad).unwrap();
        assert!(load_checkpoint(d2.to_str().unwrap()).is_err());
        assert!(matches!(load_checkpoint("/no/such/path"), Err(WeightsError::NotFound(_))));
        let empty = tmpdir("empty");
        assert!(matches!(load_checkpoint(empty.to_str().unwrap()), Err(WeightsError::NoFiles(_))));
    }
}
