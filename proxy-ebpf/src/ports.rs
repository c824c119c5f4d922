//! The port filter: packets whose ports no Service uses pass before any
//! hash lookup (see `proxy_common::ports`), IPv4 and IPv6 alike.

use proxy_common::ports;

use crate::maps::PORTS;

/// Whether the packet may be Service traffic: its destination port is a
/// frontend's (a request) or its source port a backend's (a reply).
#[inline(always)]
pub fn may_be_service(sport_be: u16, dport_be: u16) -> bool {
    to_frontend(dport_be) || has(u16::from_be(sport_be), |b| b.backend)
}

/// Whether the destination port is some frontend's: a packet of no
/// tracked flow can open one only then.
#[inline(always)]
pub fn to_frontend(dport_be: u16) -> bool {
    has(u16::from_be(dport_be), |b| b.frontend)
}

#[inline(always)]
fn has(port: u16, bits: impl Fn(&ports::PortBits) -> u64) -> bool {
    let (index, bit) = ports::slot(port);
    // An ARRAY lookup: the verifier inlines it, no helper call.
    match PORTS.get(index) {
        Some(word) => bits(word) & bit != 0,
        None => false,
    }
}
