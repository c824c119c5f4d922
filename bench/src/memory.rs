//! Memory: the agent's resident set, and the memory of the BPF maps it
//! pinned (what the kernel charges for them, its `memlock`).

use std::{fs, path::Path};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// VmRSS of the agent after programming and the measurements.
    pub agent_rss_bytes: u64,
    /// VmHWM: the most it was resident at any point.
    pub agent_peak_rss_bytes: u64,
    /// The BPF maps pinned under the agent's pin path (ebpf mode; 0
    /// elsewhere), by map name.
    pub bpf_maps: Vec<MapMemory>,
}

impl Memory {
    pub fn bpf_map_bytes(&self) -> u64 {
        self.bpf_maps.iter().map(|m| m.bytes).sum()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MapMemory {
    pub name: String,
    pub max_entries: u64,
    /// The kernel's `memlock` for the map.
    pub bytes: u64,
    /// Charged in full from creation (else it grows with its entries).
    pub preallocated: bool,
}

/// Reads the agent's memory and its pinned maps.
pub fn measure(pid: u32, pin_path: &Path) -> Result<Memory> {
    let status =
        fs::read_to_string(format!("/proc/{pid}/status")).with_context(|| format!("reading /proc/{pid}/status"))?;
    Ok(Memory {
        agent_rss_bytes: status_kib(&status, "VmRSS").context("no VmRSS")? * 1024,
        agent_peak_rss_bytes: status_kib(&status, "VmHWM").context("no VmHWM")? * 1024,
        bpf_maps: pinned_maps(pin_path)?,
    })
}

/// A `Name:   123 kB` line of /proc/PID/status, in KiB.
fn status_kib(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Every map pinned under `dir`, with what the kernel charges for it.
fn pinned_maps(dir: &Path) -> Result<Vec<MapMemory>> {
    if !dir.exists() {
        return Ok(Vec::new()); // a kernel mode pins nothing
    }
    Ok(crate::perpacket::map_memory(dir)?
        .into_iter()
        .map(|m| MapMemory {
            name: m.name,
            max_entries: u64::from(m.max_entries),
            bytes: m.memlock_bytes,
            preallocated: m.map_flags & BPF_F_NO_PREALLOC == 0,
        })
        .collect())
}

/// The flag of a map whose memory grows with its entries.
const BPF_F_NO_PREALLOC: u32 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_proc_status() {
        let status = "Name:\txproxy\nVmHWM:\t   81234 kB\nVmRSS:\t   40960 kB\n";
        assert_eq!(status_kib(status, "VmRSS"), Some(40960));
        assert_eq!(status_kib(status, "VmHWM"), Some(81234));
        assert_eq!(status_kib(status, "VmSwap"), None);
    }
}
