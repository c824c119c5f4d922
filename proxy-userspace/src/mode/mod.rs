//! Data-plane modes. Each one programs the kernel from the same model
//! through the same interface, so every mode can be compared on equal terms.

pub mod conntrack;
pub mod dual_stack;
pub mod ebpf;
pub mod fake;
#[cfg(test)]
mod fixtures;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod options;
pub mod unhonoured;
pub mod userspace;

use std::collections::BTreeMap;

use anyhow::Result;

use crate::model::{IpFamily, Problem, ServicePort};

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

    /// The address families the mode programs. The reconciler hands it
    /// the ports of these families only and reports the others, once
    /// each, as not served.
    fn families(&self) -> &'static [IpFamily] {
        &[IpFamily::V4]
    }

    /// A partial sync: programs `plan` (removals first), touching nothing else.
    fn apply(&mut self, plan: &Plan) -> Result<()>;

    /// A full sync: makes the kernel state equal to `desired`, also removing
    /// whatever else is there (left by an earlier run or a failed sync).
    /// Parts already right are left alone.
    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()>;

    /// Kernel writes (map updates, rules, ...) issued so far: a sync that
    /// finds everything in place adds none.
    fn kernel_writes(&self) -> u64;

    /// After a successful sync: deletes the tracked UDP flows `change` left
    /// pointing at an endpoint that is gone, so that their next packets
    /// pick a current one (the kernel's conntrack for the modes that NAT
    /// in netfilter, see [`conntrack`]; the programs' own table for the
    /// ebpf mode). Returns how many deletions it made, for the sync
    /// report. A failure is logged, not returned: the flows still expire
    /// on their own. The default deletes nothing (no flows to track).
    fn delete_stale_flows(&mut self, change: &SyncedChange<'_>) -> u64 {
        let _ = change;
        0
    }

    /// Service fields the mode could not honour since it was last asked
    /// (each reported once by the mode), for the agent to log and count.
    /// The default has none.
    fn take_problems(&mut self) -> Vec<Problem> {
        Vec::new()
    }

    /// The mode's own counts behind kube-proxy's mode-specific metrics.
    /// The default has none.
    fn counters(&self) -> ModeCounters {
        ModeCounters::default()
    }
}

/// What a mode counts of its kernel interface, for kube-proxy's metrics of
/// that mode (`kubeproxy_sync_proxy_rules_iptables_*`, `..._nftables_*`).
/// Counts only grow; the rule counts are a reading.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModeCounters {
    /// iptables: rules in the mode's chains and jumps into them, per
    /// table, as read back after the last full sync that wrote them.
    pub iptables_rules: Vec<(&'static str, u64)>,
    /// iptables: `iptables-restore` runs that failed, of full syncs.
    pub iptables_restore_failures: u64,
    /// iptables: `iptables-restore` runs that failed, of partial syncs.
    pub iptables_partial_restore_failures: u64,
    /// nftables: `nft` transactions that failed (kube-proxy counts them
    /// the same way, a retried one too).
    pub nftables_sync_failures: u64,
}

/// What a successful sync changed: what a mode needs to find the flows the
/// sync left stale.
#[derive(Clone, Copy, Debug)]
pub struct SyncedChange<'a> {
    /// The changes applied; for a full sync, every port that differed
    /// from `before`.
    pub plan: &'a Plan,
    /// What the kernel held before the sync, when known: not at start (an
    /// earlier run may have left anything) nor after a failed sync. Judged
    /// against an unknown state every port would look new.
    pub before: Option<&'a BTreeMap<String, ServicePort>>,
    /// What the sync programmed (the whole desired state).
    pub after: &'a BTreeMap<String, ServicePort>,
    /// Whether it was a full sync.
    pub full: bool,
}
