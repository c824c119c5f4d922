//! The agent loop: source events -> model -> reconciler -> mode.
//!
//! One task owns the model and the reconciler, so there is no locking
//! around them; a sync runs in place (`block_in_place`), and events that
//! arrive meanwhile wait in the channel and are coalesced into the next one.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::Node;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::{
    mode::ModeCounters,
    model::{Cluster, NoLocalEndpoints, Problem, object_key},
    reconcile::runner::{Reconciler, Schedule, SyncPolicy, SyncReport},
    server::service_health::ServiceHealth,
    source::{SourceEvent, Update, node},
};

/// What health and metrics need to know about the loop.
pub trait Observer: Send + Sync {
    /// A change arrived that is not programmed yet.
    fn change_queued(&self, at: Instant);
    /// A sync succeeded; `oldest_change` is when the oldest change it
    /// programmed arrived at the agent.
    fn synced(&self, report: &SyncReport, took: Duration, oldest_change: Option<Instant>);
    /// The sync programmed slice changes whose causes happened at
    /// `trigger_times` (their `last-change-trigger-time` annotations).
    fn programmed(&self, trigger_times: &[SystemTime]) {
        let _ = trigger_times;
    }
    /// Changes received and not programmed yet, by kind (Service objects,
    /// EndpointSlice objects).
    fn pending(&self, services: usize, slices: usize) {
        let _ = (services, slices);
    }
    /// Service ports whose `Local` policy finds no endpoint on this node,
    /// for ClusterIP (internal) and external traffic.
    fn no_local_endpoints(&self, internal: usize, external: usize) {
        let _ = (internal, external);
    }
    fn sync_failed(&self, error: &anyhow::Error);
    /// Objects (or parts) that were skipped.
    fn problems(&self, problems: &[Problem]);
    /// This node's Node object changed (`None`: deleted or not found).
    fn node_updated(&self, node: Option<&Node>);
    /// The mode's own counts after a sync, failed or not.
    fn mode_counters(&self, counters: &ModeCounters) {
        let _ = counters;
    }
}

/// An observer that ignores everything (the agent loop logs by itself): for
/// tests that need no health or metrics.
pub struct NullObserver;

impl Observer for NullObserver {
    fn change_queued(&self, _at: Instant) {}
    fn synced(&self, _report: &SyncReport, _took: Duration, _oldest_change: Option<Instant>) {}
    fn sync_failed(&self, _error: &anyhow::Error) {}
    fn problems(&self, _problems: &[Problem]) {}
    fn node_updated(&self, _node: Option<&Node>) {}
}

pub struct Agent {
    cluster: Cluster,
    reconciler: Reconciler,
    schedule: Schedule,
    services_synced: bool,
    slices_synced: bool,
    observer: Arc<dyn Observer>,
    /// Problems of the desired state last logged, so a standing problem is
    /// not logged again at every sync.
    logged_problems: Vec<Problem>,
    /// A (re)list came in since the last successful sync.
    relisted: bool,
    /// Runs after a sync that took in a (re)list (the binary hands the
    /// list's freed memory back to the kernel).
    after_relist_synced: Option<Box<dyn Fn() + Send>>,
    /// Service and EndpointSlice objects changed since the last sync.
    pending: (usize, usize),
    /// This node's name, for the no-local-endpoints tally.
    node_name: Option<String>,
    no_local: NoLocalEndpoints,
    /// The health check node ports, brought up to date after each sync.
    service_health: Option<ServiceHealth>,
}

impl Agent {
    pub fn new(reconciler: Reconciler, policy: SyncPolicy, observer: Arc<dyn Observer>) -> Self {
        Self {
            cluster: Cluster::default(),
            reconciler,
            schedule: Schedule::new(policy),
            services_synced: false,
            slices_synced: false,
            observer,
            logged_problems: Vec::new(),
            relisted: false,
            after_relist_synced: None,
            pending: (0, 0),
            node_name: None,
            no_local: NoLocalEndpoints::default(),
            service_health: None,
        }
    }

    /// The node the agent runs on (the Local policies' endpoints).
    pub fn on_node(mut self, name: &str) -> Self {
        self.node_name = Some(name.to_owned());
        self
    }

    /// Serves the health check node ports of the programmed Services.
    pub fn with_service_health(mut self, service_health: ServiceHealth) -> Self {
        self.service_health = Some(service_health);
        self
    }

    /// Calls `hook` after each sync that took in a (re)list.
    pub fn after_relist_synced(mut self, hook: impl Fn() + Send + 'static) -> Self {
        self.after_relist_synced = Some(Box::new(hook));
        self
    }

    /// Nothing is programmed before Services and EndpointSlices have both
    /// been listed completely: a half-known state would delete Services.
    fn ready(&self) -> bool {
        self.services_synced && self.slices_synced
    }

    /// Runs until `shutdown` resolves. Returns an error if every source
    /// went away (the channel closed), which only happens on a bug.
    pub async fn run(
        mut self,
        mut events: mpsc::Receiver<SourceEvent>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<()> {
        tokio::pin!(shutdown);
        loop {
            let next = self
                .ready()
                .then(|| tokio::time::Instant::from_std(self.schedule.next_sync()));
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                event = events.recv() => match event {
                    Some(event) => self.handle(event),
                    None => bail!("every source stopped"),
                },
                () = sleep_until_some(next) => self.sync(),
            }
        }
    }

    fn handle(&mut self, event: SourceEvent) {
        let problems = match event {
            SourceEvent::Services(update) => {
                self.pending.0 += update.object_count();
                if matches!(update, Update::Replace(_)) {
                    self.services_synced = true;
                    self.relisted = true;
                }
                match update {
                    Update::Apply(svc) => self.cluster.upsert_service(&svc),
                    Update::Delete(svc) => {
                        self.cluster.delete_service(&object_key(&svc.metadata));
                        vec![]
                    }
                    Update::ListBegin => {
                        self.cluster.begin_services_list();
                        return;
                    }
                    Update::Listed(part) => self.cluster.list_services(&part),
                    Update::Replace(rest) => self.cluster.replace_services(&rest),
                }
            }
            SourceEvent::Slices(update) => {
                self.pending.1 += update.object_count();
                if matches!(update, Update::Replace(_)) {
                    self.slices_synced = true;
                    self.relisted = true;
                }
                match update {
                    Update::Apply(slice) => self.cluster.upsert_slice(&slice),
                    Update::Delete(slice) => {
                        self.cluster.delete_slice(&object_key(&slice.metadata));
                        vec![]
                    }
                    Update::ListBegin => {
                        self.cluster.begin_slices_list();
                        return;
                    }
                    Update::Listed(part) => self.cluster.list_slices(&part),
                    Update::Replace(rest) => self.cluster.replace_slices(&rest),
                }
            }
            SourceEvent::Problems(problems) => problems,
            SourceEvent::Node(update) => {
                let node = match &update {
                    Update::Apply(node) => Some(node),
                    Update::Delete(_) => None,
                    // The watch selects one Node by name: its list is one part.
                    Update::ListBegin => return,
                    Update::Listed(nodes) | Update::Replace(nodes) => nodes.first(),
                };
                self.observer.node_updated(node);
                // A Node that is gone keeps its last zone: its endpoints
                // stay as they were programmed until it comes back.
                if let Some(node) = node
                    && self.cluster.set_node_zone(node::zone(node))
                {
                    info!(
                        zone = node::zone(node),
                        "this node's zone changed; re-joining Services with topology hints"
                    );
                    vec![]
                } else {
                    return;
                }
            }
        };
        self.report_problems(&problems);
        let now = Instant::now();
        self.schedule.changed(now);
        self.observer.change_queued(now);
        self.observer.pending(self.pending.0, self.pending.1);
    }

    fn report_problems(&self, problems: &[Problem]) {
        for problem in problems {
            warn!(object = problem.object, reason = problem.reason, "skipped");
        }
        if !problems.is_empty() {
            self.observer.problems(problems);
        }
    }

    fn sync(&mut self) {
        let now = Instant::now();
        let changed = self.cluster.refresh();
        let problems = self.cluster.problems();
        if problems != self.logged_problems {
            self.report_problems(&problems);
            self.logged_problems = problems;
        }
        let full = self.schedule.full_due(now);
        let oldest_change = self.schedule.pending_since();
        let desired = self.cluster.ports();
        let result = tokio::task::block_in_place(|| self.reconciler.sync(desired, &changed, full));
        let took = now.elapsed();
        self.schedule.record(now, full, result.is_ok());
        match result {
            Ok(report) => {
                if report.service_changes > 0 || full {
                    info!(
                        mode = self.reconciler.mode_name(),
                        full,
                        services = desired.len(),
                        changed = report.service_changes,
                        kernel_writes = report.kernel_writes,
                        stale_udp_flow_deletions = report.stale_flow_deletions,
                        took_ms = took.as_secs_f64() * 1e3,
                        "synced"
                    );
                } else {
                    debug!(took_ms = took.as_secs_f64() * 1e3, "synced, nothing changed");
                }
                self.report_problems(&report.problems);
                self.observer.synced(&report, took, oldest_change);
                if let Some(service_health) = &mut self.service_health {
                    service_health.update(desired, &changed, full);
                }
                // A full sync re-checks every port (and heals a tally that
                // missed the changes of a failed sync).
                let checked = if full {
                    desired.keys().cloned().collect()
                } else {
                    changed
                };
                let (internal, external) = self.no_local.update(desired, &checked, self.node_name.as_deref());
                self.observer.no_local_endpoints(internal, external);
                self.observer.programmed(&self.cluster.take_trigger_times());
                self.pending = (0, 0);
                self.observer.pending(0, 0);
                if std::mem::take(&mut self.relisted)
                    && let Some(hook) = &self.after_relist_synced
                {
                    hook();
                }
            }
            Err(e) => {
                warn!(error = format!("{e:#}"), "sync failed; retrying with a full sync");
                self.observer.sync_failed(&e);
            }
        }
        self.observer.mode_counters(&self.reconciler.mode_counters());
    }
}

async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use serde_json::json;

    use super::*;
    use crate::mode::fake::{Call, Fake};

    fn svc() -> Service {
        serde_json::from_value(json!({"metadata": {"name": "web", "namespace": "default"},
            "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}))
        .unwrap()
    }

    fn slice(ip: &str) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"port": 8080}], "endpoints": [{"addresses": [ip]}]}))
        .unwrap()
    }

    async fn next_programmed(fake: &Fake, want: impl Fn(&Fake) -> bool) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !want(fake) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the agent programmed the expected state in time");
    }

    /// Runs an agent programming `fake` (10 ms minimum sync interval):
    /// its event sender, its stop switch and its task.
    fn spawn_agent(
        fake: &Fake,
    ) -> (
        mpsc::Sender<SourceEvent>,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<()>>,
    ) {
        let policy = SyncPolicy::new(Duration::from_millis(10), Duration::from_secs(30));
        let agent = Agent::new(Reconciler::new(Box::new(fake.clone())), policy, Arc::new(NullObserver));
        let (tx, rx) = mpsc::channel(16);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(agent.run(rx, async move { stopped.await.unwrap_or(()) }));
        (tx, stop, task)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nothing_is_programmed_until_both_kinds_are_listed() {
        let fake = Fake::default();
        let (tx, stop, task) = spawn_agent(&fake);

        tx.send(SourceEvent::Services(Update::Replace(vec![svc()])))
            .await
            .unwrap();
        tx.send(SourceEvent::Slices(Update::Apply(slice("10.244.0.1"))))
            .await
            .unwrap();
        // Services are listed, slices only half: a sync now would program
        // 10.244.0.1, which the complete list below no longer has.
        tx.send(SourceEvent::Slices(Update::Replace(vec![slice("10.244.0.2")])))
            .await
            .unwrap();
        next_programmed(&fake, |f| {
            f.programmed()
                .get("default/web")
                .is_some_and(|p| p.endpoints.len() == 1)
        })
        .await;
        match &fake.calls()[0] {
            Call::ApplyFull(first) => {
                assert_eq!(
                    first["default/web"].endpoints[0].addr.to_string(),
                    "10.244.0.2",
                    "synced too early"
                );
            }
            other @ Call::Apply(_) => panic!("the first sync must be a full one, got {other:?}"),
        }

        tx.send(SourceEvent::Services(Update::Delete(svc()))).await.unwrap();
        next_programmed(&fake, |f| f.programmed().is_empty()).await;
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_list_in_parts_is_programmed_once_it_ends_and_a_relist_drops_what_it_lacks() {
        let fake = Fake::default();
        let (tx, stop, task) = spawn_agent(&fake);
        let named = |name: &str, ip: &str| {
            let mut slice = slice(ip);
            slice.metadata.name = Some(name.to_owned());
            slice
        };
        let addrs = |f: &Fake| -> Vec<String> {
            f.programmed()
                .get("default/web")
                .map(|p| p.endpoints.iter().map(|e| e.addr.to_string()).collect())
                .unwrap_or_default()
        };
        let send = |update| tx.send(SourceEvent::Slices(update));
        tx.send(SourceEvent::Services(Update::Replace(vec![svc()])))
            .await
            .unwrap();
        send(Update::ListBegin).await.unwrap();
        send(Update::Listed(vec![named("web-1", "10.244.0.1")])).await.unwrap();
        send(Update::Replace(vec![named("web-2", "10.244.0.2")])).await.unwrap();
        next_programmed(&fake, |f| addrs(f).len() == 2).await;
        match &fake.calls()[0] {
            Call::ApplyFull(first) => assert_eq!(first["default/web"].endpoints.len(), 2, "synced too early"),
            other @ Call::Apply(_) => panic!("the first sync must be a full one, got {other:?}"),
        }

        // A relist (after 410 Gone) in parts that no longer has web-1.
        send(Update::ListBegin).await.unwrap();
        send(Update::Listed(vec![named("web-2", "10.244.0.2")])).await.unwrap();
        send(Update::Replace(vec![named("web-3", "10.244.0.3")])).await.unwrap();
        next_programmed(&fake, |f| addrs(f) == ["10.244.0.2", "10.244.0.3"]).await;
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_relist_hook_runs_after_the_sync_that_took_the_lists_only() {
        let fake = Fake::default();
        let policy = SyncPolicy::new(Duration::from_millis(10), Duration::from_secs(30));
        let hook_runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = hook_runs.clone();
        let agent = Agent::new(Reconciler::new(Box::new(fake.clone())), policy, Arc::new(NullObserver))
            .after_relist_synced(move || {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        let (tx, rx) = mpsc::channel(16);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(agent.run(rx, async move { stopped.await.unwrap_or(()) }));
        let runs = || hook_runs.load(std::sync::atomic::Ordering::SeqCst);

        tx.send(SourceEvent::Services(Update::Replace(vec![svc()])))
            .await
            .unwrap();
        assert_eq!(runs(), 0, "nothing synced before both kinds are listed");
        tx.send(SourceEvent::Slices(Update::Replace(vec![slice("10.244.0.1")])))
            .await
            .unwrap();
        // The hook runs right after the programming: wait for it.
        next_programmed(&fake, |f| f.programmed().contains_key("default/web") && runs() == 1).await;

        // A watch event is no relist.
        tx.send(SourceEvent::Slices(Update::Apply(slice("10.244.0.2"))))
            .await
            .unwrap();
        next_programmed(&fake, |f| {
            f.programmed()
                .get("default/web")
                .is_some_and(|p| p.endpoints[0].addr.to_string() == "10.244.0.2")
        })
        .await;
        assert_eq!(runs(), 1);

        tx.send(SourceEvent::Slices(Update::Replace(vec![slice("10.244.0.3")])))
            .await
            .unwrap();
        next_programmed(&fake, |f| {
            f.programmed()
                .get("default/web")
                .is_some_and(|p| p.endpoints[0].addr.to_string() == "10.244.0.3")
                && runs() == 2
        })
        .await;
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_nodes_zone_label_reprograms_services_with_zone_hints() {
        let fake = Fake::default();
        let (tx, stop, task) = spawn_agent(&fake);
        let node = |zone: &str| -> Node {
            serde_json::from_value(json!({"metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": zone}}}))
                .unwrap()
        };
        let hinted: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"port": 8080}], "endpoints": [
                {"addresses": ["10.244.0.1"], "hints": {"forZones": [{"name": "z1"}]}},
                {"addresses": ["10.244.0.2"], "hints": {"forZones": [{"name": "z2"}]}}]}))
        .unwrap();
        tx.send(SourceEvent::Node(Update::Replace(vec![node("z1")])))
            .await
            .unwrap();
        tx.send(SourceEvent::Services(Update::Replace(vec![svc()])))
            .await
            .unwrap();
        tx.send(SourceEvent::Slices(Update::Replace(vec![hinted])))
            .await
            .unwrap();
        let zone_is = |zone: &'static str| {
            move |f: &Fake| {
                f.programmed()
                    .get("default/web")
                    .is_some_and(|p| p.node_zone.as_deref() == Some(zone))
            }
        };
        next_programmed(&fake, zone_is("z1")).await;
        tx.send(SourceEvent::Node(Update::Apply(node("z2")))).await.unwrap();
        next_programmed(&fake, zone_is("z2")).await;
        let programmed = fake.programmed();
        let sets = crate::model::EndpointSets::of(&programmed["default/web"], Some("n1"));
        assert_eq!(
            sets.cluster.iter().map(|e| e.addr.to_string()).collect::<Vec<_>>(),
            ["10.244.0.2"]
        );
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }
}
