//! The relay's wire format: length-prefixed binary frames over one TCP connection per hop.
//!
//! Every frame is a 5-byte header, `kind: u8` then `len: u32` (big endian), followed by `len`
//! payload bytes. Control payloads are JSON; chunk payloads are binary.
//!
//! | kind | name | direction | payload |
//! |---|---|---|---|
//! | 1 | `HELLO` | upstream -> downstream | `b"ERLY"`, `protocol: u16` (BE), then JSON [`Hello`] (NCCL: a second one carries the unique id) |
//! | 2 | `WELCOME` | downstream -> upstream | JSON [`Welcome`] |
//! | 3 | `MANIFEST` | upstream -> downstream | JSON [`Manifest`](crate::manifest::Manifest) |
//! | 4 | `CHUNK` | upstream -> downstream | `file: u32`, `offset: u64`, `crc32: u32` (BE), then the bytes |
//! | 5 | `END` | upstream -> downstream | empty: every chunk was sent |
//! | 6 | `RESULT` | downstream -> upstream | JSON list of [`HopResult`], this hop first |
//! | 7 | `ERROR` | either way | JSON [`ErrorBody`]: the connection is given up |
//!
//! Limits (checked before anything is allocated or written): control frames at most
//! [`MAX_CONTROL_FRAME`] bytes, chunks at most [`MAX_CHUNK`], at most [`MAX_FILES`] files,
//! names at most [`MAX_NAME_LEN`] bytes and never containing `/`, `\`, NUL or `..`, a route of
//! at most [`MAX_ROUTE`] hops. A peer speaking another protocol version gets an `ERROR` naming
//! both versions.

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First bytes of every `HELLO`.
pub const MAGIC: [u8; 4] = *b"ERLY";
/// Version of this wire format; a receiver refuses any other.
pub const PROTOCOL_VERSION: u16 = 1;
/// Frame header: kind (1) + payload length (4).
pub const HEADER_LEN: usize = 5;
/// Chunk payload header: file index (4) + offset (8) + crc32 (4).
pub const CHUNK_HEADER_LEN: usize = 16;
/// Largest JSON control frame (a manifest of [`MAX_FILES`] long names fits).
pub const MAX_CONTROL_FRAME: u32 = 16 << 20;
/// Largest chunk payload (data plus its 16-byte header).
pub const MAX_CHUNK: u32 = (64 << 20) + CHUNK_HEADER_LEN as u32;
/// Most files in one version.
pub const MAX_FILES: usize = 10_000;
/// Longest file or version name, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Most hops after the first receiver.
pub const MAX_ROUTE: usize = 256;

/// Frame kinds (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Hello = 1,
    Welcome = 2,
    Manifest = 3,
    Chunk = 4,
    End = 5,
    Result = 6,
    Error = 7,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Manifest,
            4 => Kind::Chunk,
            5 => Kind::End,
            6 => Kind::Result,
            7 => Kind::Error,
            _ => return None,
        })
    }

    /// Largest payload a frame of this kind may carry.
    fn max_len(self) -> u32 {
        match self {
            Kind::Chunk => MAX_CHUNK,
            Kind::End => 0,
            _ => MAX_CONTROL_FRAME,
        }
    }
}

/// Which data path a transfer uses after the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Chunks flow down the TCP chain (this connection).
    #[default]
    Tcp,
    /// Chunks are broadcast over NCCL; this connection carries the NCCL id and the results.
    Nccl,
}

/// `HELLO`: who is sending what, and where to forward it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// The version name (also the directory name on the receiver).
    pub version: String,
    /// Receivers after this one, in order (`host:port`).
    #[serde(default)]
    pub route: Vec<String>,
    /// Shared secret, when the receiver was started with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    #[serde(default)]
    pub transport: Transport,
    /// NCCL only: this receiver's rank, the world size and the chunk size (the
    /// unique id follows once every rank welcomed the transfer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<NcclBootstrap>,
}

/// What an NCCL receiver needs to join the sender's communicator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NcclBootstrap {
    pub rank: usize,
    pub world_size: usize,
    /// Bytes per broadcast; both sides walk the same chunk schedule.
    pub chunk_size: usize,
}

/// `WELCOME`: the receiver accepted the handshake.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    pub protocol: u16,
    /// A directory of this version's name exists at the receiver (a hint: whether it is
    /// reused is decided once the manifest arrived, and reported in the `RESULT`).
    #[serde(default)]
    pub already_present: bool,
}

/// One receiver's outcome, as reported back up the chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HopResult {
    /// The address this hop was reached at (as its upstream named it).
    pub addr: String,
    pub ok: bool,
    /// Bytes written locally (0 when the version was already present).
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub already_present: bool,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl HopResult {
    pub fn failed(addr: impl Into<String>, error: impl Into<String>) -> HopResult {
        HopResult { addr: addr.into(), ok: false, bytes: 0, already_present: false, error: Some(error.into()) }
    }
}

/// `ERROR` payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    pub message: String,
}

/// A protocol or transport failure on one connection.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection error: {0}")]
    Io(#[from] std::io::Error),
    #[error("the peer closed the connection")]
    Closed,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { kind: Kind, len: u32, max: u32 },
    #[error("expected a {expected} frame, got {got:?}")]
    Unexpected { expected: &'static str, got: Kind },
    #[error("malformed {what}: {reason}")]
    Malformed { what: &'static str, reason: String },
    #[error("peer reported an error: {0}")]
    Peer(String),
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, &'static str),
}

/// One received frame: the whole frame (header included, so it can be forwarded as is) and
/// where its payload starts.
#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: Kind,
    pub raw: Bytes,
}

impl Frame {
    pub fn payload(&self) -> Bytes {
        self.raw.slice(HEADER_LEN..)
    }

    /// Decodes a JSON payload.
    pub fn json<T: serde::de::DeserializeOwned>(&self, what: &'static str) -> Result<T, WireError> {
        serde_json::from_slice(&self.raw[HEADER_LEN..])
            .map_err(|e| WireError::Malformed { what, reason: e.to_string() })
    }

    /// Turns an `ERROR` frame into [`WireError::Peer`]; other frames pass through.
    pub fn check_error(self) -> Result<Frame, WireError> {
        if self.kind == Kind::Error {
            let body: ErrorBody =
                self.json("error frame").unwrap_or_else(|e| ErrorBody { message: format!("unreadable: {e}") });
            return Err(WireError::Peer(body.message));
        }
        Ok(self)
    }

    pub fn expect(self, kind: Kind, expected: &'static str) -> Result<Frame, WireError> {
        let f = self.check_error()?;
        if f.kind != kind {
            return Err(WireError::Unexpected { expected, got: f.kind });
        }
        Ok(f)
    }
}

/// Reads one frame; `Err(Closed)` on a clean end of stream before the header.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Frame, WireError> {
    let mut header = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r.read(&mut header[got..]).await?;
        if n == 0 {
            return Err(if got == 0 {
                WireError::Closed
            } else {
                WireError::Io(std::io::ErrorKind::UnexpectedEof.into())
            });
        }
        got += n;
    }
    let kind = Kind::from_u8(header[0]).ok_or(WireError::UnknownKind(header[0]))?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    if len > kind.max_len() {
        return Err(WireError::TooLarge { kind, len, max: kind.max_len() });
    }
    let total = HEADER_LEN + len as usize;
    let mut buf = BytesMut::with_capacity(total);
    buf.extend_from_slice(&header);
    // Reads into spare capacity (no zero fill); capacity is exactly the frame, so a read never
    // takes bytes of the next frame.
    while buf.len() < total {
        let n = r.read_buf(&mut buf).await?;
        if n == 0 {
            return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
    }
    Ok(Frame { kind, raw: buf.freeze() })
}

/// [`read_frame`] with a deadline.
pub async fn read_frame_within<R: AsyncRead + Unpin>(
    r: &mut R,
    timeout: Duration,
    what: &'static str,
) -> Result<Frame, WireError> {
    tokio::time::timeout(timeout, read_frame(r)).await.map_err(|_| WireError::Timeout(timeout, what))?
}

/// A frame with an arbitrary payload.
pub fn frame(kind: Kind, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + payload.len());
    b.put_u8(kind as u8);
    b.put_u32(u32::try_from(payload.len()).unwrap_or(u32::MAX));
    b.extend_from_slice(payload);
    b.freeze()
}

/// A JSON control frame.
pub fn json_frame<T: Serialize>(kind: Kind, value: &T) -> Bytes {
    // Serialising these plain structs cannot fail; an empty payload would be refused by the peer.
    frame(kind, &serde_json::to_vec(value).unwrap_or_default())
}

/// A `HELLO` frame.
pub fn hello_frame(hello: &Hello) -> Bytes {
    let mut payload = Vec::with_capacity(256);
    payload.extend_from_slice(&MAGIC);
    payload.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    payload.extend_from_slice(&serde_json::to_vec(hello).unwrap_or_default());
    frame(Kind::Hello, &payload)
}

/// Parses a `HELLO`, checking the magic and protocol version.
pub fn parse_hello(f: &Frame) -> Result<Hello, WireError> {
    let p = &f.raw[HEADER_LEN..];
    if p.len() < 6 || p[..4] != MAGIC {
        return Err(WireError::Malformed { what: "hello", reason: "not an Elastic Rollout relay peer".into() });
    }
    let proto = u16::from_be_bytes([p[4], p[5]]);
    if proto != PROTOCOL_VERSION {
        return Err(WireError::Malformed {
            what: "hello",
            reason: format!("peer speaks relay protocol {proto}, this receiver speaks {PROTOCOL_VERSION}"),
        });
    }
    serde_json::from_slice(&p[6..]).map_err(|e| WireError::Malformed { what: "hello", reason: e.to_string() })
}

pub fn error_frame(message: impl Into<String>) -> Bytes {
    json_frame(Kind::Error, &ErrorBody { message: message.into() })
}

/// A chunk frame: header, chunk header and `data`, in one buffer, so the data is never copied
/// after it was read (see [`ChunkBuilder::read_from`], or fill [`ChunkBuilder::data_mut`]).
pub struct ChunkBuilder {
    buf: Vec<u8>,
}

impl ChunkBuilder {
    /// Room for `data_len` bytes of data (zeroed).
    pub fn new(data_len: usize) -> ChunkBuilder {
        ChunkBuilder { buf: vec![0; HEADER_LEN + CHUNK_HEADER_LEN + data_len] }
    }

    /// Exactly `data_len` bytes read from `r` into the frame's data area: one copy (the read
    /// itself), no zero fill first. Fails with `UnexpectedEof` if `r` ends early.
    pub fn read_from(r: &mut impl std::io::Read, data_len: usize) -> std::io::Result<ChunkBuilder> {
        let total = HEADER_LEN + CHUNK_HEADER_LEN + data_len;
        let mut buf = Vec::with_capacity(total);
        buf.resize(HEADER_LEN + CHUNK_HEADER_LEN, 0);
        // `read_to_end` reads into the vector's spare capacity without initialising it; the
        // capacity is exact, so the buffer is never reallocated.
        std::io::Read::read_to_end(&mut std::io::Read::take(r, data_len as u64), &mut buf)?;
        if buf.len() != total {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(ChunkBuilder { buf })
    }

    /// The data area, to be filled by the caller.
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.buf[HEADER_LEN + CHUNK_HEADER_LEN..]
    }

    /// Fills in the headers (the crc is computed over the data) and returns the frame.
    pub fn finish(mut self, file: u32, offset: u64) -> Bytes {
        let crc = crc32fast::hash(&self.buf[HEADER_LEN + CHUNK_HEADER_LEN..]);
        let payload_len = u32::try_from(self.buf.len() - HEADER_LEN).unwrap_or(u32::MAX);
        self.buf[0] = Kind::Chunk as u8;
        self.buf[1..5].copy_from_slice(&payload_len.to_be_bytes());
        self.buf[5..9].copy_from_slice(&file.to_be_bytes());
        self.buf[9..17].copy_from_slice(&offset.to_be_bytes());
        self.buf[17..21].copy_from_slice(&crc.to_be_bytes());
        // Takes the vector's allocation as is (no copy).
        Bytes::from(self.buf)
    }
}

/// A decoded chunk header; `data` shares the frame's buffer.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub file: u32,
    pub offset: u64,
    pub crc32: u32,
    pub data: Bytes,
}

impl Chunk {
    pub fn parse(f: &Frame) -> Result<Chunk, WireError> {
        let p = &f.raw[HEADER_LEN..];
        if p.len() < CHUNK_HEADER_LEN {
            return Err(WireError::Malformed { what: "chunk", reason: format!("{} bytes is too short", p.len()) });
        }
        let file = u32::from_be_bytes([p[0], p[1], p[2], p[3]]);
        let offset = u64::from_be_bytes([p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11]]);
        let crc32 = u32::from_be_bytes([p[12], p[13], p[14], p[15]]);
        Ok(Chunk { file, offset, crc32, data: f.raw.slice(HEADER_LEN + CHUNK_HEADER_LEN..) })
    }

    /// Whether the data matches the checksum the sender computed.
    pub fn verify(&self) -> bool {
        crc32fast::hash(&self.data) == self.crc32
    }
}

/// Writes a whole frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8]) -> Result<(), WireError> {
    w.write_all(frame).await?;
    Ok(())
}

/// Why a file or version name is refused (`None` when it is acceptable).
pub fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("the name is empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Some(format!("the name is {} bytes long, the limit is {MAX_NAME_LEN}", name.len()));
    }
    if name.contains(['/', '\\', '\0']) || name.contains("..") || name == "." {
        return Some(format!("{name:?} could escape its directory: names may not contain '/', '\\', NUL or '..'"));
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_chunk_read_in_place_is_the_chunk_filled_by_hand() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let mut by_hand = ChunkBuilder::new(3000);
        by_hand.data_mut().copy_from_slice(&data[..3000]);
        let mut src = &data[..];
        let read = ChunkBuilder::read_from(&mut src, 3000).unwrap();
        assert_eq!(read.finish(2, 40), by_hand.finish(2, 40));
        assert_eq!(src.len(), 2000, "reads exactly the chunk, nothing after it");
        let mut short = &data[..10];
        let e = ChunkBuilder::read_from(&mut short, 11).err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn frames_round_trip_and_limits_hold() {
        let hello = Hello {
            version: "v1".into(),
            route: vec!["127.0.0.1:1".into()],
            token: None,
            transport: Transport::Tcp,
            nccl: None,
        };
        let mut c = ChunkBuilder::new(3);
        c.data_mut().copy_from_slice(b"abc");
        let mut wire = Vec::new();
        wire.extend_from_slice(&hello_frame(&hello));
        wire.extend_from_slice(&c.finish(2, 40));
        wire.extend_from_slice(&frame(Kind::End, &[]));
        let mut r = &wire[..];
        let h = parse_hello(&read_frame(&mut r).await.unwrap()).unwrap();
        assert_eq!(h.route, vec!["127.0.0.1:1"]);
        let f = read_frame(&mut r).await.unwrap();
        let chunk = Chunk::parse(&f).unwrap();
        assert_eq!((chunk.file, chunk.offset, &chunk.data[..]), (2, 40, &b"abc"[..]));
        assert!(chunk.verify());
        assert_eq!(read_frame(&mut r).await.unwrap().kind, Kind::End);
        assert!(matches!(read_frame(&mut r).await, Err(WireError::Closed)));

        // An oversized control frame is refused from its header alone.
        let mut big = vec![Kind::Manifest as u8];
        big.extend_from_slice(&(MAX_CONTROL_FRAME + 1).to_be_bytes());
        assert!(matches!(read_frame(&mut &big[..]).await, Err(WireError::TooLarge { .. })));
        assert!(matches!(read_frame(&mut &[99u8, 0, 0, 0, 0][..]).await, Err(WireError::UnknownKind(99))));
        // A truncated frame is an error, not a short frame.
        let short = &frame(Kind::Manifest, b"{}12345")[..8];
        assert!(matches!(read_frame(&mut &short[..]).await, Err(WireError::Io(_))));
    }

    #[test]
    fn other_protocol_versions_are_named_in_the_refusal() {
        let mut payload = MAGIC.to_vec();
        payload.extend_from_slice(&7u16.to_be_bytes());
        payload.extend_from_slice(b"{}");
        let f = Frame { kind: Kind::Hello, raw: frame(Kind::Hello, &payload) };
        let err = parse_hello(&f).unwrap_err().to_string();
        assert!(err.contains("protocol 7") && err.contains("speaks 1"), "{err}");
    }

    #[test]
    fn names_that_escape_are_refused() {
        for bad in ["", "..", "../x", "a/b", "a\\b", "x..y", ".", "a\0b"] {
            assert!(name_problem(bad).is_some(), "{bad:?}");
        }
        assert!(name_problem(&"x".repeat(MAX_NAME_LEN + 1)).is_some());
        for good in ["model-00001-of-00002.safetensors", "config.json", "v3", ".hidden"] {
            assert!(name_problem(good).is_none(), "{good:?}");
        }
    }
}
