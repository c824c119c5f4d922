//! The programs' conntrack tables as the agent keeps them (`XP_CT`, and
//! `XP_CT6` for IPv6 flows): sized and timed from the `conntrack`
//! configuration at load, read in batches, swept of flows idle past their
//! timeout, their counters (shared: both tables' programs count into one
//! set) kept in the pinned `XP_CT_STATS` for `/metrics` and `xproxy
//! status`.
//!
//! What the states and timeouts mean is `proxy_common::conntrack`'s: the
//! programs decide per packet whether a flow is over; the sweep here only
//! frees the room of flows nobody uses any more, so that the table fills
//! with live flows and the kernel's least-recently-used eviction (which
//! takes an idle long-lived connection's backend with it) stays the last
//! resort.

use std::{collections::HashMap as StdHashMap, hash::Hash, path::Path, time::Duration};

use anyhow::{Context, Result};
use aya::maps::{HashMap, MapData, MapError, PerCpuArray, PerCpuValues};
use proxy_common::{
    CtKey, CtKey6, CtTimeouts, CtValue, CtValue6,
    conntrack::{partner_key, settled_state, state},
    ipv6::partner_key6,
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
    /// Map entries of `XP_CT`: two a flow.
    pub entries: u32,
    /// Map entries of `XP_CT6`: a quarter of `entries`, the ratio of the
    /// programs' built-in sizes (an IPv6 entry takes 128 bytes of the
    /// preallocated map, an IPv4 one 88; see `proxy_common::maps`).
    pub entries6: u32,
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
        let entries6 = if config.max_per_core == 0 {
            maps::CONNTRACK6_MAX
        } else {
            // Even, as `entries`: two entries a flow.
            (entries / 4).max(2) & !1
        };
        Self {
            timeouts,
            entries,
            entries6,
        }
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

/// What the sweep reads of a conntrack value, of either table.
pub trait CtEntry {
    type Key: Copy + Eq + Hash;
    /// The key of the flow's other entry.
    fn partner(&self, key: &Self::Key) -> Self::Key;
    fn last_seen_ns(&self) -> u64;
    /// The state the flow's timeout is chosen by.
    fn settled_state(&self) -> u8;
}

/// [`CtEntry`] for a table's value type: the fields are the same in both.
macro_rules! impl_ct_entry {
    ($value:ty, $key:ty, $partner:path) => {
        impl CtEntry for $value {
            type Key = $key;
            fn partner(&self, key: &$key) -> $key {
                $partner(key, self)
            }
            fn last_seen_ns(&self) -> u64 {
                self.last_seen_ns
            }
            fn settled_state(&self) -> u8 {
                settled_state(self.state, self.flags)
            }
        }
    };
}
impl_ct_entry!(CtValue, CtKey, partner_key);
impl_ct_entry!(CtValue6, CtKey6, partner_key6);

/// The keys of the entries whose flow is idle past its state's timeout at
/// `now` both ways (an entry whose partner is gone: its own way).
pub fn expired<V: CtEntry>(entries: &[(V::Key, V)], timeouts: &CtTimeouts, now: u64) -> Vec<V::Key> {
    let last_seen: StdHashMap<V::Key, u64> = entries.iter().map(|(k, v)| (*k, v.last_seen_ns())).collect();
    entries
        .iter()
        .filter(|(key, value)| {
            let idle = |seen| timeouts.idle_past(value.settled_state(), seen, now);
            idle(value.last_seen_ns()) && last_seen.get(&value.partner(key)).is_none_or(|seen| idle(*seen))
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

/// Deletes the expired flows of both tables pinned under `pin_path` (no
/// `XP_CT6` where an older agent pinned none) and updates their counters.
pub fn sweep(pin_path: &Path, timeouts: &CtTimeouts) -> Result<Sweep> {
    let v4 = sweep_table::<CtValue>(pin_path, maps::CONNTRACK, timeouts)?;
    let v6 = if pin_path.join(maps::CONNTRACK6).exists() {
        sweep_table::<CtValue6>(pin_path, maps::CONNTRACK6, timeouts)?
    } else {
        Sweep::default()
    };
    let (entries, deleted) = (v4.entries + v6.entries, v4.expired + v6.expired);
    let mut stats = CtStats::open(pin_path)?;
    stats.add(ct_stat::AGENT_REMOVED, deleted)?;
    stats.add(ct_stat::EXPIRED, deleted)?;
    let live = entries - deleted;
    stats.set(ct_stat::LIVE, live)?;
    let evicted = stats
        .get(ct_stat::INSERTED)?
        .saturating_sub(stats.get(ct_stat::REMOVED)?)
        .saturating_sub(stats.get(ct_stat::AGENT_REMOVED)?)
        .saturating_sub(live);
    stats.set(ct_stat::EVICTED, evicted)?;
    Ok(Sweep {
        entries,
        expired: deleted,
    })
}

/// Deletes the expired flows of the table `name`.
fn sweep_table<V>(pin_path: &Path, name: &str, timeouts: &CtTimeouts) -> Result<Sweep>
where
    V: CtEntry + aya::Pod + bytemuck::Pod,
    V::Key: aya::Pod + bytemuck::Pod,
{
    let mut conntrack: HashMap<MapData, V::Key, V> = open(pin_path, name)?;
    let entries = read_entries(&conntrack, |_, _| true)?;
    let expired_keys = expired(&entries, timeouts, now_ns());
    let deleted = remove_all(&mut conntrack, &expired_keys)?;
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
    // Both tables' room: the counters are both tables' too.
    for name in [maps::CONNTRACK, maps::CONNTRACK6] {
        let table = pin_path.join(name);
        if name == maps::CONNTRACK6 && !table.exists() {
            continue;
        }
        let info = aya::maps::MapInfo::from_pin(&table).with_context(|| format!("reading {}", table.display()))?;
        counts.max_entries = counts.max_entries.saturating_add(info.max_entries());
    }
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

    /// `XP_CT6`'s entries by the same rules, partners found by their
    /// 16-byte addresses.
    #[test]
    fn ipv6_flows_expire_when_idle_both_ways() {
        let t = CtTimeouts::KERNEL;
        let now = 1000 * S;
        let ip = |s: &str| -> std::net::Ipv6Addr { s.parse().expect("address") };
        let (client, frontend, backend) = (ip("fd00:30::1"), ip("fd00:96::10"), ip("fd00:244::2"));
        let pair = |port: u16, forward_seen: u64, reply_seen: u64| {
            let value = |nat: std::net::Ipv6Addr, nat_port: u16, flags, seen| CtValue6 {
                flags,
                state: state::UDP_REPLIED,
                last_seen_ns: seen,
                nat_addr_be: proxy_common::ipv6::addr6_be(nat),
                nat_port_be: nat_port.to_be(),
                ..bytemuck::Zeroable::zeroed()
            };
            [
                (
                    CtKey6::new(client, port, frontend, 53, proto::UDP),
                    value(backend, 5353, 0, forward_seen),
                ),
                (
                    CtKey6::new(backend, 5353, client, port, proto::UDP),
                    value(frontend, 53, FLAG_REPLY, reply_seen),
                ),
            ]
        };
        let idle = pair(1, now - 121 * S, now - 130 * S);
        let busy_replies = pair(2, now - 500 * S, now - 5 * S);
        let entries: Vec<_> = [idle, busy_replies].concat();
        assert_eq!(expired(&entries, &t, now), vec![idle[0].0, idle[1].0]);
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
        assert_eq!(s.entries6, 2_500, "a quarter for IPv6");
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
        assert_eq!(defaults.entries6, 2 * 32 * 1024);
        let builtin = CtSettings::from_config(
            &ConntrackConfig {
                max_per_core: 0,
                ..ConntrackConfig::default()
            },
            4,
        );
        assert_eq!(
            (builtin.entries, builtin.entries6),
            (maps::CONNTRACK_MAX, maps::CONNTRACK6_MAX)
        );
        assert_eq!(defaults.timeouts.seconds[state::TCP_ESTABLISHED as usize], 24 * 3600);
        assert_eq!(defaults.sweep_interval(), Duration::from_secs(5));
    }
}
