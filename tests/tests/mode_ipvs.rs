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
//! This machine's kernel may have no IPVS: the tests run where
//! `XPROXY_IPVS_TESTS=1` (set by `cargo xtask vm`, whose 6.1 guest loads
//! `ip_vs`) and fail there if IPVS is missing; elsewhere they run only when
//! `/proc/net/ip_vs` exists and are skipped with a message otherwise.

use std::{collections::BTreeMap, net::Ipv4Addr, path::Path};

use anyhow::Result;
use proxy_userspace::{
    mode::{
        Dataplane, Plan,
        ipvs::{self, IpvsMode, IpvsOptions, NoIpvs, netlink::Ipvs, node_ips::NodePortAddresses, rules::RuleOptions},
        options::LocalTraffic,
    },
    model::{Endpoint, Protocol, ServicePort},
};
use testbed::{
    agent_bed::ipvs_virtual_servers,
    netns::{self, Netns},
    privileged::{require_ipvs, require_root},
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
        cluster_ip: Ipv4Addr::new(10, 96, 0, 88),
        port: 88,
        node_port: Some(30791),
        endpoints,
        ..ServicePort::default()
    }
}

fn options(scheduler: &str) -> IpvsOptions {
    IpvsOptions {
        scheduler: scheduler.into(),
        node_ports: NodePortAddresses::Fixed(vec![NODE_IP]),
        exclude_cidrs: Vec::new(),
        rules: RuleOptions {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
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
