//! Writes the model into the Service maps.
//!
//! This is the only code that writes the Service maps: the agent's ebpf mode
//! and the tests go through it. Writes are staged and reach the maps in
//! batches ([`ServiceMaps::batch`]; every public write method is one batch
//! of its own unless called inside one), ordered so that a packet never
//! sees a half-programmed Service (`write_batch`'s `FLUSH_STAGES`):
//! - backends before the slots that name them, slots (16 to a map entry,
//!   `proxy_common::SlotChunk`) before the service entry that points at
//!   them (a whole new set under a fresh id);
//! - the service entry is swapped in one update (atomic for readers);
//! - removed service entries, then old slots, then unreferenced backends,
//!   are deleted last.
//!
//! Each frontend gets a reverse NAT id of its own, which the programs copy
//! into its flows' conntrack entries (`xproxy status` counts flows by it);
//! the `XP_REV_NAT` entries older agents wrote under those ids are read by
//! nothing any more (a conntrack entry holds the address a reply is
//! rewritten to), so none are written and those found are deleted.
//!
//! External frontends of a Service port with ClientIP affinity or the
//! `Local` external policy also get a Service port entry
//! (`proxy_common::service_port`): the port's affinity id (its ClusterIP
//! frontend's reverse NAT id) and, for `Local`, the Cluster run pods'
//! traffic is short-circuited to.
//!
//! A Service port is known by its ClusterIP frontend. On open, whatever an
//! earlier agent left in the maps is read back as applied state
//! ("adopted"), so syncing the same Services again writes nothing, and
//! [`ServiceMaps::retain`] removes only what is no longer wanted. After a
//! failed batch nothing is assumed: the next one reads the maps back first.
//!
//! The maps are an [`LbMaps`]: the pinned ones ([`ServiceMaps::open`]) or,
//! in tests, ones in memory ([`ServiceMaps::on`]).
//!
//! Both families go through the same code: a Service port's frontends and
//! backends are of its ClusterIP's family and land in that family's maps
//! (`XP_SERVICES`/`XP_BACKENDS_ARR` or `XP_SERVICES6`/`XP_BACKENDS6`, see
//! `proxy_common::ipv6` for why apart); backend sets, slots, ids and the
//! port filter are shared.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::Path,
};

use anyhow::{Context, Result};
use proxy_common::{
    Backend, Backend6, CtKey, CtValue, FrontendPort, MaglevKey, MemberKey, Service6Key, ServiceKey, ServiceValue,
    SlotChunk, SlotChunkKey, Verdict, VerdictCounter,
    backend::FLAG_LOCAL,
    service::{
        FLAG_AFFINITY_CLIENT_IP, FLAG_EXTERNAL_ADDR, FLAG_EXTERNAL_LOCAL, FLAG_INTERNAL_LOCAL, FLAG_MAGLEV,
        FLAG_NEEDS_SNAT, FLAG_NODE_PORT, FLAG_SOURCE_RANGES, FLAGS_EXTERNAL,
    },
};
use tracing::debug;

use super::{
    ids::{Acquired, BackendAddr, BackendRefs, IdAllocator},
    lb_maps::LbMaps,
    maglev,
    pinned_maps::PinnedMaps,
    port_filter::PortFilter,
    slot_layout::SlotLayout,
    snapshot,
    source_ranges::{self, RangeKeyOrd},
    write_batch::{FLUSH_STAGES, Job, SPREAD_FROM, Staged, run_stage},
};
use crate::{
    dump::Snapshot,
    model::{Endpoint, EndpointSets, LbAlgorithm, ServicePort},
};

/// What was written for one Service port, to diff the next write against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Applied {
    /// Frontend key -> the service entry written for it.
    frontends: BTreeMap<FrontendKey, ServiceValue>,
    backend_set: u32,
    /// Backend ids in slot order.
    backends: Vec<u32>,
    /// The set's members are in the members map (for ClientIP affinity).
    members: bool,
    /// The run of slots `(offset, count)` the set's Maglev table was built
    /// for; its frontends with that run are flagged `FLAG_MAGLEV`.
    maglev: Option<(u32, u32)>,
    /// The source range entries of the port's load balancer IPs.
    ranges: BTreeSet<RangeKeyOrd>,
    /// Frontend reverse NAT id -> its Service port entry, for the
    /// external frontends that have one.
    service_ports: BTreeMap<u32, FrontendPort>,
}

/// What a frontend of a Service port is, which decides its flags and the
/// run of slots it picks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FrontendKind {
    ClusterIp,
    NodePort,
    /// An external IP, or a load balancer IP (`load_balancer`): on the
    /// Service's port, external traffic like a node port.
    ExternalAddr {
        load_balancer: bool,
    },
}

impl FrontendKind {
    fn is_external(self) -> bool {
        self != Self::ClusterIp
    }
}

/// A frontend of either family as the writer keeps it: ordered, for
/// deterministic iteration, and turned into its family's map key
/// ([`ServiceKey`] or [`Service6Key`]) only when staged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct FrontendKey {
    addr: IpAddr,
    port: u16,
    proto: u8,
}

impl FrontendKey {
    fn new(addr: IpAddr, port: u16, proto: u8) -> Self {
        Self { addr, port, proto }
    }

    /// A Service port's key: its ClusterIP frontend.
    fn of_port(port: &ServicePort) -> Self {
        Self::new(port.cluster_ip, port.port, port.protocol.number())
    }
}

impl From<ServiceKey> for FrontendKey {
    fn from(k: ServiceKey) -> Self {
        Self::new(k.addr().into(), k.port(), k.proto)
    }
}

impl From<Service6Key> for FrontendKey {
    fn from(k: Service6Key) -> Self {
        Self::new(k.addr().into(), k.port(), k.proto)
    }
}

/// The Service maps plus the ids handed out so far.
pub struct ServiceMaps<M = PinnedMaps> {
    maps: M,
    /// Ports of every frontend and backend written (see `port_filter`).
    port_filter: PortFilter,
    /// Both families': a Service port's node port frontends are on those
    /// of its own.
    node_ips: Vec<IpAddr>,
    /// Endpoints on this node (by their nodeName) are local backends; if
    /// `None`, or an endpoint names no node, it is taken to be local (for
    /// the SNAT decision only: the `Local` traffic policies reach only
    /// endpoints that name this node, see [`EndpointSets`]).
    node_name: Option<String>,
    /// kube-proxy's masqueradeAll: every frontend asks for SNAT.
    masquerade_all: bool,
    /// The algorithm of Service ports that do not name one.
    lb_default: LbAlgorithm,
    /// By ClusterIP frontend.
    applied: BTreeMap<FrontendKey, Applied>,
    /// Service port name -> ClusterIP frontend, for ports synced by name.
    names: BTreeMap<String, FrontendKey>,
    /// Backend ids by address, counted by the Service ports using them.
    backends: BackendRefs,
    set_ids: IdAllocator,
    rev_nat_ids: IdAllocator,
    /// Entries found in the maps that no adopted Service port references
    /// (left by an agent that died halfway through a sync, or by a failed
    /// batch): [`Self::retain`] deletes them.
    leftovers: Leftovers,
    /// Writes of the batch under way, not in the maps yet.
    staged: Staged,
    /// Reverse NAT ids of frontends that lost affinity or went: the
    /// affinity entries keyed by them go after the batch (a ClusterIP
    /// frontend's id is its Service port's affinity id; the others' key
    /// only entries of agents that kept affinity per frontend).
    forget_affinity: BTreeSet<u32>,
    /// Inside [`Self::batch`]: writes wait for its end.
    batching: bool,
    /// A batch failed: the bookkeeping above may not match the maps.
    must_read_back: bool,
}

/// Keys found in the maps, by map.
#[derive(Debug, Default)]
struct Leftovers {
    slots: Vec<SlotChunkKey>,
    backends: Vec<u32>,
    backends6: Vec<u32>,
    rev_nats: Vec<u32>,
    members: Vec<MemberKey>,
    /// Both families' source range entries.
    source_ranges: Vec<RangeKeyOrd>,
    /// Service port entries by their frontend's reverse NAT id.
    service_ports: Vec<u32>,
    maglev: Vec<MaglevKey>,
}

/// What the backends array holds when a writer opens the maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendsArray {
    /// Whatever an earlier agent left: read back. The array has an entry
    /// for every possible id (`BACKENDS_MAX`, 1M), empty or not, and
    /// reading them all is most of an open: ~0.3 s on the 2-vCPU bench VM.
    Adopted,
    /// Created by this start, nothing carried into it: every entry empty,
    /// so there is nothing to read. On a node's first start that read is
    /// on the way to the first sync (the programs load beside the lists).
    Created,
}

impl ServiceMaps<PinnedMaps> {
    /// Opens the maps pinned under `pin_path` (created by [`super::Datapath::load`]).
    /// `node_ips` are the addresses NodePort frontends are programmed on.
    pub fn open(pin_path: &Path, node_ips: Vec<IpAddr>) -> Result<Self> {
        Self::open_with(pin_path, node_ips, BackendsArray::Adopted)
    }

    /// [`Self::open`], told what the backends array holds.
    pub fn open_with(pin_path: &Path, node_ips: Vec<IpAddr>, array: BackendsArray) -> Result<Self> {
        Self::on_with(PinnedMaps::open(pin_path)?, node_ips, array)
    }
}

impl<M: LbMaps> ServiceMaps<M> {
    /// Writes into `maps`, adopting what they hold. `node_ips` are the
    /// addresses NodePort frontends are programmed on.
    pub fn on(maps: M, node_ips: Vec<IpAddr>) -> Result<Self> {
        Self::on_with(maps, node_ips, BackendsArray::Adopted)
    }

    /// [`Self::on`], told what the backends array holds.
    pub fn on_with(maps: M, node_ips: Vec<IpAddr>, array: BackendsArray) -> Result<Self> {
        // Read once, for the port filter and the ids in use alike.
        let backends = match array {
            BackendsArray::Adopted => maps.backends()?,
            BackendsArray::Created => Vec::new(),
        };
        let port_filter = PortFilter::load(&maps, &backends)?;
        let mut this = Self {
            maps,
            port_filter,
            node_ips,
            node_name: None,
            masquerade_all: false,
            lb_default: LbAlgorithm::Random,
            applied: BTreeMap::new(),
            names: BTreeMap::new(),
            backends: BackendRefs::default(),
            set_ids: IdAllocator::default(),
            rev_nat_ids: IdAllocator::default(),
            leftovers: Leftovers::default(),
            staged: Staged::default(),
            forget_affinity: BTreeSet::new(),
            batching: false,
            must_read_back: false,
        };
        this.read_back_with(backends)?;
        Ok(this)
    }

    /// The maps written to.
    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// Rebuilds the bookkeeping from the maps: the ids in use, the adopted
    /// Service ports and the leftovers. Port names and where the id
    /// allocators got to are kept.
    fn read_back(&mut self) -> Result<()> {
        let backends = self.maps.backends()?;
        self.read_back_with(backends)
    }

    /// [`Self::read_back`] with the backends array's entries read already.
    fn read_back_with(&mut self, backends: Vec<(u32, Backend)>) -> Result<()> {
        self.applied.clear();
        self.backends.forget();
        self.set_ids.forget_used();
        self.rev_nat_ids.forget_used();
        let found = self.reserve_ids_in_use(backends)?;
        self.adopt()?;
        self.leftovers = self.unreferenced(found);
        Ok(())
    }

    /// Reads the frontends in the maps back into `applied`, grouped by the
    /// backend set they share. A group whose slots or backends are missing
    /// is adopted without a set, so the next sync writes it afresh.
    fn adopt(&mut self) -> Result<()> {
        let ranges_found = source_ranges::found(&self.maps)?;
        let ports_found: BTreeMap<u32, FrontendPort> = self.maps.service_ports()?.into_iter().collect();
        let mut member_counts: BTreeMap<u32, usize> = BTreeMap::new();
        for key in self.maps.member_keys()? {
            *member_counts.entry(key.backend_set).or_default() += 1;
        }
        let mut maglev_chunks: BTreeMap<u32, u32> = BTreeMap::new();
        for key in self.maps.maglev_keys()? {
            *maglev_chunks.entry(key.backend_set).or_default() += 1;
        }
        let mut groups: BTreeMap<u32, Vec<(FrontendKey, ServiceValue)>> = BTreeMap::new();
        let v4 = self
            .maps
            .services()?
            .into_iter()
            .map(|(k, v)| (FrontendKey::from(k), v));
        let v6 = self
            .maps
            .services6()?
            .into_iter()
            .map(|(k, v)| (FrontendKey::from(k), v));
        for (key, value) in v4.chain(v6) {
            groups.entry(value.backend_set).or_default().push((key, value));
        }
        for (set, members) in groups {
            let (cluster_key, _) = *members
                .iter()
                .find(|(_, v)| v.flags & FLAGS_EXTERNAL == 0)
                .unwrap_or(&members[0]);
            // The frontends use runs of one set: it ends where the last run does.
            let len = members
                .iter()
                .map(|(_, v)| v.backend_offset.saturating_add(v.backend_count))
                .max()
                .unwrap_or(0);
            for (_, value) in &members {
                self.rev_nat_ids.reserve(value.rev_nat_id);
            }
            let frontends = members.iter().copied().collect();
            let (backend_set, backends) = match self.adopt_backend_set(set, len) {
                Some(ids) => (set, ids),
                None => (0, Vec::new()),
            };
            let ids: BTreeSet<u32> = members.iter().map(|(_, v)| v.rev_nat_id).collect();
            let ranges = (ranges_found.iter())
                .filter(|k| ids.contains(&k.rev_nat_id()))
                .copied()
                .collect();
            let service_ports = (ports_found.iter())
                .filter(|(id, _)| ids.contains(id))
                .map(|(id, entry)| (*id, *entry))
                .collect();
            // Members of a set written halfway are leftovers: the set is
            // written again with them if its port has affinity.
            let has_members =
                backend_set != 0 && !backends.is_empty() && member_counts.get(&set) == Some(&backends.len());
            let maglev = adopted_maglev_run(&members, maglev_chunks.get(&set).copied()).filter(|_| backend_set != 0);
            self.applied.insert(
                cluster_key,
                Applied {
                    frontends,
                    backend_set,
                    backends,
                    members: has_members,
                    maglev,
                    ranges,
                    service_ports,
                },
            );
        }
        Ok(())
    }

    /// The backend ids in a set in the maps, taking a reference on each;
    /// `None` (and no reference taken) if the set is incomplete.
    fn adopt_backend_set(&mut self, set: u32, count: u32) -> Option<Vec<u32>> {
        let mut ids = Vec::with_capacity(count as usize);
        for chunk in 0..SlotChunk::count(count as usize) {
            let key = SlotChunkKey {
                backend_set: set,
                chunk,
            };
            ids.extend(self.maps.slot_chunk(&key).ok()??.ids);
        }
        ids.truncate(count as usize);
        let mut members = Vec::with_capacity(ids.len());
        for id in ids {
            if id == 0 {
                return None;
            }
            members.push((id, self.backend_in_maps(id)?));
        }
        // The same address under two ids: let the next sync rewrite it.
        if members.iter().any(|(id, addr)| self.backends.aliased(*id, *addr)) {
            return None;
        }
        for (id, addr) in &members {
            self.backends.adopt(*id, *addr);
        }
        Some(members.into_iter().map(|(id, _)| id).collect())
    }

    /// The backend `id` in the maps, of either family; `None` if it is in
    /// neither (or cannot be read).
    fn backend_in_maps(&self, id: u32) -> Option<BackendAddr> {
        if let Some(b) = self.maps.backend(id).ok()? {
            return Some((b.addr().into(), b.port(), b.proto));
        }
        let b = self.maps.backend6(id).ok()??;
        Some((b.addr().into(), b.port(), b.proto))
    }

    /// Sets which endpoints are local (see the field) and masqueradeAll.
    pub fn set_topology(&mut self, node_name: Option<String>, masquerade_all: bool) {
        self.node_name = node_name;
        self.masquerade_all = masquerade_all;
    }

    /// The algorithm of Service ports without an annotation naming one
    /// (`--lb-algorithm`), from the next sync of each on.
    pub fn set_lb_default(&mut self, algorithm: LbAlgorithm) {
        self.lb_default = algorithm;
    }

    fn is_local(&self, ep: &Endpoint) -> bool {
        match (&self.node_name, &ep.node_name) {
            (Some(ours), Some(theirs)) => ours.as_str() == &**theirs,
            _ => true,
        }
    }

    /// Ids already present in the maps (left by an earlier agent) are never
    /// handed out again, so a new write cannot alias an entry still in use.
    /// Returns the keys found.
    fn reserve_ids_in_use(&mut self, backends: Vec<(u32, Backend)>) -> Result<Leftovers> {
        let mut found = Leftovers::default();
        for (id, _) in backends {
            self.backends.ids().reserve(id);
            found.backends.push(id);
        }
        for (id, _) in self.maps.backends6()? {
            self.backends.ids().reserve(id);
            found.backends6.push(id);
        }
        for id in self.maps.rev_nat_ids()? {
            self.rev_nat_ids.reserve(id);
            found.rev_nats.push(id);
        }
        for key in self.maps.slot_chunk_keys()? {
            self.set_ids.reserve(key.backend_set);
            found.slots.push(key);
        }
        // A leftover entry's id must not go to a new frontend before the
        // entry is deleted.
        for (id, _) in self.maps.service_ports()? {
            self.rev_nat_ids.reserve(id);
            found.service_ports.push(id);
        }
        found.members = self.maps.member_keys()?;
        found.maglev = self.maps.maglev_keys()?;
        found.source_ranges = source_ranges::found(&self.maps)?;
        Ok(found)
    }

    /// The part of `found` that no adopted Service port references, and
    /// every reverse NAT entry (see the module doc).
    fn unreferenced(&self, mut found: Leftovers) -> Leftovers {
        let sets: BTreeSet<u32> = self.applied.values().map(|a| a.backend_set).collect();
        found.slots.retain(|k| !sets.contains(&k.backend_set));
        found.backends.retain(|id| !self.backends.holds(*id));
        found.backends6.retain(|id| !self.backends.holds(*id));
        let member_sets: BTreeSet<u32> = (self.applied.values())
            .filter(|a| a.members)
            .map(|a| a.backend_set)
            .collect();
        found.members.retain(|k| !member_sets.contains(&k.backend_set));
        let maglev_sets: BTreeSet<u32> = (self.applied.values())
            .filter(|a| a.maglev.is_some())
            .map(|a| a.backend_set)
            .collect();
        found.maglev.retain(|k| !maglev_sets.contains(&k.backend_set));
        let ranges: BTreeSet<RangeKeyOrd> = self.applied.values().flat_map(|a| a.ranges.iter().copied()).collect();
        found.source_ranges.retain(|k| !ranges.contains(k));
        let in_use = self.rev_nat_ids_in_use();
        found.service_ports.retain(|id| !in_use.contains(id));
        found
    }

    /// The reverse NAT ids of the frontends programmed now.
    fn rev_nat_ids_in_use(&self) -> BTreeSet<u32> {
        let frontends = self.applied.values().flat_map(|a| a.frontends.values());
        frontends.map(|v| v.rev_nat_id).collect()
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
        let flushed = self.flush().and_then(|()| self.forget_stale_affinity());
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
        let id = FrontendKey::of_port(svc);
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
        // Affinity needs the set's members: a set written without them is
        // written again with them (and the other way round).
        let members = svc.affinity.is_some() && !backends.is_empty();
        let maglev = self.maglev_run(svc, &layout);
        let backend_set =
            if backends == old.backends && old.backend_set != 0 && old.members == members && old.maglev == maglev {
                old.backend_set
            } else {
                let set = self.write_backend_set(&backends, members)?;
                if let Some(run) = maglev {
                    self.write_maglev_table(set, &layout, &backends, run);
                }
                set
            };

        let ports = self.frontends_of(svc).into_iter().map(|(key, _)| key.port);
        self.port_filter
            .allow(&self.maps, ports, layout.slots.iter().map(|ep| ep.port))?;
        let mut frontends = BTreeMap::new();
        let mut ranges = BTreeSet::new();
        let mut service_ports = BTreeMap::new();
        // The ClusterIP frontend comes first: its id is the port's affinity id.
        let mut affinity_id = 0;
        for (key, kind) in self.frontends_of(svc) {
            let written = old.frontends.get(&key);
            let rev_nat_id = match written {
                Some(value) => value.rev_nat_id,
                None => self.rev_nat_ids.allocate()?,
            };
            let (backend_offset, backend_count, mut flags) = self.frontend_use(svc, &sets, &layout, kind);
            if maglev == Some((backend_offset, backend_count)) {
                flags |= FLAG_MAGLEV;
            }
            if flags & FLAG_SOURCE_RANGES != 0 {
                ranges.extend(source_ranges::entries(svc, rev_nat_id));
            }
            let value = ServiceValue {
                backend_set,
                backend_count,
                rev_nat_id,
                flags,
                affinity_timeout_s: affinity_timeout_s(svc),
                backend_offset,
            };
            if kind == FrontendKind::ClusterIp {
                affinity_id = rev_nat_id;
            }
            if written.is_some_and(|w| w.flags & !flags & FLAG_AFFINITY_CLIENT_IP != 0) {
                self.forget_affinity.insert(rev_nat_id);
            }
            if let Some(entry) = service_port_entry(&value, layout.cluster, affinity_id) {
                if old.service_ports.get(&rev_nat_id) != Some(&entry) {
                    self.staged.service_ports.write(rev_nat_id, entry);
                }
                service_ports.insert(rev_nat_id, entry);
            }
            // The bookkeeping, not a read of the map: it matches the map
            // (read back after any failure), and a read per frontend costs.
            if written != Some(&value) {
                self.write_frontend(key, value);
            }
            frontends.insert(key, value);
        }

        for range in ranges.difference(&old.ranges) {
            range.stage_write(&mut self.staged);
        }

        // Everything below removes what the new state no longer references.
        for (key, value) in &old.frontends {
            if !frontends.contains_key(key) {
                self.remove_frontend(*key, value);
            }
        }
        for range in old.ranges.difference(&ranges) {
            range.stage_delete(&mut self.staged);
        }
        for id in old.service_ports.keys() {
            if !service_ports.contains_key(id) {
                self.staged.service_ports.delete(*id);
            }
        }
        if old.backend_set != 0 && old.backend_set != backend_set {
            self.delete_backend_set(old.backend_set, &old.backends, old.members);
            self.delete_maglev_table(old.backend_set, old.maglev);
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
                members,
                maglev,
                ranges,
                service_ports,
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
        kind: FrontendKind,
    ) -> (u32, u32, u32) {
        let (local_policy, local_flag) = if kind.is_external() {
            (svc.external_local(), FLAG_EXTERNAL_LOCAL)
        } else {
            (svc.internal_local(), FLAG_INTERNAL_LOCAL)
        };
        let (offset, count) = if local_policy { layout.local } else { layout.cluster };
        let mut flags = match kind {
            FrontendKind::ClusterIp => 0,
            FrontendKind::NodePort => FLAG_NODE_PORT,
            FrontendKind::ExternalAddr { .. } => FLAG_EXTERNAL_ADDR,
        };
        // A Service without any endpoint is rejected, whatever its policies.
        if local_policy && sets.has_any() {
            flags |= local_flag;
        }
        // masqueradeAll, like kube-proxy's, leaves the client's address to
        // the Local external policy.
        if self.masquerade_all && !(kind.is_external() && local_policy) {
            flags |= FLAG_NEEDS_SNAT;
        }
        if svc.affinity.is_some() {
            flags |= FLAG_AFFINITY_CLIENT_IP;
        }
        // kube-proxy filters the load balancer IPs only (its KUBE-FW
        // chain): node ports, external IPs and the ClusterIP stay open.
        if kind == (FrontendKind::ExternalAddr { load_balancer: true }) && !svc.source_ranges.is_empty() {
            flags |= FLAG_SOURCE_RANGES;
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
        let id = FrontendKey::of_port(port);
        self.batch(|this| {
            if this.names.get(&port.name) == Some(&id) {
                this.names.remove(&port.name);
            }
            this.remove_by_key(id)
        })
    }

    /// The addresses NodePort frontends are programmed on from the next
    /// sync of each Service on (a full sync writes them all).
    pub fn set_node_ips(&mut self, node_ips: Vec<IpAddr>) {
        self.node_ips = node_ips;
    }

    /// Removes every Service port not in `keep` (adopted ones included), then
    /// whatever the maps held at open (or after a failed write) that no
    /// Service port references.
    pub fn retain(&mut self, keep: &[&ServicePort]) -> Result<()> {
        let keep: BTreeSet<FrontendKey> = keep.iter().map(|p| FrontendKey::of_port(p)).collect();
        self.batch(|this| {
            let stale: Vec<FrontendKey> = this.applied.keys().filter(|k| !keep.contains(k)).copied().collect();
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
        for key in leftovers.members {
            self.staged.members.delete(key);
        }
        for key in leftovers.maglev {
            self.staged.maglev.delete(key);
        }
        for key in leftovers.source_ranges {
            key.stage_delete(&mut self.staged);
        }
        for id in leftovers.service_ports {
            self.staged.service_ports.delete(id);
            self.rev_nat_ids.release(id);
        }
        for id in leftovers.backends {
            self.staged.backends.delete(id);
            self.backends.ids().release(id);
        }
        for id in leftovers.backends6 {
            self.staged.backends6.delete(id);
            self.backends.ids().release(id);
        }
        // An older agent's entry may carry the id of a frontend still
        // programmed: the entry goes, the id stays taken.
        let in_use = self.rev_nat_ids_in_use();
        for id in leftovers.rev_nats {
            self.staged.rev_nat.delete(id);
            if !in_use.contains(&id) {
                self.rev_nat_ids.release(id);
            }
        }
    }

    fn remove_by_key(&mut self, id: FrontendKey) -> Result<()> {
        let Some(old) = self.applied.remove(&id) else {
            return Ok(());
        };
        for (key, value) in &old.frontends {
            self.remove_frontend(*key, value);
        }
        for range in &old.ranges {
            range.stage_delete(&mut self.staged);
        }
        for id in old.service_ports.keys() {
            self.staged.service_ports.delete(*id);
        }
        if old.backend_set != 0 {
            self.delete_backend_set(old.backend_set, &old.backends, old.members);
            self.delete_maglev_table(old.backend_set, old.maglev);
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
        let (maps, staged) = (&self.maps, &staged);
        for stage in FLUSH_STAGES {
            let jobs = (stage.iter().copied())
                .filter(|step| staged.entries_of(*step) > 0)
                .map(|step| {
                    let job: Job<'_> = Box::new(move || maps.write_step(step, staged));
                    (step, job)
                })
                .collect();
            run_stage(jobs, staged.entries(stage) >= SPREAD_FROM)?;
        }
        // The entries of the backends released in this batch are gone.
        self.backends.ids().reuse_released();
        Ok(())
    }

    /// Names of the Service ports programmed through this handle.
    pub fn service_names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// Map entries written and deleted through this handle so far (a sync
    /// that finds everything in place adds none; batch calls count their
    /// entries).
    pub fn writes(&self) -> u64 {
        self.maps.writes()
    }

    /// Number of Service ports in the maps, adopted ones included.
    pub fn service_port_count(&self) -> usize {
        self.applied.len()
    }

    /// Sums the per-CPU verdict counters.
    pub fn verdict_counts(&self) -> Result<Vec<(Verdict, VerdictCounter)>> {
        self.maps.verdicts()
    }

    /// Tracked flows as (key, value), forward and reply entries alike.
    pub fn conntrack_entries(&self) -> Result<Vec<(CtKey, CtValue)>> {
        self.maps.conntrack_entries()
    }

    /// Everything the programs would use now, read from the maps (not from
    /// this handle's bookkeeping), with tracked flows counted per backend.
    pub fn snapshot(&self) -> Result<Snapshot> {
        snapshot::snapshot(&self.maps)
    }

    /// Reads one frontend back, as the programs see it.
    pub fn frontend(&self, addr: impl Into<IpAddr>, port: u16, proto: u8) -> Option<ServiceValue> {
        snapshot::frontend(&self.maps, addr.into(), port, proto)
    }

    /// Reads the backends an IPv4 frontend picks from back, in slot order.
    pub fn backend_set(&self, value: &ServiceValue) -> Result<Vec<Backend>> {
        snapshot::backend_set(&self.maps, value)
    }

    /// Reads the backends a frontend of either family picks from back, in
    /// slot order, as `(address, port)`.
    pub fn backend_endpoints(&self, value: &ServiceValue) -> Result<Vec<(IpAddr, u16)>> {
        snapshot::backend_endpoints(&self.maps, value)
    }

    /// The frontends of `svc`: its ClusterIP, every node IP of its family
    /// with its node port, and its external and load balancer IPs on its
    /// port.
    fn frontends_of(&self, svc: &ServicePort) -> Vec<(FrontendKey, FrontendKind)> {
        let proto = svc.protocol.number();
        let mut out = vec![(FrontendKey::of_port(svc), FrontendKind::ClusterIp)];
        if let Some(node_port) = svc.node_port {
            let same_family = self
                .node_ips
                .iter()
                .filter(|ip| ip.is_ipv4() == svc.cluster_ip.is_ipv4());
            out.extend(same_family.map(|ip| (FrontendKey::new(*ip, node_port, proto), FrontendKind::NodePort)));
        }
        for ip in svc.external_addresses() {
            // A Service's ClusterIP listed again is not a second frontend.
            if ip == svc.cluster_ip {
                continue;
            }
            let load_balancer = svc.load_balancer_ips.contains(&ip);
            let kind = FrontendKind::ExternalAddr { load_balancer };
            out.push((FrontendKey::new(ip, svc.port, proto), kind));
        }
        out
    }

    /// Stages a new backend set (and its members, for affinity); returns its id.
    fn write_backend_set(&mut self, backends: &[u32], members: bool) -> Result<u32> {
        let set = self.set_ids.allocate()?;
        for (chunk, ids) in SlotChunk::of_set(backends) {
            self.staged.slots.write(
                SlotChunkKey {
                    backend_set: set,
                    chunk,
                },
                ids,
            );
        }
        if members {
            // A backend in two slots keeps its first: slots hold distinct
            // endpoints in every layout the model makes.
            let mut seen = BTreeSet::new();
            for (slot, id) in (0u32..).zip(backends) {
                if seen.insert(*id) {
                    let key = MemberKey {
                        backend_set: set,
                        backend_id: *id,
                    };
                    self.staged.members.write(key, slot);
                }
            }
        }
        Ok(set)
    }

    fn delete_backend_set(&mut self, set: u32, backends: &[u32], members: bool) {
        for chunk in 0..SlotChunk::count(backends.len()) {
            self.staged.slots.delete(SlotChunkKey {
                backend_set: set,
                chunk,
            });
        }
        if members {
            for id in backends.iter().collect::<BTreeSet<_>>() {
                self.staged.members.delete(MemberKey {
                    backend_set: set,
                    backend_id: *id,
                });
            }
        }
        self.set_ids.release(set);
    }

    /// The run a Maglev table is built for when `svc` selects Maglev: the
    /// `Cluster` run, which every node's frontends of the port share (a
    /// `Local` run differs per node: its frontends balance at random unless
    /// it is the same run). `None` for an empty run or one too large for a
    /// table.
    fn maglev_run(&self, svc: &ServicePort, layout: &SlotLayout<'_>) -> Option<(u32, u32)> {
        let wanted = svc.lb_algorithm.unwrap_or(self.lb_default) == LbAlgorithm::Maglev;
        let (_, count) = layout.cluster;
        (wanted && proxy_common::maglev::table_size(count).is_some()).then_some(layout.cluster)
    }

    /// Stages the Maglev table of set `set` for its slots `run`; written
    /// with the slots, before any frontend is flagged to use it.
    fn write_maglev_table(&mut self, set: u32, layout: &SlotLayout<'_>, backends: &[u32], (offset, count): (u32, u32)) {
        let run = (layout.slots.iter().zip(backends))
            .skip(offset as usize)
            .take(count as usize);
        let members: Vec<maglev::Member> = run
            .map(|(ep, id)| maglev::Member {
                id: *id,
                addr: ep.addr,
                port: ep.port,
            })
            .collect();
        let Some(table) = maglev::table(&members) else {
            return;
        };
        for (key, chunk) in maglev::chunks(set, &table) {
            self.staged.maglev.write(key, chunk);
        }
    }

    fn delete_maglev_table(&mut self, set: u32, run: Option<(u32, u32)>) {
        let Some(size) = run.and_then(|(_, count)| proxy_common::maglev::table_size(count)) else {
            return;
        };
        for chunk in 0..proxy_common::maglev::chunks(size) {
            self.staged.maglev.delete(MaglevKey {
                backend_set: set,
                chunk,
            });
        }
    }

    /// Stages `key`'s entry in its family's map.
    fn write_frontend(&mut self, key: FrontendKey, value: ServiceValue) {
        match key.addr {
            IpAddr::V4(addr) => self
                .staged
                .services
                .write(ServiceKey::new(addr, key.port, key.proto), value),
            IpAddr::V6(addr) => (self.staged.services6).write(Service6Key::new(addr, key.port, key.proto), value),
        }
    }

    fn remove_frontend(&mut self, key: FrontendKey, value: &ServiceValue) {
        match key.addr {
            IpAddr::V4(addr) => self.staged.services.delete(ServiceKey::new(addr, key.port, key.proto)),
            IpAddr::V6(addr) => self
                .staged
                .services6
                .delete(Service6Key::new(addr, key.port, key.proto)),
        }
        self.rev_nat_ids.release(value.rev_nat_id);
        // Its id may be handed to another frontend: its clients must not
        // follow.
        if value.flags & FLAG_AFFINITY_CLIENT_IP != 0 {
            self.forget_affinity.insert(value.rev_nat_id);
        }
    }

    /// Deletes the affinity entries of frontends that lost affinity or
    /// went, after the flush took their flag out of the programs' view.
    fn forget_stale_affinity(&mut self) -> Result<()> {
        let ids = std::mem::take(&mut self.forget_affinity);
        if ids.is_empty() {
            return Ok(());
        }
        let gone = self.maps.forget_affinity(&ids).context("forgetting affinity entries")?;
        debug!(frontends = ids.len(), entries = gone, "affinity entries forgotten");
        Ok(())
    }

    fn acquire_backend(&mut self, addr: IpAddr, port: u16, proto: u8, local: bool) -> Result<u32> {
        let acquired = self.backends.acquire((addr, port, proto))?;
        if let Acquired::New(id) = acquired {
            let flags = if local { FLAG_LOCAL } else { 0 };
            match addr {
                IpAddr::V4(addr) => (self.staged.backends).write(
                    id,
                    Backend {
                        flags,
                        ..Backend::new(addr, port, proto)
                    },
                ),
                IpAddr::V6(addr) => {
                    (self.staged.backends6).write(
                        id,
                        Backend6 {
                            flags,
                            ..Backend6::new(addr, port, proto)
                        },
                    );
                }
            }
        }
        Ok(acquired.id())
    }

    fn release_backend(&mut self, id: u32) -> Result<()> {
        let ipv6 = self.backends.addr_of(id).is_some_and(|(addr, _, _)| addr.is_ipv6());
        if self.backends.release(id)? {
            if ipv6 {
                self.staged.backends6.delete(id);
            } else {
                self.staged.backends.delete(id);
            }
        }
        Ok(())
    }
}

/// The Service port entry of the frontend written as `value` (see
/// `proxy_common::service_port`), if it needs one: an external frontend
/// with affinity (the port's `affinity_id`) or with the `Local` external
/// policy (the port's `cluster` run of the same set, which pods' new flows
/// take as the ClusterIP's: no `Local` flag, no external flag, so no drop
/// and no SNAT for other nodes' backends; kube-proxy masquerades none of
/// that traffic either).
fn service_port_entry(value: &ServiceValue, cluster: (u32, u32), affinity_id: u32) -> Option<FrontendPort> {
    if value.flags & FLAGS_EXTERNAL == 0 {
        return None;
    }
    let sticky = value.flags & FLAG_AFFINITY_CLIENT_IP != 0;
    let short_circuit = value.flags & FLAG_EXTERNAL_LOCAL != 0;
    if !sticky && !short_circuit {
        return None;
    }
    let (backend_offset, backend_count) = cluster;
    // An empty Cluster run (no endpoint usable for it) short-circuits
    // nothing: such a pod's flow sees the frontend as the outside does.
    let cluster = if short_circuit && backend_count > 0 {
        ServiceValue {
            backend_offset,
            backend_count,
            flags: value.flags & !(FLAG_EXTERNAL_LOCAL | FLAGS_EXTERNAL | FLAG_SOURCE_RANGES),
            ..*value
        }
    } else {
        bytemuck::Zeroable::zeroed()
    };
    Some(FrontendPort {
        affinity_id: if sticky { affinity_id } else { 0 },
        cluster,
    })
}

/// The run `(offset, count)` of a set's Maglev table as the maps hold it:
/// the run of its frontends flagged `FLAG_MAGLEV`, if `chunks` (found in
/// the Maglev map for the set) are all of the table's. `None` otherwise:
/// a table written halfway is a leftover, and the next sync of the port
/// writes its set afresh.
fn adopted_maglev_run(frontends: &[(FrontendKey, ServiceValue)], chunks: Option<u32>) -> Option<(u32, u32)> {
    let (_, value) = frontends.iter().find(|(_, v)| v.flags & FLAG_MAGLEV != 0)?;
    let size = proxy_common::maglev::table_size(value.backend_count)?;
    (chunks == Some(proxy_common::maglev::chunks(size))).then_some((value.backend_offset, value.backend_count))
}

/// The frontend's affinity timeout: whole seconds, at least 1 (the model
/// keeps it within the API's 1..=86,400), 0 without affinity.
fn affinity_timeout_s(svc: &ServicePort) -> u32 {
    svc.affinity
        .map_or(0, |t| u32::try_from(t.as_secs()).unwrap_or(u32::MAX).max(1))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

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
            let mut maps = ServiceMaps::open(&pin, vec![Ipv4Addr::new(192, 0, 2, 1).into()])?;
            let ports: Vec<ServicePort> = (0..10_000u32)
                .map(|i| ServicePort {
                    name: format!("ns/svc-{i}:http"),
                    cluster_ip: Ipv4Addr::from(0x0a60_0000 + i).into(),
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

            // Entries per port: a service entry per frontend, 10 backends,
            // and one chunk for its 10 slots.
            let entries = |ports: &[&ServicePort]| -> usize {
                ports
                    .iter()
                    .map(|p| 1 + usize::from(p.node_port.is_some()) + 10 + 1)
                    .sum()
            };
            let half = &refs[..refs.len() / 2];
            let before = maps.writes();
            maps.batch(|m| m.retain(half))?;
            assert_eq!(maps.writes() - before, (entries(&refs) - entries(half)) as u64);
            assert_eq!(maps.maps().entries(), entries(half));

            let mut restarted = ServiceMaps::open(&pin, vec![Ipv4Addr::new(192, 0, 2, 1).into()])?;
            assert_eq!(restarted.service_port_count(), half.len());
            assert!(restarted.leftovers.rev_nats.is_empty() && restarted.leftovers.backends.is_empty());

            // A kernel without batch operations: the same, one entry at a time.
            restarted.maps().without_batches();
            let (before, few) = (restarted.writes(), &refs[..10]);
            restarted.batch(|m| m.retain(few))?;
            assert_eq!(restarted.writes() - before, (entries(half) - entries(few)) as u64);
            restarted.batch(|m| m.retain(&[]))?;
            assert_eq!(restarted.maps().entries(), 0);
            restarted.sync_service(refs[0])?;
            assert_eq!(restarted.maps().slot_chunk_keys()?.len(), 1, "10 slots, one chunk");
            Ok(())
        })();
        let _ = std::fs::remove_dir_all(&pin);
        result.expect("full sync at scale");
    }
}
