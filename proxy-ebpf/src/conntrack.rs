//! Connection tracking: pins a flow to its backend and finds replies.

use aya_ebpf::helpers::bpf_jiffies64;
use proxy_common::{
    CtKey, CtValue,
    conntrack::{
        DIR_FORWARD, DIR_REPLY, FLAG_HANDED_TO_TC, FLAG_REPLY, FLAG_SNAT, LAST_SEEN_GRANULARITY_JIFFIES, TCP_ACK,
        TCP_FIN, TCP_RST, TCP_SYN,
    },
};

use crate::{
    maps::CONNTRACK,
    parse::{Flow, TCP_FLAG_ACK, TCP_FLAG_FIN, TCP_FLAG_RST, TCP_FLAG_SYN},
};

/// The key of the packet's own tuple, as an entry of direction `dir`.
#[inline(always)]
fn key_of(flow: &Flow, dir: u8) -> CtKey {
    CtKey {
        saddr_be: flow.saddr_be,
        daddr_be: flow.daddr_be,
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto: flow.proto,
        dir,
        _pad: [0; 2],
    }
}

#[inline(always)]
fn tcp_bits(flags: u8) -> u8 {
    let mut bits = 0;
    if flags & TCP_FLAG_SYN != 0 {
        bits |= TCP_SYN;
    }
    if flags & TCP_FLAG_FIN != 0 {
        bits |= TCP_FIN;
    }
    if flags & TCP_FLAG_RST != 0 {
        bits |= TCP_RST;
    }
    if flags & TCP_FLAG_ACK != 0 {
        bits |= TCP_ACK;
    }
    bits
}

/// Marks the entry as used now. Writes only when something changed or the
/// timestamp is a second old, so a busy flow does not dirty its entry's
/// cache line on every packet.
#[inline(always)]
fn touch(entry: *mut CtValue, flow: &Flow, now: u64) {
    let bits = tcp_bits(flow.tcp_flags);
    unsafe {
        if (*entry).tcp_seen & bits != bits {
            (*entry).tcp_seen |= bits;
        }
        if now.wrapping_sub((*entry).last_seen_jiffies) > LAST_SEEN_GRANULARITY_JIFFIES {
            (*entry).last_seen_jiffies = now;
        }
    }
}

/// A tracked flow in the forward (client -> frontend) direction.
pub struct Forward {
    pub backend_id: u32,
    /// The flow is source-NATed by the kernel (see [`FLAG_SNAT`]).
    pub snat: bool,
    /// XDP picked the backend and left the packet to tc (see [`FLAG_HANDED_TO_TC`]).
    pub handed_to_tc: bool,
    /// The entry itself, so [`taken_over`] needs no second lookup.
    entry: *mut CtValue,
}

#[inline(always)]
pub fn forward(flow: &Flow) -> Option<Forward> {
    let entry = CONNTRACK.get_ptr_mut(key_of(flow, DIR_FORWARD))?;
    touch(entry, flow, unsafe { bpf_jiffies64() });
    let (backend_id, flags) = unsafe { ((*entry).backend_id, (*entry).flags) };
    Some(Forward {
        backend_id,
        snat: flags & FLAG_SNAT != 0,
        handed_to_tc: flags & FLAG_HANDED_TO_TC != 0,
        entry,
    })
}

/// The tc hook took over a flow XDP handed to it: later packets are
/// established ones.
#[inline(always)]
pub fn taken_over(tracked: &Forward) {
    // SAFETY: the pointer came from the map lookup of this same packet's
    // run; map values stay valid for the program's run (RCU).
    unsafe { (*tracked.entry).flags &= !FLAG_HANDED_TO_TC };
}

/// The reverse NAT id of a tracked flow in the reply (backend -> client) direction.
#[inline(always)]
pub fn reply_rev_nat(flow: &Flow) -> Option<u32> {
    let entry = CONNTRACK.get_ptr_mut(key_of(flow, DIR_REPLY))?;
    touch(entry, flow, unsafe { bpf_jiffies64() });
    Some(unsafe { (*entry).rev_nat_id })
}

/// Records a new flow to `backend` in both directions. The reply entry is
/// written first: once the forward entry exists, later packets are DNATed
/// and their replies must already be recognised. `handed_to_tc`: see
/// [`FLAG_HANDED_TO_TC`].
#[inline(always)]
pub fn create(
    flow: &Flow,
    backend_id: u32,
    backend_addr_be: u32,
    backend_port_be: u16,
    rev_nat_id: u32,
    snat: bool,
    handed_to_tc: bool,
) -> Result<(), ()> {
    let now = unsafe { bpf_jiffies64() };
    let mut value = CtValue {
        backend_id,
        rev_nat_id,
        last_seen_jiffies: now,
        flags: FLAG_REPLY,
        tcp_seen: 0,
        _pad: [0; 6],
    };
    let reply = CtKey {
        saddr_be: backend_addr_be,
        daddr_be: flow.saddr_be,
        sport_be: backend_port_be,
        dport_be: flow.sport_be,
        proto: flow.proto,
        dir: DIR_REPLY,
        _pad: [0; 2],
    };
    CONNTRACK.insert(&reply, &value, 0).map_err(|_| ())?;
    value.flags = if snat { FLAG_SNAT } else { 0 } | if handed_to_tc { FLAG_HANDED_TO_TC } else { 0 };
    value.tcp_seen = tcp_bits(flow.tcp_flags);
    CONNTRACK.insert(&key_of(flow, DIR_FORWARD), &value, 0).map_err(|_| ())
}
