//! Command-line flags that override the configuration file, kube-proxy
//! style. `main.rs` flattens [`RunFlags`] into its clap parser.

use std::net::IpAddr;
use std::path::PathBuf;

use super::{Mode, XdpPolicy};
use crate::model::LbAlgorithm;

/// Where the agent pins its maps and programs unless told otherwise.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/xproxy";
/// kube-apiserver's default `--service-node-port-range`.
pub const DEFAULT_NODE_PORT_RANGE: &str = "30000-32767";

/// The agent's run flags. Every flag that is given wins over the
/// configuration file (kube-proxy's precedence).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RunFlags {
    /// KubeProxyConfiguration file (kube-proxy's --config).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Data-plane mode; overrides the file's `mode` [default: ebpf].
    /// `--proxy-mode` is kube-proxy's name for it.
    #[arg(long, visible_alias = "proxy-mode", value_enum, value_name = "MODE")]
    pub mode: Option<Mode>,

    /// kube-proxy's `--cleanup`: remove the rules of every mode (`xproxy
    /// cleanup --scope all`) and exit.
    #[arg(long)]
    pub cleanup: bool,

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

    /// ebpf mode: how new flows pick an endpoint, unless their Service's
    /// `xproxy.io/lb-algorithm` annotation says otherwise. `maglev`
    /// builds a lookup table per Service (8 KiB for up to 10 endpoints).
    #[arg(long, value_name = "ALGORITHM", value_enum, default_value_t = LbAlgorithm::Random)]
    pub lb_algorithm: LbAlgorithm,

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

    /// The API server's `--service-node-port-range`, which node ports
    /// come from. ebpf mode: flows to backends on other nodes are
    /// masqueraded to source ports outside it (see `mode::ebpf::snat`).
    #[arg(long, value_name = "FIRST-LAST", default_value = DEFAULT_NODE_PORT_RANGE)]
    pub node_port_range: String,

    /// Health check server address; overrides healthzBindAddress
    /// [default: 0.0.0.0:10256].
    #[arg(long, value_name = "ADDR:PORT")]
    pub healthz_bind_address: Option<String>,

    /// Metrics server address; overrides metricsBindAddress
    /// [default: 127.0.0.1:10249].
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_bind_address: Option<String>,

    /// Addresses NodePorts answer on, comma separated CIDRs or `primary`;
    /// overrides nodePortAddresses [default: every local address].
    #[arg(long, value_name = "CIDRS", value_delimiter = ',')]
    pub nodeport_addresses: Option<Vec<String>>,

    /// Masquerade all Service traffic; overrides iptables/nftables
    /// masqueradeAll.
    #[arg(long)]
    pub masquerade_all: bool,

    /// Log verbosity, klog style: 0-2 info, 3-4 debug, 5 and up trace;
    /// overrides `RUST_LOG` and logging.verbosity (`RUST_LOG` wins over
    /// the file).
    #[arg(short = 'v', long = "v", value_name = "LEVEL")]
    pub verbosity: Option<u8>,

    /// `text` or `json`; overrides logging.format [default: text].
    #[arg(long, value_name = "FORMAT")]
    pub logging_format: Option<String>,

    /// The agent's oom_score_adj, -1000 to 1000; overrides oomScoreAdj
    /// [default: -999].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub oom_score_adj: Option<i64>,

    #[command(flatten)]
    pub conntrack: ConntrackFlags,
}

/// kube-proxy's `--conntrack-*` flags; each overrides its field of the
/// file's `conntrack` section. Durations are Go durations (`24h0m0s`).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ConntrackFlags {
    /// Connections tracked per CPU (0: leave nf_conntrack_max alone).
    #[arg(long = "conntrack-max-per-core", value_name = "N")]
    pub max_per_core: Option<i64>,
    /// The least nf_conntrack_max, whatever the CPU count.
    #[arg(long = "conntrack-min", value_name = "N")]
    pub min: Option<i64>,
    /// nf_conntrack_tcp_timeout_established (0: leave alone).
    #[arg(long = "conntrack-tcp-timeout-established", value_name = "DURATION")]
    pub tcp_established_timeout: Option<String>,
    /// nf_conntrack_tcp_timeout_close_wait (0: leave alone).
    #[arg(long = "conntrack-tcp-timeout-close-wait", value_name = "DURATION")]
    pub tcp_close_wait_timeout: Option<String>,
    /// Set nf_conntrack_tcp_be_liberal.
    #[arg(long = "conntrack-tcp-be-liberal")]
    pub tcp_be_liberal: bool,
    /// nf_conntrack_udp_timeout (0: leave alone).
    #[arg(long = "conntrack-udp-timeout", value_name = "DURATION")]
    pub udp_timeout: Option<String>,
    /// nf_conntrack_udp_timeout_stream (0: leave alone).
    #[arg(long = "conntrack-udp-timeout-stream", value_name = "DURATION")]
    pub udp_stream_timeout: Option<String>,
}

impl Default for RunFlags {
    /// No flag given: what clap produces for an empty command line.
    fn default() -> Self {
        RunFlags {
            config: None,
            mode: None,
            cleanup: false,
            kubeconfig: None,
            manifests: None,
            hostname_override: None,
            node_ips: Vec::new(),
            interfaces: Vec::new(),
            xdp: XdpPolicy::Auto,
            lb_algorithm: LbAlgorithm::Random,
            cluster_cidr: None,
            pin_path: PathBuf::from(DEFAULT_PIN_PATH),
            socket_lb_cgroup: None,
            node_port_range: DEFAULT_NODE_PORT_RANGE.to_owned(),
            healthz_bind_address: None,
            metrics_bind_address: None,
            nodeport_addresses: None,
            masquerade_all: false,
            verbosity: None,
            logging_format: None,
            oom_score_adj: None,
            conntrack: ConntrackFlags::default(),
        }
    }
}
