//! End to end: the seed scenario through real namespaces and the real
//! programs, on the test bed of `testbed::topology` (a client, a node with
//! the programs attached, three backend pods and a client pod).

use std::net::{SocketAddr, SocketAddrV4};

use anyhow::{Context, Result, anyhow, bail, ensure};
use aya::programs::{SchedClassifier, TcAttachType};
use proxy_common::{
    Verdict,
    maps::{PROG_TC_EGRESS, PROG_TC_INGRESS},
};
use proxy_userspace::mode::ebpf::{Datapath, Hook, ServiceMaps};
use testbed::{
    fixtures::{
        EMPTY_CLUSTER_IP, EMPTY_NODE_PORT, EMPTY_PORT, SEED_CLUSTER_IP, SEED_NODE_PORT, SEED_PORT, backend_ips, ports,
    },
    netns::{self, Netns},
    privileged::{PinDir, require_root},
    probe::{
        Checks, NODE_SERVER_PORT, PROTOCOLS, Protocol, REQUEST_TIMEOUT, REQUESTS, check_non_service,
        expect_all_backends, expect_refused, proto_name, request,
    },
    topology::{BACKENDS, CLIENT_IP, NODE_IP, Offloads, TARGET_PORT, Topology},
};

/// The whole test bed. Field order is drop order: the programs and pins go
/// before the namespaces (whose drop stops the servers, then deletes them
/// and so every veth).
struct Cluster {
    datapath: Option<Datapath>,
    maps: Option<ServiceMaps>,
    pins: PinDir,
    topo: Topology,
}

impl Cluster {
    /// Builds the test bed plus a server in the node namespace; loads and
    /// attaches the programs if `with_datapath`.
    fn build(offloads: Offloads, with_datapath: bool) -> Result<Self> {
        let topo = Topology::build(offloads)?;
        topo.node.serve_tcp(NODE_SERVER_PORT, "node")?;
        let mut cluster = Self {
            datapath: None,
            maps: None,
            pins: PinDir::new(),
            topo,
        };
        if with_datapath {
            cluster.attach_datapath()?;
        }
        Ok(cluster)
    }

    /// Loads the programs into this test's pin directory, attaches them in
    /// the node namespace and programs the seed and the empty Service.
    fn attach_datapath(&mut self) -> Result<()> {
        let pin_path = self.pins.path().to_owned();
        let uplink = self.topo.uplink.clone();
        let pod_ifs: Vec<String> = self.topo.pod_ifs();
        let datapath = self.topo.node.run_in(move || -> Result<Datapath> {
            let mut datapath = Datapath::load(&pin_path)?;
            datapath.attach(&uplink, Hook::Uplink)?;
            for iface in &pod_ifs {
                datapath.attach(iface, Hook::Pod)?;
            }
            Ok(datapath)
        })??;
        self.datapath = Some(datapath);

        let mut maps = ServiceMaps::open(self.pins.path(), vec![NODE_IP.into()])?;
        for (protocol, suffix) in [(Protocol::Tcp, "tcp"), (Protocol::Udp, "udp")] {
            let seed = format!("default/nginx-service:{suffix}");
            maps.sync_service(&ports::seed_port(&seed, protocol, &backend_ips()))?;
            maps.sync_service(&ports::service_port(
                &format!("default/empty-service:{suffix}"),
                protocol,
                EMPTY_CLUSTER_IP,
                EMPTY_PORT,
                Some(EMPTY_NODE_PORT),
                &[],
            ))?;
        }
        self.maps = Some(maps);
        Ok(())
    }

    fn maps(&self) -> Result<&ServiceMaps> {
        self.maps.as_ref().context("the datapath is not attached")
    }

    /// Packets per verdict, indexed by `Verdict as usize`.
    fn verdicts(&self) -> Result<[u64; Verdict::COUNT as usize]> {
        let mut out = [0; Verdict::COUNT as usize];
        for (verdict, counter) in self.maps()?.verdict_counts()? {
            out[verdict as usize] = counter.packets;
        }
        Ok(out)
    }

    /// Runs `check`, then requires each listed group of verdict counters
    /// to have grown, together, by at least the given number of packets.
    fn with_verdicts(&self, expect: &[(&[Verdict], u64)], check: impl FnOnce() -> Result<String>) -> Result<String> {
        let before = self.verdicts()?;
        let detail = check()?;
        let after = self.verdicts()?;
        let mut grew = Vec::new();
        for &(verdicts, at_least) in expect {
            let delta: u64 = verdicts.iter().map(|v| after[*v as usize] - before[*v as usize]).sum();
            let names = verdicts.iter().map(|v| v.name()).collect::<Vec<_>>().join("+");
            ensure!(
                delta >= at_least,
                "{detail}, but {names} grew by {delta} packets, expected at least {at_least} \
                 (the traffic did not take the program path)"
            );
            grew.push(format!("{names}: +{delta}"));
        }
        Ok(format!("{detail}; {}", grew.join(", ")))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Detach in the node namespace: on kernels where links are netlink
        // attachments, detaching resolves the interface in the caller's
        // namespace. The fields (pins, then namespaces) drop afterwards.
        self.maps = None;
        if let Some(datapath) = self.datapath.take()
            && let Err(e) = self.topo.node.run_in(move || drop(datapath))
        {
            eprintln!("warning: could not drop the datapath in the node namespace: {e:#}");
        }
    }
}

/// Names of the tc programs on `iface` in `ns` at `attach`: from
/// `bpftool net show` (clsact filters, kernels before 6.6) and from a tcx
/// query (tcx links, which the bpftool here does not list).
fn tc_programs(ns: &Netns, iface: &str, attach: TcAttachType) -> Result<Vec<String>> {
    let (direction, tcx) = match attach {
        TcAttachType::Ingress => ("ingress", "tcx ingress"),
        TcAttachType::Egress => ("egress", "tcx egress"),
        TcAttachType::Custom(_) => bail!("no custom parents here"),
    };
    let shown = ns.exec(&["bpftool", "net", "show", "dev", iface])?;
    let mut names: Vec<String> = shown
        .lines()
        .filter(|l| l.contains(&format!("/{direction}")))
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(|name| format!("{} (bpftool)", name.split(':').next().unwrap_or(name)))
        .collect();
    match ns.run_in(|| SchedClassifier::query_tcx(iface, attach))? {
        Ok((_, infos)) => {
            names.extend(
                infos
                    .iter()
                    .map(|i| format!("{} ({tcx})", i.name_as_str().unwrap_or("?"))),
            );
        }
        // Kernels without tcx have only the clsact filters bpftool shows.
        Err(e) if names.is_empty() => bail!("no tc program on {direction} of {iface}; tcx query: {e}"),
        Err(_) => {}
    }
    Ok(names)
}

/// Reads back how the programs are attached: XDP in native (driver) mode
/// and tc egress on the uplink, tc ingress on every pod veth.
fn check_attachments(cluster: &Cluster) -> Result<String> {
    let uplink = &cluster.topo.uplink;
    let bpftool = cluster.topo.node.exec(&["bpftool", "net", "show", "dev", uplink])?;
    let xdp_line = bpftool
        .lines()
        .find(|l| {
            l.contains(uplink.as_str()) && (l.contains("driver") || l.contains("generic") || l.contains("offload"))
        })
        .ok_or_else(|| anyhow!("bpftool shows no XDP program on {uplink}:\n{bpftool}"))?;
    ensure!(
        xdp_line.contains("driver"),
        "XDP on {uplink} is not in driver (native) mode: {xdp_line:?}"
    );
    let link = cluster.topo.node.ip(&["-d", "link", "show", "dev", uplink])?;
    ensure!(
        link.contains("prog/xdp id") && !link.contains("xdpgeneric"),
        "ip -d link does not show native XDP on {uplink}:\n{link}"
    );
    let mut found = vec![format!("{uplink}: XDP {}", xdp_line.trim())];
    let egress = tc_programs(&cluster.topo.node, uplink, TcAttachType::Egress)?;
    ensure!(
        egress.iter().any(|n| n.starts_with(PROG_TC_EGRESS)),
        "no {PROG_TC_EGRESS} on egress of {uplink}: {egress:?}"
    );
    found.push(format!("{uplink} egress: {egress:?}"));
    for iface in cluster.topo.pod_ifs() {
        let ingress = tc_programs(&cluster.topo.node, &iface, TcAttachType::Ingress)?;
        ensure!(
            ingress.iter().any(|n| n.starts_with(PROG_TC_INGRESS)),
            "no {PROG_TC_INGRESS} on ingress of {iface}: {ingress:?}"
        );
        found.push(format!("{iface} ingress: {ingress:?}"));
    }
    Ok(found.join("; "))
}

/// Every veth end has tx checksum offload on or off as the scenario asked.
fn check_offloads(cluster: &Cluster, offloads: Offloads) -> Result<String> {
    let want = match offloads {
        Offloads::On => "tx-checksumming: on",
        Offloads::TxOff | Offloads::Off => "tx-checksumming: off",
    };
    let mut ends = vec![
        (&cluster.topo.client, cluster.topo.client_if.as_str()),
        (&cluster.topo.node, cluster.topo.uplink.as_str()),
    ];
    for pod in cluster.topo.backends.iter().chain([&cluster.topo.client_pod]) {
        ends.push((&cluster.topo.node, pod.node_if.as_str()));
        ends.push((&pod.ns, "eth0"));
    }
    for (ns, dev) in &ends {
        let features = ns.ethtool_features(dev)?;
        ensure!(
            features.lines().any(|l| l.trim() == want),
            "{dev} in {}: expected {want:?}:\n{features}",
            ns.name()
        );
    }
    Ok(format!("{want} on {} ends", ends.len()))
}

/// The seed scenario, with the programs attached.
fn seed_scenario(test: &str, offloads: Offloads) {
    let cluster = Cluster::build(offloads, true).unwrap_or_else(|e| panic!("{test}: building the test bed: {e:#}"));
    let mut checks = Checks::new(format!("{test} ({offloads:?})"));

    checks.check(
        "checksum offload as asked on every veth end",
        check_offloads(&cluster, offloads),
    );
    checks.check("programs attached (native XDP, tc)", check_attachments(&cluster));
    check_non_service(&cluster.topo, &mut checks);

    let node_port = SocketAddrV4::new(NODE_IP, SEED_NODE_PORT);
    let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
    // Every request is DNATed: as a new flow, or (when the client happens to
    // reuse a source port of an earlier request, as UDP's random ports can)
    // as one the conntrack table still holds. Every answer is rev-NATed.
    let translated: [(&[Verdict], u64); 3] = [
        (&[Verdict::DnatNew, Verdict::DnatEstablished], REQUESTS as u64),
        (&[Verdict::DnatNew], REQUESTS as u64 / 2),
        (&[Verdict::RevNat], REQUESTS as u64),
    ];
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        checks.check(
            &format!("{p} client -> NODE_IP:{SEED_NODE_PORT} reaches all backends"),
            cluster.with_verdicts(&translated, || {
                expect_all_backends(&cluster.topo.client, protocol, node_port)
            }),
        );
        checks.check(
            &format!("{p} client pod -> {cluster_ip} reaches all backends"),
            cluster.with_verdicts(&translated, || {
                expect_all_backends(&cluster.topo.client_pod.ns, protocol, cluster_ip)
            }),
        );
        checks.check(
            &format!("{p} node process -> {cluster_ip} reaches all backends"),
            cluster.with_verdicts(&translated, || {
                expect_all_backends(&cluster.topo.node, protocol, cluster_ip)
            }),
        );
    }

    let empty_node_port = SocketAddrV4::new(NODE_IP, EMPTY_NODE_PORT);
    let empty_cluster_ip = SocketAddrV4::new(EMPTY_CLUSTER_IP, EMPTY_PORT);
    let rejected: [(&[Verdict], u64); 1] = [(&[Verdict::RejectNoBackend], 1)];
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        checks.check(
            &format!("{p} client -> NODE_IP:{EMPTY_NODE_PORT} (no endpoints) is refused"),
            cluster.with_verdicts(&rejected, || {
                expect_refused(&cluster.topo.client, protocol, empty_node_port)
            }),
        );
        checks.check(
            &format!("{p} client pod -> {empty_cluster_ip} (no endpoints) is refused"),
            cluster.with_verdicts(&rejected, || {
                expect_refused(&cluster.topo.client_pod.ns, protocol, empty_cluster_ip)
            }),
        );
        checks.check(
            &format!("{p} node process -> {empty_cluster_ip} (no endpoints) is refused"),
            cluster.with_verdicts(&rejected, || {
                expect_refused(&cluster.topo.node, protocol, empty_cluster_ip)
            }),
        );
    }

    checks.check("non-service traffic still passes after Service traffic", {
        let mut again = Checks::new("again");
        check_non_service(&cluster.topo, &mut again);
        if again.passed() {
            Ok("ok".into())
        } else {
            Err(anyhow!("{}", again.failures()))
        }
    });

    checks.check(
        "verdict counters",
        (|| {
            let counts = cluster.verdicts()?;
            let shown: Vec<String> = Verdict::ALL
                .iter()
                .map(|v| format!("{}={}", v.name(), counts[*v as usize]))
                .collect();
            for verdict in [Verdict::DnatNew, Verdict::RevNat, Verdict::RejectNoBackend] {
                ensure!(
                    counts[verdict as usize] > 0,
                    "{} is 0: {}",
                    verdict.name(),
                    shown.join(" ")
                );
            }
            Ok(shown.join(" "))
        })(),
    );

    checks.finish();
}

#[test]
fn seed_service_with_checksum_offload() {
    if !require_root("seed_service_with_checksum_offload") {
        return;
    }
    seed_scenario("seed_service_with_checksum_offload", Offloads::On);
}

#[test]
fn seed_service_with_tx_checksum_off() {
    if !require_root("seed_service_with_tx_checksum_off") {
        return;
    }
    seed_scenario("seed_service_with_tx_checksum_off", Offloads::TxOff);
}

/// The test bed itself, without the programs: plain routing works between
/// every pair the scenario relies on, and the servers answer.
#[test]
fn harness_topology_routes_without_datapath() {
    if !require_root("harness_topology_routes_without_datapath") {
        return;
    }
    let cluster = Cluster::build(Offloads::On, false).expect("building the test bed");
    let mut checks = Checks::new("harness");
    check_non_service(&cluster.topo, &mut checks);
    // Over IPv4 and over IPv6 (the bed's ULA addresses).
    for pod in &cluster.topo.backends {
        let ip6 = pod.ip6.expect("the bed's pods have IPv6");
        for addr in [
            SocketAddr::new(pod.ip.into(), TARGET_PORT),
            SocketAddr::new(ip6.into(), TARGET_PORT),
        ] {
            for (from, label) in [
                (&cluster.topo.node, "node"),
                (&cluster.topo.client_pod.ns, "client pod"),
                (&cluster.topo.client, "client"),
            ] {
                for protocol in PROTOCOLS {
                    checks.check(
                        &format!("{} {label} -> {} {addr}", proto_name(protocol), pod.name),
                        from.run_in(|| request(protocol, addr, REQUEST_TIMEOUT)).and_then(|r| {
                            let answer = r?;
                            ensure!(answer == pod.name, "answered {answer:?}");
                            Ok(answer)
                        }),
                    );
                }
            }
        }
    }
    checks.check(
        "client pod pings the client (routed by the node)",
        cluster
            .topo
            .client_pod
            .ns
            .ping(CLIENT_IP, REQUEST_TIMEOUT)
            .and_then(|r| Ok(format!("rtt {:?}", r?))),
    );
    checks.check(
        "ip_forward is on in the node",
        cluster.topo.node.sysctl_get("net.ipv4.ip_forward").and_then(|v| {
            ensure!(v == "1", "net.ipv4.ip_forward = {v}");
            Ok(v)
        }),
    );
    checks.check(
        "GRO is on at the client end of the uplink",
        cluster
            .topo
            .client
            .ethtool_features(&cluster.topo.client_if)
            .and_then(|f| {
                ensure!(
                    f.contains("generic-receive-offload: on"),
                    "ethtool -k {}:\n{f}",
                    cluster.topo.client_if
                );
                Ok("generic-receive-offload: on".into())
            }),
    );
    // Nothing listens on the empty Service's node port: the node's kernel
    // itself refuses (a baseline for the checks with the programs).
    checks.check(
        "TCP to a closed node port is refused by the kernel",
        expect_refused(
            &cluster.topo.client,
            Protocol::Tcp,
            SocketAddrV4::new(NODE_IP, EMPTY_NODE_PORT),
        ),
    );
    checks.finish();
}

/// A panicking test still removes its namespaces (and with them its veths)
/// and stops its servers.
#[test]
fn harness_cleans_up_after_a_panic() {
    if !require_root("harness_cleans_up_after_a_panic") {
        return;
    }
    let names = std::sync::Mutex::new(Vec::new());
    let outcome = std::panic::catch_unwind(|| {
        let cluster = Cluster::build(Offloads::TxOff, false).expect("building the test bed");
        let mut all = vec![
            cluster.topo.client.name().to_owned(),
            cluster.topo.node.name().to_owned(),
        ];
        all.extend(
            cluster
                .topo
                .backends
                .iter()
                .chain([&cluster.topo.client_pod])
                .map(|p| p.ns.name().to_owned()),
        );
        *names.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = all;
        panic!("deliberate panic with the test bed up");
    });
    assert!(outcome.is_err(), "the closure should have panicked");
    let names = names.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    assert_eq!(names.len(), 2 + BACKENDS.len() + 1, "namespace names were not recorded");
    let listed = netns::run(std::process::Command::new("ip").args(["netns", "list"])).expect("ip netns list");
    for name in &names {
        assert!(
            !std::path::Path::new("/var/run/netns").join(name).exists(),
            "netns {name} still exists"
        );
        assert!(
            !listed.split_whitespace().any(|w| w == name),
            "ip netns list still shows {name}:\n{listed}"
        );
    }
}

/// The same with the programs attached: the pins (maps and links) go too.
#[test]
fn cleanup_after_a_panic_with_the_datapath() {
    if !require_root("cleanup_after_a_panic_with_the_datapath") {
        return;
    }
    let recorded = std::sync::Mutex::new(None);
    let outcome = std::panic::catch_unwind(|| {
        let cluster = Cluster::build(Offloads::On, true).expect("building the test bed");
        let links = cluster.pins.path().join(proxy_userspace::mode::ebpf::LINKS_DIR);
        assert!(links.exists(), "no links pinned under {}", links.display());
        *recorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((cluster.pins.path().to_owned(), cluster.topo.node.name().to_owned()));
        panic!("deliberate panic with the programs attached");
    });
    assert!(outcome.is_err(), "the closure should have panicked");
    let (pins, node) = recorded
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .expect("state was recorded");
    assert!(!pins.exists(), "pin directory {} still exists", pins.display());
    assert!(
        !std::path::Path::new("/var/run/netns").join(&node).exists(),
        "netns {node} still exists"
    );
}

/// tc programs on `iface` at `attach`, counted by name: netlink filters
/// (bpftool) and tcx links, where the kernel has tcx.
fn tc_program_count(ns: &Netns, iface: &str, attach: TcAttachType, name: &str) -> Result<usize> {
    let direction = match attach {
        TcAttachType::Ingress => "ingress",
        _ => "egress",
    };
    let shown = ns.exec(&["bpftool", "net", "show", "dev", iface])?;
    let filters = shown
        .lines()
        .filter(|l| l.contains(&format!("/{direction}")) && l.contains(name))
        .count();
    let links = match ns.run_in(|| SchedClassifier::query_tcx(iface, attach))? {
        Ok((_, infos)) => infos.iter().filter(|i| i.name_as_str() == Some(name)).count(),
        // No tcx on this kernel: the filters are all there is.
        Err(_) => 0,
    };
    Ok(filters + links)
}

/// A restarted agent loads the programs again and attaches them to the
/// same interfaces: each hook keeps exactly one program (tcx links are
/// pinned and updated; on kernels before 6.6 the tc filters sit at a fixed
/// priority and handle and are replaced), and what cleanup runs (pinned
/// links, then the tc filters) leaves no program attached.
#[test]
fn a_restart_reuses_the_attachments_and_cleanup_removes_them() {
    if !require_root("a_restart_reuses_the_attachments_and_cleanup_removes_them") {
        return;
    }
    let ns = Netns::new("xr").expect("a namespace");
    ns.ip(&["link", "add", "up0", "type", "veth", "peer", "name", "pod0"])
        .expect("a veth pair");
    for dev in ["up0", "pod0"] {
        ns.ip(&["link", "set", dev, "up"]).expect("link up");
    }
    let pins = PinDir::new();
    for run in 1..=2 {
        let pin_path = pins.path().to_owned();
        ns.run_in(move || -> Result<()> {
            let mut datapath = Datapath::load(&pin_path)?;
            datapath.attach("up0", Hook::Uplink)?;
            datapath.attach("pod0", Hook::Pod)?;
            Ok(())
        })
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("attach, run {run}: {e:#}"));
    }
    let count = |iface: &str, attach: TcAttachType, name: &str| {
        tc_program_count(&ns, iface, attach, name).unwrap_or_else(|e| panic!("reading {iface}: {e:#}"))
    };
    for iface in ["up0", "pod0"] {
        assert_eq!(
            count(iface, TcAttachType::Ingress, PROG_TC_INGRESS),
            1,
            "{iface} ingress"
        );
        assert_eq!(count(iface, TcAttachType::Egress, PROG_TC_EGRESS), 1, "{iface} egress");
    }
    let xdp = ns.ip(&["-d", "link", "show", "dev", "up0"]).expect("ip link");
    assert_eq!(xdp.matches("prog/xdp id").count(), 1, "{xdp}");

    let pin_path = pins.path().to_owned();
    ns.run_in(move || -> Result<()> {
        proxy_userspace::mode::ebpf::detach_pinned_links(&pin_path)?;
        proxy_userspace::mode::ebpf::detach_tc_filters()?;
        Ok(())
    })
    .expect("entering the namespace")
    .expect("detaching");
    for iface in ["up0", "pod0"] {
        assert_eq!(
            count(iface, TcAttachType::Ingress, PROG_TC_INGRESS),
            0,
            "{iface} ingress"
        );
        assert_eq!(count(iface, TcAttachType::Egress, PROG_TC_EGRESS), 0, "{iface} egress");
    }
    let xdp = ns.ip(&["-d", "link", "show", "dev", "up0"]).expect("ip link");
    assert!(!xdp.contains("prog/xdp"), "{xdp}");
}
