//! The iptables read-back against the mode's golden `iptables-save` and a
//! kube-proxy-style save with every Service API feature.

use std::net::Ipv4Addr;

use super::*;
use crate::cmd::status::table::{rows, split_families};

fn ip(text: &str) -> Ipv4Addr {
    text.parse().expect("an address")
}

#[test]
fn reads_the_golden_rules_back() {
    let table = parse(include_str!("../../../../tests/golden/iptables/cluster.iptables-save"));
    let nginx: Vec<String> = ["10.244.0.11:80", "10.244.0.12:80", "10.244.0.13:80"]
        .map(String::from)
        .into();
    let expected = vec![
        ("TCP 0.0.0.0:30791 NodePort".to_string(), nginx.clone()),
        ("TCP 0.0.0.0:30792 NodePort".to_string(), vec![]),
        (
            "TCP 10.96.0.10:53 ClusterIP".to_string(),
            vec!["10.244.0.21:53".to_string()],
        ),
        ("TCP 10.96.0.88:88 ClusterIP".to_string(), nginx),
        ("TCP 10.96.0.89:89 ClusterIP".to_string(), vec![]),
        (
            "UDP 10.96.0.10:53 ClusterIP".to_string(),
            vec!["10.244.0.21:5353".to_string()],
        ),
    ];
    assert_eq!(rows(&table), expected, "{}", table.render());
    let empty = table.find(Protocol::Tcp, ip("10.96.0.89"), 89).expect("listed");
    assert_eq!(empty.service.as_deref(), Some("default/empty-service:http"));
    assert!(!empty.local_only);
    let seed = table.find(Protocol::Tcp, ip("10.96.0.88"), 88).expect("listed");
    assert_eq!(seed.service.as_deref(), Some("default/nginx-service"));
    assert_eq!(seed.affinity_seconds, None);
}

/// kube-proxy's shapes (pkg/proxy/iptables) for a LoadBalancer Service
/// with source ranges, an external IP, ClientIP affinity and
/// `externalTrafficPolicy: Local`, plus rules no version of it writes.
const FEATURES: &str = r#"*filter
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-SERVICES - [0:0]
-A KUBE-EXTERNAL-SERVICES -d 192.0.2.20/32 -p tcp -m comment --comment "ns/nolocal:p has no local endpoints" -m tcp --dport 80 -j DROP
-A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "ns/nolocal:p has no local endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 30020 -j DROP
-A KUBE-SERVICES -m some-future-match --with "a \"quoted\" word" -j ACCEPT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-FW-LB - [0:0]
:KUBE-EXT-LB - [0:0]
:KUBE-SVC-LB - [0:0]
:KUBE-SVL-LB - [0:0]
:KUBE-SEP-A - [0:0]
:KUBE-SEP-B - [0:0]
:KUBE-EXT-NOLOCAL - [0:0]
:KUBE-SVL-NOLOCAL - [0:0]
:KUBE-SVC-NOLOCAL - [0:0]
:KUBE-SEP-C - [0:0]
:KUBE-FUTURE - [0:0]
-A KUBE-SERVICES -d 10.96.1.1/32 -p tcp -m comment --comment "ns/lb:p cluster IP" -m tcp --dport 80 -j KUBE-SVC-LB
-A KUBE-SERVICES -d 192.0.2.10/32 -p tcp -m comment --comment "ns/lb:p loadbalancer IP" -m tcp --dport 80 -j KUBE-FW-LB
-A KUBE-SERVICES -d 198.51.100.7/32 -p tcp -m comment --comment "ns/lb:p external IP" -m tcp --dport 80 -j KUBE-EXT-LB
-A KUBE-SERVICES -d 10.96.1.2/32 -p tcp -m comment --comment "ns/nolocal:p cluster IP" -m tcp --dport 80 -j KUBE-SVC-NOLOCAL
-A KUBE-SERVICES -d 192.0.2.20/32 -p tcp -m comment --comment "ns/nolocal:p loadbalancer IP" -m tcp --dport 80 -j KUBE-EXT-NOLOCAL
-A KUBE-SERVICES -d 10.96.1.3/32 -p tcp -m tcp --dport 80 -j KUBE-FUTURE
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -p tcp -m comment --comment "ns/lb:p" -m tcp --dport 30010 -j KUBE-EXT-LB
-A KUBE-NODEPORTS -p tcp -m comment --comment "ns/nolocal:p" -m tcp --dport 30020 -j KUBE-EXT-NOLOCAL
-A KUBE-FW-LB -m comment --comment "ns/lb:p loadbalancer IP" -s 203.0.113.0/25 -j KUBE-EXT-LB
-A KUBE-FW-LB -m comment --comment "ns/lb:p loadbalancer IP" -s 192.0.2.10/32 -j KUBE-EXT-LB
-A KUBE-FW-LB -m comment --comment "ns/lb:p loadbalancer IP" -j KUBE-MARK-DROP
-A KUBE-EXT-LB -s 10.244.0.0/16 -m comment --comment "pod traffic for ns/lb:p external destinations" -j KUBE-SVC-LB
-A KUBE-EXT-LB -m comment --comment "masquerade LOCAL traffic for ns/lb:p external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-EXT-LB -m comment --comment "route LOCAL traffic for ns/lb:p external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-LB
-A KUBE-EXT-LB -j KUBE-SVL-LB
-A KUBE-SVC-LB ! -s 10.244.0.0/16 -d 10.96.1.1/32 -p tcp -m comment --comment "ns/lb:p cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-LB -m comment --comment "ns/lb:p -> 10.244.0.1:8080" -m recent --name KUBE-SEP-A --mask 255.255.255.255 --rsource --rcheck --seconds 10800 --reap -j KUBE-SEP-A
-A KUBE-SVC-LB -m comment --comment "ns/lb:p -> 10.244.1.1:8080" -m recent --name KUBE-SEP-B --mask 255.255.255.255 --rsource --rcheck --seconds 10800 --reap -j KUBE-SEP-B
-A KUBE-SVC-LB -m comment --comment "ns/lb:p -> 10.244.0.1:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-A
-A KUBE-SVC-LB -m comment --comment "ns/lb:p -> 10.244.1.1:8080" -j KUBE-SEP-B
-A KUBE-SVL-LB -m comment --comment "ns/lb:p -> 10.244.0.1:8080" -m recent --name KUBE-SEP-A --mask 255.255.255.255 --rsource --rcheck --seconds 10800 --reap -j KUBE-SEP-A
-A KUBE-SVL-LB -m comment --comment "ns/lb:p -> 10.244.0.1:8080" -j KUBE-SEP-A
-A KUBE-SEP-A -s 10.244.0.1/32 -m comment --comment "ns/lb:p" -j KUBE-MARK-MASQ
-A KUBE-SEP-A -p tcp -m comment --comment "ns/lb:p" -m recent --set --name KUBE-SEP-A --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.0.1:8080
-A KUBE-SEP-B -p tcp -m comment --comment "ns/lb:p" -m recent --set --name KUBE-SEP-B --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.1:8080
-A KUBE-EXT-NOLOCAL -s 10.244.0.0/16 -j KUBE-SVC-NOLOCAL
-A KUBE-EXT-NOLOCAL -j KUBE-SVL-NOLOCAL
-A KUBE-SVC-NOLOCAL -j KUBE-SEP-C
-A KUBE-SEP-C -p tcp -m tcp -j DNAT --to-destination 10.244.1.9:80
-A KUBE-FUTURE -m some-future-match -j KUBE-FUTURE
-A KUBE-FUTURE -j KUBE-UNKNOWN-CHAIN
COMMIT
"#;

#[test]
fn reads_every_service_api_feature_and_skips_what_it_does_not_know() {
    let table = parse(FEATURES);
    let local = vec!["10.244.0.1:8080".to_string()];
    let both = vec!["10.244.0.1:8080".to_string(), "10.244.1.1:8080".to_string()];
    let expected = vec![
        ("TCP 0.0.0.0:30010 NodePort".to_string(), local.clone()),
        ("TCP 0.0.0.0:30020 NodePort".to_string(), vec![]),
        ("TCP 10.96.1.1:80 ClusterIP".to_string(), both),
        (
            "TCP 10.96.1.2:80 ClusterIP".to_string(),
            vec!["10.244.1.9:80".to_string()],
        ),
        // 10.96.1.3 jumps to a chain it does not know (looping, leading
        // nowhere): skipped, never a failure.
        ("TCP 192.0.2.10:80 LoadBalancer".to_string(), local.clone()),
        ("TCP 192.0.2.20:80 LoadBalancer".to_string(), vec![]),
        ("TCP 198.51.100.7:80 ExternalIP".to_string(), local),
    ];
    assert_eq!(rows(&table), expected, "{}", table.render());

    let lb = table.find(Protocol::Tcp, ip("192.0.2.10"), 80).expect("listed");
    assert_eq!(lb.source_ranges, ["203.0.113.0/25", "192.0.2.10/32"]);
    assert!(lb.local_only && lb.source_filtered);
    assert_eq!(lb.affinity_seconds, Some(10800));
    let cluster = table.find(Protocol::Tcp, ip("10.96.1.1"), 80).expect("listed");
    assert!(!cluster.local_only && cluster.source_ranges.is_empty());
    assert_eq!(cluster.affinity_seconds, Some(10800));
    for (addr, port) in [("192.0.2.20", 80), ("0.0.0.0", 30020)] {
        let none = table.find(Protocol::Tcp, ip(addr), port).expect("listed");
        assert!(none.local_only, "{addr}:{port} drops: {}", table.render());
        assert_eq!(none.service.as_deref(), Some("ns/nolocal:p"));
    }
}

#[test]
fn words_keep_quoted_comments_whole() {
    assert_eq!(
        words(r#"X -m comment --comment "a \"b\" c" -j Y"#),
        ["X", "-m", "comment", "--comment", "a \"b\" c", "-j", "Y"]
    );
}

#[test]
fn nothing_to_read_is_an_empty_table() {
    assert!(parse("").frontends.is_empty());
    assert!(parse("*nat\n-A KUBE-SERVICES -j\nCOMMIT\n").frontends.is_empty());
}

/// The IPv6 half as `ip6tables-save` lists what the mode writes
/// (`dual-stack.ip6tables-save`): a LoadBalancer Service with an external
/// IP, source ranges, ClientIP affinity and `externalTrafficPolicy: Local`
/// (one of its two endpoints on this node), and a UDP Service without
/// endpoints.
const SAVED6: &str = include_str!("dual-stack.ip6tables-save");

#[test]
fn reads_the_ipv6_rules_back_beside_the_ipv4_ones() {
    let v4 = include_str!("../../../../tests/golden/iptables/cluster.iptables-save");
    let table = parse_families(v4, SAVED6);
    let (ipv4, ipv6) = split_families(&table);
    assert_eq!(ipv4, parse(v4).frontends, "the IPv4 half changed:\n{}", table.render());
    let expected = include_str!("../dual-stack-ipv6.txt");
    assert_eq!(ipv6.render(), expected, "{}", table.render());
}
