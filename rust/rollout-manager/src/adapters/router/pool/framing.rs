//! HTTP/1.1 framing of the router's exchanges with engines, without I/O: the request as written
//! ([`Outgoing::encode`]), an answer's head as parsed ([`to_head`]: status, headers, how the body
//! ends, whether the connection can be reused), and the decoding of the body from the bytes
//! read so far ([`Framing::step`]), as RFC 9112 section 6.3 says: no body for HEAD, 1xx, 204
//! and 304; chunked; a Content-Length; else until the engine closes.
//!
//! The connection code (`router::pool`) reads bytes and asks these functions what they are; so
//! every framing decision is tested here on byte strings, and there on sockets.

use super::SendError;
use axum::http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use bytes::{Buf, Bytes, BytesMut};

/// Most headers in an answer's head.
pub(super) const MAX_HEADERS: usize = 128;
/// Longest chunk-size or trailer line of a chunked body.
const MAX_LINE_BYTES: usize = 8 * 1024;
/// A request body up to this size is written in one write with its head (else in a second).
pub(super) const COALESCE_BYTES: usize = 64 * 1024;

/// A request as the router sends it to an engine: `headers` are end-to-end ones only (no
/// `host`, `content-length`, `transfer-encoding` or `connection`; the router strips them).
pub struct Outgoing<'a> {
    pub method: &'a Method,
    /// Origin form: path and query.
    pub target: &'a str,
    pub host: &'a HeaderValue,
    pub headers: &'a HeaderMap,
    pub body: &'a Bytes,
}

impl Outgoing<'_> {
    /// The request line and headers, with the body appended when it is small (then `true`).
    pub(super) fn encode(&self) -> (Vec<u8>, bool) {
        let coalesce = self.body.len() <= COALESCE_BYTES;
        let mut out = Vec::with_capacity(128 + self.headers.len() * 48 + if coalesce { self.body.len() } else { 0 });
        out.extend_from_slice(self.method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        out.extend_from_slice(self.host.as_bytes());
        out.extend_from_slice(b"\r\n");
        for (name, value) in self.headers {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        // As hyper does: a length for every body, and `0` for the methods that carry one.
        let carries_body = matches!(*self.method, Method::POST | Method::PUT | Method::PATCH);
        if !self.body.is_empty() || carries_body {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(self.body.len().to_string().as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if coalesce {
            out.extend_from_slice(self.body);
        }
        (out, coalesce)
    }
}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// This many bytes remain.
    Length(u64),
    /// Chunked transfer coding, at this point of a chunk.
    Chunked(Chunk),
    /// Until the engine closes the connection.
    UntilClose,
    /// Ended (or failed): nothing more comes.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// This many bytes of chunk data remain.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailer,
}

/// What [`Framing::step`] made of the bytes read so far.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// A piece of the body, taken from the buffer.
    Data(Bytes),
    /// Framing bytes (a chunk-size line, a CRLF, a trailer line) were taken: step again.
    Again,
    /// Nothing can be decided before more bytes are read.
    More,
    /// The body ended; the buffer holds what follows it.
    End,
    /// The answer is not valid HTTP/1.1: why.
    Invalid(&'static str),
}

impl Framing {
    /// Takes the next piece of the body, or the framing before it, from the front of `buf`.
    /// The end of a body that runs until close is not seen here: the caller sees the engine close.
    pub(super) fn step(&mut self, buf: &mut BytesMut) -> Step {
        match *self {
            Framing::Done | Framing::Length(0) => Step::End,
            _ if buf.is_empty() => Step::More,
            Framing::Length(left) => {
                let data = take(buf, left);
                *self = Framing::Length(left - data.len() as u64);
                Step::Data(data)
            }
            Framing::UntilClose => Step::Data(buf.split().freeze()),
            Framing::Chunked(Chunk::Size) => match line_end(buf) {
                Some(end) => {
                    let Some(size) = chunk_size(&buf[..end]) else {
                        return Step::Invalid("invalid chunk size line in the engine's answer");
                    };
                    buf.advance(end + 2);
                    *self = Framing::Chunked(if size == 0 { Chunk::Trailer } else { Chunk::Data(size) });
                    Step::Again
                }
                None if buf.len() > MAX_LINE_BYTES => Step::Invalid("chunk size line too long in the engine's answer"),
                None => Step::More,
            },
            Framing::Chunked(Chunk::Data(left)) => {
                let data = take(buf, left);
                let left = left - data.len() as u64;
                *self = Framing::Chunked(if left == 0 { Chunk::DataEnd } else { Chunk::Data(left) });
                Step::Data(data)
            }
            Framing::Chunked(Chunk::DataEnd) if buf.len() < 2 => Step::More,
            Framing::Chunked(Chunk::DataEnd) => {
                if &buf[..2] != b"\r\n" {
                    return Step::Invalid("chunk data not followed by CRLF in the engine's answer");
                }
                buf.advance(2);
                *self = Framing::Chunked(Chunk::Size);
                Step::Again
            }
            Framing::Chunked(Chunk::Trailer) => match line_end(buf) {
                Some(0) => {
                    buf.advance(2);
                    *self = Framing::Done;
                    Step::End
                }
                // Trailer fields are not forwarded (as hyper's server does by default).
                Some(end) => {
                    buf.advance(end + 2);
                    Step::Again
                }
                None if buf.len() > MAX_LINE_BYTES => Step::Invalid("trailer line too long in the engine's answer"),
                None => Step::More,
            },
        }
    }
}

/// Up to `left` bytes from the front of a non-empty `buf`.
fn take(buf: &mut BytesMut, left: u64) -> Bytes {
    let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
    buf.split_to(n).freeze()
}

/// The position of the first CRLF in `buf`.
fn line_end(buf: &[u8]) -> Option<usize> {
    memchr::memmem::find(buf, b"\r\n")
}

/// A chunk-size line's size (extensions after `;` ignored).
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line.split(|b| *b == b';').next()?;
    let digits = std::str::from_utf8(digits).ok()?.trim_end_matches([' ', '\t']);
    if digits.is_empty() || digits.len() > 15 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// The parts of an answer's head the client needs, and how its body is framed.
pub(super) struct Head {
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    pub(super) framing: Framing,
    /// The connection can carry another request once the body ended.
    pub(super) reusable: bool,
}

/// The head of a final answer, or `None` for an interim (1xx) one.
pub(super) fn to_head(parsed: &httparse::Response<'_, '_>, head_request: bool) -> Result<Option<Head>, SendError> {
    let code = parsed.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| SendError::Protocol(format!("status {code}")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(SendError::Protocol("101 Switching Protocols to a request that asked for no upgrade".into()));
    }
    if status.is_informational() {
        return Ok(None);
    }
    let mut headers = HeaderMap::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| SendError::Protocol(format!("header name {:?}", h.name)))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| SendError::Protocol(format!("value of header {:?}", h.name)))?;
        headers.append(name, value);
    }
    let (framing, mut reusable) = framing(status, &headers, head_request)?;
    let http11 = parsed.version == Some(1);
    let close = headers.get_all(CONNECTION).iter().any(|v| has_token(v, "close"));
    reusable &= http11 && !close;
    Ok(Some(Head { status, headers, framing, reusable }))
}

/// How the body of an answer with this status and headers ends (RFC 9112 section 6.3), and
/// whether the connection can be reused after it.
fn framing(status: StatusCode, headers: &HeaderMap, head_request: bool) -> Result<(Framing, bool), SendError> {
    if head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok((Framing::Length(0), true));
    }
    let codings: Vec<&HeaderValue> = headers.get_all(TRANSFER_ENCODING).iter().collect();
    if let Some(last) = codings.last() {
        let chunked = last
            .to_str()
            .ok()
            .and_then(|v| v.rsplit(',').next())
            .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
        // A length next to a transfer coding is ignored, and the connection not reused.
        let reusable = !headers.contains_key(CONTENT_LENGTH);
        return Ok(if chunked { (Framing::Chunked(Chunk::Size), reusable) } else { (Framing::UntilClose, false) });
    }
    let mut length: Option<u64> = None;
    for value in headers.get_all(CONTENT_LENGTH) {
        for part in value.to_str().unwrap_or("x").split(',') {
            let part = part.trim();
            let n: u64 = Some(part)
                .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| SendError::Protocol(format!("content-length {value:?}")))?;
            if length.is_some_and(|l| l != n) {
                return Err(SendError::Protocol("two different content-length values".into()));
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(n) => (Framing::Length(n), true),
        None => (Framing::UntilClose, false),
    })
}

fn has_token(value: &HeaderValue, token: &str) -> bool {
    value.to_str().is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps `framing` over `input` delivered in pieces of `piece` bytes; returns the body, how
    /// it ended, and what is left in the buffer.
    fn decode(mut framing: Framing, input: &[u8], piece: usize) -> (Vec<u8>, Step, Vec<u8>) {
        let mut buf = BytesMut::new();
        let mut rest = input;
        let mut body = Vec::new();
        loop {
            match framing.step(&mut buf) {
                Step::Data(d) => body.extend_from_slice(&d),
                Step::Again => {}
                Step::More if rest.is_empty() => return (body, Step::More, buf.to_vec()),
                Step::More => {
                    let n = piece.min(rest.len());
                    buf.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
                end => {
                    buf.extend_from_slice(rest);
                    return (body, end, buf.to_vec());
                }
            }
        }
    }

    #[test]
    fn a_chunked_body_decodes_the_same_in_any_pieces() {
        let input = b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nx-trailer: 1\r\n\r\nNEXT";
        for piece in [1, 2, 3, 7, 64] {
            let (body, end, left) = decode(Framing::Chunked(Chunk::Size), input, piece);
            assert_eq!(body, b"hello world", "pieces of {piece}");
            assert_eq!(end, Step::End);
            assert_eq!(left, b"NEXT", "the bytes after the body stay for the next answer");
        }
    }

    #[test]
    fn a_length_body_takes_exactly_its_length() {
        for piece in [1, 4, 100] {
            let (body, end, left) = decode(Framing::Length(10), b"0123456789HTTP/1.1", piece);
            assert_eq!((body.as_slice(), end), (&b"0123456789"[..], Step::End));
            assert!(b"HTTP/1.1".starts_with(&left), "pieces of {piece}: {left:?}");
        }
    }

    #[test]
    fn a_body_until_close_takes_all_and_waits_for_more() {
        let (body, end, _) = decode(Framing::UntilClose, b"all of it", 4);
        assert_eq!((body.as_slice(), end), (&b"all of it"[..], Step::More));
    }

    #[test]
    fn malformed_chunked_bodies_are_invalid() {
        for input in [&b"zz\r\n"[..], b"3\r\nabcX\r\n", b"-1\r\n"] {
            let (_, end, _) = decode(Framing::Chunked(Chunk::Size), input, 64);
            assert!(matches!(end, Step::Invalid(_)), "{input:?}: {end:?}");
        }
        let long = vec![b'1'; MAX_LINE_BYTES + 1];
        assert!(matches!(decode(Framing::Chunked(Chunk::Size), &long, 1 << 20).1, Step::Invalid(_)));
        let mut trailer = b"0\r\n".to_vec();
        trailer.extend(vec![b'x'; MAX_LINE_BYTES + 1]);
        assert!(matches!(decode(Framing::Chunked(Chunk::Size), &trailer, 1 << 20).1, Step::Invalid(_)));
    }

    #[test]
    fn chunk_size_lines() {
        assert_eq!(chunk_size(b"1a"), Some(26));
        assert_eq!(chunk_size(b"1A;name=value"), Some(26));
        assert_eq!(chunk_size(b"0"), Some(0));
        assert_eq!(chunk_size(b"10 "), Some(16));
        assert_eq!(chunk_size(b" 10"), None);
        assert_eq!(chunk_size(b"+1"), None);
        assert_eq!(chunk_size(b""), None);
        assert_eq!(chunk_size(b"g"), None);
        assert_eq!(chunk_size(b"1234567890abcdef0"), None);
    }

    fn head(text: &str, head_request: bool) -> Result<Option<Head>, SendError> {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut slots);
        assert!(parsed.parse(text.as_bytes()).unwrap().is_complete());
        to_head(&parsed, head_request)
    }

    #[test]
    fn an_answer_head_says_how_its_body_ends_and_if_the_connection_is_reused() {
        let cases: [(&str, bool, Framing, bool); 8] = [
            ("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", false, Framing::Length(5), true),
            ("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", true, Framing::Length(0), true),
            ("HTTP/1.1 204 No Content\r\n\r\n", false, Framing::Length(0), true),
            ("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", false, Framing::Chunked(Chunk::Size), true),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
                false,
                Framing::Chunked(Chunk::Size),
                false,
            ),
            ("HTTP/1.1 200 OK\r\n\r\n", false, Framing::UntilClose, false),
            ("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n", false, Framing::Length(2), false),
            ("HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n", false, Framing::Length(2), false),
        ];
        for (text, head_request, framing, reusable) in cases {
            let h = head(text, head_request).unwrap().unwrap();
            assert_eq!((h.framing, h.reusable), (framing, reusable), "{text:?}");
        }
        assert!(head("HTTP/1.1 100 Continue\r\n\r\n", false).unwrap().is_none(), "an interim answer");
        for bad in [
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 2, 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        ] {
            assert!(head(bad, false).is_err(), "{bad:?}");
        }
    }
}
