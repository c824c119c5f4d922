//! The few socket calls std does not offer: binding a client socket to a
//! chosen port before connecting, and socket options.

use std::{
    io,
    net::{SocketAddr, SocketAddrV4, TcpStream},
    os::fd::{FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.ip().octets()),
        },
        sin_zero: [0; 8],
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
    let SocketAddr::V4(addr) = addr else {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "IPv4 only"));
    };
    let sa = sockaddr(addr);
    // SAFETY: sa is a valid sockaddr_in of the size passed.
    check(unsafe {
        libc::bind(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    })
}

/// A blocking TCP connection to `to` from local port `from_port` (0: any):
/// socket, bind, connect, in the calling thread's network namespace. The
/// connect waits in the kernel (one syscall, nothing else inside what the
/// latency rounds time) and gives up after `timeout` (SO_SNDTIMEO): then it
/// fails with [`io::ErrorKind::TimedOut`], "no answer yet" to a caller that
/// probes.
pub fn connect_from(from_port: u16, to: SocketAddrV4, timeout: Duration) -> io::Result<TcpStream> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    check(fd)?;
    // SAFETY: fd is a fresh descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    if from_port != 0 {
        set_int_option(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
        bind(fd, SocketAddr::from(([0, 0, 0, 0], from_port)))?;
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
    let sa = sockaddr(to);
    // SAFETY: sa is a valid sockaddr_in of the size passed.
    check(unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    })
    .map_err(|e| connect_error(e, to, timeout))?;
    Ok(TcpStream::from(owned))
}

/// What a failed blocking connect means. When SO_SNDTIMEO runs out before
/// the handshake completes, Linux returns EINPROGRESS (socket(7)): the SYN
/// went out and nothing came back in time; the socket is closed right after,
/// so nothing is "in progress" any more: that is a timeout.
fn connect_error(e: io::Error, to: SocketAddrV4, timeout: Duration) -> io::Error {
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
    use std::net::{Ipv4Addr, TcpListener};

    use super::*;

    /// A listener whose accept queue is full drops further SYNs (Linux, with
    /// `tcp_abort_on_overflow` off as by default): a connect to it waits for
    /// the SYN-ACK that never comes, as one to a Service not programmed yet.
    #[test]
    fn a_connect_without_answer_times_out() {
        // SAFETY: plain socket calls on descriptors owned right away.
        let listener = unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            check(fd).expect("socket");
            let owned = OwnedFd::from_raw_fd(fd);
            bind(fd, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("bind");
            check(libc::listen(fd, 0)).expect("listen");
            TcpListener::from(owned)
        };
        let SocketAddr::V4(addr) = listener.local_addr().expect("address") else {
            unreachable!("bound to IPv4")
        };
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
}
