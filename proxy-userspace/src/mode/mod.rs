//! Data-plane modes. Each one programs the kernel from the same model
//! through the same interface, so every mode can be compared on equal terms.

pub mod conntrack;
pub mod ebpf;
pub mod fake;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod options;
pub mod userspace;

use std::collections::BTreeMap;

use anyhow::Result;

use crate::{
    model::{Endpoint, ServicePort},
    reconcile::Plan,
};

/// The endpoints every mode sends traffic to, kube-proxy's choice: the ready
/// ones; if there are none, those serving while terminating (so draining
/// pods still finish requests).
pub fn usable_endpoints(endpoints: &[Endpoint]) -> Vec<&Endpoint> {
    let ready: Vec<_> = endpoints.iter().filter(|e| e.ready).collect();
    if !ready.is_empty() {
        return ready;
    }
    endpoints.iter().filter(|e| e.serving && e.terminating).collect()
}

/// One way of turning Service ports into kernel state.
pub trait Dataplane: Send {
    /// The `--mode` name.
    fn name(&self) -> &'static str;

    /// A partial sync: programs `plan` (removals first), touching nothing else.
    fn apply(&mut self, plan: &Plan) -> Result<()>;

    /// A full sync: makes the kernel state equal to `desired`, also removing
    /// whatever else is there (left by an earlier run or a failed sync).
    /// Parts already right are left alone.
    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()>;

    /// Kernel writes (map updates, rules, ...) issued so far: a sync that
    /// finds everything in place adds none.
    fn kernel_writes(&self) -> u64;

    /// Whether UDP flows are translated by the kernel's conntrack (netfilter
    /// NAT), so that the flows of an endpoint that left must be deleted
    /// after a sync ([`conntrack`]). The ebpf mode tracks its own flows.
    fn nat_in_kernel_conntrack(&self) -> bool {
        false
    }
}
