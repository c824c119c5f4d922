//! Endpoint choice for one service port: round robin over its usable
//! endpoints, like kube-proxy's userspace `LoadBalancerRR`.
//!
//! The agent's sync thread replaces the endpoint set; the connection and
//! datagram tasks read it. The set lives in a `watch` channel, so a UDP
//! proxy also learns when it changed (to close sessions whose backend
//! left). The cursor is one atomic counter shared by every task: each pick
//! takes the next slot, from any thread, without a lock.
//!
//! Differences from kube-proxy: no shuffle of a new set (the order is the
//! endpoints' sorted order, so tests and logs are reproducible) and the
//! cursor is not reset when the set changes. Session affinity (`ClientIP`)
//! is not offered: the model does not carry a Service's `sessionAffinity`.

use std::{
    net::SocketAddrV4,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::sync::watch;

use crate::model::{Endpoint, ServicePort, usable_endpoints};

/// The endpoint set as the tasks see it.
pub type Endpoints = Arc<[SocketAddrV4]>;

pub struct Balancer {
    endpoints: watch::Sender<Endpoints>,
    cursor: AtomicUsize,
}

impl Balancer {
    pub fn new(endpoints: Vec<SocketAddrV4>) -> Self {
        Self {
            endpoints: watch::Sender::new(endpoints.into()),
            cursor: AtomicUsize::new(0),
        }
    }

    /// Replaces the set; returns whether it changed (receivers of
    /// [`Self::subscribe`] are told only then).
    pub fn set(&self, endpoints: Vec<SocketAddrV4>) -> bool {
        self.endpoints.send_if_modified(|current| {
            if **current == *endpoints {
                return false;
            }
            *current = endpoints.into();
            true
        })
    }

    /// The next endpoint in turn; `None` when there is none.
    pub fn next(&self) -> Option<SocketAddrV4> {
        let endpoints = self.endpoints.borrow();
        if endpoints.is_empty() {
            return None;
        }
        let slot = self.cursor.fetch_add(1, Ordering::Relaxed);
        Some(endpoints[slot % endpoints.len()])
    }

    pub fn endpoints(&self) -> Endpoints {
        self.endpoints.borrow().clone()
    }

    pub fn contains(&self, endpoint: SocketAddrV4) -> bool {
        self.endpoints.borrow().contains(&endpoint)
    }

    /// Notified whenever [`Self::set`] changes the set.
    pub fn subscribe(&self) -> watch::Receiver<Endpoints> {
        self.endpoints.subscribe()
    }
}

/// The addresses traffic of `port` goes to: its usable endpoints (see
/// [`usable_endpoints`]), sorted, each once.
pub fn endpoint_addrs(port: &ServicePort) -> Vec<SocketAddrV4> {
    let mut addrs: Vec<SocketAddrV4> = usable_endpoints(&port.endpoints)
        .into_iter()
        .map(|e: &Endpoint| SocketAddrV4::new(e.addr, e.port))
        .collect();
    addrs.sort_unstable();
    addrs.dedup();
    addrs
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::Protocol;

    fn ep(last: u8) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, last), 80)
    }

    #[test]
    fn picks_every_endpoint_in_turn() {
        let balancer = Balancer::new(vec![ep(1), ep(2), ep(3)]);
        let picks: Vec<_> = (0..7).map(|_| balancer.next()).collect();
        assert_eq!(picks, [ep(1), ep(2), ep(3), ep(1), ep(2), ep(3), ep(1)].map(Some));
    }

    #[test]
    fn no_endpoint_no_pick() {
        let balancer = Balancer::new(vec![]);
        assert_eq!(balancer.next(), None);
        balancer.set(vec![ep(9)]);
        assert_eq!(balancer.next(), Some(ep(9)));
        balancer.set(vec![]);
        assert_eq!(balancer.next(), None);
    }

    #[test]
    fn a_new_set_is_used_at_once_and_announced() {
        let balancer = Balancer::new(vec![ep(1), ep(2), ep(3)]);
        let mut changes = balancer.subscribe();
        assert!(!balancer.set(vec![ep(1), ep(2), ep(3)]), "the same set is no change");
        assert!(!changes.has_changed().expect("sender alive"));
        assert!(balancer.set(vec![ep(1), ep(2)]));
        assert!(changes.has_changed().expect("sender alive"));
        assert_eq!(**changes.borrow_and_update(), [ep(1), ep(2)]);
        assert!(!balancer.contains(ep(3)));
        let picks: Vec<_> = (0..4).filter_map(|_| balancer.next()).collect();
        assert!(!picks.contains(&ep(3)), "{picks:?}");
        assert!(picks.contains(&ep(1)) && picks.contains(&ep(2)), "{picks:?}");
    }

    #[test]
    fn concurrent_picks_spread_evenly() {
        let balancer = Arc::new(Balancer::new(vec![ep(1), ep(2), ep(3)]));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let balancer = balancer.clone();
                std::thread::spawn(move || (0..300).filter_map(|_| balancer.next()).collect::<Vec<_>>())
            })
            .collect();
        let mut counts = std::collections::BTreeMap::new();
        for thread in threads {
            for pick in thread.join().expect("picker thread") {
                *counts.entry(pick).or_insert(0) += 1;
            }
        }
        // 1200 picks from one shared cursor: exactly 400 each.
        assert_eq!(counts.values().copied().collect::<Vec<_>>(), [400, 400, 400]);
    }

    #[test]
    fn endpoints_are_the_usable_ones_sorted() {
        let mut terminating = Endpoint::ready(Ipv4Addr::new(10, 244, 0, 4), 80);
        terminating.ready = false;
        terminating.terminating = true;
        let port = ServicePort {
            name: "default/web".into(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(10, 96, 0, 1),
            port: 80,
            node_port: None,
            endpoints: vec![
                Endpoint::ready(Ipv4Addr::new(10, 244, 0, 2), 80),
                terminating.clone(),
                Endpoint::ready(Ipv4Addr::new(10, 244, 0, 1), 80),
                Endpoint::ready(Ipv4Addr::new(10, 244, 0, 2), 80),
            ],
            ..ServicePort::default()
        };
        assert_eq!(endpoint_addrs(&port), [ep(1), ep(2)]);
        let draining = ServicePort {
            endpoints: vec![terminating],
            ..port
        };
        assert_eq!(endpoint_addrs(&draining), [ep(4)], "serving while terminating");
    }
}
