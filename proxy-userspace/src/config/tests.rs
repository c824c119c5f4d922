//! Loading, validation and precedence of the configuration.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;

use super::*;

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/config")
        .join(name)
}

fn env() -> Environment {
    Environment {
        kubeconfig: None,
        hostname: Some("Machine-Host".to_owned()),
    }
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn cidrs(list: &[&str]) -> Vec<Cidr> {
    list.iter().map(|c| c.parse().unwrap()).collect()
}

/// Parses `HEADER + body` and resolves it with `flags`.
fn load_text(flags: &RunFlags, body: &str) -> Result<Loaded, ConfigError> {
    let file = ConfigFile::parse(&format!("{HEADER}{body}"))?;
    resolve(flags, Some(&file), &env())
}

fn load_body(body: &str) -> Loaded {
    load_text(&RunFlags::default(), body).unwrap_or_else(|e| panic!("{body}\n=> {e}"))
}

fn error_of(body: &str) -> String {
    match load_text(&RunFlags::default(), body) {
        Ok(loaded) => panic!("expected an error for\n{body}\ngot {:?}", loaded.config),
        Err(e) => e.to_string(),
    }
}

fn flags_with(f: impl FnOnce(&mut RunFlags)) -> RunFlags {
    let mut flags = RunFlags::default();
    f(&mut flags);
    flags
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    run: RunFlags,
}

#[test]
fn seed_file_loads_as_is() {
    let path = fixture("seed-proxy.yaml");
    let flags = flags_with(|f| f.config = Some(path.clone()));
    let loaded = load_with(&flags, &env()).unwrap();
    // The seed's rate limits and profiling switch are read and not acted
    // on: each is said once.
    let fields: Vec<&str> = loaded.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(fields, ["clientConnection.qps/burst", "enableProfiling"]);
    let c = loaded.config;
    assert_eq!(c.config_file, Some(path));
    assert_eq!(c.mode, Mode::Iptables);
    assert_eq!(c.masquerade, Masquerade { all: false, bit: 14 });
    assert_eq!(c.ipvs.scheduler, IpvsScheduler::Rr);
    assert!(c.ipvs.exclude_cidrs.is_empty());
    assert_eq!(c.healthz_bind_address, addr("127.0.0.1:10256"));
    assert_eq!(c.metrics_bind_address, addr("127.0.0.1:10249"));
    assert_eq!(c.bind_address, "127.0.0.1".parse::<std::net::IpAddr>().unwrap());
    assert_eq!(c.cluster_cidrs, cidrs(&["169.169.0.0/16"]));
    // `hostnameOverride: ##NODE_NAME##` is a comment: the machine's name is used.
    assert_eq!(c.node_name, "machine-host");
    assert_eq!(
        c.source,
        Source::Kubeconfig(PathBuf::from("/home/lizhe/minik8s/kubeconfig.yaml"))
    );
    assert_eq!(c.client_connection.qps, 100.0);
    assert_eq!(c.client_connection.burst, 200);
    assert!(c.enable_profiling);
    assert_eq!(c.port_range, None);
    assert_eq!(
        c.sync,
        SyncPeriods {
            min_sync_period: Duration::from_secs(1),
            sync_period: Duration::from_secs(30)
        }
    );
    assert_eq!(c.pin_path, PathBuf::from(DEFAULT_PIN_PATH));
}

#[test]
fn seed_file_keeps_its_spelling_and_empty_hostname() {
    let file = ConfigFile::read(&fixture("seed-proxy.yaml")).unwrap();
    assert_eq!(file.spec.hostname_override, None);
    assert_eq!(file.spec.port_range.as_deref(), Some(""));
    assert_eq!(file.spec.section_keys.iptables, "kubeProxyIPTablesConfiguration");
    assert_eq!(file.spec.section_keys.ipvs, "kubeProxyIPVSConfiguration");
    assert_eq!(file.spec.section_keys.nftables, "nftables");
    assert_eq!(
        file.spec.client_connection.and_then(|c| c.kubeconfig).as_deref(),
        Some("/home/lizhe/minik8s/kubeconfig.yaml")
    );
}

#[test]
fn manifests_and_mode_flags_override_the_seed() {
    let flags = flags_with(|f| {
        f.config = Some(fixture("seed-proxy.yaml"));
        f.manifests = Some(PathBuf::from("/srv/manifests"));
        f.mode = Some(Mode::Ebpf);
    });
    let c = load_with(&flags, &env()).unwrap().config;
    assert_eq!(c.mode, Mode::Ebpf);
    assert_eq!(c.source, Source::Manifests(PathBuf::from("/srv/manifests")));
    // The rest still comes from the file.
    assert_eq!(c.healthz_bind_address, addr("127.0.0.1:10256"));
    assert_eq!(c.cluster_cidrs, cidrs(&["169.169.0.0/16"]));
    // ebpf mode takes its periods and masquerading from the iptables section.
    assert_eq!(c.sync.sync_period, Duration::from_secs(30));
    assert_eq!(c.masquerade, Masquerade { all: false, bit: 14 });
}

#[test]
fn seed_with_ipvs_mode_flag() {
    let flags = flags_with(|f| {
        f.config = Some(fixture("seed-proxy.yaml"));
        f.mode = Some(Mode::Ipvs);
    });
    let c = load_with(&flags, &env()).unwrap().config;
    assert_eq!(c.mode, Mode::Ipvs);
    assert_eq!(
        c.sync,
        SyncPeriods {
            min_sync_period: Duration::ZERO,
            sync_period: Duration::from_secs(30)
        }
    );
}

#[test]
fn upstream_style_file() {
    let flags = flags_with(|f| f.config = Some(fixture("upstream-ipvs.yaml")));
    let loaded = load_with(&flags, &env()).unwrap();
    assert_eq!(
        loaded.warnings[0],
        Warning::new("winkernel", "Windows-only settings, ignored")
    );
    let fields: Vec<&str> = loaded.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "winkernel",
            "clientConnection.qps/burst",
            "configSyncPeriod",
            "showHiddenMetricsForVersion",
            "logging.flushFrequency",
            "logging.options",
            "featureGates.SomeAlphaFeature"
        ]
    );
    let c = loaded.config;
    assert_eq!(c.mode, Mode::Ipvs);
    assert_eq!(c.node_name, "worker-1");
    assert_eq!(
        c.source,
        Source::Kubeconfig(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(
        c.client_connection,
        ClientConnection {
            qps: 5.0,
            burst: 10,
            content_type: "application/vnd.kubernetes.protobuf".to_owned(),
            accept_content_types: String::new(),
        }
    );
    assert_eq!(c.cluster_cidrs, cidrs(&["10.244.0.0/16", "fd00:10:244::/56"]));
    assert_eq!(c.healthz_bind_address, addr("0.0.0.0:10256"));
    assert_eq!(c.metrics_bind_address, addr("0.0.0.0:10249"));
    assert_eq!(c.detect_local, DetectLocal::NodeCidr);
    assert_eq!(
        c.node_port_addresses,
        NodePortAddresses::Cidrs(cidrs(&["10.0.0.0/8", "fd00::/8"]))
    );
    // ipvs mode: periods from `ipvs`, masquerading from `iptables`.
    assert_eq!(
        c.sync,
        SyncPeriods {
            min_sync_period: Duration::from_millis(500),
            sync_period: Duration::from_secs(60)
        }
    );
    assert_eq!(c.masquerade, Masquerade { all: true, bit: 15 });
    assert!(!c.localhost_node_ports);
    assert_eq!(
        c.ipvs,
        IpvsConfig {
            scheduler: IpvsScheduler::Wrr,
            exclude_cidrs: cidrs(&["192.168.100.0/24"]),
            strict_arp: true,
            tcp_timeout: Duration::from_secs(900),
            tcp_fin_timeout: Duration::from_secs(120),
            udp_timeout: Duration::from_secs(5),
        }
    );
    assert_eq!(
        c.conntrack,
        ConntrackConfig {
            max_per_core: 0,
            min: 131_072,
            tcp_established_timeout: Duration::from_secs(86_400),
            tcp_close_wait_timeout: Duration::from_secs(3_600),
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(30),
            udp_stream_timeout: Duration::from_secs(120),
        }
    );
    assert_eq!(c.config_sync_period, Duration::from_secs(900));
    assert_eq!(c.oom_score_adj, -999);
    assert_eq!(c.feature_gates.get("SomeAlphaFeature"), Some(&true));
    assert_eq!(c.show_hidden_metrics_for_version, None);
}

#[test]
fn the_section_that_matches_the_mode_gives_the_periods() {
    let body = "iptables: {syncPeriod: 10s, minSyncPeriod: 2s, masqueradeBit: 3, masqueradeAll: true}\n\
                ipvs: {syncPeriod: 20s, minSyncPeriod: 3s}\n\
                nftables: {syncPeriod: 40s, minSyncPeriod: 4s, masqueradeBit: 5}\n";
    let periods = |mode: Mode| {
        let c = load_text(&flags_with(|f| f.mode = Some(mode)), body).unwrap().config;
        (
            c.sync.sync_period.as_secs(),
            c.sync.min_sync_period.as_secs(),
            c.masquerade,
        )
    };
    let ipt = Masquerade { all: true, bit: 3 };
    let nft = Masquerade { all: false, bit: 5 };
    assert_eq!(periods(Mode::Ebpf), (10, 2, ipt));
    assert_eq!(periods(Mode::Iptables), (10, 2, ipt));
    assert_eq!(periods(Mode::Userspace), (10, 2, ipt));
    assert_eq!(periods(Mode::Ipvs), (20, 3, ipt));
    assert_eq!(periods(Mode::Nftables), (40, 4, nft));
}

#[test]
fn defaults_without_file_or_flags() {
    let loaded = resolve(&RunFlags::default(), None, &env()).unwrap();
    assert!(loaded.warnings.is_empty());
    let c = loaded.config;
    assert_eq!(c.config_file, None);
    assert_eq!(c.mode, Mode::Ebpf);
    assert_eq!(c.source, Source::InCluster);
    assert_eq!(c.node_name, "machine-host");
    assert!(c.node_ips.is_empty() && c.interfaces.is_empty() && c.cluster_cidrs.is_empty());
    assert_eq!(c.bind_address, std::net::IpAddr::from([0, 0, 0, 0]));
    assert_eq!(c.healthz_bind_address, addr("0.0.0.0:10256"));
    assert_eq!(c.metrics_bind_address, addr("127.0.0.1:10249"));
    assert_eq!(c.pin_path, PathBuf::from("/sys/fs/bpf/xproxy"));
    assert_eq!(
        c.sync,
        SyncPeriods {
            min_sync_period: Duration::from_secs(1),
            sync_period: Duration::from_secs(30)
        }
    );
    assert_eq!(c.masquerade, Masquerade { all: false, bit: 14 });
    assert!(c.localhost_node_ports);
    assert_eq!(c.ipvs, IpvsConfig::default());
    assert_eq!(c.conntrack, ConntrackConfig::default());
    assert_eq!(c.conntrack.max_per_core, 32_768);
    assert_eq!(c.config_sync_period, Duration::from_secs(900));
    assert_eq!(c.oom_score_adj, -999);
    assert_eq!(c.node_port_addresses, NodePortAddresses::All);
    assert_eq!(c.detect_local, DetectLocal::ClusterCidr);
    assert_eq!(c.client_connection.qps, 5.0);
    assert_eq!(c.client_connection.burst, 10);
}

#[test]
fn empty_mode_and_empty_sections_mean_defaults() {
    let c = load_body("mode: \"\"\niptables:\nipvs: {}\nconntrack:\nclusterCIDR: \"\"\n").config;
    assert_eq!(c.mode, Mode::Ebpf);
    assert_eq!(c.masquerade.bit, 14);
    assert!(c.cluster_cidrs.is_empty());
    // Go's zero durations mean "default" for the periods.
    let c = load_body("iptables: {syncPeriod: 0s, minSyncPeriod: \"0\"}\n").config;
    assert_eq!(c.sync.sync_period, Duration::from_secs(30));
    assert_eq!(c.sync.min_sync_period, Duration::from_secs(1));
}

#[test]
fn ipv6_bind_address_changes_the_default_servers() {
    let c = load_body("bindAddress: \"::\"\n").config;
    assert_eq!(c.healthz_bind_address, addr("[::]:10256"));
    assert_eq!(c.metrics_bind_address, addr("[::1]:10249"));
    // A bare IP gets the default port, like kube-proxy's AppendPortIfNeeded.
    let c = load_body("healthzBindAddress: 10.0.0.1\nmetricsBindAddress: \"::1\"\n").config;
    assert_eq!(c.healthz_bind_address, addr("10.0.0.1:10256"));
    assert_eq!(c.metrics_bind_address, addr("[::1]:10249"));
}

#[test]
fn unknown_fields_are_warnings_with_their_path() {
    let flags = flags_with(|f| f.config = Some(fixture("unknown-fields.yaml")));
    let loaded = load_with(&flags, &env()).unwrap();
    let mut fields: Vec<&str> = loaded.warnings.iter().map(|w| w.field.as_str()).collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "clientConnection.timeout",
            "conntrack.max",
            "detectLocal.extra",
            "iptables.foo",
            "kubeProxyIPVSConfiguration.bar",
            "udpIdleTimeout",
        ]
    );
    assert!(loaded.warnings.iter().all(|w| w.message == "unknown field, ignored"));
    assert_eq!(
        Warning::new("iptables.foo", "unknown field, ignored").to_string(),
        "iptables.foo: unknown field, ignored"
    );
    // Known fields next to the unknown ones still count.
    let c = loaded.config;
    assert_eq!(c.mode, Mode::Nftables);
    assert_eq!(c.ipvs.scheduler, IpvsScheduler::Sh);
    assert_eq!(
        c.source,
        Source::Kubeconfig(PathBuf::from("/etc/kubernetes/proxy.kubeconfig"))
    );
    // nftables mode: masquerading from the nftables section, not iptables.
    assert!(!c.masquerade.all);
}

#[test]
fn windows_settings_are_noted_and_logging_is_accepted() {
    let loaded =
        load_body("winkernel: {networkName: x}\nwindowsRunAsService: false\nlogging: {verbosity: 4, anything: 1}\n");
    let fields: Vec<&str> = loaded.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(fields, ["winkernel", "windowsRunAsService", "logging.anything"]);
    assert!(loaded.warnings[0].message.contains("ignored"));
    assert_eq!(loaded.config.logging.verbosity, 4);
}

#[test]
fn invalid_values_name_their_field() {
    let cases: &[(&str, &str)] = &[
        (
            "ipvs:\n  scheduler: xx\n",
            "ipvs.scheduler: unknown scheduler \"xx\" (expected one of rr, wrr, lc, wlc, lblc, lblcr, dh, sh, sed, nq, mh)",
        ),
        (
            "kubeProxyIPVSConfiguration:\n  scheduler: xx\n",
            "kubeProxyIPVSConfiguration.scheduler: unknown scheduler \"xx\"",
        ),
        (
            "iptables:\n  masqueradeBit: 40\n",
            "iptables.masqueradeBit: 40 is out of range 0..=31",
        ),
        (
            "kubeProxyIPTablesConfiguration:\n  masqueradeBit: -1\n",
            "kubeProxyIPTablesConfiguration.masqueradeBit: -1 is out of range 0..=31",
        ),
        (
            "nftables: {masqueradeBit: 32}\n",
            "nftables.masqueradeBit: 32 is out of range 0..=31",
        ),
        (
            "healthzBindAddress: abc\n",
            "healthzBindAddress: \"abc\" is not HOST:PORT",
        ),
        (
            "healthzBindAddress: \":10256\"\n",
            "healthzBindAddress: \":10256\" is not HOST:PORT",
        ),
        (
            "metricsBindAddress: 1.2.3.4:99999\n",
            "metricsBindAddress: \"1.2.3.4:99999\" is not HOST:PORT",
        ),
        (
            "clusterCIDR: 10.0.0.0/33\n",
            "clusterCIDR: \"10.0.0.0/33\" is not a CIDR",
        ),
        (
            "clusterCIDR: 10.0.0.0/8,bogus\n",
            "clusterCIDR: \"bogus\" is not a CIDR",
        ),
        (
            "clusterCIDR: 10.0.0.0/8,10.1.0.0/16\n",
            "clusterCIDR: \"10.0.0.0/8,10.1.0.0/16\" has two CIDRs of the same IP family",
        ),
        (
            "clusterCIDR: 10.0.0.0/8,fd00::/8,10.1.0.0/16\n",
            "has more than two CIDRs",
        ),
        ("bindAddress: nope\n", "bindAddress: \"nope\" is not an IP address"),
        (
            "mode: fast\n",
            "mode: unknown mode \"fast\" (expected one of ebpf, iptables, ipvs, nftables, userspace",
        ),
        ("mode: IPVS\n", "mode: unknown mode \"IPVS\""),
        (
            "iptables: {syncPeriod: soon}\n",
            "iptables.syncPeriod: invalid duration \"soon\"",
        ),
        (
            "iptables: {syncPeriod: 30}\n",
            "iptables.syncPeriod: invalid type: integer `30`, expected a duration string such as \"30s\"",
        ),
        (
            "iptables: {minSyncPeriod: -1s}\n",
            "iptables.minSyncPeriod: invalid duration \"-1s\": must not be negative",
        ),
        (
            "iptables: {syncPeriod: 1s, minSyncPeriod: 5s}\n",
            "iptables.syncPeriod: 1s must be greater than or equal to iptables.minSyncPeriod (5s)",
        ),
        (
            "mode: ipvs\nipvs: {syncPeriod: 1s, minSyncPeriod: 1m}\n",
            "ipvs.syncPeriod: 1s must be greater than or equal to ipvs.minSyncPeriod (1m0s)",
        ),
        (
            "ipvs: {tcpTimeout: 5 minutes}\n",
            "ipvs.tcpTimeout: invalid duration \"5 minutes\"",
        ),
        (
            "ipvs: {excludeCIDRs: [10.0.0.0/8, 1.2.3.4]}\n",
            "ipvs.excludeCIDRs[1]: \"1.2.3.4\" is not a CIDR",
        ),
        (
            "conntrack: {maxPerCore: -1}\n",
            "conntrack.maxPerCore: -1 is out of range 0..=2147483647",
        ),
        (
            "conntrack: {min: 1.5}\n",
            "conntrack.min: invalid type: floating point `1.5`",
        ),
        (
            "conntrack: {tcpEstablishedTimeout: 1d}\n",
            "conntrack.tcpEstablishedTimeout: invalid duration \"1d\"",
        ),
        (
            "configSyncPeriod: often\n",
            "configSyncPeriod: invalid duration \"often\"",
        ),
        ("oomScoreAdj: 2000\n", "oomScoreAdj: 2000 is out of range -1000..=1000"),
        (
            "nodePortAddresses: [primary, 10.0.0.0/8]\n",
            "nodePortAddresses: \"primary\" cannot be combined with CIDRs",
        ),
        (
            "nodePortAddresses: [10.0.0.0/8, bogus]\n",
            "nodePortAddresses[1]: \"bogus\" is not a CIDR",
        ),
        (
            "nodePortAddresses: 10.0.0.0/8\n",
            "nodePortAddresses: invalid type: string",
        ),
        ("portRange: abc\n", "portRange: \"abc\" is not a port range"),
        ("detectLocalMode: Magic\n", "detectLocalMode: unknown mode \"Magic\""),
        (
            "detectLocalMode: BridgeInterface\n",
            "detectLocal.bridgeInterface: required when detectLocalMode is BridgeInterface",
        ),
        (
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: \" \"}\n",
            "detectLocal.interfaceNamePrefix: required when detectLocalMode is InterfaceNamePrefix",
        ),
        (
            "clientConnection: {burst: -1}\n",
            "clientConnection.burst: -1 is out of range",
        ),
        (
            "clientConnection: {qps: -2}\n",
            "clientConnection.qps: -2 must be a number >= 0",
        ),
        (
            "clientConnection: {qps: fast}\n",
            "clientConnection.qps: invalid type: string \"fast\"",
        ),
        (
            "iptables: {masqueradeAll: maybe}\n",
            "iptables.masqueradeAll: invalid type: string \"maybe\", expected a boolean",
        ),
        ("featureGates: {A: 1}\n", "featureGates.A: invalid type"),
        (
            "showHiddenMetricsForVersion: abc\n",
            "showHiddenMetricsForVersion: \"abc\" is not a version",
        ),
        (
            "iptables: {}\nkubeProxyIPTablesConfiguration: {}\n",
            "kubeProxyIPTablesConfiguration: is another spelling of iptables; give only one of them",
        ),
    ];
    for (body, want) in cases {
        let err = error_of(body);
        assert!(err.contains(want), "for\n{body}\nwant: {want}\ngot:  {err}");
    }
}

#[test]
fn every_invalid_value_is_reported_at_once() {
    let err = load_text(
        &RunFlags::default(),
        "iptables: {masqueradeBit: 40}\nipvs: {scheduler: xx}\nclusterCIDR: 10.0.0.0/33\n",
    )
    .unwrap_err();
    let fields: Vec<&str> = err.field_errors().iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["clusterCIDR", "iptables.masqueradeBit", "ipvs.scheduler"]);
    let text = err.to_string();
    assert!(text.starts_with("invalid configuration: "), "{text}");
    assert!(text.contains("; "), "{text}");
}

#[test]
fn wrong_api_version_or_kind_is_rejected() {
    let cases: &[(&str, &str)] = &[
        (
            "apiVersion: kubeproxy.config.k8s.io/v1beta9\nkind: KubeProxyConfiguration\n",
            "apiVersion: \"kubeproxy.config.k8s.io/v1beta9\" is not supported (expected kubeproxy.config.k8s.io/v1alpha1)",
        ),
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
            "kind: \"KubeletConfiguration\" is not supported (expected KubeProxyConfiguration)",
        ),
        (
            "kind: KubeProxyConfiguration\nmode: ipvs\n",
            "apiVersion: missing (expected kubeproxy.config.k8s.io/v1alpha1)",
        ),
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n",
            "kind: missing (expected KubeProxyConfiguration)",
        ),
        (
            "apiVersion: 1\nkind: KubeProxyConfiguration\n",
            "apiVersion: expected the string",
        ),
        (
            "- a\n- b\n",
            "invalid YAML: expected a mapping (a KubeProxyConfiguration), found a list",
        ),
        ("", "invalid YAML"),
        ("mode: [unclosed\n", "invalid YAML"),
    ];
    for (text, want) in cases {
        let err = ConfigFile::parse(text).unwrap_err().to_string();
        assert!(err.contains(want), "for\n{text}\nwant: {want}\ngot:  {err}");
    }
}

#[test]
fn a_missing_file_is_an_error_naming_it() {
    let flags = flags_with(|f| f.config = Some(PathBuf::from("/nonexistent/xproxy/proxy.yaml")));
    let err = load_with(&flags, &env()).unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("cannot read config file /nonexistent/xproxy/proxy.yaml"),
        "{text}"
    );
}

#[test]
fn errors_from_a_file_name_the_file() {
    let dir = std::env::temp_dir().join(format!("xproxy-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad_type = dir.join("bad-type.yaml");
    std::fs::write(&bad_type, format!("{HEADER}iptables: {{masqueradeAll: maybe}}\n")).unwrap();
    let bad_value = dir.join("bad-value.yaml");
    std::fs::write(&bad_value, format!("{HEADER}ipvs: {{scheduler: xx}}\n")).unwrap();
    let bad_yaml = dir.join("bad-yaml.yaml");
    std::fs::write(&bad_yaml, "mode: [unclosed\n").unwrap();
    for (path, want) in [
        (&bad_type, "iptables.masqueradeAll: invalid type"),
        (&bad_value, "ipvs.scheduler: unknown scheduler"),
        (&bad_yaml, "invalid YAML (config file "),
    ] {
        let flags = flags_with(|f| f.config = Some(path.clone()));
        let err = load_with(&flags, &env()).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(err.contains(want), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flags_win_over_the_file() {
    let body = "mode: iptables\n\
                hostnameOverride: From-File\n\
                clusterCIDR: 10.0.0.0/8\n\
                healthzBindAddress: 127.0.0.1:1111\n\
                metricsBindAddress: 127.0.0.1:2222\n\
                clientConnection: {kubeconfig: /file/kubeconfig}\n";
    let file_only = load_text(&RunFlags::default(), body).unwrap().config;
    assert_eq!(file_only.mode, Mode::Iptables);
    assert_eq!(file_only.node_name, "from-file");
    assert_eq!(file_only.cluster_cidrs, cidrs(&["10.0.0.0/8"]));
    assert_eq!(file_only.healthz_bind_address, addr("127.0.0.1:1111"));
    assert_eq!(file_only.metrics_bind_address, addr("127.0.0.1:2222"));
    assert_eq!(file_only.source, Source::Kubeconfig("/file/kubeconfig".into()));

    let flags = flags_with(|f| {
        f.mode = Some(Mode::Ebpf);
        f.hostname_override = Some("From-Flag".to_owned());
        f.cluster_cidr = Some("192.168.0.0/16, fd00::/64".to_owned());
        f.healthz_bind_address = Some("0.0.0.0:3333".to_owned());
        f.metrics_bind_address = Some("0.0.0.0".to_owned());
        f.kubeconfig = Some("/flag/kubeconfig".into());
        f.node_ips = vec!["10.1.1.1".parse().unwrap(), "fd00::1".parse().unwrap()];
        f.interfaces = vec!["eth0".to_owned(), "eth1".to_owned()];
        f.pin_path = "/sys/fs/bpf/other".into();
    });
    let c = load_text(&flags, body).unwrap().config;
    assert_eq!(c.mode, Mode::Ebpf);
    assert_eq!(c.node_name, "from-flag");
    assert_eq!(c.cluster_cidrs, cidrs(&["192.168.0.0/16", "fd00::/64"]));
    assert_eq!(c.healthz_bind_address, addr("0.0.0.0:3333"));
    assert_eq!(c.metrics_bind_address, addr("0.0.0.0:10249"));
    assert_eq!(c.source, Source::Kubeconfig("/flag/kubeconfig".into()));
    assert_eq!(c.node_ips, flags.node_ips);
    assert_eq!(c.interfaces, ["eth0", "eth1"]);
    assert_eq!(c.pin_path, PathBuf::from("/sys/fs/bpf/other"));
}

#[test]
fn source_precedence() {
    let with_env = Environment {
        kubeconfig: Some("/env/kubeconfig".into()),
        ..env()
    };
    let file = ConfigFile::parse(&format!("{HEADER}clientConnection: {{kubeconfig: /file/kc}}\n")).unwrap();
    let empty = ConfigFile::parse(&format!("{HEADER}clientConnection: {{kubeconfig: \"\"}}\n")).unwrap();
    let source = |flags: &RunFlags, file: Option<&ConfigFile>, env: &Environment| {
        resolve(flags, file, env).unwrap().config.source
    };
    let none = RunFlags::default();
    let kubeconfig = flags_with(|f| f.kubeconfig = Some("/flag/kc".into()));
    let manifests = flags_with(|f| f.manifests = Some("/m".into()));
    assert_eq!(
        source(&manifests, Some(&file), &with_env),
        Source::Manifests("/m".into())
    );
    assert_eq!(
        source(&kubeconfig, Some(&file), &with_env),
        Source::Kubeconfig("/flag/kc".into())
    );
    assert_eq!(
        source(&none, Some(&file), &with_env),
        Source::Kubeconfig("/file/kc".into())
    );
    assert_eq!(
        source(&none, Some(&empty), &with_env),
        Source::Kubeconfig("/env/kubeconfig".into())
    );
    assert_eq!(
        source(&none, None, &with_env),
        Source::Kubeconfig("/env/kubeconfig".into())
    );
    assert_eq!(source(&none, Some(&empty), &env()), Source::InCluster);
}

#[test]
fn node_name_precedence_and_absence() {
    let c = load_body("hostnameOverride: \"  Node-7 \"\n").config;
    assert_eq!(c.node_name, "node-7");
    let blank_flag = flags_with(|f| f.hostname_override = Some(" ".to_owned()));
    assert_eq!(
        resolve(&blank_flag, None, &env()).unwrap().config.node_name,
        "machine-host"
    );
    let nameless = Environment::default();
    let err = resolve(&RunFlags::default(), None, &nameless).unwrap_err();
    assert!(matches!(err, ConfigError::NodeName(_)), "{err:?}");
    let named = flags_with(|f| f.hostname_override = Some("n1".to_owned()));
    assert_eq!(resolve(&named, None, &nameless).unwrap().config.node_name, "n1");
}

#[test]
fn invalid_flags_name_the_flag() {
    let cases: Vec<(RunFlags, &str)> = vec![
        (
            flags_with(|f| f.cluster_cidr = Some("bogus".to_owned())),
            "--cluster-cidr: \"bogus\" is not a CIDR",
        ),
        (
            flags_with(|f| f.healthz_bind_address = Some("abc".to_owned())),
            "--healthz-bind-address: \"abc\" is not HOST:PORT",
        ),
        (
            flags_with(|f| f.metrics_bind_address = Some("1.2.3.4:0".to_owned())),
            "--metrics-bind-address: \"1.2.3.4:0\" has port 0",
        ),
        (
            flags_with(|f| f.interfaces = vec!["a-very-long-interface-name".to_owned()]),
            "--interface: \"a-very-long-interface-name\" is not an interface name",
        ),
        (
            flags_with(|f| f.interfaces = vec![String::new()]),
            "--interface: \"\" is not an interface name",
        ),
        (
            flags_with(|f| f.pin_path = "relative/pins".into()),
            "--pin-path: \"relative/pins\" is not an absolute path",
        ),
        (
            flags_with(|f| f.node_port_range = "30000-".to_owned()),
            "--node-port-range: \"30000-\" is not a port range",
        ),
        (
            flags_with(|f| f.node_port_range = String::new()),
            "--node-port-range: is empty",
        ),
        (
            flags_with(|f| f.node_port_range = "1000-65535".to_owned()),
            "--node-port-range: \"1000-65535\" leaves no port from 1024 up",
        ),
    ];
    for (flags, want) in cases {
        let err = resolve(&flags, None, &env()).unwrap_err().to_string();
        assert!(err.contains(want), "want: {want}\ngot:  {err}");
    }
}

#[test]
fn node_port_range_defaults_to_the_api_servers_and_takes_a_flag() {
    assert_eq!(
        resolve(&RunFlags::default(), None, &env())
            .unwrap()
            .config
            .node_port_range,
        30000..=32767
    );
    let flags = flags_with(|f| f.node_port_range = "20000-22767".to_owned());
    assert_eq!(
        resolve(&flags, None, &env()).unwrap().config.node_port_range,
        20000..=22767
    );
}

#[test]
fn run_flags_parse_with_clap() {
    let cli = Cli::try_parse_from([
        "xproxy",
        "--config",
        "/etc/xproxy/proxy.yaml",
        "--mode",
        "ipvs",
        "--manifests",
        "/srv/manifests",
        "--node-ip",
        "10.0.0.1",
        "--node-ip",
        "fd00::1,10.0.0.2",
        "--interface",
        "eth0",
        "--interface",
        "eth1,eth2",
        "--hostname-override",
        "n1",
        "--cluster-cidr",
        "10.244.0.0/16",
        "--healthz-bind-address",
        "0.0.0.0:10256",
        "--metrics-bind-address",
        "127.0.0.1:10249",
    ])
    .unwrap();
    let f = cli.run;
    assert_eq!(f.config, Some(PathBuf::from("/etc/xproxy/proxy.yaml")));
    assert_eq!(f.mode, Some(Mode::Ipvs));
    assert_eq!(f.manifests, Some(PathBuf::from("/srv/manifests")));
    assert_eq!(f.node_ips.len(), 3);
    assert_eq!(f.interfaces, ["eth0", "eth1", "eth2"]);
    assert_eq!(f.hostname_override.as_deref(), Some("n1"));
    assert_eq!(f.cluster_cidr.as_deref(), Some("10.244.0.0/16"));
    assert_eq!(f.pin_path, PathBuf::from(DEFAULT_PIN_PATH));

    assert_eq!(Cli::try_parse_from(["xproxy"]).unwrap().run, RunFlags::default());
    for mode in Mode::ALL {
        let cli = Cli::try_parse_from(["xproxy", "--mode", mode.as_str()]).unwrap();
        assert_eq!(cli.run.mode, Some(mode));
    }
    let conflict = Cli::try_parse_from(["xproxy", "--manifests", "/m", "--kubeconfig", "/k"]);
    assert!(conflict.is_err());
    assert!(Cli::try_parse_from(["xproxy", "--mode", "fast"]).is_err());
    assert!(Cli::try_parse_from(["xproxy", "--node-ip", "not-an-ip"]).is_err());
}

#[test]
fn lb_algorithm_flag_reaches_the_config() {
    let cli = Cli::try_parse_from(["xproxy", "--lb-algorithm", "maglev"]).unwrap();
    let config = resolve(&cli.run, None, &env()).unwrap().config;
    assert_eq!(config.lb_algorithm, crate::model::LbAlgorithm::Maglev);
    let default = resolve(&RunFlags::default(), None, &env()).unwrap().config;
    assert_eq!(default.lb_algorithm, crate::model::LbAlgorithm::Random);
    assert!(Cli::try_parse_from(["xproxy", "--lb-algorithm", "round-robin"]).is_err());
}

#[test]
fn mode_and_scheduler_names_round_trip() {
    for mode in Mode::ALL {
        assert_eq!(mode.to_string().parse::<Mode>(), Ok(mode));
    }
    for scheduler in IpvsScheduler::ALL {
        assert_eq!(scheduler.to_string().parse::<IpvsScheduler>(), Ok(scheduler));
    }
    assert_eq!(Mode::default(), Mode::Ebpf);
    assert_eq!(IpvsScheduler::default(), IpvsScheduler::Rr);
}

#[test]
fn kube_proxy_flags_are_accepted_with_kube_proxys_meaning() {
    let cli = Cli::try_parse_from([
        "xproxy",
        "--proxy-mode=nftables",
        "--nodeport-addresses=10.0.0.0/8, 192.168.0.0/16",
        "--masquerade-all",
        "--v=4",
        "--logging-format=json",
        "--oom-score-adj=-500",
        "--conntrack-max-per-core=0",
        "--conntrack-min=1000",
        "--conntrack-tcp-timeout-established=2h",
        "--conntrack-tcp-timeout-close-wait=30s",
        "--conntrack-tcp-be-liberal",
        "--conntrack-udp-timeout=45s",
        "--conntrack-udp-timeout-stream=3m0s",
    ])
    .unwrap();
    let c = load_with(&cli.run, &env()).unwrap().config;
    assert_eq!(c.mode, Mode::Nftables);
    assert_eq!(
        c.node_port_addresses,
        NodePortAddresses::Cidrs(vec!["10.0.0.0/8".parse().unwrap(), "192.168.0.0/16".parse().unwrap()])
    );
    assert!(c.masquerade.all);
    assert_eq!(
        c.logging,
        Logging {
            format: LogFormat::Json,
            verbosity: 4
        }
    );
    assert_eq!(c.oom_score_adj, -500);
    assert_eq!(
        c.conntrack,
        ConntrackConfig {
            max_per_core: 0,
            min: 1000,
            tcp_established_timeout: Duration::from_secs(7200),
            tcp_close_wait_timeout: Duration::from_secs(30),
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(45),
            udp_stream_timeout: Duration::from_secs(180),
        }
    );
    let short = Cli::try_parse_from(["xproxy", "-v", "2", "--cleanup"]).unwrap();
    assert_eq!(short.run.verbosity, Some(2));
    assert!(short.run.cleanup);
}

#[test]
fn kube_proxy_flags_win_over_the_file_and_are_validated() {
    let body = "oomScoreAdj: 10\nlogging: {format: json, verbosity: 1}\nconntrack: {min: 5, udpTimeout: 1m}\nnodePortAddresses: [primary]\n";
    let file_only = load_text(&RunFlags::default(), body).unwrap().config;
    assert_eq!(
        (file_only.oom_score_adj, file_only.logging.format),
        (10, LogFormat::Json)
    );
    assert_eq!(
        (file_only.conntrack.min, file_only.conntrack.udp_timeout),
        (5, Duration::from_secs(60))
    );
    let flags = flags_with(|f| {
        f.oom_score_adj = Some(-20);
        f.logging_format = Some("text".into());
        f.conntrack.min = Some(7);
        f.nodeport_addresses = Some(vec!["127.0.0.0/8".into()]);
    });
    let c = load_text(&flags, body).unwrap().config;
    assert_eq!(
        (c.oom_score_adj, c.logging.format, c.logging.verbosity),
        (-20, LogFormat::Text, 1)
    );
    assert_eq!((c.conntrack.min, c.conntrack.udp_timeout), (7, Duration::from_secs(60)));
    assert!(matches!(c.node_port_addresses, NodePortAddresses::Cidrs(_)));

    let bad = flags_with(|f| {
        f.oom_score_adj = Some(2000);
        f.logging_format = Some("yaml".into());
        f.conntrack.udp_timeout = Some("soon".into());
        f.nodeport_addresses = Some(vec!["primary".into(), "10.0.0.0/8".into()]);
    });
    let err = load_text(&bad, "").unwrap_err().to_string();
    for flag in [
        "--oom-score-adj",
        "--logging-format",
        "--conntrack-udp-timeout",
        "--nodeport-addresses",
    ] {
        assert!(err.contains(flag), "{flag} missing from: {err}");
    }
}
