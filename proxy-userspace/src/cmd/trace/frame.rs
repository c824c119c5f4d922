//! The synthetic frame a trace runs through a program (Ethernet, IPv4,
//! TCP, UDP or an SCTP INIT, correct checksums, no payload) and the addresses and ports
//! read back from the frame the program left.

use std::net::{Ipv4Addr, SocketAddrV4};

use etherparse::{IpNumber, Ipv4HeaderSlice, PacketBuilder};
use proxy_common::sctp;
use serde::Serialize;

use crate::model::Protocol;

/// Locally administered MAC addresses: the programs do not look at them.
const MAC_CLIENT: [u8; 6] = [0x02, 0x78, 0x70, 0x00, 0x00, 0x01];
const MAC_NODE: [u8; 6] = [0x02, 0x78, 0x70, 0x00, 0x00, 0x02];
const TTL: u8 = 64;
const ETH_HLEN: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
/// A TCP window that any stack accepts.
const TCP_WINDOW: u16 = 64_240;

/// The packet a trace sends: who to whom, over what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuple {
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub proto: Protocol,
}

/// Builds the frame of `tuple`. A TCP segment is a SYN (the first packet
/// of a connection) when `syn` is set, else a bare ACK (a packet of one
/// under way); UDP ignores `syn`; SCTP is an INIT when `syn` is set, else a
/// DATA chunk of an association under way.
pub fn build(tuple: &Tuple, syn: bool) -> Vec<u8> {
    let ip = PacketBuilder::ethernet2(MAC_CLIENT, MAC_NODE).ipv4(tuple.src.ip().octets(), tuple.dst.ip().octets(), TTL);
    let mut frame = Vec::new();
    let (sport, dport) = (tuple.src.port(), tuple.dst.port());
    // Writing into a Vec fails only for payloads too large for IPv4; ours is empty.
    let written = match tuple.proto {
        Protocol::Udp => ip.udp(sport, dport).write(&mut frame, &[]),
        Protocol::Tcp if syn => ip.tcp(sport, dport, 1, TCP_WINDOW).syn().write(&mut frame, &[]),
        Protocol::Tcp => ip.tcp(sport, dport, 1, TCP_WINDOW).ack(1).write(&mut frame, &[]),
        Protocol::Sctp => ip.write(&mut frame, IpNumber::SCTP, &sctp_packet(sport, dport, syn)),
    };
    debug_assert!(written.is_ok(), "an empty payload always fits");
    frame
}

/// An SCTP packet from `sport` to `dport`: an INIT chunk (verification tag
/// 0, as RFC 9260 wants it) or a DATA chunk with one byte, its CRC32c set.
fn sctp_packet(sport: u16, dport: u16, init: bool) -> Vec<u8> {
    const TAG: [u8; 4] = [0x78, 0x70, 0x00, 0x01];
    let mut packet = Vec::with_capacity(32);
    packet.extend_from_slice(&sport.to_be_bytes());
    packet.extend_from_slice(&dport.to_be_bytes());
    packet.extend_from_slice(if init { &[0; 4] } else { &TAG });
    packet.extend_from_slice(&[0; 4]);
    if init {
        // type, flags, length 20; initiate tag, a_rwnd 64 KiB, 1 stream
        // each way, initial TSN 1.
        packet.extend_from_slice(&[sctp::chunk::INIT, 0, 0, 20]);
        packet.extend_from_slice(&TAG);
        packet.extend_from_slice(&[0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1]);
    } else {
        // type, flags (B|E), length 17; TSN 1, stream 0, sequence 0,
        // payload protocol 0, one byte, padded to 4.
        packet.extend_from_slice(&[
            sctp::chunk::DATA,
            3,
            0,
            17,
            0,
            0,
            0,
            1,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            b'x',
            0,
            0,
            0,
        ]);
    }
    sctp::set_checksum(&mut packet);
    packet
}

/// Addresses and ports of an IPv4 frame (ports only for TCP, UDP and SCTP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Headers {
    /// IP protocol number.
    pub proto: u8,
    pub src: Ipv4Addr,
    pub src_port: Option<u16>,
    pub dst: Ipv4Addr,
    pub dst_port: Option<u16>,
}

impl Headers {
    /// `ADDR:PORT`, or `ADDR` where the protocol has no ports.
    pub fn source(&self) -> String {
        endpoint(self.src, self.src_port)
    }

    pub fn destination(&self) -> String {
        endpoint(self.dst, self.dst_port)
    }
}

fn endpoint(addr: Ipv4Addr, port: Option<u16>) -> String {
    match port {
        Some(port) => SocketAddrV4::new(addr, port).to_string(),
        None => addr.to_string(),
    }
}

/// The headers of `frame`; `None` if it is not untagged Ethernet + IPv4
/// (the programs only rewrite or answer with such frames).
pub fn headers(frame: &[u8]) -> Option<Headers> {
    let ether_type = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    if ether_type != ETHERTYPE_IPV4 {
        return None;
    }
    let ip = Ipv4HeaderSlice::from_slice(frame.get(ETH_HLEN..)?).ok()?;
    let proto = ip.protocol().0;
    let l4 = frame.get(ETH_HLEN + ip.slice().len()..)?;
    let ports = match (proto, l4) {
        (proxy_common::proto::TCP | proxy_common::proto::UDP | proxy_common::proto::SCTP, [s0, s1, d0, d1, ..]) => {
            Some((u16::from_be_bytes([*s0, *s1]), u16::from_be_bytes([*d0, *d1])))
        }
        _ => None,
    };
    Some(Headers {
        proto,
        src: ip.source_addr(),
        src_port: ports.map(|p| p.0),
        dst: ip.destination_addr(),
        dst_port: ports.map(|p| p.1),
    })
}

#[cfg(test)]
mod tests {
    use etherparse::{NetSlice, SlicedPacket, TransportSlice};

    use super::*;

    fn tuple(proto: Protocol) -> Tuple {
        Tuple {
            src: "10.244.0.14:49152".parse().expect("literal"),
            dst: "10.96.0.88:88".parse().expect("literal"),
            proto,
        }
    }

    /// The frame parsed by etherparse, with its IPv4 and L4 checksums
    /// recomputed and compared with the ones written.
    fn checked(frame: &[u8]) -> (SlicedPacket<'_>, Option<TransportSlice<'_>>) {
        let packet = SlicedPacket::from_ethernet(frame).expect("a valid frame");
        let Some(NetSlice::Ipv4(ip)) = &packet.net else {
            panic!("not IPv4: {packet:?}");
        };
        let header = ip.header().to_header();
        assert_eq!(header.header_checksum, header.calc_header_checksum(), "IPv4 checksum");
        let transport = packet.transport.clone();
        match &transport {
            Some(TransportSlice::Tcp(tcp)) => {
                let sum = tcp.to_header().calc_checksum_ipv4(&header, tcp.payload()).expect("sum");
                assert_eq!(tcp.checksum(), sum, "TCP checksum");
            }
            Some(TransportSlice::Udp(udp)) => {
                let sum = udp.to_header().calc_checksum_ipv4(&header, udp.payload()).expect("sum");
                assert_eq!(udp.checksum(), sum, "UDP checksum");
            }
            other => panic!("no TCP/UDP: {other:?}"),
        }
        (packet, transport)
    }

    #[test]
    fn a_syn_has_the_tuple_and_correct_checksums() {
        let frame = build(&tuple(Protocol::Tcp), true);
        let (_, transport) = checked(&frame);
        let Some(TransportSlice::Tcp(tcp)) = transport else {
            panic!("not TCP")
        };
        assert!(tcp.syn() && !tcp.ack(), "SYN only");
        assert_eq!((tcp.source_port(), tcp.destination_port()), (49152, 88));
    }

    #[test]
    fn without_syn_tcp_is_an_ack_of_a_connection_under_way() {
        let frame = build(&tuple(Protocol::Tcp), false);
        let Some(TransportSlice::Tcp(tcp)) = checked(&frame).1 else {
            panic!("not TCP")
        };
        assert!(tcp.ack() && !tcp.syn());
    }

    #[test]
    fn udp_is_a_datagram_with_a_checksum() {
        let frame = build(&tuple(Protocol::Udp), true);
        let Some(TransportSlice::Udp(udp)) = checked(&frame).1 else {
            panic!("not UDP")
        };
        assert_ne!(udp.checksum(), 0, "a UDP checksum is written");
        // Long enough for BPF_PROG_TEST_RUN of a tc program (14 + 20 bytes).
        assert_eq!(frame.len(), 14 + 20 + 8);
    }

    #[test]
    fn headers_read_back_what_was_built() {
        let t = tuple(Protocol::Udp);
        let got = headers(&build(&t, false)).expect("IPv4");
        assert_eq!(got.proto, proxy_common::proto::UDP);
        assert_eq!(got.source(), "10.244.0.14:49152");
        assert_eq!(got.destination(), "10.96.0.88:88");
    }

    #[test]
    fn headers_of_what_is_not_ipv4_are_none() {
        let mut frame = build(&tuple(Protocol::Tcp), true);
        frame[12..14].copy_from_slice(&0x86dd_u16.to_be_bytes());
        assert_eq!(headers(&frame), None);
        assert_eq!(headers(&frame[..10]), None);
    }

    #[test]
    fn an_icmp_answer_has_addresses_only() {
        let mut frame = Vec::new();
        PacketBuilder::ethernet2(MAC_NODE, MAC_CLIENT)
            .ipv4([10, 96, 0, 88], [10, 244, 0, 14], TTL)
            .icmpv4_echo_reply(1, 1)
            .write(&mut frame, &[])
            .expect("written");
        let got = headers(&frame).expect("IPv4");
        assert_eq!(
            (got.source(), got.destination()),
            ("10.96.0.88".into(), "10.244.0.14".into())
        );
    }

    /// An SCTP trace frame: IPv4 protocol 132, the tuple's ports in the
    /// common header, an INIT (or a DATA chunk) with a valid CRC32c.
    #[test]
    fn an_sctp_frame_is_an_init_or_data_with_its_crc() {
        let t = tuple(Protocol::Sctp);
        for (syn, chunk) in [(true, sctp::chunk::INIT), (false, sctp::chunk::DATA)] {
            let frame = build(&t, syn);
            let got = headers(&frame).expect("IPv4");
            assert_eq!(got.proto, proxy_common::proto::SCTP);
            assert_eq!(
                (got.source(), got.destination()),
                (t.src.to_string(), t.dst.to_string())
            );
            let packet = &frame[ETH_HLEN + 20..];
            assert_eq!(packet[sctp::FIRST_CHUNK_TYPE_OFFSET], chunk);
            assert!(sctp::checksum_ok(packet), "CRC32c of {packet:02x?}");
        }
    }
}
