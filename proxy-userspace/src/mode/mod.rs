//! Data-plane modes. Each one programs the kernel from the same model
//! through the same interface, so every mode can be compared on equal terms.

pub mod conntrack;
pub mod ebpf;
pub mod fake;
#[cfg(test)]
mod fixtures;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod options;
pub mod userspace;

use std::collections::BTreeMap;

use anyhow::Result;

// The ebpf mode's map writer still names these by their old home.
use crate::model::ServicePort;
pub use crate::model::{EndpointSets, usable_endpoints};

/// Changes for a data-plane mode to apply: first `remove`, then `upsert`.
/// The reconciler computes it (`reconcile::diff`); every mode takes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Service ports to program, new or changed.
    pub upsert: Vec<ServicePort>,
    /// Service ports to take out, as they were applied (a mode finds what
    /// to delete from them).
    pub remove: Vec<ServicePort>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty() && self.remove.is_empty()
    }

    /// Number of endpoints touched, for kube-proxy's endpoint change metric.
    pub fn endpoint_changes(&self) -> usize {
        self.upsert
            .iter()
            .chain(&self.remove)
            .map(|p| p.endpoints.len().max(1))
            .sum()
    }
}

/// One way of turning Service ports into kernel state.
pub trait Dataplane: Send {
    /// The `--mode` name.
    fn name(&self) -> &'static str;

    /// A partial sync: programs `plan` (removals first), touching nothing else.
    fn apply(&mut self, plan: &Plan) -> Result<()>;

    /// A full sync: makes the kernel state equal to `desired`, also removing
    /// whatever else is there (left by an earlier run or a failed sync).
    /// Parts already right are left alone.
    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()>;

    /// Kernel writes (map updates, rules, ...) issued so far: a sync that
    /// finds everything in place adds none.
    fn kernel_writes(&self) -> u64;

    /// Tracked flows the mode deleted itself so far (the ebpf mode's UDP
    /// flows whose endpoint left): counted in the sync report like the
    /// kernel conntrack deletions the reconciler makes for the other modes.
    fn flows_deleted(&self) -> u64 {
        0
    }

    /// Whether UDP flows are translated by the kernel's conntrack (netfilter
    /// NAT), so that the flows of an endpoint that left must be deleted
    /// after a sync ([`conntrack`]). The ebpf mode tracks its own flows.
    fn nat_in_kernel_conntrack(&self) -> bool {
        false
    }
}
