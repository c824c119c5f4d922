//! Per-CPU verdict counters: one array slot per [`Verdict`].

use bytemuck::{Pod, Zeroable};

/// What a program did with a packet. The discriminant is the index into the
/// stats map; append new verdicts at the end, never renumber.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not addressed to a Service and not a reply of a tracked flow: passed untouched.
    PassNotService = 0,
    /// Not IPv4, or an L4 protocol Services do not use (ICMP other than
    /// an error quoting TCP/UDP): passed untouched.
    PassNotIpv4OrL4 = 1,
    /// Malformed or not fully parsed (truncated, options, VLAN, port 0,
    /// bad length): passed untouched, never rewritten.
    PassMalformed = 2,
    /// First packet of a flow to a Service: backend chosen, DNATed.
    DnatNew = 3,
    /// Packet of a tracked flow: DNATed to its pinned backend.
    DnatEstablished = 4,
    /// Reply from a backend: source rewritten back to the frontend.
    RevNat = 5,
    /// Service without backends: answered with TCP RST / ICMP port
    /// unreachable (a RST to it is passed untouched, never answered).
    RejectNoBackend = 6,
    /// The maps disagreed (slot or backend missing) or a kernel helper
    /// failed: passed untouched if nothing was rewritten yet, else dropped.
    Error = 7,
    /// The flow's packets need a mark for the agent's rules in the kernel
    /// (masquerade, notrack) and XDP could not leave it in the packet's
    /// metadata (a driver that keeps none): XDP passed it on to the tc hook.
    PassToTc = 8,
    /// A frontend with a `Local` traffic policy and no endpoint on this
    /// node (while the Service has some elsewhere): dropped, like
    /// kube-proxy's DROP rule (not answered).
    DropNoLocalBackend = 9,
    /// A later IPv4 fragment (no L4 header) whose datagram's first fragment
    /// was not seen as possible Service traffic, or whose flow is not
    /// tracked: passed untouched (never translated as port 0, never
    /// answered).
    PassFragmentUntracked = 10,
    /// An ICMP error (destination unreachable, time exceeded) quoting a
    /// packet of a tracked flow: translated as the flow's packets going
    /// its way (outer and quoted headers). Errors about other packets are
    /// passed as not ours.
    IcmpError = 11,
    /// A new flow to a load balancer IP from a source outside its
    /// Service's loadBalancerSourceRanges: dropped, like kube-proxy's
    /// KUBE-FW chain.
    DropSourceRange = 12,
}

impl Verdict {
    pub const COUNT: u32 = 13;
    pub const ALL: [Verdict; Self::COUNT as usize] = [
        Verdict::PassNotService,
        Verdict::PassNotIpv4OrL4,
        Verdict::PassMalformed,
        Verdict::DnatNew,
        Verdict::DnatEstablished,
        Verdict::RevNat,
        Verdict::RejectNoBackend,
        Verdict::Error,
        Verdict::PassToTc,
        Verdict::DropNoLocalBackend,
        Verdict::PassFragmentUntracked,
        Verdict::IcmpError,
        Verdict::DropSourceRange,
    ];

    /// Stable lower-case name used in metrics and `xproxy status`.
    pub fn name(self) -> &'static str {
        match self {
            Verdict::PassNotService => "pass_not_service",
            Verdict::PassNotIpv4OrL4 => "pass_not_ipv4_or_l4",
            Verdict::PassMalformed => "pass_malformed",
            Verdict::DnatNew => "dnat_new",
            Verdict::DnatEstablished => "dnat_established",
            Verdict::RevNat => "rev_nat",
            Verdict::RejectNoBackend => "reject_no_backend",
            Verdict::Error => "error",
            Verdict::PassToTc => "pass_to_tc",
            Verdict::DropNoLocalBackend => "drop_no_local_backend",
            Verdict::PassFragmentUntracked => "pass_fragment_untracked",
            Verdict::IcmpError => "icmp_error",
            Verdict::DropSourceRange => "drop_source_range",
        }
    }
}

/// Value of the per-CPU stats array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct VerdictCounter {
    pub packets: u64,
    pub bytes: u64,
}

/// The conntrack table's counters: a per-CPU array of `u64` indexed by
/// these. The programs add to the first two; the agent's sweep writes the
/// others (into CPU 0's slot; the other CPUs' stay 0), so that `/metrics`
/// and `xproxy status` read one consistent picture from the pins.
pub mod ct_stat {
    /// Entries the programs inserted (two a flow; a replaced reply entry
    /// is not counted again).
    pub const INSERTED: u32 = 0;
    /// Entries the programs removed (a flow that gave way to a new one on
    /// its tuple; a half-created flow).
    pub const REMOVED: u32 = 1;
    /// Entries the agent removed (expired flows, stale UDP flows).
    pub const AGENT_REMOVED: u32 = 2;
    /// Of those, the expired ones (the periodic sweep).
    pub const EXPIRED: u32 = 3;
    /// Entries in the table at the last sweep.
    pub const LIVE: u32 = 4;
    /// Entries the kernel evicted (least recently used, table full) up to
    /// the last sweep: inserted, less removed, less live.
    pub const EVICTED: u32 = 5;
    pub const COUNT: u32 = 6;
}

const _: () = assert!(core::mem::size_of::<VerdictCounter>() == 16);
const _: () = assert!(Verdict::ALL.len() == Verdict::COUNT as usize);
