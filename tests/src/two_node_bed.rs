//! Harness for the two-node tests (`tests/tests/two_node.rs`): the
//! [`TwoNodes`] test bed with the real `xproxy run` binary on each node, in
//! any mode, both agents fed by one manifest directory, each with its own
//! `--hostname-override` (the node's name, which the EndpointSlices'
//! `nodeName` refer to), `--node-ip` and pin directory.
//!
//! Everything a test creates (namespaces, pins, files, processes) goes away
//! when its [`TwoNodeBed`] is dropped, also when the test panics; on a panic
//! both agents' logs are printed first.

use std::{
    fs,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use testbed::{agent::AgentProcess, netns, privileged::PinDir, topology::Offloads, two_node::TwoNodes};

use crate::agent_harness::{
    Exit, LAST_SYNC, METRICS_ADDR, Metrics, TempDir, http_get, run_xproxy, write_atomically, xproxy_binary,
};

/// A node's agent: the process (gone once stopped, but kept: dropping it
/// runs `xproxy cleanup`) and its log file.
struct NodeAgent {
    process: AgentProcess,
    log: PathBuf,
    running: bool,
}

/// The two-node test bed and an agent per node. Field order is drop order
/// (after [`Drop::drop`] stopped the agents): agents (their `xproxy
/// cleanup`), pins, files, namespaces.
pub struct TwoNodeBed {
    label: String,
    xproxy: PathBuf,
    /// In the order of `topo.nodes`; empty until [`Self::start_agents`].
    agents: Vec<NodeAgent>,
    pins: [PinDir; 2],
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
        let dir = TempDir::new(label)?;
        fs::create_dir_all(dir.path().join("manifests"))?;
        Ok(Self {
            label: label.to_owned(),
            xproxy,
            agents: Vec::new(),
            pins: [PinDir::new(), PinDir::new()],
            dir,
            topo,
        })
    }

    pub fn manifests(&self) -> PathBuf {
        self.dir.path().join("manifests")
    }

    /// Writes a manifest file atomically; both agents read it.
    pub fn write_manifest(&self, name: &str, text: &str) -> Result<Instant> {
        write_atomically(&self.manifests().join(name), text)
    }

    /// Node `i`'s pin directory.
    pub fn pin_path(&self, i: usize) -> &Path {
        self.pins[i].path()
    }

    /// Starts `xproxy run --manifests DIR --mode MODE --node-ip IP
    /// --hostname-override NAME --pin-path PINS` in each node namespace.
    pub fn start_agents(&mut self, mode: &str) -> Result<()> {
        self.start_agents_with(mode, &[])
    }

    /// [`Self::start_agents`] with `extra` arguments for both agents.
    pub fn start_agents_with(&mut self, mode: &str, extra: &[String]) -> Result<()> {
        ensure!(self.agents.is_empty(), "the agents were started already");
        for (i, node) in self.topo.nodes.iter().enumerate() {
            let mut args: Vec<String> = vec![
                "--manifests".into(),
                self.manifests().display().to_string(),
                "--mode".into(),
                mode.into(),
                "--node-ip".into(),
                node.ip().to_string(),
                "--hostname-override".into(),
                node.name().into(),
            ];
            args.extend_from_slice(extra);
            let log = self.dir.path().join(format!("agent-{}.log", node.name()));
            let process = AgentProcess::start(&self.xproxy, &node.ns, self.pins[i].path(), &args, Some(&log))?;
            eprintln!(
                "[{}] started the agent of {} (pid {:?}): xproxy run {}",
                self.label,
                node.name(),
                process.pid(),
                args.join(" ")
            );
            self.agents.push(NodeAgent {
                process,
                log,
                running: true,
            });
        }
        Ok(())
    }

    /// Ok while node `i`'s agent runs; its exit status and log otherwise.
    pub fn agent_alive(&mut self, i: usize) -> Result<(), String> {
        let Some(agent) = self.agents.get_mut(i) else {
            return Err(format!("no agent on node {i}"));
        };
        match agent.process.try_exit_status() {
            Ok(None) if agent.running => Ok(()),
            Ok(None) => Err("the agent was stopped".into()),
            Ok(Some(status)) => Err(format!("the agent exited ({status}); log:\n{}", read_log(&agent.log))),
            Err(e) => Err(format!("cannot tell whether the agent runs: {e:#}")),
        }
    }

    /// Node `i`'s agent's log.
    pub fn log(&self, i: usize) -> String {
        self.agents.get(i).map(|a| read_log(&a.log)).unwrap_or_default()
    }

    /// Node `i`'s agent's `/metrics`, scraped inside its namespace.
    pub fn metrics(&self, i: usize) -> Result<Metrics> {
        let (code, body) = http_get(&self.topo.nodes[i].ns, METRICS_ADDR, "/metrics")?;
        ensure!(code == 200, "GET /metrics answered {code}: {body}");
        Ok(Metrics(body))
    }

    /// Waits until both agents have synced once.
    pub fn wait_first_syncs(&mut self, timeout: Duration) -> Result<()> {
        for i in 0..self.topo.nodes.len() {
            let what = format!("the first sync of {}'s agent", self.topo.nodes[i].name());
            netns::wait_for(&what, timeout, || {
                self.agent_alive(i)?;
                let metrics = self.metrics(i).map_err(|e| format!("{e:#}"))?;
                match metrics.value(LAST_SYNC) {
                    Some(t) if t > 0.0 => Ok(()),
                    other => Err(format!("{LAST_SYNC} = {other:?}")),
                }
            })?;
        }
        Ok(())
    }

    /// SIGTERM to both agents; waits for them to exit with 0. The data path
    /// stays until [`Self::cleanup`] (or the drop) removes it.
    pub fn stop_agents(&mut self) -> Result<()> {
        for (agent, node) in self.agents.iter_mut().zip(&self.topo.nodes) {
            if !agent.running {
                continue;
            }
            agent.running = false;
            let status = agent.process.stop(libc::SIGTERM)?;
            ensure!(
                status.success(),
                "the agent of {} exited with {status} on SIGTERM:\n{}",
                node.name(),
                read_log(&agent.log)
            );
        }
        Ok(())
    }

    /// `xproxy cleanup --pin-path PINS` in node `i`'s namespace; fails
    /// unless it exits 0. Returns its output.
    pub fn cleanup(&self, i: usize) -> Result<String> {
        let exit: Exit = run_xproxy(
            &self.xproxy,
            &self.topo.nodes[i].ns,
            &["cleanup", "--pin-path", &self.pins[i].path().display().to_string()],
            self.dir.path(),
            Duration::from_secs(30),
        )?;
        ensure!(
            exit.code == Some(0),
            "xproxy cleanup on {} exited {:?}:\n{}",
            self.topo.nodes[i].name(),
            exit.code,
            exit.stderr
        );
        Ok(exit.stderr)
    }

    /// `xproxy status --pin-path PINS` of node `i`'s data path (ebpf mode).
    pub fn status(&self, i: usize) -> Result<String> {
        netns::run(
            std::process::Command::new(&self.xproxy)
                .arg("status")
                .arg("--pin-path")
                .arg(self.pins[i].path()),
        )
    }

    fn print_logs(&self) {
        for (agent, node) in self.agents.iter().zip(&self.topo.nodes) {
            eprintln!(
                "----- [{}] log of the agent of {} ({}) -----\n{}----- end of log -----",
                self.label,
                node.name(),
                agent.log.display(),
                read_log(&agent.log)
            );
        }
    }
}

impl Drop for TwoNodeBed {
    fn drop(&mut self) {
        // Stop the agents (SIGTERM) first, so their logs are complete.
        for agent in &mut self.agents {
            if agent.running {
                agent.running = false;
                if let Err(e) = agent.process.stop(libc::SIGTERM) {
                    eprintln!("[{}] warning: stopping an agent: {e:#}", self.label);
                }
            }
        }
        if std::thread::panicking() {
            self.print_logs();
        }
        // Dropping the processes runs `xproxy cleanup` in each node.
        self.agents.clear();
    }
}

fn read_log(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()))
}

// ---------------------------------------------------------------------------
// Objects for the manifest directory (see `agent_harness::yaml_documents`).

/// kube-proxy's `spec.externalTrafficPolicy` of a NodePort Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrafficPolicy {
    Cluster,
    Local,
}

/// One port of a Service: (name, protocol as the API spells it, port,
/// targetPort, nodePort).
#[derive(Clone, Copy, Debug)]
pub struct PortDef {
    pub name: &'static str,
    pub protocol: &'static str,
    pub port: u16,
    pub target_port: u16,
    pub node_port: Option<u16>,
}

/// A Service with `ports`: of type NodePort (with `policy`) if any port has
/// a node port, else ClusterIP.
pub fn service(name: &str, cluster_ip: Ipv4Addr, ports: &[PortDef], policy: TrafficPolicy) -> Value {
    let node_port = ports.iter().any(|p| p.node_port.is_some());
    let port_specs: Vec<Value> = ports
        .iter()
        .map(|p| {
            let mut spec = json!({"name": p.name, "port": p.port, "targetPort": p.target_port,
                                  "protocol": p.protocol});
            if let Some(np) = p.node_port {
                spec["nodePort"] = json!(np);
            }
            spec
        })
        .collect();
    let mut spec = json!({
        "type": if node_port { "NodePort" } else { "ClusterIP" },
        "clusterIP": cluster_ip.to_string(),
        "ports": port_specs,
        "selector": {"app": name},
    });
    if node_port {
        spec["externalTrafficPolicy"] = json!(match policy {
            TrafficPolicy::Cluster => "Cluster",
            TrafficPolicy::Local => "Local",
        });
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": spec,
    })
}

/// The EndpointSlice of Service `service` with the ports of `ports` (by
/// name, targetPort) and a ready endpoint per `(address, nodeName)`.
pub fn slice(service: &str, ports: &[PortDef], endpoints: &[(Ipv4Addr, &str)]) -> Value {
    let port_specs: Vec<Value> = ports
        .iter()
        .map(|p| json!({"name": p.name, "port": p.target_port, "protocol": p.protocol}))
        .collect();
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, node)| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": node}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{service}-1"),
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": port_specs,
        "endpoints": endpoints,
    })
}

/// `(address, nodeName)` of backend pods by name, for [`slice`].
pub fn endpoints_of(topo: &TwoNodes, pods: &[&str]) -> Result<Vec<(Ipv4Addr, &'static str)>> {
    pods.iter()
        .map(|name| {
            let (node, pod) = topo.find_pod(name).with_context(|| format!("no pod {name}"))?;
            Ok((pod.ip, node.name()))
        })
        .collect()
}
