//! Header parsing and the one policy for malformed input (IPv4 here; the
//! IPv6 header and its extension headers are `ipv6::parse`'s, which takes
//! the TCP and UDP parsers from here).
//!
//! A packet is translated only if every header up to and including the L4
//! ports was read and is consistent. Everything else is passed untouched and
//! counted; nothing here ever writes. Accepting only IHL = 5 (no IP options)
//! and untagged frames keeps every header at a constant offset, which is also
//! what keeps the verifier's job simple.
//!
//! IPv4 fragments: the first one is parsed like a whole datagram (its L4
//! header is there; the datagram's length reaches into the later ones); a
//! later one has no L4 header, and comes out with ports 0 and
//! [`Fragment::Later`] for `fragments` to fill in.

use proxy_common::{Verdict, proto};

use crate::{
    context::{Ctx, ptr_at},
    headers::{
        ETH_LEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, EthHdr, ICMP_DEST_UNREACH, ICMP_TIME_EXCEEDED,
        INNER_IP_OFF, INNER_L4_OFF, IP_LEN, IP_MF, IP_OFF, IP_OFFSET_MASK, Ipv4Hdr, L4_OFF, SCTP_LEN, SctpHdr, TCP_LEN,
        TcpHdr, UDP_LEN, UdpHdr,
    },
    reject::Segment,
};

/// Where a packet stands among its datagram's IPv4 fragments.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    /// A whole datagram.
    None,
    /// The first fragment: it has the L4 header.
    First,
    /// A later fragment: payload only; the ports are the first's.
    Later,
}

/// What the rest of the program needs to know about a parsed packet.
#[derive(Clone, Copy)]
pub struct Flow {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
    /// TCP sequence and acknowledgment numbers, host order (for a RST).
    pub tcp_seq: u32,
    pub tcp_ack: u32,
    /// L4 payload bytes after the TCP, UDP or SCTP common header.
    pub payload_len: u32,
    pub fragment: Fragment,
    /// IP identification, network byte order (ties fragments together).
    pub ip_id_be: u16,
    /// An ICMP error quoting a TCP/UDP packet: the tuple above is the
    /// quoted packet's, reversed (see `icmp_error`), `proto` its protocol.
    pub icmp_error: bool,
}

impl Flow {
    /// A flow of `proto` whose every other field is zero, for a parser to
    /// fill in.
    #[inline(always)]
    pub fn empty(proto: u8) -> Flow {
        Flow {
            saddr_be: 0,
            daddr_be: 0,
            sport_be: 0,
            dport_be: 0,
            proto,
            tcp_flags: 0,
            tcp_seq: 0,
            tcp_ack: 0,
            payload_len: 0,
            fragment: Fragment::None,
            ip_id_be: 0,
            icmp_error: false,
        }
    }

    /// The TCP segment's numbers, for a RST answering it.
    #[inline(always)]
    pub fn segment(&self) -> Segment {
        Segment {
            flags: self.tcp_flags,
            seq: self.tcp_seq,
            ack: self.tcp_ack,
            payload_len: self.payload_len,
        }
    }

    /// A later fragment: there is no L4 header to read or rewrite.
    #[inline(always)]
    pub fn is_later_fragment(&self) -> bool {
        self.fragment == Fragment::Later
    }
}

/// Parses Ethernet, IPv4 and TCP/UDP/SCTP, or says why the packet is not
/// ours.
#[inline(always)]
pub fn parse(ctx: &impl Ctx) -> Result<Flow, Verdict> {
    untagged_ipv4(ctx)?;
    let ip: *const Ipv4Hdr = ptr_at(ctx, IP_OFF).ok_or(Verdict::PassMalformed)?;
    // SAFETY: the header is inside the packet (ptr_at).
    let (version_ihl, tot_len, frag_off, l4_proto) = unsafe {
        (
            (*ip).version_ihl,
            u16::from_be((*ip).tot_len_be) as usize,
            u16::from_be((*ip).frag_off_be),
            (*ip).proto,
        )
    };
    // Version 4 and IHL exactly 5: options are never rewritten around.
    if version_ihl != 0x45 {
        return Err(Verdict::PassMalformed);
    }
    if tot_len < IP_LEN || tot_len > ctx.frame_len().saturating_sub(ETH_LEN) {
        return Err(Verdict::PassMalformed);
    }
    // SAFETY: the header is inside the packet (ptr_at).
    let (saddr_be, daddr_be, ip_id_be) = unsafe { ((*ip).saddr_be, (*ip).daddr_be, (*ip).id_be) };
    if l4_proto == proto::ICMP && frag_off & (IP_MF | IP_OFFSET_MASK) == 0 {
        return icmp_error(ctx, tot_len);
    }
    if l4_proto != proto::TCP && l4_proto != proto::UDP && l4_proto != proto::SCTP {
        return Err(Verdict::PassNotIpv4OrL4);
    }
    let fragment = fragment_of(frag_off);
    let flow = parse_l4(ctx, l4_proto, fragment, tot_len - IP_LEN)?;
    Ok(Flow {
        saddr_be,
        daddr_be,
        fragment,
        ip_id_be,
        icmp_error: false,
        ..flow
    })
}

/// An untagged Ethernet frame carrying IPv4, or why the packet is not ours.
#[inline(always)]
fn untagged_ipv4(ctx: &impl Ctx) -> Result<(), Verdict> {
    let eth: *const EthHdr = ptr_at(ctx, 0).ok_or(Verdict::PassMalformed)?;
    // SAFETY: the header is inside the packet (ptr_at).
    let ether_type = u16::from_be(unsafe { (*eth).ether_type_be });
    if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        // A tagged frame is translated on its VLAN device, not here.
        return Err(Verdict::PassMalformed);
    }
    if ether_type != ETH_P_IP {
        return Err(Verdict::PassNotIpv4OrL4);
    }
    Ok(())
}

/// Whether the frame is an untagged IPv6 packet (`ipv6` parses it).
#[inline(always)]
pub fn is_ipv6(ctx: &impl Ctx) -> bool {
    match ptr_at::<EthHdr>(ctx, 0) {
        // SAFETY: the header is inside the packet (ptr_at).
        Some(eth) => u16::from_be(unsafe { (*eth).ether_type_be }) == ETH_P_IPV6,
        None => false,
    }
}

/// Where the packet stands among its datagram's fragments, from its IPv4
/// `frag_off` (host order).
#[inline(always)]
fn fragment_of(frag_off: u16) -> Fragment {
    if frag_off & IP_OFFSET_MASK != 0 {
        Fragment::Later
    } else if frag_off & IP_MF != 0 {
        Fragment::First
    } else {
        Fragment::None
    }
}

/// The L4 header's part of the flow (`l4_len` bytes from the IPv4 header
/// on): none in a later fragment, whose ports are the first fragment's.
#[inline(always)]
fn parse_l4(ctx: &impl Ctx, l4_proto: u8, fragment: Fragment, l4_len: usize) -> Result<Flow, Verdict> {
    match (fragment, l4_proto) {
        (Fragment::Later, _) => Ok(Flow::empty(l4_proto)),
        (_, proto::TCP) => parse_tcp(ctx, l4_len),
        (_, proto::SCTP) => parse_sctp(ctx, l4_len),
        _ => parse_udp(ctx, l4_len, fragment == Fragment::First),
    }
}

/// An ICMP error quoting a TCP or UDP packet (IHL 5, a first or whole
/// datagram, ports quoted) as the flow of that packet's answer: its tuple
/// reversed, which is the conntrack key of the direction the error travels
/// (see `icmp_error`). Anything else ICMP is not ours.
#[inline(always)]
fn icmp_error(ctx: &impl Ctx, tot_len: usize) -> Result<Flow, Verdict> {
    let not_ours = Verdict::PassNotIpv4OrL4;
    let icmp_type: *const u8 = ptr_at(ctx, L4_OFF).ok_or(not_ours)?;
    // SAFETY: the byte is inside the packet (ptr_at).
    let icmp_type = unsafe { *icmp_type };
    if icmp_type != ICMP_DEST_UNREACH && icmp_type != ICMP_TIME_EXCEEDED {
        return Err(not_ours);
    }
    let inner: *const Ipv4Hdr = ptr_at(ctx, INNER_IP_OFF).ok_or(not_ours)?;
    let ports: *const [u16; 2] = ptr_at(ctx, INNER_L4_OFF).ok_or(not_ours)?;
    if tot_len < INNER_L4_OFF + 4 - ETH_LEN {
        return Err(not_ours);
    }
    // SAFETY: the quoted header is inside the packet (ptr_at).
    let (version_ihl, frag_off, proto, saddr_be, daddr_be) = unsafe {
        (
            (*inner).version_ihl,
            u16::from_be((*inner).frag_off_be),
            (*inner).proto,
            (*inner).saddr_be,
            (*inner).daddr_be,
        )
    };
    // SAFETY: the quoted ports are inside the packet (ptr_at).
    let [sport_be, dport_be] = unsafe { *ports };
    let quoted_l4 = proto == proto::TCP || proto == proto::UDP;
    if version_ihl != 0x45 || frag_off & IP_OFFSET_MASK != 0 || !quoted_l4 || sport_be == 0 || dport_be == 0 {
        return Err(not_ours);
    }
    Ok(Flow {
        saddr_be: daddr_be,
        daddr_be: saddr_be,
        sport_be: dport_be,
        dport_be: sport_be,
        icmp_error: true,
        ..Flow::empty(proto)
    })
}

#[inline(always)]
fn parse_tcp(ctx: &impl Ctx, l4_len: usize) -> Result<Flow, Verdict> {
    let tcp: *const TcpHdr = ptr_at(ctx, L4_OFF).ok_or(Verdict::PassMalformed)?;
    // SAFETY: the header is inside the packet (ptr_at).
    unsafe { tcp_flow(tcp, l4_len) }
}

/// The TCP header `tcp` (of `l4_len` bytes with its payload) as a flow:
/// its ports, flags and sequence numbers (the addresses are the caller's
/// to fill in). For IPv4 and IPv6 (`ipv6::parse`) alike.
///
/// # Safety
/// `tcp` points to a whole TCP header inside the packet (see `ptr_at`).
#[inline(always)]
pub unsafe fn tcp_flow(tcp: *const TcpHdr, l4_len: usize) -> Result<Flow, Verdict> {
    // SAFETY: the caller's promise.
    let (sport_be, dport_be, doff_res, flags, seq, ack) = unsafe {
        (
            (*tcp).sport_be,
            (*tcp).dport_be,
            (*tcp).doff_res,
            (*tcp).flags,
            u32::from_be((*tcp).seq_be),
            u32::from_be((*tcp).ack_seq_be),
        )
    };
    let header_len = ((doff_res >> 4) as usize) * 4;
    if header_len < TCP_LEN || header_len > l4_len {
        return Err(Verdict::PassMalformed);
    }
    check_ports(sport_be, dport_be)?;
    Ok(Flow {
        sport_be,
        dport_be,
        tcp_flags: flags,
        tcp_seq: seq,
        tcp_ack: ack,
        payload_len: (l4_len - header_len) as u32,
        ..Flow::empty(proto::TCP)
    })
}

/// A first fragment holds the UDP header but only part of the datagram:
/// its length may reach past this packet (not past the IPv4 maximum).
#[inline(always)]
fn parse_udp(ctx: &impl Ctx, l4_len: usize, first_fragment: bool) -> Result<Flow, Verdict> {
    let udp: *const UdpHdr = ptr_at(ctx, L4_OFF).ok_or(Verdict::PassMalformed)?;
    // SAFETY: the header is inside the packet (ptr_at).
    unsafe { udp_flow(udp, l4_len, first_fragment) }
}

/// The UDP header `udp` as a flow, as [`tcp_flow`].
///
/// # Safety
/// `udp` points to a whole UDP header inside the packet (see `ptr_at`).
#[inline(always)]
pub unsafe fn udp_flow(udp: *const UdpHdr, l4_len: usize, first_fragment: bool) -> Result<Flow, Verdict> {
    // SAFETY: the caller's promise.
    let (sport_be, dport_be, udp_len) =
        unsafe { ((*udp).sport_be, (*udp).dport_be, u16::from_be((*udp).len_be) as usize) };
    let fits = udp_len <= l4_len || (first_fragment && l4_len >= UDP_LEN);
    if udp_len < UDP_LEN || !fits {
        return Err(Verdict::PassMalformed);
    }
    check_ports(sport_be, dport_be)?;
    Ok(Flow {
        sport_be,
        dport_be,
        payload_len: (udp_len - UDP_LEN) as u32,
        ..Flow::empty(proto::UDP)
    })
}

/// SCTP: the common header (ports where UDP has them, the verification
/// tag, the CRC32c) must be there; the chunks are not read. Its flows are
/// tracked as UDP's are (unreplied, replied, idle timeouts).
#[inline(always)]
fn parse_sctp(ctx: &impl Ctx, l4_len: usize) -> Result<Flow, Verdict> {
    let sctp: *const SctpHdr = ptr_at(ctx, L4_OFF).ok_or(Verdict::PassMalformed)?;
    // SAFETY: the header is inside the packet (ptr_at).
    unsafe { sctp_flow(sctp, l4_len) }
}

/// The flow of the SCTP common header at `sctp`, `l4_len` bytes from it
/// to the end of the IP payload (see [`parse_sctp`]).
///
/// # Safety
/// `sctp` points at a whole `SctpHdr` inside the packet.
#[inline(always)]
pub unsafe fn sctp_flow(sctp: *const SctpHdr, l4_len: usize) -> Result<Flow, Verdict> {
    if l4_len < SCTP_LEN {
        return Err(Verdict::PassMalformed);
    }
    // SAFETY: the caller's promise.
    let (sport_be, dport_be) = unsafe { ((*sctp).sport_be, (*sctp).dport_be) };
    check_ports(sport_be, dport_be)?;
    Ok(Flow {
        sport_be,
        dport_be,
        payload_len: (l4_len - SCTP_LEN) as u32,
        ..Flow::empty(proto::SCTP)
    })
}

/// Port 0 is reserved: no Service or client uses it.
#[inline(always)]
fn check_ports(sport_be: u16, dport_be: u16) -> Result<(), Verdict> {
    if sport_be == 0 || dport_be == 0 {
        Err(Verdict::PassMalformed)
    } else {
        Ok(())
    }
}
