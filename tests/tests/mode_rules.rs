//! The rule-writing modes against the real kernel, without the agent: an
//! `IptablesMode` / `NftablesMode` driven by hand in a bare network
//! namespace, read back with `iptables-save` / `nft list`. What the agent
//! does with them end to end, the same in every mode, is `modes.rs`.
//!
//! - iptables: kube-proxy's chains through `iptables-restore` (compared
//!   with the kernel's own rendering in a golden file); a partial sync
//!   rewrites only the changed Service's chains (the rule counters of the
//!   others survive); removal and stale chains go, foreign chains stay; an
//!   idle full sync writes nothing; cleanup leaves no `KUBE-` chain.
//!   ClientIP affinity: the `recent` rules and the kernel's lists per
//!   endpoint follow endpoint removal and affinity off and on.
//! - nftables: a full sync writes the `ip xproxy` table (golden file); a
//!   partial sync rewrites only the changed Service's chains (the rule
//!   handles of the others stay); removal takes elements and chains away; a
//!   full sync replaces a tampered table and an idle one writes nothing;
//!   cleanup removes the table and nothing else.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    process::Command,
    time::Duration,
};

use anyhow::Result;
use proxy_userspace::{
    mode::{
        Dataplane, Plan,
        dual_stack::DualStack,
        iptables::{
            self, Iptables, IptablesMode, RuleOptions, SystemIptables,
            chains::{self, PortChains},
        },
        nftables::{self, NftablesMode, Options, SystemNft, names},
        options::LocalTraffic,
    },
    model::{Endpoint, IPV6_SUFFIX, IpFamily, Protocol, ServicePort, SourceRange},
};
use testbed::{
    agent_bed::workspace_root,
    fixtures::{
        EMPTY_CLUSTER_IP, EMPTY_NODE_PORT, EMPTY_PORT, SEED_CLUSTER_IP, SEED_NODE_PORT, SEED_PORT, backend_ips, ports,
    },
    netns::{self, Netns},
    privileged::require_root,
    topology::POD_CIDR,
};

const SEED_NAME: &str = "default/nginx-service";
const OTHER_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 91);

fn seed_port() -> ServicePort {
    ports::seed_port(SEED_NAME, Protocol::Tcp, &backend_ips())
}

fn empty_port() -> ServicePort {
    ports::service_port(
        "default/empty-service",
        Protocol::Tcp,
        EMPTY_CLUSTER_IP,
        EMPTY_PORT,
        Some(EMPTY_NODE_PORT),
        &[],
    )
}

fn other_port(endpoints: &[u8]) -> ServicePort {
    ServicePort {
        name: "default/other:http".into(),
        protocol: Protocol::Tcp,
        cluster_ip: OTHER_CLUSTER_IP.into(),
        port: 80,
        node_port: None,
        endpoints: endpoints
            .iter()
            .map(|e| Endpoint::ready(Ipv4Addr::new(10, 244, 1, *e), 8080))
            .collect(),
        ..ServicePort::default()
    }
}

fn state<'a>(ports: impl IntoIterator<Item = &'a ServicePort>) -> BTreeMap<String, ServicePort> {
    ports.into_iter().map(|p| (p.name.clone(), p.clone())).collect()
}

/// kube-proxy's default detectLocalMode with the test bed's pod CIDR.
fn local_traffic() -> Option<LocalTraffic> {
    Some(LocalTraffic::Cidr(POD_CIDR.parse().expect("cidr")))
}

/// Compares with `proxy-userspace/tests/golden/<name>`;
/// `XPROXY_UPDATE_GOLDEN=1` rewrites it.
fn assert_golden(name: &str, actual: &str) {
    let path = workspace_root().join("proxy-userspace/tests/golden").join(name);
    if std::env::var("XPROXY_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
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

/// A partial sync of `mode` inside `ns`: `upsert` and `remove`.
fn partial(ns: &Netns, mode: &mut dyn Dataplane, upsert: &[&ServicePort], remove: &[&ServicePort], what: &str) {
    let plan = Plan {
        upsert: upsert.iter().map(|p| (*p).clone()).collect(),
        remove: remove.iter().map(|p| (*p).clone()).collect(),
    };
    ns.run_in(|| mode.apply(&plan))
        .expect("thread")
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
}

/// A full sync of `mode` to `ports` inside `ns`.
fn full<'a>(ns: &Netns, mode: &mut dyn Dataplane, ports: impl IntoIterator<Item = &'a ServicePort>, what: &str) {
    let desired = state(ports);
    ns.run_in(|| mode.apply_full(&desired))
        .expect("thread")
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
}

// ---------------------------------------------------------------------------
// iptables

/// kube-proxy's defaults with the test bed's pod CIDR.
fn rule_options() -> RuleOptions {
    RuleOptions {
        local_traffic: local_traffic(),
        ..RuleOptions::default()
    }
}

fn save(ns: &Netns, counters: bool) -> Result<String> {
    ns.run_in(|| -> Result<String> {
        let mut cmd = Command::new("iptables-save");
        if counters {
            cmd.arg("-c");
        }
        netns::run(&mut cmd)
    })?
}

/// The filter and nat tables as `iptables-save` prints them, without the
/// timestamps and the built-in chains' counters.
fn normalized(saved: &str) -> String {
    saved
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.strip_prefix(':') {
            Some(decl) => format!(":{}", decl.split(" [").next().unwrap_or(decl)),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

fn nat_chains(saved: &str) -> BTreeSet<String> {
    let parsed = iptables::Saved::parse(saved);
    parsed
        .table("nat")
        .map(|t| {
            t.chains
                .iter()
                .filter(|c| chains::is_service_chain(c))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// Packets counted by the rules of `chain` (`iptables-save -c` output).
fn chain_packets(saved: &str, chain: &str) -> u64 {
    saved
        .lines()
        .filter(|l| l.contains(&format!("] -A {chain} ")))
        .filter_map(|l| l.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
        .sum()
}

/// Sends one SYN to `addr` from inside `ns` (nobody answers); enough for the nat OUTPUT chain to count it.
fn poke(ns: &Netns, addr: SocketAddrV4) -> Result<()> {
    let _ = ns.run_in(|| netns::tcp_connect(addr, Duration::from_millis(100)))?;
    Ok(())
}

/// A namespace with a default route into a veth whose peer (in the same
/// namespace) ignores everything, so local connects leave one SYN.
fn bare_namespace() -> Result<Netns> {
    let ns = Netns::new("xi")?;
    ns.ip(&["link", "add", "v0", "type", "veth", "peer", "name", "v1"])?;
    ns.add_addr("v0", "192.0.2.1/24")?;
    ns.ip(&["link", "set", "v0", "up"])?;
    ns.ip(&["link", "set", "v1", "up"])?;
    ns.add_route(&["default", "dev", "v0"])?;
    Ok(ns)
}

#[test]
fn iptables_mode_in_a_namespace() {
    if !require_root("iptables_mode_in_a_namespace") {
        return;
    }
    let ns = bare_namespace().expect("creating the namespace");
    let mut mode = IptablesMode::new(rule_options(), Box::new(SystemIptables::default()));
    let seed = seed_port();
    let other = other_port(&[1, 2]);

    // A foreign chain, which nothing of ours may touch.
    ns.run_in(|| {
        SystemIptables::default()
            .restore("*nat\n:MY-CHAIN - [0:0]\n-A MY-CHAIN -j RETURN\n-A OUTPUT -j MY-CHAIN\nCOMMIT\n")
    })
    .expect("thread")
    .expect("a foreign chain");

    full(&ns, &mut mode, [&seed], "full sync of the seed");
    let saved = save(&ns, false).expect("iptables-save");
    // The kernel's own rendering of the seed, like kube-proxy's node shows it
    // (minus the foreign chain).
    let without_foreign: String = normalized(&saved)
        .lines()
        .filter(|l| !l.contains("MY-CHAIN"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_golden("iptables/seed.iptables-save", &without_foreign);
    let names = PortChains::of(&seed);
    for needle in [
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_owned(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_owned(),
        format!(
            "-d {SEED_CLUSTER_IP}/32 -p tcp -m comment --comment \"{SEED_NAME} cluster IP\" -m tcp --dport {SEED_PORT} -j {}",
            names.svc
        ),
        "--probability 0.33333333349 -j KUBE-SEP-".to_owned(),
        "--probability 0.50000000000 -j KUBE-SEP-".to_owned(),
        format!("--dport {SEED_NODE_PORT} -j {}", names.ext),
        "-j DNAT --to-destination 10.244.0.13:80".to_owned(),
    ] {
        assert!(saved.contains(&needle), "iptables-save lacks {needle:?}:\n{saved}");
    }

    // Partial: another Service appears.
    partial(&ns, &mut mode, &[&other], &[], "adding a Service");
    let other_svc = chains::svc_chain(&other.name, other.protocol);
    poke(&ns, SocketAddrV4::new(SEED_CLUSTER_IP, SEED_PORT)).expect("poke seed");
    poke(&ns, SocketAddrV4::new(OTHER_CLUSTER_IP, other.port)).expect("poke other");
    let counted = save(&ns, true).expect("iptables-save -c");
    assert!(chain_packets(&counted, &names.svc) > 0, "seed not counted:\n{counted}");
    assert!(chain_packets(&counted, &other_svc) > 0, "other not counted:\n{counted}");

    // Partial: one endpoint of the other Service changes. Only its chains
    // are rewritten (counters back to 0); the seed's keep their counts.
    let other2 = other_port(&[2, 3]);
    partial(&ns, &mut mode, &[&other2], &[], "an endpoint change");
    let counted = save(&ns, true).expect("iptables-save -c");
    assert!(
        chain_packets(&counted, &names.svc) > 0,
        "the seed's chain was rewritten by a change of another Service:\n{counted}"
    );
    assert_eq!(chain_packets(&counted, &other_svc), 0, "{counted}");
    let input = mode.last_input().to_owned();
    assert!(!input.contains(&format!(":{} ", names.svc)), "{input}");
    let gone = chains::sep_chain(&other.name, other.protocol, "10.244.1.1:8080");
    let added = chains::sep_chain(&other.name, other.protocol, "10.244.1.3:8080");
    let chains_now = nat_chains(&counted);
    assert!(!chains_now.contains(&gone), "{gone} still there: {chains_now:?}");
    assert!(chains_now.contains(&added), "{added} missing: {chains_now:?}");

    // Partial: the other Service goes.
    partial(&ns, &mut mode, &[], &[&other2], "removing a Service");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains(&OTHER_CLUSTER_IP.to_string()), "{saved}");
    let only_seed: BTreeSet<String> = nat_chains(&saved);
    assert_eq!(only_seed.len(), 5, "SVC, EXT and 3 SEP: {only_seed:?}");
    assert!(only_seed.iter().all(|c| !c.contains(&other_svc[9..])));

    // Full: a stale chain (e.g. of an earlier run) is deleted.
    ns.run_in(|| {
        SystemIptables::default().restore(
            "*nat\n:KUBE-SVC-STALE0000000000 - [0:0]\n:KUBE-SEP-STALE0000000000 - [0:0]\n\
             -A KUBE-SVC-STALE0000000000 -j KUBE-SEP-STALE0000000000\nCOMMIT\n",
        )
    })
    .expect("thread")
    .expect("a stale chain");
    full(&ns, &mut mode, [&seed], "full sync");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains("STALE"), "{saved}");
    assert_eq!(nat_chains(&saved), only_seed);
    // Nothing changed since: the next full sync writes nothing.
    let writes = mode.kernel_writes();
    full(&ns, &mut mode, [&seed], "idle full sync");
    assert_eq!(
        mode.kernel_writes(),
        writes,
        "a full sync with nothing to do wrote rules"
    );

    // Cleanup: no KUBE- chain or jump, the foreign chain intact; twice.
    let removed = ns.run_in(iptables::cleanup).expect("thread").expect("cleanup");
    assert!(removed >= 9, "removed {removed} chains");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains("KUBE-"), "left behind:\n{saved}");
    assert!(
        saved.contains("-A MY-CHAIN -j RETURN") && saved.contains("-A OUTPUT -j MY-CHAIN"),
        "{saved}"
    );
    let again = ns.run_in(iptables::cleanup).expect("thread").expect("second cleanup");
    assert_eq!(again, 0);
}

/// An IPv6 address of the test's own ULA prefix (`fd00:10:<net>::<host>`).
fn ula(net: u16, host: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, net, 0, 0, 0, 0, host)
}

/// The IPv6 half of the dual-stack seed Service, with the Service API's
/// external addresses, source ranges and ClientIP affinity on top.
fn seed_port_v6() -> ServicePort {
    ServicePort {
        name: format!("{SEED_NAME}{IPV6_SUFFIX}"),
        cluster_ip: ula(0x96, 0x88).into(),
        external_ips: vec![ula(0x77, 7).into()],
        load_balancer_ips: vec![ula(0x78, 5).into()],
        source_ranges: vec![SourceRange {
            addr: ula(0x79, 0).into(),
            prefix_len: 64,
        }],
        affinity: Some(Duration::from_secs(600)),
        endpoints: (0xb..=0xd).map(|e| Endpoint::ready(ula(0x244, e), 80)).collect(),
        ..seed_port()
    }
}

/// An IPv6 port without endpoints.
fn empty_port_v6() -> ServicePort {
    ServicePort {
        name: format!("default/empty-service{IPV6_SUFFIX}"),
        cluster_ip: ula(0x96, 0x89).into(),
        endpoints: Vec::new(),
        ..empty_port()
    }
}

/// [`bare_namespace`] with an IPv6 address and default route on the same
/// veth (no duplicate address detection: usable at once).
fn dual_stack_namespace() -> Result<Netns> {
    let ns = bare_namespace()?;
    ns.ip(&["-6", "addr", "add", "fd00:10:1::1/64", "dev", "v0", "nodad"])?;
    ns.ip(&["-6", "route", "add", "default", "dev", "v0"])?;
    Ok(ns)
}

/// Whether a TCP connect from `ns` to `addr` is refused (an ICMPv6 port
/// unreachable or a RST from the rules, not a timeout).
fn refused(ns: &Netns, addr: SocketAddr) -> bool {
    let result = ns
        .run_in(|| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)))
        .expect("thread");
    matches!(result, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// `ip6tables-save` (or `ip6tables-legacy-save`) in `ns`, with counters.
fn save6(ns: &Netns, legacy: bool) -> Result<String> {
    let program = if legacy {
        "ip6tables-legacy-save"
    } else {
        "ip6tables-save"
    };
    ns.run_in(|| netns::run(Command::new(program).arg("-c")))?
}

/// The dual-stack iptables mode on one backend: the IPv4 half writes
/// exactly the IPv4-only rules (the seed golden file), the IPv6 half
/// kube-proxy's chains with IPv6 addresses, read back from the kernel;
/// a connect to the IPv6 ClusterIP walks them; cleanup removes both.
fn dual_stack_on_backend(legacy: bool) {
    let ns = dual_stack_namespace().expect("creating the namespace");
    let system = |family| {
        if legacy {
            SystemIptables::legacy(family)
        } else {
            SystemIptables::for_family(family)
        }
    };
    let v6_opts = RuleOptions {
        family: IpFamily::V6,
        local_traffic: Some(LocalTraffic::Cidr("fd00:10:244::/56".parse().expect("cidr"))),
        node_ports: iptables::NodePortDestinations::AllLocal { localhost: false },
        node_ips: vec![ula(0x79, 2).into()],
        ..RuleOptions::default()
    };
    let mut mode = DualStack::new(vec![
        Box::new(IptablesMode::new(rule_options(), Box::new(system(IpFamily::V4)))),
        Box::new(IptablesMode::new(v6_opts, Box::new(system(IpFamily::V6)))),
    ]);
    let (seed, seed6, empty6) = (seed_port(), seed_port_v6(), empty_port_v6());
    full(&ns, &mut mode, [&seed, &seed6, &empty6], "dual-stack full sync");

    if !legacy {
        assert_golden(
            "iptables/seed.iptables-save",
            &normalized(&save(&ns, false).expect("iptables-save")),
        );
    }
    // A connect to the IPv6 ClusterIP (nobody answers) is counted in its chain.
    let cluster6 = SocketAddr::new(seed6.cluster_ip, SEED_PORT);
    let _ = ns
        .run_in(|| std::net::TcpStream::connect_timeout(&cluster6, Duration::from_millis(100)))
        .expect("thread");
    let saved = save6(&ns, legacy).expect("ip6tables-save");
    let names = PortChains::of(&seed6);
    let sep_b = chains::sep_chain(&seed6.name, seed6.protocol, "[fd00:10:244::b]:80");
    for needle in [
        format!(
            "-A KUBE-SERVICES -d fd00:10:96::88/128 -p tcp -m comment --comment \"{SEED_NAME} (IPv6) cluster IP\" -m tcp --dport {SEED_PORT} -j {}",
            names.svc
        ),
        format!("-A KUBE-SERVICES -d fd00:10:77::7/128 -p tcp -m comment --comment \"{SEED_NAME} (IPv6) external IP\" -m tcp --dport {SEED_PORT} -j {}", names.ext),
        format!("-A KUBE-SERVICES -d fd00:10:78::5/128 -p tcp -m comment --comment \"{SEED_NAME} (IPv6) loadbalancer IP\" -m tcp --dport {SEED_PORT} -j {}", names.fw),
        format!("-A {} -s fd00:10:79::/64 -m comment --comment \"{SEED_NAME} (IPv6) loadbalancer IP\" -j {}", names.fw, names.ext),
        format!("-A {} -s fd00:10:78::5/128 -m comment --comment \"{SEED_NAME} (IPv6) loadbalancer IP\" -j {}", names.fw, names.ext),
        format!("-A KUBE-NODEPORTS -p tcp -m comment --comment \"{SEED_NAME} (IPv6)\" -m tcp --dport {SEED_NODE_PORT} -j {}", names.ext),
        format!("-A {sep_b} -p tcp -m comment --comment \"{SEED_NAME} (IPv6)\" -m recent --set --name {sep_b} --mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource -m tcp -j DNAT --to-destination [fd00:10:244::b]:80"),
        format!("-A {} ! -s fd00:10:244::/56 -d fd00:10:96::88/128 -p tcp", names.svc),
        "-A KUBE-SERVICES ! -d ::1/128 -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS".to_owned(),
        format!("-d fd00:10:96::89/128 -p tcp -m comment --comment \"default/empty-service (IPv6) has no endpoints\" -m tcp --dport {EMPTY_PORT} -j REJECT --reject-with icmp6-port-unreachable"),
        "-j MASQUERADE --random-fully".to_owned(),
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000".to_owned(),
    ] {
        assert!(saved.contains(&needle), "ip6tables-save lacks {needle:?}:\n{saved}");
    }
    assert!(
        !saved.contains("KUBE-FIREWALL") && !saved.contains("127.0.0.0/8"),
        "{saved}"
    );
    assert!(
        chain_packets(&saved, &names.svc) > 0,
        "the IPv6 connect was not counted:\n{saved}"
    );
    let empty = SocketAddr::new(empty6.cluster_ip, EMPTY_PORT);
    assert!(refused(&ns, empty), "{empty} without endpoints is not rejected");
    let saved4 = save(&ns, false).expect("iptables-save");
    assert!(!saved4.contains("fd00:"), "IPv6 addresses in the IPv4 rules:\n{saved4}");
    assert!(mode.counters().iptables_rules.iter().all(|(_, n)| *n > 0));

    // Cleanup (nft backend: the agent's own) removes both families' chains.
    if !legacy {
        let removed = ns.run_in(iptables::cleanup).expect("thread").expect("cleanup");
        assert!(removed >= 18, "removed {removed} chains");
        let saved = save6(&ns, false).expect("ip6tables-save");
        assert!(!saved.contains("KUBE-"), "left behind:\n{saved}");
    }
}

#[test]
fn ip6tables_dual_stack_in_a_namespace() {
    if !require_root("ip6tables_dual_stack_in_a_namespace") {
        return;
    }
    dual_stack_on_backend(false);
}

#[test]
fn ip6tables_legacy_dual_stack_in_a_namespace() {
    if !require_root("ip6tables_legacy_dual_stack_in_a_namespace") {
        return;
    }
    dual_stack_on_backend(true);
}

/// The kernel's `recent` lists in the calling thread's namespace (one per
/// endpoint chain while a rule names it).
fn recent_lists() -> BTreeSet<String> {
    std::fs::read_dir("/proc/thread-self/net/xt_recent")
        .map(|dir| dir.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default()
}

/// ClientIP affinity read back: `--rcheck` / `--set` rules and the
/// kernel's lists per endpoint; a removed endpoint's list goes with its
/// rules (its clients are released); off, no list is left; on again, the
/// lists come back.
#[test]
fn iptables_affinity_in_a_namespace() {
    if !require_root("iptables_affinity_in_a_namespace") {
        return;
    }
    let ns = bare_namespace().expect("creating the namespace");
    let mut mode = IptablesMode::new(rule_options(), Box::new(SystemIptables::default()));
    let mut port = other_port(&[1, 2]);
    port.affinity = Some(Duration::from_secs(600));
    let sep = |last: u8| chains::sep_chain(&port.name, port.protocol, &format!("10.244.1.{last}:8080"));
    let (one, two) = (sep(1), sep(2));
    full(&ns, &mut mode, [&port], "full sync with affinity");
    let saved = save(&ns, false).expect("iptables-save");
    for chain in [&one, &two] {
        assert!(
            saved.contains(&format!(
                "-m recent --rcheck --seconds 600 --reap --name {chain} --mask 255.255.255.255 --rsource -j {chain}"
            )),
            "{saved}"
        );
        assert!(saved.contains(&format!("-m recent --set --name {chain} ")), "{saved}");
    }
    let lists = ns.run_in(recent_lists).expect("thread");
    assert_eq!(lists, [one.clone(), two.clone()].into(), "the kernel's recent lists");

    // Endpoint 1 goes: its rules and list with it.
    let mut fewer = port.clone();
    fewer.endpoints.remove(0);
    partial(&ns, &mut mode, &[&fewer], &[], "removing an endpoint");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains(&one), "{saved}");
    assert_eq!(ns.run_in(recent_lists).expect("thread"), [two.clone()].into());

    // Off: no recent match, no list.
    let mut off = fewer.clone();
    off.affinity = None;
    partial(&ns, &mut mode, &[&off], &[], "affinity off");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(!saved.contains("-m recent"), "{saved}");
    assert!(ns.run_in(recent_lists).expect("thread").is_empty());

    // On again, with another timeout.
    let mut on = fewer;
    on.affinity = Some(Duration::from_secs(30));
    partial(&ns, &mut mode, &[&on], &[], "affinity on again");
    let saved = save(&ns, false).expect("iptables-save");
    assert!(
        saved.contains(&format!("--rcheck --seconds 30 --reap --name {two} ")),
        "{saved}"
    );
    assert_eq!(ns.run_in(recent_lists).expect("thread"), [two].into());
}

// ---------------------------------------------------------------------------
// nftables

/// kube-proxy's defaults with the test bed's pod CIDR.
fn nft_options() -> Options {
    Options {
        local_traffic: local_traffic(),
        ..Options::default()
    }
}

fn list_table(ns: &Netns, handles: bool) -> Result<String> {
    let mut args = vec!["nft"];
    if handles {
        args.push("-a");
    }
    args.extend(["list", "table", "ip", "xproxy"]);
    ns.exec(&args)
}

/// The rules of every chain, with their handles (`nft -a list` output).
fn rules_by_chain(listing: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in listing.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("chain ") {
            let name = rest.split_whitespace().next().unwrap_or_default().to_owned();
            out.entry(name.clone()).or_default();
            current = Some(name);
        } else if line.starts_with('}') || line.starts_with("map ") || line.starts_with("set ") {
            current = None;
        } else if let Some(chain) = &current
            && line.contains("# handle ")
            && !line.starts_with("type ")
        {
            out.entry(chain.clone()).or_default().push(line.to_owned());
        }
    }
    out
}

/// The chains of `port` in `by_chain`.
fn port_chains<'a>(by_chain: &'a BTreeMap<String, Vec<String>>, port: &ServicePort) -> BTreeMap<&'a str, &'a [String]> {
    let path = names::service_chain(port);
    let marker = &path["service-".len()..];
    let hash_free = marker.split_once('-').map_or(marker, |(_, rest)| rest).to_owned();
    by_chain
        .iter()
        .filter(|(name, _)| name.contains(&format!("-{hash_free}")))
        .map(|(name, rules)| (name.as_str(), rules.as_slice()))
        .collect()
}

#[test]
fn nftables_mode_in_a_namespace() {
    if !require_root("nftables_mode_in_a_namespace") {
        return;
    }
    let ns = Netns::new("xf").expect("creating the namespace");
    let mut mode = NftablesMode::new(nft_options(), Box::new(SystemNft::default()));
    let seed = seed_port();
    let other = other_port(&[1, 2]);

    // A foreign table (kube-proxy's name), which nothing of ours may touch.
    let foreign = "table ip kube-proxy {\n\tchain c {\n\t\ttype filter hook output priority 0; policy accept;\n\t\tcounter\n\t}\n}\n";
    ns.run_in(|| nft_stdin(foreign))
        .expect("thread")
        .expect("a foreign table");

    // Full sync: the kernel's rendering of the seed and a Service without endpoints.
    full(&ns, &mut mode, [&seed, &empty_port()], "full sync of the seed");
    let listing = list_table(&ns, false).expect("nft list");
    assert_golden("nftables/seed.nft-list", &listing);
    for needle in [
        "map service-ips {",
        "elements = { 10.96.0.88 . tcp . 88 : goto service-",
        "elements = { tcp . 30791 : goto external-",
        "10.96.0.89 . tcp . 89 comment \"default/empty-service\" : goto reject-chain",
        "numgen random mod 3 vmap { 0 : goto endpoint-",
        "meta l4proto tcp dnat to 10.244.0.13:80",
        "type nat hook prerouting priority dstnat; policy accept;",
    ] {
        assert!(listing.contains(needle), "nft list lacks {needle:?}:\n{listing}");
    }
    let seed_before = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    let seed_chains: BTreeMap<String, Vec<String>> = port_chains(&seed_before, &seed)
        .into_iter()
        .map(|(n, r)| (n.to_owned(), r.to_vec()))
        .collect();
    assert_eq!(
        seed_chains.len(),
        5,
        "service, external and 3 endpoint chains: {seed_chains:#?}"
    );

    // Partial: another Service appears; the seed's rules keep their handles.
    partial(&ns, &mut mode, &[&other], &[], "adding a Service");
    let after_add = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    assert_eq!(port_chains(&after_add, &other).len(), 3, "{after_add:#?}");
    let other_before: BTreeMap<String, Vec<String>> = port_chains(&after_add, &other)
        .into_iter()
        .map(|(n, r)| (n.to_owned(), r.to_vec()))
        .collect();

    // Partial: one endpoint of the other Service changes. Its service chain
    // is rewritten and one endpoint chain replaced; the seed is untouched.
    let other2 = other_port(&[2, 3]);
    partial(&ns, &mut mode, &[&other2], &[], "an endpoint change");
    let script = mode.last_script().to_owned();
    assert!(!script.contains("nginx-service"), "the seed was touched:\n{script}");
    let after_change = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    for (chain, rules) in &seed_chains {
        assert_eq!(
            after_change.get(chain),
            Some(rules),
            "{chain} changed with another Service's endpoints"
        );
    }
    let svc = names::service_chain(&other2);
    assert_ne!(
        after_change.get(&svc),
        other_before.get(&svc),
        "{svc} was not rewritten"
    );
    let kept = names::endpoint_chain(&other2, &other2.endpoints[0]);
    assert_eq!(after_change.get(&kept), other_before.get(&kept), "{kept} was rewritten");
    let gone = names::endpoint_chain(&other, &other.endpoints[0]);
    let added = names::endpoint_chain(&other2, &other2.endpoints[1]);
    assert!(!after_change.contains_key(&gone), "{gone} still there");
    assert!(after_change.contains_key(&added), "{added} missing");

    // Partial: the other Service goes, elements and chains.
    partial(&ns, &mut mode, &[], &[&other2], "removing a Service");
    let listing = list_table(&ns, false).expect("nft list");
    assert!(
        !listing.contains(&OTHER_CLUSTER_IP.to_string()) && !listing.contains("default/other"),
        "{listing}"
    );
    let after_remove = rules_by_chain(&list_table(&ns, true).expect("nft -a list"));
    for (chain, rules) in &seed_chains {
        assert_eq!(
            after_remove.get(chain),
            Some(rules),
            "{chain} changed with another Service's removal"
        );
    }

    // Partial: the seed loses its endpoints and is rejected; then gets them back.
    let mut lost = seed.clone();
    lost.endpoints.clear();
    partial(&ns, &mut mode, &[&lost], &[], "endpoints gone");
    let listing = list_table(&ns, false).expect("nft list");
    assert!(
        listing.contains("10.96.0.88 . tcp . 88 comment \"default/nginx-service\" : goto reject-chain"),
        "{listing}"
    );
    assert!(!listing.contains("chain service-"), "{listing}");
    partial(&ns, &mut mode, &[&seed], &[], "endpoints back");

    // Full: a tampered table (a stale chain, a stray element) is replaced
    // with the seed's again, in the same listing as before.
    ns.run_in(|| {
        nft_stdin(
            "add chain ip xproxy service-AAAAAAAA-stale/gone/tcp/\n\
             add element ip xproxy service-nodeports { tcp . 31000 : goto service-AAAAAAAA-stale/gone/tcp/ }\n",
        )
    })
    .expect("thread")
    .expect("tampering");
    full(&ns, &mut mode, [&seed, &empty_port()], "full sync");
    let listing = list_table(&ns, false).expect("nft list");
    assert!(!listing.contains("stale") && !listing.contains("31000"), "{listing}");
    assert_golden("nftables/seed.nft-list", &listing);
    // Nothing changed since: the next full sync writes nothing.
    let writes = mode.kernel_writes();
    full(&ns, &mut mode, [&seed, &empty_port()], "idle full sync");
    assert_eq!(
        mode.kernel_writes(),
        writes,
        "a full sync with nothing to do wrote rules"
    );

    // Cleanup: the table goes, the foreign one stays; twice.
    let removed = ns.run_in(nftables::cleanup).expect("thread").expect("cleanup");
    assert!(removed);
    let tables = ns.exec(&["nft", "list", "tables"]).expect("nft list tables");
    assert!(!tables.contains("xproxy"), "{tables}");
    assert!(tables.contains("table ip kube-proxy"), "{tables}");
    let again = ns.run_in(nftables::cleanup).expect("thread").expect("second cleanup");
    assert!(!again);
}

/// `nft -f -` in the calling thread's namespace.
fn nft_stdin(script: &str) -> Result<()> {
    use proxy_userspace::mode::nftables::Nft;
    SystemNft::default().run(script)
}

/// The nftables mode over both families: the `ip` table exactly as the
/// IPv4-only mode leaves it (golden file), the `ip6` table with IPv6 keys
/// and matches read back from the kernel; a Service without endpoints is
/// refused over IPv6 by the rules; cleanup removes both tables.
#[test]
fn nftables_dual_stack_in_a_namespace() {
    if !require_root("nftables_dual_stack_in_a_namespace") {
        return;
    }
    let ns = dual_stack_namespace().expect("creating the namespace");
    let v6_opts = Options {
        family: IpFamily::V6,
        local_traffic: Some(LocalTraffic::Cidr("fd00:10:244::/56".parse().expect("cidr"))),
        node_ips: vec![ula(0x79, 2).into()],
        ..Options::default()
    };
    let mut mode = DualStack::new(vec![
        Box::new(NftablesMode::new(nft_options(), Box::new(SystemNft::default()))),
        Box::new(NftablesMode::new(v6_opts, Box::new(SystemNft::default()))),
    ]);
    let (seed6, empty6) = (seed_port_v6(), empty_port_v6());
    full(
        &ns,
        &mut mode,
        [&seed_port(), &empty_port(), &seed6, &empty6],
        "dual-stack full sync",
    );
    assert_golden("nftables/seed.nft-list", &list_table(&ns, false).expect("nft list"));
    let listing = ns
        .exec(&["nft", "list", "table", "ip6", "xproxy"])
        .expect("nft list ip6");
    let service = names::service_chain(&seed6);
    for needle in [
        "map service-ips {\n\t\ttype ipv6_addr . inet_proto . inet_service : verdict".to_owned(),
        format!("fd00:10:96::88 . tcp . {SEED_PORT} : goto {service}"),
        format!("fd00:10:96::89 . tcp . {EMPTY_PORT} comment \"default/empty-service (IPv6)\" : goto reject-chain"),
        "ip6 daddr . meta l4proto . th dport vmap @service-ips".to_owned(),
        "fib daddr type local ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports".to_owned(),
        "meta l4proto tcp dnat to [fd00:10:244::b]:80".to_owned(),
        "ip6 saddr != { fd00:10:78::5, fd00:10:79::/64 } drop".to_owned(),
        "type ipv6_addr\n\t\tsize 65535\n\t\tflags dynamic,timeout\n\t\ttimeout 10m".to_owned(),
    ] {
        assert!(
            listing.contains(&needle),
            "nft list table ip6 xproxy lacks {needle:?}:\n{listing}"
        );
    }
    // nft lists `reject with icmpv6 port-unreachable` as `reject`, its
    // default in an ip6 table; the refused connect shows what it sends.
    assert!(listing.lines().any(|l| l.trim() == "reject"), "{listing}");
    let empty = SocketAddr::new(empty6.cluster_ip, EMPTY_PORT);
    assert!(refused(&ns, empty), "{empty} without endpoints is not rejected");

    assert!(ns.run_in(nftables::cleanup).expect("thread").expect("cleanup"));
    let tables = ns.exec(&["nft", "list", "tables"]).expect("nft list tables");
    assert!(!tables.contains("xproxy"), "{tables}");
}
