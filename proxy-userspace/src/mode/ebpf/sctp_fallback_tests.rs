//! The SCTP fallback table: what it holds for a port, that the kernel's
//! checker takes it (`nft -c` in a user namespace, where one can be made),
//! and when it is written, against a fake `nft`.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::{Arc, Mutex},
    time::Duration,
};

use super::*;
use crate::{
    mode::nftables::tests::expect_kernel_accepts,
    model::{Endpoint, Protocol},
};

const MARK: u32 = 0x4000;
const NODE_IPS: [IpAddr; 3] = [
    IpAddr::V4(Ipv4Addr::new(172, 30, 0, 2)),
    IpAddr::V4(Ipv4Addr::new(10, 244, 0, 1)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x30, 0, 0, 0, 0, 0, 2)),
];

/// An SCTP NodePort Service that changes the port: 88 -> 80, node port
/// 30832, an external IP, two endpoints.
fn node_port_service() -> ServicePort {
    ServicePort {
        name: "default/sig".into(),
        protocol: Protocol::Sctp,
        cluster_ip: Ipv4Addr::new(10, 96, 3, 11).into(),
        port: 88,
        node_port: Some(30832),
        external_ips: vec![Ipv4Addr::new(198, 51, 100, 7).into()],
        endpoints: vec![
            Endpoint::ready(Ipv4Addr::new(10, 244, 0, 11), 80),
            Endpoint::ready(Ipv4Addr::new(10, 244, 0, 12), 80),
        ],
        ..ServicePort::default()
    }
}

#[test]
fn a_port_changing_service_is_natted_from_every_frontend() {
    let port = node_port_service();
    let script = render([&port], &NODE_IPS, MARK, false);
    for line in [
        "add table inet xproxy-sctp\ndelete table inet xproxy-sctp\ntable inet xproxy-sctp {",
        "type nat hook prerouting priority -100; policy accept;",
        "type nat hook output priority -100; policy accept;",
        "meta l4proto sctp jump services",
        "ip daddr 10.96.3.11 sctp dport 88 goto service-0",
        "ip daddr 198.51.100.7 sctp dport 88 goto external-0",
        "ip daddr { 172.30.0.2, 10.244.0.1 } sctp dport 30832 goto external-0",
        "numgen random mod 2 vmap { 0 : goto endpoint-0-0, 1 : goto endpoint-0-1 }",
        "ip saddr 10.244.0.11 meta mark set meta mark | 0x00004000",
        "meta l4proto sctp dnat ip to 10.244.0.11:80",
        "meta l4proto sctp dnat ip to 10.244.0.12:80",
    ] {
        assert!(script.contains(line), "missing {line:?} in\n{script}");
    }
    assert!(
        !script.contains("fd00"),
        "the IPv6 node IP takes no IPv4 node port:\n{script}"
    );
    // External traffic is masqueraded, ClusterIP traffic is not (but for
    // masqueradeAll).
    let external = script.split("chain external-0 {").nth(1).expect("external chain");
    assert!(
        external
            .trim_start()
            .starts_with("meta mark set meta mark | 0x00004000"),
        "{script}"
    );
    let service = script.split("chain service-0 {").nth(1).expect("service chain");
    assert!(service.trim_start().starts_with("numgen"), "{script}");
    let all = render([&port], &NODE_IPS, MARK, true);
    let service = all.split("chain service-0 {").nth(1).expect("service chain");
    assert!(service.trim_start().starts_with("meta mark set"), "{all}");
    expect_kernel_accepts("SCTP fallback table", &script);
    expect_kernel_accepts("SCTP fallback table with masqueradeAll", &all);
}

#[test]
fn without_a_mark_or_endpoints_or_ports_it_holds_less() {
    let port = node_port_service();
    let unmarked = render([&port], &NODE_IPS, 0, true);
    assert!(!unmarked.contains("meta mark"), "{unmarked}");
    expect_kernel_accepts("SCTP fallback table without SNAT mark", &unmarked);
    let empty = ServicePort {
        endpoints: vec![],
        ..port
    };
    let only_delete = "add table inet xproxy-sctp\ndelete table inet xproxy-sctp\n";
    assert_eq!(render([&empty], &NODE_IPS, MARK, false), only_delete);
    assert_eq!(render([], &NODE_IPS, MARK, false), only_delete);
}

/// Records the scripts; lists a family's table while one that creates it
/// was the last run.
#[derive(Clone, Default)]
struct FakeNft(Arc<Mutex<Vec<String>>>);

impl FakeNft {
    fn scripts(&self) -> Vec<String> {
        self.0.lock().expect("lock").clone()
    }
}

impl Nft for FakeNft {
    fn run(&mut self, script: &str) -> Result<()> {
        self.0.lock().expect("lock").push(script.to_owned());
        Ok(())
    }

    fn list_table(&mut self, family: &str, table: &str) -> Result<Option<String>> {
        let scripts = self.0.lock().expect("lock");
        let created = format!("table {family} {table} {{");
        Ok(scripts.last().filter(|s| s.contains(&created)).cloned())
    }
}

#[test]
fn the_table_is_written_when_it_changes_and_never_without_ports() {
    let fake = FakeNft::default();
    let mut fallback = SctpFallback::new(Box::new(fake.clone()), MARK, false);
    fallback.replace([]);
    fallback.sync(&NODE_IPS).expect("first sync");
    assert!(fake.scripts().is_empty(), "no port, no earlier table: nothing run");
    let port = node_port_service();
    fallback.set(&port.name, Some(&port));
    fallback.sync(&NODE_IPS).expect("sync");
    fallback.sync(&NODE_IPS).expect("same again");
    assert_eq!(fake.scripts().len(), 1, "written once");
    let mut sticky = port.clone();
    sticky.affinity = Some(Duration::from_secs(10));
    assert!(leaves_out(&sticky) && !leaves_out(&port));
    fallback.set(&port.name, None);
    fallback.sync(&NODE_IPS).expect("sync");
    let scripts = fake.scripts();
    assert_eq!(scripts.len(), 2);
    assert_eq!(
        scripts[1],
        "add table inet xproxy-sctp\ndelete table inet xproxy-sctp\n"
    );
}

#[test]
fn an_earlier_agents_table_is_removed_at_the_first_sync() {
    for family in ["inet", "ip"] {
        let fake = FakeNft::default();
        fake.0
            .lock()
            .expect("lock")
            .push(format!("table {family} xproxy-sctp {{ }}"));
        let mut fallback = SctpFallback::new(Box::new(fake.clone()), MARK, false);
        fallback.sync(&NODE_IPS).expect("first sync");
        let scripts = fake.scripts();
        assert_eq!(scripts.len(), 2, "{scripts:?}");
        assert_eq!(
            scripts[1],
            format!("add table {family} xproxy-sctp\ndelete table {family} xproxy-sctp\n")
        );
    }
}

/// An IPv6 port takes the `ip6` matches and NAT targets in the same table,
/// and its node port only the node's IPv6 addresses.
#[test]
fn an_ipv6_port_is_natted_in_the_same_table() {
    let v4 = node_port_service();
    let v6 = ServicePort {
        name: "default/sig:v6".into(),
        cluster_ip: "fd00:96::3:11".parse().expect("IPv6 literal"),
        external_ips: vec!["fd00:51::7".parse().expect("IPv6 literal")],
        endpoints: vec![
            Endpoint::ready("fd00:244::11".parse::<Ipv6Addr>().expect("IPv6 literal"), 80),
            Endpoint::ready("fd00:244::12".parse::<Ipv6Addr>().expect("IPv6 literal"), 80),
        ],
        ..node_port_service()
    };
    let script = render([&v4, &v6], &NODE_IPS, MARK, false);
    for line in [
        "ip daddr 10.96.3.11 sctp dport 88 goto service-0",
        "ip daddr { 172.30.0.2, 10.244.0.1 } sctp dport 30832 goto external-0",
        "ip6 daddr fd00:96::3:11 sctp dport 88 goto service-1",
        "ip6 daddr fd00:51::7 sctp dport 88 goto external-1",
        "ip6 daddr { fd00:30::2 } sctp dport 30832 goto external-1",
        "ip6 saddr fd00:244::11 meta mark set meta mark | 0x00004000",
        "meta l4proto sctp dnat ip6 to [fd00:244::11]:80",
        "meta l4proto sctp dnat ip6 to [fd00:244::12]:80",
    ] {
        assert!(script.contains(line), "missing {line:?} in\n{script}");
    }
    expect_kernel_accepts("SCTP fallback table with both families", &script);
}
