//! The pod networks the programs tell pods' traffic by: kube-proxy's
//! `detectLocalMode: ClusterCIDR` (the default), from `clusterCIDR` /
//! `--cluster-cidr`. A pod's new flow to an external frontend with
//! `externalTrafficPolicy: Local` goes to every endpoint, as kube-proxy
//! short-circuits it (`proxy_common::service_port`). Written into
//! `XP_POD_CIDRS` (IPv4) and `XP_POD_CIDRS6` (IPv6; a dual-stack
//! `clusterCIDR` names one network per family) at start, replacing what an
//! earlier agent wrote: an empty trie short-circuits nothing, which is
//! what kube-proxy does when it cannot tell pod traffic apart.

use std::{collections::BTreeSet, net::IpAddr, path::Path};

use anyhow::{Context, Result};
use aya::maps::{LpmTrie, MapData, lpm_trie::Key};
use proxy_common::{
    ipv6::{Addr6, addr6_be},
    maps,
};
use tracing::{info, warn};

use super::pinned_maps::pinned;
use crate::config::{Cidr, Config, DetectLocal};

/// The pod networks of both families as the tries' entries: `(network in
/// network byte order, prefix length)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodNetworks {
    pub v4: Vec<(u32, u8)>,
    pub v6: Vec<(Addr6, u8)>,
}

/// The pod networks of `config`'s detect-local mode. The interface-based modes, and
/// `NodeCIDR` (a per-node pod range the agent does not read), are not
/// supported: warned about, none.
pub fn from_config(config: &Config) -> PodNetworks {
    match &config.detect_local {
        DetectLocal::ClusterCidr => trie_entries(&config.cluster_cidrs),
        other => {
            warn!(
                detect_local_mode = ?other,
                "the ebpf mode tells pods' traffic by clusterCIDR only: pods' traffic to node ports, \
                 external and load balancer IPs of externalTrafficPolicy: Local Services reaches this \
                 node's endpoints only (kube-proxy: every endpoint)"
            );
            PodNetworks::default()
        }
    }
}

/// The networks of `cidrs` as trie entries, each in its family's.
pub fn trie_entries(cidrs: &[Cidr]) -> PodNetworks {
    let mut out = PodNetworks::default();
    for cidr in cidrs {
        match cidr.addr() {
            IpAddr::V4(net) => out.v4.push((u32::from_ne_bytes(net.octets()), cidr.prefix_len())),
            IpAddr::V6(net) => out.v6.push((addr6_be(net), cidr.prefix_len())),
        }
    }
    out
}

/// Makes the tries pinned under `pin_path` hold exactly `networks`.
pub fn write(pin_path: &Path, networks: &PodNetworks) -> Result<()> {
    write_trie(pin_path, maps::POD_CIDRS, &networks.v4)?;
    write_trie(pin_path, maps::POD_CIDRS6, &networks.v6)?;
    info!(
        ipv4 = networks.v4.len(),
        ipv6 = networks.v6.len(),
        "pod networks written for the Local short-circuit"
    );
    Ok(())
}

/// Makes the trie `name` hold exactly `networks`.
fn write_trie<N: aya::Pod + Ord>(pin_path: &Path, name: &str, networks: &[(N, u8)]) -> Result<()> {
    let mut trie: LpmTrie<MapData, N, u8> =
        LpmTrie::try_from(pinned(pin_path, name)?).with_context(|| format!("map {name} has an unexpected layout"))?;
    let wanted: BTreeSet<(N, u8)> = networks.iter().copied().collect();
    let found: Vec<Key<N>> = trie
        .keys()
        .collect::<Result<_, _>>()
        .with_context(|| format!("listing the pod networks of {name}"))?;
    for key in found {
        let entry = (key.data(), u8::try_from(key.prefix_len()).unwrap_or(u8::MAX));
        if !wanted.contains(&entry) {
            trie.remove(&key)
                .with_context(|| format!("deleting a pod network of {name}"))?;
        }
    }
    for (net, prefix_len) in &wanted {
        trie.insert(&Key::new(u32::from(*prefix_len), *net), 1, 0)
            .with_context(|| format!("writing a pod network into {name}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_familys_cluster_cidrs_become_its_tries_entries_in_packet_order() {
        let cidrs: Vec<Cidr> = ["10.244.0.0/16", "fd00:10:244::/56"]
            .iter()
            .map(|c| c.parse().expect("cidr"))
            .collect();
        let entries = trie_entries(&cidrs);
        assert_eq!(entries.v4, vec![(u32::from_ne_bytes([10, 244, 0, 0]), 16)]);
        let v6: [u8; 16] = bytemuck::cast(entries.v6[0].0);
        assert_eq!(entries.v6.len(), 1);
        assert_eq!(
            (v6, entries.v6[0].1),
            (
                "fd00:10:244::".parse::<std::net::Ipv6Addr>().expect("address").octets(),
                56
            )
        );
    }
}
