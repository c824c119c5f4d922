//! Endpoint selection by traffic policy: which of a Service port's
//! endpoints each kind of traffic reaches from this node, as kube-proxy
//! sorts them (with topology hints, see [`super::topology`]). Every mode
//! programs these sets in its own language.

use super::{Endpoint, ServicePort, topology::Topology};

/// The endpoints every mode sends traffic to, kube-proxy's choice: the ready
/// ones; if there are none, those serving while terminating (so draining
/// pods still finish requests).
pub fn usable_endpoints(endpoints: &[Endpoint]) -> Vec<&Endpoint> {
    usable(endpoints.iter().collect())
}

/// [`usable_endpoints`] among `candidates`.
fn usable(candidates: Vec<&Endpoint>) -> Vec<&Endpoint> {
    if candidates.iter().any(|e| e.ready) {
        return candidates.into_iter().filter(|e| e.ready).collect();
    }
    candidates.into_iter().filter(|e| e.serving && e.terminating).collect()
}

/// A service port's endpoints sorted by the traffic policies, as kube-proxy
/// sorts them (`CategorizeEndpoints`): which ones
/// ClusterIP traffic and node-port traffic may reach from this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSets<'a> {
    /// The usable endpoints anywhere ([`usable_endpoints`]), narrowed by
    /// the topology hints when they apply (the port's `node_zone`): what
    /// `Cluster` policy traffic reaches. Empty only if the port has no
    /// usable endpoint at all (then its traffic is rejected, whatever the
    /// policies).
    pub cluster: Vec<&'a Endpoint>,
    /// The usable endpoints on this node, chosen among this node's endpoints
    /// alone (ready ones, else serving and terminating ones): what `Local`
    /// policy traffic reaches. Empty if no policy of the port is `Local`.
    pub local: Vec<&'a Endpoint>,
    internal_local: bool,
    external_local: bool,
    /// The port takes traffic from outside (a node port, external or load
    /// balancer IPs).
    external: bool,
}

impl<'a> EndpointSets<'a> {
    /// Sorts `port`'s endpoints for a node named `node` (`None`: no endpoint
    /// is local) in the zone `port.node_zone`.
    pub fn of(port: &'a ServicePort, node: Option<&str>) -> Self {
        let internal_local = port.internal_local();
        let external_local = port.external_local();
        let local = if internal_local || external_local {
            usable(port.endpoints.iter().filter(|e| e.is_on(node)).collect())
        } else {
            Vec::new()
        };
        Self {
            cluster: distinct(cluster_endpoints(port, node)),
            local: distinct(local),
            internal_local,
            external_local,
            external: port.externally_accessible(),
        }
    }

    /// Whether the port has a usable endpoint anywhere: without one its
    /// traffic is rejected; with one, traffic its policy leaves without an
    /// endpoint is dropped.
    pub fn has_any(&self) -> bool {
        !self.cluster.is_empty()
    }

    /// The endpoints ClusterIP traffic reaches.
    pub fn internal(&self) -> &[&'a Endpoint] {
        if self.internal_local {
            &self.local
        } else {
            &self.cluster
        }
    }

    /// The endpoints node-port traffic from outside the node reaches.
    pub fn external(&self) -> &[&'a Endpoint] {
        if self.external_local {
            &self.local
        } else {
            &self.cluster
        }
    }

    /// Whether any traffic uses the `Cluster` set: ClusterIP traffic with
    /// the `Cluster` policy, and node-port traffic always (with the `Local`
    /// policy still for the node's own and its pods' traffic, which
    /// kube-proxy "short-circuits" to every endpoint).
    pub fn uses_cluster(&self) -> bool {
        !self.cluster.is_empty() && (!self.internal_local || self.external)
    }

    /// Whether any traffic uses the `Local` set.
    pub fn uses_local(&self) -> bool {
        !self.local.is_empty() && (self.internal_local || self.external_local)
    }

    /// Every endpoint some traffic of this node reaches: the `Cluster` set
    /// (if used) followed by the `Local` endpoints not in it, each once.
    pub fn reachable(&self) -> Vec<&'a Endpoint> {
        let mut out: Vec<&Endpoint> = Vec::new();
        let cluster = if self.uses_cluster() { &self.cluster[..] } else { &[] };
        let local = if self.uses_local() { &self.local[..] } else { &[] };
        for ep in cluster.iter().chain(local) {
            if !out.iter().any(|o| (o.addr, o.port) == (ep.addr, ep.port)) {
                out.push(ep);
            }
        }
        out
    }
}

/// What `Cluster` traffic reaches: the ready endpoints the topology
/// allows; if there is no ready one anywhere, the serving and terminating
/// ones, hints ignored (a topology only applies when one of its ready
/// endpoints matches, so it never empties a set with ready endpoints).
fn cluster_endpoints<'a>(port: &'a ServicePort, node: Option<&str>) -> Vec<&'a Endpoint> {
    let topology = Topology::of(&port.endpoints, node, port.node_zone.as_deref());
    if topology == Topology::Any {
        return usable_endpoints(&port.endpoints);
    }
    port.endpoints
        .iter()
        .filter(|e| e.ready && topology.allows(e))
        .collect()
}

/// `endpoints` with each address and port once (the model joins slices so,
/// but a port built by hand may list one twice).
fn distinct(mut endpoints: Vec<&Endpoint>) -> Vec<&Endpoint> {
    let mut seen = std::collections::BTreeSet::new();
    endpoints.retain(|e| seen.insert((e.addr, e.port)));
    endpoints
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::TrafficPolicy;

    fn ep(last: u8, node: &str, ready: bool, terminating: bool) -> Endpoint {
        Endpoint {
            ready,
            serving: true,
            terminating,
            node_name: Some(node.into()),
            ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
        }
    }

    fn port(
        endpoints: Vec<Endpoint>,
        node_port: Option<u16>,
        external: TrafficPolicy,
        internal: TrafficPolicy,
    ) -> ServicePort {
        ServicePort {
            name: "default/web".into(),
            node_port,
            endpoints,
            external_policy: external,
            internal_policy: internal,
            ..ServicePort::default()
        }
    }

    fn lasts(endpoints: &[&Endpoint]) -> Vec<u8> {
        endpoints.iter().map(|e| super::super::last_octet(e.addr)).collect()
    }

    #[test]
    fn cluster_policies_use_every_usable_endpoint() {
        let p = port(
            vec![ep(1, "a", true, false), ep(2, "b", true, false)],
            Some(30000),
            TrafficPolicy::Cluster,
            TrafficPolicy::Cluster,
        );
        let sets = EndpointSets::of(&p, Some("a"));
        assert_eq!(lasts(&sets.cluster), [1, 2]);
        assert!(sets.local.is_empty(), "no Local policy: no local set");
        assert_eq!(lasts(sets.internal()), [1, 2]);
        assert_eq!(lasts(sets.external()), [1, 2]);
        assert!(sets.uses_cluster() && !sets.uses_local());
        assert_eq!(lasts(&sets.reachable()), [1, 2]);
    }

    #[test]
    fn external_local_reaches_this_nodes_endpoints_and_short_circuits_need_all() {
        let p = port(
            vec![
                ep(1, "a", true, false),
                ep(2, "b", true, false),
                ep(3, "a", false, true),
            ],
            Some(30000),
            TrafficPolicy::Local,
            TrafficPolicy::Cluster,
        );
        let sets = EndpointSets::of(&p, Some("a"));
        assert_eq!(lasts(sets.external()), [1]);
        assert_eq!(lasts(sets.internal()), [1, 2]);
        assert!(sets.uses_cluster() && sets.uses_local());
        assert_eq!(lasts(&sets.reachable()), [1, 2]);
        // The policy means nothing without a node port.
        let no_node_port = ServicePort {
            node_port: None,
            ..p.clone()
        };
        let sets = EndpointSets::of(&no_node_port, Some("a"));
        assert!(sets.local.is_empty() && !sets.uses_local());
    }

    /// kube-proxy picks local endpoints among the local ones: a node whose
    /// only endpoint is draining uses it, though ready ones run elsewhere.
    #[test]
    fn local_terminating_endpoints_serve_when_no_local_one_is_ready() {
        let p = port(
            vec![ep(1, "a", false, true), ep(2, "b", true, false)],
            Some(30000),
            TrafficPolicy::Local,
            TrafficPolicy::Cluster,
        );
        let sets = EndpointSets::of(&p, Some("a"));
        assert_eq!(lasts(&sets.cluster), [2]);
        assert_eq!(lasts(&sets.local), [1]);
        assert_eq!(lasts(&sets.reachable()), [2, 1]);
    }

    #[test]
    fn internal_local_without_node_port_never_uses_the_cluster_set() {
        let p = port(
            vec![ep(1, "a", true, false), ep(2, "b", true, false)],
            None,
            TrafficPolicy::Cluster,
            TrafficPolicy::Local,
        );
        let sets = EndpointSets::of(&p, Some("b"));
        assert_eq!(lasts(sets.internal()), [2]);
        assert!(!sets.uses_cluster());
        assert_eq!(lasts(&sets.reachable()), [2]);
        // Elsewhere, or on a node of unknown name, nothing is local.
        for node in [Some("c"), None] {
            let sets = EndpointSets::of(&p, node);
            assert!(sets.internal().is_empty() && sets.has_any());
            assert!(sets.reachable().is_empty());
        }
        // An endpoint naming no node is on none.
        let nameless = port(
            vec![Endpoint::ready(Ipv4Addr::new(10, 244, 0, 9), 80)],
            None,
            TrafficPolicy::Cluster,
            TrafficPolicy::Local,
        );
        assert!(EndpointSets::of(&nameless, Some("a")).local.is_empty());
    }

    #[test]
    fn endpoints_listed_twice_count_once() {
        let p = port(
            vec![ep(1, "a", true, false), ep(1, "a", true, false)],
            Some(30000),
            TrafficPolicy::Local,
            TrafficPolicy::Cluster,
        );
        let sets = EndpointSets::of(&p, Some("a"));
        assert_eq!((lasts(&sets.cluster), lasts(&sets.local)), (vec![1], vec![1]));
    }

    /// Zone hints narrow the `Cluster` set only: `Local` traffic keeps
    /// every local endpoint, and the fall-backs use every endpoint.
    #[test]
    fn zone_hints_narrow_the_cluster_set_only() {
        let hinted = |last: u8, node: &str, zone: &str| Endpoint {
            hints: Some(std::sync::Arc::new(crate::model::Hints {
                zones: vec![zone.into()],
                nodes: vec![],
            })),
            ..ep(last, node, true, false)
        };
        let mut p = port(
            vec![hinted(1, "a", "z1"), hinted(2, "b", "z2"), hinted(3, "a", "z2")],
            Some(30000),
            TrafficPolicy::Local,
            TrafficPolicy::Cluster,
        );
        p.node_zone = Some("z1".into());
        let sets = EndpointSets::of(&p, Some("a"));
        assert_eq!(lasts(sets.internal()), [1]);
        assert_eq!(lasts(sets.external()), [1, 3], "Local ignores hints");
        assert_eq!(lasts(&sets.reachable()), [1, 3]);
        // Zone unknown, or no endpoint for it: every endpoint.
        for zone in [None, Some("z9")] {
            p.node_zone = zone.map(Into::into);
            assert_eq!(lasts(EndpointSets::of(&p, Some("a")).internal()), [1, 2, 3]);
        }
        // Nothing ready: the terminating ones, whatever their hints.
        p.node_zone = Some("z1".into());
        for e in &mut p.endpoints {
            (e.ready, e.terminating) = (false, true);
        }
        assert_eq!(lasts(EndpointSets::of(&p, Some("a")).internal()), [1, 2, 3]);
    }
}
