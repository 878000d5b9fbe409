//! How an engine is started: which program, which argv, which environment.
//!
//! `--engine sim` runs `sglang-sim`, found next to the manager's own executable, else on PATH.
//! `--engine sglang` runs `python -m sglang.launch_server` with the Python found on PATH
//! (`python3`, then `python`). Both get the same SGLang flags, then the operator's
//! `--engine-arg`s, and `CUDA_VISIBLE_DEVICES` naming the engine's GPUs.

use crate::foundation::host::LaunchSpec;
use rollout_core::{EngineKind, ServeConfig};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot find sglang-sim: looked next to the manager ({beside}) and on PATH; build it with `cargo build -p sglang-sim` or put it on PATH")]
    SimNotFound { beside: String },
    #[error("--engine-program {path} is not an executable file")]
    NotExecutable { path: String },
    #[error("cannot find a Python interpreter (python3 or python) on PATH for --engine sglang")]
    PythonNotFound,
}

/// The program and fixed arguments every engine of this fleet starts with.
#[derive(Debug, Clone)]
pub struct EngineLauncher {
    program: PathBuf,
    prefix: Vec<String>,
    kind: EngineKind,
}

impl EngineLauncher {
    pub fn resolve(kind: EngineKind, program: Option<&Path>) -> Result<Self, LaunchError> {
        if let Some(p) = program {
            if !is_executable(p) {
                return Err(LaunchError::NotExecutable { path: p.display().to_string() });
            }
            let prefix = match kind {
                EngineKind::Sim => Vec::new(),
                EngineKind::Sglang => vec!["-m".into(), "sglang.launch_server".into()],
            };
            return Ok(Self { program: p.to_path_buf(), prefix, kind });
        }
        match kind {
            EngineKind::Sim => {
                let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("sglang-sim")));
                let program = match beside.as_deref() {
                    Some(p) if is_executable(p) => p.to_path_buf(),
                    _ => which::which("sglang-sim").map_err(|_| LaunchError::SimNotFound {
                        beside: beside.map(|p| p.display().to_string()).unwrap_or_else(|| "?".into()),
                    })?,
                };
                Ok(Self { program, prefix: Vec::new(), kind })
            }
            EngineKind::Sglang => {
                let program = which::which("python3")
                    .or_else(|_| which::which("python"))
                    .map_err(|_| LaunchError::PythonNotFound)?;
                Ok(Self { program, prefix: vec!["-m".into(), "sglang.launch_server".into()], kind })
            }
        }
    }

    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The full launch of one engine.
    /// `model_path` is the checkpoint the engine starts on (the fleet's current or newest
    /// published version, else `--model-path`); the tokenizer stays `--model-path`'s.
    pub fn spec(
        &self,
        config: &ServeConfig,
        model_path: &str,
        port: u16,
        gpu_ids: &[u32],
        weight_version: &str,
        log_path: PathBuf,
    ) -> LaunchSpec {
        let mut args = self.prefix.clone();
        args.extend([
            "--model-path".to_string(),
            model_path.to_string(),
            "--host".into(),
            config.engine_host.clone(),
            "--port".into(),
            port.to_string(),
            "--tp-size".into(),
            gpu_ids.len().max(1).to_string(),
            "--weight-version".into(),
            weight_version.to_string(),
            "--enable-metrics".into(),
        ]);
        args.extend(config.engine_args.iter().cloned());
        // Every engine starts under one served name (`/v1/models`, the OpenAI answers'
        // `model`), also one started on a published checkpoint, which would otherwise be listed
        // under the checkpoint's path. A later `/update_weights_from_disk` still renames it to
        // the checkpoint's path: SGLang 0.5.23 does so whatever the flag
        // (`tokenizer_manager.py:2368`, `_update_model_path_info`).
        if !config.engine_args.iter().any(|a| a.starts_with("--served-model-name")) {
            args.extend(["--served-model-name".to_string(), served_model_name(config)]);
        }
        let tokenizer_given = config.engine_args.iter().any(|a| a.starts_with("--tokenizer-path"));
        if model_path != config.model_path && !tokenizer_given {
            args.extend(["--tokenizer-path".to_string(), config.model_path.clone()]);
        }
        let visible = gpu_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let mut env = vec![("CUDA_VISIBLE_DEVICES".to_string(), visible)];
        if self.kind == EngineKind::Sglang {
            // Real SGLang prints progress bars to stderr; keep logs readable.
            env.push(("PYTHONUNBUFFERED".into(), "1".into()));
        }
        LaunchSpec { program: self.program.clone(), args, env, log_path }
    }
}

/// The served model name every engine gets: `--model-name` when one was given, else the startup
/// `--model-path` (what SGLang itself would list before any update).
pub fn served_model_name(config: &ServeConfig) -> String {
    if config.model_name == "default" {
        config.model_path.clone()
    } else {
        config.model_name.clone()
    }
}

/// Where a starting engine copies the fleet's version from: a running engine that serves it
/// (SGLang's `--load-format remote_instance`; the new engine asks the seed over HTTP to send
/// its weights through a 2-rank NCCL group per TP rank on `group_ports`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub engine_id: rollout_core::ids::EngineId,
    pub host: String,
    pub port: u16,
    pub group_ports: Vec<u16>,
}

impl Seed {
    /// The flags SGLang's remote-instance loader reads.
    pub fn args(&self) -> Vec<String> {
        let ports = self.group_ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
        vec![
            "--load-format".into(),
            "remote_instance".into(),
            "--remote-instance-weight-loader-seed-instance-ip".into(),
            self.host.clone(),
            "--remote-instance-weight-loader-seed-instance-service-port".into(),
            self.port.to_string(),
            "--remote-instance-weight-loader-send-weights-group-ports".into(),
            format!("[{ports}]"),
        ]
    }
}

impl EngineLauncher {
    /// The launch of one engine on a node agent (Ray mode): the agent replaces `{host}` with
    /// the address it listens on and `{port}` with a free port of its node; the GPUs are the
    /// ones Ray assigned to the engine's host actor.
    pub fn spec_on_agent(
        &self,
        config: &ServeConfig,
        model_path: &str,
        gpu_ids: &[String],
        weight_version: &str,
        log_path: PathBuf,
    ) -> LaunchSpec {
        let tp: Vec<u32> = (0..config.rollout_num_gpus_per_engine).collect();
        let mut spec = self.spec(config, model_path, 0, &tp, weight_version, log_path);
        let prefix = self.prefix.len();
        // The fixed flags come first, so these are ours, not an --engine-arg's.
        for (flag, value) in [("--host", "{host}"), ("--port", "{port}")] {
            if let Some(i) = spec.args[prefix..].iter().position(|a| a == flag) {
                if let Some(slot) = spec.args.get_mut(prefix + i + 1) {
                    *slot = value.to_string();
                }
            }
        }
        for (k, v) in &mut spec.env {
            if k == "CUDA_VISIBLE_DEVICES" {
                *v = gpu_ids.join(",");
            }
        }
        spec
    }
}

/// Flags whose value is a secret: the flag's last word names one (SGLang's `--api-key`,
/// `--admin-api-key`, `--ssl-keyfile-password`; `--hf-token`...), and no word makes it a count
/// (`--max-total-tokens`, `--kt-max-deferred-experts-per-token` and `--speculative-token-map`
/// are settings, not secrets).
fn is_secret_flag(flag: &str) -> bool {
    const SECRETS: [&str; 9] =
        ["key", "apikey", "token", "secret", "password", "passwd", "pass", "credential", "credentials"];
    const COUNTS: [&str; 4] = ["max", "min", "num", "per"];
    let Some(name) = flag.strip_prefix("--") else { return false };
    let name = name.to_ascii_lowercase();
    let words: Vec<&str> = name.split(['-', '_']).collect();
    words.last().is_some_and(|w| SECRETS.contains(w)) && !words.iter().any(|w| COUNTS.contains(w))
}

/// An engine's argv for the log: the values of secret flags (`--api-key X`, `--api-key=X`)
/// replaced by `<redacted>`. The process itself gets the real argv.
pub fn redacted(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut hide_next = false;
    for arg in args {
        if std::mem::take(&mut hide_next) && !arg.starts_with("--") {
            out.push("<redacted>".to_string());
            continue;
        }
        match arg.split_once('=') {
            Some((flag, _)) if is_secret_flag(flag) => out.push(format!("{flag}=<redacted>")),
            Some(_) => out.push(arg.clone()),
            None => {
                hide_next = is_secret_flag(arg);
                out.push(arg.clone());
            }
        }
    }
    out
}

/// Words that mark a log line as one that may carry a credential (lowercase).
const CREDENTIAL_HINTS: [&str; 9] =
    ["api_key", "api-key", "apikey", "secret", "password", "authorization", "bearer", "hf_token", "access_token"];

/// The last `lines` lines of an engine's log (read from its last 64 KiB), for its record when
/// the manager gives up on it. A line that may carry a credential (it names an API key, a
/// secret, a password or a bearer token) is withheld; an unreadable log gives one line saying why.
///
/// SGLang prints its whole `ServerArgs` at startup, `api_key` and `admin_api_key` included.
pub fn log_tail(path: &Path, lines: usize) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    const WINDOW: u64 = 64 * 1024;
    let read = || -> std::io::Result<String> {
        let mut f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(WINDOW)))?;
        let mut buf = Vec::new();
        f.take(WINDOW).read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    let text = match read() {
        Ok(t) => t,
        Err(e) => return vec![format!("(cannot read {}: {e})", path.display())],
    };
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|line| {
            let lower = line.to_ascii_lowercase();
            if CREDENTIAL_HINTS.iter().any(|w| lower.contains(w)) {
                "(line withheld: it may carry a credential)".to_string()
            } else {
                line.chars().take(500).collect()
            }
        })
        .collect()
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// A free TCP port on `host`, not handed out before by this manager.
pub fn free_port(host: &str, taken: &std::collections::HashSet<u16>) -> std::io::Result<u16> {
    for _ in 0..64 {
        let port = std::net::TcpListener::bind((host, 0))?.local_addr()?.port();
        if !taken.contains(&port) {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "no free port found after 64 tries"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeConfig,
    }

    #[test]
    fn sglang_argv_is_a_list_with_gpus_in_env() {
        let config =
            Cli::try_parse_from(["m", "--model-path", "/models/q; rm -rf /", "--engine-arg=--mem-fraction-static=0.8"])
                .unwrap()
                .serve;
        let launcher = EngineLauncher {
            program: "/usr/bin/python3".into(),
            prefix: vec!["-m".into(), "sglang.launch_server".into()],
            kind: EngineKind::Sglang,
        };
        let spec = launcher.spec(&config, &config.model_path, 31000, &[2, 3], "v7", "/tmp/e.log".into());
        assert_eq!(&spec.args[..4], ["-m", "sglang.launch_server", "--model-path", "/models/q; rm -rf /"]);
        let joined = spec.args.join(" ");
        assert!(
            joined.contains("--port 31000 --tp-size 2 --weight-version v7 --enable-metrics --mem-fraction-static=0.8"),
            "{joined}"
        );
        assert!(spec.env.contains(&("CUDA_VISIBLE_DEVICES".into(), "2,3".into())));
        assert!(!joined.contains("--tokenizer-path"), "{joined}");
        let on_agent = launcher.spec_on_agent(&config, "/models/q", &["5".into()], "v7", "/tmp/e.log".into());
        let joined = on_agent.args.join(" ");
        assert!(joined.contains("--host {host} --port {port} --tp-size 1"), "{joined}");
        assert!(on_agent.env.contains(&("CUDA_VISIBLE_DEVICES".into(), "5".into())));
        // On a published checkpoint the engine keeps the base model's tokenizer.
        let spec = launcher.spec(&config, "/ckpt/v8", 31000, &[2], "v8", "/tmp/e.log".into());
        let joined = spec.args.join(" ");
        assert!(joined.contains("--model-path /ckpt/v8 ") && joined.contains("--weight-version v8 "), "{joined}");
        assert!(joined.ends_with("--tokenizer-path /models/q; rm -rf /"), "{joined}");
        // The served name stays the startup model's on a checkpoint, so clients see no change.
        assert!(joined.contains("--served-model-name /models/q; rm -rf / "), "{joined}");
    }

    #[test]
    fn the_served_model_name_is_pinned_unless_an_engine_arg_sets_it() {
        let launcher = EngineLauncher { program: "/bin/sim".into(), prefix: vec![], kind: EngineKind::Sim };
        let named = |flags: &[&str]| {
            let mut argv = vec!["m", "--model-path", "/models/base"];
            argv.extend_from_slice(flags);
            let config = Cli::try_parse_from(argv).expect("valid flags").serve;
            let spec = launcher.spec(&config, "/ckpt/v2", 1, &[0], "v2", "/tmp/e.log".into());
            let at: Vec<usize> = spec
                .args
                .iter()
                .enumerate()
                .filter(|(_, a)| a.starts_with("--served-model-name"))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(at.len(), 1, "{:?}", spec.args);
            let flag = &spec.args[at[0]];
            flag.split_once('=').map_or_else(|| spec.args[at[0] + 1].clone(), |(_, v)| v.to_string())
        };
        assert_eq!(named(&[]), "/models/base");
        assert_eq!(named(&["--model-name", "qwen3-8b"]), "qwen3-8b");
        assert_eq!(named(&["--model-name", "qwen3-8b", "--engine-arg=--served-model-name=mine"]), "mine");
    }

    #[test]
    fn secret_values_are_redacted_for_the_log() {
        let args: Vec<String> =
            ["--port", "1", "--api-key", "sk-1", "--admin-api-key=sk-2", "--hf-token", "--tp-size", "2"]
                .iter()
                .map(ToString::to_string)
                .collect();
        let shown = redacted(&args).join(" ");
        assert_eq!(shown, "--port 1 --api-key <redacted> --admin-api-key=<redacted> --hf-token --tp-size 2");
    }

    #[test]
    fn only_flags_that_name_a_secret_are_secret() {
        for (flag, secret) in [
            ("--api-key", true),
            ("--admin-api-key", true),
            ("--ssl-keyfile-password", true),
            ("--hf-token", true),
            ("--access_token", true),
            ("--client-secret", true),
            ("--API-KEY", true),
            // Settings whose names mention tokens or keys.
            ("--max-total-tokens", false),
            ("--max-prefill-tokens", false),
            ("--kt-max-deferred-experts-per-token", false),
            ("--speculative-token-map", false),
            ("--speculative-num-draft-tokens", false),
            ("--tokenizer-path", false),
            ("--skip-tokenizer-init", false),
            ("--ssl-keyfile", false),
            ("--tokenizer-metrics-custom-labels-header", false),
            // Not a flag.
            ("api-key", false),
        ] {
            assert_eq!(is_secret_flag(flag), secret, "{flag}");
        }
        let args: Vec<String> = ["--max-total-tokens=16384", "--max-prefill-tokens", "4096", "--api-key=k"]
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            redacted(&args).join(" "),
            "--max-total-tokens=16384 --max-prefill-tokens 4096 --api-key=<redacted>"
        );
    }
}
