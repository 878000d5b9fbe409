//! `--load-format remote_instance`: a new instance takes its weights from a running seed engine
//! instead of from disk, as SGLang's remote-instance loader does.
//!
//! Expected flow (before the port is bound, in place of reading `--model-path`):
//! 1. POST the seed's `/init_weights_send_group_for_remote_instance` with `master_address` =
//!    the seed's address, `ports` = one port per TP rank, `group_rank` 0, `world_size` 2 and
//!    `group_name` = `send_weights_<this instance's host>`;
//! 2. POST the seed's `/send_weights_to_remote_instance` with the same address, ports and name.
//!
//! No tensors move: the seed's answer names the checksum of the weights it holds, which this
//! instance then reports as its own (`weights_checksum`), so a test can check that a new
//! instance got the seed's weights. The weight version still comes from `--weight-version`, as
//! in SGLang. Errors: any refusal by the seed, or a seed that cannot be reached, fails startup
//! (exit 1) with the seed's message.

use crate::cli::Config;
use crate::weights::WeightsInfo;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Longest wait for one call to the seed (a send may queue behind others, see
/// `--transfer-gbps`).
const SEED_TIMEOUT: Duration = Duration::from_secs(600);

/// `p0,p1` or `[p0, p1]`.
pub fn parse_ports(s: &str) -> Result<Vec<u16>, String> {
    let inner = s.trim().trim_start_matches('[').trim_end_matches(']');
    inner
        .split(',')
        .map(|p| {
            p.trim().parse::<u16>().map_err(|e| {
                format!("--remote-instance-weight-loader-send-weights-group-ports: {p:?} is not a port ({e})")
            })
        })
        .collect()
}

/// Flag checks for `--load-format remote_instance` (run by `Config::validate`).
pub fn check_flags(cfg: &Config) -> Result<(), String> {
    if cfg.remote_instance_weight_loader_seed_instance_ip.is_none() {
        return Err("--load-format remote_instance needs --remote-instance-weight-loader-seed-instance-ip".into());
    }
    if cfg.remote_instance_weight_loader_seed_instance_service_port.is_none() {
        return Err(
            "--load-format remote_instance needs --remote-instance-weight-loader-seed-instance-service-port".into()
        );
    }
    let Some(ports) = &cfg.remote_instance_weight_loader_send_weights_group_ports else {
        return Err(
            "--load-format remote_instance needs --remote-instance-weight-loader-send-weights-group-ports".into()
        );
    };
    let n = parse_ports(ports)?.len();
    if n != cfg.tp_size as usize {
        return Err(format!(
            "--remote-instance-weight-loader-send-weights-group-ports has {n} ports; it needs one per TP rank \
             (--tp-size {})",
            cfg.tp_size
        ));
    }
    if cfg.remote_instance_weight_loader_backend != "nccl" {
        return Err(format!(
            "--remote-instance-weight-loader-backend {} is not simulated; use nccl",
            cfg.remote_instance_weight_loader_backend
        ));
    }
    Ok(())
}

/// Runs the flow of the module docs; returns what this instance now holds.
pub async fn load_from_seed(cfg: &Config, _port: u16) -> Result<WeightsInfo, String> {
    let (Some(ip), Some(seed_port), Some(ports)) = (
        cfg.remote_instance_weight_loader_seed_instance_ip.as_deref(),
        cfg.remote_instance_weight_loader_seed_instance_service_port,
        cfg.remote_instance_weight_loader_send_weights_group_ports.as_deref(),
    ) else {
        return Err("the remote-instance flags are incomplete".into());
    };
    let ports = parse_ports(ports)?.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    let group_name = format!("send_weights_{}", cfg.host);
    let init = json!({"master_address": ip, "ports": ports, "group_rank": 0, "world_size": 2,
                      "group_name": group_name, "backend": cfg.remote_instance_weight_loader_backend});
    call_seed(ip, seed_port, "/init_weights_send_group_for_remote_instance", &init).await?;
    let send = json!({"master_address": ip, "ports": ports, "group_name": group_name});
    let out = call_seed(ip, seed_port, "/send_weights_to_remote_instance", &send).await?;
    let checksum = out.get("weights_checksum").and_then(Value::as_str).map(String::from);
    tracing::info!(seed = %format!("{ip}:{seed_port}"), checksum = checksum.as_deref().unwrap_or("-"),
                   "weights loaded from the seed instance");
    Ok(WeightsInfo { path: Some(format!("remote_instance://{ip}:{seed_port}")), checksum, ..WeightsInfo::default() })
}

/// One POST to the seed; a non-200 answer or `success: false` is an error carrying its message.
async fn call_seed(host: &str, port: u16, path: &str, body: &Value) -> Result<Value, String> {
    let (status, out) = tokio::time::timeout(SEED_TIMEOUT, post_json(host, port, path, body))
        .await
        .map_err(|_| format!("{path} on the seed {host}:{port} did not answer within {}s", SEED_TIMEOUT.as_secs()))??;
    if status != 200 || out.get("success") == Some(&Value::Bool(false)) {
        let msg = out.get("message").and_then(Value::as_str).map(String::from).unwrap_or_else(|| out.to_string());
        return Err(format!("{path} on the seed {host}:{port} answered {status}: {msg}"));
    }
    Ok(out)
}

/// A minimal HTTP/1.1 POST (`Connection: close`), enough for the seed's JSON routes.
async fn post_json(host: &str, port: u16, path: &str, body: &Value) -> Result<(u16, Value), String> {
    let mut s = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("cannot reach the seed at {host}:{port}: {e}"))?;
    let b = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{b}",
        b.len()
    );
    s.write_all(req.as_bytes()).await.map_err(|e| format!("seed {host}:{port}: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.map_err(|e| format!("seed {host}:{port}: {e}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("seed {host}:{port}: malformed answer"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("seed {host}:{port}: no status in {head:?}"))?;
    let value = serde_json::from_str(body.trim()).unwrap_or_else(|_| Value::String(body.to_string()));
    Ok((status, value))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn ports_parse_in_both_spellings() {
        assert_eq!(parse_ports("[4000, 4001]").unwrap(), vec![4000, 4001]);
        assert_eq!(parse_ports("4000,4001").unwrap(), vec![4000, 4001]);
        assert!(parse_ports("4000,x")
            .unwrap_err()
            .contains("--remote-instance-weight-loader-send-weights-group-ports"));
    }
}
