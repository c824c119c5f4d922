//! The IPVS mode read back over netlink: every virtual server is a
//! frontend, its real servers the backends, their flows IPVS's own
//! active + inactive connection counts (as `ipvsadm -Ln` shows them);
//! persistence is ClientIP affinity. kube-proxy's ipsets say what kind
//! of address a virtual server is (`KUBE-CLUSTER-IP`, `KUBE-NODE-PORT-*`,
//! `KUBE-EXTERNAL-IP`, `KUBE-LOAD-BALANCER`), which ones keep to local
//! endpoints (`*-LOCAL`) and which load balancer IPs filter sources
//! (`KUBE-LOAD-BALANCER-SOURCE-CIDR`). A set it does not know is skipped.
//! An IPv6 virtual server's kind is in the IPv6 sets (`KUBE-6-...`).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;

use super::table::{Backend, Frontend, Kind, Table};
use crate::{
    mode::ipvs::{
        ipset::{
            CLUSTER_IP, EXTERNAL_IP, EXTERNAL_IP_LOCAL, LOAD_BALANCER, LOAD_BALANCER_FW, LOAD_BALANCER_LOCAL,
            LOAD_BALANCER_SOURCE_CIDR, NODE_PORT_LOCAL_SCTP, NODE_PORT_LOCAL_TCP, NODE_PORT_LOCAL_UDP, NODE_PORT_SCTP,
            NODE_PORT_TCP, NODE_PORT_UDP, name,
        },
        netlink::{Ipvs, RealCounters, VirtualCounters},
    },
    model::{IpFamily, Protocol},
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

/// The table of the `servers` of both families, their kinds from `sets`.
pub fn table_of(servers: &[VirtualCounters], sets: &Sets) -> Table {
    Table::new("ipvs", servers.iter().map(|s| frontend(s, sets)).collect())
}

/// The frontend of a virtual server; its kind from the sets of its
/// family.
fn frontend(server: &VirtualCounters, sets: &Sets) -> Frontend {
    let key = server.key;
    let family = IpFamily::of(key.addr);
    let set = |set| name(set, family);
    let member = format!("{},{}:{}", key.addr, key.protocol.lowercase(), key.port);
    let port = key.port.to_string();
    // SCTP's node port sets are hashes of `IP,sctp:PORT`, TCP's and UDP's
    // bitmaps of ports.
    let (node_port_set, local_node_port_set, node_port_member) = match key.protocol {
        Protocol::Sctp => (set(NODE_PORT_SCTP), set(NODE_PORT_LOCAL_SCTP), &member),
        Protocol::Tcp => (set(NODE_PORT_TCP), set(NODE_PORT_LOCAL_TCP), &port),
        Protocol::Udp => (set(NODE_PORT_UDP), set(NODE_PORT_LOCAL_UDP), &port),
    };
    let (kind, local_only) = if sets.has(set(CLUSTER_IP), &member) {
        (Kind::ClusterIp, false)
    } else if sets.has(node_port_set, node_port_member) {
        (Kind::NodePort, sets.has(local_node_port_set, node_port_member))
    } else if sets.has(set(LOAD_BALANCER), &member) {
        (Kind::LoadBalancer, sets.has(set(LOAD_BALANCER_LOCAL), &member))
    } else if sets.has(set(EXTERNAL_IP), &member) {
        (Kind::ExternalIp, sets.has(set(EXTERNAL_IP_LOCAL), &member))
    } else {
        (Kind::External, false)
    };
    let mut frontend = Frontend::new(key.protocol, key.addr, key.port, kind);
    frontend.local_only = local_only;
    frontend.affinity_seconds = server.persistent_seconds;
    let prefix = format!("{member},");
    frontend.source_ranges = sets
        .starting_with(set(LOAD_BALANCER_SOURCE_CIDR), &prefix)
        .map(str::to_owned)
        .collect();
    frontend.source_filtered = !frontend.source_ranges.is_empty() || sets.has(set(LOAD_BALANCER_FW), &member);
    if !server.scheduler.is_empty() {
        frontend.notes.push(format!("scheduler {}", server.scheduler));
    }
    frontend.backends = server.reals.iter().map(backend).collect();
    frontend
}

/// A real server: its flows are IPVS's connections; a weight of 0 (a
/// terminating endpoint) takes no new ones.
fn backend(real: &RealCounters) -> Backend {
    let mut notes = vec![format!("active {}, inactive {}", real.active, real.inactive)];
    if real.persistent > 0 {
        notes.push(format!("{} affinity entries", real.persistent));
    }
    if real.weight == 0 {
        notes.push("weight 0: no new flows".into());
    }
    Backend {
        addr: Some((real.addr, real.port)),
        flows: Some(u64::from(real.active) + u64::from(real.inactive)),
        notes,
    }
}

#[cfg(test)]
mod tests;
