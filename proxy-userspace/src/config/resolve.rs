//! Flags + file + environment -> [`Config`], with kube-proxy's defaults and
//! validation. Every invalid value is reported, each with its field path.

use std::fmt::Display;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use super::duration::GoDuration;
use super::net::{Cidr, parse_bind_address, parse_port_range};
use super::{
    ClientConnection, Config, ConfigError, ConfigFile, ConntrackConfig, DEFAULT_HEALTHZ_PORT, DEFAULT_METRICS_PORT,
    DEFAULT_PIN_PATH, DetectLocal, Environment, FieldError, IpvsConfig, IpvsScheduler, KubeProxyConfiguration, Loaded,
    LogFormat, Logging, Masquerade, Mode, NodePortAddresses, RunFlags, Source, SyncPeriods, Warning,
    flags::ConntrackFlags,
};

const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
const DEFAULT_CONFIG_SYNC_PERIOD: Duration = Duration::from_secs(15 * 60);
const DEFAULT_MASQUERADE_BIT: u8 = 14;
const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
/// `DEFAULT_NODE_PORT_RANGE`, parsed.
const DEFAULT_NODE_PORTS: std::ops::RangeInclusive<u16> = 30000..=32767;
const MAX_IFNAME_LEN: usize = 15;

/// Resolves flags over the file (if any) over the defaults into a validated
/// [`Config`]. The warnings are the file's (unknown fields, ignored
/// settings); nothing is logged here. Every invalid value is reported in one
/// [`ConfigError::Invalid`].
pub fn resolve(flags: &RunFlags, file: Option<&ConfigFile>, env: &Environment) -> Result<Loaded, ConfigError> {
    let empty = KubeProxyConfiguration::default();
    let spec = file.map_or(&empty, |f| &f.spec);
    let keys = spec.section_keys;
    let mut errs = Errors::default();

    // Mode: the flag wins, then the file, then ebpf.
    let file_mode = match non_empty(spec.mode.as_deref()) {
        Some(text) => errs.check("mode", text.parse::<Mode>()),
        None => None,
    };
    let mode = flags.mode.or(file_mode).unwrap_or_default();

    let client = spec.client_connection.clone().unwrap_or_default();
    let source = if let Some(dir) = &flags.manifests {
        Source::Manifests(dir.clone())
    } else if let Some(path) = &flags.kubeconfig {
        Source::Kubeconfig(path.clone())
    } else if let Some(path) = non_empty(client.kubeconfig.as_deref()) {
        Source::Kubeconfig(PathBuf::from(path))
    } else if let Some(path) = &env.kubeconfig {
        Source::Kubeconfig(path.clone())
    } else {
        Source::InCluster
    };
    let client_connection = client_connection(&mut errs, &client);

    // Addresses.
    let bind_address = match non_empty(spec.bind_address.as_deref()) {
        Some(text) => errs
            .check(
                "bindAddress",
                text.parse::<IpAddr>()
                    .map_err(|_| format!("{text:?} is not an IP address")),
            )
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        None => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let (healthz_host, metrics_host): (IpAddr, IpAddr) = if bind_address.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED.into(), Ipv4Addr::LOCALHOST.into())
    } else {
        (Ipv6Addr::UNSPECIFIED.into(), Ipv6Addr::LOCALHOST.into())
    };
    let healthz_bind_address = bind_address_of(
        &mut errs,
        ("--healthz-bind-address", flags.healthz_bind_address.as_deref()),
        ("healthzBindAddress", spec.healthz_bind_address.as_deref()),
        SocketAddr::new(healthz_host, DEFAULT_HEALTHZ_PORT),
    );
    let metrics_bind_address = bind_address_of(
        &mut errs,
        ("--metrics-bind-address", flags.metrics_bind_address.as_deref()),
        ("metricsBindAddress", spec.metrics_bind_address.as_deref()),
        SocketAddr::new(metrics_host, DEFAULT_METRICS_PORT),
    );
    let cluster_cidrs = match non_empty(flags.cluster_cidr.as_deref()) {
        Some(text) => cidr_list(&mut errs, "--cluster-cidr", text),
        None => non_empty(spec.cluster_cidr.as_deref())
            .map(|text| cidr_list(&mut errs, "clusterCIDR", text))
            .unwrap_or_default(),
    };
    let node_port_addresses = match &flags.nodeport_addresses {
        Some(list) => node_port_addresses(&mut errs, "--nodeport-addresses", list),
        None => node_port_addresses(
            &mut errs,
            "nodePortAddresses",
            spec.node_port_addresses.as_deref().unwrap_or(&[]),
        ),
    };
    let detect_local = detect_local(&mut errs, spec);

    // Per-mode sections.
    let ipt = spec.iptables.clone().unwrap_or_default();
    let nft = spec.nftables.clone().unwrap_or_default();
    let ipvs = spec.ipvs.clone().unwrap_or_default();
    let ipt_bit = masquerade_bit(&mut errs, keys.iptables, ipt.masquerade_bit);
    let nft_bit = masquerade_bit(&mut errs, keys.nftables, nft.masquerade_bit);
    let (sync, masquerade) = match mode {
        Mode::Ebpf | Mode::Iptables | Mode::Userspace | Mode::Ipvs => {
            let masquerade = Masquerade {
                all: flags.masquerade_all || ipt.masquerade_all.unwrap_or(false),
                bit: ipt_bit,
            };
            let sync = if mode == Mode::Ipvs {
                // kube-proxy has no minSyncPeriod default for ipvs: zero.
                sync_periods(
                    &mut errs,
                    keys.ipvs,
                    ipvs.sync_period,
                    ipvs.min_sync_period,
                    Duration::ZERO,
                )
            } else {
                sync_periods(
                    &mut errs,
                    keys.iptables,
                    ipt.sync_period,
                    ipt.min_sync_period,
                    DEFAULT_MIN_SYNC_PERIOD,
                )
            };
            (sync, masquerade)
        }
        Mode::Nftables => {
            let masquerade = Masquerade {
                all: flags.masquerade_all || nft.masquerade_all.unwrap_or(false),
                bit: nft_bit,
            };
            let sync = sync_periods(
                &mut errs,
                keys.nftables,
                nft.sync_period,
                nft.min_sync_period,
                DEFAULT_MIN_SYNC_PERIOD,
            );
            (sync, masquerade)
        }
    };
    let ipvs = ipvs_config(&mut errs, keys.ipvs, &ipvs);
    let conntrack = conntrack_config(&mut errs, keys.conntrack, spec, &flags.conntrack);
    let logging = logging(&mut errs, flags, spec.logging.as_ref());

    // The rest of the top level.
    let (oom_field, oom_value) = match flags.oom_score_adj {
        Some(v) => ("--oom-score-adj", Some(v)),
        None => ("oomScoreAdj", spec.oom_score_adj),
    };
    let oom_score_adj = match oom_value {
        Some(v) => errs
            .check(oom_field, in_range(v, -1000, 1000))
            .and_then(|v| i32::try_from(v).ok())
            .unwrap_or(DEFAULT_OOM_SCORE_ADJ),
        None => DEFAULT_OOM_SCORE_ADJ,
    };
    let config_sync_period = non_zero(spec.config_sync_period).unwrap_or(DEFAULT_CONFIG_SYNC_PERIOD);
    let port_range = errs
        .check("portRange", parse_port_range(spec.port_range.as_deref().unwrap_or("")))
        .flatten();
    let node_port_range = errs
        .check("--node-port-range", parse_node_port_range(&flags.node_port_range))
        .unwrap_or(DEFAULT_NODE_PORTS);
    let show_hidden_metrics_for_version = match non_empty(spec.show_hidden_metrics_for_version.as_deref()) {
        Some(v) if is_major_minor(v) => Some(v.to_owned()),
        Some(v) => {
            errs.push(
                "showHiddenMetricsForVersion",
                format!("{v:?} is not a version like 1.30"),
            );
            None
        }
        None => None,
    };
    let interfaces = interfaces(&mut errs, &flags.interfaces);
    let pin_path = if flags.pin_path.as_os_str().is_empty() {
        PathBuf::from(DEFAULT_PIN_PATH)
    } else {
        if !flags.pin_path.is_absolute() {
            errs.push("--pin-path", format!("{:?} is not an absolute path", flags.pin_path));
        }
        flags.pin_path.clone()
    };

    errs.into_result(file.and_then(|f| f.path.clone()))?;
    let node_name = node_name(flags, spec, env)?;
    Ok(Loaded {
        config: Config {
            config_file: file.and_then(|f| f.path.clone()),
            mode,
            source,
            client_connection,
            node_name,
            node_ips: flags.node_ips.clone(),
            bind_address,
            bind_address_hard_fail: spec.bind_address_hard_fail.unwrap_or(false),
            interfaces,
            xdp: flags.xdp,
            lb_algorithm: flags.lb_algorithm,
            cluster_cidrs,
            node_port_addresses,
            detect_local,
            healthz_bind_address,
            metrics_bind_address,
            enable_profiling: spec.enable_profiling.unwrap_or(false),
            pin_path,
            socket_lb_cgroup: flags.socket_lb_cgroup.clone(),
            node_port_range,
            sync,
            config_sync_period,
            masquerade,
            localhost_node_ports: ipt.localhost_node_ports.unwrap_or(true),
            ipvs,
            conntrack,
            oom_score_adj,
            logging,
            feature_gates: spec.feature_gates.clone().unwrap_or_default(),
            port_range,
            show_hidden_metrics_for_version,
        },
        warnings: file
            .map(|f| f.warnings.clone())
            .unwrap_or_default()
            .into_iter()
            .chain(unhonoured_fields(spec))
            .collect(),
    })
}

/// Fields xproxy reads but does not act on: one warning each at start, so
/// a setting copied from a kube-proxy configuration is never dropped
/// without a word.
fn unhonoured_fields(spec: &KubeProxyConfiguration) -> Vec<Warning> {
    let mut out = Vec::new();
    let client = spec.client_connection.clone().unwrap_or_default();
    if client.qps.is_some() || client.burst.is_some() {
        out.push(Warning::new(
            "clientConnection.qps/burst",
            "not used: the agent makes one list and one watch per resource, not a request per object, so it has no client-side rate limit",
        ));
    }
    if spec.config_sync_period.is_some() {
        out.push(Warning::new(
            "configSyncPeriod",
            "not used: the agent's watches need no informer resync; the data path is re-checked every syncPeriod",
        ));
    }
    if spec.enable_profiling == Some(true) {
        out.push(Warning::new("enableProfiling", "not supported: no pprof endpoint"));
    }
    if spec.show_hidden_metrics_for_version.is_some() {
        out.push(Warning::new(
            "showHiddenMetricsForVersion",
            "not used: xproxy hides no metrics",
        ));
    }
    let logging_fields = spec.logging.as_ref().and_then(serde_json::Value::as_object);
    for field in logging_fields.into_iter().flat_map(|l| l.keys()) {
        if field != "format" && field != "verbosity" {
            out.push(Warning::new(
                format!("logging.{field}"),
                "not used: only logging.format and logging.verbosity are read",
            ));
        }
    }
    for gate in spec.feature_gates.iter().flat_map(|gates| gates.keys()) {
        out.push(Warning::new(
            format!("featureGates.{gate}"),
            "not used: xproxy has no feature gates",
        ));
    }
    out
}

/// `--v` and `--logging-format` over the file's `logging.verbosity` and
/// `logging.format`. Other `logging` fields are warned about by
/// [`unhonoured_fields`].
fn logging(errs: &mut Errors, flags: &RunFlags, section: Option<&serde_json::Value>) -> Logging {
    let file_verbosity = section.and_then(|l| l.get("verbosity")).map(|v| {
        v.as_u64()
            .and_then(|v| u8::try_from(v).ok())
            .ok_or_else(|| format!("{v} is not a verbosity (0-255)"))
    });
    let verbosity = match (flags.verbosity, file_verbosity) {
        (Some(v), _) => v,
        (None, Some(v)) => errs.check("logging.verbosity", v).unwrap_or(0),
        (None, None) => 0,
    };
    let (field, format) = match (&flags.logging_format, section.and_then(|l| l.get("format"))) {
        (Some(text), _) => ("--logging-format", Some(text.clone())),
        (None, Some(value)) => ("logging.format", Some(value.as_str().unwrap_or("").to_owned())),
        (None, None) => ("--logging-format", None),
    };
    let format = match format.as_deref() {
        None | Some("text") => LogFormat::Text,
        Some("json") => LogFormat::Json,
        Some(other) => {
            errs.push(field, format!("{other:?} is neither text nor json"));
            LogFormat::Text
        }
    };
    Logging { format, verbosity }
}

/// Field errors collected while resolving.
#[derive(Default)]
struct Errors(Vec<FieldError>);

impl Errors {
    fn push(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError {
            field: field.into(),
            message: message.into(),
        });
    }

    /// The value, or `None` after recording the error under `field`.
    fn check<T, E: Display>(&mut self, field: impl Into<String>, result: Result<T, E>) -> Option<T> {
        result.map_err(|e| self.push(field, e.to_string())).ok()
    }

    fn into_result(self, file: Option<PathBuf>) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid { file, errors: self.0 })
        }
    }
}

/// `Some` trimmed text, `None` for absent or blank.
fn non_empty(text: Option<&str>) -> Option<&str> {
    text.map(str::trim).filter(|t| !t.is_empty())
}

/// Go's zero value means "use the default" for most durations.
fn non_zero(d: Option<GoDuration>) -> Option<Duration> {
    d.map(|d| d.0).filter(|d| !d.is_zero())
}

fn in_range(value: i64, min: i64, max: i64) -> Result<i64, String> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(format!("{value} is out of range {min}..={max}"))
    }
}

fn client_connection(errs: &mut Errors, client: &super::ClientConnectionSection) -> ClientConnection {
    let qps = match client.qps {
        Some(q) if !q.is_finite() || q < 0.0 => {
            errs.push("clientConnection.qps", format!("{q} must be a number >= 0"));
            5.0
        }
        Some(q) if q > 0.0 => q as f32,
        _ => 5.0,
    };
    let burst = match client.burst {
        Some(b) if b != 0 => errs
            .check("clientConnection.burst", in_range(b, 0, i64::from(i32::MAX)))
            .and_then(|b| u32::try_from(b).ok())
            .unwrap_or(10),
        _ => 10,
    };
    ClientConnection {
        qps,
        burst,
        content_type: non_empty(client.content_type.as_deref())
            .unwrap_or("application/vnd.kubernetes.protobuf")
            .to_owned(),
        accept_content_types: client.accept_content_types.clone().unwrap_or_default(),
    }
}

/// The flag's address, else the file's, else `default`.
fn bind_address_of(
    errs: &mut Errors,
    (flag, flag_value): (&str, Option<&str>),
    (field, file_value): (&str, Option<&str>),
    default: SocketAddr,
) -> SocketAddr {
    let (name, text) = match (non_empty(flag_value), non_empty(file_value)) {
        (Some(text), _) => (flag, text),
        (None, Some(text)) => (field, text),
        (None, None) => return default,
    };
    errs.check(name, parse_bind_address(text, default.port()))
        .unwrap_or(default)
}

/// One CIDR, or two separated by a comma, one per IP family.
fn cidr_list(errs: &mut Errors, field: &str, text: &str) -> Vec<Cidr> {
    let mut cidrs = Vec::new();
    for part in text.split(',') {
        if let Some(cidr) = errs.check(field, part.trim().parse::<Cidr>()) {
            cidrs.push(cidr);
        }
    }
    match cidrs.as_slice() {
        [a, b] if a.is_ipv4() == b.is_ipv4() => errs.push(
            field,
            format!("{text:?} has two CIDRs of the same IP family (expected one, or one IPv4 and one IPv6)"),
        ),
        [_, _, _, ..] => errs.push(
            field,
            format!("{text:?} has more than two CIDRs (expected one, or one IPv4 and one IPv6)"),
        ),
        _ => {}
    }
    cidrs
}

fn node_port_addresses(errs: &mut Errors, field: &str, list: &[String]) -> NodePortAddresses {
    if list.iter().any(|a| a.trim() == "primary") {
        if list.len() != 1 {
            errs.push(field, "\"primary\" cannot be combined with CIDRs");
        }
        return NodePortAddresses::Primary;
    }
    if list.is_empty() {
        return NodePortAddresses::All;
    }
    let cidrs = list
        .iter()
        .enumerate()
        .filter_map(|(i, a)| errs.check(format!("{field}[{i}]"), a.trim().parse::<Cidr>()))
        .collect();
    NodePortAddresses::Cidrs(cidrs)
}

fn detect_local(errs: &mut Errors, spec: &KubeProxyConfiguration) -> DetectLocal {
    let section = spec.detect_local.clone().unwrap_or_default();
    let required = |errs: &mut Errors, field: &str, value: Option<String>, mode: &str| {
        let value = value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        if value.is_none() {
            errs.push(
                format!("detectLocal.{field}"),
                format!("required when detectLocalMode is {mode}"),
            );
        }
        value.unwrap_or_default()
    };
    match non_empty(spec.detect_local_mode.as_deref()) {
        None | Some("ClusterCIDR") => DetectLocal::ClusterCidr,
        Some("NodeCIDR") => DetectLocal::NodeCidr,
        Some(mode @ "BridgeInterface") => {
            DetectLocal::BridgeInterface(required(errs, "bridgeInterface", section.bridge_interface, mode))
        }
        Some(mode @ "InterfaceNamePrefix") => DetectLocal::InterfaceNamePrefix(required(
            errs,
            "interfaceNamePrefix",
            section.interface_name_prefix,
            mode,
        )),
        Some(other) => {
            errs.push(
                "detectLocalMode",
                format!(
                    "unknown mode {other:?} (expected one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix)"
                ),
            );
            DetectLocal::ClusterCidr
        }
    }
}

fn masquerade_bit(errs: &mut Errors, section: &str, bit: Option<i64>) -> u8 {
    match bit {
        Some(v) => errs
            .check(format!("{section}.masqueradeBit"), in_range(v, 0, 31))
            .and_then(|v| u8::try_from(v).ok())
            .unwrap_or(DEFAULT_MASQUERADE_BIT),
        None => DEFAULT_MASQUERADE_BIT,
    }
}

/// The sync periods of the section the mode uses; zero means the default.
fn sync_periods(
    errs: &mut Errors,
    section: &str,
    sync: Option<GoDuration>,
    min: Option<GoDuration>,
    default_min: Duration,
) -> SyncPeriods {
    let sync_period = non_zero(sync).unwrap_or(DEFAULT_SYNC_PERIOD);
    let min_sync_period = non_zero(min).unwrap_or(default_min);
    if min_sync_period > sync_period {
        errs.push(
            format!("{section}.syncPeriod"),
            format!(
                "{} must be greater than or equal to {section}.minSyncPeriod ({})",
                GoDuration(sync_period),
                GoDuration(min_sync_period)
            ),
        );
    }
    SyncPeriods {
        min_sync_period,
        sync_period,
    }
}

fn ipvs_config(errs: &mut Errors, section: &str, ipvs: &super::IpvsSection) -> IpvsConfig {
    let scheduler = match non_empty(ipvs.scheduler.as_deref()) {
        Some(name) => errs
            .check(format!("{section}.scheduler"), name.parse::<IpvsScheduler>())
            .unwrap_or_default(),
        None => IpvsScheduler::default(),
    };
    let exclude_cidrs = ipvs
        .exclude_cidrs
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, c)| errs.check(format!("{section}.excludeCIDRs[{i}]"), c.trim().parse::<Cidr>()))
        .collect();
    let d = |d: Option<GoDuration>| d.map(|d| d.0).unwrap_or_default();
    IpvsConfig {
        scheduler,
        exclude_cidrs,
        strict_arp: ipvs.strict_arp.unwrap_or(false),
        tcp_timeout: d(ipvs.tcp_timeout),
        tcp_fin_timeout: d(ipvs.tcp_fin_timeout),
        udp_timeout: d(ipvs.udp_timeout),
    }
}

/// The file's `conntrack` section with the `--conntrack-*` flags over it.
fn conntrack_config(
    errs: &mut Errors,
    section: &str,
    spec: &KubeProxyConfiguration,
    flags: &ConntrackFlags,
) -> ConntrackConfig {
    let ct = spec.conntrack.clone().unwrap_or_default();
    let defaults = ConntrackConfig::default();
    let mut count = |flag: &str, field: &str, flag_value: Option<i64>, file_value: Option<i64>, default: u32| {
        let (name, value) = match flag_value {
            Some(v) => (flag.to_owned(), Some(v)),
            None => (format!("{section}.{field}"), file_value),
        };
        match value {
            Some(v) => errs
                .check(name, in_range(v, 0, i64::from(i32::MAX)))
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(default),
            None => default,
        }
    };
    let max_per_core = count(
        "--conntrack-max-per-core",
        "maxPerCore",
        flags.max_per_core,
        ct.max_per_core,
        defaults.max_per_core,
    );
    let min = count("--conntrack-min", "min", flags.min, ct.min, defaults.min);
    let mut duration =
        |flag: &str, flag_value: &Option<String>, file_value: Option<GoDuration>, default: Duration| match flag_value {
            Some(text) => errs.check(flag, text.parse::<GoDuration>()).map_or(default, |d| d.0),
            None => file_value.map_or(default, |d| d.0),
        };
    ConntrackConfig {
        max_per_core,
        min,
        tcp_established_timeout: duration(
            "--conntrack-tcp-timeout-established",
            &flags.tcp_established_timeout,
            ct.tcp_established_timeout,
            defaults.tcp_established_timeout,
        ),
        tcp_close_wait_timeout: duration(
            "--conntrack-tcp-timeout-close-wait",
            &flags.tcp_close_wait_timeout,
            ct.tcp_close_wait_timeout,
            defaults.tcp_close_wait_timeout,
        ),
        tcp_be_liberal: flags.tcp_be_liberal || ct.tcp_be_liberal.unwrap_or(false),
        udp_timeout: duration(
            "--conntrack-udp-timeout",
            &flags.udp_timeout,
            ct.udp_timeout,
            defaults.udp_timeout,
        ),
        udp_stream_timeout: duration(
            "--conntrack-udp-timeout-stream",
            &flags.udp_stream_timeout,
            ct.udp_stream_timeout,
            defaults.udp_stream_timeout,
        ),
    }
}

/// `--node-port-range`: a port range that leaves some unprivileged ports
/// (1024 and up) outside it, for masquerading.
fn parse_node_port_range(input: &str) -> Result<std::ops::RangeInclusive<u16>, String> {
    let range = parse_port_range(input)?.ok_or_else(|| "is empty (expected FIRST-LAST)".to_owned())?;
    if *range.start() <= 1024 && *range.end() == u16::MAX {
        return Err(format!(
            "{input:?} leaves no port from 1024 up for masquerading outside it"
        ));
    }
    Ok(range)
}

fn is_major_minor(v: &str) -> bool {
    v.split_once('.').is_some_and(|(major, minor)| {
        [major, minor]
            .iter()
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

fn interfaces(errs: &mut Errors, names: &[String]) -> Vec<String> {
    for name in names {
        let bad = name.is_empty()
            || name.len() > MAX_IFNAME_LEN
            || name == "."
            || name == ".."
            || name
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control());
        if bad {
            errs.push(
                "--interface",
                format!("{name:?} is not an interface name (1 to {MAX_IFNAME_LEN} characters, no '/', ':' or spaces)"),
            );
        }
    }
    names.to_vec()
}

/// `--hostname-override`, else `hostnameOverride`, else the hostname;
/// trimmed and lowercased like kube-proxy's `GetHostname`.
fn node_name(flags: &RunFlags, spec: &KubeProxyConfiguration, env: &Environment) -> Result<String, ConfigError> {
    non_empty(flags.hostname_override.as_deref())
        .or_else(|| non_empty(spec.hostname_override.as_deref()))
        .or_else(|| non_empty(env.hostname.as_deref()))
        .map(str::to_lowercase)
        .ok_or_else(|| {
            ConfigError::NodeName(
                "no --hostname-override, no hostnameOverride in the config file, and the machine's hostname is unknown"
                    .to_owned(),
            )
        })
}
