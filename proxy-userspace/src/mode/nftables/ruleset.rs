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
    net::{IpAddr, Ipv4Addr},
};

use super::names::{self, FAMILY, TABLE};
use crate::{
    config::Cidr,
    mode::options::LocalTraffic,
    model::{Endpoint, EndpointSets, ServicePort},
};

const TABLE_COMMENT: &str = "rules for xproxy (kube-proxy's nftables layout)";
/// Matches a destination that is not localhost: NodePorts never answer on
/// 127.0.0.0/8 in this mode (that needs route_localnet, like kube-proxy's
/// iptables mode, and kube-proxy's nftables mode does not do it either).
const NOT_LOCALHOST: &str = "ip daddr != 127.0.0.0/8";
/// nftables keeps at most 256 bytes of a comment; stay well inside.
const COMMENT_MAX: usize = 128;

/// The match for "not from a local pod".
fn if_not_local(local: &LocalTraffic) -> String {
    match local {
        LocalTraffic::Cidr(cidr) => format!("ip saddr != {cidr}"),
        LocalTraffic::Bridge(name) => format!("iifname != {}", quote(name)),
        LocalTraffic::InterfacePrefix(prefix) => format!("iifname != {}", quote(&format!("{prefix}*"))),
    }
}

/// The match for "from a local pod".
fn if_local(local: &LocalTraffic) -> String {
    match local {
        LocalTraffic::Cidr(cidr) => format!("ip saddr {cidr}"),
        LocalTraffic::Bridge(name) => format!("iifname {}", quote(name)),
        LocalTraffic::InterfacePrefix(prefix) => format!("iifname {}", quote(&format!("{prefix}*"))),
    }
}

/// Which addresses NodePorts answer on (kube-proxy's `nodePortAddresses`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePorts {
    /// Every local address but 127.0.0.0/8 (`fib daddr type local`).
    AllLocal,
    /// These addresses (set `nodeport-ips`).
    Addresses(Vec<Ipv4Addr>),
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
    /// This node's IPv4 addresses: when a `loadBalancerSourceRanges` entry
    /// holds one, the LB IPs themselves are allowed as sources too
    /// (kube-proxy's allowance for LB IPs bound on the node).
    pub node_ips: Vec<Ipv4Addr>,
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
        match &self.node_ports {
            NodePorts::AllLocal => format!("fib daddr type local {NOT_LOCALHOST}"),
            NodePorts::Addresses(_) => format!("ip daddr @{}", names::NODEPORT_IPS),
            NodePorts::Cidrs(_) => format!(
                "fib daddr type local {NOT_LOCALHOST} ip daddr @{}",
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
}

impl AffinitySet {
    /// The `{ ... }` body of its `add set` command.
    fn spec(&self) -> String {
        format!(
            "{{ type ipv4_addr ; flags dynamic,timeout ; timeout {}s ; }}",
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
    // A pod reaching itself through its Service: without SNAT its reply
    // would bypass the DNAT's reverse.
    let mut rules = vec![format!("ip saddr {} jump {}", ep.addr, names::MARK_MASQ)];
    if port.affinity.is_some() {
        rules.push(format!("update @{} {{ ip saddr }}", names::affinity_set(port, ep)));
    }
    rules.push(format!("meta l4proto {proto} dnat to {}:{}", ep.addr, ep.port));
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
        .any(|range| opts.node_ips.iter().any(|ip| range.contains((*ip).into())));
    if allow_from_node {
        sources.extend(port.load_balancer_ips.iter().map(ToString::to_string));
    }
    Some(Chain {
        name: names::firewall_chain(port),
        kind: ChainKind::Firewall,
        rules: vec![format!("ip saddr != {{ {} }} drop", sources.join(", "))],
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
                "ip saddr @{} goto {}",
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
    let destination = format!("ip daddr {} {proto} dport {}", port.cluster_ip, port.port);
    if opts.masquerade_all {
        Some(format!("{destination} jump {}", names::MARK_MASQ))
    } else {
        opts.local_traffic
            .as_ref()
            .map(|local| format!("{destination} {} jump {}", if_not_local(local), names::MARK_MASQ))
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
            if_local(local),
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

/// One `nft -f` input.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Script {
    pub text: String,
    /// Table objects, chains, rules and elements added, flushed or deleted.
    pub writes: u64,
    /// Per-service chains the script deletes (or, with
    /// [`ChainRemoval::Flush`], empties).
    pub removed_chains: Vec<String>,
}

impl Script {
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
        self.cmd(1, format_args!("add set {FAMILY} {TABLE} {} {}", set.name, set.spec()));
    }

    fn chain(&mut self, chain: &Chain, flush: bool) {
        let name = &chain.name;
        self.cmd(1, format_args!("add chain {FAMILY} {TABLE} {name}"));
        if flush {
            self.cmd(1, format_args!("flush chain {FAMILY} {TABLE} {name}"));
        }
        for rule in &chain.rules {
            self.cmd(1, format_args!("add rule {FAMILY} {TABLE} {name} {rule}"));
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
            let _ = writeln!(self.text, "{verb} element {FAMILY} {TABLE} {map} {{");
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
    // `add` first so that `delete` never fails on a fresh node.
    s.cmd(1, format_args!("add table {FAMILY} {TABLE}"));
    s.cmd(1, format_args!("delete table {FAMILY} {TABLE}"));
    s.cmd(
        1,
        format_args!("add table {FAMILY} {TABLE} {{ comment {} ; }}", quote(TABLE_COMMENT)),
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
            format_args!("add chain {FAMILY} {TABLE} {name} {{ type {kind} hook {hook} priority {priority} ; }}"),
        );
    }
    for name in [
        names::SERVICES,
        names::FIREWALL_CHECK,
        names::ENDPOINTS_CHECK,
        names::MARK_MASQ,
        names::MASQUERADING,
    ] {
        s.cmd(1, format_args!("add chain {FAMILY} {TABLE} {name}"));
    }
    s.cmd(
        1,
        format_args!(
            "add chain {FAMILY} {TABLE} {} {{ comment {} ; }}",
            names::REJECT_CHAIN,
            quote("helper for @no-endpoint-services / @no-endpoint-nodeports")
        ),
    );
    s.cmd(
        1,
        format_args!(
            "add chain {FAMILY} {TABLE} {} {{ comment {} ; }}",
            names::DROP_EXTERNAL_CHAIN,
            quote("helper for @no-endpoint-nodeports: Local policy without local endpoints")
        ),
    );
    for (name, key, comment) in [
        (
            names::SERVICE_IPS,
            "ipv4_addr . inet_proto . inet_service",
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (
            names::SERVICE_NODEPORTS,
            "inet_proto . inet_service",
            "NodePort traffic",
        ),
        (
            names::NO_ENDPOINT_SERVICES,
            "ipv4_addr . inet_proto . inet_service",
            "vmap to reject packets to services with no endpoints",
        ),
        (
            names::NO_ENDPOINT_NODEPORTS,
            "inet_proto . inet_service",
            "vmap to reject packets to service nodeports with no endpoints",
        ),
        (
            names::FIREWALL_IPS,
            "ipv4_addr . inet_proto . inet_service",
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
    ] {
        s.cmd(
            1,
            format_args!(
                "add map {FAMILY} {TABLE} {name} {{ type {key} : verdict ; comment {} ; }}",
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
                    "add set {FAMILY} {TABLE} {} {{ type ipv4_addr ; comment {} ; }}",
                    names::NODEPORT_IPS,
                    quote("IPs that accept NodePort traffic")
                ),
            );
            let items: Vec<String> = ips.iter().map(Ipv4Addr::to_string).collect();
            set_elements(s, names::NODEPORT_IPS, &items);
        }
        NodePorts::Cidrs(cidrs) => {
            s.cmd(
                1,
                format_args!(
                    "add set {FAMILY} {TABLE} {} {{ type ipv4_addr ; flags interval ; auto-merge ; comment {} ; }}",
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
        s.cmd(1, format_args!("add rule {FAMILY} {TABLE} {from} {matches}jump {to}"));
    }
    let mark = opts.mark();
    let node_ports = opts.node_port_destination();
    let fixed = [
        (names::MARK_MASQ, format!("meta mark set meta mark or {mark}")),
        (names::MASQUERADING, format!("meta mark and {mark} == 0 return")),
        (names::MASQUERADING, format!("meta mark set meta mark xor {mark}")),
        (names::MASQUERADING, "masquerade fully-random".to_owned()),
        (names::REJECT_CHAIN, "reject".to_owned()),
        // The filter chains see the node's own traffic before nat-output
        // DNATs it to any endpoint (kube-proxy's short-circuit): let it be.
        (names::DROP_EXTERNAL_CHAIN, "fib saddr type local return".to_owned()),
        (names::DROP_EXTERNAL_CHAIN, "drop".to_owned()),
        (
            names::FIREWALL_CHECK,
            format!("ip daddr . meta l4proto . th dport vmap @{}", names::FIREWALL_IPS),
        ),
        (
            names::ENDPOINTS_CHECK,
            format!(
                "ip daddr . meta l4proto . th dport vmap @{}",
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
            format!("ip daddr . meta l4proto . th dport vmap @{}", names::SERVICE_IPS),
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
        s.cmd(1, format_args!("add rule {FAMILY} {TABLE} {chain} {rule}"));
    }
}

fn set_elements(s: &mut Script, set: &str, items: &[String]) {
    if items.is_empty() {
        return;
    }
    s.cmd(
        items.len() as u64,
        format_args!("add element {FAMILY} {TABLE} {set} {{ {} }}", items.join(", ")),
    );
}

/// A full sync: the whole table, replacing whatever is there.
pub fn full<'a>(opts: &Options, ports: impl IntoIterator<Item = (&'a str, &'a PortRules)>) -> Script {
    let mut s = Script::default();
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
/// by earlier syncs, removed too unless `after` uses them again.
pub fn partial(before: &Objects, after: &Objects, leftover: &[String], removal: ChainRemoval) -> Script {
    let mut s = Script::default();

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
        s.cmd(1, format_args!("{verb} chain {FAMILY} {TABLE} {name}"));
        s.removed_chains.push(name.to_owned());
    }
    // Last: the rules using them are gone (deleted, flushed or rewritten).
    // With the set go the clients its endpoint kept.
    for name in before.sets.keys().filter(|name| !after.sets.contains_key(*name)) {
        s.cmd(1, format_args!("delete set {FAMILY} {TABLE} {name}"));
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
