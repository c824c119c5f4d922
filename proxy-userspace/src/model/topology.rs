//! Topology-aware routing: which endpoints `Cluster` traffic keeps from
//! this node when the EndpointSlices carry hints (`hints.forNodes`,
//! `hints.forZones`, set by the slice controller for `trafficDistribution:
//! PreferClose` / `PreferSameNode` and the topology annotation).
//!
//! kube-proxy's rules (`topologyModeFromHints`): only ready endpoints are
//! looked at; if every one names nodes and one names this node, keep the
//! endpoints hinted for this node; else if every one names zones and one
//! names this node's zone, keep those hinted for the zone; else (an
//! endpoint without hints, no endpoint for the zone, the zone unknown)
//! ignore the hints and use every endpoint. Like kube-proxy, the proxy
//! reads the hints only, never `trafficDistribution` itself: the slice
//! controller turns the field into hints.

use std::sync::Arc;

use super::{Endpoint, Hints};

/// The label of a Node that names its zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Which hints narrow the `Cluster` set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology<'a> {
    /// No hints apply: every endpoint.
    Any,
    /// Endpoints hinted for this node.
    SameNode(&'a str),
    /// Endpoints hinted for this node's zone.
    SameZone(&'a str),
}

impl<'a> Topology<'a> {
    /// The mode for `endpoints` on a node named `node` in `zone` (both
    /// `None` when unknown).
    pub fn of(endpoints: &[Endpoint], node: Option<&'a str>, zone: Option<&'a str>) -> Self {
        let ready: Vec<&Endpoint> = endpoints.iter().filter(|e| e.ready).collect();
        if ready.is_empty() {
            return Topology::Any;
        }
        if let Some(node) = node
            && hinted_for(&ready, node, |h| &h.nodes)
        {
            return Topology::SameNode(node);
        }
        if let Some(zone) = zone
            && hinted_for(&ready, zone, |h| &h.zones)
        {
            return Topology::SameZone(zone);
        }
        Topology::Any
    }

    /// Whether `Cluster` traffic from this node may use `endpoint`.
    pub fn allows(self, endpoint: &Endpoint) -> bool {
        let has = |list: &[Arc<str>], name: &str| list.iter().any(|n| &**n == name);
        match (self, endpoint.hints.as_deref()) {
            (Topology::Any, _) => true,
            (_, None) => false,
            (Topology::SameNode(node), Some(hints)) => has(&hints.nodes, node),
            (Topology::SameZone(zone), Some(hints)) => has(&hints.zones, zone),
        }
    }
}

/// Whether every endpoint of `ready` has hints of the kind `list` picks
/// and at least one names `name`.
fn hinted_for(ready: &[&Endpoint], name: &str, list: impl Fn(&Hints) -> &Vec<Arc<str>>) -> bool {
    let lists: Option<Vec<&Vec<Arc<str>>>> = ready
        .iter()
        .map(|e| e.hints.as_deref().map(&list).filter(|l| !l.is_empty()))
        .collect();
    lists.is_some_and(|lists| lists.iter().any(|l| l.iter().any(|n| &**n == name)))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn ep(last: u8, ready: bool, zones: &[&str], nodes: &[&str]) -> Endpoint {
        let hints = (!zones.is_empty() || !nodes.is_empty()).then(|| {
            Arc::new(Hints {
                zones: zones.iter().map(|z| Arc::from(*z)).collect(),
                nodes: nodes.iter().map(|n| Arc::from(*n)).collect(),
            })
        });
        Endpoint {
            ready,
            serving: true,
            terminating: !ready,
            hints,
            ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
        }
    }

    #[test]
    fn zone_hints_apply_when_every_ready_endpoint_has_one_and_one_matches() {
        let eps = [ep(1, true, &["a"], &[]), ep(2, true, &["b"], &[])];
        let mode = Topology::of(&eps, Some("n1"), Some("a"));
        assert_eq!(mode, Topology::SameZone("a"));
        assert!(mode.allows(&eps[0]) && !mode.allows(&eps[1]));
    }

    #[test]
    fn hints_are_ignored_when_a_ready_endpoint_lacks_them() {
        let eps = [ep(1, true, &["a"], &[]), ep(2, true, &[], &[])];
        assert_eq!(Topology::of(&eps, Some("n1"), Some("a")), Topology::Any);
        // A not-ready endpoint without hints does not count.
        let eps = [ep(1, true, &["a"], &[]), ep(2, false, &[], &[])];
        assert_eq!(Topology::of(&eps, Some("n1"), Some("a")), Topology::SameZone("a"));
    }

    #[test]
    fn hints_are_ignored_when_none_matches_the_zone_or_the_zone_is_unknown() {
        let eps = [ep(1, true, &["a"], &[]), ep(2, true, &["b"], &[])];
        assert_eq!(Topology::of(&eps, Some("n1"), Some("c")), Topology::Any);
        assert_eq!(Topology::of(&eps, Some("n1"), None), Topology::Any);
        assert!(Topology::Any.allows(&eps[1]));
    }

    #[test]
    fn no_ready_endpoint_means_no_topology() {
        let eps = [ep(1, false, &["a"], &[])];
        assert_eq!(Topology::of(&eps, Some("n1"), Some("a")), Topology::Any);
        assert_eq!(Topology::of(&[], Some("n1"), Some("a")), Topology::Any);
    }

    #[test]
    fn node_hints_come_before_zone_hints_and_fall_back_to_them() {
        let eps = [ep(1, true, &["a"], &["n1"]), ep(2, true, &["a"], &["n2"])];
        let mode = Topology::of(&eps, Some("n1"), Some("a"));
        assert_eq!(mode, Topology::SameNode("n1"));
        assert!(mode.allows(&eps[0]) && !mode.allows(&eps[1]));
        // No endpoint for this node: the zone hints decide.
        assert_eq!(Topology::of(&eps, Some("n3"), Some("a")), Topology::SameZone("a"));
        // A node of unknown name uses no node hints.
        assert_eq!(Topology::of(&eps, None, Some("a")), Topology::SameZone("a"));
    }
}
