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

use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::Ipv4Addr,
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use proxy_common::{CtKey, CtValue, maps, proto, stats::ct_stat};

use super::{
    ServiceMaps,
    conntrack::{CtStats, read_entries, remove_all},
    pinned_maps::open,
};

type Endpoint = (Ipv4Addr, u16);

/// Deletes the stale UDP entries of the conntrack map pinned under
/// `pin_path`, judged against what `maps` programs now; returns how many.
pub fn delete_stale_udp_flows(pin_path: &Path, maps: &ServiceMaps) -> Result<u64> {
    let mut conntrack: HashMap<MapData, CtKey, CtValue> = open(pin_path, maps::CONNTRACK)?;
    let entries = read_entries(&conntrack, |key, _| key.proto == proto::UDP)?;
    let mut backends_of: StdHashMap<Endpoint, HashSet<Endpoint>> = StdHashMap::new();
    let mut stale = Vec::new();
    for (key, value) in entries {
        let (frontend, backend) = ends(&key, &value);
        let backends = backends_of
            .entry(frontend)
            .or_insert_with(|| current_backends(maps, frontend));
        if !backends.contains(&backend) {
            stale.push(key);
        }
    }
    let deleted = remove_all(&mut conntrack, &stale).context("deleting stale UDP flows")?;
    CtStats::open(pin_path)?.add(ct_stat::AGENT_REMOVED, deleted)?;
    Ok(deleted)
}

/// `(frontend, backend)` of a flow, from either of its entries.
fn ends(key: &CtKey, value: &CtValue) -> (Endpoint, Endpoint) {
    if value.is_reply() {
        (value.nat(), (key.saddr(), key.sport()))
    } else {
        ((key.daddr(), key.dport()), value.nat())
    }
}

/// The backends a UDP frontend picks from now (none if it is gone).
fn current_backends(maps: &ServiceMaps, (addr, port): Endpoint) -> HashSet<Endpoint> {
    let Some(value) = maps.frontend(addr, port, proto::UDP) else {
        return HashSet::new();
    };
    maps.backend_set(&value)
        .map(|set| set.iter().map(|b| (b.addr(), b.port())).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use proxy_common::conntrack::FLAG_REPLY;

    use super::*;

    #[test]
    fn both_entries_name_the_same_frontend_and_backend() {
        let client = (Ipv4Addr::new(10, 0, 0, 1), 40000);
        let frontend = (Ipv4Addr::new(10, 96, 0, 10), 53);
        let backend = (Ipv4Addr::new(10, 244, 0, 2), 5353);
        let value = |nat: Endpoint, flags| CtValue {
            flags,
            nat_addr_be: u32::from_ne_bytes(nat.0.octets()),
            nat_port_be: nat.1.to_be(),
            ..bytemuck::Zeroable::zeroed()
        };
        let forward = CtKey::new(client.0, client.1, frontend.0, frontend.1, proto::UDP);
        let reply = CtKey::new(backend.0, backend.1, client.0, client.1, proto::UDP);
        assert_eq!(ends(&forward, &value(backend, 0)), (frontend, backend));
        assert_eq!(ends(&reply, &value(frontend, FLAG_REPLY)), (frontend, backend));
    }
}
