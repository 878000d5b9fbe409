//! State of SGLang's distributed weight paths on one engine: weight-update groups (the
//! trainer's NCCL broadcast), the `begin_weight_update`/`end_weight_update` session of 0.5.x,
//! and the send groups of remote-instance loading (this engine as the seed).
//!
//! The simulator cannot receive NCCL tensors. What it checks is the *protocol*: a group must be
//! initialised (and rank 0 reachable) before an update names it, distributed updates run only
//! inside a session, sessions do not nest, a group cannot be created twice, and remote-instance
//! sends need their send group. Every refusal is a 400 with `{success: false, message}`, like
//! SGLang's handlers.
//!
//! Rendezvous: SGLang's `/init_weights_update_group` joins a torch process group whose rank 0
//! (the trainer) listens on `master_address:master_port`, and blocks until it can. The
//! simulator connects to that address (retrying until [`RENDEZVOUS_TIMEOUT`]) and writes one
//! JSON line `{"group_name","rank_offset","tp_size","world_size","engine_port"}` so a stand-in
//! rank 0 can check the group layout; nobody listening there is a failed init.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// How long `/init_weights_update_group` waits for rank 0 to accept.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(5);

/// How long `/update_weights_from_distributed` waits for rank 0's broadcast (NCCL's own
/// timeout is longer; a stand-in rank 0 answers at once).
pub const BROADCAST_TIMEOUT: Duration = Duration::from_secs(120);

/// One weight-update group this engine joined.
/// SGLang 0.5.21-0.5.23's answers about the update session
/// (`managers/scheduler_components/weight_updater.py`, 0.5.23 :187-197, :306-336).
pub const SESSION_OPEN: &str = "a weight-update session is already open; call end_weight_update() first";
pub const NO_SESSION: &str = "no weight-update session is open; call begin_weight_update() first";
pub const OUTSIDE_SESSION: &str =
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()";

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UpdateGroup {
    pub master_address: String,
    pub master_port: u16,
    pub rank_offset: u32,
    pub world_size: u32,
    pub backend: String,
}

/// A remote-instance send group (this engine is the seed).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SendGroup {
    pub master_address: String,
    pub ports: Vec<u16>,
    pub group_rank: u32,
    pub world_size: u32,
    pub backend: String,
    /// Times `/send_weights_to_remote_instance` ran on this group.
    pub sends: u32,
}

#[derive(Debug, Default)]
struct State {
    groups: HashMap<String, UpdateGroup>,
    /// The open session's selector (`target`, `draft` or `all`).
    session: Option<String>,
    send_groups: HashMap<String, SendGroup>,
}

/// Per-engine weight-sync state (a std mutex: never held across an `.await`).
#[derive(Debug, Default)]
pub struct WeightSync {
    state: Mutex<State>,
}

impl WeightSync {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn group(&self, name: &str) -> Option<UpdateGroup> {
        self.lock().groups.get(name).cloned()
    }

    /// The names of the update groups, sorted.
    pub fn group_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.lock().groups.keys().cloned().collect();
        names.sort();
        names
    }

    /// Records a group; refuses a name already in use.
    pub fn add_group(&self, name: &str, g: UpdateGroup) -> Result<(), String> {
        let mut s = self.lock();
        if s.groups.contains_key(name) {
            return Err(format!(
                "Weight update group {name:?} already exists on this engine; destroy it with \
                 /destroy_weights_update_group or use another group_name."
            ));
        }
        s.groups.insert(name.to_string(), g);
        Ok(())
    }

    pub fn remove_group(&self, name: &str) -> Result<UpdateGroup, String> {
        self.lock().groups.remove(name).ok_or_else(|| {
            format!("Weight update group {name:?} does not exist; create it with /init_weights_update_group.")
        })
    }

    pub fn begin(&self, selector: &str) -> Result<(), String> {
        let mut s = self.lock();
        if s.session.is_some() {
            return Err(SESSION_OPEN.into());
        }
        s.session = Some(selector.to_string());
        Ok(())
    }

    pub fn end(&self) -> Result<(), String> {
        let mut s = self.lock();
        if s.session.take().is_none() {
            return Err(NO_SESSION.into());
        }
        Ok(())
    }

    pub fn session(&self) -> Option<String> {
        self.lock().session.clone()
    }

    /// Records a send group. Like SGLang's seed, which makes one group per TP rank named
    /// `<group_name>_<port>_<tp_rank>`, groups are told apart by name *and* ports: several new
    /// instances on one host (the same `send_weights_<host>` name) each get their own.
    pub fn set_send_group(&self, name: &str, g: SendGroup) {
        let key = send_key(name, &g.ports);
        self.lock().send_groups.insert(key, g);
    }

    /// Counts one send on a group whose master address and ports match the init.
    pub fn record_send(&self, name: &str, master_address: &str, ports: &[u16]) -> Result<SendGroup, String> {
        let mut s = self.lock();
        let Some(g) = s.send_groups.get_mut(&send_key(name, ports)) else {
            return Err(format!(
                "Send group {name:?} is not initialized; call /init_weights_send_group_for_remote_instance first."
            ));
        };
        if g.master_address != master_address || g.ports != ports {
            return Err(format!(
                "Send group {name:?} was initialized for {}:{:?}, not {master_address}:{ports:?}.",
                g.master_address, g.ports
            ));
        }
        g.sends += 1;
        Ok(g.clone())
    }

    /// For `/server_info`: groups, session and send groups.
    pub fn snapshot(&self) -> serde_json::Value {
        let s = self.lock();
        serde_json::json!({
            "weight_update_groups": s.groups,
            "weight_update_session": s.session,
            "weight_send_groups": s.send_groups,
        })
    }
}

fn send_key(name: &str, ports: &[u16]) -> String {
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    format!("{name}_{}", ports.join("_"))
}

/// Connects to rank 0 and announces this engine's ranks (see the module docs).
pub async fn rendezvous(addr: &str, port: u16, line: &serde_json::Value) -> Result<(), String> {
    let target = format!("{addr}:{port}");
    let deadline = tokio::time::Instant::now() + RENDEZVOUS_TIMEOUT;
    loop {
        let last = match tokio::net::TcpStream::connect(&target).await {
            Ok(mut s) => {
                let mut text = line.to_string();
                text.push('\n');
                s.write_all(text.as_bytes()).await.map_err(|e| format!("rank 0 at {target}: {e}"))?;
                let _ = s.shutdown().await;
                return Ok(());
            }
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "rank 0 (the trainer) did not accept at {target} within {}s: {last}",
                RENDEZVOUS_TIMEOUT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Receives one broadcast from rank 0: connects to it (retrying until [`BROADCAST_TIMEOUT`],
/// as a rank posted into an NCCL broadcast waits for the root), announces itself with one JSON
/// line, and reads rank 0's line `{"names": [...]}`: the tensors it broadcast, which must be
/// `names`, in order.
pub async fn receive_broadcast(
    addr: &str,
    port: u16,
    line: &serde_json::Value,
    names: &[String],
) -> Result<(), String> {
    use tokio::io::AsyncBufReadExt;
    let target = format!("{addr}:{port}");
    let work = async {
        // A rank posted into an NCCL broadcast starts receiving as soon as the root sends, so
        // the stand-in's listener is polled closely (a coarse poll would charge a wait to every
        // bucket whose receiver is posted before the root).
        let mut stream = loop {
            match tokio::net::TcpStream::connect(&target).await {
                Ok(s) => break s,
                Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        };
        let mut text = line.to_string();
        text.push('\n');
        stream.write_all(text.as_bytes()).await.map_err(|e| format!("rank 0 at {target}: {e}"))?;
        let mut reply = String::new();
        tokio::io::BufReader::new(stream)
            .read_line(&mut reply)
            .await
            .map_err(|e| format!("rank 0 at {target}: {e}"))?;
        let sent: serde_json::Value =
            serde_json::from_str(reply.trim()).map_err(|e| format!("rank 0 at {target} sent no broadcast ({e})"))?;
        let sent: Vec<String> = sent
            .get("names")
            .and_then(|n| n.as_array())
            .map(|n| n.iter().filter_map(|v| v.as_str().map(String::from)).collect())
            .unwrap_or_default();
        if sent != names {
            return Err(format!("rank 0 broadcast {sent:?}; this engine was told to receive {names:?}"));
        }
        Ok(())
    };
    tokio::time::timeout(BROADCAST_TIMEOUT, work).await.unwrap_or_else(|_| {
        Err(format!("rank 0 (the trainer) did not broadcast at {target} within {}s", BROADCAST_TIMEOUT.as_secs()))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn g() -> UpdateGroup {
        UpdateGroup {
            master_address: "127.0.0.1".into(),
            master_port: 1,
            rank_offset: 1,
            world_size: 2,
            backend: "nccl".into(),
        }
    }

    #[test]
    fn groups_and_sessions_follow_sglangs_order() {
        let w = WeightSync::default();
        w.add_group("g", g()).unwrap();
        assert!(w.add_group("g", g()).is_err(), "a group cannot be created twice");
        assert!(w.end().is_err(), "no session to end");
        w.begin("all").unwrap();
        assert!(w.begin("all").is_err(), "sessions do not nest");
        w.end().unwrap();
        assert_eq!(w.remove_group("g").unwrap(), g());
        assert!(w.remove_group("g").is_err());
        assert!(w.record_send("s", "a", &[1]).is_err());
        w.set_send_group(
            "s",
            SendGroup {
                master_address: "a".into(),
                ports: vec![1],
                group_rank: 0,
                world_size: 2,
                backend: "nccl".into(),
                sends: 0,
            },
        );
        assert!(w.record_send("s", "a", &[2]).is_err());
        assert!(w.record_send("s", "b", &[1]).is_err());
        assert_eq!(w.record_send("s", "a", &[1]).unwrap().sends, 1);
        // A second new instance on the same host (same group name), other ports: its own group.
        assert!(w.snapshot()["weight_send_groups"].get("s_1").is_some());
        w.set_send_group(
            "s",
            SendGroup {
                master_address: "a".into(),
                ports: vec![2],
                group_rank: 0,
                world_size: 2,
                backend: "nccl".into(),
                sends: 0,
            },
        );
        assert_eq!(w.record_send("s", "a", &[2]).unwrap().sends, 1);
        assert_eq!(w.record_send("s", "a", &[1]).unwrap().sends, 2, "the first group is still there");
    }
}
