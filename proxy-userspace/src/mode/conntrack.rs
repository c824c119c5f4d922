//! Stale UDP flows in the kernel's connection tracking.
//!
//! The iptables and nftables modes translate in netfilter: the first packet
//! of a UDP flow picks an endpoint and the kernel's conntrack entry keeps
//! that choice for every later packet. When the endpoint leaves the Service
//! the entry still points at it, and a client that keeps sending (DNS does)
//! never moves on until the entry idles out. kube-proxy deletes such entries
//! after each sync; so do we, over netlink ([`crate::sys::conntrack`]), with
//! the filters kube-proxy used with the `conntrack` tool:
//! - an endpoint left a UDP Service port: entries whose original destination
//!   is the ClusterIP (or whose original destination port is the node port)
//!   and whose DNAT target is the endpoint;
//! - a UDP Service port got its first endpoint: entries to the ClusterIP or
//!   node port made while it had none (rejected or unanswered, but tracked:
//!   without a flush the client's next packets would match them, untranslated).
//!
//! TCP needs none of this: a connection to a gone endpoint is reset or times
//! out, and the client's next connection is a new flow.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use tracing::warn;

use super::SyncedChange;
use crate::{
    model::{IpFamily, Protocol, ServicePort, usable_endpoints},
    sys::conntrack::{self, UdpFlowFilter},
};

/// UDP flows a sync left stale, as kube-proxy names them.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StaleFlows {
    /// Flows to `cluster_ip` DNATed to `endpoint`.
    ToClusterIp { cluster_ip: IpAddr, endpoint: IpAddr },
    /// Flows to any node address on `node_port` DNATed to `endpoint`.
    ToNodePort { node_port: u16, endpoint: IpAddr },
    /// Every flow to `cluster_ip` (the port had no endpoints).
    AllToClusterIp { cluster_ip: IpAddr },
    /// Every flow to any node address of `family` on `node_port` (a
    /// dual-stack Service's node port is open in both families; each
    /// family's port flushes its own table).
    AllToNodePort { node_port: u16, family: IpFamily },
}

impl StaleFlows {
    /// The conntrack filter matching these flows, in the table of their
    /// family.
    pub fn filter(&self) -> UdpFlowFilter {
        match *self {
            StaleFlows::ToClusterIp { cluster_ip, endpoint } => UdpFlowFilter {
                family: IpFamily::of(cluster_ip),
                orig_dst: Some(cluster_ip),
                dst_nat: Some(endpoint),
                ..UdpFlowFilter::default()
            },
            StaleFlows::ToNodePort { node_port, endpoint } => UdpFlowFilter {
                family: IpFamily::of(endpoint),
                orig_dst_port: Some(node_port),
                dst_nat: Some(endpoint),
                ..UdpFlowFilter::default()
            },
            StaleFlows::AllToClusterIp { cluster_ip } => UdpFlowFilter {
                family: IpFamily::of(cluster_ip),
                orig_dst: Some(cluster_ip),
                ..UdpFlowFilter::default()
            },
            StaleFlows::AllToNodePort { node_port, family } => UdpFlowFilter {
                family,
                orig_dst_port: Some(node_port),
                ..UdpFlowFilter::default()
            },
        }
    }
}

/// The flows a sync from `applied` to `desired` left stale, for the modes
/// whose translations live in the kernel's conntrack. `applied` must be a
/// state that was in the kernel (not empty after a restart: then every
/// port would look new and every flow would be flushed).
pub fn stale_flows(
    applied: &BTreeMap<String, ServicePort>,
    desired: &BTreeMap<String, ServicePort>,
) -> BTreeSet<StaleFlows> {
    let names: BTreeSet<&String> = applied.keys().chain(desired.keys()).collect();
    let mut stale = BTreeSet::new();
    for name in names {
        stale_flows_of_port(applied.get(name), desired.get(name), &mut stale);
    }
    stale
}

/// [`stale_flows`] of the ports named in `changed` only (the others are
/// the same in both states).
pub fn stale_flows_of(
    changed: &BTreeSet<String>,
    applied: &BTreeMap<String, ServicePort>,
    desired: &BTreeMap<String, ServicePort>,
) -> BTreeSet<StaleFlows> {
    let mut stale = BTreeSet::new();
    for name in changed {
        stale_flows_of_port(applied.get(name), desired.get(name), &mut stale);
    }
    stale
}

/// The flows one port's change from `old` to `new` left stale.
fn stale_flows_of_port(old: Option<&ServicePort>, new: Option<&ServicePort>, stale: &mut BTreeSet<StaleFlows>) {
    if let Some(old) = old.filter(|p| p.protocol == Protocol::Udp) {
        let still_used: BTreeSet<IpAddr> = new
            .filter(|new| same_frontends(old, new))
            .map(|new| usable_endpoints(&new.endpoints).iter().map(|e| e.addr).collect())
            .unwrap_or_default();
        for endpoint in usable_endpoints(&old.endpoints) {
            if still_used.contains(&endpoint.addr) {
                continue;
            }
            stale.insert(StaleFlows::ToClusterIp {
                cluster_ip: old.cluster_ip,
                endpoint: endpoint.addr,
            });
            if let Some(node_port) = old.node_port {
                stale.insert(StaleFlows::ToNodePort {
                    node_port,
                    endpoint: endpoint.addr,
                });
            }
        }
    }
    if let Some(new) = new.filter(|p| p.protocol == Protocol::Udp) {
        let had_none = old.is_none_or(|old| usable_endpoints(&old.endpoints).is_empty());
        if had_none && !usable_endpoints(&new.endpoints).is_empty() {
            stale.insert(StaleFlows::AllToClusterIp {
                cluster_ip: new.cluster_ip,
            });
            if let Some(node_port) = new.node_port {
                stale.insert(StaleFlows::AllToNodePort {
                    node_port,
                    family: new.family(),
                });
            }
        }
    }
}

/// Whether `new` is still reached at `old`'s addresses (else every flow of
/// `old` is stale, whatever the endpoints).
fn same_frontends(old: &ServicePort, new: &ServicePort) -> bool {
    old.cluster_ip == new.cluster_ip && old.port == new.port && old.node_port == new.node_port
}

/// [`Dataplane::delete_stale_flows`](super::Dataplane::delete_stale_flows)
/// for the modes that translate in netfilter: deletes the kernel's
/// conntrack entries of the UDP flows `change` left stale; nothing when
/// the state before the sync is unknown.
pub fn delete_stale_flows(change: &SyncedChange<'_>) -> u64 {
    let Some(before) = change.before else {
        return 0;
    };
    // Ports outside the plan are the same before and after: none of
    // their flows is stale.
    let touched: BTreeSet<String> = change
        .plan
        .remove
        .iter()
        .chain(&change.plan.upsert)
        .map(|p| p.name.clone())
        .collect();
    let stale = stale_flows_of(&touched, before, change.after);
    if stale.is_empty() {
        return 0;
    }
    let filters: Vec<UdpFlowFilter> = stale.iter().map(StaleFlows::filter).collect();
    match conntrack::delete_udp_flows(&filters) {
        Ok(deleted) => deleted,
        Err(e) => {
            warn!(error = format!("{e:#}"), "deleting stale UDP flows");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{mode::Plan, model::Endpoint};

    const CLUSTER_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10));

    fn pod(last: u8) -> IpAddr {
        Ipv4Addr::new(10, 244, 0, last).into()
    }

    fn port(protocol: Protocol, node_port: Option<u16>, endpoints: &[u8]) -> ServicePort {
        ServicePort {
            name: "default/dns:dns".into(),
            protocol,
            cluster_ip: CLUSTER_IP,
            port: 53,
            node_port,
            endpoints: endpoints.iter().map(|e| Endpoint::ready(pod(*e), 5353)).collect(),
            ..ServicePort::default()
        }
    }

    fn state(port: ServicePort) -> BTreeMap<String, ServicePort> {
        BTreeMap::from([(port.name.clone(), port)])
    }

    #[test]
    fn a_removed_udp_endpoint_makes_its_flows_stale() {
        let stale = stale_flows(
            &state(port(Protocol::Udp, Some(30053), &[1, 2])),
            &state(port(Protocol::Udp, Some(30053), &[1])),
        );
        assert_eq!(
            stale,
            BTreeSet::from([
                StaleFlows::ToClusterIp {
                    cluster_ip: CLUSTER_IP,
                    endpoint: pod(2)
                },
                StaleFlows::ToNodePort {
                    node_port: 30053,
                    endpoint: pod(2)
                },
            ])
        );
    }

    #[test]
    fn tcp_and_unchanged_ports_need_nothing() {
        let tcp = stale_flows(
            &state(port(Protocol::Tcp, None, &[1, 2])),
            &state(port(Protocol::Tcp, None, &[1])),
        );
        assert!(tcp.is_empty(), "{tcp:?}");
        let same = stale_flows(
            &state(port(Protocol::Udp, None, &[1, 2])),
            &state(port(Protocol::Udp, None, &[2, 1])),
        );
        assert!(same.is_empty(), "{same:?}");
    }

    #[test]
    fn a_removed_port_makes_every_endpoint_stale() {
        let stale = stale_flows(&state(port(Protocol::Udp, None, &[1, 2])), &BTreeMap::new());
        assert_eq!(stale.len(), 2, "{stale:?}");
    }

    #[test]
    fn a_terminating_endpoint_that_still_serves_is_not_stale() {
        // With no ready endpoint left, serving-terminating ones take the
        // traffic (usable_endpoints): their flows must survive.
        let mut draining = port(Protocol::Udp, None, &[1]);
        draining.endpoints[0].ready = false;
        draining.endpoints[0].serving = true;
        draining.endpoints[0].terminating = true;
        let stale = stale_flows(&state(port(Protocol::Udp, None, &[1])), &state(draining));
        assert!(stale.is_empty(), "{stale:?}");
    }

    #[test]
    fn the_first_endpoint_flushes_what_was_tracked_without_one() {
        let stale = stale_flows(
            &state(port(Protocol::Udp, Some(30053), &[])),
            &state(port(Protocol::Udp, Some(30053), &[1])),
        );
        assert_eq!(
            stale,
            BTreeSet::from([
                StaleFlows::AllToClusterIp { cluster_ip: CLUSTER_IP },
                StaleFlows::AllToNodePort {
                    node_port: 30053,
                    family: IpFamily::V4
                },
            ])
        );
        // A brand-new port too: an earlier sync may have left it endpoint-less.
        let new = stale_flows(&BTreeMap::new(), &state(port(Protocol::Udp, None, &[1])));
        assert_eq!(
            new,
            BTreeSet::from([StaleFlows::AllToClusterIp { cluster_ip: CLUSTER_IP }])
        );
    }

    /// Neither case reaches the kernel: nothing to delete, or no known
    /// state to judge flows against.
    #[test]
    fn a_sync_deletes_only_what_it_made_stale_from_a_known_state() {
        let before = state(port(Protocol::Udp, None, &[1, 2]));
        let after = state(port(Protocol::Udp, None, &[1]));
        let plan = Plan {
            upsert: after.values().cloned().collect(),
            remove: vec![],
        };
        let unknown = SyncedChange {
            plan: &plan,
            before: None,
            after: &after,
            full: true,
        };
        assert_eq!(delete_stale_flows(&unknown), 0);
        let untouched = SyncedChange {
            plan: &Plan::default(),
            before: Some(&before),
            ..unknown
        };
        assert_eq!(delete_stale_flows(&untouched), 0);
    }

    #[test]
    fn filters_match_kube_proxys() {
        let flow = StaleFlows::ToNodePort {
            node_port: 30053,
            endpoint: pod(2),
        };
        // conntrack -D -p udp --orig-port-dst 30053 --dst-nat 10.244.0.2
        assert_eq!(
            flow.filter(),
            UdpFlowFilter {
                family: IpFamily::V4,
                orig_dst: None,
                orig_dst_port: Some(30053),
                dst_nat: Some(pod(2)),
            }
        );
        // conntrack -D -p udp --orig-dst 10.96.0.10
        let all = StaleFlows::AllToClusterIp { cluster_ip: CLUSTER_IP };
        assert_eq!(
            all.filter(),
            UdpFlowFilter {
                family: IpFamily::V4,
                orig_dst: Some(CLUSTER_IP),
                orig_dst_port: None,
                dst_nat: None,
            }
        );
    }

    /// The IPv6 port of a dual-stack UDP Service: its flows are looked
    /// for in the IPv6 table, the node port's too.
    #[test]
    fn ipv6_flows_are_flushed_in_the_ipv6_table() {
        let v6 = |last: u16| IpAddr::from(std::net::Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, last));
        let dual = |endpoints: &[u16]| ServicePort {
            name: format!("default/dns:dns{}", crate::model::IPV6_SUFFIX),
            cluster_ip: std::net::Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa).into(),
            endpoints: endpoints.iter().map(|e| Endpoint::ready(v6(*e), 5353)).collect(),
            ..port(Protocol::Udp, Some(30053), &[])
        };
        let stale = stale_flows(&state(dual(&[1, 2])), &state(dual(&[1])));
        let filters: Vec<UdpFlowFilter> = stale.iter().map(StaleFlows::filter).collect();
        assert_eq!(filters.len(), 2, "{stale:?}");
        assert!(filters.iter().all(|f| f.family == IpFamily::V6), "{filters:?}");
        let first = stale_flows(&state(dual(&[])), &state(dual(&[1])));
        assert!(
            first.contains(&StaleFlows::AllToNodePort {
                node_port: 30053,
                family: IpFamily::V6
            }),
            "{first:?}"
        );
    }
}
