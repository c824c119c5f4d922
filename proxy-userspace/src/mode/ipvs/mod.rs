//! kube-proxy's IPVS mode, kept for side-by-side comparison: every
//! ClusterIP, external IP and load balancer IP bound to the dummy interface
//! `kube-ipvs0`, one IPVS virtual server per Service port on each of them
//! and per NodePort and node IP, each with the Service's endpoints as real
//! servers (masquerading forward), and kube-proxy's constant iptables rules
//! matching ipsets for source NAT and `loadBalancerSourceRanges`.
//!
//! - [`netlink`]: the IPVS table over generic netlink (no `ipvsadm`).
//! - [`dummy`]: `kube-ipvs0` and its addresses over rtnetlink.
//! - [`ipset`]: kube-proxy's sets (`KUBE-CLUSTER-IP`, `KUBE-NODE-PORT-*`,
//!   `KUBE-EXTERNAL-IP*`, `KUBE-LOAD-BALANCER*`, `KUBE-LOOP-BACK`), written
//!   with `ipset restore`.
//! - [`rules`]: the constant iptables chains, one `iptables-restore`.
//! - [`node_ips`]: the addresses NodePorts are served on, read again at
//!   every sync.
//!
//! Real servers get weight 1; an endpoint that is terminating and not used
//! any more ([`crate::model::usable_endpoints`]) stays with weight 0, so
//! established connections drain while no new ones reach it (kube-proxy's
//! graceful termination). The `Local` traffic policies work as in
//! kube-proxy's IPVS mode: the ClusterIP's virtual server
//! (`internalTrafficPolicy`) or the external IPs', load balancer IPs' and
//! node ports' (`externalTrafficPolicy`) get this node's endpoints only, and
//! their `*-LOCAL` sets exempt them from masquerade. A virtual server left
//! without real servers is answered by IPVS itself (ICMP port unreachable),
//! not silently dropped as in the iptables and nftables modes; kube-proxy's
//! IPVS mode does the same.
//!
//! `sessionAffinity: ClientIP` is IPVS persistence: each virtual server of
//! the port is persistent for the affinity's timeout (one template per
//! client address and virtual server, so a client may get different
//! endpoints through the ClusterIP and a node port, as in kube-proxy).
//! Switching it on or off edits the virtual servers in place. A removed
//! real server releases its clients: IPVS checks a client's template at
//! its next connection and drops it when the real server is gone (or, with
//! `expire_quiescent_template`, has weight 0), then schedules anew;
//! `expire_nodest_conn` ends the removed server's connections at their next
//! packet.
//!
//! A partial sync touches only the virtual servers of the changed ports,
//! and within those only the real servers that changed; a full sync reads
//! the whole table and removes the unwanted virtual servers that are the
//! mode's (on a `kube-ipvs0` address or a node IP, outside
//! `ipvs.excludeCIDRs`); `xproxy cleanup` removes every virtual server, as
//! kube-proxy's cleanup does. A virtual server two ports claim (an address
//! and port in two Services) goes to the first by name; the other is
//! reported once ([`Dataplane::take_problems`]).
//!
//! Both families are served, as kube-proxy's dual-stack IPVS proxier (one
//! per family) serves them: a dual-stack Service's IPv6 port gets IPv6
//! virtual servers (its ClusterIP bound to `kube-ipvs0` as a /128, its node
//! ports on the node's IPv6 addresses only), kube-proxy's IPv6 ipsets
//! (`KUBE-6-*`) and the same constant rules through `ip6tables`. IPVS
//! answers an IPv6 virtual server without real servers with ICMPv6 port
//! unreachable. A node without IPv6 rules is served IPv4 only (warned).

pub mod dummy;
pub mod ipset;
pub mod netlink;
pub mod node_ips;
pub mod rules;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use anyhow::{Context, Result};
pub use netlink::NoIpvs;
use netlink::{IPVS_CMD_DEL_DEST, IPVS_CMD_NEW_DEST, IPVS_CMD_SET_DEST, Ipvs, Real, VirtualKey, VirtualServer};
use node_ips::NodePortAddresses;
use tracing::{debug, info, warn};

use super::{Dataplane, Plan, SyncedChange, conntrack, options::LocalTraffic};
use crate::{
    config::{Cidr, Config, DetectLocal},
    model::{Endpoint, EndpointSets, IpFamily, Problem, ServicePort},
    sys::iptables::{Iptables, Saved, SystemIptables},
};

/// Weight of a real server taking new connections.
const WEIGHT: u32 = 1;

/// What the mode is built from.
#[derive(Clone, Debug)]
pub struct IpvsOptions {
    pub scheduler: String,
    /// Addresses NodePorts get a virtual server on.
    pub node_ports: NodePortAddresses,
    /// Virtual servers in these networks are never removed.
    pub exclude_cidrs: Vec<Cidr>,
    pub rules: rules::RuleOptions,
    /// Connection timeouts in seconds (TCP, TCP FIN, UDP); 0 leaves the
    /// kernel's.
    pub timeouts: (u32, u32, u32),
    /// kube-proxy's `strictARP`: only the uplink answers ARP for its own
    /// addresses, not for the ClusterIPs on `kube-ipvs0`.
    pub strict_arp: bool,
    /// This node's name: endpoints naming it are the ones the `Local`
    /// traffic policies reach. `None`: no endpoint is local.
    pub node_name: Option<String>,
}

/// The virtual servers a set of ports needs, and the ports that could not
/// have theirs.
#[derive(Default)]
struct Desired {
    servers: BTreeMap<VirtualKey, VirtualServer>,
    /// Which port each virtual server is for.
    owners: BTreeMap<VirtualKey, String>,
    conflicts: Vec<Problem>,
}

pub struct IpvsMode {
    opts: IpvsOptions,
    ipvs: Ipvs,
    dummy: dummy::Dummy,
    /// The index of `kube-ipvs0`.
    index: u32,
    /// What the last successful syncs programmed, by port name.
    state: BTreeMap<String, ServicePort>,
    /// The addresses NodePorts are served on now ([`IpvsOptions::node_ports`]
    /// as last resolved).
    node_ips: Vec<IpAddr>,
    /// Every address NodePorts were served on in this run: a full sync
    /// removes stale node-port virtual servers on them too.
    former_node_ips: BTreeSet<IpAddr>,
    /// What could not be programmed, already reported (each once), as
    /// `(object, reason)`.
    reported: BTreeSet<(String, String)>,
    /// Reported since the agent last asked ([`Dataplane::take_problems`]).
    problems: Vec<Problem>,
    writes: u64,
    /// [`FAMILIES`], or IPv4 alone where the node has no IPv6 rules
    /// (a kernel booted without IPv6, no `ip6tables`).
    families: &'static [IpFamily],
}

/// Starts the IPVS mode for `xproxy run` (see [`IpvsMode::start`]).
pub fn start(config: &Config) -> Result<Box<dyn Dataplane>> {
    let local_traffic = LocalTraffic::from_config(config, "ipvs");
    let opts = IpvsOptions {
        scheduler: config.ipvs.scheduler.as_str().to_owned(),
        node_ports: NodePortAddresses::from_config(config),
        exclude_cidrs: config.ipvs.exclude_cidrs.clone(),
        rules: rules::RuleOptions {
            masquerade_bit: config.masquerade.bit,
            masquerade_all: config.masquerade.all,
            local_traffic_v6: local_traffic_v6(config, local_traffic.as_ref()),
            local_traffic,
        },
        timeouts: (
            seconds(config.ipvs.tcp_timeout),
            seconds(config.ipvs.tcp_fin_timeout),
            seconds(config.ipvs.udp_timeout),
        ),
        strict_arp: config.ipvs.strict_arp,
        node_name: Some(config.node_name.clone()),
    };
    Ok(Box::new(IpvsMode::start(opts)?))
}

/// The virtual servers `port` needs on a node named `node` with `node_ips`,
/// with their real servers: for the ClusterIP those of the internal traffic
/// policy; for the external IPs, load balancer IPs and node ports (external
/// traffic) those of the external one. With ClientIP affinity every one of
/// them is persistent for the affinity's timeout, as in kube-proxy.
pub fn virtual_servers(
    port: &ServicePort,
    node_ips: &[IpAddr],
    scheduler: &str,
    node: Option<&str>,
) -> Vec<(VirtualKey, VirtualServer)> {
    let sets = EndpointSets::of(port, node);
    let persistence = port.affinity.map(seconds);
    let server = |local_only: bool, usable: &[&Endpoint]| VirtualServer {
        scheduler: scheduler.to_owned(),
        persistence,
        reals: real_servers(port, usable, local_only, node),
    };
    let key = |addr: IpAddr, port_number: u16| VirtualKey {
        protocol: port.protocol,
        addr,
        port: port_number,
    };
    let mut out = vec![(
        key(port.cluster_ip, port.port),
        server(port.internal_local(), sets.internal()),
    )];
    let external = server(port.external_local(), sets.external());
    for addr in port.external_addresses() {
        out.push((key(addr, port.port), external.clone()));
    }
    // A port's node ports are on the node IPs of its own family.
    if let Some(node_port) = port.node_port {
        let own = node_ips.iter().filter(|ip| IpFamily::of(**ip) == port.family());
        out.extend(own.map(|ip| (key(*ip, node_port), external.clone())));
    }
    out
}

/// The addresses `port` needs bound to `kube-ipvs0`: its ClusterIP, external
/// IPs and load balancer IPs (so the kernel takes their packets as local
/// and IPVS sees them).
pub fn bound_addresses(port: &ServicePort) -> impl Iterator<Item = IpAddr> + '_ {
    std::iter::once(port.cluster_ip).chain(port.external_addresses())
}

/// The virtual servers of `ports` with NodePorts on `node_ips`. IPVS holds
/// one virtual server per address, port and protocol: where two ports claim
/// the same one (an external IP or load balancer IP that is another
/// Service's too), the first by name keeps it and the other is reported.
fn desired_servers(ports: &[&ServicePort], node_ips: &[IpAddr], scheduler: &str, node: Option<&str>) -> Desired {
    let mut desired = Desired::default();
    for port in ports {
        for (key, server) in virtual_servers(port, node_ips, scheduler, node) {
            match desired.owners.get(&key) {
                Some(owner) if *owner != port.name => desired.conflicts.push(Problem::new(
                    &port.name,
                    format!(
                        "virtual server {key} is already {owner}'s (IPVS holds one per address, port and \
                         protocol); not programmed for this port"
                    ),
                )),
                _ => {
                    desired.owners.insert(key, port.name.clone());
                    desired.servers.insert(key, server);
                }
            }
        }
    }
    desired
}

/// `usable` with weight 1, and the other terminating endpoints (those on
/// `node` only, if `local_only`) with weight 0, draining.
fn real_servers(port: &ServicePort, usable: &[&Endpoint], local_only: bool, node: Option<&str>) -> BTreeMap<Real, u32> {
    let mut reals = BTreeMap::new();
    let candidates = port.endpoints.iter().filter(|e| !local_only || e.is_on(node));
    for endpoint in candidates {
        if usable.contains(&endpoint) {
            reals.insert((endpoint.addr, endpoint.port), WEIGHT);
        } else if endpoint.terminating {
            reals.entry((endpoint.addr, endpoint.port)).or_insert(0);
        }
    }
    reals
}

/// IPVS sysctls kube-proxy sets (per network namespace): conntrack for
/// IPVS connections, so the nat POSTROUTING rules (masquerade) see them;
/// connections to removed real servers and stale templates expire at once.
const SYSCTLS: [(&str, &str); 3] = [
    ("/proc/sys/net/ipv4/vs/conntrack", "1"),
    ("/proc/sys/net/ipv4/vs/expire_nodest_conn", "1"),
    ("/proc/sys/net/ipv4/vs/expire_quiescent_template", "1"),
];

/// `strictARP`: answer ARP only for addresses of the receiving interface,
/// announce only the best local source.
const STRICT_ARP: [(&str, &str); 2] = [
    ("/proc/sys/net/ipv4/conf/all/arp_ignore", "1"),
    ("/proc/sys/net/ipv4/conf/all/arp_announce", "2"),
];

/// How IPv6 traffic from this node's pods is told: by the IPv6 cluster
/// CIDR where IPv4's is by the IPv4 one (`detectLocalMode: ClusterCIDR`),
/// else by the same interfaces as IPv4's.
fn local_traffic_v6(config: &Config, v4: Option<&LocalTraffic>) -> Option<LocalTraffic> {
    match config.detect_local {
        DetectLocal::ClusterCidr => config
            .cluster_cidrs
            .iter()
            .find(|c| !c.is_ipv4())
            .map(|c| LocalTraffic::Cidr(*c)),
        _ => v4.cloned(),
    }
}

/// The families the mode serves, each with its own sets and rules.
const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

/// The iptables tools of `family`.
fn iptables_of(family: IpFamily) -> SystemIptables {
    match family {
        IpFamily::V4 => SystemIptables::default(),
        IpFamily::V6 => SystemIptables::ipv6(),
    }
}

fn seconds(duration: std::time::Duration) -> u32 {
    u32::try_from(duration.as_secs()).unwrap_or(u32::MAX)
}

fn set_sysctls(strict_arp: bool) -> Result<()> {
    let strict: &[(&str, &str)] = if strict_arp { &STRICT_ARP } else { &[] };
    for &(path, value) in SYSCTLS.iter().chain(strict) {
        if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == value) {
            continue;
        }
        std::fs::write(path, value).with_context(|| format!("writing {value} to {path}"))?;
    }
    Ok(())
}

impl IpvsMode {
    /// Opens IPVS (failing with [`NoIpvs`] on a kernel without it), checks
    /// the iptables and ipset tools, creates `kube-ipvs0` and writes the
    /// constant rules and empty sets. Services are written by the syncs.
    pub fn start(opts: IpvsOptions) -> Result<Self> {
        let mut ipvs = Ipvs::open()?;
        set_sysctls(opts.strict_arp)?;
        let (tcp, tcp_fin, udp) = opts.timeouts;
        ipvs.set_timeouts(tcp, tcp_fin, udp)?;
        iptables_of(IpFamily::V4).check()?;
        ipset::save().context("the IPVS mode needs ipset")?;
        let mut dummy = dummy::Dummy::open()?;
        let index = dummy.ensure()?;
        let node_ips = opts.node_ports.resolve()?;
        let mut mode = Self {
            opts,
            ipvs,
            dummy,
            index,
            state: BTreeMap::new(),
            former_node_ips: node_ips.iter().copied().collect(),
            node_ips,
            reported: BTreeSet::new(),
            problems: Vec::new(),
            writes: 0,
            families: &FAMILIES,
        };
        mode.write_sets(true)?;
        rules::write(&mut iptables_of(IpFamily::V4), &mode.opts.rules, IpFamily::V4)?;
        mode.writes += 1;
        // IPv6 where the node has it, as kube-proxy runs single-stack on a
        // node without IPv6.
        let mut ip6tables = iptables_of(IpFamily::V6);
        match ip6tables
            .check()
            .and_then(|()| rules::write(&mut ip6tables, &mode.opts.rules, IpFamily::V6))
        {
            Ok(()) => mode.writes += 1,
            Err(e) => {
                warn!(
                    error = format!("{e:#}"),
                    "no IPv6 rules on this node: the IPVS mode serves IPv4 only"
                );
                mode.families = &FAMILIES[..1];
            }
        }
        info!(scheduler = %mode.opts.scheduler, node_ips = ?mode.node_ips, "ipvs mode ready");
        Ok(mode)
    }

    fn desired_on(&self, ports: &[&ServicePort], node_ips: &[IpAddr]) -> Desired {
        desired_servers(ports, node_ips, &self.opts.scheduler, self.opts.node_name.as_deref())
    }

    fn desired(&self, ports: &[&ServicePort]) -> BTreeMap<VirtualKey, VirtualServer> {
        self.desired_on(ports, &self.node_ips).servers
    }

    /// The virtual servers of the whole state; its conflicts are reported.
    fn desired_state(&mut self) -> BTreeMap<VirtualKey, VirtualServer> {
        let all: Vec<&ServicePort> = self.state.values().collect();
        let desired = self.desired_on(&all, &self.node_ips);
        self.report(desired.conflicts);
        desired.servers
    }

    /// Queues `problems` for the agent (which logs and counts them), each
    /// only the first time.
    fn report(&mut self, problems: Vec<Problem>) {
        for problem in problems {
            if self.reported.insert((problem.object.clone(), problem.reason.clone())) {
                self.problems.push(problem);
            }
        }
    }

    /// Reads the NodePort addresses again (kube-proxy does at every sync);
    /// returns the ones before if they changed.
    fn refresh_node_ips(&mut self) -> Result<Option<Vec<IpAddr>>> {
        let now = self.opts.node_ports.resolve()?;
        if now == self.node_ips {
            return Ok(None);
        }
        info!(before = ?self.node_ips, now = ?now, "the NodePort addresses changed");
        self.former_node_ips.extend(now.iter().copied());
        Ok(Some(std::mem::replace(&mut self.node_ips, now)))
    }

    fn excluded(&self, key: &VirtualKey) -> bool {
        self.opts.exclude_cidrs.iter().any(|c| c.contains(key.addr))
    }

    /// Makes virtual server `key` equal to `want` (or absent), given what
    /// the kernel has (`have`); touches only what differs.
    fn sync_server(
        &mut self,
        key: &VirtualKey,
        want: Option<&VirtualServer>,
        have: Option<&VirtualServer>,
    ) -> Result<()> {
        match (want, have) {
            (None, None) => {}
            (None, Some(_)) => {
                self.ipvs.del_service(key)?;
                self.writes += 1;
            }
            (Some(want), have) => {
                let empty = VirtualServer::default();
                let have = match have {
                    Some(have) => {
                        // Switching affinity on or off, or a new timeout,
                        // edits the virtual server in place: its real
                        // servers and connections stay.
                        if have.entry() != want.entry() {
                            self.ipvs.set_service(key, want.entry())?;
                            self.writes += 1;
                        }
                        have
                    }
                    None => {
                        self.ipvs.add_service(key, want.entry())?;
                        self.writes += 1;
                        &empty
                    }
                };
                for (real, weight) in &have.reals {
                    if !want.reals.contains_key(real) {
                        self.ipvs.dest(IPVS_CMD_DEL_DEST, key, *real, *weight)?;
                        self.writes += 1;
                    }
                }
                for (real, weight) in &want.reals {
                    let cmd = match have.reals.get(real) {
                        Some(w) if w == weight => continue,
                        Some(_) => IPVS_CMD_SET_DEST,
                        None => IPVS_CMD_NEW_DEST,
                    };
                    self.ipvs.dest(cmd, key, *real, *weight)?;
                    self.writes += 1;
                }
            }
        }
        Ok(())
    }

    /// Binds or unbinds `ips` on `kube-ipvs0` as the state needs them.
    fn sync_addresses(&mut self, ips: BTreeSet<IpAddr>) -> Result<()> {
        let have = self.dummy.addresses(self.index)?;
        let wanted: BTreeSet<IpAddr> = self.state.values().flat_map(bound_addresses).collect();
        for ip in ips {
            match (wanted.contains(&ip), have.contains(&ip)) {
                (true, false) => {
                    self.dummy.add(self.index, ip)?;
                    self.writes += 1;
                }
                (false, true) => {
                    self.dummy.remove(self.index, ip)?;
                    self.writes += 1;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Rewrites the ipsets that differ from the state (read from the
    /// kernel when `read`, else assumed right when unchanged).
    fn write_sets(&mut self, read: bool) -> Result<()> {
        let desired = ipset::entries(self.state.values(), self.opts.node_name.as_deref(), &self.node_ips);
        let current = if read { ipset::save()? } else { ipset::Entries::new() };
        let input = ipset::render(&desired, &current);
        if !input.is_empty() {
            crate::sys::ipset::restore(&input)?;
            self.writes += 1;
        }
        Ok(())
    }
}

impl Dataplane for IpvsMode {
    fn name(&self) -> &'static str {
        "ipvs"
    }

    fn families(&self) -> &'static [IpFamily] {
        self.families
    }

    fn delete_stale_flows(&mut self, change: &SyncedChange<'_>) -> u64 {
        conntrack::delete_stale_flows(change)
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        let moved = self.refresh_node_ips()?;
        let old_ips = moved.as_deref().unwrap_or(&self.node_ips).to_vec();
        let old: Vec<ServicePort> = plan
            .remove
            .iter()
            .chain(&plan.upsert)
            .filter_map(|p| self.state.get(&p.name).cloned())
            .chain(plan.remove.iter().cloned())
            .collect();
        let mut touched_ips = BTreeSet::new();
        let mut touched = BTreeSet::new();
        for port in &old {
            touched_ips.extend(bound_addresses(port));
            touched.extend(self.desired_on(&[port], &old_ips).servers.into_keys());
        }
        for port in &plan.remove {
            self.state.remove(&port.name);
        }
        for port in &plan.upsert {
            touched_ips.extend(bound_addresses(port));
            self.state.insert(port.name.clone(), port.clone());
        }
        let desired = self.desired_state();
        touched.extend(plan.upsert.iter().flat_map(|p| self.desired(&[p]).into_keys()));
        if moved.is_some() {
            // Every port's node ports move with the addresses.
            let all: Vec<&ServicePort> = self.state.values().collect();
            touched.extend(self.desired_on(&all, &old_ips).servers.into_keys());
            touched.extend(desired.keys().copied());
        }
        // Addresses first, so a new virtual server is reachable at once.
        self.sync_addresses(touched_ips)?;
        for key in touched {
            let have = self.ipvs.get(&key)?;
            self.sync_server(&key, desired.get(&key), have.as_ref())?;
        }
        self.write_sets(true)?;
        debug!(
            upserts = plan.upsert.len(),
            removes = plan.remove.len(),
            "ipvs partial sync"
        );
        Ok(())
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        self.index = self.dummy.ensure()?;
        self.refresh_node_ips()?;
        self.state = desired.clone();
        let want = self.desired_state();
        let have = self.ipvs.list()?;
        let bound: BTreeSet<IpAddr> = self.dummy.addresses(self.index)?;
        let mut ips = bound.clone();
        ips.extend(self.state.values().flat_map(bound_addresses));
        self.sync_addresses(ips)?;
        let keys: BTreeSet<VirtualKey> = want.keys().chain(have.keys()).copied().collect();
        for key in keys {
            // Unwanted virtual servers go only if they are the mode's: on
            // an address of kube-ipvs0 or a node IP (now or earlier in this
            // run), outside excludeCIDRs (as kube-proxy; others' virtual
            // servers stay).
            let ours = bound.contains(&key.addr) || self.former_node_ips.contains(&key.addr);
            if !want.contains_key(&key) && (!ours || self.excluded(&key)) {
                continue;
            }
            self.sync_server(&key, want.get(&key), have.get(&key))?;
        }
        self.write_sets(true)?;
        for &family in self.families {
            let mut system = iptables_of(family);
            let saved = Saved::parse(&system.save()?);
            if !rules::chains_present(&saved) || !rules::missing_jumps(&saved).is_empty() {
                rules::write(&mut system, &self.opts.rules, family)?;
                self.writes += 1;
            }
        }
        Ok(())
    }

    fn take_problems(&mut self) -> Vec<Problem> {
        std::mem::take(&mut self.problems)
    }

    fn kernel_writes(&self) -> u64 {
        self.writes
    }
}

/// Removes what the IPVS mode installed in the calling thread's network
/// namespace: every virtual server (when the kernel has IPVS), `kube-ipvs0`,
/// the constant rules and the ipsets. Idempotent; harmless without IPVS,
/// iptables or ipset.
pub fn cleanup() -> Result<()> {
    match Ipvs::open() {
        Ok(mut ipvs) => {
            let servers = ipvs.list()?;
            for key in servers.keys() {
                ipvs.del_service(key)?;
            }
            if !servers.is_empty() {
                info!(count = servers.len(), "removed the IPVS virtual servers");
            }
        }
        Err(e) if e.is::<NoIpvs>() => {}
        Err(e) => return Err(e),
    }
    if dummy::Dummy::open()?.delete()? {
        info!("removed {}", dummy::DUMMY);
    }
    let chains = rules::cleanup()?;
    if chains > 0 {
        info!(chains, "removed the IPVS mode's iptables chains");
    }
    let sets = ipset::cleanup()?;
    if sets > 0 {
        info!(sets, "removed the IPVS mode's ipsets");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        mode::fixtures::seed_port as seed,
        model::{Endpoint, Protocol, last_octet},
    };

    fn endpoint(last: u8, ready: bool, serving: bool, terminating: bool) -> Endpoint {
        Endpoint {
            ready,
            serving,
            terminating,
            ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
        }
    }

    #[test]
    fn one_virtual_server_per_cluster_ip_and_node_ip() {
        let port = seed(vec![endpoint(11, true, true, false), endpoint(12, true, true, false)]);
        let servers = virtual_servers(&port, &[Ipv4Addr::new(172, 30, 0, 2).into()], "rr", None);
        let keys: Vec<String> = servers.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(keys, ["TCP 10.96.0.88:88", "TCP 172.30.0.2:30791"]);
        for (_, server) in &servers {
            assert_eq!(server.scheduler, "rr");
            assert_eq!(server.reals.values().copied().collect::<Vec<_>>(), [1, 1]);
        }
    }

    #[test]
    fn terminating_endpoints_drain_with_weight_zero() {
        let port = seed(vec![
            endpoint(11, true, true, false),
            endpoint(12, false, true, true),
            endpoint(13, false, false, false),
        ]);
        let (_, server) = &virtual_servers(&port, &[], "lc", None)[0];
        let weights: Vec<(u8, u32)> = server.reals.iter().map(|((a, _), w)| (last_octet(*a), *w)).collect();
        assert_eq!(weights, [(11, 1), (12, 0)]);
    }

    #[test]
    fn serving_terminating_endpoints_are_used_when_nothing_is_ready() {
        let port = seed(vec![endpoint(12, false, true, true), endpoint(13, false, false, true)]);
        let (_, server) = &virtual_servers(&port, &[], "rr", None)[0];
        let weights: Vec<(u8, u32)> = server.reals.iter().map(|((a, _), w)| (last_octet(*a), *w)).collect();
        assert_eq!(weights, [(12, 1), (13, 0)]);
    }

    fn on(node: &str, endpoint: Endpoint) -> Endpoint {
        Endpoint {
            node_name: Some(node.into()),
            ..endpoint
        }
    }

    fn weights(server: &VirtualServer) -> Vec<(u8, u32)> {
        server.reals.iter().map(|((a, _), w)| (last_octet(*a), *w)).collect()
    }

    /// kube-proxy's IPVS mode: the node ports of an externalTrafficPolicy:
    /// Local port get this node's real servers only (a draining one of this
    /// node's too), the ClusterIP all of them; internalTrafficPolicy: Local
    /// does the same to the ClusterIP.
    #[test]
    fn local_policies_give_virtual_servers_this_nodes_real_servers() {
        let mut port = seed(vec![
            on("node-a", endpoint(11, true, true, false)),
            on("node-b", endpoint(12, true, true, false)),
            on("node-a", endpoint(13, false, true, true)),
            on("node-b", endpoint(14, false, true, true)),
        ]);
        port.external_policy = crate::model::TrafficPolicy::Local;
        let node_ip = IpAddr::V4(Ipv4Addr::new(172, 30, 0, 2));
        let servers = virtual_servers(&port, &[node_ip], "rr", Some("node-a"));
        assert_eq!(
            weights(&servers[0].1),
            [(11, 1), (12, 1), (13, 0), (14, 0)],
            "ClusterIP"
        );
        assert_eq!(servers[1].0.addr, node_ip);
        assert_eq!(weights(&servers[1].1), [(11, 1), (13, 0)], "node port");

        port.external_policy = crate::model::TrafficPolicy::Cluster;
        port.internal_policy = crate::model::TrafficPolicy::Local;
        let servers = virtual_servers(&port, &[node_ip], "rr", Some("node-a"));
        assert_eq!(weights(&servers[0].1), [(11, 1), (13, 0)], "ClusterIP");
        assert_eq!(
            weights(&servers[1].1),
            [(11, 1), (12, 1), (13, 0), (14, 0)],
            "node port"
        );

        // On node-b's only draining endpoint, or on no known node.
        port.endpoints.remove(1);
        let servers = virtual_servers(&port, &[], "rr", Some("node-b"));
        assert_eq!(weights(&servers[0].1), [(14, 1)], "the local draining endpoint serves");
        let servers = virtual_servers(&port, &[], "rr", None);
        assert!(servers[0].1.reals.is_empty(), "{servers:?}");
    }

    /// kube-proxy's IPVS mode: an external IP and a load balancer IP get
    /// a virtual server on the Service's port each, with the external
    /// policy's real servers like the node ports, and bound to kube-ipvs0
    /// like the ClusterIP; ClientIP affinity makes every one of them
    /// persistent for its timeout.
    #[test]
    fn external_and_load_balancer_ips_get_persistent_virtual_servers() {
        let mut port = seed(vec![
            on("node-a", endpoint(11, true, true, false)),
            on("node-b", endpoint(12, true, true, false)),
        ]);
        port.external_ips = vec![Ipv4Addr::new(198, 51, 100, 7).into()];
        port.load_balancer_ips = vec![
            Ipv4Addr::new(192, 0, 2, 10).into(),
            Ipv4Addr::new(198, 51, 100, 7).into(),
        ];
        port.external_policy = crate::model::TrafficPolicy::Local;
        port.affinity = Some(std::time::Duration::from_secs(30));
        let node_ip = IpAddr::V4(Ipv4Addr::new(172, 30, 0, 2));
        let servers = virtual_servers(&port, &[node_ip], "rr", Some("node-a"));
        let keys: Vec<String> = servers.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(
            keys,
            [
                "TCP 10.96.0.88:88",
                "TCP 198.51.100.7:88",
                "TCP 192.0.2.10:88",
                "TCP 172.30.0.2:30791"
            ]
        );
        assert_eq!(weights(&servers[0].1), [(11, 1), (12, 1)], "ClusterIP");
        for (key, server) in &servers[1..] {
            assert_eq!(weights(server), [(11, 1)], "{key}: externalTrafficPolicy: Local");
        }
        assert!(servers.iter().all(|(_, s)| s.persistence == Some(30)), "{servers:?}");
        let bound: Vec<String> = bound_addresses(&port).map(|a| a.to_string()).collect();
        assert_eq!(bound, ["10.96.0.88", "198.51.100.7", "192.0.2.10"]);

        port.affinity = None;
        let servers = virtual_servers(&port, &[node_ip], "rr", Some("node-a"));
        assert!(servers.iter().all(|(_, s)| s.persistence.is_none()), "{servers:?}");
    }

    /// IPVS holds one virtual server per address, port and protocol: a
    /// second Service claiming one keeps none there, and is reported.
    #[test]
    fn a_virtual_server_two_ports_claim_goes_to_the_first_and_the_other_is_reported() {
        let first = ServicePort {
            load_balancer_ips: vec![Ipv4Addr::new(192, 0, 2, 10).into()],
            ..seed(vec![endpoint(11, true, true, false)])
        };
        let second = ServicePort {
            name: "default/other".into(),
            cluster_ip: Ipv4Addr::new(10, 96, 0, 99).into(),
            node_port: None,
            external_ips: vec![Ipv4Addr::new(192, 0, 2, 10).into()],
            ..seed(vec![endpoint(12, true, true, false)])
        };
        let desired = desired_servers(&[&first, &second], &[], "rr", None);
        let lb = VirtualKey {
            protocol: Protocol::Tcp,
            addr: Ipv4Addr::new(192, 0, 2, 10).into(),
            port: 88,
        };
        assert_eq!(weights(&desired.servers[&lb]), [(11, 1)]);
        assert_eq!(desired.conflicts.len(), 1, "{:?}", desired.conflicts);
        assert_eq!(desired.conflicts[0].object, "default/other");
        assert!(
            desired.conflicts[0]
                .reason
                .contains("TCP 192.0.2.10:88 is already default/nginx-service's"),
            "{:?}",
            desired.conflicts
        );
        assert!(desired.servers.contains_key(&VirtualKey {
            addr: Ipv4Addr::new(10, 96, 0, 99).into(),
            ..lb
        }));
    }

    /// A dual-stack Service's IPv6 port: its virtual servers on its own
    /// family's addresses only (the IPv6 node IP for the node port), with
    /// its IPv6 endpoints as real servers.
    #[test]
    fn an_ipv6_port_gets_ipv6_virtual_servers_on_ipv6_node_ips() {
        let ip = |text: &str| -> IpAddr { text.parse().expect("an address") };
        let port = ServicePort {
            name: format!("{}{}", "default/nginx-service", crate::model::IPV6_SUFFIX),
            cluster_ip: ip("fd00:96::88"),
            external_ips: vec![ip("fd00:198::7")],
            endpoints: vec![Endpoint::ready(ip("fd00:10:244::11"), 80)],
            ..seed(Vec::new())
        };
        let node_ips = [ip("172.30.0.2"), ip("fd00:30::2")];
        let servers = virtual_servers(&port, &node_ips, "rr", None);
        let keys: Vec<String> = servers.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(
            keys,
            ["TCP [fd00:96::88]:88", "TCP [fd00:198::7]:88", "TCP [fd00:30::2]:30791"]
        );
        for (_, server) in &servers {
            assert_eq!(server.reals, BTreeMap::from([((ip("fd00:10:244::11"), 80), 1)]));
        }
        let v4 = virtual_servers(&seed(vec![endpoint(11, true, true, false)]), &node_ips, "rr", None);
        let keys: Vec<String> = v4.iter().map(|(k, _)| k.to_string()).collect();
        assert_eq!(keys, ["TCP 10.96.0.88:88", "TCP 172.30.0.2:30791"]);
        let bound: Vec<IpAddr> = bound_addresses(&port).collect();
        assert_eq!(bound, [ip("fd00:96::88"), ip("fd00:198::7")]);
    }
}
