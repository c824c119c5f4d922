//! Header parsing and the one policy for malformed input.
//!
//! A packet is translated only if every header up to and including the L4
//! ports was read and is consistent. Everything else is passed untouched and
//! counted; nothing here ever writes. Accepting only IHL = 5 (no IP options)
//! and untagged frames keeps every header at a constant offset, which is also
//! what keeps the verifier's job simple.

use proxy_common::{Verdict, proto};

use crate::context::Ctx;

pub const ETH_LEN: usize = 14;
pub const IP_OFF: usize = ETH_LEN;
pub const IP_LEN: usize = 20;
pub const L4_OFF: usize = IP_OFF + IP_LEN;
pub const TCP_LEN: usize = 20;
pub const UDP_LEN: usize = 8;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
/// "More fragments" flag and fragment offset bits of `frag_off`.
const IP_MF: u16 = 0x2000;
const IP_OFFSET_MASK: u16 = 0x1fff;

pub use proxy_common::conntrack::tcp_flags::{
    ACK as TCP_FLAG_ACK, FIN as TCP_FLAG_FIN, RST as TCP_FLAG_RST, SYN as TCP_FLAG_SYN,
};

#[repr(C)]
pub struct EthHdr {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    pub ether_type_be: u16,
}

#[repr(C)]
pub struct Ipv4Hdr {
    pub version_ihl: u8,
    pub tos: u8,
    pub tot_len_be: u16,
    pub id_be: u16,
    pub frag_off_be: u16,
    pub ttl: u8,
    pub proto: u8,
    pub check: u16,
    pub saddr_be: u32,
    pub daddr_be: u32,
}

#[repr(C)]
pub struct TcpHdr {
    pub sport_be: u16,
    pub dport_be: u16,
    pub seq_be: u32,
    pub ack_seq_be: u32,
    /// Data offset in the high nibble.
    pub doff_res: u8,
    pub flags: u8,
    pub window_be: u16,
    pub check: u16,
    pub urg_ptr_be: u16,
}

#[repr(C)]
pub struct UdpHdr {
    pub sport_be: u16,
    pub dport_be: u16,
    pub len_be: u16,
    pub check: u16,
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
    /// L4 payload bytes after the TCP or UDP header.
    pub payload_len: u32,
}

/// Returns a pointer to a `T` at `off`, if the whole `T` is inside the
/// packet's linear data. The comparison is the verifier's bounds proof.
#[inline(always)]
pub fn ptr_at<T>(ctx: &impl Ctx, off: usize) -> Option<*mut T> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + off) as *mut T)
}

/// Parses Ethernet, IPv4 and TCP/UDP, or says why the packet is not ours.
#[inline(always)]
pub fn parse(ctx: &impl Ctx) -> Result<Flow, Verdict> {
    let eth: *const EthHdr = ptr_at(ctx, 0).ok_or(Verdict::PassMalformed)?;
    let ether_type = u16::from_be(unsafe { (*eth).ether_type_be });
    if ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        // A tagged frame is translated on its VLAN device, not here.
        return Err(Verdict::PassMalformed);
    }
    if ether_type != ETH_P_IP {
        return Err(Verdict::PassNotIpv4OrL4);
    }
    let ip: *const Ipv4Hdr = ptr_at(ctx, IP_OFF).ok_or(Verdict::PassMalformed)?;
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
    if frag_off & (IP_MF | IP_OFFSET_MASK) != 0 {
        return Err(Verdict::PassMalformed);
    }
    let (saddr_be, daddr_be) = unsafe { ((*ip).saddr_be, (*ip).daddr_be) };
    let l4_len = tot_len - IP_LEN;
    let flow = match l4_proto {
        proto::TCP => parse_tcp(ctx, l4_len)?,
        proto::UDP => parse_udp(ctx, l4_len)?,
        _ => return Err(Verdict::PassNotIpv4OrL4),
    };
    Ok(Flow {
        saddr_be,
        daddr_be,
        ..flow
    })
}

#[inline(always)]
fn parse_tcp(ctx: &impl Ctx, l4_len: usize) -> Result<Flow, Verdict> {
    let tcp: *const TcpHdr = ptr_at(ctx, L4_OFF).ok_or(Verdict::PassMalformed)?;
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
        saddr_be: 0,
        daddr_be: 0,
        sport_be,
        dport_be,
        proto: proto::TCP,
        tcp_flags: flags,
        tcp_seq: seq,
        tcp_ack: ack,
        payload_len: (l4_len - header_len) as u32,
    })
}

#[inline(always)]
fn parse_udp(ctx: &impl Ctx, l4_len: usize) -> Result<Flow, Verdict> {
    let udp: *const UdpHdr = ptr_at(ctx, L4_OFF).ok_or(Verdict::PassMalformed)?;
    let (sport_be, dport_be, udp_len) =
        unsafe { ((*udp).sport_be, (*udp).dport_be, u16::from_be((*udp).len_be) as usize) };
    if udp_len < UDP_LEN || udp_len > l4_len {
        return Err(Verdict::PassMalformed);
    }
    check_ports(sport_be, dport_be)?;
    Ok(Flow {
        saddr_be: 0,
        daddr_be: 0,
        sport_be,
        dport_be,
        proto: proto::UDP,
        tcp_flags: 0,
        tcp_seq: 0,
        tcp_ack: 0,
        payload_len: (udp_len - UDP_LEN) as u32,
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
