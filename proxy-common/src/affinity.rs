//! ClientIP session affinity: which backend a client of a Service port was
//! given last, and when.
//!
//! The programs keep the affinity map themselves (an LRU hash: a client
//! that stays away long enough is forgotten when room is needed). A hit is
//! used only while it is fresh (`ServiceValue::affinity_timeout_s`) and
//! while its backend is still in the slots the frontend picks from, which
//! the members map answers in one lookup; otherwise the flow is balanced
//! anew and the entry replaced.

use bytemuck::{Pod, Zeroable};

/// Key of the affinity map: a Service port and a client address.
///
/// Affinity is per Service port, as in kube-proxy's iptables mode (one
/// `recent` list per endpoint of the port, whichever frontend the client
/// used): a client of the ClusterIP and of a node port of one port is
/// given one backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct AffinityKey {
    /// The Service port's affinity id (host order): the reverse NAT id of
    /// its ClusterIP frontend ([`crate::ServiceValue::rev_nat_id`]), which
    /// the other frontends find in [`crate::FrontendPort::affinity_id`].
    /// It stays while the port keeps its ClusterIP.
    pub affinity_id: u32,
    /// Client IPv4 address, network byte order.
    pub client_be: u32,
}

/// Value of the affinity map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct AffinityValue {
    /// The backend (backends map key) the client's last new flow went to.
    pub backend_id: u32,
    pub _pad: u32,
    /// `bpf_ktime_get_coarse_ns()` of the client's last new flow: affinity
    /// lasts while the client opens flows, as kube-proxy's `-m recent`.
    pub last_seen_ns: u64,
}

/// Key of the members map: is this backend in this backend set? The value
/// is its slot (`u32`), so a frontend can tell whether the slot is in the
/// run it picks from. Written only for the sets of Service ports with
/// affinity, beside their slots.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct MemberKey {
    /// [`crate::ServiceValue::backend_set`].
    pub backend_set: u32,
    /// Backend id (backends map key).
    pub backend_id: u32,
}

/// The affinity id of a frontend whose Service port map entry is `port`
/// (`None`: it has none, as a ClusterIP frontend): see [`AffinityKey`].
#[inline(always)]
pub fn affinity_id(svc: &crate::ServiceValue, port: Option<&crate::FrontendPort>) -> u32 {
    match port {
        Some(port) if port.affinity_id != 0 => port.affinity_id,
        _ => svc.rev_nat_id,
    }
}

/// Whether an entry last seen at `last_seen_ns` is still fresh at `now_ns`
/// for a timeout of `timeout_s` seconds.
#[inline(always)]
pub fn fresh(last_seen_ns: u64, now_ns: u64, timeout_s: u32) -> bool {
    now_ns.saturating_sub(last_seen_ns) <= u64::from(timeout_s) * 1_000_000_000
}

const _: () = assert!(core::mem::size_of::<AffinityKey>() == 8);
const _: () = assert!(core::mem::size_of::<AffinityValue>() == 16);
const _: () = assert!(core::mem::size_of::<MemberKey>() == 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_fresh_up_to_its_timeout() {
        let s = 1_000_000_000;
        assert!(fresh(5 * s, 15 * s, 10));
        assert!(!fresh(5 * s, 15 * s + 1, 10));
        assert!(fresh(20 * s, 15 * s, 10), "a clock read before the entry's is fresh");
    }
}
