//! The iptables mode against the real kernel.
//!
//! - In a bare network namespace: the mode writes kube-proxy's chains with
//!   `iptables-restore`, a partial sync rewrites only the changed Service's
//!   chains (the rule counters of the others survive), removal and stale
//!   chains go, foreign chains stay, cleanup leaves no `KUBE-` chain.
//! - End to end: the real agent (`xproxy run --mode iptables`) in the node
//!   namespace of the test bed, the seed scenario through it, a Service
//!   without endpoints rejected at once, `iptables-save` showing the chain
//!   walk with kube-proxy's probabilities, `xproxy cleanup` removing it all.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use proxy_userspace::{
    mode::{
        Dataplane,
        iptables::{
            self, Iptables, IptablesMode, LocalTraffic, RuleOptions, SystemIptables,
            chains::{self, PortChains},
        },
    },
    model::{Endpoint, Protocol, ServicePort},
    reconcile::Plan,
};
use testbed::agent::AgentProcess;
use xproxy_tests::{
    agent_harness::{TempDir, workspace_root, xproxy_binary},
    netns::{self, Netns},
    privileged::{PinDir, require_root},
    topology::{BACKENDS, NODE_IP, Offloads, TARGET_PORT, Topology},
};

const SEED_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 88);
const SEED_PORT: u16 = 88;
const SEED_NODE_PORT: u16 = 30791;
const SEED_NAME: &str = "default/nginx-service";
const EMPTY_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 89);
const EMPTY_PORT: u16 = 89;
const EMPTY_NODE_PORT: u16 = 30792;

/// With 3 equally likely backends, the chance that one never answers 60
/// requests is 3 * (2/3)^60 < 1e-10.
const REQUESTS: usize = 60;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const REJECT_AT_ONCE: Duration = Duration::from_secs(1);
const READY_WITHIN: Duration = Duration::from_secs(30);

fn seed_port() -> ServicePort {
    ServicePort {
        name: SEED_NAME.into(),
        protocol: Protocol::Tcp,
        cluster_ip: SEED_CLUSTER_IP,
        port: SEED_PORT,
        node_port: Some(SEED_NODE_PORT),
        endpoints: BACKENDS
            .iter()
            .map(|(_, ip)| Endpoint::ready(*ip, TARGET_PORT))
            .collect(),
    }
}

fn other_port(endpoints: &[u8]) -> ServicePort {
    ServicePort {
        name: "default/other:http".into(),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 90),
        port: 80,
        node_port: None,
        endpoints: endpoints
            .iter()
            .map(|e| Endpoint::ready(Ipv4Addr::new(10, 244, 1, *e), 8080))
            .collect(),
    }
}

fn state<'a>(ports: impl IntoIterator<Item = &'a ServicePort>) -> BTreeMap<String, ServicePort> {
    ports.into_iter().map(|p| (p.name.clone(), p.clone())).collect()
}

/// kube-proxy's defaults with the test bed's pod CIDR.
fn options() -> RuleOptions {
    RuleOptions {
        local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
        ..RuleOptions::default()
    }
}

fn save(ns: &Netns, counters: bool) -> Result<String> {
    ns.run_in(|| -> Result<String> {
        let mut cmd = Command::new("iptables-save");
        if counters {
            cmd.arg("-c");
        }
        netns::run(&mut cmd)
    })?
}

/// The filter and nat tables as `iptables-save` prints them, without the
/// timestamps and the built-in chains' counters.
fn normalized(saved: &str) -> String {
    saved
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.strip_prefix(':') {
            Some(decl) => format!(":{}", decl.split(" [").next().unwrap_or(decl)),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

fn nat_chains(saved: &str) -> BTreeSet<String> {
    let parsed = iptables::Saved::parse(saved);
    parsed
        .table("nat")
        .map(|t| {
            t.chains
                .iter()
                .filter(|c| chains::is_service_chain(c))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// Packets counted by the rules of `chain` (`iptables-save -c` output).
fn chain_packets(saved: &str, chain: &str) -> u64 {
    saved
        .lines()
        .filter(|l| l.contains(&format!("] -A {chain} ")))
        .filter_map(|l| l.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
        .sum()
}

/// Sends one SYN to `addr` from inside `ns` (nobody answers); enough for the nat OUTPUT chain to count it.
fn poke(ns: &Netns, addr: SocketAddrV4) -> Result<()> {
    let _ = ns.run_in(|| netns::tcp_connect(addr, Duration::from_millis(100)))?;
    Ok(())
}

/// A namespace with a default route into a veth whose peer (in the same
/// namespace) ignores everything, so local connects leave one SYN.
fn bare_namespace() -> Result<Netns> {
    let ns = Netns::new("xi")?;
    ns.ip(&["link", "add", "v0", "type", "veth", "peer", "name", "v1"])?;
    ns.add_addr("v0", "192.0.2.1/24")?;
    ns.ip(&["link", "set", "v0", "up"])?;
    ns.ip(&["link", "set", "v1", "up"])?;
    ns.add_route(&["default", "dev", "v0"])?;
    Ok(ns)
}

fn golden_path(name: &str) -> PathBuf {
    workspace_root()
        .join("proxy-userspace/tests/golden/iptables")
        .join(name)
}

/// Compares with a golden file; `XPROXY_UPDATE_GOLDEN=1` rewrites it.
fn assert_golden(name: &str, actual: &str) {
    let path = golden_path(name);
    if std::env::var("XPROXY_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert!(
        expected == actual,
        "{} differs (XPROXY_UPDATE_GOLDEN=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display()
    );
}

#[test]
fn iptables_mode_in_a_namespace() {
    if !require_root("iptables_mode_in_a_namespace") {
        return;
    }
    let ns = bare_namespace().expect("creating the namespace");
    let mut mode = IptablesMode::new(options(), Box::new(SystemIptables::default()));
    let seed = seed_port();
    let other = other_port(&[1, 2]);

    // A foreign chain, which nothing of ours may touch.
    ns.run_in(|| {
        SystemIptables::default()
            .restore("*nat\n:MY-CHAIN - [0:0]\n-A MY-CHAIN -j RETURN\n-A OUTPUT -j MY-CHAIN\nCOMMIT\n")
    })
    .expect("thread")
    .expect("a foreign chain");

    ns.run_in(|| mode.apply_full(&state([&seed])))
        .expect("thread")
        .expect("full sync of the seed");
    let saved = save(&ns, false).expect("iptables-save");
    // The kernel's own rendering of the seed, like kube-proxy's node shows it
    // (minus the foreign chain).
    let without_foreign: String = normalized(&saved)
        .lines()
        .filter(|l| !l.contains("MY-CHAIN"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_golden("seed.iptables-save", &without_foreign);
    let names = PortChains::of(&seed);
    for needle in [
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_owned(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_owned(),
        format!(
            "-d {SEED_CLUSTER_IP}/32 -p tcp -m comment --comment \"{SEED_NAME} cluster IP\" -m tcp --dport {SEED_PORT} -j {}",
            names.svc
        ),
        "--probability 0.33333333349 -j KUBE-SEP-".to_owned(),
        "--probability 0.50000000000 -j KUBE-SEP-".to_owned(),
        format!("--dport {SEED_NODE_PORT} -j {}", names.ext),
        "-j DNAT --to-destination 10.244.0.13:80".to_owned(),
    ] {
        assert!(saved.contains(&needle), "iptables-save lacks {needle:?}:\n{saved}");
    }

    // Partial: another Service appears.
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![other.clone()],
            remove: vec![],
        })
    })
    .expect("thread")
    .expect("adding a Service");
    let other_svc = chains::svc_chain(&other.name, other.protocol);
    poke(&ns, SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT)).expect("poke seed");
    poke(&ns, SocketAddrV4::new(other.cluster_ip, other.port)).expect("poke other");
    let counted = save(&ns, true).expect("iptables-save -c");
    assert!(chain_packets(&counted, &names.svc) > 0, "seed not counted:\n{counted}");
    assert!(chain_packets(&counted, &other_svc) > 0, "other not counted:\n{counted}");

    // Partial: one endpoint of the other Service changes. Only its chains
    // are rewritten (counters back to 0); the seed's keep their counts.
    let other2 = other_port(&[2, 3]);
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![other2.clone()],
            remove: vec![],
        })
    })
    .expect("thread")
    .expect("an endpoint change");
    let counted = save(&ns, true).expect("iptables-save -c");
    assert!(
        chain_packets(&counted, &names.svc) > 0,
        "the seed's chain was rewritten by a change of another Service:\n{counted}"
    );
    assert_eq!(chain_packets(&counted, &other_svc), 0, "{counted}");
    let input = mode.last_input().to_owned();
    assert!(!input.contains(&format!(":{} ", names.svc)), "{input}");
    let gone = chains::sep_chain(&other.name, other.protocol, "10.244.1.1:8080");
    let added = chains::sep_chain(&other.name, other.protocol, "10.244.1.3:8080");
    let chains_now = nat_chains(&counted);
    assert!(!chains_now.contains(&gone), "{gone} still there: {chains_now:?}");
    assert!(chains_now.contains(&added), "{added} missing: {chains_now:?}");

    // Partial: the other Service goes.
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![],
            remove: vec![other2.clone()],
        })
    })
    .expect("thread")
    .expect("removing a Service");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains("10.96.0.90"), "{saved}");
    let only_seed: BTreeSet<String> = nat_chains(&saved);
    assert_eq!(only_seed.len(), 5, "SVC, EXT and 3 SEP: {only_seed:?}");
    assert!(only_seed.iter().all(|c| !c.contains(&other_svc[9..])));

    // Full: a stale chain (e.g. of an earlier run) is deleted.
    ns.run_in(|| {
        SystemIptables::default().restore(
            "*nat\n:KUBE-SVC-STALE0000000000 - [0:0]\n:KUBE-SEP-STALE0000000000 - [0:0]\n\
             -A KUBE-SVC-STALE0000000000 -j KUBE-SEP-STALE0000000000\nCOMMIT\n",
        )
    })
    .expect("thread")
    .expect("a stale chain");
    ns.run_in(|| mode.apply_full(&state([&seed])))
        .expect("thread")
        .expect("full sync");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains("STALE"), "{saved}");
    assert_eq!(nat_chains(&saved), only_seed);
    // Nothing changed since: the next full sync writes nothing.
    let writes = mode.kernel_writes();
    ns.run_in(|| mode.apply_full(&state([&seed])))
        .expect("thread")
        .expect("idle full sync");
    assert_eq!(
        mode.kernel_writes(),
        writes,
        "a full sync with nothing to do wrote rules"
    );

    // Cleanup: no KUBE- chain or jump, the foreign chain intact; twice.
    let removed = ns.run_in(iptables::cleanup).expect("thread").expect("cleanup");
    assert!(removed >= 9, "removed {removed} chains");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains("KUBE-"), "left behind:\n{saved}");
    assert!(
        saved.contains("-A MY-CHAIN -j RETURN") && saved.contains("-A OUTPUT -j MY-CHAIN"),
        "{saved}"
    );
    let again = ns.run_in(iptables::cleanup).expect("thread").expect("second cleanup");
    assert_eq!(again, 0);
}

// ---------------------------------------------------------------------------
// End to end with the agent.

const EMPTY_SERVICE: &str = "\
apiVersion: v1
kind: Service
metadata:
  name: empty-service
  namespace: default
spec:
  type: NodePort
  clusterIP: 10.96.0.89
  ports:
  - port: 89
    targetPort: 80
    nodePort: 30792
";

/// The test bed with an agent in iptables mode. Field order is drop order:
/// the agent (SIGTERM, then `xproxy cleanup`) before the namespaces.
struct Bed {
    agent: Option<AgentProcess>,
    xproxy: PathBuf,
    log: PathBuf,
    pins: PinDir,
    _dir: TempDir,
    topo: Topology,
}

impl Bed {
    fn start() -> Result<Self> {
        let xproxy = xproxy_binary();
        let topo = Topology::build(Offloads::On)?;
        let dir = TempDir::new("iptables")?;
        let manifests = dir.path().join("manifests");
        std::fs::create_dir_all(&manifests)?;
        let seed = workspace_root().join("examples/seed/manifests/nginx.yaml");
        std::fs::copy(&seed, manifests.join("nginx.yaml")).with_context(|| format!("copying {}", seed.display()))?;
        std::fs::write(manifests.join("empty.yaml"), EMPTY_SERVICE)?;
        let pins = PinDir::new();
        let log = dir.path().join("agent.log");
        let args: Vec<String> = [
            "--mode",
            "iptables",
            "--manifests",
            &manifests.display().to_string(),
            "--node-ip",
            &NODE_IP.to_string(),
        ]
        .map(String::from)
        .to_vec();
        let agent = AgentProcess::start(&xproxy, &topo.node, pins.path(), &args, Some(&log))?;
        Ok(Self {
            agent: Some(agent),
            xproxy,
            log,
            pins,
            _dir: dir,
            topo,
        })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("<cannot read the log: {e}>"))
    }

    fn alive(&mut self) -> Result<(), String> {
        match self.agent.as_mut().map(AgentProcess::try_exit_status) {
            Some(Ok(None)) => Ok(()),
            Some(Ok(Some(status))) => Err(format!("the agent exited ({status}):\n{}", self.log())),
            Some(Err(e)) => Err(format!("{e:#}")),
            None => Err("no agent".into()),
        }
    }

    fn iptables_save(&self) -> Result<String> {
        self.topo.node.exec(&["iptables-save"])
    }

    /// `xproxy cleanup` inside the node namespace.
    fn cleanup_in_node(&self) -> Result<String> {
        let mut cmd = self.topo.node.command(&self.xproxy)?;
        cmd.arg("cleanup").arg("--pin-path").arg(self.pins.path());
        let out = cmd.output().context("running xproxy cleanup")?;
        ensure!(
            out.status.success(),
            "xproxy cleanup failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("----- agent log -----\n{}----- end of log -----", self.log());
        }
    }
}

/// `count` TCP requests from `from` to `addr`: all answered, by backends
/// only, and every backend answers.
fn expect_all_backends(from: &Netns, addr: SocketAddrV4) -> Result<String> {
    let answers = from.run_in(|| {
        (0..REQUESTS)
            .map(|_| netns::tcp_request(addr, REQUEST_TIMEOUT))
            .collect::<Vec<_>>()
    })?;
    let mut counts: BTreeMap<&str, usize> = BACKENDS.iter().map(|(n, _)| (*n, 0)).collect();
    for (i, answer) in answers.iter().enumerate() {
        match answer {
            Ok(name) => match counts.get_mut(name.as_str()) {
                Some(n) => *n += 1,
                None => bail!("request {} to {addr} answered {name:?}, not a backend", i + 1),
            },
            Err(e) => bail!("request {} of {REQUESTS} to {addr} failed: {e}", i + 1),
        }
    }
    let silent: Vec<_> = counts.iter().filter(|(_, n)| **n == 0).map(|(b, _)| *b).collect();
    ensure!(silent.is_empty(), "{silent:?} never answered: {counts:?}");
    Ok(format!("{counts:?}"))
}

/// A TCP connect to `addr` from `from` is refused, at once.
fn expect_refused(from: &Netns, addr: SocketAddrV4) -> Result<String> {
    let (result, elapsed) = from.run_in(|| {
        let started = Instant::now();
        (netns::tcp_connect(addr, Duration::from_secs(5)), started.elapsed())
    })?;
    match result {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            ensure!(elapsed < REJECT_AT_ONCE, "refused only after {elapsed:?}");
            Ok(format!("refused after {elapsed:?}"))
        }
        Err(e) => Err(anyhow!("expected ECONNREFUSED, got \"{e}\" after {elapsed:?}")),
        Ok(stream) => Err(anyhow!("expected ECONNREFUSED, connected: {stream:?}")),
    }
}

/// The chain walk of the seed in `iptables-save`: KUBE-SERVICES ->
/// KUBE-SVC -> three KUBE-SEP with 1/3, 1/2, rest -> DNAT to each pod;
/// KUBE-NODEPORTS -> KUBE-EXT -> KUBE-SVC.
fn check_chain_walk(saved: &str) -> Result<String> {
    let names = PortChains::of(&seed_port());
    let lines: Vec<&str> = saved.lines().collect();
    let find = |needle: &str| -> Result<&str> {
        lines
            .iter()
            .copied()
            .find(|l| l.contains(needle))
            .with_context(|| format!("no rule with {needle:?} in\n{saved}"))
    };
    find(&format!("-A KUBE-SERVICES -d {SEED_CLUSTER_IP}/32 -p tcp")).and_then(|l| {
        if l.ends_with(&format!("-j {}", names.svc)) {
            Ok(l)
        } else {
            bail!("{l}")
        }
    })?;
    find(&format!("--dport {SEED_NODE_PORT} -j {}", names.ext))?;
    find(&format!("-A {} -m comment", names.ext))?;
    let dispatch: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with(&format!("-A {} ", names.svc)) && l.contains("-j KUBE-SEP-"))
        .collect();
    ensure!(
        dispatch.len() == 3,
        "expected 3 KUBE-SEP jumps in {}: {dispatch:#?}",
        names.svc
    );
    ensure!(dispatch[0].contains("--probability 0.33333333349"), "{}", dispatch[0]);
    ensure!(dispatch[1].contains("--probability 0.50000000000"), "{}", dispatch[1]);
    ensure!(!dispatch[2].contains("--probability"), "{}", dispatch[2]);
    for (_, ip) in BACKENDS {
        find(&format!("-j DNAT --to-destination {ip}:{TARGET_PORT}"))?;
    }
    find("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES")?;
    find("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE")?;
    find("\"default/empty-service has no endpoints\"")?;
    Ok(dispatch.join("\n"))
}

#[test]
fn seed_scenario_in_iptables_mode() {
    if !require_root("seed_scenario_in_iptables_mode") {
        return;
    }
    let mut bed = Bed::start().expect("starting the test bed and the agent");
    let node_port = SocketAddrV4::new(NODE_IP, SEED_NODE_PORT);
    let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
    netns::wait_for("the seed NodePort to answer", READY_WITHIN, || {
        bed.alive()?;
        match bed.topo.client.tcp_request(node_port, Duration::from_millis(500)) {
            Ok(Ok(answer)) if BACKENDS.iter().any(|(n, _)| *n == answer) => Ok(()),
            Ok(Ok(answer)) => Err(format!("answered {answer:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("{e:#}")),
        }
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", bed.log()));

    let mut failures = Vec::new();
    let mut check = |what: &str, result: Result<String>| match result {
        Ok(detail) => eprintln!("ok: {what}: {detail}"),
        Err(e) => {
            eprintln!("FAILED: {what}: {e:#}");
            failures.push(format!("{what}: {e:#}"));
        }
    };
    check(
        "client -> NODE_IP:30791 reaches all backends",
        expect_all_backends(&bed.topo.client, node_port),
    );
    check(
        "client pod -> CLUSTER_IP:88 reaches all backends",
        expect_all_backends(&bed.topo.client_pod.ns, cluster_ip),
    );
    check(
        "node -> CLUSTER_IP:88 reaches all backends",
        expect_all_backends(&bed.topo.node, cluster_ip),
    );
    check(
        "pod-1 -> CLUSTER_IP:88 reaches all backends, itself too (hairpin)",
        expect_all_backends(&bed.topo.backends[0].ns, cluster_ip),
    );
    check(
        "client -> NODE_IP:30792 (no endpoints) is refused",
        expect_refused(&bed.topo.client, SocketAddrV4::new(NODE_IP, EMPTY_NODE_PORT)),
    );
    check(
        "client pod -> 10.96.0.89:89 (no endpoints) is refused",
        expect_refused(&bed.topo.client_pod.ns, SocketAddrV4::new(EMPTY_CLUSTER_IP, EMPTY_PORT)),
    );
    check(
        "node -> 10.96.0.89:89 (no endpoints) is refused",
        expect_refused(&bed.topo.node, SocketAddrV4::new(EMPTY_CLUSTER_IP, EMPTY_PORT)),
    );
    check(
        "iptables-save shows KUBE-SERVICES -> KUBE-SVC -> KUBE-SEP",
        bed.iptables_save().and_then(|saved| check_chain_walk(&saved)),
    );
    assert!(
        failures.is_empty(),
        "{} check(s) failed:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );

    // The agent stops; the rules stay (like kube-proxy's) until cleanup.
    let status = bed
        .agent
        .as_mut()
        .expect("agent")
        .stop(libc::SIGTERM)
        .expect("stopping the agent");
    assert!(status.success(), "the agent exited with {status}:\n{}", bed.log());
    let after_stop = bed.iptables_save().expect("iptables-save");
    assert!(after_stop.contains(":KUBE-SERVICES"), "rules gone with the agent");
    bed.cleanup_in_node().expect("xproxy cleanup");
    let after_cleanup = bed.iptables_save().expect("iptables-save");
    assert!(!after_cleanup.contains("KUBE-"), "left behind:\n{after_cleanup}");
    let log = bed.cleanup_in_node().expect("xproxy cleanup again");
    assert!(log.contains("no iptables chains"), "{log}");
    if std::env::var_os("XPROXY_SHOW_LOG").is_some() {
        eprintln!("{}", bed.log());
    }
}
