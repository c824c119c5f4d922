//! [`LbMaps`] without a kernel: [`MemoryMaps`] keeps the maps in plain
//! collections (with the kernel's size limits), [`FaultyMaps`] fails a
//! chosen write. The Service writer's logic (adopting maps on restart,
//! shared backend ids, the order of a flush, full maps) is tested on them
//! without root; `xproxy status`'s reader (`snapshot`) reads them back.
//!
//! After every step of a flush the in-memory maps check what a packet
//! would see at that moment: a frontend whose slots or backends are
//! missing is recorded ([`MemoryMaps::torn_views`]), so a test can assert
//! that no order of writes ever shows one.

use std::{
    collections::{BTreeSet, HashMap},
    hash::Hash,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
};

use anyhow::{Result, bail};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, Backend6, BackendSlotKey, CtKey, CtKey6, CtValue, CtValue6, FrontendPort,
    MaglevChunk, MaglevKey, MemberKey, PortBits, RevNat, Service6Key, ServiceKey, ServiceValue, SlotChunk,
    SlotChunkKey, SourceRange6Key, SourceRangeKey, Verdict, VerdictCounter, maps, ports,
};

use super::{
    lb_maps::LbMaps,
    snapshot::slots_of,
    write_batch::{Split, SplitStaged, Step, Table},
};

/// The Service maps in memory. A clone is another handle on the same maps
/// (as a restarted agent opens the pinned ones), with its own count of
/// writes and of reads of the whole backends array.
pub struct MemoryMaps {
    state: Arc<Mutex<State>>,
    writes: AtomicU64,
    backend_scans: AtomicU64,
}

impl Default for MemoryMaps {
    fn default() -> Self {
        Self::new()
    }
}

impl Clone for MemoryMaps {
    fn clone(&self) -> Self {
        Self {
            state: self.state.clone(),
            writes: AtomicU64::new(0),
            backend_scans: AtomicU64::new(0),
        }
    }
}

/// One hash map: its entries and the most it takes.
struct MemTable<K, V> {
    entries: HashMap<K, V>,
    max_entries: usize,
}

impl<K: Copy + Eq + Hash, V: Copy> MemTable<K, V> {
    fn new(max_entries: u32) -> Self {
        Self {
            entries: HashMap::new(),
            max_entries: max_entries as usize,
        }
    }

    /// Writes the entries in order, as BPF_MAP_UPDATE_BATCH does: stops
    /// at the first that does not fit (E2BIG), those before it stay.
    fn write(&mut self, split: &Split<K, V>) -> Result<u64> {
        let (keys, values) = split.writes();
        for (done, (key, value)) in keys.iter().zip(values).enumerate() {
            if !self.entries.contains_key(key) && self.entries.len() >= self.max_entries {
                bail!("map full ({} entries): stopped after {done} entries", self.max_entries);
            }
            self.entries.insert(*key, *value);
        }
        Ok(keys.len() as u64)
    }

    /// Deletes the keys; returns how many were there.
    fn delete(&mut self, split: &Split<K, V>) -> u64 {
        split
            .deletes()
            .iter()
            .filter(|key| self.entries.remove(key).is_some())
            .count() as u64
    }

    fn get(&self, key: &K) -> Option<V> {
        self.entries.get(key).copied()
    }

    fn all(&self) -> Vec<(K, V)> {
        self.entries.iter().map(|(k, v)| (*k, *v)).collect()
    }

    fn keys(&self) -> Vec<K> {
        self.entries.keys().copied().collect()
    }
}

struct State {
    services: MemTable<ServiceKey, ServiceValue>,
    services6: MemTable<Service6Key, ServiceValue>,
    slots: MemTable<SlotChunkKey, SlotChunk>,
    backends: MemTable<u32, Backend>,
    backends6: MemTable<u32, Backend6>,
    rev_nat: MemTable<u32, RevNat>,
    members: MemTable<MemberKey, u32>,
    maglev: MemTable<MaglevKey, MaglevChunk>,
    source_ranges: MemTable<SourceRangeKey, u8>,
    source_ranges6: MemTable<SourceRange6Key, u8>,
    service_ports: MemTable<u32, FrontendPort>,
    ports: Vec<PortBits>,
    conntrack: Vec<(CtKey, CtValue)>,
    conntrack6: Vec<(CtKey6, CtValue6)>,
    affinity: Vec<(AffinityKey, AffinityValue)>,
    /// Frontends a packet would have found torn after some step.
    torn: Vec<String>,
}

impl State {
    /// Writes or deletes what `step` takes; returns the entries done.
    fn apply(&mut self, step: Step, staged: &SplitStaged) -> Result<u64> {
        Ok(match step {
            Step::Write(Table::Backends) => self.backends.write(&staged.backends)?,
            Step::Write(Table::Backends6) => self.backends6.write(&staged.backends6)?,
            Step::Write(Table::Slots) => self.slots.write(&staged.slots)?,
            Step::Write(Table::RevNat) => self.rev_nat.write(&staged.rev_nat)?,
            Step::Write(Table::Services) => self.services.write(&staged.services)?,
            Step::Write(Table::Services6) => self.services6.write(&staged.services6)?,
            Step::Write(Table::Members) => self.members.write(&staged.members)?,
            Step::Write(Table::Maglev) => self.maglev.write(&staged.maglev)?,
            Step::Write(Table::SourceRanges) => self.source_ranges.write(&staged.source_ranges)?,
            Step::Write(Table::SourceRanges6) => self.source_ranges6.write(&staged.source_ranges6)?,
            Step::Write(Table::ServicePorts) => self.service_ports.write(&staged.service_ports)?,
            Step::Delete(Table::Backends) => self.backends.delete(&staged.backends),
            Step::Delete(Table::Backends6) => self.backends6.delete(&staged.backends6),
            Step::Delete(Table::Slots) => self.slots.delete(&staged.slots),
            Step::Delete(Table::RevNat) => self.rev_nat.delete(&staged.rev_nat),
            Step::Delete(Table::Services) => self.services.delete(&staged.services),
            Step::Delete(Table::Services6) => self.services6.delete(&staged.services6),
            Step::Delete(Table::Members) => self.members.delete(&staged.members),
            Step::Delete(Table::Maglev) => self.maglev.delete(&staged.maglev),
            Step::Delete(Table::SourceRanges) => self.source_ranges.delete(&staged.source_ranges),
            Step::Delete(Table::SourceRanges6) => self.source_ranges6.delete(&staged.source_ranges6),
            Step::Delete(Table::ServicePorts) => self.service_ports.delete(&staged.service_ports),
        })
    }

    /// Records every frontend whose slots or backends a packet would miss
    /// now, after `step`.
    /// (A Service port entry's short-circuit view counts as a frontend.)
    fn check_readers_view(&mut self, step: Step) {
        let frontends4 = (self.services.all().into_iter()).map(|(k, v)| (format!("{}:{}", k.addr(), k.port()), v));
        let frontends6 = (self.services6.all().into_iter()).map(|(k, v)| (format!("[{}]:{}", k.addr(), k.port()), v));
        let frontends = frontends4.chain(frontends6);
        let short_circuits = (self.service_ports.all().into_iter())
            .filter(|(_, port)| port.short_circuits())
            .map(|(id, port)| (format!("the short-circuit of frontend {id}"), port.cluster));
        let views: Vec<(String, ServiceValue)> = frontends.chain(short_circuits).collect();
        for (frontend, value) in views {
            let whole = slots_of(&value).all(|slot| {
                let slot = BackendSlotKey {
                    backend_set: value.backend_set,
                    slot,
                };
                (self.slots.get(&slot.chunk_key()))
                    .map(|chunk| chunk.ids[slot.index_in_chunk()])
                    .is_some_and(|id| self.backends.get(&id).is_some() || self.backends6.get(&id).is_some())
            });
            if !whole {
                self.torn
                    .push(format!("after {step}: {frontend} points at a missing slot or backend"));
            }
        }
    }

    fn table_mut(&mut self, table: Table) -> &mut usize {
        match table {
            Table::Backends => &mut self.backends.max_entries,
            Table::Backends6 => &mut self.backends6.max_entries,
            Table::Slots => &mut self.slots.max_entries,
            Table::RevNat => &mut self.rev_nat.max_entries,
            Table::Services => &mut self.services.max_entries,
            Table::Services6 => &mut self.services6.max_entries,
            Table::Members => &mut self.members.max_entries,
            Table::Maglev => &mut self.maglev.max_entries,
            Table::SourceRanges => &mut self.source_ranges.max_entries,
            Table::SourceRanges6 => &mut self.source_ranges6.max_entries,
            Table::ServicePorts => &mut self.service_ports.max_entries,
        }
    }
}

impl MemoryMaps {
    /// Empty maps of the programs' sizes (`proxy_common::maps`).
    pub fn new() -> Self {
        let state = State {
            services: MemTable::new(maps::SERVICES_MAX),
            services6: MemTable::new(maps::SERVICES6_MAX),
            slots: MemTable::new(maps::BACKEND_SLOT_CHUNKS_MAX),
            backends: MemTable::new(maps::BACKENDS_MAX),
            backends6: MemTable::new(maps::BACKENDS6_MAX),
            rev_nat: MemTable::new(maps::REV_NAT_MAX),
            members: MemTable::new(maps::MEMBERS_MAX),
            maglev: MemTable::new(maps::MAGLEV_MAX),
            source_ranges: MemTable::new(maps::SOURCE_RANGES_MAX),
            source_ranges6: MemTable::new(maps::SOURCE_RANGES6_MAX),
            service_ports: MemTable::new(maps::SERVICE_PORTS_MAX),
            ports: vec![PortBits::default(); ports::PORT_WORDS as usize],
            conntrack: Vec::new(),
            conntrack6: Vec::new(),
            affinity: Vec::new(),
            torn: Vec::new(),
        };
        Self {
            state: Arc::new(Mutex::new(state)),
            writes: AtomicU64::new(0),
            backend_scans: AtomicU64::new(0),
        }
    }

    /// How often this handle read the whole backends array (in the kernel
    /// the slow read: an entry for every possible id).
    pub fn backend_scans(&self) -> u64 {
        self.backend_scans.load(Ordering::Relaxed)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets how many entries `table` takes: writes past it fail like a
    /// full kernel map's.
    pub fn set_max_entries(&self, table: Table, max_entries: usize) {
        *self.state().table_mut(table) = max_entries;
    }

    /// What a packet would have seen torn after a step of a flush so far:
    /// empty if every step kept every frontend whole.
    pub fn torn_views(&self) -> Vec<String> {
        self.state().torn.clone()
    }

    /// Entries in each Service map: services, slot chunks, backends,
    /// reverse NAT (each family's frontends and backends counted together).
    pub fn entries(&self) -> [usize; 4] {
        let state = self.state();
        [
            state.services.entries.len() + state.services6.entries.len(),
            state.slots.entries.len(),
            state.backends.entries.len() + state.backends6.entries.len(),
            state.rev_nat.entries.len(),
        ]
    }

    /// Puts entries into the maps directly, as an agent that died halfway
    /// through a sync may have left them.
    pub fn leave(&self, slots: &[(BackendSlotKey, u32)], backends: &[(u32, Backend)], rev_nats: &[(u32, RevNat)]) {
        let mut state = self.state();
        for (slot, id) in slots {
            let chunk = state
                .slots
                .entries
                .entry(slot.chunk_key())
                .or_insert_with(bytemuck::Zeroable::zeroed);
            chunk.ids[slot.index_in_chunk()] = *id;
        }
        state.backends.entries.extend(backends.iter().copied());
        state.rev_nat.entries.extend(rev_nats.iter().copied());
    }

    /// Puts Service port entries into the map directly (see [`Self::leave`]).
    pub fn leave_service_ports(&self, entries: &[(u32, FrontendPort)]) {
        self.state().service_ports.entries.extend(entries.iter().copied());
    }

    /// Adds tracked flows, as the programs would.
    pub fn track(&self, entries: &[(CtKey, CtValue)]) {
        self.state().conntrack.extend(entries.iter().copied());
    }

    /// Adds tracked IPv6 flows, as the programs would.
    pub fn track6(&self, entries: &[(CtKey6, CtValue6)]) {
        self.state().conntrack6.extend(entries.iter().copied());
    }

    /// Adds affinity entries, as the programs would.
    pub fn remember_clients(&self, entries: &[(AffinityKey, AffinityValue)]) {
        self.state().affinity.extend(entries.iter().copied());
    }

    /// Deletes one Maglev chunk, as an agent that died halfway through
    /// writing a table leaves it.
    #[cfg(test)]
    pub fn drop_maglev_chunk(&self, key: &MaglevKey) {
        self.state().maglev.entries.remove(key);
    }

    /// The affinity entries left.
    pub fn affinity_entries(&self) -> Vec<(AffinityKey, AffinityValue)> {
        self.state().affinity.clone()
    }

    /// Backend set members as (key, slot).
    pub fn members(&self) -> Vec<(MemberKey, u32)> {
        self.state().members.all()
    }
}

impl LbMaps for MemoryMaps {
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>> {
        Ok(self.state().services.all())
    }

    fn service(&self, key: &ServiceKey) -> Result<Option<ServiceValue>> {
        Ok(self.state().services.get(key))
    }

    fn services6(&self) -> Result<Vec<(Service6Key, ServiceValue)>> {
        Ok(self.state().services6.all())
    }

    fn service6(&self, key: &Service6Key) -> Result<Option<ServiceValue>> {
        Ok(self.state().services6.get(key))
    }

    fn slot_chunk_keys(&self) -> Result<Vec<SlotChunkKey>> {
        Ok(self.state().slots.keys())
    }

    fn slot_chunk(&self, key: &SlotChunkKey) -> Result<Option<SlotChunk>> {
        Ok(self.state().slots.get(key))
    }

    fn backends(&self) -> Result<Vec<(u32, Backend)>> {
        self.backend_scans.fetch_add(1, Ordering::Relaxed);
        Ok(self.state().backends.all())
    }

    fn backend(&self, id: u32) -> Result<Option<Backend>> {
        Ok(self.state().backends.get(&id))
    }

    fn backends6(&self) -> Result<Vec<(u32, Backend6)>> {
        Ok(self.state().backends6.all())
    }

    fn backend6(&self, id: u32) -> Result<Option<Backend6>> {
        Ok(self.state().backends6.get(&id))
    }

    fn rev_nat_ids(&self) -> Result<Vec<u32>> {
        Ok(self.state().rev_nat.keys())
    }

    fn member_keys(&self) -> Result<Vec<MemberKey>> {
        Ok(self.state().members.keys())
    }

    fn maglev_keys(&self) -> Result<Vec<MaglevKey>> {
        Ok(self.state().maglev.keys())
    }

    fn maglev_chunk(&self, key: &MaglevKey) -> Result<Option<MaglevChunk>> {
        Ok(self.state().maglev.get(key))
    }

    fn source_range_keys(&self) -> Result<Vec<SourceRangeKey>> {
        Ok(self.state().source_ranges.keys())
    }

    fn source_range6_keys(&self) -> Result<Vec<SourceRange6Key>> {
        Ok(self.state().source_ranges6.keys())
    }

    fn service_ports(&self) -> Result<Vec<(u32, FrontendPort)>> {
        Ok(self.state().service_ports.all())
    }

    fn forget_affinity(&self, affinity_ids: &BTreeSet<u32>) -> Result<u64> {
        let mut state = self.state();
        let before = state.affinity.len();
        state.affinity.retain(|(k, _)| !affinity_ids.contains(&k.affinity_id));
        Ok((before - state.affinity.len()) as u64)
    }

    fn write_step(&self, step: Step, staged: &SplitStaged) -> Result<()> {
        let mut state = self.state();
        let result = state.apply(step, staged);
        state.check_readers_view(step);
        self.writes.fetch_add(*result.as_ref().unwrap_or(&0), Ordering::Relaxed);
        result.map(drop)
    }

    fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    fn port_words(&self) -> Result<Vec<PortBits>> {
        Ok(self.state().ports.clone())
    }

    fn set_port_word(&self, index: u32, word: PortBits) -> Result<()> {
        match self.state().ports.get_mut(index as usize) {
            Some(slot) => *slot = word,
            None => bail!("port filter word {index} out of bounds"),
        }
        Ok(())
    }

    fn conntrack_entries(&self) -> Result<Vec<(CtKey, CtValue)>> {
        Ok(self.state().conntrack.clone())
    }

    fn conntrack6_entries(&self) -> Result<Vec<(CtKey6, CtValue6)>> {
        Ok(self.state().conntrack6.clone())
    }

    fn verdicts(&self) -> Result<Vec<(Verdict, VerdictCounter)>> {
        Ok(Verdict::ALL.iter().map(|v| (*v, VerdictCounter::default())).collect())
    }
}

/// [`MemoryMaps`] that fail on purpose: the `n`th write call (a flush
/// step or a port filter word) from when it was armed fails before it
/// writes anything, or a map is full at a chosen size.
pub struct FaultyMaps {
    inner: MemoryMaps,
    /// Write calls until the failure; 0: none armed.
    fail_in: AtomicU64,
}

impl FaultyMaps {
    pub fn new(inner: MemoryMaps) -> Self {
        Self {
            inner,
            fail_in: AtomicU64::new(0),
        }
    }

    /// Makes the `n`th write call from now fail (1: the next one), once.
    pub fn fail_nth_write(&self, n: u64) {
        self.fail_in.store(n, Ordering::Relaxed);
    }

    /// Makes `table` take `max_entries` at most, like a full kernel map
    /// (see [`MemoryMaps::set_max_entries`]).
    pub fn full_at(&self, table: Table, max_entries: usize) {
        self.inner.set_max_entries(table, max_entries);
    }

    /// Whether an armed failure is still to come.
    pub fn armed(&self) -> bool {
        self.fail_in.load(Ordering::Relaxed) > 0
    }

    /// The maps underneath.
    pub fn memory(&self) -> &MemoryMaps {
        &self.inner
    }

    /// Counts a write call down; an error if it is the one to fail.
    fn call(&self, what: &str) -> Result<()> {
        let armed = self
            .fail_in
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if armed == Ok(1) {
            bail!("injected failure: {what}");
        }
        Ok(())
    }
}

impl LbMaps for FaultyMaps {
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>> {
        self.inner.services()
    }

    fn service(&self, key: &ServiceKey) -> Result<Option<ServiceValue>> {
        self.inner.service(key)
    }

    fn services6(&self) -> Result<Vec<(Service6Key, ServiceValue)>> {
        self.inner.services6()
    }

    fn service6(&self, key: &Service6Key) -> Result<Option<ServiceValue>> {
        self.inner.service6(key)
    }

    fn slot_chunk_keys(&self) -> Result<Vec<SlotChunkKey>> {
        self.inner.slot_chunk_keys()
    }

    fn slot_chunk(&self, key: &SlotChunkKey) -> Result<Option<SlotChunk>> {
        self.inner.slot_chunk(key)
    }

    fn backends(&self) -> Result<Vec<(u32, Backend)>> {
        self.inner.backends()
    }

    fn backend(&self, id: u32) -> Result<Option<Backend>> {
        self.inner.backend(id)
    }

    fn backends6(&self) -> Result<Vec<(u32, Backend6)>> {
        self.inner.backends6()
    }

    fn backend6(&self, id: u32) -> Result<Option<Backend6>> {
        self.inner.backend6(id)
    }

    fn rev_nat_ids(&self) -> Result<Vec<u32>> {
        self.inner.rev_nat_ids()
    }

    fn member_keys(&self) -> Result<Vec<MemberKey>> {
        self.inner.member_keys()
    }

    fn maglev_keys(&self) -> Result<Vec<MaglevKey>> {
        self.inner.maglev_keys()
    }

    fn maglev_chunk(&self, key: &MaglevKey) -> Result<Option<MaglevChunk>> {
        self.inner.maglev_chunk(key)
    }

    fn source_range_keys(&self) -> Result<Vec<SourceRangeKey>> {
        self.inner.source_range_keys()
    }

    fn source_range6_keys(&self) -> Result<Vec<SourceRange6Key>> {
        self.inner.source_range6_keys()
    }

    fn service_ports(&self) -> Result<Vec<(u32, FrontendPort)>> {
        self.inner.service_ports()
    }

    fn forget_affinity(&self, affinity_ids: &BTreeSet<u32>) -> Result<u64> {
        self.inner.forget_affinity(affinity_ids)
    }

    fn write_step(&self, step: Step, staged: &SplitStaged) -> Result<()> {
        self.call(&step.to_string())?;
        self.inner.write_step(step, staged)
    }

    fn writes(&self) -> u64 {
        self.inner.writes()
    }

    fn port_words(&self) -> Result<Vec<PortBits>> {
        self.inner.port_words()
    }

    fn set_port_word(&self, index: u32, word: PortBits) -> Result<()> {
        self.call("writing the port filter")?;
        self.inner.set_port_word(index, word)
    }

    fn conntrack_entries(&self) -> Result<Vec<(CtKey, CtValue)>> {
        self.inner.conntrack_entries()
    }

    fn conntrack6_entries(&self) -> Result<Vec<(CtKey6, CtValue6)>> {
        self.inner.conntrack6_entries()
    }

    fn verdicts(&self) -> Result<Vec<(Verdict, VerdictCounter)>> {
        self.inner.verdicts()
    }
}
