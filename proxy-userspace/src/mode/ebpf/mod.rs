//! The eBPF data path: XDP and tc programs that DNAT Service traffic using
//! maps pinned under bpffs.
//!
//! The `Local` traffic policies: a frontend with one picks from this node's
//! backends only (a run of its Service port's backend set, see
//! `slot_layout::SlotLayout`), keeps the client's address (no SNAT mark, unless a
//! backend reaches itself) and drops new flows when it has none (XDP_DROP /
//! TC_ACT_SHOT, verdict `drop_no_local_backend`); a Service without any
//! endpoint is still rejected. Pods' new flows to a `Local` node port,
//! external or load balancer IP go to every endpoint, as kube-proxy
//! short-circuits traffic it can tell comes from a pod: their source is in
//! `clusterCIDR` (`pod_cidrs`; without one, nothing is short-circuited, as
//! in kube-proxy). The node's own
//! requests to its node ports, external and load balancer IPs are taken by
//! the socket programs (`socket_lb`), which short-circuit them to every
//! endpoint, as kube-proxy does.
//!
//! Tracked flows follow kube-proxy: a flow's conntrack entries hold its
//! backend (and its frontend, for the replies), so a TCP flow goes on to
//! its backend after the backend or the whole Service is removed, until the
//! flow ends (a new SYN on a closed or idle flow's tuple picks afresh: see
//! `proxy_common::conntrack`) or the sweep (`conntrack`) deletes it as
//! expired; after every sync the agent deletes
//! the entries of UDP flows whose backend left their frontend
//! (`stale_flows`), so their next datagram picks a current backend, or
//! passes untranslated if the Service is gone.
//!
//! The kernel's own conntrack is kept off flows to pods that the programs
//! translate alone (`notrack`): it would see only their forward half.
//! Flows the kernel source-NATs stay in it.
//!
//! Both families: IPv6 Service ports go to the programs' IPv6 maps (see
//! `service_maps`), node ports answer on the node's IPv6 addresses too,
//! the kernel masquerades marked IPv6 flows (ip6tables), and the socket
//! programs take the node's own IPv6 connections (`socket_lb`).

pub mod conntrack;
mod ids;
mod interfaces;
mod lb_maps;
pub mod legacy_ct;
mod loader;
pub mod maglev;
mod memory_maps;
mod node_chain;
pub mod notrack;
mod object;
pub mod old_maps;
mod pinned_maps;
pub mod pod_cidrs;
pub mod pod_veths;
mod port_filter;
pub mod sctp_fallback;
mod service_maps;
mod slot_layout;
mod snapshot;
pub mod snat;
pub mod socket_lb;
mod source_ranges;
pub mod stale_flows;
mod write_batch;
/// Attaches the uplink programs to `iface`. Under `--xdp auto` an uplink
/// whose driver refuses native XDP (bridges, bonds over such drivers, many
/// virtual NICs) gets the same programs at tc, with a warning, instead of
/// failing the start; an explicit `--xdp native` still fails.
fn attach_uplink(datapath: &mut Datapath, iface: &str, hook: Hook, policy: XdpPolicy) -> Result<()> {
    match datapath.attach(iface, hook) {
        Err(e) if hook == Hook::Uplink && policy == XdpPolicy::Auto => {
            warn!(
                iface,
                error = format!("{e:#}"),
                "native XDP refused on this uplink; falling back to tc"
            );
            datapath.attach(iface, Hook::UplinkTc)
        }
        attached => attached,
    }
}

#[cfg(test)]
mod maglev_tests;
#[cfg(test)]
mod writer_api_tests;
#[cfg(test)]
mod writer_tests;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    ops::RangeInclusive,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use anyhow::{Context, Result, bail};
pub use interfaces::{Interface, MissingInterface};
pub use lb_maps::LbMaps;
pub use loader::{
    Datapath, Hook, LINKS_DIR, LoadOptions, NotBpffs, detach_pinned_links, detach_tc_filters, has_tcx, link_pin,
};
pub use memory_maps::{FaultyMaps, MemoryMaps};
pub use object::object_bytes;
pub use pinned_maps::{PinnedMaps, get as pinned_entry, open as open_pinned, pinned, sum_verdicts};
pub use service_maps::{BackendsArray, ServiceMaps};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};
pub use write_batch::{Split, SplitStaged, Step, Table};

use super::{Dataplane, Plan, SyncedChange, options::local_node_port_ips, unhonoured::Unhonoured};
use crate::{
    config::{Cidr, Config, XdpPolicy},
    model::{IpFamily, LbAlgorithm, Problem, Protocol, ServicePort, ipv6},
};

/// Where the ebpf mode attaches and what it programs NodePorts on.
#[derive(Clone, Debug)]
pub struct EbpfOptions {
    pub pin_path: PathBuf,
    /// The node's IPv4 addresses (`--node-ip`): the uplinks are the
    /// interfaces carrying them unless `interfaces` names others, and the
    /// first is where the socket programs' replies come from. Not where
    /// NodePorts answer (local addresses of both families, see
    /// [`node_port_ips`]). If empty, `interfaces` must name the uplinks.
    pub node_ips: Vec<Ipv4Addr>,
    /// Uplinks by name; if empty, the interfaces carrying `node_ips`.
    pub interfaces: Vec<String>,
    /// kube-proxy's nodePortAddresses as CIDRs: NodePorts answer on every
    /// local address inside them. `None`: on every local address
    /// (see [`node_port_ips`]).
    pub node_port_cidrs: Option<Vec<Cidr>>,
    /// The skb mark bit for flows the kernel must masquerade (kube-proxy's
    /// masqueradeBit as a mask); 0 turns the SNAT fallback off.
    pub snat_mark: u32,
    /// The source ports the kernel masquerades to: outside the node port
    /// range (see `snat`).
    pub snat_ports: RangeInclusive<u16>,
    /// The skb mark bit that keeps the kernel's conntrack off a flow to a
    /// pod (see `notrack`); 0, or no pod networks: every flow is tracked.
    pub notrack_mark: u32,
    /// This node's name: endpoints naming another node are remote backends.
    pub node_name: Option<String>,
    /// kube-proxy's masqueradeAll.
    pub masquerade_all: bool,
    /// XDP on the uplinks, or tc only.
    pub xdp: XdpPolicy,
    /// New flows' algorithm for Service ports that name none.
    pub lb_algorithm: LbAlgorithm,
    /// The conntrack table's size and timeouts.
    pub conntrack: conntrack::CtSettings,
    /// The node's own traffic to its node ports (socket programs).
    pub socket_lb: socket_lb::SocketLbOptions,
    /// The pod networks (see `pod_cidrs`), as trie entries.
    pub pod_cidrs: pod_cidrs::PodNetworks,
}

impl EbpfOptions {
    /// What `config` asks of the ebpf mode.
    pub fn from_config(config: &Config) -> Self {
        Self {
            pin_path: config.pin_path.clone(),
            node_ips: config.ipv4_node_ips(),
            interfaces: config.interfaces.clone(),
            node_port_cidrs: config.node_port_addresses.cidrs().map(<[Cidr]>::to_vec),
            snat_mark: 1 << config.masquerade.bit,
            snat_ports: snat::ports_outside(&config.node_port_range),
            notrack_mark: notrack::mark_for(config.masquerade.bit),
            node_name: Some(config.node_name.clone()),
            masquerade_all: config.masquerade.all,
            xdp: config.xdp,
            lb_algorithm: config.lb_algorithm,
            conntrack: conntrack::CtSettings::from_config(&config.conntrack, online_cpus()),
            socket_lb: socket_lb::SocketLbOptions::from_config(config),
            pod_cidrs: pod_cidrs::from_config(config),
        }
    }
}

/// CPUs the kernel runs (kube-proxy sizes conntrack by them).
fn online_cpus() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
}

/// Starts the ebpf mode for `xproxy run` (see [`EbpfMode::start`]).
/// Fails with [`MissingInterface`] or [`NotBpffs`] (in the error's chain)
/// when those are why.
pub async fn start(config: &Config) -> Result<Box<dyn Dataplane>> {
    Ok(Box::new(EbpfMode::start(&EbpfOptions::from_config(config)).await?))
}

pub struct EbpfMode {
    maps: ServiceMaps,
    /// Shared with the task that attaches pod interfaces as they appear.
    datapath: Arc<Mutex<Datapath>>,
    /// Asks that task to look for pod interfaces without programs.
    rescan_pods: mpsc::Sender<()>,
    /// The addresses NodePorts answer on (see [`node_port_ips`]).
    node_port_ips: Vec<IpAddr>,
    /// See [`EbpfOptions::node_port_cidrs`].
    node_port_cidrs: Option<Vec<Cidr>>,
    pin_path: PathBuf,
    /// See [`EbpfOptions::snat_ports`].
    snat_ports: RangeInclusive<u16>,
    /// What the programs do differently from kube-proxy, reported once a port.
    unhonoured: Unhonoured,
    /// Says when the pod interfaces found at start are attached (see
    /// [`attach_pods_meanwhile`]); taken by the first sync.
    pods_attached: Option<std::sync::mpsc::Receiver<()>>,
    /// The SCTP ports whose port changes, NATed by the kernel.
    sctp: sctp_fallback::SctpFallback,
}

impl EbpfMode {
    /// Loads the programs (adopting maps and links an earlier agent pinned),
    /// attaches them to the uplinks and every pod interface, and keeps
    /// attaching pod interfaces that appear later. Must run inside a tokio
    /// runtime, in the node's network namespace.
    pub async fn start(opts: &EbpfOptions) -> Result<Self> {
        let snat_mark = install_snat_rules(opts.snat_mark, &opts.snat_ports);
        install_snat6_rules(snat_mark, &opts.snat_ports);
        let load = LoadOptions {
            snat_mark,
            notrack_mark: install_notrack_rules(opts.notrack_mark, &opts.pod_cidrs),
            conntrack: opts.conntrack,
        };
        let mut datapath = Datapath::load_with(&opts.pin_path, &load)?;
        // Before today's programs replace an older agent's on the uplinks.
        let carried = old_maps::carry_over(&opts.pin_path);
        let backends_array = if datapath.created_backends_array() && matches!(carried, Ok(None)) {
            BackendsArray::Created
        } else {
            BackendsArray::Adopted
        };
        match carried {
            Ok(None) => {}
            Ok(Some(done)) => info!(
                backends = done.backends,
                left_out = done.left_out,
                slots = done.slots,
                "an older agent's backends and slots carried over into today's maps"
            ),
            Err(e) => warn!(
                error = format!("{e:#}"),
                "an older agent's maps not carried over: its Services serve new flows after the first sync"
            ),
        }
        let (conn, handle, _) = rtnetlink::new_connection().context("opening rtnetlink")?;
        tokio::spawn(conn);
        let all = interfaces::list(&handle).await?;
        if opts.interfaces.is_empty() && opts.node_ips.is_empty() {
            bail!("the ebpf mode needs --node-ip or --interface to know the node's uplinks");
        }
        let uplinks = interfaces::uplinks(&all, &opts.interfaces, &opts.node_ips)?;
        let local = crate::sys::addrs::local_ips().context("listing the node's addresses")?;
        let node_ips = node_port_ips(local, opts.node_port_cidrs.as_deref());
        // The address the socket programs' replies seem to come from.
        let primary = opts
            .node_ips
            .first()
            .or_else(|| uplinks.iter().find_map(|u| u.ipv4.first()))
            .copied();
        for uplink in &uplinks {
            let hook = match opts.xdp {
                XdpPolicy::Native => Hook::Uplink,
                XdpPolicy::Off => Hook::UplinkTc,
                // A veth hands XDP an skb converted to an XDP buffer, often
                // by copying it: measured on the test bed, that costs about
                // 3 us per request more than tc doing the same work.
                XdpPolicy::Auto if uplink.is_veth => Hook::UplinkTc,
                XdpPolicy::Auto => Hook::Uplink,
            };
            attach_uplink(&mut datapath, &uplink.name, hook, opts.xdp)?;
        }
        let pods = interfaces::pod_interfaces(&all, &uplinks);
        let anchors = socket_lb::Anchors {
            v4: primary,
            // Any IPv6 node port address has every node port's frontend.
            v6: node_ips.iter().copied().find_map(ipv6),
        };
        start_socket_lb(&mut datapath, &opts.socket_lb, anchors).await;
        // Without them the pods' traffic is treated as the outside's: a
        // difference from kube-proxy, not a reason to stop.
        ok_or_warn(
            pod_cidrs::write(&opts.pin_path, &opts.pod_cidrs),
            "pod networks not written: pods' traffic to Local external frontends reaches this node's endpoints only",
        );
        // Now that no older program writes old entries any more.
        match legacy_ct::migrate(&opts.pin_path) {
            Ok(0) => {}
            Ok(n) => info!(entries = n, "conntrack entries of an older agent rewritten"),
            Err(e) => warn!(
                error = format!("{e:#}"),
                "conntrack entries of an older agent not rewritten"
            ),
        }
        let datapath = Arc::new(Mutex::new(datapath));
        let pods_attached = attach_pods_meanwhile(datapath.clone(), pods);
        let rescan_pods = spawn_pod_interface_watcher(datapath.clone(), uplinks, handle)?;
        spawn_conntrack_sweeper(opts.pin_path.clone(), opts.conntrack);
        let mut maps = ServiceMaps::open_with(&opts.pin_path, node_ips.clone(), backends_array)?;
        maps.set_topology(opts.node_name.clone(), opts.masquerade_all);
        maps.set_lb_default(opts.lb_algorithm);
        info!(adopted = maps.service_port_count(), ?node_ips, "ebpf data path ready");
        Ok(Self {
            maps,
            datapath,
            rescan_pods,
            node_port_ips: node_ips,
            node_port_cidrs: opts.node_port_cidrs.clone(),
            pin_path: opts.pin_path.clone(),
            snat_ports: opts.snat_ports.clone(),
            unhonoured: Unhonoured::default(),
            pods_attached: Some(pods_attached),
            sctp: sctp_fallback::SctpFallback::new(
                Box::new(crate::sys::nft::SystemNft::default()),
                snat_mark,
                opts.masquerade_all,
            ),
        })
    }

    pub fn maps(&self) -> &ServiceMaps {
        &self.maps
    }

    /// Runs `f` with the loaded programs (e.g. to attach by hand in tests).
    pub fn with_datapath<T>(&self, f: impl FnOnce(&mut Datapath) -> T) -> T {
        let mut guard = self.datapath.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut guard)
    }
}

/// The addresses NodePorts answer on, of the node's `local` ones: those
/// inside nodePortAddresses, or, without it, every one but loopback
/// addresses, as kube-proxy's `addrtype LOCAL` (the node's own connections
/// to 127.0.0.1 are the socket programs'; no packet from outside comes to
/// it); never an IPv6 link-local one (see [`local_node_port_ips`]).
fn node_port_ips(local: impl IntoIterator<Item = IpAddr>, cidrs: Option<&[Cidr]>) -> Vec<IpAddr> {
    let usable = local.into_iter().filter(|ip| cidrs.is_some() || !ip.is_loopback());
    local_node_port_ips(usable, cidrs)
}

/// Attaches the socket programs that take the node's own connections to
/// its node ports, external and load balancer IPs (see `socket_lb`), and
/// keeps their node addresses current. Without them the data path still
/// serves every other client: a failure is warned about, not fatal.
async fn start_socket_lb(datapath: &mut Datapath, opts: &socket_lb::SocketLbOptions, anchors: socket_lb::Anchors) {
    let started = match socket_lb::attach(datapath, opts, anchors) {
        Ok(()) => socket_lb::keep_node_addrs(datapath.pin_path().to_owned(), opts.clone()).await,
        Err(e) => Err(e),
    };
    if let Err(e) = started {
        warn!(
            error = format!("{e:#}"),
            "no socket programs: the node's own connections to its node ports will be refused"
        );
    }
}

/// Installs the kernel's masquerade rules for `mark`, to source `ports`;
/// returns the mark the programs may use (0 if the rules could not be
/// installed: then no flow is marked, rather than marked for a rule that is
/// not there).
fn install_snat_rules(mark: u32, ports: &RangeInclusive<u16>) -> u32 {
    if mark == 0 {
        return 0;
    }
    let mut iptables = crate::sys::iptables::SystemIptables::default();
    match iptables
        .check()
        .and_then(|()| snat::install(&mut iptables, mark, ports))
    {
        Ok(()) => mark,
        Err(e) => {
            warn!(
                error = format!("{e:#}"),
                "no SNAT fallback: hairpin, masqueradeAll and NodePorts to other nodes will not work"
            );
            0
        }
    }
}

/// Installs the IPv6 twin of the masquerade rules (ip6tables) for the mark
/// the programs use; without them, IPv6 flows that need SNAT (hairpin,
/// node ports to other nodes, masqueradeAll) fail, the rest still work.
fn install_snat6_rules(mark: u32, ports: &RangeInclusive<u16>) {
    if mark == 0 {
        return;
    }
    let mut ip6tables = crate::sys::iptables::SystemIptables::for_family(IpFamily::V6);
    let installed = ip6tables
        .check()
        .and_then(|()| snat::install(&mut ip6tables, mark, ports));
    ok_or_warn(
        installed,
        "no IPv6 SNAT fallback: IPv6 hairpin, masqueradeAll and NodePorts to other nodes will not work",
    );
}

/// Installs the rules that keep the kernel's conntrack off packets with
/// `mark`, in both families; returns the mark the programs may use: 0
/// without pod networks (no backend can be told to be a pod) or if
/// neither family's rule is there. A family without its rule tracks its
/// marked flows as before.
fn install_notrack_rules(mark: u32, pod_networks: &pod_cidrs::PodNetworks) -> u32 {
    if mark == 0 {
        return 0;
    }
    if pod_networks.v4.is_empty() && pod_networks.v6.is_empty() {
        // Seen on the test bed: behind such a rule a NodePort to a local
        // pod never completes a handshake.
        warn!(
            "no pod networks (clusterCIDR / --cluster-cidr): the kernel's conntrack sees only the \
             forward half of every Service flow, and a firewall rule dropping conntrack-invalid \
             forwarded packets (Calico's, many hosts') drops the rest of it"
        );
        return 0;
    }
    let mut installed = false;
    for family in [IpFamily::V4, IpFamily::V6] {
        let mut iptables = crate::sys::iptables::SystemIptables::for_family(family);
        match iptables.check().and_then(|()| notrack::install(&mut iptables, mark)) {
            Ok(()) => installed = true,
            Err(e) => warn!(
                error = format!("{e:#}"),
                ?family,
                "no notrack rule: the kernel's conntrack sees half of each Service flow to a pod \
                 (rules dropping its invalid packets drop them)"
            ),
        }
    }
    if installed { mark } else { 0 }
}

/// Deletes expired flows from the conntrack table every
/// [`conntrack::CtSettings::sweep_interval`] (see `conntrack`).
fn spawn_conntrack_sweeper(pin_path: PathBuf, settings: conntrack::CtSettings) {
    let interval = settings.sweep_interval();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let pin_path = pin_path.clone();
            let swept = tokio::task::spawn_blocking(move || conntrack::sweep(&pin_path, &settings.timeouts)).await;
            match swept {
                Ok(Ok(sweep)) if sweep.expired > 0 => {
                    debug!(entries = sweep.entries, expired = sweep.expired, "conntrack swept");
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => warn!(error = format!("{e:#}"), "sweeping the conntrack table"),
                Err(e) => warn!(error = %e, "the conntrack sweep panicked"),
            }
        }
    });
}

/// Attaches the programs to the pod interfaces found at start on a thread
/// of its own, while the first sync fills the maps: each attachment waits
/// for an RCU grace period in the kernel (~10-20 ms, two a pod), which
/// at start would add up before anything is programmed. The first sync
/// waits for it at its end ([`EbpfMode::wait_for_pods`]), so a node
/// reported ready has every pod of its start attached, as before. The
/// receiver hears when all are done.
fn attach_pods_meanwhile(datapath: Arc<Mutex<Datapath>>, pods: Vec<Interface>) -> std::sync::mpsc::Receiver<()> {
    let (done, attached) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        for pod in &pods {
            // A pod interface that vanished since the listing is not an error.
            attach_pod(&datapath, pod, "pod interface attached", false);
        }
        let _ = done.send(());
    });
    attached
}

/// Attaches the programs to pod interfaces as they appear (link events),
/// and, whenever asked (every full sync), to any pod interface that has
/// none: a link event can be missed (a netlink socket buffer overrun under
/// a burst of pod starts), and a pod without programs goes untranslated.
/// Returns the sender that asks for such a rescan.
fn spawn_pod_interface_watcher(
    datapath: Arc<Mutex<Datapath>>,
    uplinks: Vec<Interface>,
    handle: rtnetlink::Handle,
) -> Result<mpsc::Sender<()>> {
    let mut new_veths = interfaces::watch_new_veths()?;
    // One pending request is enough: a rescan looks at every interface.
    let (rescan, mut rescans) = mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                Some(iface) = new_veths.recv() => {
                    if !uplinks.iter().any(|u| u.index == iface.index) {
                        attach_pod(&datapath, &iface, "pod interface attached", true);
                    }
                }
                Some(()) = rescans.recv() => rescan_pods(&datapath, &uplinks, &handle).await,
                else => break,
            }
        }
    });
    Ok(rescan)
}

/// Attaches the pod programs to `pod` and lists it among the pod veths
/// replies may be handed into (see [`pod_veths`]); logs `done` (at debug
/// level unless `notable`) or the failure. Attaching again to an attached
/// interface only swaps the program in its pinned link (or filter), so
/// repeated events are harmless.
fn attach_pod(datapath: &Mutex<Datapath>, pod: &Interface, done: &str, notable: bool) {
    let mut datapath = datapath.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let iface = pod.name.as_str();
    if let Err(e) = datapath.attach(iface, Hook::Pod) {
        warn!(iface, error = format!("{e:#}"), "could not attach to a pod interface");
        return;
    }
    if let Err(e) = pod_veths::note(datapath.pin_path(), pod) {
        warn!(
            iface,
            error = format!("{e:#}"),
            "pod interface not listed: replies to it take the longer way through its node end"
        );
    }
    if notable {
        info!(iface, "{done}");
    } else {
        debug!(iface, "{done}");
    }
}

/// `result`'s value, or `None` after a warning that says what it means.
fn ok_or_warn<T>(result: Result<T>, meaning: &str) -> Option<T> {
    result.map_err(|e| warn!(error = format!("{e:#}"), "{meaning}")).ok()
}

/// Attaches to every pod interface that lacks its tc links, and makes the
/// pod veths listed for replies exactly the pod interfaces there are.
async fn rescan_pods(datapath: &Mutex<Datapath>, uplinks: &[Interface], handle: &rtnetlink::Handle) {
    let Some(all) = ok_or_warn(
        interfaces::list(handle).await,
        "cannot list interfaces to rescan pod interfaces",
    ) else {
        return;
    };
    let pods = interfaces::pod_interfaces(&all, uplinks);
    for pod in &pods {
        let attached = datapath
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .has_tc_links(&pod.name);
        match attached {
            Some(true) => {}
            // A pod the link events missed: worth a line in the log.
            Some(false) => attach_pod(datapath, pod, "pod interface attached by the full sync's rescan", true),
            // Filters (before 6.6) cannot be told apart: re-attach quietly.
            None => attach_pod(datapath, pod, "pod interface's filters refreshed by the rescan", false),
        }
    }
    let pin_path = datapath
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .pin_path()
        .to_owned();
    match pod_veths::write(&pin_path, &pods) {
        Ok(0) => {}
        Ok(unlisted) => debug!(unlisted, "veths of deleted pods unlisted"),
        Err(e) => warn!(
            error = format!("{e:#}"),
            "pod veths not rewritten: replies to pods take the longer way through the node's veth end"
        ),
    }
}

impl EbpfMode {
    /// Lists the node's addresses again, so that one added since the last
    /// full sync takes node ports from this one and a removed one gives
    /// them up (kube-proxy reads them at every sync, too). The socket
    /// programs follow address events on their own.
    fn follow_node_addresses(&mut self) {
        let Some(local) = ok_or_warn(
            crate::sys::addrs::local_ips(),
            "node addresses not listed: node ports stay where they are",
        ) else {
            return;
        };
        let node_ips = node_port_ips(local, self.node_port_cidrs.as_deref());
        if node_ips != self.node_port_ips {
            info!(was = ?self.node_port_ips, now = ?node_ips, "node port addresses changed");
            self.maps.set_node_ips(node_ips.clone());
            self.node_port_ips = node_ips;
        }
    }

    /// Waits, once, for the pod interfaces found at start to be attached
    /// (see [`attach_pods_meanwhile`]).
    fn wait_for_pods(&mut self) {
        let Some(attached) = self.pods_attached.take() else {
            return;
        };
        let since = std::time::Instant::now();
        // An error means the thread is gone: nothing left to wait for.
        let _ = attached.recv();
        debug!(
            waited_ms = since.elapsed().as_secs_f64() * 1e3,
            "the first sync waited for the pod interfaces"
        );
    }

    /// Reports, once a port, what the programs do differently from
    /// kube-proxy for the ports just programmed.
    fn note_unhonoured<'a>(&mut self, ports: impl Iterator<Item = &'a ServicePort>) {
        for port in ports {
            if let Some(how) = node_port_among_snat_ports(port, &self.snat_ports) {
                self.unhonoured.report(port, "nodePort", &how);
            }
            if !programs_translate(port) && sctp_fallback::leaves_out(port) {
                self.unhonoured
                    .report(port, "spec.ports[].protocol", sctp_fallback::NOT_APPLIED);
            }
        }
    }
}

/// Whether the programs translate `port`: every TCP and UDP port; an SCTP
/// port of either family only where no frontend's port changes on the way
/// to an endpoint (no node port, every endpoint on the Service's port),
/// since SCTP's CRC32c covers the ports but not the addresses (see
/// proxy-ebpf's `nat`). The others are the kernel's ([`sctp_fallback`]).
fn programs_translate(port: &ServicePort) -> bool {
    let same_port = port.node_port.is_none() && port.endpoints.iter().all(|e| e.port == port.port);
    port.protocol != Protocol::Sctp || same_port
}

/// Why `port`'s node port is at risk, if it is among the ports flows to
/// other nodes are masqueraded to (see `snat`).
fn node_port_among_snat_ports(port: &ServicePort, snat_ports: &RangeInclusive<u16>) -> Option<String> {
    let node_port = port.node_port.filter(|p| snat_ports.contains(p))?;
    Some(format!(
        "{node_port} is outside --node-port-range, among the ports flows to other nodes are \
         masqueraded to: a reply to such a flow may be taken for a new connection to it \
         (set --node-port-range to the API server's)"
    ))
}

impl Dataplane for EbpfMode {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn families(&self) -> &'static [IpFamily] {
        &[IpFamily::V4, IpFamily::V6]
    }

    fn take_problems(&mut self) -> Vec<Problem> {
        self.unhonoured.take()
    }

    fn apply(&mut self, plan: &Plan) -> Result<()> {
        self.maps.batch(|maps| {
            for port in &plan.remove {
                maps.remove_port(port)
                    .with_context(|| format!("removing {}", port.name))?;
            }
            for port in &plan.upsert {
                if !programs_translate(port) {
                    // It may have been served before its ports changed.
                    maps.remove_port(port)
                        .with_context(|| format!("removing {}", port.name))?;
                    continue;
                }
                maps.sync_service(port)
                    .with_context(|| format!("programming {}", port.name))?;
            }
            Ok(())
        })?;
        for port in &plan.remove {
            self.sctp.set(&port.name, None);
        }
        for port in &plan.upsert {
            self.sctp.set(&port.name, Some(port).filter(|p| !programs_translate(p)));
        }
        self.sctp.sync(&self.node_port_ips)?;
        self.note_unhonoured(plan.upsert.iter());
        self.wait_for_pods();
        Ok(())
    }

    fn apply_full(&mut self, desired: &BTreeMap<String, ServicePort>) -> Result<()> {
        self.follow_node_addresses();
        // Full (not yet run) means a rescan is already waiting.
        let _ = self.rescan_pods.try_send(());
        self.maps.batch(|maps| {
            // Removals first, as in `apply`: a frontend a removed port
            // shares with a desired one (a node port that moved) must end
            // up written, not deleted.
            let served: Vec<&ServicePort> = desired.values().filter(|p| programs_translate(p)).collect();
            maps.retain(&served)?;
            for port in served {
                maps.sync_service(port)
                    .with_context(|| format!("programming {}", port.name))?;
            }
            Ok(())
        })?;
        self.sctp.replace(desired.values().filter(|p| !programs_translate(p)));
        self.sctp.sync(&self.node_port_ips)?;
        self.note_unhonoured(desired.values());
        self.wait_for_pods();
        Ok(())
    }

    fn kernel_writes(&self) -> u64 {
        self.maps.writes()
    }

    /// Deletes the programs' conntrack entries of UDP flows whose backend
    /// left (see `stale_flows`): after every full sync (the flows may
    /// predate this agent), and after a partial one that touched a UDP port.
    /// The state before the sync does not matter: the entries are judged
    /// against the maps.
    fn delete_stale_flows(&mut self, change: &SyncedChange<'_>) -> u64 {
        let plan = change.plan;
        let touched_udp = plan
            .remove
            .iter()
            .chain(&plan.upsert)
            .any(|p| p.protocol == Protocol::Udp);
        if !change.full && !touched_udp {
            return 0;
        }
        match stale_flows::delete_stale_udp_flows(&self.pin_path, &self.maps) {
            Ok(n) => {
                if n > 0 {
                    debug!(entries = n, "deleted conntrack entries of stale UDP flows");
                }
                n
            }
            Err(e) => {
                warn!(error = format!("{e:#}"), "deleting stale UDP flows");
                0
            }
        }
    }
}
