//! Rendering against golden files, the mode's bookkeeping against a fake
//! `nft` that records transactions, and (where a user namespace can be
//! made, which needs no root) the rendered scripts against the kernel's
//! own checker (`nft -c`). The privileged tests in
//! `tests/tests/mode_rules.rs` apply them to a real namespace.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
};

use super::*;
use crate::{
    mode::fixtures::policy_port,
    model::{Endpoint, Protocol},
};

const SEED: &str = "default/nginx-service";

fn seed(last_octets: &[u8]) -> ServicePort {
    ServicePort {
        name: SEED.into(),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 88).into(),
        port: 88,
        node_port: Some(30791),
        endpoints: last_octets
            .iter()
            .map(|o| Endpoint::ready(Ipv4Addr::new(10, 244, 0, *o), 80))
            .collect(),
        ..ServicePort::default()
    }
}

fn empty_service() -> ServicePort {
    ServicePort {
        name: "default/empty-service".into(),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 89).into(),
        port: 89,
        node_port: Some(30792),
        endpoints: vec![],
        ..ServicePort::default()
    }
}

fn dns(endpoints: &[u8]) -> ServicePort {
    ServicePort {
        name: "kube-system/kube-dns:dns".into(),
        protocol: Protocol::Udp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 10).into(),
        port: 53,
        node_port: None,
        endpoints: endpoints
            .iter()
            .map(|o| Endpoint::ready(Ipv4Addr::new(10, 244, 1, *o), 53))
            .collect(),
        ..ServicePort::default()
    }
}

fn state(ports: &[ServicePort]) -> BTreeMap<String, ServicePort> {
    ports.iter().map(|p| (p.name.clone(), p.clone())).collect()
}

/// kube-proxy's defaults with the test bed's pod network as clusterCIDR.
fn opts() -> Options {
    Options {
        local_traffic: Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr"))),
        ..Options::default()
    }
}

#[derive(Default)]
struct FakeState {
    scripts: Vec<String>,
    /// What `list_table` returns.
    listing: Option<String>,
    /// Scripts containing this fail (as many times as `fail_times`).
    fail_on: Option<(String, usize)>,
}

/// Records every transaction; a full sync "creates" the table.
#[derive(Clone, Default)]
struct FakeNft(Arc<Mutex<FakeState>>);

impl FakeNft {
    fn scripts(&self) -> Vec<String> {
        self.0.lock().expect("lock").scripts.clone()
    }

    fn last(&self) -> String {
        self.scripts().last().cloned().unwrap_or_default()
    }

    fn fail_on(&self, needle: &str, times: usize) {
        self.0.lock().expect("lock").fail_on = Some((needle.into(), times));
    }

    fn set_listing(&self, listing: Option<&str>) {
        self.0.lock().expect("lock").listing = listing.map(str::to_owned);
    }
}

impl Nft for FakeNft {
    fn run(&mut self, script: &str) -> Result<()> {
        let mut s = self.0.lock().expect("lock");
        if let Some((needle, times)) = &mut s.fail_on
            && *times > 0
            && script.contains(needle.as_str())
        {
            *times -= 1;
            anyhow::bail!("injected failure on {needle:?}");
        }
        for family in ["ip", "ip6"] {
            let delete = format!("delete table {family} xproxy");
            if script.contains(&delete) {
                let listing = format!("table {family} #{}", s.scripts.len());
                s.listing = (!script.ends_with(&format!("{delete}\n"))).then_some(listing);
            }
        }
        s.scripts.push(script.to_owned());
        Ok(())
    }

    /// The listing set, if it is of a table of `family` (an IPv4 fake
    /// has none in `ip6`).
    fn list_table(&mut self, family: &str, _table: &str) -> Result<Option<String>> {
        let listing = self.0.lock().expect("lock").listing.clone();
        let ipv6_listing = listing.as_deref().is_some_and(|l| l.starts_with("table ip6 "));
        Ok(listing.filter(|_| ipv6_listing == (family == "ip6")))
    }
}

fn mode() -> (NftablesMode, FakeNft) {
    let fake = FakeNft::default();
    (NftablesMode::new(opts(), Box::new(fake.clone())), fake)
}

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/nftables")
        .join(name)
}

/// Compares with a golden file; `XPROXY_UPDATE_GOLDEN=1` rewrites it.
fn assert_golden(name: &str, actual: &str) {
    let path = golden_path(name);
    if std::env::var("XPROXY_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("golden dir");
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert!(
        expected == actual,
        "{} differs (XPROXY_UPDATE_GOLDEN=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display()
    );
}

/// `nft -c -f -` of `script` in a fresh user and network namespace
/// (`unshare -rn`, no root needed): the kernel checks the whole
/// transaction and throws it away. `None` if no such namespace can be made
/// here or nft is missing.
pub(crate) fn kernel_check(script: &str) -> Option<Result<(), String>> {
    let probe = Command::new("unshare")
        .args(["-rn", "nft", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        return None;
    }
    let mut child = Command::new("unshare")
        .args(["-rn", "nft", "-c", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let written = std::io::Write::write_all(&mut child.stdin.take()?, script.as_bytes());
    let out = child.wait_with_output().ok()?;
    Some(match (out.status.success(), written) {
        (true, Ok(())) => Ok(()),
        (_, Err(e)) => Err(format!("writing: {e}")),
        (false, _) => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    })
}

pub(crate) fn expect_kernel_accepts(what: &str, script: &str) {
    match kernel_check(script) {
        Some(Ok(())) => {}
        Some(Err(e)) => panic!("nft -c rejects the {what}:\n{e}\n{script}"),
        None => eprintln!("skipping the nft -c check of the {what}: no user namespace or no nft here"),
    }
}

// ---------------------------------------------------------------------------
// Rendering.

/// The seed Service, plus one without endpoints: full sync, then an
/// endpoint change (pod-3 replaced by 10.244.0.14) as a partial sync.
#[test]
fn seed_scripts_match_golden_files_and_pass_the_kernel_check() {
    let (mut mode, fake) = mode();
    mode.apply_full(&state(&[seed(&[11, 12, 13]), empty_service()]))
        .expect("full sync");
    let full = fake.last();
    assert_golden("seed-full.nft", &full);

    mode.apply(&Plan {
        upsert: vec![seed(&[11, 12, 14])],
        remove: vec![],
    })
    .expect("partial sync");
    let partial = fake.last();
    assert_golden("seed-endpoint-change.nft", &partial);

    expect_kernel_accepts("full script", &full);
    expect_kernel_accepts("full + partial scripts", &format!("{full}{partial}"));
}

#[test]
fn an_endpoint_change_rewrites_only_the_service_chain_and_the_endpoint_chains_that_changed() {
    let (mut mode, fake) = mode();
    mode.apply_full(&state(&[seed(&[11, 12, 13]), dns(&[1, 2])]))
        .expect("full sync");
    mode.apply(&Plan {
        upsert: vec![seed(&[11, 12, 14])],
        remove: vec![],
    })
    .expect("partial sync");
    let script = fake.last();
    let new_ep = names::endpoint_chain(&seed(&[]), &Endpoint::ready(Ipv4Addr::new(10, 244, 0, 14), 80));
    let old_ep = names::endpoint_chain(&seed(&[]), &Endpoint::ready(Ipv4Addr::new(10, 244, 0, 13), 80));
    let kept = names::endpoint_chain(&seed(&[]), &Endpoint::ready(Ipv4Addr::new(10, 244, 0, 11), 80));
    let svc = names::service_chain(&seed(&[]));
    assert!(script.contains(&format!("add chain ip xproxy {new_ep}\n")), "{script}");
    assert!(
        !script.contains(&format!("flush chain ip xproxy {new_ep}\n")),
        "{script}"
    );
    assert!(script.contains(&format!("flush chain ip xproxy {svc}\n")), "{script}");
    assert!(
        script.ends_with(&format!("delete chain ip xproxy {old_ep}\n")),
        "{script}"
    );
    assert!(
        !script.contains(&format!("chain ip xproxy {kept}")) && !script.contains(&format!("rule ip xproxy {kept}")),
        "an unchanged endpoint chain was touched:\n{script}"
    );
    assert!(!script.contains("kube-dns"), "another Service was touched:\n{script}");
    assert!(!script.contains("element"), "no map element changes:\n{script}");
    assert!(!script.contains("table"), "{script}");
    // The new endpoint chain exists before the service chain jumps to it.
    let at = |needle: &str| script.find(needle).unwrap_or_else(|| panic!("{needle} in {script}"));
    assert!(at(&format!("add chain ip xproxy {new_ep}")) < at(&format!("flush chain ip xproxy {svc}")));
}

#[test]
fn removal_deletes_elements_before_chains_and_referring_chains_first() {
    let (mut mode, fake) = mode();
    mode.apply_full(&state(&[seed(&[11, 12]), dns(&[1])]))
        .expect("full sync");
    mode.apply(&Plan {
        upsert: vec![],
        remove: vec![seed(&[11, 12])],
    })
    .expect("removal");
    let script = fake.last();
    let lines: Vec<&str> = script.lines().collect();
    let pos = |prefix: &str| lines.iter().position(|l| l.starts_with(prefix));
    let elements = pos("delete element ip xproxy service-ips").expect("service-ips element");
    let nodeports = pos("delete element ip xproxy service-nodeports").expect("nodeport element");
    let external = pos("delete chain ip xproxy external-").expect("external chain");
    let service = pos("delete chain ip xproxy service-").expect("service chain");
    let endpoint = pos("delete chain ip xproxy endpoint-").expect("endpoint chain");
    assert!(elements < external && nodeports < external, "{script}");
    assert!(external < service && service < endpoint, "{script}");
    assert_eq!(script.matches("delete chain").count(), 4, "{script}");
    assert!(!script.contains("kube-dns") && !script.contains("add "), "{script}");
    assert_eq!(mode.state.len(), 1);
}

#[test]
fn losing_and_regaining_endpoints_swaps_the_map_elements() {
    let (mut mode, fake) = mode();
    mode.apply_full(&state(&[seed(&[11])])).expect("full sync");
    mode.apply(&Plan {
        upsert: vec![seed(&[])],
        remove: vec![],
    })
    .expect("endpoints gone");
    let script = fake.last();
    assert!(
        script.contains("delete element ip xproxy service-ips {\n\t10.96.0.88 . tcp . 88\n}"),
        "{script}"
    );
    assert!(
        script.contains(
            "add element ip xproxy no-endpoint-services {\n\t10.96.0.88 . tcp . 88 comment \"default/nginx-service\" : goto reject-chain\n}"
        ),
        "{script}"
    );
    assert!(
        script.contains("add element ip xproxy no-endpoint-nodeports {\n\ttcp . 30791 comment"),
        "{script}"
    );
    assert_eq!(script.matches("delete chain").count(), 3, "{script}");

    mode.apply(&Plan {
        upsert: vec![seed(&[11])],
        remove: vec![],
    })
    .expect("endpoints back");
    let script = fake.last();
    assert!(
        script.contains("delete element ip xproxy no-endpoint-services"),
        "{script}"
    );
    assert!(
        script.contains("delete element ip xproxy no-endpoint-nodeports"),
        "{script}"
    );
    assert!(script.contains("add element ip xproxy service-ips"), "{script}");
    assert!(!script.contains("delete chain"), "{script}");
}

/// A new ClusterIP for the same port name: the plan removes the old port
/// and upserts the new one, whose chains have the same names.
#[test]
fn a_new_cluster_ip_moves_the_element_and_keeps_the_chains() {
    let (mut mode, fake) = mode();
    let old = seed(&[11]);
    mode.apply_full(&state(std::slice::from_ref(&old))).expect("full sync");
    let new = ServicePort {
        cluster_ip: Ipv4Addr::new(10, 96, 0, 99).into(),
        ..old.clone()
    };
    mode.apply(&Plan {
        upsert: vec![new.clone()],
        remove: vec![old],
    })
    .expect("partial sync");
    let script = fake.last();
    assert!(
        script.contains("delete element ip xproxy service-ips {\n\t10.96.0.88 . tcp . 88\n}"),
        "{script}"
    );
    assert!(script.contains("\t10.96.0.99 . tcp . 88 : goto service-"), "{script}");
    // The service chain's masquerade rule names the ClusterIP: rewritten.
    assert!(script.contains("flush chain ip xproxy service-"), "{script}");
    assert!(!script.contains("delete chain"), "{script}");
    assert_eq!(mode.state[SEED].0, new);
}

#[test]
fn an_idle_full_sync_writes_nothing_unless_the_table_changed() {
    let (mut mode, fake) = mode();
    let desired = state(&[seed(&[11, 12, 13])]);
    mode.apply_full(&desired).expect("full sync");
    let writes = mode.kernel_writes();
    assert!(writes > 30, "{writes}");
    mode.apply_full(&desired).expect("idle full sync");
    assert_eq!(mode.kernel_writes(), writes);
    assert_eq!(fake.scripts().len(), 1);

    // Someone changed the table: rewritten.
    fake.set_listing(Some("something else"));
    mode.apply_full(&desired).expect("full sync after a change");
    assert_eq!(fake.scripts().len(), 2);
    // A partial sync since the last full one: rewritten too.
    mode.apply(&Plan {
        upsert: vec![seed(&[11])],
        remove: vec![],
    })
    .expect("partial");
    mode.apply_full(&state(&[seed(&[11])]))
        .expect("full sync after a partial one");
    assert_eq!(fake.scripts().len(), 4);
    assert!(fake.last().starts_with("add table ip xproxy\ndelete table ip xproxy\n"));
}

/// Kernels before 6.2 may refuse to delete a chain in the transaction that
/// deletes the last map element pointing to it: the chain is emptied
/// instead and deleted by a later sync.
#[test]
fn chains_the_kernel_will_not_delete_yet_are_emptied_and_deleted_later() {
    let (mut mode, fake) = mode();
    mode.apply_full(&state(&[seed(&[11, 12]), dns(&[1])]))
        .expect("full sync");
    fake.fail_on("delete chain", 1);
    mode.apply(&Plan {
        upsert: vec![seed(&[11])],
        remove: vec![],
    })
    .expect("partial sync with the fallback");
    // As kube-proxy counts it: the transaction failed, its retry did not.
    assert_eq!(mode.counters().nftables_sync_failures, 1);
    let script = fake.last();
    let gone = names::endpoint_chain(&seed(&[]), &Endpoint::ready(Ipv4Addr::new(10, 244, 0, 12), 80));
    assert!(script.ends_with(&format!("flush chain ip xproxy {gone}\n")), "{script}");
    assert!(mode.leftovers.contains_key(&gone));

    // Too soon: not deleted yet.
    mode.apply(&Plan {
        upsert: vec![dns(&[1, 2])],
        remove: vec![],
    })
    .expect("next partial sync");
    assert!(!fake.last().contains(&gone));
    // Later: deleted with the next change.
    std::thread::sleep(LEFTOVER_GRACE);
    mode.apply(&Plan {
        upsert: vec![dns(&[2])],
        remove: vec![],
    })
    .expect("later partial sync");
    assert!(
        fake.last().contains(&format!("delete chain ip xproxy {gone}\n")),
        "{}",
        fake.last()
    );
    assert!(mode.leftovers.is_empty());
}

#[test]
fn a_failed_sync_is_an_error_and_changes_no_bookkeeping() {
    let (mut mode, fake) = mode();
    mode.apply_full(&state(&[seed(&[11])])).expect("full sync");
    fake.fail_on("add", 1);
    let err = mode
        .apply(&Plan {
            upsert: vec![dns(&[1])],
            remove: vec![],
        })
        .expect_err("injected failure");
    assert!(format!("{err:#}").contains("injected failure"), "{err:#}");
    assert!(!mode.state.contains_key("kube-system/kube-dns:dns"));
    fake.fail_on("add", 1);
    assert!(mode.apply_full(&state(&[seed(&[11])])).is_err());
    assert!(mode.verified.is_none());
    assert_eq!(
        mode.counters().nftables_sync_failures,
        2,
        "each failed transaction counted"
    );
}

#[test]
fn masquerade_options_shape_the_service_chain() {
    let port = seed(&[11]);
    let svc_rules = |opts: &Options| -> Vec<String> {
        port_rules(opts, &port)
            .chains
            .into_iter()
            .find(|c| c.kind == ruleset::ChainKind::Service)
            .expect("service chain")
            .rules
    };
    let all = Options {
        masquerade_all: true,
        ..opts()
    };
    assert_eq!(
        svc_rules(&all)[0],
        "ip daddr 10.96.0.88 tcp dport 88 jump mark-for-masquerade"
    );
    assert_eq!(
        svc_rules(&opts())[0],
        "ip daddr 10.96.0.88 tcp dport 88 ip saddr != 10.244.0.0/16 jump mark-for-masquerade"
    );
    let prefix = Options {
        local_traffic: Some(LocalTraffic::InterfacePrefix("veth".into())),
        ..Options::default()
    };
    assert!(svc_rules(&prefix)[0].contains("iifname != \"veth*\""));
    let none = Options::default();
    assert_eq!(svc_rules(&none).len(), 1, "only the numgen dispatch");
    let bit = Options {
        masquerade_bit: 5,
        ..Options::default()
    };
    let script = ruleset::full(&bit, []).text;
    assert!(script.contains("meta mark set meta mark or 0x20\n"), "{script}");
}

#[test]
fn node_port_addresses_choose_the_destination_match() {
    let ips = Options {
        node_ports: NodePorts::Addresses(vec![Ipv4Addr::new(172, 30, 0, 2).into()]),
        ..opts()
    };
    let text = ruleset::full(&ips, []).text;
    assert!(
        text.contains("add element ip xproxy nodeport-ips { 172.30.0.2 }"),
        "{text}"
    );
    assert!(
        text.contains("services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"),
        "{text}"
    );
    expect_kernel_accepts("nodeport-ips script", &text);

    let cidrs = Options {
        node_ports: NodePorts::Cidrs(vec![
            "172.30.0.0/24".parse().expect("cidr"),
            "172.30.0.0/16".parse().expect("cidr"),
        ]),
        ..opts()
    };
    let text = ruleset::full(&cidrs, []).text;
    assert!(text.contains("flags interval ; auto-merge"), "{text}");
    assert!(text.contains("fib daddr type local ip daddr != 127.0.0.0/8 ip daddr @nodeport-cidrs meta l4proto . th dport vmap @no-endpoint-nodeports"), "{text}");
    expect_kernel_accepts("nodeport-cidrs script", &text);

    let none = Options {
        node_ports: NodePorts::Cidrs(vec![]),
        ..opts()
    };
    expect_kernel_accepts("empty nodeport-cidrs script", &ruleset::full(&none, []).text);
}

#[test]
fn udp_terminating_and_duplicate_endpoints() {
    let mut port = dns(&[1, 1, 2]);
    // Only terminating-but-serving endpoints left: they are used.
    for ep in &mut port.endpoints {
        ep.ready = false;
        ep.terminating = true;
    }
    let rules = port_rules(&opts(), &port);
    let endpoints: Vec<_> = rules
        .chains
        .iter()
        .filter(|c| c.kind == ruleset::ChainKind::Endpoint)
        .collect();
    assert_eq!(endpoints.len(), 2, "{rules:#?}");
    assert_eq!(endpoints[0].rules[1], "meta l4proto udp dnat to 10.244.1.1:53");
    let service = rules
        .chains
        .iter()
        .find(|c| c.kind == ruleset::ChainKind::Service)
        .expect("service");
    assert!(
        service.rules[1].starts_with("numgen random mod 2 vmap { 0 : goto endpoint-"),
        "{service:?}"
    );
    assert_eq!(rules.elements[0].key, "10.96.0.10 . udp . 53");
    // Not serving either: rejected.
    for ep in &mut port.endpoints {
        ep.serving = false;
    }
    let rules = port_rules(&opts(), &port);
    assert!(rules.chains.is_empty());
    assert_eq!(rules.elements[0].map, names::NO_ENDPOINT_SERVICES);
}

/// SCTP keys its map elements and its DNAT as `sctp`, and the kernel's
/// checker takes the whole script (`sctp` is a payload match, no module).
#[test]
fn sctp_ports_are_keyed_and_translated_as_sctp() {
    let port = ServicePort {
        name: format!("{SEED}:sctp"),
        protocol: Protocol::Sctp,
        ..seed(&[11])
    };
    let rules = port_rules(&opts(), &port);
    let endpoint = rules
        .chains
        .iter()
        .find(|c| c.kind == ruleset::ChainKind::Endpoint)
        .expect("an endpoint chain");
    assert_eq!(endpoint.rules[1], "meta l4proto sctp dnat to 10.244.0.11:80");
    let keys: Vec<&str> = rules.elements.iter().map(|e| e.key.as_str()).collect();
    assert!(keys.contains(&"10.96.0.88 . sctp . 88"), "{keys:?}");
    assert!(keys.contains(&"sctp . 30791"), "{keys:?}");
    let (mut mode, fake) = mode();
    mode.apply_full(&state(&[port, seed(&[12])])).expect("full sync");
    let script = fake.last();
    assert!(script.contains("sctp . 88") && script.contains("tcp . 88"), "{script}");
    expect_kernel_accepts("SCTP script", &script);
}

#[test]
fn comments_are_quoted_safely() {
    assert_eq!(ruleset::quote("a\"b\nc"), "\"a'b c\"");
    assert_eq!(ruleset::quote(&"é".repeat(100)).len(), 128 + 2);
}

#[test]
fn cleanup_removes_only_an_existing_table() {
    let fake = FakeNft::default();
    assert!(!cleanup_with(&mut fake.clone()).expect("cleanup"));
    assert!(fake.scripts().is_empty());
    fake.set_listing(Some("table ip xproxy {}"));
    assert!(cleanup_with(&mut fake.clone()).expect("cleanup"));
    assert_eq!(fake.last(), "add table ip xproxy\ndelete table ip xproxy\n");
    assert!(!cleanup_with(&mut fake.clone()).expect("second cleanup"));
    fake.set_listing(Some("table ip6 xproxy {}"));
    assert!(cleanup_with(&mut fake.clone()).expect("cleanup of the IPv6 table"));
    assert_eq!(fake.last(), "add table ip6 xproxy\ndelete table ip6 xproxy\n");
}

#[test]
fn options_from_the_configuration() {
    use crate::config::{ConfigFile, Environment, RunFlags, resolve};
    let load = |body: &str| {
        let text = format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n{body}"
        );
        let file = ConfigFile::parse(&text).expect("parse");
        let env = Environment {
            kubeconfig: None,
            hostname: Some("node".into()),
        };
        let flags = RunFlags {
            node_ips: vec!["172.30.0.2".parse().expect("ip")],
            ..RunFlags::default()
        };
        resolve(&flags, Some(&file), &env).expect("resolve").config
    };
    let o = options(&load(
        "clusterCIDR: 10.244.0.0/16\nnftables: {masqueradeBit: 5, masqueradeAll: true}\n",
    ));
    assert_eq!(o.masquerade_bit, 5);
    assert!(o.masquerade_all);
    assert_eq!(
        o.local_traffic,
        Some(LocalTraffic::Cidr("10.244.0.0/16".parse().expect("cidr")))
    );
    assert_eq!(o.node_ports, NodePorts::AllLocal);
    let o = options(&load("nodePortAddresses: [primary]\n"));
    assert_eq!(
        o.node_ports,
        NodePorts::Addresses(vec![Ipv4Addr::new(172, 30, 0, 2).into()])
    );
    let o = options(&load("nodePortAddresses: [172.30.0.0/24, \"fd00::/64\"]\n"));
    assert_eq!(
        o.node_ports,
        NodePorts::Cidrs(vec!["172.30.0.0/24".parse().expect("cidr")])
    );
    let o = options(&load(
        "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}\n",
    ));
    assert_eq!(o.local_traffic, Some(LocalTraffic::InterfacePrefix("veth".into())));
}

// ---------------------------------------------------------------------------
// Traffic policies.

fn node_a() -> Options {
    Options {
        node_name: Some("node-a".into()),
        ..opts()
    }
}

fn chain<'a>(rules: &'a PortRules, name: &str) -> Option<&'a ruleset::Chain> {
    rules.chains.iter().find(|c| c.name == name)
}

fn element<'a>(rules: &'a PortRules, map: &str) -> Option<&'a ruleset::Element> {
    rules.elements.iter().find(|e| e.map == map)
}

/// externalTrafficPolicy: Local on node-a: `external-…` short-circuits
/// pod and node traffic to `service-…` (every endpoint) and sends the rest,
/// unmasqueraded, to `local-…` (node-a's endpoint), like kube-proxy.
#[test]
fn external_local_policy_like_kube_proxy() {
    let mut port = policy_port("web", 1, Some(30884), &[(11, "node-a"), (11, "node-b")]);
    port.external_policy = crate::model::TrafficPolicy::Local;
    let rules = port_rules(&node_a(), &port);
    let (service, local) = (names::service_chain(&port), names::local_chain(&port));
    let external = chain(&rules, &names::external_chain(&port)).expect("external chain");
    assert_eq!(
        external.rules,
        [
            format!("ip saddr 10.244.0.0/16 goto {service} comment \"short-circuit pod traffic\""),
            "fib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\"".to_owned(),
            format!("fib saddr type local goto {service} comment \"short-circuit local traffic\""),
            format!("goto {local}"),
        ]
    );
    let local_chain = chain(&rules, &local).expect("local chain");
    assert_eq!(local_chain.kind, ruleset::ChainKind::Local);
    assert_eq!(
        local_chain.rules,
        [format!(
            "numgen random mod 1 vmap {{ 0 : goto {} }}",
            names::endpoint_chain(&port, &port.endpoints[0])
        )]
    );
    let service_chain = chain(&rules, &service).expect("service chain");
    assert!(service_chain.rules[0].contains("ip saddr != 10.244.0.0/16 jump mark-for-masquerade"));
    assert!(service_chain.rules[1].starts_with("numgen random mod 2 "));
    assert_eq!(
        element(&rules, names::SERVICE_IPS).expect("cluster IP").verdict,
        format!("goto {service}")
    );
    assert!(element(&rules, names::NO_ENDPOINT_NODEPORTS).is_none());
    assert_eq!(
        rules
            .chains
            .iter()
            .filter(|c| c.kind == ruleset::ChainKind::Endpoint)
            .count(),
        2
    );
}

/// On a node without a local endpoint: no `local-…` chain; the node port
/// still enters `external-…` (short-circuits), and what falls through is
/// dropped by `drop-external-chain` in the filter hooks.
#[test]
fn external_local_policy_without_local_endpoints_drops() {
    let mut port = policy_port("web", 1, Some(30884), &[(11, "node-b")]);
    port.external_policy = crate::model::TrafficPolicy::Local;
    let rules = port_rules(&node_a(), &port);
    assert!(chain(&rules, &names::local_chain(&port)).is_none(), "{rules:#?}");
    let external = chain(&rules, &names::external_chain(&port)).expect("external chain");
    assert_eq!(external.rules.len(), 3, "{external:#?}");
    assert!(element(&rules, names::SERVICE_NODEPORTS).is_some());
    let drop = element(&rules, names::NO_ENDPOINT_NODEPORTS).expect("no-endpoint element");
    assert_eq!(drop.key, "tcp . 30884");
    assert_eq!(drop.verdict, format!("goto {}", names::DROP_EXTERNAL_CHAIN));
    assert!(
        element(&rules, names::NO_ENDPOINT_SERVICES).is_none(),
        "ClusterIP unaffected"
    );
}

/// internalTrafficPolicy: Local: the ClusterIP goes to `local-…`, which
/// carries the off-cluster masquerade rule; without a node port there is no
/// `service-…`; with no local endpoint the ClusterIP is dropped.
#[test]
fn internal_local_policy_like_kube_proxy() {
    let mut port = policy_port("itp", 2, None, &[(21, "node-a"), (21, "node-b")]);
    port.internal_policy = crate::model::TrafficPolicy::Local;
    let rules = port_rules(&node_a(), &port);
    let local = names::local_chain(&port);
    assert_eq!(
        element(&rules, names::SERVICE_IPS).expect("cluster IP").verdict,
        format!("goto {local}")
    );
    assert!(chain(&rules, &names::service_chain(&port)).is_none(), "{rules:#?}");
    let local_chain = chain(&rules, &local).expect("local chain");
    assert!(local_chain.rules[0].ends_with("ip saddr != 10.244.0.0/16 jump mark-for-masquerade"));
    assert!(local_chain.rules[1].starts_with("numgen random mod 1 "));
    assert_eq!(rules.chains.len(), 2, "node-b's endpoint has no chain: {rules:#?}");

    port.endpoints.remove(0);
    let rules = port_rules(&node_a(), &port);
    assert!(rules.chains.is_empty(), "{rules:#?}");
    let drop = element(&rules, names::NO_ENDPOINT_SERVICES).expect("no-endpoint element");
    assert_eq!(
        (drop.verdict.as_str(), drop.comment.as_deref()),
        ("drop", Some("\"default/itp\""))
    );

    // No endpoint anywhere: rejected, as without a policy.
    port.endpoints.clear();
    let rules = port_rules(&node_a(), &port);
    assert_eq!(
        element(&rules, names::NO_ENDPOINT_SERVICES).expect("element").verdict,
        format!("goto {}", names::REJECT_CHAIN)
    );
}

/// The policies through the mode: a full sync with every case, then a
/// partial sync turning a Cluster port Local and back; the kernel accepts
/// every script, and the partial ones add and remove the `local-…` chain.
#[test]
fn policy_scripts_pass_the_kernel_check() {
    let fake = FakeNft::default();
    let mut mode = NftablesMode::new(node_a(), Box::new(fake.clone()));
    let mut etp = policy_port("etp", 1, Some(30884), &[(11, "node-a"), (11, "node-b")]);
    etp.external_policy = crate::model::TrafficPolicy::Local;
    let mut etp_none = policy_port("etp-none", 2, Some(30885), &[(12, "node-b")]);
    etp_none.external_policy = crate::model::TrafficPolicy::Local;
    let mut itp = policy_port("itp", 3, None, &[(13, "node-a")]);
    itp.internal_policy = crate::model::TrafficPolicy::Local;
    let mut itp_none = policy_port("itp-none", 4, None, &[(14, "node-b")]);
    itp_none.internal_policy = crate::model::TrafficPolicy::Local;
    let cluster = policy_port("cluster", 5, Some(30886), &[(15, "node-a"), (15, "node-b")]);
    mode.apply_full(&state(&[etp, etp_none, itp, itp_none, cluster.clone()]))
        .expect("full sync");
    let full = fake.last();
    expect_kernel_accepts("full script with traffic policies", &full);

    let local = ServicePort {
        external_policy: crate::model::TrafficPolicy::Local,
        ..cluster.clone()
    };
    let local_chain = names::local_chain(&local);
    let mut scripts = full.clone();
    for (port, adds) in [(&local, true), (&cluster, false)] {
        mode.apply(&Plan {
            upsert: vec![port.clone()],
            remove: vec![],
        })
        .expect("partial sync");
        let partial = fake.last();
        let verb = if adds { "add" } else { "delete" };
        assert!(
            partial.contains(&format!("{verb} chain ip xproxy {local_chain}")),
            "{partial}"
        );
        scripts.push_str(&partial);
        expect_kernel_accepts("full + partial scripts", &scripts);
    }
}

// ---------------------------------------------------------------------------
// External IPs, load balancer IPs, source ranges, ClientIP affinity.

const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);

fn range(text: &str) -> crate::model::SourceRange {
    let (addr, len) = text.split_once('/').expect("a/len");
    crate::model::SourceRange {
        addr: addr.parse().expect("addr"),
        prefix_len: len.parse().expect("len"),
    }
}

/// A LoadBalancer Service on node-a: node port, an external IP, an LB IP,
/// endpoints on node-a and node-b.
fn lb_port() -> ServicePort {
    ServicePort {
        external_ips: vec![EXTERNAL_IP.into()],
        load_balancer_ips: vec![LB_IP.into()],
        ..policy_port("lb", 7, Some(30887), &[(17, "node-a"), (17, "node-b")])
    }
}

/// Every feature at once: source ranges, affinity, eTP Local.
fn api_port() -> ServicePort {
    ServicePort {
        source_ranges: vec![range("203.0.113.0/24"), range("172.30.0.0/24")],
        affinity: Some(std::time::Duration::from_secs(600)),
        external_policy: crate::model::TrafficPolicy::Local,
        ..lb_port()
    }
}

fn node_a_with_ip() -> Options {
    Options {
        node_ips: vec![NODE_IP.into()],
        ..node_a()
    }
}

fn elements<'a>(rules: &'a PortRules, map: &str) -> Vec<(&'a str, &'a str)> {
    rules
        .elements
        .iter()
        .filter(|e| e.map == map)
        .map(|e| (e.key.as_str(), e.verdict.as_str()))
        .collect()
}

/// External and LB IPs are `@service-ips` keys for the Service's own port
/// only, leading to `external-…` like the node port; nothing filters them
/// without source ranges.
#[test]
fn external_and_load_balancer_ips_go_to_the_external_chain() {
    let port = lb_port();
    let rules = port_rules(&node_a(), &port);
    let (service, external) = (names::service_chain(&port), names::external_chain(&port));
    assert_eq!(
        elements(&rules, names::SERVICE_IPS),
        [
            ("10.96.1.7 . tcp . 80", format!("goto {service}").as_str()),
            ("192.0.2.10 . tcp . 80", format!("goto {external}").as_str()),
            ("198.51.100.7 . tcp . 80", format!("goto {external}").as_str()),
        ]
    );
    assert_eq!(
        elements(&rules, names::SERVICE_NODEPORTS),
        [("tcp . 30887", format!("goto {external}").as_str())]
    );
    assert_eq!(
        chain(&rules, &external).expect("external chain").rules,
        ["jump mark-for-masquerade".to_owned(), format!("goto {service}")]
    );
    assert!(elements(&rules, names::FIREWALL_IPS).is_empty());
    assert!(elements(&rules, names::NO_ENDPOINT_SERVICES).is_empty());

    // A ClusterIP Service with only an external IP still gets the chain.
    let only_external = ServicePort {
        node_port: None,
        load_balancer_ips: vec![],
        ..lb_port()
    };
    let rules = port_rules(&node_a(), &only_external);
    assert!(chain(&rules, &external).is_some(), "{rules:#?}");
    assert_eq!(elements(&rules, names::SERVICE_IPS).len(), 2);
}

/// Without an endpoint for external traffic, the external and LB IPs are
/// `@no-endpoint-services` keys: rejected if the port has no endpoint at
/// all, else (eTP Local, none on this node) dropped but for the node's own
/// traffic, which still enters `external-…` and short-circuits.
#[test]
fn external_addresses_without_endpoints_are_rejected_or_dropped() {
    let mut port = lb_port();
    port.external_policy = crate::model::TrafficPolicy::Local;
    port.endpoints.remove(0);
    let rules = port_rules(&node_a(), &port);
    let external = names::external_chain(&port);
    let drop = format!("goto {}", names::DROP_EXTERNAL_CHAIN);
    assert_eq!(
        elements(&rules, names::NO_ENDPOINT_SERVICES),
        [
            ("192.0.2.10 . tcp . 80", drop.as_str()),
            ("198.51.100.7 . tcp . 80", drop.as_str()),
        ]
    );
    assert_eq!(
        elements(&rules, names::SERVICE_IPS)[1..],
        [
            ("192.0.2.10 . tcp . 80", format!("goto {external}").as_str()),
            ("198.51.100.7 . tcp . 80", format!("goto {external}").as_str()),
        ]
    );

    port.endpoints.clear();
    let rules = port_rules(&node_a(), &port);
    let reject = format!("goto {}", names::REJECT_CHAIN);
    assert_eq!(
        elements(&rules, names::NO_ENDPOINT_SERVICES),
        [
            ("10.96.1.7 . tcp . 80", reject.as_str()),
            ("192.0.2.10 . tcp . 80", reject.as_str()),
            ("198.51.100.7 . tcp . 80", reject.as_str()),
        ]
    );
    assert!(elements(&rules, names::SERVICE_IPS).is_empty(), "{rules:#?}");
    assert!(rules.chains.is_empty(), "{rules:#?}");
}

/// loadBalancerSourceRanges: `@firewall-ips` holds the LB IPs only (not
/// the ClusterIP, external IPs or node port); the chain drops every other
/// source; the LB IPs are allowed as sources when a range holds a node IP.
#[test]
fn source_ranges_filter_the_load_balancer_ips_only() {
    let port = ServicePort {
        source_ranges: vec![range("203.0.113.0/24")],
        ..lb_port()
    };
    let firewall = names::firewall_chain(&port);
    assert!(firewall.starts_with("firewall-") && firewall.ends_with("-default/lb/tcp/"));
    let rules = port_rules(&node_a_with_ip(), &port);
    assert_eq!(
        elements(&rules, names::FIREWALL_IPS),
        [("198.51.100.7 . tcp . 80", format!("goto {firewall}").as_str())]
    );
    let chain_of = |rules: &PortRules| chain(rules, &firewall).expect("firewall chain").clone();
    assert_eq!(chain_of(&rules).kind, ruleset::ChainKind::Firewall);
    assert_eq!(chain_of(&rules).rules, ["ip saddr != { 203.0.113.0/24 } drop"]);

    let rules = port_rules(&node_a_with_ip(), &api_port());
    assert_eq!(
        chain_of(&rules).rules,
        ["ip saddr != { 203.0.113.0/24, 172.30.0.0/24, 198.51.100.7 } drop"],
        "a range holds the node IP: the LB IP is an allowed source"
    );

    // Ranges without LB IPs filter nothing (kube-proxy ignores them too).
    let no_lb = ServicePort {
        load_balancer_ips: vec![],
        ..api_port()
    };
    let rules = port_rules(&node_a_with_ip(), &no_lb);
    assert!(chain(&rules, &firewall).is_none() && elements(&rules, names::FIREWALL_IPS).is_empty());
}

/// ClientIP affinity as kube-proxy's nftables mode: a set per endpoint
/// with the Service's timeout, `update` in the endpoint chain before the
/// DNAT, lookups before `numgen` in the service and local chains.
#[test]
fn affinity_sets_and_rules_like_kube_proxy() {
    let port = api_port();
    let rules = port_rules(&node_a_with_ip(), &port);
    let (a, b) = (&port.endpoints[0], &port.endpoints[1]);
    let set_a = names::affinity_set(&port, a);
    let chain_a = names::endpoint_chain(&port, a);
    assert_eq!(
        set_a["affinity-".len()..],
        chain_a["endpoint-".len()..],
        "one base for both"
    );
    let sets: Vec<(&str, u64)> = rules.sets.iter().map(|s| (s.name.as_str(), s.timeout_secs)).collect();
    assert_eq!(
        sets,
        [(set_a.as_str(), 600), (names::affinity_set(&port, b).as_str(), 600)]
    );
    assert_eq!(
        chain(&rules, &chain_a).expect("endpoint chain").rules,
        [
            "ip saddr 10.244.1.17 jump mark-for-masquerade".to_owned(),
            format!("update @{set_a} {{ ip saddr }}"),
            "meta l4proto tcp dnat to 10.244.1.17:8080".to_owned(),
        ]
    );
    let service = chain(&rules, &names::service_chain(&port)).expect("service chain");
    assert_eq!(service.rules.len(), 4, "{service:#?}");
    assert_eq!(service.rules[1], format!("ip saddr @{set_a} goto {chain_a}"));
    assert!(service.rules[2].contains(&names::affinity_set(&port, b)));
    assert!(service.rules[3].starts_with("numgen random mod 2 "));
    let local = chain(&rules, &names::local_chain(&port)).expect("local chain");
    assert_eq!(
        local.rules,
        [
            format!("ip saddr @{set_a} goto {chain_a}"),
            format!("numgen random mod 1 vmap {{ 0 : goto {chain_a} }}"),
        ]
    );
    assert!(port_rules(&node_a(), &lb_port()).sets.is_empty());
}

/// The whole table for [`api_port`] (golden), accepted by the kernel; then
/// partial syncs: an endpoint goes (its set goes after the chains that used
/// it), affinity off (every set deleted last), on again (sets before
/// chains), a new timeout (the set is redefined).
#[test]
fn service_api_scripts_match_the_golden_file_and_pass_the_kernel_check() {
    let fake = FakeNft::default();
    let mut mode = NftablesMode::new(node_a_with_ip(), Box::new(fake.clone()));
    let port = api_port();
    mode.apply_full(&state(&[port.clone(), dns(&[1])])).expect("full sync");
    let mut scripts = fake.last();
    assert_golden("service-api-full.nft", &scripts);
    expect_kernel_accepts("full script with the Service API", &scripts);

    let gone = names::affinity_set(&port, &port.endpoints[1]);
    let one_left = ServicePort {
        endpoints: port.endpoints[..1].to_vec(),
        ..port.clone()
    };
    let no_affinity = ServicePort {
        affinity: None,
        ..one_left.clone()
    };
    let longer = ServicePort {
        affinity: Some(std::time::Duration::from_secs(10800)),
        ..one_left.clone()
    };
    let kept = names::affinity_set(&port, &port.endpoints[0]);
    for (next, check) in [
        (&one_left, "endpoint removed"),
        (&no_affinity, "affinity off"),
        (&one_left, "affinity on"),
        (&longer, "new timeout"),
    ] {
        mode.apply(&Plan {
            upsert: vec![next.clone()],
            remove: vec![],
        })
        .expect(check);
        let partial = fake.last();
        let at = |needle: &str| {
            partial
                .find(needle)
                .unwrap_or_else(|| panic!("{check}: {needle} in {partial}"))
        };
        match check {
            "endpoint removed" => {
                assert!(
                    partial.ends_with(&format!("delete set ip xproxy {gone}\n")),
                    "{partial}"
                );
                assert!(!partial.contains(&format!("set ip xproxy {kept}")), "{partial}");
            }
            "affinity off" => {
                assert!(
                    partial.ends_with(&format!("delete set ip xproxy {kept}\n")),
                    "{partial}"
                );
                assert!(!partial.contains("update @"), "{partial}");
            }
            "affinity on" => {
                assert!(
                    at(&format!("add set ip xproxy {kept} ")) < at("flush chain"),
                    "{partial}"
                );
                assert!(partial.contains("timeout 600s"), "{partial}");
            }
            _ => {
                assert_eq!(
                    partial,
                    format!(
                        "add set ip xproxy {kept} {{ type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }}\n"
                    )
                );
            }
        }
        scripts.push_str(&partial);
        expect_kernel_accepts(check, &scripts);
    }
}

/// The kernel fills and empties the affinity sets: the check that finds
/// the table unchanged since the last full sync looks past their elements
/// (and only theirs).
#[test]
fn clients_in_affinity_sets_do_not_count_as_a_changed_table() {
    let listing = "table ip xproxy {\n\
        \tset affinity-ABC-default/lb/tcp/__10.0.0.1/80 {\n\
        \t\ttype ipv4_addr\n\
        \t\tflags dynamic,timeout\n\
        \t\ttimeout 10m\n\
        \t\telements = { 10.1.0.1 timeout 10m expires 9m58s,\n\
        \t\t\t     10.1.0.2 timeout 10m expires 9m }\n\
        \t}\n\
        \tset nodeport-ips {\n\
        \t\ttype ipv4_addr\n\
        \t\telements = { 172.30.0.2 }\n\
        \t}\n\
        }\n";
    let stable = without_affinity_clients(listing);
    assert!(!stable.contains("10.1.0."), "{stable}");
    assert!(
        stable.contains("timeout 10m\n\t}\n") && stable.contains("elements = { 172.30.0.2 }"),
        "{stable}"
    );
    let one = listing.replace(
        "\t\telements = { 10.1.0.1 timeout 10m expires 9m58s,\n\t\t\t     10.1.0.2 timeout 10m expires 9m }\n",
        "\t\telements = { 10.1.0.9 timeout 10m expires 1s }\n",
    );
    assert_ne!(one, listing);
    assert_eq!(without_affinity_clients(&one), stable);
}

// ---------------------------------------------------------------------------
// IPv6: the `ip6 xproxy` table.

/// `fd00:10:<net>::<host>`, the test's own ULA addresses.
fn ula(net: u16, host: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, net, 0, 0, 0, 0, host)
}

/// The IPv6 half of the dual-stack seed Service, with an LB IP behind a
/// source range and ClientIP affinity.
fn seed_v6() -> ServicePort {
    ServicePort {
        name: format!("{SEED}{}", crate::model::IPV6_SUFFIX),
        cluster_ip: ula(0x96, 0x88).into(),
        load_balancer_ips: vec![ula(0x78, 5).into()],
        source_ranges: vec![range("fd00:10:79::/64")],
        affinity: Some(std::time::Duration::from_secs(600)),
        endpoints: (0xb..=0xd).map(|e| Endpoint::ready(ula(0x244, e), 80)).collect(),
        ..seed(&[])
    }
}

fn empty_service_v6() -> ServicePort {
    ServicePort {
        name: format!("default/empty-service{}", crate::model::IPV6_SUFFIX),
        cluster_ip: ula(0x96, 0x89).into(),
        ..empty_service()
    }
}

fn opts_v6() -> Options {
    Options {
        family: IpFamily::V6,
        local_traffic: Some(LocalTraffic::Cidr("fd00:10:244::/56".parse().expect("cidr"))),
        node_ips: vec![ula(0x79, 2).into()],
        ..Options::default()
    }
}

/// The IPv6 ports in an `ip6` table, as kube-proxy's IPv6 nftables
/// proxier writes them: `ipv6_addr` keys, `ip6` matches, `[ip]:port`
/// DNATs, ICMPv6 rejects, never `::1` for NodePorts, and the chains named
/// as in the `ip` table (without the model's " (IPv6)").
#[test]
fn ipv6_table_like_kube_proxys_ip6_table() {
    let fake = FakeNft::default();
    let mut mode = NftablesMode::new(opts_v6(), Box::new(fake.clone()));
    assert_eq!(mode.families(), [IpFamily::V6]);
    mode.apply_full(&state(&[seed_v6(), empty_service_v6()]))
        .expect("full sync");
    let full = fake.last();
    assert_golden("seed-ipv6-full.nft", &full);
    for needle in [
        "add table ip6 xproxy { comment",
        "add map ip6 xproxy service-ips { type ipv6_addr . inet_proto . inet_service : verdict",
        "add rule ip6 xproxy services ip6 daddr . meta l4proto . th dport vmap @service-ips",
        "fib daddr type local ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports",
        "add rule ip6 xproxy reject-chain reject with icmpv6 port-unreachable",
        "meta l4proto tcp dnat to [fd00:10:244::b]:80",
        "ip6 daddr fd00:10:96::88 tcp dport 88 ip6 saddr != fd00:10:244::/56 jump mark-for-masquerade",
        "ip6 saddr != { fd00:10:79::/64, fd00:10:78::5 } drop",
        "{ type ipv6_addr ; flags dynamic,timeout ; timeout 600s ; }",
        "update @affinity-",
        "\tfd00:10:96::89 . tcp . 89 comment \"default/empty-service (IPv6)\" : goto reject-chain",
    ] {
        assert!(full.contains(needle), "lacks {needle:?}:\n{full}");
    }
    assert!(
        !full.contains(" ip xproxy") && !full.contains("ip saddr") && !full.contains("ip daddr"),
        "{full}"
    );
    assert!(
        full.contains(&names::service_chain(&seed(&[]))),
        "the IPv4 chain names: {full}"
    );

    let mut changed = seed_v6();
    changed.endpoints.truncate(2);
    mode.apply(&Plan {
        upsert: vec![changed],
        remove: vec![],
    })
    .expect("partial sync");
    let partial = fake.last();
    assert!(partial.lines().all(|l| !l.contains(" ip xproxy")), "{partial}");
    assert!(partial.contains("delete chain ip6 xproxy endpoint-"), "{partial}");
    expect_kernel_accepts("IPv6 full script", &full);
    expect_kernel_accepts("IPv6 full + partial scripts", &format!("{full}{partial}"));
}

/// Both tables through the dual-stack split: the `ip` table's script is
/// byte for byte the one an IPv4-only mode writes; both pass the kernel's
/// check together.
#[test]
fn dual_stack_writes_an_ip_and_an_ip6_table() {
    let (v4, fake4) = mode();
    let fake6 = FakeNft::default();
    let v6 = NftablesMode::new(opts_v6(), Box::new(fake6.clone()));
    let mut dual = DualStack::new(vec![Box::new(v4), Box::new(v6)]);
    assert_eq!(dual.name(), "nftables");
    let ports = [seed(&[11, 12, 13]), seed_v6(), empty_service(), empty_service_v6()];
    dual.apply_full(&state(&ports)).expect("full sync");
    let (mut alone, fake_alone) = mode();
    alone
        .apply_full(&state(&[seed(&[11, 12, 13]), empty_service()]))
        .expect("IPv4 alone");
    assert_eq!(fake4.scripts(), fake_alone.scripts());
    assert!(!fake4.last().contains("fd00:"), "{}", fake4.last());
    assert!(fake6.last().contains("add table ip6 xproxy"));
    expect_kernel_accepts("ip and ip6 tables", &format!("{}{}", fake4.last(), fake6.last()));
}
