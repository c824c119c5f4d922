//! Endpoint choice for one service port: round robin over its usable
//! endpoints, like kube-proxy's userspace `LoadBalancerRR`.
//!
//! The agent's sync thread replaces the endpoint set; the connection and
//! datagram tasks read it. The set lives in a `watch` channel, so a UDP
//! proxy also learns when it changed (to close sessions whose backend
//! left). The cursor is one atomic counter shared by every task: each pick
//! takes the next slot, from any thread, without a lock.
//!
//! Session affinity (`ClientIP`), as kube-proxy's legacy `LoadBalancerRR`
//! kept it: a client address keeps the endpoint it was given until it has
//! not been given it for the timeout; an endpoint that leaves the set
//! releases its clients, and a client whose endpoint fails to connect is
//! given the next one. The table sits behind a mutex taken only by
//! Services with affinity.
//!
//! Differences from kube-proxy: no shuffle of a new set (the order is the
//! endpoints' sorted order, so tests and logs are reproducible) and the
//! cursor is not reset when the set changes.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::watch;

use crate::model::{Endpoint, ServicePort, usable_endpoints};

/// The endpoint set as the tasks see it.
pub type Endpoints = Arc<[SocketAddr]>;

pub struct Balancer {
    endpoints: watch::Sender<Endpoints>,
    cursor: AtomicUsize,
    /// Whether `affinity` has a timeout: without, picks skip its lock.
    sticky: AtomicBool,
    affinity: Mutex<Affinity>,
}

/// The ClientIP affinity of one service port.
#[derive(Default)]
struct Affinity {
    /// `None`: every pick takes the next endpoint in turn.
    timeout: Option<Duration>,
    clients: HashMap<IpAddr, Sticky>,
    /// The table's size after its last sweep of expired clients: it is
    /// swept again when it has doubled, so it holds the clients of about
    /// one timeout, not of all time.
    swept_at: usize,
}

#[derive(Clone, Copy)]
struct Sticky {
    endpoint: SocketAddr,
    last_used: Instant,
}

impl Affinity {
    fn sweep_if_grown(&mut self, now: Instant) {
        let Some(timeout) = self.timeout else {
            return;
        };
        if self.clients.len() >= (self.swept_at * 2).max(64) {
            self.clients.retain(|_, s| now.duration_since(s.last_used) < timeout);
            self.swept_at = self.clients.len();
        }
    }
}

impl Balancer {
    pub fn new(endpoints: Vec<SocketAddr>) -> Self {
        Self {
            endpoints: watch::Sender::new(endpoints.into()),
            cursor: AtomicUsize::new(0),
            sticky: AtomicBool::new(false),
            affinity: Mutex::new(Affinity::default()),
        }
    }

    fn affinity(&self) -> MutexGuard<'_, Affinity> {
        // A panic elsewhere leaves the table consistent (plain inserts).
        self.affinity.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Turns ClientIP affinity on with this idle timeout, or off (`None`).
    /// A change forgets every client: each is balanced anew.
    pub fn set_affinity(&self, timeout: Option<Duration>) {
        let mut affinity = self.affinity();
        if affinity.timeout != timeout {
            *affinity = Affinity {
                timeout,
                ..Affinity::default()
            };
            self.sticky.store(timeout.is_some(), Ordering::Release);
        }
    }

    /// Replaces the set; returns whether it changed (receivers of
    /// [`Self::subscribe`] are told only then). Clients of endpoints that
    /// left are released.
    pub fn set(&self, endpoints: Vec<SocketAddr>) -> bool {
        let changed = self.endpoints.send_if_modified(|current| {
            if **current == *endpoints {
                return false;
            }
            *current = endpoints.into();
            true
        });
        if changed {
            let current = self.endpoints();
            self.affinity().clients.retain(|_, s| current.contains(&s.endpoint));
        }
        changed
    }

    /// The endpoint for a new flow from `client`: with affinity the one it
    /// was given last if still there and used within the timeout, else the
    /// next in turn (remembered for the client). `None` when there is none.
    pub fn pick(&self, client: IpAddr) -> Option<SocketAddr> {
        self.pick_for(client, false)
    }

    /// As [`Self::pick`], but the next in turn even if the client has an
    /// endpoint (it failed to connect); remembered for the client.
    pub fn pick_again(&self, client: IpAddr) -> Option<SocketAddr> {
        self.pick_for(client, true)
    }

    fn pick_for(&self, client: IpAddr, anew: bool) -> Option<SocketAddr> {
        if !self.sticky.load(Ordering::Acquire) {
            return self.next();
        }
        let mut affinity = self.affinity();
        let Some(timeout) = affinity.timeout else {
            drop(affinity);
            return self.next();
        };
        let now = Instant::now();
        let kept = affinity
            .clients
            .get(&client)
            .filter(|s| !anew && now.duration_since(s.last_used) < timeout && self.contains(s.endpoint))
            .map(|s| s.endpoint);
        let endpoint = match kept {
            Some(endpoint) => endpoint,
            None => self.next()?,
        };
        affinity.clients.insert(
            client,
            Sticky {
                endpoint,
                last_used: now,
            },
        );
        affinity.sweep_if_grown(now);
        Some(endpoint)
    }

    /// The next endpoint in turn; `None` when there is none.
    pub fn next(&self) -> Option<SocketAddr> {
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

    pub fn contains(&self, endpoint: SocketAddr) -> bool {
        self.endpoints.borrow().contains(&endpoint)
    }

    /// Notified whenever [`Self::set`] changes the set.
    pub fn subscribe(&self) -> watch::Receiver<Endpoints> {
        self.endpoints.subscribe()
    }
}

/// The addresses traffic of `port` goes to: its usable endpoints (see
/// [`usable_endpoints`]), sorted, each once.
pub fn endpoint_addrs(port: &ServicePort) -> Vec<SocketAddr> {
    let mut addrs: Vec<SocketAddr> = usable_endpoints(&port.endpoints)
        .into_iter()
        .map(|e: &Endpoint| SocketAddr::new(e.addr, e.port))
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

    fn ep(last: u8) -> SocketAddr {
        SocketAddr::new(Ipv4Addr::new(10, 244, 0, last).into(), 80)
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

    const A: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    const B: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2));

    #[test]
    fn affinity_keeps_a_client_on_its_endpoint_until_it_leaves() {
        let balancer = Balancer::new(vec![ep(1), ep(2), ep(3)]);
        balancer.set_affinity(Some(Duration::from_secs(60)));
        let a = balancer.pick(A).expect("an endpoint");
        let b = balancer.pick(B).expect("an endpoint");
        assert_ne!(a, b, "new clients are balanced");
        for _ in 0..5 {
            assert_eq!(balancer.pick(A), Some(a));
            assert_eq!(balancer.pick(B), Some(b));
        }
        // A's endpoint leaves: A is released, B keeps its own.
        let rest: Vec<_> = [ep(1), ep(2), ep(3)].into_iter().filter(|e| *e != a).collect();
        balancer.set(rest.clone());
        let moved = balancer.pick(A).expect("an endpoint");
        assert!(rest.contains(&moved));
        assert_eq!(balancer.pick(A), Some(moved), "and sticks to the new one");
        assert_eq!(balancer.pick(B), Some(b));
        // A failed connect gives the next endpoint, remembered.
        let again = balancer.pick_again(A).expect("an endpoint");
        assert_ne!(again, moved);
        assert_eq!(balancer.pick(A), Some(again));
    }

    #[test]
    fn affinity_expires_after_the_idle_timeout_and_can_be_switched_off() {
        let balancer = Balancer::new(vec![ep(1), ep(2)]);
        balancer.set_affinity(Some(Duration::from_millis(1)));
        let first = balancer.pick(A).expect("an endpoint");
        std::thread::sleep(Duration::from_millis(5));
        // Idle past the timeout: balanced anew (the cursor moved on).
        assert_ne!(balancer.pick(A), Some(first));

        balancer.set_affinity(Some(Duration::from_secs(60)));
        let sticky = balancer.pick(A).expect("an endpoint");
        assert_eq!(balancer.pick(A), Some(sticky));
        balancer.set_affinity(None);
        let spread: Vec<_> = (0..4).filter_map(|_| balancer.pick(A)).collect();
        assert!(spread.contains(&ep(1)) && spread.contains(&ep(2)), "{spread:?}");
        balancer.set_affinity(Some(Duration::from_secs(60)));
        let on_again = balancer.pick(A).expect("an endpoint");
        assert_eq!(balancer.pick(A), Some(on_again));
    }

    #[test]
    fn expired_clients_are_swept_as_the_table_grows() {
        let balancer = Balancer::new(vec![ep(1)]);
        balancer.set_affinity(Some(Duration::from_millis(1)));
        for i in 0..63u8 {
            balancer.pick(Ipv4Addr::new(198, 51, 100, i).into());
        }
        std::thread::sleep(Duration::from_millis(5));
        balancer.pick(A);
        assert_eq!(balancer.affinity().clients.len(), 1, "the 63 idle clients are gone");
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
            cluster_ip: Ipv4Addr::new(10, 96, 0, 1).into(),
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
