//! The rule-writing modes (iptables, nftables) with a dual-stack seed
//! Service, through the real agent on the one-node test bed: in one run the
//! IPv4 and the IPv6 half both answer, over TCP and UDP, from every
//! backend, through the NodePort from the outside client (`NODE_IP:30791`,
//! `[NODE_IP6]:30791`) and through the ClusterIP from a pod
//! (`10.96.0.88:88`, `[fd00:96::88]:88`); a dual-stack Service without
//! endpoints is refused in both families (ICMP / ICMPv6 port unreachable);
//! the rules are read back from the kernel (`ip6tables-save`, `nft list
//! table ip6 xproxy`) and `xproxy cleanup` removes both families' rules.

use std::{
    io,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    time::Instant,
};

use anyhow::{Context, Result, bail, ensure};
use testbed::{
    agent_bed::{AgentBed, Mode, READY_WITHIN, seed_node_port},
    fixtures::{
        EMPTY_CLUSTER_IP, EMPTY_NAME, EMPTY_PORT, SEED_CLUSTER_IP, SEED_CLUSTER_IP6, SEED_NODE_PORT, SEED_PORT,
        dual_stack, seed_objects_dual_stack, seed_tcp_udp, service, yaml_documents,
    },
    netns,
    privileged::require_root,
    probe::{Checks, PROTOCOLS, Protocol, REJECT_TIMEOUT, expect_all_backends, expect_refused},
    topology::{NODE_IP, NODE_IP6, TARGET_PORT, Topology},
};

/// The IPv6 ClusterIP of the dual-stack Service without endpoints.
const EMPTY_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x89);

/// The agent in `mode` with the dual-stack seed and an endpoint-less
/// dual-stack Service, told both node addresses.
fn start(bed: &mut AgentBed, mode: Mode) -> Result<()> {
    let mut objects = seed_objects_dual_stack(&seed_tcp_udp());
    objects.push(dual_stack(
        service(EMPTY_NAME, EMPTY_CLUSTER_IP, EMPTY_PORT, TARGET_PORT, None),
        EMPTY_CLUSTER_IP6,
    ));
    bed.write_manifest("seed.yaml", &yaml_documents(&objects))?;
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
        _ => bed.topo.node.exec(&["ip6tables-save"]),
    }
}

fn dual_stack_seed(mode: Mode, test: &str) {
    if !require_root(test) || !mode.available(test) {
        return;
    }
    let mut bed = AgentBed::new(test).expect("building the test bed");
    let mut checks = Checks::new(test);
    checks.check("the agent starts", start(&mut bed, mode).map(|()| "ready".to_owned()));
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
