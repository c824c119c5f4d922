//! The nftables mode against the real kernel.
//!
//! - In a bare network namespace: a full sync writes the `ip xproxy` table
//!   (compared with the kernel's own listing in a golden file), a partial
//!   sync rewrites only the changed Service's chains (the rule handles of
//!   the others stay), removal takes elements and chains away, a full sync
//!   replaces a tampered table and an idle one writes nothing, cleanup
//!   removes the table and nothing else.
//! - End to end: the real agent (`xproxy run --mode nftables`) in the node
//!   namespace of the test bed, the seed scenario through it (NodePort from
//!   the client, ClusterIP from a pod and from the node), UDP, a Service
//!   without endpoints rejected at once, an endpoint change while running,
//!   `nft list table ip xproxy` showing the maps and chains, `xproxy
//!   cleanup` removing them.

use std::{
    collections::BTreeMap,
    io,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail, ensure};
use proxy_userspace::{
    mode::{
        Dataplane,
        nftables::{self, LocalTraffic, NftablesMode, Options, SystemNft, names},
    },
    model::{Endpoint, Protocol, ServicePort},
    reconcile::Plan,
};
use testbed::agent::AgentProcess;
use xproxy_tests::{
    agent_harness::{TempDir, seed_objects, slice, workspace_root, write_atomically, xproxy_binary, yaml_documents},
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
const UDP_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 90);
const UDP_PORT: u16 = 53;

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

fn empty_port() -> ServicePort {
    ServicePort {
        name: "default/empty-service".into(),
        protocol: Protocol::Tcp,
        cluster_ip: EMPTY_CLUSTER_IP,
        port: EMPTY_PORT,
        node_port: Some(EMPTY_NODE_PORT),
        endpoints: vec![],
    }
}

fn other_port(endpoints: &[u8]) -> ServicePort {
    ServicePort {
        name: "default/other:http".into(),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 91),
        port: 80,
        node_port: None,
        endpoints: endpoints
            .iter()
            .map(|e| Endpoint::ready(Ipv4Addr::new(10, 244, 1, *e), 8080))
            .collect(),
    }
}

fn state(ports: &[ServicePort]) -> BTreeMap<String, ServicePort> {
    ports.iter().map(|p| (p.name.clone(), p.clone())).collect()
}

/// kube-proxy's defaults with the test bed's pod CIDR.
fn options() -> Options {
    Options {
        local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
        ..Options::default()
    }
}

fn list_table(ns: &Netns, handles: bool) -> Result<String> {
    let mut args = vec!["nft"];
    if handles {
        args.push("-a");
    }
    args.extend(["list", "table", "ip", "xproxy"]);
    ns.exec(&args)
}

/// The rules of every chain, with their handles (`nft -a list` output).
fn rules_by_chain(listing: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in listing.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("chain ") {
            let name = rest.split_whitespace().next().unwrap_or_default().to_owned();
            out.entry(name.clone()).or_default();
            current = Some(name);
        } else if line.starts_with('}') || line.starts_with("map ") || line.starts_with("set ") {
            current = None;
        } else if let Some(chain) = &current
            && line.contains("# handle ")
            && !line.starts_with("type ")
        {
            out.entry(chain.clone()).or_default().push(line.to_owned());
        }
    }
    out
}

/// The chains of `port` in `by_chain`.
fn port_chains<'a>(by_chain: &'a BTreeMap<String, Vec<String>>, port: &ServicePort) -> BTreeMap<&'a str, &'a [String]> {
    let path = names::service_chain(port);
    let marker = &path["service-".len()..];
    let hash_free = marker.split_once('-').map_or(marker, |(_, rest)| rest).to_owned();
    by_chain
        .iter()
        .filter(|(name, _)| name.contains(&format!("-{hash_free}")))
        .map(|(name, rules)| (name.as_str(), rules.as_slice()))
        .collect()
}

fn golden_path(name: &str) -> PathBuf {
    workspace_root()
        .join("proxy-userspace/tests/golden/nftables")
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
fn nftables_mode_in_a_namespace() {
    if !require_root("nftables_mode_in_a_namespace") {
        return;
    }
    let ns = Netns::new("xf").expect("creating the namespace");
    let mut mode = NftablesMode::new(options(), Box::new(SystemNft::default()));
    let seed = seed_port();
    let other = other_port(&[1, 2]);

    // A foreign table (kube-proxy's name), which nothing of ours may touch.
    let foreign = "table ip kube-proxy {\n\tchain c {\n\t\ttype filter hook output priority 0; policy accept;\n\t\tcounter\n\t}\n}\n";
    ns.run_in(|| nft_stdin(foreign))
        .expect("thread")
        .expect("a foreign table");

    // Full sync: the kernel's rendering of the seed and a Service without endpoints.
    ns.run_in(|| mode.apply_full(&state(&[seed.clone(), empty_port()])))
        .expect("thread")
        .expect("full sync of the seed");
    let listing = list_table(&ns, false).expect("nft list");
    assert_golden("seed.nft-list", &listing);
    for needle in [
        "map service-ips {",
        "elements = { 10.96.0.88 . tcp . 88 : goto service-",
        "elements = { tcp . 30791 : goto external-",
        "10.96.0.89 . tcp . 89 comment \"default/empty-service\" : goto reject-chain",
        "numgen random mod 3 vmap { 0 : goto endpoint-",
        "meta l4proto tcp dnat to 10.244.0.13:80",
        "type nat hook prerouting priority dstnat; policy accept;",
    ] {
        assert!(listing.contains(needle), "nft list lacks {needle:?}:\n{listing}");
    }
    let seed_before = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    let seed_chains: BTreeMap<String, Vec<String>> = port_chains(&seed_before, &seed)
        .into_iter()
        .map(|(n, r)| (n.to_owned(), r.to_vec()))
        .collect();
    assert_eq!(
        seed_chains.len(),
        5,
        "service, external and 3 endpoint chains: {seed_chains:#?}"
    );

    // Partial: another Service appears; the seed's rules keep their handles.
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![other.clone()],
            remove: vec![],
        })
    })
    .expect("thread")
    .expect("adding a Service");
    let after_add = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    assert_eq!(port_chains(&after_add, &other).len(), 3, "{after_add:#?}");
    let other_before: BTreeMap<String, Vec<String>> = port_chains(&after_add, &other)
        .into_iter()
        .map(|(n, r)| (n.to_owned(), r.to_vec()))
        .collect();

    // Partial: one endpoint of the other Service changes. Its service chain
    // is rewritten and one endpoint chain replaced; the seed is untouched.
    let other2 = other_port(&[2, 3]);
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![other2.clone()],
            remove: vec![],
        })
    })
    .expect("thread")
    .expect("an endpoint change");
    let script = mode.last_script().to_owned();
    assert!(!script.contains("nginx-service"), "the seed was touched:\n{script}");
    let after_change = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    for (chain, rules) in &seed_chains {
        assert_eq!(
            after_change.get(chain),
            Some(rules),
            "{chain} changed with another Service's endpoints"
        );
    }
    let svc = names::service_chain(&other2);
    assert_ne!(
        after_change.get(&svc),
        other_before.get(&svc),
        "{svc} was not rewritten"
    );
    let kept = names::endpoint_chain(&other2, &other2.endpoints[0]);
    assert_eq!(after_change.get(&kept), other_before.get(&kept), "{kept} was rewritten");
    let gone = names::endpoint_chain(&other, &other.endpoints[0]);
    let added = names::endpoint_chain(&other2, &other2.endpoints[1]);
    assert!(!after_change.contains_key(&gone), "{gone} still there");
    assert!(after_change.contains_key(&added), "{added} missing");

    // Partial: the other Service goes, elements and chains.
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![],
            remove: vec![other2.clone()],
        })
    })
    .expect("thread")
    .expect("removing a Service");
    let listing = list_table(&ns, false).expect("nft list");
    assert!(
        !listing.contains("10.96.0.91") && !listing.contains("default/other"),
        "{listing}"
    );
    let after_remove = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    for (chain, rules) in &seed_chains {
        assert_eq!(
            after_remove.get(chain),
            Some(rules),
            "{chain} changed with another Service's removal"
        );
    }

    // Partial: the seed loses its endpoints and is rejected; then gets them back.
    let mut lost = seed.clone();
    lost.endpoints.clear();
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![lost.clone()],
            remove: vec![],
        })
    })
    .expect("thread")
    .expect("endpoints gone");
    let listing = list_table(&ns, false).expect("nft list");
    assert!(
        listing.contains("10.96.0.88 . tcp . 88 comment \"default/nginx-service\" : goto reject-chain"),
        "{listing}"
    );
    assert!(!listing.contains("chain service-"), "{listing}");
    ns.run_in(|| {
        mode.apply(&Plan {
            upsert: vec![seed.clone()],
            remove: vec![],
        })
    })
    .expect("thread")
    .expect("endpoints back");

    // Full: a tampered table (a stale chain, a stray element) is replaced
    // with the seed's again, in the same listing as before.
    ns.run_in(|| {
        nft_stdin(
            "add chain ip xproxy service-AAAAAAAA-stale/gone/tcp/\n\
             add element ip xproxy service-nodeports { tcp . 31000 : goto service-AAAAAAAA-stale/gone/tcp/ }\n",
        )
    })
    .expect("thread")
    .expect("tampering");
    ns.run_in(|| mode.apply_full(&state(&[seed.clone(), empty_port()])))
        .expect("thread")
        .expect("full sync");
    let listing = list_table(&ns, false).expect("nft list");
    assert!(!listing.contains("stale") && !listing.contains("31000"), "{listing}");
    assert_golden("seed.nft-list", &listing);
    // Nothing changed since: the next full sync writes nothing.
    let writes = mode.kernel_writes();
    ns.run_in(|| mode.apply_full(&state(&[seed.clone(), empty_port()])))
        .expect("thread")
        .expect("idle full sync");
    assert_eq!(
        mode.kernel_writes(),
        writes,
        "a full sync with nothing to do wrote rules"
    );

    // Cleanup: the table goes, the foreign one stays; twice.
    let removed = ns.run_in(nftables::cleanup).expect("thread").expect("cleanup");
    assert!(removed);
    let tables = ns.exec(&["nft", "list", "tables"]).expect("nft list tables");
    assert!(!tables.contains("xproxy"), "{tables}");
    assert!(tables.contains("table ip kube-proxy"), "{tables}");
    let again = ns.run_in(nftables::cleanup).expect("thread").expect("second cleanup");
    assert!(!again);
}

/// `nft -f -` in the calling thread's namespace.
fn nft_stdin(script: &str) -> Result<()> {
    use proxy_userspace::mode::nftables::Nft;
    SystemNft::default().run(script)
}

// ---------------------------------------------------------------------------
// End to end with the agent.

const EXTRA_SERVICES: &str = "\
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
---
apiVersion: v1
kind: Service
metadata:
  name: udp-service
  namespace: default
spec:
  clusterIP: 10.96.0.90
  ports:
  - name: dns
    port: 53
    targetPort: 80
    protocol: UDP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: udp-service-1
  namespace: default
  labels:
    kubernetes.io/service-name: udp-service
addressType: IPv4
ports:
- name: dns
  port: 80
  protocol: UDP
endpoints:
- addresses: [\"10.244.0.11\"]
- addresses: [\"10.244.0.12\"]
- addresses: [\"10.244.0.13\"]
";

/// The test bed with an agent in nftables mode. Field order is drop order:
/// the agent before the namespaces.
struct Bed {
    agent: Option<AgentProcess>,
    xproxy: PathBuf,
    log: PathBuf,
    manifests: PathBuf,
    pins: PinDir,
    _dir: TempDir,
    topo: Topology,
}

impl Bed {
    fn start() -> Result<Self> {
        let xproxy = xproxy_binary();
        let topo = Topology::build(Offloads::On)?;
        let dir = TempDir::new("nftables")?;
        let manifests = dir.path().join("manifests");
        std::fs::create_dir_all(&manifests)?;
        let seed = workspace_root().join("examples/seed/manifests/nginx.yaml");
        std::fs::copy(&seed, manifests.join("nginx.yaml")).with_context(|| format!("copying {}", seed.display()))?;
        std::fs::write(manifests.join("extra.yaml"), EXTRA_SERVICES)?;
        let pins = PinDir::new();
        let log = dir.path().join("agent.log");
        let args: Vec<String> = [
            "--mode",
            "nftables",
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
            manifests,
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

    fn nft_list(&self) -> Result<String> {
        list_table(&self.topo.node, false)
    }

    /// `xproxy cleanup` inside the node namespace (the agent's own drop
    /// runs it in the test's namespace, where the pins are).
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
        Ok(String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout))
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("----- agent log -----\n{}----- end of log -----", self.log());
        }
        // The table lives in the node namespace, which goes with the test
        // bed; remove it first anyway, the way an operator would.
        if self.agent.is_some() {
            let _ = self.agent.take();
            let _ = self.cleanup_in_node();
        }
    }
}

/// `REQUESTS` requests from `from` to `addr` over TCP or UDP: all answered,
/// by `backends` only, and every one of them answers.
fn expect_backends(from: &Netns, addr: SocketAddrV4, udp: bool, backends: &[&str]) -> Result<String> {
    let answers = from.run_in(|| {
        (0..REQUESTS)
            .map(|_| {
                if udp {
                    netns::udp_request(addr, REQUEST_TIMEOUT)
                } else {
                    netns::tcp_request(addr, REQUEST_TIMEOUT)
                }
            })
            .collect::<Vec<_>>()
    })?;
    let mut counts: BTreeMap<&str, usize> = backends.iter().map(|n| (*n, 0)).collect();
    for (i, answer) in answers.iter().enumerate() {
        match answer {
            Ok(name) => match counts.get_mut(name.as_str()) {
                Some(n) => *n += 1,
                None => bail!("request {} to {addr} answered {name:?}, not one of {backends:?}", i + 1),
            },
            Err(e) => bail!("request {} of {REQUESTS} to {addr} failed: {e}", i + 1),
        }
    }
    let silent: Vec<_> = counts.iter().filter(|(_, n)| **n == 0).map(|(b, _)| *b).collect();
    ensure!(silent.is_empty(), "{silent:?} never answered: {counts:?}");
    Ok(format!("{counts:?}"))
}

fn all_backends() -> Vec<&'static str> {
    BACKENDS.iter().map(|(n, _)| *n).collect()
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

/// The seed in `nft list table ip xproxy`: its elements in the verdict
/// maps, its service chain dispatching to 3 endpoint chains, each DNATing
/// to its pod; the empty Service in the no-endpoint maps.
fn check_listing(listing: &str) -> Result<String> {
    let seed = seed_port();
    let svc = names::service_chain(&seed);
    let ext = names::external_chain(&seed);
    let mut needles = vec![
        "map service-ips {".to_owned(),
        "map service-nodeports {".to_owned(),
        format!("{SEED_CLUSTER_IP} . tcp . {SEED_PORT} : goto {svc}"),
        format!("tcp . {SEED_NODE_PORT} : goto {ext}"),
        format!("chain {svc} {{"),
        format!("chain {ext} {{"),
        "numgen random mod 3 vmap {".to_owned(),
        format!("{EMPTY_CLUSTER_IP} . tcp . {EMPTY_PORT} comment \"default/empty-service\" : goto reject-chain"),
        format!("tcp . {EMPTY_NODE_PORT} comment \"default/empty-service\" : goto reject-chain"),
        format!("{UDP_CLUSTER_IP} . udp . {UDP_PORT} : goto service-"),
        "masquerade fully-random".to_owned(),
    ];
    for ep in &seed.endpoints {
        needles.push(format!("chain {} {{", names::endpoint_chain(&seed, ep)));
        needles.push(format!("dnat to {}:{}", ep.addr, ep.port));
    }
    for needle in &needles {
        ensure!(listing.contains(needle.as_str()), "no {needle:?} in\n{listing}");
    }
    Ok(format!(
        "{} lines, {} chains",
        listing.lines().count(),
        listing.matches("\tchain ").count()
    ))
}

#[test]
fn seed_scenario_in_nftables_mode() {
    if !require_root("seed_scenario_in_nftables_mode") {
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
    let all = all_backends();
    let udp = SocketAddrV4::new(UDP_CLUSTER_IP, UDP_PORT);
    check(
        "client -> NODE_IP:30791 reaches all backends",
        expect_backends(&bed.topo.client, node_port, false, &all),
    );
    check(
        "client pod -> CLUSTER_IP:88 reaches all backends",
        expect_backends(&bed.topo.client_pod.ns, cluster_ip, false, &all),
    );
    check(
        "node -> CLUSTER_IP:88 reaches all backends",
        expect_backends(&bed.topo.node, cluster_ip, false, &all),
    );
    check(
        "node -> NODE_IP:30791 reaches all backends",
        expect_backends(&bed.topo.node, node_port, false, &all),
    );
    check(
        "client pod -> 10.96.0.90:53/udp reaches all backends",
        expect_backends(&bed.topo.client_pod.ns, udp, true, &all),
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
        "nft list table ip xproxy shows the maps and chains",
        bed.nft_list().and_then(|listing| check_listing(&listing)),
    );
    assert!(
        failures.is_empty(),
        "{} check(s) failed:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );

    // pod-3 leaves the EndpointSlice: a partial sync drops its chain.
    let two: Vec<Ipv4Addr> = BACKENDS[..2].iter().map(|(_, ip)| *ip).collect();
    let mut objects = seed_objects();
    objects[1] = slice("nginx-service-demo", "nginx-service", TARGET_PORT, &two);
    write_atomically(&bed.manifests.join("nginx.yaml"), &yaml_documents(&objects)).expect("rewriting the manifest");
    let gone = names::endpoint_chain(&seed_port(), &seed_port().endpoints[2]);
    netns::wait_for("pod-3's endpoint chain to go", READY_WITHIN, || {
        bed.alive()?;
        let listing = bed.nft_list().map_err(|e| format!("{e:#}"))?;
        if listing.contains(&gone) {
            Err("still there".into())
        } else {
            Ok(())
        }
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", bed.log()));
    let listing = bed.nft_list().expect("nft list");
    assert!(listing.contains("numgen random mod 2 vmap {"), "{listing}");
    let answers = expect_backends(&bed.topo.client, node_port, false, &["pod-1", "pod-2"])
        .unwrap_or_else(|e| panic!("after the endpoint change: {e:#}"));
    eprintln!("ok: after pod-3 left: {answers}");
    // The change went in as a partial sync of that one Service.
    let log = bed.log();
    assert!(log.contains("nftables mode ready"), "{log}");
    assert!(!log.contains("sync failed"), "{log}");
    for line in log.lines().filter(|l| l.contains("synced")) {
        eprintln!("agent: {line}");
    }
    assert!(
        log.lines()
            .any(|l| l.contains("synced") && l.contains("full=false") && l.contains("changed=1")),
        "no partial sync in the log:\n{log}"
    );

    // The agent stops; the table stays (like kube-proxy's) until cleanup.
    let status = bed
        .agent
        .as_mut()
        .expect("agent")
        .stop(libc::SIGTERM)
        .expect("stopping the agent");
    assert!(status.success(), "the agent exited with {status}:\n{}", bed.log());
    let after_stop = bed.nft_list().expect("the table after the agent stopped");
    assert!(after_stop.contains("map service-ips"), "{after_stop}");
    bed.cleanup_in_node().expect("xproxy cleanup");
    let tables = bed.topo.node.exec(&["nft", "list", "tables"]).expect("nft list tables");
    assert!(!tables.contains("xproxy"), "left behind:\n{tables}");
    let log = bed.cleanup_in_node().expect("xproxy cleanup again");
    assert!(log.contains("no nftables table of xproxy found"), "{log}");
    bed.agent = None;
}
