//! An engine's answer on its way to the client: its body streamed frame by frame ([`Tracked`]),
//! holding the engine's in-flight count until it ends, bounded by `--request-timeout-secs`, a
//! stream forwarded in whole events (so a cut ends with an error event of its own); and what
//! the length estimator learns from it ([`Learn`]).

use super::metrics::{ErrorKind, RouterMetrics};
use super::peek;
use super::rids::RidEntry;
use super::send::EngineBody;
use crate::foundation::slots::{Answer, SlotQueue};
use crate::registry::fleet::InFlightGuard;
use bytes::Bytes;
use rollout_core::rids::IdSwap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;

/// A request sent to an engine, as the length estimator follows it: started when sent, ended
/// when dropped, with the answer's token counts if [`Learn::answered`] read them to its end.
pub(super) struct Learn {
    pub(super) queue: Arc<SlotQueue>,
    pub(super) class: Option<u64>,
    pub(super) budget: u64,
    pub(super) prompt: u64,
    /// When it was sent, on the estimator's clock.
    pub(super) at: f64,
    pub(super) usage: peek::Usage,
    pub(super) answered: bool,
}

impl Learn {
    pub(super) fn start(queue: &Arc<SlotQueue>, class: Option<u64>, budget: u64, prompt: u64) -> Self {
        let at = queue.started(class);
        Self { queue: queue.clone(), class, budget, prompt, at, usage: peek::Usage::default(), answered: false }
    }
}

impl Drop for Learn {
    fn drop(&mut self) {
        let answer = match (self.answered, self.usage.completion_tokens) {
            (true, Some(output)) => {
                Some(Answer { budget: self.budget, prompt: self.usage.prompt_tokens.unwrap_or(self.prompt), output })
            }
            _ => None,
        };
        self.queue.ended(self.class, self.at, answer);
    }
}

/// An engine's response body on its way to the client: holds the engine's in-flight count until
/// the body ends (or the client goes away, or the deadline passes and the stream is cut), then
/// records the request's duration.
pub(super) struct Tracked {
    /// The client's own rids, put back where the router's stand in the answer (None: nothing
    /// to replace, the bytes pass as they are).
    pub(super) swap: Option<IdSwap>,
    /// Its places among the requests a client may abort by rid, while it runs.
    pub(super) _entries: Vec<RidEntry>,
    /// Learned lengths: the answer's token counts, observed when it ends.
    pub(super) learn: Option<Learn>,
    pub(super) inner: EngineBody,
    /// The body's first frame, read before the headers were forwarded (see `router::proxy`).
    pub(super) first: Option<http_body::Frame<Bytes>>,
    /// A server-sent-event stream: cut, it ends with an error event the client can read.
    pub(super) sse: bool,
    /// Of a stream, the bytes of an event not yet complete (forwarded once its `\n\n` came):
    /// the client only ever sees whole events, so the error event of a cut never lands in
    /// the middle of one.
    pub(super) partial: bytes::BytesMut,
    pub(super) engine_id: rollout_core::ids::EngineId,
    /// The stream was cut and its error event sent: nothing follows.
    pub(super) closed: bool,
    /// The body was read to its end.
    pub(super) ended: bool,
    pub(super) _guard: InFlightGuard,
    pub(super) started: Instant,
    pub(super) metrics: Arc<RouterMetrics>,
    /// When the whole answer must have ended (`--request-timeout-secs` after it was sent).
    pub(super) deadline: Pin<Box<tokio::time::Sleep>>,
    pub(super) timeout: Duration,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.ended || http_body::Body::is_end_stream(&self.inner) {
            if let Some(l) = &mut self.learn {
                l.answered = true;
            }
        }
        self.metrics.duration.observe(self.started.elapsed());
    }
}

impl Tracked {
    /// `data` with the client's own rids put back (None while all of it is held back, inside
    /// what may be a rid).
    fn swapped(&mut self, data: Bytes) -> Option<Bytes> {
        let Some(swap) = self.swap.as_mut() else { return Some(data) };
        let mut out = Vec::with_capacity(data.len());
        swap.feed(&data, &mut out);
        (!out.is_empty()).then(|| Bytes::from(out))
    }

    /// Ends an answer the router cannot complete: a stream gets a last event in SGLang's own
    /// in-stream error shape (`data: {"error": {message, type, code, retryable}}`, then
    /// `data: [DONE]`), which clients already read; any other body is cut with an error, which
    /// closes the client's connection before the end of the body.
    fn cut(&mut self, why: String, kind: &str, code: u16) -> Result<http_body::Frame<Bytes>, axum::BoxError> {
        if !self.sse {
            return Err(why.into());
        }
        self.closed = true;
        self.ended = false;
        let event = serde_json::json!({
            "error": {"message": format!("{why}; the output so far is incomplete, send the request again"),
                      "type": kind, "code": code, "retryable": true}
        });
        Ok(http_body::Frame::data(Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n"))))
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.closed || self.ended {
            return Poll::Ready(None);
        }
        loop {
            let polled = match self.first.take() {
                Some(first) => Poll::Ready(Some(Ok(first))),
                None => Pin::new(&mut self.inner).poll_frame(cx),
            };
            let Poll::Ready(frame) = polled else { break };
            self.ended = frame.is_none();
            if let (Some(learn), Some(Ok(f))) = (self.learn.as_mut(), frame.as_ref()) {
                if let Some(data) = f.data_ref() {
                    learn.usage.scan(data);
                }
            }
            if let Some(Err(e)) = &frame {
                let why = format!("engine {} stopped in the middle of its answer ({e})", self.engine_id);
                tracing::warn!(engine_id = %self.engine_id, error = %e, "engine's answer was cut");
                return Poll::Ready(Some(self.cut(why, "engine_lost", 502)));
            }
            match frame {
                // The end: what is left of an unterminated event (or of a rid being put back)
                // goes as it is.
                None => {
                    let mut rest = self.partial.split().to_vec();
                    if let Some(swap) = self.swap.as_mut() {
                        let mut out = Vec::with_capacity(rest.len());
                        swap.feed(&rest, &mut out);
                        swap.finish(&mut out);
                        rest = out;
                    }
                    if rest.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from(rest)))));
                }
                Some(Ok(f)) => match f.into_data() {
                    Ok(data) => {
                        let out = if self.sse { whole_events(&mut self.partial, data) } else { Some(data) };
                        if let Some(out) = out.and_then(|out| self.swapped(out)) {
                            return Poll::Ready(Some(Ok(http_body::Frame::data(out))));
                        }
                    }
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
                Some(Err(_)) => unreachable!("handled above"),
            }
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            self.metrics.error(ErrorKind::Timeout);
            tracing::warn!(timeout = ?self.timeout, "engine's answer did not end within --request-timeout-secs; cut");
            let cut = format!("the engine's answer did not end within --request-timeout-secs ({:?})", self.timeout);
            return Poll::Ready(Some(self.cut(cut, "engine_timeout", 504)));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        let holds = !self.partial.is_empty() || self.swap.as_ref().is_some_and(IdSwap::holds);
        self.first.is_none() && (self.closed || (self.inner.is_end_stream() && !holds))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.swap.is_some() {
            // The client's ids put back change the length.
            return http_body::SizeHint::default();
        }
        let rest = self.inner.size_hint();
        let Some(n) = self.first.as_ref().and_then(|f| f.data_ref()).map(|d| d.len() as u64) else { return rest };
        // The upper bound first: a lower bound above the current upper one panics.
        let mut hint = http_body::SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(n));
        }
        hint.set_lower(rest.lower().saturating_add(n));
        hint
    }
}

/// The whole events of a stream so far: `data` after what `partial` holds, up to the last
/// event's end (`\n\n`); the rest stays in `partial`. None while no event is complete. A
/// frame of whole events with nothing held (nearly every frame) passes without a copy.
fn whole_events(partial: &mut bytes::BytesMut, data: Bytes) -> Option<Bytes> {
    if partial.is_empty() && data.ends_with(b"\n\n") {
        return Some(data);
    }
    partial.extend_from_slice(&data);
    let end = partial.windows(2).rposition(|w| w == b"\n\n")? + 2;
    Some(partial.split_to(end).freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_forwarded_in_whole_events() {
        let mut partial = bytes::BytesMut::new();
        let whole = Bytes::from_static(b"data: {\"a\": 1}\n\n");
        assert_eq!(whole_events(&mut partial, whole.clone()), Some(whole));
        assert_eq!(whole_events(&mut partial, Bytes::from_static(b"data: {\"b\"")), None);
        assert_eq!(
            whole_events(&mut partial, Bytes::from_static(b": 2}\n\ndata: {\"c")),
            Some(Bytes::from_static(b"data: {\"b\": 2}\n\n"))
        );
        assert_eq!(&partial[..], b"data: {\"c");
        assert_eq!(
            whole_events(&mut partial, Bytes::from_static(b"\": 3}\n\ndata: [DONE]\n\n")),
            Some(Bytes::from_static(b"data: {\"c\": 3}\n\ndata: [DONE]\n\n"))
        );
        assert!(partial.is_empty());
    }
}
