//! The nftables mode, kube-proxy's nftables layout in a table of its own
//! (`ip xproxy`, so it runs next to a kube-proxy and its cleanup never
//! touches kube-proxy's `kube-proxy` table; IPv6 ports in `ip6 xproxy`,
//! written by a second instance of the mode, as kube-proxy has an `ip` and
//! an `ip6` table and a proxier for each, see [`super::dual_stack`]): verdict maps keyed by
//! `daddr . l4proto . dport` (ClusterIPs, external IPs, LB IPs) and
//! `l4proto . dport` (NodePorts) jump to a chain per service port, which
//! picks an endpoint chain with `numgen random` (after the ClientIP
//! affinity sets, if any), which DNATs; Services without endpoints are
//! rejected through two more maps, LB IPs with source ranges filtered
//! through a fifth. See [`ruleset`] for the layout.
//!
//! Every sync is one `nft -f -` transaction. A full sync replaces the whole
//! table; a partial sync deletes and adds only the map elements, chains and
//! sets of the changed service ports (see [`ruleset::partial`]). When the
//! table still holds exactly what the last full sync of the same state left
//! (the clients in the affinity sets aside), a full sync writes nothing.
//!
//! Table, chain and map names (kube-proxy's hashes) are in [`names`], the
//! rendering is in [`ruleset`], running `nft` is in [`crate::sys::nft`].
//! Who keeps an address two Services list is decided before the modes, in
//! the model (`model::join`): no two ports reach a mode with one map key.

pub mod names;
pub mod ruleset;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

pub use crate::sys::nft::{Nft, SystemNft};
use anyhow::{Context, Result};
use ruleset::{ChainRemoval, Objects, PortRules, port_rules};
pub use ruleset::{NodePorts, Options};
use tracing::{debug, info, warn};

pub use super::options::LocalTraffic;
use super::{
    Dataplane, ModeCounters, Plan, SyncedChange, conntrack,
    dual_stack::DualStack,
    options::{FamilyNodePorts, node_ips_of},
};
use crate::{
    config::Config,
    model::{IpFamily, ServicePort},
};

/// How long an emptied chain waits before it is deleted (kube-proxy's
/// margin for kernels that release references late).
const LEFTOVER_GRACE: Duration = Duration::from_secs(1);

pub struct NftablesMode {
    opts: Options,
    nft: Box<dyn Nft>,
    /// What the last successful sync programmed, per port name.
    state: BTreeMap<String, (ServicePort, PortRules)>,
    /// What a full sync left in the kernel, to recognise a table nobody
    /// changed since.
    verified: Option<Verified>,
    /// Chains emptied instead of deleted (old kernels), and since when.
    leftovers: BTreeMap<String, Instant>,
    writes: u64,
    last_script: String,
    /// Failed transactions (see [`ModeCounters`]).
    counters: ModeCounters,
}

struct Verified {
    desired: BTreeMap<String, ServicePort>,
    listing: String,
}

/// Starts the nftables mode for `xproxy run`: the `ip` table's half and,
/// where the kernel takes an `ip6` table, the `ip6` one's (see
/// [`NftablesMode::start`] and [`DualStack`]).
pub fn start(config: &Config) -> Result<Box<dyn Dataplane>> {
    let v4 = Box::new(NftablesMode::start(config, IpFamily::V4)?);
    let v6 = NftablesMode::start(config, IpFamily::V6).map(|m| Box::new(m) as Box<dyn Dataplane>);
    Ok(Box::new(DualStack::start(v4, v6)))
}

impl NftablesMode {
    /// A mode writing through `nft` with `opts`; touches nothing yet.
    pub fn new(opts: Options, nft: Box<dyn Nft>) -> Self {
        Self {
            opts,
            nft,
            state: BTreeMap::new(),
            verified: None,
            leftovers: BTreeMap::new(),
            writes: 0,
            last_script: String::new(),
            counters: ModeCounters::default(),
        }
    }

    /// The mode for the ports of `family` on this node: checks that `nft`
    /// runs and reaches the kernel, and reads the options from `config`.
    /// The table is written by the first sync.
    pub fn start(config: &Config, family: IpFamily) -> Result<Self> {
        let system = SystemNft::default();
        system.check()?;
        system
            .check_kernel(names::nft_family(family))
            .with_context(|| format!("nftables is not usable here for {family:?}"))?;
        let opts = options_for(config, family);
        info!(?opts, "nftables mode ready for {family:?}");
        Ok(Self::new(opts, Box::new(system)))
    }

    /// The nft family of the mode's table (`ip`, `ip6`).
    fn table_family(&self) -> &'static str {
        names::nft_family(self.opts.family)
    }

    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// The renderings a partial sync of `plan` programs: the upserted ports.
    fn wanted_after(&self, plan: &Plan) -> Vec<(ServicePort, PortRules)> {
        plan.upsert
            .iter()
            .map(|port| (port.clone(), port_rules(&self.opts, port)))
            .collect()
    }

    /// The `nft -f` input of the last sync that wrote something.
    pub fn last_script(&self) -> &str {
        &self.last_script
    }

    /// Runs a partial sync's `script`; if the kernel refuses to delete
    /// chains, runs it again emptying them instead (see [`LEFTOVER_GRACE`]).
    fn run_partial(
        &mut self,
        script: &ruleset::Script,
        before: &Objects,
        after: &Objects,
        due: &[String],
        now: Instant,
    ) -> Result<()> {
        match self.run(script) {
            Ok(()) => {
                for name in &script.removed_chains {
                    self.leftovers.remove(name);
                }
            }
            Err(e) if !script.removed_chains.is_empty() => {
                // Perhaps a kernel before 6.2, which frees a chain only a
                // moment after the last map element pointing to it is gone:
                // empty the chains now, delete them in a later sync.
                let retry = ruleset::partial(self.opts.family, before, after, due, ChainRemoval::Flush);
                self.run(&retry).map_err(|retry_error| {
                    retry_error.context(format!("partial sync (also without deleting chains; first: {e:#})"))
                })?;
                warn!(
                    chains = retry.removed_chains.len(),
                    error = format!("{e:#}"),
                    "could not delete unused chains in the sync's transaction; emptied them for a later sync"
                );
                for name in &retry.removed_chains {
                    self.leftovers.entry(name.clone()).or_insert(now);
                }
            }
            Err(e) => return Err(e.context("partial sync")),
        }
        Ok(())
    }

    fn run(&mut self, script: &ruleset::Script) -> Result<()> {
        if let Err(e) = self.nft.run(&script.text) {
            self.counters.nftables_sync_failures += 1;
            return Err(e);
        }
        self.writes += script.writes;
        self.last_script.clone_from(&script.text);
        Ok(())
    }
}

impl Dataplane for NftablesMode {
    fn name(&self) -> &'static str {
        "nftables"
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
        // The changed ports as programmed (our own rendering, else the
        // plan's account of what was applied) and as wanted.
        let wanted = self.wanted_after(plan);
        let mut before = Objects::default();
        let mut seen = BTreeSet::new();
        for (port, removed) in plan
            .remove
            .iter()
            .map(|p| (p, true))
            .chain(wanted.iter().map(|(p, _)| (p, false)))
        {
            if !seen.insert(port.name.as_str()) {
                continue;
            }
            match self.state.get(&port.name) {
                Some((_, rules)) => before.add(rules),
                None if removed => before.add(&port_rules(&self.opts, port)),
                None => {}
            }
        }
        let mut after = Objects::default();
        for (_, rules) in &wanted {
            after.add(rules);
        }
        let now = Instant::now();
        let due: Vec<String> = self
            .leftovers
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= LEFTOVER_GRACE)
            .map(|(name, _)| name.clone())
            .collect();

        let script = ruleset::partial(self.opts.family, &before, &after, &due, ChainRemoval::Delete);
        debug!(
            changed = plan.upsert.len(),
            removed = plan.remove.len(),
            removed_chains = script.removed_chains.len(),
            writes = script.writes,
            "partial nftables sync"
        );
        self.verified = None;
        let result = self.run_partial(&script, &before, &after, &due, now);
        result?;
        for name in after.chains.keys() {
            self.leftovers.remove(name);
        }
        for port in &plan.remove {
            self.state.remove(&port.name);
        }
        for (port, rules) in wanted {
            self.state.insert(port.name.clone(), (port, rules));
        }
        Ok(())
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        if let Some(verified) = &self.verified
            && verified.desired == *desired
        {
            match self.nft.list_table(self.table_family(), names::TABLE) {
                Ok(Some(listing)) if without_affinity_clients(&listing) == verified.listing => {
                    debug!("full nftables sync: the table holds what the last full sync wrote");
                    return Ok(());
                }
                Ok(_) => info!("the nftables table changed since the last full sync; rewriting it"),
                Err(e) => warn!(error = format!("{e:#}"), "cannot read the table; rewriting it"),
            }
        }
        let state: BTreeMap<String, (ServicePort, PortRules)> = desired
            .iter()
            .map(|(name, port)| (name.clone(), (port.clone(), port_rules(&self.opts, port))))
            .collect();
        let script = ruleset::full(
            &self.opts,
            state.iter().map(|(name, (_, rules))| (name.as_str(), rules)),
        );
        debug!(ports = desired.len(), writes = script.writes, "full nftables sync");
        self.verified = None;
        self.run(&script).context("full sync")?;
        self.state = state;
        // The table was replaced: no chain of an earlier sync is left.
        self.leftovers.clear();
        match self.nft.list_table(self.table_family(), names::TABLE) {
            Ok(Some(listing)) => {
                self.verified = Some(Verified {
                    desired: desired.clone(),
                    listing: without_affinity_clients(&listing),
                });
            }
            Ok(None) => warn!("the nftables table is gone right after a full sync"),
            Err(e) => warn!(
                error = format!("{e:#}"),
                "cannot read the table back; the next full sync rewrites it"
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
}

/// `listing` (`nft list table`) without the elements of the affinity
/// sets: the kernel adds and expires those as clients come and go, which
/// is no reason to rewrite the table (and so forget every client).
fn without_affinity_clients(listing: &str) -> String {
    let mut out = String::with_capacity(listing.len());
    let (mut in_affinity_set, mut in_elements) = (false, false);
    for line in listing.lines() {
        let trimmed = line.trim();
        if in_elements {
            in_elements = !trimmed.ends_with('}');
            continue;
        }
        if trimmed.starts_with(&format!("set {}", names::AFFINITY_PREFIX)) {
            in_affinity_set = true;
        } else if in_affinity_set && trimmed == "}" {
            in_affinity_set = false;
        } else if in_affinity_set && trimmed.starts_with("elements = {") {
            in_elements = !trimmed.ends_with('}');
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Removes the `ip xproxy` and `ip6 xproxy` tables (and with them
/// everything the nftables mode installed) in the calling thread's network
/// namespace. Idempotent; does nothing when nft is not installed or the
/// tables are absent; never touches another table. Returns whether there
/// was a table to remove.
pub fn cleanup() -> Result<bool> {
    let mut system = SystemNft::default();
    if system.check().is_err() {
        info!("nft is not installed: no nftables table to remove");
        return Ok(false);
    }
    let removed = cleanup_with(&mut system)?;
    if !removed {
        info!("no nftables table of xproxy found");
    }
    Ok(removed)
}

/// [`cleanup`] through `nft`.
pub fn cleanup_with(nft: &mut dyn Nft) -> Result<bool> {
    let mut removed = false;
    for family in [IpFamily::V4, IpFamily::V6] {
        let family = names::nft_family(family);
        if remove_table(nft, family)? {
            info!(
                table = format!("{family} {}", names::TABLE),
                "removed the nftables mode's table"
            );
            removed = true;
        }
    }
    Ok(removed)
}

/// Removes the table of nft family `family`, if there is one.
fn remove_table(nft: &mut dyn Nft, family: &str) -> Result<bool> {
    match nft.list_table(family, names::TABLE) {
        Ok(Some(_)) => {}
        Ok(None) => return Ok(false),
        // E.g. a kernel without nf_tables: then there is no table either.
        Err(e) => {
            warn!(error = format!("{e:#}"), "cannot list nftables tables; nothing removed");
            return Ok(false);
        }
    }
    crate::sys::nft::delete_table(nft, family, names::TABLE)?;
    Ok(true)
}

/// The ruleset options `config` asks for (the `ip` table's).
pub fn options(config: &Config) -> Options {
    options_for(config, IpFamily::V4)
}

/// The ruleset options `config` asks for, for the table of `family`.
pub fn options_for(config: &Config, family: IpFamily) -> Options {
    let node_ports = match FamilyNodePorts::from_config(config, family) {
        // kube-proxy's nftables mode does not answer on localhost either.
        FamilyNodePorts::AllLocal { .. } => NodePorts::AllLocal,
        FamilyNodePorts::NodeIps(ips) => {
            let (loopback, ips): (Vec<_>, Vec<_>) = ips.into_iter().partition(IpAddr::is_loopback);
            for ip in loopback {
                warn!(%ip, "NodePorts on localhost are not supported by the nftables mode");
            }
            if ips.is_empty() {
                NodePorts::AllLocal
            } else {
                NodePorts::Addresses(ips)
            }
        }
        FamilyNodePorts::Cidrs(cidrs) => {
            if cidrs.iter().any(|c| c.addr().is_loopback()) {
                warn!("NodePorts on localhost are not supported by the nftables mode");
            }
            NodePorts::Cidrs(cidrs)
        }
    };
    Options {
        masquerade_bit: config.masquerade.bit,
        masquerade_all: config.masquerade.all,
        local_traffic: LocalTraffic::for_family(config, "nftables", family),
        node_ports,
        node_name: Some(config.node_name.clone()),
        node_ips: node_ips_of(config, family),
        family,
    }
}

#[cfg(test)]
pub(crate) mod tests;
