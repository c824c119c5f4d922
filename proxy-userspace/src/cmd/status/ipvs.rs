//! The IPVS mode read back over netlink: every virtual server is a
//! frontend, its real servers the backends, their flows IPVS's own
//! active + inactive connection counts (as `ipvsadm -Ln` shows them);
//! persistence is ClientIP affinity. kube-proxy's ipsets say what kind
//! of address a virtual server is (`KUBE-CLUSTER-IP`, `KUBE-NODE-PORT-*`,
//! `KUBE-EXTERNAL-IP`, `KUBE-LOAD-BALANCER`), which ones keep to local
//! endpoints (`*-LOCAL`) and which load balancer IPs filter sources
//! (`KUBE-LOAD-BALANCER-SOURCE-CIDR`). A set it does not know is skipped.
//! The table is IPv4 only (its addresses are, for every mode): IPv6
//! virtual servers are left out of it; `ipvsadm -Ln` shows them.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;

use super::table::{Backend, Frontend, Kind, Table};
use crate::{
    mode::ipvs::netlink::{Ipvs, RealCounters, VirtualCounters},
    model::ipv4,
    sys::ipset,
};

/// Whether the namespace has IPVS virtual servers (a kernel without IPVS
/// has none).
pub fn in_use() -> bool {
    Ipvs::open()
        .and_then(|mut ipvs| ipvs.list_counters())
        .is_ok_and(|servers| !servers.is_empty())
}

/// Reads IPVS and the ipsets of the calling thread's network namespace.
pub fn read_back() -> Result<Table> {
    let servers = Ipvs::open()?.list_counters()?;
    // Without ipsets (another IPVS user, a half cleaned-up node) every
    // address is still listed, of a kind guessed from the rest.
    let sets = ipset::save().unwrap_or_default();
    Ok(table_of(&servers, &Sets::parse(&sets)))
}

/// Members of every set, as `ipset save` writes them.
#[derive(Default)]
pub struct Sets {
    members: BTreeMap<String, BTreeSet<String>>,
}

impl Sets {
    pub fn parse(save: &str) -> Self {
        let mut sets = Sets::default();
        for line in save.lines() {
            let mut words = line.split_whitespace();
            if let (Some("add"), Some(set), Some(member)) = (words.next(), words.next(), words.next()) {
                sets.members
                    .entry(set.to_owned())
                    .or_default()
                    .insert(member.to_owned());
            }
        }
        sets
    }

    fn has(&self, set: &str, member: &str) -> bool {
        self.members.get(set).is_some_and(|m| m.contains(member))
    }

    /// Members of `set` starting with `prefix`.
    fn starting_with<'a>(&'a self, set: &str, prefix: &'a str) -> impl Iterator<Item = &'a str> {
        self.members
            .get(set)
            .into_iter()
            .flatten()
            .filter_map(move |m| m.strip_prefix(prefix))
    }
}

/// The table of the IPv4 `servers`, their kinds from `sets`.
pub fn table_of(servers: &[VirtualCounters], sets: &Sets) -> Table {
    Table::new("ipvs", servers.iter().filter_map(|s| frontend(s, sets)).collect())
}

/// The frontend of an IPv4 virtual server.
fn frontend(server: &VirtualCounters, sets: &Sets) -> Option<Frontend> {
    let key = server.key;
    let addr = ipv4(key.addr)?;
    let proto = key.protocol.lowercase();
    let upper = key.protocol.to_string();
    let member = format!("{},{proto}:{}", key.addr, key.port);
    let port = key.port.to_string();
    let (kind, local_only) = if sets.has("KUBE-CLUSTER-IP", &member) {
        (Kind::ClusterIp, false)
    } else if sets.has(&format!("KUBE-NODE-PORT-{upper}"), &port) {
        (
            Kind::NodePort,
            sets.has(&format!("KUBE-NODE-PORT-LOCAL-{upper}"), &port),
        )
    } else if sets.has("KUBE-LOAD-BALANCER", &member) {
        (Kind::LoadBalancer, sets.has("KUBE-LOAD-BALANCER-LOCAL", &member))
    } else if sets.has("KUBE-EXTERNAL-IP", &member) {
        (Kind::ExternalIp, sets.has("KUBE-EXTERNAL-IP-LOCAL", &member))
    } else {
        (Kind::External, false)
    };
    let mut frontend = Frontend::new(key.protocol, addr, key.port, kind);
    frontend.local_only = local_only;
    frontend.affinity_seconds = server.persistent_seconds;
    let prefix = format!("{member},");
    frontend.source_ranges = sets
        .starting_with("KUBE-LOAD-BALANCER-SOURCE-CIDR", &prefix)
        .map(str::to_owned)
        .collect();
    frontend.source_filtered = !frontend.source_ranges.is_empty() || sets.has("KUBE-LOAD-BALANCER-FW", &member);
    if !server.scheduler.is_empty() {
        frontend.notes.push(format!("scheduler {}", server.scheduler));
    }
    frontend.backends = server.reals.iter().filter_map(backend).collect();
    Some(frontend)
}

/// A real server: its flows are IPVS's connections; a weight of 0 (a
/// terminating endpoint) takes no new ones.
fn backend(real: &RealCounters) -> Option<Backend> {
    let mut notes = vec![format!("active {}, inactive {}", real.active, real.inactive)];
    if real.persistent > 0 {
        notes.push(format!("{} affinity entries", real.persistent));
    }
    if real.weight == 0 {
        notes.push("weight 0: no new flows".into());
    }
    Some(Backend {
        addr: Some((ipv4(real.addr)?, real.port)),
        flows: Some(u64::from(real.active) + u64::from(real.inactive)),
        notes,
    })
}

#[cfg(test)]
mod tests;
