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
    maps::{POD_CIDRS, SERVICE_PORTS},
    parse::Flow,
};

/// The frontend as the new flow sees it, and its affinity id.
pub struct View {
    pub svc: ServiceValue,
    pub affinity_id: u32,
}

/// The view of `svc` for `flow`: the Cluster run for a pod's flow to a
/// `Local` external frontend, else the frontend itself.
#[inline(always)]
pub fn view(flow: &Flow, svc: &ServiceValue) -> View {
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
    if svc.flags & FLAG_EXTERNAL_LOCAL != 0 && port.short_circuits() && from_pod(flow) {
        view.svc = port.cluster;
    }
    view
}

/// The affinity id of a new flow at `svc` without the short-circuit's
/// view (IPv6's, whose pod networks are not known yet): its Service
/// port's, found in the port's entry for an external frontend.
#[inline(always)]
pub fn affinity_id(svc: &ServiceValue) -> u32 {
    if svc.flags & FLAGS_EXTERNAL == 0 || svc.flags & FLAG_AFFINITY_CLIENT_IP == 0 {
        return svc.rev_nat_id;
    }
    // SAFETY: as in `view`: valid for the program's run.
    let port = SERVICE_PORTS.get_ptr(svc.rev_nat_id).map(|p| unsafe { &*p });
    proxy_common::affinity::affinity_id(svc, port)
}

/// Whether the packet's source is inside a pod network (`clusterCIDR`).
// The key by reference: by value the verifier walks some 2,500 more
// instructions in tc_ingress (measured: 21,206 against 18,653).
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
fn from_pod(flow: &Flow) -> bool {
    POD_CIDRS.get(&Key::new(32, flow.saddr_be)).is_some()
}
