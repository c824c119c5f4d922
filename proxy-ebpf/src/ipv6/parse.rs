//! IPv6 header parsing: the fixed header, a bounded walk over extension
//! headers to the L4 header, and the same policy for malformed input as
//! IPv4's (`parse`): translated only if every header up to the ports was
//! read and is consistent, else passed untouched and counted.
//!
//! The walk follows at most [`MAX_EXT_HEADERS`] extension headers
//! (hop-by-hop options, routing, destination options, fragment). A packet
//! whose L4 header lies deeper is passed untouched as malformed: real
//! Service traffic carries none or one, and the bound keeps the verifier's
//! walk short. A fragment header of a real fragment (an offset or more to
//! come) marks the flow's [`Fragment`] for `fragments`: the first one is
//! parsed as a whole datagram, a later one has no L4 header and comes out
//! with ports 0; only a fragment header right before TCP or UDP counts
//! (any other, e.g. destination options in the fragmentable part, passes
//! untouched). An atomic fragment (offset 0, no more) is a whole datagram.
//! SCTP's common header gives its ports as IPv4's (SCTP fragments pass
//! untouched, as any fragment not right before TCP or UDP). An ICMPv6
//! error quoting TCP or UDP is handed to `icmp_error`; the rest
//! of ICMPv6 (neighbour discovery, echo), ESP, AH and anything else is
//! not Service traffic.

use proxy_common::{Verdict, proto};

use crate::{
    context::{Addr6, Ctx, ptr_at, ptr_at_fresh},
    headers::{IP_OFF, IPV6_LEN, Ipv6Hdr, SctpHdr, TcpHdr, UdpHdr},
    parse::{Fragment, sctp_flow, tcp_flow, udp_flow},
    reject::Segment,
};

/// Extension headers the walk follows before it gives up.
pub const MAX_EXT_HEADERS: usize = 4;

/// Where the first header after the fixed IPv6 header starts.
const AFTER_IP_OFF: usize = IP_OFF + IPV6_LEN;

/// Next header values of the extension headers the walk follows.
const NEXT_HOP_BY_HOP: u8 = 0;
const NEXT_ROUTING: u8 = 43;
const NEXT_FRAGMENT: u8 = 44;
const NEXT_DEST_OPTS: u8 = 60;

/// A fragment header's offset (high 13 bits) and "more fragments" (bit 0)
/// in its host-order `frag_off` field.
const FRAG_OFFSET_AND_MORE: u16 = 0xfff9;
const FRAG_OFFSET: u16 = 0xfff8;

/// The first bytes every extension header but the fragment one starts
/// with; its length is `(len + 1) * 8` bytes.
#[repr(C)]
struct ExtHdr {
    next_header: u8,
    len: u8,
}

#[repr(C)]
struct FragHdr {
    next_header: u8,
    _reserved: u8,
    frag_off_be: u16,
    id_be: u32,
}

const FRAG_LEN: usize = 8;

/// What the rest of the IPv6 path needs to know about a parsed packet.
#[derive(Clone, Copy)]
pub struct Flow6 {
    pub saddr_be: Addr6,
    pub daddr_be: Addr6,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    /// TCP flags (0 for UDP).
    pub tcp_flags: u8,
    /// Where the TCP, UDP or SCTP header starts in the frame.
    pub l4_off: usize,
    /// The TCP segment's numbers, for a RST (`reject`).
    pub segment: Segment,
    pub fragment: Fragment,
    /// The fragment header's id, network byte order (0 if none).
    pub frag_id_be: u32,
    /// An ICMPv6 error quoting a TCP/UDP packet: the tuple above is the
    /// quoted packet's, reversed, `l4_off` the ICMPv6 header's (see
    /// `icmp_error`).
    pub icmp_error: bool,
}

/// The addresses by reference: the rewrite and the keys take them so,
/// and a copy of 16 bytes is stack IPv6 has little of (see `conntrack`).
impl Flow6 {
    #[inline(always)]
    pub fn saddr(&self) -> &Addr6 {
        &self.saddr_be
    }
    #[inline(always)]
    pub fn daddr(&self) -> &Addr6 {
        &self.daddr_be
    }
}

/// Parses the IPv6 header, its extension headers and TCP/UDP/SCTP, or says
/// why the packet is not ours. The caller checked the ether type.
#[inline(always)]
pub fn parse(ctx: &impl Ctx) -> Result<Flow6, Verdict> {
    let ip: *const Ipv6Hdr = ptr_at(ctx, IP_OFF).ok_or(Verdict::PassMalformed)?;
    // SAFETY: the header is inside the packet (ptr_at).
    let (version, payload_len, next, mut saddr_be, mut daddr_be) = unsafe {
        (
            u32::from_be((*ip).vtc_flow_be) >> 28,
            u16::from_be((*ip).payload_len_be) as usize,
            (*ip).next_header,
            (*ip).saddr_be,
            (*ip).daddr_be,
        )
    };
    // A payload length of 0 is a jumbogram's (RFC 2675): not ours.
    if version != 6 || payload_len == 0 || payload_len > ctx.frame_len().saturating_sub(AFTER_IP_OFF) {
        return Err(Verdict::PassMalformed);
    }
    let found = l4_header(ctx, next)?;
    let (l4_proto, l4_off) = (found.proto, alike(ctx, found.off));
    let end = AFTER_IP_OFF + payload_len;
    if !(AFTER_IP_OFF..=MAX_L4_OFF).contains(&l4_off) || l4_off >= end {
        return Err(Verdict::PassMalformed);
    }
    let l4_len = end - l4_off;
    let icmp_error = l4_proto == proto::ICMPV6;
    // One `Flow6` built below for every kind: a second one (an ICMPv6
    // error's) would be stack the programs do not have.
    let l4 = if icmp_error {
        super::icmp_error::quoted(ctx, l4_off, end, &mut saddr_be, &mut daddr_be)?
    } else if found.fragment == Fragment::Later {
        crate::parse::Flow::empty(l4_proto)
    } else if l4_proto == proto::TCP {
        let tcp: *const TcpHdr = header_at(ctx, l4_off)?;
        // SAFETY: the header is inside the packet (header_at).
        unsafe { tcp_flow(tcp, l4_len)? }
    } else if l4_proto == proto::SCTP {
        let sctp: *const SctpHdr = header_at(ctx, l4_off)?;
        // SAFETY: the header is inside the packet (header_at).
        unsafe { sctp_flow(sctp, l4_len)? }
    } else {
        let udp: *const UdpHdr = header_at(ctx, l4_off)?;
        // SAFETY: the header is inside the packet (header_at).
        unsafe { udp_flow(udp, l4_len, found.fragment == Fragment::First)? }
    };
    Ok(Flow6 {
        saddr_be,
        daddr_be,
        sport_be: l4.sport_be,
        dport_be: l4.dport_be,
        proto: l4.proto,
        tcp_flags: l4.tcp_flags,
        l4_off,
        segment: l4.segment(),
        fragment: found.fragment,
        frag_id_be: found.frag_id_be,
        icmp_error,
    })
}

/// Where the walk found the upper-layer header, and the fragment header's
/// word on it.
struct Found {
    proto: u8,
    off: usize,
    fragment: Fragment,
    frag_id_be: u32,
}

/// The furthest the walk's L4 offset can be: every header at its longest.
const MAX_L4_OFF: usize = AFTER_IP_OFF + MAX_EXT_HEADERS * 256 * 8;

/// A mask that leaves every offset the walk can reach as it is.
const L4_OFF_MASK: usize = 0x3fff;
const _: () = assert!(MAX_L4_OFF <= L4_OFF_MASK);

/// `off` itself, in a form the verifier cannot tell apart from any other
/// offset (`off + w - w` with `w` read twice: [`Ctx::opaque_word`]). Each
/// way through the walk (no extension header, one of each kind, two, ...)
/// ends with its own known range of offsets, and the verifier would walk
/// the whole Service path once for each: ten times IPv4's instructions.
/// Made alike they are one state to it. The mask bounds the result in the
/// register itself: a bound learnt from a comparison instead is lost on
/// 6.1 when LLVM reloads the value from the stack (6.1's verifier does
/// not carry it over to the spilled copy).
#[inline(always)]
pub fn alike(ctx: &impl Ctx, off: usize) -> usize {
    off.wrapping_add(ctx.opaque_word()).wrapping_sub(ctx.opaque_word()) & L4_OFF_MASK
}

/// Walks the extension headers from `next` (the fixed header's next
/// header) to the TCP or UDP header: its protocol and offset (for a later
/// fragment, where its payload starts).
#[inline(always)]
fn l4_header(ctx: &impl Ctx, mut next: u8) -> Result<Found, Verdict> {
    let mut found = Found {
        proto: 0,
        off: AFTER_IP_OFF,
        fragment: Fragment::None,
        frag_id_be: 0,
    };
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            proto::TCP | proto::UDP | proto::SCTP | proto::ICMPV6 => {
                found.proto = next;
                return Ok(found);
            }
            NEXT_HOP_BY_HOP | NEXT_ROUTING | NEXT_DEST_OPTS => {
                let ext: *const ExtHdr = header_at(ctx, found.off)?;
                // SAFETY: the header's first bytes are inside the packet (header_at).
                let (following, len) = unsafe { ((*ext).next_header, (*ext).len) };
                next = following;
                found.off += (len as usize + 1) * 8;
            }
            NEXT_FRAGMENT => {
                let frag: *const FragHdr = header_at(ctx, found.off)?;
                // SAFETY: the header is inside the packet (header_at).
                let (following, frag_off, id_be) =
                    unsafe { ((*frag).next_header, u16::from_be((*frag).frag_off_be), (*frag).id_be) };
                found.fragment = fragment_of(frag_off, following)?;
                found.frag_id_be = id_be;
                next = following;
                found.off += FRAG_LEN;
                if found.fragment == Fragment::Later {
                    found.proto = next;
                    return Ok(found);
                }
            }
            _ => return Err(Verdict::PassNotIpv4OrL4),
        }
    }
    // Deeper than the walk goes: passed untouched (see the module doc).
    match next {
        proto::TCP | proto::UDP | proto::SCTP => {
            found.proto = next;
            Ok(found)
        }
        _ => Err(Verdict::PassMalformed),
    }
}

/// Where a packet with a fragment header stands among its datagram's
/// fragments (`frag_off` host order, `following` the next header); a real
/// fragment not right before TCP or UDP is not translated.
#[inline(always)]
fn fragment_of(frag_off: u16, following: u8) -> Result<Fragment, Verdict> {
    if frag_off & FRAG_OFFSET_AND_MORE == 0 {
        return Ok(Fragment::None);
    }
    if following != proto::TCP && following != proto::UDP {
        return Err(Verdict::PassFragmentUntracked);
    }
    if frag_off & FRAG_OFFSET != 0 {
        Ok(Fragment::Later)
    } else {
        Ok(Fragment::First)
    }
}

/// A `T` at `off`, pulled into the linear part of an skb first if it is
/// in the frame but not there yet (extension headers may reach past what
/// the hook pulled).
///
/// No test against the frame's length first: on XDP, where that length is
/// `data_end - data`, LLVM took such a test for the bounds check and left
/// out `ptr_at`'s, which the verifier needs to see.
#[inline(always)]
pub(super) fn header_at<T>(ctx: &impl Ctx, off: usize) -> Result<*const T, Verdict> {
    make_linear::<T>(ctx, off);
    ptr_at_fresh::<T>(ctx, off)
        .map(|p| p as *const T)
        .ok_or(Verdict::PassMalformed)
}

/// Pulls a `T` at `off` into the linear part if it is not there: only
/// then, so a packet whose headers are (almost every one) pays no helper
/// call. Packet pointers taken before are invalid after.
#[inline(always)]
fn make_linear<T>(ctx: &impl Ctx, off: usize) {
    if ptr_at_fresh::<T>(ctx, off).is_none() {
        ctx.pull(off + core::mem::size_of::<T>());
    }
}
