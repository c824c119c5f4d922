//! The metrics: kube-proxy's names where they mean the same thing,
//! `xproxy_*` for what only xproxy has.
//!
//! Everything the agent loop reports is kept in prometheus-client metrics;
//! the data path's per-CPU verdict counters are read from the pinned stats
//! map at scrape time (and left out when there is no such map, as in the
//! kernel-rule modes).

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use anyhow::{Context, Result};
use aya::maps::{Map, MapData, PerCpuArray};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::ConstGauge,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use proxy_common::{Verdict, VerdictCounter, maps, stats::ct_stat};

use crate::mode::ModeCounters;
pub use crate::mode::ebpf::conntrack::{ConntrackCounts, read_conntrack_counts};
use tracing::warn;

/// kube-proxy's sync duration buckets: 1ms doubling to ~16s.
fn sync_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// Change-to-programmed latency buckets. kube-proxy starts at 0.25s (its
/// rules take that long); map updates take milliseconds, so these start at
/// 1ms and still reach kube-proxy's 300s.
const NETWORK_PROGRAMMING_BUCKETS: [f64; 17] = [
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// client-go's labels of `rest_client_requests_total`.
pub(super) type RestLabels = [(&'static str, String); 3];

/// One label, `code="200"`.
pub(super) type CodeLabel = [(&'static str, &'static str); 1];

/// What the data path's pinned counters say, or `None` when there is no
/// data path to read.
pub(super) type VerdictReader = Box<dyn Fn() -> Option<DatapathCounts> + Send + Sync>;

/// The data path's counters, summed over CPUs.
pub struct DatapathCounts {
    pub verdicts: Vec<(Verdict, VerdictCounter)>,
    /// `None` where the data path has no conntrack counters (an older one).
    pub conntrack: Option<ConntrackCounts>,
}

/// Handles to every metric the agent updates.
pub(super) struct Metrics {
    pub sync_duration: Histogram,
    pub sync_full_duration: Histogram,
    pub sync_partial_duration: Histogram,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    pub network_programming: Histogram,
    pub change_programming: Histogram,
    pub service_changes: Counter,
    pub endpoint_changes: Counter,
    pub service_changes_pending: Gauge,
    pub endpoint_changes_pending: Gauge,
    pub no_local_endpoints: Family<[(&'static str, &'static str); 1], Gauge>,
    pub rest_client_requests: Family<RestLabels, Counter>,
    pub sync_failures: Counter,
    pub skipped_objects: Counter,
    pub kernel_writes: Counter,
    pub health_check_bind_failures: Counter,
    pub healthz: Family<CodeLabel, Counter>,
    pub livez: Family<CodeLabel, Counter>,
    pub mode_metrics: ModeMetrics,
}

impl Metrics {
    /// Registers every metric in `registry`. Counters are named without
    /// `_total`: the encoder appends it.
    pub fn register(registry: &mut Registry, mode: &str, datapath: Option<VerdictReader>) -> Self {
        let m = Self {
            sync_duration: Histogram::new(sync_buckets()),
            sync_full_duration: Histogram::new(sync_buckets()),
            sync_partial_duration: Histogram::new(sync_buckets()),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            network_programming: Histogram::new(NETWORK_PROGRAMMING_BUCKETS),
            change_programming: Histogram::new(NETWORK_PROGRAMMING_BUCKETS),
            service_changes: Counter::default(),
            endpoint_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            endpoint_changes_pending: Gauge::default(),
            no_local_endpoints: Family::default(),
            rest_client_requests: Family::default(),
            sync_failures: Counter::default(),
            skipped_objects: Counter::default(),
            kernel_writes: Counter::default(),
            health_check_bind_failures: Counter::default(),
            healthz: Family::default(),
            livez: Family::default(),
            mode_metrics: ModeMetrics::default(),
        };
        // Both codes show from the start, like kube-proxy's fixed series.
        for code in ["200", "503"] {
            m.healthz.get_or_create_owned(&[("code", code)]);
            m.livez.get_or_create_owned(&[("code", code)]);
        }

        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds (from an EndpointSlice's last-change-trigger-time to the change being programmed)",
            m.network_programming.clone(),
        );
        registry.register(
            "xproxy_change_programming_duration_seconds",
            "From a change reaching the agent (any source, Services too) to it being programmed, in seconds",
            m.change_programming.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        for policy in ["internal", "external"] {
            m.no_local_endpoints.get_or_create_owned(&[("traffic_policy", policy)]);
        }
        // kube-proxy's name ends in _total although it is a gauge; the
        // encoder would add _total to a counter, not to a gauge.
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints on this node",
            m.no_local_endpoints.clone(),
        );
        registry.register(
            "rest_client_requests",
            "Number of HTTP requests to the API server, partitioned by status code, method, and host",
            m.rest_client_requests.clone(),
        );
        registry.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            m.healthz.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            m.livez.clone(),
        );
        registry.register(
            "xproxy_sync_failures",
            "Syncs that failed (each is retried as a full sync)",
            m.sync_failures.clone(),
        );
        registry.register(
            "xproxy_skipped_objects",
            "Objects or parts of objects skipped as invalid or unsupported",
            m.skipped_objects.clone(),
        );
        registry.register(
            "xproxy_sync_kernel_writes",
            "Kernel writes (map updates and deletes, rules) issued by syncs; a restart that finds the data path in place adds none",
            m.kernel_writes.clone(),
        );
        registry.register(
            "xproxy_health_check_node_port_bind_failures",
            "Attempts to open a Service's health check node port that failed (the port is retried at the next full sync)",
            m.health_check_bind_failures.clone(),
        );

        let info: Family<[(&'static str, String); 1], Gauge> = Family::default();
        info.get_or_create(&[("mode", mode.to_owned())]).set(1);
        registry.register("xproxy_info", "The running agent's data-plane mode", info);

        m.mode_metrics.register(registry, mode);
        registry.register_collector(Box::new(super::process::ProcessCollector));
        if let Some(read) = datapath {
            registry.register_collector(Box::new(DatapathStats { read }));
        }
        m
    }
}

/// kube-proxy's metrics of one mode, from the mode's own counts
/// ([`ModeCounters`]); registered only in that mode, as only that mode of
/// kube-proxy moves them.
#[derive(Default)]
pub(super) struct ModeMetrics {
    iptables_rules: Family<[(&'static str, &'static str); 1], Gauge>,
    iptables_restore_failures: Counter,
    iptables_partial_restore_failures: Counter,
    nftables_sync_failures: Counter,
    /// The counts of the last update: counters move by the difference.
    last: Mutex<ModeCounters>,
}

impl ModeMetrics {
    fn register(&self, registry: &mut Registry, mode: &str) {
        match mode {
            "iptables" => {
                // A gauge named _total, as kube-proxy names it (the encoder
                // appends _total to counters only).
                registry.register(
                    "kubeproxy_sync_proxy_rules_iptables_total",
                    "Total number of iptables rules owned by kube-proxy (xproxy: read back after the last full sync)",
                    self.iptables_rules.clone(),
                );
                registry.register(
                    "kubeproxy_sync_proxy_rules_iptables_restore_failures",
                    "Cumulative proxy iptables restore failures",
                    self.iptables_restore_failures.clone(),
                );
                registry.register(
                    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
                    "Cumulative proxy iptables partial restore failures",
                    self.iptables_partial_restore_failures.clone(),
                );
            }
            "nftables" => registry.register(
                "kubeproxy_sync_proxy_rules_nftables_sync_failures",
                "Total number of nftables sync failures",
                self.nftables_sync_failures.clone(),
            ),
            _ => {}
        }
    }

    /// Takes the mode's counts after a sync.
    pub fn update(&self, now: &ModeCounters) {
        let mut last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (table, rules) in &now.iptables_rules {
            self.iptables_rules
                .get_or_create(&[("table", *table)])
                .set(i64::try_from(*rules).unwrap_or(i64::MAX));
        }
        let grown = |now: u64, before: u64| now.saturating_sub(before);
        self.iptables_restore_failures
            .inc_by(grown(now.iptables_restore_failures, last.iptables_restore_failures));
        self.iptables_partial_restore_failures.inc_by(grown(
            now.iptables_partial_restore_failures,
            last.iptables_partial_restore_failures,
        ));
        self.nftables_sync_failures
            .inc_by(grown(now.nftables_sync_failures, last.nftables_sync_failures));
        *last = now.clone();
    }
}

impl fmt::Debug for ModeMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModeMetrics").finish_non_exhaustive()
    }
}

/// Scrape-time reader of the data path's verdict counters.
struct DatapathStats {
    read: VerdictReader,
}

impl fmt::Debug for DatapathStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatapathStats").finish_non_exhaustive()
    }
}

impl Collector for DatapathStats {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let Some(DatapathCounts { verdicts, conntrack }) = (self.read)() else {
            return Ok(());
        };
        encode_per_verdict(
            &mut encoder,
            "xproxy_datapath_packets",
            "Packets seen by the eBPF programs, by verdict",
            verdicts.iter().map(|(v, c)| (v.name(), c.packets)),
        )?;
        encode_per_verdict(
            &mut encoder,
            "xproxy_datapath_bytes",
            "Bytes (L3 length) seen by the eBPF programs, by verdict",
            verdicts.iter().map(|(v, c)| (v.name(), c.bytes)),
        )?;
        if let Some(ct) = conntrack {
            encode_conntrack(&mut encoder, &ct)?;
        }
        Ok(())
    }
}

/// The conntrack table's size, fill and turnover (see `ct_stat`).
fn encode_conntrack(encoder: &mut DescriptorEncoder, ct: &ConntrackCounts) -> fmt::Result {
    let gauges = [
        (
            "xproxy_conntrack_entries",
            "Entries in the eBPF conntrack table (two a flow) at the last sweep",
            ct.get(ct_stat::LIVE),
        ),
        (
            "xproxy_conntrack_max_entries",
            "Size of the eBPF conntrack table (two entries a flow)",
            u64::from(ct.max_entries),
        ),
    ];
    for (name, help, value) in gauges {
        let metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        ConstGauge::new(value as i64).encode(metric)?;
    }
    let counters = [
        (
            "xproxy_conntrack_inserted",
            "Conntrack entries the eBPF programs inserted",
            ct_stat::INSERTED,
        ),
        (
            "xproxy_conntrack_removed",
            "Conntrack entries the eBPF programs removed (flows that gave way to a new one on their tuple)",
            ct_stat::REMOVED,
        ),
        (
            "xproxy_conntrack_gc_deleted",
            "Conntrack entries of flows idle past their timeout that the agent's sweep deleted",
            ct_stat::EXPIRED,
        ),
        (
            "xproxy_conntrack_agent_deleted",
            "Conntrack entries the agent deleted (expired flows, UDP flows of endpoints that left)",
            ct_stat::AGENT_REMOVED,
        ),
        (
            "xproxy_conntrack_evictions",
            "Conntrack entries the kernel evicted from the full table (least recently used), up to the last sweep",
            ct_stat::EVICTED,
        ),
    ];
    for (name, help, index) in counters {
        let metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        ConstCounter::new(ct.get(index)).encode(metric)?;
    }
    Ok(())
}

fn encode_per_verdict(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl Iterator<Item = (&'static str, u64)>,
) -> fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (verdict, value) in values {
        let labels = [("verdict", verdict)];
        ConstCounter::new(value).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A reader of the stats map pinned under `pin_path`. A missing map reads
/// as "no data path" (nothing exported); a map that cannot be read is
/// warned about once and left out too.
pub(super) fn pinned_reader(pin_path: PathBuf) -> VerdictReader {
    let warned = AtomicBool::new(false);
    Box::new(move || match read_datapath_counts(&pin_path) {
        Ok(counts) => counts,
        Err(e) => {
            if !warned.swap(true, Ordering::Relaxed) {
                warn!(
                    error = format!("{e:#}"),
                    "cannot read the data path counters; leaving them out of /metrics"
                );
            }
            None
        }
    })
}

/// The verdict and conntrack counters pinned under `pin_path`; `None`
/// if no data path is pinned there.
pub fn read_datapath_counts(pin_path: &Path) -> Result<Option<DatapathCounts>> {
    let Some(verdicts) = read_verdict_counts(pin_path)? else {
        return Ok(None);
    };
    Ok(Some(DatapathCounts {
        verdicts,
        conntrack: read_conntrack_counts(pin_path)?,
    }))
}

/// Sums the per-CPU verdict counters of the stats map pinned under
/// `pin_path`; `None` if no such map is pinned. Opens the pin on every call,
/// so a data path that is loaded (or replaced) later is picked up.
pub fn read_verdict_counts(pin_path: &Path) -> Result<Option<Vec<(Verdict, VerdictCounter)>>> {
    let path = pin_path.join(maps::STATS);
    if !path
        .try_exists()
        .with_context(|| format!("looking for {}", path.display()))?
    {
        return Ok(None);
    }
    let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
    let stats: PerCpuArray<MapData, VerdictCounter> = PerCpuArray::try_from(Map::from_map_data(data)?)
        .with_context(|| format!("{} is not the stats map", path.display()))?;
    Ok(Some(crate::mode::ebpf::sum_verdicts(&stats)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_pin_reads_as_no_data_path() {
        let dir = std::env::temp_dir().join(format!("xproxy-no-pins-{}", std::process::id()));
        assert!(
            read_verdict_counts(&dir)
                .expect("a missing pin is not an error")
                .is_none()
        );
    }

    #[test]
    fn the_buckets_are_kube_proxys() {
        let buckets: Vec<f64> = sync_buckets().collect();
        assert_eq!(buckets.len(), 15);
        assert_eq!(buckets[0], 0.001);
        assert_eq!(buckets[14], 0.001 * 2f64.powi(14));
        assert_eq!(NETWORK_PROGRAMMING_BUCKETS.last(), Some(&300.0));
        assert!(NETWORK_PROGRAMMING_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }
}
