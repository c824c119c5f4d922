//! The IPVS read-back from counters and `ipset save` as the golden
//! `tests/golden/ipvs/cluster.ipvsadm` has them, plus kube-proxy's sets
//! for external and load balancer IPs.

use std::net::IpAddr;

use super::*;
use crate::{mode::ipvs::netlink::VirtualKey, model::Protocol};

const SETS: &str = "\
create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536
add KUBE-CLUSTER-IP 10.96.0.10,tcp:53
add KUBE-CLUSTER-IP 10.96.0.10,udp:53
add KUBE-CLUSTER-IP 10.96.0.88,tcp:88
create KUBE-NODE-PORT-TCP bitmap:port range 0-65535
add KUBE-NODE-PORT-TCP 30791
add KUBE-NODE-PORT-TCP 30010
create KUBE-NODE-PORT-LOCAL-TCP bitmap:port range 0-65535
add KUBE-NODE-PORT-LOCAL-TCP 30010
add KUBE-LOAD-BALANCER 192.0.2.10,tcp:80
add KUBE-LOAD-BALANCER-LOCAL 192.0.2.10,tcp:80
add KUBE-LOAD-BALANCER-FW 192.0.2.10,tcp:80
add KUBE-LOAD-BALANCER-SOURCE-CIDR 192.0.2.10,tcp:80,203.0.113.0/25
add KUBE-EXTERNAL-IP 198.51.100.7,tcp:80
add SOMETHING-ELSE 1.2.3.4
a line no version writes
";

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

fn server(protocol: Protocol, addr: &str, port: u16, reals: &[(&str, u16, u32, u32, u32)]) -> VirtualCounters {
    VirtualCounters {
        key: VirtualKey {
            protocol,
            addr: ip(addr),
            port,
        },
        scheduler: "rr".into(),
        persistent_seconds: None,
        reals: reals
            .iter()
            .map(|&(a, port, weight, active, inactive)| RealCounters {
                addr: ip(a),
                port,
                weight,
                active,
                inactive,
                persistent: 0,
            })
            .collect(),
    }
}

#[test]
fn kinds_policies_and_counts_come_from_ipvs_and_the_sets() {
    let mut lb = server(Protocol::Tcp, "192.0.2.10", 80, &[("10.244.0.1", 8080, 1, 0, 0)]);
    lb.persistent_seconds = Some(10800);
    let servers = vec![
        server(
            Protocol::Tcp,
            "10.96.0.88",
            88,
            &[("10.244.0.11", 80, 1, 2, 1), ("10.244.0.12", 80, 1, 0, 0)],
        ),
        server(
            Protocol::Udp,
            "10.96.0.10",
            53,
            &[("10.244.0.21", 5353, 1, 0, 3), ("10.244.0.22", 5353, 0, 0, 0)],
        ),
        server(Protocol::Tcp, "172.30.0.2", 30791, &[("10.244.0.11", 80, 1, 0, 0)]),
        server(Protocol::Tcp, "172.30.0.2", 30010, &[]),
        server(Protocol::Tcp, "198.51.100.7", 80, &[]),
        server(Protocol::Tcp, "203.0.113.99", 80, &[]),
        lb,
    ];
    let table = table_of(&servers, &Sets::parse(SETS));
    let expected = "\
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  10.96.0.88:88 ClusterIP [scheduler rr]
  -> 10.244.0.11:80               3 [active 2, inactive 1]
  -> 10.244.0.12:80               0 [active 0, inactive 0]
TCP  172.30.0.2:30010 NodePort (Local, no endpoint on this node: drop) [scheduler rr]
TCP  172.30.0.2:30791 NodePort [scheduler rr]
  -> 10.244.0.11:80               0 [active 0, inactive 0]
TCP  192.0.2.10:80 LoadBalancer (Local: this node's endpoints) [affinity ClientIP 10800s; source ranges 203.0.113.0/25; scheduler rr]
  -> 10.244.0.1:8080              0 [active 0, inactive 0]
TCP  198.51.100.7:80 ExternalIP (no endpoints: reject) [scheduler rr]
TCP  203.0.113.99:80 External (no endpoints: reject) [scheduler rr]
UDP  10.96.0.10:53 ClusterIP [scheduler rr]
  -> 10.244.0.21:5353             3 [active 0, inactive 3]
  -> 10.244.0.22:5353             0 [active 0, inactive 0; weight 0: no new flows]
";
    assert_eq!(table.render(), expected);
}

#[test]
fn without_sets_every_virtual_server_is_still_listed() {
    let servers = vec![server(Protocol::Tcp, "10.96.0.88", 88, &[])];
    let table = table_of(&servers, &Sets::parse(""));
    assert_eq!(table.frontends.len(), 1);
    assert_eq!(table.frontends[0].kind, Kind::External);
}

/// kube-proxy's IPv6 sets, as `ipset save` writes them (no brackets
/// around the addresses), for a dual-stack Service's IPv6 half and an
/// IPv6 load balancer IP.
const SETS6: &str = "\
create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536
add KUBE-6-CLUSTER-IP fd00:96::88,tcp:88
create KUBE-6-NODE-PORT-TCP bitmap:port range 0-65535
add KUBE-6-NODE-PORT-TCP 30791
add KUBE-6-LOAD-BALANCER 2001:db8::10,tcp:80
add KUBE-6-LOAD-BALANCER-LOCAL 2001:db8::10,tcp:80
add KUBE-6-LOAD-BALANCER-FW 2001:db8::10,tcp:80
add KUBE-6-LOAD-BALANCER-SOURCE-CID 2001:db8::10,tcp:80,2001:db8:1::/64
";

#[test]
fn ipv6_virtual_servers_take_their_kinds_from_the_ipv6_sets() {
    let servers = vec![
        server(Protocol::Tcp, "10.96.0.88", 88, &[("10.244.0.11", 80, 1, 1, 0)]),
        server(
            Protocol::Tcp,
            "fd00:96::88",
            88,
            &[("fd00:10:244::11", 80, 1, 2, 1), ("fd00:10:244::12", 80, 1, 0, 0)],
        ),
        server(Protocol::Tcp, "fd00:30::2", 30791, &[("fd00:10:244::11", 80, 1, 0, 0)]),
        server(Protocol::Tcp, "2001:db8::10", 80, &[("fd00:10:244::11", 80, 1, 0, 0)]),
        // In no IPv6 set: the IPv4 sets say nothing about it.
        server(Protocol::Tcp, "2001:db8::99", 88, &[]),
    ];
    let sets = Sets::parse(&format!("{SETS}{SETS6}"));
    let table = table_of(&servers, &sets);
    let expected = "\
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  10.96.0.88:88 ClusterIP [scheduler rr]
  -> 10.244.0.11:80               1 [active 1, inactive 0]
TCP  [2001:db8::10]:80 LoadBalancer (Local: this node's endpoints) [source ranges 2001:db8:1::/64; scheduler rr]
  -> [fd00:10:244::11]:80         0 [active 0, inactive 0]
TCP  [2001:db8::99]:88 External (no endpoints: reject) [scheduler rr]
TCP  [fd00:30::2]:30791 NodePort [scheduler rr]
  -> [fd00:10:244::11]:80         0 [active 0, inactive 0]
TCP  [fd00:96::88]:88 ClusterIP [scheduler rr]
  -> [fd00:10:244::11]:80         3 [active 2, inactive 1]
  -> [fd00:10:244::12]:80         0 [active 0, inactive 0]
";
    assert_eq!(table.render(), expected);
    let json = table.to_json();
    assert_eq!(json["frontends"][4]["address"], "fd00:96::88");
    assert_eq!(json["frontends"][4]["backends"][0]["address"], "fd00:10:244::11");
}
