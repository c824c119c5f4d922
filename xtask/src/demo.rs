//! `cargo xtask demo`: the seed scenario on a simulated cluster.
//!
//! Builds the programs and the agent, creates a node with three nginx-like
//! pods (each answers with its name) and an outside client in network
//! namespaces, runs `xproxy run` in the node with the user's own
//! `proxy.yaml` and (a copy of) the seed manifests, and shows which pod
//! answered each request through the NodePort and the ClusterIP. Then
//! [`story`]: a scale-up, a pod removed, `kill -9` of the agent under load
//! without a failed request, and cleanup. Everything is removed at the
//! end, also on failure.

mod story;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use testbed::{
    agent::AgentProcess,
    netns::{self, Netns},
    privileged::unique_name,
    topology::{NODE_IP, Offloads, Topology},
};

use crate::{build_ebpf, command, setup};

/// From examples/seed/manifests/nginx.yaml.
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 88);
const PORT: u16 = 88;
const NODE_PORT: u16 = 30791;
/// Requests per path: enough that each of the 3 pods answers some
/// (a pod missing from 30 random picks: 3 * (2/3)^30 < 2e-5).
const REQUESTS: usize = 30;
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long the agent may take to program the seed Service.
const READY_WITHIN: Duration = Duration::from_secs(20);

pub fn demo(root: &Path) -> Result<()> {
    if !testbed::privileged::is_root() {
        bail!("the demo creates network namespaces and loads eBPF programs: run it as root");
    }
    step("checking the machine: the test bed's programs, bpffs");
    setup::ensure_programs(setup::NAMESPACE_TOOLS)?;
    setup::ensure_bpffs()?;
    step("building the eBPF programs and the agent");
    build_ebpf::build_ebpf(root, &build_ebpf::Options::default())?;
    let xproxy = build_agent(root)?;

    step("creating the cluster: a node, the seed's pods pod-1..3 and an outside client (network namespaces)");
    let topo = Topology::build(Offloads::On)?;
    let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name("xproxy-demo-"));
    let seed = root.join("examples/seed");
    let manifests = story::Manifests::copy(&seed.join("manifests"))?;
    let args: Vec<String> = vec![
        "--config".into(),
        seed.join("proxy.yaml").display().to_string(),
        "--mode".into(),
        "ebpf".into(),
        "--manifests".into(),
        manifests.dir.display().to_string(),
        "--node-ip".into(),
        NODE_IP.to_string(),
        // The node the seed's EndpointSlice puts the pods on: local
        // backends, so NodePort traffic needs no SNAT and stays in XDP.
        "--hostname-override".into(),
        "demo-node".into(),
    ];
    step(&format!(
        "starting the agent in the node: xproxy run {} --pin-path {}",
        args.join(" "),
        pin_path.display()
    ));
    let mut agent = AgentProcess::start(&xproxy, &topo.node, &pin_path, &args, None)?;

    let result = show_traffic(&topo, &agent).and_then(|()| {
        story::run(&mut story::Demo {
            topo: &topo,
            agent: &mut agent,
            agent_args: &args,
            manifests: &manifests,
            xproxy: &xproxy,
        })
    });
    step("removing the namespaces and anything left of the agent");
    drop(agent);
    if result.is_ok() {
        println!(
            "
The demo ran every step: xproxy served the seed Service through every change."
        );
    }
    result
}

fn step(what: &str) {
    println!("\n==> {what}");
}

fn build_agent(root: &Path) -> Result<PathBuf> {
    command::run(command::workspace_cargo(root).args(["build", "--release", "-p", "proxy-userspace"]))
        .context("building xproxy")?;
    Ok(root.join("target/release/xproxy"))
}

fn show_traffic(topo: &Topology, agent: &AgentProcess) -> Result<()> {
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let cluster_ip = SocketAddrV4::new(CLUSTER_IP, PORT);
    wait_until_answering(&topo.client, node_port)?;

    let paths = [
        ("the outside client", &topo.client, node_port),
        ("a pod (client-pod)", &topo.client_pod.ns, cluster_ip),
        ("the node itself", &topo.node, cluster_ip),
    ];
    let mut failures = 0;
    for (who, ns, addr) in paths {
        step(&format!("{REQUESTS} requests from {who} to {addr}"));
        let answers = ns.run_in(|| {
            (0..REQUESTS)
                .map(|_| netns::tcp_request(addr, TIMEOUT))
                .collect::<Vec<_>>()
        })?;
        let mut per_pod = std::collections::BTreeMap::new();
        for (i, answer) in answers.iter().enumerate() {
            match answer {
                Ok(pod) => {
                    println!("  request {:>2}: answered by {pod}", i + 1);
                    *per_pod.entry(pod.clone()).or_insert(0) += 1;
                }
                Err(e) => {
                    failures += 1;
                    println!("  request {:>2}: FAILED: {e}", i + 1);
                }
            }
        }
        let summary: Vec<String> = per_pod.iter().map(|(pod, n)| format!("{pod}: {n}")).collect();
        println!("  answered by {} pods ({})", per_pod.len(), summary.join(", "));
    }
    step("xproxy status (the live data path)");
    print!("{}", agent.status()?);
    if failures > 0 {
        bail!("{failures} requests failed");
    }
    Ok(())
}

fn wait_until_answering(client: &Netns, addr: SocketAddrV4) -> Result<()> {
    let started = Instant::now();
    netns::wait_for("the seed Service to answer through its NodePort", READY_WITHIN, || {
        client
            .run_in(|| netns::tcp_request(addr, Duration::from_millis(300)))
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    })?;
    println!("  programmed and answering after {:?}", started.elapsed());
    Ok(())
}
