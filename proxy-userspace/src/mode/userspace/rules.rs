//! The iptables rules of the userspace mode, in the chains kube-proxy's
//! userspace mode used: they only steer a Service's traffic to the port
//! the agent listens on for it; the agent itself picks the endpoint.
//!
//! ```text
//! nat    PREROUTING -> KUBE-PORTALS-CONTAINER   -d CLUSTER_IP --dport PORT -> REDIRECT --to-ports P
//!        PREROUTING -> KUBE-NODEPORT-CONTAINER  (local destination) --dport NODE_PORT -> REDIRECT --to-ports P
//!        OUTPUT     -> KUBE-PORTALS-HOST        -d CLUSTER_IP --dport PORT -> DNAT 127.0.0.1:P
//!        OUTPUT     -> KUBE-NODEPORT-HOST       (local destination) --dport NODE_PORT -> DNAT 127.0.0.1:P
//! filter INPUT, FORWARD, OUTPUT -> KUBE-PORTALS-REJECT: REJECT for ports without endpoints
//! ```
//!
//! Why these targets: REDIRECT in PREROUTING rewrites the destination to
//! the primary address of the interface the packet came in on (the pod-side
//! veth address, the node IP on the uplink), where the listener, bound to
//! 0.0.0.0, accepts it; a DNAT to 127.0.0.1 there would be a martian
//! (dropped unless `route_localnet=1`). The node's own packets (OUTPUT) are
//! DNATed to 127.0.0.1: they never leave `lo`, so neither the node IP nor
//! `route_localnet` is needed, and the same rule serves a process reaching
//! a ClusterIP, `NODE_IP:nodePort` and `127.0.0.1:nodePort` (verified in
//! `tests/tests/modes.rs`). kube-proxy DNATed to the node IP
//! there because its listener could be bound to one address; ours is not.
//!
//! kube-proxy's userspace mode accepted connections to a Service without
//! endpoints and closed them. Here such ports are rejected in the filter
//! table, like in the iptables mode, so every mode fails the same way:
//! TCP refused, UDP answered with ICMP port unreachable (EPERM at `send`
//! for the node's own UDP, as in the iptables mode).
//!
//! Rules are written as `iptables-save` prints them, so the text read back
//! is the text written.
//!
//! IPv6 service ports get the same chains through `ip6tables` ([`render`]
//! with [`IpFamily::V6`]): `/128` destinations, the node's own traffic
//! DNATed to `[::1]`, rejects with ICMPv6 port unreachable.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
};

use crate::{
    config::{Cidr, Config},
    mode::options::FamilyNodePorts,
    model::{IpFamily, ServicePort},
    sys::iptables::is_saved_jump,
};

/// nat, from PREROUTING: ClusterIP traffic from pods and from outside.
pub const CONTAINER_PORTALS: &str = "KUBE-PORTALS-CONTAINER";
/// nat, from OUTPUT: ClusterIP traffic of the node's own processes.
pub const HOST_PORTALS: &str = "KUBE-PORTALS-HOST";
/// nat, from PREROUTING: NodePort traffic arriving at the node.
pub const CONTAINER_NODE_PORTS: &str = "KUBE-NODEPORT-CONTAINER";
/// nat, from OUTPUT: NodePort traffic of the node's own processes.
pub const HOST_NODE_PORTS: &str = "KUBE-NODEPORT-HOST";
/// filter, from INPUT, FORWARD and OUTPUT: rejects ports without endpoints.
pub const REJECT: &str = "KUBE-PORTALS-REJECT";
/// filter: kube-proxy's userspace chain accepting NodePort traffic; never
/// written, but removed by cleanup with the others.
const NON_LOCAL_NODE_PORTS: &str = "KUBE-NODEPORT-NON-LOCAL";

pub const NAT_CHAINS: [&str; 4] = [CONTAINER_PORTALS, HOST_PORTALS, CONTAINER_NODE_PORTS, HOST_NODE_PORTS];
pub const FILTER_CHAINS: [&str; 1] = [REJECT];

/// Whether `chain` in `table` belongs to the userspace mode (or to
/// kube-proxy's, which used the same names).
pub fn is_ours(table: &str, chain: &str) -> bool {
    match table {
        "nat" => NAT_CHAINS.contains(&chain),
        "filter" => chain == REJECT || chain == NON_LOCAL_NODE_PORTS,
        _ => false,
    }
}

/// A rule in a built-in chain that sends packets into one of ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Jump {
    pub table: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    /// Matches before the comment; may be "".
    pub matches: &'static str,
    pub comment: &'static str,
    /// Appended (the NodePort jumps must come after the portal jumps and
    /// match broadly) instead of inserted at the top.
    pub append: bool,
}

impl Jump {
    /// The `iptables-restore` line adding this jump.
    fn line(&self) -> String {
        let mut line = format!("{} {} ", if self.append { "-A" } else { "-I" }, self.from);
        if !self.matches.is_empty() {
            line.push_str(self.matches);
            line.push(' ');
        }
        let _ = write!(line, "-m comment --comment {} -j {}", quote(self.comment), self.to);
        line
    }

    /// Whether the saved rule `-A ...` is this jump.
    pub fn matches_saved(&self, saved: &str) -> bool {
        is_saved_jump(saved, self.from, self.to, self.comment)
    }
}

const PORTALS_FIRST: &str = "handle ClusterIPs; NOTE: this must be before the NodePort rules";
const NODE_PORTS_LAST: &str = "handle service NodePorts; NOTE: this must be the last rule in the chain";
const LOCAL: &str = "-m addrtype --dst-type LOCAL";
const NEW: &str = "-m conntrack --ctstate NEW";
const WITHOUT_ENDPOINTS: &str = "kubernetes services without endpoints";

pub const JUMPS: [Jump; 7] = [
    Jump {
        table: "nat",
        from: "PREROUTING",
        to: CONTAINER_PORTALS,
        matches: "",
        comment: PORTALS_FIRST,
        append: false,
    },
    Jump {
        table: "nat",
        from: "OUTPUT",
        to: HOST_PORTALS,
        matches: "",
        comment: PORTALS_FIRST,
        append: false,
    },
    Jump {
        table: "nat",
        from: "PREROUTING",
        to: CONTAINER_NODE_PORTS,
        matches: LOCAL,
        comment: NODE_PORTS_LAST,
        append: true,
    },
    Jump {
        table: "nat",
        from: "OUTPUT",
        to: HOST_NODE_PORTS,
        matches: LOCAL,
        comment: NODE_PORTS_LAST,
        append: true,
    },
    Jump {
        table: "filter",
        from: "INPUT",
        to: REJECT,
        matches: NEW,
        comment: WITHOUT_ENDPOINTS,
        append: false,
    },
    Jump {
        table: "filter",
        from: "FORWARD",
        to: REJECT,
        matches: NEW,
        comment: WITHOUT_ENDPOINTS,
        append: false,
    },
    Jump {
        table: "filter",
        from: "OUTPUT",
        to: REJECT,
        matches: NEW,
        comment: WITHOUT_ENDPOINTS,
        append: false,
    },
];

/// Which local addresses NodePorts answer on (`nodePortAddresses`). The
/// jumps already require a local destination; this narrows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address; 127.0.0.0/8 (`::1`) too if `localhost` (the
    /// node's own processes only: nothing from outside reaches 127.0.0.1).
    AllLocal { localhost: bool },
    /// Local addresses inside these networks (none: NodePorts answer nowhere).
    Networks(Vec<Cidr>),
}

impl NodePortAddresses {
    /// Where the NodePorts of `family` answer under `config` (see
    /// [`FamilyNodePorts`]): node IPs become host networks. Unlike the
    /// iptables mode, IPv6 answers on `::1` too when localhost is asked
    /// for: these rules redirect to a local listener, nothing is DNATed.
    pub fn of_family(config: &Config, family: IpFamily) -> Self {
        match FamilyNodePorts::from_config(config, family) {
            FamilyNodePorts::AllLocal { localhost } => NodePortAddresses::AllLocal { localhost },
            FamilyNodePorts::NodeIps(ips) => NodePortAddresses::Networks(
                ips.into_iter()
                    .filter_map(|ip| Cidr::new(ip, IpFamily::of(ip).bits()))
                    .collect(),
            ),
            FamilyNodePorts::Cidrs(cidrs) => NodePortAddresses::Networks(cidrs),
        }
    }

    /// The destination matches (each followed by a space, or "") of the
    /// NodePort rules of `family`: one rule per entry.
    fn destinations(&self, from_host: bool, family: IpFamily) -> Vec<String> {
        match self {
            NodePortAddresses::AllLocal { localhost: false } if from_host => {
                vec![format!("! -d {} ", family.loopback())]
            }
            NodePortAddresses::AllLocal { .. } => vec![String::new()],
            NodePortAddresses::Networks(cidrs) => cidrs
                .iter()
                .filter(|c| c.is_ipv4() == (family == IpFamily::V4))
                .map(|c| format!("-d {}/{} ", c.addr(), c.prefix_len()))
                .collect(),
        }
    }
}

/// What the rules of a family spell differently.
trait FamilySpelling {
    /// The loopback network, as `iptables-save` prints it.
    fn loopback(self) -> &'static str;
    /// Where the node's own traffic is DNATed to: `ADDR:PORT`.
    fn local_listener(self, port: u16) -> String;
    fn reject_with(self) -> &'static str;
}

impl FamilySpelling for IpFamily {
    fn loopback(self) -> &'static str {
        match self {
            IpFamily::V4 => "127.0.0.0/8",
            IpFamily::V6 => "::1/128",
        }
    }

    fn local_listener(self, port: u16) -> String {
        match self {
            IpFamily::V4 => format!("{}:{port}", Ipv4Addr::LOCALHOST),
            IpFamily::V6 => format!("[{}]:{port}", Ipv6Addr::LOCALHOST),
        }
    }

    fn reject_with(self) -> &'static str {
        match self {
            IpFamily::V4 => "icmp-port-unreachable",
            IpFamily::V6 => "icmp6-port-unreachable",
        }
    }
}

/// Where a service port's traffic goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// To the agent's listener on this local port.
    Proxy(u16),
    /// Rejected: the port has no usable endpoint.
    Reject,
}

/// One service port and where its traffic goes.
#[derive(Clone, Copy, Debug)]
pub struct PortRules<'a> {
    pub service: &'a ServicePort,
    pub target: Target,
}

/// The rendered input and how many rules it writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// Rules and jumps written.
    pub writes: u64,
}

/// `iptables-restore --noflush` input that replaces our chains with the
/// rules for `ports` (in the given order) and adds `jumps`. `family`: the
/// ports', and the tool's (`ip6tables-restore` for IPv6).
pub fn render(family: IpFamily, node_ports: &NodePortAddresses, ports: &[PortRules<'_>], jumps: &[Jump]) -> Rendered {
    let mut nat: Vec<String> = Vec::new();
    let mut filter: Vec<String> = Vec::new();
    for chain in NAT_CHAINS {
        for port in ports {
            if let Target::Proxy(listener) = port.target {
                nat.extend(proxy_rules(chain, node_ports, port.service, listener, family));
            }
        }
    }
    for port in ports.iter().filter(|p| p.target == Target::Reject) {
        filter.extend(reject_rules(node_ports, port.service, family));
    }
    let mut text = String::new();
    let mut writes = 0;
    for (table, chains, rules) in [("nat", &NAT_CHAINS[..], nat), ("filter", &FILTER_CHAINS[..], filter)] {
        let _ = writeln!(text, "*{table}");
        for chain in chains {
            let _ = writeln!(text, ":{chain} - [0:0]");
        }
        for jump in jumps.iter().filter(|j| j.table == table) {
            let _ = writeln!(text, "{}", jump.line());
            writes += 1;
        }
        for rule in &rules {
            let _ = writeln!(text, "{rule}");
        }
        writes += rules.len() as u64;
        text.push_str("COMMIT\n");
    }
    Rendered { text, writes }
}

/// `service`'s rules in `chain` (one of [`NAT_CHAINS`]).
fn proxy_rules(
    chain: &str,
    node_ports: &NodePortAddresses,
    service: &ServicePort,
    listener: u16,
    family: IpFamily,
) -> Vec<String> {
    let proto = service.protocol.lowercase();
    let comment = quote(&service.name);
    let from_host = chain == HOST_PORTALS || chain == HOST_NODE_PORTS;
    let target = if from_host {
        format!("-j DNAT --to-destination {}", family.local_listener(listener))
    } else {
        format!("-j REDIRECT --to-ports {listener}")
    };
    if chain == CONTAINER_PORTALS || chain == HOST_PORTALS {
        return vec![format!(
            "-A {chain} -d {}/{} -p {proto} -m comment --comment {comment} -m {proto} --dport {} {target}",
            service.cluster_ip,
            family.bits(),
            service.port
        )];
    }
    let Some(node_port) = service.node_port else {
        return vec![];
    };
    node_ports
        .destinations(from_host, family)
        .into_iter()
        .map(|dst| {
            format!("-A {chain} {dst}-p {proto} -m comment --comment {comment} -m {proto} --dport {node_port} {target}")
        })
        .collect()
}

/// The REJECT rules of a port without endpoints.
fn reject_rules(node_ports: &NodePortAddresses, service: &ServicePort, family: IpFamily) -> Vec<String> {
    let proto = service.protocol.lowercase();
    let comment = quote(&format!("{} has no endpoints", service.name));
    let reject = format!("-j REJECT --reject-with {}", family.reject_with());
    let mut rules = vec![format!(
        "-A {REJECT} -d {}/{} -p {proto} -m comment --comment {comment} -m {proto} --dport {} {reject}",
        service.cluster_ip,
        family.bits(),
        service.port
    )];
    if let Some(node_port) = service.node_port {
        // The node's own traffic to 127.0.0.1 passes here too, so the
        // localhost setting counts as for the node's DNAT rules.
        for dst in node_ports.destinations(true, family) {
            rules.push(format!(
                "-A {REJECT} {dst}-p {proto} {LOCAL} -m comment --comment {comment} -m {proto} --dport {node_port} {reject}"
            ));
        }
    }
    rules
}

/// A comment argument as `iptables-save` prints it: bare only if it is
/// made of letters, digits, `_` and `-`.
fn quote(text: &str) -> String {
    let bare = !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare { text.to_owned() } else { format!("\"{text}\"") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        config,
        mode::fixtures::default_config,
        model::{Endpoint, Protocol},
    };

    fn port(name: &str, protocol: Protocol, last: u8, node_port: Option<u16>) -> ServicePort {
        ServicePort {
            name: name.into(),
            protocol,
            cluster_ip: Ipv4Addr::new(10, 96, 0, last).into(),
            port: u16::from(last),
            node_port,
            endpoints: vec![Endpoint::ready(Ipv4Addr::new(10, 244, 0, 11), 80)],
            ..ServicePort::default()
        }
    }

    /// The seed over TCP and UDP, and a Service without endpoints, as the
    /// first sync writes them.
    #[test]
    fn golden_seed_and_a_port_without_endpoints() {
        let seed_tcp = port("default/nginx-service:http", Protocol::Tcp, 88, Some(30791));
        let seed_udp = port("default/nginx-service:udp", Protocol::Udp, 88, Some(30791));
        let cluster_only = port("default/web", Protocol::Tcp, 80, None);
        let empty = port("default/empty-service:http", Protocol::Tcp, 89, Some(30792));
        let ports = [
            PortRules {
                service: &empty,
                target: Target::Reject,
            },
            PortRules {
                service: &seed_tcp,
                target: Target::Proxy(40001),
            },
            PortRules {
                service: &seed_udp,
                target: Target::Proxy(40002),
            },
            PortRules {
                service: &cluster_only,
                target: Target::Proxy(40003),
            },
        ];
        let rendered = render(
            IpFamily::V4,
            &NodePortAddresses::AllLocal { localhost: true },
            &ports,
            &JUMPS,
        );
        let golden = "\
*nat
:KUBE-PORTALS-CONTAINER - [0:0]
:KUBE-PORTALS-HOST - [0:0]
:KUBE-NODEPORT-CONTAINER - [0:0]
:KUBE-NODEPORT-HOST - [0:0]
-I PREROUTING -m comment --comment \"handle ClusterIPs; NOTE: this must be before the NodePort rules\" -j KUBE-PORTALS-CONTAINER
-I OUTPUT -m comment --comment \"handle ClusterIPs; NOTE: this must be before the NodePort rules\" -j KUBE-PORTALS-HOST
-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment \"handle service NodePorts; NOTE: this must be the last rule in the chain\" -j KUBE-NODEPORT-CONTAINER
-A OUTPUT -m addrtype --dst-type LOCAL -m comment --comment \"handle service NodePorts; NOTE: this must be the last rule in the chain\" -j KUBE-NODEPORT-HOST
-A KUBE-PORTALS-CONTAINER -d 10.96.0.88/32 -p tcp -m comment --comment \"default/nginx-service:http\" -m tcp --dport 88 -j REDIRECT --to-ports 40001
-A KUBE-PORTALS-CONTAINER -d 10.96.0.88/32 -p udp -m comment --comment \"default/nginx-service:udp\" -m udp --dport 88 -j REDIRECT --to-ports 40002
-A KUBE-PORTALS-CONTAINER -d 10.96.0.80/32 -p tcp -m comment --comment \"default/web\" -m tcp --dport 80 -j REDIRECT --to-ports 40003
-A KUBE-PORTALS-HOST -d 10.96.0.88/32 -p tcp -m comment --comment \"default/nginx-service:http\" -m tcp --dport 88 -j DNAT --to-destination 127.0.0.1:40001
-A KUBE-PORTALS-HOST -d 10.96.0.88/32 -p udp -m comment --comment \"default/nginx-service:udp\" -m udp --dport 88 -j DNAT --to-destination 127.0.0.1:40002
-A KUBE-PORTALS-HOST -d 10.96.0.80/32 -p tcp -m comment --comment \"default/web\" -m tcp --dport 80 -j DNAT --to-destination 127.0.0.1:40003
-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment \"default/nginx-service:http\" -m tcp --dport 30791 -j REDIRECT --to-ports 40001
-A KUBE-NODEPORT-CONTAINER -p udp -m comment --comment \"default/nginx-service:udp\" -m udp --dport 30791 -j REDIRECT --to-ports 40002
-A KUBE-NODEPORT-HOST -p tcp -m comment --comment \"default/nginx-service:http\" -m tcp --dport 30791 -j DNAT --to-destination 127.0.0.1:40001
-A KUBE-NODEPORT-HOST -p udp -m comment --comment \"default/nginx-service:udp\" -m udp --dport 30791 -j DNAT --to-destination 127.0.0.1:40002
COMMIT
*filter
:KUBE-PORTALS-REJECT - [0:0]
-I INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes services without endpoints\" -j KUBE-PORTALS-REJECT
-I FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes services without endpoints\" -j KUBE-PORTALS-REJECT
-I OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes services without endpoints\" -j KUBE-PORTALS-REJECT
-A KUBE-PORTALS-REJECT -d 10.96.0.89/32 -p tcp -m comment --comment \"default/empty-service:http has no endpoints\" -m tcp --dport 89 -j REJECT --reject-with icmp-port-unreachable
-A KUBE-PORTALS-REJECT -p tcp -m addrtype --dst-type LOCAL -m comment --comment \"default/empty-service:http has no endpoints\" -m tcp --dport 30792 -j REJECT --reject-with icmp-port-unreachable
COMMIT
";
        assert_eq!(rendered.text, golden, "rendered:\n{}", rendered.text);
        assert_eq!(rendered.writes, 7 + 10 + 2);
    }

    #[test]
    fn node_port_addresses_narrow_the_node_port_rules() {
        let seed = port("default/nginx-service", Protocol::Tcp, 88, Some(30791));
        let empty = port("default/empty", Protocol::Udp, 89, Some(30792));
        let ports = [
            PortRules {
                service: &seed,
                target: Target::Proxy(40001),
            },
            PortRules {
                service: &empty,
                target: Target::Reject,
            },
        ];
        let no_localhost = render(
            IpFamily::V4,
            &NodePortAddresses::AllLocal { localhost: false },
            &ports,
            &[],
        )
        .text;
        for line in [
            "-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment \"default/nginx-service\" -m tcp --dport 30791 -j REDIRECT --to-ports 40001",
            "-A KUBE-NODEPORT-HOST ! -d 127.0.0.0/8 -p tcp -m comment --comment \"default/nginx-service\" -m tcp --dport 30791 -j DNAT --to-destination 127.0.0.1:40001",
            "-A KUBE-PORTALS-REJECT ! -d 127.0.0.0/8 -p udp -m addrtype --dst-type LOCAL -m comment --comment \"default/empty has no endpoints\" -m udp --dport 30792 -j REJECT --reject-with icmp-port-unreachable",
        ] {
            assert!(no_localhost.lines().any(|l| l == line), "no {line} in\n{no_localhost}");
        }

        let mut config = default_config();
        config.node_port_addresses = config::NodePortAddresses::Primary;
        config.node_ips = vec![
            Ipv4Addr::new(172, 30, 0, 2).into(),
            Ipv4Addr::new(192, 168, 1, 2).into(),
        ];
        let primary = NodePortAddresses::of_family(&config, IpFamily::V4);
        let node_ips = render(IpFamily::V4, &primary, &ports, &[]).text;
        for chain in [CONTAINER_NODE_PORTS, HOST_NODE_PORTS] {
            for ip in ["172.30.0.2", "192.168.1.2"] {
                let prefix = format!("-A {chain} -d {ip}/32 -p tcp ");
                assert!(
                    node_ips.lines().any(|l| l.starts_with(&prefix)),
                    "no {prefix} in\n{node_ips}"
                );
            }
        }
        assert_eq!(node_ips.matches("--dport 30792 -j REJECT").count(), 2);

        let nowhere = render(IpFamily::V4, &NodePortAddresses::Networks(vec![]), &ports, &[]).text;
        assert!(!nowhere.contains("30791"), "{nowhere}");
        assert!(!nowhere.contains("30792"), "{nowhere}");
        assert!(nowhere.contains("--dport 88 -j REDIRECT"), "ClusterIPs still answer");
    }

    #[test]
    fn nothing_but_our_chains_without_ports_or_jumps() {
        let rendered = render(IpFamily::V4, &NodePortAddresses::AllLocal { localhost: true }, &[], &[]);
        assert_eq!(rendered.writes, 0);
        assert_eq!(
            rendered.text,
            "*nat\n:KUBE-PORTALS-CONTAINER - [0:0]\n:KUBE-PORTALS-HOST - [0:0]\n\
             :KUBE-NODEPORT-CONTAINER - [0:0]\n:KUBE-NODEPORT-HOST - [0:0]\nCOMMIT\n\
             *filter\n:KUBE-PORTALS-REJECT - [0:0]\nCOMMIT\n"
        );
    }

    #[test]
    fn jumps_are_recognised_as_saved() {
        for jump in JUMPS {
            let saved = jump.line().replacen("-I ", "-A ", 1);
            assert!(jump.matches_saved(&saved), "{saved}");
        }
        let other = "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES";
        assert!(!JUMPS.iter().any(|j| j.matches_saved(other)));
    }

    #[test]
    fn ownership() {
        for chain in NAT_CHAINS {
            assert!(is_ours("nat", chain));
            assert!(!is_ours("filter", chain));
        }
        assert!(is_ours("filter", REJECT));
        assert!(is_ours("filter", "KUBE-NODEPORT-NON-LOCAL"));
        for (table, chain) in [
            ("nat", "KUBE-SERVICES"),
            ("nat", "KUBE-NODEPORTS"),
            ("nat", "KUBE-NODE-PORT"),
            ("filter", "KUBE-SERVICES"),
            ("mangle", REJECT),
        ] {
            assert!(!is_ours(table, chain), "{table} {chain}");
        }
    }

    #[test]
    fn comments_are_quoted_like_iptables_save() {
        assert_eq!(quote("web-1_a"), "web-1_a");
        assert_eq!(quote("default/web"), "\"default/web\"");
        assert_eq!(quote("a b"), "\"a b\"");
    }

    /// IPv6 NodePorts: every local address, `::1` from the node only if
    /// localhost node ports are on; `[primary]` the IPv6 node IPs; networks
    /// the IPv6 ones.
    #[test]
    fn ipv6_node_port_addresses_come_from_the_config() {
        let mut config = default_config();
        config.node_ips = vec!["172.30.0.2".parse().expect("ip"), "fd00:30::2".parse().expect("ip")];
        let with_localhost = NodePortAddresses::of_family(&config, IpFamily::V6);
        assert_eq!(
            with_localhost.destinations(true, IpFamily::V6),
            [""],
            "`::1` too: nothing is DNATed"
        );
        config.localhost_node_ports = false;
        let all = NodePortAddresses::of_family(&config, IpFamily::V6);
        assert_eq!(all.destinations(true, IpFamily::V6), ["! -d ::1/128 "]);
        config.node_port_addresses = config::NodePortAddresses::Primary;
        let primary = NodePortAddresses::of_family(&config, IpFamily::V6);
        assert_eq!(primary.destinations(false, IpFamily::V6), ["-d fd00:30::2/128 "]);
        let v4_and_v6 = vec![
            "172.30.0.0/24".parse().expect("cidr"),
            "fd00:30::/64".parse().expect("cidr"),
        ];
        config.node_port_addresses = config::NodePortAddresses::Cidrs(v4_and_v6);
        let networks = NodePortAddresses::of_family(&config, IpFamily::V6);
        assert_eq!(networks.destinations(false, IpFamily::V6), ["-d fd00:30::/64 "]);
        assert!(networks.destinations(false, IpFamily::V4).is_empty());
    }
}
