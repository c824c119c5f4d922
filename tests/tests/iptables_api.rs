//! The Service API fields of issue 12 in the iptables mode, with real
//! packets: an `IptablesMode` driven by hand in the node namespace of the
//! one-node test bed (`testbed::topology`), the client outside sending to
//! the node. Each test proves that packets take the path the rules say
//! (the rules themselves are checked in `mode::iptables::rules` and read
//! back in `mode_rules.rs` / `mode_golden.rs`):
//!
//! - external IPs and load balancer IPs answer from outside, from a pod
//!   and from the node; `externalTrafficPolicy: Local` keeps outside
//!   traffic on the node's endpoints and short-circuits pods;
//! - `loadBalancerSourceRanges`: a client outside the ranges is dropped at
//!   the LB IP but not at the node port or the external IP; inside, it
//!   is answered; the node itself passes when a range holds its address;
//! - ClientIP affinity: one client sticks to one backend, a removed
//!   backend releases it, switching affinity off spreads it again;
//! - nodePortAddresses as networks: an address added after the first
//!   sync answers from the next sync on.
//!
//! The cross-mode scenario is `service_api.rs`'s.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    sync::Arc,
};

use proxy_userspace::{
    config::Cidr,
    mode::{
        Dataplane, Plan,
        iptables::{IptablesMode, NodePortCidrs, NodePortDestinations, RuleOptions, SystemIptables},
        options::LocalTraffic,
    },
    model::{Endpoint, ServicePort, SourceRange, TrafficPolicy},
};
use testbed::{
    fixtures::{SEED_NODE_PORT, SEED_PORT, backend_ips, ports},
    netns::Netns,
    privileged::require_root,
    probe::{self, Checks, Outcome, Protocol},
    topology::{BACKENDS, NODE_IP, Offloads, POD_CIDR, Topology},
};

const NODE_NAME: &str = "node-a";
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 5);

fn options() -> RuleOptions {
    RuleOptions {
        local_traffic: Some(LocalTraffic::Cidr(POD_CIDR.parse().expect("cidr"))),
        node_name: Some(NODE_NAME.into()),
        node_ips: vec![NODE_IP.into()],
        ..RuleOptions::default()
    }
}

/// The seed Service with an external IP and a load balancer IP, every
/// backend on this node.
fn api_port() -> ServicePort {
    let mut port = ports::seed_port("default/api", Protocol::Tcp, &backend_ips());
    for ep in &mut port.endpoints {
        ep.node_name = Some(Arc::from(NODE_NAME));
    }
    port.external_ips = vec![EXTERNAL_IP.into()];
    port.load_balancer_ips = vec![LB_IP.into()];
    port
}

fn range(text: &str) -> SourceRange {
    let (addr, len) = text.split_once('/').expect("a CIDR");
    SourceRange {
        addr: addr.parse().expect("an address"),
        prefix_len: len.parse().expect("a prefix length"),
    }
}

/// The bed, with the client routing the external and LB IPs to the node.
fn bed() -> Topology {
    let bed = Topology::build(Offloads::On).expect("building the test bed");
    for ip in [EXTERNAL_IP, LB_IP] {
        bed.client
            .add_route(&[&format!("{ip}/32"), "via", &NODE_IP.to_string()])
            .expect("a route to the Service address");
    }
    bed
}

/// The bed with a mode in its node, fully synced to `port`.
fn started(port: &ServicePort) -> (Topology, IptablesMode) {
    let bed = bed();
    let mut mode = IptablesMode::new(options(), Box::new(SystemIptables::default()));
    full(&bed.node, &mut mode, &[port]);
    (bed, mode)
}

fn full(ns: &Netns, mode: &mut IptablesMode, ports: &[&ServicePort]) {
    let desired: BTreeMap<String, ServicePort> = ports.iter().map(|p| (p.name.clone(), (*p).clone())).collect();
    ns.run_in(|| mode.apply_full(&desired))
        .expect("entering the node")
        .unwrap_or_else(|e| panic!("full sync: {e:#}"));
}

fn upsert(ns: &Netns, mode: &mut IptablesMode, port: &ServicePort) {
    let plan = Plan {
        upsert: vec![port.clone()],
        remove: Vec::new(),
    };
    ns.run_in(|| mode.apply(&plan))
        .expect("entering the node")
        .unwrap_or_else(|e| panic!("partial sync: {e:#}"));
}

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// Every answer of `count` TCP requests from `from` to `addr`.
fn answers(from: &Netns, addr: SocketAddrV4, count: usize) -> Vec<String> {
    (0..count)
        .map(
            |_| match probe::outcome(from, Protocol::Tcp, addr, probe::REQUEST_TIMEOUT) {
                Ok(Outcome::Answered(name)) => name,
                other => panic!("a request to {addr} from {}: {other:?}", from.name()),
            },
        )
        .collect()
}

#[test]
fn iptables_external_and_load_balancer_ips() {
    if !require_root("iptables_external_and_load_balancer_ips") {
        return;
    }
    let mut port = api_port();
    let (bed, mut mode) = started(&port);
    let all: Vec<&str> = BACKENDS.iter().map(|(name, _)| *name).collect();
    let mut checks = Checks::new("iptables external addresses");
    for ip in [EXTERNAL_IP, LB_IP] {
        let addr = at(ip, SEED_PORT);
        checks.check(
            &format!("{addr} from outside"),
            probe::expect_all_backends(&bed.client, Protocol::Tcp, addr),
        );
        checks.check(
            &format!("{addr} from a pod"),
            probe::expect_all_backends(&bed.client_pod.ns, Protocol::Tcp, addr),
        );
        checks.check(
            &format!("{addr} from the node"),
            probe::expect_all_backends(&bed.node, Protocol::Tcp, addr),
        );
        checks.check(
            &format!("{ip}:{} (not the Service's port) from outside", SEED_PORT + 1),
            probe::expect_outcome(&bed.client, Protocol::Tcp, at(ip, SEED_PORT + 1), &Outcome::NoAnswer),
        );
    }

    // externalTrafficPolicy: Local with pod-3 on another node: outside
    // traffic reaches pod-1 and pod-2 only, a pod's reaches all three.
    port.external_policy = TrafficPolicy::Local;
    port.endpoints[2].node_name = Some(Arc::from("node-b"));
    upsert(&bed.node, &mut mode, &port);
    for ip in [EXTERNAL_IP, LB_IP] {
        let addr = at(ip, SEED_PORT);
        checks.check(
            &format!("{addr} from outside, Local"),
            probe::expect_backends(&bed.client, Protocol::Tcp, addr, &all[..2], probe::REQUESTS),
        );
        checks.check(
            &format!("{addr} from a pod, Local"),
            probe::expect_all_backends(&bed.client_pod.ns, Protocol::Tcp, addr),
        );
    }
    // No local endpoint: outside traffic is dropped, not rejected.
    for ep in &mut port.endpoints {
        ep.node_name = Some(Arc::from("node-b"));
    }
    upsert(&bed.node, &mut mode, &port);
    checks.check(
        "the external IP from outside, Local without local endpoints",
        probe::expect_outcome(
            &bed.client,
            Protocol::Tcp,
            at(EXTERNAL_IP, SEED_PORT),
            &Outcome::NoAnswer,
        ),
    );
    // No endpoint at all: rejected.
    port.endpoints.clear();
    upsert(&bed.node, &mut mode, &port);
    for ip in [EXTERNAL_IP, LB_IP] {
        checks.check(
            &format!("{ip} without endpoints"),
            probe::expect_refused(&bed.client, Protocol::Tcp, at(ip, SEED_PORT)),
        );
    }
    checks.finish();
}

#[test]
fn iptables_load_balancer_source_ranges() {
    if !require_root("iptables_load_balancer_source_ranges") {
        return;
    }
    let mut port = api_port();
    // Neither the client (172.30.0.1) nor the node (172.30.0.2) is inside.
    port.source_ranges = vec![range("192.0.2.0/24")];
    let (bed, mut mode) = started(&port);
    let lb = at(LB_IP, SEED_PORT);
    let mut checks = Checks::new("iptables source ranges");
    checks.check(
        "the LB IP from outside the ranges",
        probe::expect_outcome(&bed.client, Protocol::Tcp, lb, &Outcome::NoAnswer),
    );
    // Dropped in filter OUTPUT (TCP retries the SYN until the timeout).
    checks.check(
        "the LB IP from the node, outside the ranges",
        probe::expect_outcome(&bed.node, Protocol::Tcp, lb, &Outcome::NoAnswer),
    );
    checks.check(
        "the node port is not filtered",
        probe::expect_all_backends(&bed.client, Protocol::Tcp, at(NODE_IP, SEED_NODE_PORT)),
    );
    checks.check(
        "the external IP is not filtered",
        probe::expect_all_backends(&bed.client, Protocol::Tcp, at(EXTERNAL_IP, SEED_PORT)),
    );

    // The client's network (which holds the node's address too) is allowed.
    port.source_ranges.push(range("172.30.0.0/24"));
    upsert(&bed.node, &mut mode, &port);
    checks.check(
        "the LB IP from inside the ranges",
        probe::expect_all_backends(&bed.client, Protocol::Tcp, lb),
    );
    checks.check(
        "the LB IP from the node, its address in a range",
        probe::expect_all_backends(&bed.node, Protocol::Tcp, lb),
    );
    checks.finish();
}

#[test]
fn iptables_client_ip_affinity() {
    if !require_root("iptables_client_ip_affinity") {
        return;
    }
    let mut port = api_port();
    port.affinity = Some(std::time::Duration::from_secs(600));
    let (bed, mut mode) = started(&port);
    let addr = at(EXTERNAL_IP, SEED_PORT);

    let first = answers(&bed.client, addr, 20);
    assert!(
        first.iter().all(|a| *a == first[0]),
        "one client, one backend: {first:?}"
    );
    // The node port shares the endpoint chains, and with them the choice.
    let via_node_port = answers(&bed.client, at(NODE_IP, SEED_NODE_PORT), 10);
    assert!(via_node_port.iter().all(|a| *a == first[0]), "{via_node_port:?}");

    // The chosen backend goes: its client is released and sticks to another.
    let chosen = BACKENDS
        .iter()
        .position(|(name, _)| *name == first[0])
        .expect("a backend answered");
    let without: Vec<Endpoint> = port
        .endpoints
        .iter()
        .filter(|e| e.addr != BACKENDS[chosen].1)
        .cloned()
        .collect();
    port.endpoints = without;
    upsert(&bed.node, &mut mode, &port);
    let second = answers(&bed.client, addr, 20);
    assert!(
        second.iter().all(|a| *a == second[0] && *a != first[0]),
        "released and stuck to another: {second:?}"
    );

    // Affinity off: the client is spread over both remaining backends.
    port.affinity = None;
    upsert(&bed.node, &mut mode, &port);
    let remaining: Vec<&str> = BACKENDS
        .iter()
        .filter(|(name, _)| *name != first[0])
        .map(|(name, _)| *name)
        .collect();
    probe::expect_backends(&bed.client, Protocol::Tcp, addr, &remaining, probe::REQUESTS)
        .unwrap_or_else(|e| panic!("affinity off: {e:#}"));

    // And on again: one backend once more.
    port.affinity = Some(std::time::Duration::from_secs(600));
    upsert(&bed.node, &mut mode, &port);
    let third = answers(&bed.client, addr, 20);
    assert!(third.iter().all(|a| *a == third[0]), "affinity on again: {third:?}");
}

#[test]
fn iptables_node_port_addresses_follow_new_addresses() {
    if !require_root("iptables_node_port_addresses_follow_new_addresses") {
        return;
    }
    let bed = bed();
    let cidrs = NodePortCidrs {
        cidrs: vec!["172.31.0.0/16".parse::<Cidr>().expect("cidr")],
        localhost: false,
    };
    let opts = RuleOptions {
        node_ports: NodePortDestinations::Addresses(Vec::new()),
        ..options()
    };
    let mut mode = IptablesMode::new(opts, Box::new(SystemIptables::default())).with_node_port_cidrs(cidrs);
    let port = api_port();
    full(&bed.node, &mut mode, &[&port]);
    let new_ip = Ipv4Addr::new(172, 31, 0, 2);
    let mut checks = Checks::new("iptables nodePortAddresses");
    checks.check(
        "NODE_IP is outside nodePortAddresses",
        probe::expect_refused(&bed.client, Protocol::Tcp, at(NODE_IP, SEED_NODE_PORT)),
    );
    bed.node
        .add_addr(&bed.uplink, &format!("{new_ip}/32"))
        .expect("a new node address");
    bed.client
        .add_route(&[&format!("{new_ip}/32"), "via", &NODE_IP.to_string()])
        .expect("a route to the new address");
    full(&bed.node, &mut mode, &[&port]);
    checks.check(
        "the node port on an address added after start",
        probe::expect_all_backends(&bed.client, Protocol::Tcp, at(new_ip, SEED_NODE_PORT)),
    );
    checks.check(
        "still not on NODE_IP",
        probe::expect_refused(&bed.client, Protocol::Tcp, at(NODE_IP, SEED_NODE_PORT)),
    );
    checks.finish();
}
