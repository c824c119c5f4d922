//! Map and program names, sizes, and where they are pinned.
//!
//! Names are at most 15 bytes (the kernel's object name limit); they are the
//! file names under the pin directory.

pub const SERVICES: &str = "XP_SERVICES";
/// Backend sets' slots, 16 to an entry ([`crate::SlotChunk`]).
pub const BACKEND_SLOTS: &str = "XP_SLOT_CHUNKS";
/// What older agents kept slots in: one backend id per entry, keyed by
/// [`crate::BackendSlotKey`]. Carried over into [`BACKEND_SLOTS`] and
/// unpinned at start.
pub const OLD_BACKEND_SLOTS: &str = "XP_SLOTS";
/// Backends by id, an array: ids are dense (`1..BACKENDS_MAX`, handed out
/// lowest first), so an update takes no lock and allocates nothing (a sync
/// of 100,000 backends: 10 ms, where a hash map took 90), and the programs'
/// lookup is inlined. An entry of protocol 0 is no backend.
pub const BACKENDS: &str = "XP_BACKENDS_ARR";
/// What older agents kept backends in: a hash map of the same entries,
/// with ids that only grew. Copied into [`BACKENDS`] and unpinned at start.
pub const OLD_BACKENDS: &str = "XP_BACKENDS";
pub const REV_NAT: &str = "XP_REV_NAT";
pub const CONNTRACK: &str = "XP_CT";
pub const STATS: &str = "XP_STATS";
pub const PORTS: &str = "XP_PORTS";
pub const CT_STATS: &str = "XP_CT_STATS";
pub const FRAGMENTS: &str = "XP_FRAGS";
pub const AFFINITY: &str = "XP_AFFINITY";
pub const MEMBERS: &str = "XP_MEMBERS";
pub const SOURCE_RANGES: &str = "XP_SRC_RANGES";

/// Maglev tables, in chunks ([`crate::maglev`]). Not preallocated: only
/// Services that select Maglev use memory, 1 KiB a chunk (8 KiB for a
/// Service of 6 to 10 endpoints); this bounds them at 256 MiB, room for
/// 10,000 such Services and a swap of many (a set swap briefly holds old
/// and new tables).
pub const MAGLEV: &str = "XP_MAGLEV";
pub const MAGLEV_MAX: u32 = 262_144;

/// Frontends (service ports x frontend addresses).
pub const SERVICES_MAX: u32 = 262_144;
/// Backend slots over all sets; a swap briefly holds old and new set.
pub const BACKEND_SLOTS_MAX: u32 = 1_048_576;
/// Entries of [`BACKEND_SLOTS`]: a set takes one per 16 slots, at least
/// one, so 100,000 Service ports of up to 16 endpoints fit with a swap of
/// every one of them. Not preallocated: 64 bytes of ids an entry in use.
pub const BACKEND_SLOT_CHUNKS_MAX: u32 = 262_144;
/// Distinct endpoints (address, port, protocol), both families, one id
/// space: 100,000 Services of a few endpoints each fit. [`BACKENDS`] is an
/// array of this many 8-byte entries (8 MiB); [`BACKENDS6`] is a hash map,
/// not preallocated (only its bucket array, 16 bytes a bucket, is charged
/// up front).
pub const BACKENDS_MAX: u32 = 1_048_576;
pub const REV_NAT_MAX: u32 = 262_144;
/// Tracked flows, two entries each; least recently used entries are
/// evicted. The size the program object declares: the agent sizes the map
/// from its `conntrack` configuration at load time.
pub const CONNTRACK_MAX: u32 = 524_288;

/// Clients remembered for ClientIP affinity (preallocated, LRU: the
/// least recently seen client is forgotten first).
pub const AFFINITY_MAX: u32 = 65_536;
/// Backends of the sets of Service ports with affinity (see
/// [`crate::MemberKey`]): as many as slots can be.
pub const MEMBERS_MAX: u32 = BACKEND_SLOTS_MAX;
/// loadBalancerSourceRanges entries over every load balancer IP.
pub const SOURCE_RANGES_MAX: u32 = 65_536;
/// The IPv6 load balancer IPs' source ranges ([`crate::SourceRange6Key`]
/// -> `u8`), as many as IPv4's (an LPM trie is never preallocated).
pub const SOURCE_RANGES6: &str = "XP_SRC_RANGES6";
pub const SOURCE_RANGES6_MAX: u32 = SOURCE_RANGES_MAX;

/// What external frontends share with their Service port (see
/// [`crate::service_port`]): frontend reverse NAT id -> [`crate::FrontendPort`].
pub const SERVICE_PORTS: &str = "XP_SVC_PORTS";
/// One entry per external frontend of a port with affinity or the `Local`
/// external policy: at most one per frontend.
pub const SERVICE_PORTS_MAX: u32 = SERVICES_MAX;
/// The pod networks (`clusterCIDR`) as an LPM trie: key data the IPv4
/// address in network byte order (`u32`), value `u8` (1). A new flow from
/// inside one is a pod's (kube-proxy's `detectLocalMode: ClusterCIDR`).
pub const POD_CIDRS: &str = "XP_POD_CIDRS";
/// kube-proxy takes one cluster CIDR per family; room for a few.
pub const POD_CIDRS_MAX: u32 = 64;
/// The IPv6 pod networks: as [`POD_CIDRS`], key data the IPv6 address as
/// [`crate::ipv6::Addr6`].
pub const POD_CIDRS6: &str = "XP_POD_CIDRS6";
pub const POD_CIDRS6_MAX: u32 = POD_CIDRS_MAX;

/// The node's ends of pod veths whose other end is in another namespace
/// (the pod's): ifindex (`u32`) -> `u8` (1), written by the agent as it
/// attaches to them and rewritten at every full sync. A reply the
/// programs reverse-translate at tc ingress whose route leads to one of
/// them is handed into the pod's end directly (`bpf_redirect_peer`),
/// skipping the node end's egress and the backlog queue between the two.
/// Only such veths qualify: the kernel drops what is redirected to a
/// peer in the same namespace, or to a device that has none.
pub const POD_VETHS: &str = "XP_POD_VETHS";
/// Pods on one node (kubelet's default limit is 110), with room to spare.
pub const POD_VETHS_MAX: u32 = 16_384;

/// The IPv6 maps (see [`crate::ipv6`] for why apart from the IPv4 ones):
/// frontends ([`crate::Service6Key`] -> [`crate::ServiceValue`]), backends
/// (backend id -> [`crate::Backend6`]) and tracked flows
/// ([`crate::CtKey6`] -> [`crate::CtValue6`]).
pub const SERVICES6: &str = "XP_SERVICES6";
pub const BACKENDS6: &str = "XP_BACKENDS6";
pub const CONNTRACK6: &str = "XP_CT6";
/// As [`SERVICES_MAX`] and [`BACKENDS_MAX`]: neither is preallocated.
pub const SERVICES6_MAX: u32 = SERVICES_MAX;
pub const BACKENDS6_MAX: u32 = BACKENDS_MAX;
/// Tracked IPv6 flows, two entries each. Preallocated (LRU) at 128 bytes
/// an entry with the kernel's own (IPv4's: 88), so a quarter of
/// [`CONNTRACK_MAX`]: 16 MiB. The size the program object declares: the
/// agent sizes the map from its `conntrack` configuration at load time,
/// a quarter of IPv4's there too.
pub const CONNTRACK6_MAX: u32 = CONNTRACK_MAX / 4;

/// IPv6 clients remembered for ClientIP affinity
/// ([`crate::ipv6::AffinityKey6`] -> [`crate::AffinityValue`]): a quarter of
/// [`AFFINITY_MAX`], as [`CONNTRACK6_MAX`] (preallocated, LRU).
pub const AFFINITY6: &str = "XP_AFFINITY6";
pub const AFFINITY6_MAX: u32 = AFFINITY_MAX / 4;

/// Datagrams in flight whose first fragment's ports are remembered.
pub const FRAGMENTS_MAX: u32 = 16_384;
/// The IPv6 ones ([`crate::Frag6Key`] -> [`crate::FragPorts`]), as many.
pub const FRAGMENTS6: &str = "XP_FRAGS6";

/// Program names (the entry points in `proxy-ebpf`).
pub const PROG_XDP_UPLINK: &str = "xdp_uplink";
pub const PROG_TC_INGRESS: &str = "tc_ingress";
pub const PROG_TC_EGRESS: &str = "tc_egress";

/// Default bpffs directory for one agent's pins.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/xproxy";

/// Name of the program constant (read-only global) holding the skb mark
/// bit that asks the kernel to masquerade a flow (kube-proxy's
/// masqueradeBit as a mask); 0 disables the SNAT fallback.
pub const GLOBAL_SNAT_MARK: &str = "SNAT_MARK";

/// Name of the program constant holding the skb mark bit that keeps the
/// kernel's conntrack off a packet (a raw-table rule of the agent's
/// matches it); 0: no packet is marked.
pub const GLOBAL_NOTRACK_MARK: &str = "NOTRACK_MARK";

/// Name of the program constant holding the conntrack timeouts
/// ([`crate::CtTimeouts`]), from the agent's `conntrack` configuration.
pub const GLOBAL_CT_TIMEOUTS: &str = "CT_TIMEOUTS";
