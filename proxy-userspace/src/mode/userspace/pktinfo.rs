//! Datagrams together with the local address they were sent to, and
//! replies sent from that same address (`IP_PKTINFO`).
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
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsFd, AsRawFd, RawFd},
};

use nix::{
    cmsg_space,
    sys::socket::{
        ControlMessage, ControlMessageOwned, MsgFlags, SockaddrIn, recvmsg, sendmsg, setsockopt,
        sockopt::Ipv4PacketInfo,
    },
};
use tokio::{io::Interest, net::UdpSocket};

/// Asks the kernel to report each datagram's destination address.
pub fn enable(socket: &impl AsFd) -> io::Result<()> {
    setsockopt(socket, Ipv4PacketInfo, &true).map_err(io::Error::from)
}

/// One datagram received into the caller's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub len: usize,
    pub from: SocketAddrV4,
    /// The destination address in its IP header (after NAT).
    pub to: Ipv4Addr,
}

/// Receives one datagram from a socket with [`enable`]d pktinfo.
pub async fn recv(socket: &UdpSocket, buf: &mut [u8]) -> io::Result<Received> {
    let fd = socket.as_raw_fd();
    socket.async_io(Interest::READABLE, || recv_now(fd, buf)).await
}

/// Sends `data` to `to` with the source address `from`.
pub async fn send(socket: &UdpSocket, data: &[u8], from: Ipv4Addr, to: SocketAddrV4) -> io::Result<usize> {
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

fn recv_now(fd: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut control = cmsg_space!(libc::in_pktinfo);
    let msg = recvmsg::<SockaddrIn>(fd, &mut iov, Some(&mut control), MsgFlags::MSG_DONTWAIT)?;
    let from = msg
        .address
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not an IPv4 sender"))?;
    let to = msg
        .cmsgs()?
        .find_map(|cmsg| match cmsg {
            ControlMessageOwned::Ipv4PacketInfo(info) => Some(Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr))),
            _ => None,
        })
        .ok_or_else(|| io::Error::other("no IP_PKTINFO with the datagram"))?;
    Ok(Received {
        len: msg.bytes,
        from: SocketAddrV4::from(from),
        to,
    })
}

fn send_now(fd: RawFd, data: &[u8], from: Ipv4Addr, to: SocketAddrV4) -> io::Result<usize> {
    let info = libc::in_pktinfo {
        ipi_ifindex: 0,
        ipi_spec_dst: in_addr(from),
        ipi_addr: in_addr(Ipv4Addr::UNSPECIFIED),
    };
    let sent = sendmsg(
        fd,
        &[IoSlice::new(data)],
        &[ControlMessage::Ipv4PacketInfo(&info)],
        MsgFlags::MSG_DONTWAIT,
        Some(&SockaddrIn::from(to)),
    )?;
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any 127/8 address is local: a datagram to 127.0.0.2 is answered from
    /// 127.0.0.2, or the client's connected socket would drop the answer.
    #[tokio::test]
    async fn answers_from_the_address_the_datagram_was_sent_to() {
        let server = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await.expect("bind server");
        enable(&server).expect("IP_PKTINFO");
        let port = server.local_addr().expect("server address").port();
        for local in [Ipv4Addr::LOCALHOST, Ipv4Addr::new(127, 0, 0, 2)] {
            let client = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind client");
            client.connect((local, port)).await.expect("connect");
            client.send(b"ping").await.expect("send");
            let mut buf = [0u8; 16];
            let got = recv(&server, &mut buf).await.expect("recv");
            assert_eq!(&buf[..got.len], b"ping");
            assert_eq!(got.to, local);
            assert_eq!(SocketAddrV4::new(Ipv4Addr::LOCALHOST, got.from.port()), got.from);
            send(&server, b"pong", got.to, got.from).await.expect("send reply");
            let n = tokio::time::timeout(std::time::Duration::from_secs(2), client.recv(&mut buf))
                .await
                .expect("the reply reaches the connected client")
                .expect("recv reply");
            assert_eq!(&buf[..n], b"pong");
        }
    }
}
