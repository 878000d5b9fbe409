//! The headers of a forwarded request and answer: which are not forwarded (hop-by-hop ones and
//! the router's own), and the router's own request headers, read in one pass.

use axum::http::{HeaderMap, HeaderName};

/// Headers that are not forwarded: hop-by-hop ones (and any a `connection` header names), the
/// ones the proxy sets itself (`host`, `content-length`), `expect` (the router has read the whole
/// body already) and the router's own request headers.
const HOP_BY_HOP: [&str; 17] = [
    "connection",
    "proxy-connection",
    "expect",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "x-routing-policy",
    "x-session-id",
    "x-weight-version",
    "x-min-weight-version",
    "x-smg-version-policy",
];

fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
    let name = name.as_str();
    HOP_BY_HOP.iter().position(|h| *h == name)
}

/// Removes the headers that are not forwarded, in place. One pass over the (few) names present
/// finds which to remove, so a request or response without any costs no lookup.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut found = 0u32;
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name) {
            found |= 1 << i;
        }
    }
    if found & 1 != 0 {
        // Headers the sender declared hop-by-hop in `connection` (RFC 9110 section 7.6.1). The
        // usual `keep-alive` and `close` name nothing more, so they cost no allocation.
        let named: Vec<HeaderName> = headers
            .get_all("connection")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| !t.eq_ignore_ascii_case("keep-alive") && !t.eq_ignore_ascii_case("close"))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    while found != 0 {
        let i = found.trailing_zeros() as usize;
        found &= found - 1;
        headers.remove(HOP_BY_HOP[i]);
    }
}

/// The headers of a client's request as an engine gets them: end-to-end ones only, and never
/// this manager's own token.
pub(super) fn to_engine(mut headers: HeaderMap, token: Option<&str>) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    if crate::foundation::auth::carries_token(&headers, token) {
        headers.remove("authorization");
    }
    headers
}

/// The router's own request headers (each one's first value), read in one pass over the few
/// headers a request has rather than one hashed lookup per name.
#[derive(Default)]
pub(super) struct OwnHeaders<'a> {
    pub(super) routing_policy: Option<&'a str>,
    pub(super) weight_version: Option<&'a str>,
    pub(super) min_weight_version: Option<&'a str>,
    pub(super) session_id: Option<&'a str>,
    pub(super) smg_routing_key: Option<&'a str>,
    pub(super) partial_rollout: Option<&'a str>,
    pub(super) smg_version_policy: Option<&'a str>,
}

impl<'a> OwnHeaders<'a> {
    pub(super) fn of(headers: &'a HeaderMap) -> Self {
        let mut own = Self::default();
        let mut seen = 0u8;
        for (name, value) in headers {
            let (bit, slot) = match name.as_str() {
                "x-routing-policy" => (1, &mut own.routing_policy),
                "x-weight-version" => (2, &mut own.weight_version),
                "x-min-weight-version" => (4, &mut own.min_weight_version),
                "x-session-id" => (8, &mut own.session_id),
                "x-smg-routing-key" => (16, &mut own.smg_routing_key),
                "x-partial-rollout" => (32, &mut own.partial_rollout),
                "x-smg-version-policy" => (64, &mut own.smg_version_policy),
                _ => continue,
            };
            // The first value counts (as `HeaderMap::get`); one that is not text counts as absent.
            if seen & bit == 0 {
                seen |= bit;
                *slot = value.to_str().ok();
            }
        }
        own
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_the_ones_connection_names_are_not_forwarded() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("proxy-connection", "keep-alive"),
            ("expect", "100-continue"),
            ("transfer-encoding", "chunked"),
            ("content-length", "5"),
            ("host", "router"),
            ("x-session-id", "s"),
            ("content-type", "application/json"),
            ("authorization", "Bearer engine-key"),
        ] {
            h.append(HeaderName::from_static(k), v.parse().unwrap());
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-type"]);
    }
}
