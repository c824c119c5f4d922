//! Both families in a rule-writing mode, the way kube-proxy does it
//! (its "meta proxier"): one single-family mode per family with the same
//! layout, e.g. the iptables mode's IPv4 half writing through
//! `iptables-restore` and its IPv6 half through `ip6tables-restore`, or
//! the nftables mode's `ip` and `ip6` tables. Each half gets the ports of
//! its family only and keeps its own state, so a failure of one leaves
//! the other's sync in place; the UDP flows a sync left stale are deleted
//! once, for both families (the conntrack layer dumps both tables).

use std::collections::BTreeMap;

use anyhow::{Result, anyhow};
use tracing::warn;

use super::{Dataplane, ModeCounters, Plan, SyncedChange, conntrack};
use crate::model::{IpFamily, Problem, ServicePort};

/// A mode over every family a half was started for.
pub struct DualStack {
    /// Each serves one family (its `families()` has one entry).
    halves: Vec<Box<dyn Dataplane>>,
    families: &'static [IpFamily],
}

impl DualStack {
    /// The IPv4 half and, if `v6` could be started, the IPv6 one; else
    /// the mode serves IPv4 only and says why, as kube-proxy falls back
    /// to single-stack on a node without IPv6 support.
    pub fn start(v4: Box<dyn Dataplane>, v6: Result<Box<dyn Dataplane>>) -> Self {
        match v6 {
            Ok(v6) => Self::new(vec![v4, v6]),
            Err(e) => {
                warn!(
                    error = format!("{e:#}"),
                    "IPv6 cannot be programmed: the {} mode serves IPv4 only",
                    v4.name()
                );
                Self::new(vec![v4])
            }
        }
    }

    /// A mode over `halves`, one per family.
    pub fn new(halves: Vec<Box<dyn Dataplane>>) -> Self {
        let families = if halves.iter().any(|h| family_of(h.as_ref()) == IpFamily::V6) {
            &[IpFamily::V4, IpFamily::V6][..]
        } else {
            &[IpFamily::V4][..]
        };
        Self { halves, families }
    }
}

/// The family a half serves.
fn family_of(half: &dyn Dataplane) -> IpFamily {
    half.families().first().copied().unwrap_or_default()
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
fn each_half(
    halves: &mut [Box<dyn Dataplane>],
    mut sync: impl FnMut(&mut dyn Dataplane, IpFamily) -> Result<()>,
) -> Result<()> {
    let mut failed = Vec::new();
    for half in halves {
        let family = family_of(half.as_ref());
        if let Err(e) = sync(half.as_mut(), family) {
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
fn merged_counters(halves: &[Box<dyn Dataplane>]) -> ModeCounters {
    let mut total = ModeCounters::default();
    for counters in halves.iter().map(|h| h.counters()) {
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
        self.halves.first().map_or("dual-stack", |h| h.name())
    }

    fn families(&self) -> &'static [IpFamily] {
        self.families
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        each_half(&mut self.halves, |half, family| half.apply(&plan_of(plan, family)))
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        each_half(&mut self.halves, |half, family| {
            half.apply_full(&desired_of(desired, family))
        })
    }

    fn kernel_writes(&self) -> u64 {
        self.halves.iter().map(|h| h.kernel_writes()).sum()
    }

    fn delete_stale_flows(&mut self, change: &SyncedChange<'_>) -> u64 {
        conntrack::delete_stale_flows(change)
    }

    fn take_problems(&mut self) -> Vec<Problem> {
        self.halves.iter_mut().flat_map(|h| h.take_problems()).collect()
    }

    fn counters(&self) -> ModeCounters {
        merged_counters(&self.halves)
    }
}
