//! kube-proxy's iptables mode, kept for side-by-side comparison with the
//! eBPF data path: the same chains, rules and chain names kube-proxy
//! writes, so `iptables-save` on an xproxy node reads like on a kube-proxy
//! node.
//!
//! Every sync is one `iptables-restore --noflush` (see [`rules`] for the
//! layout). A partial sync rewrites the top-level chains (`KUBE-SERVICES`,
//! `KUBE-NODEPORTS`, the filter chains, ...) and only the changed ports'
//! own chains, and deletes the chains those ports no longer use. A full
//! sync reads the kernel's rules first (`iptables-save`), inserts missing
//! jumps from the built-in chains, rewrites all of its chains and deletes
//! stale per-service chains; when the kernel still holds exactly what the
//! last full sync of the same state left, it writes nothing.
//!
//! IPv6 ports get a ruleset of their own through `ip6tables-restore`, with
//! the same layout, as kube-proxy runs a second proxier for IPv6: an
//! `IptablesMode` serves one family ([`RuleOptions::family`]) and
//! [`start`] pairs two under [`DualStack`].
//!
//! The parts: [`chains`] names the chains (kube-proxy's hashes), [`rules`]
//! renders them; `iptables-save` and `iptables-restore` run in
//! [`crate::sys::iptables`].

pub mod chains;
pub mod rules;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
};

pub use crate::sys::iptables::{Iptables, Saved, SystemIptables};
use anyhow::{Context, Result};
pub use rules::{NodePortDestinations, RuleOptions};
use rules::{Rewrite, SyncInput, jumps, port_chains, render};
use tracing::{debug, info, warn};

pub use super::options::LocalTraffic;
use super::{
    Dataplane, ModeCounters, Plan, SyncedChange, conntrack,
    dual_stack::DualStack,
    options::{FamilyNodePorts, node_ips_of},
    unhonoured::Unhonoured,
};
use crate::{
    config::{Cidr, Config},
    model::{IpFamily, ServicePort},
    sys::{
        addrs,
        iptables::{owned_lines, owned_rule_counts, remove_chains},
    },
};

/// NodePorts on 127.0.0.1 need the kernel to route loopback destinations
/// off the host (per network namespace).
const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";
/// Set: conntrack accepts out-of-window TCP packets, so INVALID ones need
/// not be dropped.
const TCP_BE_LIBERAL: &str = "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal";

pub struct IptablesMode {
    opts: RuleOptions,
    /// `nodePortAddresses` given as networks: the local addresses in them
    /// are looked up again at every sync (kube-proxy does too), so an
    /// address added later answers from the next sync on.
    node_port_cidrs: Option<NodePortCidrs>,
    /// Whether `node_port_cidrs` were looked up once (the first lookup is
    /// always logged).
    node_ports_resolved: bool,
    iptables: Box<dyn Iptables>,
    /// What the last successful sync programmed.
    state: BTreeMap<String, ServicePort>,
    /// What a full sync left in the kernel, to recognise a kernel that
    /// nobody changed since.
    verified: Option<Verified>,
    writes: u64,
    last_input: String,
    unhonoured: Unhonoured,
    /// Restore failures and the rules read back (see [`ModeCounters`]).
    counters: ModeCounters,
}

/// The tables kube-proxy counts its rules in
/// (`kubeproxy_sync_proxy_rules_iptables_total{table}`).
const RULE_TABLES: &[&str] = &["filter", "nat"];

struct Verified {
    desired: BTreeMap<String, ServicePort>,
    /// The options it was written with (node port addresses may change).
    opts: RuleOptions,
    ours: Vec<String>,
}

/// `nodePortAddresses` as networks, and whether 127.0.0.0/8 may answer
/// (`iptables.localhostNodePorts`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePortCidrs {
    pub cidrs: Vec<Cidr>,
    pub localhost: bool,
}

impl NodePortCidrs {
    /// The local addresses of `family` (of the calling thread's network
    /// namespace) NodePorts answer on; never `::1` (see
    /// [`RuleOptions::localhost_node_ports`]).
    pub fn resolve(&self, family: IpFamily) -> Result<Vec<IpAddr>> {
        Ok(addrs::local_ips()
            .context("listing local addresses for nodePortAddresses")?
            .into_iter()
            .filter(|ip| IpFamily::of(*ip) == family)
            .filter(|ip| self.cidrs.iter().any(|c| c.contains(*ip)))
            .filter(|ip| !ip.is_loopback() || (self.localhost && family == IpFamily::V4))
            .collect())
    }
}

/// Starts the iptables mode for `xproxy run`: an IPv4 half and, where
/// `ip6tables` works, an IPv6 half (see [`DualStack`]).
pub fn start(config: &Config) -> Result<Box<dyn Dataplane>> {
    let v4 = Box::new(IptablesMode::start(config)?);
    let v6 = IptablesMode::start_family(config, IpFamily::V6).map(|m| Box::new(m) as Box<dyn Dataplane>);
    Ok(Box::new(DualStack::start(v4, v6)))
}

impl IptablesMode {
    /// A mode writing through `iptables` with `opts`; touches nothing yet.
    pub fn new(opts: RuleOptions, iptables: Box<dyn Iptables>) -> Self {
        Self {
            opts,
            node_port_cidrs: None,
            node_ports_resolved: false,
            iptables,
            state: BTreeMap::new(),
            verified: None,
            writes: 0,
            last_input: String::new(),
            unhonoured: Unhonoured::default(),
            counters: ModeCounters::default(),
        }
    }

    /// NodePorts answer on the local addresses inside `cidrs`, looked up at
    /// every sync (replaces `node_ports` of the options).
    #[must_use]
    pub fn with_node_port_cidrs(mut self, cidrs: NodePortCidrs) -> Self {
        self.node_port_cidrs = Some(cidrs);
        self
    }

    /// Looks the node port addresses up again when they are given as
    /// networks; a failure keeps the last ones.
    fn refresh_node_ports(&mut self) {
        let Some(cidrs) = &self.node_port_cidrs else {
            return;
        };
        let ips = match cidrs.resolve(self.opts.family) {
            Ok(ips) => ips,
            Err(e) => {
                warn!(error = format!("{e:#}"), "NodePorts keep the addresses found before");
                return;
            }
        };
        let now = NodePortDestinations::Addresses(ips);
        if now != self.opts.node_ports || !self.node_ports_resolved {
            self.node_ports_resolved = true;
            if matches!(&now, NodePortDestinations::Addresses(ips) if ips.is_empty()) {
                warn!(cidrs = ?cidrs.cidrs, family = ?self.opts.family, "no local address of the family is in nodePortAddresses: NodePorts answer nowhere");
            } else {
                info!(node_ports = ?now, "NodePorts answer on these addresses");
            }
            self.opts.node_ports = now;
        }
    }

    /// The mode for this node: checks that the iptables tools run, reads
    /// the options from `config` and the kernel, and sets `route_localnet`
    /// when NodePorts answer on localhost (as kube-proxy does). Rules are
    /// written by the first sync.
    pub fn start(config: &Config) -> Result<Self> {
        Self::start_family(config, IpFamily::V4)
    }

    /// [`IptablesMode::start`] for the ports of `family`, written with
    /// `iptables` or `ip6tables`.
    pub fn start_family(config: &Config, family: IpFamily) -> Result<Self> {
        let system = SystemIptables::for_family(family);
        system.check()?;
        let (opts, node_port_cidrs) = rule_options_for(config, family);
        let localhost_in_cidrs = node_port_cidrs
            .as_ref()
            .is_some_and(|c| c.localhost && c.cidrs.iter().any(|cidr| cidr.contains(Ipv4Addr::LOCALHOST.into())));
        if opts.localhost_node_ports() || (localhost_in_cidrs && family == IpFamily::V4) {
            info!(
                "setting route_localnet=1 so that NodePorts answer on 127.0.0.1 \
                 (turn off with iptables.localhostNodePorts: false, or leave 127.0.0.0/8 out of nodePortAddresses)"
            );
            std::fs::write(ROUTE_LOCALNET, "1").with_context(|| format!("writing 1 to {ROUTE_LOCALNET}"))?;
        }
        info!(?opts, "iptables mode ready for {family:?}");
        let mut mode = Self::new(opts, Box::new(system));
        mode.node_port_cidrs = node_port_cidrs;
        Ok(mode)
    }

    pub fn options(&self) -> &RuleOptions {
        &self.opts
    }

    /// The `iptables-restore` input of the last sync that wrote something.
    pub fn last_input(&self) -> &str {
        &self.last_input
    }

    /// How many (port, field) pairs the mode found it cannot honour.
    pub fn unhonoured(&self) -> usize {
        self.unhonoured.count()
    }

    /// Logs once and counts what of `ports` the mode cannot do as asked.
    fn report_unhonoured<'a>(&mut self, ports: impl IntoIterator<Item = &'a ServicePort>) {
        for port in ports {
            let unhonoured = rules::unhonoured(&self.opts, port).into_iter();
            for (field, how) in unhonoured.chain(super::unhonoured::lb_algorithm(port)) {
                self.unhonoured.report(port, field, how);
            }
        }
    }

    fn restore(&mut self, text: String, writes: u64) -> Result<()> {
        self.iptables.restore(&text)?;
        self.writes += writes;
        self.last_input = text;
        Ok(())
    }
}

impl Dataplane for IptablesMode {
    fn name(&self) -> &'static str {
        "iptables"
    }

    fn families(&self) -> &'static [IpFamily] {
        match self.opts.family {
            IpFamily::V4 => &[IpFamily::V4],
            IpFamily::V6 => &[IpFamily::V6],
        }
    }

    fn delete_stale_flows(&mut self, change: &SyncedChange<'_>) -> u64 {
        conntrack::delete_stale_flows(change)
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        // KUBE-SERVICES is rewritten whole: with the addresses of now.
        self.refresh_node_ports();
        self.report_unhonoured(&plan.upsert);
        // Chains the touched ports used before, and what to put back if
        // the restore fails.
        let mut gone = BTreeSet::new();
        let mut undo: Vec<(String, Option<ServicePort>)> = Vec::new();
        for port in &plan.remove {
            gone.extend(port_chains(&self.opts, port));
            if let Some(old) = self.state.remove(&port.name) {
                gone.extend(port_chains(&self.opts, &old));
                undo.push((port.name.clone(), Some(old)));
            }
        }
        let mut changed = BTreeSet::new();
        for port in &plan.upsert {
            let old = self.state.insert(port.name.clone(), port.clone());
            if let Some(old) = &old {
                gone.extend(port_chains(&self.opts, old));
            }
            undo.push((port.name.clone(), old));
            changed.insert(port.name.clone());
        }
        let active: BTreeSet<String> = changed
            .iter()
            .filter_map(|name| self.state.get(name))
            .flat_map(|port| port_chains(&self.opts, port))
            .collect();
        let delete: BTreeSet<String> = gone.difference(&active).cloned().collect();
        let rendered = render(
            &self.opts,
            &SyncInput {
                ports: &self.state,
                rewrite: Rewrite::Only(&changed),
                delete: &delete,
                jumps: &[],
            },
        );
        debug!(
            changed = changed.len(),
            removed = plan.remove.len(),
            deleted_chains = delete.len(),
            writes = rendered.writes,
            "partial iptables sync"
        );
        self.verified = None;
        if let Err(e) = self.restore(rendered.text, rendered.writes) {
            self.counters.iptables_partial_restore_failures += 1;
            for (name, old) in undo.into_iter().rev() {
                match old {
                    Some(old) => self.state.insert(name, old),
                    None => self.state.remove(&name),
                };
            }
            return Err(e.context("partial sync"));
        }
        Ok(())
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        self.refresh_node_ports();
        self.report_unhonoured(desired.values());
        let saved = Saved::parse(&self.iptables.save().context("reading the current rules")?);
        let active: BTreeSet<String> = desired.values().flat_map(|p| port_chains(&self.opts, p)).collect();
        let stale: BTreeSet<String> = saved
            .table("nat")
            .map(|nat| {
                nat.chains
                    .iter()
                    .filter(|c| chains::is_service_chain(c) && !active.contains(*c))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let missing: Vec<rules::Jump> = jumps(&self.opts)
            .into_iter()
            .filter(|jump| !saved.holds_rule(jump.table, |r| jump.matches_saved(r)))
            .collect();
        let ours_now = owned_lines(&saved, chains::is_ours);
        let unchanged = self
            .verified
            .as_ref()
            .is_some_and(|v| v.desired == *desired && v.opts == self.opts && v.ours == ours_now);
        if unchanged && stale.is_empty() && missing.is_empty() {
            debug!("full iptables sync: the kernel holds what the last full sync wrote");
            self.state = desired.clone();
            return Ok(());
        }
        let rendered = render(
            &self.opts,
            &SyncInput {
                ports: desired,
                rewrite: Rewrite::All,
                delete: &stale,
                jumps: &missing,
            },
        );
        debug!(
            ports = desired.len(),
            stale_chains = stale.len(),
            missing_jumps = missing.len(),
            writes = rendered.writes,
            "full iptables sync"
        );
        self.verified = None;
        if let Err(e) = self.restore(rendered.text, rendered.writes) {
            self.counters.iptables_restore_failures += 1;
            return Err(e.context("full sync"));
        }
        self.state = desired.clone();
        match self.iptables.save() {
            Ok(after) => {
                let after = Saved::parse(&after);
                self.counters.iptables_rules = owned_rule_counts(&after, RULE_TABLES, chains::is_ours);
                self.verified = Some(Verified {
                    desired: desired.clone(),
                    opts: self.opts.clone(),
                    ours: owned_lines(&after, chains::is_ours),
                });
            }
            Err(e) => warn!(
                error = format!("{e:#}"),
                "cannot read the rules back; the next full sync rewrites them"
            ),
        }
        Ok(())
    }

    fn kernel_writes(&self) -> u64 {
        self.writes
    }

    fn counters(&self) -> ModeCounters {
        self.counters.clone()
    }

    fn take_problems(&mut self) -> Vec<crate::model::Problem> {
        self.unhonoured.take()
    }
}

/// Removes every chain of the iptables mode (and of kube-proxy's, which has
/// the same names) and the rules jumping into them, in the calling thread's
/// network namespace. Idempotent; runs nothing but `iptables-save` when
/// there is nothing to remove, and nothing at all when iptables is not
/// installed. Returns how many chains it removed.
pub fn cleanup() -> Result<usize> {
    let mut removed = 0;
    for (family, tool) in [(IpFamily::V4, "iptables"), (IpFamily::V6, "ip6tables")] {
        let mut system = SystemIptables::for_family(family);
        if system.check().is_err() {
            info!("{tool} is not installed: no {tool} rules to remove");
            continue;
        }
        let here = cleanup_with(&mut system).with_context(|| format!("removing the {tool} rules"))?;
        if here > 0 {
            info!(chains = here, "removed the iptables mode's {tool} chains and jumps");
        } else {
            info!("no {tool} chains of xproxy or kube-proxy found");
        }
        removed += here;
    }
    Ok(removed)
}

/// [`cleanup`] through `iptables`.
pub fn cleanup_with(iptables: &mut dyn Iptables) -> Result<usize> {
    remove_chains(iptables, chains::is_ours)
}

/// The rule options `config` asks for, completed from the kernel, and the
/// networks of `nodePortAddresses` when it gives networks (their local
/// addresses are looked up at every sync, see [`NodePortCidrs`]).
pub fn rule_options(config: &Config) -> (RuleOptions, Option<NodePortCidrs>) {
    rule_options_for(config, IpFamily::V4)
}

/// Where the NodePorts of `family` answer, and the networks to look their
/// addresses up in at every sync.
fn node_port_destinations(config: &Config, family: IpFamily) -> (NodePortDestinations, Option<NodePortCidrs>) {
    match FamilyNodePorts::from_config(config, family) {
        // IPv6 has no `route_localnet`: `::1` cannot be DNATed away.
        FamilyNodePorts::AllLocal { localhost } => {
            let localhost = localhost && family == IpFamily::V4;
            (NodePortDestinations::AllLocal { localhost }, None)
        }
        FamilyNodePorts::NodeIps(ips) => (NodePortDestinations::Addresses(ips), None),
        FamilyNodePorts::Cidrs(cidrs) => {
            let cidrs = NodePortCidrs {
                cidrs,
                localhost: config.localhost_node_ports,
            };
            // Filled in by the first sync.
            (NodePortDestinations::Addresses(Vec::new()), Some(cidrs))
        }
    }
}

/// [`rule_options`] for the rules of `family`.
pub fn rule_options_for(config: &Config, family: IpFamily) -> (RuleOptions, Option<NodePortCidrs>) {
    let (node_ports, cidrs) = node_port_destinations(config, family);
    let be_liberal = std::fs::read_to_string(TCP_BE_LIBERAL).is_ok_and(|v| v.trim() != "0");
    if be_liberal {
        info!("nf_conntrack_tcp_be_liberal is set: INVALID packets are not dropped");
    }
    let opts = RuleOptions {
        masquerade_bit: config.masquerade.bit,
        masquerade_all: config.masquerade.all,
        local_traffic: LocalTraffic::for_family(config, "iptables", family),
        node_ports,
        drop_invalid: !be_liberal,
        node_name: Some(config.node_name.clone()),
        node_ips: node_ips_of(config, family),
        family,
    };
    (opts, cidrs)
}

#[cfg(test)]
mod tests;
