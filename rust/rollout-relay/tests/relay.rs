//! The relay end to end on loopback: real receivers, real sockets, broken connections made by
//! a proxy. Nothing asserts on timing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use rollout_relay::protocol::{
    frame, hello_frame, json_frame, read_frame, ChunkBuilder, Hello, HopResult, Kind, Transport,
};
use rollout_relay::{send, Manifest, ReceiverOptions, SendOptions};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Small chunks so a few MB make many chunks; one retry pause of 10 ms.
fn opts() -> SendOptions {
    SendOptions { chunk_size: 256 << 10, retry_backoff: Duration::from_millis(10), ..SendOptions::default() }
}

#[tokio::test]
async fn one_receiver_gets_a_verified_copy() {
    let src = checkpoint("src1");
    let dest = scratch("dest1");
    let r = receiver(&dest).await;
    let report = send("v1", &src, &[r.local_addr()], &opts()).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    assert_eq!(report.attempts, 1);
    assert_eq!(report.receivers[0].bytes, report.bytes);
    assert_eq!(report.checksum, Manifest::build("v1", &src).unwrap().checksum);
    assert_same_files(&src, &dest.join("v1"));
    assert_eq!(entries(&dest), ["v1"], "no partial directory is left");

    // Versions are immutable by name: a second send finds it present and writes nothing.
    let again = send("v1", &src, &[r.local_addr()], &opts()).await.unwrap();
    assert!(again.receivers[0].ok && again.receivers[0].already_present, "{again:?}");
    r.shutdown().await;
}

#[tokio::test]
async fn a_chain_of_three_receivers_all_get_the_version() {
    let src = checkpoint("src3");
    let dests: Vec<_> = (0..3).map(|i| scratch(&format!("dest3-{i}"))).collect();
    let mut rs = Vec::new();
    for d in &dests {
        rs.push(receiver(d).await);
    }
    let chain: Vec<_> = rs.iter().map(|r| r.local_addr()).collect();
    let report = send("v7", &src, &chain, &opts()).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    for (d, rep) in dests.iter().zip(&report.receivers) {
        assert_same_files(&src, &d.join("v7"));
        assert_eq!(rep.attempts, 1);
    }
    assert_eq!(
        report.receivers.iter().map(|r| r.addr.clone()).collect::<Vec<_>>(),
        chain.iter().map(|a| a.to_string()).collect::<Vec<_>>()
    );
    for r in rs {
        r.shutdown().await;
    }
}

#[tokio::test]
async fn a_corrupted_chunk_mid_chain_is_detected_and_only_the_failed_receivers_retry() {
    let src = checkpoint("srcflip");
    let dests: Vec<_> = (0..3).map(|i| scratch(&format!("destflip-{i}"))).collect();
    let mut rs = Vec::new();
    for d in &dests {
        rs.push(receiver(d).await);
    }
    // r1 -> proxy -> r2 -> r3; the proxy flips one byte deep inside the first chunk's data on
    // the first connection only.
    let proxy = Proxy::start(rs[1].local_addr(), &[Fault::Flip(100_000)]).await;
    let chain = [rs[0].local_addr(), proxy.addr, rs[2].local_addr()];
    let report = send("v2", &src, &chain, &opts()).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    assert_eq!(report.attempts, 2);
    let [r1, r2, r3] = &report.receivers[..] else { panic!() };
    assert_eq!((r1.attempts, r2.attempts, r3.attempts), (1, 2, 2), "{report:?}");
    assert!(r2.history[0].contains("corrupted chunk"), "{:?}", r2.history);
    assert!(r3.history[0].contains("not delivered"), "{:?}", r3.history);
    for d in &dests {
        assert_same_files(&src, &d.join("v2"));
        assert_eq!(entries(d), ["v2"]);
    }
    for r in rs {
        r.shutdown().await;
    }
}

#[tokio::test]
async fn a_receiver_that_always_gets_corrupt_data_never_exposes_the_version() {
    let src = checkpoint("srcbad");
    let dest = scratch("destbad");
    let r = receiver(&dest).await;
    let proxy = Proxy::start(r.local_addr(), &[Fault::Flip(300_000); 3]).await;
    let report = send("v3", &src, &[proxy.addr], &opts()).await.unwrap();
    assert!(!report.all_ok());
    let rep = &report.receivers[0];
    assert_eq!(rep.attempts, 3);
    assert_eq!(rep.history.len(), 3);
    assert!(rep.error.as_deref().unwrap().contains("CRC-32"), "{rep:?}");
    wait_until("the partial copy to be removed", || entries(&dest).is_empty()).await;
    r.shutdown().await;
}

#[tokio::test]
async fn a_truncated_connection_is_retried_and_leaves_nothing_partial() {
    let src = checkpoint("srccut");
    let dests: Vec<_> = (0..2).map(|i| scratch(&format!("destcut-{i}"))).collect();
    let r1 = receiver(&dests[0]).await;
    let r2 = receiver(&dests[1]).await;
    let proxy = Proxy::start(r1.local_addr(), &[Fault::Cut(900_000)]).await;
    let report = send("v4", &src, &[proxy.addr, r2.local_addr()], &opts()).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    assert_eq!(report.receivers[0].attempts, 2);
    assert_eq!(report.receivers[1].attempts, 2, "r2 was behind the cut connection");
    for d in &dests {
        assert_same_files(&src, &d.join("v4"));
        assert_eq!(entries(d), ["v4"]);
    }
    r1.shutdown().await;
    r2.shutdown().await;
}

#[tokio::test]
async fn a_stale_manifest_is_caught_by_the_file_hashes() {
    let src = checkpoint("srcstale");
    let manifest = Manifest::build("v5", &src).unwrap();
    // Same size, different bytes: every CRC matches (the sender computes them), the SHA-256 not.
    let shard = src.join("model-00002-of-00002.safetensors");
    std::fs::write(&shard, bytes(700_001, 99)).unwrap();
    let dest = scratch("deststale");
    let r = receiver(&dest).await;
    let o = SendOptions { manifest: Some(manifest), max_attempts: 2, ..opts() };
    let report = send("v5", &src, &[r.local_addr()], &o).await.unwrap();
    let err = report.receivers[0].error.clone().unwrap();
    assert!(err.contains("SHA-256") && err.contains("model-00002"), "{err}");
    wait_until("the partial copy to be removed", || entries(&dest).is_empty()).await;
    r.shutdown().await;
}

#[tokio::test]
async fn a_wrong_token_is_refused() {
    let src = checkpoint("srctok");
    let dest = scratch("desttok");
    let r = receiver_with(&dest, ReceiverOptions { token: Some("s3cret".into()), ..ReceiverOptions::default() }).await;
    let report = send("v1", &src, &[r.local_addr()], &SendOptions { max_attempts: 1, ..opts() }).await.unwrap();
    assert!(report.receivers[0].error.as_deref().unwrap().contains("unauthorized"), "{report:?}");
    let o = SendOptions { token: Some("s3cret".into()), ..opts() };
    assert!(send("v1", &src, &[r.local_addr()], &o).await.unwrap().all_ok());
    r.shutdown().await;
}

/// Speaks the protocol by hand: HELLO, then a manifest.
async fn raw_manifest(addr: std::net::SocketAddr, version: &str, manifest: serde_json::Value) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let hello = Hello { version: version.into(), route: vec![], token: None, transport: Transport::Tcp, nccl: None };
    s.write_all(&hello_frame(&hello)).await.unwrap();
    let first = read_frame(&mut s).await.unwrap();
    if first.kind == Kind::Error {
        return String::from_utf8_lossy(&first.payload()).into_owned();
    }
    assert_eq!(first.kind, Kind::Welcome);
    s.write_all(&json_frame(Kind::Manifest, &manifest)).await.unwrap();
    let f = read_frame(&mut s).await.unwrap();
    assert_eq!(f.kind, Kind::Error, "the receiver must refuse");
    String::from_utf8_lossy(&f.payload()).into_owned()
}

#[tokio::test]
async fn names_that_escape_the_destination_are_refused() {
    let root = scratch("traversal");
    let dest = root.join("dest");
    let r = receiver(&dest).await;
    let sha = "0".repeat(64);
    let evil = serde_json::json!({"version": "v1", "checksum": sha,
        "files": [{"name": "../evil.safetensors", "size": 1, "sha256": sha}]});
    let msg = raw_manifest(r.local_addr(), "v1", evil).await;
    assert!(msg.contains("escape"), "{msg}");
    let msg = raw_manifest(r.local_addr(), "../v1", serde_json::json!({})).await;
    assert!(msg.contains("escape"), "{msg}");
    let slash = serde_json::json!({"version": "v1", "checksum": sha,
        "files": [{"name": "sub/x", "size": 1, "sha256": sha}]});
    assert!(raw_manifest(r.local_addr(), "v1", slash).await.contains("escape"));
    assert!(!root.join("evil.safetensors").exists());
    assert!(entries(&dest).is_empty());
    // The sender refuses such names before connecting.
    assert!(send("../v1", &checkpoint("srctrav"), &[r.local_addr()], &opts()).await.is_err());
    r.shutdown().await;
}

#[tokio::test]
async fn out_of_order_and_short_transfers_are_refused() {
    let dest = scratch("order");
    let r = receiver(&dest).await;
    let src = checkpoint("srcorder");
    let m = Manifest::build("v9", &src).unwrap();
    let send_raw = |frames: Vec<bytes::Bytes>| {
        let (addr, m) = (r.local_addr(), m.clone());
        async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let hello =
                Hello { version: "v9".into(), route: vec![], token: None, transport: Transport::Tcp, nccl: None };
            s.write_all(&hello_frame(&hello)).await.unwrap();
            assert_eq!(read_frame(&mut s).await.unwrap().kind, Kind::Welcome);
            s.write_all(&json_frame(Kind::Manifest, &m)).await.unwrap();
            for f in frames {
                s.write_all(&f).await.unwrap();
            }
            let f = read_frame(&mut s).await.unwrap();
            assert_eq!(f.kind, Kind::Result);
            let results: Vec<HopResult> = f.json("result").unwrap();
            results[0].error.clone().unwrap()
        }
    };
    // A chunk that skips ahead.
    let mut c = ChunkBuilder::new(10);
    c.data_mut().fill(1);
    let err = send_raw(vec![c.finish(0, 10), frame(Kind::End, &[])]).await;
    assert!(err.contains("expected file 0 at offset 0"), "{err}");
    // END before the data.
    let err = send_raw(vec![frame(Kind::End, &[])]).await;
    assert!(err.contains("before every byte"), "{err}");
    assert!(entries(&dest).is_empty());
    r.shutdown().await;
}

#[tokio::test]
async fn shutting_down_mid_transfer_removes_the_partial_copy() {
    let src = checkpoint("srcstall");
    let dest = scratch("deststall");
    let r = receiver(&dest).await;
    // The proxy forwards the start of the transfer, then holds the connection.
    let proxy = Proxy::start(r.local_addr(), &[Fault::Stall(600_000)]).await;
    let o = SendOptions { max_attempts: 1, io_timeout: Duration::from_secs(60), ..opts() };
    let sending = tokio::spawn(async move { send("v6", &src, &[proxy.addr], &o).await });
    wait_until("the partial copy to appear", || entries(&dest) == ["v6.partial"]).await;
    r.shutdown().await;
    assert!(entries(&dest).is_empty(), "{:?}", entries(&dest));
    sending.abort();
}

/// Sends a NCCL-transport HELLO by hand and returns the receiver's ERROR message.
async fn nccl_hello_refusal(addr: std::net::SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let hello = Hello {
        version: "v1".into(),
        route: vec![],
        token: None,
        transport: Transport::Nccl,
        nccl: Some(rollout_relay::protocol::NcclBootstrap { rank: 1, world_size: 2, chunk_size: 1 << 20 }),
    };
    s.write_all(&hello_frame(&hello)).await.unwrap();
    let f = read_frame(&mut s).await.unwrap();
    assert_eq!(f.kind, Kind::Error, "a receiver that cannot run NCCL must refuse in the handshake");
    String::from_utf8_lossy(&f.payload()).into_owned()
}

#[cfg(not(feature = "nccl"))]
#[tokio::test]
async fn without_the_nccl_feature_both_sides_refuse_nccl_clearly() {
    let dest = scratch("no-nccl");
    let r = receiver(&dest).await;
    let msg = nccl_hello_refusal(r.local_addr()).await;
    assert!(msg.contains("built without the `nccl` feature"), "{msg}");
    let o = SendOptions { transport: Transport::Nccl, ..opts() };
    let err = send("v1", &checkpoint("no-nccl-src"), &[r.local_addr()], &o).await.unwrap_err();
    assert!(err.to_string().contains("--features nccl"), "{err}");
    assert!(entries(&dest).is_empty());
    r.shutdown().await;
}

#[cfg(feature = "nccl")]
#[tokio::test]
async fn a_receiver_without_a_gpu_refuses_nccl_in_the_handshake() {
    if rollout_relay::nccl::probe(0).is_ok() {
        eprintln!("a GPU is present: this test covers the no-GPU path only");
        return;
    }
    let dest = scratch("nccl-refuse");
    let r = receiver(&dest).await;
    let msg = nccl_hello_refusal(r.local_addr()).await;
    assert!(msg.contains("cannot join over NCCL") && msg.contains("needs a GPU"), "{msg}");
    assert!(entries(&dest).is_empty());
    r.shutdown().await;
}

#[tokio::test]
async fn a_version_that_cannot_fit_is_refused_before_anything_is_written() {
    let dest = scratch("nospace");
    let r = receiver(&dest).await;
    let sha = "0".repeat(64);
    // A well-formed manifest: its checksum is the one its file hash gives.
    let checksum = rollout_relay::manifest::version_checksum([("model.safetensors", sha.as_str())]);
    let huge = serde_json::json!({"version": "v1", "checksum": checksum,
        "files": [{"name": "model.safetensors", "size": 1u64 << 60, "sha256": sha}]});
    let msg = raw_manifest(r.local_addr(), "v1", huge).await;
    assert!(msg.contains("not enough space"), "{msg}");
    assert!(entries(&dest).is_empty());
    r.shutdown().await;
}

#[tokio::test]
async fn a_manifest_whose_checksum_its_files_do_not_give_is_refused() {
    let dest = scratch("forged");
    let r = receiver(&dest).await;
    let sha = "0".repeat(64);
    let forged = serde_json::json!({"version": "v1", "checksum": "1".repeat(64),
        "files": [{"name": "model.safetensors", "size": 4, "sha256": sha}]});
    let msg = raw_manifest(r.local_addr(), "v1", forged).await;
    assert!(msg.contains("not the one its files"), "{msg}");
    assert!(entries(&dest).is_empty());
    r.shutdown().await;
}

#[tokio::test]
async fn a_hop_that_already_holds_the_version_still_forwards_it() {
    let src = checkpoint("srcpresent");
    let dests: Vec<_> = (0..2).map(|i| scratch(&format!("destpresent-{i}"))).collect();
    let r1 = receiver(&dests[0]).await;
    let r2 = receiver(&dests[1]).await;
    assert!(send("v1", &src, &[r1.local_addr()], &opts()).await.unwrap().all_ok());
    let report = send("v1", &src, &[r1.local_addr(), r2.local_addr()], &opts()).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    assert!(report.receivers[0].already_present && report.receivers[0].bytes == 0);
    assert!(!report.receivers[1].already_present && report.receivers[1].bytes == report.bytes);
    assert_same_files(&src, &dests[1].join("v1"));
    r1.shutdown().await;
    r2.shutdown().await;
}

/// Sends `version` of `src` to `r` again and says whether the receiver reused its copy; the
/// copy must equal `src` afterwards either way.
async fn resend(
    version: &str,
    src: &std::path::Path,
    r: &rollout_relay::ReceiverHandle,
    dest: &std::path::Path,
) -> bool {
    let report = send(version, src, &[r.local_addr()], &opts()).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    let rep = &report.receivers[0];
    assert_eq!(rep.bytes, if rep.already_present { 0 } else { report.bytes }, "{report:?}");
    assert_same_files(src, &dest.join(version));
    assert_eq!(entries(dest), [version], "no partial directory is left");
    rep.already_present
}

#[tokio::test]
async fn an_existing_copy_is_reused_only_when_it_matches_the_manifest() {
    use rollout_relay::manifest::MARKER;
    let src = checkpoint("srcreuse");
    let dest = scratch("destreuse");
    let r = receiver(&dest).await;
    let copy = dest.join("v1");
    let shard = "model-00002-of-00002.safetensors";
    assert!(!resend("v1", &src, &r, &dest).await, "first transfer");
    assert!(resend("v1", &src, &r, &dest).await, "an intact copy is reused");

    // A copy without its marker (e.g. written by something else) is not trusted.
    std::fs::remove_file(copy.join(MARKER)).unwrap();
    assert!(!resend("v1", &src, &r, &dest).await, "no marker");
    // A truncated file, a missing file, an extra file.
    std::fs::write(copy.join(shard), b"short").unwrap();
    assert!(!resend("v1", &src, &r, &dest).await, "a file of another size");
    std::fs::remove_file(copy.join("config.json")).unwrap();
    assert!(!resend("v1", &src, &r, &dest).await, "a missing file");
    std::fs::write(copy.join("extra.safetensors"), b"x").unwrap();
    assert!(!resend("v1", &src, &r, &dest).await, "an extra file");
    // A marker that does not parse.
    std::fs::write(copy.join(MARKER), b"{").unwrap();
    assert!(!resend("v1", &src, &r, &dest).await, "an unreadable marker");
    // The same name sent with other bytes (same sizes): the marker's manifest differs.
    std::fs::write(src.join(shard), bytes(700_001, 42)).unwrap();
    assert!(!resend("v1", &src, &r, &dest).await, "another manifest under the same name");
    assert!(resend("v1", &src, &r, &dest).await, "and that copy is reused in turn");
    // A plain file where the version directory should be.
    std::fs::remove_dir_all(&copy).unwrap();
    std::fs::write(&copy, b"not a directory").unwrap();
    assert!(!resend("v1", &src, &r, &dest).await, "a file in the way");
    r.shutdown().await;
}

#[tokio::test]
async fn a_received_copy_can_be_sent_on_as_a_source() {
    let src = checkpoint("srchop");
    let (d1, d2) = (scratch("desthop-1"), scratch("desthop-2"));
    let r1 = receiver(&d1).await;
    let r2 = receiver(&d2).await;
    assert!(send("v1", &src, &[r1.local_addr()], &opts()).await.unwrap().all_ok());
    // The marker is not part of the version: the copy's manifest is the source's.
    assert_eq!(Manifest::build("v1", &d1.join("v1")).unwrap().files, Manifest::build("v1", &src).unwrap().files);
    let report = send("v1", &d1.join("v1"), &[r2.local_addr()], &opts()).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    assert_same_files(&src, &d2.join("v1"));
    r1.shutdown().await;
    r2.shutdown().await;
}

#[tokio::test]
async fn dropping_the_handle_stops_the_receiver_and_its_transfers() {
    let src = checkpoint("srcdrop");
    let dest = scratch("destdrop");
    let r = receiver(&dest).await;
    let addr = r.local_addr();
    // A transfer held open mid-way by a stalled proxy, then the handle dropped without
    // `shutdown`: the listener and the connection task go away, and so does the partial copy.
    let proxy = Proxy::start(addr, &[Fault::Stall(600_000)]).await;
    let o = SendOptions { max_attempts: 1, io_timeout: Duration::from_secs(60), ..opts() };
    let sending = tokio::spawn(async move { send("v1", &src, &[proxy.addr], &o).await });
    wait_until("the transfer to start", || entries(&dest) == ["v1.partial"]).await;
    drop(r);
    wait_until("the partial copy to be removed", || entries(&dest).is_empty()).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(tokio::time::Instant::now() < deadline, "the receiver still accepts connections");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sending.abort();
}
