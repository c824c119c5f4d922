//! The socket the agent listens on for one service port, and the task that
//! serves it. The port number is free on the node (any, or one of
//! `portRange` when it is set, as kube-proxy's userspace mode did); the
//! iptables rules send the Service's traffic there. An IPv6 service port
//! gets an IPv6 socket (`IPV6_V6ONLY`: the IPv4 port of the same Service
//! has its own), which the ip6tables rules send its traffic to.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    ops::RangeInclusive,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result, anyhow};
use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrIn, SockaddrIn6, bind as bind_fd, setsockopt, socket, sockopt,
};
use tokio::{
    net::{TcpListener, TcpSocket, UdpSocket},
    runtime::Handle,
    task::JoinHandle,
};

use super::{
    balancer::{Balancer, endpoint_addrs},
    pktinfo, tcp, udp,
};
use crate::model::{IpFamily, Protocol, ServicePort};

/// Pending connections per TCP listener (the kernel caps it at somaxconn).
const BACKLOG: u32 = 1024;

/// Where and how the proxies listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenOptions {
    /// `0.0.0.0` on a node: REDIRECT delivers to the address of the
    /// interface a packet came in on, so every local address must do.
    pub ip: Ipv4Addr,
    /// The same for IPv6 service ports, `::` on a node.
    pub ip6: Ipv6Addr,
    /// Ports to choose from (`portRange`); `None`: any free port.
    pub port_range: Option<RangeInclusive<u16>>,
    pub udp_idle_timeout: Duration,
}

impl Default for ListenOptions {
    fn default() -> Self {
        Self {
            ip: Ipv4Addr::UNSPECIFIED,
            ip6: Ipv6Addr::UNSPECIFIED,
            port_range: None,
            udp_idle_timeout: udp::DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// One service port's proxy: a bound socket served by a task until dropped.
pub struct PortProxy {
    protocol: Protocol,
    port: u16,
    balancer: Arc<Balancer>,
    task: JoinHandle<()>,
}

impl PortProxy {
    /// Binds a socket for `service` and starts serving it on `runtime`.
    pub fn open(runtime: &Handle, opts: &ListenOptions, service: &ServicePort) -> Result<Self> {
        // Sockets register with the runtime's reactor when created.
        let _entered = runtime.enter();
        let balancer = Arc::new(Balancer::new(endpoint_addrs(service)));
        balancer.set_affinity(service.affinity);
        let name: Arc<str> = service.name.as_str().into();
        let ip = match service.family() {
            IpFamily::V4 => IpAddr::V4(opts.ip),
            IpFamily::V6 => IpAddr::V6(opts.ip6),
        };
        let (port, task) = match service.protocol {
            Protocol::Tcp => {
                let listener = bind(ip, opts, bind_tcp)?;
                let port = listener.local_addr()?.port();
                (port, runtime.spawn(tcp::serve(listener, balancer.clone(), name)))
            }
            Protocol::Udp => {
                let socket = bind(ip, opts, bind_udp)?;
                let port = socket.local_addr()?.port();
                let serve = udp::serve(socket, balancer.clone(), opts.udp_idle_timeout, name);
                (port, runtime.spawn(serve))
            }
        };
        Ok(Self {
            protocol: service.protocol,
            port,
            balancer,
            task,
        })
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The local port the rules redirect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Takes `service`'s current endpoints and affinity; returns whether
    /// the endpoints changed.
    pub fn update(&self, service: &ServicePort) -> bool {
        self.balancer.set_affinity(service.affinity);
        self.balancer.set(endpoint_addrs(service))
    }
}

impl Drop for PortProxy {
    /// Stops listening (and ends the UDP sessions); accepted TCP
    /// connections run on.
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds `ip` with `bind_one` on a port of `opts.port_range`, or any port.
fn bind<S>(ip: IpAddr, opts: &ListenOptions, bind_one: impl Fn(SocketAddr) -> io::Result<S>) -> Result<S> {
    let Some(range) = &opts.port_range else {
        return bind_one(SocketAddr::new(ip, 0)).with_context(|| format!("binding a port on {ip}"));
    };
    for port in range.clone() {
        let addr = SocketAddr::new(ip, port);
        match bind_one(addr) {
            Ok(socket) => return Ok(socket),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
            Err(e) => return Err(e).with_context(|| format!("binding {addr}")),
        }
    }
    Err(anyhow!("no free port in portRange {range:?}"))
}

fn v6_only(socket: &impl AsFd) -> io::Result<()> {
    setsockopt(socket, sockopt::Ipv6V6Only, &true).map_err(io::Error::from)
}

fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv6() {
        let socket = TcpSocket::new_v6()?;
        v6_only(&socket)?;
        socket
    } else {
        TcpSocket::new_v4()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// A UDP socket made by hand: `IPV6_V6ONLY` must be set before `bind`,
/// and std's `UdpSocket::bind` binds while it creates.
fn bind_udp(addr: SocketAddr) -> io::Result<UdpSocket> {
    let family = if addr.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    let fd: OwnedFd = socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    if addr.is_ipv6() {
        v6_only(&fd)?;
    }
    let raw = fd.as_raw_fd();
    match addr {
        SocketAddr::V4(v4) => bind_fd(raw, &SockaddrIn::from(v4)),
        SocketAddr::V6(v6) => bind_fd(raw, &SockaddrIn6::from(v6)),
    }?;
    let socket = std::net::UdpSocket::from(fd);
    socket.set_nonblocking(true)?;
    pktinfo::enable(&socket, addr.is_ipv6())?;
    UdpSocket::from_std(socket)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Endpoint;

    fn service(protocol: Protocol) -> ServicePort {
        ServicePort {
            name: "default/web".into(),
            protocol,
            cluster_ip: Ipv4Addr::new(10, 96, 0, 1).into(),
            port: 80,
            node_port: None,
            endpoints: vec![Endpoint::ready(Ipv4Addr::LOCALHOST, 9)],
            ..ServicePort::default()
        }
    }

    fn localhost(port_range: Option<RangeInclusive<u16>>) -> ListenOptions {
        ListenOptions {
            ip: Ipv4Addr::LOCALHOST,
            port_range,
            ..ListenOptions::default()
        }
    }

    #[tokio::test]
    async fn the_port_range_is_honoured_and_skips_ports_in_use() {
        let taken = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let first = taken.local_addr().expect("address").port();
        let Some(last) = first.checked_add(20) else { return };
        let opts = localhost(Some(first..=last));
        let proxy = PortProxy::open(&Handle::current(), &opts, &service(Protocol::Tcp)).expect("open");
        assert!((first + 1..=last).contains(&proxy.port()), "port {}", proxy.port());
        let full = localhost(Some(first..=first));
        let err = PortProxy::open(&Handle::current(), &full, &service(Protocol::Tcp))
            .err()
            .expect("no free port");
        assert!(err.to_string().contains("no free port"), "{err}");
    }

    #[tokio::test]
    async fn dropping_the_proxy_stops_listening() {
        let opts = localhost(None);
        let proxy = PortProxy::open(&Handle::current(), &opts, &service(Protocol::Tcp)).expect("open");
        let addr = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), proxy.port());
        tokio::net::TcpStream::connect(addr).await.expect("listening");
        drop(proxy);
        let refused = tokio::time::timeout(Duration::from_secs(2), async {
            while tokio::net::TcpStream::connect(addr).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(refused.is_ok(), "{addr} still accepts after the proxy was dropped");
    }

    #[tokio::test]
    async fn update_reports_changes() {
        let opts = localhost(None);
        let mut svc = service(Protocol::Udp);
        let proxy = PortProxy::open(&Handle::current(), &opts, &svc).expect("open");
        assert_eq!(proxy.protocol(), Protocol::Udp);
        assert!(!proxy.update(&svc));
        svc.endpoints.push(Endpoint::ready(Ipv4Addr::LOCALHOST, 10));
        assert!(proxy.update(&svc));
    }
}
