//! Proxier health, the way kube-proxy's `ProxierHealthServer` judges it.
//!
//! The proxy is healthy while no change waits, or while the oldest waiting
//! change has waited less than the timeout (kube-proxy: 2 × syncPeriod). A
//! sync that succeeds clears the wait; a failed one does not. Before the
//! first sync the same rule holds: a proxy that has not programmed anything
//! is healthy until a change has waited longer than the timeout, and then
//! unhealthy until the first sync succeeds. That is `/livez`.
//!
//! `/healthz` (readiness) is 503 until the first sync as well: an agent
//! waiting for an API server it cannot reach yet has programmed nothing and
//! must not be counted ready, but it is alive and must not be restarted.
//!
//! `/healthz` is also 503 while the node is being deleted (deletion
//! timestamp, or the Cluster Autoscaler's taint), so that load balancers
//! drain it; `/livez` ignores the node, so kubelet does not restart a proxy
//! that is fine on a node going away.
//!
//! The state is a plain struct driven by explicit instants, so tests need
//! no clock.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::Node;
use serde::Serialize;

/// The taint the Cluster Autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// kube-proxy (Go) prints its zero time when nothing was ever programmed.
const NEVER: &str = "0001-01-01T00:00:00Z";

/// Which endpoint is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// `/healthz`: the proxy is healthy and the node is not being deleted.
    Healthz,
    /// `/livez`: the proxy is healthy, whatever the node.
    Livez,
}

/// The answer to one probe: status and JSON body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub healthy: bool,
    pub body: String,
}

impl Answer {
    /// 200 or 503, like kube-proxy.
    pub fn status(&self) -> u16 {
        if self.healthy { 200 } else { 503 }
    }
}

/// The JSON kube-proxy answers (same keys, same order).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Body {
    last_updated: String,
    current_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
}

#[derive(Clone, Debug)]
pub struct ProxierHealth {
    timeout: Duration,
    /// Wall time of the last successful sync.
    last_updated: Option<SystemTime>,
    /// When the oldest change not yet programmed arrived.
    oldest_pending: Option<Instant>,
    /// False while the node is being deleted.
    node_eligible: bool,
}

impl ProxierHealth {
    /// `timeout` is how long a change may wait to be programmed; kube-proxy
    /// uses 2 × syncPeriod. The node counts as eligible until told otherwise.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            last_updated: None,
            oldest_pending: None,
            node_eligible: true,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A change arrived at `at`; only the first one since the last sync counts.
    pub fn queued(&mut self, at: Instant) {
        self.oldest_pending.get_or_insert(at);
    }

    /// A sync succeeded (at wall time `at`): nothing is pending any more.
    pub fn updated(&mut self, at: SystemTime) {
        self.oldest_pending = None;
        self.last_updated = Some(at);
    }

    pub fn set_node_eligible(&mut self, eligible: bool) {
        self.node_eligible = eligible;
    }

    pub fn node_eligible(&self) -> bool {
        self.node_eligible
    }

    /// The proxy's own health, ignoring the node (kube-proxy's `IsHealthy`).
    pub fn is_healthy(&self, now: Instant) -> bool {
        self.oldest_pending
            .is_none_or(|since| now.saturating_duration_since(since) < self.timeout)
    }

    /// Answers a probe at `now` (`wall` is the same moment on the wall clock,
    /// for the body). Like kube-proxy, a healthy answer reports `lastUpdated`
    /// as the current time (older releases synced all the time, and clients
    /// read a recent `lastUpdated` as "healthy"); an unhealthy one reports the
    /// last successful sync.
    pub fn answer(&self, probe: Probe, now: Instant, wall: SystemTime) -> Answer {
        let proxier_healthy = self.is_healthy(now);
        let (healthy, node_eligible) = match probe {
            Probe::Healthz => (
                proxier_healthy && self.node_eligible && self.last_updated.is_some(),
                Some(self.node_eligible),
            ),
            Probe::Livez => (proxier_healthy, None),
        };
        let current_time = rfc3339(wall);
        let last_updated = if healthy {
            current_time.clone()
        } else {
            self.last_updated.map_or_else(|| NEVER.to_owned(), rfc3339)
        };
        let body = serde_json::to_string(&Body {
            last_updated,
            current_time,
            node_eligible,
        })
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
        Answer { healthy, body }
    }
}

/// Whether `node` is going away: kube-proxy's rule for failing `/healthz`
/// (a deletion timestamp, or the Cluster Autoscaler's to-be-deleted taint).
pub fn node_is_deleting(node: &Node) -> bool {
    node.metadata.deletion_timestamp.is_some()
        || node
            .spec
            .as_ref()
            .and_then(|spec| spec.taints.as_ref())
            .is_some_and(|taints| taints.iter().any(|taint| taint.key == TO_BE_DELETED_TAINT))
}

/// RFC 3339 in UTC, e.g. `2024-05-01T12:00:00.25Z`.
pub(super) fn rfc3339(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t).map_or_else(|_| NEVER.to_owned(), |ts| ts.to_string())
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(60);

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn wall(unix: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + secs(unix)
    }

    fn body(answer: &Answer) -> Value {
        serde_json::from_str(&answer.body).expect("the body is JSON")
    }

    #[test]
    fn healthy_at_start_and_while_nothing_waits() {
        let t0 = Instant::now();
        let h = ProxierHealth::new(TIMEOUT);
        assert!(h.is_healthy(t0));
        // Nothing pending: healthy however long nothing happens.
        assert!(h.is_healthy(t0 + secs(3600)));
    }

    #[test]
    fn before_the_first_sync_a_change_may_wait_up_to_the_timeout() {
        let t0 = Instant::now();
        let mut h = ProxierHealth::new(TIMEOUT);
        h.queued(t0);
        assert!(h.is_healthy(t0 + secs(59)));
        assert!(!h.is_healthy(t0 + TIMEOUT), "the timeout itself is already late");
        assert!(!h.is_healthy(t0 + secs(600)), "stays unhealthy until the first sync");
        h.updated(wall(1_700_000_000));
        assert!(h.is_healthy(t0 + secs(600)));
    }

    #[test]
    fn the_oldest_pending_change_counts_not_the_newest() {
        let t0 = Instant::now();
        let mut h = ProxierHealth::new(TIMEOUT);
        h.updated(wall(1_700_000_000));
        h.queued(t0);
        h.queued(t0 + secs(50));
        assert!(
            !h.is_healthy(t0 + secs(61)),
            "a stream of changes must not hide a stuck sync"
        );
    }

    #[test]
    fn a_sync_clears_the_wait_and_the_next_change_starts_a_new_one() {
        let t0 = Instant::now();
        let mut h = ProxierHealth::new(TIMEOUT);
        h.queued(t0);
        h.updated(wall(1_700_000_000));
        h.queued(t0 + secs(100));
        assert!(h.is_healthy(t0 + secs(159)));
        assert!(!h.is_healthy(t0 + secs(160)));
    }

    #[test]
    fn a_failed_sync_does_not_clear_the_wait() {
        // Failures only show as time passing without `updated`.
        let t0 = Instant::now();
        let mut h = ProxierHealth::new(TIMEOUT);
        h.updated(wall(1_700_000_000));
        h.queued(t0);
        assert!(!h.is_healthy(t0 + secs(61)));
    }

    #[test]
    fn healthz_waits_for_the_first_sync_livez_does_not() {
        let t0 = Instant::now();
        let mut h = ProxierHealth::new(TIMEOUT);
        let statuses = |h: &ProxierHealth| {
            (
                h.answer(Probe::Healthz, t0, wall(1_700_000_000)).status(),
                h.answer(Probe::Livez, t0, wall(1_700_000_000)).status(),
            )
        };
        assert_eq!(statuses(&h), (503, 200), "never synced: alive, not ready");
        h.updated(wall(1_700_000_000));
        assert_eq!(statuses(&h), (200, 200));
    }

    #[test]
    fn a_node_being_deleted_fails_healthz_but_not_livez() {
        let t0 = Instant::now();
        let mut h = ProxierHealth::new(TIMEOUT);
        h.updated(wall(1_700_000_000));
        h.set_node_eligible(false);
        let healthz = h.answer(Probe::Healthz, t0, wall(1_700_000_000));
        let livez = h.answer(Probe::Livez, t0, wall(1_700_000_000));
        assert_eq!((healthz.status(), livez.status()), (503, 200));
        assert_eq!(body(&healthz)["nodeEligible"], json!(false));
        assert!(
            body(&livez).get("nodeEligible").is_none(),
            "livez does not talk about the node"
        );

        h.set_node_eligible(true);
        assert_eq!(h.answer(Probe::Healthz, t0, wall(1_700_000_000)).status(), 200);
    }

    #[test]
    fn an_unhealthy_proxy_fails_both() {
        let t0 = Instant::now();
        let mut h = ProxierHealth::new(TIMEOUT);
        h.queued(t0);
        let late = t0 + secs(61);
        assert_eq!(h.answer(Probe::Healthz, late, wall(1_700_000_061)).status(), 503);
        assert_eq!(h.answer(Probe::Livez, late, wall(1_700_000_061)).status(), 503);
    }

    #[test]
    fn bodies_carry_kube_proxys_keys_and_times() {
        let t0 = Instant::now();
        let mut synced = ProxierHealth::new(TIMEOUT);
        synced.updated(wall(1_699_999_000));
        // Healthy: lastUpdated is the current time, for old clients.
        let ok = synced.answer(Probe::Healthz, t0, wall(1_700_000_000));
        assert_eq!(
            ok.body,
            r#"{"lastUpdated":"2023-11-14T22:13:20Z","currentTime":"2023-11-14T22:13:20Z","nodeEligible":true}"#
        );
        // Never synced and late: Go's zero time, like kube-proxy.
        let mut h = ProxierHealth::new(TIMEOUT);
        h.queued(t0);
        let never = h.answer(Probe::Livez, t0 + secs(61), wall(1_700_000_061));
        assert_eq!(
            never.body,
            r#"{"lastUpdated":"0001-01-01T00:00:00Z","currentTime":"2023-11-14T22:14:21Z"}"#
        );
        // Synced once, then late: the last successful sync.
        h.updated(wall(1_700_000_100));
        h.queued(t0 + secs(100));
        let late = h.answer(Probe::Livez, t0 + secs(200), wall(1_700_000_200));
        assert_eq!(body(&late)["lastUpdated"], json!("2023-11-14T22:15:00Z"));
    }

    fn node(value: Value) -> Node {
        serde_json::from_value(value).expect("a valid Node")
    }

    #[test]
    fn node_deletion_is_a_timestamp_or_the_autoscaler_taint() {
        assert!(!node_is_deleting(&node(json!({"metadata": {"name": "n1"}}))));
        assert!(node_is_deleting(&node(json!({
            "metadata": {"name": "n1", "deletionTimestamp": "2024-01-01T00:00:00Z"}}))));
        assert!(node_is_deleting(&node(json!({"metadata": {"name": "n1"},
            "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}))));
        assert!(!node_is_deleting(&node(json!({"metadata": {"name": "n1"},
            "spec": {"taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}}))));
    }
}
