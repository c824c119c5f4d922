//! The addresses NodePorts get virtual servers on, as kube-proxy's IPVS
//! mode finds them: the configured node IPs, or, where `nodePortAddresses`
//! names networks or no node IP is configured, the node's local addresses
//! (without loopback and without `kube-ipvs0`'s Service addresses), read
//! again at every sync so that an address added after start is served.

use std::net::Ipv4Addr;

use anyhow::{Context, Result};

use super::dummy::DUMMY;
use crate::{config::Cidr, mode::options::NodePortScope};

/// Where NodePorts answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// These addresses only (`--node-ip`, `nodePortAddresses: [primary]`).
    Fixed(Vec<Ipv4Addr>),
    /// Every local address inside these networks; `None`: every local
    /// address (kube-proxy's default).
    Local(Option<Vec<Cidr>>),
}

impl NodePortAddresses {
    /// What `nodePortAddresses` says: unset, every local address (as
    /// kube-proxy's IPVS mode, whatever `--node-ip` says, and re-read at
    /// every sync so addresses added later answer too); `[primary]`, the
    /// node IPs; networks, the local addresses inside them.
    pub fn from_scope(scope: &NodePortScope) -> Self {
        match scope {
            NodePortScope::AllLocal { .. } => Self::Local(None),
            NodePortScope::NodeIps(ips) => Self::Fixed(ips.clone()),
            NodePortScope::Cidrs(cidrs) => Self::Local(Some(cidrs.iter().filter(|c| c.is_ipv4()).copied().collect())),
        }
    }

    /// The addresses now, sorted, each once.
    pub fn resolve(&self) -> Result<Vec<Ipv4Addr>> {
        match self {
            Self::Fixed(ips) => Ok(ips.clone()),
            Self::Local(cidrs) => {
                let addrs = nix::ifaddrs::getifaddrs().context("listing local addresses for NodePorts")?;
                let local = addrs
                    .filter(|ifa| ifa.interface_name != DUMMY)
                    .filter_map(|ifa| Some(ifa.address?.as_sockaddr_in()?.ip()));
                Ok(select(local, cidrs.as_deref()))
            }
        }
    }
}

/// `local` without loopback, inside `cidrs` (if any), sorted and distinct.
fn select(local: impl Iterator<Item = Ipv4Addr>, cidrs: Option<&[Cidr]>) -> Vec<Ipv4Addr> {
    let mut out: Vec<Ipv4Addr> = local
        .filter(|ip| !ip.is_loopback())
        .filter(|ip| cidrs.is_none_or(|cidrs| cidrs.iter().any(|c| c.contains((*ip).into()))))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(text: &str) -> Cidr {
        text.parse().expect("cidr")
    }

    #[test]
    fn unset_means_every_local_address_primary_the_node_ips_networks_their_addresses() {
        let node = vec![Ipv4Addr::new(172, 30, 0, 2)];
        assert_eq!(
            NodePortAddresses::from_scope(&NodePortScope::Cidrs(vec![cidr("fd00::/64"), cidr("172.30.0.0/24")])),
            NodePortAddresses::Local(Some(vec![cidr("172.30.0.0/24")]))
        );
        assert_eq!(
            NodePortAddresses::from_scope(&NodePortScope::NodeIps(node.clone())),
            NodePortAddresses::Fixed(node)
        );
        assert_eq!(
            NodePortAddresses::from_scope(&NodePortScope::AllLocal { localhost: true }),
            NodePortAddresses::Local(None)
        );
    }

    #[test]
    fn local_addresses_leave_out_loopback_and_other_networks() {
        let local = [
            Ipv4Addr::new(172, 30, 0, 2),
            Ipv4Addr::LOCALHOST,
            Ipv4Addr::new(10, 244, 0, 1),
            Ipv4Addr::new(10, 244, 0, 1),
            Ipv4Addr::new(192, 0, 2, 7),
        ];
        assert_eq!(
            select(local.into_iter(), None),
            [
                Ipv4Addr::new(10, 244, 0, 1),
                Ipv4Addr::new(172, 30, 0, 2),
                Ipv4Addr::new(192, 0, 2, 7)
            ]
        );
        let only = [cidr("172.30.0.0/24"), cidr("192.0.2.0/28")];
        assert_eq!(
            select(local.into_iter(), Some(&only)),
            [Ipv4Addr::new(172, 30, 0, 2), Ipv4Addr::new(192, 0, 2, 7)]
        );
    }
}
