//! loadBalancerSourceRanges: may this client open a flow to the load
//! balancer IP? One longest-prefix lookup of `(frontend, client)` (see
//! `proxy_common::source_range`).

use aya_ebpf::maps::lpm_trie::Key;
use proxy_common::{ServiceValue, SourceRangeData, source_range::ID_BITS};

use crate::{maps::SOURCE_RANGES, parse::Flow};

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
