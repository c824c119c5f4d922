//! The Service ports joined from Services and their EndpointSlices, kept up
//! to date one Service at a time.
//!
//! A change to one object re-joins only the Service it belongs to, so an
//! endpoint change costs the same with ten Services or a hundred thousand.
//! What makes this more than a map insert is the one rule that spans
//! Services: two Service ports cannot share a frontend (ClusterIP, port,
//! protocol). The API server prevents it, a hand-written manifest may not;
//! the port of the first Service in (namespace, name) order keeps it, as if
//! every Service were joined in that order, and the others are problems.
//! When the holder of a frontend goes, the next claimant takes it over.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use super::{ObjectKey, Problem, Protocol, ServicePort};

/// What the kernel tells Service ports apart by.
type Frontend = (Ipv4Addr, u16, Protocol);

/// A port that wants a frontend: its Service, then its name (the order in
/// which claims win).
type Claim = (ObjectKey, String);

fn frontend_of(port: &ServicePort) -> Frontend {
    (port.cluster_ip, port.port, port.protocol)
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
        let touched: BTreeSet<Frontend> = old.iter().chain(&wanted).map(frontend_of).collect();
        let holders_before: Vec<Option<Claim>> = touched.iter().map(|f| self.holder(f).cloned()).collect();

        for port in &old {
            self.unclaim(service, port);
            if !wanted.iter().any(|p| p.name == port.name) {
                self.set(&port.name, None);
                self.conflicts.remove(&port.name);
            }
        }
        for port in &wanted {
            self.claims
                .entry(frontend_of(port))
                .or_default()
                .insert((service.clone(), port.name.clone()));
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
                others.extend([before, after].into_iter().flatten().map(|(key, _)| key));
            }
        }
        others.remove(service);
        others
    }

    fn holder(&self, frontend: &Frontend) -> Option<&Claim> {
        self.claims.get(frontend).and_then(|c| c.first())
    }

    fn unclaim(&mut self, service: &ObjectKey, port: &ServicePort) {
        let frontend = frontend_of(port);
        if let Some(claims) = self.claims.get_mut(&frontend) {
            claims.remove(&(service.clone(), port.name.clone()));
            if claims.is_empty() {
                self.claims.remove(&frontend);
            }
        }
    }

    /// Puts `port` in place if its Service holds the frontend, else records
    /// the conflict.
    fn place(&mut self, service: &ObjectKey, port: &ServicePort) {
        let frontend = frontend_of(port);
        let holds = self
            .holder(&frontend)
            .is_some_and(|(key, name)| key == service && *name == port.name);
        if holds {
            self.conflicts.remove(&port.name);
            self.set(&port.name, Some(port));
        } else {
            let (ip, number, protocol) = frontend;
            let problem = Problem::new(
                &port.name,
                format!("{ip}:{number}/{protocol} is already used by another Service"),
            );
            self.conflicts.insert(port.name.clone(), problem);
            self.set(&port.name, None);
        }
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
    use super::*;

    fn key(name: &str) -> ObjectKey {
        ("default".into(), name.into())
    }

    fn port(service: &str, ip: u8, endpoints: usize) -> ServicePort {
        ServicePort {
            name: format!("default/{service}"),
            cluster_ip: Ipv4Addr::new(10, 96, 0, ip),
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
