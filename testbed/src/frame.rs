//! Frames for packet tests: a builder, a checksum checker and a strict parser
//! of the data path's input policy.
//!
//! Everything here is independent of xproxy's own code: headers are written
//! and checksums computed by the `etherparse` crate, so a test compares the
//! programs' output against a second implementation, not against itself.
//!
//! - [`Frame`] describes a frame field by field (Ethernet, optional VLAN
//!   tags, IPv4 with every field settable including invalid values, TCP / UDP
//!   / ICMP or raw bytes) and [`Frame::build`]s it with correct checksums.
//! - [`check`] parses an output frame and verifies every checksum in it.
//! - [`parse_strict`] applies the programs' malformed-input policy and says
//!   whether a frame is a fully parsed IPv4 TCP/UDP flow (a whole datagram
//!   or a first fragment), a later fragment of one, or an ICMP error
//!   quoting one.
//! - [`expected_rst`] and [`expected_port_unreachable`] build the answers the
//!   programs must send for a Service without backends.
//! - [`Frame6`] and [`check6`] do the same for IPv6 frames (extension
//!   headers included, ICMPv6 checked too), [`expected_rst6`] and
//!   [`expected_port_unreachable6`] the answers.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

use etherparse::{
    EtherType, Ethernet2Header, IcmpEchoHeader, Icmpv4Header, Icmpv4Slice, Icmpv4Type, Icmpv6Header, Icmpv6Slice,
    Icmpv6Type, IpDscp, IpEcn, IpFragOffset, IpNumber, Ipv4Header, Ipv4HeaderSlice, Ipv4Options, SingleVlanHeader,
    TcpHeader, UdpHeader, VlanId, VlanPcp, checksum::Sum16BitWords, icmpv4::DestUnreachableHeader,
    icmpv6::DestUnreachableCode,
};
use proxy_common::sctp;

/// TCP flag bits as in byte 13 of the TCP header.
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
}

pub const ETH_HLEN: usize = 14;
pub const ETHERTYPE_IPV4: u16 = 0x0800;
pub const ETHERTYPE_ARP: u16 = 0x0806;
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
pub const ETHERTYPE_VLAN: u16 = 0x8100;
pub const ETHERTYPE_QINQ: u16 = 0x88a8;

/// The MAC addresses test frames use by default (locally administered).
pub const MAC_CLIENT: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x01];
pub const MAC_NODE: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x02];

/// One Ethernet frame, described field by field. Fields left at their
/// defaults describe a valid frame; the `Option` overrides write values that
/// are otherwise derived (and can be invalid on purpose).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub eth_src: [u8; 6],
    pub eth_dst: [u8; 6],
    /// VLAN tags, outermost first, as (TPID, VLAN id).
    pub vlans: Vec<(u16, u16)>,
    pub net: Net,
    /// Bytes after the network packet (Ethernet padding or trailer).
    pub padding: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Net {
    Ipv4(Ipv4),
    /// Anything else, written as given after the ether type.
    Raw {
        ether_type: u16,
        payload: Vec<u8>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv4 {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// DSCP and ECN, as the second header byte.
    pub tos: u8,
    pub id: u16,
    pub df: bool,
    pub mf: bool,
    /// Fragment offset in 8-byte units (13 bits).
    pub frag_offset: u16,
    pub ttl: u8,
    /// Raw options, a multiple of 4 bytes, at most 40.
    pub options: Vec<u8>,
    /// Overrides the version nibble (4).
    pub version: Option<u8>,
    /// Overrides the IHL nibble (5 + options / 4); the bytes written stay the same.
    pub ihl: Option<u8>,
    /// Overrides the total length (header + L4).
    pub tot_len: Option<u16>,
    /// Overrides the protocol number derived from `l4`.
    pub proto: Option<u8>,
    pub l4: L4,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum L4 {
    Tcp(Tcp),
    Udp(Udp),
    Icmp(Icmp),
    Sctp(Sctp),
    /// Raw bytes under the given protocol number.
    Raw {
        proto: u8,
        bytes: Vec<u8>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tcp {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// [`tcp_flags`] bits.
    pub flags: u8,
    pub window: u16,
    pub urgent: u16,
    /// Raw options, a multiple of 4 bytes, at most 40.
    pub options: Vec<u8>,
    pub payload: Vec<u8>,
    /// Overrides the data offset nibble (5 + options / 4); the checksum is
    /// computed over the bytes as written.
    pub data_offset: Option<u8>,
}

/// An SCTP packet: the common header and raw chunk bytes; the CRC32c is
/// computed at build time (`proxy_common::sctp`, checked against RFC 3720's
/// vectors there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sctp {
    pub sport: u16,
    pub dport: u16,
    pub vtag: u32,
    /// Chunks as written (type, flags, length, value, padding).
    pub chunks: Vec<u8>,
}

/// An INIT chunk (RFC 9260 3.3.2): initiate tag 0x78700001, a_rwnd 64 KiB,
/// one stream each way, initial TSN 1.
pub const SCTP_INIT_CHUNK: [u8; 20] = [1, 0, 0, 20, 0x78, 0x70, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Udp {
    pub sport: u16,
    pub dport: u16,
    pub payload: Vec<u8>,
    /// Sends checksum 0 ("none").
    pub zero_checksum: bool,
    /// Overrides the length field (8 + payload); the checksum is computed
    /// with the value written.
    pub length: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Icmp {
    pub icmp_type: Icmpv4Type,
    pub payload: Vec<u8>,
}

impl Ipv4 {
    fn new(src: Ipv4Addr, dst: Ipv4Addr, l4: L4) -> Self {
        Self {
            src,
            dst,
            tos: 0,
            id: 0x1234,
            df: true,
            mf: false,
            frag_offset: 0,
            ttl: 63,
            options: Vec::new(),
            version: None,
            ihl: None,
            tot_len: None,
            proto: None,
            l4,
        }
    }
}

impl Frame {
    fn ipv4(ip: Ipv4) -> Self {
        Self {
            eth_src: MAC_CLIENT,
            eth_dst: MAC_NODE,
            vlans: Vec::new(),
            net: Net::Ipv4(ip),
            padding: Vec::new(),
        }
    }

    /// A TCP segment with the given [`tcp_flags`], no options, no payload.
    pub fn tcp(src: SocketAddrV4, dst: SocketAddrV4, flags: u8) -> Self {
        let tcp = Tcp {
            sport: src.port(),
            dport: dst.port(),
            seq: 0x1000_0000,
            ack: if flags & tcp_flags::ACK != 0 { 0x2000_0000 } else { 0 },
            flags,
            window: 64240,
            urgent: 0,
            options: Vec::new(),
            payload: Vec::new(),
            data_offset: None,
        };
        Self::ipv4(Ipv4::new(*src.ip(), *dst.ip(), L4::Tcp(tcp)))
    }

    /// A UDP datagram with a checksum.
    pub fn udp(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Self {
        let udp = Udp {
            sport: src.port(),
            dport: dst.port(),
            payload: payload.to_vec(),
            zero_checksum: false,
            length: None,
        };
        Self::ipv4(Ipv4::new(*src.ip(), *dst.ip(), L4::Udp(udp)))
    }

    /// An ICMP echo request.
    /// An SCTP packet carrying `chunks` (see [`SCTP_INIT_CHUNK`]).
    pub fn sctp(src: SocketAddrV4, dst: SocketAddrV4, vtag: u32, chunks: &[u8]) -> Self {
        let sctp = Sctp {
            sport: src.port(),
            dport: dst.port(),
            vtag,
            chunks: chunks.to_vec(),
        };
        Self::ipv4(Ipv4::new(*src.ip(), *dst.ip(), L4::Sctp(sctp)))
    }

    pub fn icmp_echo(src: Ipv4Addr, dst: Ipv4Addr) -> Self {
        let icmp = Icmp {
            icmp_type: Icmpv4Type::EchoRequest(IcmpEchoHeader { id: 0x4242, seq: 1 }),
            payload: b"ping".to_vec(),
        };
        Self::ipv4(Ipv4::new(src, dst, L4::Icmp(icmp)))
    }

    /// An ICMP error of `icmp_type` quoting `quote` (an IPv4 packet's
    /// first bytes), from `src` to `dst`.
    pub fn icmp_error(src: Ipv4Addr, dst: Ipv4Addr, icmp_type: Icmpv4Type, quote: &[u8]) -> Self {
        let icmp = Icmp {
            icmp_type,
            payload: quote.to_vec(),
        };
        Self::ipv4(Ipv4::new(src, dst, L4::Icmp(icmp)))
    }

    /// An ARP request (who has `target`, tell `sender`).
    pub fn arp_request(sender: Ipv4Addr, target: Ipv4Addr) -> Self {
        let mut payload = vec![0, 1, 8, 0, 6, 4, 0, 1];
        payload.extend_from_slice(&MAC_CLIENT);
        payload.extend_from_slice(&sender.octets());
        payload.extend_from_slice(&[0; 6]);
        payload.extend_from_slice(&target.octets());
        Self {
            eth_src: MAC_CLIENT,
            eth_dst: [0xff; 6],
            vlans: Vec::new(),
            net: Net::Raw {
                ether_type: ETHERTYPE_ARP,
                payload,
            },
            padding: Vec::new(),
        }
    }

    /// An IPv6 UDP datagram whose last 4 address bytes and ports mimic `dst`
    /// (so a program that ignored the ether type might mistake it for one).
    pub fn ipv6_udp(dst: SocketAddrV4) -> Self {
        let mut payload = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        payload.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 244, 1, 5]);
        payload.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        payload.extend_from_slice(&dst.ip().octets());
        payload.extend_from_slice(&40000u16.to_be_bytes());
        payload.extend_from_slice(&dst.port().to_be_bytes());
        payload.extend_from_slice(&[0, 8, 0, 0]);
        Self {
            eth_src: MAC_CLIENT,
            eth_dst: MAC_NODE,
            vlans: Vec::new(),
            net: Net::Raw {
                ether_type: ETHERTYPE_IPV6,
                payload,
            },
            padding: Vec::new(),
        }
    }

    pub fn ip(&self) -> &Ipv4 {
        match &self.net {
            Net::Ipv4(ip) => ip,
            Net::Raw { .. } => panic!("not an IPv4 frame: {self:?}"),
        }
    }

    pub fn ip_mut(&mut self) -> &mut Ipv4 {
        match &mut self.net {
            Net::Ipv4(ip) => ip,
            Net::Raw { .. } => panic!("not an IPv4 frame"),
        }
    }

    pub fn tcp_mut(&mut self) -> &mut Tcp {
        match &mut self.ip_mut().l4 {
            L4::Tcp(tcp) => tcp,
            _ => panic!("not a TCP frame"),
        }
    }

    pub fn udp_mut(&mut self) -> &mut Udp {
        match &mut self.ip_mut().l4 {
            L4::Udp(udp) => udp,
            _ => panic!("not a UDP frame"),
        }
    }

    /// Changes the IPv4 header in place (builder style).
    pub fn with_ip(mut self, f: impl FnOnce(&mut Ipv4)) -> Self {
        f(self.ip_mut());
        self
    }

    /// Changes the TCP header in place (builder style).
    pub fn with_tcp(mut self, f: impl FnOnce(&mut Tcp)) -> Self {
        f(self.tcp_mut());
        self
    }

    /// Changes the UDP header in place (builder style).
    pub fn with_udp(mut self, f: impl FnOnce(&mut Udp)) -> Self {
        f(self.udp_mut());
        self
    }

    pub fn with_vlan(mut self, tpid: u16, vlan_id: u16) -> Self {
        self.vlans.push((tpid, vlan_id));
        self
    }

    pub fn with_padding(mut self, padding: &[u8]) -> Self {
        self.padding = padding.to_vec();
        self
    }

    /// The source address and port (TCP / UDP only).
    pub fn src(&self) -> SocketAddrV4 {
        let ip = self.ip();
        SocketAddrV4::new(ip.src, ports(&ip.l4).0)
    }

    /// The destination address and port (TCP / UDP only).
    pub fn dst(&self) -> SocketAddrV4 {
        let ip = self.ip();
        SocketAddrV4::new(ip.dst, ports(&ip.l4).1)
    }

    /// The same frame with another destination address and port.
    pub fn with_dst(mut self, dst: SocketAddrV4) -> Self {
        let ip = self.ip_mut();
        ip.dst = *dst.ip();
        *ports_mut(&mut ip.l4).1 = dst.port();
        self
    }

    /// The same frame with another source address and port.
    pub fn with_src(mut self, src: SocketAddrV4) -> Self {
        let ip = self.ip_mut();
        ip.src = *src.ip();
        *ports_mut(&mut ip.l4).0 = src.port();
        self
    }

    /// The on-the-wire bytes, checksums computed by etherparse.
    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        let net_type = match &self.net {
            Net::Ipv4(_) => ETHERTYPE_IPV4,
            Net::Raw { ether_type, .. } => *ether_type,
        };
        let mut types: Vec<u16> = self.vlans.iter().map(|v| v.0).collect();
        types.push(net_type);
        let eth = Ethernet2Header {
            source: self.eth_src,
            destination: self.eth_dst,
            ether_type: EtherType(types[0]),
        };
        eth.write(&mut out).expect("writing to a Vec cannot fail");
        for (i, (_, vid)) in self.vlans.iter().enumerate() {
            let tag = SingleVlanHeader {
                pcp: VlanPcp::ZERO,
                drop_eligible_indicator: false,
                vlan_id: VlanId::try_new(*vid).expect("VLAN id fits in 12 bits"),
                ether_type: EtherType(types[i + 1]),
            };
            tag.write(&mut out).expect("writing to a Vec cannot fail");
        }
        match &self.net {
            Net::Ipv4(ip) => out.extend_from_slice(&build_ipv4(ip)),
            Net::Raw { payload, .. } => out.extend_from_slice(payload),
        }
        out.extend_from_slice(&self.padding);
        out
    }
}

fn ports(l4: &L4) -> (u16, u16) {
    match l4 {
        L4::Tcp(t) => (t.sport, t.dport),
        L4::Udp(u) => (u.sport, u.dport),
        L4::Sctp(p) => (p.sport, p.dport),
        _ => panic!("no ports in {l4:?}"),
    }
}

fn ports_mut(l4: &mut L4) -> (&mut u16, &mut u16) {
    match l4 {
        L4::Tcp(t) => (&mut t.sport, &mut t.dport),
        L4::Udp(u) => (&mut u.sport, &mut u.dport),
        L4::Sctp(p) => (&mut p.sport, &mut p.dport),
        _ => panic!("no ports in {l4:?}"),
    }
}

fn build_sctp(sctp: &Sctp) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(sctp::COMMON_HEADER_LEN + sctp.chunks.len());
    bytes.extend_from_slice(&sctp.sport.to_be_bytes());
    bytes.extend_from_slice(&sctp.dport.to_be_bytes());
    bytes.extend_from_slice(&sctp.vtag.to_be_bytes());
    bytes.extend_from_slice(&[0; 4]);
    bytes.extend_from_slice(&sctp.chunks);
    sctp::set_checksum(&mut bytes);
    bytes
}

fn build_ipv4(ip: &Ipv4) -> Vec<u8> {
    let (default_proto, l4) = match &ip.l4 {
        L4::Tcp(tcp) => (IpNumber::TCP.0, build_tcp(ip, tcp)),
        L4::Udp(udp) => (IpNumber::UDP.0, build_udp(ip, udp)),
        L4::Icmp(icmp) => {
            let header = Icmpv4Header::with_checksum(icmp.icmp_type.clone(), &icmp.payload);
            let mut bytes = header.to_bytes().to_vec();
            bytes.extend_from_slice(&icmp.payload);
            (IpNumber::ICMP.0, bytes)
        }
        L4::Sctp(sctp) => (IpNumber::SCTP.0, build_sctp(sctp)),
        L4::Raw { proto, bytes } => (*proto, bytes.clone()),
    };
    let options = Ipv4Options::try_from(ip.options.as_slice()).expect("IPv4 options: a multiple of 4, at most 40");
    let header = Ipv4Header {
        dscp: IpDscp::try_new(ip.tos >> 2).expect("6 bits"),
        ecn: IpEcn::try_new(ip.tos & 3).expect("2 bits"),
        total_len: ip.tot_len.unwrap_or((20 + ip.options.len() + l4.len()) as u16),
        identification: ip.id,
        dont_fragment: ip.df,
        more_fragments: ip.mf,
        fragment_offset: IpFragOffset::try_new(ip.frag_offset).expect("fragment offset fits in 13 bits"),
        time_to_live: ip.ttl,
        protocol: IpNumber(ip.proto.unwrap_or(default_proto)),
        header_checksum: 0,
        source: ip.src.octets(),
        destination: ip.dst.octets(),
        options,
    };
    let mut out = Vec::with_capacity(20 + ip.options.len() + l4.len());
    header.write(&mut out).expect("writing to a Vec cannot fail");
    if ip.version.is_some() || ip.ihl.is_some() {
        let version = ip.version.unwrap_or(4);
        let ihl = ip.ihl.unwrap_or(header.ihl());
        out[0] = (version << 4) | (ihl & 0x0f);
        // Keep the checksum valid over the bytes as written.
        out[10..12].copy_from_slice(&[0, 0]);
        let sum = Sum16BitWords::new().add_slice(&out).ones_complement().to_be();
        out[10..12].copy_from_slice(&sum.to_be_bytes());
    }
    out.extend_from_slice(&l4);
    out
}

fn build_tcp(ip: &Ipv4, tcp: &Tcp) -> Vec<u8> {
    let mut header = TcpHeader::new(tcp.sport, tcp.dport, tcp.seq, tcp.window);
    header.acknowledgment_number = tcp.ack;
    header.fin = tcp.flags & tcp_flags::FIN != 0;
    header.syn = tcp.flags & tcp_flags::SYN != 0;
    header.rst = tcp.flags & tcp_flags::RST != 0;
    header.psh = tcp.flags & tcp_flags::PSH != 0;
    header.ack = tcp.flags & tcp_flags::ACK != 0;
    header.urg = tcp.flags & tcp_flags::URG != 0;
    header.ece = tcp.flags & 0x40 != 0;
    header.cwr = tcp.flags & 0x80 != 0;
    header.urgent_pointer = tcp.urgent;
    assert!(
        tcp.options.len().is_multiple_of(4),
        "TCP options must be a multiple of 4 bytes"
    );
    header
        .set_options_raw(&tcp.options)
        .expect("TCP options at most 40 bytes");
    header.checksum = header
        .calc_checksum_ipv4_raw(ip.src.octets(), ip.dst.octets(), &tcp.payload)
        .expect("TCP segment fits in an IPv4 packet");
    let mut out = header.to_bytes().to_vec();
    out.extend_from_slice(&tcp.payload);
    if let Some(doff) = tcp.data_offset {
        out[12] = (doff << 4) | (out[12] & 0x0f);
        let sum = pseudo_header_sum(ip.src, ip.dst, IpNumber::TCP.0, out.len());
        out[16..18].copy_from_slice(&[0, 0]);
        let csum = sum.add_slice(&out).ones_complement().to_be();
        out[16..18].copy_from_slice(&csum.to_be_bytes());
    }
    out
}

fn build_udp(ip: &Ipv4, udp: &Udp) -> Vec<u8> {
    let mut header = UdpHeader::without_ipv4_checksum(udp.sport, udp.dport, udp.payload.len())
        .expect("UDP datagram fits in an IPv4 packet");
    if let Some(length) = udp.length {
        header.length = length;
    }
    if !udp.zero_checksum {
        header.checksum = header
            .calc_checksum_ipv4_raw(ip.src.octets(), ip.dst.octets(), &udp.payload)
            .expect("UDP datagram fits in an IPv4 packet");
    }
    let mut out = header.to_bytes().to_vec();
    out.extend_from_slice(&udp.payload);
    out
}

fn pseudo_header_sum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4_len: usize) -> Sum16BitWords {
    Sum16BitWords::new()
        .add_4bytes(src.octets())
        .add_4bytes(dst.octets())
        .add_2bytes([0, proto])
        .add_2bytes((l4_len as u16).to_be_bytes())
}

/// Ones' complement checksums have two zeros: a field may hold either.
pub fn same_checksum(a: u16, b: u16) -> bool {
    a == b || (a | b == 0xffff && (a == 0 || b == 0))
}

/// What [`check`] found in a frame whose checksums are all valid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    pub eth: Ethernet2Header,
    pub ip: Ipv4Header,
    pub l4: CheckedL4,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckedL4 {
    Tcp(TcpHeader),
    /// `checksum == 0` means the datagram carries none.
    Udp(UdpHeader),
    Icmp(Icmpv4Header),
    /// An SCTP packet whose CRC32c is right.
    Sctp,
    Other,
}

/// Parses an untagged Ethernet + IPv4 frame with etherparse and verifies the
/// IPv4 header checksum and the TCP, UDP (unless 0) or ICMP checksum over
/// the L4 bytes up to the IPv4 total length, and SCTP's CRC32c.
pub fn check(frame: &[u8]) -> Result<Checked, String> {
    let (eth, rest) = Ethernet2Header::from_slice(frame).map_err(|e| format!("Ethernet: {e}"))?;
    if eth.ether_type != EtherType::IPV4 {
        return Err(format!("ether type {:#06x} is not IPv4", eth.ether_type.0));
    }
    let ip = check_ipv4_header(frame)?;
    let packet = rest
        .get(..usize::from(ip.total_len))
        .ok_or("IPv4 total length beyond the frame")?;
    let l4_bytes = &packet[ip.header_len()..];
    let l4 = match ip.protocol {
        IpNumber::TCP => {
            let (tcp, payload) = TcpHeader::from_slice(l4_bytes).map_err(|e| format!("TCP header: {e}"))?;
            let want = tcp.calc_checksum_ipv4(&ip, payload).map_err(|e| e.to_string())?;
            if !same_checksum(tcp.checksum, want) {
                return Err(format!("TCP checksum {:#06x}, should be {want:#06x}", tcp.checksum));
            }
            CheckedL4::Tcp(tcp)
        }
        IpNumber::UDP => {
            let (udp, payload) = UdpHeader::from_slice(l4_bytes).map_err(|e| format!("UDP header: {e}"))?;
            if usize::from(udp.length) != l4_bytes.len() {
                return Err(format!(
                    "UDP length {} but {} bytes after the IPv4 header",
                    udp.length,
                    l4_bytes.len()
                ));
            }
            if udp.checksum != 0 {
                let want = udp.calc_checksum_ipv4(&ip, payload).map_err(|e| e.to_string())?;
                if udp.checksum != want {
                    return Err(format!("UDP checksum {:#06x}, should be {want:#06x}", udp.checksum));
                }
            }
            CheckedL4::Udp(udp)
        }
        IpNumber::ICMP => {
            let (icmp, payload) = Icmpv4Header::from_slice(l4_bytes).map_err(|e| format!("ICMP header: {e}"))?;
            let want = icmp.icmp_type.calc_checksum(payload);
            if !same_checksum(icmp.checksum, want) {
                return Err(format!("ICMP checksum {:#06x}, should be {want:#06x}", icmp.checksum));
            }
            CheckedL4::Icmp(icmp)
        }
        IpNumber::SCTP => {
            if !sctp::checksum_ok(l4_bytes) {
                return Err(format!("SCTP CRC32c wrong in {}", hex(l4_bytes)));
            }
            CheckedL4::Sctp
        }
        _ => CheckedL4::Other,
    };
    Ok(Checked { eth, ip, l4 })
}

/// How the programs must classify a frame, by the malformed-input policy
/// alone (before any map lookup).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strict {
    /// Truncated, bad lengths, IP options, VLAN tag, port 0, ...
    Malformed(&'static str),
    /// Not IPv4, neither TCP nor UDP, or ICMP other than an error quoting
    /// a TCP/UDP packet.
    NotIpv4OrL4(&'static str),
    /// A fully parsed IPv4 TCP or UDP packet: a whole datagram or the
    /// first fragment of one.
    Flow(Flow),
    /// A later fragment of a TCP or UDP datagram: no L4 header, its ports
    /// are its first fragment's.
    LaterFragment(LaterFragment),
    /// An ICMP destination unreachable or time exceeded quoting a TCP or
    /// UDP packet.
    IcmpError(IcmpError),
    /// A fully parsed IPv6 TCP, UDP or SCTP packet (at most
    /// [`IPV6_EXT_HEADERS_WALKED`] extension headers before it).
    Ipv6Flow(Flow6),
    /// A fragment (not an atomic one) whose fragment header is not right
    /// before TCP or UDP: not looked up. (A first fragment right before
    /// TCP or UDP is an [`Strict::Ipv6Flow`], its UDP length reaching past
    /// it.)
    Ipv6Fragment,
    /// A later IPv6 fragment right before TCP or UDP: no L4 header, its
    /// ports are its first fragment's.
    Ipv6LaterFragment(LaterFragment6),
    /// An ICMPv6 error (types 1 to 4) quoting an IPv6 header right before
    /// TCP or UDP, both ports (not 0) inside the payload length.
    Icmp6Error(IcmpError6),
}

/// The extension headers the programs walk before they give up on a packet.
pub const IPV6_EXT_HEADERS_WALKED: usize = 4;

/// A fully parsed IPv6 TCP, UDP or SCTP packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow6 {
    pub proto: u8,
    pub src: SocketAddrV6,
    pub dst: SocketAddrV6,
    /// Offset of the L4 header in the frame.
    pub l4_offset: usize,
    /// Where the packet ends in the frame (by its payload length).
    pub end: usize,
    /// TCP only: flags, sequence and acknowledgment numbers.
    pub tcp_flags: u8,
    pub seq: u32,
    pub ack: u32,
    /// Payload bytes after the L4 header: in this packet (TCP, SCTP), or
    /// as the UDP length field says (which a first fragment may not hold).
    pub payload_len: usize,
    /// A datagram's first fragment (right before TCP or UDP), and its
    /// fragment header's identification.
    pub first_fragment: bool,
    pub frag_id: u32,
}

impl Flow6 {
    /// Offset of the L4 checksum field in the frame (none in SCTP's
    /// common header that covers the addresses).
    pub fn l4_checksum_offset(&self) -> Option<usize> {
        match self.proto {
            6 => Some(self.l4_offset + 16),
            17 => Some(self.l4_offset + 6),
            _ => None,
        }
    }
}

/// A later IPv6 fragment of a TCP or UDP datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaterFragment6 {
    pub proto: u8,
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    /// The fragment header's identification: with the addresses and the
    /// protocol, the datagram's.
    pub id: u32,
}

/// An ICMPv6 error quoting an IPv6 TCP or UDP packet (see
/// [`Strict::Icmp6Error`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcmpError6 {
    /// The outer header's addresses.
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub icmp_type: u8,
    /// The quoted packet's protocol, source and destination, as quoted.
    pub quoted_proto: u8,
    pub quoted_src: SocketAddrV6,
    pub quoted_dst: SocketAddrV6,
    /// The quoted IPv6 header's payload length (as its sender wrote it).
    pub quoted_payload_len: usize,
    /// Offsets in the frame: the ICMPv6 header, and where the outer
    /// packet ends (by its payload length).
    pub icmp_offset: usize,
    pub end: usize,
}

impl IcmpError6 {
    /// The quoted IPv6 header's offset in the frame.
    pub fn inner_ip(&self) -> usize {
        self.icmp_offset + 8
    }

    /// The quoted L4 header's offset in the frame.
    pub fn inner_l4(&self) -> usize {
        self.icmp_offset + 8 + 40
    }
}

fn ipv6_addr_at(bytes: &[u8], at: usize) -> Ipv6Addr {
    let octets: [u8; 16] = bytes[at..at + 16].try_into().expect("16 bytes of an IPv6 header");
    Ipv6Addr::from(octets)
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

/// Where the extension header walk ended: the next header, its offset
/// after the IPv6 header's start, and whether a first fragment's header
/// came before it; or the frame's class.
fn walk_ipv6_ext_headers(rest: &[u8], payload_end: usize) -> Result<(u8, usize, Option<u32>), Strict> {
    let (mut next, mut off, mut first_fragment) = (rest[6], 40, None);
    for _ in 0..IPV6_EXT_HEADERS_WALKED {
        match next {
            6 | 17 | 132 | 58 => return Ok((next, off, first_fragment)),
            0 | 43 | 60 => {
                let Some(head) = rest.get(off..off + 2) else {
                    return Err(Strict::Malformed("truncated extension header"));
                };
                (next, off) = (head[0], off + (usize::from(head[1]) + 1) * 8);
            }
            44 => {
                let Some(head) = rest.get(off..off + 8) else {
                    return Err(Strict::Malformed("truncated fragment header"));
                };
                let frag_off = u16::from_be_bytes([head[2], head[3]]);
                let id = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
                (next, off) = (head[0], off + 8);
                if frag_off & 0xfff9 != 0 {
                    if !matches!(next, 6 | 17) {
                        return Err(Strict::Ipv6Fragment);
                    }
                    if frag_off & 0xfff8 != 0 {
                        // A later fragment: its payload must start inside the packet.
                        return Err(if off >= payload_end {
                            Strict::Malformed("fragment payload past the payload")
                        } else {
                            Strict::Ipv6LaterFragment(LaterFragment6 {
                                proto: next,
                                src: ipv6_addr_at(rest, 8),
                                dst: ipv6_addr_at(rest, 24),
                                id,
                            })
                        });
                    }
                    first_fragment = Some(id);
                }
            }
            _ => return Err(Strict::NotIpv4OrL4("IPv6 next header")),
        }
    }
    if matches!(next, 6 | 17 | 132) {
        Ok((next, off, first_fragment))
    } else {
        Err(Strict::Malformed("too many extension headers"))
    }
}

/// [`parse_strict`] after an IPv6 ether type: the programs' IPv6 policy.
/// Extension headers are read where the frame has them (also past the
/// payload length, as the programs do); the L4 header must start inside
/// the payload, and its lengths fit what is left of it.
fn strict_ipv6(rest: &[u8]) -> Strict {
    let Some(ip) = rest.get(..40) else {
        return Strict::Malformed("truncated IPv6 header");
    };
    let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    if ip[0] >> 4 != 6 || payload_len == 0 || 40 + payload_len > rest.len() {
        return Strict::Malformed("IPv6 version or payload length");
    }
    let end = 40 + payload_len;
    let (next, off, first_fragment_id) = match walk_ipv6_ext_headers(rest, end) {
        Ok(found) => found,
        Err(strict) => return strict,
    };
    if off >= end {
        return Strict::Malformed("L4 header past the payload");
    }
    if next == 58 {
        return strict_icmp6(rest, off, end);
    }
    let mut flow = Flow6 {
        proto: next,
        src: SocketAddrV6::new(ipv6_addr_at(ip, 8), 0, 0, 0),
        dst: SocketAddrV6::new(ipv6_addr_at(ip, 24), 0, 0, 0),
        l4_offset: ETH_HLEN + off,
        end: ETH_HLEN + end,
        tcp_flags: 0,
        seq: 0,
        ack: 0,
        payload_len: 0,
        first_fragment: first_fragment_id.is_some(),
        frag_id: first_fragment_id.unwrap_or(0),
    };
    if let Err(why) = strict_l4_6(&rest[off..end], rest.get(off..).unwrap_or_default(), &mut flow) {
        return Strict::Malformed(why);
    }
    if flow.src.port() == 0 || flow.dst.port() == 0 {
        return Strict::Malformed("port 0");
    }
    Strict::Ipv6Flow(flow)
}

/// The L4 header of an IPv6 packet: `l4` up to the payload's end, `seen`
/// up to the frame's (the programs read a header where the frame has it;
/// its lengths must fit the payload).
fn strict_l4_6(l4: &[u8], seen: &[u8], flow: &mut Flow6) -> Result<(), &'static str> {
    match flow.proto {
        6 => {
            let tcp = seen.get(..20).ok_or("truncated TCP header")?;
            let header_len = usize::from(tcp[12] >> 4) * 4;
            if header_len < 20 || header_len > l4.len() {
                return Err("TCP data offset");
            }
            flow.tcp_flags = tcp[13];
            flow.seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
            flow.ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
            flow.payload_len = l4.len() - header_len;
        }
        132 => {
            seen.get(..sctp::COMMON_HEADER_LEN)
                .ok_or("truncated SCTP common header")?;
            if l4.len() < sctp::COMMON_HEADER_LEN {
                return Err("payload length below the SCTP common header");
            }
            flow.payload_len = l4.len() - sctp::COMMON_HEADER_LEN;
        }
        _ => {
            let udp = seen.get(..8).ok_or("truncated UDP header")?;
            let udp_len = usize::from(u16_at(udp, 4));
            let fits = udp_len <= l4.len() || (flow.first_fragment && l4.len() >= 8);
            if udp_len < 8 || !fits {
                return Err("UDP length");
            }
            flow.payload_len = udp_len - 8;
        }
    }
    flow.src.set_port(u16_at(seen, 0));
    flow.dst.set_port(u16_at(seen, 2));
    Ok(())
}

/// An ICMPv6 message at `off` (its packet ending at `end`), as the
/// programs' `ipv6::icmp_error` reads it: an error quoting TCP or UDP
/// with its ports, or not ours.
fn strict_icmp6(rest: &[u8], off: usize, end: usize) -> Strict {
    let not_ours = Strict::NotIpv4OrL4;
    let Some(type_code) = rest.get(off..off + 2) else {
        return not_ours("ICMPv6 type and code");
    };
    if !(1..=4).contains(&type_code[0]) {
        return not_ours("ICMPv6: not an error");
    }
    let (inner, inner_l4) = (off + 8, off + 8 + 40);
    if inner_l4 + 4 > end {
        return not_ours("ICMPv6 error: no quoted ports");
    }
    let quoted_proto = rest[inner + 6];
    let (sport, dport) = (u16_at(rest, inner_l4), u16_at(rest, inner_l4 + 2));
    if rest[inner] >> 4 != 6 || !matches!(quoted_proto, 6 | 17) || sport == 0 || dport == 0 {
        return not_ours("ICMPv6 error: quotes no IPv6 TCP/UDP header with ports");
    }
    Strict::Icmp6Error(IcmpError6 {
        src: ipv6_addr_at(rest, 8),
        dst: ipv6_addr_at(rest, 24),
        icmp_type: type_code[0],
        quoted_proto,
        quoted_src: SocketAddrV6::new(ipv6_addr_at(rest, inner + 8), sport, 0, 0),
        quoted_dst: SocketAddrV6::new(ipv6_addr_at(rest, inner + 24), dport, 0, 0),
        quoted_payload_len: usize::from(u16_at(rest, inner + 4)),
        icmp_offset: ETH_HLEN + off,
        end: ETH_HLEN + end,
    })
}

/// A fully parsed IPv4 TCP or UDP packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub proto: u8,
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    /// Offset of the L4 header in the frame (always 34: no VLAN, no options).
    pub l4_offset: usize,
    /// IPv4 total length.
    pub tot_len: usize,
    /// TCP only: flags, sequence and acknowledgment numbers, payload length.
    pub tcp_flags: u8,
    pub seq: u32,
    pub ack: u32,
    /// Payload bytes after the L4 header: in this packet (TCP), or as the
    /// UDP length field says (which a first fragment may not hold).
    pub payload_len: usize,
    /// UDP only: the checksum field (0 = none).
    pub udp_checksum: u16,
    /// IP identification (ties a datagram's fragments together).
    pub ip_id: u16,
    /// More fragments follow: this is a datagram's first fragment.
    pub first_fragment: bool,
}

impl Flow {
    pub fn is_tcp(&self) -> bool {
        self.proto == IpNumber::TCP.0
    }

    /// Offset of the L4 checksum field in the frame.
    pub fn l4_checksum_offset(&self) -> usize {
        self.l4_offset + if self.is_tcp() { 16 } else { 6 }
    }
}

/// A later IPv4 fragment (offset not 0) of a TCP or UDP datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaterFragment {
    pub proto: u8,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// IP identification: with the addresses and protocol, the datagram's.
    pub ip_id: u16,
    /// IPv4 total length.
    pub tot_len: usize,
}

/// Offsets in an ICMP error frame (no VLAN tag, no IP options in either header).
pub mod icmp_offsets {
    /// The ICMP header.
    pub const ICMP: usize = super::ETH_HLEN + 20;
    /// The quoted packet's IPv4 header.
    pub const INNER_IP: usize = ICMP + 8;
    /// The quoted packet's L4 header.
    pub const INNER_L4: usize = INNER_IP + 20;
}

/// An ICMP error (type 3 or 11, any code, not fragmented) quoting an IPv4
/// packet without options that is a whole datagram or a first fragment,
/// TCP or UDP, with both ports (not 0) inside the IPv4 total length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcmpError {
    /// The outer header's addresses.
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub icmp_type: u8,
    /// The quoted packet's protocol, source and destination, as quoted.
    pub quoted_proto: u8,
    pub quoted_src: SocketAddrV4,
    pub quoted_dst: SocketAddrV4,
    /// The quoted packet's IPv4 total length field (as its sender wrote it).
    pub quoted_tot_len: usize,
    /// Outer IPv4 total length: the quote ends at `ETH_HLEN + tot_len`.
    pub tot_len: usize,
}

/// Applies the data path's input policy (see the Verdict docs in
/// proxy-common) to a frame, with etherparse doing the header parsing.
///
/// Order: Ethernet, VLAN tags (malformed), ether type (not IPv4), IPv4
/// header (truncated, version, IHL, total length: malformed), an ICMP
/// error that is not fragmented (its quote: not ours unless TCP/UDP with
/// ports), L4 protocol (not TCP/UDP), a later fragment (no L4 header to
/// parse), L4 header (lengths, TCP data offset, UDP length field, ports:
/// malformed). A first fragment is parsed as a whole datagram, except that
/// its UDP length may reach past it.
pub fn parse_strict(frame: &[u8]) -> Strict {
    let Ok((eth, rest)) = Ethernet2Header::from_slice(frame) else {
        return Strict::Malformed("truncated Ethernet header");
    };
    match eth.ether_type.0 {
        ETHERTYPE_VLAN | ETHERTYPE_QINQ => return Strict::Malformed("VLAN tag"),
        ETHERTYPE_IPV4 => {}
        ETHERTYPE_IPV6 => return strict_ipv6(rest),
        _ => return Strict::NotIpv4OrL4("ether type"),
    }
    let (ip, packet) = match strict_ipv4(rest) {
        Ok(parsed) => parsed,
        Err(strict) => return strict,
    };
    match ip.protocol {
        IpNumber::ICMP if !ip.is_fragmenting_payload() => return icmp_error(&ip, packet),
        IpNumber::TCP | IpNumber::UDP | IpNumber::SCTP => {}
        _ => return Strict::NotIpv4OrL4("L4 protocol"),
    }
    if ip.fragment_offset.value() != 0 {
        return Strict::LaterFragment(LaterFragment {
            proto: ip.protocol.0,
            src: Ipv4Addr::from(ip.source),
            dst: Ipv4Addr::from(ip.destination),
            ip_id: ip.identification,
            tot_len: packet.len(),
        });
    }
    strict_l4(&ip, packet)
}

/// The IPv4 header (version 4, no options) and the packet it heads, cut
/// at its total length.
fn strict_ipv4(rest: &[u8]) -> Result<(Ipv4Header, &[u8]), Strict> {
    if rest.len() < Ipv4Header::MIN_LEN {
        return Err(Strict::Malformed("truncated IPv4 header"));
    }
    if rest[0] >> 4 != 4 {
        return Err(Strict::Malformed("IP version"));
    }
    if rest[0] & 0x0f != 5 {
        return Err(Strict::Malformed("IHL (options or too short)"));
    }
    let Ok((ip, _)) = Ipv4Header::from_slice(rest) else {
        return Err(Strict::Malformed("IPv4 header"));
    };
    let tot_len = usize::from(ip.total_len);
    // etherparse does not insist on this one.
    if tot_len < Ipv4Header::MIN_LEN {
        return Err(Strict::Malformed("IPv4 total length below the header"));
    }
    if tot_len > rest.len() {
        return Err(Strict::Malformed("IPv4 total length beyond the frame"));
    }
    Ok((ip, &rest[..tot_len]))
}

/// The TCP or UDP header of a whole datagram or a first fragment.
fn strict_l4(ip: &Ipv4Header, packet: &[u8]) -> Strict {
    let l4 = &packet[Ipv4Header::MIN_LEN..];
    let mut flow = Flow {
        proto: ip.protocol.0,
        src: SocketAddrV4::new(Ipv4Addr::from(ip.source), 0),
        dst: SocketAddrV4::new(Ipv4Addr::from(ip.destination), 0),
        l4_offset: ETH_HLEN + Ipv4Header::MIN_LEN,
        tot_len: packet.len(),
        tcp_flags: 0,
        seq: 0,
        ack: 0,
        payload_len: 0,
        udp_checksum: 0,
        ip_id: ip.identification,
        first_fragment: ip.more_fragments,
    };
    let parsed = match ip.protocol {
        IpNumber::TCP => strict_tcp(l4, &mut flow),
        IpNumber::SCTP => strict_sctp(l4, &mut flow),
        _ => strict_udp(l4, &mut flow),
    };
    if let Err(why) = parsed {
        return Strict::Malformed(why);
    }
    if flow.src.port() == 0 || flow.dst.port() == 0 {
        return Strict::Malformed("port 0");
    }
    Strict::Flow(flow)
}

fn strict_tcp(l4: &[u8], flow: &mut Flow) -> Result<(), &'static str> {
    if l4.len() < TcpHeader::MIN_LEN {
        return Err("IPv4 total length below the TCP header");
    }
    let doff = usize::from(l4[12] >> 4);
    if doff < 5 {
        return Err("TCP data offset below 5");
    }
    if doff * 4 > l4.len() {
        return Err("TCP data offset beyond the total length");
    }
    let (tcp, payload) = TcpHeader::from_slice(l4).map_err(|_| "TCP header")?;
    flow.src.set_port(tcp.source_port);
    flow.dst.set_port(tcp.destination_port);
    flow.tcp_flags = l4[13];
    flow.seq = tcp.sequence_number;
    flow.ack = tcp.acknowledgment_number;
    flow.payload_len = payload.len();
    Ok(())
}

fn strict_udp(l4: &[u8], flow: &mut Flow) -> Result<(), &'static str> {
    let (udp, _) = UdpHeader::from_slice(l4).map_err(|_| "IPv4 total length below the UDP header")?;
    // "Lengths consistent", as the kernel's UDP receive path has it: the
    // length field covers the header and stays within the IPv4 payload (a
    // shorter datagram with trailing bytes is valid). A first fragment
    // holds only the start of its datagram.
    let udp_len = usize::from(udp.length);
    if udp_len < UdpHeader::LEN {
        return Err("UDP length below the header");
    }
    if udp_len > l4.len() && !flow.first_fragment {
        return Err("UDP length beyond the total length");
    }
    flow.src.set_port(udp.source_port);
    flow.dst.set_port(udp.destination_port);
    flow.payload_len = udp_len - UdpHeader::LEN;
    flow.udp_checksum = udp.checksum;
    Ok(())
}

/// SCTP: the common header must be there (the chunks are not read, the
/// CRC32c not checked: the programs do neither).
fn strict_sctp(l4: &[u8], flow: &mut Flow) -> Result<(), &'static str> {
    let [s0, s1, d0, d1, ..] = l4 else {
        return Err("IPv4 total length below the SCTP common header");
    };
    if l4.len() < sctp::COMMON_HEADER_LEN {
        return Err("IPv4 total length below the SCTP common header");
    }
    flow.src.set_port(u16::from_be_bytes([*s0, *s1]));
    flow.dst.set_port(u16::from_be_bytes([*d0, *d1]));
    flow.payload_len = l4.len() - sctp::COMMON_HEADER_LEN;
    Ok(())
}

/// An unfragmented ICMP packet: an error quoting a TCP/UDP packet's
/// header and ports, or not ours.
fn icmp_error(ip: &Ipv4Header, packet: &[u8]) -> Strict {
    use icmp_offsets::{ICMP, INNER_IP, INNER_L4};
    let not_ours = Strict::NotIpv4OrL4;
    let icmp = &packet[Ipv4Header::MIN_LEN..];
    let Ok(header) = Icmpv4Slice::from_slice(icmp) else {
        return not_ours("ICMP header");
    };
    if header.type_u8() != 3 && header.type_u8() != 11 {
        return not_ours("ICMP: not destination unreachable or time exceeded");
    }
    // Up to the quoted ports, inside the total length.
    if packet.len() < INNER_L4 + 4 - ETH_HLEN {
        return not_ours("ICMP error: no quoted ports");
    }
    let quote = &icmp[INNER_IP - ICMP..];
    if quote[0] != 0x45 {
        return not_ours("ICMP error: quoted header not IPv4 without options");
    }
    let Ok(inner) = Ipv4HeaderSlice::from_slice(quote) else {
        return not_ours("ICMP error: quoted IPv4 header");
    };
    if inner.fragments_offset().value() != 0 {
        return not_ours("ICMP error: quotes a later fragment");
    }
    let proto = inner.protocol();
    if proto != IpNumber::TCP && proto != IpNumber::UDP {
        return not_ours("ICMP error: quotes neither TCP nor UDP");
    }
    let ports = &quote[INNER_L4 - INNER_IP..];
    let (sport, dport) = (
        u16::from_be_bytes([ports[0], ports[1]]),
        u16::from_be_bytes([ports[2], ports[3]]),
    );
    if sport == 0 || dport == 0 {
        return not_ours("ICMP error: quoted port 0");
    }
    Strict::IcmpError(IcmpError {
        src: Ipv4Addr::from(ip.source),
        dst: Ipv4Addr::from(ip.destination),
        icmp_type: header.type_u8(),
        quoted_proto: proto.0,
        quoted_src: SocketAddrV4::new(inner.source_addr(), sport),
        quoted_dst: SocketAddrV4::new(inner.destination_addr(), dport),
        quoted_tot_len: usize::from(inner.total_len()),
        tot_len: packet.len(),
    })
}

/// Splits an IPv6 frame into fragments of at most `chunk` payload bytes
/// (a multiple of 8) after its extension headers, as a sender does: a
/// fragment header with `id` in each, more fragments in all but the last.
pub fn fragments6(frame: &Frame6, chunk: usize, id: u32) -> Vec<Frame6> {
    assert!(
        chunk.is_multiple_of(8) && chunk > 0,
        "fragment payloads are multiples of 8 bytes"
    );
    let bytes = frame.build();
    let ext_len: usize = frame.ext.iter().map(|e| e.bytes(0).len()).sum();
    let proto = match &frame.l4 {
        L4::Tcp(_) => IpNumber::TCP.0,
        L4::Udp(_) => IpNumber::UDP.0,
        l4 => panic!("fragments of TCP or UDP only: {l4:?}"),
    };
    let payload = &bytes[ETH_HLEN + 40 + ext_len..];
    let pieces = payload.len().div_ceil(chunk);
    (0..pieces)
        .map(|i| {
            let part = &payload[i * chunk..((i + 1) * chunk).min(payload.len())];
            let mut ext = frame.ext.clone();
            ext.push(Ext6::Fragment {
                offset: u16::try_from(i * chunk / 8).expect("offset fits"),
                more: i + 1 < pieces,
                id,
            });
            Frame6 {
                ext,
                l4: L4::Raw {
                    proto,
                    bytes: part.to_vec(),
                },
                ..frame.clone()
            }
        })
        .collect()
}

/// One IPv6 fragment's addresses, id, offset in bytes, more flag and
/// payload (after its fragment header, the last extension header).
type Piece6 = (Ipv6Addr, Ipv6Addr, u32, usize, bool, Vec<u8>);

fn piece6(frame: &[u8]) -> Result<Piece6, String> {
    let ip = frame.get(ETH_HLEN..ETH_HLEN + 40).ok_or("truncated IPv6 header")?;
    let end = ETH_HLEN + 40 + usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let addr = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&ip[at..at + 16]).expect("16 bytes"));
    let (mut next, mut off) = (ip[6], ETH_HLEN + 40);
    while next != 44 {
        let head = frame.get(off..off + 2).ok_or("no fragment header")?;
        (next, off) = (head[0], off + (usize::from(head[1]) + 1) * 8);
    }
    let head = frame.get(off..off + 8).ok_or("truncated fragment header")?;
    let field = u16::from_be_bytes([head[2], head[3]]);
    let id = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
    let payload = frame.get(off + 8..end).ok_or("payload past the frame")?.to_vec();
    Ok((
        addr(8),
        addr(24),
        id,
        usize::from(field >> 3) * 8,
        field & 1 != 0,
        payload,
    ))
}

/// Reassembles IPv6 fragments of a UDP datagram (whole frames, any order)
/// as a receiver would: one id and pair of addresses, no gaps, the UDP
/// length and checksum right over the addresses in the headers. Returns
/// the datagram's source and destination.
pub fn reassemble_udp6(frames: &[Vec<u8>]) -> Result<(SocketAddrV6, SocketAddrV6), String> {
    let mut pieces = frames.iter().map(|f| piece6(f)).collect::<Result<Vec<_>, _>>()?;
    let (src, dst, id) = pieces.first().map(|p| (p.0, p.1, p.2)).ok_or("no fragments")?;
    if let Some(p) = pieces.iter().find(|p| (p.0, p.1, p.2) != (src, dst, id)) {
        return Err(format!(
            "fragments of different datagrams: {src} {dst} {id:#x} and {} {} {:#x}",
            p.0, p.1, p.2
        ));
    }
    pieces.sort_by_key(|p| p.3);
    let mut datagram = Vec::new();
    for piece in &pieces {
        if piece.3 != datagram.len() {
            return Err(format!(
                "a gap or overlap at {} (have {} bytes)",
                piece.3,
                datagram.len()
            ));
        }
        datagram.extend_from_slice(&piece.5);
    }
    if pieces.last().is_none_or(|p| p.4) {
        return Err("no last fragment (more fragments clear)".into());
    }
    let (udp, payload) = udp_of(&datagram)?;
    let want = udp
        .calc_checksum_ipv6_raw(src.octets(), dst.octets(), payload)
        .map_err(|e| e.to_string())?;
    if udp.checksum != want {
        return Err(format!("UDP checksum {:#06x}, should be {want:#06x}", udp.checksum));
    }
    Ok((
        SocketAddrV6::new(src, udp.source_port, 0, 0),
        SocketAddrV6::new(dst, udp.destination_port, 0, 0),
    ))
}

/// Splits an untagged IPv4 frame without options into fragments of at
/// most `chunk` payload bytes (a multiple of 8), as a sender's IP layer
/// does: the same id in each, MF in all but the last, DF clear.
pub fn fragments(frame: &Frame, chunk: usize) -> Vec<Frame> {
    assert!(
        chunk.is_multiple_of(8) && chunk > 0,
        "fragment payloads are multiples of 8 bytes"
    );
    let bytes = frame.build();
    let proto = bytes[ETH_HLEN + 9];
    let total = usize::from(u16::from_be_bytes([bytes[ETH_HLEN + 2], bytes[ETH_HLEN + 3]]));
    let payload = &bytes[ETH_HLEN + Ipv4Header::MIN_LEN..ETH_HLEN + total];
    let pieces = payload.len().div_ceil(chunk);
    (0..pieces)
        .map(|i| {
            let part = &payload[i * chunk..((i + 1) * chunk).min(payload.len())];
            frame.clone().with_ip(|ip| {
                ip.df = false;
                ip.mf = i + 1 < pieces;
                ip.frag_offset = u16::try_from(i * chunk / 8).expect("offset fits");
                ip.l4 = L4::Raw {
                    proto,
                    bytes: part.to_vec(),
                };
            })
        })
        .collect()
}

/// Reassembles IPv4 fragments (whole frames, in any order) as a receiver
/// would and checks the datagram with etherparse: every fragment's header
/// checksum, one id and pair of addresses, pieces that fill the datagram
/// without gaps, and the UDP length and checksum (computed over the whole
/// datagram with the addresses in the headers). Returns the datagram's
/// source and destination.
pub fn reassemble_udp(frames: &[Vec<u8>]) -> Result<(SocketAddrV4, SocketAddrV4), String> {
    let mut first: Option<Ipv4Header> = None;
    let mut pieces: Vec<(usize, bool, Vec<u8>)> = Vec::new();
    for frame in frames {
        let ip = check_ipv4_header(frame)?;
        let payload = frame[ETH_HLEN + ip.header_len()..ETH_HLEN + usize::from(ip.total_len)].to_vec();
        let offset = usize::from(ip.fragment_offset.value()) * 8;
        if let Some(f) = &first
            && (f.identification, f.source, f.destination) != (ip.identification, ip.source, ip.destination)
        {
            return Err(format!("fragments of different datagrams: {f:?} and {ip:?}"));
        }
        if offset == 0 || first.is_none() {
            first = Some(ip.clone());
        }
        pieces.push((offset, ip.more_fragments, payload));
    }
    pieces.sort_by_key(|p| p.0);
    let mut datagram = Vec::new();
    for (offset, _, payload) in &pieces {
        if *offset != datagram.len() {
            return Err(format!("a gap or overlap at {offset} (have {} bytes)", datagram.len()));
        }
        datagram.extend_from_slice(payload);
    }
    if pieces.last().is_none_or(|p| p.1) {
        return Err("no last fragment (MF clear)".into());
    }
    let ip = first.ok_or("no fragments")?;
    let (udp, payload) = udp_of(&datagram)?;
    let want = udp.calc_checksum_ipv4(&ip, payload).map_err(|e| e.to_string())?;
    if udp.checksum != want {
        return Err(format!("UDP checksum {:#06x}, should be {want:#06x}", udp.checksum));
    }
    Ok((
        SocketAddrV4::new(ip.source.into(), udp.source_port),
        SocketAddrV4::new(ip.destination.into(), udp.destination_port),
    ))
}

/// A reassembled datagram's UDP header, its length that of the datagram,
/// and its payload.
fn udp_of(datagram: &[u8]) -> Result<(UdpHeader, &[u8]), String> {
    let (udp, payload) = UdpHeader::from_slice(datagram).map_err(|e| format!("UDP header: {e}"))?;
    if usize::from(udp.length) != datagram.len() {
        return Err(format!(
            "UDP length {} for a {}-byte datagram",
            udp.length,
            datagram.len()
        ));
    }
    Ok((udp, payload))
}

/// The IPv4 header of an untagged frame, its checksum verified.
fn check_ipv4_header(frame: &[u8]) -> Result<Ipv4Header, String> {
    let (_, rest) = Ethernet2Header::from_slice(frame).map_err(|e| format!("Ethernet: {e}"))?;
    let (ip, _) = Ipv4Header::from_slice(rest).map_err(|e| format!("IPv4 header: {e}"))?;
    let want = ip.calc_header_checksum();
    if !same_checksum(ip.header_checksum, want) {
        return Err(format!(
            "IPv4 header checksum {:#06x}, should be {want:#06x}",
            ip.header_checksum
        ));
    }
    Ok(ip)
}

/// The ones' complement checksum over the IPv4 header and over the L4
/// pseudo header + segment of a parsed `flow` in `frame`, checksum fields
/// included: (0, 0) (or 0xffff) for valid checksums. An incremental checksum
/// update keeps both values as they were, even for invalid input checksums,
/// so comparing them before and after a rewrite checks the update.
pub fn residuals(frame: &[u8], flow: &Flow) -> (u16, u16) {
    let ip = Sum16BitWords::new()
        .add_slice(&frame[ETH_HLEN..flow.l4_offset])
        .ones_complement();
    let l4_len = flow.tot_len - Ipv4Header::MIN_LEN;
    let l4 = pseudo_header_sum(*flow.src.ip(), *flow.dst.ip(), flow.proto, l4_len)
        .add_slice(&frame[flow.l4_offset..ETH_HLEN + flow.tot_len])
        .ones_complement();
    (ip, l4)
}

/// The Ethernet addresses of a frame, swapped (destination, source of the answer).
fn swapped_macs(frame: &[u8]) -> ([u8; 6], [u8; 6]) {
    let dst: [u8; 6] = frame[6..12].try_into().expect("6 bytes");
    let src: [u8; 6] = frame[0..6].try_into().expect("6 bytes");
    (dst, src)
}

/// The answer frame a no-backend Service must send for a TCP segment (not
/// RST) `flow` parsed from `frame`: RST from the frontend back to the client.
pub fn expected_rst(frame: &[u8], flow: &Flow) -> Vec<u8> {
    let tcp = rst_answering(
        flow.tcp_flags,
        flow.seq,
        flow.ack,
        flow.payload_len as u32,
        (flow.dst.port(), flow.src.port()),
    );
    answer4(frame, flow, L4::Tcp(tcp), true)
}

/// The RST answering a segment with `flags`, `seq`, `ack` and
/// `payload_len` bytes (RFC 793's reset generation), from and to `ports`:
/// with ACK its sequence number is that ACK, else it acknowledges all the
/// segment occupied.
fn rst_answering(flags: u8, seq: u32, ack: u32, payload_len: u32, ports: (u16, u16)) -> Tcp {
    use tcp_flags::*;
    let (flags, seq, ack) = if flags & ACK != 0 {
        (RST, ack, 0)
    } else {
        let syn = u32::from(flags & SYN != 0);
        let fin = u32::from(flags & FIN != 0);
        (
            RST | ACK,
            0,
            seq.wrapping_add(payload_len).wrapping_add(syn).wrapping_add(fin),
        )
    };
    Tcp {
        sport: ports.0,
        dport: ports.1,
        seq,
        ack,
        flags,
        window: 0,
        urgent: 0,
        options: Vec::new(),
        payload: Vec::new(),
        data_offset: None,
    }
}

/// The answer frame a no-backend Service must send for a UDP datagram
/// `flow` parsed from `frame`: ICMP port unreachable quoting the original
/// IPv4 header and the first 8 bytes of the UDP header as received.
pub fn expected_port_unreachable(frame: &[u8], flow: &Flow) -> Vec<u8> {
    let quoted = frame[ETH_HLEN..flow.l4_offset + 8].to_vec();
    let icmp = Icmp {
        icmp_type: Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port),
        payload: quoted,
    };
    answer4(frame, flow, L4::Icmp(icmp), false)
}

/// The IPv4 answer to `flow` (parsed from `frame`) carrying `l4`: its
/// addresses swapped, IP id 0, TTL 64, DF as `df`.
fn answer4(frame: &[u8], flow: &Flow, l4: L4, df: bool) -> Vec<u8> {
    let (eth_dst, eth_src) = swapped_macs(frame);
    let mut ip = Ipv4::new(*flow.dst.ip(), *flow.src.ip(), l4);
    ip.id = 0;
    ip.ttl = 64;
    ip.df = df;
    Frame {
        eth_src,
        eth_dst,
        vlans: Vec::new(),
        net: Net::Ipv4(ip),
        padding: Vec::new(),
    }
    .build()
}

/// An IPv6 extension header of a [`Frame6`]; its next header field is
/// written from what follows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ext6 {
    /// Hop-by-hop options, `units` x 8 bytes (1..=32) of padding (PadN).
    HopByHop { units: u8 },
    /// Destination options, likewise.
    DestOpts { units: u8 },
    /// A routing header (experimental type 253) with no segments left, so
    /// the destination is the final one; `units` x 8 bytes (1..=32).
    Routing { units: u8 },
    /// A fragment header: offset in 8-byte units, more fragments, the
    /// datagram's id. Offset 0 without more fragments is an atomic
    /// fragment (a whole datagram).
    Fragment { offset: u16, more: bool, id: u32 },
}

impl Ext6 {
    pub fn number(self) -> u8 {
        match self {
            Ext6::HopByHop { .. } => 0,
            Ext6::Routing { .. } => 43,
            Ext6::Fragment { .. } => 44,
            Ext6::DestOpts { .. } => 60,
        }
    }

    fn bytes(self, next: u8) -> Vec<u8> {
        let padded = |units: u8, head: [u8; 2]| {
            assert!((1..=32).contains(&units), "1 to 32 units of 8 bytes");
            let len = usize::from(units) * 8;
            let mut out = vec![0; len];
            out[0] = next;
            out[1] = units - 1;
            out[2..4].copy_from_slice(&head);
            out
        };
        match self {
            // PadN over the rest of the header.
            Ext6::HopByHop { units } | Ext6::DestOpts { units } => {
                let pad = u8::try_from(u16::from(units) * 8 - 4).expect("at most 252");
                padded(units, [1, pad])
            }
            // Routing type 253, segments left 0.
            Ext6::Routing { units } => padded(units, [253, 0]),
            Ext6::Fragment { offset, more, id } => {
                let field = (offset << 3) | u16::from(more);
                let mut out = vec![next, 0];
                out.extend_from_slice(&field.to_be_bytes());
                out.extend_from_slice(&id.to_be_bytes());
                out
            }
        }
    }
}

/// An IPv6 Ethernet frame: the fixed header, extension headers as given,
/// and TCP or UDP (checksums over the IPv6 pseudo-header, by etherparse)
/// or raw bytes (`L4::Raw`; ICMP is IPv4's and panics here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame6 {
    pub eth_src: [u8; 6],
    pub eth_dst: [u8; 6],
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub hop_limit: u8,
    pub ext: Vec<Ext6>,
    pub l4: L4,
    /// Overrides the payload length (extension headers + L4).
    pub payload_len: Option<u16>,
    /// Overrides the version nibble (6).
    pub version: Option<u8>,
}

impl Frame6 {
    fn new(src: Ipv6Addr, dst: Ipv6Addr, l4: L4) -> Self {
        Self {
            eth_src: MAC_CLIENT,
            eth_dst: MAC_NODE,
            src,
            dst,
            hop_limit: 64,
            ext: Vec::new(),
            l4,
            payload_len: None,
            version: None,
        }
    }

    /// A TCP segment with the given [`tcp_flags`], no options, no payload.
    pub fn tcp(src: SocketAddrV6, dst: SocketAddrV6, flags: u8) -> Self {
        let Net::Ipv4(ip) = Frame::tcp(v4_stand_in(src.port()), v4_stand_in(dst.port()), flags).net else {
            unreachable!("Frame::tcp builds IPv4")
        };
        Self::new(*src.ip(), *dst.ip(), ip.l4)
    }

    /// A UDP datagram with a checksum.
    pub fn udp(src: SocketAddrV6, dst: SocketAddrV6, payload: &[u8]) -> Self {
        let Net::Ipv4(ip) = Frame::udp(v4_stand_in(src.port()), v4_stand_in(dst.port()), payload).net else {
            unreachable!("Frame::udp builds IPv4")
        };
        Self::new(*src.ip(), *dst.ip(), ip.l4)
    }

    /// An SCTP packet carrying `chunks` (see [`SCTP_INIT_CHUNK`]).
    pub fn sctp(src: SocketAddrV6, dst: SocketAddrV6, vtag: u32, chunks: &[u8]) -> Self {
        let Net::Ipv4(ip) = Frame::sctp(v4_stand_in(src.port()), v4_stand_in(dst.port()), vtag, chunks).net else {
            unreachable!("Frame::sctp builds IPv4")
        };
        Self::new(*src.ip(), *dst.ip(), ip.l4)
    }

    /// A neighbour solicitation for `target` from `src` (to the target's
    /// solicited-node multicast address), checksum included.
    pub fn neighbour_solicitation(src: Ipv6Addr, target: Ipv6Addr) -> Self {
        let t = target.octets();
        let dst = Ipv6Addr::from([
            0xff02,
            0,
            0,
            0,
            0,
            1,
            0xff00 | u16::from(t[13]),
            u16::from_be_bytes([t[14], t[15]]),
        ]);
        let mut icmp = vec![135, 0, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(&t);
        // Source link-layer address option.
        icmp.extend_from_slice(&[1, 1]);
        icmp.extend_from_slice(&MAC_CLIENT);
        let sum = pseudo_header_sum6(src, dst, 58, icmp.len()).add_slice(&icmp);
        icmp[2..4].copy_from_slice(&sum.ones_complement().to_be().to_be_bytes());
        let mut frame = Self::new(src, dst, L4::Raw { proto: 58, bytes: icmp });
        frame.hop_limit = 255;
        frame.eth_dst = [0x33, 0x33, 0xff, t[13], t[14], t[15]];
        frame
    }

    /// An ICMPv6 error from `src` to `dst` quoting `quote` (an IPv6 packet
    /// from its header on, cut where the sender cut it); checksum by
    /// etherparse.
    pub fn icmp6_error(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: Icmpv6Type, quote: &[u8]) -> Self {
        let header =
            Icmpv6Header::with_checksum(icmp_type, src.octets(), dst.octets(), quote).expect("a quote that fits");
        let mut icmp = header.to_bytes().to_vec();
        icmp.extend_from_slice(quote);
        Self::new(src, dst, L4::Raw { proto: 58, bytes: icmp })
    }

    pub fn with_ext(mut self, ext: &[Ext6]) -> Self {
        self.ext = ext.to_vec();
        self
    }

    pub fn with_src(mut self, src: SocketAddrV6) -> Self {
        self.src = *src.ip();
        *ports_mut(&mut self.l4).0 = src.port();
        self
    }

    pub fn with_dst(mut self, dst: SocketAddrV6) -> Self {
        self.dst = *dst.ip();
        *ports_mut(&mut self.l4).1 = dst.port();
        self
    }

    pub fn src(&self) -> SocketAddrV6 {
        SocketAddrV6::new(self.src, ports(&self.l4).0, 0, 0)
    }

    pub fn dst(&self) -> SocketAddrV6 {
        SocketAddrV6::new(self.dst, ports(&self.l4).1, 0, 0)
    }

    pub fn tcp_mut(&mut self) -> &mut Tcp {
        match &mut self.l4 {
            L4::Tcp(tcp) => tcp,
            l4 => panic!("not TCP: {l4:?}"),
        }
    }

    /// The on-the-wire bytes.
    pub fn build(&self) -> Vec<u8> {
        let (proto, l4) = match &self.l4 {
            L4::Tcp(tcp) => (IpNumber::TCP.0, build_tcp6(self, tcp)),
            L4::Udp(udp) => (IpNumber::UDP.0, build_udp6(self, udp)),
            // SCTP's CRC32c covers no IP address: the same bytes as over IPv4.
            L4::Sctp(sctp) => (IpNumber::SCTP.0, build_sctp(sctp)),
            L4::Raw { proto, bytes } => (*proto, bytes.clone()),
            L4::Icmp(_) => panic!("ICMP (v4) in an IPv6 frame"),
        };
        let mut exts = Vec::new();
        for (i, ext) in self.ext.iter().enumerate() {
            let next = self.ext.get(i + 1).map_or(proto, |e| e.number());
            exts.extend_from_slice(&ext.bytes(next));
        }
        let first = self.ext.first().map_or(proto, |e| e.number());
        let payload_len = self.payload_len.unwrap_or((exts.len() + l4.len()) as u16);
        let version = self.version.unwrap_or(6);
        let mut out = Vec::with_capacity(ETH_HLEN + 40 + exts.len() + l4.len());
        out.extend_from_slice(&self.eth_dst);
        out.extend_from_slice(&self.eth_src);
        out.extend_from_slice(&ETHERTYPE_IPV6.to_be_bytes());
        out.extend_from_slice(&[version << 4, 0, 0, 0]);
        out.extend_from_slice(&payload_len.to_be_bytes());
        out.extend_from_slice(&[first, self.hop_limit]);
        out.extend_from_slice(&self.src.octets());
        out.extend_from_slice(&self.dst.octets());
        out.extend_from_slice(&exts);
        out.extend_from_slice(&l4);
        out
    }
}

/// An IPv4 stand-in with `port`, to borrow IPv4's L4 defaults.
fn v4_stand_in(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)
}

fn build_tcp6(frame: &Frame6, tcp: &Tcp) -> Vec<u8> {
    let mut out = build_tcp(&v4_shell(), tcp);
    out[16..18].copy_from_slice(&[0, 0]);
    let sum = pseudo_header_sum6(frame.src, frame.dst, IpNumber::TCP.0, out.len()).add_slice(&out);
    out[16..18].copy_from_slice(&sum.ones_complement().to_be().to_be_bytes());
    out
}

fn build_udp6(frame: &Frame6, udp: &Udp) -> Vec<u8> {
    let mut out = build_udp(
        &v4_shell(),
        &Udp {
            zero_checksum: true,
            ..udp.clone()
        },
    );
    if !udp.zero_checksum {
        let sum = pseudo_header_sum6(frame.src, frame.dst, IpNumber::UDP.0, out.len()).add_slice(&out);
        let check = match sum.ones_complement().to_be() {
            0 => 0xffff,
            check => check,
        };
        out[6..8].copy_from_slice(&check.to_be_bytes());
    }
    out
}

/// An IPv4 header to build an L4 header in, its checksum then redone.
fn v4_shell() -> Ipv4 {
    Ipv4::new(
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        L4::Raw {
            proto: 0,
            bytes: Vec::new(),
        },
    )
}

fn pseudo_header_sum6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, l4_len: usize) -> Sum16BitWords {
    Sum16BitWords::new()
        .add_16bytes(src.octets())
        .add_16bytes(dst.octets())
        .add_4bytes((l4_len as u32).to_be_bytes())
        .add_4bytes([0, 0, 0, proto])
}

/// The longest ICMPv6 error: one at the IPv6 minimum MTU (RFC 8200 5).
pub const IPV6_MIN_MTU: usize = 1280;

/// The answer a no-backend Service must send for the IPv6 TCP segment
/// `request` (not RST): a RST as [`expected_rst`]'s, from the frontend
/// back to the client, without extension headers, hop limit 64.
pub fn expected_rst6(request: &Frame6) -> Vec<u8> {
    let L4::Tcp(tcp) = &request.l4 else {
        panic!("not TCP: {:?}", request.l4)
    };
    let payload_len = tcp.payload.len() as u32;
    let rst = rst_answering(tcp.flags, tcp.seq, tcp.ack, payload_len, (tcp.dport, tcp.sport));
    answer6(request, L4::Tcp(rst)).build()
}

/// [`expected_rst6`] for the segment `flow` parsed from `frame` (any
/// frame [`parse_strict`] takes, extension headers and all).
pub fn expected_rst6_of(frame: &[u8], flow: &Flow6) -> Vec<u8> {
    let rst = rst_answering(
        flow.tcp_flags,
        flow.seq,
        flow.ack,
        flow.payload_len as u32,
        (flow.dst.port(), flow.src.port()),
    );
    answer6_of(frame, flow, L4::Tcp(rst))
}

/// The answer a no-backend Service must send for the IPv6 UDP datagram
/// `request`: ICMPv6 destination unreachable, code 4 (port), quoting the
/// request from its IPv6 header on, as much as fits in an error of
/// [`IPV6_MIN_MTU`] bytes (RFC 4443 2.4 (c)); checksum by etherparse.
pub fn expected_port_unreachable6(request: &Frame6) -> Vec<u8> {
    let bytes = request.build();
    let icmp = port_unreachable6(request.dst, request.src, &bytes[ETH_HLEN..]);
    answer6(request, icmp).build()
}

/// [`expected_port_unreachable6`] for the datagram `flow` parsed from
/// `frame`: the quote is the packet up to its payload length.
pub fn expected_port_unreachable6_of(frame: &[u8], flow: &Flow6) -> Vec<u8> {
    let icmp = port_unreachable6(*flow.dst.ip(), *flow.src.ip(), &frame[ETH_HLEN..flow.end]);
    answer6_of(frame, flow, icmp)
}

/// An ICMPv6 port unreachable from `src` to `dst` quoting as much of
/// `packet` as fits in [`IPV6_MIN_MTU`].
fn port_unreachable6(src: Ipv6Addr, dst: Ipv6Addr, packet: &[u8]) -> L4 {
    let quote = &packet[..packet.len().min(IPV6_MIN_MTU - 40 - 8)];
    let icmp_type = Icmpv6Type::DestinationUnreachable(DestUnreachableCode::Port);
    let header = Icmpv6Header::with_checksum(icmp_type, src.octets(), dst.octets(), quote)
        .expect("a quote of at most 1232 bytes");
    let mut icmp = header.to_bytes().to_vec();
    icmp.extend_from_slice(quote);
    L4::Raw { proto: 58, bytes: icmp }
}

/// An answer to `flow` (parsed from `frame`) carrying `l4`, as [`answer6`].
fn answer6_of(frame: &[u8], flow: &Flow6, l4: L4) -> Vec<u8> {
    let (eth_dst, eth_src) = swapped_macs(frame);
    Frame6 {
        eth_src,
        eth_dst,
        ..Frame6::new(*flow.dst.ip(), *flow.src.ip(), l4)
    }
    .build()
}

/// An answer to `request` carrying `l4`: its addresses swapped, no
/// extension headers, a fresh hop limit of 64.
fn answer6(request: &Frame6, l4: L4) -> Frame6 {
    Frame6 {
        eth_src: request.eth_dst,
        eth_dst: request.eth_src,
        ..Frame6::new(request.dst, request.src, l4)
    }
}

/// What [`check6`] found in an IPv6 frame whose L4 checksum is valid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked6 {
    pub src: SocketAddrV6,
    pub dst: SocketAddrV6,
    pub proto: u8,
    /// Where the L4 header starts (after the extension headers).
    pub l4_offset: usize,
}

/// Parses an untagged Ethernet + IPv6 frame with hop-by-hop, routing,
/// destination options and (atomic) fragment headers, TCP or UDP after
/// them (or ICMPv6, its ports then 0), and verifies the L4 checksum over
/// the IPv6 pseudo-header (etherparse computes it).
pub fn check6(frame: &[u8]) -> Result<Checked6, String> {
    let (eth, rest) = Ethernet2Header::from_slice(frame).map_err(|e| format!("Ethernet: {e}"))?;
    if eth.ether_type != EtherType::IPV6 {
        return Err(format!("ether type {:#06x} is not IPv6", eth.ether_type.0));
    }
    let ip = rest.get(..40).ok_or("truncated IPv6 header")?;
    let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let packet = rest.get(..40 + payload_len).ok_or("payload length beyond the frame")?;
    let src: [u8; 16] = ip[8..24].try_into().map_err(|_| "source")?;
    let dst: [u8; 16] = ip[24..40].try_into().map_err(|_| "destination")?;
    let (mut next, mut off) = (ip[6], 40);
    while matches!(next, 0 | 43 | 44 | 60) {
        let head = packet.get(off..off + 2).ok_or("truncated extension header")?;
        off += if next == 44 { 8 } else { (usize::from(head[1]) + 1) * 8 };
        next = head[0];
    }
    let l4 = packet.get(off..).ok_or("extension headers beyond the payload")?;
    let (sport, dport) = match next {
        6 => {
            let (tcp, payload) = TcpHeader::from_slice(l4).map_err(|e| format!("TCP header: {e}"))?;
            let want = tcp
                .calc_checksum_ipv6_raw(src, dst, payload)
                .map_err(|e| e.to_string())?;
            if !same_checksum(tcp.checksum, want) {
                return Err(format!("TCP checksum {:#06x}, should be {want:#06x}", tcp.checksum));
            }
            (tcp.source_port, tcp.destination_port)
        }
        17 => {
            let (udp, payload) = UdpHeader::from_slice(l4).map_err(|e| format!("UDP header: {e}"))?;
            let want = udp
                .calc_checksum_ipv6_raw(src, dst, payload)
                .map_err(|e| e.to_string())?;
            if udp.checksum != want {
                return Err(format!("UDP checksum {:#06x}, should be {want:#06x}", udp.checksum));
            }
            (udp.source_port, udp.destination_port)
        }
        132 => {
            let ports = l4
                .get(..sctp::COMMON_HEADER_LEN)
                .ok_or("truncated SCTP common header")?;
            if !sctp::checksum_ok(l4) {
                return Err(format!("SCTP CRC32c wrong in {}", hex(l4)));
            }
            (
                u16::from_be_bytes([ports[0], ports[1]]),
                u16::from_be_bytes([ports[2], ports[3]]),
            )
        }
        58 => {
            let icmp = Icmpv6Slice::from_slice(l4).map_err(|e| format!("ICMPv6 header: {e}"))?;
            if !icmp.is_checksum_valid(src, dst) {
                return Err(format!("ICMPv6 checksum {:#06x} is wrong", icmp.checksum()));
            }
            (0, 0)
        }
        other => return Err(format!("L4 protocol {other} is neither TCP, UDP, SCTP nor ICMPv6")),
    };
    Ok(Checked6 {
        src: SocketAddrV6::new(Ipv6Addr::from(src), sport, 0, 0),
        dst: SocketAddrV6::new(Ipv6Addr::from(dst), dport, 0, 0),
        proto: next,
        l4_offset: ETH_HLEN + off,
    })
}

/// Hex dump for failure messages.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Byte offsets where `a` and `b` differ, plus a note if lengths differ.
pub fn diff(a: &[u8], b: &[u8]) -> String {
    let mut out: Vec<String> = a
        .iter()
        .zip(b)
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, (x, y))| format!("[{i}] {x:02x}!={y:02x}"))
        .collect();
    if a.len() != b.len() {
        out.push(format!("length {} != {}", a.len(), b.len()));
    }
    out.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddrV4 {
        s.parse().expect("valid socket address")
    }

    #[test]
    fn built_frames_pass_the_checker() {
        let syn = Frame::tcp(addr("10.244.1.5:40000"), addr("10.96.0.10:88"), tcp_flags::SYN)
            .with_tcp(|t| t.options = vec![2, 4, 5, 0xb4, 1, 3, 3, 7]);
        let bytes = syn.build();
        assert_eq!(bytes.len(), 14 + 20 + 28);
        check(&bytes).expect("valid SYN");
        assert!(matches!(parse_strict(&bytes), Strict::Flow(f) if f.dst == addr("10.96.0.10:88") && f.tcp_flags == 2));

        let udp = Frame::udp(addr("10.244.1.5:40000"), addr("10.96.0.10:88"), b"hello").build();
        check(&udp).expect("valid UDP");
        let zero = Frame::udp(addr("10.244.1.5:40000"), addr("10.96.0.10:88"), b"hello")
            .with_udp(|u| u.zero_checksum = true)
            .build();
        assert_eq!(&zero[40..42], &[0, 0]);
        check(&zero).expect("UDP without checksum");

        let echo = Frame::icmp_echo(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)).build();
        check(&echo).expect("valid ICMP");
        assert_eq!(
            parse_strict(&echo),
            Strict::NotIpv4OrL4("ICMP: not destination unreachable or time exceeded")
        );
    }

    #[test]
    fn a_flipped_bit_fails_the_checker() {
        let bytes = Frame::tcp(addr("10.244.1.5:40000"), addr("10.96.0.10:88"), tcp_flags::SYN).build();
        for bit in [14 * 8 + 8 * 8, 34 * 8 + 4 * 8] {
            let mut bad = bytes.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(check(&bad).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn overrides_write_invalid_fields_with_valid_checksums() {
        let base = Frame::tcp(addr("10.244.1.5:40000"), addr("10.96.0.10:88"), tcp_flags::SYN);
        let ihl4 = base.clone().with_ip(|ip| ip.ihl = Some(4)).build();
        assert_eq!(ihl4[14], 0x44);
        assert_eq!(Sum16BitWords::new().add_slice(&ihl4[14..34]).ones_complement(), 0);
        assert_eq!(parse_strict(&ihl4), Strict::Malformed("IHL (options or too short)"));
        let v6 = base.clone().with_ip(|ip| ip.version = Some(6)).build();
        assert_eq!(v6[14], 0x65);
        let opts = base.clone().with_ip(|ip| ip.options = vec![1, 1, 1, 0]).build();
        assert_eq!(opts[14], 0x46);
        check(&opts).expect("options are valid IPv4");
        let doff = base.clone().with_tcp(|t| t.data_offset = Some(4)).build();
        assert_eq!(doff[46] >> 4, 4);
        let qinq = base
            .clone()
            .with_vlan(ETHERTYPE_QINQ, 100)
            .with_vlan(ETHERTYPE_VLAN, 200)
            .build();
        assert_eq!(&qinq[12..22], &[0x88, 0xa8, 0, 100, 0x81, 0, 0, 200, 0x08, 0x00]);
        let frag = base.clone().with_ip(|ip| ip.frag_offset = 3).build();
        assert!(matches!(
            parse_strict(&frag),
            Strict::LaterFragment(LaterFragment {
                proto: 6,
                ip_id: 0x1234,
                tot_len: 40,
                ..
            })
        ));
        let icmp_frag = Frame::icmp_echo(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2))
            .with_ip(|ip| ip.frag_offset = 3)
            .build();
        assert_eq!(parse_strict(&icmp_frag), Strict::NotIpv4OrL4("L4 protocol"));
    }

    #[test]
    fn a_first_fragments_udp_length_may_reach_past_it() {
        let udp = Frame::udp(addr("10.244.1.5:40000"), addr("10.96.0.10:88"), &[7; 40]);
        let pieces = fragments(&udp, 16);
        assert_eq!(pieces.len(), 3);
        let Strict::Flow(first) = parse_strict(&pieces[0].build()) else {
            panic!("a first fragment is a flow")
        };
        assert!(first.first_fragment);
        assert_eq!(
            (first.dst, first.payload_len, first.tot_len),
            (addr("10.96.0.10:88"), 40, 36)
        );
        // Whole, the same length is beyond the datagram.
        let long = udp.clone().with_udp(|u| u.length = Some(49)).build();
        assert_eq!(
            parse_strict(&long),
            Strict::Malformed("UDP length beyond the total length")
        );
        // The 8-byte header must be there, even in a first fragment.
        let cut = pieces[0].clone().with_ip(|ip| ip.tot_len = Some(27)).build();
        assert_eq!(
            parse_strict(&cut),
            Strict::Malformed("IPv4 total length below the UDP header")
        );
        assert!(matches!(
            parse_strict(&pieces[2].build()),
            Strict::LaterFragment(LaterFragment { proto: 17, .. })
        ));
    }

    #[test]
    fn icmp_errors_quoting_tcp_or_udp_are_parsed_with_their_quote() {
        use etherparse::icmpv4::TimeExceededCode;
        let (client, backend) = (addr("10.244.1.5:40000"), addr("10.244.0.11:80"));
        let request = Frame::udp(client, backend, b"query").build();
        let unreachable = Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::Port);
        let error = Frame::icmp_error(*backend.ip(), *client.ip(), unreachable.clone(), &request[14..]);
        let Strict::IcmpError(e) = parse_strict(&error.build()) else {
            panic!("an error quoting UDP")
        };
        assert_eq!(
            (e.quoted_src, e.quoted_dst, e.quoted_proto, e.icmp_type),
            (client, backend, 17, 3)
        );
        assert_eq!((e.src, e.dst, e.tot_len), (*backend.ip(), *client.ip(), 20 + 8 + 33));
        // The ports are the least a quote must hold.
        let syn = Frame::tcp(client, backend, tcp_flags::SYN).build();
        let ttl = Icmpv4Type::TimeExceeded(TimeExceededCode::TtlExceededInTransit);
        for (quoted, parses) in [(23, false), (24, true), (28, true)] {
            let error = Frame::icmp_error(*backend.ip(), *client.ip(), ttl.clone(), &syn[14..14 + quoted]).build();
            match parse_strict(&error) {
                Strict::IcmpError(e) => assert!(parses && e.tot_len == 28 + quoted, "{quoted}"),
                other => assert!(
                    !parses && matches!(other, Strict::NotIpv4OrL4(_)),
                    "{quoted}: {other:?}"
                ),
            }
        }
        // Any code of the two types; nothing else, and no fragment.
        let mut odd_code = error.build();
        odd_code[35] = 200;
        assert!(matches!(parse_strict(&odd_code), Strict::IcmpError(_)));
        let mut redirect = error.build();
        redirect[34] = 5;
        assert!(matches!(parse_strict(&redirect), Strict::NotIpv4OrL4(_)));
        let fragmented = error.clone().with_ip(|ip| ip.mf = true).build();
        assert_eq!(parse_strict(&fragmented), Strict::NotIpv4OrL4("L4 protocol"));
        let echo = Frame::icmp_echo(*client.ip(), *backend.ip()).build();
        let about_icmp = Frame::icmp_error(*backend.ip(), *client.ip(), unreachable, &echo[14..]).build();
        assert!(matches!(parse_strict(&about_icmp), Strict::NotIpv4OrL4(_)));
    }

    #[test]
    fn reject_answers_have_the_specified_layout() {
        let syn = Frame::tcp(addr("10.244.1.5:40000"), addr("10.96.0.20:80"), tcp_flags::SYN).build();
        let Strict::Flow(flow) = parse_strict(&syn) else {
            panic!("valid SYN")
        };
        let rst = expected_rst(&syn, &flow);
        assert_eq!(rst.len(), 54);
        let c = check(&rst).expect("valid RST");
        assert_eq!(c.ip.total_len, 40);
        let CheckedL4::Tcp(tcp) = c.l4 else { panic!("TCP") };
        assert!(tcp.rst && tcp.ack && !tcp.syn);
        assert_eq!(tcp.acknowledgment_number, flow.seq + 1);

        let udp = Frame::udp(addr("10.244.1.5:40000"), addr("10.96.0.20:80"), b"q").build();
        let Strict::Flow(flow) = parse_strict(&udp) else {
            panic!("valid UDP")
        };
        let icmp = expected_port_unreachable(&udp, &flow);
        assert_eq!(icmp.len(), 70);
        let c = check(&icmp).expect("valid ICMP");
        assert_eq!(c.ip.total_len, 56);
        assert!(!c.ip.dont_fragment);
        assert_eq!(&icmp[34..38], &[3, 3, icmp[36], icmp[37]]);
        assert_eq!(&icmp[42..70], &udp[14..42]);
    }
}
