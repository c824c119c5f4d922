//! Datagrams together with the local address they were sent to, and
//! replies sent from that same address (`IP_PKTINFO`, `IPV6_PKTINFO` on an
//! IPv6 socket).
//!
//! A service socket is bound to `0.0.0.0`, and the REDIRECT/DNAT rules send
//! it datagrams for several local addresses (the pod-side address of a
//! veth, the node IP, 127.0.0.1). A reply must leave from the address the
//! datagram was NATed to: only then does conntrack recognise it as the
//! reply of the client's flow and rewrite its source back to the Service
//! address. A plain `send_to` would let routing pick the source (the node's
//! own traffic, redirected to 127.0.0.1, would be answered from the node IP),
//! and the client's connected socket would never see the answer.

use std::{
    io::{self, IoSlice, IoSliceMut},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsFd, AsRawFd, RawFd},
};

use nix::{
    cmsg_space,
    sys::socket::{
        ControlMessage, ControlMessageOwned, MsgFlags, SockaddrIn, SockaddrIn6, SockaddrLike, SockaddrStorage, recvmsg,
        sendmsg, setsockopt,
        sockopt::{Ipv4PacketInfo, Ipv6RecvPacketInfo},
    },
};
use tokio::{io::Interest, net::UdpSocket};

/// Asks the kernel to report each datagram's destination address, on a
/// socket of `ipv6`'s family.
pub fn enable(socket: &impl AsFd, ipv6: bool) -> io::Result<()> {
    if ipv6 {
        setsockopt(socket, Ipv6RecvPacketInfo, &true).map_err(io::Error::from)
    } else {
        setsockopt(socket, Ipv4PacketInfo, &true).map_err(io::Error::from)
    }
}

/// One datagram received into the caller's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub len: usize,
    pub from: SocketAddr,
    /// The destination address in its IP header (after NAT).
    pub to: IpAddr,
}

/// Receives one datagram from a socket with [`enable`]d pktinfo.
pub async fn recv(socket: &UdpSocket, buf: &mut [u8]) -> io::Result<Received> {
    let fd = socket.as_raw_fd();
    socket.async_io(Interest::READABLE, || recv_now(fd, buf)).await
}

/// Sends `data` to `to` with the source address `from`.
pub async fn send(socket: &UdpSocket, data: &[u8], from: IpAddr, to: SocketAddr) -> io::Result<usize> {
    let fd = socket.as_raw_fd();
    socket
        .async_io(Interest::WRITABLE, || send_now(fd, data, from, to))
        .await
}

fn in_addr(ip: Ipv4Addr) -> libc::in_addr {
    libc::in_addr {
        s_addr: u32::from(ip).to_be(),
    }
}

/// The sender's address, IPv4 or IPv6.
fn socket_addr(addr: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = addr.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    addr.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
}

fn recv_now(fd: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut control = cmsg_space!(libc::in6_pktinfo);
    let msg = recvmsg::<SockaddrStorage>(fd, &mut iov, Some(&mut control), MsgFlags::MSG_DONTWAIT)?;
    let from = msg
        .address
        .as_ref()
        .and_then(socket_addr)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not an IP sender"))?;
    let to = msg
        .cmsgs()?
        .find_map(|cmsg| match cmsg {
            ControlMessageOwned::Ipv4PacketInfo(info) => {
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr))))
            }
            ControlMessageOwned::Ipv6PacketInfo(info) => Some(IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr))),
            _ => None,
        })
        .ok_or_else(|| io::Error::other("no IP_PKTINFO with the datagram"))?;
    Ok(Received {
        len: msg.bytes,
        from,
        to,
    })
}

fn send_now(fd: RawFd, data: &[u8], from: IpAddr, to: SocketAddr) -> io::Result<usize> {
    let iov = [IoSlice::new(data)];
    match (from, to) {
        (IpAddr::V4(from), SocketAddr::V4(to)) => {
            let info = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: in_addr(from),
                ipi_addr: in_addr(Ipv4Addr::UNSPECIFIED),
            };
            let cmsg = [ControlMessage::Ipv4PacketInfo(&info)];
            send_with(fd, &iov, &cmsg, &SockaddrIn::from(to))
        }
        (IpAddr::V6(from), SocketAddr::V6(to)) => {
            let info = libc::in6_pktinfo {
                ipi6_addr: libc::in6_addr { s6_addr: from.octets() },
                ipi6_ifindex: 0,
            };
            let cmsg = [ControlMessage::Ipv6PacketInfo(&info)];
            send_with(fd, &iov, &cmsg, &SockaddrIn6::from(to))
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a reply from {from} cannot go to {to}"),
        )),
    }
}

fn send_with(
    fd: RawFd,
    iov: &[IoSlice<'_>],
    cmsgs: &[ControlMessage<'_>],
    to: &impl SockaddrLike,
) -> io::Result<usize> {
    Ok(sendmsg(fd, iov, cmsgs, MsgFlags::MSG_DONTWAIT, Some(to))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `client` (connected to `server`'s port on `local`) sends a ping;
    /// the server sees `local` as its destination and answers from it; the
    /// connected client gets the answer.
    async fn ping_pong(server: &UdpSocket, client: &UdpSocket, local: IpAddr) {
        client.send(b"ping").await.expect("send");
        let mut buf = [0u8; 16];
        let got = recv(server, &mut buf).await.expect("recv");
        assert_eq!((&buf[..got.len], got.to), (&b"ping"[..], local));
        assert_eq!(got.from, client.local_addr().expect("client address"));
        send(server, b"pong", got.to, got.from).await.expect("send reply");
        let n = tokio::time::timeout(std::time::Duration::from_secs(2), client.recv(&mut buf))
            .await
            .expect("the reply reaches the connected client")
            .expect("recv reply");
        assert_eq!(&buf[..n], b"pong");
    }

    /// Any 127/8 address is local: a datagram to 127.0.0.2 is answered from
    /// 127.0.0.2, or the client's connected socket would drop the answer.
    #[tokio::test]
    async fn answers_from_the_address_the_datagram_was_sent_to() {
        let server = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await.expect("bind server");
        enable(&server, false).expect("IP_PKTINFO");
        let port = server.local_addr().expect("server address").port();
        for local in [Ipv4Addr::LOCALHOST, Ipv4Addr::new(127, 0, 0, 2)] {
            let client = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind client");
            client.connect((local, port)).await.expect("connect");
            ping_pong(&server, &client, local.into()).await;
        }
    }

    /// The same on an IPv6 socket (`IPV6_PKTINFO`).
    #[tokio::test]
    async fn ipv6_answers_from_the_address_the_datagram_was_sent_to() {
        let server = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).await.expect("bind server");
        enable(&server, true).expect("IPV6_PKTINFO");
        let port = server.local_addr().expect("server address").port();
        let client = UdpSocket::bind((Ipv6Addr::LOCALHOST, 0)).await.expect("bind client");
        client.connect((Ipv6Addr::LOCALHOST, port)).await.expect("connect");
        ping_pong(&server, &client, Ipv6Addr::LOCALHOST.into()).await;
    }
}
