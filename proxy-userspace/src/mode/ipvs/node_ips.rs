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
    config::{self, Cidr, Config},
    mode::options::NodePortScope,
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
    /// What `nodePortAddresses` says: unset, every local address (as
    /// kube-proxy's IPVS mode, whatever `--node-ip` says, and re-read at
    /// every sync so addresses added later answer too); `[primary]`, the
    /// node IPs; networks, the local addresses inside them.
    pub fn from_scope(scope: &NodePortScope) -> Self {
        match scope {
            NodePortScope::AllLocal { .. } => Self::Local(None),
            NodePortScope::NodeIps(ips) => Self::Fixed(ips.iter().copied().map(IpAddr::V4).collect()),
            NodePortScope::Cidrs(cidrs) => Self::Local(Some(cidrs.iter().filter(|c| c.is_ipv4()).copied().collect())),
        }
    }

    /// [`Self::from_scope`] of `config`'s scope, with the IPv6 node IPs
    /// or networks `config` names added (the shared scope is IPv4 only).
    pub fn from_config(config: &Config) -> Self {
        let mut out = Self::from_scope(&NodePortScope::from_config(config));
        match &mut out {
            Self::Fixed(ips) => ips.extend(config.node_ips.iter().filter(|ip| ip.is_ipv6())),
            Self::Local(Some(cidrs)) => {
                if let config::NodePortAddresses::Cidrs(all) = &config.node_port_addresses {
                    cidrs.extend(all.iter().filter(|c| !c.is_ipv4()));
                }
            }
            Self::Local(None) => {}
        }
        out
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

/// Whether `ip` is an IPv6 link-local address (`fe80::/10`).
fn is_link_local(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

/// `local` without loopback and IPv6 link-local addresses, inside `cidrs`
/// (if any), sorted and distinct.
fn select(local: impl Iterator<Item = IpAddr>, cidrs: Option<&[Cidr]>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = local
        .filter(|ip| !ip.is_loopback() && !is_link_local(*ip) && *ip != IpAddr::V6(Ipv6Addr::UNSPECIFIED))
        .filter(|ip| cidrs.is_none_or(|cidrs| cidrs.iter().any(|c| c.contains(*ip))))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn cidr(text: &str) -> Cidr {
        text.parse().expect("cidr")
    }

    #[test]
    fn unset_means_every_local_address_primary_the_node_ips_networks_their_addresses() {
        let node = vec![Ipv4Addr::new(172, 30, 0, 2)];
        let node_ips: Vec<IpAddr> = node.iter().copied().map(IpAddr::V4).collect();
        assert_eq!(
            NodePortAddresses::from_scope(&NodePortScope::Cidrs(vec![cidr("fd00::/64"), cidr("172.30.0.0/24")])),
            NodePortAddresses::Local(Some(vec![cidr("172.30.0.0/24")]))
        );
        assert_eq!(
            NodePortAddresses::from_scope(&NodePortScope::NodeIps(node)),
            NodePortAddresses::Fixed(node_ips)
        );
        assert_eq!(
            NodePortAddresses::from_scope(&NodePortScope::AllLocal { localhost: true }),
            NodePortAddresses::Local(None)
        );
    }

    fn ips(texts: &[&str]) -> Vec<IpAddr> {
        texts.iter().map(|t| t.parse().expect("an address")).collect()
    }

    #[test]
    fn local_addresses_leave_out_loopback_link_local_and_other_networks() {
        let local = ips(&[
            "172.30.0.2",
            "127.0.0.1",
            "10.244.0.1",
            "10.244.0.1",
            "192.0.2.7",
            "::1",
            "fe80::1",
            "fd00:30::2",
        ]);
        assert_eq!(
            select(local.clone().into_iter(), None),
            ips(&["10.244.0.1", "172.30.0.2", "192.0.2.7", "fd00:30::2"])
        );
        let only = [cidr("172.30.0.0/24"), cidr("192.0.2.0/28"), cidr("fd00:30::/64")];
        assert_eq!(
            select(local.into_iter(), Some(&only)),
            ips(&["172.30.0.2", "192.0.2.7", "fd00:30::2"])
        );
    }

    /// The shared scope is IPv4 only: `from_config` adds the IPv6 node IPs
    /// (`[primary]`) and IPv6 networks the configuration names.
    #[test]
    fn from_config_adds_the_ipv6_node_ips_and_networks() {
        let env = crate::config::Environment {
            kubeconfig: None,
            hostname: Some("node".into()),
        };
        let mut config = crate::config::resolve(&crate::config::RunFlags::default(), None, &env)
            .expect("resolve")
            .config;
        config.node_ips = ips(&["172.30.0.2", "fd00:30::2"]);
        assert_eq!(NodePortAddresses::from_config(&config), NodePortAddresses::Local(None));
        config.node_port_addresses = config::NodePortAddresses::Primary;
        assert_eq!(
            NodePortAddresses::from_config(&config),
            NodePortAddresses::Fixed(ips(&["172.30.0.2", "fd00:30::2"]))
        );
        config.node_port_addresses =
            config::NodePortAddresses::Cidrs(vec![cidr("fd00:30::/64"), cidr("172.30.0.0/24")]);
        assert_eq!(
            NodePortAddresses::from_config(&config),
            NodePortAddresses::Local(Some(vec![cidr("172.30.0.0/24"), cidr("fd00:30::/64")]))
        );
    }
}
