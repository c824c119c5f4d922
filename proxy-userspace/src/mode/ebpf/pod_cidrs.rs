//! The pod networks the programs tell pods' traffic by: kube-proxy's
//! `detectLocalMode: ClusterCIDR` (the default), from `clusterCIDR` /
//! `--cluster-cidr`. A pod's new flow to an external frontend with
//! `externalTrafficPolicy: Local` goes to every endpoint, as kube-proxy
//! short-circuits it (`proxy_common::service_port`). Written into
//! `XP_POD_CIDRS` at start, replacing what an earlier agent wrote: an
//! empty trie short-circuits nothing, which is what kube-proxy does when
//! it cannot tell pod traffic apart.

use std::{collections::BTreeSet, net::IpAddr, path::Path};

use anyhow::{Context, Result};
use aya::maps::{LpmTrie, MapData, lpm_trie::Key};
use proxy_common::maps;
use tracing::{info, warn};

use super::pinned_maps::pinned;
use crate::config::{Cidr, Config, DetectLocal};

/// The IPv4 pod networks of `config`'s detect-local mode, as `(network in
/// network byte order, prefix length)`. The interface-based modes, and
/// `NodeCIDR` (a per-node pod range the agent does not read), are not
/// supported: warned about, none.
pub fn from_config(config: &Config) -> Vec<(u32, u8)> {
    match &config.detect_local {
        DetectLocal::ClusterCidr => trie_entries(&config.cluster_cidrs),
        other => {
            warn!(
                detect_local_mode = ?other,
                "the ebpf mode tells pods' traffic by clusterCIDR only: pods' traffic to node ports, \
                 external and load balancer IPs of externalTrafficPolicy: Local Services reaches this \
                 node's endpoints only (kube-proxy: every endpoint)"
            );
            Vec::new()
        }
    }
}

/// The IPv4 networks of `cidrs` as trie entries (IPv6 ones are the IPv6
/// data path's, which the programs do not have).
pub fn trie_entries(cidrs: &[Cidr]) -> Vec<(u32, u8)> {
    cidrs
        .iter()
        .filter_map(|c| match c.addr() {
            IpAddr::V4(net) => Some((u32::from_ne_bytes(net.octets()), c.prefix_len())),
            IpAddr::V6(_) => None,
        })
        .collect()
}

/// Makes the trie pinned under `pin_path` hold exactly `networks`.
pub fn write(pin_path: &Path, networks: &[(u32, u8)]) -> Result<()> {
    let mut trie: LpmTrie<MapData, u32, u8> = LpmTrie::try_from(pinned(pin_path, maps::POD_CIDRS)?)
        .with_context(|| format!("map {} has an unexpected layout", maps::POD_CIDRS))?;
    let wanted: BTreeSet<(u32, u8)> = networks.iter().copied().collect();
    let found: Vec<Key<u32>> = trie
        .keys()
        .collect::<Result<_, _>>()
        .context("listing the pod networks")?;
    for key in found {
        let entry = (key.data(), u8::try_from(key.prefix_len()).unwrap_or(u8::MAX));
        if !wanted.contains(&entry) {
            trie.remove(&key).context("deleting a pod network")?;
        }
    }
    for (net, prefix_len) in &wanted {
        trie.insert(&Key::new(u32::from(*prefix_len), *net), 1, 0)
            .context("writing a pod network")?;
    }
    info!(
        networks = wanted.len(),
        "pod networks written for the Local short-circuit"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_cluster_cidrs_become_trie_entries_in_packet_order() {
        let cidrs: Vec<Cidr> = ["10.244.0.0/16", "fd00:10:244::/56"]
            .iter()
            .map(|c| c.parse().expect("cidr"))
            .collect();
        assert_eq!(trie_entries(&cidrs), vec![(u32::from_ne_bytes([10, 244, 0, 0]), 16)]);
    }
}
