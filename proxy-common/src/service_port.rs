//! What an external frontend shares with the other frontends of its
//! Service port, for the two things the programs decide per Service port
//! rather than per frontend:
//!
//! - **ClientIP affinity** is kept per Service port, as kube-proxy's
//!   iptables mode keeps it (every frontend jumps to the same `KUBE-SVC`
//!   chain and its `recent` lists): a client of the ClusterIP and of the
//!   node port of one port gets one backend. The affinity map is keyed by
//!   the port's affinity id, the ClusterIP frontend's reverse NAT id.
//! - **Pods' traffic to an `externalTrafficPolicy: Local` frontend** (node
//!   port, external or load balancer IP) goes to every endpoint, as
//!   kube-proxy's `KUBE-EXT` chain short-circuits traffic it can tell comes
//!   from a pod (`detectLocalMode: ClusterCIDR`) to the Cluster chain:
//!   "as if it went out to the load balancer and came back". A new flow
//!   whose source is in the pod CIDR trie (`XP_POD_CIDRS`, see
//!   [`crate::maps::POD_CIDRS`]) picks from the port's Cluster run instead
//!   of the frontend's Local one, and keeps its source (kube-proxy marks
//!   none of it for masquerade).
//!
//! The ClusterIP frontend needs no entry (its affinity id is its own
//! reverse NAT id, and no policy of it is short-circuited), nor does an
//! external frontend of a port without affinity and without the `Local`
//! external policy: the programs look the map up only for new flows at an
//! external frontend flagged with either.

use bytemuck::{Pod, Zeroable};

use crate::ServiceValue;

/// Value of the Service port map; the key is the external frontend's
/// [`ServiceValue::rev_nat_id`] (`u32`, host order).
///
/// Written in the same flush step as the frontend's own entry, after the
/// slots `cluster` points at, and deleted with it: `cluster` names its
/// backend set itself, so a reader sees a whole set whichever of the two
/// entries it read first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct FrontendPort {
    /// The Service port's ClientIP affinity id (the ClusterIP frontend's
    /// reverse NAT id, host order), the first half of
    /// [`crate::AffinityKey`]; 0 when the port has no affinity.
    pub affinity_id: u32,
    /// The frontend as a pod's new flow sees it when the frontend has
    /// `FLAG_EXTERNAL_LOCAL`: the same backend set, the port's Cluster run
    /// of slots, no `Local` or external flag (no drop, no SNAT for other
    /// nodes' backends), the frontend's reverse NAT id, affinity and
    /// timeout. All zero (`backend_set` 0, never an id) when the frontend
    /// is not short-circuited.
    pub cluster: ServiceValue,
}

impl FrontendPort {
    /// Whether `cluster` holds a short-circuit view.
    pub fn short_circuits(&self) -> bool {
        self.cluster.backend_set != 0
    }
}

const _: () = assert!(core::mem::size_of::<FrontendPort>() == 28);
