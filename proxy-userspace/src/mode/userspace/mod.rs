//! kube-proxy's userspace mode, kept for comparison only: the agent itself
//! is the data path. Per service port it listens on a free local port
//! ([`listener`]) and iptables rules send the Service's traffic there
//! ([`rules`]); TCP connections are relayed to an endpoint ([`tcp`]), UDP
//! datagrams through one session per client ([`udp`]); endpoints are
//! taken in turn, or with `sessionAffinity: ClientIP` kept per client
//! address until idle past the timeout ([`balancer`]).
//!
//! Every sync is at most one `iptables-restore --noflush` that rewrites the
//! mode's five chains whole. Endpoint changes never touch the rules (only
//! the balancers), so most syncs write nothing; the rules change when a
//! port comes or goes, or gains or loses its last endpoint. A full sync
//! reads the kernel's rules first and writes only if they differ from what
//! the last full sync left (or a jump is missing).
//!
//! Unlike the kernel modes the data path cannot outlive the agent: the
//! rules are removed when the mode is dropped (SIGTERM), and `xproxy
//! cleanup` removes them after a crash, when they point at ports nobody
//! listens on any more.
//!
//! The traffic policies (`externalTrafficPolicy`, `internalTrafficPolicy:
//! Local`) are not supported, as in kube-proxy's legacy userspace mode,
//! which predates them: a Service port's ClusterIP and node port share one
//! listener and every connection goes to any endpoint. Nor could the
//! client's address be kept: the backend's peer is always the agent. A
//! port asking for `Local` is proxied as `Cluster`; external and load
//! balancer IPs are not served, nor are SCTP ports (kube-proxy's
//! userspace mode relayed TCP and UDP only). Each of these is logged once
//! per port and counted with the skipped objects
//! (`xproxy_skipped_objects_total`).
//!
//! IPv6 service ports (a dual-stack Service's second family) get their own
//! listeners and the same chains through `ip6tables`, written and checked
//! beside the IPv4 ones ([`RuleWriter`]); a node without `ip6tables` is
//! served IPv4 only.

pub mod balancer;
pub mod listener;
pub mod pktinfo;
pub mod rules;
pub mod tcp;
pub mod udp;

use std::collections::BTreeMap;

use anyhow::{Context, Result};
pub use listener::ListenOptions;
use listener::PortProxy;
pub use rules::NodePortAddresses;
use rules::{JUMPS, Jump, PortRules, Target};
use tokio::runtime::Handle;
use tracing::{debug, info, warn};

use super::{Dataplane, Plan, unhonoured::Unhonoured};
use crate::{
    config::Config,
    model::{IpFamily, Protocol, ServicePort, usable_endpoints},
    sys::iptables::{Iptables, Saved, SystemIptables, owned_lines, remove_chains},
};

/// What shapes the mode besides the service ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub listen: ListenOptions,
    pub node_ports: NodePortAddresses,
}

/// The rules of one family: its tool and what it was last seen to hold.
struct RuleWriter {
    family: IpFamily,
    iptables: Box<dyn Iptables>,
    node_ports: NodePortAddresses,
    /// The rules (without jumps) the kernel holds since the last write.
    written: Option<String>,
    /// Our lines of `iptables-save` after the last full sync's write.
    verified: Option<Vec<String>>,
}

impl RuleWriter {
    fn new(family: IpFamily, iptables: Box<dyn Iptables>, node_ports: NodePortAddresses) -> Self {
        Self {
            family,
            iptables,
            node_ports,
            written: None,
            verified: None,
        }
    }

    /// The jumps missing from the kernel's rules of this family.
    fn missing_jumps(&mut self) -> Result<(Saved, Vec<Jump>)> {
        let saved = Saved::parse(&self.iptables.save().context("reading the current rules")?);
        let missing = JUMPS
            .into_iter()
            .filter(|jump| !saved.holds_rule(jump.table, |r| jump.matches_saved(r)))
            .collect();
        Ok((saved, missing))
    }
}

pub struct UserspaceMode {
    opts: Options,
    runtime: Handle,
    /// IPv4's, then IPv6's where the node has `ip6tables`.
    writers: Vec<RuleWriter>,
    /// The running proxies, by service port name.
    proxies: BTreeMap<String, PortProxy>,
    /// What the last successful sync programmed.
    state: BTreeMap<String, ServicePort>,
    writes: u64,
    unhonoured: Unhonoured,
}

/// Starts the userspace mode for `xproxy run` (see [`UserspaceMode::start`]).
pub fn start(config: &Config) -> Result<Box<dyn Dataplane>> {
    Ok(Box::new(UserspaceMode::start(config)?))
}

impl UserspaceMode {
    /// A mode serving on `runtime` and writing through `iptables`; touches
    /// nothing yet.
    pub fn new(opts: Options, runtime: Handle, iptables: Box<dyn Iptables>) -> Self {
        let v4 = RuleWriter::new(IpFamily::V4, iptables, opts.node_ports.clone());
        Self {
            opts,
            runtime,
            writers: vec![v4],
            proxies: BTreeMap::new(),
            state: BTreeMap::new(),
            writes: 0,
            unhonoured: Unhonoured::default(),
        }
    }

    /// Serves IPv6 service ports too, their rules written through
    /// `ip6tables` with NodePorts on `node_ports`.
    #[must_use]
    pub fn with_ipv6(mut self, ip6tables: Box<dyn Iptables>, node_ports: NodePortAddresses) -> Self {
        self.writers.retain(|w| w.family != IpFamily::V6);
        self.writers.push(RuleWriter::new(IpFamily::V6, ip6tables, node_ports));
        self
    }

    /// The mode for this node, serving on the calling task's runtime.
    /// Checks that the iptables tools run; rules and listeners come with
    /// the first sync.
    pub fn start(config: &Config) -> Result<Self> {
        let system = SystemIptables::default();
        system.check()?;
        let runtime = Handle::try_current().context("the userspace mode needs the agent's async runtime")?;
        let opts = Options {
            listen: ListenOptions {
                port_range: config.port_range.clone(),
                ..ListenOptions::default()
            },
            node_ports: NodePortAddresses::of_family(config, IpFamily::V4),
        };
        info!(?opts, "userspace mode ready");
        let mode = Self::new(opts, runtime, Box::new(system));
        let ip6tables = SystemIptables::ipv6();
        match ip6tables.check() {
            Ok(()) => Ok(mode.with_ipv6(Box::new(ip6tables), NodePortAddresses::of_family(config, IpFamily::V6))),
            Err(e) => {
                warn!(
                    error = format!("{e:#}"),
                    "no ip6tables: the userspace mode serves IPv4 only"
                );
                Ok(mode)
            }
        }
    }

    /// The local port the agent listens on for the service port `name`.
    pub fn listener_port(&self, name: &str) -> Option<u16> {
        self.proxies.get(name).map(PortProxy::port)
    }

    /// Makes the proxy of `service` exist and carry its endpoints; a proxy
    /// of the wrong protocol is replaced (and returned, to be dropped once
    /// the rules no longer point at it). An SCTP port gets none.
    fn ensure_proxy(&mut self, service: &ServicePort) -> Result<Option<PortProxy>> {
        if service.protocol == Protocol::Sctp {
            // Not served (reported by `unhonoured_fields`): with no proxy
            // the port gets no rules, and one of an earlier protocol goes.
            return Ok(self.proxies.remove(&service.name));
        }
        if let Some(proxy) = self.proxies.get(&service.name)
            && proxy.protocol() == service.protocol
        {
            if proxy.update(service) {
                debug!(port = service.name, "endpoints changed");
            }
            return Ok(None);
        }
        let proxy = PortProxy::open(&self.runtime, &self.opts.listen, service)
            .with_context(|| format!("listening for {}", service.name))?;
        info!(port = service.name, protocol = %service.protocol, listener = proxy.port(), "proxying");
        Ok(self.proxies.insert(service.name.clone(), proxy))
    }

    /// How many (port, field) pairs the mode found it cannot honour.
    pub fn unhonoured(&self) -> usize {
        self.unhonoured.count()
    }

    /// Logs once and counts what of `service` the mode does not do.
    fn report_unhonoured(&mut self, service: &ServicePort) {
        for (field, how) in unhonoured_fields(service) {
            self.unhonoured.report(service, field, how);
        }
    }

    /// The rules of `writer`'s family for the current state: each port to
    /// its proxy, or rejected.
    fn rules_for(&self, writer: &RuleWriter, jumps: &[Jump]) -> rules::Rendered {
        let ports: Vec<PortRules<'_>> = self
            .state
            .values()
            .filter(|service| service.family() == writer.family)
            .filter_map(|service| {
                let listener = self.proxies.get(&service.name)?.port();
                let target = if usable_endpoints(&service.endpoints).is_empty() {
                    Target::Reject
                } else {
                    Target::Proxy(listener)
                };
                Some(PortRules { service, target })
            })
            .collect();
        rules::render(writer.family, &writer.node_ports, &ports, jumps)
    }

    /// A partial sync's rules: rewritten where they differ from what the
    /// kernel holds since the last write.
    fn sync_rules(&mut self) -> Result<()> {
        let mut writers = std::mem::take(&mut self.writers);
        let result = writers.iter_mut().try_for_each(|writer| {
            let body = self.rules_for(writer, &[]);
            if writer.written.as_deref() == Some(body.text.as_str()) {
                debug!(family = writer.family.name(), "partial userspace sync: the rules stay");
                return Ok(());
            }
            writer.verified = None;
            self.restore(writer, &body)
                .with_context(|| format!("partial sync of the {} rules", writer.family.name()))?;
            writer.written = Some(body.text);
            Ok(())
        });
        self.writers = writers;
        result
    }

    /// A full sync's rules: rewritten (with any missing jump) unless the
    /// kernel holds what the last full sync left.
    fn sync_rules_full(&mut self) -> Result<()> {
        let mut writers = std::mem::take(&mut self.writers);
        let result = writers.iter_mut().try_for_each(|writer| self.sync_writer_full(writer));
        self.writers = writers;
        result
    }

    fn sync_writer_full(&mut self, writer: &mut RuleWriter) -> Result<()> {
        let family = writer.family.name();
        let (saved, missing) = writer.missing_jumps()?;
        let body = self.rules_for(writer, &[]);
        let unchanged = missing.is_empty()
            && writer.written.as_deref() == Some(body.text.as_str())
            && writer
                .verified
                .as_ref()
                .is_some_and(|v| *v == owned_lines(&saved, rules::is_ours));
        if unchanged {
            debug!(
                family,
                "full userspace sync: the kernel holds what the last full sync wrote"
            );
            return Ok(());
        }
        writer.verified = None;
        self.restore(writer, &self.rules_for(writer, &missing))
            .with_context(|| format!("full sync of the {family} rules"))?;
        writer.written = Some(body.text);
        match writer.iptables.save() {
            Ok(after) => writer.verified = Some(owned_lines(&Saved::parse(&after), rules::is_ours)),
            Err(e) => warn!(
                family,
                error = format!("{e:#}"),
                "cannot read the rules back; the next full sync rewrites them"
            ),
        }
        Ok(())
    }

    fn restore(&mut self, writer: &mut RuleWriter, rendered: &rules::Rendered) -> Result<()> {
        writer.written = None;
        writer.iptables.restore(&rendered.text)?;
        self.writes += rendered.writes;
        Ok(())
    }
}

impl Dataplane for UserspaceMode {
    fn name(&self) -> &'static str {
        "userspace"
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        // Proxies that go are dropped only after the rules stopped sending
        // traffic to them.
        let mut retired = Vec::new();
        for service in &plan.remove {
            self.state.remove(&service.name);
            retired.extend(self.proxies.remove(&service.name));
        }
        for service in &plan.upsert {
            self.report_unhonoured(service);
            retired.extend(self.ensure_proxy(service)?);
            self.state.insert(service.name.clone(), service.clone());
        }
        self.sync_rules()?;
        drop(retired);
        Ok(())
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        let mut retired: Vec<PortProxy> = Vec::new();
        let gone: Vec<String> = self
            .proxies
            .keys()
            .filter(|name| !desired.contains_key(*name))
            .cloned()
            .collect();
        for name in gone {
            retired.extend(self.proxies.remove(&name));
        }
        for service in desired.values() {
            self.report_unhonoured(service);
            retired.extend(self.ensure_proxy(service)?);
        }
        self.state = desired.clone();
        self.sync_rules_full()?;
        drop(retired);
        Ok(())
    }

    fn families(&self) -> &'static [IpFamily] {
        if self.writers.iter().any(|w| w.family == IpFamily::V6) {
            &[IpFamily::V4, IpFamily::V6]
        } else {
            &[IpFamily::V4]
        }
    }

    fn kernel_writes(&self) -> u64 {
        self.writes
    }

    fn take_problems(&mut self) -> Vec<crate::model::Problem> {
        self.unhonoured.take()
    }
}

impl Drop for UserspaceMode {
    /// The data path is this process: without it the rules would send
    /// Service traffic to closed ports, so they go first, then the
    /// listeners.
    fn drop(&mut self) {
        for writer in &mut self.writers {
            let family = writer.family.name();
            match cleanup_with(writer.iptables.as_mut()) {
                Ok(chains) => info!(
                    family,
                    chains, "removed the userspace mode's rules: Services are no longer proxied"
                ),
                Err(e) => warn!(
                    family,
                    error = format!("{e:#}"),
                    "cannot remove the userspace mode's rules; `xproxy cleanup` removes them"
                ),
            }
        }
        self.proxies.clear();
    }
}

/// The fields of `service` the userspace mode leaves out, with how: it
/// proxies the ClusterIP and the node port only, from one listener that
/// reaches every endpoint (kube-proxy's legacy userspace mode predates the
/// traffic policies).
fn unhonoured_fields(service: &ServicePort) -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<_> = super::unhonoured::lb_algorithm(service).into_iter().collect();
    if service.protocol == Protocol::Sctp {
        // kube-proxy's userspace mode never relayed SCTP either.
        out.push((
            "spec.ports[].protocol",
            "SCTP is not supported by the userspace mode: the port is not served",
        ));
    }
    if !service.external_ips.is_empty() {
        out.push((
            "spec.externalIPs",
            "not served: only the ClusterIP and the node port are proxied",
        ));
    }
    if !service.load_balancer_ips.is_empty() {
        out.push((
            "status.loadBalancer.ingress",
            "not served: only the ClusterIP and the node port are proxied",
        ));
    }
    if service.external_local() {
        out.push((
            "spec.externalTrafficPolicy",
            "Local is not supported: every endpoint serves, and the client's address is not kept",
        ));
    }
    if service.internal_local() {
        out.push((
            "spec.internalTrafficPolicy",
            "Local is not supported: every endpoint serves",
        ));
    }
    out
}

/// Removes the userspace mode's chains (and kube-proxy's userspace ones)
/// and the jumps into them, in the calling thread's network namespace.
/// Idempotent; nothing happens without iptables installed. Returns how many
/// chains it removed.
pub fn cleanup() -> Result<usize> {
    let mut removed = 0;
    for mut system in [SystemIptables::default(), SystemIptables::ipv6()] {
        if system.check().is_ok() {
            removed += cleanup_with(&mut system)?;
        }
    }
    if removed > 0 {
        info!(chains = removed, "removed the userspace mode's chains and jumps");
    } else {
        info!("no userspace mode chains found");
    }
    Ok(removed)
}

/// [`cleanup`] through `iptables`.
pub fn cleanup_with(iptables: &mut dyn Iptables) -> Result<usize> {
    remove_chains(iptables, rules::is_ours)
}

#[cfg(test)]
mod tests;
