//! Connection tracking: an LRU hash keyed by the 5-tuple as seen in a packet.
//!
//! Each translated flow has two entries in one key space, so that a packet
//! needs one lookup of its own tuple whichever way it goes. The forward
//! entry is keyed by the client's tuple `client -> frontend` and holds the
//! backend to DNAT to; the reply entry is keyed by the backend's reply
//! tuple `backend -> client` and holds the frontend to rewrite the source
//! back to. [`FLAG_REPLY`] in the value says which of the two it is.
//!
//! The same five numbers can be one flow's forward tuple and another flow's
//! reply tuple only if a client uses a frontend's address and port as its
//! source (the node connecting from a NodePort-numbered port to a pod that
//! connects to that NodePort). Entries are inserted without overwriting
//! (BPF_NOEXIST): the second flow is then not tracked, and neither loses
//! its pin.
//!
//! Both entries carry the flow's state ([`state`]), moved on by the packets
//! of either direction as the kernel's conntrack does ([`next_state`]),
//! and a timeout per state ([`CtTimeouts`]). What the timeouts decide is
//! narrow on purpose: an idle or closed flow gives way to a packet that
//! opens a new one on the same tuple ([`opens_flow`]: a TCP SYN, any UDP
//! datagram), which gets a fresh backend; any other packet of the flow
//! keeps it alive, however long it was idle (as the kernel's
//! `nf_conntrack_tcp_loose` picks up a connection mid-stream, but with the
//! backend the flow had). The agent deletes flows idle past their timeout.

use core::net::Ipv4Addr;

use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct CtKey {
    /// Source IPv4 address, network byte order.
    pub saddr_be: u32,
    /// Destination IPv4 address, network byte order.
    pub daddr_be: u32,
    /// Source port, network byte order.
    pub sport_be: u16,
    /// Destination port, network byte order.
    pub dport_be: u16,
    /// IP protocol number.
    pub proto: u8,
    pub _pad: [u8; 3],
}

impl CtKey {
    pub fn new(saddr: Ipv4Addr, sport: u16, daddr: Ipv4Addr, dport: u16, proto: u8) -> Self {
        Self {
            saddr_be: u32::from_ne_bytes(saddr.octets()),
            daddr_be: u32::from_ne_bytes(daddr.octets()),
            sport_be: sport.to_be(),
            dport_be: dport.to_be(),
            proto,
            _pad: [0; 3],
        }
    }
    pub fn saddr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.saddr_be.to_ne_bytes())
    }
    pub fn daddr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.daddr_be.to_ne_bytes())
    }
    pub fn sport(&self) -> u16 {
        u16::from_be(self.sport_be)
    }
    pub fn dport(&self) -> u16 {
        u16::from_be(self.dport_be)
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct CtValue {
    /// Backend the flow was pinned to (backends map key), for read-back
    /// only: the programs translate with [`Self::nat_addr_be`].
    pub backend_id: u32,
    /// Frontend the flow was addressed to (reverse NAT map key), likewise.
    pub rev_nat_id: u32,
    /// `bpf_ktime_get_coarse_ns()` (CLOCK_MONOTONIC_COARSE) of the last
    /// packet in this entry's direction, refreshed at most every
    /// [`LAST_SEEN_GRANULARITY_NS`] so that busy flows do not bounce the
    /// entry's cache line.
    pub last_seen_ns: u64,
    /// `FLAG_*` bits below.
    pub flags: u8,
    /// The flow's state, one of [`state`]; the same in both entries.
    pub state: u8,
    /// The port the packet is rewritten to, network byte order: the
    /// backend's (forward entry, destination) or the frontend's (reply
    /// entry, source). Kept here so a tracked packet needs no other lookup.
    pub nat_port_be: u16,
    /// The address the packet is rewritten to, network byte order, likewise.
    pub nat_addr_be: u32,
}

impl CtValue {
    /// The address and port the entry rewrites to (see the fields).
    pub fn nat(&self) -> (Ipv4Addr, u16) {
        (
            Ipv4Addr::from(self.nat_addr_be.to_ne_bytes()),
            u16::from_be(self.nat_port_be),
        )
    }
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_REPLY != 0
    }
}

/// The key of the flow's other entry: the reply tuple of a forward entry
/// (`backend -> client`), the forward tuple of a reply entry (`client ->
/// frontend`).
#[inline(always)]
pub fn partner_key(key: &CtKey, value: &CtValue) -> CtKey {
    if value.flags & FLAG_REPLY != 0 {
        CtKey {
            saddr_be: key.daddr_be,
            daddr_be: value.nat_addr_be,
            sport_be: key.dport_be,
            dport_be: value.nat_port_be,
            proto: key.proto,
            _pad: [0; 3],
        }
    } else {
        CtKey {
            saddr_be: value.nat_addr_be,
            daddr_be: key.saddr_be,
            sport_be: value.nat_port_be,
            dport_be: key.sport_be,
            proto: key.proto,
            _pad: [0; 3],
        }
    }
}

/// This is the reply entry (`backend -> client`): reverse NAT to the frontend.
pub const FLAG_REPLY: u8 = 1 << 0;
/// The flow's packets carry the SNAT mark: the kernel masquerades them.
pub const FLAG_SNAT: u8 = 1 << 1;
/// Forward entry only: the XDP hook picked the backend but could not mark
/// the packet (a driver without metadata) and left it to the tc hook, which
/// translates it, counts the flow as new and clears the flag.
pub const FLAG_HANDED_TO_TC: u8 = 1 << 2;
/// The client sent a FIN (both entries).
pub const FLAG_FIN_FORWARD: u8 = 1 << 3;
/// The backend sent a FIN (both entries).
pub const FLAG_FIN_REPLY: u8 = 1 << 4;
/// Written by programs that keep flow states (every entry today's write):
/// an entry without it is an older agent's, whose `state` byte held TCP
/// flags and whose `last_seen_ns` another clock (the agent migrates them).
pub const FLAG_STATEFUL: u8 = 1 << 5;
/// Both entries: the flow's packets carry the notrack mark, which
/// keeps the kernel's conntrack off them (see the agent's `notrack`): a
/// flow between pods that no one source-NATs, whose replies the programs
/// reverse-NAT and redirect past the kernel's hooks. The kernel would see
/// only its forward half and call the client's ACK invalid.
pub const FLAG_NOTRACK: u8 = 1 << 6;
/// The flag bits that are the flow's, not the entry's: kept equal in both.
pub const FLOW_FLAGS: u8 = FLAG_FIN_FORWARD | FLAG_FIN_REPLY;

/// Flow states, as the kernel's conntrack names them (simplified: the
/// handshake's middle steps and the FIN's ACKs are not told apart).
pub mod state {
    /// Written by an agent from before states (the agent migrates such
    /// entries at start): timed out as established.
    pub const NONE: u8 = 0;
    /// The client's SYN passed; no answer yet.
    pub const TCP_SYN_SENT: u8 = 1;
    /// The backend answered.
    pub const TCP_ESTABLISHED: u8 = 2;
    /// One side sent a FIN: half closed (the kernel's FIN_WAIT/CLOSE_WAIT).
    pub const TCP_FIN_WAIT: u8 = 3;
    /// Both sides sent a FIN.
    pub const TCP_TIME_WAIT: u8 = 4;
    /// A RST ended the connection.
    pub const TCP_CLOSE: u8 = 5;
    /// Datagrams one way only so far.
    pub const UDP_UNREPLIED: u8 = 6;
    /// The backend answered.
    pub const UDP_REPLIED: u8 = 7;
    /// Number of states; a power of two, so `state & (COUNT - 1)` is a
    /// bounds proof the verifier accepts.
    pub const COUNT: usize = 8;

    /// Lower-case names, for `xproxy status` and tests.
    pub fn name(state: u8) -> &'static str {
        match state {
            TCP_SYN_SENT => "syn_sent",
            TCP_ESTABLISHED => "established",
            TCP_FIN_WAIT => "fin_wait",
            TCP_TIME_WAIT => "time_wait",
            TCP_CLOSE => "close",
            UDP_UNREPLIED => "unreplied",
            UDP_REPLIED => "replied",
            _ => "none",
        }
    }
}

/// TCP header flag bits, as in the header's 14th byte.
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const ACK: u8 = 0x10;
}

/// The flags of a new flow's forward entry (both families').
#[inline(always)]
pub fn forward_flags(snat: bool, handed_to_tc: bool, notrack: bool) -> u8 {
    let bit = |set: bool, flag: u8| if set { flag } else { 0 };
    FLAG_STATEFUL | bit(snat, FLAG_SNAT) | bit(handed_to_tc, FLAG_HANDED_TO_TC) | bit(notrack, FLAG_NOTRACK)
}

/// The state a flow starts in with its first packet.
#[inline(always)]
pub fn initial_state(proto: u8) -> u8 {
    if proto == crate::proto::TCP {
        state::TCP_SYN_SENT
    } else {
        state::UDP_UNREPLIED
    }
}

/// The flow's `(state, flow flags)` after a packet with TCP flags `flags`
/// (0 for UDP) going the `reply` way or not. The kernel's rules, less the
/// sequence numbers: a RST closes; a FIN half-closes, a FIN each way closes
/// to TIME_WAIT; the backend's answer establishes (TCP) or marks the flow
/// replied (UDP); every other packet leaves the state as it is.
#[inline(always)]
pub fn next_state(state: u8, flow_flags: u8, proto: u8, reply: bool, flags: u8) -> (u8, u8) {
    if proto != crate::proto::TCP {
        let state = if reply && state == state::UDP_UNREPLIED {
            state::UDP_REPLIED
        } else {
            state
        };
        return (state, flow_flags);
    }
    if flags & tcp_flags::RST != 0 {
        return (state::TCP_CLOSE, flow_flags);
    }
    if state == state::TCP_CLOSE {
        return (state, flow_flags);
    }
    if flags & tcp_flags::FIN != 0 {
        let fins = flow_flags | if reply { FLAG_FIN_REPLY } else { FLAG_FIN_FORWARD };
        let closed = fins & FLOW_FLAGS == FLOW_FLAGS;
        return (
            if closed {
                state::TCP_TIME_WAIT
            } else {
                state::TCP_FIN_WAIT
            },
            fins,
        );
    }
    if reply && state == state::TCP_SYN_SENT {
        return (state::TCP_ESTABLISHED, flow_flags);
    }
    (state, flow_flags)
}

/// Whether a packet may open a new flow where an old one ended: a TCP SYN
/// without ACK, or any UDP datagram.
#[inline(always)]
pub fn opens_flow(proto: u8, flags: u8) -> bool {
    proto != crate::proto::TCP || flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN
}

/// Whether the flow's connection is over (a SYN on its tuple is a new one).
#[inline(always)]
pub fn is_closed(state: u8) -> bool {
    state == state::TCP_TIME_WAIT || state == state::TCP_CLOSE
}

/// The state an entry's flow is in: `state`, unless both FIN flags are
/// set, which is TIME_WAIT (CLOSE stays). The programs set a FIN flag with
/// an atomic OR but write the state byte plainly, from the flags each saw:
/// when the two sides' FINs are handled on two CPUs at once, both flags
/// end up set while the state byte may still say FIN_WAIT. The flags are
/// the authority; a flow stuck in FIN_WAIT would keep its tuple pinned to
/// its backend when the client reuses the port.
#[inline(always)]
pub fn settled_state(state: u8, flags: u8) -> u8 {
    if flags & FLOW_FLAGS == FLOW_FLAGS && state != state::TCP_CLOSE {
        state::TCP_TIME_WAIT
    } else {
        state
    }
}

/// How long a flow may be idle in each state, in seconds, indexed by
/// [`state`]. The programs read it as a read-only global the agent sets at
/// load time ([`crate::maps::GLOBAL_CT_TIMEOUTS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct CtTimeouts {
    pub seconds: [u32; state::COUNT],
}

impl CtTimeouts {
    /// The kernel's defaults (net.netfilter.nf_conntrack_*_timeout*).
    pub const KERNEL: CtTimeouts = CtTimeouts {
        seconds: [
            432_000, // NONE: as established
            120,     // TCP_SYN_SENT
            432_000, // TCP_ESTABLISHED: 5 days
            60,      // TCP_FIN_WAIT: the kernel's CLOSE_WAIT
            120,     // TCP_TIME_WAIT
            10,      // TCP_CLOSE
            30,      // UDP_UNREPLIED
            120,     // UDP_REPLIED: the kernel's udp_timeout_stream
        ],
    };

    /// Nanoseconds a flow may be idle in `state`.
    #[inline(always)]
    pub fn ns(&self, state: u8) -> u64 {
        seconds_to_ns(self.seconds[state_index(state)])
    }

    /// Whether an entry last seen at `last_seen_ns` is idle past its
    /// state's timeout at `now_ns`.
    #[inline(always)]
    pub fn idle_past(&self, state: u8, last_seen_ns: u64, now_ns: u64) -> bool {
        idle_past(self.ns(state), last_seen_ns, now_ns)
    }
}

/// Whether an entry last seen at `last_seen_ns` has idled longer than
/// `timeout_ns` at `now_ns` (a clock behind the entry: not idle).
#[inline(always)]
pub fn idle_past(timeout_ns: u64, last_seen_ns: u64, now_ns: u64) -> bool {
    now_ns.saturating_sub(last_seen_ns) > timeout_ns
}

/// The index of `state` in [`CtTimeouts::seconds`], within bounds
/// whatever the byte holds.
#[inline(always)]
pub fn state_index(state: u8) -> usize {
    state as usize & (state::COUNT - 1)
}

#[inline(always)]
pub fn seconds_to_ns(seconds: u32) -> u64 {
    u64::from(seconds) * 1_000_000_000
}

/// How stale `last_seen_ns` may get before a packet refreshes it. Far
/// below every timeout, so an entry looks idle only when it is.
pub const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;

const _: () = assert!(core::mem::size_of::<CtKey>() == 16);
const _: () = assert!(core::mem::size_of::<CtValue>() == 24);
// The programs OR FIN flags into the 64-bit word that starts at `flags`
// (with `state`, `nat_port_be` and `nat_addr_be`, the value's last 8
// bytes): it must be 8-byte aligned.
const _: () = assert!(core::mem::offset_of!(CtValue, flags) % 8 == 0);
const _: () = assert!(core::mem::align_of::<CtValue>() == 8);
const _: () = assert!(core::mem::offset_of!(CtValue, nat_addr_be) == 20);
const _: () = assert!(core::mem::size_of::<CtTimeouts>() == 4 * state::COUNT);
const _: () = assert!(state::COUNT.is_power_of_two());

#[cfg(test)]
mod tests {
    use super::{state::*, tcp_flags::*, *};
    use crate::proto::{TCP, UDP};

    /// Runs packets `(reply, flags)` through [`next_state`] from a new flow.
    fn after(proto: u8, packets: &[(bool, u8)]) -> u8 {
        let (mut st, mut fins) = (initial_state(proto), 0);
        for &(reply, flags) in packets {
            (st, fins) = next_state(st, fins, proto, reply, flags);
        }
        st
    }

    const FWD: bool = false;
    const REP: bool = true;

    #[test]
    fn both_fin_flags_settle_the_state_as_time_wait() {
        // Two CPUs each saw one FIN: the flags say both, the state one.
        let both = FLAG_FIN_FORWARD | FLAG_FIN_REPLY | FLAG_REPLY;
        assert_eq!(settled_state(TCP_FIN_WAIT, both), TCP_TIME_WAIT);
        assert_eq!(settled_state(TCP_ESTABLISHED, both), TCP_TIME_WAIT);
        assert_eq!(settled_state(TCP_CLOSE, both), TCP_CLOSE, "a RST stays a RST");
        assert_eq!(settled_state(TCP_FIN_WAIT, FLAG_FIN_FORWARD), TCP_FIN_WAIT);
        assert_eq!(settled_state(UDP_REPLIED, FLAG_REPLY), UDP_REPLIED);
    }

    #[test]
    fn tcp_states_follow_the_kernels() {
        assert_eq!(after(TCP, &[]), TCP_SYN_SENT);
        assert_eq!(after(TCP, &[(FWD, SYN)]), TCP_SYN_SENT, "a retransmitted SYN");
        assert_eq!(after(TCP, &[(REP, SYN | ACK)]), TCP_ESTABLISHED);
        let open = [(REP, SYN | ACK), (FWD, ACK), (REP, ACK)];
        assert_eq!(after(TCP, &open), TCP_ESTABLISHED);
        let half = [&open[..], &[(FWD, FIN | ACK)]].concat();
        assert_eq!(after(TCP, &half), TCP_FIN_WAIT);
        let same_side_twice = [&half[..], &[(FWD, FIN | ACK)]].concat();
        assert_eq!(after(TCP, &same_side_twice), TCP_FIN_WAIT, "a retransmitted FIN");
        let both = [&half[..], &[(REP, FIN | ACK), (FWD, ACK)]].concat();
        assert_eq!(after(TCP, &both), TCP_TIME_WAIT);
        assert_eq!(after(TCP, &[(REP, SYN | ACK), (REP, RST)]), TCP_CLOSE);
        assert_eq!(
            after(TCP, &[(FWD, RST | ACK), (REP, FIN)]),
            TCP_CLOSE,
            "nothing reopens a reset flow"
        );
    }

    #[test]
    fn udp_is_replied_once_the_backend_answers() {
        assert_eq!(after(UDP, &[(FWD, 0), (FWD, 0)]), UDP_UNREPLIED);
        assert_eq!(after(UDP, &[(FWD, 0), (REP, 0), (FWD, 0)]), UDP_REPLIED);
    }

    #[test]
    fn only_a_bare_syn_or_a_datagram_opens_a_flow() {
        assert!(opens_flow(TCP, SYN));
        assert!(!opens_flow(TCP, SYN | ACK));
        assert!(!opens_flow(TCP, ACK));
        assert!(!opens_flow(TCP, FIN | ACK));
        assert!(opens_flow(UDP, 0));
    }

    #[test]
    fn partners_point_at_each_other() {
        let client = (Ipv4Addr::new(10, 0, 0, 1), 40000);
        let frontend = (Ipv4Addr::new(10, 96, 0, 10), 80);
        let backend = (Ipv4Addr::new(10, 244, 0, 2), 8080);
        let forward = CtKey::new(client.0, client.1, frontend.0, frontend.1, TCP);
        let reply = CtKey::new(backend.0, backend.1, client.0, client.1, TCP);
        let value = |nat: (Ipv4Addr, u16), flags| CtValue {
            flags,
            nat_addr_be: u32::from_ne_bytes(nat.0.octets()),
            nat_port_be: nat.1.to_be(),
            ..bytemuck::Zeroable::zeroed()
        };
        assert_eq!(partner_key(&forward, &value(backend, 0)), reply);
        assert_eq!(partner_key(&reply, &value(frontend, FLAG_REPLY)), forward);
    }

    #[test]
    fn timeouts_are_per_state_and_bounded() {
        let t = CtTimeouts::KERNEL;
        assert_eq!(t.ns(TCP_CLOSE), 10_000_000_000);
        assert!(!t.idle_past(TCP_CLOSE, 5, 10_000_000_005));
        assert!(t.idle_past(TCP_CLOSE, 5, 10_000_000_006));
        assert!(!t.idle_past(TCP_CLOSE, 100, 50), "a clock behind the entry is not idle");
        // Out-of-range states wrap inside the table rather than read past it.
        assert_eq!(t.ns(COUNT as u8 + TCP_CLOSE), t.ns(TCP_CLOSE));
    }
}
