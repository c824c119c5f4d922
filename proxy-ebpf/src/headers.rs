//! The packet headers the programs read and write: their layouts, where
//! each one starts in a frame, where their fields sit, and the field values
//! the programs compare against. Data only: reaching the bytes is
//! `context`'s, deciding what they mean is `parse`'s.
//!
//! `parse` accepts untagged Ethernet and IPv4 without options (IHL = 5)
//! only, so every header below starts at a constant offset: the offsets
//! are constants, which also keeps the verifier's job simple. IPv6's L4
//! header follows a bounded number of extension headers (`ipv6::parse`):
//! its offset is a bounded variable, the IPv6 header's a constant.

use core::mem::offset_of;

use proxy_common::proto;

/// Which end of the flow a header field belongs to, and a rewrite changes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

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
pub struct Ipv6Hdr {
    /// Version (high nibble), traffic class, flow label.
    pub vtc_flow_be: u32,
    pub payload_len_be: u16,
    pub next_header: u8,
    pub hop_limit: u8,
    pub saddr_be: [u32; 4],
    pub daddr_be: [u32; 4],
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

/// SCTP's common header (RFC 9260 3.1): the ports where UDP has them,
/// then the verification tag and the CRC32c of the whole SCTP packet (no
/// pseudo-header: an address change leaves it valid).
#[repr(C)]
pub struct SctpHdr {
    pub sport_be: u16,
    pub dport_be: u16,
    pub vtag_be: u32,
    pub checksum_le: u32,
}

pub const ETH_LEN: usize = 14;
pub const IP_LEN: usize = 20;
pub const IPV6_LEN: usize = 40;
pub const TCP_LEN: usize = 20;
pub const UDP_LEN: usize = 8;
pub const SCTP_LEN: usize = 12;
/// An ICMP error's header: type, code, checksum and 4 unused bytes.
pub const ICMP_LEN: usize = 8;

/// Where each header starts in the frame.
pub const IP_OFF: usize = ETH_LEN;
pub const L4_OFF: usize = IP_OFF + IP_LEN;
/// The packet an ICMP error quotes: its IPv4 header and its first L4 bytes.
pub const INNER_IP_OFF: usize = L4_OFF + ICMP_LEN;
pub const INNER_L4_OFF: usize = INNER_IP_OFF + IP_LEN;

/// Where the IPv4 checksum sits in its header.
pub const IP_CHECK: usize = offset_of!(Ipv4Hdr, check);
/// Where the ICMP checksum sits in its header.
pub const ICMP_CHECK: usize = 2;

/// Where one end's address sits in an IPv6 header.
#[inline(always)]
pub fn addr_in_ipv6(side: Side) -> usize {
    if side == Side::Source {
        offset_of!(Ipv6Hdr, saddr_be)
    } else {
        offset_of!(Ipv6Hdr, daddr_be)
    }
}

/// Where one end's address sits in an IPv4 header.
#[inline(always)]
pub fn addr_in_ip(side: Side) -> usize {
    if side == Side::Source {
        offset_of!(Ipv4Hdr, saddr_be)
    } else {
        offset_of!(Ipv4Hdr, daddr_be)
    }
}

/// Where one end's port sits in a TCP, UDP or SCTP header (the same for
/// all three).
#[inline(always)]
pub fn port_in_l4(side: Side) -> usize {
    if side == Side::Source {
        offset_of!(UdpHdr, sport_be)
    } else {
        offset_of!(UdpHdr, dport_be)
    }
}

/// Where the checksum sits in a TCP or a UDP header.
#[inline(always)]
pub fn check_in_l4(l4_proto: u8) -> usize {
    if l4_proto == proto::TCP {
        offset_of!(TcpHdr, check)
    } else {
        offset_of!(UdpHdr, check)
    }
}

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
/// "More fragments" flag and fragment offset bits of `frag_off`.
pub const IP_MF: u16 = 0x2000;
pub const IP_OFFSET_MASK: u16 = 0x1fff;
/// The IPv4 `frag_off` of a packet that must not be fragmented.
pub const IP_DF_BE: u16 = 0x4000u16.to_be();
/// The ICMP errors about a packet: destination unreachable (frag-needed
/// included) and time exceeded.
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
/// The destination unreachable code for a port nothing listens on.
pub const ICMP_PORT_UNREACH: u8 = 3;
/// ICMPv6's destination unreachable, and its code for a port nothing
/// listens on (RFC 4443 3.1).
pub const ICMPV6_DEST_UNREACH: u8 = 1;
pub const ICMPV6_PORT_UNREACH: u8 = 4;
/// The IPv6 minimum link MTU (RFC 8200 5): no ICMPv6 error is longer.
pub const IPV6_MIN_MTU: usize = 1280;
