//! loadBalancerSourceRanges: may this client open a flow to the load
//! balancer IP? One longest-prefix lookup of `(frontend, client)` (see
//! `proxy_common::source_range`), in `XP_SRC_RANGES` for IPv4 clients,
//! `XP_SRC_RANGES6` for IPv6 ones.

use aya_ebpf::maps::lpm_trie::Key;
use proxy_common::{ServiceValue, SourceRangeData, source_range::ID_BITS};

use crate::{
    context::Addr6,
    maps::{SCRATCH6, SOURCE_RANGES, SOURCE_RANGES6},
    parse::Flow,
};

/// Whether the packet's source is inside one of the frontend's ranges.
#[inline(always)]
pub fn allowed(flow: &Flow, svc: &ServiceValue) -> bool {
    let key = Key::new(
        ID_BITS + 32,
        SourceRangeData {
            rev_nat_id_be: svc.rev_nat_id.to_be(),
            addr_be: flow.saddr_be,
        },
    );
    SOURCE_RANGES.get(&key).is_some()
}

/// Whether the IPv6 source `saddr` is inside one of the frontend's
/// ranges. The 24-byte key is built in this CPU's scratch slot: the tc
/// programs' stack has no room for it on 6.1 (see `crate::maps::SCRATCH6`).
/// No slot (never, for an array): not allowed, closed.
#[inline(always)]
pub fn allowed6(saddr: &Addr6, svc: &ServiceValue) -> bool {
    let Some(scratch) = SCRATCH6.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of an array map, never freed; no other run
    // on this CPU comes between (see `crate::ipv6::conntrack::create`).
    let key = unsafe { &mut (*scratch).range_key };
    key.prefix_len = ID_BITS + 128;
    key.data.rev_nat_id_be = svc.rev_nat_id.to_be();
    key.data.addr_be = *saddr;
    // By reference: the slot's bytes, not a copy on the stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    SOURCE_RANGES6.get(&*key).is_some()
}
