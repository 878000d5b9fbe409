//! Networks in CIDR notation (`10.0.0.0/8`, `fd00::/8`, or a bare address for one host), for
//! `--external-allow-cidr`: the networks external engines may be attached from.
//!
//! IPv4-mapped IPv6 addresses (`::ffff:10.0.0.5`) are compared as the IPv4 address they carry,
//! so a mapped spelling cannot slip past an IPv4 allow-list.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// The network address, with the host bits cleared.
    network: IpAddr,
    prefix: u8,
}

/// Bits of `ip` as a 128-bit number (IPv4 in the low 32 bits) and the address width.
fn bits(ip: IpAddr) -> (u128, u8) {
    match ip.to_canonical() {
        IpAddr::V4(v4) => (u128::from(u32::from(v4)), 32),
        IpAddr::V6(v6) => (u128::from(v6), 128),
    }
}

fn mask(prefix: u8, width: u8) -> u128 {
    let all = if width == 32 { u128::from(u32::MAX) } else { u128::MAX };
    match prefix {
        0 => 0,
        p if p >= width => all,
        p => all & !(all >> p),
    }
}

impl Cidr {
    /// Whether `ip` is in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let (net, width) = bits(self.network);
        let (addr, addr_width) = bits(ip);
        width == addr_width && (addr & mask(self.prefix, width)) == net
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let written: IpAddr = addr.trim().parse().map_err(|_| format!("{s:?} is not an IP address or network"))?;
        let ip = written.to_canonical();
        let width = bits(ip).1;
        // A prefix written after an IPv4-mapped IPv6 address counts the 96 mapping bits.
        let skipped = if written.is_ipv6() && width == 32 { 96 } else { 0 };
        let prefix = match prefix {
            None => width,
            Some(p) => {
                p.trim().parse::<u8>().ok().and_then(|p| p.checked_sub(skipped)).filter(|p| *p <= width).ok_or_else(
                    || format!("{s:?}: the prefix length must be a number from {skipped} to {}", skipped + width),
                )?
            }
        };
        let (raw, _) = bits(ip);
        let net = raw & mask(prefix, width);
        let network = if width == 32 {
            IpAddr::V4(std::net::Ipv4Addr::from(u32::try_from(net).map_err(|_| format!("{s:?}: bad network"))?))
        } else {
            IpAddr::V6(std::net::Ipv6Addr::from(net))
        };
        Ok(Self { network, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_contain_their_hosts() {
        let net: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains(ip("10.1.200.3")));
        assert!(!net.contains(ip("10.2.0.1")));
        assert!(net.contains(ip("::ffff:10.1.0.9")), "IPv4-mapped IPv6 counts as IPv4");
        let mapped: Cidr = "::ffff:10.1.0.0/112".parse().unwrap();
        assert_eq!(mapped, net);
        assert!(!net.contains(ip("fd00::1")));
        // Host bits are cleared; a bare address is one host.
        assert_eq!("10.1.2.3/16".parse::<Cidr>().unwrap().to_string(), "10.1.0.0/16");
        let host: Cidr = "192.168.1.5".parse().unwrap();
        assert!(host.contains(ip("192.168.1.5")) && !host.contains(ip("192.168.1.6")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("8.8.8.8")) && !all.contains(ip("::1")));
    }

    #[test]
    fn bad_networks_say_why() {
        for bad in ["10.0.0.0/33", "fd00::/129", "10.0.0/8", "host.example/8", "10.0.0.0/x", "", "/8"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    proptest! {
        /// Every address is in its own /prefix network, and parsing never panics.
        #[test]
        fn an_address_is_in_its_networks(raw in any::<u32>(), prefix in 0u8..=32, text in ".{0,24}") {
            let addr = IpAddr::V4(std::net::Ipv4Addr::from(raw));
            let net: Cidr = format!("{addr}/{prefix}").parse().unwrap();
            prop_assert!(net.contains(addr));
            let _ = text.parse::<Cidr>();
        }

        #[test]
        fn v6_too(raw in any::<u128>(), prefix in 0u8..=128) {
            let addr = IpAddr::V6(std::net::Ipv6Addr::from(raw));
            let net: Cidr = format!("{addr}/{prefix}").parse().unwrap();
            // Mapped IPv4 addresses canonicalise to IPv4 and are checked as such.
            prop_assert!(net.contains(addr));
        }
    }
}
