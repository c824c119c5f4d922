//! The nftables read-back against captured `nft -j list table ip xproxy`
//! outputs: the mode's golden ruleset (`cluster.json`, from
//! `tests/golden/nftables/cluster.nft-list`) and a kube-proxy-style one
//! with every Service API feature and objects no version writes
//! (`features.json`, from `features.nft`).

use std::net::Ipv4Addr;

use super::*;
use crate::cmd::status::table::{rows, split_families};

fn ip(text: &str) -> Ipv4Addr {
    text.parse().expect("an address")
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_string()).collect()
}

#[test]
fn reads_the_golden_ruleset_back() {
    let table = parse(include_str!("cluster.json")).expect("parses");
    let nginx = strings(&["10.244.0.11:80", "10.244.0.12:80", "10.244.0.13:80"]);
    let expected = vec![
        ("TCP 0.0.0.0:30791 NodePort".to_string(), nginx.clone()),
        ("TCP 0.0.0.0:30792 NodePort".to_string(), vec![]),
        ("TCP 10.96.0.10:53 ClusterIP".to_string(), strings(&["10.244.0.21:53"])),
        ("TCP 10.96.0.88:88 ClusterIP".to_string(), nginx),
        ("TCP 10.96.0.89:89 ClusterIP".to_string(), vec![]),
        (
            "UDP 10.96.0.10:53 ClusterIP".to_string(),
            strings(&["10.244.0.21:5353"]),
        ),
    ];
    assert_eq!(rows(&table), expected, "{}", table.render());
    let seed = table.find(Protocol::Tcp, ip("10.96.0.88"), 88).expect("listed");
    assert_eq!(seed.service.as_deref(), Some("default/nginx-service"));
    assert!(!seed.local_only && seed.affinity_seconds.is_none());
    let empty = table.find(Protocol::Tcp, ip("10.96.0.89"), 89).expect("listed");
    assert_eq!(empty.service.as_deref(), Some("default/empty-service:http"));
    assert!(!empty.local_only);
}

#[test]
fn reads_every_service_api_feature_and_skips_what_it_does_not_know() {
    let table = parse(include_str!("features.json")).expect("parses");
    let local = strings(&["10.244.0.1:8080"]);
    let expected = vec![
        ("TCP 0.0.0.0:30010 NodePort".to_string(), local.clone()),
        ("TCP 0.0.0.0:30020 NodePort".to_string(), vec![]),
        (
            "TCP 10.96.1.1:80 ClusterIP".to_string(),
            strings(&["10.244.0.1:8080", "10.244.1.1:8080"]),
        ),
        ("TCP 10.96.1.2:80 ClusterIP".to_string(), vec![]),
        ("TCP 10.96.1.4:80 ClusterIP".to_string(), vec![]),
        ("TCP 192.0.2.10:80 LoadBalancer".to_string(), local.clone()),
        ("TCP 198.51.100.7:80 ExternalIP".to_string(), local),
        // A chain it does not know: a frontend without backends.
        ("UDP 10.96.1.3:53 ClusterIP".to_string(), vec![]),
    ];
    assert_eq!(rows(&table), expected, "{}", table.render());

    let lb = table.find(Protocol::Tcp, ip("192.0.2.10"), 80).expect("listed");
    assert!(lb.local_only && lb.source_filtered);
    assert_eq!(lb.source_ranges, ["192.0.2.10", "203.0.113.0/25"]);
    assert_eq!(lb.affinity_seconds, Some(10800));
    assert_eq!(lb.service.as_deref(), Some("ns/lb:p"));
    let cluster = table.find(Protocol::Tcp, ip("10.96.1.1"), 80).expect("listed");
    assert!(!cluster.local_only && !cluster.source_filtered);
    assert_eq!(cluster.affinity_seconds, Some(10800));
    assert_eq!(cluster.service.as_deref(), Some("ns/lb:p"));
    for (addr, port) in [("10.96.1.2", 80), ("0.0.0.0", 30020)] {
        let dropped = table.find(Protocol::Tcp, ip(addr), port).expect("listed");
        assert!(dropped.local_only, "{addr}:{port} drops:\n{}", table.render());
    }
    assert!(
        !table
            .find(Protocol::Tcp, ip("10.96.1.4"), 80)
            .expect("listed")
            .local_only
    );
}

#[test]
fn output_that_is_no_ruleset_is_an_empty_table_or_an_error() {
    assert!(parse("{}").expect("parses").frontends.is_empty());
    assert!(
        parse(r#"{"nftables": [{"map": {"map": "verdict"}}, 7]}"#)
            .expect("parses")
            .frontends
            .is_empty()
    );
    assert!(parse("not json").is_err());
}

/// The IPv6 half as `nft -j list table ip6 xproxy` lists what the mode
/// writes (`dual-stack.json`, from `dual-stack.nft`): a LoadBalancer
/// Service with an external IP, source ranges, ClientIP affinity and
/// `externalTrafficPolicy: Local` (one of its two endpoints on this
/// node), and a UDP Service without endpoints.
#[test]
fn reads_the_ipv6_table_back_beside_the_ipv4_one() {
    let v4 = include_str!("cluster.json");
    let table = parse_tables(&[(IpFamily::V4, v4), (IpFamily::V6, include_str!("dual-stack.json"))]).expect("parses");
    let (ipv4, ipv6) = split_families(&table);
    assert_eq!(
        ipv4,
        parse(v4).expect("parses").frontends,
        "the IPv4 half changed:\n{}",
        table.render()
    );
    // The mode's own elements do not say which external address is
    // which (as for IPv4): both are External.
    let expected = include_str!("../dual-stack-ipv6.txt")
        .replace("ExternalIP (", "External (")
        .replace("LoadBalancer (", "External (");
    assert_eq!(ipv6.render(), expected, "{}", table.render());
}
