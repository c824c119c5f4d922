//! sessionAffinity: ClientIP. A client's new flow goes to the backend its
//! last one to the same Service port went to (through any of its
//! frontends), while that was recent enough and the backend is still in
//! the frontend's run of slots; else it is balanced anew and remembered
//! (see `proxy_common::affinity`). IPv4 clients are kept in `XP_AFFINITY`,
//! IPv6 ones in `XP_AFFINITY6`; the rest is the same code.

use aya_ebpf::maps::LruHashMap;
use proxy_common::{AffinityKey, AffinityValue, Backend, MemberKey, ServiceValue, affinity::fresh};

use crate::{
    clock,
    maps::{AFFINITY, MEMBERS},
    parse::Flow,
    select,
};

/// The affinity entry's key of the packet's client at the Service port
/// `affinity_id` (see `service_port`).
#[inline(always)]
fn key_of(flow: &Flow, affinity_id: u32) -> AffinityKey {
    AffinityKey {
        affinity_id,
        client_be: flow.saddr_be,
    }
}

#[inline(always)]
fn now_ns() -> u64 {
    clock::now_ns()
}

/// The client's remembered backend, if it still serves (see [`kept_id`]).
#[inline(always)]
pub fn kept_backend(flow: &Flow, svc: &ServiceValue, affinity_id: u32) -> Option<(u32, Backend)> {
    let id = kept_id(&AFFINITY, &key_of(flow, affinity_id), svc)?;
    Some((id, select::backend(id)?))
}

/// Remembers `backend_id` as the client's backend at the Service port
/// `affinity_id`, from now on.
#[inline(always)]
pub fn remember(flow: &Flow, affinity_id: u32, backend_id: u32) {
    remember_in(&AFFINITY, &key_of(flow, affinity_id), backend_id);
}

/// Remembers `backend_id` under `key` in `map` (either family's), from now on.
#[inline(always)]
pub fn remember_in<K>(map: &LruHashMap<K, AffinityValue>, key: &K, backend_id: u32) {
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_seen_ns: now_ns(),
    };
    // A full map evicts its least recently used client; a failure only
    // costs this client its affinity.
    let _ = map.insert(key, value, 0);
}

/// The backend id remembered under `key` in `map` (either family's), if
/// its entry is fresh and the backend is in the frontend's slots now (a
/// backend that left the Service, or a `Local` frontend's backend that is
/// not this node's any more, releases its clients). Its time is moved on
/// in place.
#[inline(always)]
pub fn kept_id<K>(map: &LruHashMap<K, AffinityValue>, key: &K, svc: &ServiceValue) -> Option<u32> {
    let now = now_ns();
    let entry = map.get_ptr_mut(key)?;
    // SAFETY: a map value pointer stays valid for the program's run (an
    // LRU entry deleted meanwhile is recycled, not freed); a racing
    // update of the same client's entry only changes which backend wins.
    let remembered = unsafe { *entry };
    if !fresh(remembered.last_seen_ns, now, svc.affinity_timeout_s) {
        return None;
    }
    let member = MemberKey {
        backend_set: svc.backend_set,
        backend_id: remembered.backend_id,
    };
    // SAFETY: copied out at once, as in `lookup::frontend`.
    let slot = unsafe { *MEMBERS.get(member)? };
    if slot.wrapping_sub(svc.backend_offset) >= svc.backend_count {
        return None;
    }
    // SAFETY: as above: a valid, aligned pointer to the entry.
    unsafe { (*entry).last_seen_ns = now };
    Some(remembered.backend_id)
}
