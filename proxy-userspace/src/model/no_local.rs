//! kube-proxy's "no local endpoints" tally: Service ports whose traffic
//! policy is `Local` while this node has none of their endpoints, so that
//! traffic is dropped here. Kept up to date one changed port at a time.

use std::collections::{BTreeMap, BTreeSet};

use super::{EndpointSets, ServicePort};

/// Which policies of a port lead nowhere on this node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Gaps {
    internal: bool,
    external: bool,
}

/// The ports with a gap, by name.
#[derive(Debug, Default)]
pub struct NoLocalEndpoints {
    gaps: BTreeMap<String, Gaps>,
}

impl NoLocalEndpoints {
    /// Re-checks the `changed` ports (gone ones are forgotten) and returns
    /// the counts `(internal, external)` for the whole state.
    pub fn update(
        &mut self,
        ports: &BTreeMap<String, ServicePort>,
        changed: &BTreeSet<String>,
        node: Option<&str>,
    ) -> (usize, usize) {
        for name in changed {
            match ports.get(name).map(|port| gaps_of(port, node)) {
                Some(gaps) if gaps != Gaps::default() => {
                    self.gaps.insert(name.clone(), gaps);
                }
                _ => {
                    self.gaps.remove(name);
                }
            }
        }
        let internal = self.gaps.values().filter(|g| g.internal).count();
        let external = self.gaps.values().filter(|g| g.external).count();
        (internal, external)
    }
}

/// A policy has a gap when it is `Local`, the port has usable endpoints
/// somewhere (otherwise its traffic is rejected, not dropped), and none is
/// on this node.
fn gaps_of(port: &ServicePort, node: Option<&str>) -> Gaps {
    let sets = EndpointSets::of(port, node);
    let gap = sets.has_any() && sets.local.is_empty();
    Gaps {
        internal: port.internal_local() && gap,
        external: port.external_local() && gap,
    }
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv4Addr, sync::Arc};

    use super::*;
    use crate::model::{Endpoint, TrafficPolicy};

    fn port(external: TrafficPolicy, internal: TrafficPolicy, on: &str) -> ServicePort {
        ServicePort {
            node_port: Some(30000),
            external_policy: external,
            internal_policy: internal,
            endpoints: vec![Endpoint {
                node_name: Some(Arc::from(on)),
                ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, 1), 80)
            }],
            ..ServicePort::default()
        }
    }

    #[test]
    fn counts_local_policies_without_local_endpoints_and_forgets_gone_ports() {
        use TrafficPolicy::{Cluster, Local};
        let ports: BTreeMap<String, ServicePort> = [
            ("a".to_owned(), port(Local, Cluster, "other")),
            ("b".to_owned(), port(Local, Local, "other")),
            ("c".to_owned(), port(Local, Local, "this")),
            ("d".to_owned(), port(Cluster, Cluster, "other")),
            (
                "e".to_owned(),
                ServicePort {
                    endpoints: vec![],
                    ..port(Local, Local, "other")
                },
            ),
        ]
        .into_iter()
        .collect();
        let mut tally = NoLocalEndpoints::default();
        let all: BTreeSet<String> = ports.keys().cloned().collect();
        assert_eq!(tally.update(&ports, &all, Some("this")), (1, 2));
        let mut fewer = ports.clone();
        fewer.remove("b");
        let changed = ["b".to_owned()].into_iter().collect();
        assert_eq!(tally.update(&fewer, &changed, Some("this")), (0, 1));
    }
}
