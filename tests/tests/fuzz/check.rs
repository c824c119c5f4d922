//! Checks of a translated frame against its input: only the bytes the
//! translation may change changed, the output parses as it should, and
//! every checksum kept its ones' complement residual (an incremental
//! update, right even when the input's checksum was wrong).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

use etherparse::checksum::Sum16BitWords;
use proxy_common::proto;
use testbed::frame::{
    ETH_HLEN, Flow, Flow6, IcmpError, IcmpError6, Strict, icmp_offsets::*, parse_strict, residuals, same_checksum,
};

/// Which end of the packet a translation rewrites.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

/// Offsets of the IPv4 header checksum and addresses.
const IP_CHECK: usize = ETH_HLEN + 10;
const IP_SRC: usize = ETH_HLEN + 12;
const IP_DST: usize = ETH_HLEN + 16;

fn addr_offset(ip_header: usize, side: Side) -> usize {
    ip_header + if side == Side::Source { 12 } else { 16 }
}

fn port_offset(l4_header: usize, side: Side) -> usize {
    l4_header + if side == Side::Source { 0 } else { 2 }
}

/// Lists the bytes outside `allowed` that differ (both frames one length).
fn changed_outside(input: &[u8], out: &[u8], allowed: &[usize]) -> Result<(), String> {
    if out.len() != input.len() {
        return Err("length changed".into());
    }
    let changed: Vec<usize> = (0..input.len())
        .filter(|&i| input[i] != out[i] && !allowed.contains(&i))
        .collect();
    if changed.is_empty() {
        Ok(())
    } else {
        Err(format!("bytes other than the translation's changed at {changed:?}"))
    }
}

fn ones_sum(bytes: &[u8]) -> u16 {
    Sum16BitWords::new().add_slice(bytes).ones_complement()
}

fn check_residual(what: &str, before: u16, after: u16) -> Result<(), String> {
    if same_checksum(before, after) {
        Ok(())
    } else {
        Err(format!("{what} checksum not updated consistently"))
    }
}

/// An L4 checksum field after an update: UDP's 0 ("none") stays 0 and is
/// never the result; else `residual` must hold.
fn check_l4_checksum(what: &str, udp: bool, fields: ([u8; 2], [u8; 2]), residual: (u16, u16)) -> Result<(), String> {
    if udp && fields.0 == [0, 0] {
        return if fields.1 == [0, 0] {
            Ok(())
        } else {
            Err(format!("{what}: UDP checksum 0 (none) was changed"))
        };
    }
    if udp && fields.1 == [0, 0] {
        return Err(format!("{what}: UDP checksum became 0 (none) instead of 0xffff"));
    }
    check_residual(what, residual.0, residual.1)
}

fn field(frame: &[u8], at: usize) -> [u8; 2] {
    [frame[at], frame[at + 1]]
}

/// A whole datagram or first fragment, translated on `side` (address,
/// port, both checksums); returns the new address and port.
pub fn full(input: &[u8], out: &[u8], flow: &Flow, side: Side) -> Result<SocketAddrV4, String> {
    let c = flow.l4_checksum_offset();
    let addr = addr_offset(ETH_HLEN, side);
    let port = port_offset(flow.l4_offset, side);
    let allowed = [
        IP_CHECK,
        IP_CHECK + 1,
        addr,
        addr + 1,
        addr + 2,
        addr + 3,
        port,
        port + 1,
        c,
        c + 1,
    ];
    changed_outside(input, out, &allowed)?;
    let Strict::Flow(after) = parse_strict(out) else {
        return Err("output no longer parses".into());
    };
    let (ip_in, l4_in) = residuals(input, flow);
    let (ip_out, l4_out) = residuals(out, &after);
    check_residual("IPv4", ip_in, ip_out)?;
    check_l4_checksum("L4", !flow.is_tcp(), (field(input, c), field(out, c)), (l4_in, l4_out))?;
    Ok(if side == Side::Destination {
        after.dst
    } else {
        after.src
    })
}

/// A later fragment, translated on `side` (address and IPv4 checksum
/// only: it has no L4 header); returns the new address.
pub fn later(input: &[u8], out: &[u8], side: Side) -> Result<Ipv4Addr, String> {
    let addr = addr_offset(ETH_HLEN, side);
    changed_outside(
        input,
        out,
        &[IP_CHECK, IP_CHECK + 1, addr, addr + 1, addr + 2, addr + 3],
    )?;
    let Strict::LaterFragment(after) = parse_strict(out) else {
        return Err("output no longer parses as a later fragment".into());
    };
    let header = ETH_HLEN..ETH_HLEN + 20;
    check_residual("IPv4", ones_sum(&input[header.clone()]), ones_sum(&out[header]))?;
    Ok(if side == Side::Destination {
        after.dst
    } else {
        after.src
    })
}

/// How an ICMP error must be translated: the quoted packet's `quoted` end
/// from `old` to `new`, and the outer header's `outer` end too if it was
/// `old`'s address.
pub struct IcmpRewrite {
    pub quoted: Side,
    pub outer: Side,
    pub old: SocketAddrV4,
    pub new: SocketAddrV4,
}

/// An ICMP error, translated as `rewrite` says: the quote's address and
/// port, maybe one outer address, and the outer IPv4, ICMP, quoted IPv4
/// and (if quoted: the quote ends with the IPv4 total length) L4 checksums.
pub fn icmp(input: &[u8], out: &[u8], error: &IcmpError, rewrite: &IcmpRewrite) -> Result<(), String> {
    let quote_end = ETH_HLEN + error.tot_len;
    let outer_rewritten = outer_addr(error, rewrite.outer) == *rewrite.old.ip();
    let checksum = Some(quoted_checksum(error)).filter(|c| c + 2 <= quote_end);
    changed_outside(input, out, &icmp_allowed(rewrite, outer_rewritten, checksum))?;
    let Strict::IcmpError(after) = parse_strict(out) else {
        return Err("output no longer parses as an ICMP error".into());
    };
    let mut want = *error;
    set_quoted(&mut want, rewrite.quoted, rewrite.new);
    if outer_rewritten {
        set_outer(&mut want, rewrite.outer, *rewrite.new.ip());
    }
    if after != want {
        return Err(format!("translated to {after:?}, want {want:?}"));
    }
    icmp_residuals(input, out, (error, &after), checksum, quote_end)
}

/// Offset of the quoted L4 checksum, if the quote holds it.
fn quoted_checksum(error: &IcmpError) -> usize {
    INNER_L4 + if error.quoted_proto == proto::TCP { 16 } else { 6 }
}

fn outer_addr(error: &IcmpError, side: Side) -> Ipv4Addr {
    if side == Side::Source { error.src } else { error.dst }
}

fn set_outer(error: &mut IcmpError, side: Side, addr: Ipv4Addr) {
    if side == Side::Source {
        error.src = addr;
    } else {
        error.dst = addr;
    }
}

fn set_quoted(error: &mut IcmpError, side: Side, to: SocketAddrV4) {
    if side == Side::Source {
        error.quoted_src = to;
    } else {
        error.quoted_dst = to;
    }
}

fn icmp_allowed(rewrite: &IcmpRewrite, outer_rewritten: bool, checksum: Option<usize>) -> Vec<usize> {
    let inner_addr = addr_offset(INNER_IP, rewrite.quoted);
    let inner_port = port_offset(INNER_L4, rewrite.quoted);
    let mut allowed = vec![IP_CHECK, IP_CHECK + 1, ICMP + 2, ICMP + 3, INNER_IP + 10, INNER_IP + 11];
    allowed.extend(inner_addr..inner_addr + 4);
    allowed.extend([inner_port, inner_port + 1]);
    if let Some(c) = checksum {
        allowed.extend([c, c + 1]);
    }
    if outer_rewritten {
        let at = if rewrite.outer == Side::Source { IP_SRC } else { IP_DST };
        allowed.extend(at..at + 4);
    }
    allowed
}

/// Outer IPv4, ICMP (its message up to `end`), quoted IPv4, and the
/// quoted L4 checksum (at `checksum`) over the pseudo header and the
/// quoted L4 bytes up to `end`.
fn icmp_residuals(
    input: &[u8],
    out: &[u8],
    (before, after): (&IcmpError, &IcmpError),
    checksum: Option<usize>,
    end: usize,
) -> Result<(), String> {
    for (what, range) in [
        ("outer IPv4", ETH_HLEN..ICMP),
        ("ICMP", ICMP..end),
        ("quoted IPv4", INNER_IP..INNER_L4),
    ] {
        check_residual(what, ones_sum(&input[range.clone()]), ones_sum(&out[range]))?;
    }
    let Some(c) = checksum else {
        return Ok(());
    };
    let quoted_l4 = |frame: &[u8], e: &IcmpError| {
        Sum16BitWords::new()
            .add_4bytes(e.quoted_src.ip().octets())
            .add_4bytes(e.quoted_dst.ip().octets())
            .add_2bytes([0, e.quoted_proto])
            .add_2bytes((e.quoted_tot_len.saturating_sub(20) as u16).to_be_bytes())
            .add_slice(&frame[INNER_L4..end])
            .ones_complement()
    };
    let udp = before.quoted_proto == proto::UDP;
    let residual = (quoted_l4(input, before), quoted_l4(out, after));
    check_l4_checksum("quoted L4", udp, (field(input, c), field(out, c)), residual)
}

/// Offset of an IPv6 header's `side` address, the header at `ip_header`.
fn addr6_offset(ip_header: usize, side: Side) -> usize {
    ip_header + if side == Side::Source { 8 } else { 24 }
}

/// The ones' complement sum of an IPv6 L4 segment's bytes `l4..end` of
/// `frame` with its pseudo header (`l4_len` as the header says it): what
/// a consistent checksum update keeps.
fn residual6(
    frame: &[u8],
    (src, dst): (Ipv6Addr, Ipv6Addr),
    proto: u8,
    l4_len: usize,
    (l4, end): (usize, usize),
) -> u16 {
    Sum16BitWords::new()
        .add_16bytes(src.octets())
        .add_16bytes(dst.octets())
        .add_4bytes((l4_len as u32).to_be_bytes())
        .add_4bytes([0, 0, 0, proto])
        .add_slice(&frame[l4..end])
        .ones_complement()
}

/// An IPv6 whole datagram or first fragment, translated on `side`: the
/// address, the port (not SCTP's: it stays) and the TCP/UDP checksum
/// (SCTP's CRC32c covers no address); returns the new address and port.
pub fn full6(input: &[u8], out: &[u8], flow: &Flow6, side: Side) -> Result<SocketAddrV6, String> {
    let addr = addr6_offset(ETH_HLEN, side);
    let mut allowed: Vec<usize> = (addr..addr + 16).collect();
    if flow.proto != proto::SCTP {
        let port = port_offset(flow.l4_offset, side);
        allowed.extend([port, port + 1]);
    }
    let c = flow.l4_checksum_offset();
    allowed.extend(c.iter().flat_map(|&c| [c, c + 1]));
    changed_outside(input, out, &allowed)?;
    let Strict::Ipv6Flow(after) = parse_strict(out) else {
        return Err("output no longer parses".into());
    };
    if let Some(c) = c {
        let span = (flow.l4_offset, flow.end);
        let l4_len = flow.end - flow.l4_offset;
        let before = residual6(input, (*flow.src.ip(), *flow.dst.ip()), flow.proto, l4_len, span);
        let now = residual6(out, (*after.src.ip(), *after.dst.ip()), flow.proto, l4_len, span);
        let udp = flow.proto == proto::UDP;
        check_l4_checksum("L4", udp, (field(input, c), field(out, c)), (before, now))?;
    }
    Ok(if side == Side::Destination {
        after.dst
    } else {
        after.src
    })
}

/// A later IPv6 fragment, translated on `side`: the address alone (no
/// L4 header, and IPv6 has no header checksum); returns the new address.
pub fn later6(input: &[u8], out: &[u8], side: Side) -> Result<Ipv6Addr, String> {
    let addr = addr6_offset(ETH_HLEN, side);
    changed_outside(input, out, &(addr..addr + 16).collect::<Vec<_>>())?;
    let Strict::Ipv6LaterFragment(after) = parse_strict(out) else {
        return Err("output no longer parses as a later fragment".into());
    };
    Ok(if side == Side::Destination {
        after.dst
    } else {
        after.src
    })
}

/// An ICMPv6 error, translated as the entry it names says: towards the
/// client (`reply`) the quote's destination from the backend to `nat`
/// (the frontend) and an outer source that was the backend; else the
/// quote's source from the frontend to `nat` (the backend) and an outer
/// destination that was the frontend. The ICMPv6 checksum and the quoted
/// L4 one (if quoted) keep their residuals.
pub fn icmp6(input: &[u8], out: &[u8], error: &IcmpError6, reply: bool, nat: SocketAddrV6) -> Result<(), String> {
    let (quoted, outer) = if reply {
        (Side::Destination, Side::Source)
    } else {
        (Side::Source, Side::Destination)
    };
    let old = if reply { error.quoted_dst } else { error.quoted_src };
    let outer_addr = if outer == Side::Source { error.src } else { error.dst };
    let outer_rewritten = outer_addr == *old.ip();
    let inner_addr = addr6_offset(error.inner_ip(), quoted);
    let inner_port = port_offset(error.inner_l4(), quoted);
    let checksum = error.inner_l4() + if error.quoted_proto == proto::TCP { 16 } else { 6 };
    let checksum = Some(checksum).filter(|c| c + 2 <= error.end);
    let mut allowed: Vec<usize> = (inner_addr..inner_addr + 16).collect();
    allowed.extend([inner_port, inner_port + 1, error.icmp_offset + 2, error.icmp_offset + 3]);
    allowed.extend(checksum.iter().flat_map(|&c| [c, c + 1]));
    if outer_rewritten {
        let at = addr6_offset(ETH_HLEN, outer);
        allowed.extend(at..at + 16);
    }
    changed_outside(input, out, &allowed)?;
    let Strict::Icmp6Error(after) = parse_strict(out) else {
        return Err("output no longer parses as an ICMPv6 error".into());
    };
    let mut want = *error;
    if reply {
        want.quoted_dst = nat;
        if outer_rewritten {
            want.src = *nat.ip();
        }
    } else {
        want.quoted_src = nat;
        if outer_rewritten {
            want.dst = *nat.ip();
        }
    }
    if after != want {
        return Err(format!("translated to {after:?}, want {want:?}"));
    }
    let icmp = |frame: &[u8], e: &IcmpError6| {
        let span = (e.icmp_offset, e.end);
        residual6(frame, (e.src, e.dst), 58, e.end - e.icmp_offset, span)
    };
    check_residual("ICMPv6", icmp(input, error), icmp(out, &after))?;
    let Some(c) = checksum else {
        return Ok(());
    };
    let quoted_l4 = |frame: &[u8], e: &IcmpError6| {
        let addrs = (*e.quoted_src.ip(), *e.quoted_dst.ip());
        residual6(
            frame,
            addrs,
            e.quoted_proto,
            e.quoted_payload_len,
            (e.inner_l4(), e.end),
        )
    };
    let udp = error.quoted_proto == proto::UDP;
    let residual = (quoted_l4(input, error), quoted_l4(out, &after));
    check_l4_checksum("quoted L4", udp, (field(input, c), field(out, c)), residual)
}
