//! kube-proxy's ipsets of the IPVS mode, which the constant iptables rules
//! of [`super::rules`] match against, so the rules never grow with the
//! number of Services.
//!
//! Written with `ipset restore` ([`crate::sys::ipset`], one process per
//! sync that changes a set):
//! each changed set is filled as a `-NEW` copy and swapped in atomically,
//! so no packet sees a half-filled set. Read back with `ipset save`.
//!
//! IPv6 ports have a second set of sets ([`SETS6`], `family inet6`), named
//! as kube-proxy's IPv6 proxier names them: `KUBE-` becomes `KUBE-6-`, cut
//! at ipset's 31 characters (`KUBE-6-LOAD-BALANCER-SOURCE-CID`). The
//! IPv6 rules of [`super::rules`] match those.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use anyhow::Result;

use crate::{
    model::{EndpointSets, IpFamily, Protocol, ServicePort, SourceRange},
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
/// SCTP NodePorts, per node address: `IP,sctp:PORT`. A `bitmap:port` set
/// holds TCP and UDP ports only, so kube-proxy keeps SCTP's in a hash of
/// the node's addresses and matches them `dst,dst`.
pub const NODE_PORT_SCTP: &str = "KUBE-NODE-PORT-SCTP-HASH";
/// SCTP NodePorts with `externalTrafficPolicy: Local`: `IP,sctp:PORT`.
pub const NODE_PORT_LOCAL_SCTP: &str = "KUBE-NODE-PORT-LOCAL-SCTP-HASH";
/// Endpoints that may reach themselves through their Service (hairpin,
/// masqueraded): `IP,PROTO:PORT,IP`.
pub const LOOP_BACK: &str = "KUBE-LOOP-BACK";
/// External IPs of ports with `externalTrafficPolicy: Cluster`
/// (masqueraded): `IP,PROTO:PORT`.
pub const EXTERNAL_IP: &str = "KUBE-EXTERNAL-IP";
/// External IPs of ports with `externalTrafficPolicy: Local` (the client's
/// address kept): `IP,PROTO:PORT`.
pub const EXTERNAL_IP_LOCAL: &str = "KUBE-EXTERNAL-IP-LOCAL";
/// Every load balancer IP: `IP,PROTO:PORT`.
pub const LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
/// Load balancer IPs of ports with `externalTrafficPolicy: Local` (not
/// masqueraded): `IP,PROTO:PORT`.
pub const LOAD_BALANCER_LOCAL: &str = "KUBE-LOAD-BALANCER-LOCAL";
/// Load balancer IPs with `loadBalancerSourceRanges` (filtered):
/// `IP,PROTO:PORT`.
pub const LOAD_BALANCER_FW: &str = "KUBE-LOAD-BALANCER-FW";
/// The networks allowed to reach a filtered load balancer IP:
/// `IP,PROTO:PORT,NET`.
pub const LOAD_BALANCER_SOURCE_CIDR: &str = "KUBE-LOAD-BALANCER-SOURCE-CIDR";
/// Traffic to a filtered load balancer IP whose source is that IP itself
/// (kube-proxy's allowance for the node, which holds it on `kube-ipvs0`),
/// allowed where a range holds a node IP: `IP,PROTO:PORT,IP`.
pub const LOAD_BALANCER_SOURCE_IP: &str = "KUBE-LOAD-BALANCER-SOURCE-IP";

const HASH_IP_PORT: &str = "hash:ip,port family inet hashsize 1024 maxelem 65536";
const HASH_IP_PORT_IP: &str = "hash:ip,port,ip family inet hashsize 1024 maxelem 65536";
const HASH_IP_PORT_NET: &str = "hash:ip,port,net family inet hashsize 1024 maxelem 65536";
const HASH_IP_PORT6: &str = "hash:ip,port family inet6 hashsize 1024 maxelem 65536";
const HASH_IP_PORT_IP6: &str = "hash:ip,port,ip family inet6 hashsize 1024 maxelem 65536";
const HASH_IP_PORT_NET6: &str = "hash:ip,port,net family inet6 hashsize 1024 maxelem 65536";
const BITMAP_PORT: &str = "bitmap:port range 0-65535";

/// The IPv4 sets: name and `ipset create` type and options.
pub const SETS: [(&str, &str); 15] = [
    (CLUSTER_IP, HASH_IP_PORT),
    (NODE_PORT_TCP, BITMAP_PORT),
    (NODE_PORT_UDP, BITMAP_PORT),
    (NODE_PORT_LOCAL_TCP, BITMAP_PORT),
    (NODE_PORT_LOCAL_UDP, BITMAP_PORT),
    (NODE_PORT_SCTP, HASH_IP_PORT),
    (NODE_PORT_LOCAL_SCTP, HASH_IP_PORT),
    (LOOP_BACK, HASH_IP_PORT_IP),
    (EXTERNAL_IP, HASH_IP_PORT),
    (EXTERNAL_IP_LOCAL, HASH_IP_PORT),
    (LOAD_BALANCER, HASH_IP_PORT),
    (LOAD_BALANCER_LOCAL, HASH_IP_PORT),
    (LOAD_BALANCER_FW, HASH_IP_PORT),
    (LOAD_BALANCER_SOURCE_CIDR, HASH_IP_PORT_NET),
    (LOAD_BALANCER_SOURCE_IP, HASH_IP_PORT_IP),
];

/// The IPv6 sets, in the order of [`SETS`] (the same set at the same
/// index): kube-proxy's names for them, and `family inet6`.
pub const SETS6: [(&str, &str); 15] = [
    ("KUBE-6-CLUSTER-IP", HASH_IP_PORT6),
    ("KUBE-6-NODE-PORT-TCP", BITMAP_PORT),
    ("KUBE-6-NODE-PORT-UDP", BITMAP_PORT),
    ("KUBE-6-NODE-PORT-LOCAL-TCP", BITMAP_PORT),
    ("KUBE-6-NODE-PORT-LOCAL-UDP", BITMAP_PORT),
    ("KUBE-6-NODE-PORT-SCTP-HASH", HASH_IP_PORT6),
    // ipset's 31 characters, as kube-proxy's SOURCE-CID.
    ("KUBE-6-NODE-PORT-LOCAL-SCTP-HAS", HASH_IP_PORT6),
    ("KUBE-6-LOOP-BACK", HASH_IP_PORT_IP6),
    ("KUBE-6-EXTERNAL-IP", HASH_IP_PORT6),
    ("KUBE-6-EXTERNAL-IP-LOCAL", HASH_IP_PORT6),
    ("KUBE-6-LOAD-BALANCER", HASH_IP_PORT6),
    ("KUBE-6-LOAD-BALANCER-LOCAL", HASH_IP_PORT6),
    ("KUBE-6-LOAD-BALANCER-FW", HASH_IP_PORT6),
    ("KUBE-6-LOAD-BALANCER-SOURCE-CID", HASH_IP_PORT_NET6),
    ("KUBE-6-LOAD-BALANCER-SOURCE-IP", HASH_IP_PORT_IP6),
];

/// The sets of `family`.
pub fn sets_of(family: IpFamily) -> &'static [(&'static str, &'static str); 15] {
    match family {
        IpFamily::V4 => &SETS,
        IpFamily::V6 => &SETS6,
    }
}

/// The name of set `set` (one of [`SETS`]' names) for `family`.
pub fn name(set: &'static str, family: IpFamily) -> &'static str {
    SETS.iter()
        .position(|(n, _)| *n == set)
        .map_or(set, |i| sets_of(family)[i].0)
}

/// Every set of both families.
fn all_sets() -> impl Iterator<Item = &'static (&'static str, &'static str)> {
    SETS.iter().chain(&SETS6)
}

/// Suffix of the copy a set is built in before the swap.
const NEW_SUFFIX: &str = "-NEW";

/// ipset's longest set name (`IPSET_MAXNAMELEN` less the NUL).
const MAX_NAME_LEN: usize = 31;

/// The name of the copy `name` is built in: `NAME-NEW`, with
/// `LOAD-BALANCER` shortened to `LB` and `NODE-PORT` to `NP` where that
/// would be longer than ipset allows (`KUBE-LB-SOURCE-CIDR-NEW`,
/// `KUBE-NP-LOCAL-SCTP-HASH-NEW`).
fn new_copy(name: &str) -> String {
    let new = format!("{name}{NEW_SUFFIX}");
    if new.len() <= MAX_NAME_LEN {
        return new;
    }
    new.replace("LOAD-BALANCER", "LB").replace("NODE-PORT", "NP")
}

/// Set name -> entries, as `ipset save` spells them.
pub type Entries = BTreeMap<&'static str, BTreeSet<String>>;

/// What the sets (of both families) hold for `ports` on the node named
/// `node` whose addresses are `node_ips`; each port fills the sets of its
/// own family.
pub fn entries<'a>(
    ports: impl IntoIterator<Item = &'a ServicePort>,
    node: Option<&str>,
    node_ips: &[IpAddr],
) -> Entries {
    let mut sets: Entries = all_sets().map(|(name, _)| (*name, BTreeSet::new())).collect();
    for port in ports {
        let family = port.family();
        let mut add = |set: &'static str, entry: String| {
            sets.entry(name(set, family)).or_default().insert(entry);
        };
        let p = port.protocol.lowercase();
        add(CLUSTER_IP, format!("{},{p}:{}", port.cluster_ip, port.port));
        if let Some(node_port) = port.node_port {
            let (set, local_set) = match port.protocol {
                Protocol::Tcp => (NODE_PORT_TCP, NODE_PORT_LOCAL_TCP),
                Protocol::Udp => (NODE_PORT_UDP, NODE_PORT_LOCAL_UDP),
                Protocol::Sctp => (NODE_PORT_SCTP, NODE_PORT_LOCAL_SCTP),
            };
            for entry in node_port_entries(port.protocol, node_port, node_ips, family) {
                if port.external_local() {
                    add(local_set, entry.clone());
                }
                add(set, entry);
            }
        }
        for endpoint in EndpointSets::of(port, node).reachable() {
            add(
                LOOP_BACK,
                format!("{},{p}:{},{}", endpoint.addr, endpoint.port, endpoint.addr),
            );
        }
        external_entries(&mut add, port, node_ips);
    }
    sets
}

/// The entries of a node port: the port alone in TCP's and UDP's bitmaps,
/// `IP,sctp:PORT` for each node address of `family` in SCTP's hashes.
fn node_port_entries(protocol: Protocol, node_port: u16, node_ips: &[IpAddr], family: IpFamily) -> Vec<String> {
    match protocol {
        Protocol::Tcp | Protocol::Udp => vec![node_port.to_string()],
        Protocol::Sctp => node_ips
            .iter()
            .filter(|ip| IpFamily::of(**ip) == family)
            .map(|ip| format!("{ip},sctp:{node_port}"))
            .collect(),
    }
}

/// The entries of `port`'s external IPs and load balancer IPs, as
/// kube-proxy's IPVS mode fills them, through `add` (set, entry).
fn external_entries(add: &mut impl FnMut(&'static str, String), port: &ServicePort, node_ips: &[IpAddr]) {
    let p = port.protocol.lowercase();
    let local = port.external_local();
    for ip in &port.external_ips {
        let set = if local { EXTERNAL_IP_LOCAL } else { EXTERNAL_IP };
        add(set, format!("{ip},{p}:{}", port.port));
    }
    for ip in &port.load_balancer_ips {
        let entry = format!("{ip},{p}:{}", port.port);
        add(LOAD_BALANCER, entry.clone());
        if local {
            add(LOAD_BALANCER_LOCAL, entry.clone());
        }
        if port.source_ranges.is_empty() {
            continue;
        }
        add(LOAD_BALANCER_FW, entry.clone());
        for range in port.source_ranges.iter().flat_map(|r| ipset_networks(*r)) {
            add(LOAD_BALANCER_SOURCE_CIDR, format!("{entry},{range}"));
        }
        let node_allowed = port
            .source_ranges
            .iter()
            .any(|r| node_ips.iter().any(|node_ip| r.contains(*node_ip)));
        if node_allowed {
            add(LOAD_BALANCER_SOURCE_IP, format!("{entry},{ip}"));
        }
    }
}

/// `range` as `ipset` takes and prints it in a `hash:*,net` set: a host
/// without `/32` or `/128` (`ipset save` leaves it off), and `0.0.0.0/0`
/// or `::/0`, which ipset refuses, as its two halves.
fn ipset_networks(range: SourceRange) -> Vec<String> {
    let family = range.family();
    match range.prefix_len {
        0 if family == IpFamily::V4 => vec!["0.0.0.0/1".to_owned(), "128.0.0.0/1".to_owned()],
        0 => vec!["::/1".to_owned(), "8000::/1".to_owned()],
        len if len == family.bits() => vec![range.addr.to_string()],
        _ => vec![range.to_string()],
    }
}

/// Our sets' entries from `ipset save` output (other sets ignored).
pub fn parse_save(text: &str) -> Entries {
    let mut sets = Entries::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(command), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        let Some((name, _)) = all_sets().find(|(n, _)| *n == name) else {
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
    for &(name, options) in all_sets() {
        let want = desired.get(name).cloned().unwrap_or_default();
        if current.get(name) == Some(&want) {
            continue;
        }
        let new = new_copy(name);
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
    use crate::{mode::fixtures::seed_port, model::Endpoint};

    fn seed() -> ServicePort {
        seed_port(vec![Endpoint::ready(Ipv4Addr::new(10, 244, 0, 11), 80)])
    }

    #[test]
    fn the_seed_fills_cluster_ip_node_port_and_loop_back() {
        let sets = entries([&seed()], None, &[]);
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
        let desired = entries([&seed()], None, &[]);
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

    /// ipset refuses names longer than 31 characters: every set and its
    /// copy fit.
    #[test]
    fn every_set_and_its_copy_fit_ipsets_name_limit() {
        for (name, _) in SETS {
            assert!(name.len() <= MAX_NAME_LEN, "{name}");
            assert!(new_copy(name).len() <= MAX_NAME_LEN, "{}", new_copy(name));
        }
        assert_eq!(new_copy(LOAD_BALANCER_SOURCE_CIDR), "KUBE-LB-SOURCE-CIDR-NEW");
        assert_eq!(new_copy(CLUSTER_IP), "KUBE-CLUSTER-IP-NEW");
        assert_eq!(new_copy(NODE_PORT_LOCAL_SCTP), "KUBE-NP-LOCAL-SCTP-HASH-NEW");
    }

    /// SCTP node ports are `IP,sctp:PORT` per node address, as kube-proxy
    /// writes them (a `bitmap:port` holds TCP and UDP ports only); the rest
    /// of an SCTP port's entries spell the protocol as TCP's do.
    #[test]
    fn sctp_node_ports_fill_hashes_of_the_node_addresses() {
        let sctp = ServicePort {
            protocol: Protocol::Sctp,
            external_policy: crate::model::TrafficPolicy::Local,
            ..seed()
        };
        // The IPv6 node address is not the IPv4 port's.
        let node_ips: [IpAddr; 3] = [
            Ipv4Addr::new(172, 30, 0, 2).into(),
            Ipv4Addr::new(192, 168, 1, 10).into(),
            "fd00:30::2".parse().expect("IPv6 literal"),
        ];
        let sets = entries([&sctp], None, &node_ips);
        assert!(sets[name(NODE_PORT_SCTP, IpFamily::V6)].is_empty());
        let expected = BTreeSet::from(["172.30.0.2,sctp:30791".to_owned(), "192.168.1.10,sctp:30791".to_owned()]);
        assert_eq!(sets[NODE_PORT_SCTP], expected);
        assert_eq!(sets[NODE_PORT_LOCAL_SCTP], expected);
        assert!(sets[NODE_PORT_TCP].is_empty() && sets[NODE_PORT_LOCAL_TCP].is_empty());
        assert_eq!(sets[CLUSTER_IP], BTreeSet::from(["10.96.0.88,sctp:88".to_owned()]));
        assert_eq!(
            sets[LOOP_BACK],
            BTreeSet::from(["10.244.0.11,sctp:80,10.244.0.11".to_owned()])
        );
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
        let sets = entries([&tcp, &udp, &cluster], Some("node-a"), &[]);
        assert_eq!(sets[NODE_PORT_LOCAL_TCP], BTreeSet::from(["30791".to_owned()]));
        assert_eq!(sets[NODE_PORT_LOCAL_UDP], BTreeSet::from(["30053".to_owned()]));
        assert_eq!(
            sets[NODE_PORT_TCP],
            BTreeSet::from(["30791".to_owned(), "30800".to_owned()])
        );
    }

    fn range(text: &str) -> SourceRange {
        let (addr, len) = text.split_once('/').expect("a CIDR");
        SourceRange {
            addr: addr.parse().expect("an address"),
            prefix_len: len.parse().expect("a prefix length"),
        }
    }

    fn set(entries: &[&str]) -> BTreeSet<String> {
        entries.iter().map(|e| (*e).to_owned()).collect()
    }

    /// kube-proxy's IPVS mode: external IPs go into KUBE-EXTERNAL-IP, or
    /// KUBE-EXTERNAL-IP-LOCAL with externalTrafficPolicy: Local; load
    /// balancer IPs into KUBE-LOAD-BALANCER, KUBE-LOAD-BALANCER-LOCAL too
    /// with Local, and with source ranges into KUBE-LOAD-BALANCER-FW with
    /// one KUBE-LOAD-BALANCER-SOURCE-CIDR entry per range, plus a
    /// KUBE-LOAD-BALANCER-SOURCE-IP entry (the node's own traffic) where a
    /// range holds a node IP.
    #[test]
    fn external_and_load_balancer_ips_fill_kube_proxys_sets() {
        let lb = ServicePort {
            name: "default/lb".into(),
            external_ips: vec![Ipv4Addr::new(198, 51, 100, 7).into()],
            load_balancer_ips: vec![Ipv4Addr::new(192, 0, 2, 10).into()],
            source_ranges: vec![range("172.30.0.0/24"), range("203.0.113.5/32"), range("0.0.0.0/0")],
            ..seed()
        };
        let node_ip = IpAddr::V4(Ipv4Addr::new(172, 30, 0, 2));
        let sets = entries([&lb], None, &[node_ip]);
        assert_eq!(sets[EXTERNAL_IP], set(&["198.51.100.7,tcp:88"]));
        assert!(sets[EXTERNAL_IP_LOCAL].is_empty());
        assert_eq!(sets[LOAD_BALANCER], set(&["192.0.2.10,tcp:88"]));
        assert!(sets[LOAD_BALANCER_LOCAL].is_empty());
        assert_eq!(sets[LOAD_BALANCER_FW], set(&["192.0.2.10,tcp:88"]));
        assert_eq!(
            sets[LOAD_BALANCER_SOURCE_CIDR],
            set(&[
                "192.0.2.10,tcp:88,0.0.0.0/1",
                "192.0.2.10,tcp:88,128.0.0.0/1",
                "192.0.2.10,tcp:88,172.30.0.0/24",
                "192.0.2.10,tcp:88,203.0.113.5",
            ])
        );
        assert_eq!(sets[LOAD_BALANCER_SOURCE_IP], set(&["192.0.2.10,tcp:88,192.0.2.10"]));
        // No range holds the node: its own traffic is filtered too.
        let narrow = ServicePort {
            source_ranges: vec![range("203.0.113.0/24")],
            ..lb.clone()
        };
        assert!(entries([&narrow], None, &[node_ip])[LOAD_BALANCER_SOURCE_IP].is_empty());

        let local = ServicePort {
            external_policy: crate::model::TrafficPolicy::Local,
            source_ranges: Vec::new(),
            ..lb
        };
        let sets = entries([&local], Some("node-a"), &[node_ip]);
        assert!(sets[EXTERNAL_IP].is_empty());
        assert_eq!(sets[EXTERNAL_IP_LOCAL], set(&["198.51.100.7,tcp:88"]));
        assert_eq!(sets[LOAD_BALANCER], set(&["192.0.2.10,tcp:88"]));
        assert_eq!(sets[LOAD_BALANCER_LOCAL], set(&["192.0.2.10,tcp:88"]));
        assert!(sets[LOAD_BALANCER_FW].is_empty(), "no source ranges, no filter");
        assert!(sets[LOAD_BALANCER_SOURCE_CIDR].is_empty());
    }

    /// kube-proxy's IPv6 proxier names its sets `KUBE-6-...`, cut at 31
    /// characters; every one of them and its copy fit ipset's limit.
    #[test]
    fn ipv6_sets_have_kube_proxys_names_and_family() {
        for ((v4, options4), (v6, options6)) in SETS.iter().zip(&SETS6) {
            let mut want = v4.replacen("KUBE-", "KUBE-6-", 1);
            want.truncate(MAX_NAME_LEN);
            assert_eq!(*v6, want);
            assert!(new_copy(v6).len() <= MAX_NAME_LEN, "{}", new_copy(v6));
            assert_eq!(*options6, options4.replace("family inet ", "family inet6 "));
        }
        assert_eq!(
            name(LOAD_BALANCER_SOURCE_CIDR, IpFamily::V6),
            "KUBE-6-LOAD-BALANCER-SOURCE-CID"
        );
        assert_eq!(name(CLUSTER_IP, IpFamily::V4), CLUSTER_IP);
    }

    /// An IPv6 port fills the IPv6 sets only, with ipset's IPv6 spelling;
    /// `::/0` is written as its two halves, a /128 as a bare address.
    #[test]
    fn an_ipv6_port_fills_the_ipv6_sets() {
        let v6 = ServicePort {
            name: format!("default/nginx-service{}", crate::model::IPV6_SUFFIX),
            cluster_ip: "fd00:96::88".parse().expect("an address"),
            endpoints: vec![Endpoint::ready(
                "fd00:10:244::11".parse::<IpAddr>().expect("an address"),
                80,
            )],
            load_balancer_ips: vec!["fd00:192::10".parse().expect("an address")],
            source_ranges: vec![range("::/0"), range("fd00:30::5/128")],
            ..seed()
        };
        let node_ip: IpAddr = "fd00:30::2".parse().expect("an address");
        let sets = entries([&seed(), &v6], None, &[node_ip]);
        assert_eq!(sets["KUBE-6-CLUSTER-IP"], set(&["fd00:96::88,tcp:88"]));
        assert_eq!(sets[CLUSTER_IP], set(&["10.96.0.88,tcp:88"]));
        assert_eq!(sets["KUBE-6-NODE-PORT-TCP"], set(&["30791"]));
        assert_eq!(
            sets["KUBE-6-LOOP-BACK"],
            set(&["fd00:10:244::11,tcp:80,fd00:10:244::11"])
        );
        assert_eq!(
            sets["KUBE-6-LOAD-BALANCER-SOURCE-CID"],
            set(&[
                "fd00:192::10,tcp:88,8000::/1",
                "fd00:192::10,tcp:88,::/1",
                "fd00:192::10,tcp:88,fd00:30::5",
            ])
        );
        assert_eq!(
            sets["KUBE-6-LOAD-BALANCER-SOURCE-IP"],
            set(&["fd00:192::10,tcp:88,fd00:192::10"]),
            "::/0 holds the node's IPv6 address"
        );
        let input = render(&sets, &Entries::new());
        assert!(
            input.contains("create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536\n"),
            "{input}"
        );
        assert!(input.contains("swap KUBE-6-LB-SOURCE-CID-NEW KUBE-6-LOAD-BALANCER-SOURCE-CID\n"));
        // What ipset save prints back parses into the same entries.
        let saved = "create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536\n\
                     add KUBE-6-CLUSTER-IP fd00:96::88,tcp:88\n";
        assert_eq!(parse_save(saved)["KUBE-6-CLUSTER-IP"], sets["KUBE-6-CLUSTER-IP"]);
    }
}
