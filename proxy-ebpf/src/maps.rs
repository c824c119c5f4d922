//! The maps, pinned by name so a restarted agent finds and keeps them.
//! Layouts and sizes live in `proxy-common`; see there for every field.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
};
use proxy_common::{
    AffinityKey, AffinityKey6, AffinityValue, Backend, Backend6, CtKey, CtKey6, CtTimeouts, CtValue, CtValue6,
    Frag6Key, FragKey, FragPorts, FrontendPort, MaglevChunk, MaglevKey, MemberKey, PortBits, RevNat, Service6Key,
    ServiceKey, ServiceValue, SlotChunk, SlotChunkKey, SourceRange6Data, SourceRangeData, Verdict, VerdictCounter,
    conntrack::{seconds_to_ns, state_index},
    maps::{
        AFFINITY_MAX, AFFINITY6_MAX, BACKEND_SLOT_CHUNKS_MAX, BACKENDS_MAX, BACKENDS6_MAX, CONNTRACK_MAX,
        CONNTRACK6_MAX, FRAGMENTS_MAX, MAGLEV_MAX, MEMBERS_MAX, POD_CIDRS_MAX, POD_CIDRS6_MAX, POD_VETHS_MAX,
        REV_NAT_MAX, SERVICE_PORTS_MAX, SERVICES_MAX, SERVICES6_MAX, SOURCE_RANGES_MAX, SOURCE_RANGES6_MAX,
    },
    ports::PORT_WORDS,
};

// Only user space writes these, so they need not be preallocated: memory
// grows with the Services actually programmed.
#[map(name = "XP_SERVICES")]
pub static SERVICES: HashMap<ServiceKey, ServiceValue> = HashMap::pinned(SERVICES_MAX, BPF_F_NO_PREALLOC);

#[map(name = "XP_SLOT_CHUNKS")]
pub static BACKEND_SLOTS: HashMap<SlotChunkKey, SlotChunk> =
    HashMap::pinned(BACKEND_SLOT_CHUNKS_MAX, BPF_F_NO_PREALLOC);

// An array (see `proxy_common::maps::BACKENDS`): 8 MiB preallocated, half
// what a hash map's bucket array of this size is charged.
#[map(name = "XP_BACKENDS_ARR")]
pub static BACKENDS: Array<Backend> = Array::pinned(BACKENDS_MAX, 0);

#[map(name = "XP_REV_NAT")]
pub static REV_NAT: HashMap<u32, RevNat> = HashMap::pinned(REV_NAT_MAX, BPF_F_NO_PREALLOC);

// Written for the backend sets of Service ports with ClientIP affinity.
#[map(name = "XP_MEMBERS")]
pub static MEMBERS: HashMap<MemberKey, u32> = HashMap::pinned(MEMBERS_MAX, BPF_F_NO_PREALLOC);

// Maglev tables of the backend sets whose frontends select Maglev, in
// chunks (see `proxy_common::maglev`).
#[map(name = "XP_MAGLEV")]
pub static MAGLEV: HashMap<MaglevKey, MaglevChunk> = HashMap::pinned(MAGLEV_MAX, BPF_F_NO_PREALLOC);

// loadBalancerSourceRanges of every load balancer IP (an LPM trie is never
// preallocated).
#[map(name = "XP_SRC_RANGES")]
pub static SOURCE_RANGES: LpmTrie<SourceRangeData, u8> = LpmTrie::pinned(SOURCE_RANGES_MAX, 0);

// Written from the data path on every new flow of a Service port with
// ClientIP affinity.
#[map(name = "XP_AFFINITY")]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue> = LruHashMap::pinned(AFFINITY_MAX, 0);

// What external frontends share with their Service port (affinity id,
// pods' short-circuit), and the pod networks that short-circuit (see
// `proxy_common::service_port`); user space writes both.
#[map(name = "XP_SVC_PORTS")]
pub static SERVICE_PORTS: HashMap<u32, FrontendPort> = HashMap::pinned(SERVICE_PORTS_MAX, BPF_F_NO_PREALLOC);

#[map(name = "XP_POD_CIDRS")]
pub static POD_CIDRS: LpmTrie<u32, u8> = LpmTrie::pinned(POD_CIDRS_MAX, 0);

#[map(name = "XP_POD_VETHS")]
pub static POD_VETHS: HashMap<u32, u8> = HashMap::pinned(POD_VETHS_MAX, BPF_F_NO_PREALLOC);

// Written from the data path on every new flow: LRU maps are preallocated.
#[map(name = "XP_CT")]
pub static CONNTRACK: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(CONNTRACK_MAX, 0);

// IPv6's frontends, backends and flows (see `proxy_common::ipv6` for why
// apart from IPv4's): written and sized as their IPv4 counterparts.
#[map(name = "XP_SERVICES6")]
pub static SERVICES6: HashMap<Service6Key, ServiceValue> = HashMap::pinned(SERVICES6_MAX, BPF_F_NO_PREALLOC);

#[map(name = "XP_BACKENDS6")]
pub static BACKENDS6: HashMap<u32, Backend6> = HashMap::pinned(BACKENDS6_MAX, BPF_F_NO_PREALLOC);

#[map(name = "XP_CT6")]
pub static CONNTRACK6: LruHashMap<CtKey6, CtValue6> = LruHashMap::pinned(CONNTRACK6_MAX, 0);

// IPv6's source ranges and pod networks, as `SOURCE_RANGES` and
// `POD_CIDRS` (the key data: `proxy_common::ipv6::Addr6`).
#[map(name = "XP_SRC_RANGES6")]
pub static SOURCE_RANGES6: LpmTrie<SourceRange6Data, u8> = LpmTrie::pinned(SOURCE_RANGES6_MAX, 0);

#[map(name = "XP_POD_CIDRS6")]
pub static POD_CIDRS6: LpmTrie<[u32; 4], u8> = LpmTrie::pinned(POD_CIDRS6_MAX, 0);

#[map(name = "XP_AFFINITY6")]
pub static AFFINITY6: LruHashMap<AffinityKey6, AffinityValue> = LruHashMap::pinned(AFFINITY6_MAX, 0);

/// Room for a new IPv6 flow's conntrack key and value while they are
/// written, its trie lookup keys (source range, pod network) and a
/// fragment's key: bytes the tc programs' stack has no room for on 6.1
/// (whose verifier counts each helper function a call chain reaches at 32
/// bytes more). Per CPU, and not pinned: a scratch pad, not state.
#[map(name = "XP_SCRATCH6")]
pub static SCRATCH6: PerCpuArray<Scratch6> = PerCpuArray::with_max_entries(1, 0);

/// Each CPU's last reading of the programs' clock and the jiffies it was
/// taken at (see `clock`). Not pinned: a cache, not state.
#[map(name = "XP_CLOCK")]
pub static CLOCK: PerCpuArray<ClockCache> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
pub struct ClockCache {
    pub jiffies: u64,
    pub now_ns: u64,
}

#[repr(C)]
pub struct Scratch6 {
    pub key: CtKey6,
    pub value: CtValue6,
    pub range_key: Key<SourceRange6Data>,
    pub pod_key: Key<[u32; 4]>,
    /// An IPv6 fragment's key (`ipv6::fragments`), for the same reason.
    pub frag_key: Frag6Key,
}

// The first fragment's ports of datagrams in flight.
#[map(name = "XP_FRAGS")]
pub static FRAGMENTS: LruHashMap<FragKey, FragPorts> = LruHashMap::pinned(FRAGMENTS_MAX, 0);

#[map(name = "XP_FRAGS6")]
pub static FRAGMENTS6: LruHashMap<Frag6Key, FragPorts> = LruHashMap::pinned(FRAGMENTS_MAX, 0);

// Set by user space for every frontend and backend port.
#[map(name = "XP_PORTS")]
pub static PORTS: Array<PortBits> = Array::pinned(PORT_WORDS, 0);

/// Indexed by `proxy_common::stats::ct_stat`.
#[map(name = "XP_CT_STATS")]
pub static CT_STATS: PerCpuArray<u64> = PerCpuArray::pinned(proxy_common::stats::ct_stat::COUNT, 0);

#[map(name = "XP_STATS")]
pub static STATS: PerCpuArray<VerdictCounter> = PerCpuArray::pinned(Verdict::COUNT, 0);

/// The skb mark bit asking the kernel to masquerade a flow; 0 disables the
/// SNAT fallback. A read-only global: the agent sets it at load time.
#[unsafe(no_mangle)]
static SNAT_MARK: u32 = 0;

#[inline(always)]
pub fn snat_mark() -> u32 {
    // Volatile: the value is patched into .rodata after compilation.
    // SAFETY: a reference to a static: valid, aligned and initialised.
    unsafe { core::ptr::read_volatile(&SNAT_MARK) }
}

/// The skb mark bit that keeps the kernel's conntrack off a packet (see
/// `notrack`); 0: no flow is kept off. A read-only global, as `SNAT_MARK`.
#[unsafe(no_mangle)]
static NOTRACK_MARK: u32 = 0;

#[inline(always)]
pub fn notrack_mark() -> u32 {
    // Volatile, as `snat_mark`: patched into .rodata after compilation.
    // SAFETY: a reference to a static: valid, aligned and initialised.
    unsafe { core::ptr::read_volatile(&NOTRACK_MARK) }
}

/// How long a flow may idle in each state; the agent sets it at load time
/// from its `conntrack` configuration. A read-only global.
#[unsafe(no_mangle)]
static CT_TIMEOUTS: CtTimeouts = CtTimeouts::KERNEL;

/// How long a flow may idle in `state`, in nanoseconds: one element read,
/// not the table.
#[inline(always)]
pub fn ct_timeout_ns(state: u8) -> u64 {
    // Volatile, as `snat_mark`: patched into .rodata after compilation.
    // SAFETY: a reference into a static: valid, aligned and initialised.
    let seconds = unsafe { core::ptr::read_volatile(&CT_TIMEOUTS.seconds[state_index(state)]) };
    seconds_to_ns(seconds)
}
