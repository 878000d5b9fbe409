//! What a version is made of: its files, their sizes and SHA-256s, and the whole-version
//! checksum.
//!
//! The version checksum is the rule `sglang-sim` (and the manager) use for a loaded checkpoint:
//! lowercase hex SHA-256 of the listing `sha256sum` prints for the `*.safetensors` files in
//! byte-wise sorted name order (`<file hex digest>  <file name>\n` per file), i.e. it follows
//! from the per-file SHA-256s alone ([`version_checksum`]). Files are listed (and sent) in that
//! same order. [`Manifest::build`] reads every file once, so files that match their per-file
//! hashes also have the manifest's version checksum: receivers check the per-file hashes only
//! (see [`crate::sink`]).
//!
//! Only regular files directly in the version directory are part of it (checkpoints are flat);
//! subdirectories are skipped and named in [`Manifest::skipped`], and so is a receiver's marker
//! ([`MARKER`]), so a received copy can be sent on as a source. No version may contain a file
//! of that name.

use crate::protocol::{name_problem, MAX_FILES};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// One file of a version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    /// Lowercase hex SHA-256 of the file's bytes.
    pub sha256: String,
}

/// A version's contents, sent ahead of its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: String,
    /// Sorted by name (byte-wise).
    pub files: Vec<FileEntry>,
    /// SHA-256 over the `*.safetensors` files in name order (see the module docs).
    pub checksum: String,
    /// Names of directory entries that were not included (subdirectories, special files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
}

/// Why a manifest cannot be built or accepted.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("invalid name: {0}")]
    BadName(String),
    #[error("{0} files exceed the limit of {MAX_FILES}")]
    TooManyFiles(usize),
    #[error("files are not in sorted order or repeat a name: {0:?}")]
    Order(String),
    #[error("manifest checksum {0} is not the one its files' SHA-256s give (a corrupt or forged manifest)")]
    ChecksumDisagrees(String),
    #[error("manifest checksum {0:?} is not 64 lowercase hex digits")]
    BadChecksum(String),
    #[error("{path} is not a directory of files")]
    NotADirectory { path: String },
}

/// The file a receiver writes into every version directory it publishes: the manifest the copy
/// was verified against (see [`crate::sink`]). Reserved: not part of any version.
pub const MARKER: &str = ".relay-manifest.json";

/// Lowercase hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The version checksum from the files' `(name, hex SHA-256)`, given in sorted name order: the
/// SHA-256 of their `sha256sum` listing, counting only [`in_version_checksum`] files.
pub fn version_checksum<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut listing = Sha256::new();
    for (name, digest) in files.into_iter().filter(|(name, _)| in_version_checksum(name)) {
        listing.update(digest.as_bytes());
        listing.update(b"  ");
        listing.update(name.as_bytes());
        listing.update(b"\n");
    }
    hex(&listing.finalize())
}

/// Whether a file takes part in the version checksum.
pub fn in_version_checksum(name: &str) -> bool {
    name.ends_with(".safetensors")
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl Manifest {
    /// Lists and hashes `dir` (blocking IO: call from `spawn_blocking`). One read of every file.
    pub fn build(version: &str, dir: &Path) -> Result<Manifest, ManifestError> {
        if let Some(p) = name_problem(version) {
            return Err(ManifestError::BadName(format!("version: {p}")));
        }
        let shown = dir.display().to_string();
        let io = |source| ManifestError::Io { path: shown.clone(), source };
        if !dir.is_dir() {
            return Err(ManifestError::NotADirectory { path: shown });
        }
        let mut names = Vec::new();
        let mut skipped = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            // Follows symlinks: a checkpoint directory of links to a shared store is fine.
            match std::fs::metadata(entry.path()) {
                Ok(m) if m.is_file() && name != MARKER => names.push(name),
                _ => skipped.push(name),
            }
        }
        names.sort();
        skipped.sort();
        if names.len() > MAX_FILES {
            return Err(ManifestError::TooManyFiles(names.len()));
        }
        let mut files = Vec::with_capacity(names.len());
        let mut buf = vec![0u8; 4 << 20];
        for name in names {
            if let Some(p) = name_problem(&name) {
                return Err(ManifestError::BadName(p));
            }
            let path = dir.join(&name);
            let shown = path.display().to_string();
            let io = |source| ManifestError::Io { path: shown.clone(), source };
            let mut f = std::fs::File::open(&path).map_err(io)?;
            let mut file_hash = Sha256::new();
            let mut size = 0u64;
            loop {
                let n = f.read(&mut buf).map_err(io)?;
                if n == 0 {
                    break;
                }
                file_hash.update(&buf[..n]);
                size += n as u64;
            }
            files.push(FileEntry { name, size, sha256: hex(&file_hash.finalize()) });
        }
        let checksum = version_checksum(files.iter().map(|f| (f.name.as_str(), f.sha256.as_str())));
        Ok(Manifest { version: version.to_string(), files, checksum, skipped })
    }

    /// Checks a manifest that came over the wire: names, limits, order, hash shapes.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if let Some(p) = name_problem(&self.version) {
            return Err(ManifestError::BadName(format!("version: {p}")));
        }
        if self.version.ends_with(".partial") {
            return Err(ManifestError::BadName("version names may not end in .partial".into()));
        }
        if self.files.len() > MAX_FILES {
            return Err(ManifestError::TooManyFiles(self.files.len()));
        }
        for (i, f) in self.files.iter().enumerate() {
            if let Some(p) = name_problem(&f.name) {
                return Err(ManifestError::BadName(p));
            }
            if f.name == MARKER {
                return Err(ManifestError::BadName(format!("{MARKER} is reserved for the receivers' marker")));
            }
            if !is_hex64(&f.sha256) {
                return Err(ManifestError::BadChecksum(f.sha256.clone()));
            }
            if i > 0 && self.files[i - 1].name >= f.name {
                return Err(ManifestError::Order(f.name.clone()));
            }
        }
        if !is_hex64(&self.checksum) {
            return Err(ManifestError::BadChecksum(self.checksum.clone()));
        }
        if version_checksum(self.files.iter().map(|f| (f.name.as_str(), f.sha256.as_str()))) != self.checksum {
            return Err(ManifestError::ChecksumDisagrees(self.checksum.clone()));
        }
        Ok(())
    }

    /// Sum of the file sizes.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn build_hashes_files_and_the_safetensors_in_name_order() {
        let d = std::env::temp_dir().join(format!("relay-manifest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("b.safetensors"), b"bbbb").unwrap();
        std::fs::write(d.join("a.safetensors"), b"aa").unwrap();
        std::fs::write(d.join("config.json"), b"{}").unwrap();
        std::fs::write(d.join(MARKER), b"{}").unwrap();
        let m = Manifest::build("v1", &d).unwrap();
        let names: Vec<_> = m.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["a.safetensors", "b.safetensors", "config.json"]);
        assert_eq!(m.skipped, [MARKER, "sub"], "a received copy's marker is not part of the version");
        assert_eq!(m.files[0].sha256, hex(&Sha256::digest(b"aa")));
        let listing = format!(
            "{}  a.safetensors\n{}  b.safetensors\n",
            hex(&Sha256::digest(b"aa")),
            hex(&Sha256::digest(b"bbbb"))
        );
        assert_eq!(m.checksum, hex(&Sha256::digest(listing.as_bytes())), "config.json is not part of the checksum");
        assert_eq!(m.total_bytes(), 8);
        m.validate().unwrap();

        let mut bad = m.clone();
        bad.files[2].name = "../config.json".into();
        assert!(matches!(bad.validate(), Err(ManifestError::BadName(_))));
        let mut reserved = m.clone();
        reserved.files[2].name = MARKER.into();
        reserved.files.sort_by(|a, b| a.name.cmp(&b.name));
        assert!(matches!(reserved.validate(), Err(ManifestError::BadName(_))));
        let mut unsorted = m.clone();
        unsorted.files.swap(0, 1);
        assert!(matches!(unsorted.validate(), Err(ManifestError::Order(_))));
        let mut forged = m.clone();
        forged.files[1].sha256 = hex(&Sha256::digest(b"other"));
        assert!(matches!(forged.validate(), Err(ManifestError::ChecksumDisagrees(_))));
        let mut partial = m;
        partial.version = "v1.partial".into();
        assert!(partial.validate().is_err());
        assert!(Manifest::build("../v", &d).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
