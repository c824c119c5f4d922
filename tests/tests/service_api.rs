//! The Service API beyond ClusterIP and NodePort (issue 12), live in every
//! mode: the real agent (`xproxy run --mode MODE --manifests DIR`) in the
//! node namespace of the test bed (`testbed::topology`), real requests from
//! the client outside the node, from a pod and from the node itself. One
//! test per (feature, mode), each on a topology of its own, so they run in
//! parallel; the IPVS ones where the kernel has IPVS (`cargo xtask vm` runs
//! `service_api:ipvs` in its 6.1 guest).
//!
//! The features (one module of tests each, a test per mode in it):
//! - [`external_addresses`]: a LoadBalancer Service with two ingress IPs
//!   (one with `ipMode: Proxy`, which must not be answered) and an
//!   `externalIP`, over TCP and UDP; another port on those addresses; a
//!   second LoadBalancer Service with `externalTrafficPolicy: Local` and
//!   one of its three endpoints on this node, from outside and from a pod
//!   (the agent is given `--cluster-cidr`, so pods' traffic can be told
//!   apart, as kube-proxy's `detectLocalMode: ClusterCIDR` does).
//! - [`source_ranges`]: `loadBalancerSourceRanges` with a space around one
//!   range and one that does not parse (skipped, logged and counted in
//!   `xproxy_skipped_objects_total`); a client inside the range and one
//!   outside it (a second address of the client namespace, outside the
//!   node's subnet), to the LB IP, the NodePort and the ClusterIP.
//! - [`affinity`]: `sessionAffinity: ClientIP` with a 5 s timeout: new
//!   connections from one client stick to one backend, the same through
//!   the ClusterIP and the node port where the mode keeps affinity per
//!   Service port; after the client
//!   was idle past the timeout it moves (over repeated idle periods the
//!   backend changes at least once); its backend leaving the EndpointSlice
//!   moves it; affinity switched off spreads, switched on again sticks.
//! - [`node_port_addresses`]: `NODE_IP:NODEPORT` from the node itself and
//!   from a pod, and on an address added to the node after the agent
//!   started, from outside, from a pod and from the node.
//!
//! The Service addresses come from the documentation networks
//! 198.51.100.0/24 and 203.0.113.0/24; only the client namespace of each
//! bed routes them (and the ClusterIPs) to the node. Without a proxy a
//! request to them goes from the node back to the client (the node's
//! default route), which does not forward it: no answer. That is what
//! "as without a proxy" means for them ([`Baseline`]).
//!
//! Where the modes differ, the difference is asserted per mode (the
//! [`Differences`] methods), not skipped:
//!
//! | Service field | ebpf | iptables | nftables | ipvs | userspace | kube-proxy (iptables) |
//! |---|---|---|---|---|---|---|
//! | `status.loadBalancer.ingress[].ip` | answered from outside, pods and the node | answered | answered | answered | not served (warned and counted) | answered |
//! | ... with `ipMode: Proxy` | not answered | not answered | not answered | not answered | not answered | not answered |
//! | `spec.externalIPs` | answered from outside, pods and the node | answered | answered | answered | not served (warned and counted) | answered |
//! | another port on those addresses | as without a proxy | as without a proxy | as without a proxy | refused: the addresses are local (on `kube-ipvs0`), as in kube-proxy's IPVS mode | as without a proxy | as without a proxy |
//! | `externalTrafficPolicy: Local` on an LB IP, from outside | the node's endpoints only | the node's endpoints only | the node's endpoints only | the node's endpoints only | not served | the node's endpoints only |
//! | ... from a pod (`clusterCIDR` set), to the LB IP and the node port | every endpoint (the programs short-circuit sources in the pod CIDR) | every endpoint (`KUBE-EXT` short-circuits pod traffic) | every endpoint (the same in `external-…`) | the node's endpoints only (the virtual servers of external addresses have only the node's real servers, as in kube-proxy's IPVS mode) | LB IP not served; node port: every endpoint (the legacy proxier ignores the policies) | every endpoint |
//! | `loadBalancerSourceRanges` | outside the ranges dropped (no answer); NodePort and ClusterIP not filtered | dropped (KUBE-FW) | dropped | dropped (KUBE-LOAD-BALANCER-FW) | not served (no LB IP) | dropped |
//! | ... an entry that does not parse | skipped, logged, counted | the same | the same | the same | the same | skipped, logged |
//! | `sessionAffinity: ClientIP` | sticks; moves after the timeout, and when its backend leaves | the same (`-m recent`) | the same (affinity sets) | sticks; after the timeout it stays while IPVS still holds connection entries of the client (TIME_WAIT, 2 min) under its persistence template, as in kube-proxy's IPVS mode | the same as ebpf (the agent's balancer) | sticks; moves after the timeout |
//! | ... one client through the ClusterIP and the node port | one backend (affinity is kept per Service port) | one backend (one `recent` list per endpoint of the port) | one backend (one affinity set per endpoint of the port) | two may differ (persistence is per virtual server) | one backend | one backend (IPVS mode: per virtual server) |
//! | NodePort from the node, `NODE_IP:NODEPORT` | answered | answered | answered | answered | answered | answered |
//! | NodePort on an address added after the agent started (`nodePortAddresses` unset, whatever `--node-ip` says) | answered from the next sync (it lists the node's addresses at each full sync; the node's own traffic at once: the socket programs follow address events) | answered (`addrtype LOCAL`) | answered (`fib daddr type local`) | answered from the next sync (it lists the node's addresses at each sync) | answered (`addrtype LOCAL`) | answered (IPVS mode: from the next sync) |
//!
//! The userspace mode is kube-proxy's legacy userspace proxier, which
//! xproxy keeps for comparison with ClusterIPs and NodePorts only: of the
//! fields above it honours affinity; for the others the agent warns (a log
//! line naming the Service) and counts ([`UNSERVED`]), and the requests
//! end as without a proxy.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    thread,
    time::Duration,
};

use anyhow::{Context, Result, anyhow, ensure};
use serde_json::{Value, json};
use testbed::{
    agent_bed::{AgentBed, Mode, READY_WITHIN, SKIPPED, on_own_bed, seed_node_port},
    fixtures::{
        PortDef, SEED_NODE_PORT, TrafficPolicy, backend_ips, load_balancer, on_node, seed_objects_with, seed_tcp_udp,
        service_with, slice_with, yaml_documents,
    },
    netns::{self, Netns},
    probe::{
        self, Checks, Outcome, PROTOCOLS, Place, Protocol, REQUEST_TIMEOUT, REQUESTS, Stages, backend_names,
        expect_all_backends, expect_backends, expect_backends_from, expect_outcome, expect_outcome_from, proto_name,
    },
    topology::{BACKENDS, CLIENT_IP, NODE_IP, POD_CIDR, TARGET_PORT, Topology},
};

// ---------------------------------------------------------------------------
// Addresses and Services.

/// The documentation networks the LB and external IPs come from.
const TEST_NETS: [&str; 2] = ["198.51.100.0/24", "203.0.113.0/24"];
/// The ClusterIPs, which the source ranges' clients reach through the node.
const CLUSTER_NET: &str = "10.96.0.0/16";

/// Every Service's port (-> [`TARGET_PORT`]).
const PORT: u16 = 88;
/// A port no Service has, on the Services' addresses.
const OTHER_PORT: u16 = 8088;

/// `lb-ips`: LoadBalancer, an ingress IP, an ipMode Proxy one, an external IP.
const LB_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 10);
const LB_NODE_PORT: u16 = 30810;
const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const LB_PROXY_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);

/// `lb-local`: LoadBalancer with `externalTrafficPolicy: Local`.
const LOCAL_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 11);
const LOCAL_NODE_PORT: u16 = 30811;
const LOCAL_LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
/// The node the EndpointSlice puts `lb-local`'s other endpoints on (they
/// are this bed's pods all the same, so its ClusterIP reaches all three).
const OTHER_NODE: &str = "another-node";

/// `ranges`: LoadBalancer with `loadBalancerSourceRanges`.
const RANGES_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 12);
const RANGES_NODE_PORT: u16 = 30812;
const RANGES_LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 30);
/// The client's subnet, with spaces around it as the API server allows.
const INSIDE_RANGE: &str = " 172.30.0.0/24 ";
const BAD_RANGE: &str = "not-a-cidr";
/// A second address of the client namespace, outside [`INSIDE_RANGE`]
/// (the node's default route leads back to it).
const OUTSIDE_SOURCE: Ipv4Addr = Ipv4Addr::new(192, 168, 99, 1);

/// `sticky`: `sessionAffinity: ClientIP`.
const STICKY_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 13);
const STICKY_NODE_PORT: u16 = 30813;
/// Short, for a test (the API server's minimum is 1 s).
const AFFINITY_TIMEOUT: Duration = Duration::from_secs(5);

/// An address the node gets after the agent started (on the uplink, in
/// the client's subnet).
const ADDED_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 50);
/// How long a mode may take to answer on a new address: those that list
/// the node's addresses at each sync (not through `addrtype LOCAL` / `fib
/// daddr type local`) see it at the next periodic sync (`syncPeriod`,
/// 30 s by default, as kube-proxy).
const ADDED_WITHIN: Duration = Duration::from_secs(45);

const MANIFEST: &str = "api.yaml";

/// Where the agent counts the Service fields a mode does not honour: its
/// problems, like the objects it skips (issue 12 item 7).
const UNSERVED: &str = SKIPPED;

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// [`PORT`] over TCP and UDP, with `node_port`.
fn tcp_udp(node_port: u16) -> [PortDef; 2] {
    PortDef::tcp_udp(("http", "udp"), PORT, (TARGET_PORT, TARGET_PORT), Some(node_port))
}

/// `lb-ips` and `lb-local` with their EndpointSlices.
fn external_objects() -> Vec<Value> {
    let ports = tcp_udp(LB_NODE_PORT);
    let mut lb = load_balancer(
        service_with("lb-ips", LB_CLUSTER_IP, &ports, None),
        &[(LB_IP, None), (LB_PROXY_IP, Some("Proxy"))],
    );
    lb["spec"]["externalIPs"] = json!([EXTERNAL_IP.to_string()]);
    let local_ports = tcp_udp(LOCAL_NODE_PORT);
    let local = load_balancer(
        service_with("lb-local", LOCAL_CLUSTER_IP, &local_ports, Some(TrafficPolicy::Local)),
        &[(LOCAL_LB_IP, None)],
    );
    let ips = backend_ips();
    let mut endpoints = on_node(&ips[..1]);
    endpoints.extend(ips[1..].iter().map(|ip| (*ip, OTHER_NODE)));
    vec![
        lb,
        slice_with("lb-ips-1", "lb-ips", &ports, &on_node(&ips)),
        local,
        slice_with("lb-local-1", "lb-local", &local_ports, &endpoints),
    ]
}

fn ranges_objects() -> Vec<Value> {
    let ports = tcp_udp(RANGES_NODE_PORT);
    let mut svc = load_balancer(
        service_with("ranges", RANGES_CLUSTER_IP, &ports, None),
        &[(RANGES_LB_IP, None)],
    );
    svc["spec"]["loadBalancerSourceRanges"] = json!([INSIDE_RANGE, BAD_RANGE]);
    vec![svc, slice_with("ranges-1", "ranges", &ports, &on_node(&backend_ips()))]
}

/// `sticky` with `backends`, with ClientIP affinity or without.
fn sticky_objects(affinity: bool, backends: &[Ipv4Addr]) -> Vec<Value> {
    let ports = [PortDef::tcp(PORT, TARGET_PORT, Some(STICKY_NODE_PORT))];
    let mut svc = service_with("sticky", STICKY_CLUSTER_IP, &ports, None);
    if affinity {
        svc["spec"]["sessionAffinity"] = json!("ClientIP");
        svc["spec"]["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": AFFINITY_TIMEOUT.as_secs()}});
    }
    vec![svc, slice_with("sticky-1", "sticky", &ports, &on_node(backends))]
}

// ---------------------------------------------------------------------------
// The modes and where they differ.

/// How requests to another port of an LB or external IP end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OtherPorts {
    /// As without a proxy: the mode leaves them alone.
    AsWithoutProxy,
    /// Refused by the node: the address is one of its own.
    Refused,
}

/// What becomes of a client's affinity once it was idle past the timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AfterIdle {
    /// Its next connection is balanced anew.
    Moves,
    /// It keeps its backend (for now).
    Stays,
}

/// Which endpoints a pod's traffic to a `Local` external frontend reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PodsToLocal {
    /// Every endpoint: short-circuited, as kube-proxy's iptables mode does
    /// with traffic from the cluster CIDR.
    Every,
    /// The node's own, as any client's.
    NodesOwn,
}

/// Where the modes differ (the table at the top).
trait Differences {
    fn serves_external_addresses(self) -> bool;
    fn other_ports(self) -> OtherPorts;
    fn affinity_after_idle(self) -> AfterIdle;
    fn pods_to_local_external(self) -> PodsToLocal;
    fn affinity_per_service_port(self) -> bool;
}

impl Differences for Mode {
    /// LB IPs and external IPs (with their source ranges and policy).
    fn serves_external_addresses(self) -> bool {
        match self {
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Ipvs => true,
            // kube-proxy's legacy userspace proxier, kept for ClusterIPs
            // and NodePorts: the agent warns and counts instead.
            Mode::Userspace => false,
        }
    }

    fn other_ports(self) -> OtherPorts {
        match self {
            // A lookup of (address, port, protocol) that misses, or rules
            // that match the Service's port only.
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Userspace => OtherPorts::AsWithoutProxy,
            // IPVS sees only traffic to local addresses: like ClusterIPs,
            // LB and external IPs are bound to kube-ipvs0, so the node
            // itself answers their other ports (RST, port unreachable), as
            // in kube-proxy's IPVS mode.
            Mode::Ipvs => OtherPorts::Refused,
        }
    }

    fn affinity_after_idle(self) -> AfterIdle {
        match self {
            // The idle time is measured from the client's last new
            // connection (the programs' affinity map, `-m recent
            // --seconds`, the affinity sets' timeout, the balancer).
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Userspace => AfterIdle::Moves,
            // A persistence template expires only once no connection
            // entry it controls is left, and a closed TCP connection's
            // entry stays in TIME_WAIT for 2 minutes: longer than the
            // scenario waits (kube-proxy's IPVS mode behaves the same).
            Mode::Ipvs => AfterIdle::Stays,
        }
    }

    fn pods_to_local_external(self) -> PodsToLocal {
        match self {
            // The pod CIDR trie, KUBE-EXT's and `external-…`'s
            // short-circuit; the legacy proxier ignores the policies.
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Userspace => PodsToLocal::Every,
            // The virtual servers of the node port and the LB IP have the
            // node's real servers only, whoever the client (kube-proxy's
            // IPVS mode too).
            Mode::Ipvs => PodsToLocal::NodesOwn,
        }
    }

    /// Whether one client gets one backend through every frontend of a
    /// Service port (else per frontend: IPVS persistence is per virtual
    /// server, so two frontends may or may not agree; not asserted).
    fn affinity_per_service_port(self) -> bool {
        match self {
            // The programs' affinity id, kube-proxy's `recent` lists and
            // the affinity sets per endpoint of the port, the legacy
            // proxier's one balancer per port.
            Mode::Ebpf | Mode::Iptables | Mode::Nftables | Mode::Userspace => true,
            Mode::Ipvs => false,
        }
    }
}

// ---------------------------------------------------------------------------
// Running a feature in a mode.

/// A scenario: the steps of one feature in one mode on a fresh bed.
type Scenario = fn(Mode, &str, &mut AgentBed, &mut Checks) -> Result<()>;

/// Runs `scenario` in `mode` on a bed of its own, if the mode can run here.
fn run(feature: &str, mode: Mode, scenario: Scenario) {
    let label = format!("{feature}_{}", mode.name());
    if !mode.available(&label) {
        return;
    }
    on_own_bed(&label, |bed, checks| scenario(mode, &label, bed, checks));
}

/// A test per mode of each feature, in a module named after it
/// (`external_addresses::ebpf`, ...: `cargo test --test service_api --
/// ipvs` picks a mode, `-- affinity::` a feature).
macro_rules! per_mode {
    ($($feature:ident),* $(,)?) => {$(
        mod $feature {
            use super::{Mode, run};

            per_mode!(@tests $feature: ebpf Ebpf, iptables Iptables, nftables Nftables, ipvs Ipvs, userspace Userspace);
        }
    )*};
    (@tests $feature:ident: $($test:ident $mode:ident),*) => {$(
        #[test]
        fn $test() {
            run(stringify!($feature), Mode::$mode, super::$feature);
        }
    )*};
}

per_mode!(external_addresses, source_ranges, affinity, node_port_addresses);

/// Writes `objects` as the manifest, starts the agent in `mode` and waits
/// until `ready` answers the client.
fn start(bed: &mut AgentBed, mode: Mode, objects: &[Value], ready: SocketAddrV4) -> Result<()> {
    start_with(bed, mode, objects, ready, &[])
}

/// [`start`] with `extra` arguments for the agent.
fn start_with(bed: &mut AgentBed, mode: Mode, objects: &[Value], ready: SocketAddrV4, extra: &[&str]) -> Result<()> {
    bed.write_manifest(MANIFEST, &yaml_documents(objects))?;
    let mut args = bed.manifest_args();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    bed.start_agent_in(mode.name(), &args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    bed.wait_answering(ready, READY_WITHIN)?;
    Ok(())
}

type Probe = probe::Probe<Place>;

/// What requests to `targets` from every place do without a proxy; all
/// are to addresses of Services (nothing answers them without a proxy).
struct Baseline(probe::Baseline<Place>);

impl Baseline {
    fn take(label: &str, topo: &Topology, targets: &[SocketAddrV4]) -> Result<Self> {
        let mut probes = Vec::new();
        for protocol in PROTOCOLS {
            for from in [Place::Client, Place::ClientPod, Place::Node] {
                for to in targets {
                    probes.push(Probe {
                        from,
                        protocol,
                        to: (*to).into(),
                        service: true,
                    });
                }
            }
        }
        Ok(Self(probe::Baseline::take(label, probes, |p| Ok(p.ns(topo)))?))
    }

    fn same(&self, topo: &Topology) -> Result<String> {
        self.0.same(|p| Ok(p.ns(topo)))
    }
}

/// Every backend answers `to` over `protocol` from `from`; or, where
/// `served` is false, nothing does (as without a proxy).
fn answered_or_not(served: bool, from: &Netns, protocol: Protocol, to: SocketAddrV4) -> Result<String> {
    if served {
        expect_all_backends(from, protocol, to)
    } else {
        expect_outcome(from, protocol, to, &Outcome::NoAnswer)
    }
}

/// What a mode does not serve of `services` is logged and counted through
/// the agent's problems (a WARN line naming the Service, and
/// [`UNSERVED`], beyond the `expected` problems of the manifests
/// themselves). A mode that serves them names none of the `plain` ones
/// (those it serves as kube-proxy does) in a warning; it may warn about
/// how it serves the others (a policy it applies otherwise, say).
fn check_unserved(mode: Mode, bed: &AgentBed, checks: &mut Checks, services: &[&str], plain: &[&str], expected: f64) {
    let counted = bed.metrics().map(|m| m.value(UNSERVED).unwrap_or(0.0));
    let log = bed.log();
    if mode.serves_external_addresses() {
        for service in plain {
            let name = format!("default/{service}");
            let lines = warnings_naming(&log, &name);
            checks.check(
                &format!("no warning about {name}"),
                if lines.is_empty() {
                    Ok("none".into())
                } else {
                    Err(anyhow!("{}", lines.join("\n")))
                },
            );
        }
        checks.check(
            &format!("the manifests' {expected} problem(s) counted"),
            counted.and_then(|n| {
                ensure!(n >= expected, "{UNSERVED} = {n}, expected at least {expected}");
                Ok(format!("{UNSERVED} = {n}"))
            }),
        );
        return;
    }
    checks.check(
        &format!("the {} mode counts what it does not serve", mode.name()),
        counted.and_then(|n| {
            ensure!(
                n > expected,
                "{UNSERVED} = {n}, the manifests' own problems: {expected}"
            );
            Ok(format!("{UNSERVED} = {n}"))
        }),
    );
    for service in services {
        let name = format!("default/{service}");
        checks.check(
            &format!("the agent warns that the LB / external IPs of {name} are not served"),
            warned_about(&log, &name),
        );
    }
}

/// The warning lines of `log` that name `object` (followed by no more of
/// a name: `default/lb` is not `default/lb-local`), but for the bad
/// source range's.
fn warnings_naming<'a>(log: &'a str, object: &str) -> Vec<&'a str> {
    let named = |line: &str| {
        line.match_indices(object).any(|(i, _)| {
            !line[i + object.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        })
    };
    log.lines()
        .filter(|l| l.contains("WARN") && !l.contains(BAD_RANGE) && named(l))
        .collect()
}

/// The warning lines about `object`'s LB or external IPs; at least one.
fn warned_about(log: &str, object: &str) -> Result<String> {
    let about_the_field = |line: &&str| {
        let line = line.to_lowercase();
        ["externalip", "external ip", "load balancer", "loadbalancer"]
            .iter()
            .any(|field| line.contains(field))
    };
    let lines: Vec<&str> = warnings_naming(log, object)
        .into_iter()
        .filter(about_the_field)
        .collect();
    // The log itself is printed when the test fails.
    ensure!(
        !lines.is_empty(),
        "no warning about {object}'s LB / external IPs in the agent's log"
    );
    Ok(lines.join("\n"))
}

// ---------------------------------------------------------------------------
// LB IPs and external IPs.

/// See the module doc.
fn external_addresses(mode: Mode, label: &str, bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    bed.topo.route_to_node(&TEST_NETS)?;
    // The baselines, then the agent.
    let mut stages = Stages::new(2);
    stages.next(&bed.topo)?;
    let proxy_ip = Baseline::take(label, &bed.topo, &[at(LB_PROXY_IP, PORT)])?;
    let other_ports = [at(LB_IP, OTHER_PORT), at(EXTERNAL_IP, OTHER_PORT)];
    let other_baseline = Baseline::take(label, &bed.topo, &other_ports)?;

    stages.next(&bed.topo)?;
    // The pods' network, so that pods' traffic can be told apart (the
    // `Local` policy's short-circuit).
    let cluster_cidr = ["--cluster-cidr", POD_CIDR];
    start_with(bed, mode, &external_objects(), at(NODE_IP, LB_NODE_PORT), &cluster_cidr)?;
    let served = mode.serves_external_addresses();
    let topo = &bed.topo;
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for from in [Place::Client, Place::ClientPod, Place::Node] {
            for (what, ip) in [("LB IP", LB_IP), ("external IP", EXTERNAL_IP)] {
                let to = at(ip, PORT);
                let expected = if served { "every backend answers" } else { "not served" };
                checks.check(
                    &format!("{p} {from:?} -> {what} {to}: {expected}"),
                    answered_or_not(served, from.ns(topo), protocol, to),
                );
            }
        }
    }
    checks.check(
        "the ipMode Proxy ingress IP: every request ends as without a proxy",
        proxy_ip.same(topo),
    );
    check_other_ports(mode, topo, checks, &other_baseline, &other_ports);
    check_local_policy(mode, topo, checks);
    // IPVS serves lb-local as kube-proxy's IPVS mode, not its iptables mode.
    let plain: &[&str] = match mode {
        Mode::Ipvs => &["lb-ips"],
        _ => &["lb-ips", "lb-local"],
    };
    check_unserved(mode, bed, checks, &["lb-ips", "lb-local"], plain, 0.0);
    Ok(())
}

/// Other ports of the LB and external IPs: as without a proxy, or refused
/// by the node (see [`OtherPorts`]).
fn check_other_ports(mode: Mode, topo: &Topology, checks: &mut Checks, baseline: &Baseline, targets: &[SocketAddrV4]) {
    match mode.other_ports() {
        OtherPorts::AsWithoutProxy => checks.check(
            &format!("other ports {targets:?}: every request ends as without a proxy"),
            baseline.same(topo),
        ),
        OtherPorts::Refused => {
            for protocol in PROTOCOLS {
                for from in [Place::Client, Place::ClientPod, Place::Node] {
                    for to in targets {
                        checks.check(
                            &format!("{} {from:?} -> {to}: refused by the node", proto_name(protocol)),
                            expect_outcome(from.ns(topo), protocol, *to, &Outcome::Refused),
                        );
                    }
                }
            }
        }
    }
}

/// `lb-local` from outside: only pod-1, the node's own endpoint, answers
/// its LB IP; from a pod, its LB IP and node port reach every endpoint or
/// the node's own ([`PodsToLocal`]); its ClusterIP (internal traffic)
/// reaches all three.
fn check_local_policy(mode: Mode, topo: &Topology, checks: &mut Checks) {
    let served = mode.serves_external_addresses();
    let local = [BACKENDS[0].0];
    let pod = &topo.client_pod.ns;
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        let to = at(LOCAL_LB_IP, PORT);
        checks.check(
            &format!("{p} client -> eTP Local LB IP {to}: only the node's endpoint {local:?}"),
            if served {
                expect_backends(&topo.client, protocol, to, &local, REQUESTS / 3)
            } else {
                expect_outcome(&topo.client, protocol, to, &Outcome::NoAnswer)
            },
        );
        let pods = mode.pods_to_local_external();
        for (what, to, answered) in [("LB IP", to, served), ("node port", at(NODE_IP, LOCAL_NODE_PORT), true)] {
            let expected = if answered {
                format!("{pods:?}")
            } else {
                "not served".to_owned()
            };
            checks.check(
                &format!("{p} client pod -> eTP Local {what} {to}: {expected}"),
                match (answered, pods) {
                    (false, _) => expect_outcome(pod, protocol, to, &Outcome::NoAnswer),
                    (true, PodsToLocal::Every) => expect_all_backends(pod, protocol, to),
                    (true, PodsToLocal::NodesOwn) => expect_backends(pod, protocol, to, &local, REQUESTS / 3),
                },
            );
        }
        let cluster = at(LOCAL_CLUSTER_IP, PORT);
        checks.check(
            &format!("{p} client pod -> its ClusterIP {cluster}: every endpoint, on any node"),
            expect_all_backends(&topo.client_pod.ns, protocol, cluster),
        );
    }
}

// ---------------------------------------------------------------------------
// loadBalancerSourceRanges.

/// See the module doc.
fn source_ranges(mode: Mode, _label: &str, bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    bed.topo.route_to_node(&[TEST_NETS[1], CLUSTER_NET])?;
    bed.topo
        .client
        .add_addr(&bed.topo.client_if, &format!("{OUTSIDE_SOURCE}/32"))?;
    start(bed, mode, &ranges_objects(), at(NODE_IP, RANGES_NODE_PORT))?;
    let served = mode.serves_external_addresses();
    let client = &bed.topo.client;
    let lb = at(RANGES_LB_IP, PORT);
    let backends = backend_names();
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        let inside = if served { "every backend answers" } else { "not served" };
        checks.check(
            &format!("{p} {CLIENT_IP} (inside the ranges) -> {lb}: {inside}"),
            answered_or_not(served, client, protocol, lb),
        );
        checks.check(
            &format!("{p} {OUTSIDE_SOURCE} (outside the ranges) -> {lb}: dropped, no answer"),
            expect_outcome_from(client, Some(OUTSIDE_SOURCE), protocol, lb, &Outcome::NoAnswer),
        );
        for source in [CLIENT_IP, OUTSIDE_SOURCE] {
            for to in [at(NODE_IP, RANGES_NODE_PORT), at(RANGES_CLUSTER_IP, PORT)] {
                checks.check(
                    &format!("{p} {source} -> {to}: not filtered, every backend answers"),
                    expect_backends_from(client, Some(source), protocol, to, &backends, REQUESTS),
                );
            }
        }
    }
    checks.check(
        &format!("the range {BAD_RANGE:?} is skipped, logged and counted"),
        bad_range_reported(bed),
    );
    // The bad range is one problem of the manifest in every mode.
    check_unserved(mode, bed, checks, &["ranges"], &["ranges"], 1.0);
    Ok(())
}

/// The agent's log names [`BAD_RANGE`] and `xproxy_skipped_objects_total`
/// counts it.
fn bad_range_reported(bed: &AgentBed) -> Result<String> {
    let log = bed.log();
    let line = log
        .lines()
        .find(|l| l.contains(BAD_RANGE))
        .with_context(|| format!("no line names {BAD_RANGE:?} in the log:\n{log}"))?;
    let skipped = bed.metrics()?.value(SKIPPED).unwrap_or(0.0);
    ensure!(skipped >= 1.0, "{SKIPPED} = {skipped}");
    Ok(format!("{SKIPPED} = {skipped}; {line}"))
}

// ---------------------------------------------------------------------------
// sessionAffinity: ClientIP.

/// New connections in a row for "sticks to one backend": with 3 backends
/// balanced at random, the chance that 20 land on one is 3 * (1/3)^20.
const STICKY_REQUESTS: usize = 20;
/// Idle periods past the timeout until a client must have moved: with a
/// fresh pick among 3 each time, the chance that 8 all repeat the last
/// backend is (1/3)^8 < 2e-4.
const IDLE_TRIALS: usize = 8;

/// See the module doc.
fn affinity(mode: Mode, _label: &str, bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    let all = backend_ips();
    start(bed, mode, &sticky_objects(true, &all), at(NODE_IP, STICKY_NODE_PORT))?;
    let pod = &bed.topo.client_pod.ns;
    let cluster = at(STICKY_CLUSTER_IP, PORT);
    let node_port = at(NODE_IP, STICKY_NODE_PORT);
    checks.check(
        &format!("client -> NodePort {node_port}: {STICKY_REQUESTS} new connections, one backend"),
        sticks(&bed.topo.client, node_port),
    );
    let first = sticks(pod, cluster).context("the client pod's affinity to the ClusterIP")?;
    checks.check(
        &format!("client pod -> ClusterIP {cluster}: {STICKY_REQUESTS} new connections, one backend"),
        Ok(first.clone()),
    );
    let through_node_port = sticks(pod, node_port);
    checks.check(
        &format!("client pod -> NodePort {node_port}: one backend, the ClusterIP's where kept per Service port"),
        through_node_port.and_then(|b| {
            ensure!(
                b == first || !mode.affinity_per_service_port(),
                "{b} through the node port, {first} through the ClusterIP"
            );
            Ok(b)
        }),
    );
    let now = after_idle(mode, pod, cluster, &first, checks)?;

    // Its backend leaves the Service.
    let gone = backend_ip(&now)?;
    let rest: Vec<Ipv4Addr> = all.iter().copied().filter(|ip| *ip != gone).collect();
    bed.write_manifest(MANIFEST, &yaml_documents(&sticky_objects(true, &rest)))?;
    checks.check(
        &format!("{now} leaves the EndpointSlice: the client pod moves to another backend and sticks there"),
        moves_off(pod, cluster, &now),
    );

    // Affinity off, then on again.
    let rest_names: Vec<&str> = BACKENDS
        .iter()
        .filter(|(_, ip)| *ip != gone)
        .map(|(name, _)| *name)
        .collect();
    bed.write_manifest(MANIFEST, &yaml_documents(&sticky_objects(false, &rest)))?;
    checks.check(
        "affinity off: new connections spread over the backends",
        spreads(pod, cluster, &rest_names),
    );
    bed.write_manifest(MANIFEST, &yaml_documents(&sticky_objects(true, &rest)))?;
    checks.check("affinity on again: new connections stick", sticks_again(pod, cluster));
    Ok(())
}

/// One TCP request from `from` to `to`: the backend that answered.
fn one_request(from: &Netns, to: SocketAddrV4) -> Result<String> {
    from.run_in(|| netns::tcp_request(to, REQUEST_TIMEOUT))?
        .with_context(|| format!("a request to {to} from {}", from.name()))
}

/// [`STICKY_REQUESTS`] new connections land on one backend: its name.
fn sticks(from: &Netns, to: SocketAddrV4) -> Result<String> {
    let first = one_request(from, to)?;
    for i in 1..STICKY_REQUESTS {
        let answer = one_request(from, to)?;
        ensure!(
            answer == first,
            "connection {} went to {answer}, the first {i} to {first}",
            i + 1
        );
    }
    Ok(first)
}

/// The client pod idles past the timeout, [`IDLE_TRIALS`] times at most:
/// its backend must change at least once (or stay, as the mode says).
/// Returns the backend it is on at the end.
fn after_idle(mode: Mode, from: &Netns, to: SocketAddrV4, first: &str, checks: &mut Checks) -> Result<String> {
    let idle = AFFINITY_TIMEOUT + Duration::from_millis(1500);
    let mut last = first.to_owned();
    let expected = mode.affinity_after_idle();
    let trials = match expected {
        AfterIdle::Moves => IDLE_TRIALS,
        AfterIdle::Stays => 2,
    };
    let mut seen = Vec::new();
    for _ in 0..trials {
        // The wait is the feature: the client must be idle that long.
        thread::sleep(idle);
        let now = one_request(from, to)?;
        seen.push(now.clone());
        let moved = now != last;
        last = now;
        if moved && expected == AfterIdle::Moves {
            break;
        }
    }
    let what = format!("after idle periods of {idle:?}: {expected:?}");
    checks.check(
        &what,
        match expected {
            AfterIdle::Moves if seen.iter().any(|b| b != first) => Ok(format!("{first} then {seen:?}")),
            AfterIdle::Moves => Err(anyhow!("still {first} after {trials} idle periods: {seen:?}")),
            AfterIdle::Stays if seen.iter().all(|b| b == first) => Ok(format!("{first} then {seen:?}")),
            AfterIdle::Stays => Err(anyhow!("moved from {first}: {seen:?}")),
        },
    );
    Ok(last)
}

fn backend_ip(name: &str) -> Result<Ipv4Addr> {
    BACKENDS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, ip)| *ip)
        .with_context(|| format!("{name:?} is no backend"))
}

/// Polls until a request from `from` is answered by another backend than
/// `gone` (the change is programmed), then new connections stick there.
fn moves_off(from: &Netns, to: SocketAddrV4, gone: &str) -> Result<String> {
    let moved = netns::wait_for(
        &format!("{to} to answer from another backend than {gone}"),
        READY_WITHIN,
        || match one_request(from, to) {
            Ok(answer) if answer != gone => Ok(answer),
            Ok(answer) => Err(format!("still {answer}")),
            Err(e) => Err(format!("{e:#}")),
        },
    )?;
    let now = sticks(from, to)?;
    ensure!(now != gone, "back on {gone}");
    Ok(format!("moved to {moved}, sticks to {now}"))
}

/// Polls until two backends answer (the change is programmed), then every
/// one of `backends` answers [`REQUESTS`] new connections.
fn spreads(from: &Netns, to: SocketAddrV4, backends: &[&str]) -> Result<String> {
    let mut seen = Vec::new();
    netns::wait_for(&format!("two backends answering {to}"), READY_WITHIN, || {
        let answer = one_request(from, to).map_err(|e| format!("{e:#}"))?;
        if !seen.contains(&answer) {
            seen.push(answer);
        }
        if seen.len() >= 2 {
            Ok(())
        } else {
            Err(format!("only {seen:?}"))
        }
    })?;
    expect_backends(from, Protocol::Tcp, to, backends, REQUESTS)
}

/// Connections in a row on one backend that show affinity is on again:
/// balanced at random over 2 backends, 12 in a row happen with a chance
/// of 2 * (1/2)^12 < 1e-3, and [`sticks`] follows anyway.
const ON_AGAIN_RUN: usize = 12;

/// Polls until [`ON_AGAIN_RUN`] new connections in a row land on one
/// backend (the change is programmed), then [`sticks`].
fn sticks_again(from: &Netns, to: SocketAddrV4) -> Result<String> {
    let mut run: Vec<String> = Vec::new();
    netns::wait_for(
        &format!("{ON_AGAIN_RUN} connections in a row to one backend"),
        READY_WITHIN,
        || {
            let answer = one_request(from, to).map_err(|e| format!("{e:#}"))?;
            if run.last().is_some_and(|last| *last != answer) {
                run.clear();
            }
            run.push(answer);
            if run.len() >= ON_AGAIN_RUN {
                Ok(())
            } else {
                Err(format!("{} in a row", run.len()))
            }
        },
    )?;
    let backend = sticks(from, to)?;
    Ok(format!("sticks to {backend}"))
}

// ---------------------------------------------------------------------------
// NodePort addresses.

/// See the module doc.
fn node_port_addresses(mode: Mode, _label: &str, bed: &mut AgentBed, checks: &mut Checks) -> Result<()> {
    let objects = seed_objects_with(&seed_tcp_udp(), &on_node(&backend_ips()));
    start(bed, mode, &objects, seed_node_port())?;
    let topo = &bed.topo;
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for from in [Place::Node, Place::ClientPod] {
            checks.check(
                &format!("{p} {from:?} -> {}: every backend answers", seed_node_port()),
                expect_all_backends(from.ns(topo), protocol, seed_node_port()),
            );
        }
    }

    topo.node.add_addr(&topo.uplink, &format!("{ADDED_IP}/24"))?;
    let added = at(ADDED_IP, SEED_NODE_PORT);
    let waited = netns::wait_for(
        &format!("{added}, on an address added after the agent started, to answer the client"),
        ADDED_WITHIN,
        || probe::answers(&topo.client, added),
    );
    checks.check(
        &format!("{added} answers the client within {ADDED_WITHIN:?}"),
        waited.map(|answer| format!("first answer from {answer}")),
    );
    for protocol in PROTOCOLS {
        let p = proto_name(protocol);
        for from in [Place::Client, Place::ClientPod, Place::Node] {
            checks.check(
                &format!("{p} {from:?} -> {added}: every backend answers"),
                expect_all_backends(from.ns(topo), protocol, added),
            );
        }
    }
    Ok(())
}
