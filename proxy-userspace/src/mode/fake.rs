//! A mode that programs nothing and records what it was asked to do, with
//! optional injected failures: for the reconciler's tests.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use anyhow::{Result, bail};

use super::{Dataplane, Plan, SyncedChange};
use crate::model::ServicePort;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Apply(Plan),
    ApplyFull(BTreeMap<String, ServicePort>),
}

/// Shared with the test, which keeps a clone to look inside.
#[derive(Clone, Default)]
pub struct Fake {
    inner: Arc<Mutex<FakeState>>,
}

#[derive(Default)]
struct FakeState {
    calls: Vec<Call>,
    programmed: BTreeMap<String, ServicePort>,
    failures_left: usize,
    writes: u64,
    /// Flows the next stale-flow deletion deletes.
    flows_to_delete: u64,
}

impl Fake {
    /// The next sync deletes `n` stale flows.
    pub fn delete_flows_next(&self, n: u64) {
        self.lock().flows_to_delete = n;
    }

    /// The next `n` calls fail (after recording themselves).
    pub fn fail_next(&self, n: usize) {
        self.lock().failures_left = n;
    }

    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// What the fake kernel holds now.
    pub fn programmed(&self) -> BTreeMap<String, ServicePort> {
        self.lock().programmed.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn fail_if_asked(state: &mut FakeState) -> Result<()> {
        if state.failures_left > 0 {
            state.failures_left -= 1;
            bail!("injected failure");
        }
        Ok(())
    }
}

impl Dataplane for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        let mut state = self.lock();
        state.calls.push(Call::Apply(plan.clone()));
        Self::fail_if_asked(&mut state)?;
        for port in &plan.remove {
            state.programmed.remove(&port.name);
        }
        for port in &plan.upsert {
            state.programmed.insert(port.name.clone(), port.clone());
        }
        state.writes += (plan.remove.len() + plan.upsert.len()) as u64;
        Ok(())
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        let mut state = self.lock();
        state.calls.push(Call::ApplyFull(desired.clone()));
        Self::fail_if_asked(&mut state)?;
        if state.programmed != *desired {
            state.writes += desired.len() as u64;
            state.programmed = desired.clone();
        }
        Ok(())
    }

    fn kernel_writes(&self) -> u64 {
        self.lock().writes
    }

    fn delete_stale_flows(&mut self, _change: &SyncedChange<'_>) -> u64 {
        std::mem::take(&mut self.lock().flows_to_delete)
    }
}
