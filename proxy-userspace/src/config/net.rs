//! Address forms used by the configuration: CIDR blocks, `IP:PORT` bind
//! addresses and port ranges.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::RangeInclusive;
use std::str::FromStr;

/// An IPv4 or IPv6 network, `addr/prefix_len`, with the host bits cleared
/// (like the network Go's `net.ParseCIDR` returns: `10.1.2.3/8` is
/// `10.0.0.0/8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    prefix_len: u8,
}

/// Why a text is not a CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a CIDR ({reason})")]
pub struct CidrError {
    /// The text as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl Cidr {
    /// The network of `addr` with `prefix_len` leading bits; `None` when the
    /// prefix is longer than the address.
    pub fn new(addr: IpAddr, prefix_len: u8) -> Option<Self> {
        let addr = match addr {
            IpAddr::V4(a) if prefix_len <= 32 => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix_len)).unwrap_or(0);
                IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
            }
            IpAddr::V6(a) if prefix_len <= 128 => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix_len)).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
            }
            _ => return None,
        };
        Some(Cidr { addr, prefix_len })
    }

    /// The network address (host bits zero).
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The number of leading network bits.
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// True for an IPv4 network.
    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// Whether `ip` lies inside this network (never across address families).
    pub fn contains(&self, ip: IpAddr) -> bool {
        Cidr::new(ip, self.prefix_len).is_some_and(|net| net.addr == self.addr)
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |reason| CidrError {
            input: s.to_owned(),
            reason,
        };
        let (addr, len) = s.split_once('/').ok_or_else(|| fail("missing /PREFIX"))?;
        let addr: IpAddr = addr.parse().map_err(|_| fail("bad IP address"))?;
        if len.is_empty() || len.len() > 3 || !len.bytes().all(|b| b.is_ascii_digit()) {
            return Err(fail("bad prefix length"));
        }
        let len: u8 = len.parse().map_err(|_| fail("bad prefix length"))?;
        Cidr::new(addr, len).ok_or_else(|| {
            fail(if addr.is_ipv4() {
                "prefix length above 32"
            } else {
                "prefix length above 128"
            })
        })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// Parses a bind address the way kube-proxy does for `healthzBindAddress`
/// and `metricsBindAddress`: `IP:PORT` (`[IPv6]:PORT`), or a bare IP that gets
/// `default_port`. The host must be an IP literal and the port 1..=65535.
pub fn parse_bind_address(input: &str, default_port: u16) -> Result<SocketAddr, String> {
    if let Ok(ip) = input.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    match input.parse::<SocketAddr>() {
        Ok(addr) if addr.port() != 0 => Ok(addr),
        Ok(_) => Err(format!("{input:?} has port 0 (expected 1..=65535)")),
        Err(_) => Err(format!(
            "{input:?} is not HOST:PORT (an IP address and a port, e.g. 0.0.0.0:{default_port})"
        )),
    }
}

/// Parses kube-proxy's `portRange`: `""` (none), `PORT`, `BEGIN-END` or
/// `BEGIN+OFFSET`, inclusive, ports 1..=65535.
pub fn parse_port_range(input: &str) -> Result<Option<RangeInclusive<u16>>, String> {
    let fail = || format!("{input:?} is not a port range (expected BEGIN-END, BEGIN+OFFSET or PORT)");
    let input_t = input.trim();
    if input_t.is_empty() {
        return Ok(None);
    }
    let port = |s: &str| -> Result<u16, String> {
        match s.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(fail()),
        }
    };
    let (first, last) = if let Some((a, b)) = input_t.split_once('-') {
        (port(a)?, port(b)?)
    } else if let Some((a, b)) = input_t.split_once('+') {
        let first = port(a)?;
        let offset: u16 = b.trim().parse().map_err(|_| fail())?;
        (first, first.checked_add(offset).ok_or_else(fail)?)
    } else {
        let p = port(input_t)?;
        (p, p)
    };
    if first > last {
        return Err(fail());
    }
    Ok(Some(first..=last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cidrs() {
        let c: Cidr = "169.169.0.0/16".parse().unwrap();
        assert_eq!(c.to_string(), "169.169.0.0/16");
        assert!(c.is_ipv4());
        assert!(c.contains("169.169.3.4".parse().unwrap()));
        assert!(!c.contains("169.170.0.1".parse().unwrap()));
        assert!(!c.contains("::1".parse().unwrap()));
        assert_eq!("10.1.2.3/8".parse::<Cidr>().unwrap().to_string(), "10.0.0.0/8");
        assert_eq!("0.0.0.0/0".parse::<Cidr>().unwrap().prefix_len(), 0);
        assert_eq!("fd00::1/64".parse::<Cidr>().unwrap().to_string(), "fd00::/64");
        assert_eq!("1.2.3.4/32".parse::<Cidr>().unwrap().to_string(), "1.2.3.4/32");
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0",
            "10.0.0/8",
            "x/8",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "::/129",
            "10.0.0.0/8 ",
        ] {
            let err = bad.parse::<Cidr>().expect_err(bad);
            assert!(err.to_string().contains(&format!("{bad:?} is not a CIDR")), "{err}");
        }
    }

    #[test]
    fn parses_bind_addresses() {
        assert_eq!(
            parse_bind_address("127.0.0.1:10256", 1),
            Ok("127.0.0.1:10256".parse().unwrap())
        );
        assert_eq!(parse_bind_address("[::1]:10249", 1), Ok("[::1]:10249".parse().unwrap()));
        assert_eq!(
            parse_bind_address("0.0.0.0", 10256),
            Ok("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(parse_bind_address("::", 10256), Ok("[::]:10256".parse().unwrap()));
        for bad in [
            "abc",
            "localhost:10256",
            ":10256",
            "1.2.3.4:",
            "1.2.3.4:70000",
            "1.2.3.4:0",
        ] {
            assert!(parse_bind_address(bad, 1).is_err(), "{bad}");
        }
        assert!(
            parse_bind_address("abc", 1)
                .unwrap_err()
                .contains("\"abc\" is not HOST:PORT")
        );
    }

    #[test]
    fn parses_port_ranges() {
        assert_eq!(parse_port_range(""), Ok(None));
        assert_eq!(parse_port_range("300-2000"), Ok(Some(300..=2000)));
        assert_eq!(parse_port_range("300+10"), Ok(Some(300..=310)));
        assert_eq!(parse_port_range("8080"), Ok(Some(8080..=8080)));
        for bad in ["x", "2000-300", "0-10", "1-70000", "65535+1", "-"] {
            assert!(parse_port_range(bad).is_err(), "{bad}");
        }
    }
}
