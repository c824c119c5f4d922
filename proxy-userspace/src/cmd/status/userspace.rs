//! The userspace mode read back from its portal rules: each ClusterIP and
//! NodePort the rules send to one of the agent's listeners is a frontend,
//! with that listener as its one backend row (the agent, not the kernel,
//! picks the endpoint, so the endpoints are not in any kernel state);
//! its flows are the kernel's conntrack entries redirected to the
//! listener. Ports without endpoints are the REJECT rules. The IPv6
//! listeners' portals are the same chains in `ip6tables-save`.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::Result;

use super::{
    iptables::Rule,
    saved_rules, saved_table,
    table::{Backend, Frontends, Kind, Table, any_address, kernel_flows},
};
use crate::{
    mode::userspace::rules::{CONTAINER_NODE_PORTS, CONTAINER_PORTALS, HOST_NODE_PORTS, HOST_PORTALS, REJECT},
    model::IpFamily,
    sys::{conntrack::Entry, iptables::Saved},
};

/// What the listener row says.
const LISTENER_NOTE: &str = "the agent's listener: the agent picks the endpoint";

/// Whether `saved` holds the userspace mode's chains.
pub fn in_use(saved: &Saved) -> bool {
    saved.table("nat").is_some_and(|nat| nat.has_chain(CONTAINER_PORTALS))
}

/// Reads both families' rules and the conntrack tables of the calling
/// thread's network namespace.
pub fn read_back() -> Result<Table> {
    let mut table = parse_families(&saved_rules(IpFamily::V4)?, &saved_rules(IpFamily::V6)?);
    count_flows(&mut table, &kernel_flows()?);
    Ok(table)
}

/// The table of the IPv4 rules in `saved` (`iptables-save` output), flows
/// unknown.
pub fn parse(saved: &str) -> Table {
    parse_families(saved, "")
}

/// The table of both families' rules (`iptables-save` and
/// `ip6tables-save` output), flows unknown.
pub fn parse_families(saved_v4: &str, saved_v6: &str) -> Table {
    saved_table("userspace", saved_v4, saved_v6, add_saved)
}

/// The frontends of one family's saved portal rules; the listener row is
/// `0.0.0.0:PORT` (`[::]:PORT`).
fn add_saved(frontends: &mut Frontends, saved: &str, family: IpFamily) {
    let saved = Saved::parse(saved);
    let any = any_address(family);
    let rules = |table: &str| -> Vec<(String, Rule)> {
        let lines = saved.table(table).map(|t| t.rules.as_slice()).unwrap_or_default();
        lines
            .iter()
            .filter_map(|l| Some((crate::sys::iptables::rule_chain(l)?.to_owned(), Rule::parse(l)?)))
            .collect()
    };
    for (chain, rule) in rules("nat") {
        let kind = match chain.as_str() {
            CONTAINER_PORTALS | HOST_PORTALS => Kind::ClusterIp,
            CONTAINER_NODE_PORTS | HOST_NODE_PORTS => Kind::NodePort,
            _ => continue,
        };
        let listener = rule.to_ports.or(rule.to_destination.map(|(_, port)| port));
        let (Some(proto), Some(port), Some(listener)) = (rule.proto, rule.dport, listener) else {
            continue;
        };
        let addr = if kind == Kind::ClusterIp {
            let Some(addr) = rule.dst else { continue };
            addr
        } else {
            rule.dst.unwrap_or(any)
        };
        let frontend = frontends.entry(proto, addr, port, kind);
        frontend.service = frontend.service.take().or_else(|| rule.service());
        if !frontend.backends.iter().any(|b| b.addr == Some((any, listener))) {
            let mut backend = Backend::new(any, listener);
            backend.notes.push(LISTENER_NOTE.into());
            frontend.backends.push(backend);
        }
    }
    for (chain, rule) in rules("filter") {
        let (Some(proto), Some(port), Some("REJECT")) = (rule.proto, rule.dport, rule.target.as_deref()) else {
            continue;
        };
        let (addr, kind) = match rule.dst {
            Some(addr) => (addr, Kind::ClusterIp),
            None if rule.dst_local => (any, Kind::NodePort),
            None => continue,
        };
        if chain == REJECT {
            let frontend = frontends.entry_any_kind(proto, addr, port, kind);
            frontend.service = frontend.service.take().or_else(|| rule.service());
        }
    }
}

/// Flows per listener row: connections to the frontend that the rules
/// redirected to that listener (the agent's own connections to the
/// endpoints are not translated and not counted).
fn count_flows<A: Copy + Into<IpAddr>>(table: &mut Table, entries: &[Entry<A>]) {
    let mut counts: BTreeMap<(u8, IpAddr, u16, u16), u64> = BTreeMap::new();
    for entry in entries.iter().filter(|e| e.dst_nat) {
        let orig = entry.orig;
        *counts
            .entry((orig.proto, orig.dst.into(), orig.dport, entry.reply.sport))
            .or_default() += 1;
    }
    for frontend in &mut table.frontends {
        for backend in &mut frontend.backends {
            let Some((_, listener)) = backend.addr else { continue };
            let flows = counts
                .iter()
                .filter(|((proto, dst, dport, to), _)| {
                    let dst_any = &any_address(IpFamily::of(*dst));
                    *proto == frontend.proto.number()
                        && *dport == frontend.port
                        && *to == listener
                        && (*dst == frontend.addr || *dst_any == frontend.addr)
                })
                .map(|(_, n)| n)
                .sum();
            backend.flows = Some(flows);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        cmd::status::table::{split_families, widen},
        model::Protocol,
        sys::conntrack::Tuple,
    };

    /// The userspace mode's rules for the seed Service and one without
    /// endpoints (as `mode::userspace::rules` writes them).
    const SAVED: &str = r#"*nat
:KUBE-PORTALS-CONTAINER - [0:0]
:KUBE-PORTALS-HOST - [0:0]
:KUBE-NODEPORT-CONTAINER - [0:0]
:KUBE-NODEPORT-HOST - [0:0]
-A PREROUTING -m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j KUBE-PORTALS-CONTAINER
-A KUBE-PORTALS-CONTAINER -d 10.96.0.88/32 -p tcp -m comment --comment default/nginx-service -m tcp --dport 88 -j REDIRECT --to-ports 41000
-A KUBE-PORTALS-HOST -d 10.96.0.88/32 -p tcp -m comment --comment default/nginx-service -m tcp --dport 88 -j DNAT --to-destination 127.0.0.1:41000
-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment default/nginx-service -m tcp --dport 30791 -j REDIRECT --to-ports 41000
-A KUBE-NODEPORT-HOST ! -d 127.0.0.0/8 -p tcp -m comment --comment default/nginx-service -m tcp --dport 30791 -j DNAT --to-destination 127.0.0.1:41000
-A KUBE-NODEPORT-HOST -p tcp -m some-future-match -j DNAT
COMMIT
*filter
:KUBE-PORTALS-REJECT - [0:0]
-A KUBE-PORTALS-REJECT -d 10.96.0.89/32 -p tcp -m comment --comment "default/empty-service:http has no endpoints" -m tcp --dport 89 -j REJECT --reject-with icmp-port-unreachable
-A KUBE-PORTALS-REJECT -p tcp -m addrtype --dst-type LOCAL -m comment --comment "default/empty-service:http has no endpoints" -m tcp --dport 30792 -j REJECT --reject-with icmp-port-unreachable
COMMIT
"#;

    fn redirected(dst: &str, dport: u16, listener: u16) -> Entry {
        redirected_from("10.244.0.5", "10.244.0.1", dst, dport, listener)
    }

    /// A conntrack entry of `client`'s connection to `dst:dport` that the
    /// rules redirected to the listener on `listener` (at `node`).
    fn redirected_from<A>(client: &str, node: &str, dst: &str, dport: u16, listener: u16) -> Entry<A>
    where
        A: std::str::FromStr + Copy,
        A::Err: std::fmt::Debug,
    {
        let client: A = client.parse().expect("an address");
        let node: A = node.parse().expect("an address");
        Entry::new(
            Tuple {
                src: client,
                dst: dst.parse().expect("an address"),
                proto: 6,
                sport: 50000,
                dport,
            },
            Tuple {
                src: node,
                dst: client,
                proto: 6,
                sport: listener,
                dport: 50000,
            },
            true,
        )
    }

    #[test]
    fn the_portals_lead_to_the_agents_listener() {
        assert!(in_use(&Saved::parse(SAVED)));
        let mut table = parse(SAVED);
        count_flows(
            &mut table,
            &[
                redirected("10.96.0.88", 88, 41000),
                redirected("172.30.0.2", 30791, 41000),
                redirected("172.30.0.2", 30791, 41000),
                redirected("10.96.0.88", 88, 9),
            ],
        );
        let expected = "\
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  0.0.0.0:30791 NodePort [default/nginx-service]
  -> 0.0.0.0:41000                2 [the agent's listener: the agent picks the endpoint]
TCP  0.0.0.0:30792 NodePort (no endpoints: reject) [default/empty-service:http]
TCP  10.96.0.88:88 ClusterIP [default/nginx-service]
  -> 0.0.0.0:41000                1 [the agent's listener: the agent picks the endpoint]
TCP  10.96.0.89:89 ClusterIP (no endpoints: reject) [default/empty-service:http]
";
        assert_eq!(table.render(), expected);
        assert!(
            table
                .find(Protocol::Tcp, "10.96.0.88".parse::<Ipv4Addr>().expect("ip"), 88)
                .is_some()
        );
    }

    /// The IPv6 listener's portals, as the mode writes them in ip6tables
    /// (`[::1]` for the node's own traffic, `::1` never a NodePort).
    const SAVED6: &str = r#"*nat
:KUBE-PORTALS-CONTAINER - [0:0]
:KUBE-PORTALS-HOST - [0:0]
:KUBE-NODEPORT-CONTAINER - [0:0]
:KUBE-NODEPORT-HOST - [0:0]
-A KUBE-PORTALS-CONTAINER -d fd00:96::88/128 -p tcp -m comment --comment "default/nginx-service (IPv6)" -m tcp --dport 88 -j REDIRECT --to-ports 41006
-A KUBE-PORTALS-HOST -d fd00:96::88/128 -p tcp -m comment --comment "default/nginx-service (IPv6)" -m tcp --dport 88 -j DNAT --to-destination [::1]:41006
-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/nginx-service (IPv6)" -m tcp --dport 30791 -j REDIRECT --to-ports 41006
-A KUBE-NODEPORT-HOST ! -d ::1/128 -p tcp -m comment --comment "default/nginx-service (IPv6)" -m tcp --dport 30791 -j DNAT --to-destination [::1]:41006
COMMIT
*filter
:KUBE-PORTALS-REJECT - [0:0]
-A KUBE-PORTALS-REJECT -d fd00:96::89/128 -p tcp -m comment --comment "default/empty-service:http (IPv6) has no endpoints" -m tcp --dport 89 -j REJECT --reject-with icmp6-port-unreachable
COMMIT
"#;

    #[test]
    fn the_ipv6_portals_lead_to_the_agents_ipv6_listener() {
        let mut table = parse_families(SAVED, SAVED6);
        let (ipv4, _) = split_families(&table);
        assert_eq!(
            ipv4,
            parse(SAVED).frontends,
            "the IPv4 half changed:\n{}",
            table.render()
        );
        let v6 =
            |dst, dport| redirected_from::<std::net::Ipv6Addr>("fd00:10:244::5", "fd00:10:244::1", dst, dport, 41006);
        let flows: Vec<Entry<IpAddr>> = [
            v6("fd00:96::88", 88),
            v6("fd00:30::2", 30791),
            v6("fd00:30::2", 30791),
            v6("fd00:30::2", 30791),
        ]
        .into_iter()
        .map(widen)
        .chain([widen(redirected("10.96.0.88", 88, 41000))])
        .collect();
        count_flows(&mut table, &flows);
        let (_, ipv6) = split_families(&table);
        let expected = "\
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  [::]:30791 NodePort [default/nginx-service]
  -> [::]:41006                   3 [the agent's listener: the agent picks the endpoint]
TCP  [fd00:96::88]:88 ClusterIP [default/nginx-service]
  -> [::]:41006                   1 [the agent's listener: the agent picks the endpoint]
TCP  [fd00:96::89]:89 ClusterIP (no endpoints: reject) [default/empty-service:http]
";
        assert_eq!(ipv6.render(), expected, "{}", table.render());
        // The IPv4 NodePort (`0.0.0.0`) counts none of the IPv6 flows.
        let node_port = table.find(Protocol::Tcp, Ipv4Addr::UNSPECIFIED, 30791).expect("listed");
        assert_eq!(node_port.backends[0].flows, Some(0));
    }
}
