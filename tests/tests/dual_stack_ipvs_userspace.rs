//! The dual-stack seed through the real agent in the IPVS and userspace
//! modes (issue 13, item 2): `xproxy run --mode MODE` with both node IPs,
//! the seed as a dual-stack Service (10.96.0.88 and fd00:96::88, an IPv4
//! and an IPv6 EndpointSlice of the same three pods) and a dual-stack
//! Service without endpoints, on the one-node bed with its ULA addresses.
//! In one run, over TCP and UDP and in both families: the outside client
//! reaches every pod through the node port on the node's IPv4 and IPv6
//! address, the client pod through both ClusterIPs; the Service without
//! endpoints is refused at once (ICMP / ICMPv6 port unreachable: from IPVS
//! itself for a virtual server without real servers, from the REJECT rules
//! in the userspace mode). Then each mode's own IPv6 read-back: `ipvsadm
//! -Ln` with the IPv6 virtual and real servers, kube-proxy's `KUBE-6-*`
//! ipsets and `ip6tables-save`; the userspace mode's portal rules in
//! `ip6tables-save`.
//!
//! IPVS runs where the kernel has it: `cargo xtask vm --kernel 6.1 --tests
//! dual_stack_ipvs_userspace:ipvs`.

use std::{
    io,
    net::{Ipv6Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use testbed::{
    agent_bed::{AgentBed, Mode, ipvs_virtual_servers},
    fixtures::{
        EMPTY_CLUSTER_IP, EMPTY_NAME, EMPTY_NODE_PORT, EMPTY_PORT, SEED_CLUSTER_IP, SEED_CLUSTER_IP6, SEED_NODE_PORT,
        SEED_PORT, dual_stack, node_dual_stack, seed_objects_dual_stack, seed_tcp_udp, service, yaml_documents,
    },
    netns::{self, Netns},
    probe::{Checks, Protocol, expect_all_backends, expect_refused, proto_name},
    topology::{NODE_IP, NODE_IP6, TARGET_PORT},
};

/// The IPv6 ClusterIP of the Service without endpoints.
const EMPTY_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x89);
const PROTOCOLS: [Protocol; 2] = [Protocol::Tcp, Protocol::Udp];
const FIRST_SYNC: Duration = Duration::from_secs(20);
/// The first SYN retransmission (1 s) and some slack: see [`refused`].
const IPV6_REFUSED_WITHIN: Duration = Duration::from_millis(1_900);

/// The manifests: the dual-stack seed (TCP and UDP), the dual-stack
/// Service without endpoints, and this node with both addresses.
fn manifests() -> String {
    let mut objects = seed_objects_dual_stack(&seed_tcp_udp());
    let empty = service(
        EMPTY_NAME,
        EMPTY_CLUSTER_IP,
        EMPTY_PORT,
        TARGET_PORT,
        Some(EMPTY_NODE_PORT),
    );
    objects.push(dual_stack(empty, EMPTY_CLUSTER_IP6));
    objects.push(node_dual_stack());
    yaml_documents(&objects)
}

/// Both families' addresses of the seed and the empty Service, by what
/// reaches them.
struct Frontends {
    label: &'static str,
    node_port: SocketAddr,
    cluster_ip: SocketAddr,
    empty_node_port: SocketAddr,
    empty_cluster_ip: SocketAddr,
}

fn frontends() -> [Frontends; 2] {
    [
        Frontends {
            label: "IPv4",
            node_port: SocketAddr::new(NODE_IP.into(), SEED_NODE_PORT),
            cluster_ip: SocketAddr::new(SEED_CLUSTER_IP.into(), SEED_PORT),
            empty_node_port: SocketAddr::new(NODE_IP.into(), EMPTY_NODE_PORT),
            empty_cluster_ip: SocketAddr::new(EMPTY_CLUSTER_IP.into(), EMPTY_PORT),
        },
        Frontends {
            label: "IPv6",
            node_port: SocketAddr::new(NODE_IP6.into(), SEED_NODE_PORT),
            cluster_ip: SocketAddr::new(SEED_CLUSTER_IP6.into(), SEED_PORT),
            empty_node_port: SocketAddr::new(NODE_IP6.into(), EMPTY_NODE_PORT),
            empty_cluster_ip: SocketAddr::new(EMPTY_CLUSTER_IP6.into(), EMPTY_PORT),
        },
    ]
}

/// Runs the agent in `mode` on a fresh bed, sends the requests of both
/// families, and hands the bed to `read_back` for the mode's own checks.
fn dual_stack_seed(mode: Mode, read_back: impl FnOnce(&AgentBed, &mut Checks)) {
    let label = format!("dual_stack_seed_{}", mode.name());
    if !mode.available(&label) {
        return;
    }
    let mut bed = AgentBed::new(&label).expect("the test bed");
    bed.write_manifest("seed.yaml", &manifests()).expect("the manifests");
    let mut args = bed.manifest_args();
    args.extend(["--node-ip".into(), format!("{NODE_IP},{NODE_IP6}")]);
    bed.start_agent_finding_node_ip(mode.name(), &args)
        .expect("starting the agent");
    if let Err(e) = bed.wait_first_sync(FIRST_SYNC) {
        eprintln!("agent log:\n{}", bed.log());
        panic!("no first sync: {e:#}");
    }
    let mut checks = Checks::new(&label);
    for f in frontends() {
        for protocol in PROTOCOLS {
            let proto = proto_name(protocol);
            checks.check(
                &format!("{proto} client -> node port {} ({})", f.node_port, f.label),
                expect_all_backends(&bed.topo.client, protocol, f.node_port),
            );
            checks.check(
                &format!("{proto} client pod -> ClusterIP {} ({})", f.cluster_ip, f.label),
                expect_all_backends(&bed.topo.client_pod.ns, protocol, f.cluster_ip),
            );
        }
        // The Service without endpoints has a TCP port.
        checks.check(
            &format!(
                "TCP client pod -> {} without endpoints ({})",
                f.empty_cluster_ip, f.label
            ),
            refused(&bed.topo.client_pod.ns, f.empty_cluster_ip),
        );
        checks.check(
            &format!(
                "TCP client -> node port {} without endpoints ({})",
                f.empty_node_port, f.label
            ),
            refused(&bed.topo.client, f.empty_node_port),
        );
    }
    read_back(&bed, &mut checks);
    if !checks.passed() {
        eprintln!("agent log:\n{}", bed.log());
        panic!("{}", checks.failures());
    }
}

/// A TCP connection to `addr` from `from` is refused (an ICMP or ICMPv6
/// port unreachable): over IPv4 at once ([`expect_refused`]); over IPv6
/// within the first SYN retransmission. This kernel fails an IPv6
/// connect on the ICMPv6 error about its retransmitted SYN only, 1 s
/// later (reproduced with a plain `ip6tables ... -j REJECT` between two
/// namespaces: kube-proxy's IPv6 REJECT rules behave the same).
fn refused(from: &Netns, addr: SocketAddr) -> Result<String> {
    if addr.is_ipv4() {
        return expect_refused(from, Protocol::Tcp, addr);
    }
    let (result, elapsed) = from.run_in(|| {
        let started = Instant::now();
        (netns::tcp_connect(addr, IPV6_REFUSED_WITHIN), started.elapsed())
    })?;
    match result {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(format!("refused after {elapsed:?}")),
        Err(e) => bail!("expected ECONNREFUSED, got \"{e}\" after {elapsed:?}"),
        Ok(stream) => bail!("connected: {stream:?}"),
    }
}

/// `text` holds every one of `needles`.
fn holds(text: &str, needles: &[&str]) -> Result<String> {
    let missing: Vec<&&str> = needles.iter().filter(|n| !text.contains(**n)).collect();
    ensure!(missing.is_empty(), "missing {missing:?} in\n{text}");
    Ok(format!("{} lines found", needles.len()))
}

/// IPVS: the IPv6 virtual servers with the pods' IPv6 addresses as real
/// servers (and the IPv4 ones beside them), the IPv6 sets, the IPv6 rules.
fn ipvs_read_back(bed: &AgentBed, checks: &mut Checks) {
    let node = &bed.topo.node;
    let servers = node.exec(&["ipvsadm", "-Ln"]).map(|text| ipvs_virtual_servers(&text));
    checks.check(
        "ipvsadm -Ln: IPv6 and IPv4 virtual servers",
        servers.and_then(|servers| {
            let reals = |vs: &str| {
                servers
                    .iter()
                    .find(|(key, _)| key.split_whitespace().nth(1) == Some(vs))
                    .map(|(_, reals)| reals.clone())
                    .with_context(|| format!("no virtual server {vs} in {servers:#?}"))
            };
            for vs in [
                format!("[{SEED_CLUSTER_IP6}]:{SEED_PORT}"),
                format!("[{NODE_IP6}]:{SEED_NODE_PORT}"),
                format!("{SEED_CLUSTER_IP}:{SEED_PORT}"),
            ] {
                let reals = reals(&vs)?;
                ensure!(reals.len() == 3, "{vs}: {reals:?}");
                let v6 = vs.starts_with('[');
                ensure!(
                    reals.iter().all(|r| r.starts_with('[') == v6),
                    "{vs} has real servers of the other family: {reals:?}"
                );
            }
            let empty = reals(&format!("[{EMPTY_CLUSTER_IP6}]:{EMPTY_PORT}"))?;
            ensure!(empty.is_empty(), "{empty:?}");
            Ok(format!("{} virtual servers", servers.len()))
        }),
    );
    checks.check(
        "kube-ipvs0 holds the IPv6 ClusterIPs",
        node.ip(&["-6", "-o", "addr", "show", "dev", "kube-ipvs0"])
            .and_then(|text| {
                holds(
                    &text,
                    &[&format!("{SEED_CLUSTER_IP6}/128"), &format!("{EMPTY_CLUSTER_IP6}/128")],
                )
            }),
    );
    checks.check(
        "ipset save: the KUBE-6-* sets",
        node.exec(&["ipset", "save"]).and_then(|text| {
            holds(
                &text,
                &[
                    &format!("add KUBE-6-CLUSTER-IP {SEED_CLUSTER_IP6},tcp:{SEED_PORT}"),
                    &format!("add KUBE-6-CLUSTER-IP {SEED_CLUSTER_IP6},udp:{SEED_PORT}"),
                    &format!("add KUBE-6-NODE-PORT-TCP {SEED_NODE_PORT}"),
                ],
            )
        }),
    );
    checks.check(
        "ip6tables-save: the IPVS mode's constant rules",
        node.exec(&["ip6tables-save"]).and_then(|text| {
            holds(
                &text,
                &[
                    "-j KUBE-SERVICES",
                    "--match-set KUBE-6-NODE-PORT-TCP dst -j KUBE-MARK-MASQ",
                    "--match-set KUBE-6-LOOP-BACK dst,dst,src -j MASQUERADE",
                ],
            )
        }),
    );
}

/// The userspace mode: the IPv6 ClusterIPs redirected to the agent's
/// listeners, the node's own traffic to `[::1]`, the Service without
/// endpoints rejected with ICMPv6.
fn userspace_read_back(bed: &AgentBed, checks: &mut Checks) {
    checks.check(
        "ip6tables-save: the userspace mode's portal rules",
        bed.topo.node.exec(&["ip6tables-save"]).and_then(|text| {
            holds(
                &text,
                &[
                    &format!("-A KUBE-PORTALS-CONTAINER -d {SEED_CLUSTER_IP6}/128 -p tcp"),
                    "-j DNAT --to-destination [::1]:",
                    &format!("-A KUBE-PORTALS-REJECT -d {EMPTY_CLUSTER_IP6}/128 -p tcp"),
                    "--reject-with icmp6-port-unreachable",
                ],
            )
        }),
    );
    let v4_only = bed.topo.node.exec(&["iptables-save"]).and_then(|text| {
        ensure!(!text.contains("fd00:"), "IPv6 addresses in iptables:\n{text}");
        Ok("no IPv6 address in iptables".to_owned())
    });
    checks.check("iptables-save: IPv4 only", v4_only);
}

#[test]
fn dual_stack_seed_ipvs() {
    dual_stack_seed(Mode::Ipvs, ipvs_read_back);
}

#[test]
fn dual_stack_seed_userspace() {
    dual_stack_seed(Mode::Userspace, userspace_read_back);
}
