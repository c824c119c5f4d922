//! ICMPv6 errors of translated flows, as IPv4's (`crate::icmp_error`):
//! destination unreachable, packet too big (path MTU discovery), time
//! exceeded and parameter problem, quoting a packet the programs
//! translated, are translated in the direction they travel. Towards the
//! client the quote's backend becomes the frontend, and so does an outer
//! source that is the backend; towards the backend the quote's frontend
//! becomes the backend, and so does an outer destination that is the
//! frontend.
//!
//! `parse` hands the error over as the flow of the direction it travels
//! (the quoted tuple reversed). The quoted header is read at a bounded
//! depth: an IPv6 header right before TCP or UDP whose ports are quoted;
//! a quote with extension headers passes untouched. Every change is
//! written directly and the checksums updated incrementally: the quoted
//! L4 one (when quoted; UDP's 0 kept) and the ICMPv6 one, which covers
//! the quote and, through the pseudo-header, the outer addresses. Nothing
//! else covers them (IPv6 has no header checksum), so the packet's sum is
//! what it was and an skb's CHECKSUM_COMPLETE stays right.

use proxy_common::{Verdict, proto};

use super::parse::{Flow6, header_at};
use crate::{
    context::{Addr6, Ctx, ptr_at_fresh},
    csum,
    headers::{IP_OFF, IPV6_LEN, Ipv6Hdr, Side, addr_in_ipv6, check_in_l4, port_in_l4},
    parse::Flow,
};

/// ICMPv6 error types (RFC 4443 3): every one quotes the packet.
const DEST_UNREACH: u8 = 1;
const PARAMETER_PROBLEM: u8 = 4;

/// The ICMPv6 header: type, code, checksum, a 4-byte field.
const ICMPV6_LEN: usize = 8;
const ICMPV6_CHECK: usize = 2;
/// The TCP header's bytes up to its checksum, what a quote must hold for
/// it to be updated.
const QUOTED_L4_WANTED: usize = 20;

/// Where the quoted packet's headers are, from the ICMPv6 header's offset.
#[inline(always)]
fn inner_ip(icmp_off: usize) -> usize {
    icmp_off + ICMPV6_LEN
}
#[inline(always)]
fn inner_l4(icmp_off: usize) -> usize {
    icmp_off + ICMPV6_LEN + IPV6_LEN
}

/// The error at `icmp_off` (its packet ending at `end`) as the flow of
/// the direction it travels: the quoted ports reversed, the quoted
/// addresses written reversed over `saddr` and `daddr` (the outer ones the
/// caller read); or why it is not ours.
#[inline(always)]
pub fn quoted(
    ctx: &impl Ctx,
    icmp_off: usize,
    end: usize,
    saddr: &mut Addr6,
    daddr: &mut Addr6,
) -> Result<Flow, Verdict> {
    let not_ours = Verdict::PassNotIpv4OrL4;
    // Type and code: a one-byte read's bounds check LLVM turns into a
    // form the verifier does not take.
    let type_code: *const [u8; 2] = header_at(ctx, icmp_off).map_err(|_| not_ours)?;
    // SAFETY: the bytes are inside the packet (header_at).
    if !(DEST_UNREACH..=PARAMETER_PROBLEM).contains(&unsafe { (*type_code)[0] }) {
        return Err(not_ours);
    }
    if inner_l4(icmp_off) + 4 > end {
        return Err(not_ours);
    }
    // The quoted L4 header up to its checksum, if quoted, in the linear
    // part for `translate` (best effort: without it only the ports move).
    let _ = header_at::<[u8; QUOTED_L4_WANTED]>(ctx, inner_l4(icmp_off));
    let inner: *const Ipv6Hdr = header_at(ctx, inner_ip(icmp_off)).map_err(|_| not_ours)?;
    // Read at once: the next `header_at` may pull, which invalidates
    // `inner`. The addresses are the caller's to drop if this is not ours.
    // SAFETY: the quoted header is inside the packet (header_at).
    let (version, next) = unsafe {
        *saddr = (*inner).daddr_be;
        *daddr = (*inner).saddr_be;
        (u32::from_be((*inner).vtc_flow_be) >> 28, (*inner).next_header)
    };
    let ports: *const [u16; 2] = header_at(ctx, inner_l4(icmp_off)).map_err(|_| not_ours)?;
    // SAFETY: the quoted ports are inside the packet (header_at).
    let [sport_be, dport_be] = unsafe { *ports };
    let quoted_l4 = next == proto::TCP || next == proto::UDP;
    if version != 6 || !quoted_l4 || sport_be == 0 || dport_be == 0 {
        return Err(not_ours);
    }
    Ok(Flow {
        sport_be: dport_be,
        dport_be: sport_be,
        ..Flow::empty(next)
    })
}

/// Translates the error `flow` (from [`quoted`]) whose quoted packet
/// had `old` as its `quoted` end into `new`; the outer header's `outer`
/// end is rewritten too where it was `old`'s address.
#[inline(always)]
pub fn translate(
    ctx: &impl Ctx,
    flow: &Flow6,
    quoted: Side,
    outer: Side,
    old: (&Addr6, u16),
    new: (&Addr6, u16),
) -> Result<(), ()> {
    let icmp_off = flow.l4_off;
    let diff = csum::diff128(old.0, new.0);
    // Each field on its own, so few packet pointers are live at once.
    let inner_addr: *mut Addr6 = ptr_at_fresh(ctx, inner_ip(icmp_off) + addr_in_ipv6(quoted)).ok_or(())?;
    // SAFETY: the address is inside the packet (ptr_at_fresh).
    unsafe { *inner_addr = *new.0 };
    let inner_port: *mut u16 = ptr_at_fresh(ctx, inner_l4(icmp_off) + port_in_l4(quoted)).ok_or(())?;
    // SAFETY: the port is inside the packet (ptr_at_fresh).
    unsafe { *inner_port = new.1 };
    let l4_check = quoted_l4_check(ctx, flow, diff, old.1, new.1);
    let outer_moved = outer_address(ctx, outer, old.0, new.0)?;
    let icmp_check: *mut u16 = ptr_at_fresh(ctx, icmp_off + ICMPV6_CHECK).ok_or(())?;
    // SAFETY: the checksum is inside the packet (ptr_at_fresh).
    unsafe {
        let mut icmp = csum::replace16(csum::replace_diff(*icmp_check, diff), old.1, new.1);
        if let Some((before, after)) = l4_check {
            icmp = csum::replace16(icmp, before, after);
        }
        if outer_moved {
            icmp = csum::replace_diff(icmp, diff);
        }
        *icmp_check = icmp;
    }
    Ok(())
}

/// Rewrites the outer header's `side` address from `old` to `new` if it
/// is `old` (an error from a router keeps the router's address); whether
/// it did.
#[inline(always)]
fn outer_address(ctx: &impl Ctx, side: Side, old: &Addr6, new: &Addr6) -> Result<bool, ()> {
    let addr: *mut Addr6 = ptr_at_fresh(ctx, IP_OFF + addr_in_ipv6(side)).ok_or(())?;
    // SAFETY: the address is inside the packet (ptr_at_fresh).
    unsafe {
        if !same_addr(&*addr, old) {
            return Ok(false);
        }
        *addr = *new;
    }
    Ok(true)
}

/// Word by word: an array comparison may become a `bcmp` call, which BPF
/// has not.
#[inline(always)]
fn same_addr(a: &Addr6, b: &Addr6) -> bool {
    (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) == 0
}

/// Where the IPv6 packet ends in the frame (what follows is the link's
/// padding, not the quote's); 0 if its header is not there.
#[inline(always)]
fn packet_end(ctx: &impl Ctx) -> usize {
    match ptr_at_fresh::<Ipv6Hdr>(ctx, IP_OFF) {
        // SAFETY: the header is inside the packet (ptr_at_fresh).
        Some(ip) => IP_OFF + IPV6_LEN + u16::from_be(unsafe { (*ip).payload_len_be }) as usize,
        None => 0,
    }
}

/// Updates the quoted L4 checksum, if the quote holds it, for the address
/// (`diff`) and port change: its value before and after.
#[inline(always)]
fn quoted_l4_check(ctx: &impl Ctx, flow: &Flow6, diff: u16, old_port: u16, new_port: u16) -> Option<(u16, u16)> {
    let off = inner_l4(flow.l4_off) + check_in_l4(flow.proto);
    if off + 2 > packet_end(ctx) {
        return None;
    }
    let check = ptr_at_fresh::<u16>(ctx, off)?;
    // SAFETY: the checksum is inside the packet (ptr_at_fresh).
    unsafe {
        let before = *check;
        let after = if flow.proto == proto::UDP {
            csum::udp_replace16(csum::udp_replace_diff(before, diff), old_port, new_port)
        } else {
            csum::replace16(csum::replace_diff(before, diff), old_port, new_port)
        };
        *check = after;
        Some((before, after))
    }
}
