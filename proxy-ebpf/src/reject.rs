//! Answers for a Service without backends, like kube-proxy's REJECT rule:
//! TCP gets a RST, UDP an ICMP port unreachable, at once, instead of a
//! silent timeout. The packet is rewritten in place into the answer; the
//! hook sends it back where it came from.

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

const TTL: u8 = 64;
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
    if flow.proto == proto::TCP {
        if flow.tcp_flags & tcp_flags::RST != 0 {
            return Rejection::NotAnswered;
        }
        tcp_rst(ctx, flow)
    } else {
        icmp_port_unreachable(ctx, flow)
    }
}

/// Swaps the Ethernet addresses: the answer goes back where the packet
/// came from.
///
/// # Safety
/// `eth` points to a writable `EthHdr` (in the packet: see `ptr_at`).
#[inline(always)]
unsafe fn swap_macs(eth: *mut EthHdr) {
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
unsafe fn sum_words<const N: usize>(p: *const u16) -> u64 {
    let mut sum = 0u64;
    let mut i = 0;
    while i < N / 2 {
        // SAFETY: word `i` of `N / 2` lies within the caller's `N` bytes.
        sum += unsafe { core::ptr::read_unaligned(p.add(i)) } as u64;
        i += 1;
    }
    sum
}

/// RFC 793 reset generation: if the offending segment has ACK, the RST
/// takes its sequence number from that ACK; otherwise it acknowledges
/// everything the segment occupied.
#[inline(always)]
fn tcp_rst(ctx: &impl Ctx, flow: &Flow) -> Rejection {
    const LEN: usize = ETH_LEN + IP_LEN + TCP_LEN;
    if ctx.frame_len() > LEN && ctx.truncate(LEN).is_err() {
        return Rejection::NotAnswered;
    }
    let (Some(eth), Some(ip), Some(tcp)) = (
        ptr_at::<EthHdr>(ctx, 0),
        ptr_at::<Ipv4Hdr>(ctx, IP_OFF),
        ptr_at::<TcpHdr>(ctx, L4_OFF),
    ) else {
        return Rejection::Failed;
    };
    let (flags, seq, ack) = rst_numbers(flow);
    // SAFETY: the three headers are inside the packet (ptr_at, after the
    // truncation), and nothing moves it until they are written.
    unsafe {
        swap_macs(eth);
        write_ipv4(ip, proto::TCP, IP_LEN + TCP_LEN, IP_DF_BE, flow.daddr_be, flow.saddr_be);
        (*tcp).sport_be = flow.dport_be;
        (*tcp).dport_be = flow.sport_be;
        (*tcp).seq_be = seq.to_be();
        (*tcp).ack_seq_be = ack.to_be();
        (*tcp).doff_res = ((TCP_LEN / 4) as u8) << 4;
        (*tcp).flags = flags;
        (*tcp).window_be = 0;
        (*tcp).check = 0;
        (*tcp).urg_ptr_be = 0;
        let pseudo = pseudo_header_sum(flow.daddr_be, flow.saddr_be, proto::TCP, TCP_LEN);
        (*tcp).check = !csum::fold(pseudo + sum_words::<TCP_LEN>(tcp.cast()));
    }
    Rejection::Answered
}

/// The RST's flags, sequence and acknowledgment numbers (host order).
#[inline(always)]
fn rst_numbers(flow: &Flow) -> (u8, u32, u32) {
    if flow.tcp_flags & tcp_flags::ACK != 0 {
        return (tcp_flags::RST, flow.tcp_ack, 0);
    }
    let mut occupied = flow.payload_len;
    if flow.tcp_flags & tcp_flags::SYN != 0 {
        occupied += 1;
    }
    if flow.tcp_flags & tcp_flags::FIN != 0 {
        occupied += 1;
    }
    (tcp_flags::RST | tcp_flags::ACK, 0, flow.tcp_seq.wrapping_add(occupied))
}

#[inline(always)]
fn pseudo_header_sum(saddr_be: u32, daddr_be: u32, l4_proto: u8, l4_len: usize) -> u64 {
    let sum = csum::add32(csum::add32(0, saddr_be), daddr_be);
    // Protocol and length as big-endian 16-bit words, in the words' memory order.
    sum + (l4_proto as u16).to_be() as u64 + (l4_len as u16).to_be() as u64
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
    let Some(eth) = ptr_at::<EthHdr>(ctx, 0) else {
        return Rejection::NotAnswered;
    };
    // SAFETY: both are inside the packet (ptr_at); copied out before the
    // packet is grown.
    let (quote, mut macs) = unsafe { (*quote, core::ptr::read(eth)) };
    if ctx.grow_for_icmp().is_err() {
        return Rejection::NotAnswered;
    }
    if ctx.frame_len() > LEN && ctx.truncate(LEN).is_err() {
        return Rejection::Failed;
    }
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
        swap_macs(&mut macs);
        core::ptr::write(eth, macs);
        *quote_out = quote;
        let tot_len = IP_LEN + ICMP_LEN + QUOTE_LEN;
        write_ipv4(ip, proto::ICMP, tot_len, 0, flow.daddr_be, flow.saddr_be);
        *icmp = icmp_header(&quote);
    }
    Rejection::Answered
}

/// The port unreachable's ICMP header, its checksum over it and `quote`.
#[inline(always)]
fn icmp_header(quote: &[u8; QUOTE_LEN]) -> [u8; ICMP_LEN] {
    let mut header = [ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
    // SAFETY: both are local arrays of the lengths summed.
    let sum = unsafe { sum_words::<ICMP_LEN>(header.as_ptr().cast()) + sum_words::<QUOTE_LEN>(quote.as_ptr().cast()) };
    let check = (!csum::fold(sum)).to_ne_bytes();
    header[2] = check[0];
    header[3] = check[1];
    header
}
