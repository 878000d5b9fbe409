//! The NCCL transport (built with `--features nccl`). Without a GPU it must fail cleanly, on
//! both sides; with two or more GPUs, `cargo test -p rollout-relay --features nccl -- --ignored`
//! broadcasts a real checkpoint (one process, rank 0 on device 0, the receiver on device 1).

#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use rollout_relay::{send, ReceiverOptions, SendOptions, Transport};

fn gpus() -> usize {
    if rollout_relay::nccl::probe(0).is_err() {
        return 0;
    }
    cudarc::driver::CudaContext::device_count().map(|n| n as usize).unwrap_or(0)
}

#[tokio::test]
async fn without_a_gpu_the_nccl_transport_says_so() {
    if gpus() > 0 {
        eprintln!("a GPU is present: this test covers the no-GPU path only");
        return;
    }
    let err = rollout_relay::nccl::probe(0).unwrap_err();
    assert!(err.contains("needs a GPU") || err.contains("libnccl"), "{err}");
    let src = checkpoint("nccl-src");
    let dest = scratch("nccl-dest");
    let r = receiver(&dest).await;
    let o = SendOptions { transport: Transport::Nccl, max_attempts: 1, ..SendOptions::default() };
    let report = send("v1", &src, &[r.local_addr()], &o).await.unwrap();
    let e = report.receivers[0].error.clone().unwrap();
    assert!(e.contains("needs a GPU") || e.contains("libnccl"), "{e}");
    assert!(entries(&dest).is_empty());
    r.shutdown().await;
}

#[tokio::test]
#[ignore = "needs two GPUs and libnccl"]
async fn nccl_broadcast_delivers_a_verified_copy() {
    if gpus() < 2 {
        eprintln!("skipped: fewer than two CUDA devices");
        return;
    }
    let src = checkpoint("nccl-gpu-src");
    let dest = scratch("nccl-gpu-dest");
    // The in-process receiver must not share rank 0's device.
    let r = receiver_with(&dest, ReceiverOptions { nccl_device: 1, ..ReceiverOptions::default() }).await;
    let o = SendOptions { transport: Transport::Nccl, chunk_size: 256 << 10, ..SendOptions::default() };
    let report = send("v1", &src, &[r.local_addr()], &o).await.unwrap();
    assert!(report.all_ok(), "{report:?}");
    assert_same_files(&src, &dest.join("v1"));
    r.shutdown().await;
}

/// What one GPU can show (benches/gpu/run.sh): cudarc loads libcuda and libnccl, a one-rank NCCL
/// communicator forms from a fresh unique id, and a broadcast from rank 0 leaves the device
/// buffer intact through a host round trip, for every chunk size the relay uses.
#[test]
#[ignore = "needs a GPU and libnccl"]
fn a_one_rank_communicator_broadcasts_on_one_gpu() {
    if gpus() < 1 {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let id = cudarc::nccl::Id::new().unwrap();
    let comm = cudarc::nccl::Comm::from_rank(stream.clone(), 0, 1, id).map_err(|e| format!("{:?}", e.0)).unwrap();
    for size in [1usize << 10, 256 << 10, 4 << 20, 64 << 20] {
        let host: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let mut dev = stream.alloc_zeros::<u8>(size).unwrap();
        stream.memcpy_htod(&host, &mut dev).unwrap();
        let started = std::time::Instant::now();
        comm.broadcast_in_place(&mut dev, 0).map_err(|e| format!("{:?}", e.0)).unwrap();
        stream.synchronize().unwrap();
        let took = started.elapsed();
        let mut back = vec![0u8; size];
        stream.memcpy_dtoh(&dev, &mut back).unwrap();
        stream.synchronize().unwrap();
        assert_eq!(back, host, "{size} bytes changed in a one-rank broadcast");
        println!("one-rank NCCL broadcast of {size} bytes: {:.1} us", took.as_secs_f64() * 1e6);
    }
}
