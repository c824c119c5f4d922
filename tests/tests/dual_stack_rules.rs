//! The rule-writing modes (iptables, nftables) and the ebpf mode with a
//! dual-stack seed Service, through the real agent on the one-node test
//! bed: in one run the
//! IPv4 and the IPv6 half both answer, over TCP and UDP, from every
//! backend, through the NodePort from the outside client (`NODE_IP:30791`,
//! `[NODE_IP6]:30791`) and through the ClusterIP from a pod
//! (`10.96.0.88:88`, `[fd00:96::88]:88`); a dual-stack Service without
//! endpoints is refused in both families (ICMP / ICMPv6 port unreachable);
//! a UDP flow of the IPv6 half moves off an endpoint that left it (the
//! agent deletes its entry from the IPv6 conntrack table); a dual-stack
//! Service with `sessionAffinity: ClientIP` keeps each client on one
//! backend over IPv6 as over IPv4, through the ClusterIP and the node port;
//! the rules are read back from the kernel (`ip6tables-save`, `nft list
//! table ip6 xproxy`; for the ebpf mode its IPv6 frontend map and its
//! ip6tables masquerade chain) and `xproxy cleanup` removes both
//! families' rules.
//!
//! The ebpf mode's IPv6 load balancer IPs besides
//! ([`ebpf_ipv6_source_ranges_and_local_short_circuit`]): a dual-stack
//! LoadBalancer Service with IPv6 `loadBalancerSourceRanges` only answers
//! an IPv6 client inside them and drops one outside (its ranges read back
//! from `XP_SRC_RANGES6`), while its IPv4 load balancer IP, with no range
//! of its family, answers everyone (kube-proxy filters per family); a
//! dual-stack `externalTrafficPolicy: Local` Service (one endpoint of three
//! on this node) answers the outside client from the node's endpoint only
//! over IPv6, and a pod (inside the IPv6 `clusterCIDR`, read back from
//! `XP_POD_CIDRS6`) from every endpoint.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use testbed::{
    agent_bed::{AgentBed, DATAPATH_PACKETS, Mode, READY_WITHIN, seed_node_port},
    fixtures::{
        EMPTY_CLUSTER_IP, EMPTY_NAME, EMPTY_PORT, NODE_NAME, PortDef, SEED_CLUSTER_IP, SEED_CLUSTER_IP6,
        SEED_NODE_PORT, SEED_PORT, backend_ips, backend_ips6, dual_stack, on_node, seed_objects_dual_stack,
        seed_tcp_udp, service, service_with, slice_with, slice6_with, yaml_documents,
    },
    netns,
    privileged::require_root,
    probe::{self, Checks, PROTOCOLS, Protocol, REJECT_TIMEOUT, expect_all_backends, expect_backends, expect_refused},
    topology::{
        BACKENDS, CLIENT_IP, CLIENT_IP6, NODE_IP, NODE_IP6, POD_CIDR, POD_CIDR6, TARGET_PORT, Topology, pod_ipv6,
    },
};

/// The IPv6 ClusterIP of the dual-stack Service without endpoints.
const EMPTY_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x89);

/// The dual-stack Service with ClientIP affinity: its ClusterIPs, port and
/// node port.
const STICKY_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 90);
const STICKY_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x90);
const STICKY_PORT: u16 = 90;
const STICKY_NODE_PORT: u16 = 30790;

/// The dual-stack seed (TCP and UDP), an endpoint-less dual-stack Service
/// and a dual-stack Service with ClientIP affinity.
fn seed_objects() -> Vec<serde_json::Value> {
    let mut objects = seed_objects_dual_stack(&seed_tcp_udp());
    objects.push(dual_stack(
        service(EMPTY_NAME, EMPTY_CLUSTER_IP, EMPTY_PORT, TARGET_PORT, None),
        EMPTY_CLUSTER_IP6,
    ));
    objects.extend(sticky_objects());
    objects
}

/// The Service with ClientIP affinity and its slices of both families.
fn sticky_objects() -> Vec<serde_json::Value> {
    let ports = [PortDef {
        name: None,
        protocol: Protocol::Tcp,
        port: STICKY_PORT,
        target_port: TARGET_PORT,
        node_port: Some(STICKY_NODE_PORT),
    }];
    let mut svc = service_with("sticky", STICKY_CLUSTER_IP, &ports, None);
    svc["spec"]["sessionAffinity"] = "ClientIP".into();
    let endpoints6: Vec<(Ipv6Addr, &str)> = backend_ips6().into_iter().map(|ip| (ip, NODE_NAME)).collect();
    vec![
        dual_stack(svc, STICKY_CLUSTER_IP6),
        slice_with("sticky-4", "sticky", &ports, &on_node(&backend_ips())),
        slice6_with("sticky-6", "sticky", &ports, &endpoints6),
    ]
}

/// Every request from `from` to `addr` answered by one backend.
fn sticks(from: &testbed::netns::Netns, addr: SocketAddr) -> Result<String> {
    let answers = from.run_in(|| -> Result<Vec<String>> {
        (0..20)
            .map(|i| {
                probe::request(Protocol::Tcp, addr, probe::REQUEST_TIMEOUT)
                    .with_context(|| format!("request {} to {addr}", i + 1))
            })
            .collect()
    })??;
    let first = &answers[0];
    ensure!(answers.iter().all(|a| a == first), "answers spread: {answers:?}");
    Ok(format!("20 of 20 on {first}"))
}

/// The agent in `mode` with `objects`, told both node addresses.
fn start(bed: &mut AgentBed, mode: Mode, objects: &[serde_json::Value]) -> Result<()> {
    bed.write_manifest("seed.yaml", &yaml_documents(objects))?;
    let mut args = bed.manifest_args();
    // Beside the IPv4 one the bed passes.
    args.extend(["--node-ip".to_owned(), NODE_IP6.to_string()]);
    bed.start_agent_in(mode.name(), &args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    bed.wait_answering(seed_node_port(), READY_WITHIN)?;
    Ok(())
}

/// Both families of the seed from the client (NodePort) and the client
/// pod (ClusterIP), and of the Service without endpoints from the pod.
fn check_both_families(bed: &AgentBed, checks: &mut Checks) {
    let topo = &bed.topo;
    for (node, cluster, empty) in [
        (
            IpAddr::from(NODE_IP),
            IpAddr::from(SEED_CLUSTER_IP),
            IpAddr::from(EMPTY_CLUSTER_IP),
        ),
        (NODE_IP6.into(), SEED_CLUSTER_IP6.into(), EMPTY_CLUSTER_IP6.into()),
    ] {
        for protocol in PROTOCOLS {
            let node_port = SocketAddr::new(node, SEED_NODE_PORT);
            checks.check(
                &format!("{protocol:?} client -> {node_port}"),
                expect_all_backends(&topo.client, protocol, node_port),
            );
            let cluster_ip = SocketAddr::new(cluster, SEED_PORT);
            checks.check(
                &format!("{protocol:?} client pod -> {cluster_ip}"),
                expect_all_backends(&topo.client_pod.ns, protocol, cluster_ip),
            );
        }
        let empty = SocketAddr::new(empty, EMPTY_PORT);
        checks.check(
            &format!("TCP client pod -> {empty} (no endpoints)"),
            refused(topo, empty),
        );
    }
    for (sticky, node) in [
        (IpAddr::from(STICKY_CLUSTER_IP), IpAddr::from(NODE_IP)),
        (STICKY_CLUSTER_IP6.into(), NODE_IP6.into()),
    ] {
        let cluster_ip = SocketAddr::new(sticky, STICKY_PORT);
        checks.check(
            &format!("ClientIP affinity: client pod -> {cluster_ip}"),
            sticks(&topo.client_pod.ns, cluster_ip),
        );
        let node_port = SocketAddr::new(node, STICKY_NODE_PORT);
        checks.check(
            &format!("ClientIP affinity: client -> {node_port}"),
            sticks(&topo.client, node_port),
        );
    }
}

/// A TCP connect from the client pod to `addr` fails with ECONNREFUSED
/// (the rules' ICMP or ICMPv6 port unreachable), not by a timeout. Over
/// IPv4 at once ([`expect_refused`]); over IPv6 the first SYN's ICMPv6
/// error comes back (on this bed, in the same softirq on the same CPU)
/// while the connecting socket is still locked and is only kept as a soft
/// error (`TcpExtLockDroppedIcmps` counts it): the retransmitted SYN's
/// error, a second later, ends the connect. Both rule modes alike.
fn refused(topo: &Topology, addr: SocketAddr) -> Result<String> {
    if addr.is_ipv4() {
        return expect_refused(&topo.client_pod.ns, Protocol::Tcp, addr);
    }
    let started = Instant::now();
    let result = topo.client_pod.ns.run_in(|| netns::tcp_connect(addr, REJECT_TIMEOUT))?;
    match result {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(format!("refused after {:?}", started.elapsed())),
        other => bail!("expected ECONNREFUSED, got {other:?} after {:?}", started.elapsed()),
    }
}

/// The mode's IPv6 rules as the kernel lists them.
fn ipv6_rules(bed: &AgentBed, mode: Mode) -> Result<String> {
    match mode {
        Mode::Nftables => bed.topo.node.exec(&["nft", "list", "table", "ip6", "xproxy"]),
        Mode::Ebpf => ebpf_ipv6_state(bed),
        _ => bed.topo.node.exec(&["ip6tables-save"]),
    }
}

/// The ebpf mode's IPv6 frontends, read from its pinned `XP_SERVICES6`
/// (one `[addr]:port/proto` line each), after its ip6tables masquerade
/// chain (which must be there while the agent runs).
fn ebpf_ipv6_state(bed: &AgentBed) -> Result<String> {
    use proxy_common::{Service6Key, ServiceValue, maps};
    let services6: aya::maps::HashMap<_, Service6Key, ServiceValue> =
        proxy_userspace::mode::ebpf::open_pinned(bed.pin_path(), maps::SERVICES6)?;
    let mut out = bed.topo.node.exec(&["ip6tables-save", "-t", "nat"])?;
    ensure!(out.contains(":XPROXY-SNAT"), "no IPv6 masquerade chain: {out}");
    for key in services6.keys() {
        let key = key.context("reading XP_SERVICES6")?;
        out.push_str(&format!(
            "{}/{}\n",
            SocketAddr::new(key.addr().into(), key.port()),
            key.proto
        ));
    }
    Ok(out)
}

/// Local ports of the client pod's IPv6 UDP flows (outside the probes'
/// stage ports).
const FLOW_PORTS: std::ops::RangeInclusive<u16> = 61_101..=61_140;

/// The seed's dual-stack objects without pod-3 in its IPv6 EndpointSlice.
fn without_pod3_in_ipv6(objects: &mut [serde_json::Value]) {
    let pod3 = pod_ipv6(BACKENDS[2].1).to_string();
    for slice in objects.iter_mut().filter(|o| o["addressType"] == "IPv6") {
        if let Some(endpoints) = slice["endpoints"].as_array_mut() {
            endpoints.retain(|e| e["addresses"][0] != pod3.as_str());
        }
    }
}

/// A UDP flow of the IPv6 half whose endpoint leaves it moves on: from a
/// fixed local port of the client pod, a flow lands on pod-3; pod-3
/// leaves the IPv6 EndpointSlice (it still serves, and is still in the
/// IPv4 one); once new flows miss it, the same flow's next datagram is
/// answered by another pod. Without the agent deleting the flow's entry
/// from the IPv6 conntrack table, pod-3 would keep answering it.
fn ipv6_udp_flow_moves(bed: &mut AgentBed, objects: &mut [serde_json::Value]) -> Result<String> {
    let addr = SocketAddr::new(SEED_CLUSTER_IP6.into(), SEED_PORT);
    let pod3 = BACKENDS[2].0;
    let ask = |port: u16| -> Result<String> {
        Ok(bed
            .topo
            .client_pod
            .ns
            .run_in(|| netns::udp_request_from(port, addr, Duration::from_secs(1)))??)
    };
    let mut on_pod3 = None;
    for port in FLOW_PORTS {
        if ask(port)? == pod3 {
            on_pod3 = Some(port);
            break;
        }
    }
    let port = on_pod3.context("no flow landed on pod-3")?;
    without_pod3_in_ipv6(objects);
    bed.write_manifest("seed.yaml", &yaml_documents(objects))?;
    netns::wait_for("pod-3 to leave the IPv6 backends", READY_WITHIN, || {
        for _ in 0..30 {
            let answer = ask(0).map_err(|e| format!("{e:#}"))?;
            if answer == pod3 {
                return Err("pod-3 still answers new IPv6 flows".into());
            }
        }
        Ok(())
    })?;
    // The agent deletes the entries just after the sync that changed the
    // rules, so new flows may miss pod-3 a moment before. Asking again
    // keeps the entry alive (UDP timeout 30 s): only its deletion moves it.
    let answer = netns::wait_for(&format!("the flow from port {port} to move"), READY_WITHIN, || {
        let answer = ask(port).map_err(|e| format!("{e:#}"))?;
        if answer == pod3 {
            return Err(format!("still on {answer}"));
        }
        Ok(answer)
    })?;
    Ok(format!("the flow from port {port} moved from {pod3} to {answer}"))
}

fn dual_stack_seed(mode: Mode, test: &str) {
    if !require_root(test) || !mode.available(test) {
        return;
    }
    let mut bed = AgentBed::new(test).expect("building the test bed");
    let mut checks = Checks::new(test);
    let mut objects = seed_objects();
    checks.check(
        "the agent starts",
        start(&mut bed, mode, &objects).map(|()| "ready".to_owned()),
    );
    check_both_families(&bed, &mut checks);
    checks.check(
        "the IPv6 rules name the IPv6 ClusterIP",
        ipv6_rules(&bed, mode).and_then(|rules| {
            ensure!(rules.contains(&SEED_CLUSTER_IP6.to_string()), "{rules}");
            ensure!(
                !rules.contains(&SEED_CLUSTER_IP.to_string()),
                "IPv4 in the IPv6 rules: {rules}"
            );
            Ok(format!("{} lines", rules.lines().count()))
        }),
    );
    checks.check(
        "an IPv6 UDP flow leaves a gone endpoint",
        ipv6_udp_flow_moves(&mut bed, &mut objects),
    );
    let stopped = bed.stop_agent(libc::SIGTERM).context("stopping the agent");
    checks.check(
        "cleanup removes the IPv6 rules too",
        stopped.and_then(|_| bed.cleanup()).and_then(|_| {
            // nft: the table is gone, so listing it fails.
            let rules = ipv6_rules(&bed, mode).unwrap_or_default();
            ensure!(!rules.contains(&SEED_CLUSTER_IP6.to_string()), "left behind: {rules}");
            Ok("gone".to_owned())
        }),
    );
    if !checks.passed() {
        eprintln!("{}", bed.log());
    }
    checks.finish();
}

#[test]
fn iptables_dual_stack_seed() {
    dual_stack_seed(Mode::Iptables, "iptables_dual_stack_seed");
}

#[test]
fn nftables_dual_stack_seed() {
    dual_stack_seed(Mode::Nftables, "nftables_dual_stack_seed");
}

#[test]
fn ebpf_dual_stack_seed() {
    dual_stack_seed(Mode::Ebpf, "ebpf_dual_stack_seed");
}

/// `ranges6`: a dual-stack LoadBalancer Service with IPv6 source ranges
/// only; its LB IPs, the IPv6 ones each reached from one client source.
const RANGES_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 91);
const RANGES_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x91);
const RANGES_PORT: u16 = 91;
const RANGES_LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
/// Reached from the client's own address, inside [`INSIDE_RANGE6`].
const RANGES_LB_IP6_IN: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x78, 0, 0, 0, 0, 5);
/// Reached from [`OUTSIDE_SOURCE6`] (a route's `src`).
const RANGES_LB_IP6_OUT: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x78, 0, 0, 0, 0, 6);
/// The client link's network (`CLIENT_IP6`'s).
const INSIDE_RANGE6: &str = "fd00:30::/64";
const OUTSIDE_SOURCE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x31, 0, 0, 0, 0, 0, 1);

/// `local6`: a dual-stack LoadBalancer Service with
/// `externalTrafficPolicy: Local`, pod-1 on this node, the others not.
const LOCAL_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 92);
const LOCAL_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x92);
const LOCAL_PORT: u16 = 92;
const LOCAL_LB_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 7);
const OTHER_NODE: &str = "another-node";

/// A dual-stack LoadBalancer Service `name` on TCP `port` with `ingress`
/// IPs of both families.
fn lb_dual_stack(name: &str, ips: (Ipv4Addr, Ipv6Addr), port: u16, ingress: &[IpAddr]) -> serde_json::Value {
    let ports = [PortDef::tcp(port, TARGET_PORT, None)];
    let mut svc = dual_stack(service_with(name, ips.0, &ports, None), ips.1);
    svc["spec"]["type"] = "LoadBalancer".into();
    let ingress: Vec<serde_json::Value> = ingress
        .iter()
        .map(|ip| serde_json::json!({"ip": ip.to_string()}))
        .collect();
    svc["status"] = serde_json::json!({"loadBalancer": {"ingress": ingress}});
    svc
}

/// `ranges6` and `local6` with their slices of both families.
fn lb6_objects() -> Vec<serde_json::Value> {
    let ports = [PortDef::tcp(RANGES_PORT, TARGET_PORT, None)];
    let mut ranges = lb_dual_stack(
        "ranges6",
        (RANGES_CLUSTER_IP, RANGES_CLUSTER_IP6),
        RANGES_PORT,
        &[RANGES_LB_IP.into(), RANGES_LB_IP6_IN.into(), RANGES_LB_IP6_OUT.into()],
    );
    ranges["spec"]["loadBalancerSourceRanges"] = serde_json::json!([INSIDE_RANGE6]);
    let endpoints6: Vec<(Ipv6Addr, &str)> = backend_ips6().into_iter().map(|ip| (ip, NODE_NAME)).collect();
    let local_ports = [PortDef::tcp(LOCAL_PORT, TARGET_PORT, None)];
    let mut local = lb_dual_stack(
        "local6",
        (LOCAL_CLUSTER_IP, LOCAL_CLUSTER_IP6),
        LOCAL_PORT,
        &[LOCAL_LB_IP6.into()],
    );
    local["spec"]["externalTrafficPolicy"] = "Local".into();
    let local6: Vec<(Ipv6Addr, &str)> = (backend_ips6().into_iter().enumerate())
        .map(|(i, ip)| (ip, if i == 0 { NODE_NAME } else { OTHER_NODE }))
        .collect();
    vec![
        ranges,
        slice_with("ranges6-4", "ranges6", &ports, &on_node(&backend_ips())),
        slice6_with("ranges6-6", "ranges6", &ports, &endpoints6),
        local,
        slice6_with("local6-6", "local6", &local_ports, &local6),
    ]
}

/// The client's routes to the load balancer IPs, each IPv6 one with its
/// source: [`RANGES_LB_IP6_OUT`] from [`OUTSIDE_SOURCE6`], the others
/// from `CLIENT_IP6` (the node's default route takes the replies back to
/// the client).
fn route_lb_ips(topo: &Topology) -> Result<()> {
    topo.client
        .add_addr(&topo.client_if, &format!("{OUTSIDE_SOURCE6}/128"))?;
    topo.route_to_node(&[&format!("{RANGES_LB_IP}/32")])?;
    let via = NODE_IP6.to_string();
    for (to, src) in [
        (RANGES_LB_IP6_IN, CLIENT_IP6),
        (LOCAL_LB_IP6, CLIENT_IP6),
        (RANGES_LB_IP6_OUT, OUTSIDE_SOURCE6),
    ] {
        let (to, src) = (format!("{to}/128"), src.to_string());
        topo.client
            .add_route(&[&to, "via", &via, "dev", &topo.client_if, "src", &src])?;
    }
    Ok(())
}

/// A TCP connect from `from` to `addr` gets no answer at all (dropped).
fn no_answer(from: &testbed::netns::Netns, addr: SocketAddr) -> Result<String> {
    let result = from.run_in(|| netns::tcp_connect(addr, Duration::from_secs(2)))?;
    match result {
        Err(e) if e.kind() == io::ErrorKind::TimedOut || e.kind() == io::ErrorKind::WouldBlock => {
            Ok(format!("no answer ({e})"))
        }
        other => bail!("expected a timeout, got {other:?}"),
    }
}

/// The data path's `drop_source_range` packets, from the agent's metrics.
fn source_range_drops(bed: &AgentBed) -> Result<f64> {
    let metrics = bed.metrics()?;
    Ok((metrics.labeled(DATAPATH_PACKETS, "verdict=\"drop_source_range\"")).unwrap_or(0.0))
}

/// `XP_SRC_RANGES6`'s networks, sorted (each once per LB IP frontend).
fn ranges6_read_back(bed: &AgentBed) -> Result<Vec<String>> {
    use proxy_common::{SourceRange6Data, SourceRange6Key, maps};
    let map = proxy_userspace::mode::ebpf::pinned(bed.pin_path(), maps::SOURCE_RANGES6)?;
    let trie: aya::maps::LpmTrie<_, SourceRange6Data, u8> = aya::maps::LpmTrie::try_from(map)?;
    let mut out = Vec::new();
    for key in trie.keys() {
        let key = key.context("reading XP_SRC_RANGES6")?;
        let data = key.data();
        let key = SourceRange6Key {
            prefix_len: key.prefix_len(),
            rev_nat_id_be: data.rev_nat_id_be,
            addr_be: data.addr_be,
        };
        out.push(format!("{}/{}", key.addr(), key.range_len()));
    }
    out.sort();
    Ok(out)
}

/// `XP_POD_CIDRS6` as networks, sorted.
fn pod_cidrs6_read_back(bed: &AgentBed) -> Result<Vec<String>> {
    use proxy_common::{ipv6::ipv6_of, maps};
    let map = proxy_userspace::mode::ebpf::pinned(bed.pin_path(), maps::POD_CIDRS6)?;
    let trie: aya::maps::LpmTrie<_, [u32; 4], u8> = aya::maps::LpmTrie::try_from(map)?;
    let mut out = Vec::new();
    for key in trie.keys() {
        let key = key.context("reading XP_POD_CIDRS6")?;
        out.push(format!("{}/{}", ipv6_of(key.data()), key.prefix_len()));
    }
    out.sort();
    Ok(out)
}

fn check_source_ranges6(bed: &AgentBed, checks: &mut Checks) {
    let client = &bed.topo.client;
    let inside = SocketAddr::new(RANGES_LB_IP6_IN.into(), RANGES_PORT);
    checks.check(
        &format!("client (inside {INSIDE_RANGE6}) -> {inside}: every backend answers"),
        expect_all_backends(client, Protocol::Tcp, inside),
    );
    let outside = SocketAddr::new(RANGES_LB_IP6_OUT.into(), RANGES_PORT);
    let drops_before = source_range_drops(bed);
    checks.check(
        &format!("{OUTSIDE_SOURCE6} (outside the ranges) -> {outside}: dropped, counted as drop_source_range"),
        no_answer(client, outside).and_then(|answer| {
            let (before, after) = (drops_before?, source_range_drops(bed)?);
            ensure!(after > before, "drop_source_range {before} -> {after}");
            Ok(format!("{answer}; drop_source_range {before} -> {after}"))
        }),
    );
    let v4 = SocketAddr::new(RANGES_LB_IP.into(), RANGES_PORT);
    checks.check(
        &format!("{CLIENT_IP} -> {v4} (no IPv4 range): every backend answers"),
        expect_all_backends(client, Protocol::Tcp, v4),
    );
    checks.check(
        "XP_SRC_RANGES6 holds the range and the IPv6 LB IPs",
        ranges6_read_back(bed).and_then(|found| {
            // Under each of the two IPv6 LB IPs' frontend ids.
            let once = ["2001:db8:78::5/128", "2001:db8:78::6/128", INSIDE_RANGE6];
            let want: Vec<String> = once.iter().flat_map(|n| [n.to_string(), n.to_string()]).collect();
            ensure!(found == want, "{found:?}");
            Ok(found.join(", "))
        }),
    );
}

fn check_local_short_circuit6(bed: &AgentBed, checks: &mut Checks) {
    let topo = &bed.topo;
    let lb = SocketAddr::new(LOCAL_LB_IP6.into(), LOCAL_PORT);
    let local = [BACKENDS[0].0];
    checks.check(
        &format!("client -> eTP Local {lb}: only the node's endpoint"),
        expect_backends(&topo.client, Protocol::Tcp, lb, &local, probe::REQUESTS / 3),
    );
    checks.check(
        &format!("client pod -> eTP Local {lb}: every endpoint (short-circuited)"),
        expect_all_backends(&topo.client_pod.ns, Protocol::Tcp, lb),
    );
    checks.check(
        "XP_POD_CIDRS6 holds the IPv6 clusterCIDR",
        pod_cidrs6_read_back(bed).and_then(|found| {
            ensure!(found == [POD_CIDR6], "{found:?}");
            Ok(found.join(", "))
        }),
    );
}

#[test]
fn ebpf_ipv6_source_ranges_and_local_short_circuit() {
    let test = "ebpf_ipv6_source_ranges_and_local_short_circuit";
    if !require_root(test) || !Mode::Ebpf.available(test) {
        return;
    }
    let mut bed = AgentBed::new(test).expect("building the test bed");
    let mut checks = Checks::new(test);
    let mut objects = seed_objects_dual_stack(&seed_tcp_udp());
    objects.extend(lb6_objects());
    let started = route_lb_ips(&bed.topo).and_then(|()| {
        bed.write_manifest("seed.yaml", &yaml_documents(&objects))?;
        let mut args = bed.manifest_args();
        let cidrs = format!("{POD_CIDR},{POD_CIDR6}");
        args.extend([
            "--node-ip".to_owned(),
            NODE_IP6.to_string(),
            "--cluster-cidr".to_owned(),
            cidrs,
        ]);
        bed.start_agent_in(Mode::Ebpf.name(), &args)?;
        bed.wait_first_sync(READY_WITHIN)?;
        bed.wait_answering(seed_node_port(), READY_WITHIN)
    });
    checks.check("the agent starts", started.map(|_| "ready".to_owned()));
    check_source_ranges6(&bed, &mut checks);
    check_local_short_circuit6(&bed, &mut checks);
    if !checks.passed() {
        eprintln!("{}", bed.log());
    }
    checks.finish();
}
