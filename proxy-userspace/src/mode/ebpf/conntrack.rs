//! The programs' conntrack table as the agent keeps it: sized and timed
//! from the `conntrack` configuration at load, read in batches, swept of
//! flows idle past their timeout, its counters kept in the pinned
//! `XP_CT_STATS` for `/metrics` and `xproxy status`.
//!
//! What the states and timeouts mean is `proxy_common::conntrack`'s: the
//! programs decide per packet whether a flow is over; the sweep here only
//! frees the room of flows nobody uses any more, so that the table fills
//! with live flows and the kernel's least-recently-used eviction (which
//! takes an idle long-lived connection's backend with it) stays the last
//! resort.

use std::{collections::HashMap as StdHashMap, net::IpAddr, path::Path, time::Duration};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData, MapError, PerCpuArray, PerCpuValues};
use proxy_common::{
    CtKey, CtKey6, CtTimeouts, CtValue, CtValue6,
    conntrack::{partner_key, settled_state, state},
    maps,
    stats::ct_stat,
};

use bpf_sys::map::{BatchCursor, lookup_batch};

use super::pinned_maps::{fd_of, open, pinned};
use crate::config::ConntrackConfig;

/// Entries read per bpf(2) call: 256 KiB of keys and values.
const READ_BATCH: usize = 4096;

/// The table's size and timeouts, from the `conntrack` configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtSettings {
    pub timeouts: CtTimeouts,
    /// Map entries: two a flow.
    pub entries: u32,
}

impl Default for CtSettings {
    fn default() -> Self {
        Self::from_config(&ConntrackConfig::default(), 1)
    }
}

impl CtSettings {
    /// kube-proxy's reading of the section, for a table of our own: flows
    /// `maxPerCore` x `cpus`, at least `min` (0 for `maxPerCore` leaves
    /// the programs' built-in size); each timeout set overrides the
    /// kernel's default for its state (0 leaves it).
    pub fn from_config(config: &ConntrackConfig, cpus: u32) -> Self {
        let mut timeouts = CtTimeouts::KERNEL;
        let mut set = |states: &[u8], value: Duration| {
            if !value.is_zero() {
                let seconds = u32::try_from(value.as_secs().max(1)).unwrap_or(u32::MAX);
                for s in states {
                    timeouts.seconds[*s as usize] = seconds;
                }
            }
        };
        set(&[state::NONE, state::TCP_ESTABLISHED], config.tcp_established_timeout);
        set(&[state::TCP_FIN_WAIT], config.tcp_close_wait_timeout);
        set(&[state::UDP_UNREPLIED], config.udp_timeout);
        set(&[state::UDP_REPLIED], config.udp_stream_timeout);
        let entries = if config.max_per_core == 0 {
            maps::CONNTRACK_MAX
        } else {
            let flows = u64::from(config.max_per_core) * u64::from(cpus.max(1));
            let flows = flows.max(u64::from(config.min));
            u32::try_from(flows * 2).unwrap_or(u32::MAX)
        };
        Self { timeouts, entries }
    }

    /// How often the sweep runs: half the shortest timeout, between 1 s
    /// and 10 s.
    pub fn sweep_interval(&self) -> Duration {
        let shortest = self.timeouts.seconds.iter().copied().min().unwrap_or(10);
        Duration::from_millis(u64::from(shortest) * 500).clamp(Duration::from_secs(1), Duration::from_secs(10))
    }
}

/// CLOCK_MONOTONIC_COARSE in nanoseconds: the programs' clock
/// (`bpf_ktime_get_coarse_ns`).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a pointer to a timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// An IPv6 flow as `xproxy status` counts it: its frontend `(address,
/// port)`, protocol and backend `(address, port)`.
pub type Flow6 = ((IpAddr, u16), u8, (IpAddr, u16));

/// The tracked IPv6 flows of the `XP_CT6` pinned under `pin_path`, by
/// their forward entries (the snapshot counts `XP_CT`'s); none where an
/// older agent pinned no `XP_CT6`.
pub fn ipv6_flow_counts(pin_path: &Path) -> Result<StdHashMap<Flow6, u64>> {
    let mut counts = StdHashMap::new();
    if !pin_path.join(maps::CONNTRACK6).exists() {
        return Ok(counts);
    }
    let conntrack: HashMap<MapData, CtKey6, CtValue6> = open(pin_path, maps::CONNTRACK6)?;
    for (key, value) in read_entries(&conntrack, |_, value| !value.is_reply())? {
        let (frontend, backend, proto) = super::stale_flows::ends6(&key, &value);
        *counts.entry((frontend, proto, backend)).or_default() += 1;
    }
    Ok(counts)
}

/// The entries of a conntrack map (`XP_CT` or `XP_CT6`) that `keep`
/// accepts, read [`READ_BATCH`] at a time (BPF_MAP_LOOKUP_BATCH; aya's
/// iterator takes two syscalls an entry). Falls back to the iterator where
/// the kernel has no batches.
pub fn read_entries<K: aya::Pod + bytemuck::Pod, V: aya::Pod + bytemuck::Pod>(
    conntrack: &HashMap<MapData, K, V>,
    keep: impl Fn(&K, &V) -> bool,
) -> Result<Vec<(K, V)>> {
    let mut kept = Vec::new();
    let mut cursor = BatchCursor::default();
    let mut keys: Vec<K> = Vec::with_capacity(READ_BATCH);
    let mut values: Vec<V> = Vec::with_capacity(READ_BATCH);
    loop {
        // SAFETY: aya opened `conntrack` as a map of `K` to `V` after
        // checking the kernel's key and value sizes.
        let read = unsafe { lookup_batch(fd_of(conntrack), &mut cursor, &mut keys, &mut values) };
        match read {
            Ok(complete) => {
                let batch = keys.drain(..).zip(values.drain(..));
                kept.extend(batch.filter(|(key, value)| keep(key, value)));
                if complete {
                    return Ok(kept);
                }
            }
            // One hash bucket holds more flows than there was room for.
            Err(e) if e.error.raw_os_error() == Some(libc::ENOSPC) => {
                let room = keys.capacity() * 2;
                keys.reserve(room);
                values.reserve(room);
            }
            Err(e) if e.unsupported() && !cursor.started() => {
                return Ok(conntrack
                    .iter()
                    .filter_map(Result::ok)
                    .filter(|(key, value)| keep(key, value))
                    .collect());
            }
            Err(e) => return Err(e).context("reading the conntrack map"),
        }
    }
}

/// The keys of the entries whose flow is idle past its state's timeout at
/// `now` both ways (an entry whose partner is gone: its own way).
pub fn expired(entries: &[(CtKey, CtValue)], timeouts: &CtTimeouts, now: u64) -> Vec<CtKey> {
    let last_seen: std::collections::HashMap<CtKey, u64> = entries.iter().map(|(k, v)| (*k, v.last_seen_ns)).collect();
    entries
        .iter()
        .filter(|(key, value)| {
            let state = settled_state(value.state, value.flags);
            let idle = |seen| timeouts.idle_past(state, seen, now);
            idle(value.last_seen_ns) && last_seen.get(&partner_key(key, value)).is_none_or(|seen| idle(*seen))
        })
        .map(|(key, _)| *key)
        .collect()
}

/// What one sweep found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Entries before the sweep.
    pub entries: u64,
    /// Entries it deleted.
    pub expired: u64,
}

/// Deletes the expired flows of the table pinned under `pin_path` and
/// updates its counters.
pub fn sweep(pin_path: &Path, timeouts: &CtTimeouts) -> Result<Sweep> {
    let mut conntrack: HashMap<MapData, CtKey, CtValue> = open(pin_path, maps::CONNTRACK)?;
    let entries = read_entries(&conntrack, |_, _| true)?;
    let expired_keys = expired(&entries, timeouts, now_ns());
    let deleted = remove_all(&mut conntrack, &expired_keys)?;
    let mut stats = CtStats::open(pin_path)?;
    stats.add(ct_stat::AGENT_REMOVED, deleted)?;
    stats.add(ct_stat::EXPIRED, deleted)?;
    let live = entries.len() as u64 - deleted;
    stats.set(ct_stat::LIVE, live)?;
    let evicted = stats
        .get(ct_stat::INSERTED)?
        .saturating_sub(stats.get(ct_stat::REMOVED)?)
        .saturating_sub(stats.get(ct_stat::AGENT_REMOVED)?)
        .saturating_sub(live);
    stats.set(ct_stat::EVICTED, evicted)?;
    Ok(Sweep {
        entries: entries.len() as u64,
        expired: deleted,
    })
}

/// Deletes `keys`; returns how many were there to delete.
pub fn remove_all<K: aya::Pod, V: aya::Pod>(conntrack: &mut HashMap<MapData, K, V>, keys: &[K]) -> Result<u64> {
    let mut deleted = 0;
    for key in keys {
        match conntrack.remove(key) {
            Ok(()) => deleted += 1,
            // Evicted or deleted by the programs meanwhile.
            Err(MapError::KeyNotFound) => {}
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e).context("deleting a conntrack entry"),
        }
    }
    Ok(deleted)
}

/// The pinned conntrack counters (`proxy_common::stats::ct_stat`).
pub struct CtStats(PerCpuArray<MapData, u64>);

impl CtStats {
    pub fn open(pin_path: &Path) -> Result<Self> {
        let map = PerCpuArray::try_from(pinned(pin_path, maps::CT_STATS)?)
            .with_context(|| format!("map {} has an unexpected layout", maps::CT_STATS))?;
        Ok(Self(map))
    }

    /// The counter summed over every CPU.
    pub fn get(&self, index: u32) -> Result<u64> {
        let values = self.0.get(&index, 0).context("reading a conntrack counter")?;
        Ok(values.iter().fold(0u64, |sum, v| sum.wrapping_add(*v)))
    }

    /// Sets the counter (into CPU 0's slot, the others to 0).
    pub fn set(&mut self, index: u32, value: u64) -> Result<()> {
        let cpus = self.0.get(&index, 0).context("reading a conntrack counter")?.len();
        let mut values = vec![0u64; cpus];
        values[0] = value;
        let values = PerCpuValues::try_from(values).context("per-CPU values")?;
        self.0.set(index, values, 0).context("writing a conntrack counter")
    }

    pub fn add(&mut self, index: u32, n: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let sum = self.get(index)?;
        self.set(index, sum.wrapping_add(n))
    }
}

/// The conntrack counters (indexed by `ct_stat`) and the table's size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConntrackCounts {
    pub counters: [u64; ct_stat::COUNT as usize],
    pub max_entries: u32,
}

impl ConntrackCounts {
    pub fn get(&self, index: u32) -> u64 {
        self.counters.get(index as usize).copied().unwrap_or(0)
    }
}

/// The conntrack counters and the table's size; `None` if the data path
/// pinned under `pin_path` has no conntrack counters.
pub fn read_conntrack_counts(pin_path: &Path) -> Result<Option<ConntrackCounts>> {
    let path = pin_path.join(maps::CT_STATS);
    if !path.exists() {
        return Ok(None);
    }
    let stats = CtStats::open(pin_path)?;
    let mut counts = ConntrackCounts::default();
    for (index, slot) in (0..).zip(counts.counters.iter_mut()) {
        *slot = stats.get(index)?;
    }
    let table = pin_path.join(maps::CONNTRACK);
    counts.max_entries = aya::maps::MapInfo::from_pin(&table)
        .with_context(|| format!("reading {}", table.display()))?
        .max_entries();
    Ok(Some(counts))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proxy_common::{conntrack::FLAG_REPLY, proto};

    use super::*;

    const S: u64 = 1_000_000_000;

    fn pair(client_port: u16, st: u8, forward_seen: u64, reply_seen: u64) -> [(CtKey, CtValue); 2] {
        let client = Ipv4Addr::new(10, 0, 0, 1);
        let frontend = (Ipv4Addr::new(10, 96, 0, 10), 53);
        let backend = (Ipv4Addr::new(10, 244, 0, 2), 5353);
        let value = |nat: (Ipv4Addr, u16), flags, seen| CtValue {
            flags,
            state: st,
            last_seen_ns: seen,
            nat_addr_be: u32::from_ne_bytes(nat.0.octets()),
            nat_port_be: nat.1.to_be(),
            ..bytemuck::Zeroable::zeroed()
        };
        [
            (
                CtKey::new(client, client_port, frontend.0, frontend.1, proto::UDP),
                value(backend, 0, forward_seen),
            ),
            (
                CtKey::new(backend.0, backend.1, client, client_port, proto::UDP),
                value(frontend, FLAG_REPLY, reply_seen),
            ),
        ]
    }

    #[test]
    fn a_flow_expires_when_idle_both_ways() {
        let t = CtTimeouts::KERNEL; // UDP replied: 120 s
        let now = 1000 * S;
        let idle = pair(1, state::UDP_REPLIED, now - 121 * S, now - 130 * S);
        let busy_replies = pair(2, state::UDP_REPLIED, now - 500 * S, now - 5 * S);
        let fresh = pair(3, state::UDP_REPLIED, now - 5 * S, now - 5 * S);
        let entries: Vec<_> = [idle, busy_replies, fresh].concat();
        assert_eq!(expired(&entries, &t, now), vec![idle[0].0, idle[1].0]);
        // An entry whose partner is gone goes by its own age.
        assert_eq!(expired(&busy_replies[..1], &t, now), vec![busy_replies[0].0]);
    }

    #[test]
    fn closed_flows_expire_sooner() {
        let t = CtTimeouts::KERNEL;
        let now = 1000 * S;
        let [forward, reply] = pair(1, state::TCP_CLOSE, now - 11 * S, now - 11 * S);
        assert_eq!(expired(&[forward, reply], &t, now).len(), 2);
        let [forward, reply] = pair(1, state::TCP_ESTABLISHED, now - 11 * S, now - 11 * S);
        assert!(expired(&[forward, reply], &t, now).is_empty());
    }

    #[test]
    fn settings_follow_kube_proxys_conntrack_section() {
        let config = ConntrackConfig {
            max_per_core: 1000,
            min: 5000,
            tcp_established_timeout: Duration::from_secs(3600),
            tcp_close_wait_timeout: Duration::ZERO,
            udp_timeout: Duration::from_secs(2),
            ..ConntrackConfig::default()
        };
        let s = CtSettings::from_config(&config, 2);
        assert_eq!(s.entries, 10_000, "min 5,000 flows, two entries each");
        assert_eq!(CtSettings::from_config(&config, 8).entries, 16_000);
        assert_eq!(s.timeouts.seconds[state::TCP_ESTABLISHED as usize], 3600);
        assert_eq!(s.timeouts.seconds[state::NONE as usize], 3600);
        assert_eq!(
            s.timeouts.seconds[state::TCP_FIN_WAIT as usize],
            60,
            "0 leaves the kernel's"
        );
        assert_eq!(s.timeouts.seconds[state::UDP_UNREPLIED as usize], 2);
        assert_eq!(s.sweep_interval(), Duration::from_secs(1));
        let defaults = CtSettings::default();
        assert_eq!(defaults.entries, 2 * 128 * 1024, "kube-proxy's min wins on one CPU");
        assert_eq!(defaults.timeouts.seconds[state::TCP_ESTABLISHED as usize], 24 * 3600);
        assert_eq!(defaults.sweep_interval(), Duration::from_secs(5));
    }
}
