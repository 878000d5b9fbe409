//! `elastic_rollout._native`: the few pieces of the manager that Python front ends need, from the
//! manager's own Rust code, so nothing is declared twice.
//!
//! - `parse_serve_args` and `describe_serve_args`: `rollout-manager serve`'s clap parser,
//!   layered as the binary layers it (command line > `ROLLOUT_MANAGER_*` environment variables of
//!   this process > `--config` file > defaults), then [`ServeConfig::validate`], so
//!   `python -m elastic_rollout_ray.launch` rejects a bad flag with the binary's own message
//!   before anything starts on a cluster. The dict returned is `ServeConfig`'s serde form.
//! - `binary_path`: the `rollout-manager` binary that matches this module (bundled in the
//!   package's `_bin/`, or the cargo build of the source tree this module was built from).
//! - `autoscaler_replay`: the pure `replay()` of `rollout-manager autoscaler-replay` (the same
//!   `decide()` as the live autoscaler) over a YAML config and a JSONL trace given as strings.
//!
//! Errors: a bad argument list, environment variable, config file or config raises `ValueError`
//! whose message is exactly what the binary prints on stderr for the same input; a missing
//! binary raises `FileNotFoundError` listing every place tried.

use clap::{CommandFactory, FromArgMatches, Parser};
use pyo3::exceptions::{PyFileNotFoundError, PyValueError};
use pyo3::prelude::*;
use rollout_core::autoscaler::{parse_trace, replay, AutoscalerConfig};
use rollout_core::cli::{self, LayerError, Source};
use rollout_core::{LogArgs, ServeArgs, ServeConfig};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `rollout-manager serve` as the binary parses it (a flag given twice takes its last value).
#[derive(Parser)]
#[command(name = "rollout-manager", bin_name = "rollout-manager serve", args_override_self = true)]
struct Serve {
    #[command(flatten)]
    log: LogArgs,
    #[command(flatten)]
    args: ServeArgs,
}

/// A parse of `serve`'s arguments, and where each value came from.
#[derive(serde::Serialize)]
struct Described {
    config: ServeConfig,
    /// The `--config` file, as given (flag or `ROLLOUT_MANAGER_CONFIG`).
    config_file: Option<PathBuf>,
    log_format: rollout_core::LogFormat,
    /// By `ServeConfig` field name (and `config_file`, `log_format`).
    sources: BTreeMap<String, Source>,
}

/// Parses and validates `serve`'s arguments (without the program and subcommand names), with
/// the environment of this process and the `--config` file. Returns the binary's stderr text on
/// error (without the trailing newline).
fn parse(argv: &[String]) -> Result<Described, String> {
    let full: Vec<std::ffi::OsString> =
        std::iter::once("rollout-manager serve".into()).chain(argv.iter().map(Into::into)).collect();
    let command = cli::with_env(Serve::command(), cli::ENV_PREFIX);
    let layered = cli::layered_matches(command, &full, None, |path| std::fs::read_to_string(path))
        .and_then(|layered| Ok((Serve::from_arg_matches(&layered.matches)?, layered)));
    let (serve, layered) = match layered {
        Ok(parsed) => parsed,
        Err(LayerError::Clap(e)) => return Err(e.render().to_string().trim_end().to_string()),
        Err(LayerError::File(e)) => return Err(format!("error: {e}")),
    };
    serve.args.config.validate().map_err(|e| format!("error: {e}"))?;
    Ok(Described {
        config: serve.args.config,
        config_file: serve.args.config_file,
        log_format: serve.log.log_format,
        sources: layered.sources(None),
    })
}

/// A JSON value as Python objects (through the standard `json` module, so the mapping of
/// numbers, nulls and nesting is Python's own).
fn to_python<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (value.to_string(),))
}

/// Parse and validate `rollout-manager serve` arguments exactly as the binary does.
///
/// Returns the configuration as a dict (field names as in `ServeConfig`'s JSON form).
/// Raises ValueError with the binary's own error message (which names the flag).
#[pyfunction]
fn parse_serve_args<'py>(py: Python<'py>, argv: Vec<String>) -> PyResult<Bound<'py, PyAny>> {
    let described = parse(&argv).map_err(PyValueError::new_err)?;
    let value = serde_json::to_value(&described.config).map_err(|e| PyValueError::new_err(e.to_string()))?;
    to_python(py, &value)
}

/// Like `parse_serve_args`, and says where each value came from.
///
/// Returns `{"config": <parse_serve_args' dict>, "config_file": path or None, "log_format":
/// "text" or "json", "sources": {field: "command_line" | "env" | "config_file" | "default"}}`.
/// Raises ValueError with the binary's own error message (which names the flag).
#[pyfunction]
fn describe_serve_args<'py>(py: Python<'py>, argv: Vec<String>) -> PyResult<Bound<'py, PyAny>> {
    let described = parse(&argv).map_err(PyValueError::new_err)?;
    let value = serde_json::to_value(&described).map_err(|e| PyValueError::new_err(e.to_string()))?;
    to_python(py, &value)
}

/// Where a `rollout-manager` binary matching this module may be: the package's `_bin/`, then
/// the cargo build of the source tree this module was compiled from.
fn binary_candidates(package_dir: Option<&Path>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(dir) = package_dir {
        out.push(dir.join("_bin").join("rollout-manager"));
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..");
    for profile in ["release", "debug"] {
        out.push(workspace.join("target").join(profile).join("rollout-manager"));
    }
    out
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// The path of the `rollout-manager` binary that matches this module: `$ELASTIC_ROLLOUT_MANAGER_BIN`
/// if set, else the one bundled in `elastic_rollout/_bin/`, else the source tree's cargo build
/// (release or debug, whichever was built last), else `PATH`.
///
/// Raises FileNotFoundError naming every place tried.
#[pyfunction]
fn binary_path(py: Python<'_>) -> PyResult<String> {
    if let Ok(path) = std::env::var("ELASTIC_ROLLOUT_MANAGER_BIN") {
        if !path.is_empty() {
            return if is_executable(Path::new(&path)) {
                Ok(path)
            } else {
                Err(PyFileNotFoundError::new_err(format!(
                    "ELASTIC_ROLLOUT_MANAGER_BIN={path:?} is not an executable file; point it at rollout-manager or unset it"
                )))
            };
        }
    }
    let package_dir = py
        .import("elastic_rollout")
        .and_then(|m| m.getattr("__file__"))
        .and_then(|f| f.extract::<String>())
        .ok()
        .and_then(|f| Path::new(&f).parent().map(Path::to_path_buf));
    let candidates = binary_candidates(package_dir.as_deref());
    let bundled = package_dir.is_some().then(|| &candidates[0]).filter(|p| is_executable(p));
    // Of the two cargo builds, the one built last (a stale release build must not shadow it).
    let built = candidates
        .iter()
        .skip(usize::from(package_dir.is_some()))
        .filter(|p| is_executable(p))
        .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
    if let Some(found) = bundled.or(built) {
        return Ok(found.canonicalize().unwrap_or_else(|_| found.clone()).display().to_string());
    }
    // Last, PATH (a moved checkout, or a binary installed on its own).
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    if let Some(found) = std::env::split_paths(&path_var).map(|d| d.join("rollout-manager")).find(|p| is_executable(p))
    {
        return Ok(found.display().to_string());
    }
    let mut tried: Vec<String> = candidates.iter().map(|p| format!("  - {}", p.display())).collect();
    tried.push(format!("  - PATH ({})", path_var.to_string_lossy()));
    Err(PyFileNotFoundError::new_err(format!(
        "could not find the rollout-manager binary; tried:\n{}\nTo fix: `cargo build -p rollout-manager` in the \
         repository, or set ELASTIC_ROLLOUT_MANAGER_BIN",
        tried.join("\n")
    )))
}

/// Run the autoscaler's `replay()` (the `decide()` of the live autoscaler and of
/// `rollout-manager autoscaler-replay`) over a YAML config and a JSONL metrics trace.
///
/// Returns one dict per evaluation (`at`, `action`, `reason`, `signal`, `conditions`, ...).
/// Raises ValueError naming what is wrong with the config or the trace.
#[pyfunction]
fn autoscaler_replay<'py>(py: Python<'py>, config_yaml: &str, trace_jsonl: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let config = AutoscalerConfig::from_yaml(config_yaml).map_err(|e| PyValueError::new_err(format!("config: {e}")))?;
    let lines = parse_trace(trace_jsonl).map_err(|e| PyValueError::new_err(format!("trace: {e}")))?;
    let evaluations = py.detach(|| replay(config, &lines));
    evaluations
        .iter()
        .map(|e| {
            let value = serde_json::to_value(e).map_err(|err| PyValueError::new_err(err.to_string()))?;
            to_python(py, &value)
        })
        .collect()
}

/// The manager's argument parser, binary location and autoscaler replay, from its Rust code.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_serve_args, m)?)?;
    m.add_function(wrap_pyfunction!(describe_serve_args, m)?)?;
    m.add_function(wrap_pyfunction!(binary_path, m)?)?;
    m.add_function(wrap_pyfunction!(autoscaler_replay, m)?)?;
    Ok(())
}
