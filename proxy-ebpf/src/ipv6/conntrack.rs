//! Connection tracking of IPv6 flows in `XP_CT6`: IPv4's scheme
//! (`crate::conntrack`: two entries a flow, one lookup a packet, the
//! flow's state moved on by both directions, a closed or idle flow giving
//! way to a new one on its tuple) with 16-byte addresses. The state
//! arithmetic is IPv4's own functions; only what touches keys is here.

use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::{
    CtKey6, CtValue6,
    conntrack::{
        FLAG_HANDED_TO_TC, FLAG_NOTRACK, FLAG_REPLY, FLAG_SNAT, FLAG_STATEFUL, FLOW_FLAGS, LAST_SEEN_GRANULARITY_NS,
        idle_past, initial_state, next_state,
    },
    ipv6::partner_key6,
    stats::ct_stat,
};

use super::parse::Flow6;
use crate::{
    conntrack::{Age, age, begins_anew, now_ns, set_entry_state},
    context::Addr6,
    maps::{CONNTRACK6, SCRATCH6},
    stats::count_ct,
};

#[inline(always)]
fn key_of(flow: &Flow6) -> CtKey6 {
    CtKey6 {
        saddr_be: *flow.saddr(),
        daddr_be: *flow.daddr(),
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto: flow.proto,
        _pad: [0; 3],
    }
}

/// The entry of a tracked flow the packet belongs to (see
/// `crate::conntrack::Tracked`).
pub struct Tracked6 {
    pub reply: bool,
    pub snat: bool,
    pub handed_to_tc: bool,
    pub notrack: bool,
    /// A `CONNTRACK6` value pointer of this run, as `Tracked::entry`.
    entry: *mut CtValue6,
}

/// The tracked flow the packet belongs to, either way; `None` also when
/// the packet opens a new flow on the tuple of one that is over.
#[inline(always)]
pub fn lookup(flow: &Flow6) -> Option<Tracked6> {
    let key = key_of(flow);
    let entry = CONNTRACK6.get_ptr_mut(key)?;
    let now = now_ns();
    // SAFETY: a map value pointer stays valid for the program's run (see
    // `crate::conntrack::lookup`).
    let value = unsafe { &*entry };
    let reply = value.flags & FLAG_REPLY != 0;
    if begins_anew(flow.proto, flow.tcp_flags, reply) && is_over(&key, value, now) {
        remove(&key);
        return None;
    }
    advance(&key, entry, flow, reply, now);
    // SAFETY: as above.
    let value = unsafe { &*entry };
    Some(Tracked6 {
        reply,
        snat: value.flags & FLAG_SNAT != 0,
        handed_to_tc: value.flags & FLAG_HANDED_TO_TC != 0,
        notrack: value.flags & FLAG_NOTRACK != 0,
        entry,
    })
}

/// The tracked flow an ICMPv6 error's flow (see `icmp_error`) belongs
/// to, as it is: an error moves no state on.
#[inline(always)]
pub fn lookup_related(flow: &Flow6) -> Option<Tracked6> {
    let entry = CONNTRACK6.get_ptr_mut(key_of(flow))?;
    // SAFETY: a map value pointer stays valid for the program's run.
    let flags = unsafe { (*entry).flags };
    Some(Tracked6 {
        reply: flags & FLAG_REPLY != 0,
        snat: flags & FLAG_SNAT != 0,
        handed_to_tc: flags & FLAG_HANDED_TO_TC != 0,
        notrack: flags & FLAG_NOTRACK != 0,
        entry,
    })
}

#[inline(always)]
fn is_over(key: &CtKey6, value: &CtValue6, now: u64) -> bool {
    match age(value.state, value.flags, value.last_seen_ns, now) {
        Age::Closed => true,
        Age::Live => false,
        Age::Idle(timeout) => match partner_of(key, value) {
            // SAFETY: a `CONNTRACK6` value pointer of this run (`partner_of`).
            Some(other) => idle_past(timeout, unsafe { (*other).last_seen_ns }, now),
            None => true,
        },
    }
}

/// The flow's other entry, if it names this one back (see
/// `crate::conntrack::partner_of`).
#[inline(always)]
fn partner_of(key: &CtKey6, value: &CtValue6) -> Option<*mut CtValue6> {
    let other_key = partner_key6(key, value);
    let other = CONNTRACK6.get_ptr_mut(other_key)?;
    // SAFETY: a map value pointer, valid for the program's run.
    if partner_key6(&other_key, unsafe { &*other }) == *key {
        Some(other)
    } else {
        None
    }
}

/// Moves the flow's state on in both entries, and the entry's time (see
/// `crate::conntrack::advance`).
#[inline(always)]
fn advance(key: &CtKey6, entry: *mut CtValue6, flow: &Flow6, reply: bool, now: u64) {
    // SAFETY: `lookup`'s `CONNTRACK6` value pointer; concurrent writers
    // as in `crate::conntrack::advance`.
    let value = unsafe { &mut *entry };
    let flow_flags = value.flags & FLOW_FLAGS;
    let (state, new_flags) = next_state(value.state, flow_flags, flow.proto, reply, flow.tcp_flags);
    if state != value.state || new_flags != flow_flags {
        let fins = new_flags & !flow_flags;
        set_state(entry, state, fins);
        if let Some(other) = partner_of(key, value) {
            set_state(other, state, fins);
        }
    }
    if now.wrapping_sub(value.last_seen_ns) > LAST_SEEN_GRANULARITY_NS {
        value.last_seen_ns = now;
    }
}

#[inline(always)]
fn set_state(entry: *mut CtValue6, state: u8, fins: u8) {
    // SAFETY: a `CONNTRACK6` value pointer of this run: the fields'
    // addresses, nothing read.
    let (flags, state_byte) = unsafe {
        (
            core::ptr::addr_of_mut!((*entry).flags),
            core::ptr::addr_of_mut!((*entry).state),
        )
    };
    set_entry_state(flags, state_byte, state, fins);
}

impl Tracked6 {
    /// `(address, port)` to rewrite to, network byte order, read in the
    /// entry itself (a copy would cost 16 bytes of stack, of which IPv6
    /// has none to spare: see `create`).
    #[inline(always)]
    pub fn nat(&self) -> (&Addr6, u16) {
        // SAFETY: `entry` is a `CONNTRACK6` value pointer of this run,
        // valid until it ends; the reference does not outlive `self`.
        unsafe { (&(*self.entry).nat_addr_be, (*self.entry).nat_port_be) }
    }
}

/// The tc hook took over a flow XDP handed to it.
#[inline(always)]
pub fn taken_over(tracked: &Tracked6) {
    // SAFETY: `entry` came from this run's `CONNTRACK6` lookup.
    unsafe { (*tracked.entry).flags &= !FLAG_HANDED_TO_TC };
}

/// A new flow's backend end, for [`create`].
pub struct NewFlow6 {
    pub backend_id: u32,
    pub backend: (Addr6, u16),
    pub rev_nat_id: u32,
    /// The forward entry's flags (`conntrack::forward_flags`).
    pub forward_flags: u8,
}

/// Records a new flow in both directions, the reply entry first (see
/// `crate::conntrack::create`); `Err`: not tracked, not to be translated.
/// The key and the value are written in this CPU's [`SCRATCH6`] slot and
/// over in place, not on the stack: IPv6's 40-byte keys and values are
/// what the stack (512 bytes, 480 where a helper function is called on
/// 6.1) has no room for.
#[inline(always)]
pub fn create(flow: &Flow6, new: &NewFlow6) -> Result<(), ()> {
    let scratch = SCRATCH6.get_ptr_mut(0).ok_or(())?;
    // SAFETY: this CPU's slot of an array map, never freed; no other run
    // on this CPU comes between (the hooks run with bottom halves off).
    let (key, value) = unsafe { (&mut (*scratch).key, &mut (*scratch).value) };
    *key = reply_key_of(flow, new);
    *value = CtValue6 {
        backend_id: new.backend_id,
        rev_nat_id: new.rev_nat_id,
        last_seen_ns: now_ns(),
        flags: FLAG_REPLY | FLAG_STATEFUL | (new.forward_flags & FLAG_NOTRACK),
        state: initial_state(flow.proto),
        nat_port_be: flow.dport_be,
        _pad: 0,
        nat_addr_be: *flow.daddr(),
    };
    insert_reply(key, value)?;
    value.flags = new.forward_flags;
    value.nat_port_be = new.backend.1;
    value.nat_addr_be = new.backend.0;
    *key = key_of(flow);
    // By reference: the scratch slot's bytes, not a copy on the stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let inserted = CONNTRACK6.insert(&*key, &*value, BPF_NOEXIST as u64);
    if inserted.is_err() {
        *key = reply_key_of(flow, new);
        remove(key);
        return Err(());
    }
    count_ct(ct_stat::INSERTED);
    Ok(())
}

/// The key of a new flow's reply entry: `backend -> client`.
#[inline(always)]
fn reply_key_of(flow: &Flow6, new: &NewFlow6) -> CtKey6 {
    CtKey6 {
        saddr_be: new.backend.0,
        daddr_be: *flow.saddr(),
        sport_be: new.backend.1,
        dport_be: flow.sport_be,
        proto: flow.proto,
        _pad: [0; 3],
    }
}

#[inline(always)]
fn remove(key: &CtKey6) {
    if CONNTRACK6.remove(key).is_ok() {
        count_ct(ct_stat::REMOVED);
    }
}

/// Inserts a reply entry unless its tuple is another flow's forward
/// entry (see `crate::conntrack::insert_reply`).
#[inline(always)]
fn insert_reply(key: &CtKey6, value: &CtValue6) -> Result<(), ()> {
    if CONNTRACK6.insert(key, value, BPF_NOEXIST as u64).is_ok() {
        count_ct(ct_stat::INSERTED);
        return Ok(());
    }
    let existing = CONNTRACK6.get_ptr(key).ok_or(())?;
    // SAFETY: a map value pointer, valid for the program's run.
    if unsafe { (*existing).flags } & FLAG_REPLY == 0 {
        return Err(());
    }
    CONNTRACK6.insert(key, value, 0).map_err(|_| ())
}
