//! ICMP errors of translated flows: destination unreachable (frag-needed
//! included, for path MTU discovery) and time exceeded, quoting a packet
//! the programs translated. Like the kernel's NAT of RELATED packets, the
//! error is translated as its flow's packets are, in the direction it
//! travels, outer and inner headers alike:
//!
//! - towards the client (a backend, or a router behind the DNAT, about a
//!   packet `client -> backend`): the quote becomes `client -> frontend`,
//!   and an outer source that is the backend becomes the frontend;
//! - towards the backend (a router, or the client, about a reply the
//!   client saw as `frontend -> client`): the quote becomes `backend ->
//!   client`, and an outer destination that is the frontend becomes the
//!   backend.
//!
//! `parse` hands the error over as the flow of the direction it travels
//! (the quoted tuple reversed), so one conntrack lookup finds the entry
//! whose translation applies. Every checksum is updated incrementally:
//! outer IPv4, inner IPv4, inner L4 (when quoted, UDP's 0 kept), and the
//! ICMP checksum over all of the inner changes; the sum of the whole
//! packet stays the same, so an skb's CHECKSUM_COMPLETE stays right too.

use proxy_common::proto;

use crate::{
    context::{Ctx, ptr_at},
    csum,
    headers::{
        ETH_LEN, ICMP_CHECK, INNER_IP_OFF, INNER_L4_OFF, IP_CHECK, IP_OFF, Ipv4Hdr, L4_OFF, Side, addr_in_ip,
        check_in_l4, port_in_l4,
    },
};

const ICMP_CHECK_OFF: usize = L4_OFF + ICMP_CHECK;
const INNER_CHECK_OFF: usize = INNER_IP_OFF + IP_CHECK;

/// Translates the ICMP error whose quoted packet had `old` as its
/// `quoted` end into `new` (both `(address, port)`, network byte order);
/// the outer header's `outer` end is rewritten too where it was `old`'s
/// address.
#[inline(always)]
pub fn translate(
    ctx: &impl Ctx,
    l4_proto: u8,
    quoted: Side,
    outer: Side,
    old: (u32, u16),
    new: (u32, u16),
) -> Result<(), ()> {
    let inner_addr: *mut u32 = ptr_at(ctx, INNER_IP_OFF + addr_in_ip(quoted)).ok_or(())?;
    let inner_port: *mut u16 = ptr_at(ctx, INNER_L4_OFF + port_in_l4(quoted)).ok_or(())?;
    let inner_check: *mut u16 = ptr_at(ctx, INNER_CHECK_OFF).ok_or(())?;
    let icmp_check: *mut u16 = ptr_at(ctx, ICMP_CHECK_OFF).ok_or(())?;
    // SAFETY: every field is inside the packet (ptr_at); `quoted_l4_check`
    // and `packet_end` call no helper that could move it.
    unsafe {
        let mut icmp = *icmp_check;
        *inner_addr = new.0;
        *inner_port = new.1;
        icmp = csum::replace16(csum::replace32(icmp, old.0, new.0), old.1, new.1);
        let inner_ip_check = csum::replace32(*inner_check, old.0, new.0);
        icmp = csum::replace16(icmp, *inner_check, inner_ip_check);
        *inner_check = inner_ip_check;
        icmp = quoted_l4_check(ctx, l4_proto, old, new, icmp, packet_end(ctx)?);
        *icmp_check = icmp;
    }
    outer_address(ctx, outer, old.0, new.0)
}

/// Where the IPv4 packet ends in the frame (bytes after it are the link's
/// padding or trailer, not the quote's).
#[inline(always)]
fn packet_end(ctx: &impl Ctx) -> Result<usize, ()> {
    let ip: *const Ipv4Hdr = ptr_at(ctx, IP_OFF).ok_or(())?;
    // SAFETY: the header is inside the packet (ptr_at).
    Ok(ETH_LEN + u16::from_be(unsafe { (*ip).tot_len_be }) as usize)
}

/// Updates the quoted L4 checksum (if the quote, which ends at `end`,
/// reaches it) for the address and port change; returns the ICMP checksum
/// updated for it.
#[inline(always)]
fn quoted_l4_check(ctx: &impl Ctx, l4_proto: u8, old: (u32, u16), new: (u32, u16), icmp: u16, end: usize) -> u16 {
    let off = INNER_L4_OFF + check_in_l4(l4_proto);
    if off + 2 > end {
        return icmp;
    }
    let Some(check) = ptr_at::<u16>(ctx, off) else {
        return icmp;
    };
    // SAFETY: the checksum is inside the packet (ptr_at).
    unsafe {
        let before = *check;
        let after = if l4_proto == proto::UDP {
            csum::udp_replace16(csum::udp_replace32(before, old.0, new.0), old.1, new.1)
        } else {
            csum::replace16(csum::replace32(before, old.0, new.0), old.1, new.1)
        };
        *check = after;
        csum::replace16(icmp, before, after)
    }
}

/// Rewrites the outer header's `side` address from `old` to `new` if it is
/// `old` (an error from a router keeps the router's address).
#[inline(always)]
fn outer_address(ctx: &impl Ctx, side: Side, old: u32, new: u32) -> Result<(), ()> {
    let addr: *const u32 = ptr_at(ctx, IP_OFF + addr_in_ip(side)).ok_or(())?;
    // SAFETY: the address is inside the packet (ptr_at).
    if unsafe { *addr } != old {
        return Ok(());
    }
    ctx.rewrite_addr(side, old, new)
}
