//! An engine's address, parsed once: the manager keeps engines by their base URL
//! (`http://host:port`), and the port of a managed engine is part of the fleet's accounting.

/// The base URL of an engine, split into its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineAddr {
    /// `http` or `https`.
    pub scheme: String,
    /// A name, an IPv4 address, or an IPv6 address in brackets (`[::1]`).
    pub host: String,
    /// None when the URL names no port.
    pub port: Option<u16>,
}

impl EngineAddr {
    /// Parses `scheme://host[:port][/]`; None for anything else (a path, a user, a bad port).
    pub fn parse(url: &str) -> Option<Self> {
        let (scheme, rest) = url.split_once("://")?;
        if scheme != "http" && scheme != "https" {
            return None;
        }
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.is_empty() || authority.contains(['/', '@', '?', '#']) {
            return None;
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (inside, after) = v6.split_once(']')?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':')?.parse::<u16>().ok()?),
            };
            (format!("[{inside}]"), port)
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host.to_string(), Some(port.parse::<u16>().ok()?)),
                None => (authority.to_string(), None),
            }
        };
        if host.is_empty() || host == "[]" {
            return None;
        }
        Some(Self { scheme: scheme.to_string(), host, port })
    }

    /// The port of the engine at `url`, if `url` is a base URL that names one.
    pub fn port_of(url: &str) -> Option<u16> {
        Self::parse(url).and_then(|a| a.port)
    }

    /// `host:port` (or `host` without a port), as in an HTTP `Host` header or a TCP connect.
    pub fn authority(&self) -> String {
        match self.port {
            Some(port) => format!("{}:{port}", self.host),
            None => self.host.clone(),
        }
    }
}

impl std::fmt::Display for EngineAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A URL and the host and port it parses to (None: refused).
    type Case = (&'static str, Option<(&'static str, Option<u16>)>);

    #[test]
    fn parse_table() {
        let table: [Case; 14] = [
            ("http://127.0.0.1:30000", Some(("127.0.0.1", Some(30000)))),
            ("http://127.0.0.1:30000/", Some(("127.0.0.1", Some(30000)))),
            ("https://engine-3.cluster:443", Some(("engine-3.cluster", Some(443)))),
            ("http://engine", Some(("engine", None))),
            ("http://[::1]:8000", Some(("[::1]", Some(8000)))),
            ("http://[fe80::1]", Some(("[fe80::1]", None))),
            ("http://127.0.0.1:70000", None),
            ("http://127.0.0.1:", None),
            ("http://127.0.0.1:30000/generate", None),
            ("http://user@host:1", None),
            ("ftp://host:1", None),
            ("127.0.0.1:30000", None),
            ("http://", None),
            ("http://[::1", None),
        ];
        for (url, want) in table {
            let got = EngineAddr::parse(url);
            assert_eq!(got.as_ref().map(|a| (a.host.as_str(), a.port)), want, "{url}");
        }
        assert_eq!(EngineAddr::port_of("http://127.0.0.1:30001"), Some(30001));
        assert_eq!(EngineAddr::port_of("http://engine"), None);
    }

    proptest! {
        /// What an address prints, it parses back to, and the authority is what the URL had.
        #[test]
        fn printed_addresses_parse_back(
            v4 in any::<[u8; 4]>(),
            port in proptest::option::of(any::<u16>()),
            https in any::<bool>(),
        ) {
            let host = format!("{}.{}.{}.{}", v4[0], v4[1], v4[2], v4[3]);
            let addr = EngineAddr { scheme: if https { "https" } else { "http" }.into(), host, port };
            let text = addr.to_string();
            prop_assert_eq!(EngineAddr::parse(&text), Some(addr.clone()));
            prop_assert_eq!(EngineAddr::port_of(&text), port);
            prop_assert_eq!(text.split_once("://").map(|(_, a)| a.to_string()), Some(addr.authority()));
        }

        /// Any text: parsing never panics.
        #[test]
        fn parsing_never_panics(text in ".{0,40}") {
            let _ = EngineAddr::parse(&text);
        }
    }
}
