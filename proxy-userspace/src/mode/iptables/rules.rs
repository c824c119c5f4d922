//! Rendering: service ports -> `iptables-restore` input, with kube-proxy's
//! chain structure and rule text.
//!
//! ```text
//! nat    PREROUTING, OUTPUT -> KUBE-SERVICES
//!          per port: -d CLUSTER_IP --dport PORT -> KUBE-SVC-x
//!                    -d EXTERNAL_IP --dport PORT -> KUBE-EXT-x
//!                    -d LB_IP --dport PORT -> KUBE-EXT-x (KUBE-FW-x with source ranges)
//!          last:     -m addrtype --dst-type LOCAL -> KUBE-NODEPORTS
//!        KUBE-NODEPORTS: --dport NODE_PORT -> KUBE-EXT-x
//!        KUBE-FW-x: -s RANGE -> KUBE-EXT-x, ...; the rest falls through
//!        KUBE-EXT-x: -> KUBE-MARK-MASQ, -> KUBE-SVC-x
//!        KUBE-SVC-x: off-cluster source -> KUBE-MARK-MASQ;
//!                    (ClientIP affinity: -m recent --rcheck -> KUBE-SEP-a, ...)
//!                    -m statistic --probability 1/n -> KUBE-SEP-a, ... -> KUBE-SEP-z
//!        KUBE-SEP-a: -s ENDPOINT (hairpin) -> KUBE-MARK-MASQ;
//!                    (-m recent --set) DNAT --to-destination ENDPOINT
//!        POSTROUTING -> KUBE-POSTROUTING: marked -> clear the mark, MASQUERADE
//! filter INPUT, FORWARD, OUTPUT -> KUBE-SERVICES / KUBE-EXTERNAL-SERVICES:
//!          REJECT for ports without endpoints; FORWARD -> KUBE-FORWARD;
//!          KUBE-PROXY-FIREWALL: DROP to LB_IP --dport PORT (what KUBE-FW-x
//!          did not send on: it is still addressed to the LB IP);
//!          KUBE-NODEPORTS: ACCEPT the health check node port
//! ```
//!
//! The `Local` traffic policies, as kube-proxy lays them out:
//!
//! ```text
//! internalTrafficPolicy: Local   KUBE-SERVICES: -d CLUSTER_IP --dport PORT -> KUBE-SVL-x
//!                                (the off-cluster masquerade rule moves there too)
//! externalTrafficPolicy: Local   KUBE-EXT-x: from a local pod -> KUBE-SVC-x
//!                                            --src-type LOCAL -> KUBE-MARK-MASQ
//!                                            --src-type LOCAL -> KUBE-SVC-x
//!                                            -> KUBE-SVL-x (no masquerade)
//! KUBE-SVL-x: like KUBE-SVC-x, over this node's endpoints only
//! no local endpoint (but some elsewhere): no jump to KUBE-SVL-x; filter
//!   KUBE-SERVICES / KUBE-EXTERNAL-SERVICES DROP "... has no local endpoints"
//! ```
//!
//! The input is laid out like kube-proxy's: per table the chain lines
//! (`:CHAIN - [0:0]` creates or flushes a chain), then jump rules into the
//! built-in chains that are missing, then the rules, then `-X` for chains to
//! delete. Ports are written in name order, so the same state always gives
//! the same text.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt::Write as _,
    net::IpAddr,
};

use super::chains::{self, PortChains, endpoint_string, sep_chain};
use crate::{
    mode::options::LocalTraffic,
    model::{Endpoint, EndpointSets, IpFamily, ServicePort},
    sys::iptables::is_saved_jump,
};

/// The match for "not from a local pod".
fn if_not_local(local: &LocalTraffic) -> String {
    format!("! {}", if_local(local))
}

/// The match for "from a local pod".
fn if_local(local: &LocalTraffic) -> String {
    match local {
        LocalTraffic::Cidr(cidr) => format!("-s {}/{}", cidr.addr(), cidr.prefix_len()),
        LocalTraffic::Bridge(name) => format!("-i {name}"),
        LocalTraffic::InterfacePrefix(prefix) => format!("-i {prefix}+"),
    }
}

/// Which local addresses NodePorts answer on (kube-proxy's `nodePortAddresses`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortDestinations {
    /// Every local address (`-m addrtype --dst-type LOCAL`); 127.0.0.0/8
    /// too if `localhost` (which needs `route_localnet=1`).
    AllLocal { localhost: bool },
    /// Only these addresses (of the rules' family).
    Addresses(Vec<IpAddr>),
}

impl NodePortDestinations {
    /// Whether NodePorts answer on 127.0.0.0/8: then the martian guard
    /// (`KUBE-FIREWALL`) is installed too.
    pub fn localhost(&self) -> bool {
        match self {
            NodePortDestinations::AllLocal { localhost } => *localhost,
            NodePortDestinations::Addresses(ips) => ips.iter().any(IpAddr::is_loopback),
        }
    }
}

/// Everything besides the service ports that shapes the rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleOptions {
    /// The fwmark bit that asks for masquerade (kube-proxy's default 14).
    pub masquerade_bit: u8,
    /// Masquerade all ClusterIP traffic, not only off-cluster traffic.
    pub masquerade_all: bool,
    /// `None`: local traffic cannot be told apart, so only NodePort and
    /// hairpin traffic is masqueraded (unless `masquerade_all`).
    pub local_traffic: Option<LocalTraffic>,
    pub node_ports: NodePortDestinations,
    /// Drop forwarded packets conntrack finds INVALID (kube-proxy does
    /// unless `nf_conntrack_tcp_be_liberal` is set).
    pub drop_invalid: bool,
    /// This node's name: endpoints naming it are the ones the `Local`
    /// traffic policies reach. `None`: no endpoint is local.
    pub node_name: Option<String>,
    /// The family of the ports, addresses and tools (`iptables` or
    /// `ip6tables`) these rules are for: kube-proxy runs one proxier per
    /// family with the same chain layout.
    pub family: IpFamily,
    /// This node's addresses of `family`, as far as known: when a
    /// `loadBalancerSourceRanges` entry holds one, the node's own traffic
    /// to the load balancer IPs (which may come back with a load balancer
    /// IP as its source) is let through too, as kube-proxy does.
    pub node_ips: Vec<IpAddr>,
}

impl Default for RuleOptions {
    /// kube-proxy's defaults.
    fn default() -> Self {
        Self {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: None,
            node_ports: NodePortDestinations::AllLocal { localhost: true },
            drop_invalid: true,
            node_name: None,
            node_ips: Vec::new(),
            family: IpFamily::V4,
        }
    }
}

impl RuleOptions {
    /// The mark, as iptables prints it (`0x4000` for bit 14).
    pub fn mark(&self) -> String {
        format!("{:#x}", 1u32 << self.masquerade_bit)
    }

    /// Whether NodePorts answer on 127.0.0.0/8 (with `route_localnet` and
    /// the martian guard `KUBE-FIREWALL`). Never for IPv6: the kernel
    /// has no `route_localnet` there, so `::1` cannot be DNATed away
    /// (kube-proxy leaves it out too).
    pub fn localhost_node_ports(&self) -> bool {
        self.family == IpFamily::V4 && self.node_ports.localhost()
    }
}

/// A rule in a built-in chain that sends packets into one of ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Jump {
    pub table: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    /// Matches before the comment (`-m conntrack --ctstate NEW`), may be "".
    pub matches: &'static str,
    /// May be "" (no comment).
    pub comment: &'static str,
}

impl Jump {
    /// The rule's specification, after `-A CHAIN` / `-I CHAIN`.
    pub fn spec(&self) -> String {
        let mut spec = String::new();
        if !self.matches.is_empty() {
            spec.push_str(self.matches);
            spec.push(' ');
        }
        if !self.comment.is_empty() {
            let _ = write!(spec, "-m comment --comment {} ", quote(self.comment));
        }
        let _ = write!(spec, "-j {}", self.to);
        spec
    }

    /// Whether the saved rule `-A FROM ...` is this jump (as iptables-save
    /// prints it: same chain, target and comment).
    pub fn matches_saved(&self, saved: &str) -> bool {
        is_saved_jump(saved, self.from, self.to, self.comment)
    }
}

const CTSTATE_NEW: &str = "-m conntrack --ctstate NEW";

/// kube-proxy's jumps (`iptablesJumpChains`), in its order: each is
/// inserted at the top of its chain, so the last one ends up first.
const JUMPS: [Jump; 12] = [
    Jump {
        table: "filter",
        from: "INPUT",
        to: chains::EXTERNAL_SERVICES,
        matches: CTSTATE_NEW,
        comment: "kubernetes externally-visible service portals",
    },
    Jump {
        table: "filter",
        from: "FORWARD",
        to: chains::EXTERNAL_SERVICES,
        matches: CTSTATE_NEW,
        comment: "kubernetes externally-visible service portals",
    },
    Jump {
        table: "filter",
        from: "INPUT",
        to: chains::NODE_PORTS,
        matches: "",
        comment: "kubernetes health check service ports",
    },
    Jump {
        table: "filter",
        from: "FORWARD",
        to: chains::SERVICES,
        matches: CTSTATE_NEW,
        comment: "kubernetes service portals",
    },
    Jump {
        table: "filter",
        from: "OUTPUT",
        to: chains::SERVICES,
        matches: CTSTATE_NEW,
        comment: "kubernetes service portals",
    },
    Jump {
        table: "filter",
        from: "FORWARD",
        to: chains::FORWARD,
        matches: "",
        comment: "kubernetes forwarding rules",
    },
    Jump {
        table: "filter",
        from: "INPUT",
        to: chains::PROXY_FIREWALL,
        matches: CTSTATE_NEW,
        comment: "kubernetes load balancer firewall",
    },
    Jump {
        table: "filter",
        from: "OUTPUT",
        to: chains::PROXY_FIREWALL,
        matches: CTSTATE_NEW,
        comment: "kubernetes load balancer firewall",
    },
    Jump {
        table: "filter",
        from: "FORWARD",
        to: chains::PROXY_FIREWALL,
        matches: CTSTATE_NEW,
        comment: "kubernetes load balancer firewall",
    },
    Jump {
        table: "nat",
        from: "OUTPUT",
        to: chains::SERVICES,
        matches: "",
        comment: "kubernetes service portals",
    },
    Jump {
        table: "nat",
        from: "PREROUTING",
        to: chains::SERVICES,
        matches: "",
        comment: "kubernetes service portals",
    },
    Jump {
        table: "nat",
        from: "POSTROUTING",
        to: chains::POSTROUTING,
        matches: "",
        comment: "kubernetes postrouting rules",
    },
];

/// The martian guard's jumps (kubelet's copy has no comment either).
const FIREWALL_JUMPS: [Jump; 2] = [
    Jump {
        table: "filter",
        from: "INPUT",
        to: chains::FIREWALL,
        matches: "",
        comment: "",
    },
    Jump {
        table: "filter",
        from: "OUTPUT",
        to: chains::FIREWALL,
        matches: "",
        comment: "",
    },
];

/// The jumps these options need.
pub fn jumps(opts: &RuleOptions) -> Vec<Jump> {
    let mut all = JUMPS.to_vec();
    if opts.localhost_node_ports() {
        all.extend(FIREWALL_JUMPS);
    }
    all
}

/// Which per-service chains to write.
#[derive(Clone, Copy, Debug)]
pub enum Rewrite<'a> {
    /// Every port's (a full sync).
    All,
    /// Only these ports' (a partial sync); the top-level chains are always
    /// written whole.
    Only(&'a BTreeSet<String>),
}

impl Rewrite<'_> {
    fn includes(&self, name: &str) -> bool {
        match self {
            Rewrite::All => true,
            Rewrite::Only(names) => names.contains(name),
        }
    }
}

/// One sync's input to `iptables-restore`.
pub struct SyncInput<'a> {
    /// The whole state after the sync.
    pub ports: &'a BTreeMap<String, ServicePort>,
    pub rewrite: Rewrite<'a>,
    /// nat chains to flush and delete.
    pub delete: &'a BTreeSet<String>,
    /// Jump rules to insert (those not found in the kernel).
    pub jumps: &'a [Jump],
}

/// The rendered input and how many rules it writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// Rules written (`-A`, `-I`) plus chains deleted (`-X`).
    pub writes: u64,
}

/// The nat chains one port needs (for stale-chain bookkeeping).
pub fn port_chains(opts: &RuleOptions, port: &ServicePort) -> BTreeSet<String> {
    let sets = EndpointSets::of(port, opts.node_name.as_deref());
    let mut out = BTreeSet::new();
    if !sets.has_any() {
        return out;
    }
    let names = PortChains::of(port);
    if sets.uses_cluster() {
        out.insert(names.svc);
    }
    if sets.uses_local() {
        out.insert(names.svl);
    }
    if port.externally_accessible() {
        out.insert(names.ext);
    }
    if uses_firewall(port) {
        out.insert(names.fw);
    }
    for ep in sets.reachable() {
        out.insert(sep_chain(&port.name, port.protocol, &endpoint_string(ep)));
    }
    out
}

/// Whether load balancer traffic of `port` passes a `KUBE-FW-` chain: it
/// has load balancer IPs and source ranges (kube-proxy; the caller checks
/// that the port has endpoints).
fn uses_firewall(port: &ServicePort) -> bool {
    !port.load_balancer_ips.is_empty() && !port.source_ranges.is_empty()
}

/// What of `port` these rules cannot do as kube-proxy would, as (field,
/// how it is handled instead): only that without a known node address
/// the node's own traffic to source-ranged load balancer IPs cannot be
/// let through (kube-proxy lets it through when a range holds the node IP).
pub fn unhonoured(opts: &RuleOptions, port: &ServicePort) -> Option<(&'static str, &'static str)> {
    (uses_firewall(port) && opts.node_ips.is_empty()).then_some((
        "spec.loadBalancerSourceRanges",
        "no node IP is known (--node-ip): the node's own traffic to the load balancer IPs \
         is filtered by the source ranges like any client's",
    ))
}

/// The lines of one table: rules are grouped by chain, in the order the
/// chains were declared.
#[derive(Default)]
struct Table {
    order: Vec<String>,
    rules: HashMap<String, Vec<String>>,
    jumps: Vec<String>,
    deletes: Vec<String>,
}

impl Table {
    fn chain(&mut self, name: &str) {
        self.order.push(name.to_owned());
        self.rules.entry(name.to_owned()).or_default();
    }

    fn rule(&mut self, chain: &str, spec: impl AsRef<str>) {
        self.rules
            .entry(chain.to_owned())
            .or_default()
            .push(format!("-A {chain} {}", spec.as_ref()));
    }

    fn write(self, name: &str, out: &mut String) -> u64 {
        let _ = writeln!(out, "*{name}");
        for chain in &self.order {
            let _ = writeln!(out, ":{chain} - [0:0]");
        }
        let mut writes = self.jumps.len() + self.deletes.len();
        let rules = self.order.iter().filter_map(|chain| self.rules.get(chain)).flatten();
        for line in self.jumps.iter().chain(rules).chain(&self.deletes) {
            out.push_str(line);
            out.push('\n');
        }
        writes += self
            .order
            .iter()
            .filter_map(|chain| self.rules.get(chain))
            .map(Vec::len)
            .sum::<usize>();
        out.push_str("COMMIT\n");
        writes as u64
    }
}

/// A comment argument: quoted when it has spaces, like kube-proxy writes it.
fn quote(comment: &str) -> String {
    if comment.contains(' ') {
        format!("\"{comment}\"")
    } else {
        comment.to_owned()
    }
}

/// kube-proxy's `1/n` with ten decimals.
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

pub fn render(opts: &RuleOptions, input: &SyncInput<'_>) -> Rendered {
    let mark = opts.mark();
    let mut filter = Table::default();
    let mut nat = Table::default();
    for chain in [
        chains::NODE_PORTS,
        chains::SERVICES,
        chains::EXTERNAL_SERVICES,
        chains::FORWARD,
        chains::PROXY_FIREWALL,
    ] {
        filter.chain(chain);
    }
    if opts.localhost_node_ports() {
        filter.chain(chains::FIREWALL);
    }
    for chain in [
        chains::SERVICES,
        chains::NODE_PORTS,
        chains::POSTROUTING,
        chains::MARK_MASQ,
    ] {
        nat.chain(chain);
    }
    for jump in input.jumps {
        let table = if jump.table == "nat" { &mut nat } else { &mut filter };
        table.jumps.push(format!("-I {} {}", jump.from, jump.spec()));
    }

    nat.rule(chains::POSTROUTING, format!("-m mark ! --mark {mark}/{mark} -j RETURN"));
    // Cleared so that a packet that comes round again is not masqueraded twice.
    nat.rule(chains::POSTROUTING, format!("-j MARK --xor-mark {mark}"));
    nat.rule(
        chains::POSTROUTING,
        "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
    );
    nat.rule(chains::MARK_MASQ, format!("-j MARK --or-mark {mark}"));
    if opts.localhost_node_ports() {
        filter.rule(
            chains::FIREWALL,
            "-m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 \
             -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
        );
    }

    for port in input.ports.values() {
        render_port(opts, port, input.rewrite.includes(&port.name), &mut filter, &mut nat);
    }

    let nodeports_comment =
        "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    match &opts.node_ports {
        NodePortDestinations::AllLocal { localhost } => {
            let not_localhost = match opts.family {
                IpFamily::V6 => " ! -d ::1/128",
                IpFamily::V4 if *localhost => "",
                IpFamily::V4 => " ! -d 127.0.0.0/8",
            };
            nat.rule(
                chains::SERVICES,
                format!(
                    "{nodeports_comment} -m addrtype --dst-type LOCAL{not_localhost} -j {}",
                    chains::NODE_PORTS
                ),
            );
        }
        NodePortDestinations::Addresses(ips) => {
            for ip in ips {
                nat.rule(
                    chains::SERVICES,
                    format!("{nodeports_comment} -d {ip} -j {}", chains::NODE_PORTS),
                );
            }
        }
    }

    if opts.drop_invalid {
        filter.rule(chains::FORWARD, "-m conntrack --ctstate INVALID -j DROP");
    }
    filter.rule(
        chains::FORWARD,
        format!("-m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"),
    );
    filter.rule(
        chains::FORWARD,
        "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    );

    for chain in input.delete {
        nat.chain(chain);
        nat.deletes.push(format!("-X {chain}"));
    }

    let mut text = String::new();
    let mut writes = filter.write("filter", &mut text);
    writes += nat.write("nat", &mut text);
    Rendered { text, writes }
}

/// One port's rules: always its entries in the top-level chains, and its
/// own chains if `own_chains`. Laid out like kube-proxy's for both traffic
/// policies: ClusterIP traffic enters the internal policy's chain
/// (`KUBE-SVC` or `KUBE-SVL`); external traffic (node port, external IPs,
/// load balancer IPs, the latter through `KUBE-FW` with source ranges)
/// enters `KUBE-EXT`, which for the `Local` policy masquerades and
/// short-circuits only the node's (and its pods') own traffic before it
/// enters `KUBE-SVL`.
fn render_port(opts: &RuleOptions, port: &ServicePort, own_chains: bool, filter: &mut Table, nat: &mut Table) {
    let sets = EndpointSets::of(port, opts.node_name.as_deref());
    let names = PortChains::of(port);
    let entries = Entries::new(port, &names, &sets);
    entries.cluster_ip(filter, nat);
    entries.external_ips(filter, nat);
    entries.load_balancer_ips(filter, nat);
    entries.node_port(filter, nat);
    entries.health_check_node_port(filter);
    if own_chains && sets.has_any() {
        own_chains_of(opts, port, &names, &sets, nat);
    }
}

/// A port's entries in the top-level chains: where each of its addresses
/// leads in nat, and what filter drops or rejects when it leads nowhere.
struct Entries<'a> {
    port: &'a ServicePort,
    names: &'a PortChains,
    proto: &'static str,
    has_any: bool,
    has_internal: bool,
    has_external: bool,
    /// What filter does to traffic without an endpoint: REJECT if the port
    /// has none at all, DROP if only its traffic policy leaves it none
    /// (kube-proxy), with the comment saying which.
    no_endpoint: (&'static str, String),
}

impl<'a> Entries<'a> {
    fn new(port: &'a ServicePort, names: &'a PortChains, sets: &EndpointSets<'_>) -> Self {
        let has_any = sets.has_any();
        let no_endpoint = if has_any {
            ("DROP", quote(&format!("{} has no local endpoints", port.name)))
        } else {
            ("REJECT", quote(&format!("{} has no endpoints", port.name)))
        };
        Self {
            port,
            names,
            proto: port.protocol.lowercase(),
            has_any,
            has_internal: !sets.internal().is_empty(),
            has_external: !sets.external().is_empty(),
            no_endpoint,
        }
    }

    /// `-m tcp -p tcp -d IP --dport PORT`, kube-proxy's match for one of
    /// the port's addresses.
    fn to(&self, ip: IpAddr) -> String {
        format!("-m {0} -p {0} -d {ip} --dport {1}", self.proto, self.port.port)
    }

    fn refuse(&self, filter: &mut Table, chain: &str, matches: &str) {
        let (target, comment) = &self.no_endpoint;
        filter.rule(chain, format!("-m comment --comment {comment} {matches} -j {target}"));
    }

    fn cluster_ip(&self, filter: &mut Table, nat: &mut Table) {
        let to = self.to(self.port.cluster_ip);
        if self.has_internal {
            let comment = quote(&format!("{} cluster IP", self.port.name));
            let chain = if self.port.internal_local() {
                &self.names.svl
            } else {
                &self.names.svc
            };
            nat.rule(
                chains::SERVICES,
                format!("-m comment --comment {comment} {to} -j {chain}"),
            );
        } else {
            self.refuse(filter, chains::SERVICES, &to);
        }
    }

    /// External IPs take external traffic from every source, as kube-proxy.
    fn external_ips(&self, filter: &mut Table, nat: &mut Table) {
        let comment = quote(&format!("{} external IP", self.port.name));
        for ip in &self.port.external_ips {
            let to = self.to(*ip);
            if self.has_any {
                nat.rule(
                    chains::SERVICES,
                    format!("-m comment --comment {comment} {to} -j {}", self.names.ext),
                );
            }
            if !self.has_external {
                self.refuse(filter, chains::EXTERNAL_SERVICES, &to);
            }
        }
    }

    /// Load balancer IPs: to `KUBE-EXT`, or through `KUBE-FW` when source
    /// ranges restrict them; what `KUBE-FW` lets through without a DNAT is
    /// dropped in filter `KUBE-PROXY-FIREWALL`.
    fn load_balancer_ips(&self, filter: &mut Table, nat: &mut Table) {
        let firewall = self.has_any && uses_firewall(self.port);
        let chain = if firewall { &self.names.fw } else { &self.names.ext };
        let name = &self.port.name;
        let comment = quote(&format!("{name} loadbalancer IP"));
        let not_accepted = quote(&format!("{name} traffic not accepted by {}", self.names.fw));
        for ip in &self.port.load_balancer_ips {
            let to = self.to(*ip);
            if self.has_any {
                nat.rule(
                    chains::SERVICES,
                    format!("-m comment --comment {comment} {to} -j {chain}"),
                );
            }
            if firewall {
                filter.rule(
                    chains::PROXY_FIREWALL,
                    format!("-m comment --comment {not_accepted} {to} -j DROP"),
                );
            }
        }
        if !self.has_external {
            for ip in &self.port.load_balancer_ips {
                self.refuse(filter, chains::EXTERNAL_SERVICES, &self.to(*ip));
            }
        }
    }

    /// Node ports are not filtered by source ranges (kube-proxy: "for
    /// better or for worse").
    fn node_port(&self, filter: &mut Table, nat: &mut Table) {
        let Some(node_port) = self.port.node_port else {
            return;
        };
        let proto = self.proto;
        if self.has_any {
            nat.rule(
                chains::NODE_PORTS,
                format!(
                    "-m comment --comment {} -m {proto} -p {proto} --dport {node_port} -j {}",
                    quote(&self.port.name),
                    self.names.ext
                ),
            );
        }
        if !self.has_external {
            self.refuse(
                filter,
                chains::EXTERNAL_SERVICES,
                &format!("-m addrtype --dst-type LOCAL -m {proto} -p {proto} --dport {node_port}"),
            );
        }
    }

    /// The health check node port is accepted whether or not the node has
    /// endpoints (the answer says which); the server is the agent's.
    fn health_check_node_port(&self, filter: &mut Table) {
        let Some(port) = self.port.health_check_node_port else {
            return;
        };
        filter.rule(
            chains::NODE_PORTS,
            format!(
                "-m comment --comment {} -m tcp -p tcp --dport {port} -j ACCEPT",
                quote(&format!("{} health check node port", self.port.name))
            ),
        );
    }
}

/// The port's own chains (it has endpoints): policy chains, `KUBE-EXT`,
/// `KUBE-FW` and one `KUBE-SEP` per endpoint some traffic reaches.
fn own_chains_of(opts: &RuleOptions, port: &ServicePort, names: &PortChains, sets: &EndpointSets<'_>, nat: &mut Table) {
    if sets.uses_cluster() {
        nat.chain(&names.svc);
    }
    if sets.uses_local() {
        nat.chain(&names.svl);
    }
    let internal_chain = if port.internal_local() { &names.svl } else { &names.svc };
    if !sets.internal().is_empty() {
        let cluster_ip_match = format!(
            "-m comment --comment {} -m {proto} -p {proto} -d {} --dport {}",
            quote(&format!("{} cluster IP", port.name)),
            port.cluster_ip,
            port.port,
            proto = port.protocol.lowercase(),
        );
        if opts.masquerade_all {
            nat.rule(internal_chain, format!("{cluster_ip_match} -j {}", chains::MARK_MASQ));
        } else if let Some(local) = &opts.local_traffic {
            // Off-cluster traffic to a ClusterIP (a route to the service range
            // via this node) may leave the node again: masquerade it.
            nat.rule(
                internal_chain,
                format!("{cluster_ip_match} {} -j {}", if_not_local(local), chains::MARK_MASQ),
            );
        }
    }
    if port.externally_accessible() {
        nat.chain(&names.ext);
        external_rules(opts, port, names, !sets.external().is_empty(), nat);
    }
    if uses_firewall(port) {
        nat.chain(&names.fw);
        firewall_rules(opts, port, names, nat);
    }
    if sets.uses_cluster() {
        dispatch(nat, &names.svc, port, &sets.cluster);
    }
    if sets.uses_local() {
        dispatch(nat, &names.svl, port, &sets.local);
    }
    for ep in sets.reachable() {
        endpoint_rules(port, ep, nat);
    }
}

/// `KUBE-SEP-x`: masquerade hairpin traffic, remember the client for
/// affinity, DNAT.
fn endpoint_rules(port: &ServicePort, ep: &Endpoint, nat: &mut Table) {
    let proto = port.protocol.lowercase();
    let comment = quote(&port.name);
    let sep = sep_chain(&port.name, port.protocol, &endpoint_string(ep));
    nat.chain(&sep);
    // A pod reaching itself through its Service: masquerade, or the
    // reply would bypass the DNAT.
    nat.rule(
        &sep,
        format!("-m comment --comment {comment} -s {} -j {}", ep.addr, chains::MARK_MASQ),
    );
    // The client's last use of this endpoint, checked by the policy
    // chains' `--rcheck` rules (the list is named after this chain).
    let remember = if port.affinity.is_some() {
        format!(" -m recent --name {sep} --set")
    } else {
        String::new()
    };
    nat.rule(
        &sep,
        format!(
            "-m comment --comment {comment}{remember} -m {proto} -p {proto} -j DNAT --to-destination {}",
            endpoint_string(ep)
        ),
    );
}

/// `KUBE-FW-x`: load balancer traffic from the allowed source ranges (and
/// from the load balancer IPs themselves when a range holds a node
/// address: the node's own traffic to a load balancer IP configured on
/// it comes back with that IP as its source) goes on to `KUBE-EXT-x`;
/// the rest leaves the chain without a DNAT and is dropped in filter
/// `KUBE-PROXY-FIREWALL`.
fn firewall_rules(opts: &RuleOptions, port: &ServicePort, names: &PortChains, nat: &mut Table) {
    let fw = &names.fw;
    let comment = quote(&format!("{} loadbalancer IP", port.name));
    for range in &port.source_ranges {
        nat.rule(
            fw,
            format!("-m comment --comment {comment} -s {range} -j {}", names.ext),
        );
    }
    let allow_from_node = port
        .source_ranges
        .iter()
        .any(|range| opts.node_ips.iter().any(|ip| range.contains(*ip)));
    if allow_from_node {
        for ip in &port.load_balancer_ips {
            nat.rule(fw, format!("-m comment --comment {comment} -s {ip} -j {}", names.ext));
        }
    }
    nat.rule(
        fw,
        format!(
            "-m comment --comment {}",
            quote(&format!(
                "other traffic to {} will be dropped by {}",
                port.name,
                chains::PROXY_FIREWALL
            ))
        ),
    );
}

/// `KUBE-EXT-x`: with the `Cluster` policy every node-port flow may cross
/// to another node, so all are masqueraded; with `Local` the client's
/// source is kept, except for traffic from this node's pods (to every
/// endpoint, as if it had gone out to a load balancer and come back) and
/// from the node itself (masqueraded: its source is a node address).
fn external_rules(opts: &RuleOptions, port: &ServicePort, names: &PortChains, has_external: bool, nat: &mut Table) {
    let name = &port.name;
    let ext = &names.ext;
    if !port.external_local() {
        nat.rule(
            ext,
            format!(
                "-m comment --comment {} -j {}",
                quote(&format!("masquerade traffic for {name} external destinations")),
                chains::MARK_MASQ
            ),
        );
        nat.rule(ext, format!("-j {}", names.svc));
        return;
    }
    if let Some(local) = &opts.local_traffic {
        nat.rule(
            ext,
            format!(
                "-m comment --comment {} {} -j {}",
                quote(&format!("pod traffic for {name} external destinations")),
                if_local(local),
                names.svc
            ),
        );
    }
    nat.rule(
        ext,
        format!(
            "-m comment --comment {} -m addrtype --src-type LOCAL -j {}",
            quote(&format!("masquerade LOCAL traffic for {name} external destinations")),
            chains::MARK_MASQ
        ),
    );
    nat.rule(
        ext,
        format!(
            "-m comment --comment {} -m addrtype --src-type LOCAL -j {}",
            quote(&format!("route LOCAL traffic for {name} external destinations")),
            names.svc
        ),
    );
    if has_external {
        nat.rule(ext, format!("-j {}", names.svl));
    }
}

/// The rules of a policy chain (`KUBE-SVC` / `KUBE-SVL`): with ClientIP
/// affinity first one rule per endpoint that sends a client seen there
/// within the timeout back to it (`--reap` forgets older entries); then
/// each rule takes 1/(remaining) of what reaches it to an endpoint's
/// chain, the last takes all.
fn dispatch(nat: &mut Table, chain: &str, port: &ServicePort, endpoints: &[&Endpoint]) {
    let n = endpoints.len();
    let seps: Vec<(String, String)> = endpoints
        .iter()
        .map(|ep| {
            let endpoint = endpoint_string(ep);
            let comment = quote(&format!("{} -> {endpoint}", port.name));
            (sep_chain(&port.name, port.protocol, &endpoint), comment)
        })
        .collect();
    if let Some(timeout) = port.affinity {
        let seconds = timeout.as_secs();
        for (sep, comment) in &seps {
            nat.rule(
                chain,
                format!(
                    "-m comment --comment {comment} -m recent --name {sep} --rcheck --seconds {seconds} --reap -j {sep}"
                ),
            );
        }
    }
    for (i, (sep, comment)) in seps.iter().enumerate() {
        let statistic = if i + 1 < n {
            format!(" -m statistic --mode random --probability {}", probability(n - i))
        } else {
            String::new()
        };
        nat.rule(chain, format!("-m comment --comment {comment}{statistic} -j {sep}"));
    }
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv4Addr, path::PathBuf};

    use super::*;
    use crate::{
        mode::fixtures::{self, policy_port},
        model::{Endpoint, Protocol, SourceRange},
    };

    fn seed_port() -> ServicePort {
        fixtures::seed_port(
            (11..=13)
                .map(|i| Endpoint::ready(Ipv4Addr::new(10, 244, 0, i), 80))
                .collect(),
        )
    }

    fn state(ports: &[ServicePort]) -> BTreeMap<String, ServicePort> {
        ports.iter().map(|p| (p.name.clone(), p.clone())).collect()
    }

    fn full(opts: &RuleOptions, ports: &BTreeMap<String, ServicePort>) -> Rendered {
        let jumps = jumps(opts);
        render(
            opts,
            &SyncInput {
                ports,
                rewrite: Rewrite::All,
                delete: &BTreeSet::new(),
                jumps: &jumps,
            },
        )
    }

    fn golden(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden/iptables")
            .join(name)
    }

    /// Compares with a golden file; `XPROXY_UPDATE_GOLDEN=1` rewrites it.
    fn assert_golden(name: &str, actual: &str) {
        let path = golden(name);
        if std::env::var("XPROXY_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
            std::fs::write(&path, actual).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            return;
        }
        let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        if expected != actual {
            panic!(
                "{} differs (XPROXY_UPDATE_GOLDEN=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}",
                path.display()
            );
        }
    }

    /// The seed Service with kube-proxy's default options and a pod CIDR.
    #[test]
    fn seed_service_golden() {
        let opts = RuleOptions {
            local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
            ..RuleOptions::default()
        };
        let mut empty = seed_port();
        empty.name = "default/empty-service".into();
        empty.cluster_ip = Ipv4Addr::new(10, 96, 0, 89).into();
        empty.port = 89;
        empty.node_port = Some(30792);
        empty.endpoints.clear();
        let rendered = full(&opts, &state(&[seed_port(), empty]));
        assert_golden("seed.rules", &rendered.text);
        // 12 jumps + 3 POSTROUTING + 1 MARK-MASQ + 1 KUBE-FIREWALL + 3 KUBE-FORWARD
        // + 2 REJECT + 2 KUBE-SERVICES + 1 KUBE-NODEPORTS
        // + SVC (masq + 3) + EXT 2 + SEP 3 x 2
        assert_eq!(rendered.writes, 14 + 3 + 1 + 1 + 3 + 2 + 2 + 1 + 4 + 2 + 6);
    }

    /// SCTP as kube-proxy writes it: `-m sctp -p sctp` wherever TCP has
    /// `-m tcp -p tcp`, in chains of their own (the protocol is in the
    /// chain-name hash), so a TCP and an SCTP port of one name coexist.
    #[test]
    fn sctp_ports_match_sctp() {
        let sctp = ServicePort {
            protocol: Protocol::Sctp,
            ..seed_port()
        };
        let text = full(&RuleOptions::default(), &state(std::slice::from_ref(&sctp))).text;
        let svc = chains::svc_chain(&sctp.name, Protocol::Sctp);
        assert_ne!(svc, chains::svc_chain(&sctp.name, Protocol::Tcp));
        for line in [
            format!(
                "-A KUBE-SERVICES -m comment --comment \"default/nginx-service cluster IP\" -m sctp -p sctp -d 10.96.0.88 --dport 88 -j {svc}"
            ),
            "-m comment --comment default/nginx-service -m sctp -p sctp -j DNAT --to-destination 10.244.0.11:80"
                .to_owned(),
        ] {
            assert!(text.lines().any(|l| l.ends_with(&line)), "missing {line} in\n{text}");
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("-A KUBE-NODEPORTS") && l.contains("-m sctp -p sctp --dport 30791 -j")),
            "{text}"
        );
        assert!(
            !text.contains("-p tcp --dport 88") && !text.contains("-p udp"),
            "{text}"
        );
    }

    #[test]
    fn probabilities_like_kube_proxy() {
        assert_eq!(probability(2), "0.5000000000");
        assert_eq!(probability(3), "0.3333333333");
        assert_eq!(probability(7), "0.1428571429");
        let mut port = seed_port();
        port.endpoints = (1..=4)
            .map(|i| Endpoint::ready(Ipv4Addr::new(10, 244, 1, i), 8080))
            .collect();
        let text = full(&RuleOptions::default(), &state(&[port])).text;
        let probs: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split("--probability ").nth(1))
            .map(|rest| rest.split(' ').next().unwrap_or(""))
            .collect();
        assert_eq!(probs, ["0.2500000000", "0.3333333333", "0.5000000000"]);
    }

    #[test]
    fn masquerade_options() {
        let ports = state(&[seed_port()]);
        let svc = PortChains::of(&seed_port()).svc;
        let masq_lines = |opts: &RuleOptions| -> Vec<String> {
            full(opts, &ports)
                .text
                .lines()
                .filter(|l| l.starts_with(&format!("-A {svc} ")) && l.ends_with("-j KUBE-MARK-MASQ"))
                .map(str::to_owned)
                .collect()
        };
        assert!(masq_lines(&RuleOptions::default()).is_empty());
        let all = masq_lines(&RuleOptions {
            masquerade_all: true,
            ..RuleOptions::default()
        });
        assert_eq!(all.len(), 1);
        assert!(!all[0].contains("! -s"), "{}", all[0]);
        let bridge = masq_lines(&RuleOptions {
            local_traffic: Some(LocalTraffic::Bridge("cbr0".into())),
            ..RuleOptions::default()
        });
        assert!(
            bridge[0].contains("--dport 88 ! -i cbr0 -j KUBE-MARK-MASQ"),
            "{bridge:?}"
        );
        let prefix = masq_lines(&RuleOptions {
            local_traffic: Some(LocalTraffic::InterfacePrefix("veth".into())),
            ..RuleOptions::default()
        });
        assert!(prefix[0].contains("! -i veth+"), "{prefix:?}");

        let bit0 = full(
            &RuleOptions {
                masquerade_bit: 0,
                ..RuleOptions::default()
            },
            &ports,
        )
        .text;
        assert!(bit0.contains("-A KUBE-MARK-MASQ -j MARK --or-mark 0x1\n"), "{bit0}");
        assert!(bit0.contains("-m mark ! --mark 0x1/0x1 -j RETURN"), "{bit0}");
    }

    #[test]
    fn node_port_destinations() {
        let ports = state(&[seed_port()]);
        let last_rules = |node_ports: NodePortDestinations| -> Vec<String> {
            let opts = RuleOptions {
                node_ports,
                ..RuleOptions::default()
            };
            full(&opts, &ports)
                .text
                .lines()
                .filter(|l| l.starts_with("-A KUBE-SERVICES") && l.ends_with("-j KUBE-NODEPORTS"))
                .map(str::to_owned)
                .collect()
        };
        let no_lo = last_rules(NodePortDestinations::AllLocal { localhost: false });
        assert_eq!(no_lo.len(), 1);
        assert!(no_lo[0].contains("--dst-type LOCAL ! -d 127.0.0.0/8 -j"), "{no_lo:?}");
        let ips = last_rules(NodePortDestinations::Addresses(vec![
            Ipv4Addr::new(172, 30, 0, 2).into(),
            Ipv4Addr::new(192, 168, 1, 2).into(),
        ]));
        assert_eq!(ips.len(), 2);
        assert!(ips[0].contains("-d 172.30.0.2 -j KUBE-NODEPORTS"), "{ips:?}");
        // Without localhost NodePorts there is no martian guard.
        let opts = RuleOptions {
            node_ports: NodePortDestinations::AllLocal { localhost: false },
            ..RuleOptions::default()
        };
        assert!(!full(&opts, &ports).text.contains("KUBE-FIREWALL"));
        assert!(!jumps(&opts).iter().any(|j| j.to == chains::FIREWALL));
    }

    #[test]
    fn draining_endpoints_serve_only_when_none_is_ready() {
        let mut port = seed_port();
        for ep in &mut port.endpoints {
            ep.ready = false;
            ep.terminating = true;
        }
        port.endpoints[2].serving = false;
        let chains = port_chains(&RuleOptions::default(), &port);
        // SVC, EXT and the two serving endpoints.
        assert_eq!(chains.len(), 4, "{chains:?}");
        port.endpoints[0].ready = true;
        assert_eq!(port_chains(&RuleOptions::default(), &port).len(), 3);
        port.endpoints.clear();
        assert!(port_chains(&RuleOptions::default(), &port).is_empty());
    }

    #[test]
    fn partial_render_writes_only_changed_ports_chains() {
        let a = seed_port();
        let mut b = seed_port();
        b.name = "default/other".into();
        b.cluster_ip = Ipv4Addr::new(10, 96, 0, 90).into();
        b.node_port = None;
        let ports = state(&[a.clone(), b.clone()]);
        let only: BTreeSet<String> = [b.name.clone()].into();
        let delete: BTreeSet<String> = ["KUBE-SEP-OLD".to_owned()].into();
        let rendered = render(
            &RuleOptions::default(),
            &SyncInput {
                ports: &ports,
                rewrite: Rewrite::Only(&only),
                delete: &delete,
                jumps: &[],
            },
        );
        let a_chains = port_chains(&RuleOptions::default(), &a);
        for chain in &a_chains {
            assert!(
                !rendered.text.contains(&format!(":{chain} ")),
                "{chain} declared:\n{}",
                rendered.text
            );
            assert!(
                !rendered.text.contains(&format!("-A {chain} ")),
                "{chain} written:\n{}",
                rendered.text
            );
        }
        // a stays reachable: its KUBE-SERVICES and KUBE-NODEPORTS entries are rewritten.
        let a_svc = PortChains::of(&a);
        assert!(rendered.text.contains(&format!("-j {}\n", a_svc.svc)));
        assert!(rendered.text.contains(&format!("-j {}\n", a_svc.ext)));
        for chain in port_chains(&RuleOptions::default(), &b) {
            assert!(rendered.text.contains(&format!(":{chain} - [0:0]")), "{chain}");
        }
        assert!(rendered.text.contains(":KUBE-SEP-OLD - [0:0]\n"));
        assert!(
            rendered.text.ends_with("-X KUBE-SEP-OLD\nCOMMIT\n"),
            "{}",
            rendered.text
        );
        assert!(!rendered.text.contains("-I "), "no jumps in a partial sync");
    }

    fn node_a_options() -> RuleOptions {
        RuleOptions {
            local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
            node_name: Some("node-a".into()),
            ..RuleOptions::default()
        }
    }

    /// The rules of `chain` in `text`, without the `-A CHAIN ` prefix.
    fn rules_of<'a>(text: &'a str, chain: &str) -> Vec<&'a str> {
        let prefix = format!("-A {chain} ");
        text.lines().filter_map(|l| l.strip_prefix(prefix.as_str())).collect()
    }

    fn declared(text: &str, chain: &str) -> bool {
        text.contains(&format!(":{chain} - [0:0]\n"))
    }

    /// externalTrafficPolicy: Local with endpoints on both nodes, on
    /// node-a: KUBE-EXT keeps the client's address for outside traffic and
    /// sends it to KUBE-SVL (node-a's endpoint); pod and node traffic go
    /// to KUBE-SVC (every endpoint), the node's masqueraded.
    #[test]
    fn external_local_policy_like_kube_proxy() {
        let mut port = policy_port("web", 1, Some(30884), &[(11, "node-a"), (11, "node-b")]);
        port.external_policy = crate::model::TrafficPolicy::Local;
        let text = full(&node_a_options(), &state(&[port.clone()])).text;
        let names = PortChains::of(&port);
        assert_eq!(
            rules_of(&text, &names.ext),
            [
                format!(
                    "-m comment --comment \"pod traffic for default/web external destinations\" -s 10.244.0.0/16 -j {}",
                    names.svc
                ),
                "-m comment --comment \"masquerade LOCAL traffic for default/web external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ".to_owned(),
                format!(
                    "-m comment --comment \"route LOCAL traffic for default/web external destinations\" -m addrtype --src-type LOCAL -j {}",
                    names.svc
                ),
                format!("-j {}", names.svl),
            ],
            "{text}"
        );
        let local_sep = sep_chain(&port.name, port.protocol, "10.244.1.11:8080");
        let remote_sep = sep_chain(&port.name, port.protocol, "10.244.2.11:8080");
        assert_eq!(
            rules_of(&text, &names.svl),
            [format!(
                "-m comment --comment \"default/web -> 10.244.1.11:8080\" -j {local_sep}"
            )],
            "KUBE-SVL holds node-a's endpoint only:\n{text}"
        );
        let svc = rules_of(&text, &names.svc);
        assert_eq!(svc.len(), 3, "masquerade rule and both endpoints: {svc:#?}");
        assert!(svc[0].ends_with("! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"), "{svc:#?}");
        assert!(svc[1].contains("--probability 0.5000000000") && svc[1].ends_with(&local_sep));
        assert!(svc[2].ends_with(&remote_sep));
        assert!(declared(&text, &local_sep) && declared(&text, &remote_sep));
        // ClusterIP traffic is not affected by the external policy.
        assert!(
            rules_of(&text, chains::SERVICES)
                .iter()
                .any(|r| r.ends_with(&format!("-j {}", names.svc)))
        );
        assert!(!text.contains("has no local endpoints"), "{text}");
        assert_eq!(
            port_chains(&node_a_options(), &port),
            [names.svc, names.svl, names.ext, local_sep, remote_sep]
                .into_iter()
                .collect()
        );
    }

    /// On a node without a local endpoint: no KUBE-SVL; KUBE-EXT still
    /// short-circuits pod and node traffic, everything else falls through
    /// and is dropped (not rejected) in filter KUBE-EXTERNAL-SERVICES.
    #[test]
    fn external_local_policy_without_local_endpoints_drops() {
        let mut port = policy_port("web", 1, Some(30884), &[(11, "node-b"), (12, "node-b")]);
        port.external_policy = crate::model::TrafficPolicy::Local;
        let text = full(&node_a_options(), &state(&[port.clone()])).text;
        let names = PortChains::of(&port);
        assert!(!declared(&text, &names.svl), "{text}");
        let ext = rules_of(&text, &names.ext);
        assert_eq!(ext.len(), 3, "{ext:#?}");
        assert!(ext.iter().all(|r| !r.contains("KUBE-SVL")), "{ext:#?}");
        assert!(
            rules_of(&text, chains::NODE_PORTS)
                .iter()
                .any(|r| r.ends_with(&format!("--dport 30884 -j {}", names.ext))),
            "{text}"
        );
        assert_eq!(
            rules_of(&text, chains::EXTERNAL_SERVICES),
            [
                "-m comment --comment \"default/web has no local endpoints\" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30884 -j DROP"
            ],
            "{text}"
        );
        // The ClusterIP still reaches both endpoints.
        assert!(!rules_of(&text, chains::SERVICES).iter().any(|r| r.contains("DROP")));
        assert_eq!(
            rules_of(&text, &names.svc).len(),
            3,
            "masquerade rule and 2 endpoints:\n{text}"
        );
    }

    /// internalTrafficPolicy: Local: ClusterIP traffic enters KUBE-SVL
    /// (with the off-cluster masquerade rule); no KUBE-SVC without a node
    /// port; with no local endpoint the ClusterIP is dropped.
    #[test]
    fn internal_local_policy_like_kube_proxy() {
        let mut here = policy_port("itp", 2, None, &[(21, "node-a"), (21, "node-b")]);
        here.internal_policy = crate::model::TrafficPolicy::Local;
        let mut elsewhere = policy_port("itp-elsewhere", 3, None, &[(22, "node-b")]);
        elsewhere.internal_policy = crate::model::TrafficPolicy::Local;
        let text = full(&node_a_options(), &state(&[here.clone(), elsewhere.clone()])).text;
        let names = PortChains::of(&here);
        assert!(
            rules_of(&text, chains::SERVICES).contains(
                &format!(
                    "-m comment --comment \"default/itp cluster IP\" -m tcp -p tcp -d 10.96.1.2 --dport 80 -j {}",
                    names.svl
                )
                .as_str()
            ),
            "{text}"
        );
        assert!(!declared(&text, &names.svc), "{text}");
        let svl = rules_of(&text, &names.svl);
        assert_eq!(svl.len(), 2, "{svl:#?}");
        assert!(svl[0].ends_with("! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"));
        assert!(svl[1].contains("10.244.1.21:8080"));
        assert!(
            !text.contains("10.244.2.21"),
            "node-b's endpoint is unreachable from node-a:\n{text}"
        );
        let other = PortChains::of(&elsewhere);
        assert!(!declared(&text, &other.svl) && !declared(&text, &other.svc), "{text}");
        assert!(
            text.contains(
                "-A KUBE-SERVICES -m comment --comment \"default/itp-elsewhere has no local endpoints\" -m tcp -p tcp -d 10.96.1.3 --dport 80 -j DROP\n"
            ),
            "{text}"
        );
        assert!(port_chains(&node_a_options(), &elsewhere).is_empty());
    }

    /// A Service without any endpoint is rejected whatever its policies;
    /// without a node name no endpoint is local.
    #[test]
    fn local_policies_reject_services_without_endpoints_and_need_a_node_name() {
        let mut empty = policy_port("empty", 4, Some(30886), &[]);
        empty.external_policy = crate::model::TrafficPolicy::Local;
        empty.internal_policy = crate::model::TrafficPolicy::Local;
        let text = full(&node_a_options(), &state(&[empty])).text;
        assert_eq!(text.matches("has no endpoints\"").count(), 2, "{text}");
        assert!(!text.contains("no local endpoints"), "{text}");

        let mut port = policy_port("web", 1, Some(30884), &[(11, "node-a")]);
        port.external_policy = crate::model::TrafficPolicy::Local;
        let nameless = RuleOptions {
            node_name: None,
            ..node_a_options()
        };
        let text = full(&nameless, &state(&[port.clone()])).text;
        assert!(!declared(&text, &PortChains::of(&port).svl), "{text}");
        assert!(text.contains("default/web has no local endpoints"), "{text}");
    }

    /// The Service API fields together on node-a: a LoadBalancer Service
    /// with external IPs, load balancer IPs behind source ranges (one of
    /// which holds the node's address), ClientIP affinity, the `Local`
    /// external policy and a health check node port.
    fn api_port() -> ServicePort {
        let mut port = policy_port("lb", 5, Some(30885), &[(31, "node-a"), (32, "node-b")]);
        port.external_policy = crate::model::TrafficPolicy::Local;
        port.external_ips = vec![Ipv4Addr::new(198, 51, 100, 7).into()];
        port.load_balancer_ips = vec![
            Ipv4Addr::new(203, 0, 113, 5).into(),
            Ipv4Addr::new(203, 0, 113, 6).into(),
        ];
        port.source_ranges = vec![
            SourceRange {
                addr: Ipv4Addr::new(192, 0, 2, 0).into(),
                prefix_len: 24,
            },
            SourceRange {
                addr: Ipv4Addr::new(172, 30, 0, 0).into(),
                prefix_len: 16,
            },
        ];
        port.affinity = Some(std::time::Duration::from_secs(600));
        port.health_check_node_port = Some(32005);
        port
    }

    fn api_options() -> RuleOptions {
        RuleOptions {
            node_ips: vec![Ipv4Addr::new(172, 30, 0, 2).into()],
            ..node_a_options()
        }
    }

    #[test]
    fn service_api_golden() {
        let rendered = full(&api_options(), &state(&[api_port()]));
        assert_golden("service-api.rules", &rendered.text);
    }

    /// External IPs and load balancer IPs lead to KUBE-EXT like the node
    /// port; with source ranges the LB IPs pass KUBE-FW first, whose
    /// leftovers filter KUBE-PROXY-FIREWALL drops; the node's own traffic
    /// (source = an LB IP) is let through because a range holds the node IP.
    #[test]
    fn external_and_load_balancer_ips_like_kube_proxy() {
        let port = api_port();
        let text = full(&api_options(), &state(std::slice::from_ref(&port))).text;
        let names = PortChains::of(&port);
        let services = rules_of(&text, chains::SERVICES);
        assert!(
            services.contains(
                &format!(
                    "-m comment --comment \"default/lb external IP\" -m tcp -p tcp -d 198.51.100.7 --dport 80 -j {}",
                    names.ext
                )
                .as_str()
            ),
            "{text}"
        );
        for lb in ["203.0.113.5", "203.0.113.6"] {
            assert!(
                services.contains(
                    &format!(
                        "-m comment --comment \"default/lb loadbalancer IP\" -m tcp -p tcp -d {lb} --dport 80 -j {}",
                        names.fw
                    )
                    .as_str()
                ),
                "{text}"
            );
            assert!(
                rules_of(&text, chains::PROXY_FIREWALL).contains(
                    &format!(
                        "-m comment --comment \"default/lb traffic not accepted by {}\" -m tcp -p tcp -d {lb} --dport 80 -j DROP",
                        names.fw
                    )
                    .as_str()
                ),
                "{text}"
            );
        }
        let ext = &names.ext;
        assert_eq!(
            rules_of(&text, &names.fw),
            [
                format!("-m comment --comment \"default/lb loadbalancer IP\" -s 192.0.2.0/24 -j {ext}"),
                format!("-m comment --comment \"default/lb loadbalancer IP\" -s 172.30.0.0/16 -j {ext}"),
                format!("-m comment --comment \"default/lb loadbalancer IP\" -s 203.0.113.5 -j {ext}"),
                format!("-m comment --comment \"default/lb loadbalancer IP\" -s 203.0.113.6 -j {ext}"),
                "-m comment --comment \"other traffic to default/lb will be dropped by KUBE-PROXY-FIREWALL\""
                    .to_owned(),
            ],
            "{text}"
        );
        // eTP Local: KUBE-EXT short-circuits pods and the node, then KUBE-SVL.
        let ext_rules = rules_of(&text, ext);
        assert_eq!(ext_rules.len(), 4, "{ext_rules:#?}");
        assert_eq!(ext_rules[3], format!("-j {}", names.svl));
        assert!(
            rules_of(&text, chains::NODE_PORTS)
                .iter()
                .any(|r| r.ends_with(&format!("--dport 30885 -j {ext}"))),
            "node ports are not filtered by source ranges:\n{text}"
        );
        assert!(
            text.contains(
                "-A KUBE-NODEPORTS -m comment --comment \"default/lb health check node port\" -m tcp -p tcp --dport 32005 -j ACCEPT\n"
            ),
            "{text}"
        );
        assert!(port_chains(&api_options(), &port).contains(&names.fw));

        // Without a range holding a node address, LB IPs as sources are not allowed.
        let text = full(&node_a_options(), &state(std::slice::from_ref(&port))).text;
        assert_eq!(rules_of(&text, &names.fw).len(), 3, "{text}");
        // Without source ranges: no KUBE-FW, the LB IPs go to KUBE-EXT.
        let mut open = port.clone();
        open.source_ranges.clear();
        let text = full(&api_options(), &state(&[open.clone()])).text;
        assert!(!declared(&text, &names.fw), "{text}");
        assert!(rules_of(&text, chains::PROXY_FIREWALL).is_empty(), "{text}");
        assert!(
            text.contains(&format!("-d 203.0.113.5 --dport 80 -j {ext}\n")),
            "{text}"
        );
        assert!(!port_chains(&api_options(), &open).contains(&names.fw));
    }

    /// Without a local endpoint the external addresses drop what KUBE-EXT
    /// did not short-circuit; without any endpoint they reject, and no nat
    /// rule leads anywhere.
    #[test]
    fn external_addresses_without_endpoints_drop_or_reject() {
        let mut remote = api_port();
        remote.endpoints.retain(|e| e.is_on(Some("node-b")));
        let text = full(&api_options(), &state(&[remote])).text;
        let external = rules_of(&text, chains::EXTERNAL_SERVICES);
        for addr in ["198.51.100.7", "203.0.113.5", "203.0.113.6"] {
            assert!(
                external.contains(
                    &format!("-m comment --comment \"default/lb has no local endpoints\" -m tcp -p tcp -d {addr} --dport 80 -j DROP")
                        .as_str()
                ),
                "{text}"
            );
        }
        assert_eq!(external.len(), 4, "3 addresses and the node port: {external:#?}");

        let mut empty = api_port();
        empty.endpoints.clear();
        let text = full(&api_options(), &state(&[empty.clone()])).text;
        let external = rules_of(&text, chains::EXTERNAL_SERVICES);
        assert_eq!(external.len(), 4, "{external:#?}");
        assert!(external.iter().all(|r| r.ends_with("-j REJECT")), "{external:#?}");
        assert!(rules_of(&text, chains::PROXY_FIREWALL).is_empty(), "{text}");
        assert!(!text.contains("KUBE-FW-") && !text.contains("KUBE-EXT-"), "{text}");
        assert!(port_chains(&api_options(), &empty).is_empty());
    }

    /// ClientIP affinity: `--rcheck` per endpoint before the random
    /// choice in every policy chain, `--set` in the endpoint chains; off
    /// again, no `recent` match is left.
    #[test]
    fn affinity_like_kube_proxy() {
        let port = api_port();
        let text = full(&api_options(), &state(std::slice::from_ref(&port))).text;
        let names = PortChains::of(&port);
        let local = sep_chain(&port.name, port.protocol, "10.244.1.31:8080");
        let remote = sep_chain(&port.name, port.protocol, "10.244.2.32:8080");
        let svc = rules_of(&text, &names.svc);
        assert!(svc[0].ends_with("-j KUBE-MARK-MASQ"), "{svc:#?}");
        assert_eq!(
            &svc[1..3],
            [
                format!(
                    "-m comment --comment \"default/lb -> 10.244.1.31:8080\" -m recent --name {local} --rcheck --seconds 600 --reap -j {local}"
                ),
                format!(
                    "-m comment --comment \"default/lb -> 10.244.2.32:8080\" -m recent --name {remote} --rcheck --seconds 600 --reap -j {remote}"
                ),
            ],
            "{text}"
        );
        assert!(svc[3].contains("--probability 0.5000000000"), "{svc:#?}");
        assert_eq!(
            rules_of(&text, &names.svl),
            [
                format!(
                    "-m comment --comment \"default/lb -> 10.244.1.31:8080\" -m recent --name {local} --rcheck --seconds 600 --reap -j {local}"
                ),
                format!("-m comment --comment \"default/lb -> 10.244.1.31:8080\" -j {local}"),
            ],
            "{text}"
        );
        assert_eq!(
            rules_of(&text, &remote)[1],
            format!(
                "-m comment --comment default/lb -m recent --name {remote} --set -m tcp -p tcp -j DNAT --to-destination 10.244.2.32:8080"
            )
        );
        let mut off = port;
        off.affinity = None;
        let text = full(&api_options(), &state(&[off])).text;
        assert!(!text.contains("-m recent"), "{text}");
    }
}
