//! IPv6's answers for a Service without backends, as IPv4's
//! (`crate::reject`, whose helpers they share): a RST for TCP, an ICMPv6
//! port unreachable for UDP. The answer has no extension headers: the
//! packet's are overwritten (RST) or quoted. The ICMPv6 error quotes as
//! much of the packet as fits in the IPv6 minimum MTU (RFC 4443 2.4 (c)),
//! so its checksum covers up to 1232 quoted bytes: summed in pieces of
//! constant sizes (see [`quote_sum`]).

use aya_ebpf::helpers::bpf_csum_diff;
use proxy_common::proto;

use super::parse::{Flow6, alike};
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
/// length's bits pick pieces of constant sizes, largest first: the
/// verifier checks each piece at its own size, and every piece but the
/// last starts an even number of bytes in, as the sum's 16-bit words need.
#[inline(always)]
fn quote_sum(ctx: &impl Ctx, len: usize) -> Option<u64> {
    let mut at = (alike(ctx, QUOTE_OFF), 0);
    at = piece::<CSUM_DIFF_MAX>(ctx, len & 1024 != 0, at)?;
    at = piece::<CSUM_DIFF_MAX>(ctx, len & 1024 != 0, at)?;
    at = piece::<512>(ctx, len & 512 != 0, at)?;
    at = piece::<256>(ctx, len & 256 != 0, at)?;
    at = piece::<128>(ctx, len & 128 != 0, at)?;
    at = piece::<64>(ctx, len & 64 != 0, at)?;
    at = piece::<32>(ctx, len & 32 != 0, at)?;
    at = piece::<16>(ctx, len & 16 != 0, at)?;
    at = piece::<8>(ctx, len & 8 != 0, at)?;
    at = piece::<4>(ctx, len & 4 != 0, at)?;
    at = piece::<2>(ctx, len & 2 != 0, at)?;
    if len & 1 != 0 {
        at.1 += last_byte(ctx, at.0)?;
    }
    Some(at.1)
}

/// `(offset, sum)` after the `N` bytes at the offset, if `wanted`: the
/// offset moved past them, their sum added. The offset comes out in a
/// form the verifier cannot tell from any other (`parse::alike`): with
/// and without each piece its state is then the same, where 6.1 otherwise
/// walked every combination of the twelve pieces (ten times the
/// instructions of the rest of the program).
#[inline(always)]
fn piece<const N: usize>(ctx: &impl Ctx, wanted: bool, (off, sum): (usize, u64)) -> Option<(usize, u64)> {
    if !wanted {
        return Some((off, sum));
    }
    let bytes = ptr_at_fresh::<[u8; N]>(ctx, off)?;
    // SAFETY: the `N` bytes are inside the packet (ptr_at_fresh).
    let part = unsafe { sum_bytes(bytes) }?;
    Some((alike(ctx, off + N), sum + part))
}

/// One's complement sum of `N` bytes (a multiple of 2): by the kernel's
/// helper in words of 4 bytes, by hand for 2. Not `sum_words` for 2
/// bytes: LLVM's BPF backend crashed on it here.
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
    // SAFETY: the caller's promise (`N` is 2).
    let (first, second) = unsafe { ((*bytes)[0], (*bytes)[1]) };
    Some(u16::from_ne_bytes([first, second]) as u64)
}

/// The quote's lone last byte at `off`, padded with a zero byte into a
/// word. Read as the second of two bytes (`off` is past the quote's
/// first): LLVM turns a one-byte bounds check into `off < data_end`,
/// from which the verifier learns no readable length.
#[inline(always)]
fn last_byte(ctx: &impl Ctx, off: usize) -> Option<u64> {
    let pair = ptr_at_fresh::<[u8; 2]>(ctx, off - 1)?;
    // SAFETY: both bytes are inside the packet (ptr_at_fresh).
    let byte = unsafe { (*pair)[1] };
    Some(u16::from_ne_bytes([byte, 0]) as u64)
}
