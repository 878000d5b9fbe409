//! The autoscaler: metrics collection, the decision loop, its API, the terminal monitor and
//! the offline replay. The decisions themselves are pure and live in
//! `rollout_core::autoscaler`; see `docs/autoscaler.md`.
//!
//! | file | what it holds |
//! |---|---|
//! | `collector.rs` | reads `/v1/loads` and `/metrics` of every ACTIVE engine into a tick |
//! | `service.rs` | the task: tick, decide, act through the scale API, keep the history |
//! | `api.rs` | `/autoscaler/*` and `/rollout/pipeline` |
//! | `monitor.rs`, `monitor_view.rs` | `rollout-manager monitor`, a live terminal UI |
//! | `replay.rs` | `rollout-manager autoscaler-replay` |

pub mod api;
pub mod collector;
pub mod monitor;
pub mod monitor_view;
pub mod replay;
pub mod service;

pub use api::routes;
pub use service::Autoscaler;

use rollout_core::autoscaler::AutoscalerConfig;
use rollout_core::ConfigError;
use std::path::{Path, PathBuf};

/// Reads and validates `--autoscaler-config` (None without the flag). Errors name the flag,
/// the file and the field.
pub fn load_config(path: Option<&Path>) -> Result<Option<(PathBuf, AutoscalerConfig)>, ConfigError> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        flag: "--autoscaler-config",
        message: format!("cannot read {}: {e}", path.display()),
    })?;
    let config = AutoscalerConfig::from_yaml(&text)
        .map_err(|e| ConfigError { flag: "--autoscaler-config", message: format!("{}: {e}", path.display()) })?;
    Ok(Some((path.to_path_buf(), config)))
}
