//! The bed with the real agent in it, for the agent's end-to-end tests
//! (`proxy-userspace/tests/agent.rs`, `tests/tests/modes.rs`, and through
//! [`crate::two_node_bed`] `tests/tests/two_node.rs`): the real `xproxy
//! run` binary, in any mode, in a node namespace ([`NodeAgent`]: one per
//! node of a bed), fed by a manifest directory or by a [`TestApiServer`]
//! that listens inside the node namespace, plus what the tests measure
//! with: traffic generators, a Prometheus text parser, and readers of
//! `xproxy status` and `ipvsadm -Ln`.
//!
//! Everything a test creates (namespaces, pins, files, processes, threads)
//! goes away when its [`AgentBed`] is dropped, also when the test panics;
//! on a panic the agent's log is printed first.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    io::{self, Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;
use xproxy_test_apiserver::{ServerConfig, TestApiServer};

use crate::{
    agent::AgentProcess,
    fixtures::{NODE_NAME, SEED_NODE_PORT, node, seed_objects},
    netns::{self, Netns},
    privileged::{self, PinDir, unique_name},
    probe::{self, Checks, Protocol, error_kind, is_backend_name},
    topology::{NODE_IP, Offloads, Topology},
};

/// The agent's default metrics address, inside the node namespace.
pub const METRICS_ADDR: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249);
/// The agent's default health address (0.0.0.0:10256), inside the node namespace.
pub const HEALTHZ_ADDR: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10256);
/// The agent's default `minSyncPeriod`: a change that arrives sooner than
/// this after a sync waits for the rest of it (kube-proxy's rule).
pub const MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);

pub const LAST_SYNC: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds";
pub const LAST_QUEUED: &str = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds";
pub const SERVICE_CHANGES: &str = "kubeproxy_sync_proxy_rules_service_changes_total";
pub const SKIPPED: &str = "xproxy_skipped_objects_total";
pub const KERNEL_WRITES: &str = "xproxy_sync_kernel_writes_total";
pub const DATAPATH_PACKETS: &str = "xproxy_datapath_packets_total";

/// How long a freshly started agent may take to program the seed.
pub const READY_WITHIN: Duration = Duration::from_secs(30);

pub fn seed_node_port() -> SocketAddrV4 {
    SocketAddrV4::new(NODE_IP, SEED_NODE_PORT)
}

pub fn node_port(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(NODE_IP, port)
}

// ---------------------------------------------------------------------------
// The binary.

/// `target/<profile>/xproxy`, next to this test executable's `deps`
/// directory: built with `cargo build -p proxy-userspace` first if it is
/// missing or older than its sources (once per test process).
pub fn xproxy_binary() -> PathBuf {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BINARY.get_or_init(|| locate_or_build().map_err(|e| format!("{e:#}"))) {
        Ok(path) => path.clone(),
        Err(e) => panic!("the xproxy binary: {e}"),
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
        .to_owned()
}

fn locate_or_build() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    // target/<profile>/deps/<test>-<hash>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .with_context(|| format!("{} is not in target/<profile>/deps", exe.display()))?;
    let binary = profile_dir.join("xproxy");
    let root = workspace_root();
    let stale = match fs::metadata(&binary).and_then(|m| m.modified()) {
        Err(_) => Some("missing".to_owned()),
        Ok(built) => newest_source(&root)
            .filter(|(_, changed)| *changed > built)
            .map(|(path, _)| format!("older than {}", path.display())),
    };
    if let Some(why) = stale {
        eprintln!(
            "agent tests: {} is {why}: cargo build -p proxy-userspace",
            binary.display()
        );
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(&root)
            .args(["build", "-p", "proxy-userspace", "--bin", "xproxy"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().context("running cargo build")?;
        ensure!(status.success(), "cargo build -p proxy-userspace failed ({status})");
    }
    ensure!(binary.exists(), "{} does not exist after the build", binary.display());
    Ok(binary)
}

/// The most recently modified input of the agent binary.
fn newest_source(root: &Path) -> Option<(PathBuf, SystemTime)> {
    let mut files = Vec::new();
    for dir in ["proxy-userspace/src", "proxy-common/src"] {
        collect_files(&root.join(dir), &mut files);
    }
    for file in [
        "proxy-userspace/build.rs",
        "proxy-userspace/Cargo.toml",
        "proxy-common/Cargo.toml",
        "Cargo.lock",
        "proxy-ebpf/target/bpfel-unknown-none/release/proxy-ebpf",
    ] {
        files.push(root.join(file));
    }
    files
        .into_iter()
        .filter_map(|p| Some((fs::metadata(&p).and_then(|m| m.modified()).ok()?, p)))
        .max()
        .map(|(t, p)| (p, t))
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_files(&path, out);
        } else {
            out.push(path);
        }
    }
}

// ---------------------------------------------------------------------------
// Files.

/// A scratch directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(unique_name(&format!("xproxy-agent-{tag}-")));
        fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }

    /// [`Self::new`] with an empty `manifests` directory in it.
    pub fn with_manifests(tag: &str) -> Result<Self> {
        let dir = Self::new(tag)?;
        fs::create_dir_all(dir.manifests())?;
        Ok(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `manifests` in it: the agents' `--manifests` directory.
    pub fn manifests(&self) -> PathBuf {
        self.0.join("manifests")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

pub use crate::fixtures::write_atomically;

// ---------------------------------------------------------------------------
// The test API server, listening inside the node namespace.

/// A [`TestApiServer`] whose sockets live in the node's network namespace,
/// so the agent reaches it on 127.0.0.1 there.
///
/// The runtime is built on a thread inside the namespace: its worker
/// threads (and the threads they spawn) start there too. Everything that
/// binds (start, restart) runs as a task on those workers.
pub struct NodeApiServer {
    server: Option<TestApiServer>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl NodeApiServer {
    pub fn start(node: &Netns) -> Result<Self> {
        node.run_in(|| -> Result<Self> {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("node-apiserver")
                .enable_all()
                .build()
                .context("building the API server's runtime")?;
            // No periodic bookmarks: a compaction then reliably expires
            // every version the agent's watchers hold.
            let config = ServerConfig {
                bookmark_interval: None,
                ..ServerConfig::default()
            };
            let server = runtime
                .block_on(runtime.spawn(TestApiServer::start_with(config)))
                .context("the API server's start task")?
                .context("starting the API server")?;
            Ok(Self {
                server: Some(server),
                runtime: Some(runtime),
            })
        })?
    }

    pub fn server(&self) -> &TestApiServer {
        self.server.as_ref().expect("the server lives until drop")
    }

    /// Runs `future` as a task on the server's runtime (inside the node
    /// namespace) and waits for it.
    pub fn run<F>(&self, future: F) -> Result<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = self.runtime.as_ref().expect("the runtime lives until drop");
        runtime
            .block_on(runtime.spawn(future))
            .context("an API server task failed")
    }

    /// Stops listening and closes every connection (the store is kept).
    pub fn stop(&self) -> Result<()> {
        let server = self.server().clone();
        self.run(async move { server.stop().await })
    }

    /// Listens again on the same address.
    pub fn restart(&self) -> Result<()> {
        let server = self.server().clone();
        self.run(async move { server.restart().await })?
            .context("restarting the API server")
    }

    /// `apply` that names the object in its error.
    pub fn apply(&self, object: &Value) -> Result<()> {
        self.server()
            .apply(object)
            .map(drop)
            .map_err(|e| anyhow!("applying {}: {e:?}", describe(object)))
    }

    pub fn delete(&self, kind: &str, name: &str) -> Result<()> {
        self.server()
            .delete(kind, "default", name)
            .map(drop)
            .map_err(|e| anyhow!("deleting {kind} default/{name}: {e:?}"))
    }

    /// GET requests that were lists (not watches) of `path` so far.
    pub fn list_requests(&self, path: &str) -> usize {
        self.server()
            .requests()
            .iter()
            .filter(|r| r.method == "GET" && r.path == path && !r.is_watch())
            .count()
    }
}

impl Drop for NodeApiServer {
    fn drop(&mut self) {
        drop(self.server.take());
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

fn describe(object: &Value) -> String {
    format!(
        "{} {}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

pub const SERVICES_PATH: &str = "/api/v1/services";
pub const SLICES_PATH: &str = "/apis/discovery.k8s.io/v1/endpointslices";

// ---------------------------------------------------------------------------
// The modes.

/// The agent's modes (`xproxy run --mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Ebpf,
    Iptables,
    Nftables,
    /// Runs where the kernel has IPVS: in `cargo xtask vm`.
    Ipvs,
    Userspace,
}

impl Mode {
    /// Every mode, in the order `modes.rs`'s
    /// `switching_modes_with_cleanup_between` runs them.
    pub const ALL: [Mode; 5] = [Mode::Ebpf, Mode::Iptables, Mode::Nftables, Mode::Ipvs, Mode::Userspace];

    /// What `--mode` calls it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
            Mode::Ipvs => "ipvs",
            Mode::Userspace => "userspace",
        }
    }

    /// Whether the mode can run here (else the test is skipped, or fails
    /// where it was demanded: see `testbed::privileged`).
    pub fn available(self, test: &str) -> bool {
        match self {
            Mode::Ipvs => privileged::require_ipvs(test),
            _ => privileged::require_root(test),
        }
    }
}

// ---------------------------------------------------------------------------
// One node's agent.

/// The agent of one node of a bed: the process that runs (if any), the
/// ones that were stopped (kept, because dropping one runs `xproxy
/// cleanup`, which would take the data path away), their logs, and the
/// node's pin directory. Field order is drop order: processes (their
/// cleanup), then the pins.
pub struct NodeAgent {
    /// `[test label]` or `[test label] node name`, for messages.
    tag: String,
    xproxy: PathBuf,
    running: Option<AgentProcess>,
    stopped: Vec<AgentProcess>,
    logs: Vec<PathBuf>,
    pins: PinDir,
    /// Where the logs go, and `xproxy cleanup`'s scratch directory.
    dir: PathBuf,
}

impl NodeAgent {
    /// No agent yet; a fresh pin directory. Logs go to `dir`.
    pub fn new(tag: String, xproxy: PathBuf, dir: &Path) -> Self {
        Self {
            tag,
            xproxy,
            running: None,
            stopped: Vec::new(),
            logs: Vec::new(),
            pins: PinDir::new(),
            dir: dir.to_owned(),
        }
    }

    pub fn pin_path(&self) -> &Path {
        self.pins.path()
    }

    /// Starts `xproxy run ARGS --pin-path PINS` in `node`, logging to
    /// `dir/LOG_NAME`.
    pub fn start(&mut self, node: &Netns, args: &[String], log_name: &str) -> Result<()> {
        ensure!(self.running.is_none(), "an agent is already running");
        let log = self.dir.join(log_name);
        let agent = AgentProcess::start(&self.xproxy, node, self.pins.path(), args, Some(&log))?;
        eprintln!(
            "{} started agent {} (pid {:?}): xproxy run {}",
            self.tag,
            self.logs.len() + 1,
            agent.pid(),
            args.join(" ")
        );
        self.logs.push(log);
        self.running = Some(agent);
        Ok(())
    }

    /// The running agent's process id.
    pub fn pid(&self) -> Option<u32> {
        self.running.as_ref().and_then(AgentProcess::pid)
    }

    /// Whether an agent was started and not stopped since (it may have
    /// exited on its own: see [`Self::alive`]).
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// How many agents were started on this node so far.
    pub fn started(&self) -> usize {
        self.logs.len()
    }

    /// Sends `signal` to the running agent and waits for it to exit. The
    /// data path stays (its cleanup runs only when this is dropped).
    pub fn stop(&mut self, signal: i32) -> Result<ExitStatus> {
        let mut agent = self.running.take().context("no agent is running")?;
        let status = agent.stop(signal);
        self.stopped.push(agent);
        status
    }

    /// Ok while the agent runs; its exit status (and log) otherwise.
    pub fn alive(&mut self) -> Result<(), String> {
        let Some(agent) = self.running.as_mut() else {
            return Err("no agent is running".into());
        };
        match agent.try_exit_status() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!("the agent exited ({status}); log:\n{}", self.log())),
            Err(e) => Err(format!("cannot tell whether the agent runs: {e:#}")),
        }
    }

    /// The current (last started) agent's log.
    pub fn log(&self) -> String {
        self.logs.last().map(|p| read_log(p)).unwrap_or_default()
    }

    /// Every agent's log, to stderr.
    pub fn print_logs(&self) {
        for (i, path) in self.logs.iter().enumerate() {
            eprintln!(
                "----- {} log of agent {} ({}) -----\n{}----- end of log -----",
                self.tag,
                i + 1,
                path.display(),
                read_log(path)
            );
        }
    }

    /// `xproxy cleanup --scope SCOPE --pin-path PINS` in `node`, where the
    /// kernel modes' rules live (the pins are on the host's bpffs); fails
    /// unless it exits 0. Returns its output.
    pub fn cleanup(&self, node: &Netns, scope: &str) -> Result<String> {
        let exit = run_xproxy(
            &self.xproxy,
            node,
            &[
                "cleanup",
                "--scope",
                scope,
                "--pin-path",
                &self.pins.path().display().to_string(),
            ],
            &self.dir,
            Duration::from_secs(30),
        )?;
        ensure!(
            exit.code == Some(0),
            "{} xproxy cleanup exited {:?}:\n{}",
            self.tag,
            exit.code,
            exit.stderr
        );
        Ok(exit.stderr)
    }

    /// `xproxy status --pin-path PINS` (works with or without a running agent).
    pub fn status(&self) -> Result<String> {
        netns::run(
            Command::new(&self.xproxy)
                .arg("status")
                .arg("--pin-path")
                .arg(self.pins.path()),
        )
    }

    /// `xproxy status --pin-path PINS` inside `node`, where the rule-based
    /// modes' state is (the ebpf mode's pins are global).
    pub fn status_in(&self, node: &Netns) -> Result<String> {
        netns::run(
            node.command(&self.xproxy)?
                .arg("status")
                .arg("--pin-path")
                .arg(self.pins.path()),
        )
    }

    /// The agent's `/metrics`, scraped inside `node`.
    pub fn metrics(node: &Netns) -> Result<Metrics> {
        let (code, body) = http_get(node, METRICS_ADDR, "/metrics")?;
        ensure!(code == 200, "GET /metrics answered {code}: {body}");
        Ok(Metrics(body))
    }

    /// Waits until the running agent has synced once
    /// (`kubeproxy_sync_proxy_rules_last_timestamp_seconds` > 0).
    pub fn wait_first_sync(&mut self, node: &Netns, what: &str, timeout: Duration) -> Result<Metrics> {
        netns::wait_for(what, timeout, || {
            self.alive()?;
            let metrics = Self::metrics(node).map_err(|e| format!("{e:#}"))?;
            match metrics.value(LAST_SYNC) {
                Some(t) if t > 0.0 => Ok(metrics),
                other => Err(format!("{LAST_SYNC} = {other:?}")),
            }
        })
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        // Stop the running agent (SIGTERM) first, so its log is complete.
        if let Some(mut agent) = self.running.take()
            && let Err(e) = agent.stop(libc::SIGTERM)
        {
            eprintln!("{} warning: stopping the agent: {e:#}", self.tag);
            self.stopped.push(agent);
        }
        if std::thread::panicking() {
            self.print_logs();
        }
        // `xproxy cleanup` of every agent: the programs and maps go.
        self.stopped.clear();
    }
}

fn read_log(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()))
}

// ---------------------------------------------------------------------------
// The one-node bed with an agent.

/// A [`Topology`], its node's agent and a scratch directory for one test.
/// Field order is drop order: the agent (its `xproxy cleanup`), API
/// server, files, namespaces.
pub struct AgentBed {
    agent: NodeAgent,
    pub api: Option<NodeApiServer>,
    dir: TempDir,
    pub topo: Topology,
}

impl AgentBed {
    /// The namespaces (pods serving their names on TCP/UDP 80), an empty
    /// manifest directory, a pin directory; no agent yet.
    pub fn new(label: &str) -> Result<Self> {
        Self::with_offloads(label, Offloads::On)
    }

    /// [`Self::new`] with `offloads` on every veth end.
    pub fn with_offloads(label: &str, offloads: Offloads) -> Result<Self> {
        let topo = Topology::build(offloads).context("building the test bed")?;
        let dir = TempDir::with_manifests(label)?;
        Ok(Self {
            agent: NodeAgent::new(format!("[{label}]"), xproxy_binary(), dir.path()),
            api: None,
            dir,
            topo,
        })
    }

    pub fn xproxy(&self) -> &Path {
        &self.agent.xproxy
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pin_path(&self) -> &Path {
        self.agent.pin_path()
    }

    pub fn manifests(&self) -> PathBuf {
        self.dir.manifests()
    }

    /// Copies the seed manifests (examples/seed/manifests) into the manifest directory.
    pub fn copy_seed_manifests(&self) -> Result<()> {
        let seed = workspace_root().join("examples/seed/manifests");
        for entry in fs::read_dir(&seed).with_context(|| format!("reading {}", seed.display()))? {
            let path = entry?.path();
            if let Some(name) = path.file_name() {
                fs::copy(&path, self.manifests().join(name)).with_context(|| format!("copying {}", path.display()))?;
            }
        }
        Ok(())
    }

    /// Writes a manifest file atomically; returns when it was in place.
    pub fn write_manifest(&self, name: &str, text: &str) -> Result<Instant> {
        write_atomically(&self.manifests().join(name), text)
    }

    pub fn remove_manifest(&self, name: &str) -> Result<Instant> {
        let path = self.manifests().join(name);
        fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        Ok(Instant::now())
    }

    /// Starts the test API server inside the node namespace with the Node
    /// object and the seed Service and EndpointSlice; writes a kubeconfig.
    pub fn start_api_server(&mut self) -> Result<&NodeApiServer> {
        let api = NodeApiServer::start(&self.topo.node)?;
        api.apply(&node())?;
        for object in seed_objects() {
            api.apply(&object)?;
        }
        api.server()
            .write_kubeconfig(&self.kubeconfig())
            .context("writing the kubeconfig")?;
        Ok(self.api.insert(api))
    }

    pub fn api(&self) -> &NodeApiServer {
        self.api.as_ref().expect("start_api_server first")
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig.yaml")
    }

    /// `--manifests DIR`.
    pub fn manifest_args(&self) -> Vec<String> {
        vec!["--manifests".into(), self.manifests().display().to_string()]
    }

    /// `--kubeconfig FILE` of the API server started with [`Self::start_api_server`].
    pub fn kubeconfig_args(&self) -> Vec<String> {
        vec!["--kubeconfig".into(), self.kubeconfig().display().to_string()]
    }

    /// Starts `xproxy run SOURCE --mode ebpf --node-ip NODE_IP
    /// --hostname-override NODE_NAME --pin-path PINS` in the node namespace,
    /// logging to a file of its own.
    pub fn start_agent(&mut self, source_args: &[String]) -> Result<()> {
        self.start_agent_in("ebpf", source_args)
    }

    /// [`Self::start_agent_in`] without `--node-ip`: the agent finds the
    /// node's IPs itself (from its Node object).
    pub fn start_agent_finding_node_ip(&mut self, mode: &str, source_args: &[String]) -> Result<()> {
        let mut args = source_args.to_vec();
        let [mode_flag, mode, _, _, name_flag, name] = node_args(mode, NODE_IP, NODE_NAME);
        args.extend([mode_flag, mode, name_flag, name]);
        let log = format!("agent-{}.log", self.agent.started() + 1);
        self.agent.start(&self.topo.node, &args, &log)
    }

    /// [`Self::start_agent`] with `--mode mode`.
    pub fn start_agent_in(&mut self, mode: &str, source_args: &[String]) -> Result<()> {
        let mut args = source_args.to_vec();
        args.extend(node_args(mode, NODE_IP, NODE_NAME));
        let log = format!("agent-{}.log", self.agent.started() + 1);
        self.agent.start(&self.topo.node, &args, &log)
    }

    /// Sends `signal` to the running agent and waits for it to exit. The
    /// data path stays (its cleanup runs only when the bed is dropped).
    pub fn stop_agent(&mut self, signal: i32) -> Result<ExitStatus> {
        self.agent.stop(signal)
    }

    /// The running agent's process id.
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.pid()
    }

    /// Ok while the agent runs; its exit status (and log) otherwise.
    pub fn agent_alive(&mut self) -> Result<(), String> {
        self.agent.alive()
    }

    /// The current (last started) agent's log.
    pub fn log(&self) -> String {
        self.agent.log()
    }

    /// `xproxy cleanup --scope all --pin-path PINS` in the node namespace
    /// (the bed's own: every mode's rules go); fails unless it exits 0.
    /// Returns its output.
    pub fn cleanup(&self) -> Result<String> {
        self.agent.cleanup(&self.topo.node, "all")
    }

    /// [`Self::cleanup`] with `--scope scope` (`own`, `kube-proxy`, `all`).
    pub fn cleanup_scope(&self, scope: &str) -> Result<String> {
        self.agent.cleanup(&self.topo.node, scope)
    }

    /// `xproxy status --pin-path PINS` in the node namespace (works with
    /// or without a running agent).
    pub fn status(&self) -> Result<String> {
        self.agent.status_in(&self.topo.node)
    }

    /// The agent's `/metrics`, scraped inside the node namespace.
    pub fn metrics(&self) -> Result<Metrics> {
        NodeAgent::metrics(&self.topo.node)
    }

    /// Waits until the running agent has synced once.
    pub fn wait_first_sync(&mut self, timeout: Duration) -> Result<Metrics> {
        self.agent
            .wait_first_sync(&self.topo.node, "the agent's first sync", timeout)
    }

    /// Waits until `addr` answers a TCP request from the client with a
    /// backend's name (e.g. a freshly started agent programmed the seed).
    pub fn wait_answering(&mut self, addr: impl Into<SocketAddr>, timeout: Duration) -> Result<Duration> {
        let addr = addr.into();
        let started = Instant::now();
        netns::wait_for(&format!("{addr} to answer from the client"), timeout, || {
            self.agent_alive()?;
            let answer = self
                .topo
                .client
                .tcp_request(addr, Duration::from_millis(500))
                .map_err(|e| format!("{e:#}"))?
                .map_err(|e| e.to_string())?;
            if is_backend_name(&answer) {
                Ok(())
            } else {
                Err(format!("answered {answer:?}"))
            }
        })?;
        Ok(started.elapsed())
    }

    /// Waits until no change is pending in the agent and its last sync is at
    /// least [`MIN_SYNC_PERIOD`] old, so that the next change is programmed
    /// by a sync of its own at once (not held back by the minimum interval).
    pub fn wait_sync_gap(&mut self) -> Result<()> {
        netns::wait_for(
            "a quiet agent (no change pending, minSyncPeriod over)",
            Duration::from_secs(15),
            || {
                self.agent_alive()?;
                let metrics = self.metrics().map_err(|e| format!("{e:#}"))?;
                let synced = metrics.value(LAST_SYNC).unwrap_or(0.0);
                let queued = metrics.value(LAST_QUEUED).unwrap_or(0.0);
                let quiet_since = synced + MIN_SYNC_PERIOD.as_secs_f64() + 0.05;
                let now = unix_now();
                if synced > 0.0 && queued <= synced && now >= quiet_since {
                    Ok(())
                } else {
                    Err(format!("last sync {synced:.3}, last queued {queued:.3}, now {now:.3}"))
                }
            },
        )
    }

    /// Sends `count` TCP requests from `from` to `addr`; every one must be
    /// answered by a backend and every backend must answer. Returns the
    /// answers per backend.
    pub fn expect_all_backends(&self, from: &Netns, addr: SocketAddrV4, count: usize) -> Result<String> {
        probe::expect_backends(from, Protocol::Tcp, addr, &probe::backend_names(), count)
    }
}

/// Runs `steps` on a test bed of its own labeled `label`; panics with every
/// failed check.
pub fn on_own_bed(label: &str, steps: impl FnOnce(&mut AgentBed, &mut Checks) -> Result<()>) {
    let started = Instant::now();
    let mut bed = AgentBed::new(label).unwrap_or_else(|e| panic!("{label}: setting up the test bed: {e:#}"));
    let mut checks = Checks::new(label);
    if let Err(e) = steps(&mut bed, &mut checks) {
        panic!("{label}: {e:#}\nchecks failed before: {}", checks.failures());
    }
    checks.finish();
    eprintln!("[{label}] passed in {:.1?}", started.elapsed());
}

/// `--mode MODE --node-ip IP --hostname-override NAME`: what places an
/// agent on its node.
pub fn node_args(mode: &str, ip: Ipv4Addr, name: &str) -> [String; 6] {
    [
        "--mode".into(),
        mode.into(),
        "--node-ip".into(),
        ip.to_string(),
        "--hostname-override".into(),
        name.into(),
    ]
}

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

// ---------------------------------------------------------------------------
// Probes.

/// One HTTP/1.1 GET from inside `ns`: status code and body.
pub fn http_get(ns: &Netns, addr: SocketAddrV4, path: &str) -> Result<(u16, String)> {
    ns.run_in(|| http_get_here(addr, path, Duration::from_secs(5)))?
        .with_context(|| format!("GET http://{addr}{path} in netns {}", ns.name()))
}

fn http_get_here(addr: SocketAddrV4, path: &str, timeout: Duration) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&SocketAddr::V4(addr), timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("no end of the response header")?;
    let code: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad status line in {head:?}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.to_ascii_lowercase().contains("chunked")
    });
    let body = if chunked { dechunk(body)? } else { body.to_owned() };
    Ok((code, body))
}

fn dechunk(mut body: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").context("truncated chunk header")?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("bad chunk size {size:?}"))?;
        if size == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..size).context("truncated chunk")?);
        body = rest.get(size + 2..).context("truncated chunk end")?;
    }
}

/// A `/metrics` page (Prometheus / OpenMetrics text).
#[derive(Clone, Debug)]
pub struct Metrics(pub String);

impl Metrics {
    /// The value of the sample `name` without labels.
    pub fn value(&self, name: &str) -> Option<f64> {
        self.samples()
            .find(|(n, labels, _)| *n == name && labels.is_empty())
            .map(|(_, _, v)| v)
    }

    /// The value of the sample `name{labels}`; `labels` as written, e.g.
    /// `verdict="dnat_new"`.
    pub fn labeled(&self, name: &str, labels: &str) -> Option<f64> {
        self.samples()
            .find(|(n, l, _)| *n == name && *l == labels)
            .map(|(_, _, v)| v)
    }

    /// Whether any sample of the family `name` is present.
    pub fn has(&self, name: &str) -> bool {
        self.samples().any(|(n, _, _)| n == name)
    }

    /// (name, labels without braces, value) of every sample line.
    pub fn samples(&self) -> impl Iterator<Item = (&str, &str, f64)> {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let value: f64 = value.parse().ok()?;
                match series.split_once('{') {
                    Some((name, labels)) => Some((name, labels.strip_suffix('}')?, value)),
                    None => Some((series, "", value)),
                }
            })
    }
}

/// Polls `check` every 10 ms until it holds (at most `patience`) and
/// returns how long after `since` it first held. The caller compares that
/// with its bound; waiting longer than the bound only makes the failure
/// message say how late it was.
pub fn time_until(
    what: &str,
    since: Instant,
    patience: Duration,
    mut check: impl FnMut() -> Result<(), String>,
) -> Result<Duration> {
    let deadline = since + patience;
    loop {
        let last = match check() {
            Ok(()) => return Ok(since.elapsed()),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            bail!("{what}: still not the case after {patience:?}: {last}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------
// `xproxy status`.

/// The services part of `xproxy status` (up to the flow totals), with the
/// per-backend flow counts replaced by `*`.
pub fn services_masked(status: &str) -> String {
    let services = status.split("\nTracked flows:").next().unwrap_or(status);
    let mut out = String::new();
    for line in services.lines() {
        match line.rsplit_once(' ') {
            Some((head, count)) if line.starts_with("  -> ") && count.parse::<u64>().is_ok() => {
                let _ = writeln!(out, "{head} *");
            }
            _ => {
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out
}

/// Frontends in `xproxy status`: `"TCP 10.96.0.88:88"` -> (kind, number of backends).
pub fn frontends(status: &str) -> BTreeMap<String, (String, usize)> {
    let services = status.split("\nTracked flows:").next().unwrap_or(status);
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in services.lines().skip(2) {
        if line.starts_with("  -> ") {
            if let Some((_, n)) = current.as_ref().and_then(|c| out.get_mut(c)) {
                *n += 1;
            }
            continue;
        }
        let mut words = line.split_whitespace();
        if let (Some(proto), Some(addr), Some(kind)) = (words.next(), words.next(), words.next()) {
            let key = format!("{proto} {addr}");
            out.insert(key.clone(), (kind.to_owned(), 0));
            current = Some(key);
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Traffic.

/// One request of a [`Load`].
#[derive(Clone, Debug)]
pub struct Outcome {
    /// When it started, since the load started.
    pub at: Duration,
    pub took: Duration,
    /// The answer, or the error.
    pub result: Result<String, String>,
}

/// Requests on new TCP connections at a steady rate, from threads inside a
/// namespace, until stopped.
pub struct Load {
    started: Instant,
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<Vec<Outcome>>>,
    target: String,
}

impl Load {
    pub fn start(from: &Netns, addr: SocketAddrV4, per_second: u32, timeout: Duration) -> Result<Self> {
        ensure!(per_second > 0, "a rate of 0");
        // A worker per 50 requests/s: one slow request holds up only its own.
        let workers = per_second.div_ceil(50);
        let interval = Duration::from_secs_f64(f64::from(workers) / f64::from(per_second));
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for k in 0..workers {
            let path = from.path().to_owned();
            let stop = stop.clone();
            let first = started + interval.mul_f64(f64::from(k) / f64::from(workers));
            let handle = std::thread::Builder::new()
                .name(format!("load-{k}"))
                .spawn(move || {
                    let mut outcomes = Vec::new();
                    if let Err(e) = netns::enter(&path) {
                        outcomes.push(Outcome {
                            at: Duration::ZERO,
                            took: Duration::ZERO,
                            result: Err(format!("entering the namespace: {e:#}")),
                        });
                        return outcomes;
                    }
                    for i in 0u32.. {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let due = first + interval * i;
                        let now = Instant::now();
                        if due > now {
                            std::thread::sleep(due - now);
                        }
                        let begin = Instant::now();
                        let result = match netns::tcp_request(addr, timeout) {
                            Ok(answer) if is_backend_name(&answer) => Ok(answer),
                            Ok(other) => Err(format!("answered {other:?}")),
                            Err(e) => Err(error_kind(&e)),
                        };
                        outcomes.push(Outcome {
                            at: begin - started,
                            took: begin.elapsed(),
                            result,
                        });
                    }
                    outcomes
                })
                .context("spawning a load thread")?;
            handles.push(handle);
        }
        Ok(Self {
            started,
            stop,
            workers: handles,
            target: format!("{addr} at {per_second}/s"),
        })
    }

    /// Time since the load started (the `at` of its outcomes is on this clock).
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn stop(mut self) -> LoadReport {
        self.stop.store(true, Ordering::Relaxed);
        let mut outcomes = Vec::new();
        for worker in self.workers.drain(..) {
            match worker.join() {
                Ok(o) => outcomes.extend(o),
                Err(_) => outcomes.push(Outcome {
                    at: Duration::ZERO,
                    took: Duration::ZERO,
                    result: Err("a load thread panicked".into()),
                }),
            }
        }
        outcomes.sort_by_key(|o| o.at);
        LoadReport {
            target: self.target.clone(),
            duration: self.started.elapsed(),
            outcomes,
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

pub struct LoadReport {
    pub target: String,
    pub duration: Duration,
    pub outcomes: Vec<Outcome>,
}

impl LoadReport {
    pub fn failures(&self) -> Vec<&Outcome> {
        self.outcomes.iter().filter(|o| o.result.is_err()).collect()
    }

    pub fn summary(&self) -> String {
        let mut by_backend: BTreeMap<&str, usize> = BTreeMap::new();
        for o in &self.outcomes {
            if let Ok(name) = &o.result {
                *by_backend.entry(name.as_str()).or_default() += 1;
            }
        }
        let mut took: Vec<Duration> = self.outcomes.iter().map(|o| o.took).collect();
        took.sort();
        let pct = |p: f64| {
            took.get(((took.len() as f64 - 1.0) * p) as usize)
                .copied()
                .unwrap_or_default()
        };
        let secs = self.duration.as_secs_f64();
        format!(
            "{}: {} requests in {secs:.1}s ({:.0}/s), {} failed; latency p50 {:?} p99 {:?} max {:?}; answers {by_backend:?}",
            self.target,
            self.outcomes.len(),
            self.outcomes.len() as f64 / secs.max(0.001),
            self.failures().len(),
            pct(0.5),
            pct(0.99),
            took.last().copied().unwrap_or_default(),
        )
    }

    /// Ok if nothing failed; else the failures, with when they happened.
    pub fn expect_no_failures(&self) -> Result<()> {
        let failures = self.failures();
        if failures.is_empty() {
            return Ok(());
        }
        let shown: Vec<String> = failures
            .iter()
            .take(20)
            .map(|o| {
                format!(
                    "at {:.3}s after {:?}: {}",
                    o.at.as_secs_f64(),
                    o.took,
                    o.result.as_ref().err().map_or("", String::as_str)
                )
            })
            .collect();
        bail!(
            "{} of {} requests failed ({}); first ones:\n    {}",
            failures.len(),
            self.outcomes.len(),
            self.summary(),
            shown.join("\n    ")
        )
    }
}

/// How one long-lived connection of [`EchoClients`] fared.
#[derive(Clone, Debug)]
pub struct EchoOutcome {
    pub id: usize,
    pub target: SocketAddrV4,
    /// Messages sent and echoed back intact.
    pub exchanges: u64,
    /// The first error (the connection is given up then), with when it happened.
    pub error: Option<(Duration, String)>,
}

/// Long-lived TCP connections from a namespace, each exchanging a message
/// with an echo server every `interval` until stopped.
pub struct EchoClients {
    started: Instant,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<EchoOutcome>>,
}

impl EchoClients {
    /// Opens `count` connections to `addr` from `from` (ids from `first_id`)
    /// and returns once every one is established and has echoed once.
    pub fn start(from: &Netns, addr: SocketAddrV4, count: usize, first_id: usize, interval: Duration) -> Result<Self> {
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let mut threads = Vec::new();
        for id in first_id..first_id + count {
            let path = from.path().to_owned();
            let stop = stop.clone();
            let ready = ready_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("echo-{id}"))
                .spawn(move || echo_client(id, &path, addr, interval, started, &stop, &ready))
                .context("spawning an echo client thread")?;
            threads.push(thread);
        }
        drop(ready_tx);
        let clients = Self { started, stop, threads };
        for _ in 0..count {
            match ready_rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => bail!("a long-lived connection to {addr} did not start: {e}"),
                Err(e) => bail!("a long-lived connection to {addr} did not report: {e}"),
            }
        }
        Ok(clients)
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Stops (closing every connection) and reports.
    pub fn stop(mut self) -> Vec<EchoOutcome> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .drain(..)
            .map(|t| {
                t.join().unwrap_or_else(|_| EchoOutcome {
                    id: usize::MAX,
                    target: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0),
                    exchanges: 0,
                    error: Some((Duration::ZERO, "the thread panicked".into())),
                })
            })
            .collect()
    }
}

impl Drop for EchoClients {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn echo_client(
    id: usize,
    ns: &Path,
    addr: SocketAddrV4,
    interval: Duration,
    started: Instant,
    stop: &AtomicBool,
    ready: &mpsc::Sender<Result<(), String>>,
) -> EchoOutcome {
    let mut outcome = EchoOutcome {
        id,
        target: addr,
        exchanges: 0,
        error: None,
    };
    let exchange = |stream: &mut TcpStream, seq: u64| -> io::Result<()> {
        let message = format!("connection {id} message {seq}\n");
        stream.write_all(message.as_bytes())?;
        let mut echoed = vec![0u8; message.len()];
        stream.read_exact(&mut echoed)?;
        if echoed != message.as_bytes() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("echoed {:?} for {message:?}", String::from_utf8_lossy(&echoed)),
            ));
        }
        Ok(())
    };
    let connected = netns::enter(ns).map_err(|e| format!("{e:#}")).and_then(|()| {
        let mut stream =
            TcpStream::connect_timeout(&SocketAddr::V4(addr), Duration::from_secs(3)).map_err(|e| error_kind(&e))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(3))))
            .and_then(|()| stream.set_nodelay(true))
            .map_err(|e| error_kind(&e))?;
        exchange(&mut stream, 0).map_err(|e| format!("first exchange: {}", error_kind(&e)))?;
        Ok(stream)
    });
    let mut stream = match connected {
        Ok(stream) => {
            let _ = ready.send(Ok(()));
            stream
        }
        Err(e) => {
            let _ = ready.send(Err(e.clone()));
            outcome.error = Some((started.elapsed(), e));
            return outcome;
        }
    };
    outcome.exchanges = 1;
    let mut seq = 1;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(interval);
        match exchange(&mut stream, seq) {
            Ok(()) => outcome.exchanges += 1,
            Err(e) => {
                outcome.error = Some((started.elapsed(), error_kind(&e)));
                return outcome;
            }
        }
        seq += 1;
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    outcome
}

// ---------------------------------------------------------------------------
// Running the binary for its exit code.

/// How `xproxy ARGS` ended.
#[derive(Debug)]
pub struct Exit {
    pub code: Option<i32>,
    pub stderr: String,
    pub took: Duration,
}

/// Runs `xproxy args...` inside `ns` (network namespace only) and waits at
/// most `timeout` (then kills it and fails). Output goes through files, so
/// a chatty process never blocks on a full pipe.
pub fn run_xproxy(xproxy: &Path, ns: &Netns, args: &[&str], scratch: &Path, timeout: Duration) -> Result<Exit> {
    let out = scratch.join(unique_name("run-out-"));
    let err = scratch.join(unique_name("run-err-"));
    let mut cmd = ns.command(xproxy)?;
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out)?)
        .stderr(fs::File::create(&err)?);
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting xproxy {}", args.join(" ")))?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "xproxy {} still ran after {timeout:?}; stderr:\n{}",
                args.join(" "),
                fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    Ok(Exit {
        code: status.code(),
        stderr: fs::read_to_string(&err).unwrap_or_default() + &fs::read_to_string(&out).unwrap_or_default(),
        took,
    })
}

/// A TCP port on 127.0.0.1 in `ns` that nothing listens on (bound once to
/// find it, then released).
pub fn free_local_port(ns: &Netns) -> Result<u16> {
    let listener = ns.run_in(|| std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))??;
    Ok(listener.local_addr()?.port())
}

/// `ipvsadm -Ln` output as `"PROTO VS SCHEDULER" -> ["REAL WEIGHT", ...]`,
/// sorted (the kernel lists virtual servers in hash order).
pub fn ipvs_virtual_servers(listing: &str) -> BTreeMap<String, Vec<String>> {
    let mut servers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = None;
    for line in listing.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [proto @ ("TCP" | "UDP"), vs, scheduler, ..] => {
                let key = format!("{proto} {vs} {scheduler}");
                servers.insert(key.clone(), Vec::new());
                current = Some(key);
            }
            ["->", real, "Masq", weight, ..] => {
                if let Some(reals) = current.as_ref().and_then(|key| servers.get_mut(key)) {
                    reals.push(format!("{real} {weight}"));
                    reals.sort();
                }
            }
            _ => {}
        }
    }
    servers
}
