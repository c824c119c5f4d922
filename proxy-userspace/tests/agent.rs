//! The agent end to end: the real `xproxy run` binary in the node namespace
//! of the test bed (client, node, three backend pods, a client pod), fed by
//! a manifest directory or by the test API server listening inside the
//! node, with real traffic through the programs it attaches.
//!
//! Every test builds its own namespaces, pin directory and scratch
//! directory (removed on drop, also on failure; a failing test prints the
//! agent's log). Every wait polls a condition with a deadline; the only
//! fixed durations are those the scenario is about (an API server outage of
//! 60 s, a few seconds without an agent).

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    os::unix::process::ExitStatusExt,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use testbed::{
    agent_bed::{
        self as h, AgentBed, EchoClients, Load, NodeApiServer, READY_WITHIN, TempDir, frontends, node_port,
        seed_node_port, services_masked, time_until,
    },
    fixtures::{self, SEED_CLUSTER_IP, SEED_PORT, backend_ips, slice, yaml_documents},
    netns::{self, Netns},
    privileged::{PinDir, require_root},
    probe::{answers, refused},
    topology::{NODE_IP, POD_GATEWAY, TARGET_PORT},
};

/// A change must be in the data path this soon after it was made.
const VISIBLE_WITHIN: Duration = Duration::from_secs(1);
/// How long a measurement keeps polling past [`VISIBLE_WITHIN`], so that a
/// late change is reported with its real latency.
const PATIENCE: Duration = Duration::from_secs(10);
/// Requests per "every backend answers" check: the chance that one of three
/// equally likely backends never answers 45 requests is 3 * (2/3)^45 < 1e-7.
const ALL_BACKENDS_REQUESTS: usize = 45;

/// Runs a scenario on a fresh test bed; an error fails the test (the bed
/// prints the agent's log as it unwinds).
fn run(test: &str, scenario: impl FnOnce(&mut AgentBed) -> Result<()>) {
    let started = Instant::now();
    let mut bed = AgentBed::new(test).unwrap_or_else(|e| panic!("{test}: setting up the test bed: {e:#}"));
    if let Err(e) = scenario(&mut bed) {
        panic!("{test}: {e:#}");
    }
    eprintln!("[{test}] passed in {:.1?}", started.elapsed());
}

fn note(test: &str, what: impl std::fmt::Display) {
    eprintln!("[{test}] {what}");
}

// ---------------------------------------------------------------------------
// 1 and 2: changes reach the data path within a second.

/// The Service the change tests create, re-port and delete.
const SECOND_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 77);
const SECOND_PORT: (u16, u16) = (89, 90);
const SECOND_NODE_PORT: (u16, u16) = (30801, 30802);

fn second_service(version: usize) -> Value {
    let (port, node_port) = if version == 0 {
        (SECOND_PORT.0, SECOND_NODE_PORT.0)
    } else {
        (SECOND_PORT.1, SECOND_NODE_PORT.1)
    };
    fixtures::service("second", SECOND_IP, port, TARGET_PORT, Some(node_port))
}

fn second_slice() -> Value {
    slice("second-1", "second", TARGET_PORT, &backend_ips())
}

/// How the change tests change the cluster.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    Manifests,
    ApiServer,
}

const SECOND_FILE: &str = "second.yaml";

/// Makes one change and returns when it was made (the file renamed into
/// place, or the first object applied).
fn change(bed: &AgentBed, via: Via, step: &str) -> Result<Instant> {
    match (via, step) {
        (Via::Manifests, "create") => {
            bed.write_manifest(SECOND_FILE, &yaml_documents(&[second_service(0), second_slice()]))
        }
        (Via::Manifests, "re-port") => {
            bed.write_manifest(SECOND_FILE, &yaml_documents(&[second_service(1), second_slice()]))
        }
        (Via::Manifests, "delete") => bed.remove_manifest(SECOND_FILE),
        (Via::ApiServer, "create") => {
            let at = Instant::now();
            bed.api().apply(&second_service(0))?;
            bed.api().apply(&second_slice())?;
            Ok(at)
        }
        (Via::ApiServer, "re-port") => {
            let at = Instant::now();
            bed.api().apply(&second_service(1))?;
            Ok(at)
        }
        (Via::ApiServer, "delete") => {
            let at = Instant::now();
            bed.api().delete("Service", "second")?;
            bed.api().delete("EndpointSlice", "second-1")?;
            Ok(at)
        }
        _ => bail!("no change {step:?}"),
    }
}

/// Whether the data path and `xproxy status` show what `step` asked for.
fn programmed(bed: &mut AgentBed, step: &str) -> Result<(), String> {
    bed.agent_alive()?;
    let status = bed.status().map_err(|e| format!("{e:#}"))?;
    let shown = frontends(&status);
    let has = |key: &str, backends: usize| match shown.get(key) {
        Some((_, n)) if *n == backends => Ok(()),
        Some((_, n)) => Err(format!("status shows {key} with {n} backends, expected {backends}")),
        None => Err(format!("status lacks {key}")),
    };
    let lacks = |key: &str| match shown.get(key) {
        Some(_) => Err(format!("status still shows {key}")),
        None => Ok(()),
    };
    let client = &bed.topo.client;
    let (old, new) = (
        format!("TCP {SECOND_IP}:{}", SECOND_PORT.0),
        format!("TCP {SECOND_IP}:{}", SECOND_PORT.1),
    );
    let (old_np, new_np) = (
        format!("TCP {NODE_IP}:{}", SECOND_NODE_PORT.0),
        format!("TCP {NODE_IP}:{}", SECOND_NODE_PORT.1),
    );
    match step {
        "create" => {
            has(&old, 3)?;
            has(&old_np, 3)?;
            answers(client, node_port(SECOND_NODE_PORT.0)).map(drop)
        }
        "re-port" => {
            has(&new, 3)?;
            has(&new_np, 3)?;
            lacks(&old)?;
            lacks(&old_np)?;
            answers(client, node_port(SECOND_NODE_PORT.1))?;
            refused(client, node_port(SECOND_NODE_PORT.0))
        }
        "delete" => {
            lacks(&new)?;
            lacks(&new_np)?;
            refused(client, node_port(SECOND_NODE_PORT.1))
        }
        _ => Err(format!("no step {step:?}")),
    }
}

/// Create, re-port and delete a Service (and its EndpointSlice): each must
/// be in the data path within [`VISIBLE_WITHIN`] of being made.
///
/// Each change is made once the agent is quiet: nothing pending and its
/// last sync older than minSyncPeriod (1 s by default, kube-proxy's). A
/// change made sooner after a sync waits for the rest of that period by
/// design; that is not what is measured here.
fn change_sequence(test: &str, bed: &mut AgentBed, via: Via) -> Result<()> {
    let mut latencies = Vec::new();
    for step in ["create", "re-port", "delete"] {
        bed.wait_sync_gap()?;
        let at = change(bed, via, step)?;
        let took = time_until(&format!("{step} programmed"), at, PATIENCE, || programmed(bed, step))?;
        note(
            test,
            format!("{step}: in the data path and `xproxy status` after {took:.3?}"),
        );
        latencies.push((step, took));
    }
    let late: Vec<String> = latencies
        .iter()
        .filter(|(_, took)| *took >= VISIBLE_WITHIN)
        .map(|(step, took)| format!("{step} took {took:.3?}"))
        .collect();
    ensure!(
        late.is_empty(),
        "changes must be programmed within {VISIBLE_WITHIN:?}: {}",
        late.join(", ")
    );
    let seen = bed.expect_all_backends(&bed.topo.client, seed_node_port(), ALL_BACKENDS_REQUESTS)?;
    note(test, format!("the seed still answers from every backend: {seen}"));
    Ok(())
}

#[test]
fn manifest_changes_are_programmed_within_a_second() {
    const TEST: &str = "manifest_changes_are_programmed_within_a_second";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.copy_seed_manifests()?;
        bed.start_agent(&bed.manifest_args())?;
        let ready = bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let seen = bed.expect_all_backends(&bed.topo.client, seed_node_port(), ALL_BACKENDS_REQUESTS)?;
        note(
            TEST,
            format!("seed NodePort answering {ready:.1?} after the start: {seen}"),
        );
        change_sequence(TEST, bed, Via::Manifests)
    });
}

#[test]
fn api_server_changes_are_programmed_within_a_second() {
    const TEST: &str = "api_server_changes_are_programmed_within_a_second";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.start_api_server()?;
        bed.start_agent(&bed.kubeconfig_args())?;
        let ready = bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let seen = bed.expect_all_backends(&bed.topo.client, seed_node_port(), ALL_BACKENDS_REQUESTS)?;
        note(
            TEST,
            format!("seed NodePort answering {ready:.1?} after the start: {seen}"),
        );
        change_sequence(TEST, bed, Via::ApiServer)?;
        trigger_time_latency_is_measured(bed)
    });
}

/// A slice carrying the EndpointSlice controller's trigger time (here: a
/// change two seconds ago) adds one sample of at least two seconds to
/// kube-proxy's network programming latency.
fn trigger_time_latency_is_measured(bed: &mut AgentBed) -> Result<()> {
    const LATENCY: &str = "kubeproxy_network_programming_duration_seconds";
    let metrics = bed.metrics()?;
    // The lists and watches so far were counted as client-go counts them.
    ensure!(
        metrics.has("rest_client_requests_total"),
        "no rest_client_requests_total after the lists and watches"
    );
    let before = metrics.value(&format!("{LATENCY}_count")).unwrap_or(0.0);
    let two_seconds_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(2);
    let mut annotated = slice("nginx-service-1", "nginx-service", TARGET_PORT, &backend_ips());
    annotated["metadata"]["annotations"] =
        json!({"endpoints.kubernetes.io/last-change-trigger-time": two_seconds_ago.to_string()});
    bed.api().apply(&annotated)?;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let metrics = bed.metrics()?;
        let count = metrics.value(&format!("{LATENCY}_count")).unwrap_or(0.0);
        if count > before {
            let under_two = metrics
                .labeled(&format!("{LATENCY}_bucket"), "le=\"1.0\"")
                .unwrap_or(0.0);
            let under_five = metrics
                .labeled(&format!("{LATENCY}_bucket"), "le=\"5.0\"")
                .unwrap_or(0.0);
            ensure!(
                under_five - under_two >= 1.0,
                "no sample between 2 s and 5 s: {under_two} / {under_five}"
            );
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{LATENCY} gained no sample within {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Without `--node-ip` the agent takes the node's IPs from its Node
/// object's `InternalIP`, as kube-proxy does: the ebpf mode finds its
/// uplink by that address and the NodePort answers on it.
#[test]
fn node_ips_come_from_the_node_object_without_node_ip() {
    const TEST: &str = "node_ips_come_from_the_node_object_without_node_ip";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.start_api_server()?;
        bed.start_agent_finding_node_ip("ebpf", &bed.kubeconfig_args())?;
        let ready = bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let found = log_lines(&bed.log(), "node IPs found");
        ensure!(
            found.iter().any(|l| l.contains(&NODE_IP.to_string())),
            "the log does not say {NODE_IP} was found: {found:?}"
        );
        let seen = bed.expect_all_backends(&bed.topo.client, seed_node_port(), ALL_BACKENDS_REQUESTS)?;
        note(
            TEST,
            format!("NodePort on the Node's InternalIP answering {ready:.1?} after the start: {seen}"),
        );
        Ok(())
    });
}

/// The same from the manifest directory's Node document: the directory is
/// read once at the start, for the node IPs and for the Services alike.
#[test]
fn node_ips_come_from_the_manifests_node_document_without_node_ip() {
    const TEST: &str = "node_ips_come_from_the_manifests_node_document_without_node_ip";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.copy_seed_manifests()?;
        bed.write_manifest("node.yaml", &yaml_documents(&[fixtures::node()]))?;
        bed.start_agent_finding_node_ip("ebpf", &bed.manifest_args())?;
        let ready = bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let log = bed.log();
        let found = log_lines(&log, "node IPs found");
        ensure!(
            found
                .iter()
                .any(|l| l.contains(&NODE_IP.to_string()) && l.contains("from_node=true")),
            "the log does not say {NODE_IP} was found on the Node: {found:?}"
        );
        // The source's first snapshot comes from that reading: no file read.
        let readings = log_lines(&log, "manifests read");
        let parsing: Vec<&String> = readings.iter().filter(|l| !l.contains(" read=0 ")).collect();
        ensure!(parsing.len() == 1, "the files were read more than once: {readings:?}");
        note(
            TEST,
            format!("NodePort answering {ready:.1?} after the start, one reading"),
        );
        Ok(())
    });
}

/// The node's zone comes from its Node object through the API watch: zone
/// hints keep the Service's traffic in this node's zone, and when the
/// Node's zone label changes the agent re-programs the Service for the
/// new zone (kube-proxy's topology-aware routing; the fall-backs are
/// unit-tested in the model).
#[test]
fn zone_hints_follow_the_node_objects_zone() {
    const TEST: &str = "zone_hints_follow_the_node_objects_zone";
    if !require_root(TEST) {
        return;
    }
    let node_in = |zone: &str| {
        let mut node = fixtures::node();
        node["metadata"]["labels"]["topology.kubernetes.io/zone"] = json!(zone);
        node
    };
    run(TEST, |bed| {
        bed.start_api_server()?;
        let api = bed.api();
        api.apply(&node_in("zone-1"))?;
        let mut hinted = slice(fixtures::SEED_SLICE, fixtures::SEED_NAME, TARGET_PORT, &backend_ips());
        for (i, endpoint) in hinted["endpoints"].as_array_mut().into_iter().flatten().enumerate() {
            let zone = if i == 0 { "zone-1" } else { "zone-2" };
            endpoint["zone"] = json!(zone);
            endpoint["hints"] = json!({"forZones": [{"name": zone}]});
        }
        api.apply(&hinted)?;
        bed.start_agent(&bed.kubeconfig_args())?;
        bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let zone_1 = testbed::probe::expect_backends(
            &bed.topo.client,
            testbed::probe::Protocol::Tcp,
            seed_node_port(),
            &["pod-1"],
            ALL_BACKENDS_REQUESTS,
        )?;
        bed.api().apply(&node_in("zone-2"))?;
        let client = &bed.topo.client;
        let zone_2 = netns::wait_for("zone-2's pods to answer alone", READY_WITHIN, || {
            testbed::probe::expect_backends(
                client,
                testbed::probe::Protocol::Tcp,
                seed_node_port(),
                &["pod-2", "pod-3"],
                ALL_BACKENDS_REQUESTS,
            )
            .map_err(|e| format!("{e:#}"))
        })?;
        note(TEST, format!("in zone-1: {zone_1}; moved to zone-2: {zone_2}"));
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// 3: API server outage and 410.

/// A Service deleted while the agent cannot see it, and one created then.
const DOOMED: (&str, Ipv4Addr, u16) = ("doomed", Ipv4Addr::new(10, 96, 0, 60), 30821);
const LATE: (&str, Ipv4Addr, u16) = ("late", Ipv4Addr::new(10, 96, 0, 61), 30822);
/// ClusterIPs of the Services that make a list longer than one part.
const FIRST_FILLER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 16, 0);

fn apply_service_with_slice(api: &NodeApiServer, (name, ip, np): (&str, Ipv4Addr, u16)) -> Result<()> {
    api.apply(&fixtures::service(name, ip, 80, TARGET_PORT, Some(np)))?;
    api.apply(&slice(&format!("{name}-1"), name, TARGET_PORT, &backend_ips()))
}

fn delete_service_with_slice(api: &NodeApiServer, (name, _, _): (&str, Ipv4Addr, u16)) -> Result<()> {
    api.delete("Service", name)?;
    api.delete("EndpointSlice", &format!("{name}-1"))
}

/// `late` is programmed and `doomed` is gone.
fn caught_up(bed: &mut AgentBed) -> Result<(), String> {
    bed.agent_alive()?;
    answers(&bed.topo.client, node_port(LATE.2))?;
    refused(&bed.topo.client, node_port(DOOMED.2))
}

/// Log lines that contain `needle`.
fn log_lines(log: &str, needle: &str) -> Vec<String> {
    log.lines().filter(|l| l.contains(needle)).map(str::to_owned).collect()
}

/// Starts the API server (seed + `doomed` + `fillers` ClusterIP Services
/// with a slice each) and the agent, waits until the seed and `doomed`
/// answer, and starts a client at 50 requests/s on the seed's NodePort.
fn api_bed_with_load(test: &str, bed: &mut AgentBed, fillers: u32) -> Result<Load> {
    bed.start_api_server()?;
    apply_service_with_slice(bed.api(), DOOMED)?;
    for i in 0..fillers {
        let (name, ip) = (format!("filler-{i}"), Ipv4Addr::from(u32::from(FIRST_FILLER_IP) + i));
        bed.api().apply(&fixtures::service(&name, ip, 80, TARGET_PORT, None))?;
        bed.api()
            .apply(&slice(&format!("{name}-1"), &name, TARGET_PORT, &backend_ips()))?;
    }
    bed.start_agent(&bed.kubeconfig_args())?;
    // Answering is not enough: the uplink answers once the maps are
    // written, while the first sync may still wait for pod interfaces,
    // and the kernel writes metric counts only finished syncs.
    bed.wait_first_sync(READY_WITHIN)?;
    bed.wait_answering(seed_node_port(), READY_WITHIN)?;
    bed.wait_answering(node_port(DOOMED.2), READY_WITHIN)?;
    let load = Load::start(&bed.topo.client, seed_node_port(), 50, Duration::from_secs(3))?;
    note(
        test,
        "agent programmed seed and doomed; client at 50 requests/s on new connections",
    );
    Ok(load)
}

#[test]
fn api_server_outage_keeps_the_data_path_and_relists_after() {
    const TEST: &str = "api_server_outage_keeps_the_data_path_and_relists_after";
    const OUTAGE: Duration = Duration::from_secs(60);
    /// The agent's watchers retry at most 7.5 s apart (5 s plus jitter):
    /// one retry to find the server back, its resume fails with 410, one
    /// more for the relist.
    const RECOVERY: Duration = Duration::from_secs(20);
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        let load = api_bed_with_load(TEST, bed, 0)?;
        let writes_before = bed
            .metrics()?
            .value(h::KERNEL_WRITES)
            .context("no kernel writes metric")?;

        bed.api().stop()?;
        let down = Instant::now();
        note(TEST, format!("API server stopped (load at {:.1?})", load.elapsed()));
        // Changes the agent cannot see until the server is back; the
        // compaction makes its resume fail with 410, so it must relist.
        apply_service_with_slice(bed.api(), LATE)?;
        delete_service_with_slice(bed.api(), DOOMED)?;
        bed.api().server().compact();
        while down.elapsed() < OUTAGE {
            bed.agent_alive().map_err(anyhow::Error::msg)?;
            std::thread::sleep(Duration::from_secs(1));
        }
        // The data path is what it was: doomed still answers, late does not
        // exist, nothing was written, the agent is healthy.
        answers(&bed.topo.client, node_port(DOOMED.2)).map_err(anyhow::Error::msg)?;
        refused(&bed.topo.client, node_port(LATE.2)).map_err(anyhow::Error::msg)?;
        let writes = bed
            .metrics()?
            .value(h::KERNEL_WRITES)
            .context("no kernel writes metric")?;
        ensure!(
            writes == writes_before,
            "kernel writes during the outage: {writes_before} -> {writes}"
        );
        let (code, body) = h::http_get(&bed.topo.node, h::HEALTHZ_ADDR, "/healthz")?;
        ensure!(code == 200, "/healthz during the outage: {code} {body}");
        let failed_watches = log_lines(&bed.log(), "watch failed").len();
        note(
            TEST,
            format!(
                "after {OUTAGE:?} down: data path unchanged, /healthz 200, {failed_watches} failed watch attempts logged"
            ),
        );

        bed.api().restart()?;
        let up = Instant::now();
        let took = time_until("the changes made during the outage programmed", up, RECOVERY, || {
            caught_up(bed)
        })?;
        note(
            TEST,
            format!("API server back: late programmed and doomed removed {took:.1?} after the restart"),
        );
        let log = bed.log();
        let watch_lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("watch failed") || l.contains("listed"))
            .collect();
        let tail = &watch_lines[watch_lines.len().saturating_sub(8)..];
        note(TEST, format!("the agent's last watch events:\n  {}", tail.join("\n  ")));
        // A little more traffic on the caught-up data path, then the verdict.
        let until = load.elapsed() + Duration::from_secs(1);
        while load.elapsed() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        let report = load.stop();
        note(TEST, report.summary());
        report.expect_no_failures()?;
        let lists = (
            bed.api().list_requests(h::SERVICES_PATH),
            bed.api().list_requests(h::SLICES_PATH),
        );
        ensure!(
            lists.0 >= 2 && lists.1 >= 2,
            "no relist after the outage: list requests (services, slices) = {lists:?}"
        );
        Ok(())
    });
}

#[test]
fn expired_watches_relist_without_flushing() {
    const TEST: &str = "expired_watches_relist_without_flushing";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        // More Services than one part of a list (500): the agent takes
        // each (re)list in as parts and a rest.
        let load = api_bed_with_load(TEST, bed, 700)?;
        let listed = log_lines(&bed.log(), "listed kind=\"Service\" objects=");
        ensure!(
            listed.iter().any(|l| l.ends_with("objects=702")),
            "the Services' list should hold 702 objects: {listed:?}"
        );

        // 1. Nothing changed: a 410 and relist must write nothing.
        bed.wait_sync_gap()?;
        let before = bed.metrics()?;
        let writes = before.value(h::KERNEL_WRITES).context("no kernel writes metric")?;
        let changes = before.value(h::SERVICE_CHANGES).context("no service changes metric")?;
        let lists = (
            bed.api().list_requests(h::SERVICES_PATH),
            bed.api().list_requests(h::SLICES_PATH),
        );
        let cut = h::unix_now();
        bed.api().server().compact();
        bed.api().server().drop_watches();
        let relisted = Instant::now();
        netns::wait_for("Services and EndpointSlices relisted", Duration::from_secs(20), || {
            bed.agent_alive()?;
            let now = (
                bed.api().list_requests(h::SERVICES_PATH),
                bed.api().list_requests(h::SLICES_PATH),
            );
            if now.0 > lists.0 && now.1 > lists.1 {
                Ok(())
            } else {
                Err(format!("list requests {now:?}"))
            }
        })?;
        let after = netns::wait_for("a sync after the relist", Duration::from_secs(10), || {
            let m = bed.metrics().map_err(|e| format!("{e:#}"))?;
            match m.value(h::LAST_SYNC) {
                Some(t) if t > cut => Ok(m),
                other => Err(format!("last sync {other:?}, watches cut at {cut:.3}")),
            }
        })?;
        let (writes_after, changes_after) = (after.value(h::KERNEL_WRITES), after.value(h::SERVICE_CHANGES));
        ensure!(
            writes_after == Some(writes) && changes_after == Some(changes),
            "a relist of unchanged objects must write nothing: kernel writes {writes} -> {writes_after:?}, \
             service changes {changes} -> {changes_after:?}"
        );
        note(
            TEST,
            format!(
                "410 + relist of unchanged objects after {:.1?}: 0 kernel writes",
                relisted.elapsed()
            ),
        );

        // 2. Changes made while the watches are down: found by the relist.
        bed.wait_sync_gap()?;
        bed.api().server().compact();
        bed.api().server().drop_watches();
        let changed = Instant::now();
        apply_service_with_slice(bed.api(), LATE)?;
        delete_service_with_slice(bed.api(), DOOMED)?;
        let took = time_until(
            "the changes made while the watches were down programmed",
            changed,
            Duration::from_secs(30),
            || caught_up(bed),
        )?;
        note(
            TEST,
            format!("late programmed and doomed removed {took:.1?} after the watches were cut"),
        );

        let report = load.stop();
        note(TEST, report.summary());
        report.expect_no_failures()?;
        let failed = log_lines(&bed.log(), "watch failed");
        let expired = failed
            .iter()
            .find(|l| l.contains("410") || l.contains("Expired") || l.contains("too old"));
        match expired {
            Some(line) => note(TEST, format!("the agent saw the 410: {line}")),
            None => bail!(
                "the agent's log shows no expired watch (410); its failed watches:\n{}",
                failed.join("\n")
            ),
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// 4: kill -9 and restart.

/// The echo Service for long-lived connections.
const ECHO_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 90);
const ECHO_PORT: u16 = 7;
const ECHO_TARGET_PORT: u16 = 7007;
const ECHO_NODE_PORT: u16 = 30790;

#[test]
fn sigkill_and_restart_keep_traffic_and_adopt_the_maps() {
    const TEST: &str = "sigkill_and_restart_keep_traffic_and_adopt_the_maps";
    const RATE: u32 = 200;
    const CONNECTIONS_PER_SIDE: usize = 25;
    const EXCHANGE_EVERY: Duration = Duration::from_millis(100);
    const WITHOUT_AGENT: Duration = Duration::from_secs(3);
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        for pod in &bed.topo.backends {
            pod.ns.serve_tcp_echo(ECHO_TARGET_PORT)?;
        }
        bed.copy_seed_manifests()?;
        let echo = [
            fixtures::service("echo", ECHO_IP, ECHO_PORT, ECHO_TARGET_PORT, Some(ECHO_NODE_PORT)),
            slice("echo-1", "echo", ECHO_TARGET_PORT, &backend_ips()),
        ];
        bed.write_manifest("echo.yaml", &yaml_documents(&echo))?;
        bed.start_agent(&bed.manifest_args())?;
        bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let before = services_masked(&bed.status()?);
        let shown = frontends(&before);
        // Each a ClusterIP and a node port on both node addresses (the
        // node IP and the pods' gateway).
        ensure!(
            shown.len() == 6,
            "expected the seed's and echo's frontends, status shows:\n{before}"
        );

        let load = Load::start(&bed.topo.client, seed_node_port(), RATE, Duration::from_secs(3))?;
        let from_outside = EchoClients::start(
            &bed.topo.client,
            node_port(ECHO_NODE_PORT),
            CONNECTIONS_PER_SIDE,
            0,
            EXCHANGE_EVERY,
        )?;
        let from_pod = EchoClients::start(
            &bed.topo.client_pod.ns,
            SocketAddrV4::new(ECHO_IP, ECHO_PORT),
            CONNECTIONS_PER_SIDE,
            CONNECTIONS_PER_SIDE,
            EXCHANGE_EVERY,
        )?;
        note(
            TEST,
            format!(
                "load at {RATE}/s, {} long-lived connections open",
                2 * CONNECTIONS_PER_SIDE
            ),
        );
        let until = load.elapsed() + Duration::from_secs(1);
        while load.elapsed() < until {
            std::thread::sleep(Duration::from_millis(20));
        }

        let killed_at = load.elapsed();
        let status = bed.stop_agent(libc::SIGKILL)?;
        ensure!(
            status.signal() == Some(libc::SIGKILL),
            "the agent ended with {status}, not by SIGKILL"
        );
        note(TEST, format!("agent killed (-9) at {killed_at:.2?} into the load"));
        while load.elapsed() < killed_at + WITHOUT_AGENT {
            std::thread::sleep(Duration::from_millis(20));
        }
        let restarted_at = load.elapsed();
        bed.start_agent(&bed.manifest_args())?;
        let first = bed.wait_first_sync(READY_WITHIN)?;
        let synced_at = load.elapsed();
        let writes = first.value(h::KERNEL_WRITES);
        note(
            TEST,
            format!("restarted at {restarted_at:.2?}, first sync by {synced_at:.2?}: kernel writes {writes:?}"),
        );
        ensure!(
            writes == Some(0.0),
            "the restarted agent wrote to the kernel in its first sync: {writes:?}"
        );

        let until = load.elapsed() + Duration::from_secs(2);
        while load.elapsed() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        let later = bed.metrics()?.value(h::KERNEL_WRITES);
        ensure!(
            later == Some(0.0),
            "the restarted agent wrote to the kernel later: {later:?}"
        );

        let outside = from_outside.stop();
        let inside = from_pod.stop();
        let report = load.stop();
        note(TEST, report.summary());
        let without_agent = report
            .outcomes
            .iter()
            .filter(|o| o.at >= killed_at && o.at < restarted_at)
            .count();
        note(TEST, format!("{without_agent} requests while no agent ran"));
        report.expect_no_failures()?;
        ensure!(
            without_agent >= 100,
            "only {without_agent} requests were sent while no agent ran"
        );

        let echo: Vec<_> = outside.iter().chain(&inside).collect();
        let broken: Vec<String> = echo
            .iter()
            .filter_map(|o| {
                o.error.as_ref().map(|(at, e)| {
                    format!(
                        "connection {} to {} failed at {at:.2?} after {} exchanges: {e}",
                        o.id, o.target, o.exchanges
                    )
                })
            })
            .collect();
        let fewest = echo.iter().map(|o| o.exchanges).min().unwrap_or(0);
        let total: u64 = echo.iter().map(|o| o.exchanges).sum();
        note(
            TEST,
            format!(
                "{} long-lived connections: {total} exchanges, at least {fewest} each",
                echo.len()
            ),
        );
        ensure!(
            broken.is_empty(),
            "long-lived connections broke:\n  {}",
            broken.join("\n  ")
        );
        ensure!(fewest >= 20, "a long-lived connection exchanged only {fewest} messages");

        let after = services_masked(&bed.status()?);
        ensure!(
            after == before,
            "`xproxy status` changed across the restart:\nbefore:\n{before}after:\n{after}"
        );
        let log = bed.log();
        ensure!(
            log.contains("adopted=2"),
            "the restarted agent did not report adopting both Service ports; its log:\n{log}"
        );
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// 5: bad input.

/// kubectl's shapes: the seed as `kubectl get svc,endpointslices -o json`
/// writes it (a `v1` `List`) is served; a file that is not YAML is an
/// ERROR naming it and a skipped object in the metrics.
#[test]
fn a_kubectl_list_is_served_and_a_broken_file_is_an_error() {
    const TEST: &str = "a_kubectl_list_is_served_and_a_broken_file_is_an_error";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        let list = json!({"apiVersion": "v1", "kind": "List", "items": fixtures::seed_objects(), "metadata": {}});
        bed.write_manifest("seed.json", &list.to_string())?;
        bed.write_manifest("broken.yaml", BROKEN_YAML)?;
        bed.start_agent(&bed.manifest_args())?;
        bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let seen = bed.expect_all_backends(&bed.topo.client, seed_node_port(), ALL_BACKENDS_REQUESTS)?;
        note(TEST, format!("the List's seed answers from every backend: {seen}"));
        let errors = log_lines(&bed.log(), "manifest file not used");
        ensure!(
            errors.iter().any(|l| l.contains("ERROR") && l.contains("broken.yaml")),
            "no ERROR naming broken.yaml: {errors:#?}"
        );
        let skipped = bed.metrics()?.value(h::SKIPPED);
        ensure!(skipped >= Some(1.0), "{} = {skipped:?}", h::SKIPPED);
        Ok(())
    });
}

const BROKEN_YAML: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: broken\n spec: [unclosed\n";

fn bad_objects() -> Vec<Value> {
    let mut port_zero = fixtures::service("port-zero", Ipv4Addr::new(10, 96, 0, 50), 80, 80, None);
    port_zero["spec"]["ports"][0]["port"] = json!(0);
    let mut port_too_big = fixtures::service("port-too-big", Ipv4Addr::new(10, 96, 0, 51), 80, 80, None);
    port_too_big["spec"]["ports"][0]["port"] = json!(70000);
    let mut dup_ports = fixtures::service("dup-ports", Ipv4Addr::new(10, 96, 0, 52), 80, 80, None);
    dup_ports["spec"]["ports"] = json!([
        {"name": "a", "port": 80, "targetPort": 80, "protocol": "TCP"},
        {"name": "b", "port": 80, "targetPort": 81, "protocol": "TCP"},
    ]);
    let mut bad_ip = fixtures::service("bad-cluster-ip", Ipv4Addr::new(10, 96, 0, 53), 80, 80, None);
    bad_ip["spec"]["clusterIP"] = json!("10.96.0.300");
    let bad_slice_service = fixtures::service("bad-slice", Ipv4Addr::new(10, 96, 0, 54), 80, TARGET_PORT, None);
    let mut bad_slice = slice("bad-slice-1", "bad-slice", TARGET_PORT, &backend_ips()[..1]);
    bad_slice["endpoints"]
        .as_array_mut()
        .expect("endpoints is a list")
        .push(json!({"addresses": ["10.244.0.999"], "conditions": {"ready": true}}));
    vec![port_zero, port_too_big, dup_ports, bad_ip, bad_slice_service, bad_slice]
}

#[test]
fn bad_input_is_skipped_and_the_seed_keeps_working() {
    const TEST: &str = "bad_input_is_skipped_and_the_seed_keeps_working";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.copy_seed_manifests()?;
        bed.write_manifest("broken.yaml", BROKEN_YAML)?;
        bed.write_manifest("bad.yaml", &yaml_documents(&bad_objects()))?;
        bed.start_agent(&bed.manifest_args())?;
        bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let seen = bed.expect_all_backends(&bed.topo.client, seed_node_port(), ALL_BACKENDS_REQUESTS)?;
        note(TEST, format!("seed answers from every backend: {seen}"));

        // Each bad object is named in a "skipped" warning.
        let named = [
            "broken.yaml",
            "Service default/port-zero",
            "Service default/port-too-big",
            "Service default/dup-ports",
            "Service default/bad-cluster-ip",
            "EndpointSlice default/bad-slice-1",
        ];
        let skipped = netns::wait_for(
            "every bad object in a \"skipped\" warning",
            Duration::from_secs(10),
            || {
                bed.agent_alive()?;
                let lines = log_lines(&bed.log(), "skipped object=");
                let missing: Vec<_> = named.iter().filter(|n| !lines.iter().any(|l| l.contains(*n))).collect();
                if missing.is_empty() {
                    Ok(lines)
                } else {
                    Err(format!("not named: {missing:?}; \"skipped\" lines: {lines:#?}"))
                }
            },
        )?;
        note(TEST, format!("skipped warnings:\n  {}", skipped.join("\n  ")));
        let count = bed.metrics()?.value(h::SKIPPED);
        ensure!(
            count.is_some_and(|n| n >= named.len() as f64),
            "{} = {count:?}",
            h::SKIPPED
        );

        // The good parts of the bad objects are programmed, the rest is not.
        let status = bed.status()?;
        let shown = frontends(&status);
        let expect = [
            ("TCP 10.96.0.52:80", Some(0)), // dup-ports: the first port, no endpoints
            ("TCP 10.96.0.54:80", Some(1)), // bad-slice: its one valid address
            ("TCP 10.96.0.50:0", None),
            ("TCP 10.96.0.51:80", None),
        ];
        for (frontend, backends) in expect {
            let got = shown.get(frontend).map(|(_, n)| *n);
            ensure!(
                got == backends,
                "{frontend}: expected {backends:?} backends, status has {got:?}:\n{status}"
            );
        }
        ensure!(
            !status.contains("10.96.0.300") && !status.contains("10.96.0.51"),
            "skipped Services are in the data path:\n{status}"
        );
        bed.agent_alive().map_err(anyhow::Error::msg)?;
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// 6: health, metrics and status.

/// What `xproxy status` shows of the seed (the mode found on its own):
/// the node port on every address of the node, the pods' gateway too
/// (kube-proxy's `addrtype LOCAL`).
const SEED_STATUS: &str = "\
Mode: ebpf
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  10.96.0.88:88 ClusterIP
  -> 10.244.0.11:80               *
  -> 10.244.0.12:80               *
  -> 10.244.0.13:80               *
TCP  10.244.0.1:30791 NodePort
  -> 10.244.0.11:80               *
  -> 10.244.0.12:80               *
  -> 10.244.0.13:80               *
TCP  172.30.0.2:30791 NodePort
  -> 10.244.0.11:80               *
  -> 10.244.0.12:80               *
  -> 10.244.0.13:80               *
";

#[test]
fn health_metrics_and_status_of_a_running_agent() {
    const TEST: &str = "health_metrics_and_status_of_a_running_agent";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.copy_seed_manifests()?;
        bed.start_agent(&bed.manifest_args())?;
        bed.wait_first_sync(READY_WITHIN)?;
        for path in ["/healthz", "/livez"] {
            let (code, body) = h::http_get(&bed.topo.node, h::HEALTHZ_ADDR, path)?;
            ensure!(code == 200, "{path} after the first sync: {code} {body}");
            let json: Value = serde_json::from_str(&body).with_context(|| format!("{path} body {body:?}"))?;
            ensure!(
                json["lastUpdated"].is_string() && json["currentTime"].is_string(),
                "{path} body {body}"
            );
            note(TEST, format!("{path}: 200 {body}"));
        }
        let (code, mode) = h::http_get(&bed.topo.node, h::METRICS_ADDR, "/proxyMode")?;
        ensure!(code == 200 && mode == "ebpf", "/proxyMode: {code} {mode:?}");

        bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let outside = bed.expect_all_backends(&bed.topo.client, seed_node_port(), ALL_BACKENDS_REQUESTS)?;
        let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
        let inside = bed.expect_all_backends(&bed.topo.client_pod.ns, cluster_ip, ALL_BACKENDS_REQUESTS)?;
        note(
            TEST,
            format!("NodePort from the client: {outside}; ClusterIP from a pod: {inside}"),
        );

        let metrics = bed.metrics()?;
        let now = h::unix_now();
        let value = |name: &str| metrics.value(name).with_context(|| format!("/metrics lacks {name}"));
        let last_sync = value(h::LAST_SYNC)?;
        ensure!(
            last_sync > now - 600.0 && last_sync <= now + 1.0,
            "{} = {last_sync} (now {now})",
            h::LAST_SYNC
        );
        let changes = value(h::SERVICE_CHANGES)?;
        ensure!(changes >= 1.0, "{} = {changes}", h::SERVICE_CHANGES);
        let skipped = value(h::SKIPPED)?;
        ensure!(skipped == 0.0, "{} = {skipped} for the valid seed", h::SKIPPED);
        let writes = value(h::KERNEL_WRITES)?;
        ensure!(
            writes > 0.0,
            "{} = {writes} after programming a fresh data path",
            h::KERNEL_WRITES
        );
        let dnat_new = metrics.labeled(h::DATAPATH_PACKETS, "verdict=\"dnat_new\"");
        ensure!(
            // Each new connection's SYN is a new flow (half of them, in
            // case a source port is reused while its flow is still tracked).
            dnat_new.is_some_and(|n| n >= ALL_BACKENDS_REQUESTS as f64),
            "{}{{verdict=\"dnat_new\"}} = {dnat_new:?} after {} new connections",
            h::DATAPATH_PACKETS,
            2 * ALL_BACKENDS_REQUESTS
        );
        ensure!(
            metrics.labeled("xproxy_info", "mode=\"ebpf\"") == Some(1.0),
            "xproxy_info{{mode=\"ebpf\"}} is not 1"
        );
        // Everything is programmed and the seed has no Local policy.
        for (family, labels) in [
            ("kubeproxy_sync_proxy_rules_service_changes_pending", ""),
            ("kubeproxy_sync_proxy_rules_endpoint_changes_pending", ""),
            (
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                "traffic_policy=\"external\"",
            ),
            (
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                "traffic_policy=\"internal\"",
            ),
        ] {
            let value = if labels.is_empty() {
                metrics.value(family)
            } else {
                metrics.labeled(family, labels)
            };
            ensure!(value == Some(0.0), "{family}{{{labels}}} = {value:?}, not 0");
        }
        ensure!(metrics.has("process_resident_memory_bytes"), "no process_* metrics");
        for family in [
            "kubeproxy_sync_proxy_rules_duration_seconds_count",
            // The manifests carry no trigger times, so only xproxy's own
            // latency (from arrival) has samples.
            "xproxy_change_programming_duration_seconds_count",
        ] {
            ensure!(
                metrics.value(family).is_some_and(|n| n >= 1.0),
                "{family} = {:?}",
                metrics.value(family)
            );
        }
        note(
            TEST,
            format!(
                "metrics: last sync {last_sync:.3}, service changes {changes}, skipped {skipped}, kernel writes {writes}, dnat_new {dnat_new:?}"
            ),
        );

        let status = bed.status()?;
        let services = services_masked(&status);
        ensure!(
            services == SEED_STATUS,
            "`xproxy status` services (flows masked):\n{services}expected:\n{SEED_STATUS}"
        );
        ensure!(
            status.contains("Tracked flows:") && status.contains("dnat_new"),
            "`xproxy status`:\n{status}"
        );
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// 7: command-line errors.

/// Runs `xproxy ARGS` in `ns` and checks its exit code and that its output
/// mentions every one of `mentions`.
fn expect_exit(
    xproxy: &std::path::Path,
    ns: &Netns,
    scratch: &TempDir,
    args: &[&str],
    code: i32,
    mentions: &[&str],
    within: Duration,
) -> Result<String> {
    let exit = h::run_xproxy(xproxy, ns, args, scratch.path(), within)?;
    let shown = format!(
        "xproxy {} exited with {:?} after {:.1?}: {}",
        args.join(" "),
        exit.code,
        exit.took,
        exit.stderr.trim()
    );
    ensure!(exit.code == Some(code), "expected exit code {code}: {shown}");
    for needle in mentions {
        ensure!(
            exit.stderr.contains(needle),
            "the output does not mention {needle:?}: {shown}"
        );
    }
    Ok(shown)
}

#[test]
fn cli_errors_exit_with_their_codes() {
    const TEST: &str = "cli_errors_exit_with_their_codes";
    if !require_root(TEST) {
        return;
    }
    let xproxy = h::xproxy_binary();
    let scratch = TempDir::new("cli").expect("scratch directory");
    let ns = Netns::new("xq").expect("a namespace to run in");
    let manifests = scratch.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("manifest directory");
    let manifests = manifests.to_str().expect("utf-8 path");
    let config = scratch.path().join("proxy.yaml");
    std::fs::write(
        &config,
        "kind: KubeProxyConfiguration\napiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
         metricsBindAddress: not-an-address\nipvs:\n  scheduler: fastest\n",
    )
    .expect("config file");
    let config = config.to_str().expect("utf-8 path");
    let pins = PinDir::new();
    let pin_path = pins.path().to_str().expect("utf-8 path");
    let quick = Duration::from_secs(20);
    let cases: [(&str, Vec<&str>, i32, Vec<&str>); 4] = [
        (
            "bad config file",
            vec![
                "run",
                "--config",
                config,
                "--manifests",
                manifests,
                "--pin-path",
                pin_path,
            ],
            2,
            vec!["metricsBindAddress", "ipvs.scheduler", "fastest"],
        ),
        (
            "unknown mode",
            vec![
                "run",
                "--mode",
                "bogus",
                "--manifests",
                manifests,
                "--pin-path",
                pin_path,
            ],
            2,
            vec!["bogus", "--mode"],
        ),
        (
            // A mode this kernel cannot offer: IPVS where it has none (every
            // mode is built now); left out below on a kernel with IPVS.
            "mode not available",
            vec![
                "run",
                "--mode",
                "ipvs",
                "--manifests",
                manifests,
                "--pin-path",
                pin_path,
            ],
            6,
            vec!["IPVS"],
        ),
        (
            "missing interface",
            vec![
                "run",
                "--interface",
                "nope",
                "--manifests",
                manifests,
                "--pin-path",
                pin_path,
            ],
            5,
            vec!["nope"],
        ),
    ];
    let mut failures = Vec::new();
    for (what, args, code, mentions) in cases {
        if what == "mode not available" && std::path::Path::new("/proc/net/ip_vs").exists() {
            note(TEST, format!("{what}: skipped, this kernel has IPVS"));
            continue;
        }
        match expect_exit(&xproxy, &ns, &scratch, &args, code, &mentions, quick) {
            Ok(shown) => note(TEST, format!("{what}: {shown}")),
            Err(e) => failures.push(format!("{what}: {e:#}")),
        }
    }
    // Whatever the failed start pinned goes with the pin directory; run in
    // the namespace, so nothing of the host's is looked at.
    let _ = h::run_xproxy(
        &xproxy,
        &ns,
        &["cleanup", "--pin-path", pin_path],
        scratch.path(),
        quick,
    );
    assert!(failures.is_empty(), "{TEST}:\n  {}", failures.join("\n  "));
}

/// A node that boots before its control plane: the agent neither exits
/// nor crash-loops while the API server is down; it stays up with
/// `/healthz` 503 (not synced yet) and `/livez` 200, logs that it waits,
/// and syncs as soon as the API server answers.
#[test]
fn agent_waits_for_an_api_server_that_is_down_at_start() {
    const TEST: &str = "agent_waits_for_an_api_server_that_is_down_at_start";
    /// Longer than the 10 s after which the agent used to give up.
    const DOWN: Duration = Duration::from_secs(15);
    /// The first sync's last steps after its maps answer take milliseconds.
    const FIRST_SYNC_ENDS_WITHIN: Duration = Duration::from_secs(5);
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.start_api_server()?;
        bed.api().stop()?;
        bed.start_agent(&bed.kubeconfig_args())?;
        std::thread::sleep(DOWN);
        bed.agent_alive()
            .map_err(|e| anyhow::anyhow!("the agent gave up on the API server: {e}"))?;
        let (healthz, _) = h::http_get(&bed.topo.node, h::HEALTHZ_ADDR, "/healthz")?;
        let (livez, _) = h::http_get(&bed.topo.node, h::HEALTHZ_ADDR, "/livez")?;
        ensure!(
            (healthz, livez) == (503, 200),
            "before the first sync /healthz and /livez must be 503 and 200, not {healthz} and {livez}"
        );
        let waiting = log_lines(&bed.log(), "waiting for it");
        ensure!(
            !waiting.is_empty(),
            "the log does not say the agent waits for the API server"
        );
        refused(&bed.topo.client, seed_node_port())
            .map_err(|e| anyhow::anyhow!("nothing is programmed yet, but: {e}"))?;

        bed.api().restart()?;
        let took = bed.wait_answering(seed_node_port(), Duration::from_secs(45))?;
        // The maps answer while the first sync is still finishing (stale
        // conntrack entries, the report); /healthz turns 200 when it is done.
        netns::wait_for(
            "/healthz 200 after the first sync",
            FIRST_SYNC_ENDS_WITHIN,
            || match h::http_get(&bed.topo.node, h::HEALTHZ_ADDR, "/healthz") {
                Ok((200, _)) => Ok(()),
                Ok((status, body)) => Err(format!("{status} {body}")),
                Err(e) => Err(format!("{e:#}")),
            },
        )?;
        note(
            TEST,
            format!(
                "{DOWN:?} down at start: alive, /healthz 503, {} waiting lines; programmed {took:?} after the API server came up",
                waiting.len()
            ),
        );
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// kube-proxy's flags: logging, OOM score, conntrack sysctls, `--cleanup`.

/// The value of a sysctl file as seen from inside `ns`.
fn sysctl_in(ns: &Netns, name: &str) -> Result<u64> {
    let text = ns.exec(&["cat", &format!("/proc/sys/net/netfilter/{name}")])?;
    text.trim().parse().with_context(|| format!("{name} = {text:?}"))
}

/// The agent started with kube-proxy's flags logs JSON at debug level,
/// holds the OOM score it was given, sets the conntrack timeouts in its
/// network namespace (and cannot change `nf_conntrack_max` there: only the
/// initial namespace may, so the host's table is left alone and the agent
/// says so), and `run --cleanup` removes the rules like `kube-proxy
/// --cleanup`.
#[test]
fn kube_proxy_flags_set_logging_oom_score_and_conntrack() {
    const TEST: &str = "kube_proxy_flags_set_logging_oom_score_and_conntrack";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.copy_seed_manifests()?;
        // The conntrack sysctls exist once the module is loaded (the agent
        // sets them before its first rule would load it).
        if !std::path::Path::new("/proc/sys/net/netfilter/nf_conntrack_max").exists() {
            let modprobe = std::process::Command::new("modprobe").arg("nf_conntrack").status()?;
            ensure!(modprobe.success(), "modprobe nf_conntrack: {modprobe}");
        }
        let host_max = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max")?;
        let mut args = bed.manifest_args();
        args.extend(
            [
                "--v=4",
                "--logging-format=json",
                "--oom-score-adj=500",
                "--conntrack-tcp-timeout-established=2h",
                "--conntrack-udp-timeout=45s",
                "--conntrack-tcp-be-liberal",
            ]
            .map(str::to_owned),
        );
        bed.start_agent_in("iptables", &args)?;
        bed.wait_first_sync(READY_WITHIN)?;
        bed.wait_answering(seed_node_port(), READY_WITHIN)?;

        let pid = bed.agent_pid().context("no agent pid")?;
        let oom = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))?;
        ensure!(oom.trim() == "500", "oom_score_adj is {oom:?}");
        let node = &bed.topo.node;
        let set = (
            sysctl_in(node, "nf_conntrack_tcp_timeout_established")?,
            sysctl_in(node, "nf_conntrack_udp_timeout")?,
            sysctl_in(node, "nf_conntrack_tcp_be_liberal")?,
        );
        ensure!(set == (7200, 45, 1), "conntrack sysctls in the node namespace: {set:?}");
        let host_after = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max")?;
        ensure!(host_max == host_after, "the host's nf_conntrack_max changed");

        let log = bed.log();
        let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
        let parsed: Vec<Value> = lines.iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
        ensure!(
            !parsed.is_empty() && parsed.len() == lines.len(),
            "{} of {} log lines are JSON",
            parsed.len(),
            lines.len()
        );
        let level_of = |v: &Value| v.get("level").and_then(Value::as_str).unwrap_or("").to_owned();
        ensure!(
            parsed.iter().any(|v| level_of(v) == "DEBUG"),
            "--v=4 logs no debug line"
        );
        ensure!(
            parsed
                .iter()
                .any(|v| level_of(v) == "WARN" && v.to_string().contains("nf_conntrack_max")),
            "no warning that nf_conntrack_max could not be set in the namespace"
        );

        bed.stop_agent(libc::SIGTERM)?;
        ensure!(kube_chains(bed)?, "the iptables mode's chains went with SIGTERM");
        let pins = bed.pin_path().display().to_string();
        let xproxy = bed.xproxy().to_owned();
        let exit = h::run_xproxy(
            &xproxy,
            &bed.topo.node,
            &["run", "--cleanup", "--pin-path", &pins],
            bed.dir(),
            Duration::from_secs(30),
        )?;
        ensure!(exit.code == Some(0), "xproxy run --cleanup: {}", exit.stderr);
        ensure!(!kube_chains(bed)?, "xproxy run --cleanup left KUBE-* chains");
        note(
            TEST,
            format!("{} JSON log lines; timeouts {set:?}; cleanup ok", parsed.len()),
        );
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// `--xdp`: XDP on the uplink or tc only.

/// Whether native XDP is on the test bed's uplink.
fn uplink_has_xdp(bed: &AgentBed) -> Result<bool> {
    let link = bed.topo.node.ip(&["-d", "link", "show", "dev", &bed.topo.uplink])?;
    Ok(link.contains("prog/xdp id"))
}

/// `--xdp native` puts the uplink's program at XDP; a restart with the
/// default (`auto`, which on a veth uplink means tc only) takes it off
/// again, and NodePort and ClusterIP traffic is translated either way.
#[test]
fn xdp_policy_native_then_auto_on_a_veth_uplink() {
    const TEST: &str = "xdp_policy_native_then_auto_on_a_veth_uplink";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.copy_seed_manifests()?;
        let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
        for (policy, xdp) in [("native", true), ("auto", false)] {
            let mut args = bed.manifest_args();
            args.extend(["--xdp".to_owned(), policy.to_owned()]);
            bed.start_agent(&args)?;
            bed.wait_first_sync(READY_WITHIN)?;
            bed.wait_answering(seed_node_port(), READY_WITHIN)?;
            ensure!(
                uplink_has_xdp(bed)? == xdp,
                "--xdp {policy}: XDP on the uplink should be {xdp}"
            );
            for (from, addr) in [
                (&bed.topo.client, seed_node_port()),
                (&bed.topo.client_pod.ns, cluster_ip),
            ] {
                let seen = bed.expect_all_backends(from, addr, ALL_BACKENDS_REQUESTS)?;
                note(TEST, format!("--xdp {policy}: {addr}: {seen}"));
            }
            let status = bed.stop_agent(libc::SIGTERM)?;
            ensure!(status.success(), "the agent exited with {status}");
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// `xproxy cleanup`: only what it is asked to remove.

/// Plain `xproxy cleanup` removes what carries xproxy's own names (the SNAT
/// chain, the nftables table) and leaves the KUBE-* chains, which a running
/// kube-proxy (or this agent's iptables, IPVS and userspace modes) owns;
/// `--scope kube-proxy` removes those and nothing of xproxy's own.
#[test]
fn cleanup_leaves_kube_proxy_names_unless_asked() {
    const TEST: &str = "cleanup_leaves_kube_proxy_names_unless_asked";
    if !require_root(TEST) {
        return;
    }
    let xproxy = h::xproxy_binary();
    let scratch = TempDir::new("cleanup").expect("scratch directory");
    let pins = PinDir::new();
    let pin_path = pins.path().display().to_string();
    let ns = Netns::new("xcl").expect("a namespace");
    for args in [
        ["iptables", "-t", "nat", "-N", "KUBE-SERVICES"].as_slice(),
        &["iptables", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES"],
        &["iptables", "-t", "nat", "-N", "XPROXY-SNAT"],
        &["iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "XPROXY-SNAT"],
        &["nft", "add", "table", "ip", "xproxy"],
    ] {
        ns.exec(args).unwrap_or_else(|e| panic!("{TEST}: {args:?}: {e:#}"));
    }
    let cleanup = |extra: &[&str]| {
        let args: Vec<&str> = ["cleanup", "--pin-path", &pin_path]
            .iter()
            .chain(extra)
            .copied()
            .collect();
        let exit = h::run_xproxy(&xproxy, &ns, &args, scratch.path(), Duration::from_secs(30)).expect("xproxy cleanup");
        assert_eq!(exit.code, Some(0), "{TEST}: xproxy {args:?}:\n{}", exit.stderr);
        exit.stderr
    };
    let nat_chains = || ns.exec(&["iptables-save", "-t", "nat"]).expect("iptables-save");
    let nft_tables = || ns.exec(&["nft", "list", "tables"]).expect("nft list tables");

    let said = cleanup(&[]);
    let (nat, tables) = (nat_chains(), nft_tables());
    assert!(!nat.contains("XPROXY-SNAT"), "{TEST}: the SNAT chain stayed:\n{nat}");
    assert!(
        !tables.contains("xproxy"),
        "{TEST}: the nftables table stayed:\n{tables}"
    );
    assert!(
        nat.contains(":KUBE-SERVICES") && nat.contains("-A PREROUTING -j KUBE-SERVICES"),
        "{TEST}: plain cleanup removed kube-proxy's chain:\n{nat}"
    );
    assert!(
        said.contains("--scope kube-proxy"),
        "{TEST}: the log does not say how to remove the rest:\n{said}"
    );

    // xproxy's own table again: the kube-proxy scope must leave it.
    ns.exec(&["nft", "add", "table", "ip", "xproxy"])
        .expect("nft add table");
    cleanup(&["--scope", "kube-proxy"]);
    let tables = nft_tables();
    assert!(
        tables.contains("xproxy"),
        "{TEST}: --scope kube-proxy removed xproxy's table"
    );
    let nat = nat_chains();
    assert!(
        !nat.contains("KUBE-SERVICES"),
        "{TEST}: --scope kube-proxy left kube-proxy's chain:\n{nat}"
    );
    note(TEST, "plain cleanup kept KUBE-SERVICES; --scope kube-proxy removed it");
}

// ---------------------------------------------------------------------------
// The README's migration runbook, with traffic flowing.

/// From kube-proxy to the ebpf mode and back, as the README's runbook says,
/// with a client at 50 requests/s on new connections through the seed's
/// NodePort from outside and a pod at 50/s through its ClusterIP. The
/// iptables mode stands in for kube-proxy (the same KUBE-* layout):
///
/// 1. kube-proxy runs; its pod is deleted (SIGTERM: its rules stay);
/// 2. xproxy starts in the ebpf mode over them (its programs see Service
///    traffic before netfilter does);
/// 3. `xproxy cleanup --scope kube-proxy` removes kube-proxy's rules, and
///    the ebpf data path serves on;
/// 4. back: kube-proxy starts again, xproxy stops, and
///    `xproxy cleanup --scope own` removes the ebpf data path.
///
/// A request may fail when it is in flight at a hand-over (a connection one
/// data path translated, continued by the other, picks a backend afresh
/// and is reset; a SYN lost while programs attach times out): at most one
/// per client and hand-over, 8 of ~800. Seen: 2 to 4, at the switch to
/// the ebpf mode and at the ebpf mode's removal.
#[test]
fn migration_from_kube_proxy_to_ebpf_and_back_under_load() {
    const TEST: &str = "migration_from_kube_proxy_to_ebpf_and_back_under_load";
    /// Requests that may fail: one per client and hand-over.
    const TOLERATED: usize = 2 * 4;
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
        bed.start_api_server()?;
        bed.start_agent_in("iptables", &bed.kubeconfig_args())?;
        bed.wait_answering(seed_node_port(), READY_WITHIN)?;
        let from_outside = Load::start(&bed.topo.client, seed_node_port(), 50, Duration::from_secs(3))?;
        let from_pod = Load::start(&bed.topo.client_pod.ns, cluster_ip, 50, Duration::from_secs(3))?;
        let settle = || std::thread::sleep(Duration::from_secs(2));
        settle();

        bed.stop_agent(libc::SIGTERM)?;
        ensure!(kube_chains(bed)?, "kube-proxy's rules must outlive its process");
        bed.start_agent_in("ebpf", &bed.kubeconfig_args())?;
        bed.wait_first_sync(READY_WITHIN)?;
        settle();
        let said = bed.cleanup_scope("kube-proxy")?;
        ensure!(
            !kube_chains(bed)?,
            "cleanup --scope kube-proxy left KUBE-* chains:\n{said}"
        );
        settle();
        let status = bed.status()?;
        ensure!(
            !frontends(&status).is_empty(),
            "the ebpf data path went with kube-proxy's rules:\n{status}"
        );
        note(TEST, "the ebpf mode serves alone");

        bed.stop_agent(libc::SIGTERM)?;
        bed.start_agent_in("iptables", &bed.kubeconfig_args())?;
        bed.wait_first_sync(READY_WITHIN)?;
        bed.cleanup_scope("own")?;
        ensure!(kube_chains(bed)?, "cleanup --scope own removed kube-proxy's rules");
        settle();

        let reports = [from_outside.stop(), from_pod.stop()];
        let failed: Vec<String> = reports
            .iter()
            .flat_map(|r| {
                r.failures()
                    .into_iter()
                    .map(move |o| format!("{} at {:?}: {:?}", r.target, o.at, o.result))
            })
            .collect();
        for report in &reports {
            note(TEST, report.summary());
        }
        ensure!(
            reports.iter().all(|r| r.outcomes.len() > 200),
            "too few requests were made to judge: {:?}",
            reports.iter().map(|r| r.outcomes.len()).collect::<Vec<_>>()
        );
        ensure!(
            failed.len() <= TOLERATED,
            "{} requests failed across the hand-overs:\n  {}",
            failed.len(),
            failed.join("\n  ")
        );
        note(
            TEST,
            format!("{} requests failed across four hand-overs: {failed:?}", failed.len()),
        );
        Ok(())
    });
}

/// Whether the node has kube-proxy's KUBE-SERVICES chain.
fn kube_chains(bed: &AgentBed) -> Result<bool> {
    Ok(bed
        .topo
        .node
        .exec(&["iptables-save", "-t", "nat"])?
        .contains(":KUBE-SERVICES"))
}

// ---------------------------------------------------------------------------
// `--xdp auto` on an uplink whose driver has no native XDP.

/// A bridge as the uplink (its driver has no native XDP, like many virtual
/// NICs): under the default `--xdp auto` the agent attaches the uplink's
/// programs at tc with a warning and syncs, instead of failing to start.
#[test]
fn xdp_auto_falls_back_to_tc_where_native_xdp_is_refused() {
    const TEST: &str = "xdp_auto_falls_back_to_tc_where_native_xdp_is_refused";
    if !require_root(TEST) {
        return;
    }
    let scratch = TempDir::new("xdpfallback").expect("scratch directory");
    let ns = Netns::new("xxf").expect("a namespace");
    let manifests = scratch.path().join("manifests");
    std::fs::create_dir_all(&manifests).expect("manifest directory");
    for args in [
        ["link", "add", "br0", "type", "bridge"].as_slice(),
        &["link", "set", "br0", "up"],
        &["addr", "add", &format!("{NODE_IP}/24"), "dev", "br0"],
    ] {
        ns.ip(args).unwrap_or_else(|e| panic!("{TEST}: ip {args:?}: {e:#}"));
    }
    let mut agent = h::NodeAgent::new(format!("[{TEST}]"), h::xproxy_binary(), scratch.path());
    let mut args = vec!["--manifests".to_owned(), manifests.display().to_string()];
    args.extend(h::node_args("ebpf", NODE_IP, fixtures::NODE_NAME));
    agent.start(&ns, &args, "agent.log").expect("starting the agent");
    let synced = agent.wait_first_sync(&ns, "the first sync", READY_WITHIN);
    let log = agent.log();
    assert!(synced.is_ok(), "{TEST}: no first sync ({synced:?}):\n{log}");
    assert!(
        !log_lines(&log, "falling back to tc").is_empty(),
        "{TEST}: no warning about the fallback:\n{log}"
    );
    let link = ns.ip(&["-d", "link", "show", "br0"]).expect("ip link show");
    assert!(!link.contains("prog/xdp"), "{TEST}: XDP on the bridge:\n{link}");
    assert!(
        log.lines()
            .any(|l| l.contains("attached") && l.contains("br0") && l.contains("UplinkTc")),
        "{TEST}: the uplink's programs are not attached at tc:\n{log}"
    );
    note(TEST, "bridge uplink: native XDP refused, tc attached, synced");
}

// ---------------------------------------------------------------------------
// Pod interfaces are rescanned on every full sync.

/// Starts the agent on the seed manifests with a config whose syncPeriod
/// (the ebpf mode reads the iptables section's, as kube-proxy's own modes
/// do) is `period`: how often a full sync runs.
fn start_with_sync_period(bed: &mut AgentBed, period: Duration) -> Result<()> {
    let config = bed.dir().join("proxy.yaml");
    std::fs::write(
        &config,
        format!(
            "kind: KubeProxyConfiguration\napiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
             iptables:\n  syncPeriod: {}s\n",
            period.as_secs()
        ),
    )?;
    bed.copy_seed_manifests()?;
    let mut args = bed.manifest_args();
    args.extend(["--config".to_owned(), config.display().to_string()]);
    bed.start_agent(&args)?;
    bed.wait_first_sync(READY_WITHIN).map(drop)
}

/// A pod interface whose link event the agent missed (simulated: its tc
/// links are detached and unpinned by hand while the agent runs) gets its
/// programs back at the next full sync, and the pod reaches the ClusterIP
/// again.
#[test]
fn a_pod_interface_without_programs_is_attached_by_the_next_full_sync() {
    const TEST: &str = "a_pod_interface_without_programs_is_attached_by_the_next_full_sync";
    /// The config's syncPeriod (the ebpf mode reads the iptables
    /// section's, as kube-proxy's own modes do): how often a full sync runs.
    const SYNC_PERIOD: Duration = Duration::from_secs(2);
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        start_with_sync_period(bed, SYNC_PERIOD)?;
        let cluster_ip = SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT);
        let pod = &bed.topo.client_pod;
        answers(&pod.ns, cluster_ip).map_err(|e| anyhow::anyhow!("before: {e}"))?;

        let pins: Vec<std::path::PathBuf> = ["tc_ingress", "tc_egress"]
            .iter()
            .map(|prog| bed.pin_path().join("links").join(prog).join(&pod.node_if))
            .collect();
        for pin in &pins {
            bpf_sys::obj::detach_pinned_link(pin).with_context(|| format!("detaching {}", pin.display()))?;
            std::fs::remove_file(pin)?;
        }
        // (The pod still reaches the ClusterIP meanwhile, through the
        // uplink's egress program: what it loses is the translation at its
        // own interface, e.g. for traffic that never leaves by the uplink.)
        let detached = Instant::now();
        // A pin is made only for a link the kernel created (this bpftool
        // predates tcx and cannot show the link's interface).
        netns::wait_for("the pod's links pinned again", SYNC_PERIOD * 5, || {
            if pins.iter().all(|p| p.exists()) {
                Ok(())
            } else {
                Err("not yet".to_owned())
            }
        })?;
        ensure!(
            !log_lines(&bed.log(), "full sync's rescan").is_empty(),
            "the links came back, but not by the rescan:\n{}",
            bed.log()
        );
        answers(&pod.ns, cluster_ip).map_err(|e| anyhow::anyhow!("after the rescan: {e}"))?;
        let back = detached.elapsed();
        note(TEST, format!("programs back on {} after {back:?}", pod.node_if));
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// The pod veths replies are handed into follow the pods.

/// `XP_POD_VETHS` (the node's ends of pod veths the programs hand
/// reverse-NATed replies into) lists every pod's veth at start and never
/// the uplink; a pod that appears later is listed; a veth whose other end
/// is still in the node's namespace is not (the kernel would drop what is
/// handed to it) until a CNI-style move of that end into a pod; a deleted
/// pod's veth and an entry nothing backs are dropped by the next full sync.
#[test]
fn the_pod_veths_listed_for_replies_follow_the_pods() {
    const TEST: &str = "the_pod_veths_listed_for_replies_follow_the_pods";
    const SYNC_PERIOD: Duration = Duration::from_secs(2);
    /// An ifindex no interface has: a deleted pod's entry the agent missed.
    const STALE: u32 = 999_999;
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        start_with_sync_period(bed, SYNC_PERIOD)?;
        let node = &bed.topo.node;
        let ifindex = |dev: &str| node.ifindex(dev);
        let pins = bed.pin_path().to_owned();
        let listed = || proxy_userspace::mode::ebpf::pod_veths::listed(&pins);
        let mut at_start = Vec::new();
        for pod in bed.topo.backends.iter().chain([&bed.topo.client_pod]) {
            at_start.push(ifindex(&pod.node_if)?);
        }
        let now = listed()?;
        ensure!(
            at_start.iter().all(|i| now.contains(i)),
            "at start: {now:?}, want every pod's veth {at_start:?}"
        );
        let uplink = ifindex(&bed.topo.uplink)?;
        ensure!(!now.contains(&uplink), "the uplink ({uplink}) is listed: {now:?}");

        let late = testbed::topology::add_pod(node, POD_GATEWAY, "late-pod", Ipv4Addr::new(10, 244, 0, 60))?;
        let late_index = ifindex(&late.node_if)?;
        wait_listed(&listed, "the late pod's veth listed", |l| l.contains(&late_index))?;

        // A CNI may create the pair in the node's namespace and move one end
        // into the pod afterwards.
        let (host_end, pod_end) = (
            testbed::privileged::unique_name("xh"),
            testbed::privileged::unique_name("xq"),
        );
        node.ip(&["link", "add", &host_end, "type", "veth", "peer", "name", &pod_end])?;
        node.ip(&["link", "set", &host_end, "up"])?;
        let moved_index = ifindex(&host_end)?;
        // Two full syncs, each of which would have listed it.
        std::thread::sleep(SYNC_PERIOD * 2);
        ensure!(
            !listed()?.contains(&moved_index),
            "a veth with both ends in the node's namespace is listed"
        );
        let cni_pod = Netns::new("xq")?;
        node.ip(&["link", "set", &pod_end, "netns", cni_pod.name()])?;
        wait_listed(&listed, "the veth listed once its other end is in a pod", |l| {
            l.contains(&moved_index)
        })?;

        insert_pod_veth(&pins, STALE)?;
        node.ip(&["link", "del", &late.node_if])?;
        wait_listed(&listed, "the deleted pod's veth and the stale entry unlisted", |l| {
            !l.contains(&late_index) && !l.contains(&STALE)
        })?;
        let end = listed()?;
        ensure!(
            at_start.iter().all(|i| end.contains(i)),
            "the other pods' veths unlisted too: {end:?}"
        );
        note(TEST, format!("listed at start {at_start:?}, at the end {end:?}"));
        Ok(())
    });

    /// Waits (a few full syncs) until the listing satisfies `ok`.
    fn wait_listed(listed: &dyn Fn() -> Result<Vec<u32>>, what: &str, ok: impl Fn(&[u32]) -> bool) -> Result<()> {
        netns::wait_for(what, SYNC_PERIOD * 5, || {
            let now = listed().map_err(|e| format!("{e:#}"))?;
            if ok(&now) {
                Ok(())
            } else {
                Err(format!("listed: {now:?}"))
            }
        })
    }
}

/// Lists `ifindex` in `XP_POD_VETHS` by hand.
fn insert_pod_veth(pin_path: &std::path::Path, ifindex: u32) -> Result<()> {
    let map = proxy_userspace::mode::ebpf::pinned(pin_path, proxy_common::maps::POD_VETHS)?;
    let mut veths: aya::maps::HashMap<_, u32, u8> = aya::maps::HashMap::try_from(map)?;
    veths.insert(ifindex, 1, 0).context("writing XP_POD_VETHS")
}

/// Without pod networks the ebpf mode cannot keep the kernel's conntrack
/// off Service flows to pods, and a firewall dropping invalid forwarded
/// packets then breaks them: the agent says so once at start, and not
/// when it knows the pod networks.
#[test]
fn without_pod_networks_the_agent_warns_what_a_firewall_breaks() {
    const TEST: &str = "without_pod_networks_the_agent_warns_what_a_firewall_breaks";
    const WARNING: &str = "no pod networks";
    if !require_root(TEST) {
        return;
    }
    run(TEST, |bed| {
        bed.copy_seed_manifests()?;
        bed.start_agent(&bed.manifest_args())?;
        bed.wait_first_sync(READY_WITHIN)?;
        let warned = log_lines(&bed.log(), WARNING);
        ensure!(warned.len() == 1, "want one warning without pod networks: {warned:?}");
        bed.stop_agent(libc::SIGTERM)?;
        let mut args = bed.manifest_args();
        args.extend(["--cluster-cidr".to_owned(), "10.244.0.0/16".to_owned()]);
        bed.start_agent(&args)?;
        bed.wait_first_sync(READY_WITHIN)?;
        // The log of the agent started last.
        let now = log_lines(&bed.log(), WARNING);
        ensure!(now.is_empty(), "warned with the pod networks given: {now:?}");
        note(TEST, "warned without pod networks, not with them");
        Ok(())
    });
}
