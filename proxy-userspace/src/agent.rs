//! The agent loop: source events -> model -> reconciler -> mode.
//!
//! One task owns the model and the reconciler, so there is no locking
//! around them; a sync runs in place (`block_in_place`), and events that
//! arrive meanwhile wait in the channel and are coalesced into the next one.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::Node;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::{
    model::{Cluster, Problem, object_key},
    reconcile::runner::{Reconciler, Schedule, SyncPolicy, SyncReport},
    source::{SourceEvent, Update},
};

/// What health and metrics need to know about the loop.
pub trait Observer: Send + Sync {
    /// A change arrived that is not programmed yet.
    fn change_queued(&self, at: Instant);
    /// A sync succeeded; `oldest_change` is when the oldest change it
    /// programmed arrived (for the network programming latency).
    fn synced(&self, report: &SyncReport, took: Duration, oldest_change: Option<Instant>);
    fn sync_failed(&self, error: &anyhow::Error);
    /// Objects (or parts) that were skipped.
    fn problems(&self, problems: &[Problem]);
    /// This node's Node object changed (`None`: deleted or not found).
    fn node_updated(&self, node: Option<&Node>);
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
    /// What the mode does not honour, as last logged (each is logged and
    /// counted once, not at every sync).
    logged_unsupported: Vec<Problem>,
    /// A (re)list came in since the last successful sync.
    relisted: bool,
    /// Runs after a sync that took in a (re)list (the binary hands the
    /// list's freed memory back to the kernel).
    after_relist_synced: Option<Box<dyn Fn() + Send>>,
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
            logged_unsupported: Vec::new(),
            relisted: false,
            after_relist_synced: None,
        }
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
                    Update::Replace(all) => self.cluster.replace_services(&all),
                }
            }
            SourceEvent::Slices(update) => {
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
                    Update::Replace(all) => self.cluster.replace_slices(&all),
                }
            }
            SourceEvent::Problems(problems) => problems,
            SourceEvent::Node(update) => {
                // Only health cares about the Node; the desired state is unchanged.
                match update {
                    Update::Apply(node) => self.observer.node_updated(Some(&node)),
                    Update::Delete(_) => self.observer.node_updated(None),
                    Update::Replace(nodes) => self.observer.node_updated(nodes.first()),
                }
                return;
            }
        };
        self.report_problems(&problems);
        let now = Instant::now();
        self.schedule.changed(now);
        self.observer.change_queued(now);
    }

    fn report_problems(&self, problems: &[Problem]) {
        for problem in problems {
            warn!(object = problem.object, reason = problem.reason, "skipped");
        }
        if !problems.is_empty() {
            self.observer.problems(problems);
        }
    }

    /// Logs and counts what the mode does not honour and was not reported
    /// at the last sync.
    fn report_unsupported(&mut self, unsupported: Vec<Problem>) {
        let new: Vec<Problem> = (unsupported.iter())
            .filter(|p| !self.logged_unsupported.contains(p))
            .cloned()
            .collect();
        for problem in &new {
            warn!(
                object = problem.object,
                mode = self.reconciler.mode_name(),
                reason = problem.reason,
                "not honoured by this mode"
            );
        }
        if !new.is_empty() {
            self.observer.problems(&new);
        }
        self.logged_unsupported = unsupported;
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
                self.observer.synced(&report, took, oldest_change);
                let unsupported = self.reconciler.unsupported(desired);
                self.report_unsupported(unsupported);
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nothing_is_programmed_until_both_kinds_are_listed() {
        let fake = Fake::default();
        let policy = SyncPolicy::new(Duration::from_millis(10), Duration::from_secs(30));
        let agent = Agent::new(Reconciler::new(Box::new(fake.clone())), policy, Arc::new(NullObserver));
        let (tx, rx) = mpsc::channel(16);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(agent.run(rx, async move { stopped.await.unwrap_or(()) }));

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
}
