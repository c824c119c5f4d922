//! IPv4 fragments (see `proxy_common::fragment`): a first fragment's ports
//! are remembered, a later fragment gets them back and is translated as
//! its flow, addresses only (it has no L4 header; the L4 checksum, which
//! covers the whole datagram, was updated in the first). A later fragment
//! whose first was not seen stays untranslated, never taken for port 0.

use proxy_common::{FragKey, FragPorts};

use crate::{
    maps::FRAGMENTS,
    parse::{Flow, Fragment},
};

#[inline(always)]
fn key_of(flow: &Flow) -> FragKey {
    FragKey {
        saddr_be: flow.saddr_be,
        daddr_be: flow.daddr_be,
        id_be: flow.ip_id_be,
        proto: flow.proto,
        _pad: 0,
    }
}

/// Remembers a first fragment's ports for the later ones (a duplicate
/// first fragment writes the same again).
#[inline(always)]
pub fn remember(flow: &Flow) {
    if flow.fragment != Fragment::First {
        return;
    }
    let ports = FragPorts {
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
    };
    let _ = FRAGMENTS.insert(key_of(flow), ports, 0);
}

/// The flow with its ports: as it is, or for a later fragment the first
/// fragment's; `None` for a later fragment whose first was not seen.
#[inline(always)]
pub fn with_ports(flow: Flow) -> Option<Flow> {
    if flow.fragment != Fragment::Later {
        return Some(flow);
    }
    // SAFETY: the value is copied out at once, while the program's run
    // keeps it valid (an LRU entry is recycled, never freed, meanwhile).
    let ports = unsafe { FRAGMENTS.get(key_of(&flow))? };
    Some(Flow {
        sport_be: ports.sport_be,
        dport_be: ports.dport_be,
        ..flow
    })
}
