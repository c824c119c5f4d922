//! The two-node bed (`tests/tests/two_node.rs`): the [`TwoNodes`]
//! namespaces with the real `xproxy run` binary on each node
//! ([`NodeAgent`], as the one-node bed has one), in any mode, both agents
//! fed by one manifest directory, each with its own `--hostname-override`
//! (the node's name, which the EndpointSlices' `nodeName` refer to),
//! `--node-ip` and pin directory.
//!
//! Everything a test creates (namespaces, pins, files, processes) goes away
//! when its [`TwoNodeBed`] is dropped, also when the test panics; on a panic
//! both agents' logs are printed first.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};

use crate::{
    agent_bed::{Metrics, NodeAgent, TempDir, node_args, write_atomically, xproxy_binary},
    topology::Offloads,
    two_node::TwoNodes,
};

/// The two-node namespaces and an agent per node. Field order is drop
/// order: agents (their `xproxy cleanup`), files, namespaces.
pub struct TwoNodeBed {
    /// In the order of `topo.nodes`.
    agents: Vec<NodeAgent>,
    dir: TempDir,
    pub topo: TwoNodes,
}

impl TwoNodeBed {
    /// The namespaces (backends serving on their ports, checksum offload as
    /// `offloads` says), an empty manifest directory and a pin directory per
    /// node; no agent yet.
    pub fn new(label: &str, offloads: Offloads) -> Result<Self> {
        let xproxy = xproxy_binary();
        let topo = TwoNodes::build(offloads).context("building the two-node test bed")?;
        let dir = TempDir::with_manifests(label)?;
        let agents = topo
            .nodes
            .iter()
            .map(|node| NodeAgent::new(format!("[{label}] {}:", node.name()), xproxy.clone(), dir.path()))
            .collect();
        Ok(Self { agents, dir, topo })
    }

    pub fn manifests(&self) -> PathBuf {
        self.dir.manifests()
    }

    /// Writes a manifest file atomically; both agents read it.
    pub fn write_manifest(&self, name: &str, text: &str) -> Result<Instant> {
        write_atomically(&self.manifests().join(name), text)
    }

    /// Node `i`'s pin directory.
    pub fn pin_path(&self, i: usize) -> &Path {
        self.agents[i].pin_path()
    }

    /// Starts `xproxy run --manifests DIR --mode MODE --node-ip IP
    /// --hostname-override NAME --pin-path PINS` in each node namespace.
    pub fn start_agents(&mut self, mode: &str) -> Result<()> {
        self.start_agents_with(mode, &[])
    }

    /// [`Self::start_agents`] with `extra` arguments for both agents.
    pub fn start_agents_with(&mut self, mode: &str, extra: &[String]) -> Result<()> {
        let manifests = self.manifests().display().to_string();
        for (agent, node) in self.agents.iter_mut().zip(&self.topo.nodes) {
            let mut args: Vec<String> = vec!["--manifests".into(), manifests.clone()];
            args.extend(node_args(mode, node.ip(), node.name()));
            args.extend_from_slice(extra);
            agent.start(&node.ns, &args, &format!("agent-{}.log", node.name()))?;
        }
        Ok(())
    }

    /// Ok while node `i`'s agent runs; its exit status and log otherwise.
    pub fn agent_alive(&mut self, i: usize) -> Result<(), String> {
        match self.agents.get_mut(i) {
            Some(agent) => agent.alive(),
            None => Err(format!("no agent on node {i}")),
        }
    }

    /// Node `i`'s agent's log.
    pub fn log(&self, i: usize) -> String {
        self.agents.get(i).map(NodeAgent::log).unwrap_or_default()
    }

    /// Node `i`'s agent's `/metrics`, scraped inside its namespace.
    pub fn metrics(&self, i: usize) -> Result<Metrics> {
        NodeAgent::metrics(&self.topo.nodes[i].ns)
    }

    /// Waits until both agents have synced once.
    pub fn wait_first_syncs(&mut self, timeout: Duration) -> Result<()> {
        for (agent, node) in self.agents.iter_mut().zip(&self.topo.nodes) {
            let what = format!("the first sync of {}'s agent", node.name());
            agent.wait_first_sync(&node.ns, &what, timeout)?;
        }
        Ok(())
    }

    /// SIGTERM to both agents; waits for them to exit with 0. The data path
    /// stays until [`Self::cleanup`] (or the drop) removes it.
    pub fn stop_agents(&mut self) -> Result<()> {
        for (agent, node) in self.agents.iter_mut().zip(&self.topo.nodes) {
            if !agent.is_running() {
                continue;
            }
            let status = agent.stop(libc::SIGTERM)?;
            ensure!(
                status.success(),
                "the agent of {} exited with {status} on SIGTERM:\n{}",
                node.name(),
                agent.log()
            );
        }
        Ok(())
    }

    /// `xproxy cleanup --pin-path PINS` in node `i`'s namespace; fails
    /// unless it exits 0. Returns its output.
    pub fn cleanup(&self, i: usize) -> Result<String> {
        self.agents[i].cleanup(&self.topo.nodes[i].ns, "all")
    }

    /// `xproxy status --pin-path PINS` of node `i`'s data path (ebpf mode).
    pub fn status(&self, i: usize) -> Result<String> {
        self.agents[i].status()
    }
}

/// `(address, nodeName)` of backend pods by name, for
/// [`crate::fixtures::slice_with`].
pub fn endpoints_of(topo: &TwoNodes, pods: &[&str]) -> Result<Vec<(Ipv4Addr, &'static str)>> {
    pods.iter()
        .map(|name| {
            let (node, pod) = topo.find_pod(name).with_context(|| format!("no pod {name}"))?;
            Ok((pod.ip, node.name()))
        })
        .collect()
}
