//! Answers for a Service without backends, like kube-proxy's REJECT rule:
//! TCP gets a RST, UDP an ICMP port unreachable, at once, instead of a
//! silent timeout. The packet is rewritten in place into the answer; the
//! hook sends it back where it came from. IPv4's answers are here, with
//! the helpers IPv6's (`ipv6::reject`) share.

use proxy_common::{conntrack::tcp_flags, proto};

use crate::{
    context::{Ctx, ptr_at},
    csum,
    headers::{
        ETH_LEN, EthHdr, ICMP_DEST_UNREACH, ICMP_LEN, ICMP_PORT_UNREACH, IP_DF_BE, IP_LEN, IP_OFF, Ipv4Hdr, L4_OFF,
        TCP_LEN, TcpHdr, UDP_LEN,
    },
    parse::Flow,
};

/// The TTL (IPv4) or hop limit (IPv6) of an answer.
pub const TTL: u8 = 64;
/// The ICMP error quotes the offending IPv4 header and 8 bytes of UDP.
const QUOTE_LEN: usize = IP_LEN + UDP_LEN;

pub enum Rejection {
    /// The packet now holds the answer.
    Answered,
    /// Nothing to answer (a RST is never answered): pass it untouched.
    NotAnswered,
    /// A helper failed after the packet was changed: it must be dropped.
    Failed,
}

#[inline(always)]
pub fn reject(ctx: &impl Ctx, flow: &Flow) -> Rejection {
    answer(
        flow.proto,
        flow.tcp_flags,
        || tcp_rst(ctx, flow),
        || icmp_port_unreachable(ctx, flow),
    )
}

/// Which answer a packet of `l4_proto` (with `tcp_flags`, for TCP) gets,
/// for either family: TCP a RST (but a RST none), anything else a port
/// unreachable.
#[inline(always)]
pub fn answer(
    l4_proto: u8,
    tcp_flags: u8,
    rst: impl FnOnce() -> Rejection,
    port_unreachable: impl FnOnce() -> Rejection,
) -> Rejection {
    if l4_proto != proto::TCP {
        return port_unreachable();
    }
    if tcp_flags & tcp_flags::RST != 0 {
        return Rejection::NotAnswered;
    }
    rst()
}

/// Cuts the frame to `len` bytes if it is longer.
#[inline(always)]
pub fn cut_to(ctx: &impl Ctx, len: usize) -> Result<(), ()> {
    if ctx.frame_len() > len {
        ctx.truncate(len)
    } else {
        Ok(())
    }
}

/// Swaps the Ethernet addresses: the answer goes back where the packet
/// came from.
///
/// # Safety
/// `eth` points to a writable `EthHdr` (in the packet: see `ptr_at`).
#[inline(always)]
pub unsafe fn swap_macs(eth: *mut EthHdr) {
    // SAFETY: the caller's promise.
    unsafe { core::mem::swap(&mut (*eth).dst, &mut (*eth).src) };
}

/// Writes a fresh IPv4 header (no options) with its checksum.
///
/// # Safety
/// `ip` points to a writable `Ipv4Hdr` (in the packet: see `ptr_at`).
#[inline(always)]
unsafe fn write_ipv4(ip: *mut Ipv4Hdr, l4_proto: u8, tot_len: usize, frag_off_be: u16, saddr_be: u32, daddr_be: u32) {
    // SAFETY: the caller's promise; `sum_words` reads the `IP_LEN` bytes
    // of the same header.
    unsafe {
        (*ip).version_ihl = 0x45;
        (*ip).tos = 0;
        (*ip).tot_len_be = (tot_len as u16).to_be();
        (*ip).id_be = 0;
        (*ip).frag_off_be = frag_off_be;
        (*ip).ttl = TTL;
        (*ip).proto = l4_proto;
        (*ip).check = 0;
        (*ip).saddr_be = saddr_be;
        (*ip).daddr_be = daddr_be;
        (*ip).check = !csum::fold(sum_words::<IP_LEN>(ip.cast()));
    }
}

/// One's complement sum of `N` bytes (N even, a constant so the loop unrolls).
///
/// # Safety
/// `p` points to `N` readable bytes (any alignment).
#[inline(always)]
pub unsafe fn sum_words<const N: usize>(p: *const u16) -> u64 {
    let mut sum = 0u64;
    let mut i = 0;
    while i < N / 2 {
        // SAFETY: word `i` of `N / 2` lies within the caller's `N` bytes.
        sum += unsafe { core::ptr::read_unaligned(p.add(i)) } as u64;
        i += 1;
    }
    sum
}

#[inline(always)]
fn tcp_rst(ctx: &impl Ctx, flow: &Flow) -> Rejection {
    const LEN: usize = ETH_LEN + IP_LEN + TCP_LEN;
    if cut_to(ctx, LEN).is_err() {
        return Rejection::NotAnswered;
    }
    let (Some(eth), Some(ip), Some(tcp)) = (
        ptr_at::<EthHdr>(ctx, 0),
        ptr_at::<Ipv4Hdr>(ctx, IP_OFF),
        ptr_at::<TcpHdr>(ctx, L4_OFF),
    ) else {
        return Rejection::Failed;
    };
    let offending = flow.segment();
    let pseudo = csum::add32(csum::add32(0, flow.daddr_be), flow.saddr_be);
    // SAFETY: the three headers are inside the packet (ptr_at, after the
    // truncation), and nothing moves it until they are written.
    unsafe {
        swap_macs(eth);
        write_ipv4(ip, proto::TCP, IP_LEN + TCP_LEN, IP_DF_BE, flow.daddr_be, flow.saddr_be);
        write_rst(tcp, (flow.dport_be, flow.sport_be), &offending, pseudo);
    }
    Rejection::Answered
}

/// The TCP segment a RST answers: what RFC 793 takes its numbers from.
#[derive(Clone, Copy)]
pub struct Segment {
    pub flags: u8,
    /// Sequence and acknowledgment numbers, host order.
    pub seq: u32,
    pub ack: u32,
    /// Payload bytes after the TCP header.
    pub payload_len: u32,
}

/// Writes the RST answering `offending` from `ports_be` (the answer's
/// source and destination port), its checksum over the pseudo-header's
/// addresses (`addr_sum`, the family's) and the header.
///
/// # Safety
/// `tcp` points to a writable `TcpHdr` (in the packet: see `ptr_at`).
#[inline(always)]
pub unsafe fn write_rst(tcp: *mut TcpHdr, ports_be: (u16, u16), offending: &Segment, addr_sum: u64) {
    let (flags, seq, ack) = rst_numbers(offending);
    // SAFETY: the caller's promise; `sum_words` reads the `TCP_LEN` bytes
    // of the same header.
    unsafe {
        (*tcp).sport_be = ports_be.0;
        (*tcp).dport_be = ports_be.1;
        (*tcp).seq_be = seq.to_be();
        (*tcp).ack_seq_be = ack.to_be();
        (*tcp).doff_res = ((TCP_LEN / 4) as u8) << 4;
        (*tcp).flags = flags;
        (*tcp).window_be = 0;
        (*tcp).check = 0;
        (*tcp).urg_ptr_be = 0;
        let pseudo = addr_sum + pseudo_header_tail(proto::TCP, TCP_LEN);
        (*tcp).check = !csum::fold(pseudo + sum_words::<TCP_LEN>(tcp.cast()));
    }
}

/// RFC 793 reset generation: the RST's flags, sequence and acknowledgment
/// numbers (host order). If the offending segment has ACK, the RST takes
/// its sequence number from that ACK; otherwise it acknowledges
/// everything the segment occupied.
#[inline(always)]
fn rst_numbers(offending: &Segment) -> (u8, u32, u32) {
    if offending.flags & tcp_flags::ACK != 0 {
        return (tcp_flags::RST, offending.ack, 0);
    }
    let mut occupied = offending.payload_len;
    if offending.flags & tcp_flags::SYN != 0 {
        occupied += 1;
    }
    if offending.flags & tcp_flags::FIN != 0 {
        occupied += 1;
    }
    (tcp_flags::RST | tcp_flags::ACK, 0, offending.seq.wrapping_add(occupied))
}

/// The pseudo-header's protocol and length, for IPv4 and IPv6 alike (IPv6
/// widens both to 32 bits, whose upper halves are 0 here).
#[inline(always)]
pub fn pseudo_header_tail(l4_proto: u8, l4_len: usize) -> u64 {
    // Protocol and length as big-endian 16-bit words, in the words' memory order.
    (l4_proto as u16).to_be() as u64 + (l4_len as u16).to_be() as u64
}

/// ICMP destination unreachable (port) quoting the packet's IPv4 header and
/// the first 8 bytes of its UDP header, sent from the frontend address.
#[inline(always)]
fn icmp_port_unreachable(ctx: &impl Ctx, flow: &Flow) -> Rejection {
    const LEN: usize = ETH_LEN + IP_LEN + ICMP_LEN + QUOTE_LEN;
    // Keep the original headers: the answer quotes them as received.
    let Some(quote) = ptr_at::<[u8; QUOTE_LEN]>(ctx, IP_OFF) else {
        return Rejection::NotAnswered;
    };
    // SAFETY: inside the packet (ptr_at); copied out before it is grown.
    let quote = unsafe { *quote };
    let macs = match grow_for_error(ctx, (IP_LEN + ICMP_LEN) as u32, LEN) {
        Ok(macs) => macs,
        Err(rejection) => return rejection,
    };
    let (Some(eth), Some(ip), Some(icmp), Some(quote_out)) = (
        ptr_at::<EthHdr>(ctx, 0),
        ptr_at::<Ipv4Hdr>(ctx, IP_OFF),
        ptr_at::<[u8; ICMP_LEN]>(ctx, L4_OFF),
        ptr_at::<[u8; QUOTE_LEN]>(ctx, L4_OFF + ICMP_LEN),
    ) else {
        return Rejection::Failed;
    };
    // SAFETY: `macs` is a local; every other pointer is inside the packet
    // (ptr_at, after the last resize), and nothing moves it until written.
    unsafe {
        core::ptr::write(eth, macs);
        *quote_out = quote;
        let tot_len = IP_LEN + ICMP_LEN + QUOTE_LEN;
        write_ipv4(ip, proto::ICMP, tot_len, 0, flow.daddr_be, flow.saddr_be);
        // `quote` is a local array of the length summed.
        let quote_sum = sum_words::<QUOTE_LEN>(quote.as_ptr().cast());
        *icmp = error_header(ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, quote_sum);
    }
    Rejection::Answered
}

/// Makes room for an error's headers (`room` bytes after the Ethernet
/// header) and cuts the frame to `len` bytes: the answer's Ethernet
/// header (the packet's, its addresses swapped) is returned, for the
/// caller to write after everything else in front of the quote.
#[inline(always)]
pub fn grow_for_error(ctx: &impl Ctx, room: u32, len: usize) -> Result<EthHdr, Rejection> {
    let eth = ptr_at::<EthHdr>(ctx, 0).ok_or(Rejection::NotAnswered)?;
    // SAFETY: inside the packet (ptr_at); copied out before it is grown.
    let mut macs = unsafe { core::ptr::read(eth) };
    // SAFETY: `macs` is a local.
    unsafe { swap_macs(&mut macs) };
    ctx.grow_after_eth(room).map_err(|()| Rejection::NotAnswered)?;
    cut_to(ctx, len).map_err(|()| Rejection::Failed)?;
    Ok(macs)
}

/// An ICMP or ICMPv6 error's header (`icmp_type`, `code`, 4 unused
/// bytes), its checksum over it and `rest_sum`: the sum of everything
/// else it covers (the quote; for ICMPv6 the pseudo-header too).
#[inline(always)]
pub fn error_header(icmp_type: u8, code: u8, rest_sum: u64) -> [u8; ICMP_LEN] {
    let mut header = [icmp_type, code, 0, 0, 0, 0, 0, 0];
    // SAFETY: a local array of the length summed.
    let sum = unsafe { sum_words::<ICMP_LEN>(header.as_ptr().cast()) } + rest_sum;
    let check = (!csum::fold(sum)).to_ne_bytes();
    header[2] = check[0];
    header[3] = check[1];
    header
}
