//! kube-proxy's ipsets of the IPVS mode, which the constant iptables rules
//! of [`super::rules`] match against, so the rules never grow with the
//! number of Services.
//!
//! Written with `ipset restore` ([`crate::sys::ipset`], one process per
//! sync that changes a set):
//! each changed set is filled as a `-NEW` copy and swapped in atomically,
//! so no packet sees a half-filled set. Read back with `ipset save`.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;

use crate::{
    model::{EndpointSets, Protocol, ServicePort},
    sys::ipset,
};

/// Every ClusterIP, port and protocol: `IP,PROTO:PORT`.
pub const CLUSTER_IP: &str = "KUBE-CLUSTER-IP";
/// TCP NodePorts: `PORT`.
pub const NODE_PORT_TCP: &str = "KUBE-NODE-PORT-TCP";
/// UDP NodePorts: `PORT`.
pub const NODE_PORT_UDP: &str = "KUBE-NODE-PORT-UDP";
/// TCP NodePorts with `externalTrafficPolicy: Local` (not masqueraded): `PORT`.
pub const NODE_PORT_LOCAL_TCP: &str = "KUBE-NODE-PORT-LOCAL-TCP";
/// UDP NodePorts with `externalTrafficPolicy: Local`: `PORT`.
pub const NODE_PORT_LOCAL_UDP: &str = "KUBE-NODE-PORT-LOCAL-UDP";
/// Endpoints that may reach themselves through their Service (hairpin,
/// masqueraded): `IP,PROTO:PORT,IP`.
pub const LOOP_BACK: &str = "KUBE-LOOP-BACK";

/// The sets: name and `ipset create` type and options.
pub const SETS: [(&str, &str); 6] = [
    (CLUSTER_IP, "hash:ip,port family inet hashsize 1024 maxelem 65536"),
    (NODE_PORT_TCP, "bitmap:port range 0-65535"),
    (NODE_PORT_UDP, "bitmap:port range 0-65535"),
    (NODE_PORT_LOCAL_TCP, "bitmap:port range 0-65535"),
    (NODE_PORT_LOCAL_UDP, "bitmap:port range 0-65535"),
    (LOOP_BACK, "hash:ip,port,ip family inet hashsize 1024 maxelem 65536"),
];

/// Suffix of the copy a set is built in before the swap.
const NEW_SUFFIX: &str = "-NEW";

/// Set name -> entries, as `ipset save` spells them.
pub type Entries = BTreeMap<&'static str, BTreeSet<String>>;

/// What the sets hold for `ports` on the node named `node`.
pub fn entries<'a>(ports: impl IntoIterator<Item = &'a ServicePort>, node: Option<&str>) -> Entries {
    let mut sets: Entries = SETS.iter().map(|(name, _)| (*name, BTreeSet::new())).collect();
    for port in ports {
        let p = port.protocol.lowercase();
        sets.entry(CLUSTER_IP)
            .or_default()
            .insert(format!("{},{p}:{}", port.cluster_ip, port.port));
        if let Some(node_port) = port.node_port {
            let (set, local_set) = match port.protocol {
                Protocol::Tcp => (NODE_PORT_TCP, NODE_PORT_LOCAL_TCP),
                Protocol::Udp => (NODE_PORT_UDP, NODE_PORT_LOCAL_UDP),
            };
            sets.entry(set).or_default().insert(node_port.to_string());
            if port.external_local() {
                sets.entry(local_set).or_default().insert(node_port.to_string());
            }
        }
        for endpoint in EndpointSets::of(port, node).reachable() {
            sets.entry(LOOP_BACK)
                .or_default()
                .insert(format!("{},{p}:{},{}", endpoint.addr, endpoint.port, endpoint.addr));
        }
    }
    sets
}

/// Our sets' entries from `ipset save` output (other sets ignored).
pub fn parse_save(text: &str) -> Entries {
    let mut sets = Entries::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(command), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        let Some((name, _)) = SETS.iter().find(|(n, _)| *n == name) else {
            continue;
        };
        match (command, words.next()) {
            ("create", _) => {
                sets.entry(*name).or_default();
            }
            ("add", Some(entry)) => {
                sets.entry(*name).or_default().insert(entry.to_owned());
            }
            _ => {}
        }
    }
    sets
}

/// The `ipset restore -exist` input turning `current` into `desired`: only
/// sets that differ are rebuilt and swapped in.
pub fn render(desired: &Entries, current: &Entries) -> String {
    let mut out = String::new();
    for (name, options) in SETS {
        let want = desired.get(name).cloned().unwrap_or_default();
        if current.get(name) == Some(&want) {
            continue;
        }
        let new = format!("{name}{NEW_SUFFIX}");
        out.push_str(&format!("create {name} {options}\n"));
        out.push_str(&format!("create {new} {options}\n"));
        out.push_str(&format!("flush {new}\n"));
        for entry in &want {
            out.push_str(&format!("add {new} {entry}\n"));
        }
        out.push_str(&format!("swap {new} {name}\n"));
        out.push_str(&format!("destroy {new}\n"));
    }
    out
}

/// Our sets in the calling thread's network namespace.
pub fn save() -> Result<Entries> {
    Ok(parse_save(&ipset::save()?))
}

/// Destroys our sets (after the rules using them are gone); returns how
/// many existed. Nothing happens without ipset installed.
pub fn cleanup() -> Result<usize> {
    let Ok(current) = save() else {
        return Ok(0);
    };
    let mut input = String::new();
    for name in current.keys() {
        input.push_str(&format!("destroy {name}\n"));
    }
    if !input.is_empty() {
        ipset::restore(&input)?;
    }
    Ok(current.len())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::Endpoint;

    fn seed() -> ServicePort {
        ServicePort {
            name: "default/nginx-service".into(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(10, 96, 0, 88),
            port: 88,
            node_port: Some(30791),
            endpoints: vec![Endpoint::ready(Ipv4Addr::new(10, 244, 0, 11), 80)],
            ..ServicePort::default()
        }
    }

    #[test]
    fn the_seed_fills_cluster_ip_node_port_and_loop_back() {
        let sets = entries([&seed()], None);
        assert_eq!(sets[CLUSTER_IP], BTreeSet::from(["10.96.0.88,tcp:88".to_owned()]));
        assert_eq!(sets[NODE_PORT_TCP], BTreeSet::from(["30791".to_owned()]));
        assert!(sets[NODE_PORT_UDP].is_empty());
        assert_eq!(
            sets[LOOP_BACK],
            BTreeSet::from(["10.244.0.11,tcp:80,10.244.0.11".to_owned()])
        );
    }

    #[test]
    fn only_changed_sets_are_swapped() {
        let desired = entries([&seed()], None);
        let current = parse_save(
            "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536\n\
             add KUBE-CLUSTER-IP 10.96.0.88,tcp:88\n\
             create KUBE-NODE-PORT-TCP bitmap:port range 0-65535\n\
             add KUBE-NODE-PORT-TCP 30791\n\
             create KUBE-NODE-PORT-UDP bitmap:port range 0-65535\n\
             create OTHER hash:ip\nadd OTHER 1.2.3.4\n",
        );
        let input = render(&desired, &current);
        assert!(!input.contains("KUBE-CLUSTER-IP"), "{input}");
        assert!(input.contains("add KUBE-LOOP-BACK-NEW 10.244.0.11,tcp:80,10.244.0.11\n"));
        assert!(input.contains("swap KUBE-LOOP-BACK-NEW KUBE-LOOP-BACK\ndestroy KUBE-LOOP-BACK-NEW\n"));
        assert_eq!(render(&desired, &desired), "");
    }

    /// kube-proxy's `KUBE-NODE-PORT-LOCAL-TCP/UDP`: the node ports of
    /// externalTrafficPolicy: Local ports (besides `KUBE-NODE-PORT-*`).
    #[test]
    fn local_node_ports_fill_their_own_sets() {
        let tcp = ServicePort {
            external_policy: crate::model::TrafficPolicy::Local,
            ..seed()
        };
        let udp = ServicePort {
            name: "default/dns".into(),
            protocol: Protocol::Udp,
            node_port: Some(30053),
            ..tcp.clone()
        };
        let cluster = ServicePort {
            name: "default/other".into(),
            node_port: Some(30800),
            ..seed()
        };
        let sets = entries([&tcp, &udp, &cluster], Some("node-a"));
        assert_eq!(sets[NODE_PORT_LOCAL_TCP], BTreeSet::from(["30791".to_owned()]));
        assert_eq!(sets[NODE_PORT_LOCAL_UDP], BTreeSet::from(["30053".to_owned()]));
        assert_eq!(
            sets[NODE_PORT_TCP],
            BTreeSet::from(["30791".to_owned(), "30800".to_owned()])
        );
    }
}
