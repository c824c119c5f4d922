//! This node's Node object: what the agent reads from it besides the
//! deletion mark (see `server::healthz`): its zone, for topology hints,
//! and its addresses, the node IPs when `--node-ip` is not given.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use tracing::warn;

use crate::model::topology::ZONE_LABEL;

/// The zone a Node names (its `topology.kubernetes.io/zone` label).
pub fn zone(node: &Node) -> Option<&str> {
    node.metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(ZONE_LABEL))
        .map(String::as_str)
        .filter(|zone| !zone.is_empty())
}

/// The node's IPs as kube-proxy takes them from the Node (`GetNodeHostIPs`):
/// its `InternalIP` addresses, then its `ExternalIP` ones; the first of
/// them, and the first of the other IP family if there is one.
pub fn host_ips(node: &Node) -> Vec<IpAddr> {
    let addresses = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let of_type = |ty: &'static str| {
        addresses
            .iter()
            .filter(move |a| a.type_ == ty)
            .filter_map(|a| a.address.trim().parse::<IpAddr>().ok())
    };
    let mut all = of_type("InternalIP").chain(of_type("ExternalIP"));
    let Some(primary) = all.next() else {
        return Vec::new();
    };
    let secondary = all.find(|ip| ip.is_ipv4() != primary.is_ipv4());
    std::iter::once(primary).chain(secondary).collect()
}

/// This node's interfaces, as [`node_ips`] reads them.
pub struct Interfaces {
    /// Every local IPv4 address.
    pub local: Vec<Ipv4Addr>,
    /// The addresses of the interface the default route leaves by.
    pub default_route: Vec<Ipv4Addr>,
}

/// The node IPs to use when `--node-ip` is not given: the Node's
/// ([`host_ips`]), only those on this node's interfaces if any is (an
/// `ExternalIP` that a cloud translates to the node is no address packets
/// arrive at); else `bindAddress` when it is set, as kube-proxy falls
/// back; else the addresses of the default route's interface (where
/// kube-proxy would assume loopback); else none.
pub fn node_ips(node: Option<&Node>, interfaces: &Interfaces, bind_address: IpAddr) -> Vec<IpAddr> {
    let from_node = from_node(node, &interfaces.local);
    if !from_node.is_empty() {
        return from_node;
    }
    if !bind_address.is_unspecified() {
        return vec![bind_address];
    }
    interfaces.default_route.iter().copied().map(IpAddr::V4).collect()
}

/// The Node's IPs, only those in `local` if any is.
fn from_node(node: Option<&Node>, local: &[Ipv4Addr]) -> Vec<IpAddr> {
    let from_node = node.map(host_ips).unwrap_or_default();
    let is_local = |ip: &IpAddr| matches!(ip, IpAddr::V4(v4) if local.contains(v4));
    if from_node.iter().any(is_local) {
        from_node.into_iter().filter(is_local).collect()
    } else {
        from_node
    }
}

/// Gets the Node named `name` from the API server, giving up after
/// `timeout` (the API server may be down at start; the agent then goes on
/// without it).
pub async fn fetch(client: Client, name: &str, timeout: Duration) -> Option<Node> {
    let nodes = Api::<Node>::all(client);
    match tokio::time::timeout(timeout, nodes.get_opt(name)).await {
        Ok(Ok(node)) => {
            if node.is_none() {
                warn!(node = name, "no Node object of this name");
            }
            node
        }
        Ok(Err(e)) => {
            warn!(node = name, error = %e, "cannot read this node's Node object");
            None
        }
        Err(_) => {
            warn!(
                node = name,
                ?timeout,
                "the API server did not answer for this node's Node object"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn node(addresses: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n1"}, "status": {"addresses": addresses}})).unwrap()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn internal_ips_come_first_then_external_and_one_per_family() {
        let n = node(json!([
            {"type": "Hostname", "address": "n1"},
            {"type": "ExternalIP", "address": "203.0.113.5"},
            {"type": "InternalIP", "address": "10.0.0.5"},
            {"type": "InternalIP", "address": "10.0.0.6"},
            {"type": "InternalIP", "address": "fd00::5"},
        ]));
        assert_eq!(host_ips(&n), ips(&["10.0.0.5", "fd00::5"]));
        let external_only = node(json!([{"type": "ExternalIP", "address": "203.0.113.5"}]));
        assert_eq!(host_ips(&external_only), ips(&["203.0.113.5"]));
        let garbage = node(json!([{"type": "InternalIP", "address": "not-an-ip"}]));
        assert!(host_ips(&garbage).is_empty());
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap();
        assert!(host_ips(&bare).is_empty());
    }

    #[test]
    fn the_node_then_the_bind_address_then_the_default_routes_interface() {
        let interfaces = Interfaces {
            local: vec![Ipv4Addr::new(10, 0, 0, 5), Ipv4Addr::new(192, 168, 9, 1)],
            default_route: vec![Ipv4Addr::new(10, 0, 0, 5)],
        };
        let unspecified = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
        let bind: IpAddr = "10.0.0.9".parse().unwrap();
        let external = node(json!([
            {"type": "ExternalIP", "address": "203.0.113.5"},
            {"type": "ExternalIP", "address": "fd00::5"},
        ]));
        assert_eq!(
            node_ips(Some(&external), &interfaces, bind),
            ips(&["203.0.113.5", "fd00::5"]),
            "none local: the Node's all the same"
        );
        let with_local = node(json!([
            {"type": "ExternalIP", "address": "203.0.113.5"},
            {"type": "InternalIP", "address": "fd00::5"},
            {"type": "InternalIP", "address": "192.168.9.1"},
        ]));
        assert_eq!(host_ips(&with_local), ips(&["fd00::5", "192.168.9.1"]));
        assert_eq!(node_ips(Some(&with_local), &interfaces, bind), ips(&["192.168.9.1"]));
        let bare = node(json!([]));
        assert_eq!(node_ips(Some(&bare), &interfaces, bind), vec![bind]);
        assert_eq!(node_ips(None, &interfaces, bind), vec![bind]);
        assert_eq!(node_ips(None, &interfaces, unspecified), ips(&["10.0.0.5"]));
        let no_route = Interfaces {
            default_route: vec![],
            ..interfaces
        };
        assert!(node_ips(None, &no_route, unspecified).is_empty());
    }

    #[test]
    fn the_zone_is_a_label() {
        let n: Node = serde_json::from_value(json!({"metadata": {"name": "n1",
            "labels": {"topology.kubernetes.io/zone": "z1"}}}))
        .unwrap();
        assert_eq!(zone(&n), Some("z1"));
        let blank: Node = serde_json::from_value(json!({"metadata": {"name": "n1",
            "labels": {"topology.kubernetes.io/zone": ""}}}))
        .unwrap();
        assert_eq!(zone(&blank), None);
    }
}
