//! What the rule-writing modes (iptables, nftables) read from the
//! configuration in the same way: which traffic comes from this node's pods
//! (kube-proxy's `detectLocalMode`, [`LocalTraffic`]) and where NodePorts
//! answer (`nodePortAddresses`, [`NodePortScope`]). Each mode renders these
//! in its own language (an iptables match, an nft expression) next to its
//! rules.

use std::net::{IpAddr, Ipv4Addr};

use tracing::warn;

use crate::{
    config::{Cidr, Config, DetectLocal, NodePortAddresses},
    model::{IpFamily, ipv4},
};

/// How traffic from this node's pods is recognised (kube-proxy's
/// `detectLocalMode`); traffic from anywhere else to a ClusterIP is
/// masqueraded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalTraffic {
    /// Source inside the cluster's pod CIDR.
    Cidr(Cidr),
    /// Arriving on this bridge.
    Bridge(String),
    /// Arriving on an interface whose name starts with this prefix.
    InterfacePrefix(String),
}

impl LocalTraffic {
    /// What `config` asks for. `None` when local traffic cannot be told
    /// apart: `ClusterCIDR` without an IPv4 cluster CIDR, or `NodeCIDR`
    /// (not supported yet; warned about, naming `mode`).
    pub fn from_config(config: &Config, mode: &str) -> Option<Self> {
        Self::for_family(config, mode, IpFamily::V4)
    }

    /// [`LocalTraffic::from_config`] for the rules of `family`: the
    /// cluster CIDR of that family (interfaces match both).
    pub fn for_family(config: &Config, mode: &str, family: IpFamily) -> Option<Self> {
        match &config.detect_local {
            DetectLocal::ClusterCidr => config
                .cluster_cidrs
                .iter()
                .find(|c| c.is_ipv4() == (family == IpFamily::V4))
                .map(|c| LocalTraffic::Cidr(*c)),
            DetectLocal::NodeCidr => {
                warn!(
                    "detectLocalMode NodeCIDR is not supported by the {mode} mode yet: \
                     off-cluster traffic to ClusterIPs is not masqueraded"
                );
                None
            }
            DetectLocal::BridgeInterface(name) => Some(LocalTraffic::Bridge(name.clone())),
            DetectLocal::InterfaceNamePrefix(prefix) => Some(LocalTraffic::InterfacePrefix(prefix.clone())),
        }
    }
}

/// Where NodePorts answer, as the configuration puts it (kube-proxy's
/// `nodePortAddresses`, IPv4 only). A mode turns this into its own match:
/// the iptables mode resolves networks to the local addresses in them at
/// every sync, the nftables mode lets the kernel check them per packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortScope {
    /// Every local address; 127.0.0.0/8 too if `localhost` and the mode can
    /// (`iptables.localhostNodePorts`; false when this stands in for
    /// `[primary]` without a known node IP).
    AllLocal { localhost: bool },
    /// The node's IPv4 addresses (`[primary]`); never empty.
    NodeIps(Vec<Ipv4Addr>),
    /// Local addresses inside these IPv4 networks; may be empty (then
    /// NodePorts answer nowhere).
    Cidrs(Vec<Cidr>),
}

impl NodePortScope {
    /// What `config` asks for, warning about what cannot be honoured.
    pub fn from_config(config: &Config) -> Self {
        match FamilyNodePorts::from_config(config, IpFamily::V4) {
            FamilyNodePorts::AllLocal { localhost } => NodePortScope::AllLocal { localhost },
            FamilyNodePorts::NodeIps(ips) => NodePortScope::NodeIps(ips.into_iter().filter_map(ipv4).collect()),
            FamilyNodePorts::Cidrs(v4) => {
                if v4.is_empty() {
                    warn!(cidrs = ?config.node_port_addresses, "no IPv4 network in nodePortAddresses: NodePorts answer nowhere");
                }
                NodePortScope::Cidrs(v4)
            }
        }
    }
}

/// The node's configured addresses of `family` (`--node-ip`, or those
/// found at start).
pub fn node_ips_of(config: &Config, family: IpFamily) -> Vec<IpAddr> {
    config
        .node_ips
        .iter()
        .copied()
        .filter(|ip| IpFamily::of(*ip) == family)
        .collect()
}

/// [`NodePortScope`] for the rules of one family, as kube-proxy's proxier
/// of that family reads `nodePortAddresses`: that family's node IPs and
/// networks; localhost only for IPv4 (IPv6 has no `route_localnet`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FamilyNodePorts {
    /// Every local address of the family; 127.0.0.0/8 too if `localhost`.
    AllLocal { localhost: bool },
    /// The node's addresses of the family (`[primary]`); never empty.
    NodeIps(Vec<IpAddr>),
    /// Local addresses inside these networks of the family; may be empty.
    Cidrs(Vec<Cidr>),
}

impl FamilyNodePorts {
    /// What `config` asks of the rules of `family`, warning about what
    /// cannot be honoured.
    pub fn from_config(config: &Config, family: IpFamily) -> Self {
        let of_family = |ip: &IpAddr| IpFamily::of(*ip) == family;
        match &config.node_port_addresses {
            NodePortAddresses::All => FamilyNodePorts::AllLocal {
                localhost: config.localhost_node_ports && family == IpFamily::V4,
            },
            NodePortAddresses::Primary => {
                let ips = node_ips_of(config, family);
                if ips.is_empty() {
                    warn!(
                        "nodePortAddresses is [primary] but no {family:?} node IP is known: \
                         its NodePorts answer on every local address"
                    );
                    FamilyNodePorts::AllLocal { localhost: false }
                } else {
                    FamilyNodePorts::NodeIps(ips)
                }
            }
            NodePortAddresses::Cidrs(cidrs) => {
                FamilyNodePorts::Cidrs(cidrs.iter().filter(|c| of_family(&c.addr())).copied().collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Environment, RunFlags, resolve};

    /// kube-proxy's defaults, no node IP known.
    fn defaults() -> Config {
        let env = Environment {
            kubeconfig: None,
            hostname: Some("node".into()),
        };
        resolve(&RunFlags::default(), None, &env).expect("resolve").config
    }

    fn cidr(text: &str) -> Cidr {
        text.parse().expect("cidr")
    }

    #[test]
    fn local_traffic_follows_detect_local_mode() {
        let mut config = defaults();
        assert_eq!(LocalTraffic::from_config(&config, "test"), None, "no cluster CIDR");
        config.cluster_cidrs = vec![cidr("fd00:10:244::/56"), cidr("10.244.0.0/16")];
        assert_eq!(
            LocalTraffic::from_config(&config, "test"),
            Some(LocalTraffic::Cidr(cidr("10.244.0.0/16"))),
            "the IPv4 cluster CIDR"
        );
        config.detect_local = DetectLocal::NodeCidr;
        assert_eq!(
            LocalTraffic::from_config(&config, "test"),
            None,
            "NodeCIDR is not supported"
        );
        config.detect_local = DetectLocal::BridgeInterface("cbr0".into());
        assert_eq!(
            LocalTraffic::from_config(&config, "test"),
            Some(LocalTraffic::Bridge("cbr0".into()))
        );
        config.detect_local = DetectLocal::InterfaceNamePrefix("veth".into());
        assert_eq!(
            LocalTraffic::from_config(&config, "test"),
            Some(LocalTraffic::InterfacePrefix("veth".into()))
        );
    }

    #[test]
    fn node_port_scope_follows_node_port_addresses() {
        let mut config = defaults();
        assert_eq!(
            NodePortScope::from_config(&config),
            NodePortScope::AllLocal { localhost: true }
        );
        config.localhost_node_ports = false;
        assert_eq!(
            NodePortScope::from_config(&config),
            NodePortScope::AllLocal { localhost: false }
        );
        config.localhost_node_ports = true;
        config.node_port_addresses = NodePortAddresses::Primary;
        assert_eq!(
            NodePortScope::from_config(&config),
            NodePortScope::AllLocal { localhost: false },
            "[primary] without a node IP: every local address but localhost"
        );
        config.node_ips = vec!["fd00::2".parse().expect("ip"), "172.30.0.2".parse().expect("ip")];
        assert_eq!(
            NodePortScope::from_config(&config),
            NodePortScope::NodeIps(vec![Ipv4Addr::new(172, 30, 0, 2)])
        );
        config.node_port_addresses = NodePortAddresses::Cidrs(vec![cidr("fd00::/64"), cidr("172.30.0.0/24")]);
        assert_eq!(
            NodePortScope::from_config(&config),
            NodePortScope::Cidrs(vec![cidr("172.30.0.0/24")])
        );
        config.node_port_addresses = NodePortAddresses::Cidrs(vec![cidr("fd00::/64")]);
        assert_eq!(NodePortScope::from_config(&config), NodePortScope::Cidrs(vec![]));
    }

    /// The IPv6 rules: the IPv6 node IPs and networks, never localhost.
    #[test]
    fn family_node_ports_take_the_familys_addresses() {
        let mut config = defaults();
        assert_eq!(
            FamilyNodePorts::from_config(&config, IpFamily::V6),
            FamilyNodePorts::AllLocal { localhost: false },
            "localhostNodePorts is IPv4 only"
        );
        config.node_port_addresses = NodePortAddresses::Primary;
        config.node_ips = vec!["fd00::2".parse().expect("ip"), "172.30.0.2".parse().expect("ip")];
        assert_eq!(
            FamilyNodePorts::from_config(&config, IpFamily::V6),
            FamilyNodePorts::NodeIps(vec!["fd00::2".parse().expect("ip")])
        );
        config.node_port_addresses = NodePortAddresses::Cidrs(vec![cidr("fd00::/64"), cidr("172.30.0.0/24")]);
        assert_eq!(
            FamilyNodePorts::from_config(&config, IpFamily::V6),
            FamilyNodePorts::Cidrs(vec![cidr("fd00::/64")])
        );
        config.cluster_cidrs = vec![cidr("10.244.0.0/16"), cidr("fd00:10:244::/56")];
        config.detect_local = DetectLocal::ClusterCidr;
        assert_eq!(
            LocalTraffic::for_family(&config, "test", IpFamily::V6),
            Some(LocalTraffic::Cidr(cidr("fd00:10:244::/56")))
        );
    }
}
