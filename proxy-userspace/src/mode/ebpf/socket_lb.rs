//! The node's own traffic to its node ports, external and load balancer IPs:
//! the socket programs (`proxy-ebpf/src/socket_lb.rs`) attached to a
//! cgroup, the node's network namespace cookie they check, and the node
//! addresses they take node ports on, kept current as addresses come and go.
//!
//! Why sockets and not packets: the node's connection to one of its own
//! addresses goes through `lo`, where no tc or XDP program runs. kube-proxy
//! DNATs it in netfilter's OUTPUT hook; the programs here rewrite the
//! destination when the socket connects or sends instead, as Cilium's
//! kube-proxy replacement does.
//!
//! Why the root cgroup, filtered by network namespace: cgroup programs run
//! for every process of the cgroup's subtree, whatever its network
//! namespace, and the node's processes can sit anywhere in the hierarchy.
//! So the programs are attached (as bpf links, which run beside anyone
//! else's programs) to the root of the cgroup v2 hierarchy by default
//! (`--socket-lb-cgroup` picks another), and act only on sockets of the
//! namespace whose cookie the agent writes into their config map: several
//! agents on one host, each in its own namespace (the test beds), leave
//! each other's sockets alone. The links are pinned beside the tc links
//! (`links/<program>/cgroup`), so they outlive the agent like the rest of
//! the data path and `xproxy cleanup` detaches them with the others.
//!
//! IPv6 sockets have programs and maps of their own (`socket_lb6` in
//! proxy-ebpf), fed the same way: the node's IPv6 addresses that take node
//! ports (never `::1`: kube-proxy's `localhostNodePorts` is IPv4's, and
//! never a link-local one) and an IPv6 anchor.

use std::{
    collections::BTreeSet,
    fs::File,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV6, UdpSocket},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    maps::{Array, HashMap, MapData},
    programs::{CgroupAttachMode, links::FdLink},
};
use futures_util::StreamExt;
use proxy_common::{
    ipv6::{Addr6, addr6_be, ipv6_of},
    socket_lb::{self, NODE_ADDR_PRESENT, SockLbConfig, SockLbConfig6, SockRev6Key, SockRev6Value},
};
use rtnetlink::{MulticastGroup, packet_core::NetlinkPayload, packet_route::RouteNetlinkMessage};
use tracing::{debug, info, warn};

use super::{
    loader::{Datapath, open_pinned_link, pin_link},
    pinned_maps::{open, pinned},
};
use crate::{
    config::Config,
    mode::options::FamilyNodePorts,
    model::{IpFamily, ipv4, ipv6},
};

/// What the socket programs are attached to and which node addresses take
/// node ports.
#[derive(Clone, Debug)]
pub struct SocketLbOptions {
    /// The cgroup v2 directory; `None`: the root of the hierarchy.
    pub cgroup: Option<PathBuf>,
    /// kube-proxy's `nodePortAddresses`, for IPv4.
    pub scope: FamilyNodePorts,
    /// kube-proxy's `nodePortAddresses`, for IPv6.
    pub scope6: FamilyNodePorts,
    /// `iptables.localhostNodePorts`: node ports answer on `127.0.0.1`
    /// too (kube-proxy's iptables mode, the default, does; its nftables and
    /// IPVS modes do not). Only where `scope` takes loopback addresses.
    pub localhost: bool,
}

impl SocketLbOptions {
    pub fn from_config(config: &Config) -> Self {
        Self {
            cgroup: config.socket_lb_cgroup.clone(),
            scope: FamilyNodePorts::from_config(config, IpFamily::V4),
            scope6: FamilyNodePorts::from_config(config, IpFamily::V6),
            localhost: config.localhost_node_ports,
        }
    }
}

/// Attaches the socket programs to the cgroup of `opts`, pinned, replacing
/// (without a gap) the links an earlier agent pinned; then points them at
/// this network namespace with `anchors` (IPv4, IPv6) as the node IPs
/// whose node port frontends serve every node address of their family.
pub fn attach(datapath: &mut Datapath, opts: &SocketLbOptions, anchors: Anchors) -> Result<()> {
    let cgroup = open_cgroup(opts.cgroup.as_deref())?;
    for name in socket_lb::PROGRAMS {
        attach_one(datapath, &cgroup, name).with_context(|| format!("attaching {name} to the cgroup"))?;
    }
    // IPv6's anchor first: the cookie turns the programs on.
    let config6 = SockLbConfig6::new(anchors.v6);
    write_config(datapath.pin_path(), socket_lb::SOCK_CONFIG6, config6)?;
    let config = SockLbConfig::new(netns_cookie()?, anchors.v4);
    write_config(datapath.pin_path(), socket_lb::SOCK_CONFIG, config)?;
    info!(netns_cookie = config.netns_cookie, ?anchors, "socket programs attached");
    Ok(())
}

/// The node IPs whose node port frontends serve node ports on every node
/// address of their family (see [`attach`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Anchors {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

/// Writes the only element of the config map `name`.
fn write_config<T: aya::Pod>(pin_path: &Path, name: &str, config: T) -> Result<()> {
    let mut map: Array<MapData, T> =
        Array::try_from(pinned(pin_path, name)?).with_context(|| format!("{name} has an unexpected layout"))?;
    map.set(0, config, 0).with_context(|| format!("writing {name}"))
}

/// A new link first, then the old one detached: for a moment both run,
/// which is harmless (the second sees a backend, no frontend).
fn attach_one(datapath: &mut Datapath, cgroup: &File, name: &str) -> Result<()> {
    let pin = datapath.link_pin(CGROUP_LINK, name);
    let old = open_pinned_link(&pin)?;
    let prog = datapath.socket_program(name)?;
    // A bpf link (aya makes one from 5.7 on) runs beside every other
    // program of the cgroup whatever the mode; the kernel refuses any
    // flag on a cgroup link (EINVAL), and `Single` is no flag.
    let id = prog.attach(cgroup, CgroupAttachMode::Single)?;
    let link = FdLink::try_from(prog.take_link(id)?).context("cgroup program attached without a bpf link")?;
    if let Some(old) = old {
        drop(old);
        bpf_sys::obj::detach_pinned_link(&pin).context("detaching the earlier agent's link")?;
        std::fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
    }
    pin_link(link, &pin)
}

/// The name of the socket programs' links under `links/<program>/`.
const CGROUP_LINK: &str = "cgroup";

/// The cgroup directory at `path`, or the root of the cgroup v2 hierarchy:
/// where it is mounted, or (a machine that has only cgroup v1 mounted, the
/// test VM) mounted for the moment on a directory of our own (the
/// attachment holds the cgroup, not the mount).
fn open_cgroup(path: Option<&Path>) -> Result<File> {
    if let Some(path) = path {
        return File::open(path).with_context(|| format!("opening cgroup {}", path.display()));
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    if let Some(root) = cgroup2_root(&mountinfo) {
        return File::open(&root).with_context(|| format!("opening cgroup {}", root.display()));
    }
    open_cgroup2_root_by_mounting()
}

/// The mount point of the cgroup v2 hierarchy's root, from
/// `/proc/self/mountinfo` (a mount of a sub-cgroup, as a container's
/// cgroup namespace shows it, does not count).
fn cgroup2_root(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (fields, rest) = line.split_once(" - ")?;
        let fields: Vec<&str> = fields.split(' ').collect();
        let fstype = rest.split(' ').next()?;
        let mount_point = fields.get(4)?;
        (fstype == "cgroup2" && fields.get(3) == Some(&"/")).then(|| PathBuf::from(mount_point))
    })
}

fn open_cgroup2_root_by_mounting() -> Result<File> {
    let dir = std::env::temp_dir().join(format!("xproxy-cgroup2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let c_dir = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).context("temporary directory name")?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the
    // call; no data argument.
    let rc = unsafe {
        libc::mount(
            c"cgroup2".as_ptr(),
            c_dir.as_ptr(),
            c"cgroup2".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    let opened = if rc == 0 {
        let opened = File::open(&dir).context("opening the cgroup v2 root");
        // SAFETY: as above. Lazily: our descriptor holds the cgroup, not the mount.
        unsafe { libc::umount2(c_dir.as_ptr(), libc::MNT_DETACH) };
        opened
    } else {
        Err(std::io::Error::last_os_error())
            .with_context(|| format!("no cgroup v2 mounted, and mounting one on {} failed", dir.display()))
    };
    if let Err(e) = std::fs::remove_dir(&dir) {
        debug!(error = %e, "removing the temporary cgroup v2 mount point");
    }
    opened
}

/// The cookie of the calling thread's network namespace.
fn netns_cookie() -> Result<u64> {
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).context("opening a socket for SO_NETNS_COOKIE")?;
    let mut cookie: u64 = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<u64>()).context("socklen")?;
    // SAFETY: `cookie` is a valid u64 and `len` says so; the kernel writes
    // at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("SO_NETNS_COOKIE (Linux 5.14 or newer)");
    }
    if cookie == 0 {
        bail!("the kernel returned network namespace cookie 0");
    }
    Ok(cookie)
}

/// The local addresses that take node ports under `opts`, out of every
/// local IPv4 address `local`.
pub fn node_port_addresses(opts: &SocketLbOptions, local: &[Ipv4Addr]) -> BTreeSet<Ipv4Addr> {
    let local: Vec<IpAddr> = local.iter().copied().map(IpAddr::V4).collect();
    of_family(&opts.scope, opts.localhost, &local)
        .into_iter()
        .filter_map(ipv4)
        .collect()
}

/// The local IPv6 addresses that take node ports under `opts`, out of
/// every local IPv6 address `local`: never loopback (kube-proxy's
/// `localhostNodePorts` is IPv4's) nor link-local (see
/// `crate::mode::options::local_node_port_ips`).
pub fn node_port_addresses6(opts: &SocketLbOptions, local: &[Ipv6Addr]) -> BTreeSet<Ipv6Addr> {
    let local: Vec<IpAddr> = local
        .iter()
        .filter(|ip| !ip.is_unicast_link_local())
        .copied()
        .map(IpAddr::V6)
        .collect();
    of_family(&opts.scope6, false, &local)
        .into_iter()
        .filter_map(ipv6)
        .collect()
}

/// The addresses of `local` (of one family) that `scope` takes; loopback
/// ones only if `localhost` allows them.
fn of_family(scope: &FamilyNodePorts, localhost: bool, local: &[IpAddr]) -> Vec<IpAddr> {
    let loopback_ok = |ip: &IpAddr| !ip.is_loopback() || localhost;
    match scope {
        FamilyNodePorts::AllLocal { localhost: all } => local
            .iter()
            .copied()
            .filter(|ip| !ip.is_loopback() || (*all && localhost))
            .collect(),
        FamilyNodePorts::NodeIps(ips) => ips.clone(),
        FamilyNodePorts::Cidrs(cidrs) => local
            .iter()
            .copied()
            .filter(|ip| loopback_ok(ip) && cidrs.iter().any(|c| c.contains(*ip)))
            .collect(),
    }
}

/// Makes the node address map `name` hold exactly `wanted`.
fn write_node_addrs<K: aya::Pod + PartialEq>(pin_path: &Path, name: &str, wanted: &[K]) -> Result<()> {
    let mut map: HashMap<MapData, K, u32> = open(pin_path, name)?;
    let present: Vec<K> = map.keys().collect::<Result<_, _>>().context("listing node addresses")?;
    for old in present.iter().filter(|old| !wanted.contains(old)) {
        map.remove(old).context("removing a node address")?;
    }
    for key in wanted {
        map.insert(key, NODE_ADDR_PRESENT, 0).context("adding a node address")?;
    }
    Ok(())
}

/// The keys of the node address map `name`.
fn node_addr_keys<K: aya::Pod>(pin_path: &Path, name: &str) -> Result<Vec<K>> {
    let map: HashMap<MapData, K, u32> = open(pin_path, name)?;
    map.keys().map(|k| k.context("listing node addresses")).collect()
}

/// The node IPv4 addresses the socket programs take node ports on, read back.
pub fn read_node_addrs(pin_path: &Path) -> Result<BTreeSet<Ipv4Addr>> {
    let keys: Vec<u32> = node_addr_keys(pin_path, socket_lb::NODE_ADDRS)?;
    Ok(keys.into_iter().map(|k| Ipv4Addr::from(k.to_ne_bytes())).collect())
}

/// The node IPv6 addresses the socket programs take node ports on, read back.
pub fn read_node_addrs6(pin_path: &Path) -> Result<BTreeSet<Ipv6Addr>> {
    let keys: Vec<Addr6> = node_addr_keys(pin_path, socket_lb::NODE_ADDRS6)?;
    Ok(keys.into_iter().map(ipv6_of).collect())
}

/// The IPv6 reverse translations the socket programs remember:
/// (socket cookie, backend, frontend the socket addressed).
pub fn read_sock_rev6(pin_path: &Path) -> Result<Vec<(u64, SocketAddrV6, SocketAddrV6)>> {
    // aya's HashMap opens an LRU hash map too.
    let map: HashMap<MapData, SockRev6Key, SockRev6Value> = open(pin_path, socket_lb::SOCK_REV_NAT6)?;
    let at = |addr_be, port_be| SocketAddrV6::new(ipv6_of(addr_be), u16::from_be(port_be), 0, 0);
    map.iter()
        .map(|entry| {
            let (key, value) = entry.context("listing the IPv6 socket reverse map")?;
            Ok((
                key.cookie,
                at(key.addr_be, key.port_be),
                at(value.addr_be, value.port_be),
            ))
        })
        .collect()
}

/// Writes the node addresses now and again whenever an address is added
/// or removed in this network namespace.
pub async fn keep_node_addrs(pin_path: PathBuf, opts: SocketLbOptions) -> Result<()> {
    // Subscribed before the first listing, so no change slips between.
    let (conn, _, mut events) =
        rtnetlink::new_multicast_connection(&[MulticastGroup::Ipv4Ifaddr, MulticastGroup::Ipv6Ifaddr])
            .context("subscribing to address events")?;
    tokio::spawn(conn);
    sync_node_addrs(&pin_path, &opts)?;
    tokio::spawn(async move {
        while let Some((msg, _)) = events.next().await {
            if !matches!(
                msg.payload,
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(_) | RouteNetlinkMessage::DelAddress(_))
            ) {
                continue;
            }
            if let Err(e) = sync_node_addrs(&pin_path, &opts) {
                warn!(
                    error = format!("{e:#}"),
                    "updating the node addresses of the socket programs"
                );
            }
        }
    });
    Ok(())
}

fn sync_node_addrs(pin_path: &Path, opts: &SocketLbOptions) -> Result<()> {
    let local = crate::sys::addrs::local_ips().context("listing the node's addresses")?;
    let (local4, local6): (Vec<IpAddr>, Vec<IpAddr>) = local.into_iter().partition(IpAddr::is_ipv4);
    let local4: Vec<Ipv4Addr> = local4.into_iter().filter_map(ipv4).collect();
    let local6: Vec<Ipv6Addr> = local6.into_iter().filter_map(ipv6).collect();
    let wanted = node_port_addresses(opts, &local4);
    let wanted6 = node_port_addresses6(opts, &local6);
    write_node_addresses(pin_path, &wanted, &wanted6)?;
    debug!(?wanted, ?wanted6, "node addresses of the socket programs");
    Ok(())
}

/// Makes the node address maps of both families hold exactly `v4` and `v6`.
pub fn write_node_addresses(pin_path: &Path, v4: &BTreeSet<Ipv4Addr>, v6: &BTreeSet<Ipv6Addr>) -> Result<()> {
    let keys: Vec<u32> = v4.iter().map(|ip| u32::from_ne_bytes(ip.octets())).collect();
    write_node_addrs(pin_path, socket_lb::NODE_ADDRS, &keys)?;
    let keys6: Vec<Addr6> = v6.iter().copied().map(addr6_be).collect();
    write_node_addrs(pin_path, socket_lb::NODE_ADDRS6, &keys6)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(scope: FamilyNodePorts, localhost: bool) -> SocketLbOptions {
        SocketLbOptions {
            cgroup: None,
            scope6: scope.clone(),
            scope,
            localhost,
        }
    }

    fn ip(text: &str) -> Ipv4Addr {
        text.parse().expect("ip")
    }

    #[test]
    fn node_port_addresses_follow_node_port_addresses_and_localhost_node_ports() {
        let local = [ip("127.0.0.1"), ip("172.30.0.2"), ip("10.1.0.5")];
        let all = |localhost| node_port_addresses(&opts(FamilyNodePorts::AllLocal { localhost }, true), &local);
        assert_eq!(all(true), local.into_iter().collect());
        assert_eq!(all(false), [ip("172.30.0.2"), ip("10.1.0.5")].into_iter().collect());
        let cidrs = |localhost| {
            let scope = FamilyNodePorts::Cidrs(vec![
                "127.0.0.0/8".parse().expect("cidr"),
                "10.0.0.0/8".parse().expect("cidr"),
            ]);
            node_port_addresses(&opts(scope, localhost), &local)
        };
        assert_eq!(cidrs(true), [ip("127.0.0.1"), ip("10.1.0.5")].into_iter().collect());
        assert_eq!(cidrs(false), [ip("10.1.0.5")].into_iter().collect());
        let primary = node_port_addresses(
            &opts(FamilyNodePorts::NodeIps(vec![ip("172.30.0.2").into()]), true),
            &local,
        );
        assert_eq!(primary, [ip("172.30.0.2")].into_iter().collect());
    }

    fn ip6(text: &str) -> Ipv6Addr {
        text.parse().expect("ip")
    }

    #[test]
    fn ipv6_node_port_addresses_leave_out_loopback_and_link_local() {
        let local = [ip6("::1"), ip6("fe80::1"), ip6("fd00:30::2"), ip6("2001:db8::5")];
        let set = |ips: &[&str]| ips.iter().map(|i| ip6(i)).collect::<BTreeSet<_>>();
        let all = node_port_addresses6(&opts(FamilyNodePorts::AllLocal { localhost: true }, true), &local);
        assert_eq!(all, set(&["fd00:30::2", "2001:db8::5"]));
        let scope = FamilyNodePorts::Cidrs(vec![
            "::1/128".parse().expect("cidr"),
            "fd00::/16".parse().expect("cidr"),
        ]);
        assert_eq!(node_port_addresses6(&opts(scope, true), &local), set(&["fd00:30::2"]));
        let primary = FamilyNodePorts::NodeIps(vec![ip6("fd00:30::2").into(), ip("172.30.0.2").into()]);
        assert_eq!(node_port_addresses6(&opts(primary, true), &local), set(&["fd00:30::2"]));
    }

    #[test]
    fn the_cgroup2_root_is_the_mount_of_the_hierarchy_root() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs ro,mode=755
35 30 0:31 /kubepods/pod1 /sys/fs/cgroup/sub rw - cgroup2 cgroup2 rw
36 30 0:31 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
";
        assert_eq!(cgroup2_root(mountinfo), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_root("30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs ro\n"), None);
    }
}
