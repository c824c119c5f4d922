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
//! balancer IPs are not served. Each of these is logged once per port and
//! counted with the skipped objects (`xproxy_skipped_objects_total`).

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

use super::{Dataplane, Plan, options::NodePortScope, unhonoured::Unhonoured};
use crate::{
    config::Config,
    model::{ServicePort, usable_endpoints},
    sys::iptables::{Iptables, Saved, SystemIptables, owned_lines, remove_chains},
};

/// What shapes the mode besides the service ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub listen: ListenOptions,
    pub node_ports: NodePortAddresses,
}

pub struct UserspaceMode {
    opts: Options,
    runtime: Handle,
    iptables: Box<dyn Iptables>,
    /// The running proxies, by service port name.
    proxies: BTreeMap<String, PortProxy>,
    /// What the last successful sync programmed.
    state: BTreeMap<String, ServicePort>,
    /// The rules (without jumps) the kernel holds since the last write.
    written: Option<String>,
    /// Our lines of `iptables-save` after the last full sync's write.
    verified: Option<Vec<String>>,
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
        Self {
            opts,
            runtime,
            iptables,
            proxies: BTreeMap::new(),
            state: BTreeMap::new(),
            written: None,
            verified: None,
            writes: 0,
            unhonoured: Unhonoured::default(),
        }
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
            node_ports: NodePortAddresses::from_scope(NodePortScope::from_config(config)),
        };
        info!(?opts, "userspace mode ready");
        Ok(Self::new(opts, runtime, Box::new(system)))
    }

    /// The local port the agent listens on for the service port `name`.
    pub fn listener_port(&self, name: &str) -> Option<u16> {
        self.proxies.get(name).map(PortProxy::port)
    }

    /// Makes the proxy of `service` exist and carry its endpoints; a proxy
    /// of the wrong protocol is replaced (and returned, to be dropped once
    /// the rules no longer point at it).
    fn ensure_proxy(&mut self, service: &ServicePort) -> Result<Option<PortProxy>> {
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

    /// The rules for the current state: each port to its proxy, or rejected.
    fn rules_for(&self, jumps: &[Jump]) -> rules::Rendered {
        let ports: Vec<PortRules<'_>> = self
            .state
            .values()
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
        rules::render(&self.opts.node_ports, &ports, jumps)
    }

    fn restore(&mut self, rendered: &rules::Rendered) -> Result<()> {
        self.written = None;
        self.iptables.restore(&rendered.text)?;
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
        let body = self.rules_for(&[]);
        if self.written.as_deref() == Some(body.text.as_str()) {
            debug!("partial userspace sync: endpoints only, the rules stay");
            return Ok(());
        }
        self.verified = None;
        self.restore(&body).context("partial sync")?;
        self.written = Some(body.text);
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

        let saved = Saved::parse(&self.iptables.save().context("reading the current rules")?);
        let missing: Vec<Jump> = JUMPS
            .into_iter()
            .filter(|jump| {
                !saved
                    .table(jump.table)
                    .is_some_and(|t| t.rules.iter().any(|r| jump.matches_saved(r)))
            })
            .collect();
        let body = self.rules_for(&[]);
        let unchanged = missing.is_empty()
            && self.written.as_deref() == Some(body.text.as_str())
            && self
                .verified
                .as_ref()
                .is_some_and(|v| *v == owned_lines(&saved, rules::is_ours));
        if unchanged {
            debug!("full userspace sync: the kernel holds what the last full sync wrote");
            drop(retired);
            return Ok(());
        }
        self.verified = None;
        self.restore(&self.rules_for(&missing)).context("full sync")?;
        self.written = Some(body.text);
        drop(retired);
        match self.iptables.save() {
            Ok(after) => self.verified = Some(owned_lines(&Saved::parse(&after), rules::is_ours)),
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

    fn take_problems(&mut self) -> Vec<crate::model::Problem> {
        self.unhonoured.take()
    }
}

impl Drop for UserspaceMode {
    /// The data path is this process: without it the rules would send
    /// Service traffic to closed ports, so they go first, then the
    /// listeners.
    fn drop(&mut self) {
        match cleanup_with(self.iptables.as_mut()) {
            Ok(chains) => info!(
                chains,
                "removed the userspace mode's rules: Services are no longer proxied"
            ),
            Err(e) => warn!(
                error = format!("{e:#}"),
                "cannot remove the userspace mode's rules; `xproxy cleanup` removes them"
            ),
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
    let mut system = SystemIptables::default();
    if system.check().is_err() {
        return Ok(0);
    }
    let removed = cleanup_with(&mut system)?;
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
