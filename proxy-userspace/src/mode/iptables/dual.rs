//! Both families in the iptables mode, the way kube-proxy does it: one
//! proxier per family with the same chain layout, the IPv4 one writing
//! through `iptables-restore`, the IPv6 one through `ip6tables-restore`
//! (kube-proxy's "meta proxier"). Each half gets the ports of its family
//! only and keeps its own state, so a failure of one leaves the other's
//! sync in place; the UDP flows a sync left stale are deleted once, for
//! both families (the conntrack layer dumps both tables).

use std::collections::BTreeMap;

use anyhow::{Result, anyhow};
use tracing::warn;

use super::IptablesMode;
use crate::{
    config::Config,
    mode::{Dataplane, ModeCounters, Plan, SyncedChange, conntrack},
    model::{IpFamily, Problem, ServicePort},
};

/// The iptables mode over every family the node's tools handle.
pub struct DualStack {
    halves: Vec<IptablesMode>,
    families: &'static [IpFamily],
}

impl DualStack {
    /// Both halves; without working `ip6tables` tools (or an IPv6 nat
    /// table) the mode serves IPv4 only and says so, as kube-proxy falls
    /// back to single-stack on a node without IPv6 support.
    pub fn start(config: &Config) -> Result<Self> {
        let v4 = IptablesMode::start(config)?;
        match IptablesMode::start_family(config, IpFamily::V6) {
            Ok(v6) => Ok(Self::new(vec![v4, v6])),
            Err(e) => {
                warn!(
                    error = format!("{e:#}"),
                    "ip6tables cannot be used: the iptables mode serves IPv4 only"
                );
                Ok(Self::new(vec![v4]))
            }
        }
    }

    /// A mode over `halves`, one per family (as tests build them).
    pub fn new(halves: Vec<IptablesMode>) -> Self {
        let families = if halves.iter().any(|h| h.options().family == IpFamily::V6) {
            &[IpFamily::V4, IpFamily::V6][..]
        } else {
            &[IpFamily::V4][..]
        };
        Self { halves, families }
    }

    /// The half writing the rules of `family`, if there is one.
    pub fn half(&self, family: IpFamily) -> Option<&IptablesMode> {
        self.halves.iter().find(|h| h.options().family == family)
    }
}

/// The part of `plan` of `family`.
fn plan_of(plan: &Plan, family: IpFamily) -> Plan {
    let of = |ports: &[ServicePort]| ports.iter().filter(|p| p.family() == family).cloned().collect();
    Plan {
        upsert: of(&plan.upsert),
        remove: of(&plan.remove),
    }
}

/// The ports of `desired` of `family`.
fn desired_of(desired: &BTreeMap<String, ServicePort>, family: IpFamily) -> BTreeMap<String, ServicePort> {
    desired
        .iter()
        .filter(|(_, p)| p.family() == family)
        .map(|(name, p)| (name.clone(), p.clone()))
        .collect()
}

/// Runs `sync` on every half and returns the first failure (naming its
/// family) after all have run: one family's broken rules must not keep
/// the other's from being written.
fn each_half(halves: &mut [IptablesMode], mut sync: impl FnMut(&mut IptablesMode) -> Result<()>) -> Result<()> {
    let mut failed = Vec::new();
    for half in halves {
        let family = half.options().family;
        if let Err(e) = sync(half) {
            failed.push(e.context(format!("{family:?} rules")));
        }
    }
    let mut failed = failed.into_iter();
    match (failed.next(), failed.next()) {
        (None, _) => Ok(()),
        (Some(e), None) => Err(e),
        (Some(first), Some(second)) => Err(anyhow!("{first:#}; and {second:#}")),
    }
}

/// The counters of both halves: failures add up, and so do the rules of
/// a table (`filter` counts the IPv4 and the IPv6 filter table's rules).
fn merged_counters(halves: &[IptablesMode]) -> ModeCounters {
    let mut total = ModeCounters::default();
    for counters in halves.iter().map(Dataplane::counters) {
        total.iptables_restore_failures += counters.iptables_restore_failures;
        total.iptables_partial_restore_failures += counters.iptables_partial_restore_failures;
        total.nftables_sync_failures += counters.nftables_sync_failures;
        for (table, rules) in counters.iptables_rules {
            match total.iptables_rules.iter_mut().find(|(t, _)| *t == table) {
                Some((_, sum)) => *sum += rules,
                None => total.iptables_rules.push((table, rules)),
            }
        }
    }
    total
}

impl Dataplane for DualStack {
    fn name(&self) -> &'static str {
        "iptables"
    }

    fn families(&self) -> &'static [IpFamily] {
        self.families
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        each_half(&mut self.halves, |half| {
            let part = plan_of(plan, half.options().family);
            half.apply(&part)
        })
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        each_half(&mut self.halves, |half| {
            half.apply_full(&desired_of(desired, half.options().family))
        })
    }

    fn kernel_writes(&self) -> u64 {
        self.halves.iter().map(Dataplane::kernel_writes).sum()
    }

    fn delete_stale_flows(&mut self, change: &SyncedChange<'_>) -> u64 {
        conntrack::delete_stale_flows(change)
    }

    fn take_problems(&mut self) -> Vec<Problem> {
        self.halves.iter_mut().flat_map(Dataplane::take_problems).collect()
    }

    fn counters(&self) -> ModeCounters {
        merged_counters(&self.halves)
    }
}
