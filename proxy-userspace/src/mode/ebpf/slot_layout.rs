//! Where a Service port's endpoints go in its backend set: one set per
//! Service port, this node's endpoints first, and the run of slots each
//! traffic policy's frontends pick from.

use anyhow::{Context, Result};

use crate::model::{Endpoint, EndpointSets};

/// The endpoints of a Service port's backend set in slot order, and the run
/// of slots each traffic policy uses. This node's endpoints come first, so
/// that `Local` frontends use slots `0..local`; the `Cluster` run is
/// `0..all` when it includes them (they are ready, or nothing is ready
/// anywhere), else it follows them (only terminating endpoints are here,
/// ready ones elsewhere). A port with both policies `Cluster` gets its
/// usable endpoints in order, as before the policies existed.
pub(super) struct SlotLayout<'a> {
    pub slots: Vec<&'a Endpoint>,
    /// `(offset, count)` of the `Cluster` run.
    pub cluster: (u32, u32),
    /// `(offset, count)` of the `Local` run.
    pub local: (u32, u32),
}

impl<'a> SlotLayout<'a> {
    pub fn of(sets: &EndpointSets<'a>) -> Result<Self> {
        let cluster: &[&Endpoint] = if sets.uses_cluster() { &sets.cluster } else { &[] };
        let local: &[&Endpoint] = if sets.uses_local() { &sets.local } else { &[] };
        let same = |a: &&Endpoint, b: &&Endpoint| (a.addr, a.port) == (b.addr, b.port);
        let in_cluster = |ep: &&Endpoint| cluster.iter().any(|c| same(c, ep));
        let mut slots: Vec<&Endpoint> = local.to_vec();
        let cluster_offset = if cluster.is_empty() || local.iter().all(in_cluster) {
            slots.extend(cluster.iter().filter(|c| !local.iter().any(|l| same(l, c))));
            0
        } else {
            slots.extend(cluster);
            local.len()
        };
        let count = |n: usize| u32::try_from(n).context("too many endpoints");
        Ok(Self {
            cluster: (count(cluster_offset)?, count(cluster.len())?),
            local: (0, count(local.len())?),
            slots,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{ServicePort, TrafficPolicy, usable_endpoints};

    #[test]
    fn terminating_endpoints_serve_only_when_none_is_ready() {
        let ip = Ipv4Addr::new(10, 0, 0, 1);
        let mut draining = Endpoint::ready(ip, 80);
        draining.ready = false;
        draining.terminating = true;
        let ready = Endpoint::ready(Ipv4Addr::new(10, 0, 0, 2), 80);
        assert_eq!(usable_endpoints(&[draining.clone(), ready.clone()]), vec![&ready]);
        assert_eq!(usable_endpoints(std::slice::from_ref(&draining)), vec![&draining]);
    }

    fn on(node: &str, last: u8, ready: bool) -> Endpoint {
        Endpoint {
            ready,
            terminating: !ready,
            node_name: Some(node.into()),
            ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
        }
    }

    fn layout_of(port: &ServicePort, node: &str) -> (Vec<u8>, (u32, u32), (u32, u32)) {
        let sets = EndpointSets::of(port, Some(node));
        let layout = SlotLayout::of(&sets).expect("layout");
        let slots = layout.slots.iter().map(|e| crate::model::last_octet(e.addr)).collect();
        (slots, layout.cluster, layout.local)
    }

    /// The set holds this node's endpoints first; `Cluster` frontends use
    /// all of it, `Local` ones the first run; a port without `Local` policy
    /// keeps its endpoints' order.
    #[test]
    fn slot_layout_puts_local_endpoints_first() {
        let endpoints = vec![on("b", 1, true), on("a", 2, true), on("b", 3, true), on("a", 4, true)];
        let cluster = ServicePort {
            node_port: Some(30000),
            endpoints,
            ..ServicePort::default()
        };
        assert_eq!(layout_of(&cluster, "a"), (vec![1, 2, 3, 4], (0, 4), (0, 0)));
        let local = ServicePort {
            external_policy: TrafficPolicy::Local,
            ..cluster.clone()
        };
        assert_eq!(layout_of(&local, "a"), (vec![2, 4, 1, 3], (0, 4), (0, 2)));
        assert_eq!(layout_of(&local, "c"), (vec![1, 2, 3, 4], (0, 4), (0, 0)));
    }

    /// A node whose only endpoint is draining while others are ready
    /// elsewhere: the `Local` run is that endpoint, the `Cluster` run the
    /// ready ones after it.
    #[test]
    fn slot_layout_with_a_draining_local_endpoint() {
        let port = ServicePort {
            node_port: Some(30000),
            endpoints: vec![on("b", 1, true), on("a", 2, false), on("b", 3, true)],
            external_policy: TrafficPolicy::Local,
            ..ServicePort::default()
        };
        assert_eq!(layout_of(&port, "a"), (vec![2, 1, 3], (1, 2), (0, 1)));
        let internal_only = ServicePort {
            node_port: None,
            external_policy: TrafficPolicy::Cluster,
            internal_policy: TrafficPolicy::Local,
            ..port
        };
        assert_eq!(layout_of(&internal_only, "a"), (vec![2], (0, 0), (0, 1)));
    }
}
