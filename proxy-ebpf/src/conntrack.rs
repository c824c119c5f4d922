//! Connection tracking: one lookup of the packet's own tuple says whether
//! it belongs to a tracked flow, which way it goes, and what to rewrite it
//! to (see `proxy_common::conntrack`). The flow's state moves on with the
//! packets of both directions; a flow that is over gives way to a packet
//! that opens a new one on its tuple.

use core::{
    intrinsics::{AtomicOrdering, atomic_or},
    ptr::addr_of_mut,
};

use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::{
    Backend, CtKey, CtValue,
    conntrack::{
        FLAG_HANDED_TO_TC, FLAG_NOTRACK, FLAG_REPLY, FLAG_SNAT, FLAG_STATEFUL, FLOW_FLAGS, LAST_SEEN_GRANULARITY_NS,
        idle_past, initial_state, is_closed, next_state, opens_flow, partner_key, settled_state, tcp_flags,
    },
    proto,
    stats::ct_stat,
};

use crate::{
    clock,
    maps::{CONNTRACK, ct_timeout_ns},
    parse::Flow,
    stats::count_ct,
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

/// The clock of `CtValue::last_seen_ns`: CLOCK_MONOTONIC_COARSE, a read
/// of the last tick's time (no clock source access, unlike ktime_get_ns),
/// read once a tick per CPU (see `clock`).
#[inline(always)]
pub fn now_ns() -> u64 {
    clock::now_ns()
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
    /// Forward only: XDP picked the backend and left the packet to tc, which
    /// marks it (see [`FLAG_HANDED_TO_TC`]).
    pub handed_to_tc: bool,
    /// Either way: the kernel's conntrack is kept off the flow (see
    /// [`FLAG_NOTRACK`]).
    pub notrack: bool,
    /// The entry itself, so [`taken_over`] needs no second lookup. Only
    /// this module makes a `Tracked`, always from a `CONNTRACK` lookup of
    /// the same run: every `SAFETY` comment on `entry` rests on that.
    entry: *mut CtValue,
}

/// The tracked flow the packet belongs to, in either direction. `None`
/// also when the packet opens a new flow on the tuple of one that is over
/// (see [`is_over`]): its entry is removed, and the packet is what it
/// would be on an untracked tuple (a forward one gets a fresh backend, a
/// backend's is passed as no Service's).
#[inline(always)]
pub fn lookup(flow: &Flow) -> Option<Tracked> {
    let key = key_of(flow);
    let entry = CONNTRACK.get_ptr_mut(key)?;
    let now = now_ns();
    // SAFETY: a map value pointer stays valid for the program's run (the
    // program runs under RCU; an LRU entry deleted meanwhile is not freed,
    // only recycled: its bytes are some flow's, never foreign memory).
    let value = unsafe { &*entry };
    let reply = value.flags & FLAG_REPLY != 0;
    if begins_anew(flow.proto, flow.tcp_flags, reply) && is_over(&key, value, now) {
        remove(&key);
        return None;
    }
    advance(&key, entry, flow, reply, now);
    Some(tracked(entry))
}

/// What the rest of the program needs of an entry.
#[inline(always)]
fn tracked(entry: *mut CtValue) -> Tracked {
    // SAFETY: both callers pass a `CONNTRACK` value pointer of this run,
    // valid until it ends (see `lookup`).
    let value = unsafe { &*entry };
    Tracked {
        reply: value.flags & FLAG_REPLY != 0,
        nat: (value.nat_addr_be, value.nat_port_be),
        snat: value.flags & FLAG_SNAT != 0,
        handed_to_tc: value.flags & FLAG_HANDED_TO_TC != 0,
        notrack: value.flags & FLAG_NOTRACK != 0,
        entry,
    }
}

/// The tracked flow an ICMP error is about (its flow's tuple is the
/// direction it travels): the entry as it is, its state and age untouched
/// (an error neither opens nor keeps a flow alive).
#[inline(always)]
pub fn lookup_related(flow: &Flow) -> Option<Tracked> {
    CONNTRACK.get_ptr_mut(key_of(flow)).map(tracked)
}

/// Whether the packet would begin a connection on an unused tuple: the
/// client's bare SYN or any datagram forward; a SYN (or SYN-ACK) or any
/// datagram from the backend's side.
#[inline(always)]
pub fn begins_anew(l4_proto: u8, flags: u8, reply: bool) -> bool {
    if reply {
        l4_proto != proto::TCP || flags & tcp_flags::SYN != 0
    } else {
        opens_flow(l4_proto, flags)
    }
}

/// Whether the flow is over: closed (TIME_WAIT after a FIN each way,
/// CLOSE after a RST), or idle past its state's timeout both ways (the
/// other entry is read only when this one is idle: a reply-only stream
/// keeps its flow alive).
#[inline(always)]
fn is_over(key: &CtKey, value: &CtValue, now: u64) -> bool {
    match age(value.state, value.flags, value.last_seen_ns, now) {
        Age::Closed => true,
        Age::Live => false,
        Age::Idle(timeout) => match partner_of(key, value) {
            // SAFETY: a `CONNTRACK` value pointer of this run (`partner_of`).
            Some(other) => idle_past(timeout, unsafe { (*other).last_seen_ns }, now),
            None => true,
        },
    }
}

/// What an entry's own fields (of either family) say of its flow's end.
pub enum Age {
    Closed,
    Live,
    /// Idle past its state's timeout (this): over if the other entry is too.
    Idle(u64),
}

#[inline(always)]
pub fn age(state: u8, flags: u8, last_seen_ns: u64, now: u64) -> Age {
    let state = settled_state(state, flags);
    if is_closed(state) {
        return Age::Closed;
    }
    let timeout = ct_timeout_ns(state);
    if idle_past(timeout, last_seen_ns, now) {
        Age::Idle(timeout)
    } else {
        Age::Live
    }
}

/// The flow's other entry: the one at this entry's partner tuple, if it
/// names this entry as its partner in turn. After a client reopened a
/// closed flow's tuple to another backend, the old flow's reply entry
/// points at the new flow's forward entry but not back: a late RST of the
/// old connection must not close the new one.
#[inline(always)]
fn partner_of(key: &CtKey, value: &CtValue) -> Option<*mut CtValue> {
    let other_key = partner_key(key, value);
    let other = CONNTRACK.get_ptr_mut(other_key)?;
    // SAFETY: a map value pointer, valid for the program's run (see `lookup`).
    if partner_key(&other_key, unsafe { &*other }) == *key {
        Some(other)
    } else {
        None
    }
}

/// Moves the flow's state on with the packet (in both entries: the rare
/// packets that change it, SYN-ACK, FIN, RST and a first UDP reply, pay
/// for a second lookup) and marks the entry as used. Writes only what
/// changed, and the timestamp only when it is a second old, so a busy flow
/// does not dirty its entry's cache line on every packet.
#[inline(always)]
fn advance(key: &CtKey, entry: *mut CtValue, flow: &Flow, reply: bool, now: u64) {
    // SAFETY: `lookup`, the one caller, passes its `CONNTRACK` value
    // pointer. Another CPU may write the same entry at once (a flow's
    // packets in both directions): a FIN flag is set atomically (see
    // `set_state`); the other fields are plain integers, and the worst
    // outcome is one of two timestamps or state steps lost, which the next
    // packet repeats.
    let value = unsafe { &mut *entry };
    let flow_flags = value.flags & FLOW_FLAGS;
    let (state, new_flags) = next_state(value.state, flow_flags, flow.proto, reply, flow.tcp_flags);
    if state != value.state || new_flags != flow_flags {
        let fins = new_flags & !flow_flags;
        set_state(entry, state, fins);
        if let Some(other) = partner_of(key, value) {
            // At another key (`create` never makes an entry its own
            // partner), so the two do not alias.
            set_state(other, state, fins);
        }
    }
    if now.wrapping_sub(value.last_seen_ns) > LAST_SEEN_GRANULARITY_NS {
        value.last_seen_ns = now;
    }
}

/// Sets the FIN flags `fins` in the entry with one atomic OR, then its
/// state, settled by every FIN flag now set. Each side's FIN may be handled
/// on its own CPU at the same moment: a plain read-modify-write of the
/// flags byte could lose one of them and leave the flow half-closed for
/// good (its tuple would stay pinned to the old backend when reused).
#[inline(always)]
fn set_state(entry: *mut CtValue, state: u8, fins: u8) {
    // SAFETY: a `CONNTRACK` value pointer of this run (`advance`): the
    // fields' addresses, nothing read.
    let (flags, state_byte) = unsafe { (addr_of_mut!((*entry).flags), addr_of_mut!((*entry).state)) };
    set_entry_state(flags, state_byte, state, fins);
}

/// [`set_state`] on an entry's `flags` and `state` bytes, for both
/// families' entries (`ipv6::conntrack`), which keep them at the same
/// offsets.
#[inline(always)]
pub fn set_entry_state(flags_byte: *mut u8, state_byte: *mut u8, state: u8, fins: u8) {
    let flags = if fins == 0 {
        // SAFETY: the caller's pointers are a conntrack value's fields,
        // valid for the program's run.
        unsafe { *flags_byte }
    } else {
        or_flags(flags_byte, fins) | fins
    };
    // SAFETY: as above.
    unsafe { *state_byte = settled_state(state, flags) };
}

/// ORs `bits` into an entry's flags atomically; returns the flags before.
#[inline(always)]
fn or_flags(flags_byte: *mut u8, bits: u8) -> u8 {
    let word = flags_byte.cast::<u64>();
    // SAFETY: a conntrack value's `flags` (`set_entry_state`), which
    // starts an 8-byte aligned word of the value (asserted in proxy-common)
    // and is its lowest byte on this little-endian target, so ORing `bits`
    // into the word changes `flags` alone. The intrinsic, because core's
    // atomic types give this target (no compare-and-swap) no `fetch_or`;
    // it compiles to one BPF_ATOMIC | BPF_OR | BPF_FETCH (cpu v3).
    let before = unsafe { atomic_or::<u64, u64, { AtomicOrdering::Relaxed }>(word, u64::from(bits)) };
    // Truncation keeps the lowest byte: `flags`.
    #[allow(clippy::cast_possible_truncation)]
    let flags = before as u8;
    flags
}

#[cfg(target_endian = "big")]
compile_error!("or_flags assumes `flags` is the lowest byte of its word");

/// The tc hook took over a flow XDP handed to it: later packets are
/// established ones.
#[inline(always)]
pub fn taken_over(tracked: &Tracked) {
    // SAFETY: `entry` came from this run's `CONNTRACK` lookup (see
    // `Tracked::entry`), valid until the run ends.
    unsafe { (*tracked.entry).flags &= !FLAG_HANDED_TO_TC };
}

/// Records a new flow (the packet is its first, `client -> frontend`) to
/// `backend` in both directions. The reply entry is written first: once the
/// forward entry exists, later packets are DNATed and their replies must
/// already be recognised. Neither insert overwrites another flow's entry;
/// `Err` means the flow is not tracked (and must not be translated).
/// `forward_flags`: the forward entry's (`conntrack::forward_flags`).
#[inline(always)]
pub fn create(flow: &Flow, backend_id: u32, backend: &Backend, rev_nat_id: u32, forward_flags: u8) -> Result<(), ()> {
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
        last_seen_ns: now_ns(),
        flags: FLAG_REPLY | FLAG_STATEFUL | (forward_flags & FLAG_NOTRACK),
        state: initial_state(flow.proto),
        nat_port_be: flow.dport_be,
        nat_addr_be: flow.daddr_be,
    };
    insert_reply(&reply_key, &reply)?;
    let forward = CtValue {
        flags: forward_flags,
        nat_port_be: backend.port_be,
        nat_addr_be: backend.addr_be,
        ..reply
    };
    // The lookup just missed, so this fails only if another CPU created the
    // same flow meanwhile: its entries win, this packet passes.
    if CONNTRACK.insert(key_of(flow), forward, BPF_NOEXIST as u64).is_err() {
        remove(&reply_key);
        return Err(());
    }
    count_ct(ct_stat::INSERTED);
    Ok(())
}

#[inline(always)]
fn remove(key: &CtKey) {
    if CONNTRACK.remove(key).is_ok() {
        count_ct(ct_stat::REMOVED);
    }
}

/// Inserts a reply entry unless its tuple is another flow's forward entry.
/// An older reply entry there (a flow the same client port had to the same
/// backend, over or its forward entry gone) is replaced: its replies and
/// the new flow's are the same packets.
#[inline(always)]
fn insert_reply(key: &CtKey, value: &CtValue) -> Result<(), ()> {
    if CONNTRACK.insert(key, value, BPF_NOEXIST as u64).is_ok() {
        count_ct(ct_stat::INSERTED);
        return Ok(());
    }
    let existing = CONNTRACK.get_ptr(key).ok_or(())?;
    // SAFETY: a map value pointer, valid for the program's run (see `lookup`).
    if unsafe { (*existing).flags } & FLAG_REPLY == 0 {
        return Err(());
    }
    CONNTRACK.insert(key, value, 0).map_err(|_| ())
}
