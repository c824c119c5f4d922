//! IPv6 fragments, as IPv4's (`crate::fragments`): a first fragment's
//! ports are remembered in `XP_FRAGS6` under (source, destination,
//! fragment id, protocol); a later fragment gets them back and is
//! translated as its flow, addresses only. It has no L4 header, and IPv6
//! no header checksum: the L4 checksum, pseudo-header included, is the
//! first fragment's and was updated there for the whole datagram. A later
//! fragment whose first was not seen stays untranslated, never taken for
//! port 0.

use proxy_common::{Frag6Key, FragPorts};

use super::parse::Flow6;
use crate::{
    maps::{FRAGMENTS6, SCRATCH6},
    parse::Fragment,
};

/// The flow's fragment key, written in this CPU's scratch slot (40 bytes
/// the stack has no room for: see `conntrack::create`).
#[inline(always)]
fn key_of(flow: &Flow6) -> Option<&'static Frag6Key> {
    let scratch = SCRATCH6.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of an array map, never freed; no other run
    // on this CPU comes between (the hooks run with bottom halves off).
    let key = unsafe { &mut (*scratch).frag_key };
    key.saddr_be = *flow.saddr();
    key.daddr_be = *flow.daddr();
    key.id_be = flow.frag_id_be;
    key.proto = flow.proto;
    key._pad = [0; 3];
    Some(key)
}

/// Remembers a first fragment's ports for the later ones (a duplicate
/// first fragment writes the same again).
#[inline(always)]
pub fn remember(flow: &Flow6) {
    if flow.fragment != Fragment::First {
        return;
    }
    let Some(key) = key_of(flow) else { return };
    let ports = FragPorts {
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
    };
    let _ = FRAGMENTS6.insert(key, ports, 0);
}

/// Fills a later fragment's ports in from its first fragment's; `false`
/// for a later fragment whose first was not seen. Other packets keep
/// theirs.
#[inline(always)]
pub fn fill_ports(flow: &mut Flow6) -> bool {
    if flow.fragment != Fragment::Later {
        return true;
    }
    let Some(key) = key_of(flow) else { return false };
    // SAFETY: the value is copied out at once, while the program's run
    // keeps it valid (an LRU entry is recycled, never freed, meanwhile).
    let Some(ports) = (unsafe { FRAGMENTS6.get(key).copied() }) else {
        return false;
    };
    flow.sport_be = ports.sport_be;
    flow.dport_be = ports.dport_be;
    true
}
