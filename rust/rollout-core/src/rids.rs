//! The request ids (`rid`) the router sends to engines, and the ids clients see.
//!
//! SGLang aborts every request whose rid *starts with* the rid an `/abort_request` names (its
//! scheduler's waiting queue and running batch; its front end passes on only a rid it holds
//! exactly). Client rids (`rs-1` and `rs-10`) and suffixed rids (`<rid>-m1`) can be prefixes of
//! one another, so one abort would end requests nobody asked to end. The router therefore sends
//! engines only rids of its own ([`RidMaker`]): all of one width, a prefix drawn once per run
//! and a counter, so that no two are prefixes of each other. They start with `er`, which no rid
//! SGLang makes itself (32 hex digits of a uuid4, [`sglang_made`]) starts with, and they are
//! longer than those, so neither kind is a prefix of the other. SGLang's own suffixes
//! (`<rid>_<i>` for each prompt of a batch, or each sample of `n`) keep the property: a router
//! rid is a prefix only of its own suffixed rids, which an abort of it should end.
//!
//! A client's own rid is replaced by a router rid on the way in ([`take_client_rids`]) and put
//! back on the way out ([`IdSwap`], over the answer's bytes, so that an answer passed on unparsed
//! stays unparsed), and a client's abort names requests by the rid it sent ([`abort_ask`]).

use serde_json::Value;

/// The width of every rid a [`RidMaker`] makes.
pub const RID_LEN: usize = 2 + 32 + 16;
/// The width of a [`RidMaker`]'s prefix (`er` and 32 hex digits).
const PREFIX_LEN: usize = 2 + 32;

/// Makes the router's rids: `er`, 32 hex digits fixed for the run, and a 16-hex-digit counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RidMaker {
    prefix: String,
}

impl RidMaker {
    /// A maker whose rids carry `run` (a random number drawn once per manager run, so rids do not
    /// repeat across runs on engines that outlive one).
    pub fn new(run: u128) -> Self {
        Self { prefix: format!("er{run:032x}") }
    }

    /// The `n`th rid of this run.
    pub fn rid(&self, n: u64) -> String {
        format!("{}{n:016x}", self.prefix)
    }

    /// The part every rid of this run starts with.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether `rid` is one of this run's.
    pub fn owns(&self, rid: &str) -> bool {
        rid.len() == RID_LEN && rid.starts_with(&self.prefix) && rid[PREFIX_LEN..].bytes().all(is_hex)
    }
}

fn is_hex(b: u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(&b)
}

/// Whether `rid` is one SGLang made for a request that came without one (`uuid.uuid4().hex`: 32
/// lowercase hex digits). Such a rid is never a prefix of another of its kind or of a router rid.
pub fn sglang_made(rid: &str) -> bool {
    rid.len() == 32 && rid.bytes().all(is_hex)
}

/// Replaces the top-level `rid` of a request body (a string, or a list of strings for a batch)
/// by rids from `next`, and returns each pair (the client's rid, the router's), in order. None
/// when the body has no rid (or one that is not a string or a list of strings: SGLang refuses
/// it, and so the body goes on unchanged for the engine to say so).
pub fn take_client_rids(body: &mut Value, mut next: impl FnMut() -> String) -> Option<Vec<(String, String)>> {
    let rid = body.as_object_mut()?.get_mut("rid")?;
    match rid {
        Value::String(client) => {
            let ours = next();
            let pair = (std::mem::replace(client, ours.clone()), ours);
            Some(vec![pair])
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_string) => {
            let mut pairs = Vec::with_capacity(items.len());
            for item in items.iter_mut() {
                let ours = next();
                let client = std::mem::replace(item, Value::String(ours.clone()));
                pairs.push((client.as_str().unwrap_or_default().to_string(), ours));
            }
            Some(pairs)
        }
        _ => None,
    }
}

/// What a client's `/abort_request` body asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortAsk {
    /// `{"abort_all": true}`: every request.
    All,
    /// `{"rid": "..."}`: the requests the client sent with this rid (or whose answer showed it).
    Rid(String),
    /// Neither (SGLang then aborts nothing, and answers 200).
    Nothing,
}

/// Reads a client's `/abort_request` body: `abort_all` first, as SGLang reads it.
pub fn abort_ask(body: &[u8]) -> AbortAsk {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(body) else { return AbortAsk::Nothing };
    if obj.get("abort_all").and_then(Value::as_bool) == Some(true) {
        return AbortAsk::All;
    }
    match obj.get("rid").and_then(Value::as_str) {
        Some(rid) if !rid.is_empty() => AbortAsk::Rid(rid.to_string()),
        _ => AbortAsk::Nothing,
    }
}

/// Puts back, in an answer's bytes, the id the client should see wherever a router rid of this
/// request stands (the `meta_info.id` of `/generate`, the `id` of an OpenAI answer, with SGLang's
/// `_<i>` suffixes kept). Fed the answer piece by piece: a piece that ends inside what may be a
/// rid keeps that end back until the next piece (or [`IdSwap::finish`]) tells.
#[derive(Debug, Clone, Default)]
pub struct IdSwap {
    /// The prefix every rid of the run has (taken from the first pair: empty until then, so a
    /// swap with nothing to replace costs nothing).
    prefix: Vec<u8>,
    /// Router rid -> the bytes to write instead (the client's id, escaped for a JSON string).
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Bytes of any length written as others (an OpenAI answer's `"model":"<engine's name>"`
    /// as the client named it): see [`IdSwap::rename`].
    rename: Option<(Vec<u8>, Vec<u8>)>,
    held: Vec<u8>,
}

impl IdSwap {
    /// From now on, `ours` (a rid of a [`RidMaker`]'s; every pair's of the same one) is shown as
    /// `shown`.
    pub fn add(&mut self, ours: &str, shown: &str) {
        let escaped = serde_json::to_string(shown).unwrap_or_default();
        let escaped = escaped.as_bytes();
        let inner = escaped.get(1..escaped.len().saturating_sub(1)).unwrap_or_default();
        if ours.as_bytes() != inner {
            if self.prefix.is_empty() {
                self.prefix = ours.as_bytes().get(..PREFIX_LEN).unwrap_or_default().to_vec();
            }
            self.pairs.push((ours.as_bytes().to_vec(), inner.to_vec()));
        }
    }

    /// From now on, the bytes `from` (not empty) are written as `to` as well.
    pub fn rename(&mut self, from: &[u8], to: &[u8]) {
        if !from.is_empty() && from != to {
            self.rename = Some((from.to_vec(), to.to_vec()));
        }
    }

    /// Whether there is nothing to replace (an answer then passes as it is).
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty() && self.rename.is_none()
    }

    /// Whether it holds back bytes that [`IdSwap::finish`] would write.
    pub fn holds(&self) -> bool {
        !self.held.is_empty()
    }

    /// Writes `data` to `out` with the rids replaced, keeping back an end that may be the start
    /// of a rid.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.is_empty() {
            out.extend_from_slice(data);
            return;
        }
        let joined;
        let data = if self.held.is_empty() {
            data
        } else {
            let mut all = std::mem::take(&mut self.held);
            all.extend_from_slice(data);
            joined = all;
            &joined[..]
        };
        let keep = self.partial_rid_at_end(data);
        self.replace_into(&data[..keep], out);
        self.held.extend_from_slice(&data[keep..]);
    }

    /// Writes what was kept back (the answer ended).
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        let held = std::mem::take(&mut self.held);
        self.replace_into(&held, out);
    }

    /// `data` with every whole rid of ours and every whole renamed string replaced, appended to
    /// `out`.
    fn replace_into(&self, data: &[u8], out: &mut Vec<u8>) {
        let Some((from, to)) = &self.rename else { return self.replace_rids_into(data, out) };
        let mut rids = Vec::with_capacity(data.len());
        self.replace_rids_into(data, &mut rids);
        let mut at = 0;
        for found in memchr::memmem::find_iter(&rids, from) {
            if found >= at {
                out.extend_from_slice(&rids[at..found]);
                out.extend_from_slice(to);
                at = found + from.len();
            }
        }
        out.extend_from_slice(&rids[at..]);
    }

    /// `data` with every whole rid of ours replaced, appended to `out`.
    fn replace_rids_into(&self, data: &[u8], out: &mut Vec<u8>) {
        if self.pairs.is_empty() {
            return out.extend_from_slice(data);
        }
        let finder = memchr::memmem::Finder::new(&self.prefix);
        let mut from = 0;
        for at in finder.find_iter(data) {
            if at < from {
                continue;
            }
            let rid = data.get(at..at + RID_LEN);
            let shown = rid.and_then(|rid| self.pairs.iter().find(|(ours, _)| ours == rid)).map(|(_, s)| s);
            if let Some(shown) = shown {
                out.extend_from_slice(&data[from..at]);
                out.extend_from_slice(shown);
                from = at + RID_LEN;
            }
        }
        out.extend_from_slice(&data[from..]);
    }

    /// Where the end of `data` that may begin a rid or a renamed string starts (`data.len()`
    /// when none does).
    fn partial_rid_at_end(&self, data: &[u8]) -> usize {
        let renamed = self.rename.as_ref().map_or(data.len(), |(from, _)| {
            // Never inside a whole one: its last bytes may begin another.
            let whole = memchr::memmem::rfind(data, from).map_or(0, |at| at + from.len());
            let start = data.len().saturating_sub(from.len() - 1).max(whole);
            (start..data.len()).find(|at| from.starts_with(&data[*at..])).unwrap_or(data.len())
        });
        if self.pairs.is_empty() {
            return renamed;
        }
        renamed.min(self.partial_of_a_rid(data))
    }

    fn partial_of_a_rid(&self, data: &[u8]) -> usize {
        let mut start = data.len().saturating_sub(RID_LEN - 1);
        // Never inside a whole one: its last bytes may begin another.
        if let Some(at) = memchr::memmem::rfind(data, &self.prefix).filter(|at| at + RID_LEN <= data.len()) {
            start = start.max(at + RID_LEN);
        }
        for at in start..data.len() {
            let tail = &data[at..];
            let in_prefix = tail.len().min(PREFIX_LEN);
            if tail[..in_prefix] == self.prefix[..in_prefix] && tail[in_prefix..].iter().all(|b| is_hex(*b)) {
                return at;
            }
        }
        data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn maker() -> RidMaker {
        RidMaker::new(0x0123_4567_89ab_cdef_0011_2233_4455_6677)
    }

    #[test]
    fn router_rids_have_one_width_and_are_owned() {
        let m = maker();
        for n in [0, 1, 0x10, 0x2a, u64::MAX] {
            let rid = m.rid(n);
            assert_eq!(rid.len(), RID_LEN, "{rid}");
            assert!(m.owns(&rid));
            assert!(!sglang_made(&rid));
        }
        assert!(!m.owns("er0123"));
        assert!(!RidMaker::new(7).owns(&m.rid(1)));
        assert!(sglang_made("e4b3f725dbce4d18af3f9b262cb8e062"));
        assert!(!sglang_made("e4b3f725dbce4d18af3f9b262cb8e06"));
        assert!(!sglang_made("E4B3F725DBCE4D18AF3F9B262CB8E062"));
    }

    proptest! {
        /// No rid the router sends is a prefix of another it sends, of SGLang's own, or of a
        /// suffixed one SGLang derives from another (`_<i>`); nor is SGLang's a prefix of ours.
        #[test]
        fn no_rid_is_a_prefix_of_another(a in any::<u64>(), b in any::<u64>(), run in any::<u128>(),
                                         uuid in "[0-9a-f]{32}", i in 0u32..64) {
            let m = RidMaker::new(run);
            let (ra, rb) = (m.rid(a), m.rid(b));
            if a != b {
                let suffixed = format!("{}_{}", rb, i);
                prop_assert!(!rb.starts_with(&ra));
                prop_assert!(!suffixed.starts_with(&ra));
            }
            prop_assert!(!uuid.starts_with(&ra) && !ra.starts_with(&uuid));
            prop_assert!(!RidMaker::new(run.wrapping_add(1)).rid(b).starts_with(&ra));
        }
    }

    #[test]
    fn client_rids_are_replaced_in_the_body_and_returned() {
        let m = maker();
        let mut n = 0;
        let mut next = || {
            n += 1;
            m.rid(n)
        };
        let mut one = json!({"input_ids": [1], "rid": "rs-1"});
        assert_eq!(take_client_rids(&mut one, &mut next), Some(vec![("rs-1".into(), m.rid(1))]));
        assert_eq!(one["rid"], m.rid(1));
        let mut batch = json!({"text": ["a", "b"], "rid": ["x", "y"]});
        let pairs = take_client_rids(&mut batch, &mut next).unwrap();
        assert_eq!(pairs, vec![("x".into(), m.rid(2)), ("y".into(), m.rid(3))]);
        assert_eq!(batch["rid"], json!([m.rid(2), m.rid(3)]));
        for mut body in
            [json!({"text": "a"}), json!({"rid": 7}), json!({"rid": ["a", 1]}), json!({"rid": []}), json!([1])]
        {
            let before = body.clone();
            assert_eq!(take_client_rids(&mut body, &mut next), None);
            assert_eq!(body, before);
        }
    }

    #[test]
    fn abort_asks() {
        for (body, ask) in [
            (&br#"{"rid": "rs-1"}"#[..], AbortAsk::Rid("rs-1".into())),
            (br#"{"abort_all": true, "rid": "x"}"#, AbortAsk::All),
            (br#"{"abort_all": false, "rid": "x"}"#, AbortAsk::Rid("x".into())),
            (br#"{"rid": ""}"#, AbortAsk::Nothing),
            (br#"{}"#, AbortAsk::Nothing),
            (b"", AbortAsk::Nothing),
            (b"not json", AbortAsk::Nothing),
        ] {
            assert_eq!(abort_ask(body), ask, "{}", String::from_utf8_lossy(body));
        }
    }

    fn swapped(swap: &mut IdSwap, pieces: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in pieces {
            swap.feed(piece, &mut out);
        }
        swap.finish(&mut out);
        out
    }

    #[test]
    fn the_client_sees_its_own_id() {
        let m = maker();
        let mut swap = IdSwap::default();
        swap.add(&m.rid(1), "rs-1");
        swap.add(&m.rid(2), "quote\"d");
        let answer = format!(
            r#"{{"meta_info":{{"id":"{}"}},"x":"{}_3","y":"{}","z":"{}"}}"#,
            m.rid(1),
            m.rid(2),
            m.rid(9),
            &m.rid(1)[..40]
        );
        let want =
            format!(r#"{{"meta_info":{{"id":"rs-1"}},"x":"quote\"d_3","y":"{}","z":"{}"}}"#, m.rid(9), &m.rid(1)[..40]);
        assert_eq!(String::from_utf8(swapped(&mut swap, &[answer.as_bytes()])).unwrap(), want);
        // Nothing to replace: the bytes as they are.
        let mut none = IdSwap::default();
        assert!(none.is_empty());
        assert_eq!(swapped(&mut none, &[answer.as_bytes()]), answer.as_bytes());
        // A client rid equal to ours needs nothing.
        none.add(&m.rid(1), &m.rid(1));
        assert!(none.is_empty());
    }

    proptest! {
        /// However the answer is cut into pieces, the client gets the same bytes.
        #[test]
        fn pieces_do_not_change_the_result(cuts in proptest::collection::vec(0usize..400, 0..6), n in 1u64..4) {
            let m = maker();
            let mut whole = IdSwap::default();
            whole.add(&m.rid(n), "client-rid");
            let answer = format!(
                "data: {{\"meta_info\":{{\"id\":\"{}\"}}}}\n\ndata: {{\"id\":\"{}_1\",\"e\":\"er\"}}\n\ner{}",
                m.rid(n), m.rid(n), &m.rid(n)[2..30]
            );
            let bytes = answer.as_bytes();
            let expected = swapped(&mut whole.clone(), &[bytes]);
            let mut at: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            at.sort_unstable();
            let mut pieces: Vec<&[u8]> = Vec::new();
            let mut from = 0;
            for c in at {
                pieces.push(&bytes[from..c]);
                from = c;
            }
            pieces.push(&bytes[from..]);
            prop_assert_eq!(swapped(&mut whole, &pieces), expected.clone());
            prop_assert!(String::from_utf8(expected).unwrap().contains("\"id\":\"client-rid_1\""));
        }
    }
}

#[cfg(test)]
mod rename_tests {
    use super::IdSwap;
    use proptest::prelude::*;

    fn fed(swap: &mut IdSwap, data: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().filter(|c| **c <= data.len()) {
            if cut >= from {
                swap.feed(&data[from..cut], &mut out);
                from = cut;
            }
        }
        swap.feed(&data[from..], &mut out);
        swap.finish(&mut out);
        out
    }

    proptest! {
        /// However the answer is cut into pieces, every renamed string is written as the other
        /// and nothing else changes.
        #[test]
        fn a_rename_holds_across_any_cut(mut cuts in proptest::collection::vec(0usize..160, 0..6)) {
            cuts.sort_unstable();
            let answer = br#"data: {"id":"x","model":"/ckpt/step-1","choices":[]}

data: {"model":"/ckpt/step-1","text":"\"model\":\"/ckpt/step\""}

"#;
            let mut swap = IdSwap::default();
            swap.rename(br#""model":"/ckpt/step-1""#, br#""model":"qwen-rl""#);
            let out = fed(&mut swap, answer, &cuts);
            let want = String::from_utf8_lossy(answer).replace(r#""model":"/ckpt/step-1""#, r#""model":"qwen-rl""#);
            prop_assert_eq!(String::from_utf8_lossy(&out), want);
        }
    }
}
