//! The agent's configuration: kube-proxy's `KubeProxyConfiguration` file
//! (`--config`) plus command-line flags ([`RunFlags`]), resolved into one
//! validated [`Config`] that the rest of the agent reads.
//!
//! Unknown fields in the file are warnings (logged and returned), invalid
//! values are errors that name the field: `ipvs.scheduler: unknown scheduler
//! "xx" (...)`. Flags win over the file; the file wins over the defaults.

mod duration;
mod file;
mod flags;
mod net;
mod resolve;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

pub use duration::{DurationError, GoDuration, format_duration, parse_duration};
pub use file::{
    API_VERSION, ClientConnectionSection, ConfigFile, ConntrackSection, DetectLocalSection, IptablesSection,
    IpvsSection, KIND, KubeProxyConfiguration, NftablesSection, SectionKeys,
};
pub use flags::{ConntrackFlags, DEFAULT_PIN_PATH, RunFlags};
pub use net::{Cidr, CidrError, parse_bind_address, parse_port_range};
pub use resolve::resolve;

/// Default port of the `/healthz` server (kube-proxy's).
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// Default port of the `/metrics` server (kube-proxy's).
pub const DEFAULT_METRICS_PORT: u16 = 10249;

/// Whether the ebpf mode runs its uplink program at XDP (`--xdp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum XdpPolicy {
    /// Native XDP, except on veth uplinks (tc only there).
    #[default]
    Auto,
    /// Native XDP on every uplink.
    Native,
    /// tc only.
    Off,
}

/// The data-plane implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, clap::ValueEnum)]
pub enum Mode {
    /// Service translation in tc/XDP programs (xproxy's own).
    #[default]
    Ebpf,
    /// kube-proxy's iptables chains.
    Iptables,
    /// kube-proxy's IPVS virtual servers.
    Ipvs,
    /// kube-proxy's nftables tables.
    Nftables,
    /// Proxying through a user-space process.
    Userspace,
}

impl Mode {
    /// Every mode, in the order error messages list them.
    pub const ALL: [Mode; 5] = [Mode::Ebpf, Mode::Iptables, Mode::Ipvs, Mode::Nftables, Mode::Userspace];

    /// The name used in the file and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Ipvs => "ipvs",
            Mode::Nftables => "nftables",
            Mode::Userspace => "userspace",
        }
    }
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| {
            format!(
                "unknown mode {s:?} (expected one of {}, or \"\" for the default)",
                Mode::ALL.map(Mode::as_str).join(", ")
            )
        })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where Services and EndpointSlices come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An API server described by this kubeconfig file (not yet read).
    Kubeconfig(PathBuf),
    /// The API server of the cluster the agent runs in (service account).
    InCluster,
    /// Service and EndpointSlice YAML files in this directory.
    Manifests(PathBuf),
}

/// The client settings of `clientConnection`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientConnection {
    /// Queries per second to the API server.
    pub qps: f32,
    /// Burst above `qps`.
    pub burst: u32,
    /// Content type of requests.
    pub content_type: String,
    /// `Accept` header; empty means the client's default.
    pub accept_content_types: String,
}

/// How often the data plane is synced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncPeriods {
    /// Changes are applied at most this often (bursts coalesce).
    pub min_sync_period: Duration,
    /// A full resync happens at least this often.
    pub sync_period: Duration,
}

/// Source NAT of Service traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Masquerade {
    /// SNAT all Service traffic, not only traffic that needs it.
    pub all: bool,
    /// The fwmark bit (0..=31) that marks packets for SNAT.
    pub bit: u8,
}

/// IPVS load-balancing algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum IpvsScheduler {
    /// Round robin.
    #[default]
    Rr,
    /// Weighted round robin.
    Wrr,
    /// Least connection.
    Lc,
    /// Weighted least connection.
    Wlc,
    /// Locality-based least connection.
    Lblc,
    /// Locality-based least connection with replication.
    Lblcr,
    /// Destination hashing.
    Dh,
    /// Source hashing.
    Sh,
    /// Shortest expected delay.
    Sed,
    /// Never queue.
    Nq,
    /// Maglev hashing.
    Mh,
}

impl IpvsScheduler {
    /// Every scheduler, in the order error messages list them.
    pub const ALL: [IpvsScheduler; 11] = [
        IpvsScheduler::Rr,
        IpvsScheduler::Wrr,
        IpvsScheduler::Lc,
        IpvsScheduler::Wlc,
        IpvsScheduler::Lblc,
        IpvsScheduler::Lblcr,
        IpvsScheduler::Dh,
        IpvsScheduler::Sh,
        IpvsScheduler::Sed,
        IpvsScheduler::Nq,
        IpvsScheduler::Mh,
    ];

    /// The kernel's (and `ipvsadm -s`'s) name.
    pub fn as_str(self) -> &'static str {
        match self {
            IpvsScheduler::Rr => "rr",
            IpvsScheduler::Wrr => "wrr",
            IpvsScheduler::Lc => "lc",
            IpvsScheduler::Wlc => "wlc",
            IpvsScheduler::Lblc => "lblc",
            IpvsScheduler::Lblcr => "lblcr",
            IpvsScheduler::Dh => "dh",
            IpvsScheduler::Sh => "sh",
            IpvsScheduler::Sed => "sed",
            IpvsScheduler::Nq => "nq",
            IpvsScheduler::Mh => "mh",
        }
    }
}

impl FromStr for IpvsScheduler {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        IpvsScheduler::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| {
            format!(
                "unknown scheduler {s:?} (expected one of {})",
                IpvsScheduler::ALL.map(IpvsScheduler::as_str).join(", ")
            )
        })
    }
}

impl fmt::Display for IpvsScheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `ipvs` section, resolved. Zero timeouts leave the kernel's value.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IpvsConfig {
    pub scheduler: IpvsScheduler,
    /// Virtual servers in these networks are never cleaned up.
    pub exclude_cidrs: Vec<Cidr>,
    /// Set `arp_ignore`/`arp_announce` so only the uplink answers ARP.
    pub strict_arp: bool,
    pub tcp_timeout: Duration,
    pub tcp_fin_timeout: Duration,
    pub udp_timeout: Duration,
}

/// The `conntrack` section, resolved. A zero leaves the kernel's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackConfig {
    /// `nf_conntrack_max` per CPU.
    pub max_per_core: u32,
    /// Lower bound of `nf_conntrack_max`.
    pub min: u32,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    /// `nf_conntrack_tcp_be_liberal`.
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

impl Default for ConntrackConfig {
    /// kube-proxy's defaults.
    fn default() -> Self {
        ConntrackConfig {
            max_per_core: 32 * 1024,
            min: 128 * 1024,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// How traffic from local pods is recognised (`detectLocalMode`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DetectLocal {
    /// Source inside the cluster CIDR(s) (kube-proxy's default).
    #[default]
    ClusterCidr,
    /// Source inside the Node's `podCIDRs`.
    NodeCidr,
    /// Arriving on this bridge interface.
    BridgeInterface(String),
    /// Arriving on an interface whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

/// How the agent logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Logging {
    pub format: LogFormat,
    /// klog's `-v`: 0-2 info, 3-4 debug, 5 and up trace.
    pub verbosity: u8,
}

/// `--logging-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line (kube-proxy's `--logging-format=json`).
    Json,
}

/// Which local addresses accept NodePort traffic (`nodePortAddresses`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NodePortAddresses {
    /// Every local address (the field is empty).
    #[default]
    All,
    /// The node's primary IP(s) (`["primary"]`).
    Primary,
    /// Local addresses inside these networks.
    Cidrs(Vec<Cidr>),
}

/// The validated configuration the agent runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The `--config` file, if any.
    pub config_file: Option<PathBuf>,
    pub mode: Mode,
    pub source: Source,
    pub client_connection: ClientConnection,
    /// This node's name: the override, else the hostname; lowercased.
    pub node_name: String,
    /// `--node-ip`; empty means detect (from the Node object, else
    /// `bind_address` when it is not unspecified, like kube-proxy).
    pub node_ips: Vec<IpAddr>,
    /// `bindAddress` (default 0.0.0.0): kube-proxy's hint of the node's
    /// primary IP and family.
    pub bind_address: IpAddr,
    pub bind_address_hard_fail: bool,
    /// `--interface`; empty means detect.
    pub interfaces: Vec<String>,
    /// `--xdp`.
    pub xdp: XdpPolicy,
    /// `--lb-algorithm` (ebpf mode): for Services without the annotation.
    pub lb_algorithm: crate::model::LbAlgorithm,
    /// Pod networks (`clusterCIDR` / `--cluster-cidr`); at most one per family.
    pub cluster_cidrs: Vec<Cidr>,
    pub node_port_addresses: NodePortAddresses,
    pub detect_local: DetectLocal,
    pub healthz_bind_address: SocketAddr,
    pub metrics_bind_address: SocketAddr,
    pub enable_profiling: bool,
    /// bpffs directory for pinned maps and programs.
    pub pin_path: PathBuf,
    /// `--socket-lb-cgroup` (ebpf mode); `None`: the cgroup v2 root.
    pub socket_lb_cgroup: Option<PathBuf>,
    /// `--node-port-range`: where the API server allocates node ports.
    pub node_port_range: RangeInclusive<u16>,
    /// From the section of the file that matches `mode`.
    pub sync: SyncPeriods,
    /// Informer resync period (`configSyncPeriod`, default 15m).
    pub config_sync_period: Duration,
    /// From `nftables` in nftables mode, else from `iptables`.
    pub masquerade: Masquerade,
    /// `iptables.localhostNodePorts` (default true).
    pub localhost_node_ports: bool,
    pub ipvs: IpvsConfig,
    pub conntrack: ConntrackConfig,
    /// Default -999, like kube-proxy.
    pub oom_score_adj: i32,
    /// `--v` / `--logging-format`, or the file's `logging` section.
    pub logging: Logging,
    pub feature_gates: BTreeMap<String, bool>,
    /// `portRange`: the ports the userspace mode listens on (legacy;
    /// unused by the other modes).
    pub port_range: Option<RangeInclusive<u16>>,
    pub show_hidden_metrics_for_version: Option<String>,
}

impl Config {
    /// The configured IPv4 node IPs (`--node-ip`, one per family): what
    /// finds the ebpf mode's uplinks and the health check listeners' primary
    /// addresses.
    pub fn ipv4_node_ips(&self) -> Vec<Ipv4Addr> {
        self.node_ips.iter().filter_map(|ip| crate::model::ipv4(*ip)).collect()
    }
}

impl NodePortAddresses {
    /// The networks NodePorts answer in, when the addresses are given as
    /// networks (`None` for every local address or the node's primary IPs).
    pub fn cidrs(&self) -> Option<&[Cidr]> {
        match self {
            NodePortAddresses::Cidrs(cidrs) => Some(cidrs),
            NodePortAddresses::All | NodePortAddresses::Primary => None,
        }
    }
}

/// Something in the configuration that was accepted but not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// The field's path, e.g. `iptables.foo`.
    pub field: String,
    pub message: String,
}

impl Warning {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Warning {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// One invalid value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field's path (`iptables.masqueradeBit`) or flag (`--cluster-cidr`).
    pub field: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    /// Not YAML, or not a mapping.
    #[error("invalid YAML{}: {message}", in_file(file.as_deref()))]
    Yaml {
        /// The config file, when the text came from one.
        file: Option<PathBuf>,
        message: String,
    },
    /// Invalid values; every one names its field (or flag).
    #[error("invalid configuration{}: {}", in_file(file.as_deref()), join(errors))]
    Invalid {
        /// The config file, when one was given.
        file: Option<PathBuf>,
        errors: Vec<FieldError>,
    },
    /// No node name could be found.
    #[error("cannot determine the node name: {0}")]
    NodeName(String),
}

fn in_file(file: Option<&std::path::Path>) -> String {
    file.map(|f| format!(" (config file {})", f.display()))
        .unwrap_or_default()
}

fn join(errors: &[FieldError]) -> String {
    errors.iter().map(FieldError::to_string).collect::<Vec<_>>().join("; ")
}

impl ConfigError {
    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            file: None,
            errors: vec![FieldError {
                field: field.into(),
                message: message.into(),
            }],
        }
    }

    fn yaml(message: impl Into<String>) -> Self {
        ConfigError::Yaml {
            file: None,
            message: message.into(),
        }
    }

    /// The same error, attributed to the config file `path`.
    fn in_file(self, path: &std::path::Path) -> Self {
        match self {
            ConfigError::Yaml { message, .. } => ConfigError::Yaml {
                file: Some(path.to_owned()),
                message,
            },
            ConfigError::Invalid { errors, .. } => ConfigError::Invalid {
                file: Some(path.to_owned()),
                errors,
            },
            other => other,
        }
    }

    /// The invalid fields, if this is a validation error.
    pub fn field_errors(&self) -> &[FieldError] {
        match self {
            ConfigError::Invalid { errors, .. } => errors,
            _ => &[],
        }
    }
}

/// What the process environment contributes: `$KUBECONFIG` and the
/// machine's hostname. Tests build one by hand.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment {
    /// The first non-empty entry of `$KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// The machine's hostname, if it could be read.
    pub hostname: Option<String>,
}

impl Environment {
    /// Reads `$KUBECONFIG` and the hostname of this process.
    pub fn from_process() -> Self {
        let kubeconfig = std::env::var_os("KUBECONFIG")
            .and_then(|list| std::env::split_paths(&list).find(|p| !p.as_os_str().is_empty()));
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty());
        Environment { kubeconfig, hostname }
    }
}

/// A resolved configuration and the warnings met on the way.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<Warning>,
}

/// Loads the configuration for `flags` in this process's environment: reads
/// `--config` if given, applies the flags, validates, and logs every warning.
pub fn load(flags: &RunFlags) -> Result<Loaded, ConfigError> {
    load_with(flags, &Environment::from_process())
}

/// [`load`] with an explicit environment.
pub fn load_with(flags: &RunFlags, env: &Environment) -> Result<Loaded, ConfigError> {
    let file = flags.config.as_deref().map(ConfigFile::read).transpose()?;
    resolve(flags, file.as_ref(), env)
}

impl Loaded {
    /// Logs every warning once (after logging is set up: the configuration
    /// says how to log).
    pub fn log_warnings(&self) {
        for warning in &self.warnings {
            match &self.config.config_file {
                Some(path) => tracing::warn!(file = %path.display(), "{warning}"),
                None => tracing::warn!("{warning}"),
            }
        }
    }
}
