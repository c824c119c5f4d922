//! The mode against an in-memory kernel that applies `iptables-restore
//! --noflush` input the way iptables does (chain lines flush, `-X` fails on
//! a referenced chain, a failing input changes nothing), so partial and
//! full syncs and cleanup are checked without root. The privileged tests in
//! `tests/tests/mode_rules.rs` run the same against the real kernel.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;
use crate::{
    model::{Endpoint, Protocol},
    sys::fake_iptables::{FakeKernel, builtin},
};

fn port(name: &str, ip: u8, node_port: Option<u16>, endpoints: &[u8]) -> ServicePort {
    ServicePort {
        name: format!("default/{name}"),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, ip).into(),
        port: 80,
        node_port,
        endpoints: endpoints
            .iter()
            .map(|e| Endpoint::ready(Ipv4Addr::new(10, 244, 0, *e), 8080))
            .collect(),
        ..ServicePort::default()
    }
}

/// The nat chains `p` needs with the default options (no node name).
fn port_chains(p: &ServicePort) -> BTreeSet<String> {
    rules::port_chains(&RuleOptions::default(), p)
}

fn state<'a>(ports: impl IntoIterator<Item = &'a ServicePort>) -> BTreeMap<String, ServicePort> {
    ports.into_iter().map(|p| (p.name.clone(), p.clone())).collect()
}

fn mode() -> (IptablesMode, FakeKernel) {
    let kernel = FakeKernel::default();
    let opts = RuleOptions {
        local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
        ..RuleOptions::default()
    };
    (IptablesMode::new(opts, Box::new(kernel.clone())), kernel)
}

fn sep(p: &ServicePort, e: u8) -> String {
    chains::sep_chain(&p.name, p.protocol, &format!("10.244.0.{e}:8080"))
}

fn service_chains(kernel: &FakeKernel) -> BTreeSet<String> {
    kernel
        .chains("nat")
        .into_iter()
        .filter(|c| chains::is_service_chain(c))
        .collect()
}

#[test]
fn full_sync_installs_chains_and_jumps_then_writes_nothing_when_in_place() {
    let (mut mode, kernel) = mode();
    let a = port("a", 1, Some(30001), &[11, 12]);
    let desired = state([&a]);
    mode.apply_full(&desired).expect("first full sync");
    let names = chains::PortChains::of(&a);
    let expected: BTreeSet<String> = [names.svc.clone(), names.ext.clone(), sep(&a, 11), sep(&a, 12)].into();
    assert_eq!(service_chains(&kernel), expected);
    for (table, from, to) in [
        ("nat", "PREROUTING", "KUBE-SERVICES"),
        ("nat", "OUTPUT", "KUBE-SERVICES"),
        ("nat", "POSTROUTING", "KUBE-POSTROUTING"),
        ("filter", "INPUT", "KUBE-EXTERNAL-SERVICES"),
        ("filter", "FORWARD", "KUBE-FORWARD"),
        ("filter", "OUTPUT", "KUBE-SERVICES"),
        ("filter", "INPUT", "KUBE-FIREWALL"),
    ] {
        let jumps = kernel.rules(table, from);
        assert_eq!(
            jumps.iter().filter(|r| r.ends_with(&format!("-j {to}"))).count(),
            1,
            "{table} {from} -> {to}: {jumps:?}"
        );
    }
    let writes = mode.kernel_writes();
    assert!(writes > 0);

    mode.apply_full(&desired).expect("second full sync");
    assert_eq!(mode.kernel_writes(), writes, "nothing changed, nothing written");
    assert_eq!(kernel.restores().len(), 1);

    // Someone removes a jump and a rule: the next full sync repairs both,
    // without inserting the jumps that are still there a second time.
    kernel.tamper("*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n");
    kernel.tamper(&format!("*nat\n:{} - [0:0]\nCOMMIT\n", sep(&a, 11)));
    mode.apply_full(&desired).expect("repairing full sync");
    assert!(mode.kernel_writes() > writes);
    let repair = kernel.restores().pop().expect("a restore");
    assert_eq!(repair.matches("-I ").count(), 1, "{repair}");
    assert_eq!(kernel.rules("nat", "PREROUTING").len(), 1);
    assert_eq!(kernel.rules("nat", &sep(&a, 11)).len(), 2);
}

#[test]
fn full_sync_deletes_stale_service_chains_and_leaves_foreign_ones() {
    let (mut mode, kernel) = mode();
    kernel.tamper(
        "*nat\n:KUBE-SVC-STALE0000000000 - [0:0]\n:KUBE-SEP-STALE0000000000 - [0:0]\n:MY-CHAIN - [0:0]\n\
         -A KUBE-SVC-STALE0000000000 -j KUBE-SEP-STALE0000000000\n-A MY-CHAIN -j RETURN\n\
         -A PREROUTING -j MY-CHAIN\nCOMMIT\n",
    );
    let a = port("a", 1, None, &[11]);
    mode.apply_full(&state([&a])).expect("full sync");
    let chains = kernel.chains("nat");
    assert!(!chains.iter().any(|c| c.contains("STALE")), "{chains:?}");
    assert_eq!(kernel.rules("nat", "MY-CHAIN"), ["-j RETURN"]);
    assert!(kernel.rules("nat", "PREROUTING").contains(&"-j MY-CHAIN".to_owned()));
    assert_eq!(service_chains(&kernel).len(), 2);
}

#[test]
fn partial_sync_rewrites_only_the_changed_port() {
    let (mut mode, kernel) = mode();
    let a = port("a", 1, Some(30001), &[11, 12]);
    let b = port("b", 2, Some(30002), &[13, 14]);
    mode.apply_full(&state([&a, &b])).expect("full sync");

    let b2 = port("b", 2, Some(30002), &[14, 15]);
    mode.apply(&Plan {
        upsert: vec![b2.clone()],
        remove: vec![],
    })
    .expect("partial sync");
    let input = mode.last_input().to_owned();
    for chain in port_chains(&a) {
        assert!(!input.contains(&format!("-A {chain} ")), "{chain} rewritten:\n{input}");
        assert!(!input.contains(&format!(":{chain} ")), "{chain} rewritten:\n{input}");
    }
    assert!(input.contains(&format!("-X {}\n", sep(&b, 13))), "{input}");
    let expected: BTreeSet<String> = port_chains(&a).into_iter().chain(port_chains(&b2)).collect();
    assert_eq!(service_chains(&kernel), expected);
    // a is still dispatched.
    let services = kernel.rules("nat", "KUBE-SERVICES");
    assert!(
        services.iter().any(|r| r.ends_with(&chains::PortChains::of(&a).svc)),
        "{services:?}"
    );
}

#[test]
fn partial_sync_removes_ports_and_handles_a_new_frontend() {
    let (mut mode, kernel) = mode();
    let a = port("a", 1, Some(30001), &[11]);
    let b = port("b", 2, None, &[12]);
    mode.apply_full(&state([&a, &b])).expect("full sync");

    mode.apply(&Plan {
        upsert: vec![],
        remove: vec![b.clone()],
    })
    .expect("removal");
    assert_eq!(service_chains(&kernel), port_chains(&a));
    assert!(
        !kernel
            .rules("nat", "KUBE-SERVICES")
            .iter()
            .any(|r| r.contains("10.96.0.2"))
    );

    // A new ClusterIP for a: removed and upserted in one plan, same chains.
    let a2 = port("a", 9, Some(30001), &[11]);
    mode.apply(&Plan {
        upsert: vec![a2.clone()],
        remove: vec![a.clone()],
    })
    .expect("new frontend");
    assert_eq!(service_chains(&kernel), port_chains(&a2));
    let services = kernel.rules("nat", "KUBE-SERVICES");
    assert!(services.iter().any(|r| r.contains("-d 10.96.0.9 ")), "{services:?}");
    assert!(!services.iter().any(|r| r.contains("-d 10.96.0.1 ")), "{services:?}");

    // Dropping the NodePort deletes the EXT chain.
    let a3 = port("a", 9, None, &[11]);
    mode.apply(&Plan {
        upsert: vec![a3.clone()],
        remove: vec![],
    })
    .expect("no node port");
    assert_eq!(service_chains(&kernel), port_chains(&a3));
    assert!(kernel.rules("nat", "KUBE-NODEPORTS").is_empty());
}

/// A policy change is a partial sync like any other: `Local` adds
/// KUBE-SVL (and its DROP rule once node-a's endpoint leaves), `Cluster`
/// again deletes it, in the kernel too.
#[test]
fn switching_the_external_policy_creates_and_deletes_the_local_chain() {
    let kernel = FakeKernel::default();
    let opts = RuleOptions {
        node_name: Some("node-a".into()),
        ..RuleOptions::default()
    };
    let mut mode = IptablesMode::new(opts.clone(), Box::new(kernel.clone()));
    let mut cluster = port("a", 1, Some(30001), &[11, 12]);
    cluster.endpoints[0].node_name = Some("node-a".into());
    cluster.endpoints[1].node_name = Some("node-b".into());
    mode.apply_full(&state([&cluster])).expect("full sync");
    let svl = chains::PortChains::of(&cluster).svl;
    assert!(!service_chains(&kernel).contains(&svl));

    let local = ServicePort {
        external_policy: crate::model::TrafficPolicy::Local,
        ..cluster.clone()
    };
    let upsert = |mode: &mut IptablesMode, p: &ServicePort| {
        mode.apply(&Plan {
            upsert: vec![p.clone()],
            remove: vec![],
        })
        .expect("partial sync");
    };
    upsert(&mut mode, &local);
    assert_eq!(service_chains(&kernel), rules::port_chains(&opts, &local));
    assert_eq!(kernel.rules("nat", &svl).len(), 1, "node-a's endpoint only");
    assert!(kernel.rules("filter", "KUBE-EXTERNAL-SERVICES").is_empty());

    let mut remote_only = local.clone();
    remote_only.endpoints.remove(0);
    upsert(&mut mode, &remote_only);
    assert!(!service_chains(&kernel).contains(&svl), "{:?}", service_chains(&kernel));
    let filter = kernel.rules("filter", "KUBE-EXTERNAL-SERVICES");
    assert!(
        filter.len() == 1 && filter[0].contains("has no local endpoints") && filter[0].ends_with("-j DROP"),
        "{filter:?}"
    );

    upsert(&mut mode, &cluster);
    assert_eq!(service_chains(&kernel), rules::port_chains(&opts, &cluster));
    assert!(kernel.rules("filter", "KUBE-EXTERNAL-SERVICES").is_empty());
}

#[test]
fn ports_without_endpoints_are_rejected_in_filter() {
    let (mut mode, kernel) = mode();
    let empty = port("e", 3, Some(30003), &[]);
    mode.apply_full(&state([&empty])).expect("full sync");
    assert!(service_chains(&kernel).is_empty());
    let reject = kernel.rules("filter", "KUBE-SERVICES");
    assert_eq!(reject.len(), 1, "{reject:?}");
    assert!(reject[0].contains("\"default/e has no endpoints\""), "{reject:?}");
    assert!(reject[0].contains("-d 10.96.0.3 --dport 80 -j REJECT"), "{reject:?}");
    let external = kernel.rules("filter", "KUBE-EXTERNAL-SERVICES");
    assert!(external[0].contains("--dport 30003 -j REJECT"), "{external:?}");

    let filled = port("e", 3, Some(30003), &[11]);
    mode.apply(&Plan {
        upsert: vec![filled.clone()],
        remove: vec![],
    })
    .expect("endpoints appear");
    assert!(kernel.rules("filter", "KUBE-SERVICES").is_empty());
    assert!(kernel.rules("filter", "KUBE-EXTERNAL-SERVICES").is_empty());
    assert_eq!(service_chains(&kernel), port_chains(&filled));

    mode.apply(&Plan {
        upsert: vec![empty.clone()],
        remove: vec![],
    })
    .expect("endpoints go");
    assert!(service_chains(&kernel).is_empty());
}

#[test]
fn a_failed_partial_sync_changes_nothing_and_a_full_one_recovers() {
    let (mut mode, kernel) = mode();
    let a = port("a", 1, None, &[11]);
    mode.apply_full(&state([&a])).expect("full sync");
    let before = kernel.clone().save().expect("save");
    let a2 = port("a", 1, None, &[12]);
    kernel.fail_next();
    assert!(
        mode.apply(&Plan {
            upsert: vec![a2.clone()],
            remove: vec![],
        })
        .is_err()
    );
    assert_eq!(kernel.clone().save().expect("save"), before);
    assert_eq!(mode.state, state([&a]), "state rolled back");
    mode.apply_full(&state([&a2])).expect("recovery");
    assert_eq!(service_chains(&kernel), port_chains(&a2));
}

#[test]
fn counters_give_the_rules_read_back_and_the_failed_restores() {
    let (mut mode, kernel) = mode();
    assert_eq!(mode.counters(), ModeCounters::default());
    let a = port("a", 1, Some(30001), &[11, 12]);
    mode.apply_full(&state([&a])).expect("full sync");
    let counted = mode.counters().iptables_rules;
    for (table, rules) in &counted {
        let saved = Saved::parse(&kernel.clone().save().expect("save"));
        let ours = owned_lines(&saved, chains::is_ours)
            .iter()
            .filter(|l| l.starts_with(&format!("{table} -A")))
            .count();
        assert_eq!(*rules, ours as u64, "{table}: {counted:?}");
    }
    assert!(counted.iter().all(|(_, n)| *n > 0), "{counted:?}");
    kernel.fail_next();
    let plan = Plan {
        upsert: vec![port("a", 1, Some(30001), &[13])],
        remove: vec![],
    };
    assert!(mode.apply(&plan).is_err());
    kernel.fail_next();
    let b = port("b", 2, None, &[14]);
    assert!(mode.apply_full(&state([&a, &b])).is_err());
    let counters = mode.counters();
    assert_eq!(counters.iptables_partial_restore_failures, 1);
    assert_eq!(counters.iptables_restore_failures, 1);
    assert_eq!(counters.iptables_rules, counted, "the last reading stays");
}

#[test]
fn cleanup_removes_everything_ours_once() {
    let (mut mode, kernel) = mode();
    kernel.tamper("*nat\n:MY-CHAIN - [0:0]\n-A MY-CHAIN -j RETURN\n-A OUTPUT -j MY-CHAIN\nCOMMIT\n");
    mode.apply_full(&state([
        &port("a", 1, Some(30001), &[11, 12]),
        &port("e", 2, Some(30002), &[]),
    ]))
    .expect("full sync");
    let mut k = kernel.clone();
    let removed = cleanup_with(&mut k).expect("cleanup");
    assert!(removed >= 8, "removed {removed}");
    for table in ["nat", "filter"] {
        let left: Vec<String> = kernel
            .chains(table)
            .into_iter()
            .filter(|c| c.starts_with("KUBE-"))
            .collect();
        assert!(left.is_empty(), "{table}: {left:?}");
        for chain in builtin(table) {
            let rules = kernel.rules(table, chain);
            assert!(!rules.iter().any(|r| r.contains("KUBE-")), "{table} {chain}: {rules:?}");
        }
    }
    assert_eq!(kernel.rules("nat", "OUTPUT"), ["-j MY-CHAIN"]);
    let restores = kernel.restores().len();
    assert_eq!(cleanup_with(&mut k).expect("second cleanup"), 0);
    assert_eq!(kernel.restores().len(), restores, "nothing to do, nothing run");
}

/// Source ranges come and go by partial syncs: KUBE-FW and the filter
/// KUBE-PROXY-FIREWALL rules with them. Without a node IP the node's own
/// traffic cannot be let through: reported once, however often synced.
#[test]
fn source_ranges_add_and_remove_the_firewall_chain() {
    let (mut mode, kernel) = mode();
    let mut lb = port("lb", 5, Some(30005), &[11, 12]);
    lb.load_balancer_ips = vec![Ipv4Addr::new(203, 0, 113, 5).into()];
    lb.source_ranges = vec![crate::model::SourceRange {
        addr: Ipv4Addr::new(192, 0, 2, 0).into(),
        prefix_len: 24,
    }];
    let fw = chains::PortChains::of(&lb).fw;
    mode.apply_full(&state([&lb])).expect("full sync");
    assert!(service_chains(&kernel).contains(&fw));
    assert_eq!(kernel.rules("filter", chains::PROXY_FIREWALL).len(), 1);
    mode.apply_full(&state([&lb])).expect("full sync again");
    assert_eq!(mode.unhonoured(), 1, "no node IP: reported once");

    lb.source_ranges.clear();
    let plan = Plan {
        upsert: vec![lb.clone()],
        remove: vec![],
    };
    mode.apply(&plan).expect("ranges gone");
    assert!(!service_chains(&kernel).contains(&fw), "{:?}", service_chains(&kernel));
    assert!(kernel.rules("filter", chains::PROXY_FIREWALL).is_empty());
    let ext = chains::PortChains::of(&lb).ext;
    assert!(
        kernel
            .rules("nat", chains::SERVICES)
            .iter()
            .any(|r| r.contains("-d 203.0.113.5 ") && r.ends_with(&format!("-j {ext}"))),
        "{:?}",
        kernel.rules("nat", chains::SERVICES)
    );
}

/// The IPv6 half of a dual-stack `port("a", ...)`: `fd00:10:96::IP` and
/// endpoints `fd00:10:244::E`, named as the model names it.
fn port_v6(name: &str, ip: u16, node_port: Option<u16>, endpoints: &[u16]) -> ServicePort {
    ServicePort {
        name: format!("default/{name}{}", crate::model::IPV6_SUFFIX),
        cluster_ip: Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, ip).into(),
        endpoints: endpoints
            .iter()
            .map(|e| Endpoint::ready(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, *e), 8080))
            .collect(),
        ..port(name, 0, node_port, &[])
    }
}

fn mode_v6() -> (IptablesMode, FakeKernel) {
    let kernel = FakeKernel::default();
    let opts = RuleOptions {
        family: IpFamily::V6,
        local_traffic: Some(LocalTraffic::Cidr("fd00:10:244::/56".parse().expect("cidr"))),
        node_ports: NodePortDestinations::AllLocal { localhost: false },
        ..RuleOptions::default()
    };
    (IptablesMode::new(opts, Box::new(kernel.clone())), kernel)
}

/// The IPv6 rules: kube-proxy's chains with IPv6 addresses, `[ip]:port`
/// endpoints (in the DNAT and in the chain hashes), no localnet guard
/// and NodePorts never on `::1`; a port without endpoints is rejected.
#[test]
fn ipv6_rules_like_kube_proxys_ipv6_proxier() {
    let (mut mode, kernel) = mode_v6();
    let a = port_v6("a", 0x88, Some(30001), &[0xb, 0xc]);
    let empty = port_v6("empty", 0x89, None, &[]);
    mode.apply_full(&state([&a, &empty])).expect("full sync");
    let names = chains::PortChains::of(&a);
    let sep_b = chains::sep_chain(&a.name, a.protocol, "[fd00:10:244::b]:8080");
    assert!(
        kernel.rules("nat", chains::SERVICES).contains(&format!(
            "-m comment --comment \"default/a (IPv6) cluster IP\" -m tcp -p tcp -d fd00:10:96::88 --dport 80 -j {}",
            names.svc
        )),
        "{:?}",
        kernel.rules("nat", chains::SERVICES)
    );
    assert_eq!(
        kernel.rules("nat", &sep_b),
        [
            "-m comment --comment \"default/a (IPv6)\" -s fd00:10:244::b -j KUBE-MARK-MASQ",
            "-m comment --comment \"default/a (IPv6)\" -m tcp -p tcp -j DNAT --to-destination [fd00:10:244::b]:8080",
        ]
    );
    let svc = kernel.rules("nat", &names.svc);
    assert!(svc[0].ends_with("! -s fd00:10:244::/56 -j KUBE-MARK-MASQ"), "{svc:?}");
    assert!(
        kernel
            .rules("nat", chains::SERVICES)
            .last()
            .is_some_and(|r| r.ends_with("-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS")),
        "{:?}",
        kernel.rules("nat", chains::SERVICES)
    );
    assert!(!kernel.chains("filter").iter().any(|c| c == chains::FIREWALL));
    assert!(!kernel.clone().save().expect("save").contains("127.0.0.0/8"));
    assert_eq!(
        kernel.rules("filter", chains::SERVICES),
        [
            "-m comment --comment \"default/empty (IPv6) has no endpoints\" -m tcp -p tcp -d fd00:10:96::89 --dport 80 -j REJECT"
        ]
    );
    assert_eq!(mode.families(), [IpFamily::V6]);
}

fn dual_stack() -> (DualStack, FakeKernel, FakeKernel, RuleOptions) {
    let (v4, kernel4) = mode();
    let (v6, kernel6) = mode_v6();
    let v6_opts = v6.options().clone();
    (
        DualStack::new(vec![Box::new(v4), Box::new(v6)]),
        kernel4,
        kernel6,
        v6_opts,
    )
}

/// A dual-stack Service: each family's ports go to its own tool only;
/// the IPv4 rules are byte for byte what an IPv4-only mode writes.
#[test]
fn dual_stack_writes_each_family_with_its_own_tool() {
    let (mut dual, kernel4, kernel6, v6_opts) = dual_stack();
    assert_eq!(dual.families(), [IpFamily::V4, IpFamily::V6]);
    assert_eq!(dual.name(), "iptables");
    let a4 = port("a", 1, Some(30001), &[11, 12]);
    let a6 = port_v6("a", 1, Some(30001), &[0x11]);
    dual.apply_full(&state([&a4, &a6])).expect("full sync");
    let (mut alone, kernel_alone) = mode();
    alone.apply_full(&state([&a4])).expect("IPv4 alone");
    assert_eq!(kernel4.restores(), kernel_alone.restores());
    assert_eq!(service_chains(&kernel4), port_chains(&a4));
    assert_eq!(service_chains(&kernel6), rules::port_chains(&v6_opts, &a6));
    assert!(!kernel6.restores().concat().contains("10.96.0.1"));

    // A partial sync of the IPv6 port only leaves the IPv4 tool alone.
    let a6b = port_v6("a", 1, Some(30001), &[0x12]);
    dual.apply(&Plan {
        upsert: vec![a6b.clone()],
        remove: vec![],
    })
    .expect("partial sync");
    assert_eq!(kernel4.restores().len(), 1);
    assert_eq!(service_chains(&kernel6), rules::port_chains(&v6_opts, &a6b));
}

/// A failing IPv6 restore does not keep the IPv4 rules from being
/// written; the error names the family, and the counters add up.
#[test]
fn dual_stack_syncs_one_family_when_the_other_fails() {
    let (mut dual, kernel4, kernel6, _) = dual_stack();
    let a4 = port("a", 1, Some(30001), &[11]);
    let a6 = port_v6("a", 1, Some(30001), &[0x11]);
    kernel6.fail_next();
    let err = dual.apply_full(&state([&a4, &a6])).expect_err("the IPv6 restore fails");
    assert!(format!("{err:#}").contains("V6 rules"), "{err:#}");
    assert_eq!(service_chains(&kernel4), port_chains(&a4));
    assert_eq!(dual.counters().iptables_restore_failures, 1);
    dual.apply_full(&state([&a4, &a6])).expect("retry");
    let rules = dual.counters().iptables_rules;
    let count = |kernel: &FakeKernel, table: &str| {
        let saved = Saved::parse(&kernel.clone().save().expect("save"));
        owned_lines(&saved, chains::is_ours)
            .iter()
            .filter(|l| l.starts_with(&format!("{table} -A")))
            .count() as u64
    };
    for (table, n) in &rules {
        assert_eq!(
            *n,
            count(&kernel4, table) + count(&kernel6, table),
            "{table}: {rules:?}"
        );
    }
    assert_eq!(rules.len(), 2, "{rules:?}");
}
