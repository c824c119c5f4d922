//! What the modes read from the configuration in the same way: which traffic comes from this node's pods
//! (kube-proxy's `detectLocalMode`, [`LocalTraffic`]) and where NodePorts
//! answer (`nodePortAddresses`, [`FamilyNodePorts`], for every mode). Each
//! mode renders these in its own language (an iptables match, an nft
//! expression, IPVS virtual servers) next to its rules.

use std::net::IpAddr;

use tracing::warn;

use crate::{
    config::{Cidr, Config, DetectLocal, NodePortAddresses},
    model::IpFamily,
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

/// Where the NodePorts of one family answer, as kube-proxy's proxier of
/// that family reads `nodePortAddresses`: that family's node IPs and
/// networks. Every mode starts from this and turns it into its own match
/// (the iptables mode resolves networks to the local addresses in them at
/// every sync, the nftables mode lets the kernel check them per packet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FamilyNodePorts {
    /// Every local address of the family; loopback too if `localhost`
    /// (`iptables.localhostNodePorts`, a mode answering there if it can:
    /// the iptables mode only for IPv4, which has `route_localnet`; false
    /// when this stands in for `[primary]` without a node IP).
    AllLocal { localhost: bool },
    /// The node's addresses of the family (`[primary]`); never empty.
    NodeIps(Vec<IpAddr>),
    /// Local addresses inside these networks of the family; may be empty
    /// (then the family's NodePorts answer nowhere).
    Cidrs(Vec<Cidr>),
}

impl FamilyNodePorts {
    /// What `config` asks of the rules of `family`, warning about what
    /// cannot be honoured.
    pub fn from_config(config: &Config, family: IpFamily) -> Self {
        match &config.node_port_addresses {
            NodePortAddresses::All => FamilyNodePorts::AllLocal {
                localhost: config.localhost_node_ports,
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
                let of_family: Vec<Cidr> = cidrs
                    .iter()
                    .filter(|c| IpFamily::of(c.addr()) == family)
                    .copied()
                    .collect();
                if of_family.is_empty() {
                    warn!(
                        ?cidrs,
                        "no {family:?} network in nodePortAddresses: its NodePorts answer nowhere"
                    );
                }
                FamilyNodePorts::Cidrs(of_family)
            }
        }
    }
}

/// The addresses of the node's `local` ones that can take NodePorts,
/// inside `cidrs` (all of them if `None`): IPv6 link-local ones never (an
/// `fe80::` address means nothing without its link, which neither a
/// frontend key nor a virtual server can name, and a client off the link
/// cannot reach it). Sorted and distinct, so that two listings compare.
pub fn local_node_port_ips(local: impl IntoIterator<Item = IpAddr>, cidrs: Option<&[Cidr]>) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = local
        .into_iter()
        .filter(|ip| !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()))
        .filter(|ip| cidrs.is_none_or(|cidrs| cidrs.iter().any(|c| c.contains(*ip))))
        .collect();
    ips.sort_unstable();
    ips.dedup();
    ips
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mode::fixtures::{cidr, default_config, ips};

    #[test]
    fn local_traffic_follows_detect_local_mode() {
        let mut config = default_config();
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
    fn ipv4_node_ports_follow_node_port_addresses() {
        let v4 = |config: &Config| FamilyNodePorts::from_config(config, IpFamily::V4);
        let mut config = default_config();
        assert_eq!(v4(&config), FamilyNodePorts::AllLocal { localhost: true });
        config.localhost_node_ports = false;
        assert_eq!(v4(&config), FamilyNodePorts::AllLocal { localhost: false });
        config.localhost_node_ports = true;
        config.node_port_addresses = NodePortAddresses::Primary;
        assert_eq!(
            v4(&config),
            FamilyNodePorts::AllLocal { localhost: false },
            "[primary] without a node IP: every local address but localhost"
        );
        config.node_ips = ips(&["fd00::2", "172.30.0.2"]);
        assert_eq!(v4(&config), FamilyNodePorts::NodeIps(ips(&["172.30.0.2"])));
        config.node_port_addresses = NodePortAddresses::Cidrs(vec![cidr("fd00::/64"), cidr("172.30.0.0/24")]);
        assert_eq!(v4(&config), FamilyNodePorts::Cidrs(vec![cidr("172.30.0.0/24")]));
        config.node_port_addresses = NodePortAddresses::Cidrs(vec![cidr("fd00::/64")]);
        assert_eq!(v4(&config), FamilyNodePorts::Cidrs(vec![]));
    }

    /// The IPv6 rules: the IPv6 node IPs and networks. Whether loopback
    /// answers is the mode's to decide, as for IPv4.
    #[test]
    fn family_node_ports_take_the_familys_addresses() {
        let mut config = default_config();
        assert_eq!(
            FamilyNodePorts::from_config(&config, IpFamily::V6),
            FamilyNodePorts::AllLocal { localhost: true }
        );
        config.node_port_addresses = NodePortAddresses::Primary;
        config.node_ips = ips(&["fd00::2", "172.30.0.2"]);
        assert_eq!(
            FamilyNodePorts::from_config(&config, IpFamily::V6),
            FamilyNodePorts::NodeIps(ips(&["fd00::2"]))
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

    #[test]
    fn local_node_port_ips_leave_out_link_local_and_other_networks() {
        let local = ips(&[
            "10.0.0.2",
            "127.0.0.1",
            "10.244.1.1",
            "192.168.5.5",
            "10.0.0.2",
            "::1",
            "fe80::1",
            "fd00:30::2",
        ]);
        assert_eq!(
            local_node_port_ips(local.clone(), None),
            ips(&[
                "10.0.0.2",
                "10.244.1.1",
                "127.0.0.1",
                "192.168.5.5",
                "::1",
                "fd00:30::2"
            ]),
            "every address but IPv6 link-local ones, once each, sorted"
        );
        let cidrs = [
            cidr("10.0.0.0/24"),
            cidr("127.0.0.0/8"),
            cidr("fe80::/10"),
            cidr("fd00:30::/64"),
        ];
        assert_eq!(
            local_node_port_ips(local, Some(&cidrs)),
            ips(&["10.0.0.2", "127.0.0.1", "fd00:30::2"]),
            "only those inside the networks, never a link-local one"
        );
    }
}
