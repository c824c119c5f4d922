//! The ctnetlink codec and filters, and (as root) a real deletion in a
//! fresh network namespace, checked with the `conntrack` tool.

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, UdpSocket},
    time::Duration,
};

use super::*;
use crate::sys::{
    fresh_netns::{privileged, run_in_fresh_netns},
    tool,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const OTHER_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const ENDPOINT: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
const OTHER_ENDPOINT: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 3);

/// A UDP flow from the client to `frontend:53`, DNATed to `endpoint:5353`.
fn flow(frontend: Ipv4Addr, endpoint: Ipv4Addr) -> Entry {
    Entry {
        orig: Tuple {
            src: CLIENT,
            dst: frontend,
            proto: IPPROTO_UDP,
            sport: 40000,
            dport: 53,
        },
        reply: Tuple {
            src: endpoint,
            dst: CLIENT,
            proto: IPPROTO_UDP,
            sport: 5353,
            dport: 40000,
        },
        dst_nat: true,
        zone: None,
    }
}

#[test]
fn a_dumped_entry_parses_with_its_nat_status() {
    let entry = flow(CLUSTER_IP, ENDPOINT);
    let mut answer = message(IPCTNL_MSG_CT_GET, 0, IpFamily::V4);
    put_tuple(&mut answer, CTA_TUPLE_ORIG, entry.orig);
    put_tuple(&mut answer, CTA_TUPLE_REPLY, entry.reply);
    answer.attr(CTA_STATUS, &(IPS_DST_NAT | 0x8).to_be_bytes());
    let bytes = answer.finish(1);
    assert_eq!(parse_entry(&bytes[16..]), Some(entry));
    assert_eq!(
        parse_entry::<Ipv6Addr>(&bytes[16..]),
        None,
        "an IPv4 entry is not an IPv6 one"
    );
    // Without the NAT bit, and in a zone.
    let mut answer = message(IPCTNL_MSG_CT_GET, 0, IpFamily::V4);
    put_tuple(&mut answer, CTA_TUPLE_ORIG, entry.orig);
    put_tuple(&mut answer, CTA_TUPLE_REPLY, entry.reply);
    answer
        .attr(CTA_STATUS, &0x8u32.to_be_bytes())
        .attr(CTA_ZONE, &7u16.to_be_bytes());
    let parsed = parse_entry::<Ipv4Addr>(&answer.finish(1)[16..]).expect("an entry");
    assert!(!parsed.dst_nat);
    assert_eq!(parsed.zone, Some(7));
    assert_eq!(parse_entry::<Ipv4Addr>(&[2, 0, 0, 0]), None, "no tuples");
}

#[test]
fn a_delete_names_the_original_tuple() {
    let entry = flow(CLUSTER_IP, ENDPOINT);
    let bytes = delete_message(&entry).finish(3);
    assert_eq!(&bytes[4..6], &0x0102u16.to_ne_bytes(), "CTNETLINK << 8 | CT_DELETE");
    assert_eq!(&bytes[6..8], &(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    assert_eq!(&bytes[16..20], &[libc::AF_INET as u8, NFNETLINK_V0, 0, 0]);
    let top = attrs(&bytes[20..]);
    assert_eq!(top.len(), 1, "no zone: the default one");
    assert_eq!(top[0].0, CTA_TUPLE_ORIG);
    assert_eq!(parse_tuple(top[0].1), Some(entry.orig));
}

const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 1);
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xa);
const ENDPOINT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 2);
const OTHER_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xb);
const OTHER_ENDPOINT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 3);

/// [`flow`] over IPv6.
fn flow6(frontend: Ipv6Addr, endpoint: Ipv6Addr) -> Entry<Ipv6Addr> {
    Entry::new(
        Tuple {
            src: CLIENT6,
            dst: frontend,
            proto: IPPROTO_UDP,
            sport: 40000,
            dport: 53,
        },
        Tuple {
            src: endpoint,
            dst: CLIENT6,
            proto: IPPROTO_UDP,
            sport: 5353,
            dport: 40000,
        },
        true,
    )
}

/// IPv6 entries: AF_INET6, 16-byte CTA_IP_V6_SRC/DST, and filters of the
/// IPv6 family only.
#[test]
fn ipv6_entries_and_filters() {
    let entry = flow6(CLUSTER_IP6, ENDPOINT6);
    let bytes = delete_message(&entry).finish(3);
    assert_eq!(&bytes[16..20], &[libc::AF_INET6 as u8, NFNETLINK_V0, 0, 0]);
    let top = attrs(&bytes[20..]);
    let ip = find(&attrs(top[0].1), CTA_TUPLE_IP).expect("the addresses");
    let ip = attrs(&ip);
    assert_eq!(ip[0], (CTA_IP_V6_SRC, &CLIENT6.octets()[..]));
    assert_eq!(ip[1], (CTA_IP_V6_DST, &CLUSTER_IP6.octets()[..]));

    let mut answer = message(IPCTNL_MSG_CT_GET, 0, IpFamily::V6);
    put_tuple(&mut answer, CTA_TUPLE_ORIG, entry.orig);
    put_tuple(&mut answer, CTA_TUPLE_REPLY, entry.reply);
    answer.attr(CTA_STATUS, &IPS_DST_NAT.to_be_bytes());
    let parsed = parse_entry::<Ipv6Addr>(&answer.finish(1)[16..]);
    assert_eq!(parsed, Some(entry));

    let node_port = |family| UdpFlowFilter {
        family,
        orig_dst_port: Some(53),
        ..UdpFlowFilter::default()
    };
    assert!(node_port(IpFamily::V6).matches(&entry));
    assert!(
        !node_port(IpFamily::V4).matches(&entry),
        "a node-port filter of the other family"
    );
    assert!(!node_port(IpFamily::V6).matches(&flow(CLUSTER_IP, ENDPOINT)));
    let by_nat = UdpFlowFilter {
        family: IpFamily::V6,
        orig_dst: Some(CLUSTER_IP6.into()),
        dst_nat: Some(ENDPOINT6.into()),
        ..UdpFlowFilter::default()
    };
    assert!(by_nat.matches(&entry));
    assert!(!by_nat.matches(&flow6(CLUSTER_IP6, OTHER_ENDPOINT6)));
}

#[test]
fn filters_match_like_the_conntrack_tools_options() {
    let entry = flow(CLUSTER_IP, ENDPOINT);
    let by = |orig_dst, orig_dst_port, dst_nat| UdpFlowFilter {
        family: IpFamily::V4,
        orig_dst,
        orig_dst_port,
        dst_nat,
    };
    assert!(by(Some(CLUSTER_IP.into()), None, Some(ENDPOINT.into())).matches(&entry));
    assert!(by(None, Some(53), Some(ENDPOINT.into())).matches(&entry));
    assert!(by(Some(CLUSTER_IP.into()), None, None).matches(&entry));
    assert!(by(None, Some(53), None).matches(&entry));
    assert!(!by(Some(CLUSTER_IP.into()), None, Some(OTHER_ENDPOINT.into())).matches(&entry));
    assert!(!by(Some(OTHER_CLUSTER_IP.into()), None, None).matches(&entry));
    assert!(!by(None, Some(54), None).matches(&entry));
    let untranslated = Entry {
        dst_nat: false,
        ..entry
    };
    assert!(!by(Some(CLUSTER_IP.into()), None, Some(ENDPOINT.into())).matches(&untranslated));
    assert!(by(Some(CLUSTER_IP.into()), None, None).matches(&untranslated));
    let tcp = Entry {
        orig: Tuple { proto: 6, ..entry.orig },
        ..entry
    };
    assert!(!by(Some(CLUSTER_IP.into()), None, None).matches(&tcp));
}

/// What `program` printed; panics if it failed.
fn run(program: &str, args: &[&str]) -> String {
    let out = tool::run(program, args, program).expect("the tool runs");
    tool::stdout_of(program, args, out).expect("the tool succeeds")
}

/// The `conntrack -L` lines of UDP flows to `frontend` (in the table of
/// its family).
fn tracked_to(frontend: impl Into<IpAddr>) -> Vec<String> {
    let frontend = frontend.into();
    let family = if frontend.is_ipv6() { "ipv6" } else { "ipv4" };
    let listing = run("conntrack", &["-L", "-f", family, "-p", "udp"]);
    let needle = format!("dst={frontend} ");
    listing
        .lines()
        .filter(|l| l.contains(&needle))
        .map(str::to_owned)
        .collect()
}

/// One datagram to `frontend:53`, received at `endpoint:5353` through the
/// DNAT rule: a real, translated conntrack entry.
fn send_through(frontend: impl Into<IpAddr>, endpoint: &UdpSocket) {
    let frontend = frontend.into();
    let client_ip: IpAddr = if frontend.is_ipv6() {
        CLIENT6.into()
    } else {
        CLIENT.into()
    };
    let client = UdpSocket::bind((client_ip, 0)).expect("client socket");
    endpoint
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    let mut buf = [0; 16];
    // Sent again (the same flow) if it does not arrive: under load the
    // first IPv6 datagram in a fresh namespace was seen lost once in three
    // runs of the whole suite; what is tested is the flow's entry.
    let received = (0..3).find_map(|_| {
        client.send_to(b"ping", (frontend, 53)).expect("send");
        endpoint.recv_from(&mut buf).ok()
    });
    let (n, _) = received.expect("the datagram arrives DNATed");
    assert_eq!(&buf[..n], b"ping");
}

/// Sets up two DNATed UDP flows (in a fresh network namespace), deletes one by its ClusterIP and endpoint, and reads back with
/// the `conntrack` tool that only that one is gone.
fn delete_one_of_two_flows() {
    run("ip", &["link", "set", "lo", "up"]);
    for addr in [CLIENT, CLUSTER_IP, OTHER_CLUSTER_IP, ENDPOINT, OTHER_ENDPOINT] {
        run("ip", &["addr", "add", &format!("{addr}/32"), "dev", "lo"]);
    }
    let rules = format!(
        "table ip conntrack_test {{\n\
         \tchain out {{ type nat hook output priority -100;\n\
         \t\tip daddr {CLUSTER_IP} udp dport 53 dnat to {ENDPOINT}:5353\n\
         \t\tip daddr {OTHER_CLUSTER_IP} udp dport 53 dnat to {OTHER_ENDPOINT}:5353\n\
         \t}}\n}}\n"
    );
    tool::pipe("nft", &["-f", "-"], &rules, |_| None).expect("the DNAT rules");
    let endpoint = UdpSocket::bind(SocketAddrV4::new(ENDPOINT, 5353)).expect("endpoint socket");
    let other = UdpSocket::bind(SocketAddrV4::new(OTHER_ENDPOINT, 5353)).expect("other endpoint socket");
    send_through(CLUSTER_IP, &endpoint);
    send_through(OTHER_CLUSTER_IP, &other);
    assert_eq!(tracked_to(CLUSTER_IP).len(), 1, "{:?}", tracked_to(CLUSTER_IP));
    assert_eq!(tracked_to(OTHER_CLUSTER_IP).len(), 1);

    let stale = UdpFlowFilter {
        orig_dst: Some(CLUSTER_IP.into()),
        dst_nat: Some(ENDPOINT.into()),
        ..UdpFlowFilter::default()
    };
    let elsewhere = UdpFlowFilter {
        orig_dst_port: Some(53),
        dst_nat: Some(Ipv4Addr::new(10, 244, 0, 9).into()),
        ..UdpFlowFilter::default()
    };
    assert_eq!(delete_udp_flows(&[stale, elsewhere]).expect("deleting"), 1);
    assert!(tracked_to(CLUSTER_IP).is_empty(), "{:?}", tracked_to(CLUSTER_IP));
    assert_eq!(tracked_to(OTHER_CLUSTER_IP).len(), 1, "the other flow stays");
    assert_eq!(delete_udp_flows(&[stale]).expect("deleting again"), 0);
}

#[test]
fn deletes_a_real_flow_by_filter_and_leaves_the_others() {
    if privileged("deletes_a_real_flow_by_filter_and_leaves_the_others") {
        run_in_fresh_netns(delete_one_of_two_flows);
    }
}

/// [`delete_one_of_two_flows`] over IPv6, with an IPv4 flow on the same
/// port beside them: a node-port filter of the IPv6 family deletes the
/// IPv6 flows and leaves the IPv4 one.
fn delete_ipv6_flows_only() {
    run("ip", &["link", "set", "lo", "up"]);
    for addr in [CLIENT6, CLUSTER_IP6, OTHER_CLUSTER_IP6, ENDPOINT6, OTHER_ENDPOINT6] {
        run(
            "ip",
            &["-6", "addr", "add", &format!("{addr}/128"), "dev", "lo", "nodad"],
        );
    }
    for addr in [CLIENT, CLUSTER_IP, ENDPOINT] {
        run("ip", &["addr", "add", &format!("{addr}/32"), "dev", "lo"]);
    }
    let rules = format!(
        "table ip6 conntrack_test6 {{\n\
         \tchain out {{ type nat hook output priority -100;\n\
         \t\tip6 daddr {CLUSTER_IP6} udp dport 53 dnat to [{ENDPOINT6}]:5353\n\
         \t\tip6 daddr {OTHER_CLUSTER_IP6} udp dport 53 dnat to [{OTHER_ENDPOINT6}]:5353\n\
         \t}}\n}}\n\
         table ip conntrack_test {{\n\
         \tchain out {{ type nat hook output priority -100;\n\
         \t\tip daddr {CLUSTER_IP} udp dport 53 dnat to {ENDPOINT}:5353\n\
         \t}}\n}}\n"
    );
    tool::pipe("nft", &["-f", "-"], &rules, |_| None).expect("the DNAT rules");
    let endpoint = UdpSocket::bind(SocketAddr::new(ENDPOINT6.into(), 5353)).expect("endpoint socket");
    let other = UdpSocket::bind(SocketAddr::new(OTHER_ENDPOINT6.into(), 5353)).expect("other endpoint socket");
    let endpoint4 = UdpSocket::bind(SocketAddrV4::new(ENDPOINT, 5353)).expect("IPv4 endpoint socket");
    send_through(CLUSTER_IP6, &endpoint);
    send_through(OTHER_CLUSTER_IP6, &other);
    send_through(CLUSTER_IP, &endpoint4);
    assert_eq!(tracked_to(CLUSTER_IP6).len(), 1, "{:?}", tracked_to(CLUSTER_IP6));
    assert_eq!(list_entries_of::<Ipv6Addr>().expect("the IPv6 table").len(), 2);

    let stale = UdpFlowFilter {
        family: IpFamily::V6,
        orig_dst: Some(CLUSTER_IP6.into()),
        dst_nat: Some(ENDPOINT6.into()),
        ..UdpFlowFilter::default()
    };
    assert_eq!(delete_udp_flows(&[stale]).expect("deleting"), 1);
    assert!(tracked_to(CLUSTER_IP6).is_empty(), "{:?}", tracked_to(CLUSTER_IP6));
    assert_eq!(tracked_to(OTHER_CLUSTER_IP6).len(), 1, "the other flow stays");
    let node_port6 = UdpFlowFilter {
        family: IpFamily::V6,
        orig_dst_port: Some(53),
        ..UdpFlowFilter::default()
    };
    assert_eq!(delete_udp_flows(&[node_port6]).expect("deleting by port"), 1);
    assert!(tracked_to(OTHER_CLUSTER_IP6).is_empty());
    assert_eq!(tracked_to(CLUSTER_IP).len(), 1, "the IPv4 flow on the same port stays");
}

#[test]
fn deletes_real_ipv6_flows_and_leaves_the_ipv4_ones() {
    if privileged("deletes_real_ipv6_flows_and_leaves_the_ipv4_ones") {
        run_in_fresh_netns(delete_ipv6_flows_only);
    }
}
