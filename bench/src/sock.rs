//! The few socket calls std does not offer: binding a client socket to a
//! chosen port before connecting, and socket options.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

/// An address as bind(2) and connect(2) take it.
enum RawAddr {
    V4(libc::sockaddr_in),
    V6(libc::sockaddr_in6),
}

impl RawAddr {
    fn of(addr: SocketAddr) -> Self {
        match addr {
            SocketAddr::V4(a) => RawAddr::V4(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            }),
            SocketAddr::V6(a) => RawAddr::V6(libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            }),
        }
    }

    /// The pointer and the length to pass; valid while `self` lives.
    fn as_raw(&self) -> (*const libc::sockaddr, libc::socklen_t) {
        match self {
            RawAddr::V4(sa) => (
                (sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            ),
            RawAddr::V6(sa) => (
                (sa as *const libc::sockaddr_in6).cast(),
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            ),
        }
    }
}

/// A blocking TCP socket of `addr`'s family.
pub fn stream_socket(addr: SocketAddr) -> io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    check(fd)?;
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The unspecified address of `addr`'s family.
fn unspecified(addr: SocketAddr) -> IpAddr {
    match addr {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    }
}

fn check(result: libc::c_int) -> io::Result<()> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub fn set_int_option(fd: RawFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: the option value is a c_int of the size passed.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
}

pub fn bind(fd: RawFd, addr: SocketAddr) -> io::Result<()> {
    let raw = RawAddr::of(addr);
    let (sa, len) = raw.as_raw();
    // SAFETY: sa points at a sockaddr of `len` bytes that outlives the call.
    check(unsafe { libc::bind(fd, sa, len) })
}

/// A blocking TCP connection to `to` from local port `from_port` (0: any):
/// socket, bind, connect, in the calling thread's network namespace. The
/// connect waits in the kernel (one syscall, nothing else inside what the
/// latency rounds time) and gives up after `timeout` (SO_SNDTIMEO): then it
/// fails with [`io::ErrorKind::TimedOut`], "no answer yet" to a caller that
/// probes.
pub fn connect_from(from_port: u16, to: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let owned = stream_socket(to)?;
    let fd = owned.as_raw_fd();
    if from_port != 0 {
        set_int_option(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
        bind(fd, SocketAddr::new(unspecified(to), from_port))?;
    }
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(timeout.subsec_micros()),
    };
    // SAFETY: tv is a valid timeval of the size passed.
    check(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    })?;
    let raw = RawAddr::of(to);
    let (sa, len) = raw.as_raw();
    // SAFETY: sa points at a sockaddr of `len` bytes that outlives the call.
    check(unsafe { libc::connect(fd, sa, len) }).map_err(|e| connect_error(e, to, timeout))?;
    Ok(TcpStream::from(owned))
}

/// What a failed blocking connect means. When SO_SNDTIMEO runs out before
/// the handshake completes, Linux returns EINPROGRESS (socket(7)): the SYN
/// went out and nothing came back in time; the socket is closed right after,
/// so nothing is "in progress" any more: that is a timeout.
fn connect_error(e: io::Error, to: SocketAddr, timeout: Duration) -> io::Error {
    match e.raw_os_error() {
        Some(libc::EINPROGRESS | libc::EAGAIN) => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer from {to} within {timeout:?} (connect timed out)"),
        ),
        _ => e,
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A listener whose accept queue is full drops further SYNs (Linux, with
    /// `tcp_abort_on_overflow` off as by default): a connect to it waits for
    /// the SYN-ACK that never comes, as one to a Service not programmed yet.
    #[test]
    fn a_connect_without_answer_times_out() {
        let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let owned = stream_socket(loopback).expect("socket");
        bind(owned.as_raw_fd(), loopback).expect("bind");
        // SAFETY: listen(2) on a socket this test owns.
        check(unsafe { libc::listen(owned.as_raw_fd(), 0) }).expect("listen");
        let listener = TcpListener::from(owned);
        let addr = listener.local_addr().expect("address");
        // Fill the accept queue (never accepted) until a connect goes unanswered.
        let mut held = Vec::new();
        let timeout = Duration::from_millis(100);
        let error = loop {
            assert!(held.len() < 16, "the accept queue never filled up");
            match connect_from(0, addr, timeout) {
                Ok(stream) => held.push(stream),
                Err(e) => break e,
            }
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut, "{error}");
        assert!(error.to_string().contains("no answer"), "{error}");
        // Other errors stay what they are.
        let refused = connect_error(io::Error::from_raw_os_error(libc::ECONNREFUSED), addr, timeout);
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
    }

    /// Connections over IPv6 and IPv4 loopback to a listener on every
    /// address of both families (as the pods' servers listen).
    #[test]
    fn a_dual_stack_listener_is_reached_over_both_families() {
        let any = SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0));
        let owned = stream_socket(any).expect("socket");
        set_int_option(owned.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0).expect("dual-stack");
        bind(owned.as_raw_fd(), any).expect("bind");
        // SAFETY: listen(2) on a socket this test owns.
        check(unsafe { libc::listen(owned.as_raw_fd(), 4) }).expect("listen");
        let listener = TcpListener::from(owned);
        let port = listener.local_addr().expect("address").port();
        let stream = connect_from(0, SocketAddr::from((Ipv6Addr::LOCALHOST, port)), Duration::from_secs(1))
            .expect("connect over IPv6");
        assert!(stream.local_addr().expect("local").is_ipv6());
        let v4 = connect_from(0, SocketAddr::from((Ipv4Addr::LOCALHOST, port)), Duration::from_secs(1));
        assert!(v4.is_ok(), "the dual-stack listener takes IPv4 too: {v4:?}");
    }
}
