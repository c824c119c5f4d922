//! What a new flow at an external frontend takes from the frontend's
//! Service port (see `proxy_common::service_port`): the port's ClientIP
//! affinity id, and, for a pod's flow to a frontend with
//! externalTrafficPolicy: Local, the port's Cluster run of backends
//! (kube-proxy's short-circuit of pod traffic). One lookup, only for the
//! frontends flagged with either.

use aya_ebpf::maps::lpm_trie::Key;
use proxy_common::{
    FrontendPort, ServiceValue,
    service::{FLAG_AFFINITY_CLIENT_IP, FLAG_EXTERNAL_LOCAL, FLAGS_EXTERNAL},
};

use crate::{
    context::Addr6,
    maps::{POD_CIDRS, POD_CIDRS6, SCRATCH6, SERVICE_PORTS},
    parse::Flow,
};

/// The frontend as the new flow sees it, and its affinity id.
pub struct View {
    pub svc: ServiceValue,
    pub affinity_id: u32,
}

/// The view of `svc` for a new flow: the Cluster run for a pod's flow
/// (`from_pod`, asked only when it matters) to a `Local` external
/// frontend, else the frontend itself. Either family's.
#[inline(always)]
pub fn view(svc: &ServiceValue, from_pod: impl FnOnce() -> bool) -> View {
    let mut view = View {
        svc: *svc,
        affinity_id: svc.rev_nat_id,
    };
    if svc.flags & FLAGS_EXTERNAL == 0 || svc.flags & (FLAG_AFFINITY_CLIENT_IP | FLAG_EXTERNAL_LOCAL) == 0 {
        return view;
    }
    let Some(port) = SERVICE_PORTS.get_ptr(svc.rev_nat_id) else {
        return view;
    };
    // SAFETY: a map value pointer stays valid for the program's run (an
    // update by user space swaps in a new element, freed after RCU).
    let port: &FrontendPort = unsafe { &*port };
    if port.affinity_id != 0 {
        view.affinity_id = port.affinity_id;
    }
    if svc.flags & FLAG_EXTERNAL_LOCAL != 0 && port.short_circuits() && from_pod() {
        view.svc = port.cluster;
    }
    view
}

/// Whether the packet's source is inside a pod network (`clusterCIDR`).
// The key by reference: by value the verifier walks some 2,500 more
// instructions in tc_ingress (measured: 21,206 against 18,653).
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn from_pod(flow: &Flow) -> bool {
    POD_CIDRS.get(&Key::new(32, flow.saddr_be)).is_some()
}

/// Whether the IPv6 source `saddr` is inside a pod network, looked up
/// with a key in this CPU's scratch slot (as `crate::source_range::allowed6`:
/// 20 bytes the tc programs' stack has no room for on 6.1).
#[inline(always)]
pub fn from_pod6(saddr: &Addr6) -> bool {
    let Some(scratch) = SCRATCH6.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of an array map, never freed; no other run
    // on this CPU comes between.
    let key = unsafe { &mut (*scratch).pod_key };
    key.prefix_len = 128;
    key.data = *saddr;
    #[allow(clippy::needless_borrows_for_generic_args)]
    POD_CIDRS6.get(&*key).is_some()
}
