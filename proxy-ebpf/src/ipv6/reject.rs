//! IPv6's answers for a Service without backends, as IPv4's
//! (`crate::reject`, whose helpers they share): a RST for TCP, an ICMPv6
//! port unreachable for UDP. The answer has no extension headers: the
//! packet's are overwritten (RST) or quoted. The ICMPv6 error quotes as
//! much of the packet as fits in the IPv6 minimum MTU (RFC 4443 2.4 (c)),
//! so its checksum covers up to 1232 quoted bytes: summed in pieces of
//! constant sizes (see [`quote_sum`]).

use aya_ebpf::helpers::bpf_csum_diff;
use proxy_common::proto;

use super::parse::Flow6;
use crate::{
    context::{Ctx, ptr_at_fresh},
    csum,
    headers::{
        EthHdr, ICMP_LEN, ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, IP_OFF, IPV6_LEN, IPV6_MIN_MTU, Ipv6Hdr, TCP_LEN,
        TcpHdr,
    },
    reject::{Rejection, TTL, answer, cut_to, error_header, grow_for_error, pseudo_header_tail, swap_macs, write_rst},
};

/// Where the answer's L4 header (TCP or ICMPv6) goes: right after its
/// IPv6 header.
const ANSWER_L4_OFF: usize = IP_OFF + IPV6_LEN;
/// Where the ICMPv6 error's quote of the packet starts.
const QUOTE_OFF: usize = ANSWER_L4_OFF + ICMP_LEN;
/// The longest quote: the error at the minimum MTU.
const QUOTE_MAX: usize = IPV6_MIN_MTU - IPV6_LEN - ICMP_LEN;
/// A mask that keeps every quote length as it is, and bounds it in the
/// register for the verifier (see `quote_sum`).
const QUOTE_MASK: usize = 0x7ff;
const _: () = assert!(QUOTE_MAX <= QUOTE_MASK);
/// The most bytes `bpf_csum_diff` sums in a call.
const CSUM_DIFF_MAX: usize = 512;

#[inline(always)]
pub fn reject(ctx: &impl Ctx, flow: &Flow6) -> Rejection {
    answer(
        flow.proto,
        flow.tcp_flags,
        || tcp_rst(ctx, flow),
        || port_unreachable(ctx, flow),
    )
}

/// The RST (see `crate::reject::write_rst`), from the frontend.
#[inline(always)]
fn tcp_rst(ctx: &impl Ctx, flow: &Flow6) -> Rejection {
    if cut_to(ctx, ANSWER_L4_OFF + TCP_LEN).is_err() {
        return Rejection::NotAnswered;
    }
    let (Some(eth), Some(ip), Some(tcp)) = (
        ptr_at_fresh::<EthHdr>(ctx, 0),
        ptr_at_fresh::<Ipv6Hdr>(ctx, IP_OFF),
        ptr_at_fresh::<TcpHdr>(ctx, ANSWER_L4_OFF),
    ) else {
        return Rejection::Failed;
    };
    // SAFETY: the three headers are inside the packet (ptr_at_fresh, after
    // the truncation), and nothing moves it until they are written.
    unsafe {
        swap_macs(eth);
        write_ipv6(ip, proto::TCP, TCP_LEN, flow);
        write_rst(tcp, (flow.dport_be, flow.sport_be), &flow.segment, addr_sum(flow));
    }
    Rejection::Answered
}

/// ICMPv6 destination unreachable (port), from the frontend, quoting the
/// packet from its IPv6 header on, as much as fits.
#[inline(always)]
fn port_unreachable(ctx: &impl Ctx, flow: &Flow6) -> Rejection {
    let Some(ip) = ptr_at_fresh::<Ipv6Hdr>(ctx, IP_OFF) else {
        return Rejection::NotAnswered;
    };
    // SAFETY: the header is inside the packet (ptr_at_fresh).
    let packet_len = IPV6_LEN + u16::from_be(unsafe { (*ip).payload_len_be }) as usize;
    let quote_len = if packet_len < QUOTE_MAX { packet_len } else { QUOTE_MAX };
    let answer_len = QUOTE_OFF + quote_len;
    // The packet, from its IPv6 header on, moves to `QUOTE_OFF`.
    let macs = match grow_for_error(ctx, (IPV6_LEN + ICMP_LEN) as u32, answer_len) {
        Ok(macs) => macs,
        Err(rejection) => return rejection,
    };
    ctx.pull(answer_len);
    let Some(quoted) = quote_sum(ctx, quote_len) else {
        return Rejection::Failed;
    };
    let (Some(eth), Some(ip), Some(icmp)) = (
        ptr_at_fresh::<EthHdr>(ctx, 0),
        ptr_at_fresh::<Ipv6Hdr>(ctx, IP_OFF),
        ptr_at_fresh::<[u8; ICMP_LEN]>(ctx, ANSWER_L4_OFF),
    ) else {
        return Rejection::Failed;
    };
    let icmp_len = ICMP_LEN + quote_len;
    let covered = addr_sum(flow) + pseudo_header_tail(proto::ICMPV6, icmp_len) + quoted;
    // SAFETY: `macs` is a local; every other pointer is inside the packet
    // (ptr_at_fresh, after the last resize), and nothing moves it until
    // written.
    unsafe {
        core::ptr::write(eth, macs);
        write_ipv6(ip, proto::ICMPV6, icmp_len, flow);
        *icmp = error_header(ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, covered);
    }
    Rejection::Answered
}

/// Writes the answer's IPv6 header: no extension headers, traffic class
/// and flow label 0, a fresh hop limit, from the frontend to the client.
///
/// # Safety
/// `ip` points to a writable `Ipv6Hdr` (in the packet: see `ptr_at`).
#[inline(always)]
unsafe fn write_ipv6(ip: *mut Ipv6Hdr, next_header: u8, payload_len: usize, flow: &Flow6) {
    // SAFETY: the caller's promise.
    unsafe {
        (*ip).vtc_flow_be = (6u32 << 28).to_be();
        (*ip).payload_len_be = (payload_len as u16).to_be();
        (*ip).next_header = next_header;
        (*ip).hop_limit = TTL;
        (*ip).saddr_be = flow.daddr_be;
        (*ip).daddr_be = flow.saddr_be;
    }
}

/// The pseudo-header's addresses summed (the same either way round).
#[inline(always)]
fn addr_sum(flow: &Flow6) -> u64 {
    let mut sum = 0u64;
    for i in 0..4 {
        sum = csum::add32(csum::add32(sum, flow.saddr_be[i]), flow.daddr_be[i]);
    }
    sum
}

/// One's complement sum of the `len` quoted bytes at `QUOTE_OFF`. The
/// length's bits pick pieces of constant sizes, largest first, each at the
/// offset the larger bits make: the verifier checks each piece at its own
/// size, and every piece but the last starts an even number of bytes in,
/// as the sum's 16-bit words need. The masks keep every offset bounded in
/// the register itself.
#[inline(always)]
fn quote_sum(ctx: &impl Ctx, len: usize) -> Option<u64> {
    let len = len & QUOTE_MASK;
    let mut sum = piece::<CSUM_DIFF_MAX>(ctx, len, 1024, 0)?;
    sum += piece::<CSUM_DIFF_MAX>(ctx, len, 1024, CSUM_DIFF_MAX)?;
    sum += piece::<512>(ctx, len, 512, 0)?;
    sum += piece::<256>(ctx, len, 256, 0)?;
    sum += piece::<128>(ctx, len, 128, 0)?;
    sum += piece::<64>(ctx, len, 64, 0)?;
    sum += piece::<32>(ctx, len, 32, 0)?;
    sum += piece::<16>(ctx, len, 16, 0)?;
    sum += piece::<8>(ctx, len, 8, 0)?;
    sum += piece::<4>(ctx, len, 4, 0)?;
    sum += piece::<2>(ctx, len, 2, 0)?;
    sum += piece::<1>(ctx, len, 1, 0)?;
    Some(sum)
}

/// The sum of `N` bytes of the quote if `len` has `bit` (else 0): those
/// at `skip` into the part of the quote that `bit` stands for, which
/// starts after the parts of `len`'s larger bits.
#[inline(always)]
fn piece<const N: usize>(ctx: &impl Ctx, len: usize, bit: usize, skip: usize) -> Option<u64> {
    if len & bit == 0 {
        return Some(0);
    }
    let larger_bits = len & !(2 * bit - 1) & QUOTE_MASK;
    let bytes = ptr_at_fresh::<[u8; N]>(ctx, QUOTE_OFF + larger_bits + skip)?;
    // SAFETY: the `N` bytes are inside the packet (ptr_at_fresh).
    unsafe { sum_bytes(bytes) }
}

/// One's complement sum of `N` bytes: by the kernel's helper in words of
/// 4 bytes, by hand below that (a lone last byte is padded with a zero
/// byte into a word). Not `sum_words` for 2 bytes: LLVM's BPF backend
/// crashed on it here.
///
/// # Safety
/// `bytes` points to `N` readable bytes (in the packet: see `ptr_at`).
#[inline(always)]
unsafe fn sum_bytes<const N: usize>(bytes: *mut [u8; N]) -> Option<u64> {
    if N.is_multiple_of(4) {
        // SAFETY: the caller's promise; the helper only reads `N` bytes
        // (no `from` to subtract: null, 0 bytes).
        let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, bytes.cast(), N as u32, 0) };
        return if sum < 0 { None } else { Some(sum as u32 as u64) };
    }
    // SAFETY: the caller's promise (`N` is 1 or 2).
    let (first, second) = unsafe { ((*bytes)[0], (*bytes).get(1).copied().unwrap_or(0)) };
    Some(u16::from_ne_bytes([first, second]) as u64)
}
