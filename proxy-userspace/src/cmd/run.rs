//! `xproxy run`: config -> data-plane mode -> sources -> the agent loop.

mod starting;

use std::{sync::Arc, time::Duration};

use anyhow::{Context, anyhow};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{ExitCode, Failure, WithExitCode, is_root};
use crate::{
    agent::Agent,
    config::{self, Config, Mode, RunFlags, Source},
    mode::{
        self, Dataplane,
        ebpf::{MissingInterface, NotBpffs},
    },
    reconcile::runner::{Reconciler, SyncPolicy},
    server::{
        Telemetry, bind_healthz, bind_metrics,
        service_health::{self, ServiceHealth},
    },
    source::{self, manifest::ManifestDir},
};

/// How long one attempt to reach the API server at start-up may take.
const API_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// The first and the longest pause between start-up attempts.
const API_RETRY_MIN: Duration = Duration::from_secs(1);
const API_RETRY_MAX: Duration = Duration::from_secs(30);

pub fn run(flags: &RunFlags) -> Result<(), Failure> {
    let loaded = config::load(flags).exit_code(ExitCode::BadConfig)?;
    super::logging::init(loaded.config.logging, flags.verbosity);
    loaded.log_warnings();
    if flags.cleanup {
        // kube-proxy's `--cleanup`: every mode's rules, then exit.
        return super::cleanup::cleanup(&loaded.config.pin_path, super::cleanup::Scope::All);
    }
    let config = loaded.config;
    if !IMPLEMENTED_MODES.contains(&config.mode) {
        return Err(Failure::new(
            ExitCode::ModeUnavailable,
            anyhow!(
                "mode {} is not implemented yet (available: {IMPLEMENTED_MODES:?})",
                config.mode
            ),
        ));
    }
    if !is_root() {
        return Err(Failure::new(
            ExitCode::NoPrivileges,
            anyhow!("xproxy run needs root (CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN for bpffs)"),
        ));
    }
    raise_open_file_limit();
    raise_locked_memory_limit();
    tune_malloc();
    super::node_setup::prepare(config.oom_score_adj, &config.conntrack);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .exit_code(ExitCode::Error)?;
    runtime.block_on(run_agent(config))
}

/// Raises the soft limit of open files to the hard one, as Go programs
/// (kube-proxy among them) do at start: the userspace mode holds a socket
/// per service port and per connection, and 1024 (the usual soft limit)
/// ran out at 20,000 Services in the benchmark.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let raised =
        getrlimit(Resource::RLIMIT_NOFILE).and_then(|(_, hard)| setrlimit(Resource::RLIMIT_NOFILE, hard, hard));
    if let Err(e) = raised {
        warn!(error = %e, "could not raise the open file limit");
    }
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK (often 64 KiB or
/// 8 MiB), too little for the ebpf mode's maps; later kernels charge the
/// memory cgroup instead and ignore the limit. Lifted as far as allowed.
fn raise_locked_memory_limit() {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit, setrlimit};
    if let Err(e) = setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY) {
        let hard = getrlimit(Resource::RLIMIT_MEMLOCK).map(|(_, hard)| hard);
        let raised = hard.and_then(|hard| setrlimit(Resource::RLIMIT_MEMLOCK, hard, hard));
        warn!(error = %e, fallback = ?raised, "could not lift the locked memory limit (kernels before 5.11 need it for maps)");
    }
}

/// glibc's malloc, set up for how the agent uses memory: a (re)list of
/// every Service and EndpointSlice is decoded on the runtime's worker
/// threads, turned into the agent's state and freed; the state stays.
/// By default each thread gets an arena of its own, and memory freed in a
/// worker's arena is kept there for that worker, never reused for the
/// state (built on another thread): at 10,000 Services x 10 endpoints the
/// freed lists held ~140 MiB of the 240 MiB resident. One arena lets the
/// state reuse what the lists freed. Fixed thresholds stop glibc from
/// raising them after a large block is freed (up to 32 MiB mapped blocks
/// and a 64 MiB trim threshold), which kept freed memory resident too.
/// Must run before any thread starts.
fn tune_malloc() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets malloc parameters; no other thread exists yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
    }
}

/// Hands memory freed inside the heap back to the kernel (`malloc_trim`).
/// Called after a sync that took in a (re)list: the list's objects were
/// freed in between long-lived allocations, where malloc keeps the pages
/// resident until something reuses them. Only then: the trim walks the
/// whole heap under the arena's lock. (Polling `mallinfo2` once a second
/// instead walked the heap too: ~100 ms a call with the lock held at
/// 100,000 Services, in the middle of the first sync.) Logged when done:
/// the agent's resident set is what it keeps from then on (the bench
/// reads it after this line).
fn release_freed_memory() {
    let started = std::time::Instant::now();
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only adjusts malloc's own state.
    unsafe {
        libc::malloc_trim(0);
    }
    info!(
        took_ms = started.elapsed().as_secs_f64() * 1e3,
        "freed memory returned to the kernel"
    );
}

async fn run_agent(mut config: Config) -> Result<(), Failure> {
    info!(mode = %config.mode, node = config.node_name, source = ?config.source, "starting");
    let stats_pin = (config.mode == Mode::Ebpf).then(|| config.pin_path.clone());
    let telemetry = Telemetry::new(config.mode.as_str(), config.sync.sync_period, stats_pin);
    start_servers(&config, &telemetry).await?;
    let client = api_client(&config, &telemetry).await?;
    let mut manifests = manifest_dir(&config)?;
    if config.node_ips.is_empty() {
        config.node_ips = find_node_ips(&config, client.clone(), manifests.as_mut()).await;
    }
    // The source first: it reads (a manifest directory of 10,000 Services
    // takes a few tenths of a second) while the mode loads and attaches
    // its programs, and the agent takes in what it read meanwhile; its
    // first sync waits for the mode.
    let (events, receiver) = mpsc::channel(1024);
    start_source(&config, client, manifests, events)?;
    let (mode, mode_sender) = starting::starting(config.mode.as_str());

    let policy = SyncPolicy::new(config.sync.min_sync_period, config.sync.sync_period);
    let service_health = ServiceHealth::new(
        Some(config.node_name.clone()),
        service_health::listen_addresses(&config),
        telemetry.clone(),
    );
    let agent = Agent::new(Reconciler::new(Box::new(mode)), policy, Arc::new(telemetry))
        .on_node(&config.node_name)
        .with_service_health(service_health)
        .after_relist_synced(|| {
            tokio::task::spawn_blocking(release_freed_memory);
        });
    let agent = tokio::spawn(agent.run(receiver, shutdown_signal()));
    match start_mode(&config).await {
        Ok(mode) => mode_sender.started(mode),
        Err(failure) => {
            // The agent's first sync may be waiting for the mode: it fails.
            drop(mode_sender);
            agent.abort();
            return Err(failure);
        }
    }
    agent
        .await
        .context("the agent's task")
        .exit_code(ExitCode::Error)?
        .exit_code(ExitCode::Error)?;
    if config.mode == Mode::Userspace {
        // The mode was dropped with the agent loop: it removed its rules.
        info!("stopping; the userspace data path ends with the agent");
    } else {
        info!("stopping; the data path stays in place (`xproxy cleanup` removes it)");
    }
    Ok(())
}

/// Binds both servers before anything else. A port that cannot be bound
/// ends the start with a clear error when `bindAddressHardFail` is set;
/// otherwise it is logged and the agent runs without that server, as
/// kube-proxy does.
async fn start_servers(config: &Config, telemetry: &Telemetry) -> Result<(), Failure> {
    let hard_fail = config.bind_address_hard_fail;
    let healthz = bind_healthz(config.healthz_bind_address, telemetry.clone()).await;
    if let Some((bound, serve)) = bound_or_skipped("healthz", healthz, hard_fail)? {
        info!(healthz = %bound, "serving health");
        tokio::spawn(serve);
    }
    let metrics = bind_metrics(config.metrics_bind_address, telemetry.clone()).await;
    if let Some((bound, serve)) = bound_or_skipped("metrics", metrics, hard_fail)? {
        info!(metrics = %bound, "serving metrics");
        tokio::spawn(serve);
    }
    Ok(())
}

/// A bound server, `None` for one that could not bind and is skipped, or
/// the failure when binding must succeed.
fn bound_or_skipped<T>(what: &str, result: anyhow::Result<T>, hard_fail: bool) -> Result<Option<T>, Failure> {
    match result {
        Ok(server) => Ok(Some(server)),
        Err(e) if hard_fail => Err(Failure::new(ExitCode::BadConfig, e)),
        Err(e) => {
            warn!(server = what, error = %format!("{e:#}"), "not serving (set bindAddressHardFail to make this fatal)");
            Ok(None)
        }
    }
}

/// The modes `start_mode` can start; checked before anything else happens.
const IMPLEMENTED_MODES: &[Mode] = &[Mode::Ebpf, Mode::Iptables, Mode::Nftables, Mode::Ipvs, Mode::Userspace];

async fn start_mode(config: &Config) -> Result<Box<dyn Dataplane>, Failure> {
    match config.mode {
        Mode::Ebpf => mode::ebpf::start(config).await.map_err(ebpf_failure),
        Mode::Iptables => mode::iptables::start(config).exit_code(ExitCode::ModeUnavailable),
        Mode::Nftables => mode::nftables::start(config).exit_code(ExitCode::ModeUnavailable),
        Mode::Ipvs => mode::ipvs::start(config).exit_code(ExitCode::ModeUnavailable),
        Mode::Userspace => mode::userspace::start(config).exit_code(ExitCode::ModeUnavailable),
    }
}

/// The exit code of an ebpf mode that did not start: a missing interface
/// and a missing bpffs have codes of their own.
fn ebpf_failure(error: anyhow::Error) -> Failure {
    let code = if error.is::<MissingInterface>() {
        ExitCode::NoInterface
    } else if error.is::<NotBpffs>() {
        ExitCode::NoPrivileges
    } else {
        ExitCode::Error
    };
    Failure::new(code, error.context("starting the ebpf mode"))
}

/// The API client, for the API sources (`None` with `--manifests`).
async fn api_client(config: &Config, telemetry: &Telemetry) -> Result<Option<kube::Client>, Failure> {
    let kubeconfig = match &config.source {
        Source::Manifests(_) => return Ok(None),
        Source::Kubeconfig(path) => Some(path.as_path()),
        Source::InCluster => None,
    };
    let client = source::kube::client(kubeconfig, Some(telemetry.request_counter()))
        .await
        .exit_code(ExitCode::BadConfig)?;
    Ok(Some(client))
}

/// How long the agent waits at start for its Node object when it needs
/// the node IPs from it (kube-proxy waits up to 30 s; a node whose API
/// server is down goes on sooner, with what the interfaces say).
const NODE_IP_WAIT: Duration = Duration::from_secs(10);

/// The node IPs when `--node-ip` is not given: from this node's Node
/// object (the API's, or the manifest directory's Node document), else
/// `bindAddress`, else the default route's interface (see
/// [`source::node::node_ips`]).
async fn find_node_ips(
    config: &Config,
    client: Option<kube::Client>,
    manifests: Option<&mut ManifestDir>,
) -> Vec<std::net::IpAddr> {
    let node = match (manifests, client) {
        // The source reuses this reading: the directory is read once.
        (Some(manifests), _) => manifests
            .reload_if_changed()
            .ok()
            .and_then(|_| manifests.node().cloned()),
        (None, Some(client)) => source::node::fetch(client, &config.node_name, NODE_IP_WAIT).await,
        (None, None) => None,
    };
    let listed = |what: &str, addrs: anyhow::Result<Vec<std::net::Ipv4Addr>>| {
        addrs.unwrap_or_else(|e| {
            warn!(error = format!("{e:#}"), "cannot list {what}");
            Vec::new()
        })
    };
    let interfaces = source::node::Interfaces {
        local: listed("this node's addresses", crate::sys::addrs::local_ipv4()),
        default_route: listed("the default route's addresses", crate::sys::addrs::default_route_ipv4()),
    };
    let ips = source::node::node_ips(node.as_ref(), &interfaces, config.bind_address);
    if ips.is_empty() {
        warn!(
            "no node IP: none given (--node-ip), none on the Node object, no bindAddress, no default route; \
             NodePorts answer where the mode finds addresses itself"
        );
    } else {
        info!(node_ips = ?ips, from_node = node.is_some(), "node IPs found");
    }
    ips
}

/// The manifest directory of the manifests source (`None` for the API).
fn manifest_dir(config: &Config) -> Result<Option<ManifestDir>, Failure> {
    let Source::Manifests(dir) = &config.source else {
        return Ok(None);
    };
    let manifests = ManifestDir::new(dir).exit_code(ExitCode::BadConfig)?;
    Ok(Some(manifests.for_node(&config.node_name)))
}

fn start_source(
    config: &Config,
    client: Option<kube::Client>,
    manifests: Option<ManifestDir>,
    events: mpsc::Sender<source::SourceEvent>,
) -> Result<(), Failure> {
    match (manifests, client) {
        (Some(manifests), _) => manifests.spawn(events),
        (None, Some(client)) => {
            // Never give up on the API server: a node may boot before its
            // control plane, and a proxy that exits then only crash-loops.
            // The watchers retry on their own; this says why nothing syncs
            // (/healthz stays 503 until the first sync, as kube-proxy's).
            tokio::spawn(report_api_server(client.clone()));
            source::kube::spawn(client, &config.node_name, events);
        }
        (None, None) => {
            return Err(Failure::new(
                ExitCode::Error,
                anyhow!("no API client for the API source"),
            ));
        }
    }
    Ok(())
}

/// Logs when the API server first answers, and every unanswered attempt
/// before that (backing off up to [`API_RETRY_MAX`]).
async fn report_api_server(client: kube::Client) {
    let mut delay = API_RETRY_MIN;
    loop {
        match tokio::time::timeout(API_ATTEMPT_TIMEOUT, client.apiserver_version()).await {
            Ok(Ok(version)) => {
                info!(version = version.git_version, "connected to the API server");
                return;
            }
            Ok(Err(e)) => warn!(error = %e, retry_in = ?delay, "the API server is unreachable; waiting for it"),
            Err(_) => warn!(
                retry_in = ?delay,
                "the API server did not answer within {API_ATTEMPT_TIMEOUT:?}; waiting for it"
            ),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(API_RETRY_MAX);
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "cannot watch SIGTERM; only SIGINT stops the agent");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => info!("SIGINT"),
    }
}
