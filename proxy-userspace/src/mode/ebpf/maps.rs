//! Writes the model into the pinned maps.
//!
//! This is the only code that writes the Service maps: the agent's ebpf mode
//! and the tests go through it. Writes are staged and reach the kernel in
//! batches ([`ServiceMaps::batch`]; every public write method is one batch
//! of its own unless called inside one), ordered so that a packet never
//! sees a half-programmed Service (`write_batch`'s `FLUSH_STAGES`):
//! - backends before the slots that name them, slots before the service
//!   entry that points at them (a whole new set under a fresh id);
//! - the service entry is swapped in one update (atomic for readers);
//! - removed service entries, then old slots, then unreferenced backends,
//!   are deleted last.
//!
//! A Service port is known by its ClusterIP frontend. On open, whatever an
//! earlier agent left in the pinned maps is read back as applied state
//! ("adopted"), so syncing the same Services again writes nothing, and
//! [`ServiceMaps::retain`] removes only what is no longer wanted. After a
//! failed batch nothing is assumed: the next one reads the maps back first.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap},
    net::Ipv4Addr,
    os::fd::{AsFd, BorrowedFd},
    path::Path,
};

use super::{
    port_filter::PortFilter,
    write_batch::{FLUSH_STAGES, Job, SPREAD_FROM, SplitStaged, Staged, Step, Table, Writer, run_stage},
};
use crate::{
    mode::EndpointSets,
    model::{Endpoint, ServicePort},
};
use anyhow::{Context, Result, bail};
use aya::maps::{HashMap, IterableMap, Map, MapData, PerCpuArray};
use proxy_common::{
    Backend, BackendSlotKey, CtKey, CtValue, RevNat, ServiceKey, ServiceValue, Verdict, VerdictCounter,
    backend::FLAG_LOCAL,
    maps,
    service::{FLAG_EXTERNAL_LOCAL, FLAG_INTERNAL_LOCAL, FLAG_NEEDS_SNAT, FLAG_NODE_PORT, FLAGS_LOCAL},
};

/// What was written for one Service port, to diff the next write against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Applied {
    /// Frontend key -> the service entry written for it.
    frontends: BTreeMap<ServiceKeyOrd, ServiceValue>,
    backend_set: u32,
    /// Backend ids in slot order.
    backends: Vec<u32>,
}

/// `ServiceKey` ordered by its bytes, for deterministic iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ServiceKeyOrd([u8; 8]);

impl From<ServiceKey> for ServiceKeyOrd {
    fn from(k: ServiceKey) -> Self {
        Self(bytemuck::cast(k))
    }
}
impl From<ServiceKeyOrd> for ServiceKey {
    fn from(k: ServiceKeyOrd) -> Self {
        bytemuck::cast(k.0)
    }
}

/// Handles to the pinned maps plus the ids handed out so far.
pub struct ServiceMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    slots: HashMap<MapData, BackendSlotKey, u32>,
    backends: HashMap<MapData, u32, Backend>,
    rev_nat: HashMap<MapData, u32, RevNat>,
    conntrack: HashMap<MapData, CtKey, CtValue>,
    stats: PerCpuArray<MapData, VerdictCounter>,
    /// Ports of every frontend and backend written (see `port_filter`).
    port_filter: PortFilter,
    node_ips: Vec<Ipv4Addr>,
    /// Endpoints on this node (by their nodeName) are local backends; if
    /// `None`, or an endpoint names no node, it is taken to be local (for
    /// the SNAT decision only: the `Local` traffic policies reach only
    /// endpoints that name this node, see [`EndpointSets`]).
    node_name: Option<String>,
    /// kube-proxy's masqueradeAll: every frontend asks for SNAT.
    masquerade_all: bool,
    /// By ClusterIP frontend.
    applied: BTreeMap<ServiceKeyOrd, Applied>,
    /// Service port name -> ClusterIP frontend, for ports synced by name.
    names: BTreeMap<String, ServiceKeyOrd>,
    /// (ip, port, proto) -> (backend id, number of Service ports using it).
    /// foldhash, not SipHash: a full sync at 10,000 x 10 endpoints looks up
    /// and inserts 100,000 of each, and SipHash was 8% of it; the keys are
    /// addresses from the API server, not from packets.
    backend_refs: foldhash::HashMap<(Ipv4Addr, u16, u8), (u32, u32)>,
    /// backend id -> (ip, port, proto), the reverse of `backend_refs`.
    backend_addrs: foldhash::HashMap<u32, (Ipv4Addr, u16, u8)>,
    backend_ids: IdAllocator,
    set_ids: IdAllocator,
    rev_nat_ids: IdAllocator,
    /// Entries found in the maps that no adopted Service port references
    /// (left by an agent that died halfway through a sync, or by a failed
    /// batch): [`Self::retain`] deletes them.
    leftovers: Leftovers,
    /// Writes of the batch under way, not in the kernel yet.
    staged: Staged,
    /// Inside [`Self::batch`]: writes wait for its end.
    batching: bool,
    /// A batch failed: the bookkeeping above may not match the maps.
    must_read_back: bool,
    writer: Writer,
}

/// The per-CPU verdict counters of `stats`, summed, every verdict listed
/// (one a map pinned by an older agent does not know counts 0).
pub fn sum_verdicts(stats: &PerCpuArray<MapData, VerdictCounter>) -> Result<Vec<(Verdict, VerdictCounter)>> {
    let mut out = Vec::with_capacity(Verdict::ALL.len());
    for verdict in Verdict::ALL {
        let per_cpu = match stats.get(&(verdict as u32), 0) {
            Ok(per_cpu) => per_cpu,
            Err(aya::maps::MapError::OutOfBounds { .. }) => {
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

/// The map pinned as `name` under `pin_path`.
pub(super) fn pinned(pin_path: &Path, name: &str) -> Result<Map> {
    let path = pin_path.join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
    Ok(Map::from_map_data(data)?)
}

/// The hash map pinned as `name` under `pin_path`.
pub(super) fn open<K: aya::Pod, V: aya::Pod>(pin_path: &Path, name: &str) -> Result<HashMap<MapData, K, V>> {
    HashMap::try_from(pinned(pin_path, name)?).with_context(|| format!("map {name} has an unexpected layout"))
}

impl ServiceMaps {
    /// Opens the maps pinned under `pin_path` (created by [`super::Datapath::load`]).
    /// `node_ips` are the addresses NodePort frontends are programmed on.
    pub fn open(pin_path: &Path, node_ips: Vec<Ipv4Addr>) -> Result<Self> {
        let stats_path = pin_path.join(maps::STATS);
        let stats_data =
            MapData::from_pin(&stats_path).with_context(|| format!("opening pinned map {}", stats_path.display()))?;
        let mut this = Self {
            services: open(pin_path, maps::SERVICES)?,
            slots: open(pin_path, maps::BACKEND_SLOTS)?,
            backends: open(pin_path, maps::BACKENDS)?,
            rev_nat: open(pin_path, maps::REV_NAT)?,
            conntrack: open(pin_path, maps::CONNTRACK)?,
            stats: PerCpuArray::try_from(Map::from_map_data(stats_data)?)?,
            port_filter: PortFilter::open(pin_path)?,
            node_ips,
            node_name: None,
            masquerade_all: false,
            applied: BTreeMap::new(),
            names: BTreeMap::new(),
            backend_refs: foldhash::HashMap::default(),
            backend_addrs: foldhash::HashMap::default(),
            backend_ids: IdAllocator::default(),
            set_ids: IdAllocator::default(),
            rev_nat_ids: IdAllocator::default(),
            leftovers: Leftovers::default(),
            staged: Staged::default(),
            batching: false,
            must_read_back: false,
            writer: Writer::default(),
        };
        this.read_back()?;
        Ok(this)
    }

    /// Rebuilds the bookkeeping from the maps: the ids in use, the adopted
    /// Service ports and the leftovers. Port names and where the id
    /// allocators got to are kept.
    fn read_back(&mut self) -> Result<()> {
        self.applied.clear();
        self.backend_refs.clear();
        self.backend_addrs.clear();
        for ids in [&mut self.backend_ids, &mut self.set_ids, &mut self.rev_nat_ids] {
            ids.forget_used();
        }
        let found = self.reserve_ids_in_use()?;
        self.adopt()?;
        self.leftovers = self.unreferenced(found);
        Ok(())
    }

    /// Reads the frontends in the maps back into `applied`, grouped by the
    /// backend set they share. A group whose slots or backends are missing
    /// is adopted without a set, so the next sync writes it afresh.
    fn adopt(&mut self) -> Result<()> {
        let mut groups: BTreeMap<u32, Vec<(ServiceKey, ServiceValue)>> = BTreeMap::new();
        for entry in self.services.iter() {
            let (key, value) = entry?;
            groups.entry(value.backend_set).or_default().push((key, value));
        }
        for (set, members) in groups {
            let (cluster_key, _) = *members
                .iter()
                .find(|(_, v)| v.flags & FLAG_NODE_PORT == 0)
                .unwrap_or(&members[0]);
            // The frontends use runs of one set: it ends where the last run does.
            let len = members
                .iter()
                .map(|(_, v)| v.backend_offset.saturating_add(v.backend_count))
                .max()
                .unwrap_or(0);
            let backends = self.adopt_backend_set(set, len);
            let frontends = members.iter().map(|(k, v)| (ServiceKeyOrd::from(*k), *v)).collect();
            let (backend_set, backends) = match backends {
                Some(ids) => (set, ids),
                None => (0, Vec::new()),
            };
            self.applied.insert(
                cluster_key.into(),
                Applied {
                    frontends,
                    backend_set,
                    backends,
                },
            );
        }
        Ok(())
    }

    /// The backend ids in a pinned set, taking a reference on each; `None`
    /// (and no reference taken) if the set is incomplete.
    fn adopt_backend_set(&mut self, set: u32, count: u32) -> Option<Vec<u32>> {
        let mut members = Vec::new();
        for slot in 0..count {
            let id = self.slots.get(&BackendSlotKey { backend_set: set, slot }, 0).ok()?;
            let backend = self.backends.get(&id, 0).ok()?;
            members.push((id, (backend.addr(), backend.port(), backend.proto)));
        }
        // The same address under two ids: let the next sync rewrite it.
        let aliased = |(id, addr): &(u32, _)| self.backend_refs.get(addr).is_some_and(|(held, _)| held != id);
        if members.iter().any(aliased) {
            return None;
        }
        for (id, addr) in &members {
            self.backend_refs.entry(*addr).or_insert((*id, 0)).1 += 1;
            self.backend_addrs.insert(*id, *addr);
        }
        Some(members.into_iter().map(|(id, _)| id).collect())
    }

    /// Sets which endpoints are local (see the field) and masqueradeAll.
    pub fn set_topology(&mut self, node_name: Option<String>, masquerade_all: bool) {
        self.node_name = node_name;
        self.masquerade_all = masquerade_all;
    }

    fn is_local(&self, ep: &crate::model::Endpoint) -> bool {
        match (&self.node_name, &ep.node_name) {
            (Some(ours), Some(theirs)) => ours.as_str() == &**theirs,
            _ => true,
        }
    }

    /// Ids already present in the maps (left by an earlier agent) are never
    /// handed out again, so a new write cannot alias an entry still in use.
    /// Returns the keys found.
    fn reserve_ids_in_use(&mut self) -> Result<Leftovers> {
        let mut found = Leftovers::default();
        for id in self.backends.keys() {
            let id = id?;
            self.backend_ids.reserve(id);
            found.backends.push(id);
        }
        for id in self.rev_nat.keys() {
            let id = id?;
            self.rev_nat_ids.reserve(id);
            found.rev_nats.push(id);
        }
        for key in self.slots.keys() {
            let key = key?;
            self.set_ids.reserve(key.backend_set);
            found.slots.push(key);
        }
        Ok(found)
    }

    /// The part of `found` that no adopted Service port references.
    fn unreferenced(&self, mut found: Leftovers) -> Leftovers {
        let sets: BTreeSet<u32> = self.applied.values().map(|a| a.backend_set).collect();
        let rev_nats: BTreeSet<u32> = self
            .applied
            .values()
            .flat_map(|a| a.frontends.values().map(|v| v.rev_nat_id))
            .collect();
        found.slots.retain(|k| !sets.contains(&k.backend_set));
        found.backends.retain(|id| !self.backend_addrs.contains_key(id));
        found.rev_nats.retain(|id| !rev_nats.contains(id));
        found
    }

    /// Runs `f` (calls of this handle's write methods) and writes what it
    /// staged in one go: one batch call per map and chunk of entries, in
    /// `FLUSH_STAGES`. What `f` staged before failing is written all the
    /// same; after any failure the next batch reads the maps back first.
    /// Inside a batch, a nested one is part of it.
    pub fn batch<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.batching {
            let result = f(self);
            self.must_read_back |= result.is_err();
            return result;
        }
        if self.must_read_back {
            self.read_back().context("reading the maps back after a failed write")?;
            self.must_read_back = false;
        }
        self.batching = true;
        let result = f(self);
        self.batching = false;
        let flushed = self.flush();
        self.must_read_back = result.is_err() || flushed.is_err();
        let value = result?;
        flushed?;
        Ok(value)
    }

    /// Programs one Service port: its frontends (ClusterIP, and every node IP
    /// with the node port) and its backend set, laid out for its traffic
    /// policies (`SlotLayout`). Writes nothing if it is already programmed
    /// as asked.
    pub fn sync_service(&mut self, svc: &ServicePort) -> Result<()> {
        self.batch(|this| this.stage_service(svc))
    }

    fn stage_service(&mut self, svc: &ServicePort) -> Result<()> {
        let proto = svc.protocol.number();
        let id = ServiceKeyOrd::from(ServiceKey::new(svc.cluster_ip, svc.port, proto));
        if let Some(previous) = self.names.insert(svc.name.clone(), id)
            && previous != id
        {
            self.remove_by_key(previous)?;
        }
        let old = self.applied.get(&id).cloned().unwrap_or_default();

        let sets = EndpointSets::of(svc, self.node_name.as_deref());
        let layout = SlotLayout::of(&sets)?;
        let mut backends = Vec::with_capacity(layout.slots.len());
        for ep in &layout.slots {
            let local = self.is_local(ep);
            backends.push(self.acquire_backend(ep.addr, ep.port, proto, local)?);
        }
        let backend_set = if backends == old.backends && old.backend_set != 0 {
            old.backend_set
        } else {
            self.write_backend_set(&backends)?
        };

        let ports = self.frontends_of(svc).into_iter().map(|(key, _)| key.port());
        self.port_filter.allow(ports, layout.slots.iter().map(|ep| ep.port))?;
        let mut frontends = BTreeMap::new();
        for (key, is_node_port) in self.frontends_of(svc) {
            let ord = ServiceKeyOrd::from(key);
            let written = old.frontends.get(&ord);
            let rev_nat_id = match written {
                Some(value) => value.rev_nat_id,
                None => self.new_rev_nat(key)?,
            };
            let (backend_offset, backend_count, flags) = self.frontend_use(svc, &sets, &layout, is_node_port);
            let value = ServiceValue {
                backend_set,
                backend_count,
                rev_nat_id,
                flags,
                affinity_timeout_s: 0,
                backend_offset,
            };
            // The bookkeeping, not a read of the map: it matches the map
            // (read back after any failure), and a read per frontend costs.
            if written != Some(&value) {
                self.staged.services.write(key, value);
            }
            frontends.insert(ord, value);
        }

        // Everything below removes what the new state no longer references.
        for (ord, value) in &old.frontends {
            if !frontends.contains_key(ord) {
                self.remove_frontend((*ord).into(), value.rev_nat_id);
            }
        }
        if old.backend_set != 0 && old.backend_set != backend_set {
            self.delete_backend_set(old.backend_set, old.backends.len());
        }
        for id in &old.backends {
            self.release_backend(*id)?;
        }
        self.applied.insert(
            id,
            Applied {
                frontends,
                backend_set,
                backends,
            },
        );
        Ok(())
    }

    /// `(offset, count, flags)` of a frontend of `svc`: the run of slots its
    /// traffic policy picks from, and how the programs treat it.
    fn frontend_use(
        &self,
        svc: &ServicePort,
        sets: &EndpointSets<'_>,
        layout: &SlotLayout<'_>,
        is_node_port: bool,
    ) -> (u32, u32, u32) {
        let (local_policy, kind, local_flag) = if is_node_port {
            (svc.external_local(), FLAG_NODE_PORT, FLAG_EXTERNAL_LOCAL)
        } else {
            (svc.internal_local(), 0, FLAG_INTERNAL_LOCAL)
        };
        let (offset, count) = if local_policy { layout.local } else { layout.cluster };
        let mut flags = kind;
        // A Service without any endpoint is rejected, whatever its policies.
        if local_policy && sets.has_any() {
            flags |= local_flag;
        }
        // masqueradeAll, like kube-proxy's, leaves the client's address to
        // the Local external policy.
        if self.masquerade_all && !(is_node_port && local_policy) {
            flags |= FLAG_NEEDS_SNAT;
        }
        (offset, count, flags)
    }

    /// Removes a Service port programmed by [`Self::sync_service`].
    pub fn remove_service(&mut self, name: &str) -> Result<()> {
        self.batch(|this| match this.names.remove(name) {
            Some(id) => this.remove_by_key(id),
            None => Ok(()),
        })
    }

    /// Removes a Service port by its frontend, whoever programmed it.
    pub fn remove_port(&mut self, port: &ServicePort) -> Result<()> {
        let id = ServiceKeyOrd::from(ServiceKey::new(port.cluster_ip, port.port, port.protocol.number()));
        self.batch(|this| {
            if this.names.get(&port.name) == Some(&id) {
                this.names.remove(&port.name);
            }
            this.remove_by_key(id)
        })
    }

    /// Removes every Service port not in `keep` (adopted ones included), then
    /// whatever the maps held at open (or after a failed write) that no
    /// Service port references.
    pub fn retain(&mut self, keep: &[&ServicePort]) -> Result<()> {
        let keep: BTreeSet<ServiceKeyOrd> = keep
            .iter()
            .map(|p| ServiceKey::new(p.cluster_ip, p.port, p.protocol.number()).into())
            .collect();
        self.batch(|this| {
            let stale: Vec<ServiceKeyOrd> = this.applied.keys().filter(|k| !keep.contains(k)).copied().collect();
            for id in stale {
                this.remove_by_key(id)?;
            }
            this.names.retain(|_, id| keep.contains(id));
            this.remove_leftovers();
            Ok(())
        })
    }

    /// Deletes the leftovers found when the maps were read back. Their ids
    /// were reserved then, so nothing written since can be among them.
    fn remove_leftovers(&mut self) {
        let leftovers = std::mem::take(&mut self.leftovers);
        for key in leftovers.slots {
            self.staged.slots.delete(key);
            self.set_ids.release(key.backend_set);
        }
        for id in leftovers.backends {
            self.staged.backends.delete(id);
            self.backend_ids.release(id);
        }
        for id in leftovers.rev_nats {
            self.staged.rev_nat.delete(id);
            self.rev_nat_ids.release(id);
        }
    }

    fn remove_by_key(&mut self, id: ServiceKeyOrd) -> Result<()> {
        let Some(old) = self.applied.remove(&id) else {
            return Ok(());
        };
        for (ord, value) in &old.frontends {
            self.remove_frontend((*ord).into(), value.rev_nat_id);
        }
        if old.backend_set != 0 {
            self.delete_backend_set(old.backend_set, old.backends.len());
        }
        for id in &old.backends {
            self.release_backend(*id)?;
        }
        Ok(())
    }

    /// Writes everything staged, stage after stage of [`FLUSH_STAGES`]. On
    /// failure the rest is dropped (the caller reads the maps back).
    fn flush(&mut self) -> Result<()> {
        let staged = std::mem::take(&mut self.staged).split();
        for stage in FLUSH_STAGES {
            let jobs = (stage.iter().copied())
                .filter(|step| staged.entries_of(*step) > 0)
                .map(|step| (step, self.job(step, &staged)))
                .collect();
            run_stage(jobs, staged.entries(stage) >= SPREAD_FROM)?;
        }
        Ok(())
    }

    /// What `step` writes of `staged`, ready to run on any thread.
    fn job<'a>(&'a self, step: Step, staged: &'a SplitStaged) -> Job<'a> {
        let writer = &self.writer;
        match step {
            Step::Write(Table::Backends) => writer.write_job(fd_of(&self.backends), &staged.backends),
            Step::Write(Table::Slots) => writer.write_job(fd_of(&self.slots), &staged.slots),
            Step::Write(Table::RevNat) => writer.write_job(fd_of(&self.rev_nat), &staged.rev_nat),
            Step::Write(Table::Services) => writer.write_job(fd_of(&self.services), &staged.services),
            Step::Delete(Table::Backends) => writer.delete_job(fd_of(&self.backends), &staged.backends),
            Step::Delete(Table::Slots) => writer.delete_job(fd_of(&self.slots), &staged.slots),
            Step::Delete(Table::RevNat) => writer.delete_job(fd_of(&self.rev_nat), &staged.rev_nat),
            Step::Delete(Table::Services) => writer.delete_job(fd_of(&self.services), &staged.services),
        }
    }

    /// Names of the Service ports programmed through this handle.
    pub fn service_names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// Map entries written and deleted through this handle so far (a sync
    /// that finds everything in place adds none; batch calls count their
    /// entries).
    pub fn writes(&self) -> u64 {
        self.writer.writes()
    }

    /// Number of Service ports in the maps, adopted ones included.
    pub fn service_port_count(&self) -> usize {
        self.applied.len()
    }

    /// Sums the per-CPU verdict counters.
    pub fn verdict_counts(&self) -> Result<Vec<(Verdict, VerdictCounter)>> {
        sum_verdicts(&self.stats)
    }

    /// Tracked flows as (key, value), forward and reply entries alike.
    pub fn conntrack_entries(&self) -> Result<Vec<(CtKey, CtValue)>> {
        Ok(self.conntrack.iter().collect::<Result<_, _>>()?)
    }

    /// Everything the programs would use now, read from the maps (not from
    /// this handle's bookkeeping), with tracked flows counted per backend.
    pub fn snapshot(&self) -> Result<crate::dump::Snapshot> {
        use crate::dump::{BackendRow, FrontendRow, Snapshot};
        let mut flows: StdHashMap<(u32, u32), u64> = StdHashMap::new();
        let mut states: std::collections::BTreeMap<u8, u64> = std::collections::BTreeMap::new();
        let (mut forward, mut reply) = (0, 0);
        for entry in self.conntrack.iter() {
            let (_, ct) = entry?;
            if ct.flags & proxy_common::conntrack::FLAG_REPLY != 0 {
                reply += 1;
            } else {
                forward += 1;
                *flows.entry((ct.rev_nat_id, ct.backend_id)).or_default() += 1;
                *states.entry(ct.state).or_default() += 1;
            }
        }
        let mut frontends = Vec::new();
        for entry in self.services.iter() {
            let (key, value) = entry?;
            let mut backends = Vec::new();
            for slot in run(&value) {
                let slot_key = BackendSlotKey {
                    backend_set: value.backend_set,
                    slot,
                };
                let row = match self
                    .slots
                    .get(&slot_key, 0)
                    .ok()
                    .and_then(|id| Some((id, self.backends.get(&id, 0).ok()?)))
                {
                    Some((id, b)) => BackendRow {
                        addr: Some((b.addr(), b.port())),
                        flows: flows.get(&(value.rev_nat_id, id)).copied().unwrap_or(0),
                    },
                    None => BackendRow { addr: None, flows: 0 },
                };
                backends.push(row);
            }
            frontends.push(FrontendRow {
                proto: key.proto,
                addr: key.addr(),
                port: key.port(),
                node_port: value.flags & FLAG_NODE_PORT != 0,
                local_only: value.flags & FLAGS_LOCAL != 0,
                backends,
            });
        }
        frontends.sort_by_key(|f| (f.proto, f.addr, f.port));
        Ok(Snapshot {
            frontends,
            forward_flows: forward,
            reply_flows: reply,
            flow_states: states.into_iter().collect(),
            table: None,
            verdicts: self.verdict_counts()?,
        })
    }

    /// Reads one frontend back, as the programs see it.
    pub fn frontend(&self, addr: Ipv4Addr, port: u16, proto: u8) -> Option<ServiceValue> {
        self.services.get(&ServiceKey::new(addr, port, proto), 0).ok()
    }

    /// Reads the backends a frontend picks from back, in slot order.
    pub fn backend_set(&self, value: &ServiceValue) -> Result<Vec<Backend>> {
        run(value)
            .map(|slot| {
                let id = self.slots.get(
                    &BackendSlotKey {
                        backend_set: value.backend_set,
                        slot,
                    },
                    0,
                )?;
                Ok(self.backends.get(&id, 0)?)
            })
            .collect()
    }

    fn frontends_of(&self, svc: &ServicePort) -> Vec<(ServiceKey, bool)> {
        let proto = svc.protocol.number();
        let mut out = vec![(ServiceKey::new(svc.cluster_ip, svc.port, proto), false)];
        if let Some(node_port) = svc.node_port {
            out.extend(
                self.node_ips
                    .iter()
                    .map(|ip| (ServiceKey::new(*ip, node_port, proto), true)),
            );
        }
        out
    }

    fn write_backend_set(&mut self, backends: &[u32]) -> Result<u32> {
        let set = self.set_ids.allocate()?;
        for (slot, id) in (0u32..).zip(backends) {
            self.staged.slots.write(BackendSlotKey { backend_set: set, slot }, *id);
        }
        Ok(set)
    }

    fn delete_backend_set(&mut self, set: u32, len: usize) {
        for slot in (0u32..).take(len) {
            self.staged.slots.delete(BackendSlotKey { backend_set: set, slot });
        }
        self.set_ids.release(set);
    }

    fn new_rev_nat(&mut self, key: ServiceKey) -> Result<u32> {
        let id = self.rev_nat_ids.allocate()?;
        let value = RevNat {
            addr_be: key.addr_be,
            port_be: key.port_be,
            _pad: 0,
        };
        self.staged.rev_nat.write(id, value);
        Ok(id)
    }

    fn remove_frontend(&mut self, key: ServiceKey, rev_nat_id: u32) {
        self.staged.services.delete(key);
        self.staged.rev_nat.delete(rev_nat_id);
        self.rev_nat_ids.release(rev_nat_id);
    }

    fn acquire_backend(&mut self, addr: Ipv4Addr, port: u16, proto: u8, local: bool) -> Result<u32> {
        if let Some((id, refs)) = self.backend_refs.get_mut(&(addr, port, proto)) {
            *refs += 1;
            return Ok(*id);
        }
        let id = self.backend_ids.allocate()?;
        let backend = Backend {
            flags: if local { FLAG_LOCAL } else { 0 },
            ..Backend::new(addr, port, proto)
        };
        self.staged.backends.write(id, backend);
        self.backend_refs.insert((addr, port, proto), (id, 1));
        self.backend_addrs.insert(id, (addr, port, proto));
        Ok(id)
    }

    fn release_backend(&mut self, id: u32) -> Result<()> {
        let Some(&addr_key) = self.backend_addrs.get(&id) else {
            bail!("backend id {id} released but not held");
        };
        let Some(entry) = self.backend_refs.get_mut(&addr_key) else {
            bail!("backend id {id} has no reference count");
        };
        entry.1 -= 1;
        if entry.1 == 0 {
            self.backend_refs.remove(&addr_key);
            self.backend_addrs.remove(&id);
            self.staged.backends.delete(id);
            self.backend_ids.release(id);
        }
        Ok(())
    }
}

/// The slots a frontend picks from.
fn run(value: &ServiceValue) -> std::ops::Range<u32> {
    value.backend_offset..value.backend_offset.saturating_add(value.backend_count)
}

/// The endpoints of a Service port's backend set in slot order, and the run
/// of slots each traffic policy uses. This node's endpoints come first, so
/// that `Local` frontends use slots `0..local`; the `Cluster` run is
/// `0..all` when it includes them (they are ready, or nothing is ready
/// anywhere), else it follows them (only terminating endpoints are here,
/// ready ones elsewhere). A port with both policies `Cluster` gets its
/// usable endpoints in order, as before the policies existed.
struct SlotLayout<'a> {
    slots: Vec<&'a Endpoint>,
    /// `(offset, count)` of the `Cluster` run.
    cluster: (u32, u32),
    /// `(offset, count)` of the `Local` run.
    local: (u32, u32),
}

impl<'a> SlotLayout<'a> {
    fn of(sets: &EndpointSets<'a>) -> Result<Self> {
        let cluster: &[&Endpoint] = if sets.uses_cluster() { &sets.cluster } else { &[] };
        let local: &[&Endpoint] = if sets.uses_local() { &sets.local } else { &[] };
        let same = |a: &&Endpoint, b: &&Endpoint| (a.addr, a.port) == (b.addr, b.port);
        let in_cluster = |ep: &&Endpoint| cluster.iter().any(|c| same(c, ep));
        let mut slots: Vec<&Endpoint> = local.to_vec();
        let cluster_offset = if cluster.is_empty() || local.iter().all(in_cluster) {
            slots.extend(cluster.iter().filter(|c| !local.iter().any(|l| same(l, c))));
            0
        } else {
            slots.extend(cluster);
            local.len()
        };
        let count = |n: usize| u32::try_from(n).context("too many endpoints");
        Ok(Self {
            cluster: (count(cluster_offset)?, count(cluster.len())?),
            local: (0, count(local.len())?),
            slots,
        })
    }
}

/// Hands out map ids (backends, backend sets, reverse NAT entries).
///
/// Ids move forward and wrap only after 2^32 - 1 of them: a freed id is not
/// handed out again soon, because conntrack entries of old flows may still
/// name it, and such a flow must not land on whatever got the id next.
#[derive(Clone, Debug, Default)]
struct IdAllocator {
    used: BTreeSet<u32>,
    /// The next candidate (0 is never an id).
    next: u32,
}

impl IdAllocator {
    /// Marks an id found in the maps as taken; allocation continues after
    /// the highest one seen.
    fn reserve(&mut self, id: u32) {
        self.used.insert(id);
        self.next = self.next.max(id.wrapping_add(1));
    }

    fn allocate(&mut self) -> Result<u32> {
        if self.used.len() >= u32::MAX as usize {
            bail!("id space exhausted");
        }
        loop {
            let id = self.next.max(1);
            self.next = id.wrapping_add(1);
            if self.used.insert(id) {
                return Ok(id);
            }
        }
    }

    fn release(&mut self, id: u32) {
        self.used.remove(&id);
    }

    /// Forgets which ids are taken (before reading the maps back), but not
    /// where allocation got to: freed ids stay out of reach.
    fn forget_used(&mut self) {
        self.used.clear();
    }
}

/// Keys found in the maps, by map.
#[derive(Debug, Default)]
struct Leftovers {
    slots: Vec<BackendSlotKey>,
    backends: Vec<u32>,
    rev_nats: Vec<u32>,
}

pub(super) fn fd_of<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>) -> BorrowedFd<'_> {
    IterableMap::map(map).fd().as_fd()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mode::usable_endpoints;

    #[test]
    fn freed_ids_are_not_handed_out_again_soon() {
        let mut ids = IdAllocator::default();
        assert_eq!(ids.allocate().unwrap(), 1);
        assert_eq!(ids.allocate().unwrap(), 2);
        ids.release(1);
        assert_eq!(ids.allocate().unwrap(), 3, "a freed id may still be named by old flows");
    }

    #[test]
    fn ids_found_in_the_maps_are_skipped_and_allocation_wraps_past_them() {
        let mut ids = IdAllocator::default();
        ids.reserve(7);
        assert_eq!(ids.allocate().unwrap(), 8);
        let mut ids = IdAllocator {
            next: u32::MAX,
            ..Default::default()
        };
        ids.reserve(1);
        assert_eq!(ids.allocate().unwrap(), u32::MAX);
        assert_eq!(ids.allocate().unwrap(), 2, "wraps to the smallest free id, never 0");
    }

    #[test]
    fn terminating_endpoints_serve_only_when_none_is_ready() {
        let ip = Ipv4Addr::new(10, 0, 0, 1);
        let mut draining = Endpoint::ready(ip, 80);
        draining.ready = false;
        draining.terminating = true;
        let ready = Endpoint::ready(Ipv4Addr::new(10, 0, 0, 2), 80);
        assert_eq!(usable_endpoints(&[draining.clone(), ready.clone()]), vec![&ready]);
        assert_eq!(usable_endpoints(std::slice::from_ref(&draining)), vec![&draining]);
    }

    fn on(node: &str, last: u8, ready: bool) -> Endpoint {
        Endpoint {
            ready,
            terminating: !ready,
            node_name: Some(node.into()),
            ..Endpoint::ready(Ipv4Addr::new(10, 244, 0, last), 80)
        }
    }

    fn layout_of(port: &ServicePort, node: &str) -> (Vec<u8>, (u32, u32), (u32, u32)) {
        let sets = EndpointSets::of(port, Some(node));
        let layout = SlotLayout::of(&sets).expect("layout");
        let slots = layout.slots.iter().map(|e| e.addr.octets()[3]).collect();
        (slots, layout.cluster, layout.local)
    }

    /// The set holds this node's endpoints first; `Cluster` frontends use
    /// all of it, `Local` ones the first run; a port without `Local` policy
    /// keeps its endpoints' order.
    #[test]
    fn slot_layout_puts_local_endpoints_first() {
        let endpoints = vec![on("b", 1, true), on("a", 2, true), on("b", 3, true), on("a", 4, true)];
        let cluster = ServicePort {
            node_port: Some(30000),
            endpoints,
            ..ServicePort::default()
        };
        assert_eq!(layout_of(&cluster, "a"), (vec![1, 2, 3, 4], (0, 4), (0, 0)));
        let local = ServicePort {
            external_policy: crate::model::TrafficPolicy::Local,
            ..cluster.clone()
        };
        assert_eq!(layout_of(&local, "a"), (vec![2, 4, 1, 3], (0, 4), (0, 2)));
        assert_eq!(layout_of(&local, "c"), (vec![1, 2, 3, 4], (0, 4), (0, 0)));
    }

    /// A node whose only endpoint is draining while others are ready
    /// elsewhere: the `Local` run is that endpoint, the `Cluster` run the
    /// ready ones after it.
    #[test]
    fn slot_layout_with_a_draining_local_endpoint() {
        let port = ServicePort {
            node_port: Some(30000),
            endpoints: vec![on("b", 1, true), on("a", 2, false), on("b", 3, true)],
            external_policy: crate::model::TrafficPolicy::Local,
            ..ServicePort::default()
        };
        assert_eq!(layout_of(&port, "a"), (vec![2, 1, 3], (1, 2), (0, 1)));
        let internal_only = ServicePort {
            node_port: None,
            external_policy: crate::model::TrafficPolicy::Cluster,
            internal_policy: crate::model::TrafficPolicy::Local,
            ..port
        };
        assert_eq!(layout_of(&internal_only, "a"), (vec![2], (0, 0), (0, 1)));
    }

    /// CPU time of this process (the flush's threads included), in ms: wall
    /// time means little on a busy machine.
    fn process_cpu_ms() -> f64 {
        // SAFETY: an all-zero rusage is a valid value of the plain C struct.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: getrusage only writes into the struct passed.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
        ms(usage.ru_utime) + ms(usage.ru_stime)
    }

    /// The first full sync of 10,000 Service ports x 10 endpoints (a quarter
    /// with a node port) on fresh maps, timed. Needs root and bpffs:
    /// `cargo test --release -p proxy-userspace --lib -- --ignored full_sync_at_scale --nocapture`.
    #[test]
    #[ignore = "a measurement; needs root, bpffs and the eBPF object"]
    fn full_sync_at_scale() {
        let pin = std::path::PathBuf::from(format!("/sys/fs/bpf/xproxy-maps-scale-{}", std::process::id()));
        let result = (|| -> Result<()> {
            let _datapath = super::super::Datapath::load(&pin)?;
            let mut maps = ServiceMaps::open(&pin, vec![Ipv4Addr::new(192, 0, 2, 1)])?;
            let ports: Vec<ServicePort> = (0..10_000u32)
                .map(|i| ServicePort {
                    name: format!("ns/svc-{i}:http"),
                    cluster_ip: Ipv4Addr::from(0x0a60_0000 + i),
                    port: 80,
                    node_port: (i % 4 == 0).then(|| 30000 + (i / 4) as u16),
                    endpoints: (0..10)
                        .map(|e| Endpoint::ready(Ipv4Addr::from(0x0af4_0000 + i * 16 + e), 8080))
                        .collect(),
                    ..ServicePort::default()
                })
                .collect();
            let refs: Vec<&ServicePort> = ports.iter().collect();
            let (started, cpu) = (std::time::Instant::now(), process_cpu_ms());
            maps.batch(|m| {
                m.retain(&refs)?;
                refs.iter().try_for_each(|p| m.sync_service(p))
            })?;
            eprintln!(
                "full sync of {} ports: {:.1} ms wall, {:.1} ms cpu, {} entries written",
                ports.len(),
                started.elapsed().as_secs_f64() * 1e3,
                process_cpu_ms() - cpu,
                maps.writes()
            );
            let again = maps.writes();
            maps.batch(|m| refs.iter().try_for_each(|p| m.sync_service(p)))?;
            assert_eq!(maps.writes(), again, "a second sync writes nothing");
            // What a failed batch leads to: the maps read back match the bookkeeping.
            maps.must_read_back = true;
            maps.batch(|m| refs.iter().try_for_each(|p| m.sync_service(p)))?;
            assert_eq!(maps.writes(), again, "a sync after reading back writes nothing");
            assert!(maps.leftovers.backends.is_empty() && maps.leftovers.slots.is_empty());

            // Entries per port: a service and a reverse NAT entry per frontend, 10 backends, 10 slots.
            let entries = |ports: &[&ServicePort]| -> usize {
                ports
                    .iter()
                    .map(|p| 2 * (1 + usize::from(p.node_port.is_some())) + 20)
                    .sum()
            };
            let half = &refs[..refs.len() / 2];
            let before = maps.writes();
            maps.batch(|m| m.retain(half))?;
            assert_eq!(maps.writes() - before, (entries(&refs) - entries(half)) as u64);
            let in_maps = maps.services.keys().count()
                + maps.rev_nat.keys().count()
                + maps.slots.keys().count()
                + maps.backends.keys().count();
            assert_eq!(in_maps, entries(half));

            let mut restarted = ServiceMaps::open(&pin, vec![Ipv4Addr::new(192, 0, 2, 1)])?;
            assert_eq!(restarted.service_port_count(), half.len());
            assert!(restarted.leftovers.rev_nats.is_empty() && restarted.leftovers.backends.is_empty());

            // A kernel without batch operations: the same, one entry at a time.
            restarted.writer.without_batches();
            let (before, few) = (restarted.writes(), &refs[..10]);
            restarted.batch(|m| m.retain(few))?;
            assert_eq!(restarted.writes() - before, (entries(half) - entries(few)) as u64);
            restarted.batch(|m| m.retain(&[]))?;
            assert_eq!(restarted.backends.keys().count() + restarted.services.keys().count(), 0);
            restarted.sync_service(refs[0])?;
            assert_eq!(restarted.slots.keys().count(), 10);
            Ok(())
        })();
        let _ = std::fs::remove_dir_all(&pin);
        result.expect("full sync at scale");
    }
}
