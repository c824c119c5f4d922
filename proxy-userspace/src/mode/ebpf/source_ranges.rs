//! The source range entries of a Service port's load balancer IPs
//! (`XP_SRC_RANGES` for IPv4, `XP_SRC_RANGES6` for IPv6, see
//! `proxy_common::source_range`).

use std::{collections::BTreeSet, net::IpAddr};

use anyhow::Result;
use proxy_common::{SourceRange6Key, SourceRangeKey};

use super::{LbMaps, write_batch::Staged};
use crate::model::ServicePort;

/// An entry of either trie, ordered by family then its bytes, for sets
/// and diffs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum RangeKeyOrd {
    V4([u8; 12]),
    V6([u8; 24]),
}

impl From<SourceRangeKey> for RangeKeyOrd {
    fn from(k: SourceRangeKey) -> Self {
        Self::V4(bytemuck::cast(k))
    }
}
impl From<SourceRange6Key> for RangeKeyOrd {
    fn from(k: SourceRange6Key) -> Self {
        Self::V6(bytemuck::cast(k))
    }
}

impl RangeKeyOrd {
    /// The frontend the entry lets clients reach.
    pub(super) fn rev_nat_id(&self) -> u32 {
        match *self {
            Self::V4(bytes) => bytemuck::cast::<_, SourceRangeKey>(bytes).rev_nat_id(),
            Self::V6(bytes) => bytemuck::cast::<_, SourceRange6Key>(bytes).rev_nat_id(),
        }
    }

    /// Stages the entry's write into its family's trie.
    pub(super) fn stage_write(self, staged: &mut Staged) {
        match self {
            Self::V4(bytes) => staged.source_ranges.write(bytemuck::cast(bytes), 1),
            Self::V6(bytes) => staged.source_ranges6.write(bytemuck::cast(bytes), 1),
        }
    }

    /// Stages the entry's delete from its family's trie.
    pub(super) fn stage_delete(self, staged: &mut Staged) {
        match self {
            Self::V4(bytes) => staged.source_ranges.delete(bytemuck::cast(bytes)),
            Self::V6(bytes) => staged.source_ranges6.delete(bytemuck::cast(bytes)),
        }
    }
}

/// Every entry of both tries.
pub(super) fn found(maps: &impl LbMaps) -> Result<Vec<RangeKeyOrd>> {
    let v4 = maps.source_range_keys()?.into_iter().map(RangeKeyOrd::from);
    let v6 = maps.source_range6_keys()?.into_iter().map(RangeKeyOrd::from);
    Ok(v4.chain(v6).collect())
}

/// The entries allowing clients to reach the load balancer IP frontend
/// `rev_nat_id` of `svc`: its `loadBalancerSourceRanges`, and every load
/// balancer IP of the Service as a source of its own (kube-proxy's KUBE-FW
/// chain allows those too, for load balancers that hairpin). A port is of
/// one family (the model keeps the ranges of the port's family, as
/// kube-proxy filters them per family), so are its entries.
pub(super) fn entries(svc: &ServicePort, rev_nat_id: u32) -> BTreeSet<RangeKeyOrd> {
    let ranges = svc.source_ranges.iter().map(|r| (r.addr, r.prefix_len));
    let own = svc
        .load_balancer_ips
        .iter()
        .map(|ip| (*ip, if ip.is_ipv4() { 32 } else { 128 }));
    ranges
        .chain(own)
        .map(|(addr, len)| match addr {
            IpAddr::V4(v4) => SourceRangeKey::range(rev_nat_id, v4, len).into(),
            IpAddr::V6(v6) => SourceRange6Key::range(rev_nat_id, v6, len).into(),
        })
        .collect()
}
