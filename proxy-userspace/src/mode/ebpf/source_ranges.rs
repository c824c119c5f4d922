//! The source range entries of a Service port's load balancer IPs
//! (`XP_SRC_RANGES`, see `proxy_common::source_range`).

use std::collections::BTreeSet;

use proxy_common::SourceRangeKey;

use crate::model::{ServicePort, ipv4};

/// `SourceRangeKey` ordered by its bytes, for sets and diffs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct RangeKeyOrd([u8; 12]);

impl From<SourceRangeKey> for RangeKeyOrd {
    fn from(k: SourceRangeKey) -> Self {
        Self(bytemuck::cast(k))
    }
}
impl From<RangeKeyOrd> for SourceRangeKey {
    fn from(k: RangeKeyOrd) -> Self {
        bytemuck::cast(k.0)
    }
}

/// The entries allowing clients to reach the load balancer IP frontend
/// `rev_nat_id` of `svc`: its `loadBalancerSourceRanges`, and every load
/// balancer IP of the Service as a source of its own (kube-proxy's KUBE-FW
/// chain allows those too, for load balancers that hairpin). The map is
/// IPv4's: IPv6 ranges are not among them.
pub(super) fn entries(svc: &ServicePort, rev_nat_id: u32) -> BTreeSet<RangeKeyOrd> {
    let ranges = (svc.source_ranges.iter()).filter_map(|r| Some((ipv4(r.addr)?, r.prefix_len)));
    let own = (svc.load_balancer_ips.iter()).filter_map(|ip| Some((ipv4(*ip)?, 32)));
    ranges
        .chain(own)
        .map(|(addr, len)| SourceRangeKey::range(rev_nat_id, addr, len).into())
        .collect()
}
