//! `xproxy trace` against a running agent: the real binary in the ebpf
//! mode on the seed (ClusterIP 10.96.0.88:88, NodePort 30791, three
//! backends) in the test bed's node namespace, traced to the ClusterIP
//! from a pod, to the NodePort from outside and to an address that is no
//! Service; the live maps read back before and after through their pins.
//!
//! Before Linux 6.6 the tc programs are cls_bpf filters, which leave no
//! pin: the trace finds the program by name and pinned maps, and a pod's
//! hook needs `--iface` (given here on those kernels; `cargo xtask vm`
//! runs this suite on 6.1).
//!
//! No traffic is sent: the only packets the programs count meanwhile are
//! the kernel's own (ARP, IPv6 neighbour discovery), which count as
//! `pass_not_ipv4_or_l4`; every other counter and the conntrack table must
//! be exactly as they were.

use std::net::{Ipv4Addr, SocketAddrV4};

use anyhow::{Context, Result, ensure};
use proxy_common::{CtKey, CtValue, Verdict, VerdictCounter, maps};
use proxy_userspace::mode::ebpf::{LINKS_DIR, ServiceMaps, has_tcx};
use serde_json::Value;
use testbed::{
    agent_bed::{AgentBed, READY_WITHIN},
    fixtures::{SEED_CLUSTER_IP, SEED_NODE_PORT, SEED_PORT, backend_ips},
    netns,
    privileged::require_root,
    probe::answers,
    topology::{CLIENT_IP, CLIENT_POD, NODE_IP, TARGET_PORT},
};

/// What the pinned maps hold that a trace must leave alone.
#[derive(Debug, PartialEq, Eq)]
struct State {
    conntrack: Vec<(CtKey, CtValue)>,
    /// Every verdict but `pass_not_ipv4_or_l4` (the kernel's own packets).
    verdicts: Vec<(Verdict, VerdictCounter)>,
}

fn state(bed: &AgentBed) -> Result<State> {
    let maps = ServiceMaps::open(bed.pin_path(), vec![]).context("opening the pinned maps")?;
    let mut conntrack = maps.conntrack_entries()?;
    conntrack.sort_by_key(|(k, _)| (k.saddr_be, k.daddr_be, k.sport_be, k.dport_be, k.proto));
    let verdicts = maps
        .verdict_counts()?
        .into_iter()
        .filter(|(v, _)| *v != Verdict::PassNotIpv4OrL4)
        .collect();
    Ok(State { conntrack, verdicts })
}

/// `xproxy trace --pin-path PINS --from FROM --to TO EXTRA...` in the
/// node namespace; its stdout.
fn trace(bed: &AgentBed, from: &str, to: &str, extra: &[&str]) -> Result<String> {
    let mut cmd = bed.topo.node.command(bed.xproxy())?;
    cmd.arg("trace").arg("--pin-path").arg(bed.pin_path());
    cmd.args(["--from", from, "--to", to]).args(extra);
    netns::run(&mut cmd)
}

/// `--hook pod` from the pod with address `ip`: before Linux 6.6 with the
/// pod's interface (`--iface`), which no pin names there.
fn pod_hook(bed: &AgentBed, ip: Ipv4Addr) -> Vec<String> {
    let mut args = vec!["--hook".to_owned(), "pod".to_owned()];
    let mut pods = bed.topo.backends.iter().chain([&bed.topo.client_pod]);
    if !has_tcx()
        && let Some(pod) = pods.find(|p| p.ip == ip)
    {
        args.extend(["--iface".to_owned(), pod.node_if.clone()]);
    }
    args
}

/// `hook` followed by `more`, as `trace` takes them.
fn with<'a>(hook: &'a [String], more: &[&'a str]) -> Vec<&'a str> {
    hook.iter().map(String::as_str).chain(more.iter().copied()).collect()
}

/// [`trace`] with `--json`, parsed.
fn trace_json(bed: &AgentBed, from: &str, to: &str, extra: &[&str]) -> Result<Value> {
    let out = trace(bed, from, to, &[extra, &["--json"]].concat())?;
    serde_json::from_str(&out).with_context(|| format!("trace output is not JSON:\n{out}"))
}

fn endpoint(headers: &Value, side: &str) -> Option<SocketAddrV4> {
    let addr: Ipv4Addr = headers[side].as_str()?.parse().ok()?;
    let port = u16::try_from(headers[format!("{side}_port")].as_u64()?).ok()?;
    Some(SocketAddrV4::new(addr, port))
}

/// A trace to a Service frontend: a new flow DNATed to one of the seed's
/// backends, the rewritten destination that backend, the source kept, the
/// flow's two conntrack entries undone.
fn expect_dnat(report: &Value, frontend: SocketAddrV4) -> Result<SocketAddrV4> {
    ensure!(report["action"] == "TC_ACT_OK", "return code:\n{report:#}");
    expect_dnat_to(report, frontend)
}

/// [`expect_dnat`] whatever the program returned.
fn expect_dnat_to(report: &Value, frontend: SocketAddrV4) -> Result<SocketAddrV4> {
    ensure!(report["verdict"] == "dnat_new", "verdict:\n{report:#}");
    let backend = seed_backend(report)?;
    ensure!(
        endpoint(&report["before"], "dst") == Some(frontend),
        "destination before:\n{report:#}"
    );
    ensure!(
        endpoint(&report["after"], "dst") == Some(backend),
        "the destination was not rewritten to the backend {backend}:\n{report:#}"
    );
    ensure!(
        endpoint(&report["after"], "src") == endpoint(&report["before"], "src"),
        "the source changed:\n{report:#}"
    );
    ensure!(
        report["undone"]["conntrack_entries"] == 2 && report["undone"]["counters"] == true,
        "undone:\n{report:#}"
    );
    Ok(backend)
}

/// The backend the report names, which must be one of the seed's.
fn seed_backend(report: &Value) -> Result<SocketAddrV4> {
    let backend: SocketAddrV4 = report["backend"]
        .as_str()
        .and_then(|b| b.parse().ok())
        .with_context(|| format!("no backend:\n{report:#}"))?;
    let seed: Vec<SocketAddrV4> = backend_ips()
        .into_iter()
        .map(|ip| SocketAddrV4::new(ip, TARGET_PORT))
        .collect();
    ensure!(seed.contains(&backend), "backend {backend} is not one of {seed:?}");
    Ok(backend)
}

/// A backend reaching itself through the Service (hairpin): traced until
/// the pick is the backend itself (each pick is one of three, so 40 tries
/// all miss with a chance of (2/3)^40 < 1e-7), the skb then carries the
/// mark that asks the kernel to masquerade the flow.
fn hairpin(bed: &AgentBed, cluster_ip: SocketAddrV4) -> Result<Value> {
    let backend = backend_ips()[0];
    let from = backend.to_string();
    for _ in 0..40 {
        let hook = pod_hook(bed, backend);
        let report = trace_json(bed, &from, &cluster_ip.to_string(), &with(&hook, &["--syn"]))?;
        if expect_dnat(&report, cluster_ip)?.ip() == &backend {
            ensure!(
                report["mark"].as_u64().is_some_and(|m| m != 0),
                "a hairpin flow is not marked for masquerade:\n{report:#}"
            );
            return Ok(report);
        }
    }
    anyhow::bail!("40 traces from {backend} to {cluster_ip} never picked {backend}")
}

/// Whether conntrack holds an entry of the flow from `client` either way.
fn tracks(state: &State, client: SocketAddrV4) -> bool {
    let be = u32::from_ne_bytes(client.ip().octets());
    let port = client.port().to_be();
    state
        .conntrack
        .iter()
        .any(|(k, _)| (k.saddr_be == be && k.sport_be == port) || (k.daddr_be == be && k.dport_be == port))
}

/// Runs `scenario` on a fresh bed; an error fails the test (the bed
/// prints the agent's log as it unwinds).
fn run(test: &str, scenario: impl FnOnce(&mut AgentBed) -> Result<()>) {
    if !require_root(test) {
        return;
    }
    let mut bed = AgentBed::new(test).unwrap_or_else(|e| panic!("{test}: setting up the test bed: {e:#}"));
    if let Err(e) = scenario(&mut bed) {
        panic!("{test}: {e:#}");
    }
}

/// Starts the agent on the seed with `extra` flags and waits until its
/// program `program` is attached to the uplink: a pinned link, or before
/// Linux 6.6 a tc filter of that name.
fn start(bed: &mut AgentBed, extra: &[&str], program: &str) -> Result<()> {
    bed.copy_seed_manifests()?;
    let mut args = bed.manifest_args();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    bed.start_agent(&args)?;
    bed.wait_first_sync(READY_WITHIN)?;
    if program != maps::PROG_XDP_UPLINK && !has_tcx() {
        let uplink = bed.topo.uplink.clone();
        return netns::wait_for("the agent's tc filter on the uplink", READY_WITHIN, || {
            let filters = bed
                .topo
                .node
                .command("tc")
                .and_then(|mut tc| netns::run(tc.args(["filter", "show", "dev", &uplink, "ingress"])))
                .map_err(|e| format!("{e:#}"))?;
            if filters.contains(program) {
                Ok(())
            } else {
                Err(format!("no {program} filter on {uplink}:\n{filters}"))
            }
        });
    }
    let link = bed.pin_path().join(LINKS_DIR).join(program).join(&bed.topo.uplink);
    netns::wait_for("the agent's link on the uplink", READY_WITHIN, || {
        if link.exists() {
            Ok(())
        } else {
            Err(format!("no {}", link.display()))
        }
    })
}

#[test]
fn trace_shows_verdict_backend_and_rewrite_and_changes_nothing() {
    run(
        "trace_shows_verdict_backend_and_rewrite_and_changes_nothing",
        tc_scenario,
    );
}

fn tc_scenario(bed: &mut AgentBed) -> Result<()> {
    start(bed, &[], maps::PROG_TC_INGRESS)?;
    let uplink = bed.topo.uplink.clone();
    let before = state(bed)?;

    let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
    let pod = CLIENT_POD.1.to_string();
    let hook = pod_hook(bed, CLIENT_POD.1);
    let to_cluster_ip = trace_json(bed, &pod, &cluster_ip.to_string(), &with(&hook, &["--syn"]))?;
    expect_dnat(&to_cluster_ip, cluster_ip)?;
    ensure!(
        to_cluster_ip["hook"] == "pod" && to_cluster_ip["iface"] != uplink.as_str(),
        "the pod hook ran on the uplink:\n{to_cluster_ip:#}"
    );
    ensure!(
        to_cluster_ip["mark"] == 0,
        "a pod's flow to another pod is masqueraded:\n{to_cluster_ip:#}"
    );
    let hairpin = hairpin(bed, cluster_ip)?;

    let node_port = SocketAddrV4::new(NODE_IP, SEED_NODE_PORT);
    let client = format!("{CLIENT_IP}:40001");
    let to_node_port = trace_json(bed, &client, &node_port.to_string(), &["--iface", &uplink, "--syn"])?;
    expect_dnat(&to_node_port, node_port)?;
    // The seed's backends are on another node (`demo-node`): the kernel
    // must masquerade the flow for its replies to come back this way.
    ensure!(
        to_node_port["program"] == "tc_ingress" && to_node_port["mark"].as_u64().is_some_and(|m| m != 0),
        "a NodePort flow to another node's backend is not marked:\n{to_node_port:#}"
    );

    // The node's own packet to the ClusterIP, on the uplink's egress (where
    // the default route sends it): DNATed, then redirected to the
    // backend's interface, which the route to the backend names.
    let from_node = trace_json(
        bed,
        &NODE_IP.to_string(),
        &cluster_ip.to_string(),
        &["--hook", "tc-egress", "--iface", &uplink, "--syn"],
    )?;
    ensure!(
        from_node["program"] == "tc_egress" && from_node["action"] == "TC_ACT_REDIRECT",
        "the node's packet is not redirected:\n{from_node:#}"
    );
    expect_dnat_to(&from_node, cluster_ip)?;

    let not_a_service = trace_json(bed, &pod, &format!("{NODE_IP}:22"), &["--hook", "tc-ingress"])?;
    ensure!(
        not_a_service["verdict"] == "pass_not_service"
            && not_a_service["action"] == "TC_ACT_OK"
            && not_a_service["backend"].is_null()
            && not_a_service["after"] == not_a_service["before"],
        "a packet to no Service:\n{not_a_service:#}"
    );

    let text = trace(bed, &pod, &cluster_ip.to_string(), &with(&hook, &["--proto", "udp"]))?;
    ensure!(
        text.contains("counted as pass_not_service: not a Service") && text.contains("backend:      -"),
        "UDP to a TCP-only Service port:\n{text}"
    );

    let text = trace(bed, &pod, &cluster_ip.to_string(), &with(&hook, &["--syn"]))?;
    ensure!(
        text.contains("counted as dnat_new") && text.contains("undone:       2 conntrack entries"),
        "to the ClusterIP, as text:\n{text}"
    );
    eprintln!("[trace] to the ClusterIP from a pod, as text:\n{text}");
    eprintln!("[trace] to the NodePort from outside:\n{to_node_port:#}");
    let after = state(bed)?;
    for report in [&to_cluster_ip, &hairpin, &to_node_port, &from_node, &not_a_service] {
        let client = endpoint(&report["before"], "src").context("traced source")?;
        ensure!(!tracks(&after, client), "conntrack holds the traced flow of {client}");
    }
    ensure!(
        after == before,
        "the trace changed the maps:\nbefore: {before:#?}\nafter: {after:#?}"
    );
    Ok(())
}

/// With native XDP on the uplink, a trace on the uplink runs the XDP
/// program. The seed's backends are on another node, so the NodePort flow
/// needs the kernel's masquerade: XDP DNATs it and leaves the SNAT mark in
/// the metadata for tc ingress, and the report shows that mark.
#[test]
fn trace_runs_the_xdp_program_of_an_uplink() {
    run("trace_runs_the_xdp_program_of_an_uplink", |bed| {
        start(bed, &["--xdp", "native"], maps::PROG_XDP_UPLINK)?;
        let before = state(bed)?;
        let node_port = SocketAddrV4::new(NODE_IP, SEED_NODE_PORT).to_string();
        let uplink = bed.topo.uplink.clone();
        let client = CLIENT_IP.to_string();
        let report = trace_json(bed, &client, &node_port, &["--iface", &uplink, "--syn"])?;
        ensure!(
            report["program"] == "xdp_uplink" && report["hook"] == "xdp",
            "not the XDP program:\n{report:#}"
        );
        let backend = seed_backend(&report)?;
        ensure!(
            report["verdict"] == "dnat_new"
                && report["action"] == "XDP_PASS"
                && report["after"]["dst"] == backend.ip().to_string(),
            "not DNATed by XDP:\n{report:#}"
        );
        ensure!(
            report["mark"].as_u64().is_some_and(|m| m != 0) && report["mark_for"] == "the kernel masquerades the flow",
            "no SNAT mark left for tc:\n{report:#}"
        );
        let after = state(bed)?;
        ensure!(
            after == before,
            "the trace changed the maps:\nbefore: {before:#?}\nafter: {after:#?}"
        );
        Ok(())
    });
}

/// A packet of a flow conntrack tracks (a real connection from the client
/// pod, closed): traced with the flow's source port and no SYN, it goes to
/// the flow's backend, and the backend's answer is rewritten back to the
/// ClusterIP; the flow's entries are left exactly as they were (a trace
/// restores what it changed, it does not only delete).
#[test]
fn trace_of_a_tracked_flow_follows_it_and_restores_its_entries() {
    run("trace_of_a_tracked_flow_follows_it_and_restores_its_entries", |bed| {
        start(bed, &[], maps::PROG_TC_INGRESS)?;
        let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
        answers(&bed.topo.client_pod.ns, cluster_ip).map_err(anyhow::Error::msg)?;
        let (key, value) = netns::wait_for("the flow's close in conntrack", READY_WITHIN, || {
            closed_flow(bed, CLIENT_POD.1, cluster_ip)
        })?;
        // Its last ACK may still be on its way: wait until the maps settle.
        let before = netns::wait_for("the maps to settle", READY_WITHIN, || {
            let (first, second) = (state(bed), state(bed));
            match (first, second) {
                (Ok(first), Ok(second)) if first == second => Ok(first),
                (Err(e), _) | (_, Err(e)) => Err(format!("{e:#}")),
                _ => Err("the maps still change".to_owned()),
            }
        })?;
        let from = SocketAddrV4::new(CLIENT_POD.1, key.sport()).to_string();
        let hook = pod_hook(bed, CLIENT_POD.1);
        let report = trace_json(bed, &from, &cluster_ip.to_string(), &with(&hook, &[]))?;
        let (addr, port) = value.nat();
        let backend = SocketAddrV4::new(addr, port);
        ensure!(
            report["verdict"] == "dnat_established"
                && report["backend"] == backend.to_string().as_str()
                && endpoint(&report["after"], "dst") == Some(backend),
            "not the tracked flow's backend {backend}:\n{report:#}"
        );
        // The backend's answer on the flow's way back: its source
        // rewritten to the ClusterIP.
        let hook = pod_hook(bed, addr);
        let reply = trace_json(bed, &backend.to_string(), &from, &with(&hook, &[]))?;
        ensure!(
            reply["verdict"] == "rev_nat"
                && reply["frontend"] == cluster_ip.to_string().as_str()
                && endpoint(&reply["after"], "src") == Some(cluster_ip),
            "the backend's reply is not rewritten back to {cluster_ip}:\n{reply:#}"
        );
        let after = state(bed)?;
        ensure!(
            after == before,
            "the trace changed the maps:\nbefore: {before:#?}\nafter: {after:#?}"
        );
        Ok(())
    });
}

/// The forward entry of the flow from `client` to `frontend`, once both
/// sides have sent their FIN.
fn closed_flow(bed: &AgentBed, client: Ipv4Addr, frontend: SocketAddrV4) -> Result<(CtKey, CtValue), String> {
    let state = state(bed).map_err(|e| format!("{e:#}"))?;
    state
        .conntrack
        .into_iter()
        .find(|(k, v)| {
            k.saddr() == client
                && SocketAddrV4::new(k.daddr(), k.dport()) == frontend
                && !v.is_reply()
                && v.state == proxy_common::conntrack::state::TCP_TIME_WAIT
        })
        .ok_or_else(|| format!("no closed flow of {client} to {frontend}"))
}
