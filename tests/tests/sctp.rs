//! SCTP Services live (issue 13 item 3): the real agent in each mode, real
//! SCTP associations (one-to-one sockets) from the client outside the node
//! and from a pod, answered by the pods' SCTP servers with their names.
//!
//! Two Services, both SCTP:
//! - `sctp-same`: a ClusterIP whose port is its pods' (80 -> 80);
//! - `sctp-node`: a NodePort Service that changes the port (88 -> 80,
//!   node port 30832).
//!
//! | mode | `sctp-same` from a pod | `sctp-node`: its node port from outside, its ClusterIP from a pod |
//! |---|---|---|
//! | iptables | every backend | every backend (`-m sctp -p sctp`; the kernel's NAT recomputes the CRC32c) |
//! | nftables | every backend | every backend (`sctp` keys in the verdict maps) |
//! | ipvs | every backend | every backend (IPPROTO_SCTP virtual servers, `KUBE-NODE-PORT-SCTP-HASH`) |
//! | ebpf | every backend (the programs rewrite the address only) | every backend, through the kernel: a port change needs the CRC32c recomputed, so the programs leave such ports to the mode's `inet xproxy-sctp` nftables table |
//! | userspace | not served, reported (kube-proxy's userspace mode never relayed SCTP) | not served, reported |
//!
//! Both Services are dual-stack (an IPv6 ClusterIP and an IPv6
//! EndpointSlice of the same pods, the node's IPv6 address as a second
//! `--node-ip`), and the same three paths are probed over IPv6:
//!
//! | mode | over IPv6 |
//! |---|---|
//! | iptables | every backend (ip6tables) |
//! | nftables | every backend (the `ip6` table) |
//! | ipvs | every backend (IPv6 virtual servers) |
//! | ebpf | every backend: `sctp-same` by the programs (address only), `sctp-node` by the same `inet` fallback table |
//! | userspace | not served, reported |
//!
//! The host kernel of this project has no SCTP (no `sctp` module): there
//! every test says so and skips (with `XPROXY_PRIVILEGED_TESTS=1` too: it
//! is the kernel, not the privileges). `cargo xtask vm --kernel 6.1
//! --tests sctp` runs them in the guest, which loads `sctp` and `xt_sctp`.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

use anyhow::{Result, ensure};
use serde_json::Value;
use testbed::{
    agent_bed::{AgentBed, Mode, READY_WITHIN, SKIPPED, on_own_bed},
    fixtures::{
        NODE_NAME, PortDef, backend_ips, backend_ips6, dual_stack, on_node, service_with, slice_with, slice6_with,
        yaml_documents,
    },
    netns::{self, Netns},
    probe::{Checks, Outcome, Protocol, REQUEST_TIMEOUT, expect_all_backends},
    topology::{NODE_IP, NODE_IP6, TARGET_PORT},
};

const SAME_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 3, 10);
const NODE_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 3, 11);
const SAME_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 3, 0x10);
const NODE_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 3, 0x11);
const NODE_SERVICE_PORT: u16 = 88;
const NODE_PORT: u16 = 30832;
const MANIFEST: &str = "sctp.yaml";

/// An SCTP port of a Service.
const fn sctp_port(port: u16, node_port: Option<u16>) -> PortDef {
    PortDef {
        name: None,
        protocol: Protocol::Sctp,
        port,
        target_port: TARGET_PORT,
        node_port,
    }
}

/// The two Services and their EndpointSlices (the bed's three pods).
fn objects() -> Vec<Value> {
    let endpoints = on_node(&backend_ips());
    let endpoints6: Vec<(Ipv6Addr, &str)> = backend_ips6().into_iter().map(|ip| (ip, NODE_NAME)).collect();
    let same = [sctp_port(TARGET_PORT, None)];
    let node = [sctp_port(NODE_SERVICE_PORT, Some(NODE_PORT))];
    vec![
        dual_stack(
            service_with("sctp-same", SAME_CLUSTER_IP, &same, None),
            SAME_CLUSTER_IP6,
        ),
        slice_with("sctp-same-1", "sctp-same", &same, &endpoints),
        slice6_with("sctp-same-6", "sctp-same", &same, &endpoints6),
        dual_stack(
            service_with("sctp-node", NODE_CLUSTER_IP, &node, None),
            NODE_CLUSTER_IP6,
        ),
        slice_with("sctp-node-1", "sctp-node", &node, &endpoints),
        slice6_with("sctp-node-6", "sctp-node", &node, &endpoints6),
    ]
}

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// Whether the kernel has SCTP sockets; says why the test skips if not.
fn kernel_has_sctp(label: &str) -> bool {
    match netns::sctp_available() {
        true => true,
        false => {
            eprintln!(
                "skipping {label}: this kernel has no SCTP sockets (no `sctp` module); \
                 `cargo xtask vm --kernel 6.1 --tests sctp` runs it in a guest that has"
            );
            false
        }
    }
}

/// Runs the scenario in `mode` on a bed of its own, if the kernel and the
/// mode can run it here.
fn run(mode: Mode) {
    let label = format!("sctp_{}", mode.name());
    if !mode.available(&label) || !kernel_has_sctp(&label) {
        return;
    }
    on_own_bed(&label, |bed, checks| scenario(mode, bed, checks));
}

fn scenario(mode: Mode, bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    for pod in &bed.topo.backends {
        pod.ns.serve_sctp(TARGET_PORT, pod.name)?;
    }
    bed.write_manifest(MANIFEST, &yaml_documents(&objects()))?;
    let mut args = bed.manifest_args();
    // Beside the IPv4 one the bed passes.
    args.extend(["--node-ip".to_owned(), NODE_IP6.to_string()]);
    bed.start_agent_in(mode.name(), &args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    let same = at(SAME_CLUSTER_IP, TARGET_PORT);
    let node_port = at(NODE_IP, NODE_PORT);
    let node_cluster_ip = at(NODE_CLUSTER_IP, NODE_SERVICE_PORT);
    let (client, pod) = (&bed.topo.client, &bed.topo.client_pod.ns);
    let paths = |family: &str, same, node_port, node_cluster_ip| {
        [
            (format!("same-port ClusterIP from a pod{family}"), pod, same),
            (format!("NodePort from outside{family}"), client, node_port),
            (
                format!("port-changing ClusterIP from a pod{family}"),
                pod,
                node_cluster_ip,
            ),
        ]
    };
    let ipv4 = paths("", same.into(), node_port.into(), node_cluster_ip.into());
    let ipv6: [(String, &Netns, SocketAddr); 3] = paths(
        " (IPv6)",
        SocketAddr::new(SAME_CLUSTER_IP6.into(), TARGET_PORT),
        SocketAddr::new(NODE_IP6.into(), NODE_PORT),
        SocketAddr::new(NODE_CLUSTER_IP6.into(), NODE_SERVICE_PORT),
    );
    match mode {
        Mode::Userspace => {
            for (what, from, to) in ipv4.iter().chain(&ipv6) {
                checks.check(&format!("{what}: {to} not served"), expect_no_backend(from, *to));
            }
            // Two ports, each in two families.
            checks.check("reported", expect_reported(bed, 4.0));
        }
        Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Ipvs => {
            wait_answering(pod, same.into())?;
            for (what, from, to) in &ipv4 {
                checks.check(what, expect_all_backends(from, Protocol::Sctp, *to));
            }
        }
    }
    if mode != Mode::Userspace {
        wait_answering(pod, ipv6[0].2)?;
        for (what, from, to) in &ipv6 {
            checks.check(what, expect_all_backends(from, Protocol::Sctp, *to));
        }
    }
    if mode == Mode::Ebpf {
        checks.check(
            "the kernel fallback holds the node port",
            expect_fallback(&bed.topo.node),
        );
    }
    Ok(())
}

/// The ebpf mode's SCTP fallback table NATs the port-changing Service in
/// both families (only it: the same-port one is the programs').
fn expect_fallback(node: &Netns) -> Result<String> {
    let table = node.exec(&["nft", "list", "table", "inet", "xproxy-sctp"])?;
    for wanted in [
        format!("ip daddr {NODE_CLUSTER_IP} sctp dport {NODE_SERVICE_PORT}"),
        format!("ip6 daddr {NODE_CLUSTER_IP6} sctp dport {NODE_SERVICE_PORT}"),
    ] {
        ensure!(table.contains(&wanted), "no {wanted:?} in {table}");
    }
    let node_port = format!("sctp dport {NODE_PORT}");
    for (family, ip) in [("ip", IpAddr::from(NODE_IP)), ("ip6", NODE_IP6.into())] {
        let holds = |line: &&str| {
            line.trim_start().starts_with(&format!("{family} daddr {{"))
                && line.contains(&ip.to_string())
                && line.contains(&node_port)
        };
        ensure!(
            table.lines().any(|line| holds(&line)),
            "no {family} node port on {ip} in {table}"
        );
    }
    for unwanted in [SAME_CLUSTER_IP.to_string(), SAME_CLUSTER_IP6.to_string()] {
        ensure!(!table.contains(&unwanted), "{unwanted} in {table}");
    }
    Ok("inet xproxy-sctp holds sctp-node in both families only".into())
}

/// Waits until an SCTP association to `to` from `from` is answered (the
/// first sync may be a moment behind the metric).
fn wait_answering(from: &Netns, to: SocketAddr) -> Result<()> {
    netns::wait_for(&format!("{to} to answer over SCTP"), READY_WITHIN, || {
        match from.sctp_request(to, REQUEST_TIMEOUT) {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        }
    })
}

/// No backend answers `to` (as without a proxy: refused by the node's own
/// SCTP stack, or nothing at all).
fn expect_no_backend(from: &Netns, to: SocketAddr) -> Result<String> {
    let got = Outcome::of(from.sctp_request(to, Duration::from_secs(2))?);
    ensure!(!matches!(got, Outcome::Answered(_)), "answered: {got:?}");
    Ok(format!("{got:?}"))
}

/// The agent counted at least `at_least` objects it skipped or did not
/// honour (the SCTP ports it does not serve).
fn expect_reported(bed: &AgentBed, at_least: f64) -> Result<String> {
    let skipped = bed.metrics()?.value(SKIPPED).unwrap_or(0.0);
    ensure!(skipped >= at_least, "{SKIPPED} = {skipped}, want >= {at_least}");
    Ok(format!("{SKIPPED} = {skipped}"))
}

#[test]
fn sctp_iptables() {
    run(Mode::Iptables);
}

#[test]
fn sctp_nftables() {
    run(Mode::Nftables);
}

#[test]
fn sctp_ipvs() {
    run(Mode::Ipvs);
}

#[test]
fn sctp_ebpf() {
    run(Mode::Ebpf);
}

#[test]
fn sctp_userspace() {
    run(Mode::Userspace);
}
