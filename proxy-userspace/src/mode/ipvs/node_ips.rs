//! The addresses NodePorts get virtual servers on, as kube-proxy's IPVS
//! mode finds them: the configured node IPs, or, where `nodePortAddresses`
//! names networks or no node IP is configured, the node's local addresses
//! (without loopback and without `kube-ipvs0`'s Service addresses), read
//! again at every sync so that an address added after start is served.
//! IPv4 and IPv6 alike; IPv6 link-local addresses are left out (a virtual
//! server cannot name the link an `fe80::` address is on).

use std::net::{IpAddr, Ipv6Addr};

use anyhow::{Context, Result};

use super::dummy::DUMMY;
use crate::{
    config::{Cidr, Config},
    mode::options::{FamilyNodePorts, local_node_port_ips},
    model::IpFamily,
};

/// Where NodePorts answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// These addresses only (`--node-ip`, `nodePortAddresses: [primary]`).
    Fixed(Vec<IpAddr>),
    /// Every local address inside these networks; `None`: every local
    /// address (kube-proxy's default).
    Local(Option<Vec<Cidr>>),
}

impl NodePortAddresses {
    /// What `nodePortAddresses` says (see [`FamilyNodePorts`]): unset,
    /// every local address (as kube-proxy's IPVS mode, whatever
    /// `--node-ip` says, and re-read at every sync so addresses added
    /// later answer too); `[primary]`, the node IPs of both families (every
    /// local address without an IPv4 one); networks, the local addresses
    /// inside them.
    pub fn from_config(config: &Config) -> Self {
        let of = |family| FamilyNodePorts::from_config(config, family);
        match (of(IpFamily::V4), of(IpFamily::V6)) {
            (FamilyNodePorts::NodeIps(mut ips), v6) => {
                if let FamilyNodePorts::NodeIps(v6) = v6 {
                    ips.extend(v6);
                }
                Self::Fixed(ips)
            }
            (FamilyNodePorts::Cidrs(mut cidrs), FamilyNodePorts::Cidrs(v6)) => {
                cidrs.extend(v6);
                Self::Local(Some(cidrs))
            }
            _ => Self::Local(None),
        }
    }

    /// The addresses now, sorted, each once.
    pub fn resolve(&self) -> Result<Vec<IpAddr>> {
        match self {
            Self::Fixed(ips) => Ok(ips.clone()),
            Self::Local(cidrs) => {
                let addrs = nix::ifaddrs::getifaddrs().context("listing local addresses for NodePorts")?;
                let local = addrs.filter(|ifa| ifa.interface_name != DUMMY).filter_map(|ifa| {
                    let addr = ifa.address?;
                    match addr.as_sockaddr_in() {
                        Some(v4) => Some(IpAddr::V4(v4.ip())),
                        None => Some(IpAddr::V6(addr.as_sockaddr_in6()?.ip())),
                    }
                });
                Ok(select(local, cidrs.as_deref()))
            }
        }
    }
}

/// `local` without loopback addresses, as [`local_node_port_ips`] selects
/// them.
fn select(local: impl Iterator<Item = IpAddr>, cidrs: Option<&[Cidr]>) -> Vec<IpAddr> {
    let usable = local.filter(|ip| !ip.is_loopback() && *ip != IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    local_node_port_ips(usable, cidrs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        config,
        mode::fixtures::{cidr, default_config, ips},
    };

    /// On top of [`local_node_port_ips`]: never loopback or `::`, even
    /// inside the networks.
    #[test]
    fn local_addresses_leave_out_loopback() {
        let local = ips(&["172.30.0.2", "127.0.0.1", "::1", "::", "fe80::1", "fd00:30::2"]);
        assert_eq!(
            select(local.clone().into_iter(), None),
            ips(&["172.30.0.2", "fd00:30::2"])
        );
        let only = [cidr("127.0.0.0/8"), cidr("::/127"), cidr("fd00:30::/64")];
        assert_eq!(select(local.into_iter(), Some(&only)), ips(&["fd00:30::2"]));
    }

    /// Unset: every local address; `[primary]`: the node IPs of both
    /// families; networks: those of both families.
    #[test]
    fn from_config_takes_both_families_node_ips_and_networks() {
        let mut config = default_config();
        config.node_ips = ips(&["172.30.0.2", "fd00:30::2"]);
        assert_eq!(NodePortAddresses::from_config(&config), NodePortAddresses::Local(None));
        config.node_port_addresses = config::NodePortAddresses::Primary;
        assert_eq!(
            NodePortAddresses::from_config(&config),
            NodePortAddresses::Fixed(ips(&["172.30.0.2", "fd00:30::2"]))
        );
        config.node_ips = ips(&["fd00:30::2"]);
        assert_eq!(
            NodePortAddresses::from_config(&config),
            NodePortAddresses::Local(None),
            "[primary] without an IPv4 node IP"
        );
        config.node_port_addresses =
            config::NodePortAddresses::Cidrs(vec![cidr("fd00:30::/64"), cidr("172.30.0.0/24")]);
        assert_eq!(
            NodePortAddresses::from_config(&config),
            NodePortAddresses::Local(Some(vec![cidr("172.30.0.0/24"), cidr("fd00:30::/64")]))
        );
    }
}
