//! The IPVS mode against a real kernel with IPVS, in a fresh network
//! namespace: the seed Service read back with `ipvsadm -Ln` (virtual
//! servers, real servers, scheduler), `kube-ipvs0` holding the ClusterIP,
//! the ipsets and constant iptables rules; a partial sync touching only the
//! changed real servers; a terminating endpoint draining with weight 0; a
//! full sync that finds everything in place writing nothing; a scheduler
//! change; removal; cleanup leaving no virtual server, no `kube-ipvs0`, no
//! `KUBE-` chain or ipset.
//!
//! This machine's kernel may have no IPVS: the tests run where
//! `XPROXY_IPVS_TESTS=1` (set by `cargo xtask vm`, whose 6.1 guest loads
//! `ip_vs`) and fail there if IPVS is missing; elsewhere they run only when
//! `/proc/net/ip_vs` exists and are skipped with a message otherwise.

use std::{collections::BTreeMap, net::Ipv4Addr, path::Path};

use anyhow::Result;
use proxy_userspace::{
    mode::{
        Dataplane,
        ipvs::{self, IpvsMode, IpvsOptions, NoIpvs, netlink::Ipvs, rules::RuleOptions},
        options::LocalTraffic,
    },
    model::{Endpoint, Protocol, ServicePort},
    reconcile::Plan,
};
use std::time::Duration;
use xproxy_tests::{
    agent_harness::{AgentBed, backend_ips, seed_node_port, seed_objects, slice, yaml_documents},
    netns::{self, Netns},
    privileged::require_root,
    scenario::{REQUESTS, SEED_CLUSTER_IP, SEED_PORT, expect_all_backends, expect_backends},
    topology::TARGET_PORT,
};

const SEED_NAME: &str = "default/nginx-service";
const NODE_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);

/// Whether the IPVS tests run here (see the module comment); panics when
/// they are demanded but IPVS is missing.
fn ipvs_available(test: &str) -> bool {
    if !require_root(test) {
        return false;
    }
    let demanded = std::env::var("XPROXY_IPVS_TESTS").is_ok_and(|v| v == "1");
    let present = Path::new("/proc/net/ip_vs").exists();
    match (present, demanded) {
        (true, _) => true,
        (false, true) => panic!("{test}: XPROXY_IPVS_TESTS=1 but this kernel has no IPVS (/proc/net/ip_vs is missing)"),
        (false, false) => {
            eprintln!(
                "skipping {test}: this kernel has no IPVS (/proc/net/ip_vs is missing); \
                 run `cargo xtask vm --tests mode_ipvs`"
            );
            false
        }
    }
}

fn endpoint(last: u8) -> Endpoint {
    Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
}

fn seed(endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: SEED_NAME.into(),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 88),
        port: 88,
        node_port: Some(30791),
        endpoints,
    }
}

fn options(scheduler: &str) -> IpvsOptions {
    IpvsOptions {
        scheduler: scheduler.into(),
        node_ips: vec![NODE_IP],
        exclude_cidrs: Vec::new(),
        rules: RuleOptions {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
        },
        timeouts: (900, 120, 300),
        strict_arp: true,
    }
}

fn run_in_ns(ns: &Netns, program: &str, args: &[&str]) -> String {
    let mut cmd = ns.command(program).expect("a command in the namespace");
    cmd.args(args);
    netns::run(&mut cmd).unwrap_or_else(|e| panic!("{program} {args:?}: {e:#}"))
}

/// `ipvsadm -Ln` as `"PROTO VS SCHEDULER" -> ["REAL WEIGHT", ...]`, sorted
/// (the kernel lists virtual servers in hash order).
fn ipvsadm(ns: &Netns) -> BTreeMap<String, Vec<String>> {
    let text = run_in_ns(ns, "ipvsadm", &["-Ln"]);
    eprintln!("ipvsadm -Ln:\n{text}");
    let mut servers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = None;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [proto @ ("TCP" | "UDP"), vs, scheduler, ..] => {
                let key = format!("{proto} {vs} {scheduler}");
                servers.insert(key.clone(), Vec::new());
                current = Some(key);
            }
            ["->", real, "Masq", weight, ..] => {
                let key = current.as_ref().expect("a real server before any virtual server");
                let reals = servers.get_mut(key).expect("the current virtual server");
                reals.push(format!("{real} {weight}"));
                reals.sort();
            }
            _ => {}
        }
    }
    servers
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
    if !ipvs_available("seed_partial_updates_draining_and_cleanup") {
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

/// The seed scenario through the real agent (`xproxy run --mode ipvs`) in
/// the node namespace of the test bed: every pod answers through the
/// NodePort from the outside client and through the ClusterIP from a pod
/// and from the node; `ipvsadm -Ln` in the node shows the virtual servers;
/// `xproxy cleanup` removes them and `kube-ipvs0`.
#[test]
fn seed_scenario_through_the_agent() {
    if !ipvs_available("seed_scenario_through_the_agent") {
        return;
    }
    let within = Duration::from_secs(30);
    let mut bed = AgentBed::new("ipvs-e2e").expect("the test bed");
    bed.copy_seed_manifests().expect("the seed manifests");
    let args = bed.manifest_args();
    bed.start_agent_in("ipvs", &args).expect("starting the agent");
    bed.wait_first_sync(within)
        .unwrap_or_else(|e| panic!("{e:#}\nagent log:\n{}", bed.log()));
    bed.wait_answering(seed_node_port(), within)
        .unwrap_or_else(|e| panic!("{e:#}\nagent log:\n{}", bed.log()));
    let listing = run_in_ns(&bed.topo.node, "ipvsadm", &["-Ln"]);
    eprintln!("ipvsadm -Ln in the node:\n{listing}");
    let cluster_ip = std::net::SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
    let mut failures = Vec::new();
    for (what, from, addr) in [
        ("client", &bed.topo.client, seed_node_port()),
        ("client pod", &bed.topo.client_pod.ns, cluster_ip),
        ("node", &bed.topo.node, cluster_ip),
    ] {
        match expect_all_backends(from, Protocol::Tcp, addr) {
            Ok(seen) => eprintln!("TCP {what} -> {addr}: {seen}"),
            Err(e) => failures.push(format!("TCP {what} -> {addr}: {e:#}")),
        }
    }

    // pod-3 leaves the EndpointSlice: the agent's partial sync takes it
    // out of both virtual servers; pod-1 and pod-2 answer.
    let mut objects = seed_objects();
    objects[1] = slice("nginx-service-demo", "nginx-service", TARGET_PORT, &backend_ips()[..2]);
    bed.write_manifest("nginx.yaml", &yaml_documents(&objects))
        .expect("writing the manifest");
    netns::wait_for("pod-3 to leave the virtual servers", within, || {
        let listing = ipvsadm(&bed.topo.node);
        if listing.values().flatten().any(|real| real.starts_with("10.244.0.13:")) {
            Err(format!("still there: {listing:?}"))
        } else {
            Ok(())
        }
    })
    .unwrap_or_else(|e| panic!("{e:#}\nagent log:\n{}", bed.log()));
    for (what, from, addr) in [
        ("client", &bed.topo.client, seed_node_port()),
        ("client pod", &bed.topo.client_pod.ns, cluster_ip),
    ] {
        match expect_backends(from, Protocol::Tcp, addr, &["pod-1", "pod-2"], REQUESTS) {
            Ok(seen) => eprintln!("after pod-3 left: TCP {what} -> {addr}: {seen}"),
            Err(e) => failures.push(format!("after pod-3 left: TCP {what} -> {addr}: {e:#}")),
        }
    }
    let log = bed.log();
    let partial: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("synced") && l.contains("full=false"))
        .collect();
    eprintln!("partial syncs in the agent's log:\n{}", partial.join("\n"));
    if partial.is_empty() {
        failures.push("no partial sync in the agent's log".into());
    }

    let status = bed.stop_agent(libc::SIGTERM).expect("stopping the agent");
    assert!(status.success(), "the agent exited with {status}:\n{}", bed.log());
    let output = bed.cleanup().expect("xproxy cleanup");
    eprintln!("xproxy cleanup:\n{output}");
    assert_eq!(ipvsadm(&bed.topo.node), BTreeMap::new());
    let links = bed.topo.node.ip(&["-o", "link", "show"]).expect("ip link");
    assert!(!links.contains("kube-ipvs0"), "kube-ipvs0 left:\n{links}");
    assert!(
        failures.is_empty(),
        "{}\nagent log:\n{}",
        failures.join("\n"),
        bed.log()
    );
}
