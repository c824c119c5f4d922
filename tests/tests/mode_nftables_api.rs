//! The nftables mode's Service API (issue 12) against the real kernel: an
//! `NftablesMode` driven by hand on the test bed (a node with pods, a
//! client outside), its table read back with `nft -j list` and real TCP
//! through it:
//!
//! - external IPs and load balancer IPs answer on the Service's port from
//!   outside, from a pod and from the node; another port on them does not;
//!   `externalTrafficPolicy: Local` keeps outside clients on this node's
//!   endpoint, short-circuits pods and the node, and drops outside clients
//!   (only them) when this node has no endpoint;
//! - `loadBalancerSourceRanges` drops outside clients to the LB IP (not to
//!   the node port, the external IP or the ClusterIP) until a range holds
//!   them;
//! - ClientIP affinity keeps a client on one endpoint (its address in that
//!   endpoint's set), a removed endpoint's set goes and its clients move,
//!   affinity switches off and on;
//! - NodePorts answer on an address added to the node after the sync, not
//!   on localhost.
//!
//! The whole table for such a Service is a golden file
//! (`nftables/service-api.nft-list`, `XPROXY_UPDATE_GOLDEN=1` rewrites it).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use proxy_userspace::{
    mode::{
        Dataplane, Plan,
        nftables::{NftablesMode, Options, SystemNft, names},
        options::LocalTraffic,
    },
    model::{Endpoint, ServicePort, SourceRange, TrafficPolicy},
};
use serde_json::Value;
use testbed::{
    agent_bed::workspace_root,
    fixtures::NODE_NAME,
    netns::Netns,
    privileged::require_root,
    topology::{BACKENDS, CLIENT_IP, NODE_IP, Offloads, POD_CIDR, TARGET_PORT, Topology},
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 120);
const PORT: u16 = 8080;
const NODE_PORT: u16 = 30900;
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
/// A request expected to be answered.
const ANSWER: Duration = Duration::from_secs(2);
/// A request expected to be dropped: waited for this long.
const SILENCE: Duration = Duration::from_millis(700);

fn range(addr: [u8; 4], prefix_len: u8) -> SourceRange {
    SourceRange {
        addr: Ipv4Addr::from(addr).into(),
        prefix_len,
    }
}

/// A LoadBalancer Service: pod-1 on this node, pod-2 and pod-3 elsewhere.
fn lb_port() -> ServicePort {
    let endpoints = BACKENDS
        .iter()
        .enumerate()
        .map(|(i, (_, ip))| Endpoint {
            node_name: Some(if i == 0 { NODE_NAME } else { "other-node" }.into()),
            ..Endpoint::ready(*ip, TARGET_PORT)
        })
        .collect();
    ServicePort {
        name: "default/lb:http".into(),
        cluster_ip: CLUSTER_IP.into(),
        port: PORT,
        node_port: Some(NODE_PORT),
        endpoints,
        external_ips: vec![EXTERNAL_IP.into()],
        load_balancer_ips: vec![LB_IP.into()],
        ..ServicePort::default()
    }
}

/// The node's options: the bed's pod CIDR, node name and node IP.
fn options() -> Options {
    Options {
        local_traffic: Some(LocalTraffic::Cidr(POD_CIDR.parse().expect("cidr"))),
        node_name: Some(NODE_NAME.into()),
        node_ips: vec![NODE_IP.into()],
        ..Options::default()
    }
}

/// The test bed with the mode and routes from the client to the external
/// and LB IPs through the node.
struct Bed {
    topo: Topology,
    mode: NftablesMode,
}

impl Bed {
    fn new() -> Self {
        let topo = Topology::build(Offloads::On).expect("the test bed");
        for ip in [EXTERNAL_IP, LB_IP] {
            topo.client
                .add_route(&[&format!("{ip}/32"), "via", &NODE_IP.to_string()])
                .expect("client route");
        }
        let mode = NftablesMode::new(options(), Box::new(SystemNft::default()));
        Self { topo, mode }
    }

    /// The bed with `port` programmed by a full sync, if `test` may run.
    fn start(test: &str, port: &ServicePort) -> Option<Self> {
        if !require_root(test) {
            return None;
        }
        let mut bed = Self::new();
        bed.full(port);
        Some(bed)
    }

    fn full(&mut self, port: &ServicePort) {
        let desired = BTreeMap::from([(port.name.clone(), port.clone())]);
        let mode = &mut self.mode;
        self.topo
            .node
            .run_in(|| mode.apply_full(&desired))
            .expect("thread")
            .unwrap_or_else(|e| panic!("full sync: {e:#}"));
    }

    fn partial(&mut self, port: &ServicePort) {
        let plan = Plan {
            upsert: vec![port.clone()],
            remove: vec![],
        };
        let mode = &mut self.mode;
        self.topo
            .node
            .run_in(|| mode.apply(&plan))
            .expect("thread")
            .unwrap_or_else(|e| panic!("partial sync: {e:#}"));
    }

    /// `nft -j list <what>` in the node, parsed.
    fn json(&self, what: &[&str]) -> Value {
        let mut args = vec!["nft", "-j", "list"];
        args.extend(what);
        let out = self.topo.node.exec(&args).expect("nft -j list");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("nft -j output: {e}\n{out}"))
    }

    /// The keys of a verdict map (`IP . proto . port` or `proto . port`)
    /// with the chains they go to.
    fn map(&self, name: &str) -> BTreeMap<String, String> {
        let listing = self.json(&["map", "ip", "xproxy", name]);
        objects(&listing, "map")
            .flat_map(|map| map["elem"].as_array().cloned().unwrap_or_default())
            .map(|pair| {
                let key = concat_key(&pair[0]);
                let target = pair[1]
                    .pointer("/goto/target")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_owned();
                (key, target)
            })
            .collect()
    }

    /// The affinity sets and the addresses in each.
    fn affinity_sets(&self) -> BTreeMap<String, BTreeSet<String>> {
        let listing = self.json(&["table", "ip", "xproxy"]);
        objects(&listing, "set")
            .filter_map(|set| {
                let name = set["name"].as_str()?;
                name.starts_with(names::AFFINITY_PREFIX).then(|| {
                    let elements = set["elem"]
                        .as_array()
                        .map(|elems| elems.iter().filter_map(element_address).collect())
                        .unwrap_or_default();
                    (name.to_owned(), elements)
                })
            })
            .collect()
    }
}

/// The objects of one kind (`map`, `set`) in `nft -j` output.
fn objects<'a>(listing: &'a Value, kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    listing["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(move |o| o.get(kind))
}

/// `a . b . c` from a JSON `concat` (or a single value), also inside
/// `{"elem": {"val": ..., "comment": ...}}`.
fn concat_key(key: &Value) -> String {
    let key = key.pointer("/elem/val").unwrap_or(key);
    match key.get("concat").and_then(Value::as_array) {
        Some(parts) => parts.iter().map(scalar).collect::<Vec<_>>().join(" . "),
        None => scalar(key),
    }
}

fn scalar(v: &Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_owned)
}

/// The address of a set element: plain, or `{"elem": {"val": ...}}` with a timeout.
fn element_address(elem: &Value) -> Option<String> {
    elem.as_str()
        .or_else(|| elem.pointer("/elem/val").and_then(Value::as_str))
        .map(str::to_owned)
}

/// The answers of `n` requests to `addr` from `ns`, counted by answer
/// (failures as `error: KIND`).
fn answers(ns: &Netns, addr: SocketAddrV4, n: usize) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let answer = match ns.tcp_request(addr, ANSWER).expect("thread") {
            Ok(text) => text,
            Err(e) => format!("error: {:?}", e.kind()),
        };
        *out.entry(answer).or_insert(0) += 1;
    }
    out
}

/// The backend answering one request, panicking if none does.
fn answered(ns: &Netns, addr: SocketAddrV4, what: &str) -> String {
    match ns.tcp_request(addr, ANSWER).expect("thread") {
        Ok(name) if BACKENDS.iter().any(|(b, _)| *b == name) => name,
        other => panic!("{what}: {addr} answered {other:?}"),
    }
}

/// Panics if a backend answers a request to `addr` from `ns`.
fn unanswered(ns: &Netns, addr: SocketAddrV4, what: &str) {
    if let Ok(Ok(name)) = ns.tcp_request(addr, SILENCE) {
        panic!("{what}: {addr} answered {name:?}");
    }
}

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

fn only(answers: &BTreeMap<String, usize>, backend: &str) -> bool {
    answers.len() == 1 && answers.contains_key(backend)
}

#[test]
fn nftables_external_and_load_balancer_ips() {
    let port = lb_port();
    let Some(bed) = Bed::start("nftables_external_and_load_balancer_ips", &port) else {
        return;
    };

    let service_ips = bed.map(names::SERVICE_IPS);
    let external = names::external_chain(&port);
    for ip in [EXTERNAL_IP, LB_IP] {
        assert_eq!(
            service_ips.get(&format!("{ip} . tcp . {PORT}")),
            Some(&external),
            "{service_ips:#?}"
        );
    }
    assert_eq!(service_ips.len(), 3, "only the port's own keys: {service_ips:#?}");

    let t = &bed.topo;
    for ip in [EXTERNAL_IP, LB_IP] {
        answered(&t.client, at(ip, PORT), "outside client");
        answered(&t.client_pod.ns, at(ip, PORT), "pod");
        answered(&t.node, at(ip, PORT), "the node");
        unanswered(&t.client, at(ip, PORT + 1), "another port");
    }
    answered(&t.client, at(NODE_IP, NODE_PORT), "node port");
}

#[test]
fn nftables_external_traffic_policy_local_on_external_addresses() {
    let mut port = ServicePort {
        external_policy: TrafficPolicy::Local,
        ..lb_port()
    };
    let Some(mut bed) = Bed::start("nftables_external_traffic_policy_local_on_external_addresses", &port) else {
        return;
    };
    for ip in [EXTERNAL_IP, LB_IP] {
        let outside = answers(&bed.topo.client, at(ip, PORT), 8);
        assert!(
            only(&outside, "pod-1"),
            "outside clients stay on this node: {outside:?}"
        );
        let from_pod = answers(&bed.topo.client_pod.ns, at(ip, PORT), 24);
        assert!(from_pod.len() > 1, "pods short-circuit to every endpoint: {from_pod:?}");
    }

    // No endpoint on this node: outside clients are dropped, the node's
    // own traffic still short-circuits.
    port.endpoints.remove(0);
    bed.partial(&port);
    let no_endpoint = bed.map(names::NO_ENDPOINT_SERVICES);
    assert_eq!(
        no_endpoint
            .get(&format!("{EXTERNAL_IP} . tcp . {PORT}"))
            .map(String::as_str),
        Some(names::DROP_EXTERNAL_CHAIN),
        "{no_endpoint:#?}"
    );
    for ip in [EXTERNAL_IP, LB_IP] {
        unanswered(
            &bed.topo.client,
            at(ip, PORT),
            "outside client without a local endpoint",
        );
        answered(&bed.topo.node, at(ip, PORT), "the node without a local endpoint");
    }
}

#[test]
fn nftables_load_balancer_source_ranges() {
    let mut port = ServicePort {
        source_ranges: vec![range([203, 0, 113, 0], 24)],
        ..lb_port()
    };
    let Some(mut bed) = Bed::start("nftables_load_balancer_source_ranges", &port) else {
        return;
    };
    let firewall = bed.map(names::FIREWALL_IPS);
    assert_eq!(
        firewall,
        BTreeMap::from([(format!("{LB_IP} . tcp . {PORT}"), names::firewall_chain(&port))]),
        "only the LB IP is filtered"
    );
    let t = &bed.topo;
    unanswered(&t.client, at(LB_IP, PORT), "a client outside the ranges");
    answered(&t.client, at(EXTERNAL_IP, PORT), "the external IP, unfiltered");
    answered(&t.client, at(NODE_IP, NODE_PORT), "the node port, unfiltered");
    answered(&t.client_pod.ns, at(CLUSTER_IP, PORT), "the ClusterIP, unfiltered");

    port.source_ranges.push(range(CLIENT_IP.octets(), 32));
    bed.partial(&port);
    answered(&bed.topo.client, at(LB_IP, PORT), "a client inside the ranges");

    port.source_ranges.clear();
    bed.partial(&port);
    assert!(bed.map(names::FIREWALL_IPS).is_empty());
    answered(&bed.topo.client, at(LB_IP, PORT), "no ranges");
}

#[test]
fn nftables_client_ip_affinity() {
    let mut port = ServicePort {
        affinity: Some(Duration::from_secs(600)),
        ..lb_port()
    };
    let Some(mut bed) = Bed::start("nftables_client_ip_affinity", &port) else {
        return;
    };
    let client = bed.topo.client_pod.ns.name().to_owned();
    let cluster_ip = at(CLUSTER_IP, PORT);
    let first = answers(&bed.topo.client_pod.ns, cluster_ip, 12);
    assert_eq!(first.len(), 1, "{client} sticks to one endpoint: {first:?}");
    let chosen = first.keys().next().expect("an answer").clone();
    let index = BACKENDS.iter().position(|(b, _)| *b == chosen).expect("a backend");
    let chosen_set = names::affinity_set(&port, &port.endpoints[index]);
    let sets = bed.affinity_sets();
    assert_eq!(sets.len(), 3, "{sets:#?}");
    assert_eq!(
        sets.get(&chosen_set),
        Some(&BTreeSet::from([bed.topo.client_pod.ip.to_string()])),
        "{sets:#?}"
    );

    // A periodic full sync finds the table as it left it (the clients the
    // kernel added are no change) and writes nothing: affinity survives.
    let writes = bed.mode.kernel_writes();
    bed.full(&port);
    assert_eq!(bed.mode.kernel_writes(), writes, "an idle full sync rewrote the table");
    assert_eq!(bed.affinity_sets(), sets);

    // The endpoint goes: its set goes, the client moves to another one and
    // sticks there.
    port.endpoints.remove(index);
    bed.partial(&port);
    let sets = bed.affinity_sets();
    assert!(!sets.contains_key(&chosen_set) && sets.len() == 2, "{sets:#?}");
    let moved = answers(&bed.topo.client_pod.ns, cluster_ip, 12);
    assert!(moved.len() == 1 && !moved.contains_key(&chosen), "{moved:?}");

    // Off: balanced again, no set left; on: sticky again.
    port.affinity = None;
    bed.partial(&port);
    assert!(bed.affinity_sets().is_empty());
    let spread = answers(&bed.topo.client_pod.ns, cluster_ip, 24);
    assert_eq!(spread.len(), 2, "without affinity both endpoints answer: {spread:?}");
    port.affinity = Some(Duration::from_secs(600));
    bed.partial(&port);
    let again = answers(&bed.topo.client_pod.ns, cluster_ip, 12);
    assert_eq!(again.len(), 1, "{again:?}");
}

/// `nodePortAddresses` unset: every local address but localhost, also one
/// added after the sync (the kernel checks `fib daddr type local`).
#[test]
fn nftables_node_ports_on_every_local_address() {
    let Some(bed) = Bed::start("nftables_node_ports_on_every_local_address", &lb_port()) else {
        return;
    };
    let added = Ipv4Addr::new(172, 30, 0, 50);
    bed.topo
        .node
        .add_addr(&bed.topo.uplink, &format!("{added}/24"))
        .expect("a new node address");
    answered(
        &bed.topo.client,
        at(added, NODE_PORT),
        "an address added after the sync",
    );
    answered(&bed.topo.node, at(NODE_IP, NODE_PORT), "the node to its own IP");
    unanswered(&bed.topo.node, at(Ipv4Addr::LOCALHOST, NODE_PORT), "localhost");
}

/// The kernel's rendering of the table for a Service with every field:
/// LB IP with source ranges (one holding the node IP), an external IP,
/// affinity, `externalTrafficPolicy: Local`.
#[test]
fn nftables_service_api_golden() {
    if !require_root("nftables_service_api_golden") {
        return;
    }
    let ns = Netns::new("xg").expect("namespace");
    let mut mode = NftablesMode::new(options(), Box::new(SystemNft::default()));
    let port = ServicePort {
        source_ranges: vec![range([203, 0, 113, 0], 24), range([172, 30, 0, 0], 24)],
        affinity: Some(Duration::from_secs(10800)),
        external_policy: TrafficPolicy::Local,
        ..lb_port()
    };
    let desired = BTreeMap::from([(port.name.clone(), port)]);
    ns.run_in(|| mode.apply_full(&desired))
        .expect("thread")
        .expect("full sync");
    let listing = ns.exec(&["nft", "list", "table", "ip", "xproxy"]).expect("nft list");
    let path = workspace_root().join("proxy-userspace/tests/golden/nftables/service-api.nft-list");
    if std::env::var("XPROXY_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &listing).expect("writing the golden file");
        return;
    }
    let expected = std::fs::read_to_string(&path).expect("reading the golden file");
    assert!(
        expected == listing,
        "{} differs (XPROXY_UPDATE_GOLDEN=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{listing}",
        path.display()
    );
}
