//! The results file, `bench/results/<date>-<host>.json`: the machine, every
//! parameter, and per mode and per number of Services what was measured.
//! The report and the charts are rendered from this alone, so a committed
//! file can be rendered again (`xproxy-bench report FILE`).

use std::{fs, path::Path, process::Command};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::{
    latency::Latency, memory::Memory, program_time::TargetProgramTime, programming::EndpointChange,
    programming::Programming, throughput::Throughput, throughput::WrkOptions,
};

/// Bumped when a field changes meaning.
pub const SCHEMA: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub schema: u32,
    pub machine: Machine,
    pub parameters: Parameters,
    pub modes: Vec<ModeResult>,
    /// Extra ebpf runs for the scale targets (10,000 x 10 endpoints,
    /// 100,000 Services): programming and memory only.
    pub scale: Vec<ScaleRun>,
    pub per_packet: Option<PerPacket>,
    /// How long each part of the run took, in order.
    pub timings: Vec<PartTiming>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// RFC 3339, UTC.
    pub date: String,
    pub host: String,
    pub kernel: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_bytes: u64,
    pub git_commit: String,
    /// Uncommitted changes in the work tree when the run started.
    pub git_dirty: bool,
    /// Set when the run was not on the machine itself but in a guest it
    /// started (`cargo xtask bench --vm`): which, and how it was emulated.
    /// Its numbers compare with each other, not with the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<String>,
}

/// Set by whoever runs the bench in a guest: what the guest is (recorded as
/// [`Machine::guest`]) and the commit it was built from (a guest has no git).
pub const GUEST_ENV: &str = "XPROXY_BENCH_GUEST";
pub const COMMIT_ENV: &str = "XPROXY_BENCH_COMMIT";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Parameters {
    pub quick: bool,
    pub modes: Vec<String>,
    pub services: Vec<usize>,
    pub seed: u64,
    pub endpoints_per_service: (usize, usize),
    pub backend_pods: usize,
    pub node_port_every: usize,
    pub latency_connections: usize,
    pub latency_rounds: usize,
    /// None: `wrk` was not installed, no throughput was measured.
    pub wrk: Option<WrkOptions>,
    pub endpoint_changes: usize,
    /// The number of Services the endpoint changes are measured at.
    pub endpoint_change_services: usize,
    /// How long a probe of a Service not programmed yet waited for an answer.
    #[serde(default = "default_probe_timeout_ms")]
    pub probe_timeout_ms: u64,
    pub server_threads: usize,
    /// The agent's KubeProxyConfiguration.
    pub agent_config: String,
    /// What the paths are, in words.
    pub paths: Vec<(String, String)>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModeResult {
    pub mode: String,
    /// Where it ran: "host", or why it did not.
    pub status: ModeStatus,
    /// Straight to a pod, before any agent ran on this topology.
    pub baseline: Option<Baseline>,
    pub runs: Vec<Run>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModeStatus {
    Ran,
    Skipped { reason: String },
}

/// Connects straight to a pod, no proxy running: on the bare node, and
/// (since 2026-12-05) with a CNI's masquerade rule in the node's nat table,
/// which is what a node with flannel, Calico (natOutgoing) or kindnet looks
/// like: that rule alone turns the kernel's conntrack on for every flow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    #[serde(flatten)]
    pub bare: BaselinePaths,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cni_masquerade: Option<BaselinePaths>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BaselinePaths {
    /// Client pod -> a backend pod's address.
    pub clusterip_path: Latency,
    /// Outside client -> a backend pod's address, routed by the node.
    pub nodeport_path: Latency,
}

/// One mode at one number of Services.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Run {
    pub services: usize,
    pub endpoints: usize,
    pub node_ports: usize,
    pub programming: Option<Programming>,
    pub latency: Option<RunLatency>,
    pub throughput: Option<RunThroughput>,
    pub memory: Option<Memory>,
    pub endpoint_change: Option<EndpointChange>,
    /// The agent's programs' time per request, from the kernel's BPF
    /// statistics (modes without programs: `None`).
    #[serde(default)]
    pub program_time: Option<Vec<TargetProgramTime>>,
    /// What went wrong, if something did (the fields above stop there).
    pub error: Option<String>,
    /// Why this run measured nothing although nothing went wrong (the
    /// mode did not program fewer Services in time).
    #[serde(default)]
    pub note: Option<String>,
    pub seconds: f64,
}

impl Run {
    pub fn new(services: usize, endpoints: usize, node_ports: usize) -> Self {
        Self {
            services,
            endpoints,
            node_ports,
            programming: None,
            latency: None,
            throughput: None,
            memory: None,
            endpoint_change: None,
            program_time: None,
            error: None,
            note: None,
            seconds: 0.0,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunLatency {
    /// Client pod -> ClusterIP of the first / last Service.
    pub clusterip_first: Latency,
    pub clusterip_last: Latency,
    /// Client pod -> a pod's address directly, with this mode in place.
    pub clusterip_direct: Latency,
    /// Outside client -> NODE_IP:NodePort of the first / last Service.
    pub nodeport_first: Latency,
    pub nodeport_last: Latency,
    pub nodeport_direct: Latency,
    /// The last Service (dual-stack) over IPv6, from the same clients;
    /// absent where the mode did not answer over IPv6 (or in results from
    /// before IPv6 was measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<Ipv6Latency>,
}

/// The last Service's IPv6 paths.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ipv6Latency {
    /// Client pod -> the IPv6 ClusterIP.
    pub clusterip: Latency,
    /// Outside client -> NODE_IP6:NodePort.
    pub nodeport: Latency,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunThroughput {
    /// Outside client -> NodePort of the last Service.
    pub nodeport_short: Throughput,
    pub nodeport_keepalive: Throughput,
    /// Client pod -> ClusterIP of the last Service.
    pub clusterip_short: Throughput,
    pub clusterip_keepalive: Throughput,
}

/// Where a scale run's agent took its Services from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ScaleSource {
    /// The test API server (list and watch).
    #[default]
    Api,
    /// A manifest directory (`--manifests`): YAML files of
    /// [`MANIFEST_FILE_SERVICES`] Services each.
    Manifests,
}

impl std::fmt::Display for ScaleSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScaleSource::Api => "api",
            ScaleSource::Manifests => "manifests",
        })
    }
}

/// Services (each with its EndpointSlice) per file of a manifests scale run.
pub const MANIFEST_FILE_SERVICES: usize = 500;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleRun {
    pub mode: String,
    /// Results written before the manifests runs came from the API server.
    #[serde(default)]
    pub source: ScaleSource,
    pub services: usize,
    pub endpoints: usize,
    /// The median of [`Self::repeats`] (by delivered -> answering; one
    /// not programmed in time counts as the slowest).
    pub programming: Option<Programming>,
    /// Every agent started at this point, in order, each on fresh maps
    /// (results written before repeats existed: none, `programming` only).
    #[serde(default)]
    pub repeats: Vec<Programming>,
    pub memory: Option<Memory>,
    /// Why it was not programmed in time, if the agent's log says.
    #[serde(default)]
    pub note: Option<String>,
    pub error: Option<String>,
}

/// A case with a target: its net median and the target, in ns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PacketTarget {
    pub program: String,
    pub label: String,
    /// `new_flow`, `established`, ... (the case kind).
    pub kind: String,
    pub net_ns: f64,
    pub target_ns: f64,
}

impl PacketTarget {
    pub fn met(&self) -> bool {
        self.net_ns <= self.target_ns
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PerPacket {
    /// The per-packet report as measured (its own schema).
    pub report: Option<serde_json::Value>,
    pub markdown: String,
    /// The cases with a target, for the targets table.
    pub targets: Vec<PacketTarget>,
    pub error: Option<String>,
    /// Maglev's table build and programming at 10,000 Services
    /// (`maglev_scale`), measured with this step; its Markdown follows
    /// `markdown`. Absent from older results.
    #[serde(default)]
    pub maglev: Option<serde_json::Value>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartTiming {
    pub part: String,
    pub seconds: f64,
}

impl Results {
    pub fn mode(&self, name: &str) -> Option<&ModeResult> {
        self.modes
            .iter()
            .find(|m| m.mode == name && m.status == ModeStatus::Ran)
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).context("serializing the results")?;
        fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Whether any run of any mode, or the per-packet part, failed.
    pub fn errors(&self) -> Vec<String> {
        let runs = self.modes.iter().flat_map(|m| {
            m.runs
                .iter()
                .filter_map(move |r| r.error.as_ref().map(|e| format!("{} at {}: {e}", m.mode, r.services)))
        });
        let scale = self.scale.iter().filter_map(|s| {
            s.error
                .as_ref()
                .map(|e| format!("{} scale at {}: {e}", s.mode, s.services))
        });
        let per_packet = self
            .per_packet
            .iter()
            .filter_map(|p| p.error.as_ref().map(|e| format!("per-packet: {e}")));
        runs.chain(scale).chain(per_packet).collect()
    }
}

impl ModeResult {
    pub fn run(&self, services: usize) -> Option<&Run> {
        self.runs.iter().find(|r| r.services == services && r.error.is_none())
    }
}

/// What runs before `probe_timeout_ms` was recorded used.
fn default_probe_timeout_ms() -> u64 {
    5
}

impl Machine {
    /// This machine, now; the commit of the work tree at `root`.
    pub fn detect(root: &Path) -> Self {
        let git = |args: &[&str]| {
            Command::new("git")
                .arg("-C")
                .arg(root)
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        };
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Self {
            date: jiff::Timestamp::now()
                .round(jiff::Unit::Second)
                .unwrap_or(jiff::Timestamp::now())
                .to_string(),
            host: read_trimmed("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown".into()),
            kernel: read_trimmed("/proc/sys/kernel/osrelease").unwrap_or_else(|| "unknown".into()),
            cpus: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            cpu_model: cpuinfo
                .lines()
                .find_map(|l| {
                    l.strip_prefix("model name")?
                        .split_once(':')
                        .map(|(_, v)| v.trim().to_owned())
                })
                .unwrap_or_else(|| "unknown".into()),
            memory_bytes: meminfo
                .lines()
                .find_map(|l| {
                    l.strip_prefix("MemTotal:")?
                        .split_whitespace()
                        .next()?
                        .parse::<u64>()
                        .ok()
                })
                .map_or(0, |kib| kib * 1024),
            git_commit: git(&["rev-parse", "HEAD"])
                .or_else(|| std::env::var(COMMIT_ENV).ok())
                .unwrap_or_else(|| "unknown".into()),
            git_dirty: git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty()),
            guest: std::env::var(GUEST_ENV).ok().filter(|g| !g.is_empty()),
        }
    }

    /// `<date>-<host>`: the name of every file of this run.
    pub fn file_stem(&self) -> String {
        let day = self.date.get(..10).unwrap_or("unknown-date");
        let host: String = self
            .host
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
            .collect();
        format!("{day}-{host}")
    }
}

fn read_trimmed(path: &str) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_date_and_host() {
        let mut machine = Machine::detect(Path::new("."));
        machine.date = "2026-12-02T15:11:23Z".into();
        machine.host = "bench box.local".into();
        assert_eq!(machine.file_stem(), "2026-12-02-bench_box_local");
    }

    /// The committed reference runs stay readable (`xproxy-bench report`):
    /// those before the CNI baseline have the bare baseline only.
    #[test]
    fn committed_results_still_parse() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/2026-12-03-vm.json");
        let results = Results::read(&file).expect("the 2026-12-03 reference run");
        let ebpf = results.mode("ebpf").expect("an ebpf mode");
        let baseline = ebpf.baseline.as_ref().expect("a baseline");
        assert!(baseline.bare.clusterip_path.connect_p50_us.median > 0.0);
        assert_eq!(baseline.cni_masquerade, None);
        let again: Results = serde_json::from_str(&serde_json::to_string(&results).expect("written")).expect("read");
        assert_eq!(again, results);
    }
}
