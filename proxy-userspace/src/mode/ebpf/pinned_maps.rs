//! The maps pinned under bpffs: opening them by name, and [`PinnedMaps`],
//! the kernel's implementation of [`LbMaps`] (what the agent runs on).

use std::{
    collections::BTreeSet,
    os::fd::{AsFd, BorrowedFd},
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, IterableMap, LpmTrie, Map, MapData, MapError, PerCpuArray};
use proxy_common::{
    AffinityKey, AffinityKey6, AffinityValue, Backend, Backend6, CtKey, CtKey6, CtValue, CtValue6, FrontendPort,
    MaglevChunk, MaglevKey, MemberKey, PortBits, RevNat, Service6Key, ServiceKey, ServiceValue, SlotChunk,
    SlotChunkKey, SourceRange6Data, SourceRange6Key, SourceRangeData, SourceRangeKey, Verdict, VerdictCounter, maps,
    ports,
};

use bpf_sys::map::{self as bpf_map, BatchCursor};

use super::{
    lb_maps::LbMaps,
    write_batch::{Split, SplitStaged, Step, Table, Writer},
};

/// The map pinned as `name` under `pin_path`.
pub fn pinned(pin_path: &Path, name: &str) -> Result<Map> {
    let path = pin_path.join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
    Ok(Map::from_map_data(data)?)
}

/// The hash map pinned as `name` under `pin_path`.
pub fn open<K: aya::Pod, V: aya::Pod>(pin_path: &Path, name: &str) -> Result<HashMap<MapData, K, V>> {
    HashMap::try_from(pinned(pin_path, name)?).with_context(|| format!("map {name} has an unexpected layout"))
}

/// The backends array pinned under `pin_path` (`maps::BACKENDS`).
pub fn open_backends(pin_path: &Path) -> Result<Array<MapData, Backend>> {
    Array::try_from(pinned(pin_path, maps::BACKENDS)?)
        .with_context(|| format!("map {} has an unexpected layout", maps::BACKENDS))
}

/// The descriptor of a map, for the `bpf_sys` commands aya lacks.
pub(super) fn fd_of<K: aya::Pod, V>(map: &impl IterableMap<K, V>) -> BorrowedFd<'_> {
    map.map().fd().as_fd()
}

/// Every key of an LPM trie, as `(prefix length, data)` made into `K`.
fn trie_keys<D: aya::Pod, K>(trie: &LpmTrie<MapData, D, u8>, key: impl Fn(u32, D) -> K) -> Result<Vec<K>> {
    let keys = trie.keys().collect::<Result<Vec<_>, _>>()?;
    Ok(keys.into_iter().map(|k| key(k.prefix_len(), k.data())).collect())
}

/// The per-CPU verdict counters of `stats`, summed, every verdict listed
/// (one a map pinned by an older agent does not know counts 0).
pub fn sum_verdicts(stats: &PerCpuArray<MapData, VerdictCounter>) -> Result<Vec<(Verdict, VerdictCounter)>> {
    let mut out = Vec::with_capacity(Verdict::ALL.len());
    for verdict in Verdict::ALL {
        let per_cpu = match stats.get(&(verdict as u32), 0) {
            Ok(per_cpu) => per_cpu,
            Err(MapError::OutOfBounds { .. }) => {
                out.push((verdict, VerdictCounter::default()));
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", verdict.name())),
        };
        let sum = per_cpu.iter().fold(VerdictCounter::default(), |sum, c| VerdictCounter {
            packets: sum.packets.wrapping_add(c.packets),
            bytes: sum.bytes.wrapping_add(c.bytes),
        });
        out.push((verdict, sum));
    }
    Ok(out)
}

/// The maps an agent's programs use, pinned under one directory of bpffs
/// (created by [`super::Datapath::load`]).
pub struct PinnedMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    services6: HashMap<MapData, Service6Key, ServiceValue>,
    slots: HashMap<MapData, SlotChunkKey, SlotChunk>,
    backends: Array<MapData, Backend>,
    backends6: HashMap<MapData, u32, Backend6>,
    rev_nat: HashMap<MapData, u32, RevNat>,
    members: HashMap<MapData, MemberKey, u32>,
    maglev: HashMap<MapData, MaglevKey, MaglevChunk>,
    source_ranges: LpmTrie<MapData, SourceRangeData, u8>,
    source_ranges6: LpmTrie<MapData, SourceRange6Data, u8>,
    service_ports: HashMap<MapData, u32, FrontendPort>,
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    affinity6: HashMap<MapData, AffinityKey6, AffinityValue>,
    conntrack: HashMap<MapData, CtKey, CtValue>,
    conntrack6: HashMap<MapData, CtKey6, CtValue6>,
    stats: PerCpuArray<MapData, VerdictCounter>,
    ports: Array<MapData, PortBits>,
    writer: Writer,
}

impl PinnedMaps {
    /// Opens the maps pinned under `pin_path`, checking their layouts.
    pub fn open(pin_path: &Path) -> Result<Self> {
        let layout = |name: &str| format!("map {name} has an unexpected layout");
        Ok(Self {
            services: open(pin_path, maps::SERVICES)?,
            services6: open(pin_path, maps::SERVICES6)?,
            slots: open(pin_path, maps::BACKEND_SLOTS)?,
            backends: open_backends(pin_path)?,
            backends6: open(pin_path, maps::BACKENDS6)?,
            rev_nat: open(pin_path, maps::REV_NAT)?,
            members: open(pin_path, maps::MEMBERS)?,
            maglev: open(pin_path, maps::MAGLEV)?,
            source_ranges: LpmTrie::try_from(pinned(pin_path, maps::SOURCE_RANGES)?)
                .with_context(|| layout(maps::SOURCE_RANGES))?,
            source_ranges6: LpmTrie::try_from(pinned(pin_path, maps::SOURCE_RANGES6)?)
                .with_context(|| layout(maps::SOURCE_RANGES6))?,
            service_ports: open(pin_path, maps::SERVICE_PORTS)?,
            affinity: open(pin_path, maps::AFFINITY)?,
            affinity6: open(pin_path, maps::AFFINITY6)?,
            conntrack: open(pin_path, maps::CONNTRACK)?,
            conntrack6: open(pin_path, maps::CONNTRACK6)?,
            stats: PerCpuArray::try_from(pinned(pin_path, maps::STATS)?).with_context(|| layout(maps::STATS))?,
            ports: Array::try_from(pinned(pin_path, maps::PORTS)?).with_context(|| layout(maps::PORTS))?,
            writer: Writer::default(),
        })
    }

    /// Writes one entry at a time from now on, as on a kernel without
    /// batch operations (for tests of that path on kernels with them).
    #[cfg(test)]
    pub(super) fn without_batches(&self) {
        self.writer.without_batches();
    }

    /// Entries in the Service maps (for tests).
    #[cfg(test)]
    pub(super) fn entries(&self) -> usize {
        self.services.keys().count()
            + self.services6.keys().count()
            + self.backends6.keys().count()
            + self.rev_nat.keys().count()
            + self.slots.keys().count()
            + read_backends(&self.backends).map_or(0, |b| b.len())
            + self.members.keys().count()
            + self.maglev.keys().count()
            + self.source_ranges.keys().count()
            + self.source_ranges6.keys().count()
            + self.service_ports.keys().count()
    }

    /// The descriptor of the source ranges map, whose keys are written as
    /// [`SourceRangeKey`]s (the same 12 bytes as aya's `Key<SourceRangeData>`).
    fn source_ranges_fd(&self) -> BorrowedFd<'_> {
        fd_of(&self.source_ranges)
    }
}

const _: () = assert!(
    size_of::<SourceRangeKey>() == size_of::<aya::maps::lpm_trie::Key<SourceRangeData>>(),
    "the source range key is the trie's key"
);
const _: () = assert!(
    size_of::<SourceRange6Key>() == size_of::<aya::maps::lpm_trie::Key<SourceRange6Data>>(),
    "the IPv6 source range key is the trie's key"
);

/// One entry of `map`; `None` if it is not there.
pub fn get<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>, key: &K) -> Result<Option<V>> {
    match map.get(key, 0) {
        Ok(value) => Ok(Some(value)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(e).context("reading a map entry"),
    }
}

/// Every backend in the backends array, by id: read in batches (8 MiB at
/// 1M entries), the empty entries left out.
fn read_backends(backends: &Array<MapData, Backend>) -> Result<Vec<(u32, Backend)>> {
    const ROOM: usize = 65_536;
    let mut found = Vec::new();
    let mut cursor = BatchCursor::default();
    let (mut ids, mut values): (Vec<u32>, Vec<Backend>) = (Vec::with_capacity(ROOM), Vec::with_capacity(ROOM));
    loop {
        // SAFETY: aya opened the array with `Backend`'s size checked; its
        // keys are `u32` indices.
        match unsafe { bpf_map::lookup_batch(fd_of(backends), &mut cursor, &mut ids, &mut values) } {
            Ok(complete) => {
                let batch = ids.drain(..).zip(values.drain(..));
                found.extend(batch.filter(|(_, b)| b.is_present()));
                if complete {
                    return Ok(found);
                }
            }
            Err(e) if e.unsupported() && !cursor.started() => break,
            Err(e) => return Err(e).context("reading the backends"),
        }
    }
    // Before Linux 5.6: one entry at a time.
    let mut found = Vec::new();
    for id in 0..backends.len() {
        let backend = backends.get(&id, 0).context("reading a backend")?;
        if backend.is_present() {
            found.push((id, backend));
        }
    }
    Ok(found)
}

/// Writes the entries of `split` into `map`.
fn write_to<K: aya::Pod + bytemuck::Pod, V: aya::Pod + bytemuck::Pod>(
    writer: &Writer,
    map: &HashMap<MapData, K, V>,
    split: &Split<K, V>,
) -> Result<()> {
    // SAFETY: aya opened `map` as a map of `K` to `V` only after checking
    // that the kernel's key and value sizes are theirs.
    unsafe { writer.write(fd_of(map), split) }
}

/// Deletes the keys of `split` from `map`.
fn delete_from<K: aya::Pod + bytemuck::Pod, V: aya::Pod>(
    writer: &Writer,
    map: &HashMap<MapData, K, V>,
    split: &Split<K, V>,
) -> Result<()> {
    // SAFETY: as in `write_to`: aya checked the key size.
    unsafe { writer.delete(fd_of(map), split) }
}

/// Deletes the entries of an affinity map (either family's) whose key
/// `forget` picks; returns how many went.
fn forget_clients<K: aya::Pod + bytemuck::Pod>(
    affinity: &HashMap<MapData, K, AffinityValue>,
    forget: impl Fn(&K) -> bool,
) -> Result<u64> {
    let keys: Vec<K> = affinity.keys().filter_map(Result::ok).filter(|k| forget(k)).collect();
    let mut gone = 0;
    for key in &keys {
        // SAFETY: aya opened the map with `K`'s size checked.
        match unsafe { bpf_sys::map::delete_elem(fd_of(affinity), key) } {
            Ok(()) => gone += 1,
            // Evicted meanwhile by the programs' LRU.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e).context("deleting an affinity entry"),
        }
    }
    Ok(gone)
}

impl LbMaps for PinnedMaps {
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>> {
        Ok(self.services.iter().collect::<Result<_, _>>()?)
    }

    fn service(&self, key: &ServiceKey) -> Result<Option<ServiceValue>> {
        get(&self.services, key)
    }

    fn services6(&self) -> Result<Vec<(Service6Key, ServiceValue)>> {
        Ok(self.services6.iter().collect::<Result<_, _>>()?)
    }

    fn service6(&self, key: &Service6Key) -> Result<Option<ServiceValue>> {
        get(&self.services6, key)
    }

    fn slot_chunk_keys(&self) -> Result<Vec<SlotChunkKey>> {
        Ok(self.slots.keys().collect::<Result<_, _>>()?)
    }

    fn slot_chunk(&self, key: &SlotChunkKey) -> Result<Option<SlotChunk>> {
        get(&self.slots, key)
    }

    fn backends(&self) -> Result<Vec<(u32, Backend)>> {
        read_backends(&self.backends)
    }

    fn backend(&self, id: u32) -> Result<Option<Backend>> {
        match self.backends.get(&id, 0) {
            Ok(backend) => Ok(Some(backend).filter(Backend::is_present)),
            Err(MapError::OutOfBounds { .. }) => Ok(None),
            Err(e) => Err(e).context("reading a backend"),
        }
    }

    fn backends6(&self) -> Result<Vec<(u32, Backend6)>> {
        Ok(self.backends6.iter().collect::<Result<_, _>>()?)
    }

    fn backend6(&self, id: u32) -> Result<Option<Backend6>> {
        get(&self.backends6, &id)
    }

    fn rev_nat_ids(&self) -> Result<Vec<u32>> {
        Ok(self.rev_nat.keys().collect::<Result<_, _>>()?)
    }

    fn member_keys(&self) -> Result<Vec<MemberKey>> {
        Ok(self.members.keys().collect::<Result<_, _>>()?)
    }

    fn maglev_keys(&self) -> Result<Vec<MaglevKey>> {
        Ok(self.maglev.keys().collect::<Result<_, _>>()?)
    }

    fn maglev_chunk(&self, key: &MaglevKey) -> Result<Option<MaglevChunk>> {
        get(&self.maglev, key)
    }

    fn source_range_keys(&self) -> Result<Vec<SourceRangeKey>> {
        trie_keys(&self.source_ranges, |prefix_len, d| SourceRangeKey {
            prefix_len,
            rev_nat_id_be: d.rev_nat_id_be,
            addr_be: d.addr_be,
        })
    }

    fn source_range6_keys(&self) -> Result<Vec<SourceRange6Key>> {
        trie_keys(&self.source_ranges6, |prefix_len, d| SourceRange6Key {
            prefix_len,
            rev_nat_id_be: d.rev_nat_id_be,
            addr_be: d.addr_be,
        })
    }

    fn service_ports(&self) -> Result<Vec<(u32, FrontendPort)>> {
        Ok(self.service_ports.iter().collect::<Result<_, _>>()?)
    }

    fn forget_affinity(&self, affinity_ids: &BTreeSet<u32>) -> Result<u64> {
        let v4 = forget_clients(&self.affinity, |k| affinity_ids.contains(&k.affinity_id))?;
        let v6 = forget_clients(&self.affinity6, |k| affinity_ids.contains(&k.affinity_id))?;
        Ok(v4 + v6)
    }

    fn write_step(&self, step: Step, staged: &SplitStaged) -> Result<()> {
        let w = &self.writer;
        let ranges = self.source_ranges_fd();
        let ranges6 = fd_of(&self.source_ranges6);
        match step {
            // SAFETY: aya opened the array with `Backend`'s size checked.
            Step::Write(Table::Backends) => unsafe { w.write(fd_of(&self.backends), &staged.backends) },
            Step::Write(Table::Backends6) => write_to(w, &self.backends6, &staged.backends6),
            Step::Write(Table::Slots) => write_to(w, &self.slots, &staged.slots),
            Step::Write(Table::RevNat) => write_to(w, &self.rev_nat, &staged.rev_nat),
            Step::Write(Table::Services) => write_to(w, &self.services, &staged.services),
            Step::Write(Table::Services6) => write_to(w, &self.services6, &staged.services6),
            Step::Write(Table::Members) => write_to(w, &self.members, &staged.members),
            Step::Write(Table::ServicePorts) => write_to(w, &self.service_ports, &staged.service_ports),
            Step::Write(Table::Maglev) => write_to(w, &self.maglev, &staged.maglev),
            // SAFETY: the trie's key is a `SourceRangeKey` (asserted above)
            // and its value a `u8` (aya checked both sizes at open).
            Step::Write(Table::SourceRanges) => unsafe { w.write(ranges, &staged.source_ranges) },
            // SAFETY: as IPv4's: the key is a `SourceRange6Key` (asserted above).
            Step::Write(Table::SourceRanges6) => unsafe { w.write(ranges6, &staged.source_ranges6) },
            // SAFETY: as above.
            Step::Delete(Table::Backends) => unsafe { w.clear(fd_of(&self.backends), &staged.backends) },
            Step::Delete(Table::Backends6) => delete_from(w, &self.backends6, &staged.backends6),
            Step::Delete(Table::Slots) => delete_from(w, &self.slots, &staged.slots),
            Step::Delete(Table::RevNat) => delete_from(w, &self.rev_nat, &staged.rev_nat),
            Step::Delete(Table::Services) => delete_from(w, &self.services, &staged.services),
            Step::Delete(Table::Services6) => delete_from(w, &self.services6, &staged.services6),
            Step::Delete(Table::Members) => delete_from(w, &self.members, &staged.members),
            Step::Delete(Table::ServicePorts) => delete_from(w, &self.service_ports, &staged.service_ports),
            Step::Delete(Table::Maglev) => delete_from(w, &self.maglev, &staged.maglev),
            // SAFETY: as for the writes.
            Step::Delete(Table::SourceRanges) => unsafe { w.delete(ranges, &staged.source_ranges) },
            // SAFETY: as for the writes.
            Step::Delete(Table::SourceRanges6) => unsafe { w.delete(ranges6, &staged.source_ranges6) },
        }
    }

    fn writes(&self) -> u64 {
        self.writer.writes()
    }

    fn port_words(&self) -> Result<Vec<PortBits>> {
        (0..ports::PORT_WORDS)
            .map(|i| self.ports.get(&i, 0))
            .collect::<Result<Vec<_>, _>>()
            .context("reading the port filter")
    }

    fn set_port_word(&self, index: u32, word: PortBits) -> Result<()> {
        // SAFETY: aya opened `ports` as an array of `PortBits` (u32 keys)
        // after checking the kernel's key and value sizes.
        unsafe { bpf_sys::map::update_elem(fd_of(&self.ports), &index, &word) }.context("writing the port filter")
    }

    fn conntrack_entries(&self) -> Result<Vec<(CtKey, CtValue)>> {
        Ok(self.conntrack.iter().collect::<Result<_, _>>()?)
    }

    fn conntrack6_entries(&self) -> Result<Vec<(CtKey6, CtValue6)>> {
        Ok(self.conntrack6.iter().collect::<Result<_, _>>()?)
    }

    fn verdicts(&self) -> Result<Vec<(Verdict, VerdictCounter)>> {
        sum_verdicts(&self.stats)
    }
}
