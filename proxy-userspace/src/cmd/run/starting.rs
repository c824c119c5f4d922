//! A mode that is still starting, for the agent to hold meanwhile: the
//! agent takes in the source's lists and builds its model while the mode
//! loads its programs (or sets up its tables), and its first sync waits
//! for the mode.
//!
//! At 10,000 Services x 10 endpoints from a manifest directory the lists
//! are read before the ebpf mode is ready (0.3-0.6 s into the start),
//! and building the model from them took ~0.15-0.2 s more after the mode
//! was ready: started this way, that work is done by then.

use std::{
    cell::OnceCell,
    collections::BTreeMap,
    sync::mpsc::{self, Receiver, SyncSender},
    time::Instant,
};

use anyhow::{Result, anyhow};
use tracing::info;

use crate::{
    mode::{Dataplane, ModeCounters, Plan, SyncedChange},
    model::{IpFamily, Problem, ServicePort},
};

/// Stands for the mode `name` until [`ModeSender::started`] hands it over.
pub struct Starting {
    name: &'static str,
    /// Set once, when the mode arrives (also from `&self`: the families
    /// the mode serves are asked before the first sync).
    mode: OnceCell<Box<dyn Dataplane>>,
    arrival: Receiver<Box<dyn Dataplane>>,
}

/// Hands the started mode to its [`Starting`].
pub struct ModeSender(SyncSender<Box<dyn Dataplane>>);

impl ModeSender {
    /// The mode has started. Dropped at once if the agent is gone.
    pub fn started(self, mode: Box<dyn Dataplane>) {
        let _ = self.0.send(mode);
    }
}

/// A stand-in for the mode `name` and what hands the mode to it.
pub fn starting(name: &'static str) -> (Starting, ModeSender) {
    let (sender, arrival) = mpsc::sync_channel(1);
    let starting = Starting {
        name,
        mode: OnceCell::new(),
        arrival,
    };
    (starting, ModeSender(sender))
}

impl Starting {
    /// The mode, once it has started; waits for it (a sync runs on a
    /// blocking thread, see the agent). An error if it never will.
    fn started(&mut self) -> Result<&mut Box<dyn Dataplane>> {
        self.wait();
        self.mode
            .get_mut()
            .ok_or_else(|| anyhow!("the {} mode did not start", self.name))
    }

    /// Waits for the mode unless it is here (or will never come).
    fn wait(&self) {
        if self.mode.get().is_some() {
            return;
        }
        let since = Instant::now();
        if let Ok(mode) = self.arrival.recv() {
            info!(
                mode = self.name,
                waited_ms = since.elapsed().as_secs_f64() * 1e3,
                "the first sync waited for the mode to start"
            );
            let _ = self.mode.set(mode);
        }
    }
}

impl Dataplane for Starting {
    fn name(&self) -> &'static str {
        self.name
    }

    /// The mode's: the first sync asks before it applies, so this waits
    /// for the mode (IPv4 if it never starts; that sync fails anyway).
    fn families(&self) -> &'static [IpFamily] {
        self.wait();
        self.mode.get().map_or(&[IpFamily::V4], |mode| mode.families())
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        self.started()?.apply(plan)
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        self.started()?.apply_full(desired)
    }

    /// None before the mode started: its own count starts then.
    fn kernel_writes(&self) -> u64 {
        self.mode.get().map_or(0, |mode| mode.kernel_writes())
    }

    fn delete_stale_flows(&mut self, change: &SyncedChange<'_>) -> u64 {
        self.mode.get_mut().map_or(0, |mode| mode.delete_stale_flows(change))
    }

    fn take_problems(&mut self) -> Vec<Problem> {
        self.mode.get_mut().map(|mode| mode.take_problems()).unwrap_or_default()
    }

    fn counters(&self) -> ModeCounters {
        self.mode.get().map(|mode| mode.counters()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mode::fake::Fake;

    #[test]
    fn a_sync_waits_for_the_mode_and_goes_to_it() {
        let (mut starting, sender) = starting("fake");
        let fake = Fake::default();
        let seen = fake.clone();
        assert_eq!(starting.kernel_writes(), 0);
        let handing = std::thread::spawn(move || sender.started(Box::new(fake)));
        starting
            .apply_full(&BTreeMap::new())
            .expect("synced once the mode came");
        handing.join().expect("handed over");
        assert_eq!(seen.calls().len(), 1, "the sync reached the mode");
    }

    /// The reconciler asks which families the mode serves before the
    /// first sync: the answer is the started mode's, not the default.
    #[test]
    fn the_families_are_the_started_modes() {
        struct BothFamilies(Fake);
        impl Dataplane for BothFamilies {
            fn name(&self) -> &'static str {
                "both"
            }
            fn families(&self) -> &'static [IpFamily] {
                &[IpFamily::V4, IpFamily::V6]
            }
            fn apply(&mut self, plan: &Plan) -> Result<()> {
                self.0.apply(plan)
            }
            fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
                self.0.apply_full(desired)
            }
            fn kernel_writes(&self) -> u64 {
                self.0.kernel_writes()
            }
        }
        let (starting, sender) = starting("both");
        let handing = std::thread::spawn(move || sender.started(Box::new(BothFamilies(Fake::default()))));
        assert_eq!(starting.families(), [IpFamily::V4, IpFamily::V6]);
        handing.join().expect("handed over");
    }

    #[test]
    fn a_mode_that_never_starts_fails_the_sync() {
        let (mut starting, sender) = starting("fake");
        drop(sender);
        let failed = starting.apply_full(&BTreeMap::new());
        assert!(failed.is_err_and(|e| e.to_string().contains("did not start")));
    }
}
