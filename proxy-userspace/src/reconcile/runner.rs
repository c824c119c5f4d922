//! When to sync, and the sync itself.
//!
//! Like kube-proxy's sync runner: changes are coalesced (a sync may follow
//! another at once, but after a burst of two, syncs wait so that on average
//! at most one runs per `min_sync_period`), everything is re-applied every `sync_period` (a full
//! sync repairs state someone else changed), and a failed sync is retried
//! after `retry_period` as a full one. Nothing is programmed before every
//! source has delivered its first complete list.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use anyhow::Result;

use super::{diff, diff_of};
use crate::{
    mode::{Dataplane, ModeCounters, SyncedChange},
    model::{Problem, ServicePort},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncPolicy {
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    pub retry_period: Duration,
}

impl SyncPolicy {
    /// kube-proxy's retry: as soon as coalescing allows, but not in a busy loop.
    pub fn new(min_sync_period: Duration, sync_period: Duration) -> Self {
        let retry_period = min_sync_period
            .max(Duration::from_secs(1))
            .min(sync_period.max(Duration::from_secs(1)));
        Self {
            min_sync_period,
            sync_period,
            retry_period,
        }
    }
}

/// Syncs that may run back to back before `min_sync_period` applies
/// (kube-proxy's burstSyncs): a Service and its EndpointSlice arriving a
/// moment apart are then both programmed at once, not one a period later.
const BURST_SYNCS: f64 = 2.0;

/// Pure timing state: tests drive it with made-up instants.
#[derive(Clone, Debug)]
pub struct Schedule {
    policy: SyncPolicy,
    last_sync: Option<Instant>,
    last_full: Option<Instant>,
    pending_since: Option<Instant>,
    failed: bool,
    /// Token bucket of sync permits: `tokens` at `tokens_at`, refilled by
    /// one per `min_sync_period`, at most [`BURST_SYNCS`].
    tokens: f64,
    tokens_at: Option<Instant>,
}

impl Schedule {
    pub fn new(policy: SyncPolicy) -> Self {
        Self {
            policy,
            last_sync: None,
            last_full: None,
            pending_since: None,
            failed: false,
            tokens: BURST_SYNCS,
            tokens_at: None,
        }
    }

    fn tokens(&self, now: Instant) -> f64 {
        let period = self.policy.min_sync_period.as_secs_f64();
        match self.tokens_at {
            Some(at) if period > 0.0 => {
                (self.tokens + now.saturating_duration_since(at).as_secs_f64() / period).min(BURST_SYNCS)
            }
            _ => BURST_SYNCS,
        }
    }

    /// The earliest instant from `from` on at which a sync permit is free.
    fn permit_from(&self, from: Instant) -> Instant {
        let tokens = self.tokens(from);
        if tokens >= 1.0 {
            from
        } else {
            from + self.policy.min_sync_period.mul_f64(1.0 - tokens)
        }
    }

    /// Something in the desired state changed at `now`.
    pub fn changed(&mut self, now: Instant) {
        self.pending_since.get_or_insert(now);
    }

    /// When the oldest change not yet programmed arrived.
    pub fn pending_since(&self) -> Option<Instant> {
        self.pending_since
    }

    /// When the next sync should run (may be in the past: run it now).
    pub fn next_sync(&self) -> Instant {
        let Some(last) = self.last_sync else {
            return self.pending_since.unwrap_or_else(Instant::now);
        };
        if self.failed {
            return last + self.policy.retry_period;
        }
        let full_due = self.last_full.unwrap_or(last) + self.policy.sync_period;
        match self.pending_since {
            Some(since) => self.permit_from(since).min(full_due),
            None => full_due,
        }
    }

    /// Whether a sync at `now` must be a full one.
    pub fn full_due(&self, now: Instant) -> bool {
        self.failed || self.last_full.is_none_or(|full| now >= full + self.policy.sync_period)
    }

    pub fn record(&mut self, now: Instant, full: bool, ok: bool) {
        self.tokens = (self.tokens(now) - 1.0).max(0.0);
        self.tokens_at = Some(now);
        self.last_sync = Some(now);
        self.failed = !ok;
        if ok {
            self.pending_since = None;
            if full {
                self.last_full = Some(now);
            }
        }
    }
}

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub full: bool,
    pub service_changes: usize,
    pub endpoint_changes: usize,
    /// Kernel writes the mode issued (0 when everything was in place).
    pub kernel_writes: u64,
    /// Deletions of UDP flows the sync left stale, as the mode counts them
    /// ([`Dataplane::delete_stale_flows`]).
    pub stale_flow_deletions: u64,
    /// What the mode could not honour ([`Dataplane::take_problems`]).
    pub problems: Vec<Problem>,
}

/// Holds the mode and what it was last told successfully.
pub struct Reconciler {
    mode: Box<dyn Dataplane>,
    /// Ports of a family the mode does not program, already reported.
    unserved: BTreeSet<String>,
    applied: BTreeMap<String, ServicePort>,
    /// Whether `applied` is what the kernel had before the current sync:
    /// not at start (an earlier run may have left anything) nor after a
    /// failure.
    applied_known: bool,
}

impl Reconciler {
    pub fn new(mode: Box<dyn Dataplane>) -> Self {
        Self {
            mode,
            unserved: BTreeSet::new(),
            applied: BTreeMap::new(),
            applied_known: false,
        }
    }

    pub fn mode_name(&self) -> &'static str {
        self.mode.name()
    }

    /// The mode's own counts ([`Dataplane::counters`]).
    pub fn mode_counters(&self) -> ModeCounters {
        self.mode.counters()
    }

    /// Brings the mode to `desired`: everything if `full`, else the ports
    /// named in `changed` (every port whose entry differs from the last
    /// successful sync must be named there). After a failure nothing is
    /// assumed about the kernel: the caller makes the next sync a full one.
    pub fn sync(
        &mut self,
        desired: &BTreeMap<String, ServicePort>,
        changed: &BTreeSet<String>,
        full: bool,
    ) -> Result<SyncReport> {
        let (served, unserved_problems) = self.served(desired, changed, full);
        let desired = served.as_ref().unwrap_or(desired);
        let plan = if full {
            diff(desired, &self.applied)
        } else {
            diff_of(changed, desired, &self.applied)
        };
        let mut report = SyncReport {
            full,
            service_changes: plan.upsert.len() + plan.remove.len(),
            endpoint_changes: plan.endpoint_changes(),
            kernel_writes: 0,
            stale_flow_deletions: 0,
            problems: Vec::new(),
        };
        let writes_before = self.mode.kernel_writes();
        let result = if full {
            self.mode.apply_full(desired)
        } else if plan.is_empty() {
            Ok(())
        } else {
            self.mode.apply(&plan)
        };
        if let Err(e) = result {
            self.applied.clear();
            self.applied_known = false;
            return Err(e);
        }
        report.kernel_writes = self.mode.kernel_writes() - writes_before;
        report.problems = unserved_problems;
        report.problems.extend(self.mode.take_problems());
        // After the new state is in place, so the flows' next packets pick
        // a current endpoint.
        report.stale_flow_deletions = self.mode.delete_stale_flows(&SyncedChange {
            plan: &plan,
            before: self.applied_known.then_some(&self.applied),
            after: desired,
            full,
        });
        if full {
            self.applied = desired.clone();
        } else {
            for name in changed {
                match desired.get(name) {
                    Some(port) => self.applied.insert(name.clone(), port.clone()),
                    None => self.applied.remove(name),
                };
            }
        }
        self.applied_known = true;
        Ok(report)
    }
}

impl Reconciler {
    /// `desired` without the ports of families the mode does not program
    /// (`None`: nothing to leave out, use `desired` as it is), and a
    /// problem for each such port not reported before.
    fn served(
        &mut self,
        desired: &BTreeMap<String, ServicePort>,
        changed: &BTreeSet<String>,
        full: bool,
    ) -> (Option<BTreeMap<String, ServicePort>>, Vec<Problem>) {
        let families = self.mode.families();
        let serves = |port: &ServicePort| families.contains(&port.family());
        let mut problems = Vec::new();
        // A partial sync looks at the changed ports only: the others were
        // judged before and are the same.
        let to_judge: Vec<&ServicePort> = if full {
            self.unserved
                .retain(|name| desired.get(name).is_some_and(|p| !serves(p)));
            desired.values().collect()
        } else {
            self.unserved
                .retain(|name| !changed.contains(name) || desired.get(name).is_some_and(|p| !serves(p)));
            changed.iter().filter_map(|name| desired.get(name)).collect()
        };
        for port in to_judge.into_iter().filter(|p| !serves(p)) {
            if self.unserved.insert(port.name.clone()) {
                problems.push(Problem::new(
                    &port.name,
                    format!(
                        "{} is not served by the {} mode",
                        port.family().name(),
                        self.mode.name()
                    ),
                ));
            }
        }
        if self.unserved.is_empty() {
            return (None, problems);
        }
        let served = desired.iter().filter(|(_, p)| serves(p));
        (Some(served.map(|(n, p)| (n.clone(), p.clone())).collect()), problems)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        mode::fake::{Call, Fake},
        model::{Endpoint, Protocol},
    };

    const MIN: Duration = Duration::from_secs(1);
    const FULL: Duration = Duration::from_secs(30);

    fn schedule() -> Schedule {
        Schedule::new(SyncPolicy::new(MIN, FULL))
    }

    #[test]
    fn first_sync_is_full_and_immediate() {
        let t0 = Instant::now();
        let mut s = schedule();
        s.changed(t0);
        assert_eq!(s.next_sync(), t0);
        assert!(s.full_due(t0));
    }

    #[test]
    fn two_syncs_may_run_back_to_back_then_one_per_min_period() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = schedule();
        s.record(t0, true, true);
        // The second sync of a burst goes out at once...
        s.changed(t0 + ms(100));
        s.changed(t0 + ms(150));
        assert_eq!(s.next_sync(), t0 + ms(100));
        s.record(t0 + ms(100), false, true);
        // ...the third waits until a permit has refilled.
        s.changed(t0 + ms(200));
        let next = s.next_sync();
        assert!(next > t0 + ms(900) && next <= t0 + ms(1100), "{:?}", next - t0);
        assert!(!s.full_due(next));
        // A change long after the last sync goes out at once.
        s.record(next, false, true);
        s.changed(next + Duration::from_secs(5));
        assert_eq!(s.next_sync(), next + Duration::from_secs(5));
    }

    #[test]
    fn a_zero_min_sync_period_never_holds_a_change_back() {
        let t0 = Instant::now();
        let mut s = Schedule::new(SyncPolicy::new(Duration::ZERO, FULL));
        for i in 0..5 {
            let at = t0 + Duration::from_millis(i);
            s.changed(at);
            assert_eq!(s.next_sync(), at);
            s.record(at, i == 0, true);
        }
    }

    #[test]
    fn idle_state_resyncs_fully_every_sync_period() {
        let t0 = Instant::now();
        let mut s = schedule();
        s.record(t0, true, true);
        assert_eq!(s.next_sync(), t0 + FULL);
        assert!(s.full_due(t0 + FULL));
    }

    #[test]
    fn a_failure_is_retried_as_a_full_sync() {
        let t0 = Instant::now();
        let mut s = schedule();
        s.record(t0, true, true);
        s.changed(t0 + Duration::from_secs(2));
        s.record(t0 + Duration::from_secs(2), false, false);
        assert_eq!(s.next_sync(), t0 + Duration::from_secs(3));
        assert!(s.full_due(t0 + Duration::from_secs(3)));
        assert!(s.pending_since().is_some(), "the change is still pending");
    }

    fn desired(endpoints: &[u8]) -> BTreeMap<String, ServicePort> {
        let port = ServicePort {
            name: "default/web".into(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(10, 96, 0, 1).into(),
            port: 80,
            node_port: None,
            endpoints: endpoints
                .iter()
                .map(|e| Endpoint::ready(Ipv4Addr::new(10, 244, 0, *e), 80))
                .collect(),
            ..ServicePort::default()
        };
        BTreeMap::from([(port.name.clone(), port)])
    }

    #[test]
    fn partial_syncs_send_only_the_diff_and_failures_force_a_full_sync() {
        let fake = Fake::default();
        let mut r = Reconciler::new(Box::new(fake.clone()));
        let web = BTreeSet::from(["default/web".to_string()]);
        let none = BTreeSet::new();
        r.sync(&desired(&[1]), &none, true).unwrap();
        r.sync(&desired(&[1]), &none, false).unwrap();
        assert_eq!(fake.calls().len(), 1, "an unchanged state is not sent again");
        let report = r.sync(&desired(&[1, 2]), &web, false).unwrap();
        assert_eq!((report.service_changes, report.endpoint_changes), (1, 2));
        assert!(matches!(&fake.calls()[1], Call::Apply(plan) if plan.upsert.len() == 1));

        fake.fail_next(1);
        assert!(r.sync(&desired(&[2]), &web, false).is_err());
        // The caller retries with a full sync; the fake kernel ends up right.
        r.sync(&desired(&[2]), &none, true).unwrap();
        assert_eq!(fake.programmed(), desired(&[2]));
        assert!(matches!(fake.calls().last(), Some(Call::ApplyFull(state)) if state == &desired(&[2])));
    }

    #[test]
    fn the_modes_stale_flow_deletions_are_in_the_report() {
        let fake = Fake::default();
        let mut r = Reconciler::new(Box::new(fake.clone()));
        let web = BTreeSet::from(["default/web".to_string()]);
        assert_eq!(r.sync(&desired(&[1]), &web, true).unwrap().stale_flow_deletions, 0);
        fake.delete_flows_next(3);
        assert_eq!(r.sync(&desired(&[2]), &web, false).unwrap().stale_flow_deletions, 3);
        assert_eq!(
            r.sync(&desired(&[3]), &web, false).unwrap().stale_flow_deletions,
            0,
            "each sync counts its own"
        );
    }

    /// `desired(endpoints)` plus the Service's IPv6 port with `v6_endpoints`.
    fn dual_stack(endpoints: &[u8], v6_endpoints: &[u16]) -> BTreeMap<String, ServicePort> {
        let mut state = desired(endpoints);
        let v6 = ServicePort {
            name: "default/web (IPv6)".into(),
            cluster_ip: "fd00:96::1".parse().unwrap(),
            port: 80,
            endpoints: (v6_endpoints.iter())
                .map(|e| Endpoint::ready(std::net::Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, *e), 80))
                .collect(),
            ..ServicePort::default()
        };
        state.insert(v6.name.clone(), v6);
        state
    }

    #[test]
    fn a_mode_gets_the_ports_of_its_families_only_and_the_others_are_reported_once() {
        let fake = Fake::default();
        let mut r = Reconciler::new(Box::new(fake.clone()));
        let v6 = BTreeSet::from(["default/web (IPv6)".to_string()]);
        let not_served = [Problem::new(
            "default/web (IPv6)",
            "IPv6 is not served by the fake mode",
        )];
        let report = r.sync(&dual_stack(&[1], &[1]), &BTreeSet::new(), true).unwrap();
        assert_eq!(report.problems, not_served);
        assert_eq!(fake.programmed(), desired(&[1]));
        // The IPv6 port changes: nothing for the mode, no second report.
        let report = r.sync(&dual_stack(&[1], &[1, 2]), &v6, false).unwrap();
        assert!(report.problems.is_empty());
        assert_eq!(report.service_changes, 0);
        let report = r.sync(&dual_stack(&[1], &[1, 2]), &BTreeSet::new(), true).unwrap();
        assert!(report.problems.is_empty(), "reported once, full syncs included");
        // Gone and back: reported again.
        r.sync(&desired(&[1]), &v6, false).unwrap();
        let report = r.sync(&dual_stack(&[1], &[1]), &v6, false).unwrap();
        assert_eq!(report.problems, not_served);
        assert_eq!(fake.programmed(), desired(&[1]));
    }

    /// A mode that cannot honour something at every sync and says so.
    struct Unhonoured;

    impl Dataplane for Unhonoured {
        fn name(&self) -> &'static str {
            "unhonoured"
        }
        fn apply(&mut self, _plan: &crate::mode::Plan) -> Result<()> {
            Ok(())
        }
        fn apply_full(&mut self, _desired: &BTreeMap<String, ServicePort>) -> Result<()> {
            Ok(())
        }
        fn kernel_writes(&self) -> u64 {
            0
        }
        fn take_problems(&mut self) -> Vec<Problem> {
            vec![Problem::new("default/web", "a field this mode cannot honour")]
        }
    }

    #[test]
    fn the_modes_problems_are_in_the_report() {
        let mut r = Reconciler::new(Box::new(Unhonoured));
        let report = r.sync(&desired(&[1]), &BTreeSet::new(), true).unwrap();
        assert_eq!(
            report.problems,
            [Problem::new("default/web", "a field this mode cannot honour")]
        );
    }
}
