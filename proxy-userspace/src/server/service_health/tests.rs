//! Health check node ports over real sockets on 127.0.0.1: opened,
//! answered, counted and closed as the desired state changes.

use std::{net::TcpListener as StdListener, time::Duration};

use super::*;
use crate::{
    model::{Endpoint, TrafficPolicy},
    server::tests::{get, json},
};

const NODE: &str = "node-a";

/// A port 127.0.0.1 has free now.
fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn endpoint(last: u8, node: &str, ready: bool) -> Endpoint {
    Endpoint {
        ready,
        node_name: Some(node.into()),
        ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
    }
}

fn port(name: &str, health_check: u16, endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: name.into(),
        node_port: Some(30080),
        load_balancer_ips: vec![Ipv4Addr::new(192, 0, 2, 10).into()],
        external_policy: TrafficPolicy::Local,
        health_check_node_port: Some(health_check),
        endpoints,
        ..ServicePort::default()
    }
}

fn server() -> (ServiceHealth, Telemetry) {
    let telemetry = Telemetry::new("test", Duration::from_secs(30), None);
    let health = ServiceHealth::new(
        Some(NODE.into()),
        vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
        telemetry.clone(),
    );
    (health, telemetry)
}

fn desired(ports: Vec<ServicePort>) -> BTreeMap<String, ServicePort> {
    ports.into_iter().map(|p| (p.name.clone(), p)).collect()
}

fn all_names(desired: &BTreeMap<String, ServicePort>) -> BTreeSet<String> {
    desired.keys().cloned().collect()
}

fn at(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// Waits until nothing listens on `port` any more (the listener task
/// ends at its next poll after the abort).
async fn closed(port: u16) {
    tokio::time::timeout(Duration::from_secs(5), async {
        while tokio::net::TcpStream::connect(at(port)).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the health check port closed in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_local_endpoints_answers_200_with_the_count_like_kube_proxy() {
    let (mut health, _telemetry) = server();
    let hc = free_port();
    // Two ports of one Service: a pod counts once; other nodes' and
    // unready endpoints not at all.
    let eps = vec![
        endpoint(1, NODE, true),
        endpoint(2, NODE, true),
        endpoint(3, "node-b", true),
        endpoint(4, NODE, false),
    ];
    let state = desired(vec![
        port("shop/web:http", hc, eps.clone()),
        port("shop/web:https", hc, eps),
    ]);
    health.update(&state, &all_names(&state), false);
    assert_eq!(
        health.listening(),
        BTreeMap::from([(("shop".into(), "web".into()), hc)])
    );

    let (status, head, body) = get(at(hc), "/any/path").await;
    assert_eq!(status, 200, "{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    assert!(head.contains("x-content-type-options: nosniff"), "{head}");
    assert!(head.contains("x-load-balancing-endpoint-weight: 2"), "{head}");
    assert_eq!(
        json(&body),
        serde_json::json!({"service": {"namespace": "shop", "name": "web"},
            "localEndpoints": 2, "serviceProxyHealthy": true})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_follow_endpoint_changes_and_the_port_closes_with_the_service() {
    let (mut health, _telemetry) = server();
    let hc = free_port();
    let mut state = desired(vec![port("default/lb", hc, vec![endpoint(1, "node-b", true)])]);
    health.update(&state, &all_names(&state), false);
    let (status, head, body) = get(at(hc), "/").await;
    assert_eq!((status, json(&body)["localEndpoints"].as_u64()), (503, Some(0)));
    assert!(head.contains("x-load-balancing-endpoint-weight: 0"), "{head}");

    // An endpoint moves here: a partial sync of that port.
    state = desired(vec![port("default/lb", hc, vec![endpoint(1, NODE, true)])]);
    health.update(&state, &BTreeSet::from(["default/lb".to_string()]), false);
    let (status, _, body) = get(at(hc), "/healthz").await;
    assert_eq!((status, json(&body)["localEndpoints"].as_u64()), (200, Some(1)));

    // A port change elsewhere leaves it alone.
    health.update(&state, &BTreeSet::from(["default/other".to_string()]), false);
    assert_eq!(get(at(hc), "/").await.0, 200);

    // The Service goes (or stops being a Local load balancer): closed.
    health.update(&BTreeMap::new(), &BTreeSet::from(["default/lb".to_string()]), false);
    assert!(health.listening().is_empty());
    closed(hc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_health_check_port_moves_the_listener() {
    let (mut health, _telemetry) = server();
    let (first, second) = (free_port(), free_port());
    let state = desired(vec![port("default/lb", first, vec![endpoint(1, NODE, true)])]);
    health.update(&state, &all_names(&state), false);
    assert_eq!(get(at(first), "/").await.0, 200);
    let state = desired(vec![port("default/lb", second, vec![endpoint(1, NODE, true)])]);
    health.update(&state, &all_names(&state), false);
    assert_eq!(get(at(second), "/").await.0, 200);
    closed(first).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_in_use_is_counted_and_retried_at_the_next_full_sync() {
    let (mut health, telemetry) = server();
    let taken = StdListener::bind("127.0.0.1:0").expect("bind");
    let hc = taken.local_addr().expect("addr").port();
    let state = desired(vec![port("default/lb", hc, vec![endpoint(1, NODE, true)])]);
    health.update(&state, &all_names(&state), false);
    assert!(health.listening().is_empty(), "nothing listens: the port is taken");
    let failures = |t: &Telemetry| {
        t.encode_metrics()
            .expect("metrics")
            .lines()
            .find_map(|l| l.strip_prefix("xproxy_health_check_node_port_bind_failures_total "))
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(failures(&telemetry), Some(1.0));
    // A partial sync does not retry (no log line per change)...
    health.update(&state, &all_names(&state), false);
    assert_eq!(failures(&telemetry), Some(1.0));
    // ... a full sync does, and succeeds once the port is free.
    drop(taken);
    health.update(&state, &BTreeSet::new(), true);
    assert_eq!(health.listening().len(), 1);
    assert_eq!(get(at(hc), "/").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_proxy_answers_503_whatever_the_endpoints() {
    let telemetry = Telemetry::new("test", Duration::from_millis(1), None);
    let mut health = ServiceHealth::new(
        Some(NODE.into()),
        vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
        telemetry.clone(),
    );
    let hc = free_port();
    let state = desired(vec![port("default/lb", hc, vec![endpoint(1, NODE, true)])]);
    health.update(&state, &all_names(&state), false);
    // A change that waits past the (1 ms) timeout makes the proxy unhealthy.
    crate::agent::Observer::change_queued(&telemetry, std::time::Instant::now() - Duration::from_secs(1));
    let (status, _, body) = get(at(hc), "/").await;
    assert_eq!(status, 503);
    assert_eq!(json(&body)["serviceProxyHealthy"], false);
    assert_eq!(json(&body)["localEndpoints"], 1);
}

#[test]
fn service_names_come_from_port_names() {
    assert_eq!(service_of("ns/web:http"), Some(("ns".into(), "web".into())));
    assert_eq!(service_of("ns/web"), Some(("ns".into(), "web".into())));
    assert_eq!(service_of("nonsense"), None);
}
