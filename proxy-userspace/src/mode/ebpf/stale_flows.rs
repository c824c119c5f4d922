//! Deletes the programs' conntrack entries of UDP flows whose backend left
//! their frontend, after a sync.
//!
//! A tracked flow's packets are translated from its conntrack entries
//! alone (`proxy_common::conntrack`): a flow keeps its backend until its
//! entries go, whatever the Service does. That is kube-proxy's behaviour
//! for TCP (its conntrack entries outlive the rules: a connection to a
//! removed endpoint goes on until it ends). For UDP kube-proxy deletes the
//! flows of endpoints that left (`mode::conntrack`), so that a client that
//! keeps sending (DNS) moves to a remaining endpoint; so do we, here: both
//! entries of every UDP flow whose backend is no longer among its
//! frontend's backends, or whose frontend is gone (a deleted Service).
//! Both families: `XP_CT` and `XP_CT6`.

use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::IpAddr,
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use proxy_common::{CtKey, CtKey6, CtValue, CtValue6, ipv6::ipv6_of, maps, proto, stats::ct_stat};

use super::{
    ServiceMaps,
    conntrack::{CtStats, read_entries, remove_all},
    pinned_maps::open,
};

type Endpoint = (IpAddr, u16);

/// Deletes the stale UDP entries of the conntrack maps pinned under
/// `pin_path`, judged against what `maps` programs now; returns how many.
pub fn delete_stale_udp_flows(pin_path: &Path, maps: &ServiceMaps) -> Result<u64> {
    let mut backends_of: StdHashMap<Endpoint, HashSet<Endpoint>> = StdHashMap::new();
    let mut conntrack: HashMap<MapData, CtKey, CtValue> = open(pin_path, maps::CONNTRACK)?;
    let deleted = delete_stale(&mut conntrack, ends, |f, b| is_current(maps, &mut backends_of, f, b))?;
    let mut conntrack6: HashMap<MapData, CtKey6, CtValue6> = open(pin_path, maps::CONNTRACK6)?;
    let deleted6 = delete_stale(&mut conntrack6, ends6, |f, b| is_current(maps, &mut backends_of, f, b))?;
    let deleted = deleted + deleted6;
    CtStats::open(pin_path)?.add(ct_stat::AGENT_REMOVED, deleted)?;
    Ok(deleted)
}

/// Deletes both entries of every UDP flow in `conntrack` whose backend is
/// not `current` for its frontend; returns how many went.
fn delete_stale<K, V>(
    conntrack: &mut HashMap<MapData, K, V>,
    ends: fn(&K, &V) -> (Endpoint, Endpoint, u8),
    mut current: impl FnMut(Endpoint, Endpoint) -> bool,
) -> Result<u64>
where
    K: aya::Pod + bytemuck::Pod,
    V: aya::Pod + bytemuck::Pod,
{
    let entries = read_entries(conntrack, |key, value| ends(key, value).2 == proto::UDP)?;
    let stale: Vec<K> = (entries.into_iter())
        .filter(|(key, value)| {
            let (frontend, backend, _) = ends(key, value);
            !current(frontend, backend)
        })
        .map(|(key, _)| key)
        .collect();
    remove_all(conntrack, &stale).context("deleting stale UDP flows")
}

/// `(frontend, backend, protocol)` of an IPv4 flow, from either of its entries.
fn ends(key: &CtKey, value: &CtValue) -> (Endpoint, Endpoint, u8) {
    let source = (key.saddr().into(), key.sport());
    let destination = (key.daddr().into(), key.dport());
    let (frontend, backend) = frontend_and_backend(source, destination, endpoint(value.nat()), value.is_reply());
    (frontend, backend, key.proto)
}

/// `(frontend, backend, protocol)` of an IPv6 flow, from either of its entries.
pub(super) fn ends6(key: &CtKey6, value: &CtValue6) -> (Endpoint, Endpoint, u8) {
    let source = (ipv6_of(key.saddr_be).into(), u16::from_be(key.sport_be));
    let destination = (ipv6_of(key.daddr_be).into(), u16::from_be(key.dport_be));
    let (frontend, backend) = frontend_and_backend(source, destination, endpoint(value.nat()), value.is_reply());
    (frontend, backend, key.proto)
}

/// `(frontend, backend)` of a flow of either family, from one of its
/// entries, keyed `source -> destination` and translated to `nat`: the
/// forward entry is keyed client -> frontend and NATs to the backend, the
/// reply entry is keyed backend -> client and NATs back to the frontend.
fn frontend_and_backend(source: Endpoint, destination: Endpoint, nat: Endpoint, reply: bool) -> (Endpoint, Endpoint) {
    if reply { (nat, source) } else { (destination, nat) }
}

/// An address of either family with its port.
fn endpoint<A: Into<IpAddr>>((addr, port): (A, u16)) -> Endpoint {
    (addr.into(), port)
}

/// Whether `backend` is among the backends the UDP frontend picks from
/// now (none if it is gone); each frontend's are read once, into `known`.
fn is_current(
    maps: &ServiceMaps,
    known: &mut StdHashMap<Endpoint, HashSet<Endpoint>>,
    (addr, port): Endpoint,
    backend: Endpoint,
) -> bool {
    let backends = known.entry((addr, port)).or_insert_with(|| {
        let Some(value) = maps.frontend(addr, port, proto::UDP) else {
            return HashSet::new();
        };
        maps.backend_endpoints(&value)
            .map(HashSet::from_iter)
            .unwrap_or_default()
    });
    backends.contains(&backend)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use proxy_common::conntrack::FLAG_REPLY;

    use super::*;

    #[test]
    fn both_entries_name_the_same_frontend_and_backend() {
        let client = (Ipv4Addr::new(10, 0, 0, 1), 40000);
        let frontend = (Ipv4Addr::new(10, 96, 0, 10), 53);
        let backend = (Ipv4Addr::new(10, 244, 0, 2), 5353);
        let value = |nat: (Ipv4Addr, u16), flags| CtValue {
            flags,
            nat_addr_be: u32::from_ne_bytes(nat.0.octets()),
            nat_port_be: nat.1.to_be(),
            ..bytemuck::Zeroable::zeroed()
        };
        let forward = CtKey::new(client.0, client.1, frontend.0, frontend.1, proto::UDP);
        let reply = CtKey::new(backend.0, backend.1, client.0, client.1, proto::UDP);
        let want = (
            (frontend.0.into(), frontend.1),
            (backend.0.into(), backend.1),
            proto::UDP,
        );
        assert_eq!(ends(&forward, &value(backend, 0)), want);
        assert_eq!(ends(&reply, &value(frontend, FLAG_REPLY)), want);
    }

    #[test]
    fn both_ipv6_entries_name_the_same_frontend_and_backend() {
        let ip = |s: &str| s.parse::<Ipv6Addr>().expect("ip");
        let (client, frontend, backend) = (
            (ip("fd00::1"), 40000),
            (ip("fd00:96::a"), 53),
            (ip("fd00:244::2"), 5353),
        );
        let value = |nat: (Ipv6Addr, u16), flags| CtValue6 {
            flags,
            nat_addr_be: proxy_common::ipv6::addr6_be(nat.0),
            nat_port_be: nat.1.to_be(),
            ..bytemuck::Zeroable::zeroed()
        };
        let forward = CtKey6::new(client.0, client.1, frontend.0, frontend.1, proto::UDP);
        let reply = CtKey6::new(backend.0, backend.1, client.0, client.1, proto::UDP);
        let want = (
            (frontend.0.into(), frontend.1),
            (backend.0.into(), backend.1),
            proto::UDP,
        );
        assert_eq!(ends6(&forward, &value(backend, 0)), want);
        assert_eq!(ends6(&reply, &value(frontend, FLAG_REPLY)), want);
    }
}
