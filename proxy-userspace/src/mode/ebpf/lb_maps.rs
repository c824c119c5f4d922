//! The maps the Service writer (`service_maps`) and the snapshot reader
//! (`snapshot`) use, as an interface with three implementations:
//! [`super::PinnedMaps`] (the kernel's maps pinned under bpffs),
//! [`super::MemoryMaps`] (plain collections, for tests without root) and
//! [`super::FaultyMaps`] (in memory, failing a chosen write or refusing
//! entries past a size, like a full kernel map).
//!
//! Reads are one entry, or all keys, at a time; writes come as the steps
//! of a flush (`write_batch::FLUSH_STAGES`), which may run on threads of
//! their own: hence `&self` and `Sync`.

use std::collections::BTreeSet;

use anyhow::Result;
use proxy_common::{
    Backend, Backend6, BackendSlotKey, CtKey, CtKey6, CtValue, CtValue6, FrontendPort, MaglevChunk, MaglevKey,
    MemberKey, PortBits, Service6Key, ServiceKey, ServiceValue, SlotChunk, SlotChunkKey, SourceRange6Key,
    SourceRangeKey, Verdict, VerdictCounter,
};

use super::write_batch::{SplitStaged, Step};

/// The Service maps (`XP_SERVICES`, `XP_SERVICES6`, `XP_SLOT_CHUNKS`,
/// `XP_BACKENDS_ARR`, `XP_BACKENDS6`,
/// `XP_REV_NAT`, `XP_MEMBERS`, `XP_SRC_RANGES`, `XP_SRC_RANGES6`, `XP_SVC_PORTS`,
/// `XP_MAGLEV`),
/// the port filter
/// (`XP_PORTS`), what the programs write that a snapshot shows (`XP_CT`,
/// `XP_STATS`) and the affinity map the programs fill (`XP_AFFINITY`).
pub trait LbMaps: Sync {
    /// Every frontend: `XP_SERVICES`.
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>>;
    /// One frontend, `None` if it is not there.
    fn service(&self, key: &ServiceKey) -> Result<Option<ServiceValue>>;
    /// Every IPv6 frontend: `XP_SERVICES6`.
    fn services6(&self) -> Result<Vec<(Service6Key, ServiceValue)>>;
    /// One IPv6 frontend, `None` if it is not there.
    fn service6(&self, key: &Service6Key) -> Result<Option<ServiceValue>>;
    /// Every key of the slots map (16 slots to an entry): `XP_SLOT_CHUNKS`.
    fn slot_chunk_keys(&self) -> Result<Vec<SlotChunkKey>>;
    /// One entry of the slots map, `None` if it is not there.
    fn slot_chunk(&self, key: &SlotChunkKey) -> Result<Option<SlotChunk>>;
    /// The backend id in one slot, `None` if the slot is not there.
    fn slot(&self, key: &BackendSlotKey) -> Result<Option<u32>> {
        let chunk = self.slot_chunk(&key.chunk_key())?;
        Ok(chunk.map(|c| c.ids[key.index_in_chunk()]).filter(|id| *id != 0))
    }
    /// Every backend by id: `XP_BACKENDS_ARR`.
    fn backends(&self) -> Result<Vec<(u32, Backend)>>;
    /// One backend, `None` if it is not there.
    fn backend(&self, id: u32) -> Result<Option<Backend>>;
    /// Every IPv6 backend by id: `XP_BACKENDS6`.
    fn backends6(&self) -> Result<Vec<(u32, Backend6)>>;
    /// One IPv6 backend, `None` if it is not there.
    fn backend6(&self, id: u32) -> Result<Option<Backend6>>;
    /// Every reverse NAT id: `XP_REV_NAT`.
    fn rev_nat_ids(&self) -> Result<Vec<u32>>;
    /// Every backend set member's key: `XP_MEMBERS`.
    fn member_keys(&self) -> Result<Vec<MemberKey>>;
    /// Every Maglev table chunk's key: `XP_MAGLEV`.
    fn maglev_keys(&self) -> Result<Vec<MaglevKey>>;
    /// One chunk of a Maglev table, `None` if it is not there.
    fn maglev_chunk(&self, key: &MaglevKey) -> Result<Option<MaglevChunk>>;
    /// Every source range entry: `XP_SRC_RANGES`.
    fn source_range_keys(&self) -> Result<Vec<SourceRangeKey>>;
    /// Every IPv6 source range entry: `XP_SRC_RANGES6`.
    fn source_range6_keys(&self) -> Result<Vec<SourceRange6Key>>;
    /// Every external frontend's Service port entry by its reverse NAT
    /// id: `XP_SVC_PORTS`.
    fn service_ports(&self) -> Result<Vec<(u32, FrontendPort)>>;
    /// Deletes the affinity entries (`XP_AFFINITY`) of the Service ports
    /// with these affinity ids; returns how many went.
    fn forget_affinity(&self, affinity_ids: &BTreeSet<u32>) -> Result<u64>;

    /// Writes (or deletes) what `step` takes of `staged`. An error may
    /// leave part of the step done, as a kernel batch call does.
    fn write_step(&self, step: Step, staged: &SplitStaged) -> Result<()>;
    /// Entries written and deleted through this handle so far (a delete of
    /// a key that was not there counts none).
    fn writes(&self) -> u64;

    /// The port filter's words, `proxy_common::ports::PORT_WORDS` of them.
    fn port_words(&self) -> Result<Vec<PortBits>>;
    /// Writes one word of the port filter.
    fn set_port_word(&self, index: u32, word: PortBits) -> Result<()>;

    /// Tracked flows, forward and reply entries alike.
    fn conntrack_entries(&self) -> Result<Vec<(CtKey, CtValue)>>;
    /// Tracked IPv6 flows (`XP_CT6`), forward and reply entries alike.
    fn conntrack6_entries(&self) -> Result<Vec<(CtKey6, CtValue6)>>;
    /// The verdict counters summed over CPUs, every verdict listed.
    fn verdicts(&self) -> Result<Vec<(Verdict, VerdictCounter)>>;
}
