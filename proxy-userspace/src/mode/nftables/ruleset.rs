//! Rendering: service ports -> `nft -f` input, in kube-proxy's layout.
//!
//! ```text
//! filter-prerouting, filter-output (filter, -110): ct state new -> firewall-check
//!   firewall-check: daddr . proto . dport vmap @firewall-ips -> firewall-HASH-…
//!   firewall-…: ip saddr != { loadBalancerSourceRanges [, LB IPs] } drop
//! filter-input/forward/output (filter, priority -110): ct state new -> endpoints-check
//!   endpoints-check: daddr . proto . dport  vmap @no-endpoint-services  -> reject-chain
//!                    NODEPORT-DEST proto . dport vmap @no-endpoint-nodeports -> reject-chain
//! nat-prerouting, nat-output (dstnat, -100) -> services
//!   services: daddr . proto . dport  vmap @service-ips       -> service-HASH-ns/svc/proto/port
//!                                                             (ClusterIP), external-HASH-…
//!                                                             (external IPs, LB IPs)
//!             NODEPORT-DEST proto . dport vmap @service-nodeports -> external-HASH-…
//!   external-…: jump mark-for-masquerade; goto service-…
//!   service-…:  off-cluster source -> mark-for-masquerade;
//!               [ClientIP affinity: ip saddr @affinity-… goto endpoint-…, per endpoint]
//!               numgen random mod N vmap { 0 : goto endpoint-…, ... }
//!   endpoint-…: saddr = endpoint (hairpin) -> mark-for-masquerade;
//!               [update @affinity-… { ip saddr }]; dnat to IP:PORT
//! nat-postrouting (srcnat, 100) -> masquerading: marked -> clear the bit, masquerade
//! ```
//!
//! External IPs and load balancer IPs are keys of `@service-ips` like the
//! ClusterIP, but lead to `external-…` as node ports do, so the external
//! traffic policy applies to them; without an endpoint for external
//! traffic they are keys of `@no-endpoint-services`. Only their own
//! `IP . proto . port` is matched: other ports on those addresses are
//! left alone. Affinity sets (`affinity-…`, one per endpoint, timeout =
//! the Service's `timeoutSeconds`) are written before the chains that use
//! them and deleted after.
//!
//! The `Local` traffic policies, as kube-proxy's nftables mode lays them out:
//!
//! ```text
//! internalTrafficPolicy: Local  @service-ips -> local-HASH-… (this node's endpoints)
//! externalTrafficPolicy: Local  external-…: from a local pod -> goto service-…
//!                                            fib saddr type local -> mark-for-masquerade, goto service-…
//!                                            goto local-… (the client's address kept)
//! no local endpoint (but some elsewhere): @no-endpoint-services -> drop;
//!   @no-endpoint-nodeports -> drop-external-chain (drops all but the node's own traffic)
//! ```
//!
//! NODEPORT-DEST is `fib daddr type local` (every local address but
//! 127.0.0.0/8), a set of node IPs, or local addresses inside a set of CIDRs.
//!
//! The drawing is the `ip` table's; the `ip6` table of IPv6 ports is the
//! same with `ip6` matches, `ipv6_addr` keys, `[IP]:PORT` DNATs, ICMPv6
//! rejects and `::1` where it says 127.0.0.0/8 ([`Options::family`]).
//!
//! A full sync is one transaction that replaces the table (`add table`,
//! `delete table`, `add table` with everything in it): atomic, so no packet
//! ever sees a half-written table. A partial sync is one transaction that
//! touches only what changed between two renderings of the changed ports:
//! stale map elements are deleted first, changed chains are flushed and
//! refilled (endpoint chains before the service chains that jump to them),
//! new elements are added, and chains nothing refers to any more go last.
//! The same input always gives the same text.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use super::names::{self, TABLE, nft_family};
use crate::{
    config::Cidr,
    mode::options::LocalTraffic,
    model::{Endpoint, EndpointSets, IpFamily, ServicePort},
};

const TABLE_COMMENT: &str = "rules for xproxy (kube-proxy's nftables layout)";
/// Matches a destination that is not localhost: NodePorts never answer on
/// 127.0.0.0/8 in this mode (that needs route_localnet, like kube-proxy's
/// iptables mode, and kube-proxy's nftables mode does not do it either),
/// nor on `::1` (IPv6 has no route_localnet at all).
fn not_localhost(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip daddr != 127.0.0.0/8",
        IpFamily::V6 => "ip6 daddr != ::1",
    }
}

/// The nft type of an address of `family`, in set and map keys.
fn addr_type(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ipv4_addr",
        IpFamily::V6 => "ipv6_addr",
    }
}

/// What `reject-chain` answers with: ICMP port unreachable (nft's default
/// in an `ip` table), ICMPv6 port unreachable in the `ip6` table.
fn reject(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "reject",
        IpFamily::V6 => "reject with icmpv6 port-unreachable",
    }
}

/// nftables keeps at most 256 bytes of a comment; stay well inside.
const COMMENT_MAX: usize = 128;

/// The match for "not from a local pod" (in the table of `family`).
fn if_not_local(local: &LocalTraffic, family: IpFamily) -> String {
    match local {
        LocalTraffic::Cidr(cidr) => format!("{} saddr != {cidr}", nft_family(family)),
        LocalTraffic::Bridge(name) => format!("iifname != {}", quote(name)),
        LocalTraffic::InterfacePrefix(prefix) => format!("iifname != {}", quote(&format!("{prefix}*"))),
    }
}

/// The match for "from a local pod" (in the table of `family`).
fn if_local(local: &LocalTraffic, family: IpFamily) -> String {
    match local {
        LocalTraffic::Cidr(cidr) => format!("{} saddr {cidr}", nft_family(family)),
        LocalTraffic::Bridge(name) => format!("iifname {}", quote(name)),
        LocalTraffic::InterfacePrefix(prefix) => format!("iifname {}", quote(&format!("{prefix}*"))),
    }
}

/// Which addresses NodePorts answer on (kube-proxy's `nodePortAddresses`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePorts {
    /// Every local address but 127.0.0.0/8 (`fib daddr type local`).
    AllLocal,
    /// These addresses (set `nodeport-ips`), of the table's family.
    Addresses(Vec<IpAddr>),
    /// Local addresses inside these networks (set `nodeport-cidrs`). Read
    /// by the kernel at packet time, so addresses added later count too.
    Cidrs(Vec<Cidr>),
}

/// Everything besides the service ports that shapes the ruleset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// The fwmark bit that asks for masquerade (kube-proxy's default 14).
    pub masquerade_bit: u8,
    /// Masquerade all ClusterIP traffic, not only off-cluster traffic.
    pub masquerade_all: bool,
    /// `None`: local traffic cannot be told apart, so only NodePort and
    /// hairpin traffic is masqueraded (unless `masquerade_all`).
    pub local_traffic: Option<LocalTraffic>,
    pub node_ports: NodePorts,
    /// This node's name: endpoints naming it are the ones the `Local`
    /// traffic policies reach. `None`: no endpoint is local.
    pub node_name: Option<String>,
    /// This node's addresses of `family`: when a `loadBalancerSourceRanges`
    /// entry holds one, the LB IPs themselves are allowed as sources too
    /// (kube-proxy's allowance for LB IPs bound on the node).
    pub node_ips: Vec<IpAddr>,
    /// The family of the ports and of the table (`ip xproxy` or `ip6
    /// xproxy`): kube-proxy keeps one table per family too.
    pub family: IpFamily,
}

impl Default for Options {
    /// kube-proxy's defaults.
    fn default() -> Self {
        Self {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: None,
            node_ports: NodePorts::AllLocal,
            node_name: None,
            node_ips: Vec::new(),
            family: IpFamily::V4,
        }
    }
}

impl Options {
    /// The mark bit as a hex number (`0x4000` for bit 14).
    pub fn mark(&self) -> String {
        format!("{:#x}", 1u32 << self.masquerade_bit)
    }

    /// The match for "addressed to a NodePort address".
    fn node_port_destination(&self) -> String {
        let (ip, not_localhost) = (nft_family(self.family), not_localhost(self.family));
        match &self.node_ports {
            NodePorts::AllLocal => format!("fib daddr type local {not_localhost}"),
            NodePorts::Addresses(_) => format!("{ip} daddr @{}", names::NODEPORT_IPS),
            NodePorts::Cidrs(_) => format!(
                "fib daddr type local {not_localhost} {ip} daddr @{}",
                names::NODEPORT_CIDRS
            ),
        }
    }
}

/// In which order chains are written: a chain exists before a rule jumps
/// to it. Removed in the reverse order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ChainKind {
    Endpoint,
    Service,
    Local,
    External,
    /// Referred to by `@firewall-ips` only.
    Firewall,
}

/// One per-service chain and its rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    pub kind: ChainKind,
    pub rules: Vec<String>,
}

/// A per-endpoint affinity set: the client addresses the endpoint served
/// within the last `timeout_secs`, kept by the kernel (`flags dynamic,
/// timeout`: each `update` restarts an address's timeout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AffinitySet {
    pub name: String,
    pub timeout_secs: u64,
    /// The family of the client addresses it holds.
    pub family: IpFamily,
}

impl AffinitySet {
    /// The `{ ... }` body of its `add set` command.
    fn spec(&self) -> String {
        format!(
            "{{ type {} ; flags dynamic,timeout ; timeout {}s ; }}",
            addr_type(self.family),
            self.timeout_secs
        )
    }
}

/// One element of one of the verdict maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Element {
    pub map: &'static str,
    /// `IP . proto . port` or `proto . port`.
    pub key: String,
    /// Already quoted, if any.
    pub comment: Option<String>,
    /// `goto CHAIN`.
    pub verdict: String,
}

/// What one service port puts into the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortRules {
    /// Endpoint chains, then the service and local chains, then the
    /// external one.
    pub chains: Vec<Chain>,
    pub elements: Vec<Element>,
    /// The affinity sets of the endpoint chains (ClientIP affinity only).
    pub sets: Vec<AffinitySet>,
}

/// The rendering of `port`: kube-proxy's chains and elements for both
/// traffic policies. ClusterIP traffic goes to the internal policy's chain
/// (`service-…` or `local-…`); external traffic (node port, external IPs,
/// LB IPs) to `external-…`, which masquerades everything (`Cluster`) or,
/// with the `Local` policy, sends this node's pods' and the node's own
/// traffic (masqueraded) to every endpoint and the rest, unmasqueraded, to
/// `local-…`. Traffic left with no endpoint is rejected if the port has
/// none at all, else dropped. LB IPs with source ranges get a firewall
/// chain; ClientIP affinity gets a set per endpoint.
pub fn port_rules(opts: &Options, port: &ServicePort) -> PortRules {
    let sets = EndpointSets::of(port, opts.node_name.as_deref());
    let mut out = PortRules::default();
    for ep in sets.reachable() {
        out.chains.push(endpoint_chain(port, ep));
        if let Some(set) = affinity_set(port, ep) {
            out.sets.push(set);
        }
    }
    policy_chains(opts, port, &sets, &mut out);
    cluster_ip_elements(port, &sets, &mut out);
    if port.externally_accessible() {
        external_elements(opts, port, &sets, &mut out);
    }
    if let Some(firewall) = firewall_chain(opts, port) {
        out.chains.push(firewall);
        out.elements.extend(firewall_elements(port));
    }
    out
}

/// `IP . proto . port`, the key of `@service-ips` and its kin.
fn address_key(port: &ServicePort, ip: IpAddr) -> String {
    format!("{ip} . {} . {}", port.protocol.lowercase(), port.port)
}

/// The verdicts for traffic its policy leaves without an endpoint:
/// (internal, external). Dropped if the port has endpoints elsewhere
/// (external traffic through `drop-external-chain`, which lets the node's
/// own traffic on to its short-circuit), rejected if it has none at all.
fn no_endpoint_verdicts(sets: &EndpointSets<'_>) -> (String, String) {
    if sets.has_any() {
        ("drop".to_owned(), format!("goto {}", names::DROP_EXTERNAL_CHAIN))
    } else {
        let reject = format!("goto {}", names::REJECT_CHAIN);
        (reject.clone(), reject)
    }
}

/// The DNAT chain of one endpoint; with affinity it also records the
/// client in the endpoint's set.
fn endpoint_chain(port: &ServicePort, ep: &Endpoint) -> Chain {
    let proto = port.protocol.lowercase();
    let ip = nft_family(port.family());
    // A pod reaching itself through its Service: without SNAT its reply
    // would bypass the DNAT's reverse.
    let mut rules = vec![format!("{ip} saddr {} jump {}", ep.addr, names::MARK_MASQ)];
    if port.affinity.is_some() {
        rules.push(format!("update @{} {{ {ip} saddr }}", names::affinity_set(port, ep)));
    }
    // `[ip]:port` for IPv6.
    let to = SocketAddr::new(ep.addr, ep.port);
    rules.push(format!("meta l4proto {proto} dnat to {to}"));
    Chain {
        name: names::endpoint_chain(port, ep),
        kind: ChainKind::Endpoint,
        rules,
    }
}

/// The affinity set of one endpoint, if the port has ClientIP affinity.
fn affinity_set(port: &ServicePort, ep: &Endpoint) -> Option<AffinitySet> {
    port.affinity.map(|timeout| AffinitySet {
        name: names::affinity_set(port, ep),
        // The model keeps the timeout within 1..=86400 s; never 0, which
        // nft would read as "no timeout".
        timeout_secs: timeout.as_secs().max(1),
        family: port.family(),
    })
}

/// `service-…` and `local-…`, each if some traffic uses it.
fn policy_chains(opts: &Options, port: &ServicePort, sets: &EndpointSets<'_>, out: &mut PortRules) {
    let internal_chain = internal_chain(port);
    for (chain, kind, used, endpoints) in [
        (
            names::service_chain(port),
            ChainKind::Service,
            sets.uses_cluster(),
            &sets.cluster,
        ),
        (
            names::local_chain(port),
            ChainKind::Local,
            sets.uses_local(),
            &sets.local,
        ),
    ] {
        if !used {
            continue;
        }
        let mut rules = Vec::new();
        if chain == internal_chain {
            rules.extend(internal_masquerade(opts, port));
        }
        rules.extend(affinity_lookups(port, endpoints));
        rules.push(dispatch(port, endpoints));
        out.chains.push(Chain {
            name: chain,
            kind,
            rules,
        });
    }
}

/// The chain ClusterIP traffic goes to.
fn internal_chain(port: &ServicePort) -> String {
    if port.internal_local() {
        names::local_chain(port)
    } else {
        names::service_chain(port)
    }
}

/// The ClusterIP's element: to the internal chain, or a no-endpoint verdict.
fn cluster_ip_elements(port: &ServicePort, sets: &EndpointSets<'_>, out: &mut PortRules) {
    let key = address_key(port, port.cluster_ip);
    if sets.internal().is_empty() {
        out.elements.push(Element {
            map: names::NO_ENDPOINT_SERVICES,
            key,
            comment: Some(quote(&port.name)),
            verdict: no_endpoint_verdicts(sets).0,
        });
    } else {
        out.elements.push(Element {
            map: names::SERVICE_IPS,
            key,
            comment: None,
            verdict: format!("goto {}", internal_chain(port)),
        });
    }
}

/// External traffic: `external-…` and the elements of the node port, the
/// external IPs and the LB IPs leading to it (or to a no-endpoint verdict).
fn external_elements(opts: &Options, port: &ServicePort, sets: &EndpointSets<'_>, out: &mut PortRules) {
    let proto = port.protocol.lowercase();
    let node_key = port.node_port.map(|np| {
        (
            names::SERVICE_NODEPORTS,
            names::NO_ENDPOINT_NODEPORTS,
            format!("{proto} . {np}"),
        )
    });
    let address_keys = port
        .external_addresses()
        .into_iter()
        .map(|ip| (names::SERVICE_IPS, names::NO_ENDPOINT_SERVICES, address_key(port, ip)));
    let keys: Vec<_> = node_key.into_iter().chain(address_keys).collect();
    if sets.has_any() {
        let external = names::external_chain(port);
        out.chains.push(Chain {
            name: external.clone(),
            kind: ChainKind::External,
            rules: external_rules(opts, port, sets),
        });
        for (map, _, key) in &keys {
            out.elements.push(Element {
                map,
                key: key.clone(),
                comment: None,
                verdict: format!("goto {external}"),
            });
        }
    }
    if sets.external().is_empty() {
        let verdict = no_endpoint_verdicts(sets).1;
        for (_, map, key) in keys {
            out.elements.push(Element {
                map,
                key,
                comment: Some(quote(&port.name)),
                verdict: verdict.clone(),
            });
        }
    }
}

/// `firewall-…` for a port with LB IPs and `loadBalancerSourceRanges`:
/// drops new connections from anywhere else. If a range holds a node IP,
/// the LB IPs count as allowed sources too: an LB IP bound on the node
/// makes the node's own requests to it leave from the LB IP (kube-proxy
/// allows them for the same reason).
fn firewall_chain(opts: &Options, port: &ServicePort) -> Option<Chain> {
    if port.source_ranges.is_empty() || port.load_balancer_ips.is_empty() {
        return None;
    }
    let mut sources: Vec<String> = port.source_ranges.iter().map(ToString::to_string).collect();
    let allow_from_node = port
        .source_ranges
        .iter()
        .any(|range| opts.node_ips.iter().any(|ip| range.contains(*ip)));
    if allow_from_node {
        sources.extend(port.load_balancer_ips.iter().map(ToString::to_string));
    }
    Some(Chain {
        name: names::firewall_chain(port),
        kind: ChainKind::Firewall,
        rules: vec![format!(
            "{} saddr != {{ {} }} drop",
            nft_family(port.family()),
            sources.join(", ")
        )],
    })
}

/// The `@firewall-ips` elements of a port [`firewall_chain`] filters.
fn firewall_elements(port: &ServicePort) -> impl Iterator<Item = Element> + '_ {
    let verdict = format!("goto {}", names::firewall_chain(port));
    port.load_balancer_ips.iter().map(move |ip| Element {
        map: names::FIREWALL_IPS,
        key: address_key(port, *ip),
        comment: Some(quote(&port.name)),
        verdict: verdict.clone(),
    })
}

/// ClientIP affinity: a client an endpoint of `endpoints` served within
/// the timeout goes to it again, before any balancing.
fn affinity_lookups(port: &ServicePort, endpoints: &[&Endpoint]) -> Vec<String> {
    if port.affinity.is_none() {
        return Vec::new();
    }
    endpoints
        .iter()
        .map(|ep| {
            format!(
                "{} saddr @{} goto {}",
                nft_family(port.family()),
                names::affinity_set(port, ep),
                names::endpoint_chain(port, ep)
            )
        })
        .collect()
}

/// The first rule of the internal policy's chain: which ClusterIP traffic
/// to masquerade (all, off-cluster traffic, or none if local traffic
/// cannot be told apart).
fn internal_masquerade(opts: &Options, port: &ServicePort) -> Option<String> {
    let proto = port.protocol.lowercase();
    let family = port.family();
    let destination = format!(
        "{} daddr {} {proto} dport {}",
        nft_family(family),
        port.cluster_ip,
        port.port
    );
    if opts.masquerade_all {
        Some(format!("{destination} jump {}", names::MARK_MASQ))
    } else {
        opts.local_traffic.as_ref().map(|local| {
            format!(
                "{destination} {} jump {}",
                if_not_local(local, family),
                names::MARK_MASQ
            )
        })
    }
}

/// `numgen random` over the endpoint chains of `endpoints`.
fn dispatch(port: &ServicePort, endpoints: &[&Endpoint]) -> String {
    let choices: Vec<String> = endpoints
        .iter()
        .enumerate()
        .map(|(i, ep)| format!("{i} : goto {}", names::endpoint_chain(port, ep)))
        .collect();
    format!(
        "numgen random mod {} vmap {{ {} }}",
        endpoints.len(),
        choices.join(", ")
    )
}

/// The rules of `external-…`.
fn external_rules(opts: &Options, port: &ServicePort, sets: &EndpointSets<'_>) -> Vec<String> {
    let service = names::service_chain(port);
    if !port.external_local() {
        // NodePort traffic may come from anywhere: masquerade it so
        // replies come back through this node.
        return vec![format!("jump {}", names::MARK_MASQ), format!("goto {service}")];
    }
    let mut rules = Vec::new();
    if let Some(local) = &opts.local_traffic {
        rules.push(format!(
            "{} goto {service} comment {}",
            if_local(local, port.family()),
            quote("short-circuit pod traffic")
        ));
    }
    rules.push(format!(
        "fib saddr type local jump {} comment {}",
        names::MARK_MASQ,
        quote("masquerade local traffic")
    ));
    rules.push(format!(
        "fib saddr type local goto {service} comment {}",
        quote("short-circuit local traffic")
    ));
    if !sets.external().is_empty() {
        rules.push(format!("goto {}", names::local_chain(port)));
    }
    rules
}

/// The chains and elements of a set of service ports, by name and key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Objects {
    pub chains: BTreeMap<String, Chain>,
    pub elements: BTreeMap<(&'static str, String), Element>,
    /// Affinity sets by name.
    pub sets: BTreeMap<String, AffinitySet>,
}

impl Objects {
    pub fn add(&mut self, rules: &PortRules) {
        for chain in &rules.chains {
            self.chains.insert(chain.name.clone(), chain.clone());
        }
        for set in &rules.sets {
            self.sets.insert(set.name.clone(), set.clone());
        }
        for element in &rules.elements {
            self.elements
                .insert((element.map, element.key.clone()), element.clone());
        }
    }
}

/// One `nft -f` input, for the table of one family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Script {
    /// The table's family (`ip`, `ip6`).
    family: &'static str,
    pub text: String,
    /// Table objects, chains, rules and elements added, flushed or deleted.
    pub writes: u64,
    /// Per-service chains the script deletes (or, with
    /// [`ChainRemoval::Flush`], empties).
    pub removed_chains: Vec<String>,
}

impl Script {
    fn new(family: IpFamily) -> Self {
        Self {
            family: nft_family(family),
            ..Self::default()
        }
    }

    fn cmd(&mut self, writes: u64, args: std::fmt::Arguments<'_>) {
        let _ = writeln!(self.text, "{args}");
        self.writes += writes;
    }

    fn note(&mut self, text: &str) {
        let _ = writeln!(self.text, "# {}", sanitize(text, COMMENT_MAX));
    }

    /// `add set`: creates the set, or gives an existing one the new
    /// timeout (kernels that cannot refuse it; the sync then fails and the
    /// full sync after it replaces the table).
    fn set(&mut self, set: &AffinitySet) {
        let f = self.family;
        self.cmd(1, format_args!("add set {f} {TABLE} {} {}", set.name, set.spec()));
    }

    fn chain(&mut self, chain: &Chain, flush: bool) {
        let (f, name) = (self.family, &chain.name);
        self.cmd(1, format_args!("add chain {f} {TABLE} {name}"));
        if flush {
            self.cmd(1, format_args!("flush chain {f} {TABLE} {name}"));
        }
        for rule in &chain.rules {
            self.cmd(1, format_args!("add rule {f} {TABLE} {name} {rule}"));
        }
    }

    /// `add element` (with values) or `delete element` (keys only), one
    /// command per map with one element per line.
    fn elements<'a>(&mut self, verb: &str, elements: impl IntoIterator<Item = &'a Element>) {
        let mut by_map: BTreeMap<&str, Vec<&Element>> = BTreeMap::new();
        for element in elements {
            by_map.entry(element.map).or_default().push(element);
        }
        for (map, elements) in by_map {
            let _ = writeln!(self.text, "{verb} element {} {TABLE} {map} {{", self.family);
            let last = elements.len() - 1;
            for (i, e) in elements.iter().enumerate() {
                let sep = if i == last { "" } else { "," };
                let comment = e.comment.as_ref().map(|c| format!(" comment {c}")).unwrap_or_default();
                if verb == "delete" {
                    let _ = writeln!(self.text, "\t{}{sep}", e.key);
                } else {
                    let _ = writeln!(self.text, "\t{}{comment} : {}{sep}", e.key, e.verdict);
                }
                self.writes += 1;
            }
            let _ = writeln!(self.text, "}}");
        }
    }
}

/// The fixed part of the table: base chains, helper chains, maps, sets.
fn base(opts: &Options, s: &mut Script) {
    let (f, ip, addr) = (s.family, nft_family(opts.family), addr_type(opts.family));
    // `add` first so that `delete` never fails on a fresh node.
    s.cmd(1, format_args!("add table {f} {TABLE}"));
    s.cmd(1, format_args!("delete table {f} {TABLE}"));
    s.cmd(
        1,
        format_args!("add table {f} {TABLE} {{ comment {} ; }}", quote(TABLE_COMMENT)),
    );
    // Filtering sees the destination before DNAT; numeric priorities
    // because nft takes names like `dstnat` only on some hooks.
    for (name, kind, hook, priority) in [
        (names::FILTER_PREROUTING, "filter", "prerouting", -110),
        (names::FILTER_INPUT, "filter", "input", -110),
        (names::FILTER_FORWARD, "filter", "forward", -110),
        (names::FILTER_OUTPUT, "filter", "output", -110),
        (names::NAT_PREROUTING, "nat", "prerouting", -100),
        (names::NAT_OUTPUT, "nat", "output", -100),
        (names::NAT_POSTROUTING, "nat", "postrouting", 100),
    ] {
        s.cmd(
            1,
            format_args!("add chain {f} {TABLE} {name} {{ type {kind} hook {hook} priority {priority} ; }}"),
        );
    }
    for name in [
        names::SERVICES,
        names::FIREWALL_CHECK,
        names::ENDPOINTS_CHECK,
        names::MARK_MASQ,
        names::MASQUERADING,
    ] {
        s.cmd(1, format_args!("add chain {f} {TABLE} {name}"));
    }
    s.cmd(
        1,
        format_args!(
            "add chain {f} {TABLE} {} {{ comment {} ; }}",
            names::REJECT_CHAIN,
            quote("helper for @no-endpoint-services / @no-endpoint-nodeports")
        ),
    );
    s.cmd(
        1,
        format_args!(
            "add chain {f} {TABLE} {} {{ comment {} ; }}",
            names::DROP_EXTERNAL_CHAIN,
            quote("helper for @no-endpoint-nodeports: Local policy without local endpoints")
        ),
    );
    let address_key = format!("{addr} . inet_proto . inet_service");
    for (name, key, comment) in [
        (
            names::SERVICE_IPS,
            address_key.as_str(),
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (
            names::SERVICE_NODEPORTS,
            "inet_proto . inet_service",
            "NodePort traffic",
        ),
        (
            names::NO_ENDPOINT_SERVICES,
            address_key.as_str(),
            "vmap to reject packets to services with no endpoints",
        ),
        (
            names::NO_ENDPOINT_NODEPORTS,
            "inet_proto . inet_service",
            "vmap to reject packets to service nodeports with no endpoints",
        ),
        (
            names::FIREWALL_IPS,
            address_key.as_str(),
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
    ] {
        s.cmd(
            1,
            format_args!(
                "add map {f} {TABLE} {name} {{ type {key} : verdict ; comment {} ; }}",
                quote(comment)
            ),
        );
    }
    match &opts.node_ports {
        NodePorts::AllLocal => {}
        NodePorts::Addresses(ips) => {
            s.cmd(
                1,
                format_args!(
                    "add set {f} {TABLE} {} {{ type {addr} ; comment {} ; }}",
                    names::NODEPORT_IPS,
                    quote("IPs that accept NodePort traffic")
                ),
            );
            let items: Vec<String> = ips.iter().map(IpAddr::to_string).collect();
            set_elements(s, names::NODEPORT_IPS, &items);
        }
        NodePorts::Cidrs(cidrs) => {
            s.cmd(
                1,
                format_args!(
                    "add set {f} {TABLE} {} {{ type {addr} ; flags interval ; auto-merge ; comment {} ; }}",
                    names::NODEPORT_CIDRS,
                    quote("networks whose local IPs accept NodePort traffic")
                ),
            );
            let items: Vec<String> = cidrs.iter().map(Cidr::to_string).collect();
            set_elements(s, names::NODEPORT_CIDRS, &items);
        }
    }
    for (from, matches, to) in [
        // Before DNAT, which would hide the LB IP.
        (names::FILTER_PREROUTING, "ct state new ", names::FIREWALL_CHECK),
        (names::FILTER_OUTPUT, "ct state new ", names::FIREWALL_CHECK),
        (names::FILTER_INPUT, "ct state new ", names::ENDPOINTS_CHECK),
        (names::FILTER_FORWARD, "ct state new ", names::ENDPOINTS_CHECK),
        (names::FILTER_OUTPUT, "ct state new ", names::ENDPOINTS_CHECK),
        (names::NAT_PREROUTING, "", names::SERVICES),
        (names::NAT_OUTPUT, "", names::SERVICES),
        (names::NAT_POSTROUTING, "", names::MASQUERADING),
    ] {
        s.cmd(1, format_args!("add rule {f} {TABLE} {from} {matches}jump {to}"));
    }
    let mark = opts.mark();
    let node_ports = opts.node_port_destination();
    let fixed = [
        (names::MARK_MASQ, format!("meta mark set meta mark or {mark}")),
        (names::MASQUERADING, format!("meta mark and {mark} == 0 return")),
        (names::MASQUERADING, format!("meta mark set meta mark xor {mark}")),
        (names::MASQUERADING, "masquerade fully-random".to_owned()),
        (names::REJECT_CHAIN, reject(opts.family).to_owned()),
        // The filter chains see the node's own traffic before nat-output
        // DNATs it to any endpoint (kube-proxy's short-circuit): let it be.
        (names::DROP_EXTERNAL_CHAIN, "fib saddr type local return".to_owned()),
        (names::DROP_EXTERNAL_CHAIN, "drop".to_owned()),
        (
            names::FIREWALL_CHECK,
            format!("{ip} daddr . meta l4proto . th dport vmap @{}", names::FIREWALL_IPS),
        ),
        (
            names::ENDPOINTS_CHECK,
            format!(
                "{ip} daddr . meta l4proto . th dport vmap @{}",
                names::NO_ENDPOINT_SERVICES
            ),
        ),
        (
            names::ENDPOINTS_CHECK,
            format!(
                "{node_ports} meta l4proto . th dport vmap @{}",
                names::NO_ENDPOINT_NODEPORTS
            ),
        ),
        (
            names::SERVICES,
            format!("{ip} daddr . meta l4proto . th dport vmap @{}", names::SERVICE_IPS),
        ),
        (
            names::SERVICES,
            format!(
                "{node_ports} meta l4proto . th dport vmap @{}",
                names::SERVICE_NODEPORTS
            ),
        ),
    ];
    for (chain, rule) in fixed {
        s.cmd(1, format_args!("add rule {f} {TABLE} {chain} {rule}"));
    }
}

fn set_elements(s: &mut Script, set: &str, items: &[String]) {
    if items.is_empty() {
        return;
    }
    let f = s.family;
    s.cmd(
        items.len() as u64,
        format_args!("add element {f} {TABLE} {set} {{ {} }}", items.join(", ")),
    );
}

/// A full sync: the whole table, replacing whatever is there.
pub fn full<'a>(opts: &Options, ports: impl IntoIterator<Item = (&'a str, &'a PortRules)>) -> Script {
    let mut s = Script::new(opts.family);
    base(opts, &mut s);
    let mut all = Objects::default();
    for (name, rules) in ports {
        if !rules.chains.is_empty() {
            s.note(name);
        }
        for set in &rules.sets {
            s.set(set);
        }
        for chain in &rules.chains {
            s.chain(chain, false);
        }
        all.add(rules);
    }
    s.elements("add", all.elements.values());
    s
}

/// What a partial sync does with chains no port uses any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainRemoval {
    Delete,
    /// Empty them and leave them for a later sync to delete: before Linux
    /// 6.2 the kernel may still count a reference from a map element
    /// deleted in the same transaction.
    Flush,
}

/// A partial sync from `before` to `after`, the renderings of the changed
/// ports as programmed and as wanted. `leftover` names chains left empty
/// by earlier syncs, removed too unless `after` uses them again. All in the
/// table of `family`.
pub fn partial(
    family: IpFamily,
    before: &Objects,
    after: &Objects,
    leftover: &[String],
    removal: ChainRemoval,
) -> Script {
    let mut s = Script::new(family);
    let f = s.family;

    let gone: Vec<&Element> = before
        .elements
        .iter()
        .filter(|(key, e)| after.elements.get(*key) != Some(*e))
        .map(|(_, e)| e)
        .collect();
    s.elements("delete", gone);

    // New sets before the chains that use them; a changed one (timeout)
    // is updated in place.
    for set in after
        .sets
        .values()
        .filter(|set| before.sets.get(&set.name) != Some(*set))
    {
        s.set(set);
    }

    let mut changed: Vec<&Chain> = after
        .chains
        .values()
        .filter(|c| before.chains.get(&c.name) != Some(*c))
        .collect();
    changed.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
    for chain in changed {
        let existed = before.chains.contains_key(&chain.name) || leftover.contains(&chain.name);
        s.chain(chain, existed);
    }

    let added: Vec<&Element> = after
        .elements
        .iter()
        .filter(|(key, e)| before.elements.get(*key) != Some(*e))
        .map(|(_, e)| e)
        .collect();
    s.elements("add", added);

    let mut unused: Vec<(Option<ChainKind>, &str)> = before
        .chains
        .values()
        .filter(|c| !after.chains.contains_key(&c.name))
        .map(|c| (Some(c.kind), c.name.as_str()))
        .collect();
    unused.extend(
        leftover
            .iter()
            .filter(|name| !after.chains.contains_key(*name) && !before.chains.contains_key(*name))
            .map(|name| (None, name.as_str())),
    );
    // Referring chains first: external -> service -> endpoint.
    unused.sort_by(|a, b| b.cmp(a));
    let verb = match removal {
        ChainRemoval::Delete => "delete",
        ChainRemoval::Flush => "flush",
    };
    for (_, name) in unused {
        s.cmd(1, format_args!("{verb} chain {f} {TABLE} {name}"));
        s.removed_chains.push(name.to_owned());
    }
    // Last: the rules using them are gone (deleted, flushed or rewritten).
    // With the set go the clients its endpoint kept.
    for name in before.sets.keys().filter(|name| !after.sets.contains_key(*name)) {
        s.cmd(1, format_args!("delete set {f} {TABLE} {name}"));
    }
    s
}

/// `"text"` for nft: quotes and control characters replaced, cut short.
pub fn quote(text: &str) -> String {
    format!("\"{}\"", sanitize(text, COMMENT_MAX))
}

fn sanitize(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        let c = match c {
            '"' => '\'',
            c if c.is_control() => ' ',
            c => c,
        };
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}
