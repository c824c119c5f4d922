//! What a new flow at an external frontend takes from the frontend's
//! Service port (see `proxy_common::service_port`): the port's ClientIP
//! affinity id, and, for a pod's flow to a frontend with
//! externalTrafficPolicy: Local, the port's Cluster run of backends
//! (kube-proxy's short-circuit of pod traffic). One lookup, only for the
//! frontends flagged with either.

use proxy_common::{
    FrontendPort, ServiceValue,
    service::{FLAG_AFFINITY_CLIENT_IP, FLAG_EXTERNAL_LOCAL, FLAGS_EXTERNAL},
};

use crate::maps::SERVICE_PORTS;

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
