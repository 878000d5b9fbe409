//! The rids the router sends to engines, and the requests running under them.
//!
//! Every rid an engine gets from the router is one of the router's own
//! (`rollout_core::rids::RidMaker`: one width, so an SGLang abort, which matches by prefix,
//! ends exactly the request it names): a client's own rid is replaced on the way in and shown
//! again in the answer (`rollout_core::rids::IdSwap`), a `/generate` request the router may move
//! gets one, and each part of a moved or chunked request runs under a fresh one.
//!
//! [`Rids`] keeps, by the rid the client knows it by, each request that has one, with the rid
//! its part runs under now, so that a client's `/abort_request {"rid"}` reaches it wherever it
//! runs (moved, continued, between two chunks): the router marks it ([`Live`]), which ends a
//! request it follows part by part at its next step, and asks the engines to abort the rid its
//! part runs under. A rid the router does not know is sent on only if SGLang made it itself
//! (then it is a prefix of no other rid); any other is answered as SGLang answers an unknown one,
//! without reaching an engine, since it may be a prefix of rids it does not mean.

use crate::foundation::locks::Locked;
use rollout_core::rids::{sglang_made, AbortAsk, RidMaker};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The router's rids and the requests that run under them now.
#[derive(Debug)]
pub struct Rids {
    maker: RidMaker,
    next: AtomicU64,
    /// By the rid the client knows the request by (its own, or the router's first one).
    live: Mutex<HashMap<Arc<str>, Vec<Arc<Live>>>>,
}

impl Default for Rids {
    fn default() -> Self {
        Self { maker: RidMaker::new(uuid::Uuid::new_v4().as_u128()), next: AtomicU64::new(0), live: Mutex::default() }
    }
}

/// One request the client may abort by its rid.
#[derive(Debug, Default)]
pub(super) struct Live {
    /// The rid its part runs under on its engine now.
    engine_rid: Mutex<Arc<str>>,
    aborted: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Live {
    /// Whether the client aborted it.
    pub(super) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Resolves once the client aborted it.
    pub(super) async fn aborted(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_aborted() {
                return;
            }
            notified.await;
        }
    }

    /// Its next part runs under `rid`.
    pub(super) fn runs_as(&self, rid: &str) {
        *self.engine_rid.locked() = Arc::from(rid);
    }

    fn abort(&self) -> String {
        self.aborted.store(true, Ordering::Release);
        self.notify.notify_waiters();
        self.engine_rid.locked().to_string()
    }
}

/// What a client's `/abort_request` is sent on as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Forward {
    /// The body as the client sent it (`abort_all`, or a rid SGLang made).
    AsIs,
    /// One abort per rid, to every engine.
    Rids(Vec<String>),
    /// Nothing to send: no request has that rid (SGLang answers 200 and aborts nothing).
    Nothing,
}

impl Rids {
    /// A fresh rid of the router's.
    pub(super) fn next(&self) -> String {
        self.maker.rid(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Follows a request the client knows as `shown` while the returned entry lives; its part
    /// runs under `engine_rid`.
    pub(super) fn enter(self: &Arc<Self>, shown: &str, engine_rid: &str) -> RidEntry {
        let shown: Arc<str> = Arc::from(shown);
        let engine_rid = if *shown == *engine_rid { shown.clone() } else { Arc::from(engine_rid) };
        let live = Arc::new(Live { engine_rid: Mutex::new(engine_rid), ..Live::default() });
        self.live.locked().entry(shown.clone()).or_default().push(live.clone());
        RidEntry { rids: self.clone(), shown, live }
    }

    /// A client's `/abort_request`: marks the requests it names and says what to send engines.
    pub(super) fn abort(&self, ask: &AbortAsk) -> Forward {
        match ask {
            AbortAsk::All => {
                for live in self.live.locked().values().flatten() {
                    live.abort();
                }
                Forward::AsIs
            }
            AbortAsk::Rid(rid) => {
                let rids: Vec<String> =
                    self.live.locked().get(rid.as_str()).into_iter().flatten().map(|live| live.abort()).collect();
                match rids.is_empty() {
                    false => Forward::Rids(rids),
                    true if sglang_made(rid) => Forward::AsIs,
                    true => Forward::Nothing,
                }
            }
            AbortAsk::Nothing => Forward::Nothing,
        }
    }
}

/// A request's place in [`Rids`]; it leaves when this drops.
#[derive(Debug)]
pub(super) struct RidEntry {
    rids: Arc<Rids>,
    shown: Arc<str>,
    pub(super) live: Arc<Live>,
}

impl RidEntry {
    /// The rid the client knows the request by.
    pub(super) fn shown(&self) -> &str {
        &self.shown
    }
}

impl Drop for RidEntry {
    fn drop(&mut self) {
        let mut map = self.rids.live.locked();
        if let Some(entries) = map.get_mut(&*self.shown) {
            entries.retain(|l| !Arc::ptr_eq(l, &self.live));
            if entries.is_empty() {
                map.remove(&*self.shown);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abort_reaches_exactly_the_requests_it_names_wherever_they_run() {
        let rids = Arc::new(Rids::default());
        let (r1, r10, ours) = (rids.next(), rids.next(), rids.next());
        let a = rids.enter("rs-1", &r1);
        let b = rids.enter("rs-10", &r10);
        let c = rids.enter(&ours, &ours);
        // Moved: its part runs under another rid now.
        let moved = rids.next();
        a.live.runs_as(&moved);
        assert_eq!(rids.abort(&AbortAsk::Rid("rs-1".into())), Forward::Rids(vec![moved]));
        assert!(a.live.is_aborted() && !b.live.is_aborted() && !c.live.is_aborted());
        // By the router's rid its answer showed.
        assert_eq!(rids.abort(&AbortAsk::Rid(ours.clone())), Forward::Rids(vec![ours.clone()]));
        assert!(c.live.is_aborted() && !b.live.is_aborted());
        // Unknown: sent on only when SGLang made it (32 hex digits).
        assert_eq!(rids.abort(&AbortAsk::Rid("rs".into())), Forward::Nothing);
        assert_eq!(rids.abort(&AbortAsk::Rid("e".into())), Forward::Nothing);
        let uuid = "e4b3f725dbce4d18af3f9b262cb8e062";
        assert_eq!(rids.abort(&AbortAsk::Rid(uuid.into())), Forward::AsIs);
        assert_eq!(rids.abort(&AbortAsk::Nothing), Forward::Nothing);
        assert_eq!(rids.abort(&AbortAsk::All), Forward::AsIs);
        assert!(b.live.is_aborted());
        drop((a, b, c));
        assert!(rids.live.locked().is_empty());
    }

    #[test]
    fn two_requests_under_one_client_rid_are_both_reached_and_leave_one_by_one() {
        let rids = Arc::new(Rids::default());
        let (x, y) = (rids.next(), rids.next());
        let a = rids.enter("same", &x);
        let b = rids.enter("same", &y);
        drop(a);
        assert_eq!(rids.abort(&AbortAsk::Rid("same".into())), Forward::Rids(vec![y]));
        drop(b);
        assert!(rids.live.locked().is_empty());
    }
}
