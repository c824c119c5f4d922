//! The IPVS mode against a real kernel with IPVS, in a fresh network
//! namespace: the seed Service read back with `ipvsadm -Ln` (virtual
//! servers, real servers, scheduler), `kube-ipvs0` holding the ClusterIP,
//! the ipsets and constant iptables rules; a partial sync touching only the
//! changed real servers; a terminating endpoint draining with weight 0; a
//! full sync that finds everything in place writing nothing; a scheduler
//! change; removal; cleanup leaving no virtual server, no `kube-ipvs0`, no
//! `KUBE-` chain or ipset. (The seed scenario through the agent in IPVS
//! mode is in `modes.rs`, with every other mode.)
//!
//! The Service API (issue 12) on the seed test bed with real traffic: a
//! LoadBalancer Service with an external IP, source ranges, ClientIP
//! affinity and `externalTrafficPolicy: Local` read back (`ipvsadm -Ln`
//! with persistence, `ipset save`, `iptables-save`, `kube-ipvs0`) and
//! tried from the client outside, a pod and the node.
//!
//! This machine's kernel may have no IPVS: the tests run where
//! `XPROXY_IPVS_TESTS=1` (set by `cargo xtask vm`, whose 6.1 guest loads
//! `ip_vs`) and fail there if IPVS is missing; elsewhere they run only when
//! `/proc/net/ip_vs` exists and are skipped with a message otherwise.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddrV4},
    path::Path,
    sync::Arc,
    time::Duration,
};

use anyhow::Result;
use proxy_userspace::{
    mode::{
        Dataplane, Plan,
        ipvs::{self, IpvsMode, IpvsOptions, NoIpvs, netlink::Ipvs, node_ips::NodePortAddresses, rules::RuleOptions},
        options::LocalTraffic,
    },
    model::{Endpoint, IPV6_SUFFIX, IpFamily, Protocol, ServicePort, SourceRange, TrafficPolicy},
};
use testbed::{
    agent_bed::ipvs_virtual_servers,
    netns::{self, Netns},
    privileged::{require_ipvs, require_root},
    topology::{BACKENDS, Offloads, TARGET_PORT, Topology},
};

const SEED_NAME: &str = "default/nginx-service";
const NODE_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);

fn endpoint(last: u8) -> Endpoint {
    Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
}

fn seed(endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: SEED_NAME.into(),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 88).into(),
        port: 88,
        node_port: Some(30791),
        endpoints,
        ..ServicePort::default()
    }
}

fn options(scheduler: &str) -> IpvsOptions {
    IpvsOptions {
        scheduler: scheduler.into(),
        node_ports: NodePortAddresses::Fixed(vec![NODE_IP.into()]),
        exclude_cidrs: Vec::new(),
        rules: RuleOptions {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
            local_traffic_v6: Some(LocalTraffic::Cidr("fd00:10:244::/56".parse().expect("cidr"))),
        },
        timeouts: (900, 120, 300),
        strict_arp: true,
        node_name: None,
    }
}

fn run_in_ns(ns: &Netns, program: &str, args: &[&str]) -> String {
    let mut cmd = ns.command(program).expect("a command in the namespace");
    cmd.args(args);
    netns::run(&mut cmd).unwrap_or_else(|e| panic!("{program} {args:?}: {e:#}"))
}

/// `ipvsadm -Ln` in `ns`, parsed.
fn ipvsadm(ns: &Netns) -> BTreeMap<String, Vec<String>> {
    let text = run_in_ns(ns, "ipvsadm", &["-Ln"]);
    eprintln!("ipvsadm -Ln:\n{text}");
    ipvs_virtual_servers(&text)
}

fn expected(scheduler: &str, reals: &[(&str, u32)]) -> BTreeMap<String, Vec<String>> {
    ["10.96.0.88:88", "172.30.0.2:30791"]
        .into_iter()
        .map(|vs| {
            (
                format!("TCP {vs} {scheduler}"),
                reals.iter().map(|(real, w)| format!("{real} {w}")).collect(),
            )
        })
        .collect()
}

fn in_ns<R: Send>(ns: &Netns, f: impl FnOnce() -> R + Send) -> R {
    ns.run_in(f).expect("entering the namespace")
}

#[test]
fn seed_partial_updates_draining_and_cleanup() {
    if !require_ipvs("seed_partial_updates_draining_and_cleanup") {
        return;
    }
    let ns = Netns::new("ipvs-").expect("a namespace");
    let mut mode = in_ns(&ns, || IpvsMode::start(options("rr"))).expect("starting the ipvs mode");

    // The seed: two virtual servers, three real servers each.
    let port = seed(vec![endpoint(11), endpoint(12), endpoint(13)]);
    let desired = BTreeMap::from([(SEED_NAME.to_owned(), port.clone())]);
    in_ns(&ns, || mode.apply_full(&desired)).expect("full sync");
    let three = [("10.244.0.11:80", 1), ("10.244.0.12:80", 1), ("10.244.0.13:80", 1)];
    assert_eq!(ipvsadm(&ns), expected("rr", &three));
    let addrs = ns
        .ip(&["-4", "-o", "addr", "show", "dev", "kube-ipvs0"])
        .expect("ip addr");
    assert!(
        addrs.contains("10.96.0.88/32"),
        "kube-ipvs0 lacks the ClusterIP:\n{addrs}"
    );
    let sets = run_in_ns(&ns, "ipset", &["save"]);
    for entry in [
        "add KUBE-CLUSTER-IP 10.96.0.88,tcp:88",
        "add KUBE-NODE-PORT-TCP 30791",
        "add KUBE-LOOP-BACK 10.244.0.11,tcp:80,10.244.0.11",
    ] {
        assert!(sets.lines().any(|l| l == entry), "missing {entry} in\n{sets}");
    }
    let rules = run_in_ns(&ns, "iptables-save", &[]);
    eprintln!("iptables-save:\n{rules}");
    for needle in [
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        "--match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
        "--match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE",
    ] {
        assert!(rules.contains(needle), "missing {needle} in\n{rules}");
    }

    // The timeouts and strictARP.
    let timeouts = run_in_ns(&ns, "ipvsadm", &["-L", "--timeout"]);
    assert!(
        timeouts.contains("Timeout (tcp tcpfin udp): 900 120 300"),
        "unexpected timeouts: {timeouts}"
    );
    assert_eq!(
        ns.sysctl_get("net.ipv4.conf.all.arp_ignore").expect("sysctl").trim(),
        "1"
    );

    // A full sync removes a stale virtual server of the mode's (on a node
    // IP) but leaves someone else's alone.
    run_in_ns(&ns, "ipvsadm", &["-A", "-t", "172.30.0.2:30999", "-s", "rr"]);
    run_in_ns(&ns, "ipvsadm", &["-A", "-t", "192.0.2.1:80", "-s", "rr"]);
    in_ns(&ns, || mode.apply_full(&desired)).expect("full sync with strangers");
    let mut with_foreign = expected("rr", &three);
    with_foreign.insert("TCP 192.0.2.1:80 rr".into(), Vec::new());
    assert_eq!(ipvsadm(&ns), with_foreign);
    run_in_ns(&ns, "ipvsadm", &["-D", "-t", "192.0.2.1:80"]);

    // Nothing changed: a full sync writes nothing.
    let before = mode.kernel_writes();
    in_ns(&ns, || mode.apply_full(&desired)).expect("idle full sync");
    assert_eq!(mode.kernel_writes(), before, "an idle full sync wrote something");

    // One endpoint replaced: per virtual server one real server deleted and
    // one added, plus the KUBE-LOOP-BACK set swapped; nothing else.
    let port = seed(vec![endpoint(11), endpoint(12), endpoint(14)]);
    let before = mode.kernel_writes();
    in_ns(&ns, || {
        mode.apply(&Plan {
            upsert: vec![port.clone()],
            remove: vec![],
        })
    })
    .expect("partial sync");
    assert_eq!(mode.kernel_writes() - before, 2 * 2 + 1);
    let replaced = [("10.244.0.11:80", 1), ("10.244.0.12:80", 1), ("10.244.0.14:80", 1)];
    assert_eq!(ipvsadm(&ns), expected("rr", &replaced));

    // A terminating endpoint drains: weight 0, still listed.
    let mut draining = endpoint(12);
    draining.ready = false;
    draining.terminating = true;
    let port = seed(vec![endpoint(11), draining, endpoint(14)]);
    let before = mode.kernel_writes();
    in_ns(&ns, || {
        mode.apply(&Plan {
            upsert: vec![port.clone()],
            remove: vec![],
        })
    })
    .expect("partial sync");
    assert_eq!(
        mode.kernel_writes() - before,
        2 + 1,
        "one weight per virtual server and KUBE-LOOP-BACK"
    );
    let drained = [("10.244.0.11:80", 1), ("10.244.0.12:80", 0), ("10.244.0.14:80", 1)];
    assert_eq!(ipvsadm(&ns), expected("rr", &drained));

    // Another agent configured with another scheduler adopts the table.
    drop(mode);
    let mut mode = in_ns(&ns, || IpvsMode::start(options("wlc"))).expect("restarting with wlc");
    let desired = BTreeMap::from([(SEED_NAME.to_owned(), port.clone())]);
    in_ns(&ns, || mode.apply_full(&desired)).expect("full sync with wlc");
    assert_eq!(ipvsadm(&ns), expected("wlc", &drained));

    // Removal.
    in_ns(&ns, || {
        mode.apply(&Plan {
            upsert: vec![],
            remove: vec![port.clone()],
        })
    })
    .expect("removal");
    assert_eq!(ipvsadm(&ns), BTreeMap::new());
    let addrs = ns
        .ip(&["-4", "-o", "addr", "show", "dev", "kube-ipvs0"])
        .expect("ip addr");
    assert!(!addrs.contains("10.96.0.88"), "the ClusterIP is still bound:\n{addrs}");
    let sets = run_in_ns(&ns, "ipset", &["save"]);
    assert!(!sets.contains("add KUBE-"), "ipsets still hold entries:\n{sets}");

    // Cleanup leaves nothing, and a second one finds nothing.
    in_ns(&ns, || mode.apply_full(&desired)).expect("full sync before cleanup");
    drop(mode);
    in_ns(&ns, ipvs::cleanup).expect("cleanup");
    in_ns(&ns, ipvs::cleanup).expect("cleanup again");
    assert_eq!(ipvsadm(&ns), BTreeMap::new());
    let links = ns.ip(&["-o", "link", "show"]).expect("ip link");
    assert!(!links.contains("kube-ipvs0"), "kube-ipvs0 left:\n{links}");
    let rules = run_in_ns(&ns, "iptables-save", &[]);
    assert!(!rules.contains("KUBE-"), "KUBE- rules left:\n{rules}");
    let sets = run_in_ns(&ns, "ipset", &["save"]);
    assert!(!sets.contains("KUBE-"), "KUBE- ipsets left:\n{sets}");
}

/// The seed's IPv6 port, as a dual-stack Service yields it.
fn seed6(endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: format!("{SEED_NAME}{IPV6_SUFFIX}"),
        cluster_ip: ip6("fd00:96::88"),
        ..seed(endpoints)
    }
}

fn ip6(text: &str) -> IpAddr {
    text.parse().expect("an IPv6 address")
}

fn endpoint6(last: u8) -> Endpoint {
    Endpoint::ready(ip6(&format!("fd00:10:244::{last:x}")), 80)
}

/// A dual-stack seed: both ports programmed side by side and read back
/// from the kernel per family (`ipvsadm -Ln` with IPv6 virtual and real
/// servers, the /128 on `kube-ipvs0`, kube-proxy's `KUBE-6-*` ipsets of
/// `family inet6`, the constant rules in `ip6tables-save`); ClientIP
/// affinity on the IPv6 port alone; removing it leaves IPv4 untouched;
/// cleanup removes both families.
#[test]
fn dual_stack_seed_in_both_families() {
    if !require_ipvs("dual_stack_seed_in_both_families") {
        return;
    }
    let ns = Netns::new("ipvs6-").expect("a namespace");
    let mut opts = options("rr");
    opts.node_ports = NodePortAddresses::Fixed(vec![NODE_IP.into(), ip6("fd00:30::2")]);
    let mut mode = in_ns(&ns, || IpvsMode::start(opts)).expect("starting the ipvs mode");
    assert_eq!(mode.families(), [IpFamily::V4, IpFamily::V6]);

    let v4 = seed(vec![endpoint(11), endpoint(12)]);
    let mut v6 = seed6(vec![endpoint6(0x11), endpoint6(0x12)]);
    let desired = BTreeMap::from([(v4.name.clone(), v4.clone()), (v6.name.clone(), v6.clone())]);
    in_ns(&ns, || mode.apply_full(&desired)).expect("full sync");
    let reals4 = vec!["10.244.0.11:80 1".to_owned(), "10.244.0.12:80 1".to_owned()];
    let reals6 = vec!["[fd00:10:244::11]:80 1".to_owned(), "[fd00:10:244::12]:80 1".to_owned()];
    let both = BTreeMap::from([
        ("TCP 10.96.0.88:88 rr".to_owned(), reals4.clone()),
        ("TCP 172.30.0.2:30791 rr".to_owned(), reals4.clone()),
        ("TCP [fd00:96::88]:88 rr".to_owned(), reals6.clone()),
        ("TCP [fd00:30::2]:30791 rr".to_owned(), reals6),
    ]);
    assert_eq!(ipvsadm(&ns), both);
    let addrs = ns
        .ip(&["-6", "-o", "addr", "show", "dev", "kube-ipvs0"])
        .expect("ip addr");
    assert!(
        addrs.contains("fd00:96::88/128"),
        "kube-ipvs0 lacks the IPv6 ClusterIP:\n{addrs}"
    );
    assert!(!addrs.contains("tentative"), "the ClusterIP waits for DAD:\n{addrs}");
    let sets = run_in_ns(&ns, "ipset", &["save"]);
    assert!(
        sets.contains("create KUBE-6-CLUSTER-IP hash:ip,port family inet6 "),
        "no IPv6 ClusterIP set in\n{sets}"
    );
    assert_lines(
        &sets,
        &[
            "add KUBE-6-CLUSTER-IP fd00:96::88,tcp:88",
            "add KUBE-6-NODE-PORT-TCP 30791",
            "add KUBE-6-LOOP-BACK fd00:10:244::11,tcp:80,fd00:10:244::11",
            "add KUBE-CLUSTER-IP 10.96.0.88,tcp:88",
        ],
        "ipset save",
    );
    let rules6 = run_in_ns(&ns, "ip6tables-save", &[]);
    for needle in [
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        "--match-set KUBE-6-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ",
        "--match-set KUBE-6-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
        "--match-set KUBE-6-LOOP-BACK dst,dst,src -j MASQUERADE",
    ] {
        assert!(rules6.contains(needle), "missing {needle} in\n{rules6}");
    }
    let before = mode.kernel_writes();
    in_ns(&ns, || mode.apply_full(&desired)).expect("idle full sync");
    assert_eq!(mode.kernel_writes(), before, "an idle full sync wrote something");

    // Affinity on the IPv6 port: its virtual servers turn persistent
    // (one template per client /128), the IPv4 ones stay as they were.
    v6.affinity = Some(Duration::from_secs(10_800));
    upsert(&ns, &mut mode, &v6);
    assert!(ipvsadm_line(&ns, "[fd00:96::88]:88").ends_with("persistent 10800"));
    assert!(!ipvsadm_line(&ns, "10.96.0.88:88").contains("persistent"));

    // The IPv6 port leaves: its virtual servers, address and entries go.
    in_ns(&ns, || {
        mode.apply(&Plan {
            upsert: vec![],
            remove: vec![v6.clone()],
        })
    })
    .expect("removal");
    let only4 = BTreeMap::from([
        ("TCP 10.96.0.88:88 rr".to_owned(), reals4.clone()),
        ("TCP 172.30.0.2:30791 rr".to_owned(), reals4),
    ]);
    assert_eq!(ipvsadm(&ns), only4);
    let addrs = ns
        .ip(&["-6", "-o", "addr", "show", "dev", "kube-ipvs0"])
        .expect("ip addr");
    assert!(
        !addrs.contains("fd00:96::88"),
        "the IPv6 ClusterIP is still bound:\n{addrs}"
    );
    let sets = run_in_ns(&ns, "ipset", &["save"]);
    assert!(!sets.contains("add KUBE-6-"), "IPv6 sets still hold entries:\n{sets}");

    drop(mode);
    in_ns(&ns, ipvs::cleanup).expect("cleanup");
    assert_eq!(ipvsadm(&ns), BTreeMap::new());
    let rules6 = run_in_ns(&ns, "ip6tables-save", &[]);
    assert!(!rules6.contains("KUBE-"), "KUBE- rules left:\n{rules6}");
    let sets = run_in_ns(&ns, "ipset", &["save"]);
    assert!(!sets.contains("KUBE-"), "KUBE- ipsets left:\n{sets}");
}

/// Without IPVS the mode refuses to start with [`NoIpvs`] (what `xproxy
/// run --mode ipvs` turns into exit code 6). Runs only where IPVS is absent.
#[test]
fn a_kernel_without_ipvs_is_reported() -> Result<()> {
    if Path::new("/proc/net/ip_vs").exists() || std::env::var("XPROXY_IPVS_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("skipping a_kernel_without_ipvs_is_reported: this kernel has IPVS");
        return Ok(());
    }
    let error = Ipvs::open().err().expect("IPVS opened on a kernel without it");
    assert!(error.is::<NoIpvs>(), "unexpected error: {error:#}");
    // Cleanup is harmless without IPVS.
    if require_root("a_kernel_without_ipvs_is_reported") {
        let ns = Netns::new("noipvs-")?;
        in_ns(&ns, ipvs::cleanup)?;
    }
    Ok(())
}

const LB_NAME: &str = "default/lb";
const LB_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 90);
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const LB_NODE_PORT: u16 = 30_790;
/// An address the node gets after the mode started, inside
/// `nodePortAddresses`.
const LATE_NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
const THIS_NODE: &str = "node-a";
const WAIT: Duration = Duration::from_secs(2);

fn range(addr: [u8; 4], prefix_len: u8) -> SourceRange {
    SourceRange {
        addr: addr.into(),
        prefix_len,
    }
}

/// The LoadBalancer Service on the seed bed: pod-1 on this node, the
/// others on another; the client's network allowed; affinity for 30 s.
fn load_balancer() -> ServicePort {
    let endpoints = BACKENDS
        .iter()
        .enumerate()
        .map(|(i, (_, ip))| Endpoint {
            node_name: Some(Arc::from(if i == 0 { THIS_NODE } else { "node-b" })),
            ..Endpoint::ready(*ip, TARGET_PORT)
        })
        .collect();
    ServicePort {
        name: LB_NAME.into(),
        protocol: Protocol::Tcp,
        cluster_ip: LB_CLUSTER_IP.into(),
        port: 88,
        node_port: Some(LB_NODE_PORT),
        endpoints,
        external_ips: vec![EXTERNAL_IP.into()],
        load_balancer_ips: vec![LB_IP.into()],
        source_ranges: vec![range([172, 30, 0, 0], 24)],
        affinity: Some(Duration::from_secs(30)),
        ..ServicePort::default()
    }
}

fn upsert(ns: &Netns, mode: &mut IpvsMode, port: &ServicePort) {
    let plan = Plan {
        upsert: vec![port.clone()],
        remove: vec![],
    };
    in_ns(ns, || mode.apply(&plan)).expect("partial sync");
}

/// The pods answering `count` requests from `from` to `ip:port`.
fn answers(from: &Netns, ip: Ipv4Addr, port: u16, count: usize) -> Vec<String> {
    (0..count)
        .map(|_| {
            from.tcp_request(SocketAddrV4::new(ip, port), WAIT)
                .expect("entering the namespace")
                .unwrap_or_else(|e| panic!("{ip}:{port} did not answer: {e}"))
        })
        .collect()
}

fn distinct(answers: &[String]) -> BTreeSet<&str> {
    answers.iter().map(String::as_str).collect()
}

fn refused_or_dropped(from: &Netns, ip: Ipv4Addr, port: u16) -> bool {
    from.tcp_request(SocketAddrV4::new(ip, port), Duration::from_secs(1))
        .expect("entering the namespace")
        .is_err()
}

/// `ipvsadm -Ln`'s line for virtual server `vs` (`ADDR:PORT`).
fn ipvsadm_line(ns: &Netns, vs: &str) -> String {
    let text = run_in_ns(ns, "ipvsadm", &["-Ln"]);
    text.lines()
        .find(|l| l.split_whitespace().nth(1) == Some(vs))
        .unwrap_or_else(|| panic!("no virtual server {vs} in\n{text}"))
        .to_owned()
}

fn assert_lines(text: &str, lines: &[&str], what: &str) {
    for line in lines {
        assert!(text.lines().any(|l| l == *line), "missing {line} in {what}:\n{text}");
    }
}

/// Issue 12 in the IPVS mode on the seed test bed: read-backs of a
/// LoadBalancer Service with an external IP, source ranges, ClientIP
/// affinity and externalTrafficPolicy: Local, then each feature live.
#[test]
fn load_balancer_external_ips_source_ranges_affinity_and_local_policy() {
    if !require_ipvs("load_balancer_external_ips_source_ranges_affinity_and_local_policy") {
        return;
    }
    let bed = Topology::build(Offloads::On).expect("the seed test bed");
    for net in [LB_IP.to_string(), EXTERNAL_IP.to_string(), "192.168.77.0/24".into()] {
        bed.client
            .add_route(&[&net, "via", "172.30.0.2"])
            .expect("a client route");
    }
    let mut opts = options("rr");
    opts.node_name = Some(THIS_NODE.into());
    opts.node_ports = NodePortAddresses::Local(Some(vec![
        "172.30.0.0/24".parse().expect("cidr"),
        "192.168.77.0/24".parse().expect("cidr"),
    ]));
    let mut mode = in_ns(&bed.node, || IpvsMode::start(opts)).expect("starting the ipvs mode");
    let mut port = load_balancer();
    let desired = BTreeMap::from([(LB_NAME.to_owned(), port.clone())]);
    in_ns(&bed.node, || mode.apply_full(&desired)).expect("full sync");

    read_back(&bed.node);
    affinity_and_release(&bed, &mut mode, &mut port);
    source_ranges(&bed, &mut mode, &mut port);
    local_policy(&bed, &mut mode, &mut port);
    late_node_address(&bed, &mut mode, &port);
    conflicts_are_reported_once(&bed, &mut mode, &port);

    drop(mode);
    in_ns(&bed.node, ipvs::cleanup).expect("cleanup");
    let rules = run_in_ns(&bed.node, "iptables-save", &[]);
    assert!(!rules.contains("KUBE-"), "KUBE- rules left:\n{rules}");
}

/// What the Service looks like in `ipvsadm -Ln`, `ipset save`,
/// `iptables-save` and on kube-ipvs0.
fn read_back(node: &Netns) {
    for vs in ["10.96.0.90:88", "192.0.2.10:88", "198.51.100.7:88", "172.30.0.2:30790"] {
        let line = ipvsadm_line(node, vs);
        assert!(
            line.ends_with("rr persistent 30"),
            "{vs} is not persistent for 30 s: {line}"
        );
    }
    let sets = run_in_ns(node, "ipset", &["save"]);
    assert_lines(
        &sets,
        &[
            "add KUBE-LOAD-BALANCER 192.0.2.10,tcp:88",
            "add KUBE-LOAD-BALANCER-FW 192.0.2.10,tcp:88",
            "add KUBE-LOAD-BALANCER-SOURCE-CIDR 192.0.2.10,tcp:88,172.30.0.0/24",
            // The range holds the node's address: its own traffic passes.
            "add KUBE-LOAD-BALANCER-SOURCE-IP 192.0.2.10,tcp:88,192.0.2.10",
            "add KUBE-EXTERNAL-IP 198.51.100.7,tcp:88",
        ],
        "ipset save",
    );
    let rules = run_in_ns(node, "iptables-save", &[]);
    assert_lines(
        &rules,
        &[
            "-A INPUT -m comment --comment \"kube-proxy firewall rules\" -j KUBE-PROXY-FIREWALL",
            "-A KUBE-SERVICES -m comment --comment \"Kubernetes service lb portal\" -m set --match-set KUBE-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER",
            "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP",
        ],
        "iptables-save",
    );
    let addrs = node
        .ip(&["-4", "-o", "addr", "show", "dev", "kube-ipvs0"])
        .expect("ip addr");
    for ip in ["10.96.0.90/32", "192.0.2.10/32", "198.51.100.7/32"] {
        assert!(addrs.contains(ip), "kube-ipvs0 lacks {ip}:\n{addrs}");
    }
}

/// ClientIP affinity: one pod per client; switched off, the scheduler
/// spreads again; on again, sticky again; a removed pod releases its
/// clients, who then stick to another.
fn affinity_and_release(bed: &Topology, mode: &mut IpvsMode, port: &mut ServicePort) {
    let sticky = answers(&bed.client, LB_IP, 88, 6);
    assert_eq!(distinct(&sticky).len(), 1, "affinity through the LB IP: {sticky:?}");
    let external = answers(&bed.client, EXTERNAL_IP, 88, 4);
    assert_eq!(
        distinct(&external).len(),
        1,
        "affinity through the external IP: {external:?}"
    );

    port.affinity = None;
    upsert(&bed.node, mode, port);
    assert!(
        ipvsadm_line(&bed.node, "192.0.2.10:88").ends_with("rr"),
        "persistence left on"
    );
    let spread = answers(&bed.client, LB_IP, 88, 6);
    assert_eq!(distinct(&spread).len(), 3, "round robin without affinity: {spread:?}");

    port.affinity = Some(Duration::from_secs(30));
    upsert(&bed.node, mode, port);
    let pinned = answers(&bed.client, LB_IP, 88, 4);
    assert_eq!(distinct(&pinned).len(), 1, "affinity on again: {pinned:?}");

    // IPVS forgets a client's persistence template when the real server it
    // names is gone (the template is checked at the next connection).
    let gone = pinned[0].clone();
    let kept: Vec<Endpoint> = port
        .endpoints
        .iter()
        .filter(|e| BACKENDS.iter().any(|(name, ip)| *ip == e.addr && *name != gone))
        .cloned()
        .collect();
    let all = std::mem::replace(&mut port.endpoints, kept);
    upsert(&bed.node, mode, port);
    let moved = answers(&bed.client, LB_IP, 88, 4);
    assert_eq!(distinct(&moved).len(), 1, "sticky to the next pod: {moved:?}");
    assert_ne!(moved[0], gone, "the removed pod still answers");
    port.endpoints = all;
    upsert(&bed.node, mode, port);
}

/// loadBalancerSourceRanges: the LB IP drops clients outside the ranges,
/// pods too; node ports, external IPs and the ClusterIP stay open. The
/// node's own connections are not filtered, as in kube-proxy's IPVS mode:
/// IPVS translates them at LOCAL_OUT, so no filter hook sees the LB IP.
fn source_ranges(bed: &Topology, mode: &mut IpvsMode, port: &mut ServicePort) {
    port.source_ranges = vec![range([203, 0, 113, 0], 24)];
    upsert(&bed.node, mode, port);
    assert!(
        refused_or_dropped(&bed.client, LB_IP, 88),
        "the LB IP let an outside client in"
    );
    assert!(
        refused_or_dropped(&bed.client_pod.ns, LB_IP, 88),
        "the LB IP let a pod in"
    );
    answers(&bed.node, LB_IP, 88, 1);
    answers(&bed.client, EXTERNAL_IP, 88, 1);
    answers(&bed.client, Ipv4Addr::new(172, 30, 0, 2), LB_NODE_PORT, 1);
    answers(&bed.client_pod.ns, LB_CLUSTER_IP, 88, 1);

    port.source_ranges = vec![range([172, 30, 0, 0], 24)];
    upsert(&bed.node, mode, port);
    answers(&bed.client, LB_IP, 88, 1);
}

/// externalTrafficPolicy: Local: the LB IP, external IP and node port
/// reach this node's pod only, without masquerade.
fn local_policy(bed: &Topology, mode: &mut IpvsMode, port: &mut ServicePort) {
    port.external_policy = TrafficPolicy::Local;
    port.affinity = None;
    upsert(&bed.node, mode, port);
    let sets = run_in_ns(&bed.node, "ipset", &["save"]);
    assert_lines(
        &sets,
        &[
            "add KUBE-LOAD-BALANCER-LOCAL 192.0.2.10,tcp:88",
            "add KUBE-EXTERNAL-IP-LOCAL 198.51.100.7,tcp:88",
        ],
        "ipset save",
    );
    for ip in [LB_IP, EXTERNAL_IP] {
        let local = answers(&bed.client, ip, 88, 4);
        assert_eq!(distinct(&local), BTreeSet::from([BACKENDS[0].0]), "{ip}: {local:?}");
    }
    let node_port = answers(&bed.client, Ipv4Addr::new(172, 30, 0, 2), LB_NODE_PORT, 3);
    assert_eq!(distinct(&node_port), BTreeSet::from([BACKENDS[0].0]));
    port.external_policy = TrafficPolicy::Cluster;
    upsert(&bed.node, mode, port);
}

/// nodePortAddresses: an address added after start gets the node ports at
/// the next sync, a partial one too (the addresses are read again at every
/// sync); once the address is gone, a full sync removes them again.
fn late_node_address(bed: &Topology, mode: &mut IpvsMode, port: &ServicePort) {
    let late = format!("{LATE_NODE_IP}/24");
    bed.node.add_addr(&bed.uplink, &late).expect("a new node address");
    upsert(&bed.node, mode, port);
    ipvsadm_line(&bed.node, "192.168.77.2:30790");
    answers(&bed.client, LATE_NODE_IP, LB_NODE_PORT, 1);

    bed.node
        .ip(&["addr", "del", &late, "dev", &bed.uplink])
        .expect("removing the address");
    let desired = BTreeMap::from([(LB_NAME.to_owned(), port.clone())]);
    in_ns(&bed.node, || mode.apply_full(&desired)).expect("full sync");
    let servers = ipvsadm(&bed.node);
    assert!(
        !servers.keys().any(|vs| vs.contains("192.168.77.2")),
        "a node port stayed on a removed address: {servers:?}"
    );
}

/// A field the mode cannot honour (an external IP whose virtual server
/// another Service has) is reported once, not at every sync.
fn conflicts_are_reported_once(bed: &Topology, mode: &mut IpvsMode, port: &ServicePort) {
    let _ = mode.take_problems();
    let other = ServicePort {
        name: "default/other".into(),
        cluster_ip: Ipv4Addr::new(10, 96, 0, 91).into(),
        node_port: None,
        external_ips: vec![LB_IP.into()],
        load_balancer_ips: Vec::new(),
        source_ranges: Vec::new(),
        ..port.clone()
    };
    upsert(&bed.node, mode, &other);
    let problems = mode.take_problems();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].object, "default/other");
    upsert(&bed.node, mode, &other);
    assert!(mode.take_problems().is_empty(), "reported twice");
}
