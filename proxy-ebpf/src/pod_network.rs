//! Whether an address is a pod's: inside the pod networks (`clusterCIDR`)
//! the agent writes into `XP_POD_CIDRS` / `XP_POD_CIDRS6`. Asked of a new
//! flow's client (pods' short-circuit of `Local` external frontends, see
//! `service_port`) and of its backend (flows between pods keep out of the
//! kernel's conntrack, see `notrack`).

use aya_ebpf::maps::lpm_trie::Key;

use crate::{
    context::Addr6,
    maps::{POD_CIDRS, POD_CIDRS6, SCRATCH6},
};

/// Whether the IPv4 address `addr_be` (network byte order) is a pod's.
// The key by reference: by value the verifier walks some 2,500 more
// instructions in tc_ingress (measured: 21,206 against 18,653).
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn contains(addr_be: u32) -> bool {
    POD_CIDRS.get(&Key::new(32, addr_be)).is_some()
}

/// Whether the IPv6 address `addr` is a pod's, looked up with a key in
/// this CPU's scratch slot (as `crate::source_range::allowed6`: 20 bytes
/// the tc programs' stack has no room for on 6.1).
#[inline(always)]
pub fn contains6(addr: &Addr6) -> bool {
    let Some(scratch) = SCRATCH6.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of an array map, never freed; no other run
    // on this CPU comes between.
    let key = unsafe { &mut (*scratch).pod_key };
    key.prefix_len = 128;
    key.data = *addr;
    #[allow(clippy::needless_borrows_for_generic_args)]
    POD_CIDRS6.get(&*key).is_some()
}
