//! Connection tracking: one lookup of the packet's own tuple says whether
//! it belongs to a tracked flow, which way it goes, and what to rewrite it
//! to (see `proxy_common::conntrack`).

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_jiffies64};
use proxy_common::{
    Backend, CtKey, CtValue,
    conntrack::{
        FLAG_HANDED_TO_TC, FLAG_REPLY, FLAG_SNAT, LAST_SEEN_GRANULARITY_JIFFIES, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN,
    },
};

use crate::{
    maps::CONNTRACK,
    parse::{Flow, TCP_FLAG_ACK, TCP_FLAG_FIN, TCP_FLAG_RST, TCP_FLAG_SYN},
};

/// The key of the packet's own tuple.
#[inline(always)]
fn key_of(flow: &Flow) -> CtKey {
    CtKey {
        saddr_be: flow.saddr_be,
        daddr_be: flow.daddr_be,
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto: flow.proto,
        _pad: [0; 3],
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

/// The entry of a tracked flow the packet belongs to.
pub struct Tracked {
    /// A reply (`backend -> client`): reverse NAT the source to `nat`.
    /// Else a forward packet (`client -> frontend`): DNAT to `nat`.
    pub reply: bool,
    /// `(address, port)`, network byte order.
    pub nat: (u32, u16),
    /// Forward only: the flow is source-NATed by the kernel (see [`FLAG_SNAT`]).
    pub snat: bool,
    /// Forward only: XDP picked the backend and left the packet to tc (see
    /// [`FLAG_HANDED_TO_TC`]).
    pub handed_to_tc: bool,
    /// The entry itself, so [`taken_over`] needs no second lookup.
    entry: *mut CtValue,
}

/// The tracked flow the packet belongs to, in either direction.
#[inline(always)]
pub fn lookup(flow: &Flow) -> Option<Tracked> {
    let entry = CONNTRACK.get_ptr_mut(key_of(flow))?;
    touch(entry, flow, unsafe { bpf_jiffies64() });
    // SAFETY: map values stay valid for the program's run (RCU).
    let value = unsafe { &*entry };
    Some(Tracked {
        reply: value.flags & FLAG_REPLY != 0,
        nat: (value.nat_addr_be, value.nat_port_be),
        snat: value.flags & FLAG_SNAT != 0,
        handed_to_tc: value.flags & FLAG_HANDED_TO_TC != 0,
        entry,
    })
}

/// The tc hook took over a flow XDP handed to it: later packets are
/// established ones.
#[inline(always)]
pub fn taken_over(tracked: &Tracked) {
    // SAFETY: the pointer came from the map lookup of this same packet's run.
    unsafe { (*tracked.entry).flags &= !FLAG_HANDED_TO_TC };
}

/// Records a new flow (the packet is its first, `client -> frontend`) to
/// `backend` in both directions. The reply entry is written first: once the
/// forward entry exists, later packets are DNATed and their replies must
/// already be recognised. Neither insert overwrites another flow's entry;
/// `Err` means the flow is not tracked (and must not be translated).
#[inline(always)]
pub fn create(
    flow: &Flow,
    backend_id: u32,
    backend: &Backend,
    rev_nat_id: u32,
    snat: bool,
    handed_to_tc: bool,
) -> Result<(), ()> {
    let now = unsafe { bpf_jiffies64() };
    let reply_key = CtKey {
        saddr_be: backend.addr_be,
        daddr_be: flow.saddr_be,
        sport_be: backend.port_be,
        dport_be: flow.sport_be,
        proto: flow.proto,
        _pad: [0; 3],
    };
    let reply = CtValue {
        backend_id,
        rev_nat_id,
        last_seen_jiffies: now,
        flags: FLAG_REPLY,
        tcp_seen: 0,
        nat_port_be: flow.dport_be,
        nat_addr_be: flow.daddr_be,
    };
    insert_reply(&reply_key, &reply)?;
    let forward = CtValue {
        flags: if snat { FLAG_SNAT } else { 0 } | if handed_to_tc { FLAG_HANDED_TO_TC } else { 0 },
        tcp_seen: tcp_bits(flow.tcp_flags),
        nat_port_be: backend.port_be,
        nat_addr_be: backend.addr_be,
        ..reply
    };
    // The lookup just missed, so this fails only if another CPU created the
    // same flow meanwhile: its entries win, this packet passes.
    if CONNTRACK.insert(&key_of(flow), &forward, BPF_NOEXIST as u64).is_err() {
        let _ = CONNTRACK.remove(&reply_key);
        return Err(());
    }
    Ok(())
}

/// Inserts a reply entry unless its tuple is another flow's forward entry.
/// An older reply entry there (a flow the same client port had to the same
/// backend, its forward entry evicted or gone) is replaced: its replies and
/// the new flow's are the same packets.
#[inline(always)]
fn insert_reply(key: &CtKey, value: &CtValue) -> Result<(), ()> {
    if CONNTRACK.insert(key, value, BPF_NOEXIST as u64).is_ok() {
        return Ok(());
    }
    let existing = CONNTRACK.get_ptr(key).ok_or(())?;
    if unsafe { (*existing).flags } & FLAG_REPLY == 0 {
        return Err(());
    }
    CONNTRACK.insert(key, value, 0).map_err(|_| ())
}
