//! Command-line flags that override the configuration file, kube-proxy
//! style. `main.rs` flattens [`RunFlags`] into its clap parser.

use std::net::IpAddr;
use std::path::PathBuf;

use super::{Mode, XdpPolicy};

/// Where the agent pins its maps and programs unless told otherwise.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/xproxy";

/// The agent's run flags. Every flag that is given wins over the
/// configuration file (kube-proxy's precedence).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RunFlags {
    /// KubeProxyConfiguration file (kube-proxy's --config).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Data-plane mode; overrides the file's `mode` [default: ebpf].
    #[arg(long, value_enum, value_name = "MODE")]
    pub mode: Option<Mode>,

    /// kubeconfig of the API server; overrides clientConnection.kubeconfig
    /// and $KUBECONFIG (default: in-cluster config).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// Read Services and EndpointSlices from YAML files in DIR instead of
    /// an API server.
    #[arg(long, value_name = "DIR", conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,

    /// Node name, instead of the machine's hostname.
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,

    /// The node's IP address(es); repeat (or separate by commas) for dual
    /// stack. Default: detected.
    #[arg(long = "node-ip", value_name = "IP", value_delimiter = ',')]
    pub node_ips: Vec<IpAddr>,

    /// Interface to attach the data plane to; repeat (or separate by commas)
    /// for several. Default: detected.
    #[arg(long = "interface", value_name = "IFACE", value_delimiter = ',')]
    pub interfaces: Vec<String>,

    /// ebpf mode: XDP on the uplinks. `auto`: native XDP, except on veth
    /// uplinks, where the skb is converted to an XDP buffer (often copied)
    /// for every packet and tc does the same work for less.
    #[arg(long, value_name = "POLICY", value_enum, default_value_t = XdpPolicy::Auto)]
    pub xdp: XdpPolicy,

    /// Pod network CIDR(s), comma separated; overrides clusterCIDR.
    #[arg(long, value_name = "CIDR")]
    pub cluster_cidr: Option<String>,

    /// bpffs directory for pinned maps and programs.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_PATH)]
    pub pin_path: PathBuf,

    /// ebpf mode: the cgroup (v2 directory) whose processes' connections to
    /// the node's own node ports are translated at the socket. Default: the
    /// root of the cgroup v2 hierarchy, i.e. every process of the node.
    #[arg(long, value_name = "DIR")]
    pub socket_lb_cgroup: Option<PathBuf>,

    /// Health check server address; overrides healthzBindAddress
    /// [default: 0.0.0.0:10256].
    #[arg(long, value_name = "ADDR:PORT")]
    pub healthz_bind_address: Option<String>,

    /// Metrics server address; overrides metricsBindAddress
    /// [default: 127.0.0.1:10249].
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_bind_address: Option<String>,
}

impl Default for RunFlags {
    /// No flag given: what clap produces for an empty command line.
    fn default() -> Self {
        RunFlags {
            config: None,
            mode: None,
            kubeconfig: None,
            manifests: None,
            hostname_override: None,
            node_ips: Vec::new(),
            interfaces: Vec::new(),
            xdp: XdpPolicy::Auto,
            cluster_cidr: None,
            pin_path: PathBuf::from(DEFAULT_PIN_PATH),
            socket_lb_cgroup: None,
            healthz_bind_address: None,
            metrics_bind_address: None,
        }
    }
}
