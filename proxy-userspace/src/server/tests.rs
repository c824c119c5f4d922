//! Telemetry as the agent drives it, and both servers over real sockets.

use std::net::{Ipv4Addr, SocketAddr};

use proxy_common::{Verdict, VerdictCounter, stats::ct_stat};

use super::metrics::{ConntrackCounts, DatapathCounts};
use serde_json::Value;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::*;

fn report(full: bool, service_changes: usize, endpoint_changes: usize) -> SyncReport {
    SyncReport {
        full,
        service_changes,
        endpoint_changes,
        kernel_writes: 3,
        stale_flow_deletions: 0,
        problems: Vec::new(),
    }
}

fn metrics(t: &Telemetry) -> String {
    t.encode_metrics().expect("the metrics encode")
}

/// The value of the sample line that starts with `series` followed by a space.
fn sample(text: &str, series: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.strip_prefix(series).is_some_and(|rest| rest.starts_with(' ')))
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"));
    line[series.len()..]
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{line}: {e}"))
}

#[test]
fn metrics_carry_kube_proxys_names_and_values() {
    let t = Telemetry::new("fake", Duration::from_secs(30), None);
    let text = metrics(&t);
    assert!(text.ends_with("# EOF\n"));
    assert_eq!(sample(&text, "kubeproxy_sync_proxy_rules_duration_seconds_count"), 0.0);
    assert_eq!(sample(&text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds"), 0.0);
    assert_eq!(sample(&text, r#"kubeproxy_proxy_healthz_total{code="503"}"#), 0.0);
    assert_eq!(sample(&text, r#"xproxy_info{mode="fake"}"#), 1.0);

    let before = unix_seconds(SystemTime::now());
    t.change_queued(Instant::now() - Duration::from_millis(30));
    t.synced(
        &report(true, 3, 5),
        Duration::from_micros(1500),
        Some(Instant::now() - Duration::from_millis(30)),
    );
    t.synced(&report(false, 1, 2), Duration::from_millis(40), None);
    // Two slice changes whose causes happened 3 s and 20 ms ago.
    t.programmed(&[
        SystemTime::now() - Duration::from_secs(3),
        SystemTime::now() - Duration::from_millis(20),
    ]);
    t.pending(2, 9);
    t.no_local_endpoints(1, 3);
    t.sync_failed(&anyhow::anyhow!("boom"));
    t.problems(&[
        Problem::new("default/a", "bad port"),
        Problem::new("default/b", "bad IP"),
    ]);

    let text = metrics(&t);
    let all = "kubeproxy_sync_proxy_rules_duration_seconds";
    assert_eq!(sample(&text, &format!("{all}_count")), 2.0);
    assert!((sample(&text, &format!("{all}_sum")) - 0.0415).abs() < 1e-9);
    // Buckets are cumulative: 1.5ms is in le=0.002, 40ms from le=0.064 on.
    assert_eq!(sample(&text, &format!("{all}_bucket{{le=\"0.001\"}}")), 0.0);
    assert_eq!(sample(&text, &format!("{all}_bucket{{le=\"0.002\"}}")), 1.0);
    assert_eq!(sample(&text, &format!("{all}_bucket{{le=\"0.032\"}}")), 1.0);
    assert_eq!(sample(&text, &format!("{all}_bucket{{le=\"0.064\"}}")), 2.0);
    assert_eq!(sample(&text, &format!("{all}_bucket{{le=\"16.384\"}}")), 2.0);
    assert_eq!(
        sample(&text, "kubeproxy_sync_full_proxy_rules_duration_seconds_count"),
        1.0
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_partial_proxy_rules_duration_seconds_count"),
        1.0
    );
    assert_eq!(sample(&text, "xproxy_change_programming_duration_seconds_count"), 1.0);
    assert_eq!(
        sample(
            &text,
            r#"xproxy_change_programming_duration_seconds_bucket{le="0.025"}"#
        ),
        0.0
    );
    assert_eq!(
        sample(
            &text,
            r#"xproxy_change_programming_duration_seconds_bucket{le="300.0"}"#
        ),
        1.0
    );
    assert_eq!(sample(&text, "kubeproxy_sync_proxy_rules_service_changes_pending"), 2.0);
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_endpoint_changes_pending"),
        9.0
    );
    let no_local = "kubeproxy_sync_proxy_rules_no_local_endpoints_total";
    assert_eq!(
        sample(&text, &format!("{no_local}{{traffic_policy=\"internal\"}}")),
        1.0
    );
    assert_eq!(
        sample(&text, &format!("{no_local}{{traffic_policy=\"external\"}}")),
        3.0
    );
    let latency = "kubeproxy_network_programming_duration_seconds";
    assert_eq!(sample(&text, &format!("{latency}_count")), 2.0);
    assert_eq!(sample(&text, &format!("{latency}_bucket{{le=\"0.025\"}}")), 1.0);
    assert_eq!(sample(&text, &format!("{latency}_bucket{{le=\"2.0\"}}")), 1.0);
    assert_eq!(sample(&text, &format!("{latency}_bucket{{le=\"5.0\"}}")), 2.0);
    assert_eq!(sample(&text, "kubeproxy_sync_proxy_rules_service_changes_total"), 4.0);
    assert_eq!(sample(&text, "kubeproxy_sync_proxy_rules_endpoint_changes_total"), 7.0);
    assert_eq!(sample(&text, "xproxy_sync_failures_total"), 1.0);
    assert_eq!(sample(&text, "xproxy_skipped_objects_total"), 2.0);
    // Two reports of 3 writes each were observed above.
    assert_eq!(sample(&text, "xproxy_sync_kernel_writes_total"), 6.0);
    let last_sync = sample(&text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds");
    assert!(
        last_sync >= before && last_sync <= unix_seconds(SystemTime::now()),
        "{last_sync} is not now"
    );
    let queued = sample(&text, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds");
    assert!(
        queued < last_sync && queued > before - 1.0,
        "{queued} is not 30ms before {last_sync}"
    );
    // No data path to read: no datapath series at all.
    assert!(!text.contains("xproxy_datapath"), "{text}");
}

#[test]
fn datapath_counters_are_read_at_scrape_time() {
    let reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = reads.clone();
    let reader: VerdictReader = Box::new(move || {
        let n = seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let verdicts = Verdict::ALL
            .iter()
            .map(|&v| {
                (
                    v,
                    VerdictCounter {
                        packets: n * v as u64,
                        bytes: 100 * n,
                    },
                )
            })
            .collect();
        let mut conntrack = ConntrackCounts {
            max_entries: 1000,
            ..ConntrackCounts::default()
        };
        conntrack.counters[ct_stat::LIVE as usize] = 40;
        conntrack.counters[ct_stat::EXPIRED as usize] = 7 * n;
        conntrack.counters[ct_stat::EVICTED as usize] = 3;
        Some(DatapathCounts {
            verdicts,
            conntrack: Some(conntrack),
        })
    });
    let t = Telemetry::with_reader("ebpf", Duration::from_secs(60), Some(reader));
    let first = metrics(&t);
    assert!(first.contains("# TYPE xproxy_datapath_packets counter\n"), "{first}");
    assert_eq!(
        sample(&first, r#"xproxy_datapath_packets_total{verdict="dnat_new"}"#),
        3.0
    );
    assert_eq!(sample(&first, r#"xproxy_datapath_packets_total{verdict="error"}"#), 7.0);
    assert_eq!(
        sample(&first, r#"xproxy_datapath_bytes_total{verdict="rev_nat"}"#),
        100.0
    );
    let second = metrics(&t);
    assert_eq!(
        sample(&second, r#"xproxy_datapath_packets_total{verdict="dnat_new"}"#),
        6.0
    );
    assert_eq!(reads.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(second.contains("# TYPE xproxy_conntrack_entries gauge\n"), "{second}");
    assert_eq!(sample(&second, "xproxy_conntrack_entries"), 40.0);
    assert_eq!(sample(&second, "xproxy_conntrack_max_entries"), 1000.0);
    assert_eq!(sample(&second, "xproxy_conntrack_gc_deleted_total"), 14.0);
    assert_eq!(sample(&second, "xproxy_conntrack_evictions_total"), 3.0);

    // A pin directory without a stats map: nothing exported, no error.
    let missing = std::env::temp_dir().join(format!("xproxy-telemetry-test-{}", std::process::id()));
    let t = Telemetry::new("iptables", Duration::from_secs(30), Some(missing));
    assert!(!metrics(&t).contains("xproxy_datapath"));
}

#[test]
fn health_follows_the_agent() {
    let t = Telemetry::new("fake", Duration::from_secs(30), None);
    assert!(t.is_healthy());
    t.change_queued(Instant::now() - Duration::from_secs(59));
    assert!(t.is_healthy(), "59s is within 2 x syncPeriod");
    t.sync_failed(&anyhow::anyhow!("boom"));
    assert!(t.is_healthy());

    let t = Telemetry::new("fake", Duration::from_secs(30), None);
    t.change_queued(Instant::now() - Duration::from_secs(61));
    assert!(!t.is_healthy(), "a change waited longer than 2 x syncPeriod");
    assert_eq!(t.probe(Probe::Livez).status(), 503);
    t.synced(&report(true, 1, 1), Duration::from_millis(1), None);
    assert!(t.is_healthy());
    assert_eq!(t.probe(Probe::Livez).status(), 200);

    t.set_node_deleting(true);
    assert!(t.is_healthy(), "the node does not change the proxy's own health");
    assert_eq!(
        (t.probe(Probe::Healthz).status(), t.probe(Probe::Livez).status()),
        (503, 200)
    );
    let text = metrics(&t);
    assert_eq!(sample(&text, r#"kubeproxy_proxy_livez_total{code="200"}"#), 2.0);
    assert_eq!(sample(&text, r#"kubeproxy_proxy_livez_total{code="503"}"#), 1.0);
    assert_eq!(sample(&text, r#"kubeproxy_proxy_healthz_total{code="503"}"#), 1.0);
    assert_eq!(sample(&text, r#"kubeproxy_proxy_healthz_total{code="200"}"#), 0.0);
}

/// Status, lower-cased head, and body of one HTTP/1.1 GET.
pub(super) async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut raw))
        .await
        .expect("answered in time")
        .expect("read");
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not HTTP: {raw:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{head}"));
    (status, head.to_ascii_lowercase(), body.to_owned())
}

pub(super) fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"))
}

fn any_port() -> SocketAddr {
    (Ipv4Addr::LOCALHOST, 0).into()
}

#[tokio::test]
async fn health_server_answers_like_kube_proxy() {
    let t = Telemetry::new("ebpf", Duration::from_secs(30), None);
    let (addr, serve) = bind_healthz(any_port(), t.clone()).await.expect("bind");
    assert_ne!(addr.port(), 0, "the bound port is reported");
    let server = tokio::spawn(serve);

    // Not ready before the first sync, but alive.
    assert_eq!(get(addr, "/healthz").await.0, 503, "never synced");
    assert_eq!(get(addr, "/livez").await.0, 200, "never synced, nothing waits");
    t.synced(&report(true, 1, 1), Duration::from_millis(1), None);

    let (status, head, body) = get(addr, "/healthz").await;
    assert_eq!(status, 200, "{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    assert!(head.contains("x-content-type-options: nosniff"), "{head}");
    let body = json(&body);
    assert_eq!(body["nodeEligible"], Value::Bool(true));
    assert_eq!(body["lastUpdated"], body["currentTime"], "healthy: lastUpdated is now");

    t.set_node_deleting(true);
    let (status, _, body) = get(addr, "/healthz").await;
    assert_eq!(status, 503);
    assert_eq!(json(&body)["nodeEligible"], Value::Bool(false));
    let (status, _, body) = get(addr, "/livez").await;
    assert_eq!(status, 200);
    assert!(json(&body).get("nodeEligible").is_none());

    t.set_node_deleting(false);
    t.change_queued(Instant::now() - Duration::from_secs(120));
    assert_eq!(get(addr, "/healthz").await.0, 503);
    let (status, _, body) = get(addr, "/livez").await;
    assert_eq!(status, 503);
    assert_ne!(
        json(&body)["lastUpdated"],
        "0001-01-01T00:00:00Z",
        "unhealthy after a sync: lastUpdated is that sync"
    );

    assert_eq!(get(addr, "/metrics").await.0, 404, "metrics live on the other server");
    server.abort();
}

#[tokio::test]
async fn metrics_server_serves_metrics_healthz_and_mode() {
    let t = Telemetry::new("ebpf", Duration::from_secs(30), None);
    let (health_addr, health) = bind_healthz(any_port(), t.clone()).await.expect("bind healthz");
    let (addr, serve) = bind_metrics(any_port(), t.clone()).await.expect("bind metrics");
    let servers = [tokio::spawn(health), tokio::spawn(serve)];

    t.synced(&report(true, 1, 1), Duration::from_millis(1), None);
    get(health_addr, "/healthz").await;
    t.problems(&[Problem::new("default/bad", "no ports")]);
    let (status, head, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(head.contains("content-type: application/openmetrics-text"), "{head}");
    assert_eq!(sample(&body, r#"kubeproxy_proxy_healthz_total{code="200"}"#), 1.0);
    assert_eq!(sample(&body, "xproxy_skipped_objects_total"), 1.0);
    assert!(body.ends_with("# EOF\n"));

    assert_eq!(
        get(addr, "/healthz").await,
        (200, get(addr, "/healthz").await.1, "ok".to_owned())
    );
    assert_eq!(get(addr, "/proxyMode").await.2, "ebpf");
    assert_eq!(get(addr, "/nope").await.0, 404);
    for server in servers {
        server.abort();
    }
}

#[tokio::test]
async fn a_port_in_use_is_a_clear_startup_error() {
    let t = Telemetry::new("ebpf", Duration::from_secs(30), None);
    let (addr, _serve) = bind_metrics(any_port(), t.clone()).await.expect("bind");
    let err = serve_healthz(addr, t).await.expect_err("the port is taken");
    let msg = format!("{err:#}");
    assert!(msg.contains(&addr.to_string()), "{msg}");
    assert!(msg.contains("healthz"), "{msg}");
    assert!(msg.to_ascii_lowercase().contains("address already in use"), "{msg}");
}

#[test]
fn a_modes_own_counts_become_kube_proxys_metrics_of_that_mode() {
    let t = Telemetry::new("iptables", Duration::from_secs(30), None);
    let counts = |restore, partial| crate::mode::ModeCounters {
        iptables_rules: vec![("filter", 7), ("nat", 42)],
        iptables_restore_failures: restore,
        iptables_partial_restore_failures: partial,
        nftables_sync_failures: 0,
    };
    t.mode_counters(&counts(1, 2));
    t.mode_counters(&counts(1, 5));
    let text = metrics(&t);
    assert_eq!(
        sample(&text, r#"kubeproxy_sync_proxy_rules_iptables_total{table="nat"}"#),
        42.0
    );
    assert_eq!(
        sample(&text, r#"kubeproxy_sync_proxy_rules_iptables_total{table="filter"}"#),
        7.0
    );
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total"
        ),
        5.0
    );
    assert!(!text.contains("nftables"), "{text}");

    let t = Telemetry::new("nftables", Duration::from_secs(30), None);
    let failed = crate::mode::ModeCounters {
        nftables_sync_failures: 3,
        ..crate::mode::ModeCounters::default()
    };
    t.mode_counters(&failed);
    let text = metrics(&t);
    assert_eq!(
        sample(&text, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"),
        3.0
    );
    assert!(!text.contains("iptables_restore"), "{text}");
}
