//! The Service ports joined from Services and their EndpointSlices, kept up
//! to date one Service at a time.
//!
//! A change to one object re-joins only the Service it belongs to, so an
//! endpoint change costs the same with ten Services or a hundred thousand.
//! What makes this more than a map insert is the one rule that spans
//! Services: two Service ports cannot share a frontend. Every mode keys its
//! translation by frontend (a map key, a verdict map element, an IPVS
//! virtual server), so the rule lives here, once, and every mode programs
//! the same winner:
//! - A ClusterIP with its port and protocol: the API server keeps them
//!   unique, a hand-written manifest may not. The port of the first Service
//!   in (namespace, name) order keeps it, as if every Service were joined
//!   in that order; the others are left out whole, each a problem.
//! - An external IP or LoadBalancer IP with the port, and a node port:
//!   nothing in the API stops two Services from listing the same external
//!   IP. A ClusterIP outranks them (an external IP that is another
//!   Service's ClusterIP is lost); among the rest the first Service in
//!   order keeps the frontend, and the others lose only that frontend (a
//!   problem naming it) and keep the rest. A port left out whole claims no
//!   external frontend.
//!
//! When the holder of a frontend goes, the next claimant takes it over.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use super::{IpFamily, ObjectKey, Problem, Protocol, ServicePort};

/// What the modes tell Service ports apart by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Frontend {
    /// A ClusterIP, external IP or LoadBalancer IP with the port.
    Addr(IpAddr, u16, Protocol),
    /// A node port, on every node address of the family (a dual-stack
    /// Service's two ports share theirs).
    NodePort(u16, Protocol, IpFamily),
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frontend::Addr(ip, port, protocol) => write!(f, "{ip}:{port}/{protocol}"),
            Frontend::NodePort(port, protocol, IpFamily::V4) => write!(f, "node port {port}/{protocol}"),
            Frontend::NodePort(port, protocol, family) => write!(f, "{} node port {port}/{protocol}", family.name()),
        }
    }
}

/// How a port claims a frontend; claims win in this order first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    ClusterIp,
    External,
}

/// A port that wants a frontend: how, its Service, then its name (the
/// order in which claims win).
type Claim = (Rank, ObjectKey, String);

fn cluster_frontend(port: &ServicePort) -> Frontend {
    Frontend::Addr(port.cluster_ip, port.port, port.protocol)
}

/// The port's external IPs, LoadBalancer IPs and node port as frontends
/// (an address equal to its own ClusterIP adds nothing).
fn external_frontends(port: &ServicePort) -> BTreeSet<Frontend> {
    let addrs = port.external_ips.iter().chain(&port.load_balancer_ips);
    addrs
        .map(|ip| Frontend::Addr(*ip, port.port, port.protocol))
        .chain(
            port.node_port
                .map(|n| Frontend::NodePort(n, port.protocol, port.family())),
        )
        .filter(|f| *f != cluster_frontend(port))
        .collect()
}

/// Every frontend `port` may claim.
fn frontends_of(port: &ServicePort) -> impl Iterator<Item = Frontend> {
    std::iter::once(cluster_frontend(port)).chain(external_frontends(port))
}

/// `port` without the frontends in `lost`.
fn without(port: &ServicePort, lost: &BTreeSet<Frontend>) -> ServicePort {
    let kept = |ip: &IpAddr| !lost.contains(&Frontend::Addr(*ip, port.port, port.protocol));
    let mut placed = port.clone();
    placed.external_ips.retain(kept);
    placed.load_balancer_ips.retain(kept);
    if placed
        .node_port
        .is_some_and(|n| lost.contains(&Frontend::NodePort(n, port.protocol, port.family())))
    {
        placed.node_port = None;
    }
    placed
}

/// The joined ports, and what changed since the caller last asked.
#[derive(Clone, Debug, Default)]
pub struct Joined {
    ports: BTreeMap<String, ServicePort>,
    /// Every port each Service wants, including the ones that lost their
    /// frontend to another Service.
    wanted: BTreeMap<ObjectKey, Vec<ServicePort>>,
    claims: BTreeMap<Frontend, BTreeSet<Claim>>,
    /// Ports left out because another Service holds their frontend.
    conflicts: BTreeMap<String, Problem>,
    /// Names of ports added, changed or removed since [`Joined::take_changed`].
    changed: BTreeSet<String>,
}

impl Joined {
    /// The ports in place now, by name.
    pub fn ports(&self) -> &BTreeMap<String, ServicePort> {
        &self.ports
    }

    /// Ports left out, one problem each, in name order.
    pub fn problems(&self) -> Vec<Problem> {
        self.conflicts.values().cloned().collect()
    }

    /// The names of the ports that changed since the last call.
    pub fn take_changed(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.changed)
    }

    /// Makes `service`'s ports the ones in `wanted` (none: the Service is
    /// gone). Returns the other Services whose frontends changed hands:
    /// their ports must be joined again.
    pub fn replace(&mut self, service: &ObjectKey, wanted: Vec<ServicePort>) -> BTreeSet<ObjectKey> {
        let old = self.wanted.remove(service).unwrap_or_default();
        let touched: BTreeSet<Frontend> = old.iter().chain(&wanted).flat_map(frontends_of).collect();
        let holders_before: Vec<Option<Claim>> = touched.iter().map(|f| self.holder(f).cloned()).collect();

        for port in &old {
            self.unclaim(service, port);
            if !wanted.iter().any(|p| p.name == port.name) {
                self.set(&port.name, None);
                self.conflicts.remove(&port.name);
            }
        }
        for port in &wanted {
            self.claim(
                cluster_frontend(port),
                (Rank::ClusterIp, service.clone(), port.name.clone()),
            );
        }
        // Only a port that keeps its ClusterIP claims more: one left out
        // must not hold an external IP that another could serve.
        for port in &wanted {
            if self.holds(&cluster_frontend(port), Rank::ClusterIp, service, &port.name) {
                for frontend in external_frontends(port) {
                    self.claim(frontend, (Rank::External, service.clone(), port.name.clone()));
                }
            }
        }
        for port in &wanted {
            self.place(service, port);
        }
        if !wanted.is_empty() {
            self.wanted.insert(service.clone(), wanted);
        }

        let mut others = BTreeSet::new();
        for (frontend, before) in touched.iter().zip(holders_before) {
            let after = self.holder(frontend).cloned();
            if before != after {
                others.extend([before, after].into_iter().flatten().map(|(_, key, _)| key));
            }
        }
        others.remove(service);
        others
    }

    fn holder(&self, frontend: &Frontend) -> Option<&Claim> {
        self.claims.get(frontend).and_then(|c| c.first())
    }

    /// Whether the port `name` of `service` holds `frontend` by a claim of `rank`.
    fn holds(&self, frontend: &Frontend, rank: Rank, service: &ObjectKey, name: &str) -> bool {
        self.holder(frontend)
            .is_some_and(|(r, key, n)| *r == rank && key == service && n == name)
    }

    fn claim(&mut self, frontend: Frontend, claim: Claim) {
        self.claims.entry(frontend).or_default().insert(claim);
    }

    /// Drops every claim of `port` (of either rank).
    fn unclaim(&mut self, service: &ObjectKey, port: &ServicePort) {
        for frontend in frontends_of(port) {
            if let Some(claims) = self.claims.get_mut(&frontend) {
                claims.retain(|(_, key, name)| !(key == service && *name == port.name));
                if claims.is_empty() {
                    self.claims.remove(&frontend);
                }
            }
        }
    }

    /// Puts `port` in place, without the external frontends other ports
    /// hold, if it holds its ClusterIP; else records the conflict.
    fn place(&mut self, service: &ObjectKey, port: &ServicePort) {
        let cluster = cluster_frontend(port);
        if !self.holds(&cluster, Rank::ClusterIp, service, &port.name) {
            let problem = Problem::new(&port.name, format!("{cluster} is already used by another Service"));
            self.conflicts.insert(port.name.clone(), problem);
            self.set(&port.name, None);
            return;
        }
        let lost: BTreeSet<Frontend> = external_frontends(port)
            .into_iter()
            .filter(|f| !self.holds(f, Rank::External, service, &port.name))
            .collect();
        if lost.is_empty() {
            self.conflicts.remove(&port.name);
        } else {
            let list: Vec<String> = lost.iter().map(ToString::to_string).collect();
            let problem = Problem::new(
                &port.name,
                format!(
                    "{} already used by another Service: not served for this one",
                    list.join(", ")
                ),
            );
            self.conflicts.insert(port.name.clone(), problem);
        }
        self.set(&port.name, Some(&without(port, &lost)));
    }

    /// Sets or removes one port, remembering the name if anything changed.
    fn set(&mut self, name: &str, port: Option<&ServicePort>) {
        let changed = match port {
            Some(port) if self.ports.get(name) != Some(port) => {
                self.ports.insert(name.to_owned(), port.clone());
                true
            }
            Some(_) => false,
            None => self.ports.remove(name).is_some(),
        };
        if changed {
            self.changed.insert(name.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn key(name: &str) -> ObjectKey {
        ("default".into(), name.into())
    }

    fn port(service: &str, ip: u8, endpoints: usize) -> ServicePort {
        ServicePort {
            name: format!("default/{service}"),
            cluster_ip: Ipv4Addr::new(10, 96, 0, ip).into(),
            port: 80,
            endpoints: (0..endpoints)
                .map(|i| super::super::Endpoint::ready(Ipv4Addr::new(10, 244, 0, i as u8 + 1), 8080))
                .collect(),
            ..ServicePort::default()
        }
    }

    #[test]
    fn only_ports_that_really_changed_are_reported() {
        let mut joined = Joined::default();
        joined.replace(&key("a"), vec![port("a", 1, 1)]);
        joined.replace(&key("b"), vec![port("b", 2, 1)]);
        assert_eq!(joined.take_changed().len(), 2);
        joined.replace(&key("a"), vec![port("a", 1, 1)]);
        assert!(joined.take_changed().is_empty(), "the same port again is no change");
        joined.replace(&key("b"), vec![port("b", 2, 2)]);
        assert_eq!(joined.take_changed(), BTreeSet::from(["default/b".to_string()]));
        joined.replace(&key("a"), vec![]);
        assert_eq!(joined.take_changed(), BTreeSet::from(["default/a".to_string()]));
        assert_eq!(joined.ports().keys().collect::<Vec<_>>(), vec!["default/b"]);
    }

    #[test]
    fn the_first_service_holds_a_shared_frontend_whatever_the_arrival_order() {
        let mut joined = Joined::default();
        assert!(joined.replace(&key("b"), vec![port("b", 9, 1)]).is_empty());
        // "a" sorts first: it takes the frontend over and "b" must be re-joined.
        let others = joined.replace(&key("a"), vec![port("a", 9, 2)]);
        assert_eq!(others, BTreeSet::from([key("b")]));
        assert!(joined.replace(&key("b"), vec![port("b", 9, 1)]).is_empty());
        assert_eq!(joined.ports().keys().collect::<Vec<_>>(), vec!["default/a"]);
        assert_eq!(joined.problems().len(), 1);
        assert_eq!(joined.problems()[0].object, "default/b");

        // "a" goes: "b" holds the frontend again once it is re-joined.
        let others = joined.replace(&key("a"), vec![]);
        assert_eq!(others, BTreeSet::from([key("b")]));
        joined.replace(&key("b"), vec![port("b", 9, 1)]);
        assert_eq!(joined.ports().keys().collect::<Vec<_>>(), vec!["default/b"]);
        assert!(joined.problems().is_empty());
    }

    /// `port(service, ip, 1)` with external IP `external` and node port `node_port`.
    fn exposed(service: &str, ip: u8, external: [u8; 4], node_port: u16) -> ServicePort {
        ServicePort {
            external_ips: vec![Ipv4Addr::from(external).into()],
            node_port: Some(node_port),
            ..port(service, ip, 1)
        }
    }

    #[test]
    fn a_shared_external_ip_or_node_port_goes_to_the_first_service_and_comes_back() {
        let mut joined = Joined::default();
        joined.replace(&key("b"), vec![exposed("b", 2, [198, 51, 100, 1], 30080)]);
        assert_eq!(joined.ports()["default/b"].external_ips.len(), 1);
        // "a" sorts first: "b" keeps its port and ClusterIP, loses both.
        let others = joined.replace(&key("a"), vec![exposed("a", 1, [198, 51, 100, 1], 30080)]);
        assert_eq!(others, BTreeSet::from([key("b")]));
        joined.replace(&key("b"), vec![exposed("b", 2, [198, 51, 100, 1], 30080)]);
        let b = &joined.ports()["default/b"];
        assert!(b.external_ips.is_empty() && b.node_port.is_none(), "{b:?}");
        assert_eq!(joined.problems().len(), 1);
        assert_eq!(
            joined.problems()[0].reason,
            "198.51.100.1:80/TCP, node port 30080/TCP already used by another Service: not served for this one"
        );
        // "a" goes: both come back to "b" once it is re-joined.
        assert_eq!(joined.replace(&key("a"), vec![]), BTreeSet::from([key("b")]));
        joined.replace(&key("b"), vec![exposed("b", 2, [198, 51, 100, 1], 30080)]);
        assert_eq!(joined.ports()["default/b"], exposed("b", 2, [198, 51, 100, 1], 30080));
        assert!(joined.problems().is_empty());
    }

    #[test]
    fn a_cluster_ip_outranks_an_external_ip_and_a_port_left_out_claims_nothing() {
        let mut joined = Joined::default();
        // "a"'s external IP is "z"'s ClusterIP (same port): "z" keeps it.
        joined.replace(&key("a"), vec![exposed("a", 1, [10, 96, 0, 9], 30080)]);
        joined.replace(&key("z"), vec![port("z", 9, 1)]);
        joined.replace(&key("a"), vec![exposed("a", 1, [10, 96, 0, 9], 30080)]);
        assert!(joined.ports()["default/a"].external_ips.is_empty());
        assert_eq!(joined.ports()["default/a"].node_port, Some(30080));
        // "c" loses its ClusterIP to "a": left out whole, it claims no node
        // port, so "d" (after "c") serves 30081.
        joined.replace(&key("c"), vec![exposed("c", 1, [198, 51, 100, 2], 30081)]);
        joined.replace(&key("d"), vec![exposed("d", 4, [198, 51, 100, 2], 30081)]);
        assert!(!joined.ports().contains_key("default/c"));
        assert_eq!(joined.ports()["default/d"], exposed("d", 4, [198, 51, 100, 2], 30081));
    }

    #[test]
    fn a_port_moving_to_a_free_frontend_leaves_its_conflict_behind() {
        let mut joined = Joined::default();
        joined.replace(&key("a"), vec![port("a", 9, 1)]);
        joined.replace(&key("b"), vec![port("b", 9, 1)]);
        assert_eq!(joined.problems().len(), 1);
        assert!(joined.replace(&key("b"), vec![port("b", 10, 1)]).is_empty());
        assert!(joined.problems().is_empty());
        assert_eq!(joined.ports().len(), 2);
    }
}
