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
/// connect gives up after `timeout` (SO_SNDTIMEO), failing with
/// `WouldBlock`/`TimedOut`.
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
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
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
    })?;
    Ok(TcpStream::from(owned))
}
