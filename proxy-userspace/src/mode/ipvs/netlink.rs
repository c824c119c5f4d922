//! The kernel's IPVS table over generic netlink (the family `IPVS`, what
//! `ipvsadm` speaks), plus the small netlink socket and attribute codec the
//! dummy interface code shares.
//!
//! Messages are encoded by hand: a netlink header, a generic netlink header
//! and nested attributes, every one padded to 4 bytes. The layouts follow
//! `include/uapi/linux/ip_vs.h`; the encoders are pure and unit-tested, the
//! socket is a plain `AF_NETLINK` one from `libc` bound in the network
//! namespace of the thread that opened it.

use std::{
    collections::BTreeMap,
    io,
    net::Ipv4Addr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use anyhow::{Context, Result, bail};

use crate::model::Protocol;

// Netlink message types and flags (linux/netlink.h).
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
const NLMSG_HDRLEN: usize = 16;
const NLA_HDRLEN: usize = 4;

// Generic netlink controller (linux/genetlink.h).
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

// The IPVS family (linux/ip_vs.h).
const IPVS_FAMILY: &str = "IPVS";
const IPVS_VERSION: u8 = 1;
pub const IPVS_CMD_NEW_SERVICE: u8 = 1;
pub const IPVS_CMD_SET_SERVICE: u8 = 2;
pub const IPVS_CMD_DEL_SERVICE: u8 = 3;
pub const IPVS_CMD_GET_SERVICE: u8 = 4;
pub const IPVS_CMD_NEW_DEST: u8 = 5;
pub const IPVS_CMD_SET_DEST: u8 = 6;
pub const IPVS_CMD_DEL_DEST: u8 = 7;
pub const IPVS_CMD_GET_DEST: u8 = 8;
pub const IPVS_CMD_SET_CONFIG: u8 = 12;
const IPVS_CMD_ATTR_SERVICE: u16 = 1;
const IPVS_CMD_ATTR_DEST: u16 = 2;
const IPVS_CMD_ATTR_TIMEOUT_TCP: u16 = 4;
const IPVS_CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
const IPVS_CMD_ATTR_TIMEOUT_UDP: u16 = 6;
const IPVS_SVC_ATTR_AF: u16 = 1;
const IPVS_SVC_ATTR_PROTOCOL: u16 = 2;
const IPVS_SVC_ATTR_ADDR: u16 = 3;
const IPVS_SVC_ATTR_PORT: u16 = 4;
const IPVS_SVC_ATTR_SCHED_NAME: u16 = 6;
const IPVS_SVC_ATTR_FLAGS: u16 = 7;
const IPVS_SVC_ATTR_TIMEOUT: u16 = 8;
const IPVS_SVC_ATTR_NETMASK: u16 = 9;
const IPVS_DEST_ATTR_ADDR: u16 = 1;
const IPVS_DEST_ATTR_PORT: u16 = 2;
const IPVS_DEST_ATTR_FWD_METHOD: u16 = 3;
const IPVS_DEST_ATTR_WEIGHT: u16 = 4;
const IPVS_DEST_ATTR_U_THRESH: u16 = 5;
const IPVS_DEST_ATTR_L_THRESH: u16 = 6;
const IPVS_DEST_ATTR_ADDR_FAMILY: u16 = 11;
/// `IP_VS_CONN_F_MASQ`: real servers are reached by DNAT (as kube-proxy).
const IP_VS_CONN_F_MASQ: u32 = 0;
const AF_INET: u16 = libc::AF_INET as u16;

/// A virtual server's identity: what `ipvsadm -t/-u ADDR:PORT` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualKey {
    pub protocol: Protocol,
    pub addr: Ipv4Addr,
    pub port: u16,
}

impl std::fmt::Display for VirtualKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}:{}", self.protocol, self.addr, self.port)
    }
}

/// A virtual server as programmed: its scheduler and real servers
/// (`(address, port) -> weight`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct VirtualServer {
    pub scheduler: String,
    pub reals: BTreeMap<(Ipv4Addr, u16), u32>,
}

fn ipproto(protocol: Protocol) -> u16 {
    match protocol {
        Protocol::Tcp => libc::IPPROTO_TCP as u16,
        Protocol::Udp => libc::IPPROTO_UDP as u16,
    }
}

fn protocol_of(proto: u16) -> Option<Protocol> {
    match i32::from(proto) {
        libc::IPPROTO_TCP => Some(Protocol::Tcp),
        libc::IPPROTO_UDP => Some(Protocol::Udp),
        _ => None,
    }
}

/// A netlink message under construction.
pub struct Message {
    buf: Vec<u8>,
}

impl Message {
    /// A message of `kind` with `flags` (sequence number filled in on send)
    /// and a fixed family header `header`.
    pub fn new(kind: u16, flags: u16, header: &[u8]) -> Self {
        let mut buf = vec![0; NLMSG_HDRLEN];
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(header);
        pad(&mut buf);
        Self { buf }
    }

    /// A generic netlink message of `family` for `cmd`.
    fn genl(family: u16, cmd: u8, version: u8, flags: u16) -> Self {
        Self::new(family, flags, &[cmd, version, 0, 0])
    }

    pub fn attr(&mut self, kind: u16, payload: &[u8]) -> &mut Self {
        let len = (NLA_HDRLEN + payload.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        pad(&mut self.buf);
        self
    }

    pub fn u16(&mut self, kind: u16, value: u16) -> &mut Self {
        self.attr(kind, &value.to_ne_bytes())
    }

    pub fn u32(&mut self, kind: u16, value: u32) -> &mut Self {
        self.attr(kind, &value.to_ne_bytes())
    }

    /// A NUL-terminated string.
    pub fn string(&mut self, kind: u16, value: &str) -> &mut Self {
        let mut bytes = value.as_bytes().to_vec();
        bytes.push(0);
        self.attr(kind, &bytes)
    }

    /// A nested attribute holding what `fill` adds.
    pub fn nested(&mut self, kind: u16, fill: impl FnOnce(&mut Self)) -> &mut Self {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0, 0]);
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        fill(self);
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    /// The bytes with length and sequence number set.
    pub fn finish(&self, seq: u32) -> Vec<u8> {
        let mut buf = self.buf.clone();
        let len = buf.len() as u32;
        buf[0..4].copy_from_slice(&len.to_ne_bytes());
        buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        buf
    }
}

fn pad(buf: &mut Vec<u8>) {
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

/// The attributes in `data`: `(type without flags, payload)`.
pub fn attrs(mut data: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while data.len() >= NLA_HDRLEN {
        let len = usize::from(u16::from_ne_bytes([data[0], data[1]]));
        let kind = u16::from_ne_bytes([data[2], data[3]]) & 0x3fff;
        if len < NLA_HDRLEN || len > data.len() {
            break;
        }
        out.push((kind, &data[NLA_HDRLEN..len]));
        let next = len.div_ceil(4) * 4;
        data = &data[next.min(data.len())..];
    }
    out
}

fn find(attrs: &[(u16, &[u8])], kind: u16) -> Option<Vec<u8>> {
    attrs.iter().find(|(k, _)| *k == kind).map(|(_, v)| v.to_vec())
}

fn read_u16(bytes: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(bytes.get(..2)?.try_into().ok()?))
}

fn read_u32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?))
}

fn read_ipv4(bytes: &[u8]) -> Option<Ipv4Addr> {
    let octets: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
    Some(Ipv4Addr::from(octets))
}

/// `union nf_inet_addr` holding an IPv4 address.
fn inet_addr(addr: Ipv4Addr) -> [u8; 16] {
    let mut bytes = [0; 16];
    bytes[..4].copy_from_slice(&addr.octets());
    bytes
}

/// A netlink socket of one protocol, in the network namespace of the
/// thread that opened it.
pub struct Socket {
    fd: OwnedFd,
    seq: u32,
}

/// An error the kernel answered with (negative errno in `NLMSG_ERROR`).
#[derive(Debug, thiserror::Error)]
#[error("the kernel answered: {source}")]
pub struct KernelError {
    pub source: io::Error,
}

impl KernelError {
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

impl Socket {
    pub fn open(protocol: i32) -> Result<Self> {
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening a netlink socket");
        }
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { fd, seq: 1 })
    }

    fn send(&mut self, message: &Message) -> Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let bytes = message.finish(self.seq);
        // SAFETY: the kernel address (all zero) and a valid buffer.
        let sent = unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as u16;
            libc::sendto(
                self.fd.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                0,
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error()).context("sending a netlink message");
        }
        Ok(self.seq)
    }

    fn recv(&self, buf: &mut [u8]) -> Result<usize> {
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error()).context("receiving from netlink");
        }
        Ok(n as usize)
    }

    /// Sends `message` and returns the payloads (after the netlink header)
    /// of the answers, until the ACK or the end of the dump. A kernel error
    /// is returned as [`KernelError`].
    pub fn request(&mut self, message: &Message) -> Result<Vec<Vec<u8>>> {
        let seq = self.send(message)?;
        let mut buf = vec![0u8; 1 << 16];
        let mut out = Vec::new();
        loop {
            let n = self.recv(&mut buf)?;
            let mut data = &buf[..n];
            while data.len() >= NLMSG_HDRLEN {
                let len = read_u32(data).unwrap_or(0) as usize;
                if len < NLMSG_HDRLEN || len > data.len() {
                    bail!("a truncated netlink message");
                }
                let kind = read_u16(&data[4..]).unwrap_or(0);
                let msg_seq = read_u32(&data[8..]).unwrap_or(0);
                let payload = &data[NLMSG_HDRLEN..len];
                data = &data[(len.div_ceil(4) * 4).min(data.len())..];
                if msg_seq != seq {
                    continue;
                }
                match kind {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = payload
                            .get(..4)
                            .map(|b| i32::from_ne_bytes(b.try_into().unwrap_or([0; 4])));
                        return match code {
                            Some(0) => Ok(out),
                            Some(errno) => Err(KernelError {
                                source: io::Error::from_raw_os_error(-errno),
                            }
                            .into()),
                            None => bail!("a truncated netlink error"),
                        };
                    }
                    _ => out.push(payload.to_vec()),
                }
            }
        }
    }
}

/// The kernel's errno in `error`, if it is a [`KernelError`].
pub fn errno(error: &anyhow::Error) -> Option<i32> {
    error.downcast_ref::<KernelError>().and_then(KernelError::errno)
}

/// Why IPVS cannot be used here.
#[derive(Debug, thiserror::Error)]
#[error("the kernel has no IPVS (generic netlink family \"IPVS\" not found; load ip_vs, or pick another --mode)")]
pub struct NoIpvs;

/// The IPVS table of one network namespace.
pub struct Ipvs {
    socket: Socket,
    family: u16,
}

impl Ipvs {
    /// Opens the table; fails with [`NoIpvs`] when the kernel lacks IPVS.
    pub fn open() -> Result<Self> {
        let mut socket = Socket::open(libc::NETLINK_GENERIC)?;
        let mut message = Message::genl(GENL_ID_CTRL, CTRL_CMD_GETFAMILY, 1, NLM_F_REQUEST | NLM_F_ACK);
        message.string(CTRL_ATTR_FAMILY_NAME, IPVS_FAMILY);
        let answers = match socket.request(&message) {
            Ok(answers) => answers,
            Err(e) if errno(&e) == Some(libc::ENOENT) => return Err(NoIpvs.into()),
            Err(e) => return Err(e.context("resolving the IPVS generic netlink family")),
        };
        let family = answers
            .iter()
            .find_map(|a| a.get(4..).and_then(|a| find(&attrs(a), CTRL_ATTR_FAMILY_ID)))
            .and_then(|id| read_u16(&id))
            .context("the controller's answer has no family id")?;
        Ok(Self { socket, family })
    }

    fn do_cmd(&mut self, message: &Message, what: impl std::fmt::Display) -> Result<()> {
        self.socket.request(message).with_context(|| what.to_string())?;
        Ok(())
    }

    pub fn add_service(&mut self, key: &VirtualKey, scheduler: &str) -> Result<()> {
        let message = service_message(self.family, IPVS_CMD_NEW_SERVICE, key, Some(scheduler));
        self.do_cmd(&message, format_args!("adding the virtual server {key}"))
    }

    pub fn set_scheduler(&mut self, key: &VirtualKey, scheduler: &str) -> Result<()> {
        let message = service_message(self.family, IPVS_CMD_SET_SERVICE, key, Some(scheduler));
        self.do_cmd(&message, format_args!("setting the scheduler of {key}"))
    }

    pub fn del_service(&mut self, key: &VirtualKey) -> Result<()> {
        let message = service_message(self.family, IPVS_CMD_DEL_SERVICE, key, None);
        self.do_cmd(&message, format_args!("deleting the virtual server {key}"))
    }

    /// Adds (`IPVS_CMD_NEW_DEST`), re-weights (`SET_DEST`) or deletes
    /// (`DEL_DEST`) one real server of `key`.
    pub fn dest(&mut self, cmd: u8, key: &VirtualKey, real: (Ipv4Addr, u16), weight: u32) -> Result<()> {
        let message = dest_message(self.family, cmd, key, real, weight);
        self.do_cmd(
            &message,
            format_args!(
                "real server {}:{} (weight {weight}) of {key}, command {cmd}",
                real.0, real.1
            ),
        )
    }

    /// Sets the connection timeouts in seconds (`ipvsadm --set TCP
    /// TCPFIN UDP`); a zero leaves the kernel's value.
    pub fn set_timeouts(&mut self, tcp: u32, tcp_fin: u32, udp: u32) -> Result<()> {
        if tcp == 0 && tcp_fin == 0 && udp == 0 {
            return Ok(());
        }
        let message = timeouts_message(self.family, tcp, tcp_fin, udp);
        self.do_cmd(&message, "setting the IPVS timeouts")
    }

    /// Every IPv4 TCP/UDP virtual server with its real servers.
    pub fn list(&mut self) -> Result<BTreeMap<VirtualKey, VirtualServer>> {
        let message = Message::genl(
            self.family,
            IPVS_CMD_GET_SERVICE,
            IPVS_VERSION,
            NLM_F_REQUEST | NLM_F_DUMP,
        );
        let answers = self.socket.request(&message).context("listing the virtual servers")?;
        let mut out = BTreeMap::new();
        for answer in answers {
            let Some((key, scheduler)) = parse_service(&answer) else {
                continue;
            };
            let reals = self.reals(&key)?;
            out.insert(key, VirtualServer { scheduler, reals });
        }
        Ok(out)
    }

    /// One virtual server, if it exists.
    pub fn get(&mut self, key: &VirtualKey) -> Result<Option<VirtualServer>> {
        let message = service_message(self.family, IPVS_CMD_GET_SERVICE, key, None);
        let answers = match self.socket.request(&message) {
            Ok(answers) => answers,
            Err(e) if errno(&e) == Some(libc::ESRCH) => return Ok(None),
            Err(e) => return Err(e.context(format!("reading the virtual server {key}"))),
        };
        let Some((_, scheduler)) = answers.iter().find_map(|a| parse_service(a)) else {
            return Ok(None);
        };
        let reals = self.reals(key)?;
        Ok(Some(VirtualServer { scheduler, reals }))
    }

    fn reals(&mut self, key: &VirtualKey) -> Result<BTreeMap<(Ipv4Addr, u16), u32>> {
        let mut message = Message::genl(self.family, IPVS_CMD_GET_DEST, IPVS_VERSION, NLM_F_REQUEST | NLM_F_DUMP);
        message.nested(IPVS_CMD_ATTR_SERVICE, |m| service_key(m, key));
        let answers = self
            .socket
            .request(&message)
            .with_context(|| format!("listing the real servers of {key}"))?;
        Ok(answers.iter().filter_map(|a| parse_dest(a)).collect())
    }
}

fn service_key(m: &mut Message, key: &VirtualKey) {
    m.u16(IPVS_SVC_ATTR_AF, AF_INET)
        .u16(IPVS_SVC_ATTR_PROTOCOL, ipproto(key.protocol))
        .attr(IPVS_SVC_ATTR_ADDR, &inet_addr(key.addr))
        .attr(IPVS_SVC_ATTR_PORT, &key.port.to_be_bytes());
}

/// A service command; `scheduler` makes it a full entry (flags, timeout,
/// netmask too), as NEW/SET need.
pub fn service_message(family: u16, cmd: u8, key: &VirtualKey, scheduler: Option<&str>) -> Message {
    let mut message = Message::genl(family, cmd, IPVS_VERSION, NLM_F_REQUEST | NLM_F_ACK);
    message.nested(IPVS_CMD_ATTR_SERVICE, |m| {
        service_key(m, key);
        if let Some(scheduler) = scheduler {
            let mut flags = [0u8; 8];
            flags[4..].copy_from_slice(&u32::MAX.to_ne_bytes());
            m.string(IPVS_SVC_ATTR_SCHED_NAME, scheduler)
                .attr(IPVS_SVC_ATTR_FLAGS, &flags)
                .u32(IPVS_SVC_ATTR_TIMEOUT, 0)
                .u32(IPVS_SVC_ATTR_NETMASK, u32::MAX);
        }
    });
    message
}

/// A real server command (always a full entry: masquerading, `weight`, no
/// thresholds).
pub fn dest_message(family: u16, cmd: u8, key: &VirtualKey, real: (Ipv4Addr, u16), weight: u32) -> Message {
    let mut message = Message::genl(family, cmd, IPVS_VERSION, NLM_F_REQUEST | NLM_F_ACK);
    message.nested(IPVS_CMD_ATTR_SERVICE, |m| service_key(m, key));
    message.nested(IPVS_CMD_ATTR_DEST, |m| {
        m.attr(IPVS_DEST_ATTR_ADDR, &inet_addr(real.0))
            .attr(IPVS_DEST_ATTR_PORT, &real.1.to_be_bytes())
            .u32(IPVS_DEST_ATTR_FWD_METHOD, IP_VS_CONN_F_MASQ)
            .u32(IPVS_DEST_ATTR_WEIGHT, weight)
            .u32(IPVS_DEST_ATTR_U_THRESH, 0)
            .u32(IPVS_DEST_ATTR_L_THRESH, 0)
            .u16(IPVS_DEST_ATTR_ADDR_FAMILY, AF_INET);
    });
    message
}

/// `IPVS_CMD_SET_CONFIG` with the non-zero timeouts (seconds).
pub fn timeouts_message(family: u16, tcp: u32, tcp_fin: u32, udp: u32) -> Message {
    let mut message = Message::genl(family, IPVS_CMD_SET_CONFIG, IPVS_VERSION, NLM_F_REQUEST | NLM_F_ACK);
    for (kind, value) in [
        (IPVS_CMD_ATTR_TIMEOUT_TCP, tcp),
        (IPVS_CMD_ATTR_TIMEOUT_TCP_FIN, tcp_fin),
        (IPVS_CMD_ATTR_TIMEOUT_UDP, udp),
    ] {
        if value != 0 {
            message.u32(kind, value);
        }
    }
    message
}

/// `(key, scheduler)` from a generic netlink payload holding a service.
fn parse_service(payload: &[u8]) -> Option<(VirtualKey, String)> {
    let top = attrs(payload.get(4..)?);
    let service = find(&top, IPVS_CMD_ATTR_SERVICE)?;
    let fields = attrs(&service);
    if read_u16(&find(&fields, IPVS_SVC_ATTR_AF)?)? != AF_INET {
        return None;
    }
    let protocol = protocol_of(read_u16(&find(&fields, IPVS_SVC_ATTR_PROTOCOL)?)?)?;
    let addr = read_ipv4(&find(&fields, IPVS_SVC_ATTR_ADDR)?)?;
    let port = u16::from_be_bytes(find(&fields, IPVS_SVC_ATTR_PORT)?.get(..2)?.try_into().ok()?);
    let scheduler = find(&fields, IPVS_SVC_ATTR_SCHED_NAME)
        .map(|s| String::from_utf8_lossy(&s).trim_end_matches('\0').to_owned())
        .unwrap_or_default();
    Some((VirtualKey { protocol, addr, port }, scheduler))
}

/// `((address, port), weight)` from a payload holding a destination.
fn parse_dest(payload: &[u8]) -> Option<((Ipv4Addr, u16), u32)> {
    let top = attrs(payload.get(4..)?);
    let dest = find(&top, IPVS_CMD_ATTR_DEST)?;
    let fields = attrs(&dest);
    let addr = read_ipv4(&find(&fields, IPVS_DEST_ATTR_ADDR)?)?;
    let port = u16::from_be_bytes(find(&fields, IPVS_DEST_ATTR_PORT)?.get(..2)?.try_into().ok()?);
    let weight = read_u32(&find(&fields, IPVS_DEST_ATTR_WEIGHT)?)?;
    Some(((addr, port), weight))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: VirtualKey = VirtualKey {
        protocol: Protocol::Tcp,
        addr: Ipv4Addr::new(10, 96, 0, 88),
        port: 88,
    };

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn encodes_a_new_service_like_ipvsadm() {
        let bytes = service_message(0x22, IPVS_CMD_NEW_SERVICE, &SEED, Some("rr")).finish(7);
        // nlmsghdr: length, family id, REQUEST|ACK, seq 7, port 0.
        assert_eq!(
            usize::try_from(u32::from_ne_bytes(bytes[0..4].try_into().unwrap())).unwrap(),
            bytes.len()
        );
        assert_eq!(&bytes[4..6], &0x22u16.to_ne_bytes());
        assert_eq!(&bytes[6..8], &5u16.to_ne_bytes());
        assert_eq!(&bytes[8..12], &7u32.to_ne_bytes());
        // genlmsghdr: command 1, version 1.
        assert_eq!(&bytes[16..20], &[1, 1, 0, 0]);
        let top = attrs(&bytes[20..]);
        assert_eq!(top.len(), 1);
        assert_eq!(top[0].0, IPVS_CMD_ATTR_SERVICE);
        let fields = attrs(top[0].1);
        let kinds: Vec<u16> = fields.iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, [1, 2, 3, 4, 6, 7, 8, 9]);
        assert_eq!(hex(fields[2].1), "0a600058000000000000000000000000");
        assert_eq!(fields[3].1, [0, 88], "the port is in network byte order");
        assert_eq!(fields[4].1, b"rr\0");
        assert_eq!(read_u16(fields[1].1), Some(6));
    }

    #[test]
    fn a_key_only_service_message_has_no_scheduler() {
        let bytes = service_message(0x22, IPVS_CMD_DEL_SERVICE, &SEED, None).finish(1);
        let top = attrs(&bytes[20..]);
        let kinds: Vec<u16> = attrs(top[0].1).iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, [1, 2, 3, 4]);
    }

    #[test]
    fn encodes_a_destination_with_its_service() {
        let real = (Ipv4Addr::new(10, 244, 0, 11), 80);
        let bytes = dest_message(0x22, IPVS_CMD_NEW_DEST, &SEED, real, 1).finish(1);
        assert_eq!(bytes[16], IPVS_CMD_NEW_DEST);
        let top = attrs(&bytes[20..]);
        assert_eq!(top.iter().map(|(k, _)| *k).collect::<Vec<_>>(), [1, 2]);
        // The same payload parses back (as a dump answer would carry it).
        assert_eq!(parse_dest(&bytes[16..]), Some((real, 1)));
        assert_eq!(parse_service(&bytes[16..]).map(|(k, _)| k), Some(SEED));
    }

    #[test]
    fn only_non_zero_timeouts_are_sent() {
        let bytes = timeouts_message(0x22, 900, 0, 300).finish(1);
        assert_eq!(bytes[16], IPVS_CMD_SET_CONFIG);
        let top = attrs(&bytes[20..]);
        assert_eq!(
            top,
            vec![(4, &900u32.to_ne_bytes()[..]), (6, &300u32.to_ne_bytes()[..])]
        );
    }

    #[test]
    fn attributes_are_padded_to_four_bytes() {
        let mut message = Message::new(1, 0, &[]);
        message.string(1, "abcde").u16(2, 9);
        let bytes = message.finish(0);
        assert_eq!(bytes.len(), 16 + 12 + 8);
        let parsed = attrs(&bytes[16..]);
        assert_eq!(parsed, vec![(1, &b"abcde\0"[..]), (2, &9u16.to_ne_bytes()[..])]);
    }
}
