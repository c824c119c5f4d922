//! Deleting UDP flows from the kernel's connection tracking over netlink
//! (ctnetlink, `NFNL_SUBSYS_CTNETLINK`): one dump of the IPv4 table (and
//! one of the IPv6 table when a filter is of that family), then an
//! `IPCTNL_MSG_CT_DELETE` of each entry a filter matches, all on one
//! socket. The two families differ only in the address attributes
//! (`CTA_IP_V4_*`, 4 bytes; `CTA_IP_V6_*`, 16 bytes): see [`TupleAddr`]. This is what `conntrack -D -p udp --orig-dst ... --dst-nat ...`
//! does, without a process per filter (kube-proxy moved to netlink too).
//! The filters are applied here rather than in the kernel: the kernel's
//! own flush filter cannot match the NAT target on every kernel the modes
//! run on.

use std::{
    fmt::Debug,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::{Context, Result};
use tracing::debug;

use super::netlink::{
    Message, NETLINK_NETFILTER, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, Socket, attrs, errno, find, read_ipv4,
};
use crate::model::IpFamily;

// linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NFNETLINK_V0: u8 = 0;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
/// `IPS_DST_NAT` in `CTA_STATUS`: the flow's destination was translated.
const IPS_DST_NAT: u32 = 1 << 5;
const IPPROTO_UDP: u8 = 17;

/// An address of one family as ctnetlink carries it in a tuple.
pub trait TupleAddr: Copy + Debug + Eq + Into<IpAddr> {
    /// The table (`nfgen_family`) the entries are in.
    const FAMILY: IpFamily;
    /// `CTA_IP_V4_SRC` / `CTA_IP_V6_SRC`.
    const SRC: u16;
    /// `CTA_IP_V4_DST` / `CTA_IP_V6_DST`.
    const DST: u16;
    /// The address from an attribute's payload.
    fn read(bytes: &[u8]) -> Option<Self>;
    /// The address as an attribute's payload (network order).
    fn bytes(self) -> Vec<u8>;
}

impl TupleAddr for Ipv4Addr {
    const FAMILY: IpFamily = IpFamily::V4;
    const SRC: u16 = CTA_IP_V4_SRC;
    const DST: u16 = CTA_IP_V4_DST;

    fn read(bytes: &[u8]) -> Option<Self> {
        read_ipv4(bytes)
    }

    fn bytes(self) -> Vec<u8> {
        self.octets().to_vec()
    }
}

impl TupleAddr for Ipv6Addr {
    const FAMILY: IpFamily = IpFamily::V6;
    const SRC: u16 = CTA_IP_V6_SRC;
    const DST: u16 = CTA_IP_V6_DST;

    fn read(bytes: &[u8]) -> Option<Self> {
        let octets: [u8; 16] = bytes.get(..16)?.try_into().ok()?;
        Some(Ipv6Addr::from(octets))
    }

    fn bytes(self) -> Vec<u8> {
        self.octets().to_vec()
    }
}

/// The `nfgen_family` of a table.
fn af(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => libc::AF_INET as u8,
        IpFamily::V6 => libc::AF_INET6 as u8,
    }
}

/// UDP flows to delete, by what their conntrack entry holds; a field left
/// `None` matches anything. A filter looks into the table of its `family`
/// only (a node port is open in both: each family's flows have a filter
/// of their own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct UdpFlowFilter {
    /// The table the flows are in.
    pub family: IpFamily,
    /// The original destination address (where the client sent to).
    pub orig_dst: Option<IpAddr>,
    /// The original destination port.
    pub orig_dst_port: Option<u16>,
    /// The address the flow was DNATed to (its replies' source).
    pub dst_nat: Option<IpAddr>,
}

impl UdpFlowFilter {
    /// Whether `entry` is one of these flows (as `conntrack -D -p udp`
    /// with `--orig-dst`, `--orig-port-dst`, `--dst-nat` judges it).
    pub fn matches<A: TupleAddr>(&self, entry: &Entry<A>) -> bool {
        self.family == A::FAMILY
            && entry.orig.proto == IPPROTO_UDP
            && self.orig_dst.is_none_or(|dst| entry.orig.dst.into() == dst)
            && self.orig_dst_port.is_none_or(|port| entry.orig.dport == port)
            && self
                .dst_nat
                .is_none_or(|nat| entry.dst_nat && entry.reply.src.into() == nat)
    }
}

/// One direction of a tracked flow (IPv4 unless said otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuple<A = Ipv4Addr> {
    pub src: A,
    pub dst: A,
    /// The IP protocol number.
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
}

/// A conntrack entry, as far as the filters look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry<A = Ipv4Addr> {
    /// The flow as the client sent it.
    pub orig: Tuple<A>,
    /// The flow as the replies come back (source: the DNAT target).
    pub reply: Tuple<A>,
    /// Whether the destination was translated.
    pub dst_nat: bool,
    /// The conntrack zone, if not the default one.
    zone: Option<u16>,
}

impl<A> Entry<A> {
    /// An entry of the default zone (for tables built by hand).
    pub fn new(orig: Tuple<A>, reply: Tuple<A>, dst_nat: bool) -> Self {
        Self {
            orig,
            reply,
            dst_nat,
            zone: None,
        }
    }
}

/// Every IPv4 entry of the calling thread's network namespace (`xproxy
/// status` counts the rule-based modes' flows from them).
pub fn list_entries() -> Result<Vec<Entry>> {
    list_entries_of()
}

/// Every entry of the table of `A`'s family.
pub fn list_entries_of<A: TupleAddr>() -> Result<Vec<Entry<A>>> {
    let mut socket = Socket::open(NETLINK_NETFILTER)?;
    let mut entries = Vec::new();
    socket
        .request_each(&dump_message(A::FAMILY), |payload| {
            entries.extend(parse_entry(payload));
            Ok(())
        })
        .context("listing the conntrack table")?;
    Ok(entries)
}

/// Deletes the flows any of `filters` matches from the calling thread's
/// network namespace; returns how many entries went. An entry that expires
/// between the dump and its deletion is not an error.
pub fn delete_udp_flows(filters: &[UdpFlowFilter]) -> Result<u64> {
    if filters.is_empty() {
        return Ok(0);
    }
    let mut socket = Socket::open(NETLINK_NETFILTER)?;
    let deleted = delete_in::<Ipv4Addr>(&mut socket, filters)? + delete_in::<Ipv6Addr>(&mut socket, filters)?;
    debug!(filters = filters.len(), deleted, "deleted stale UDP flows");
    Ok(deleted)
}

/// [`delete_udp_flows`] in the table of `A`'s family: no dump at all
/// when no filter is of that family.
fn delete_in<A: TupleAddr>(socket: &mut Socket, filters: &[UdpFlowFilter]) -> Result<u64> {
    if !filters.iter().any(|f| f.family == A::FAMILY) {
        return Ok(0);
    }
    let mut doomed = Vec::new();
    socket
        .request_each(&dump_message(A::FAMILY), |payload| {
            if let Some(entry) = parse_entry::<A>(payload)
                && filters.iter().any(|f| f.matches(&entry))
            {
                doomed.push(entry);
            }
            Ok(())
        })
        .with_context(|| format!("listing the {:?} conntrack table", A::FAMILY))?;
    let mut deleted = 0;
    for entry in &doomed {
        match socket.request(&delete_message(entry)) {
            Ok(_) => deleted += 1,
            Err(e) if errno(&e) == Some(libc::ENOENT) => {}
            Err(e) => return Err(e.context(format!("deleting the conntrack entry {entry:?}"))),
        }
    }
    Ok(deleted)
}

/// A ctnetlink message of `kind` about the entries of `family`.
fn message(kind: u16, flags: u16, family: IpFamily) -> Message {
    let nfgenmsg = [af(family), NFNETLINK_V0, 0, 0];
    Message::new((NFNL_SUBSYS_CTNETLINK << 8) | kind, flags, &nfgenmsg)
}

/// Lists the table of `family`.
fn dump_message(family: IpFamily) -> Message {
    message(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, family)
}

/// Deletes `entry`, named by its original tuple (and zone).
fn delete_message<A: TupleAddr>(entry: &Entry<A>) -> Message {
    let mut message = message(IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK, A::FAMILY);
    put_tuple(&mut message, CTA_TUPLE_ORIG, entry.orig);
    if let Some(zone) = entry.zone {
        message.attr(CTA_ZONE, &zone.to_be_bytes());
    }
    message
}

/// `tuple` as attribute `kind` (`CTA_TUPLE_ORIG`/`_REPLY`), nested as the
/// kernel nests it.
fn put_tuple<A: TupleAddr>(message: &mut Message, kind: u16, tuple: Tuple<A>) {
    message.nested(kind, |m| {
        m.nested(CTA_TUPLE_IP, |m| {
            m.attr(A::SRC, &tuple.src.bytes()).attr(A::DST, &tuple.dst.bytes());
        })
        .nested(CTA_TUPLE_PROTO, |m| {
            m.attr(CTA_PROTO_NUM, &[tuple.proto])
                .attr(CTA_PROTO_SRC_PORT, &tuple.sport.to_be_bytes())
                .attr(CTA_PROTO_DST_PORT, &tuple.dport.to_be_bytes());
        });
    });
}

/// An entry from a dump answer's payload (after the netlink header); `None`
/// for anything that is not a TCP/UDP-like entry of `A`'s family with both
/// tuples.
fn parse_entry<A: TupleAddr>(payload: &[u8]) -> Option<Entry<A>> {
    let top = attrs(payload.get(4..)?);
    let status = find(&top, CTA_STATUS).and_then(|s| Some(u32::from_be_bytes(s.get(..4)?.try_into().ok()?)));
    let zone = find(&top, CTA_ZONE)
        .and_then(|z| Some(u16::from_be_bytes(z.get(..2)?.try_into().ok()?)))
        .filter(|z| *z != 0);
    Some(Entry {
        orig: parse_tuple(&find(&top, CTA_TUPLE_ORIG)?)?,
        reply: parse_tuple(&find(&top, CTA_TUPLE_REPLY)?)?,
        dst_nat: status.is_some_and(|s| s & IPS_DST_NAT != 0),
        zone,
    })
}

fn parse_tuple<A: TupleAddr>(tuple: &[u8]) -> Option<Tuple<A>> {
    let fields = attrs(tuple);
    let ip = find(&fields, CTA_TUPLE_IP)?;
    let ip = attrs(&ip);
    let proto = find(&fields, CTA_TUPLE_PROTO)?;
    let proto = attrs(&proto);
    let port = |kind| Some(u16::from_be_bytes(find(&proto, kind)?.get(..2)?.try_into().ok()?));
    Some(Tuple {
        src: A::read(&find(&ip, A::SRC)?)?,
        dst: A::read(&find(&ip, A::DST)?)?,
        proto: *find(&proto, CTA_PROTO_NUM)?.first()?,
        sport: port(CTA_PROTO_SRC_PORT)?,
        dport: port(CTA_PROTO_DST_PORT)?,
    })
}

#[cfg(test)]
mod tests;
