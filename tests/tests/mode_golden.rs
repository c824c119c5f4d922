//! Golden files: every mode's applied state, rendered by the kernel's own
//! tools, from the same Service/EndpointSlice YAML (the seed manifest and
//! `proxy-userspace/tests/golden/cluster/more.yaml`) read through the same
//! manifest source and model as the agent uses. Each mode is driven by hand
//! (a full sync) in a bare network namespace of its own:
//!
//! | mode     | golden file               | read back with
//! |----------|---------------------------|------------------------------
//! | ebpf     | `ebpf/cluster.maps`       | the pinned maps (`xproxy status`)
//! | iptables | `iptables/cluster.iptables-save` | `iptables-save`
//! | iptables | `iptables/service-api.iptables-save` (input `iptables/service-api.yaml`) | `iptables-save`
//! | nftables | `nftables/cluster.nft-list` | `nft list table ip xproxy`
//! | ipvs     | `ipvs/cluster.ipvsadm`    | `ipvsadm -Ln` and `ipset list` (sorted)
//!
//! The IPVS test runs where the kernel has IPVS (`cargo xtask vm`). The
//! goldens are compiled in, so the test runs in the VM without the source
//! tree; `XPROXY_UPDATE_GOLDEN=1` rewrites them in the source tree instead.

use std::{collections::BTreeMap, net::Ipv4Addr};

use anyhow::{Context, Result, ensure};
use proxy_userspace::{
    dump,
    mode::{
        Dataplane,
        iptables::{self, IptablesMode, SystemIptables},
        ipvs::{IpvsMode, IpvsOptions, node_ips::NodePortAddresses, rules::RuleOptions as IpvsRuleOptions},
        nftables::{NftablesMode, SystemNft},
        options::LocalTraffic,
    },
    model::{Cluster, ServicePort},
    source::manifest::ManifestDir,
};
use testbed::{
    agent_bed::{TempDir, ipvs_virtual_servers, workspace_root},
    netns::Netns,
    privileged::{require_ipvs, require_root},
    testrun::Harness,
    topology::POD_CIDR,
};

/// The node the NodePorts are programmed on.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);

/// The input, compiled in (the VM has no source tree).
const SEED_YAML: &str = include_str!("../../examples/seed/manifests/nginx.yaml");
const MORE_YAML: &str = include_str!("../../proxy-userspace/tests/golden/cluster/more.yaml");

/// The iptables mode's Service API input (one LoadBalancer Service with
/// every field of issue 12).
const IPTABLES_API_YAML: &str = include_str!("../../proxy-userspace/tests/golden/iptables/service-api.yaml");

/// The Service ports the agent would program from the YAML.
fn desired() -> Result<BTreeMap<String, ServicePort>> {
    desired_from(&[("nginx.yaml", SEED_YAML), ("more.yaml", MORE_YAML)])
}

/// The Service ports the agent would program from these YAML files.
fn desired_from(files: &[(&str, &str)]) -> Result<BTreeMap<String, ServicePort>> {
    let dir = TempDir::new("golden-input")?;
    for (name, yaml) in files {
        std::fs::write(dir.path().join(name), yaml)?;
    }
    let (services, slices, problems) = ManifestDir::new(dir.path())?
        .reload_if_changed()?
        .context("a first reading")?;
    ensure!(problems.is_empty(), "the golden input has problems: {problems:?}");
    let mut cluster = Cluster::default();
    let mut problems = cluster.replace_services(&services);
    problems.extend(cluster.replace_slices(&slices));
    let desired = cluster.desired();
    problems.extend(desired.problems);
    ensure!(problems.is_empty(), "the golden input has problems: {problems:?}");
    Ok(desired.ports)
}

/// Compares `actual` with the compiled-in golden `expected`, or with
/// `XPROXY_UPDATE_GOLDEN=1` writes it to `proxy-userspace/tests/golden/<name>`.
fn assert_golden(name: &str, expected: &str, actual: &str) {
    if std::env::var("XPROXY_UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        let path = workspace_root().join("proxy-userspace/tests/golden").join(name);
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    assert!(
        expected == actual,
        "golden {name} differs (XPROXY_UPDATE_GOLDEN=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}"
    );
}

fn local_traffic() -> Option<LocalTraffic> {
    Some(LocalTraffic::Cidr(POD_CIDR.parse().expect("the pod CIDR parses")))
}

/// A full sync of `mode` to the golden input, inside `ns`.
fn apply(ns: &Netns, mode: &mut dyn Dataplane) {
    let desired = desired().unwrap_or_else(|e| panic!("reading the golden input: {e:#}"));
    ns.run_in(|| mode.apply_full(&desired))
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("{}: full sync: {e:#}", mode.name()));
}

#[test]
fn ebpf_maps() {
    if !require_root("ebpf_maps") {
        return;
    }
    let mut harness = Harness::new(vec![NODE_IP]);
    for port in desired().expect("the golden input").values() {
        harness.sync(port);
    }
    let snapshot = harness.maps.snapshot().expect("reading the maps back");
    assert_golden(
        "ebpf/cluster.maps",
        include_str!("../../proxy-userspace/tests/golden/ebpf/cluster.maps"),
        &dump::render_services(&snapshot),
    );
}

/// `iptables-save` without comments and counters.
fn iptables_save(ns: &Netns) -> String {
    let saved = ns.exec(&["iptables-save"]).expect("iptables-save");
    saved
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.strip_prefix(':') {
            Some(decl) => format!(":{}\n", decl.split(" [").next().unwrap_or(decl)),
            None => format!("{l}\n"),
        })
        .collect()
}

/// An iptables mode with kube-proxy's defaults and the bed's pod CIDR,
/// `with` changing the options.
fn iptables_mode(with: impl FnOnce(&mut iptables::RuleOptions)) -> IptablesMode {
    let mut options = iptables::RuleOptions {
        local_traffic: local_traffic(),
        ..iptables::RuleOptions::default()
    };
    with(&mut options);
    IptablesMode::new(options, Box::new(SystemIptables::default()))
}

#[test]
fn iptables_rules() {
    if !require_root("iptables_rules") {
        return;
    }
    let ns = Netns::new("xg").expect("a namespace");
    let mut mode = iptables_mode(|_| {});
    apply(&ns, &mut mode);
    assert_golden(
        "iptables/cluster.iptables-save",
        include_str!("../../proxy-userspace/tests/golden/iptables/cluster.iptables-save"),
        &iptables_save(&ns),
    );
}

/// A LoadBalancer Service with external and LB IPs, source ranges,
/// affinity and eTP Local, on the node its first endpoint runs on.
#[test]
fn iptables_service_api() {
    if !require_root("iptables_service_api") {
        return;
    }
    let ns = Netns::new("xg").expect("a namespace");
    let mut mode = iptables_mode(|o| {
        o.node_name = Some("demo-node".into());
        o.node_ips = vec![NODE_IP.into()];
    });
    let desired = desired_from(&[("service-api.yaml", IPTABLES_API_YAML)]).expect("the Service API input");
    assert_eq!(desired.len(), 1, "{desired:?}");
    ns.run_in(|| mode.apply_full(&desired))
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("full sync: {e:#}"));
    assert_golden(
        "iptables/service-api.iptables-save",
        include_str!("../../proxy-userspace/tests/golden/iptables/service-api.iptables-save"),
        &iptables_save(&ns),
    );
}

#[test]
fn nftables_ruleset() {
    if !require_root("nftables_ruleset") {
        return;
    }
    let ns = Netns::new("xg").expect("a namespace");
    let options = proxy_userspace::mode::nftables::Options {
        local_traffic: local_traffic(),
        ..Default::default()
    };
    let mut mode = NftablesMode::new(options, Box::new(SystemNft::default()));
    apply(&ns, &mut mode);
    let listing = ns.exec(&["nft", "list", "table", "ip", "xproxy"]).expect("nft list");
    assert_golden(
        "nftables/cluster.nft-list",
        include_str!("../../proxy-userspace/tests/golden/nftables/cluster.nft-list"),
        &listing,
    );
}

/// `ipvsadm -Ln` (virtual servers sorted: the kernel lists them in hash
/// order) and the members of every ipset, sorted.
fn ipvs_state(ns: &Netns) -> Result<String> {
    let mut out = String::from("# ipvsadm -Ln, sorted\n");
    for (server, reals) in ipvs_virtual_servers(&ns.exec(&["ipvsadm", "-Ln"])?) {
        out.push_str(&format!("{server}\n"));
        for real in reals {
            out.push_str(&format!("  -> {real}\n"));
        }
    }
    out.push_str("# ipset list, members sorted\n");
    let sets = ns.exec(&["ipset", "list", "-n"])?;
    let mut names: Vec<&str> = sets.lines().collect();
    names.sort();
    for name in names {
        let listing = ns.exec(&["ipset", "list", name])?;
        let mut members: Vec<&str> = listing
            .lines()
            .skip_while(|l| !l.starts_with("Members:"))
            .skip(1)
            .filter(|l| !l.is_empty())
            .collect();
        members.sort();
        out.push_str(&format!("{name}:"));
        for member in members {
            out.push_str(&format!(" {member}"));
        }
        out.push('\n');
    }
    Ok(out)
}

#[test]
fn ipvs_virtual_servers_and_ipsets() {
    if !require_ipvs("ipvs_virtual_servers_and_ipsets") {
        return;
    }
    let ns = Netns::new("xg").expect("a namespace");
    let options = IpvsOptions {
        scheduler: "rr".into(),
        node_ports: NodePortAddresses::Fixed(vec![NODE_IP.into()]),
        exclude_cidrs: Vec::new(),
        rules: IpvsRuleOptions {
            masquerade_bit: 14,
            masquerade_all: false,
            local_traffic: local_traffic(),
            local_traffic_v6: None,
        },
        timeouts: (900, 120, 300),
        strict_arp: true,
        node_name: None,
    };
    let mut mode = ns
        .run_in(|| IpvsMode::start(options))
        .expect("entering the namespace")
        .expect("starting the IPVS mode");
    apply(&ns, &mut mode);
    let state = ipvs_state(&ns).expect("reading IPVS back");
    // The VM has no source tree to write to: the update happens on a host
    // with IPVS, or by hand from the printed state.
    eprintln!("IPVS state:\n{state}");
    assert_golden(
        "ipvs/cluster.ipvsadm",
        include_str!("../../proxy-userspace/tests/golden/ipvs/cluster.ipvsadm"),
        &state,
    );
    let _ = ns.run_in(proxy_userspace::mode::ipvs::cleanup);
}

/// The goldens hold what the input says: a cheap check that runs
/// everywhere, also without root.
#[test]
fn goldens_cover_every_service_port() {
    let goldens = [
        include_str!("../../proxy-userspace/tests/golden/ebpf/cluster.maps"),
        include_str!("../../proxy-userspace/tests/golden/iptables/cluster.iptables-save"),
        include_str!("../../proxy-userspace/tests/golden/nftables/cluster.nft-list"),
        include_str!("../../proxy-userspace/tests/golden/ipvs/cluster.ipvsadm"),
    ];
    let desired = desired().expect("the golden input");
    assert_eq!(desired.len(), 4, "{:?}", desired.keys().collect::<Vec<_>>());
    for golden in goldens {
        for port in desired.values() {
            assert!(
                golden.contains(&port.cluster_ip.to_string()),
                "{} missing from a golden:\n{golden}",
                port.name
            );
        }
    }
}
