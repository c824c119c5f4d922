//! The pod veths the programs hand reverse-translated replies straight
//! into (`XP_POD_VETHS`, see [`proxy_common::maps::POD_VETHS`]): the node's
//! end of every pod interface the programs are attached to whose other end
//! is in another namespace. A veth whose peer is still in the node's
//! namespace (a CNI may move it into the pod after creating the pair) is
//! not listed: the kernel drops a frame redirected to such a peer.
//!
//! Listed as each pod interface is attached, and rewritten from the
//! interfaces there are at every full sync, which also unlists deleted
//! pods' veths (an unlisted pod only loses the shortcut).

use std::{collections::BTreeSet, path::Path};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData};
use proxy_common::maps;

use super::{interfaces::Interface, pinned_maps};

fn open(pin_path: &Path) -> Result<HashMap<MapData, u32, u8>> {
    pinned_maps::open(pin_path, maps::POD_VETHS)
}

/// Lists `pod` if its other end is in another namespace, unlists it
/// otherwise.
pub fn note(pin_path: &Path, pod: &Interface) -> Result<()> {
    let mut veths = open(pin_path)?;
    if pod.peer_elsewhere {
        veths
            .insert(pod.index, 1, 0)
            .with_context(|| format!("listing pod veth {} (ifindex {})", pod.name, pod.index))
    } else {
        unlist(&mut veths, pod.index)
    }
}

/// Makes the map list exactly those of `pods` whose other end is in
/// another namespace; returns how many entries it removed.
pub fn write(pin_path: &Path, pods: &[Interface]) -> Result<usize> {
    let mut veths = open(pin_path)?;
    let wanted: BTreeSet<u32> = pods.iter().filter(|p| p.peer_elsewhere).map(|p| p.index).collect();
    let stale: Vec<u32> = keys(&veths)?.into_iter().filter(|i| !wanted.contains(i)).collect();
    for ifindex in &stale {
        unlist(&mut veths, *ifindex)?;
    }
    for ifindex in wanted {
        veths
            .insert(ifindex, 1, 0)
            .with_context(|| format!("listing pod veth ifindex {ifindex}"))?;
    }
    Ok(stale.len())
}

/// The ifindexes listed under `pin_path` (for tests and diagnostics).
pub fn listed(pin_path: &Path) -> Result<Vec<u32>> {
    keys(&open(pin_path)?)
}

fn keys(veths: &HashMap<MapData, u32, u8>) -> Result<Vec<u32>> {
    veths.keys().collect::<Result<_, _>>().context("listing the pod veths")
}

/// Removes `ifindex` from the map; not listed is no error.
fn unlist(veths: &mut HashMap<MapData, u32, u8>, ifindex: u32) -> Result<()> {
    match veths.remove(&ifindex) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("unlisting pod veth ifindex {ifindex}")),
    }
}
