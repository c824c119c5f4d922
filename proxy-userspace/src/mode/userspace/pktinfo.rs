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
    io, mem,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsRawFd, RawFd},
    ptr,
};

use tokio::{io::Interest, net::UdpSocket};

/// Asks the kernel to report each datagram's destination address.
pub fn enable(socket: &impl AsRawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt reads an int from a valid pointer of the given size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_PKTINFO,
            ptr::from_ref(&on).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One datagram received into the caller's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub len: usize,
    pub from: SocketAddrV4,
    /// The destination address in its IP header (after NAT).
    pub to: Ipv4Addr,
}

/// Control-message space, aligned for `cmsghdr`: more than
/// `CMSG_SPACE(sizeof(struct in_pktinfo))` (32 bytes on 64-bit Linux).
#[repr(C, align(8))]
struct Control([u8; 64]);

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

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: in_addr(*addr.ip()),
        sin_zero: [0; 8],
    }
}

fn in_addr(ip: Ipv4Addr) -> libc::in_addr {
    libc::in_addr {
        s_addr: u32::from(ip).to_be(),
    }
}

fn ipv4(addr: libc::in_addr) -> Ipv4Addr {
    Ipv4Addr::from(u32::from_be(addr.s_addr))
}

fn recv_now(fd: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    // SAFETY: all-zero is a valid sockaddr_in and msghdr.
    let mut name: libc::sockaddr_in = unsafe { mem::zeroed() };
    let mut control = Control([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_name = ptr::from_mut(&mut name).cast();
    msg.msg_namelen = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = control.0.len() as _;
    // SAFETY: msg points to live buffers of the sizes it states.
    let len = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if len < 0 {
        return Err(io::Error::last_os_error());
    }
    if i32::from(name.sin_family) != libc::AF_INET {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not an IPv4 sender"));
    }
    let from = SocketAddrV4::new(ipv4(name.sin_addr), u16::from_be(name.sin_port));
    let to = destination(&msg).ok_or_else(|| io::Error::other("no IP_PKTINFO with the datagram"))?;
    Ok(Received {
        len: len as usize,
        from,
        to,
    })
}

/// The `ipi_addr` of the IP_PKTINFO control message in `msg`.
fn destination(msg: &libc::msghdr) -> Option<Ipv4Addr> {
    // SAFETY: msg was filled by recvmsg; the CMSG_* walk stays within
    // msg_control/msg_controllen, and the data is read unaligned.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            let header = &*cmsg;
            if header.cmsg_level == libc::IPPROTO_IP && header.cmsg_type == libc::IP_PKTINFO {
                let info: libc::in_pktinfo = ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                return Some(ipv4(info.ipi_addr));
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    None
}

fn send_now(fd: RawFd, data: &[u8], from: Ipv4Addr, to: SocketAddrV4) -> io::Result<usize> {
    let mut name = sockaddr(to);
    let mut control = Control([0; 64]);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    let info = libc::in_pktinfo {
        ipi_ifindex: 0,
        ipi_spec_dst: in_addr(from),
        ipi_addr: in_addr(Ipv4Addr::UNSPECIFIED),
    };
    // SAFETY: all-zero is a valid msghdr.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_name = ptr::from_mut(&mut name).cast();
    msg.msg_namelen = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE/CMSG_LEN are pure arithmetic; the control buffer
    // holds one cmsghdr plus an in_pktinfo (see `Control`), which
    // CMSG_FIRSTHDR points at and CMSG_DATA writes into.
    let len = unsafe {
        msg.msg_controllen = libc::CMSG_SPACE(mem::size_of::<libc::in_pktinfo>() as u32) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::IPPROTO_IP;
        (*cmsg).cmsg_type = libc::IP_PKTINFO;
        (*cmsg).cmsg_len = libc::CMSG_LEN(mem::size_of::<libc::in_pktinfo>() as u32) as _;
        ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast(), info);
        libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT)
    };
    if len < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(len as usize)
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
