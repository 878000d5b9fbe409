//! NCCL data path (feature `nccl`): the sender is rank 0 of a fresh NCCL communicator and
//! broadcasts each chunk; every receiver is rank 1..N, copies each chunk to the host and writes
//! it through the same verified [`Sink`] as the TCP path.
//!
//! Bootstrap, through our own channel (never torch's TCPStore): the sender opens one relay TCP
//! connection per receiver; the receiver checks that it can run NCCL (libcuda and libnccl load,
//! the device exists) *before* it answers `WELCOME`, so a rank that cannot join fails the
//! handshake instead of hanging the communicator. Only then does rank 0 create the NCCL unique
//! id (`HELLO` carried everything else: rank, world size, chunk size); the id follows
//! in a second `HELLO`-kind frame ([`IdFrame`]). The TCP connections then carry the
//! manifest and, at the end, each receiver's `RESULT`.
//!
//! cudarc loads libcuda and libnccl at run time (`dynamic-loading`), so this builds without
//! CUDA. cudarc looks for `libnccl.so`; the NCCL pip wheel ships only `libnccl.so.2`, so put a
//! `libnccl.so -> libnccl.so.2` link on `LD_LIBRARY_PATH` (use the engines' torch's NCCL).
//!
//! Errors: without a GPU, or without the libraries, [`probe`] returns a message saying what is
//! missing; nothing panics (cudarc panics when a library is absent, so it is probed first).

use crate::chain::Timeouts;
use crate::manifest::Manifest;
use crate::protocol::{
    error_frame, json_frame, read_frame_within, Hello, HopResult, Kind, NcclBootstrap, Transport, Welcome, WireError,
    PROTOCOL_VERSION,
};
use crate::receiver::{read_manifest, Context};
use crate::sender::SendOptions;
use crate::sink::Sink;
use bytes::Bytes;
use cudarc::driver::CudaContext;
use cudarc::nccl::{Comm, Id};
use std::io::Read;
use std::path::Path;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// The unique id, sent after every receiver welcomed the transfer.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct IdFrame {
    /// `ncclUniqueId` bytes, hex.
    pub unique_id: String,
}

/// Checks that CUDA and NCCL can be used on `device`; the error says what is missing.
#[expect(unsafe_code, reason = "cudarc's library probes are unsafe fns; they only try to dlopen")]
pub fn probe(device: usize) -> Result<(), String> {
    // SAFETY: both only attempt to load the shared library and drop it.
    let (cuda, nccl) = unsafe { (cudarc::driver::sys::is_culib_present(), cudarc::nccl::sys::is_culib_present()) };
    if !cuda {
        return Err("the NCCL transport needs a GPU: libcuda could not be loaded (no NVIDIA driver)".into());
    }
    if !nccl {
        return Err("the NCCL transport needs libnccl: none found (link libnccl.so -> libnccl.so.2 from the \
                    NCCL wheel into a directory on LD_LIBRARY_PATH)"
            .into());
    }
    let count = CudaContext::device_count().map_err(|e| format!("cannot count CUDA devices: {e:?}"))?;
    if usize::try_from(count).unwrap_or(0) <= device {
        return Err(format!("CUDA device {device} does not exist ({count} visible)"));
    }
    Ok(())
}

fn id_to_hex(id: &Id) -> String {
    id.internal().iter().map(|b| format!("{:02x}", *b as u8)).collect()
}

fn id_from_hex(s: &str) -> Result<Id, String> {
    if s.len() != 256 {
        return Err(format!("NCCL unique id must be 256 hex digits, got {}", s.len()));
    }
    let mut raw = [0 as std::ffi::c_char; 128];
    for (i, slot) in raw.iter_mut().enumerate() {
        let b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| format!("NCCL unique id: {e}"))?;
        *slot = b as std::ffi::c_char;
    }
    Ok(Id::uninit(raw))
}

/// The chunk schedule both sides walk in lockstep: (file index, offset, length).
fn schedule(manifest: &Manifest, chunk: usize) -> impl Iterator<Item = (usize, u64, usize)> + '_ {
    manifest.files.iter().enumerate().flat_map(move |(i, f)| {
        let chunk = chunk.max(1) as u64;
        (0..f.size.div_ceil(chunk)).map(move |k| {
            let off = k * chunk;
            (i, off, usize::try_from((f.size - off).min(chunk)).unwrap_or(0))
        })
    })
}

/// Rank 0: one NCCL broadcast of `manifest` to every address of `route`.
pub async fn send_once(manifest: &Manifest, source: &Path, route: Vec<String>, opts: &SendOptions) -> Vec<HopResult> {
    let all_failed = |why: String| route.iter().map(|a| HopResult::failed(a.clone(), why.clone())).collect::<Vec<_>>();
    if let Err(e) = probe(0) {
        return all_failed(format!("sender: {e}"));
    }
    let world = route.len() + 1;
    let t = Timeouts { connect: opts.connect_timeout, io: opts.io_timeout };
    let mut conns = Vec::new();
    for (i, addr) in route.iter().enumerate() {
        let hello = Hello {
            version: manifest.version.clone(),
            route: vec![],
            token: opts.token.clone(),
            transport: Transport::Nccl,
            nccl: Some(NcclBootstrap { rank: i + 1, world_size: world, chunk_size: opts.chunk_size }),
        };
        match handshake(addr, &hello, manifest, t).await {
            Ok(s) => conns.push(s),
            Err(e) => {
                for mut s in conns {
                    let _ = s.write_all(&error_frame("another rank could not join")).await;
                }
                return route
                    .iter()
                    .map(|a| {
                        if a == addr {
                            HopResult::failed(a.clone(), e.to_string())
                        } else {
                            HopResult::failed(a.clone(), format!("not delivered: rank at {addr} could not join"))
                        }
                    })
                    .collect();
            }
        }
    }
    let id = match tokio::task::spawn_blocking(Id::new).await {
        Ok(Ok(id)) => id,
        Ok(Err(e)) => return all_failed(format!("ncclGetUniqueId failed: {:?}", e.0)),
        Err(e) => return all_failed(format!("ncclGetUniqueId task failed: {e}")),
    };
    let idf = json_frame(Kind::Hello, &IdFrame { unique_id: id_to_hex(&id) });
    for s in &mut conns {
        if let Err(e) = s.write_all(&idf).await {
            return all_failed(format!("sending the NCCL id: {e}"));
        }
    }
    let (m, dir, chunk) = (manifest.clone(), source.to_path_buf(), opts.chunk_size);
    let broadcast = tokio::task::spawn_blocking(move || root_broadcast(&m, &dir, chunk, world, id)).await;
    let failure = match broadcast {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(e) => Some(format!("broadcast task failed: {e}")),
    };
    let mut out = Vec::with_capacity(route.len());
    for (addr, mut s) in route.iter().zip(conns) {
        if let Some(e) = &failure {
            out.push(HopResult::failed(addr.clone(), format!("sender: {e}")));
            continue;
        }
        let r = read_frame_within(&mut s, opts.io_timeout, "the receiver's result")
            .await
            .and_then(|f| f.expect(Kind::Result, "RESULT"))
            .and_then(|f| f.json::<Vec<HopResult>>("result"));
        out.push(match r {
            Ok(list) => list
                .into_iter()
                .next()
                .map(|h| HopResult { addr: addr.clone(), ..h })
                .unwrap_or_else(|| HopResult::failed(addr.clone(), "no result reported")),
            Err(e) => HopResult::failed(addr.clone(), e.to_string()),
        });
    }
    out
}

async fn handshake(addr: &str, hello: &Hello, manifest: &Manifest, t: Timeouts) -> Result<TcpStream, WireError> {
    let mut s = tokio::time::timeout(t.connect, TcpStream::connect(addr))
        .await
        .map_err(|_| WireError::Timeout(t.connect, "connect"))??;
    s.set_nodelay(true)?;
    s.write_all(&crate::protocol::hello_frame(hello)).await?;
    let w: Welcome =
        read_frame_within(&mut s, t.io, "welcome").await?.expect(Kind::Welcome, "WELCOME")?.json("welcome")?;
    if w.protocol != PROTOCOL_VERSION {
        return Err(WireError::Peer(format!("receiver speaks protocol {}", w.protocol)));
    }
    s.write_all(&json_frame(Kind::Manifest, manifest)).await?;
    Ok(s)
}

fn root_broadcast(manifest: &Manifest, dir: &Path, chunk: usize, world: usize, id: Id) -> Result<(), String> {
    let ctx = CudaContext::new(0).map_err(|e| format!("CUDA context: {e:?}"))?;
    let stream = ctx.default_stream();
    let comm = Comm::from_rank(stream.clone(), 0, world, id).map_err(|e| format!("NCCL init: {:?}", e.0))?;
    let mut dev = stream.alloc_zeros::<u8>(chunk.max(1)).map_err(|e| format!("device alloc: {e:?}"))?;
    let mut host = vec![0u8; chunk.max(1)];
    let mut file: Option<(usize, std::fs::File)> = None;
    for (i, _off, n) in schedule(manifest, chunk) {
        if file.as_ref().map(|(j, _)| *j) != Some(i) {
            let p = dir.join(&manifest.files[i].name);
            file = Some((i, std::fs::File::open(&p).map_err(|e| format!("{}: {e}", p.display()))?));
        }
        if let Some((_, f)) = file.as_mut() {
            f.read_exact(&mut host[..n]).map_err(|e| format!("reading {}: {e}", manifest.files[i].name))?;
        }
        let mut view = dev.slice_mut(..n);
        stream.memcpy_htod(&host[..n], &mut view).map_err(|e| format!("copy to device: {e:?}"))?;
        comm.broadcast_in_place(&mut view, 0).map_err(|e| format!("NCCL broadcast: {:?}", e.0))?;
    }
    stream.synchronize().map_err(|e| format!("CUDA sync: {e:?}"))?;
    Ok(())
}

/// Rank k: joins the communicator, receives every chunk, writes it through the sink.
pub(crate) async fn serve_receiver(mut stream: TcpStream, hello: Hello, ctx: &Context) -> Result<(), WireError> {
    let Some(boot) = hello.nccl.clone() else {
        return Err(refuse(&mut stream, "NCCL transfer without rank information").await);
    };
    let chunk = boot.chunk_size;
    if chunk == 0 || chunk > 64 << 20 || boot.rank == 0 || boot.rank >= boot.world_size {
        return Err(refuse(&mut stream, "bad NCCL bootstrap (rank, world size or chunk size)").await);
    }
    let device = ctx.opts.nccl_device;
    if let Err(e) = probe(device) {
        return Err(refuse(&mut stream, &format!("this receiver cannot join over NCCL: {e}")).await);
    }
    let already = crate::sink::final_dir(&ctx.dest, &hello.version).is_dir();
    stream
        .write_all(&json_frame(Kind::Welcome, &Welcome { protocol: PROTOCOL_VERSION, already_present: already }))
        .await?;
    let (manifest, _) = read_manifest(&mut stream, &hello, ctx).await?;
    let idf =
        read_frame_within(&mut stream, ctx.opts.io_timeout, "the NCCL id").await?.expect(Kind::Hello, "NCCL id")?;
    let id = id_from_hex(&idf.json::<IdFrame>("NCCL id")?.unique_id)
        .map_err(|e| WireError::Malformed { what: "NCCL id", reason: e })?;
    let mut sink = Sink::open(&ctx.dest, &manifest, &ctx.in_progress).map_err(WireError::Peer)?;
    let (tx, mut rx) = mpsc::channel::<(u32, Bytes)>(4);
    let m = manifest.clone();
    let worker = tokio::task::spawn_blocking(move || rank_receive(&m, chunk, device, boot, id, &tx));
    let mut writing = true;
    while let Some((file, data)) = rx.recv().await {
        if writing {
            writing = sink.write(file, data).await;
        }
    }
    let received = worker.await.unwrap_or_else(|e| Err(format!("receive task failed: {e}")));
    let mine = match received {
        Ok(()) => sink.finish().await,
        Err(e) => HopResult::failed("", e),
    };
    stream.write_all(&json_frame(Kind::Result, &vec![mine])).await?;
    stream.shutdown().await?;
    Ok(())
}

fn rank_receive(
    manifest: &Manifest,
    chunk: usize,
    device: usize,
    boot: NcclBootstrap,
    id: Id,
    tx: &mpsc::Sender<(u32, Bytes)>,
) -> Result<(), String> {
    let ctx = CudaContext::new(device).map_err(|e| format!("CUDA context: {e:?}"))?;
    let stream = ctx.default_stream();
    let comm =
        Comm::from_rank(stream.clone(), boot.rank, boot.world_size, id).map_err(|e| format!("NCCL init: {:?}", e.0))?;
    let mut dev = stream.alloc_zeros::<u8>(chunk).map_err(|e| format!("device alloc: {e:?}"))?;
    for (i, _off, n) in schedule(manifest, chunk) {
        let mut view = dev.slice_mut(..n);
        comm.broadcast_in_place(&mut view, 0).map_err(|e| format!("NCCL broadcast: {:?}", e.0))?;
        let mut host = vec![0u8; n];
        stream.memcpy_dtoh(&view, &mut host).map_err(|e| format!("copy to host: {e:?}"))?;
        stream.synchronize().map_err(|e| format!("CUDA sync: {e:?}"))?;
        let idx = u32::try_from(i).map_err(|_| "too many files".to_string())?;
        // A closed channel means the sink stopped; keep participating so rank 0 is not stuck.
        let _ = tx.blocking_send((idx, Bytes::from(host)));
    }
    Ok(())
}

async fn refuse(stream: &mut TcpStream, why: &str) -> WireError {
    let _ = stream.write_all(&error_frame(why)).await;
    WireError::Peer(why.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn ids_survive_hex() {
        let raw: [std::ffi::c_char; 128] = std::array::from_fn(|i| (i as u8).wrapping_mul(7) as std::ffi::c_char);
        let id = Id::uninit(raw);
        let back = id_from_hex(&id_to_hex(&id)).unwrap();
        assert_eq!(back.internal(), id.internal());
        assert!(id_from_hex("abc").is_err());
    }

    #[test]
    fn the_schedule_covers_every_byte_once() {
        let m = Manifest {
            version: "v".into(),
            files: [5u64, 0, 8]
                .iter()
                .enumerate()
                .map(|(i, s)| crate::manifest::FileEntry { name: format!("f{i}"), size: *s, sha256: "0".repeat(64) })
                .collect(),
            checksum: "0".repeat(64),
            skipped: vec![],
        };
        let s: Vec<_> = schedule(&m, 4).collect();
        assert_eq!(s, vec![(0, 0, 4), (0, 4, 1), (2, 0, 4), (2, 4, 4)]);
    }
}
