//! Health and metrics, the way kube-proxy serves them.
//!
//! [`Telemetry`] is the agent loop's [`Observer`]: it keeps the metrics and
//! the proxier health state. Two servers read it:
//! - the health server (kube-proxy's `:10256`): `/healthz` and `/livez`,
//!   JSON, 200 or 503 (see [`healthz`] for the rule);
//! - the metrics server (kube-proxy's `:10249`): `/metrics` (OpenMetrics
//!   text), `/healthz` ("ok": the process answers) and `/proxyMode`;
//! - the health check node ports of `externalTrafficPolicy: Local` load
//!   balancers ([`service_health`]), opened and closed as Services come
//!   and go.
//!
//! ```no_run
//! # async fn run() -> anyhow::Result<()> {
//! use std::time::Duration;
//! use proxy_userspace::server::{self, Telemetry};
//! let telemetry = Telemetry::new("ebpf", Duration::from_secs(30), Some("/sys/fs/bpf/xproxy".into()));
//! let (_, healthz) = server::bind_healthz("0.0.0.0:10256".parse()?, telemetry.clone()).await?;
//! let (_, metrics) = server::bind_metrics("127.0.0.1:10249".parse()?, telemetry.clone()).await?;
//! tokio::spawn(healthz);
//! tokio::spawn(metrics);
//! // Agent::new(reconciler, policy, Arc::new(telemetry)) ...
//! # Ok(()) }
//! ```

pub mod healthz;
mod http;
pub mod metrics;
mod process;
pub mod service_health;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use hyper::{StatusCode, header::HeaderValue};
use prometheus_client::{encoding::text, registry::Registry};

pub use self::healthz::{Answer, Probe, ProxierHealth, node_is_deleting};
use self::{
    http::{Response, not_found, response},
    metrics::{Metrics, VerdictReader},
};
use crate::{agent::Observer, model::Problem, reconcile::runner::SyncReport};

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";
const JSON: &str = "application/json";

/// Metrics and health of one agent; clones share the same state.
#[derive(Clone)]
pub struct Telemetry(Arc<Inner>);

struct Inner {
    mode: String,
    registry: Registry,
    metrics: Metrics,
    health: Mutex<ProxierHealth>,
}

impl Telemetry {
    /// `mode` is reported in `xproxy_info` and `/proxyMode`. A change that
    /// waits longer than 2 × `sync_period` makes the proxy unhealthy
    /// (kube-proxy's healthz timeout). With `stats_pin_path` (the bpffs pin
    /// directory), the data path's verdict counters are read from its
    /// pinned stats map at every scrape.
    pub fn new(mode: &str, sync_period: Duration, stats_pin_path: Option<PathBuf>) -> Self {
        Self::with_reader(mode, sync_period * 2, stats_pin_path.map(metrics::pinned_reader))
    }

    fn with_reader(mode: &str, health_timeout: Duration, datapath: Option<VerdictReader>) -> Self {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry, mode, datapath);
        Self(Arc::new(Inner {
            mode: mode.to_owned(),
            registry,
            metrics,
            health: Mutex::new(ProxierHealth::new(health_timeout)),
        }))
    }

    pub fn mode(&self) -> &str {
        &self.0.mode
    }

    fn health(&self) -> MutexGuard<'_, ProxierHealth> {
        // The state stays consistent even if a holder panicked.
        self.0.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The node is being deleted (see [`node_is_deleting`]): `/healthz`
    /// answers 503 so load balancers drain the node; `/livez` is unaffected.
    pub fn set_node_deleting(&self, deleting: bool) {
        self.health().set_node_eligible(!deleting);
    }

    /// The proxy's own health now, ignoring the node (what `/livez` says).
    pub fn is_healthy(&self) -> bool {
        self.health().is_healthy(Instant::now())
    }

    /// Answers a probe now, and counts the answer in
    /// `kubeproxy_proxy_{healthz,livez}_total{code}`.
    pub fn probe(&self, probe: Probe) -> Answer {
        let answer = self.health().answer(probe, Instant::now(), SystemTime::now());
        let code = if answer.healthy { "200" } else { "503" };
        let family = match probe {
            Probe::Healthz => &self.0.metrics.healthz,
            Probe::Livez => &self.0.metrics.livez,
        };
        family.get_or_create(&[("code", code)]).inc();
        answer
    }

    /// Counts the API client's requests in `rest_client_requests_total`.
    pub fn request_counter(&self) -> crate::source::request_counter::CountRequest {
        let family = self.0.metrics.rest_client_requests.clone();
        std::sync::Arc::new(move |method: &str, code: &str, host: &str| {
            let labels = [
                ("code", code.to_owned()),
                ("host", host.to_owned()),
                ("method", method.to_owned()),
            ];
            family.get_or_create(&labels).inc();
        })
    }

    /// Counts a health check node port that could not be opened.
    pub fn health_check_bind_failed(&self) {
        self.0.metrics.health_check_bind_failures.inc();
    }

    /// Every metric in the OpenMetrics text format (ends with `# EOF`).
    pub fn encode_metrics(&self) -> Result<String> {
        let mut out = String::new();
        text::encode(&mut out, &self.0.registry).map_err(|_| anyhow::anyhow!("encoding the metrics failed"))?;
        Ok(out)
    }
}

impl Observer for Telemetry {
    fn change_queued(&self, at: Instant) {
        let waited = Instant::now().saturating_duration_since(at);
        self.0
            .metrics
            .last_queued_timestamp
            .set(unix_seconds(SystemTime::now()) - waited.as_secs_f64());
        self.health().queued(at);
    }

    fn synced(&self, report: &SyncReport, took: Duration, oldest_change: Option<Instant>) {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let m = &self.0.metrics;
        m.sync_duration.observe(took.as_secs_f64());
        if report.full {
            m.sync_full_duration.observe(took.as_secs_f64());
        } else {
            m.sync_partial_duration.observe(took.as_secs_f64());
        }
        m.last_sync_timestamp.set(unix_seconds(wall));
        if let Some(since) = oldest_change {
            m.change_programming
                .observe(now.saturating_duration_since(since).as_secs_f64());
        }
        m.service_changes.inc_by(report.service_changes as u64);
        m.endpoint_changes.inc_by(report.endpoint_changes as u64);
        m.kernel_writes.inc_by(report.kernel_writes);
        self.health().updated(wall);
    }

    /// kube-proxy's network programming latency: from the change in the
    /// cluster (the slice's trigger time) to the data path holding it.
    fn programmed(&self, trigger_times: &[SystemTime]) {
        let now = SystemTime::now();
        for at in trigger_times {
            // A trigger time ahead of this node's clock counts as zero.
            let latency = now.duration_since(*at).unwrap_or_default();
            self.0.metrics.network_programming.observe(latency.as_secs_f64());
        }
    }

    fn pending(&self, services: usize, slices: usize) {
        let m = &self.0.metrics;
        m.service_changes_pending
            .set(i64::try_from(services).unwrap_or(i64::MAX));
        m.endpoint_changes_pending
            .set(i64::try_from(slices).unwrap_or(i64::MAX));
    }

    fn no_local_endpoints(&self, internal: usize, external: usize) {
        let family = &self.0.metrics.no_local_endpoints;
        for (policy, count) in [("internal", internal), ("external", external)] {
            family
                .get_or_create(&[("traffic_policy", policy)])
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    fn sync_failed(&self, _error: &anyhow::Error) {
        // Health sees a failure as the pending change getting older.
        self.0.metrics.sync_failures.inc();
    }

    fn problems(&self, problems: &[Problem]) {
        self.0.metrics.skipped_objects.inc_by(problems.len() as u64);
    }

    fn mode_counters(&self, counters: &crate::mode::ModeCounters) {
        self.0.metrics.mode_metrics.update(counters);
    }

    /// A node that is gone keeps its last verdict: kube-proxy only reacts
    /// to the deletion mark, which arrives before the object disappears.
    fn node_updated(&self, node: Option<&k8s_openapi::api::core::v1::Node>) {
        if let Some(node) = node {
            self.set_node_deleting(node_is_deleting(node));
        }
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Binds the health server (`/healthz`, `/livez`) to `addr` (port 0 picks
/// one) and returns the bound address and the future that serves it. A
/// bind failure (e.g. "address already in use") names the address.
pub async fn bind_healthz(
    addr: SocketAddr,
    telemetry: Telemetry,
) -> Result<(SocketAddr, impl Future<Output = ()> + Send + 'static)> {
    let (listener, bound) = http::bind("healthz", addr).await?;
    let route = move |req: &hyper::Request<_>| healthz_route(&telemetry, req.uri().path());
    Ok((bound, http::serve("healthz", listener, route)))
}

/// Binds and serves the health server; returns only on a bind failure.
pub async fn serve_healthz(addr: SocketAddr, telemetry: Telemetry) -> Result<()> {
    let (_, serve) = bind_healthz(addr, telemetry).await?;
    serve.await;
    Ok(())
}

/// Binds the metrics server (`/metrics`, `/healthz`, `/proxyMode`) to
/// `addr` (port 0 picks one) and returns the bound address and the future
/// that serves it.
pub async fn bind_metrics(
    addr: SocketAddr,
    telemetry: Telemetry,
) -> Result<(SocketAddr, impl Future<Output = ()> + Send + 'static)> {
    let (listener, bound) = http::bind("metrics", addr).await?;
    let route = move |req: &hyper::Request<_>| metrics_route(&telemetry, req.uri().path());
    Ok((bound, http::serve("metrics", listener, route)))
}

/// Binds and serves the metrics server; returns only on a bind failure.
pub async fn serve_metrics(addr: SocketAddr, telemetry: Telemetry) -> Result<()> {
    let (_, serve) = bind_metrics(addr, telemetry).await?;
    serve.await;
    Ok(())
}

fn healthz_route(telemetry: &Telemetry, path: &str) -> Response {
    let probe = match path {
        "/healthz" => Probe::Healthz,
        "/livez" => Probe::Livez,
        _ => return not_found(),
    };
    let answer = telemetry.probe(probe);
    let status = if answer.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut resp = response(status, JSON, answer.body);
    resp.headers_mut()
        .insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    resp
}

fn metrics_route(telemetry: &Telemetry, path: &str) -> Response {
    match path {
        "/metrics" => match telemetry.encode_metrics() {
            Ok(body) => response(StatusCode::OK, OPENMETRICS, body),
            Err(e) => response(StatusCode::INTERNAL_SERVER_ERROR, TEXT, format!("{e:#}\n")),
        },
        "/healthz" => response(StatusCode::OK, TEXT, "ok"),
        "/proxyMode" => response(StatusCode::OK, TEXT, telemetry.mode().to_owned()),
        _ => not_found(),
    }
}

#[cfg(test)]
mod tests;
