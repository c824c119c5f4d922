//! The kernel's IPVS table over generic netlink (the family `IPVS`, what
//! `ipvsadm` speaks), through the socket and codec of
//! [`crate::sys::netlink`].
//!
//! Messages are encoded by hand: a netlink header, a generic netlink header
//! and nested attributes. The layouts follow `include/uapi/linux/ip_vs.h`;
//! the encoders are pure and unit-tested. Both families share every
//! message: the family attribute (`IPVS_SVC_ATTR_AF`,
//! `IPVS_DEST_ATTR_ADDR_FAMILY`) says how to read the 16 bytes of
//! `union nf_inet_addr` (an IPv4 address fills the first 4).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv6Addr},
};

use anyhow::{Context, Result};

use crate::{
    model::Protocol,
    sys::netlink::{
        Message, NETLINK_GENERIC, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, Socket, attrs, errno, find, read_ipv4,
        read_u16, read_u32,
    },
};

mod counters;

pub use counters::{RealCounters, VirtualCounters};

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
/// `IP_VS_SVC_F_PERSISTENT`: a client keeps its real server (a template
/// connection per client address) until idle for the service's timeout.
const IP_VS_SVC_F_PERSISTENT: u32 = 0x0001;
const AF_INET: u16 = libc::AF_INET as u16;
const AF_INET6: u16 = libc::AF_INET6 as u16;

/// A virtual server's identity: what `ipvsadm -t/-u ADDR:PORT` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualKey {
    pub protocol: Protocol,
    pub addr: IpAddr,
    pub port: u16,
}

impl std::fmt::Display for VirtualKey {
    /// `TCP 10.96.0.88:88`, `TCP [fd00:96::88]:88` (as `ipvsadm -Ln`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}",
            self.protocol,
            std::net::SocketAddr::new(self.addr, self.port)
        )
    }
}

/// A real server: address and port.
pub type Real = (IpAddr, u16);

/// A virtual server as programmed: its scheduler, persistence and real
/// servers (`(address, port) -> weight`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct VirtualServer {
    pub scheduler: String,
    /// The persistence timeout in seconds (`ipvsadm -p`), kube-proxy's
    /// `sessionAffinity: ClientIP`; `None`: every connection is scheduled.
    pub persistence: Option<u32>,
    pub reals: BTreeMap<Real, u32>,
}

/// What a virtual server is, without its real servers: what
/// `IPVS_CMD_NEW_SERVICE` and `SET_SERVICE` write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceEntry<'a> {
    pub scheduler: &'a str,
    pub persistence: Option<u32>,
}

impl VirtualServer {
    pub fn entry(&self) -> ServiceEntry<'_> {
        ServiceEntry {
            scheduler: &self.scheduler,
            persistence: self.persistence,
        }
    }
}

fn ipproto(protocol: Protocol) -> u16 {
    match protocol {
        Protocol::Tcp => libc::IPPROTO_TCP as u16,
        Protocol::Udp => libc::IPPROTO_UDP as u16,
        Protocol::Sctp => libc::IPPROTO_SCTP as u16,
    }
}

fn protocol_of(proto: u16) -> Option<Protocol> {
    match i32::from(proto) {
        libc::IPPROTO_TCP => Some(Protocol::Tcp),
        libc::IPPROTO_UDP => Some(Protocol::Udp),
        libc::IPPROTO_SCTP => Some(Protocol::Sctp),
        _ => None,
    }
}

/// The `AF_*` of `addr`.
fn family_of(addr: IpAddr) -> u16 {
    match addr {
        IpAddr::V4(_) => AF_INET,
        IpAddr::V6(_) => AF_INET6,
    }
}

/// `union nf_inet_addr` holding `addr`.
fn inet_addr(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(v4) => {
            let mut bytes = [0; 16];
            bytes[..4].copy_from_slice(&v4.octets());
            bytes
        }
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The address of family `af` in `union nf_inet_addr` bytes; `None` for
/// another family or too few bytes.
fn read_inet_addr(af: u16, bytes: &[u8]) -> Option<IpAddr> {
    match af {
        AF_INET => read_ipv4(bytes).map(IpAddr::V4),
        AF_INET6 => {
            let octets: [u8; 16] = bytes.get(..16)?.try_into().ok()?;
            Some(IpAddr::V6(Ipv6Addr::from(octets)))
        }
        _ => None,
    }
}

/// The persistence netmask: one template per client address, kube-proxy's
/// /32 (a mask) for IPv4, /128 (a prefix length, as the kernel takes it
/// for IPv6) for IPv6.
fn persistence_netmask(addr: IpAddr) -> u32 {
    match addr {
        IpAddr::V4(_) => u32::MAX,
        IpAddr::V6(_) => 128,
    }
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
        let mut socket = Socket::open(NETLINK_GENERIC)?;
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

    pub fn add_service(&mut self, key: &VirtualKey, entry: ServiceEntry<'_>) -> Result<()> {
        let message = service_message(self.family, IPVS_CMD_NEW_SERVICE, key, Some(entry));
        self.do_cmd(&message, format_args!("adding the virtual server {key}"))
    }

    /// Rewrites the scheduler and persistence of `key` (its real servers
    /// stay).
    pub fn set_service(&mut self, key: &VirtualKey, entry: ServiceEntry<'_>) -> Result<()> {
        let message = service_message(self.family, IPVS_CMD_SET_SERVICE, key, Some(entry));
        self.do_cmd(&message, format_args!("setting the scheduler and persistence of {key}"))
    }

    pub fn del_service(&mut self, key: &VirtualKey) -> Result<()> {
        let message = service_message(self.family, IPVS_CMD_DEL_SERVICE, key, None);
        self.do_cmd(&message, format_args!("deleting the virtual server {key}"))
    }

    /// Adds (`IPVS_CMD_NEW_DEST`), re-weights (`SET_DEST`) or deletes
    /// (`DEL_DEST`) one real server of `key`.
    pub fn dest(&mut self, cmd: u8, key: &VirtualKey, real: Real, weight: u32) -> Result<()> {
        let message = dest_message(self.family, cmd, key, real, weight);
        self.do_cmd(
            &message,
            format_args!(
                "real server {} (weight {weight}) of {key}, command {cmd}",
                std::net::SocketAddr::from(real)
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

    /// Every TCP/UDP virtual server (IPv4 and IPv6) with its real servers.
    pub fn list(&mut self) -> Result<BTreeMap<VirtualKey, VirtualServer>> {
        let mut out = BTreeMap::new();
        for (key, scheduler, persistence) in self.dump_services()? {
            let reals = self.reals(&key)?;
            out.insert(
                key,
                VirtualServer {
                    scheduler,
                    persistence,
                    reals,
                },
            );
        }
        Ok(out)
    }

    /// `(key, scheduler, persistence)` of every TCP/UDP virtual server.
    pub(super) fn dump_services(&mut self) -> Result<Vec<(VirtualKey, String, Option<u32>)>> {
        let message = Message::genl(
            self.family,
            IPVS_CMD_GET_SERVICE,
            IPVS_VERSION,
            NLM_F_REQUEST | NLM_F_DUMP,
        );
        let answers = self.socket.request(&message).context("listing the virtual servers")?;
        Ok(answers.iter().filter_map(|answer| parse_service(answer)).collect())
    }

    /// One virtual server, if it exists.
    pub fn get(&mut self, key: &VirtualKey) -> Result<Option<VirtualServer>> {
        let message = service_message(self.family, IPVS_CMD_GET_SERVICE, key, None);
        let answers = match self.socket.request(&message) {
            Ok(answers) => answers,
            Err(e) if errno(&e) == Some(libc::ESRCH) => return Ok(None),
            Err(e) => return Err(e.context(format!("reading the virtual server {key}"))),
        };
        let Some((_, scheduler, persistence)) = answers.iter().find_map(|a| parse_service(a)) else {
            return Ok(None);
        };
        let reals = self.reals(key)?;
        Ok(Some(VirtualServer {
            scheduler,
            persistence,
            reals,
        }))
    }

    fn reals(&mut self, key: &VirtualKey) -> Result<BTreeMap<Real, u32>> {
        self.dump_reals(key, parse_dest)
    }

    /// The real servers of `key`, each answer read by `parse` (given the
    /// virtual server's address family); those it cannot read left out.
    fn dump_reals<T, C: FromIterator<T>>(
        &mut self,
        key: &VirtualKey,
        parse: impl Fn(&[u8], u16) -> Option<T>,
    ) -> Result<C> {
        let mut message = Message::genl(self.family, IPVS_CMD_GET_DEST, IPVS_VERSION, NLM_F_REQUEST | NLM_F_DUMP);
        message.nested(IPVS_CMD_ATTR_SERVICE, |m| service_key(m, key));
        let answers = self
            .socket
            .request(&message)
            .with_context(|| format!("listing the real servers of {key}"))?;
        let af = family_of(key.addr);
        Ok(answers.iter().filter_map(|a| parse(a, af)).collect())
    }
}

fn service_key(m: &mut Message, key: &VirtualKey) {
    m.u16(IPVS_SVC_ATTR_AF, family_of(key.addr))
        .u16(IPVS_SVC_ATTR_PROTOCOL, ipproto(key.protocol))
        .attr(IPVS_SVC_ATTR_ADDR, &inet_addr(key.addr))
        .attr(IPVS_SVC_ATTR_PORT, &key.port.to_be_bytes());
}

/// A service command; `entry` makes it a full entry (scheduler, flags,
/// timeout, netmask), as NEW/SET need.
pub fn service_message(family: u16, cmd: u8, key: &VirtualKey, entry: Option<ServiceEntry<'_>>) -> Message {
    let mut message = Message::genl(family, cmd, IPVS_VERSION, NLM_F_REQUEST | NLM_F_ACK);
    message.nested(IPVS_CMD_ATTR_SERVICE, |m| {
        service_key(m, key);
        if let Some(entry) = entry {
            // `struct ip_vs_flags { flags, mask }`: the mask covers every
            // bit, so a SET clears persistence as well as it sets it.
            let flag = if entry.persistence.is_some() {
                IP_VS_SVC_F_PERSISTENT
            } else {
                0
            };
            let mut flags = [0u8; 8];
            flags[..4].copy_from_slice(&flag.to_ne_bytes());
            flags[4..].copy_from_slice(&u32::MAX.to_ne_bytes());
            m.string(IPVS_SVC_ATTR_SCHED_NAME, entry.scheduler)
                .attr(IPVS_SVC_ATTR_FLAGS, &flags)
                .u32(IPVS_SVC_ATTR_TIMEOUT, entry.persistence.unwrap_or(0))
                .u32(IPVS_SVC_ATTR_NETMASK, persistence_netmask(key.addr));
        }
    });
    message
}

/// A real server command (always a full entry: masquerading, `weight`, no
/// thresholds). The real server's family is its own attribute; IPVS
/// masquerading needs it to be the virtual server's.
pub fn dest_message(family: u16, cmd: u8, key: &VirtualKey, real: Real, weight: u32) -> Message {
    let mut message = Message::genl(family, cmd, IPVS_VERSION, NLM_F_REQUEST | NLM_F_ACK);
    message.nested(IPVS_CMD_ATTR_SERVICE, |m| service_key(m, key));
    message.nested(IPVS_CMD_ATTR_DEST, |m| {
        m.attr(IPVS_DEST_ATTR_ADDR, &inet_addr(real.0))
            .attr(IPVS_DEST_ATTR_PORT, &real.1.to_be_bytes())
            .u32(IPVS_DEST_ATTR_FWD_METHOD, IP_VS_CONN_F_MASQ)
            .u32(IPVS_DEST_ATTR_WEIGHT, weight)
            .u32(IPVS_DEST_ATTR_U_THRESH, 0)
            .u32(IPVS_DEST_ATTR_L_THRESH, 0)
            .u16(IPVS_DEST_ATTR_ADDR_FAMILY, family_of(real.0));
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

/// `(key, scheduler, persistence)` from a generic netlink payload holding
/// a service.
fn parse_service(payload: &[u8]) -> Option<(VirtualKey, String, Option<u32>)> {
    let top = attrs(payload.get(4..)?);
    let service = find(&top, IPVS_CMD_ATTR_SERVICE)?;
    let fields = attrs(&service);
    let af = read_u16(&find(&fields, IPVS_SVC_ATTR_AF)?)?;
    let protocol = protocol_of(read_u16(&find(&fields, IPVS_SVC_ATTR_PROTOCOL)?)?)?;
    let addr = read_inet_addr(af, &find(&fields, IPVS_SVC_ATTR_ADDR)?)?;
    let port = u16::from_be_bytes(find(&fields, IPVS_SVC_ATTR_PORT)?.get(..2)?.try_into().ok()?);
    let scheduler = find(&fields, IPVS_SVC_ATTR_SCHED_NAME)
        .map(|s| String::from_utf8_lossy(&s).trim_end_matches('\0').to_owned())
        .unwrap_or_default();
    // The kernel answers its own flags (HASHED among them) with a full mask.
    let flags = find(&fields, IPVS_SVC_ATTR_FLAGS).and_then(|f| read_u32(f.get(..4)?));
    let persistence = match flags {
        Some(flags) if flags & IP_VS_SVC_F_PERSISTENT != 0 => Some(
            find(&fields, IPVS_SVC_ATTR_TIMEOUT)
                .and_then(|t| read_u32(&t))
                .unwrap_or(0),
        ),
        _ => None,
    };
    Some((VirtualKey { protocol, addr, port }, scheduler, persistence))
}

/// The address of a destination's attributes: of its own family where the
/// kernel says it (`IPVS_DEST_ATTR_ADDR_FAMILY`, since 4.9), else of its
/// virtual server's, which the dump request named (`service_af`).
fn dest_addr(fields: &[(u16, &[u8])], service_af: u16) -> Option<IpAddr> {
    let af = find(fields, IPVS_DEST_ATTR_ADDR_FAMILY)
        .and_then(|f| read_u16(&f))
        .unwrap_or(service_af);
    read_inet_addr(af, &find(fields, IPVS_DEST_ATTR_ADDR)?)
}

/// `((address, port), weight)` from a payload holding a destination of a
/// virtual server of family `service_af`.
fn parse_dest(payload: &[u8], service_af: u16) -> Option<(Real, u32)> {
    let top = attrs(payload.get(4..)?);
    let dest = find(&top, IPVS_CMD_ATTR_DEST)?;
    let fields = attrs(&dest);
    let addr = dest_addr(&fields, service_af)?;
    let port = u16::from_be_bytes(find(&fields, IPVS_DEST_ATTR_PORT)?.get(..2)?.try_into().ok()?);
    let weight = read_u32(&find(&fields, IPVS_DEST_ATTR_WEIGHT)?)?;
    Some(((addr, port), weight))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const SEED: VirtualKey = VirtualKey {
        protocol: Protocol::Tcp,
        addr: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 88)),
        port: 88,
    };

    const SEED6: VirtualKey = VirtualKey {
        protocol: Protocol::Tcp,
        addr: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x88)),
        port: 88,
    };

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn encodes_a_new_service_like_ipvsadm() {
        let entry = ServiceEntry {
            scheduler: "rr",
            persistence: None,
        };
        let bytes = service_message(0x22, IPVS_CMD_NEW_SERVICE, &SEED, Some(entry)).finish(7);
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
        let real = (Ipv4Addr::new(10, 244, 0, 11).into(), 80);
        let bytes = dest_message(0x22, IPVS_CMD_NEW_DEST, &SEED, real, 1).finish(1);
        assert_eq!(bytes[16], IPVS_CMD_NEW_DEST);
        let top = attrs(&bytes[20..]);
        assert_eq!(top.iter().map(|(k, _)| *k).collect::<Vec<_>>(), [1, 2]);
        // The same payload parses back (as a dump answer would carry it).
        assert_eq!(parse_dest(&bytes[16..], AF_INET), Some((real, 1)));
        assert_eq!(parse_service(&bytes[16..]).map(|(k, _, _)| k), Some(SEED));
    }

    /// `ipvsadm -A -t [fd00:96::88]:88 -p`: family AF_INET6 and the 16
    /// address bytes in the service, the real server's family in its own
    /// attribute, and the persistence netmask as a prefix length (the
    /// kernel refuses an IPv6 netmask outside 1..=128).
    #[test]
    fn encodes_ipv6_virtual_and_real_servers() {
        let sticky = ServiceEntry {
            scheduler: "rr",
            persistence: Some(10_800),
        };
        let bytes = service_message(0x22, IPVS_CMD_NEW_SERVICE, &SEED6, Some(sticky)).finish(1);
        let fields = attrs(attrs(&bytes[20..])[0].1);
        assert_eq!(find(&fields, IPVS_SVC_ATTR_AF).and_then(|f| read_u16(&f)), Some(10));
        assert_eq!(
            hex(&find(&fields, IPVS_SVC_ATTR_ADDR).expect("address")),
            "fd000096000000000000000000000088"
        );
        assert_eq!(
            find(&fields, IPVS_SVC_ATTR_NETMASK).and_then(|m| read_u32(&m)),
            Some(128)
        );
        assert_eq!(
            parse_service(&bytes[16..]),
            Some((SEED6, "rr".to_owned(), Some(10_800)))
        );

        let real = ("fd00:10:244::11".parse().expect("an address"), 80);
        let bytes = dest_message(0x22, IPVS_CMD_NEW_DEST, &SEED6, real, 1).finish(1);
        let dest = attrs(attrs(&bytes[20..])[1].1);
        assert_eq!(
            find(&dest, IPVS_DEST_ATTR_ADDR_FAMILY).and_then(|f| read_u16(&f)),
            Some(10)
        );
        assert_eq!(
            hex(&find(&dest, IPVS_DEST_ATTR_ADDR).expect("address")),
            "fd000010024400000000000000000011"
        );
        assert_eq!(parse_dest(&bytes[16..], AF_INET6), Some((real, 1)));
        // An older kernel's answer without the destination's family reads
        // the address as its virtual server's family.
        let mut old = Message::genl(0x22, IPVS_CMD_NEW_DEST, IPVS_VERSION, 0);
        old.nested(IPVS_CMD_ATTR_DEST, |m| {
            m.attr(IPVS_DEST_ATTR_ADDR, &inet_addr(real.0))
                .attr(IPVS_DEST_ATTR_PORT, &80u16.to_be_bytes())
                .u32(IPVS_DEST_ATTR_WEIGHT, 1);
        });
        assert_eq!(parse_dest(&old.finish(1)[16..], AF_INET6), Some((real, 1)));
        assert_eq!(SEED6.to_string(), "TCP [fd00:96::88]:88");
    }

    /// An SCTP virtual server carries IPPROTO_SCTP (132) and parses back
    /// as SCTP, so a sync finds it again rather than re-creating it.
    #[test]
    fn sctp_services_carry_ipproto_sctp_and_parse_back() {
        let sctp = VirtualKey {
            protocol: Protocol::Sctp,
            ..SEED
        };
        let bytes = service_message(0x22, IPVS_CMD_NEW_SERVICE, &sctp, None).finish(1);
        let fields = attrs(attrs(&bytes[20..])[0].1);
        assert_eq!(
            find(&fields, IPVS_SVC_ATTR_PROTOCOL).and_then(|p| read_u16(&p)),
            Some(132)
        );
        assert_eq!(parse_service(&bytes[16..]).map(|(k, _, _)| k), Some(sctp));
    }

    /// kube-proxy's ClientIP affinity: the persistent flag (under a full
    /// mask, so that switching it off clears it) and the timeout; what the
    /// kernel answers parses back to the same persistence.
    #[test]
    fn persistence_sets_the_flag_and_timeout_and_parses_back() {
        let sticky = ServiceEntry {
            scheduler: "rr",
            persistence: Some(10_800),
        };
        let bytes = service_message(0x22, IPVS_CMD_SET_SERVICE, &SEED, Some(sticky)).finish(1);
        let top = attrs(&bytes[20..]);
        let fields = attrs(top[0].1);
        let flags = find(&fields, IPVS_SVC_ATTR_FLAGS).expect("flags");
        assert_eq!(read_u32(&flags[..4]), Some(IP_VS_SVC_F_PERSISTENT));
        assert_eq!(read_u32(&flags[4..]), Some(u32::MAX));
        assert_eq!(
            find(&fields, IPVS_SVC_ATTR_TIMEOUT).and_then(|t| read_u32(&t)),
            Some(10_800)
        );
        assert_eq!(
            parse_service(&bytes[16..]).map(|(_, s, p)| (s, p)),
            Some(("rr".to_owned(), Some(10_800)))
        );

        let plain = ServiceEntry {
            persistence: None,
            ..sticky
        };
        let bytes = service_message(0x22, IPVS_CMD_SET_SERVICE, &SEED, Some(plain)).finish(1);
        let fields = attrs(attrs(&bytes[20..])[0].1);
        let flags = find(&fields, IPVS_SVC_ATTR_FLAGS).expect("flags");
        assert_eq!(read_u32(&flags[..4]), Some(0), "switching affinity off clears the flag");
        assert_eq!(parse_service(&bytes[16..]).map(|(_, _, p)| p), Some(None));
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
}
