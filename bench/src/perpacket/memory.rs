//! Memory of the ebpf mode's maps, as the kernel reports it.

use std::{fs, path::Path};

use anyhow::{Context, Result};
use serde::Serialize;

use super::raw;

/// One pinned map: its shape as created and what the kernel charges for it.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct MapMemory {
    /// The pin's file name (the map's name).
    pub name: String,
    /// `hash`, `lru_hash`, `percpu_array`, ... (bpftool's names).
    pub map_type: String,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// `map_flags`; 0x1 is BPF_F_NO_PREALLOC (memory grows with entries).
    pub map_flags: u32,
    /// `(key_size + value_size) x max_entries`, per-CPU values counted once
    /// per possible CPU: the payload the map can hold, without overhead.
    pub payload_bytes: u64,
    /// The kernel's `memlock` for the map now (what `bpftool map show`
    /// prints): preallocated maps are charged in full from creation,
    /// BPF_F_NO_PREALLOC ones for what they hold.
    pub memlock_bytes: u64,
}

/// bpftool's names of the map types the ebpf mode uses (others by number).
fn type_name(map_type: u32) -> String {
    match map_type {
        1 => "hash".into(),
        2 => "array".into(),
        5 => "percpu_hash".into(),
        6 => "percpu_array".into(),
        9 => "lru_hash".into(),
        10 => "lru_percpu_hash".into(),
        other => format!("type {other}"),
    }
}

fn is_per_cpu(map_type: u32) -> bool {
    matches!(map_type, 5 | 6 | 10)
}

/// Every map pinned directly under `pin_dir` (links and other pins are
/// skipped), sorted by name.
pub fn map_memory(pin_dir: &Path) -> Result<Vec<MapMemory>> {
    let cpus = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))? as u64;
    let mut maps = Vec::new();
    for entry in fs::read_dir(pin_dir).with_context(|| format!("listing {}", pin_dir.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            continue;
        }
        let path = entry.path();
        let fd = raw::obj_get(&path).with_context(|| format!("opening the pin {}", path.display()))?;
        let fdinfo = format!("/proc/self/fdinfo/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        let text = fs::read_to_string(&fdinfo).with_context(|| format!("reading {fdinfo}"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(map) = parse_fdinfo(name, &text, cpus)? {
            maps.push(map);
        }
    }
    maps.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(maps)
}

/// The map described by a map descriptor's fdinfo, `None` if it is no map.
fn parse_fdinfo(name: String, text: &str, cpus: u64) -> Result<Option<MapMemory>> {
    let field = |key: &str| -> Option<&str> {
        text.lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
            .map(str::trim)
    };
    let Some(map_type) = field("map_type") else {
        return Ok(None);
    };
    let number = |key: &str| -> Result<u64> {
        let value = field(key).with_context(|| format!("{name}: no {key} in fdinfo"))?;
        let parsed = match value.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => value.parse(),
        };
        parsed.with_context(|| format!("{name}: {key} {value:?} is not a number"))
    };
    let map_type: u32 = map_type
        .parse()
        .with_context(|| format!("{name}: map_type {map_type:?}"))?;
    let key_size = number("key_size")? as u32;
    let value_size = number("value_size")? as u32;
    let max_entries = number("max_entries")? as u32;
    let value_copies = if is_per_cpu(map_type) { cpus } else { 1 };
    Ok(Some(MapMemory {
        map_type: type_name(map_type),
        key_size,
        value_size,
        max_entries,
        map_flags: number("map_flags")? as u32,
        payload_bytes: (u64::from(key_size) + u64::from(value_size) * value_copies) * u64::from(max_entries),
        memlock_bytes: number("memlock")?,
        name,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_of_a_per_cpu_map_counts_every_cpu() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1\nmap_type:\t6\nkey_size:\t4\n\
                    value_size:\t16\nmax_entries:\t9\nmap_flags:\t0x0\nmap_extra:\t0x0\n\
                    memlock:\t1024\nmap_id:\t7\nfrozen:\t0\n";
        let map = parse_fdinfo("XP_STATS".into(), text, 2)
            .expect("parses")
            .expect("is a map");
        assert_eq!(map.map_type, "percpu_array");
        assert_eq!(map.payload_bytes, (4 + 16 * 2) * 9);
        assert_eq!(map.memlock_bytes, 1024);
    }

    #[test]
    fn fdinfo_of_a_link_is_no_map() {
        let text = "pos:\t0\nflags:\t02000000\nlink_type:\txdp\nlink_id:\t3\nprog_tag:\tabc\n";
        assert_eq!(parse_fdinfo("x".into(), text, 2).expect("parses"), None);
    }
}
