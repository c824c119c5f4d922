//! IPv6 fragments (proxy-ebpf's `ipv6::fragments`): datagrams in
//! fragments arrive whole and translated both ways (reassembled and their
//! UDP checksum checked with etherparse), the first fragment's ports read
//! back from `XP_FRAGS6`, and later fragments whose first was not seen
//! pass untouched in any order.

use proxy_common::{Frag6Key, FragPorts};
use testbed::frame::{fragments6, reassemble_udp6};

use super::*;

/// Fragment payloads of a 1,500-byte MTU: 1,500 - 40 - 8, rounded down to 8.
const CHUNK6: usize = 1448;

/// A UDP datagram of `len` payload bytes, behind `ext`, in fragments with
/// an id of its own; returns the frames and the id.
fn fragmented6(h: &mut Harness, src: SocketAddrV6, dst: SocketAddrV6, len: usize, ext: &[Ext6]) -> (Vec<Vec<u8>>, u32) {
    let payload: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let id = 0x6000_0000 | u32::from(h.next_port());
    let datagram = Frame6::udp(src, dst, &payload).with_ext(ext);
    let frames = fragments6(&datagram, CHUNK6, id).iter().map(Frame6::build).collect();
    (frames, id)
}

fn remembered_ports(h: &Harness, src: SocketAddrV6, dst: SocketAddrV6, id: u32) -> Option<FragPorts> {
    let map: BpfHashMap<MapData, Frag6Key, FragPorts> = pinned(h, map_names::FRAGMENTS6);
    let key = Frag6Key {
        saddr_be: addr6_be(*src.ip()),
        daddr_be: addr6_be(*dst.ip()),
        id_be: id.to_be(),
        proto: proto::UDP,
        _pad: [0; 3],
    };
    map.get(&key, 0).ok()
}

/// A 4,000-byte datagram to the ClusterIP (and one behind a destination
/// options header to the NodePort) and a 3,000-byte answer, each in
/// fragments, through every program: each arrives whole and translated.
#[test]
fn ipv6_fragmented_datagrams_are_translated_whole() {
    if !require_root("ipv6_fragmented_datagrams_are_translated_whole") {
        return;
    }
    let mut h = seeded6();
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let node_port = v6(NODE_IP6, NODE_PORT);
    let opts = [Ext6::DestOpts { units: 1 }];
    for prog in Prog::ALL {
        for (c, frontend, ext) in [
            (client6(&mut h), cluster, &[][..]),
            (external6(&mut h), node_port, &opts[..]),
        ] {
            let what = format!("to {frontend} behind {ext:?} via {}", prog.name());
            let (request, id) = fragmented6(&mut h, c, frontend, 4000, ext);
            assert_eq!(request.len(), 3);
            let out = run_fragments(&mut h, prog, &request, Verdict::DnatNew, Verdict::DnatEstablished);
            let (src, backend) = reassemble_udp6(&out).unwrap_or_else(|e| panic!("request {what}: {e}"));
            assert_eq!(src, c, "{what}");
            assert!(backends6().contains(&backend), "{what}: {backend} is no backend");
            let ports = remembered_ports(&h, c, frontend, id).unwrap_or_else(|| panic!("{what}: not in XP_FRAGS6"));
            assert_eq!(
                (u16::from_be(ports.sport_be), u16::from_be(ports.dport_be)),
                (c.port(), frontend.port()),
                "{what}"
            );
            let (answer, _) = fragmented6(&mut h, backend, c, 3000, ext);
            let out = run_fragments(&mut h, prog, &answer, Verdict::RevNat, Verdict::RevNat);
            let ends = reassemble_udp6(&out).unwrap_or_else(|e| panic!("answer {what}: {e}"));
            assert_eq!(ends, (frontend, c), "{what}");
        }
    }
}

/// Later fragments before their first pass untouched (never translated as
/// port 0); after the first, they are translated; a duplicated first
/// fragment is translated alike; without a first, none is.
#[test]
fn ipv6_fragments_in_any_order_are_never_taken_for_port_0() {
    if !require_root("ipv6_fragments_in_any_order_are_never_taken_for_port_0") {
        return;
    }
    let mut h = seeded6();
    let cluster = v6(CLUSTER_IP6, SERVICE_PORT);
    let untracked = Verdict::PassFragmentUntracked;
    for prog in Prog::ALL {
        let c = client6(&mut h);
        let (frames, _) = fragmented6(&mut h, c, cluster, 4000, &[]);
        for (i, later) in frames[1..].iter().enumerate() {
            let what = format!("fragment {} before the first", i + 1);
            assert_passed(&mut h, prog, later, untracked, &what);
        }
        let out = first_twice_then_the_rest(&mut h, prog, &frames);
        reassemble_udp6(&out).unwrap_or_else(|e| panic!("via {}: {e}", prog.name()));

        let other = client6(&mut h);
        let (lost_first, id) = fragmented6(&mut h, other, cluster, 4000, &[]);
        for later in &lost_first[1..] {
            assert_passed(&mut h, prog, later, untracked, "its first lost");
        }
        assert_eq!(remembered_ports(&h, other, cluster, id), None);
    }
}
