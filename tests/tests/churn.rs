//! Endpoint churn under connection load: no new connection may reach an
//! endpoint that left the Service more than a second before.
//!
//! The client opens short connections to the NodePort one after another,
//! from an ephemeral port range of 1,000 ports, so its ports wrap within
//! about a second and every new connection reuses the tuple of one that
//! ended moments before (its flow in TIME_WAIT on the node; the client
//! reuses its own TIME_WAIT ports, `tcp_tw_reuse`). Meanwhile
//! the EndpointSlice changes 20 times a second: one pod is out for 2.5 s
//! at a time while the other two come and go. A proxy that let a reused tuple follow its old flow sends
//! the new connection to a pod that may have left long ago. After the
//! churn, every connection reaches the final set.
//!
//! Each mode runs on a bed of its own (ebpf, iptables, nftables), with
//! `minSyncPeriod: 100ms` so that a change is programmed well within the
//! second the check allows, once over IPv4 and once over IPv6 (`churn6_*`:
//! the Service is dual-stack, the client connects to the node's IPv6
//! NodePort; the ebpf mode's flows are in `XP_CT6`). The kernel modes' conntrack gives a SYN in
//! TIME_WAIT a new connection and a new NAT decision; the ebpf mode's does
//! the same (`proxy_common::conntrack`).
//!
//! The node is configured as real ones are: the agent knows the pod
//! networks (`--cluster-cidr`, both families), so the ebpf mode keeps the
//! kernel's conntrack off these flows (`notrack`: the backends are pods
//! on this node, no SNAT), and the node's firewall drops forwarded packets
//! the kernel's conntrack finds invalid: a reused tuple the kernel half
//! remembered would be lost to it.

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use testbed::{
    agent_bed::{AgentBed, READY_WITHIN, seed_node_port},
    fixtures::{NODE_NAME, PortDef, dual_stack, service, slice, slice6_with, yaml_documents},
    privileged::require_root,
    probe::Protocol,
    topology::{BACKENDS, NODE_IP6, POD_CIDR, POD_CIDR6, drop_invalid_forwarding, pod_ipv6},
};

const SEED_FILE: &str = "seed.yaml";
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 88);
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x88);
const NODE_PORT: u16 = 30791;
const CHURN: Duration = Duration::from_secs(10);
const CHANGE_EVERY: Duration = Duration::from_millis(50);
/// How long after leaving the Service an endpoint may still get a new
/// connection (the bound: programming takes milliseconds here).
const GRACE: Duration = Duration::from_secs(1);
const FINAL_PROBES: usize = 40;

/// How long one pod stays out of the Service while the others churn.
const PHASE: Duration = Duration::from_millis(2500);

/// The endpoints of change `i`: pod `phase % 3` is out for the whole
/// phase; the other two alternate between both, one and the other.
fn set_of(phase: usize, i: usize) -> Vec<usize> {
    let others: Vec<usize> = (0..3).filter(|p| *p != phase % 3).collect();
    match i % 3 {
        0 => others,
        k => vec![others[k - 1]],
    }
}

/// A manifest change: the set in place from `at` on.
struct Change {
    at: Instant,
    pods: Vec<&'static str>,
}

/// One connection of the load: when it started and who answered.
struct Answer {
    at: Instant,
    pod: String,
}

/// Which family the load connects over.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    /// The NodePort the load connects to.
    fn node_port(self) -> SocketAddr {
        match self {
            Family::V4 => seed_node_port().into(),
            Family::V6 => SocketAddr::new(NODE_IP6.into(), NODE_PORT),
        }
    }
}

/// The Service with `pods` as its endpoints: IPv4 only, or dual-stack with
/// an IPv6 slice of the same pods.
fn manifest(family: Family, pods: &[usize]) -> String {
    let ips: Vec<Ipv4Addr> = pods.iter().map(|i| BACKENDS[*i].1).collect();
    let service = service("nginx-service", CLUSTER_IP, 88, 80, Some(NODE_PORT));
    let slice = slice("nginx-service-1", "nginx-service", 80, &ips);
    if family == Family::V4 {
        return yaml_documents(&[service, slice]);
    }
    let ports = [PortDef {
        name: None,
        protocol: Protocol::Tcp,
        port: 88,
        target_port: 80,
        node_port: Some(NODE_PORT),
    }];
    let endpoints6: Vec<(Ipv6Addr, &str)> = ips.iter().map(|ip| (pod_ipv6(*ip), NODE_NAME)).collect();
    yaml_documents(&[
        dual_stack(service, CLUSTER_IP6),
        slice,
        slice6_with("nginx-service-v6-1", "nginx-service", &ports, &endpoints6),
    ])
}

fn config(bed: &AgentBed) -> Result<Vec<String>> {
    let path = bed.dir().join("proxy.yaml");
    let text = "kind: KubeProxyConfiguration\napiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
                iptables: {minSyncPeriod: 100ms}\nnftables: {minSyncPeriod: 100ms}\n";
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(vec!["--config".into(), path.display().to_string()])
}

fn churn(label: &str, mode: &str, family: Family) {
    if !require_root(label) {
        return;
    }
    let mut bed = AgentBed::new(label).unwrap_or_else(|e| panic!("{label}: test bed: {e:#}"));
    if let Err(e) = run(&mut bed, label, mode, family) {
        panic!("{label}: {e:#}\nagent log:\n{}", bed.log());
    }
}

fn run(bed: &mut AgentBed, label: &str, mode: &str, family: Family) -> Result<()> {
    bed.write_manifest(SEED_FILE, &manifest(family, &[0, 1, 2]))?;
    let mut args = bed.manifest_args();
    args.extend(config(bed)?);
    args.extend(["--cluster-cidr".to_owned(), format!("{POD_CIDR},{POD_CIDR6}")]);
    drop_invalid_forwarding(&bed.topo.node)?;
    if family == Family::V6 {
        // Beside the IPv4 one the bed passes.
        args.extend(["--node-ip".to_owned(), NODE_IP6.to_string()]);
    }
    bed.start_agent_in(mode, &args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    let target = family.node_port();
    bed.wait_answering(target, READY_WITHIN)?;
    let client = &bed.topo.client;
    // The client half-closes first, so its ports go through TIME_WAIT:
    // reusing them after a second (with timestamps) keeps the load going.
    client.sysctl("net.ipv4.ip_local_port_range", "40000 40999")?;
    client.sysctl("net.ipv4.tcp_tw_reuse", "1")?;

    let (changes, answers) = std::thread::scope(|scope| -> Result<_> {
        // The seed's three pods are in place from before the first connection.
        let started = Instant::now();
        let load = scope.spawn(|| client.run_in(|| connect_until(target, Instant::now() + CHURN)));
        let changes = change_endpoints(bed, family, started, started + CHURN);
        let answers = load.join().map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
        Ok((changes?, answers))
    })?;
    ensure!(
        answers.len() > 1000,
        "the load made only {} connections in {CHURN:?}",
        answers.len()
    );
    let late: Vec<String> = answers
        .iter()
        .filter(|a| !allowed(&changes, a))
        .map(|a| format!("{} at +{:?}", a.pod, a.at - changes[0].at))
        .collect();
    ensure!(
        late.is_empty(),
        "{} of {} connections reached a pod that had left more than {GRACE:?} before: {:?}",
        late.len(),
        answers.len(),
        &late[..late.len().min(10)]
    );
    eprintln!(
        "[{label}] {} connections, {} changes, none late",
        answers.len(),
        changes.len()
    );

    // The final set alone, once the agent had a moment to program it.
    let last = changes.last().context("no change made")?;
    std::thread::sleep(GRACE);
    let probes = client.run_in(|| connect_until_count(target, FINAL_PROBES))??;
    let strays: Vec<&String> = probes.iter().filter(|pod| !last.pods.contains(&pod.as_str())).collect();
    ensure!(
        strays.is_empty(),
        "after the churn, connections reached pods outside {:?}: {strays:?}",
        last.pods
    );
    if mode == "ebpf" {
        ensure_untracked(&bed.topo.node, answers.len())?;
    }
    Ok(())
}

/// The ebpf mode kept the kernel's conntrack off the churn's flows: no
/// entry names the node port, while the kernel modes' tables hold one per
/// recent connection (TIME_WAIT lasts two minutes).
fn ensure_untracked(node: &testbed::netns::Netns, connections: usize) -> Result<()> {
    let table = node.exec(&["cat", "/proc/net/nf_conntrack"])?;
    let dport = format!(" dport={NODE_PORT} ");
    let tracked = table.lines().filter(|l| l.contains(&dport)).count();
    ensure!(
        tracked == 0,
        "the kernel's conntrack tracks {tracked} of the {connections} connections to the node port"
    );
    Ok(())
}

/// Rewrites the EndpointSlice every [`CHANGE_EVERY`] until `until`; the
/// first change in the list is the set in place since `started`.
fn change_endpoints(bed: &AgentBed, family: Family, started: Instant, until: Instant) -> Result<Vec<Change>> {
    let mut changes = vec![Change {
        at: started,
        pods: BACKENDS.iter().map(|(name, _)| *name).collect(),
    }];
    let start = Instant::now();
    for i in 0.. {
        let now = Instant::now();
        if now >= until {
            break;
        }
        let phase = ((now - start).as_millis() / PHASE.as_millis()) as usize;
        let set = set_of(phase, i);
        let at = bed.write_manifest(SEED_FILE, &manifest(family, &set))?;
        changes.push(Change {
            at,
            pods: set.iter().map(|i| BACKENDS[*i].0).collect(),
        });
        std::thread::sleep(CHANGE_EVERY);
    }
    Ok(changes)
}

/// Whether `answer`'s pod was in the Service at some moment of the
/// [`GRACE`] before the connection started.
fn allowed(changes: &[Change], answer: &Answer) -> bool {
    let since = answer.at.checked_sub(GRACE).unwrap_or(answer.at);
    changes.iter().enumerate().any(|(i, change)| {
        let ended = changes.get(i + 1).map_or(answer.at, |next| next.at);
        ended >= since && change.at <= answer.at && change.pods.contains(&answer.pod.as_str())
    })
}

/// Connections to `target`, one after another, until `until`.
/// Failures (a connection that found no backend) are not answers.
fn connect_until(target: SocketAddr, until: Instant) -> Vec<Answer> {
    let mut answers = Vec::new();
    while Instant::now() < until {
        let at = Instant::now();
        if let Ok(pod) = testbed::netns::tcp_request(target, Duration::from_secs(1)) {
            answers.push(Answer { at, pod });
        }
    }
    answers
}

fn connect_until_count(target: SocketAddr, count: usize) -> Result<Vec<String>> {
    (0..count)
        .map(|_| testbed::netns::tcp_request(target, Duration::from_secs(2)).context("a connection after the churn"))
        .collect()
}

#[test]
fn churn_ebpf() {
    churn("churn_ebpf", "ebpf", Family::V4);
}

#[test]
fn churn6_ebpf() {
    churn("churn6_ebpf", "ebpf", Family::V6);
}

#[test]
fn churn_iptables() {
    churn("churn_iptables", "iptables", Family::V4);
}

#[test]
fn churn6_iptables() {
    churn("churn6_iptables", "iptables", Family::V6);
}

#[test]
fn churn_nftables() {
    churn("churn_nftables", "nftables", Family::V4);
}

#[test]
fn churn6_nftables() {
    churn("churn6_nftables", "nftables", Family::V6);
}
