//! The real agent, `xproxy run --mode MODE --kubeconfig ...`, in the bench's
//! node, fed by the test API server (or `--manifests DIR`, a directory of
//! YAML files); and what its log says about when the Services were
//! delivered and how long its syncs took.
//!
//! The bench runs `xproxy cleanup` only between the ebpf scale runs'
//! repeats, where it is cheap ([`BenchAgent::stop_and_clean_up`]).
//! Otherwise every agent gets a node of its own, and deleting the node's
//! namespace takes its rules with it (removing 10,000 Services' iptables
//! chains one by one would take minutes): the agent is stopped, whatever
//! it started in the node is killed (an `iptables-restore` still at work),
//! and its pins are removed.

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, bail};
use testbed::fixtures::NODE_NAME;
use testbed::{
    agent::AgentProcess,
    netns::Netns,
    privileged::unique_name,
    topology::{NODE_IP, NODE_IP6},
};

/// `xproxy run`'s exit code for a mode this machine cannot run.
const EXIT_MODE_UNAVAILABLE: i32 = 6;
/// How long a mode that cannot run may take to say so.
const START_GRACE: Duration = Duration::from_millis(1500);

/// The agent's configuration for the bench: a change is programmed at once
/// (kube-proxy treats a zero `minSyncPeriod` as "the default", 1 s, so the
/// smallest non-zero one), no periodic full resync runs in the middle of a
/// measurement, and the pod networks are named, as a real node's
/// configuration names them (every pod and endpoint address of the bench's
/// cluster is in 10.0.0.0/8 or `fd00:244::/64`, see `topology`).
pub const CONFIG: &str = "\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clusterCIDR: 10.0.0.0/8,fd00:244::/64
iptables:
  minSyncPeriod: 1ms
  syncPeriod: 1h
nftables:
  minSyncPeriod: 1ms
  syncPeriod: 1h
ipvs:
  minSyncPeriod: 1ms
  syncPeriod: 1h
";

/// Where the agent takes its Services from.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// The test API server, through this kubeconfig.
    Kubeconfig(&'a Path),
    /// A manifest directory.
    Manifests(&'a Path),
}

impl Source<'_> {
    fn args(self) -> [String; 2] {
        match self {
            Source::Kubeconfig(path) => ["--kubeconfig".into(), path.display().to_string()],
            Source::Manifests(dir) => ["--manifests".into(), dir.display().to_string()],
        }
    }
}

pub struct BenchAgent {
    /// `None` once stopped.
    process: Option<AgentProcess>,
    pin_path: PathBuf,
    node_ns: PathBuf,
    pub log: PathBuf,
    /// When the process was started (wall clock, to compare with its log).
    pub started: SystemTime,
    pub started_at: Instant,
}

pub enum Started {
    Running(Box<BenchAgent>),
    /// The mode cannot run here (exit code 6), with the agent's reason.
    Unavailable(String),
}

/// The bench's modes that are the iptables mode on one backend, and the
/// backend: kube-proxy's image runs whichever one the node's rules use (its
/// wrapper switches the `iptables` alternative), so both are measured, each
/// named, whatever this machine's alternative is.
pub const IPTABLES_BACKENDS: [(&str, &str); 2] = [("iptables", "nft"), ("iptables-legacy", "legacy")];

/// The iptables commands the agent runs (`ip6tables*` for its IPv6 rules,
/// on the same backend).
const IPTABLES_COMMANDS: [&str; 6] = [
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
];

/// `xproxy run --mode` for the bench's `mode`, and the environment that
/// picks its iptables backend: a `PATH` starting with a directory (in
/// `dir`) whose `iptables*` lead to that backend's binaries. `Err` with the
/// reason when this machine lacks them.
fn agent_mode(mode: &str, dir: &Path) -> Result<(String, Vec<(String, String)>), String> {
    let Some((_, backend)) = IPTABLES_BACKENDS.iter().find(|(m, _)| *m == mode) else {
        return Ok((mode.to_owned(), Vec::new()));
    };
    let bin = dir.join(format!("iptables-{backend}-bin"));
    fs::create_dir_all(&bin).map_err(|e| format!("creating {}: {e}", bin.display()))?;
    for command in IPTABLES_COMMANDS {
        let real = command.replacen("tables", &format!("tables-{backend}"), 1);
        let target = find_in_path(&real).ok_or(format!("no {real} on this machine (Debian: the iptables package)"))?;
        let link = bin.join(command);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).map_err(|e| format!("linking {}: {e}", link.display()))?;
    }
    let path = std::env::var("PATH").unwrap_or_default();
    Ok((
        "iptables".to_owned(),
        vec![("PATH".to_owned(), format!("{}:{path}", bin.display()))],
    ))
}

/// `name` in the directories of `PATH` and the sbin ones.
fn find_in_path(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|dir| Path::new(dir).join(name))
        .find(|candidate| candidate.is_file())
}

impl BenchAgent {
    /// Starts the agent in `mode`; `dir` gets its configuration and log.
    /// With `check`, waits a moment for a mode this machine lacks to say so
    /// (the measurements cannot wait: the agent programs meanwhile).
    pub fn start(
        xproxy: &Path,
        node: &Netns,
        mode: &str,
        source: Source<'_>,
        dir: &Path,
        check: bool,
    ) -> Result<Started> {
        let config = dir.join("bench-proxy.yaml");
        fs::write(&config, CONFIG).with_context(|| format!("writing {}", config.display()))?;
        let log = dir.join(format!("agent-{mode}-{}.log", unique_name("")));
        let (agent_mode, env) = match agent_mode(mode, dir) {
            Ok(found) => found,
            Err(reason) => return Ok(Started::Unavailable(reason)),
        };
        let [source_flag, source_path] = source.args();
        let args: Vec<String> = [
            "--config",
            &config.display().to_string(),
            "--mode",
            &agent_mode,
            &source_flag,
            &source_path,
            "--node-ip",
            &format!("{NODE_IP},{NODE_IP6}"),
            "--hostname-override",
            NODE_NAME,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let pin_path = Path::new("/sys/fs/bpf").join(unique_name("xproxy-bench-"));
        let started = SystemTime::now();
        let started_at = Instant::now();
        let process = AgentProcess::start_with_env(xproxy, node, &pin_path, &args, Some(&log), env)?;
        let mut agent = Self {
            process: Some(process),
            pin_path,
            node_ns: node.path().to_owned(),
            log,
            started,
            started_at,
        };
        // A mode this machine lacks fails at once; give it the chance.
        while check && started_at.elapsed() < START_GRACE {
            if let Some(status) = agent.exit_status()? {
                let text = agent.log_text();
                if status.code() == Some(EXIT_MODE_UNAVAILABLE) {
                    return Ok(Started::Unavailable(last_error(&text)));
                }
                bail!("xproxy run --mode {mode} exited at start ({status}):\n{text}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Started::Running(Box::new(agent)))
    }

    fn exit_status(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.process.as_mut() {
            Some(process) => process.try_exit_status(),
            None => Ok(None),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(AgentProcess::pid)
    }

    pub fn pin_path(&self) -> &Path {
        &self.pin_path
    }

    /// Ok while the process runs; an error with its log once it exited.
    pub fn alive(&mut self) -> Result<()> {
        if let Some(status) = self.exit_status()? {
            bail!("the agent exited ({status}); log:\n{}", self.log_text());
        }
        Ok(())
    }

    /// Stops the agent with `signal` (SIGTERM: it finishes what it does and
    /// exits; SIGKILL: at once, e.g. in the middle of a sync that takes
    /// minutes), kills what it left running in the node, removes its pins.
    /// Its rules go with the node's namespace.
    pub fn stop(&mut self, signal: i32) {
        let Some(mut process) = self.process.take() else {
            return;
        };
        if let Err(e) = process.stop(signal) {
            eprintln!("warning: stopping the agent: {e:#}");
        }
        // Dropping it would run `xproxy cleanup`: see the module's comment.
        std::mem::forget(process);
        self.remove_leftovers();
    }

    /// Stops the agent with SIGTERM and runs `xproxy cleanup` in its node:
    /// for a next agent in the same node that must start from nothing (the
    /// scale runs' repeats). Cheap in the ebpf mode (programs detached, maps
    /// unpinned); see the module's comment for the kernel modes.
    pub fn stop_and_clean_up(&mut self) {
        // Dropping the process stops it and runs the cleanup.
        drop(self.process.take());
        self.remove_leftovers();
    }

    /// Kills what the agent left running in the node and removes its pins
    /// (what `xproxy cleanup`, if it ran, did not).
    fn remove_leftovers(&self) {
        kill_processes_in(&self.node_ns);
        if self.pin_path.exists()
            && let Err(e) = fs::remove_dir_all(&self.pin_path)
        {
            eprintln!("warning: removing {}: {e}", self.pin_path.display());
        }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (up to `patience`) until the agent says it returned the
    /// memory a full list freed, which it does right after the sync that
    /// took the list in: its resident set is settled from then on.
    pub fn wait_memory_settled(&self, patience: Duration) -> Result<()> {
        testbed::netns::wait_for("the agent to return freed memory", patience, || {
            match parse_log(&self.log_text()).memory_returned {
                0 => Err("not in its log yet".to_owned()),
                _ => Ok(()),
            }
        })
    }
}

impl Drop for BenchAgent {
    fn drop(&mut self) {
        self.stop(libc::SIGKILL);
    }
}

/// SIGKILLs every process in the network namespace at `ns` (the agent's
/// children: all of them started by this bench).
fn kill_processes_in(ns: &Path) {
    let Ok(target) = fs::metadata(ns) else { return };
    let me = std::process::id();
    let Ok(entries) = fs::read_dir("/proc") else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(net) = fs::metadata(entry.path().join("ns/net")) else {
            continue;
        };
        if pid != me && net.dev() == target.dev() && net.ino() == target.ino() {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// The reason a failed start gives: the last line that says ERROR, or the
/// last line.
fn last_error(log: &str) -> String {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    lines
        .iter()
        .rev()
        .find(|l| l.contains("ERROR") || l.starts_with("error"))
        .or(lines.last())
        .map_or_else(|| "no output".to_owned(), |l| l.trim().to_owned())
}

/// What the agent's log says.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogFacts {
    /// When each source kind finished its list (`listed kind=...`), or
    /// the manifest directory was read (`manifests read ...`, kind
    /// `manifests`, the Services as objects).
    pub listed: Vec<(String, SystemTime, u64)>,
    /// Every sync that changed something: (services, took in seconds).
    pub syncs: Vec<(u64, f64)>,
    /// How long the agent's first reading of the manifest directory took.
    pub manifests_read_s: Option<f64>,
    /// Syncs that failed, and the error of the last one.
    pub sync_failures: usize,
    pub last_sync_failure: Option<String>,
    /// How often the agent returned freed memory to the kernel (after a
    /// sync that took in a full list): its RSS has settled after the first.
    pub memory_returned: usize,
}

impl LogFacts {
    /// When the last list was complete: the source had delivered everything.
    pub fn delivered(&self) -> Option<SystemTime> {
        self.listed.iter().map(|(_, at, _)| *at).max()
    }

    /// How long the first sync that programmed at least `services` took.
    pub fn first_sync_with(&self, services: u64) -> Option<f64> {
        self.syncs.iter().find(|(n, _)| *n >= services).map(|(_, took)| *took)
    }
}

/// Reads the lines of tracing's default format:
/// `2026-12-02T15:11:23.123456Z  INFO xproxy::source::kube: listed kind="Service" objects=100`.
pub fn parse_log(text: &str) -> LogFacts {
    let mut facts = LogFacts::default();
    for line in text.lines() {
        let Some((stamp, rest)) = line.split_once(' ') else {
            continue;
        };
        let message = rest.split_once(": ").map_or("", |(_, m)| m);
        if let Some(fields) = message.strip_prefix("listed ") {
            let Ok(at) = stamp.parse::<jiff::Timestamp>() else {
                continue;
            };
            let kind = field(fields, "kind").unwrap_or_default().trim_matches('"').to_owned();
            let objects = field(fields, "objects").and_then(|n| n.parse().ok()).unwrap_or(0);
            facts.listed.push((kind, SystemTime::from(at), objects));
        } else if let Some(fields) = message.strip_prefix("manifests read ") {
            let Ok(at) = stamp.parse::<jiff::Timestamp>() else {
                continue;
            };
            let services = field(fields, "services").and_then(|n| n.parse().ok()).unwrap_or(0);
            facts
                .listed
                .push(("manifests".to_owned(), SystemTime::from(at), services));
            let took_ms = field(fields, "took_ms").and_then(|n| n.parse::<f64>().ok());
            facts.manifests_read_s = facts.manifests_read_s.or(took_ms.map(|ms| ms / 1e3));
        } else if message.starts_with("freed memory returned") {
            facts.memory_returned += 1;
        } else if message.starts_with("sync failed") {
            let error = message.split_once("error=").map_or(message, |(_, e)| e);
            facts.sync_failures += 1;
            facts.last_sync_failure = Some(error.trim().trim_matches('"').to_owned());
        } else if let Some(fields) = message.strip_prefix("synced ") {
            let services = field(fields, "services").and_then(|n| n.parse().ok());
            let took_ms = field(fields, "took_ms").and_then(|n| n.parse::<f64>().ok());
            if let (Some(services), Some(took_ms)) = (services, took_ms) {
                facts.syncs.push((services, took_ms / 1e3));
            }
        }
    }
    facts
}

/// The value of `name=value` among space-separated fields.
fn field<'a>(fields: &'a str, name: &str) -> Option<&'a str> {
    fields
        .split_whitespace()
        .find_map(|f| f.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
2026-12-02T15:11:23.100000Z  INFO xproxy::cmd::run: starting mode=ebpf node=\"xproxy-node\"
2026-12-02T15:11:23.500000Z  INFO xproxy::source::kube: listed kind=\"Service\" objects=101
2026-12-02T15:11:23.750000Z  INFO xproxy::source::kube: listed kind=\"EndpointSlice\" objects=101
2026-12-02T15:11:23.760000Z  INFO xproxy::agent: synced mode=\"ebpf\" full=true services=0 changed=0 kernel_writes=0 took_ms=0.1
2026-12-02T15:11:23.900000Z  INFO xproxy::agent: synced mode=\"ebpf\" full=true services=101 changed=101 kernel_writes=900 took_ms=123.5
2026-12-02T15:11:23.950000Z  INFO xproxy::cmd::run: freed memory returned to the kernel took_ms=2.5
2026-12-02T15:11:24.000000Z  WARN xproxy::agent: sync failed; retrying with a full sync error=\"writing a backend: E2BIG\"
";

    #[test]
    fn reads_deliveries_and_syncs() {
        let facts = parse_log(LOG);
        assert_eq!(facts.listed.len(), 2);
        assert_eq!(facts.listed[0].0, "Service");
        assert_eq!(facts.listed[1].2, 101);
        let delivered = facts.delivered().expect("listed");
        let expected: jiff::Timestamp = "2026-12-02T15:11:23.75Z".parse().expect("timestamp");
        assert_eq!(delivered, SystemTime::from(expected));
        assert_eq!(facts.syncs, vec![(0, 0.0001), (101, 0.1235)]);
        assert_eq!(facts.first_sync_with(101), Some(0.1235));
        assert_eq!(facts.first_sync_with(102), None);
        assert_eq!(facts.last_sync_failure.as_deref(), Some("writing a backend: E2BIG"));
        assert_eq!(facts.memory_returned, 1);
    }

    #[test]
    fn a_manifest_directory_read_is_a_delivery() {
        let log = "2026-12-02T15:11:23.100000Z  INFO xproxy::source::manifest: manifests read \
                   files=20 read=20 services=10001 slices=10001 took_ms=812.5\n";
        let facts = parse_log(log);
        assert_eq!(facts.listed.len(), 1);
        assert_eq!((facts.listed[0].0.as_str(), facts.listed[0].2), ("manifests", 10_001));
        let expected: jiff::Timestamp = "2026-12-02T15:11:23.1Z".parse().expect("timestamp");
        assert_eq!(facts.delivered(), Some(SystemTime::from(expected)));
        assert_eq!(facts.manifests_read_s, Some(0.8125));
    }

    #[test]
    fn names_the_reason_a_mode_is_unavailable() {
        let log = "2026 INFO x: starting\nerror: mode ipvs is not available: no IPVS in this kernel\n";
        assert_eq!(
            last_error(log),
            "error: mode ipvs is not available: no IPVS in this kernel"
        );
        assert_eq!(last_error(""), "no output");
    }
}
