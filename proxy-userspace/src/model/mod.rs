//! The desired state every data-plane mode programs: Service ports and their
//! endpoints, already filtered and resolved (targetPort -> number).
//!
//! `service` and `endpoint` turn API objects into plain facts, `desired`
//! keeps those facts per object and joins them into [`ServicePort`]s.

mod desired;
pub mod endpoint;
mod endpoint_sets;
mod join;
mod no_local;
pub mod service;
pub mod topology;

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

pub use desired::{Cluster, Desired, ObjectKey, object_key};
pub use endpoint_sets::{EndpointSets, usable_endpoints};
pub use no_local::NoLocalEndpoints;

/// An object (or a part of one) that was skipped, and why. Logged and counted
/// by whoever feeds the model; the rest of the state is programmed as usual.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub object: String,
    pub reason: String,
}

impl Problem {
    pub fn new(object: &str, reason: impl Into<String>) -> Self {
        Self {
            object: object.to_owned(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

impl Protocol {
    /// The protocol a Service or EndpointSlice port names (`spec.ports[].protocol`,
    /// the API's spelling), or `None` for one the API does not define.
    pub fn from_api(name: &str) -> Option<Self> {
        match name {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// The protocol of a lowercase name ([`Self::lowercase`]), as rules and
    /// set entries read back spell it.
    pub fn from_lowercase(name: &str) -> Option<Self> {
        [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
            .into_iter()
            .find(|p| p.lowercase() == name)
    }

    /// The protocol of an IP protocol number ([`Self::number`]).
    pub fn from_number(number: u8) -> Option<Self> {
        [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
            .into_iter()
            .find(|p| p.number() == number)
    }

    /// The lowercase name, as kube-proxy spells it in chain-name hashes and
    /// iptables, nft and ipset spell it in rules and set entries.
    pub fn lowercase(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::proto::TCP,
            Protocol::Udp => proxy_common::proto::UDP,
            Protocol::Sctp => proxy_common::proto::SCTP,
        }
    }
}

/// An address family. A dual-stack Service is two sets of ports, one per
/// family, each with its ClusterIP, its addresses and its endpoints of that
/// family (kube-proxy runs one proxier per family the same way).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    #[default]
    V4,
    V6,
}

impl IpFamily {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    /// As the API spells it (`ipFamilies`, EndpointSlice `addressType`).
    pub fn name(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
    }

    /// The longest prefix of an address of the family.
    pub fn bits(self) -> u8 {
        match self {
            Self::V4 => 32,
            Self::V6 => 128,
        }
    }
}

/// The IPv4 address `ip` is; `None` for an IPv6 one (for code that
/// handles IPv4 only: the reconciler hands a mode only the families it
/// serves, see `Dataplane::families`).
pub fn ipv4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(_) => None,
    }
}

/// The IPv6 address `ip` is, if it is one.
pub fn ipv6(ip: IpAddr) -> Option<std::net::Ipv6Addr> {
    match ip {
        IpAddr::V6(ip) => Some(ip),
        IpAddr::V4(_) => None,
    }
}

/// The last byte of `ip` (tests name their pods by it).
#[cfg(test)]
pub fn last_octet(ip: IpAddr) -> u8 {
    match ip {
        IpAddr::V4(ip) => ip.octets()[3],
        IpAddr::V6(ip) => ip.octets()[15],
    }
}

/// Which endpoints a kind of traffic may reach (`spec.externalTrafficPolicy`,
/// `spec.internalTrafficPolicy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TrafficPolicy {
    /// Every usable endpoint, wherever it runs.
    #[default]
    Cluster,
    /// Only endpoints on this node (their `nodeName` is the agent's node
    /// name); none there means the traffic is dropped.
    Local,
}

/// How a new flow picks its endpoint among a Service port's (the ebpf
/// mode's; the other modes balance as their kernel tables do).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum LbAlgorithm {
    /// Uniformly at random, as kube-proxy's modes do.
    #[default]
    Random,
    /// Maglev consistent hashing of the flow's 5-tuple: every node picks
    /// the same endpoint for a flow, and an endpoint change moves few flows.
    Maglev,
}

/// Appended to the name of an IPv6 port (see [`ServicePort::name`]).
pub const IPV6_SUFFIX: &str = " (IPv6)";

/// The annotation a Service selects its algorithm with (`random` or
/// `maglev`), over the agent's `--lb-algorithm`.
pub const LB_ALGORITHM_ANNOTATION: &str = "xproxy.io/lb-algorithm";

impl LbAlgorithm {
    /// The algorithm named `text` (`random`, `maglev`; any case).
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "random" => Some(Self::Random),
            "maglev" => Some(Self::Maglev),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Maglev => "maglev",
        }
    }
}

/// One port of one Service, with the endpoints that serve it.
///
/// `Default` is an empty TCP port on 0.0.0.0 with both policies `Cluster`,
/// for building ports field by field (`..ServicePort::default()`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// `namespace/name:portname`, as kube-proxy names it in logs and
    /// comments; an IPv6 port's name has [`IPV6_SUFFIX`] appended, so the
    /// two families of a dual-stack Service are two names in the desired
    /// state.
    pub name: String,
    pub protocol: Protocol,
    /// The ClusterIP of the port's family; every other address of the port
    /// and its endpoints are of the same family.
    pub cluster_ip: IpAddr,
    pub port: u16,
    /// Set for NodePort (and LoadBalancer) Services.
    pub node_port: Option<u16>,
    pub endpoints: Vec<Endpoint>,
    /// Where traffic to the node port goes; always `Cluster` without a node
    /// port (kube-proxy ignores the field for Services nothing outside
    /// reaches).
    pub external_policy: TrafficPolicy,
    /// Where traffic to the ClusterIP goes.
    pub internal_policy: TrafficPolicy,
    /// `spec.externalIPs`: addresses that answer on the Service's port like
    /// the ClusterIP, for traffic from anywhere (external traffic: the
    /// external policy applies, as to node ports).
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`, without the entries whose
    /// `ipMode` is `Proxy` (the load balancer itself proxies those, so the
    /// node must not short-circuit them). External traffic, like
    /// `external_ips`.
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`: only clients inside these networks
    /// may reach `load_balancer_ips` (empty: every client). Node ports,
    /// external IPs and the ClusterIP are not filtered.
    pub source_ranges: Vec<SourceRange>,
    /// `sessionAffinity: ClientIP`: a client keeps its endpoint until it
    /// has been idle this long (`None`: every new flow is balanced anew).
    pub affinity: Option<std::time::Duration>,
    /// `spec.healthCheckNodePort`: where this node answers a load
    /// balancer's health check for the Service (set by the API server for
    /// LoadBalancer Services with `externalTrafficPolicy: Local`).
    pub health_check_node_port: Option<u16>,
    /// This node's zone (its Node's `topology.kubernetes.io/zone` label)
    /// as of the join, for the endpoints' zone hints
    /// ([`EndpointSets`]). `None` when the zone is unknown or no endpoint
    /// of the port carries hints: a zone change then leaves the port as
    /// it is.
    pub node_zone: Option<Arc<str>>,
    /// The Service's [`LB_ALGORITHM_ANNOTATION`]; `None` without one (the
    /// agent's default applies).
    pub lb_algorithm: Option<LbAlgorithm>,
}

/// One entry of `loadBalancerSourceRanges`: a network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRange {
    /// The network address, host bits zero.
    pub addr: IpAddr,
    pub prefix_len: u8,
}

impl SourceRange {
    /// The network of `addr` with `prefix_len` bits (host bits cleared);
    /// `None` if the prefix is longer than the family's addresses.
    pub fn new(addr: IpAddr, prefix_len: u8) -> Option<Self> {
        let host_bits = IpFamily::of(addr).bits().checked_sub(prefix_len)?;
        let addr = match addr {
            IpAddr::V4(a) => IpAddr::V4((u32::from(a) & u32::MAX.checked_shl(host_bits.into()).unwrap_or(0)).into()),
            IpAddr::V6(a) => IpAddr::V6((u128::from(a) & u128::MAX.checked_shl(host_bits.into()).unwrap_or(0)).into()),
        };
        Some(Self { addr, prefix_len })
    }

    /// Whether `ip` is inside the network (never for the other family).
    pub fn contains(&self, ip: IpAddr) -> bool {
        Self::new(ip, self.prefix_len).is_some_and(|net| net.addr == self.addr)
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of(self.addr)
    }
}

impl fmt::Display for SourceRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

impl Default for ServicePort {
    fn default() -> Self {
        Self {
            name: String::new(),
            protocol: Protocol::Tcp,
            cluster_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            port: 0,
            node_port: None,
            endpoints: Vec::new(),
            external_policy: TrafficPolicy::Cluster,
            internal_policy: TrafficPolicy::Cluster,
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            source_ranges: Vec::new(),
            affinity: None,
            health_check_node_port: None,
            node_zone: None,
            lb_algorithm: None,
        }
    }
}

impl ServicePort {
    /// Whether traffic can reach the port from outside the cluster: through
    /// a node port, an external IP or a load balancer IP (kube-proxy's
    /// `ExternallyAccessible`).
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }

    /// Whether external traffic (to the node port, external IPs and load
    /// balancer IPs) goes to this node's endpoints only.
    pub fn external_local(&self) -> bool {
        self.externally_accessible() && self.external_policy == TrafficPolicy::Local
    }

    /// The addresses besides the ClusterIP that answer on `port`: the
    /// external IPs, then the load balancer IPs, each once.
    pub fn external_addresses(&self) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = Vec::new();
        for ip in self.external_ips.iter().chain(&self.load_balancer_ips) {
            if !out.contains(ip) {
                out.push(*ip);
            }
        }
        out
    }

    /// The family of every address of the port.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(self.cluster_ip)
    }

    /// Whether ClusterIP traffic goes to this node's endpoints only.
    pub fn internal_local(&self) -> bool {
        self.internal_policy == TrafficPolicy::Local
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    pub addr: IpAddr,
    /// The resolved targetPort.
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Shared, not owned: each endpoint is copied into the joined ports and
    /// into each mode's bookkeeping, 100,000 of them at 10,000 Services.
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    /// The EndpointSlice's topology hints (`hints.forZones`,
    /// `hints.forNodes`): where the slice controller wants the endpoint
    /// used (`trafficDistribution: PreferClose` / `PreferSameNode`, or the
    /// topology-aware-hints annotation). `None` without hints.
    pub hints: Option<Arc<Hints>>,
}

/// An endpoint's topology hints, as the EndpointSlice names them.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Hints {
    /// `hints.forZones[].name`: zones whose nodes should use the endpoint.
    pub zones: Vec<Arc<str>>,
    /// `hints.forNodes[].name`: nodes that should use the endpoint.
    pub nodes: Vec<Arc<str>>,
}

impl Endpoint {
    /// Whether the endpoint runs on node `node` (kube-proxy's `IsLocal`:
    /// its `nodeName` is the node's name; one without a `nodeName`, or
    /// with no node name known, is on no node).
    pub fn is_on(&self, node: Option<&str>) -> bool {
        node.is_some() && self.node_name.as_deref() == node
    }

    /// A ready endpoint on no particular node (what tests and manifests without
    /// conditions mean).
    pub fn ready(addr: impl Into<IpAddr>, port: u16) -> Self {
        Self {
            addr: addr.into(),
            port,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
            hints: None,
        }
    }
}
