//! The demo's second half: what happens to a running Service. A pod
//! starts and joins the EndpointSlice (scale-up), a pod leaves it, the
//! agent is killed with SIGKILL and restarted while a client keeps
//! connecting (not one request may fail: the data path is pinned and runs
//! without the agent), and `xproxy cleanup` leaves the node as it was
//! without a proxy. Each step says what it did and how long it took.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use testbed::{
    agent::AgentProcess,
    fixtures::{PortDef, slice_with, yaml_documents},
    netns,
    topology::{NODE_IP, POD_GATEWAY, Pod, TARGET_PORT, Topology, add_pod},
};

use super::{NODE_PORT, TIMEOUT, step};

/// The seed's EndpointSlice and Service, as `examples/seed` names them.
const SLICE: &str = "nginx-service-demo";
const SERVICE: &str = "nginx-service";
/// The manifest file the seed's EndpointSlice is in.
const SEED_FILE: &str = "nginx.yaml";
/// The node the seed's endpoints are on (`--hostname-override`).
const NODE: &str = "demo-node";
/// The pod the scale-up starts (the seed's are pod-1..3).
const NEW_POD: (&str, Ipv4Addr) = ("pod-4", Ipv4Addr::new(10, 244, 0, 21));
/// The seed's pod that leaves (its index in the topology's backends).
const LEAVING: usize = 1;
/// How long a change may take to show in the traffic.
const PROGRAMMED_WITHIN: Duration = Duration::from_secs(10);
/// Consecutive requests without the leaving pod that show it is gone.
const WITHOUT_LEAVING: usize = 30;
/// How long the agent stays dead while the client keeps connecting.
const DEAD_FOR: Duration = Duration::from_secs(2);

/// The seed's manifests, copied where the demo may change them.
pub struct Manifests {
    pub dir: PathBuf,
    seed_text: String,
}

impl Manifests {
    /// Copies every file of `seed` into a fresh directory.
    pub fn copy(seed: &Path) -> Result<Self> {
        let dir = std::env::temp_dir().join(testbed::privileged::unique_name("xproxy-demo-manifests-"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for entry in std::fs::read_dir(seed).with_context(|| format!("reading {}", seed.display()))? {
            let path = entry?.path();
            if let Some(name) = path.file_name() {
                std::fs::copy(&path, dir.join(name)).with_context(|| format!("copying {}", path.display()))?;
            }
        }
        let seed_text = std::fs::read_to_string(dir.join(SEED_FILE)).context("reading the seed manifest")?;
        Ok(Self { dir, seed_text })
    }

    /// Rewrites the seed's file with its EndpointSlice listing `pods`
    /// (the other documents as the user wrote them); returns when.
    fn set_endpoints(&self, pods: &[(&str, Ipv4Addr)]) -> Result<Instant> {
        let kept: Vec<&str> = self
            .seed_text
            .split("\n---\n")
            .filter(|doc| !doc.contains("kind: EndpointSlice"))
            .collect();
        let endpoints: Vec<(Ipv4Addr, &str)> = pods.iter().map(|(_, ip)| (*ip, NODE)).collect();
        let slice = slice_with(SLICE, SERVICE, &[PortDef::tcp(0, TARGET_PORT, None)], &endpoints);
        let text = format!("{}\n{}", kept.join("\n---\n"), yaml_documents(&[slice]));
        testbed::fixtures::write_atomically(&self.dir.join(SEED_FILE), &text)
    }
}

impl Drop for Manifests {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Everything the story needs of the running demo.
pub struct Demo<'a> {
    pub topo: &'a Topology,
    pub agent: &'a mut AgentProcess,
    pub agent_args: &'a [String],
    pub manifests: &'a Manifests,
    pub xproxy: &'a Path,
}

/// Runs the story's steps in order; the first failure ends it.
pub fn run(demo: &mut Demo<'_>) -> Result<()> {
    let new_pod = scale_up(demo)?;
    remove_a_pod(demo, &new_pod)?;
    kill_and_restart(demo)?;
    clean_up(demo)
}

fn node_port() -> SocketAddrV4 {
    SocketAddrV4::new(NODE_IP, NODE_PORT)
}

/// The seed's pods and their addresses, as the topology built them.
fn seed_pods(topo: &Topology) -> Vec<(&'static str, Ipv4Addr)> {
    topo.backends.iter().map(|p| (p.name, p.ip)).collect()
}

/// A new pod starts and joins the EndpointSlice: it answers through the
/// NodePort.
fn scale_up(demo: &Demo<'_>) -> Result<Pod> {
    step(&format!(
        "scale-up: pod {} ({}) starts and joins the EndpointSlice",
        NEW_POD.0, NEW_POD.1
    ));
    let pod = add_pod(&demo.topo.node, POD_GATEWAY, NEW_POD.0, NEW_POD.1)?;
    pod.ns.serve_tcp(TARGET_PORT, NEW_POD.0)?;
    let mut pods = seed_pods(demo.topo);
    pods.push(NEW_POD);
    let written = demo.manifests.set_endpoints(&pods)?;
    netns::wait_for(&format!("{} to answer", NEW_POD.0), PROGRAMMED_WITHIN, || {
        match demo.topo.client.run_in(|| netns::tcp_request(node_port(), TIMEOUT)) {
            Ok(Ok(answer)) if answer == NEW_POD.0 => Ok(()),
            Ok(Ok(answer)) => Err(format!("answered by {answer}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        }
    })?;
    println!(
        "  {} answers through the NodePort, {:?} after the manifest changed",
        NEW_POD.0,
        written.elapsed()
    );
    Ok(pod)
}

/// A pod leaves the EndpointSlice: no new connection reaches it.
fn remove_a_pod(demo: &Demo<'_>, new_pod: &Pod) -> Result<()> {
    let leaving = demo.topo.backends.get(LEAVING).context("the seed's pods")?.name;
    step(&format!("a pod removed: {leaving} leaves the EndpointSlice"));
    let mut pods: Vec<(&str, Ipv4Addr)> = seed_pods(demo.topo)
        .into_iter()
        .filter(|(name, _)| *name != leaving)
        .collect();
    pods.push((new_pod.name, new_pod.ip));
    let written = demo.manifests.set_endpoints(&pods)?;
    let mut run = 0;
    netns::wait_for(&format!("{leaving} to be left out"), PROGRAMMED_WITHIN, || {
        match demo.topo.client.run_in(|| netns::tcp_request(node_port(), TIMEOUT)) {
            Ok(Ok(answer)) if answer == leaving => run = 0,
            Ok(Ok(_)) => run += 1,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(e) => return Err(format!("{e:#}")),
        }
        if run >= WITHOUT_LEAVING {
            Ok(())
        } else {
            Err(format!("{run} requests in a row without {leaving}"))
        }
    })?;
    println!(
        "  {WITHOUT_LEAVING} requests in a row answered by the others, {:?} after the manifest changed",
        written.elapsed()
    );
    Ok(())
}

/// SIGKILL to the agent while the client connects without pause; a new
/// agent adopts the pinned data path. Every request must be answered.
fn kill_and_restart(demo: &mut Demo<'_>) -> Result<()> {
    step("kill -9 of the agent while the client keeps connecting, then a restart");
    let stop = AtomicBool::new(false);
    let (answered, failures) = std::thread::scope(|scope| -> Result<_> {
        let load = scope.spawn(|| demo.topo.client.run_in(|| keep_connecting(&stop)));
        let outage = kill_then_restart(demo);
        stop.store(true, Ordering::Relaxed);
        let counts = load
            .join()
            .map_err(|_| anyhow::anyhow!("the client thread panicked"))??;
        outage?;
        Ok(counts)
    })?;
    println!(
        "  {answered} requests answered, {} failed, with the agent dead for {DEAD_FOR:?}",
        failures.len()
    );
    if !failures.is_empty() {
        bail!("requests failed across the agent's restart: {failures:?}");
    }
    println!("  the restarted agent took over the pinned data path:");
    print!("{}", demo.agent.status()?);
    Ok(())
}

fn kill_then_restart(demo: &mut Demo<'_>) -> Result<()> {
    // Some traffic before the kill.
    std::thread::sleep(Duration::from_millis(500));
    let pid = demo.agent.pid();
    demo.agent.stop(libc::SIGKILL)?;
    println!("  killed the agent (pid {pid:?}) with SIGKILL; the programs keep serving");
    std::thread::sleep(DEAD_FOR);
    demo.agent.restart(demo.agent_args, None)?;
    println!("  restarted the agent (pid {:?})", demo.agent.pid());
    // Traffic while the new agent adopts the maps and syncs.
    std::thread::sleep(Duration::from_secs(2));
    Ok(())
}

/// Requests through the NodePort, one after another, until `stop`:
/// how many were answered, and the errors of those that were not.
fn keep_connecting(stop: &AtomicBool) -> (usize, Vec<String>) {
    let (mut answered, mut failures) = (0, Vec::new());
    while !stop.load(Ordering::Relaxed) {
        match netns::tcp_request(node_port(), TIMEOUT) {
            Ok(_) => answered += 1,
            Err(e) => failures.push(e.to_string()),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    (answered, failures)
}

/// SIGTERM (the data path stays, as kube-proxy's rules do), then `xproxy
/// cleanup`: the NodePort ends as without a proxy (refused by the node).
fn clean_up(demo: &mut Demo<'_>) -> Result<()> {
    step("SIGTERM, then xproxy cleanup: the node as without a proxy");
    demo.agent.stop(libc::SIGTERM)?;
    let answered = demo.topo.client.run_in(|| netns::tcp_request(node_port(), TIMEOUT))?;
    ensure!(
        answered.is_ok(),
        "after SIGTERM the data path should still serve: {answered:?}"
    );
    println!(
        "  after SIGTERM the NodePort still answers ({}): the data path stays",
        answered?
    );
    let mut cmd = demo.topo.node.command(demo.xproxy)?;
    cmd.args(["cleanup", "--pin-path"]).arg(demo.agent.pin_path());
    let output = netns::run(&mut cmd).context("xproxy cleanup")?;
    print!("{output}");
    let after = demo.topo.client.run_in(|| netns::tcp_request(node_port(), TIMEOUT))?;
    match after {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            println!("  {} is refused now: nothing of xproxy's is left", node_port());
            Ok(())
        }
        other => bail!(
            "after cleanup {} gave {other:?}, expected connection refused",
            node_port()
        ),
    }
}
