//! `kube-ipvs0`: a dummy interface holding every ClusterIP as a /32 (an
//! IPv6 one as a /128), so the kernel treats those addresses as local and
//! IPVS (hooked at LOCAL_IN) sees the packets. Like kube-proxy, the
//! interface stays down: the local routes exist anyway and nothing is sent
//! through it. IPv6 addresses are bound without duplicate address detection
//! (`nodad`): the address is no neighbour's business, and a tentative
//! address would not be local until DAD ended.
//!
//! Spoken over rtnetlink: the messages are `netlink-packet-route`'s (the
//! codec under the `rtnetlink` crate), sent on the blocking socket of
//! [`crate::sys::netlink`], as the mode syncs from blocking code.

use std::{collections::BTreeSet, net::IpAddr};

use anyhow::{Context, Result};
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
    Parseable,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressHeaderFlags, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage},
};

use crate::sys::netlink::{NETLINK_ROUTE, Socket, errno};

/// The interface's name, kube-proxy's.
pub const DUMMY: &str = "kube-ipvs0";

/// The addresses of [`DUMMY`] in the network namespace the socket was
/// opened in.
pub struct Dummy {
    socket: Socket,
}

/// `message` with `flags` and sequence number `seq`, as bytes.
fn encode(message: RouteNetlinkMessage, flags: u16, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(message));
    packet.finalize();
    let mut bytes = vec![0; packet.buffer_len()];
    packet.serialize(&mut bytes);
    bytes
}

/// `RTM_NEWLINK` creating a dummy interface `name`.
pub fn new_link_message(name: &str) -> RouteNetlinkMessage {
    let mut link = LinkMessage::default();
    link.attributes.push(LinkAttribute::IfName(name.to_owned()));
    link.attributes
        .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Dummy)]));
    RouteNetlinkMessage::NewLink(link)
}

/// `addr`/32 (or /128, `nodad`) on interface `index`; without `addr`,
/// every address of either family (0: on any interface), a dump request.
pub fn address(index: u32, addr: Option<IpAddr>) -> AddressMessage {
    let mut message = AddressMessage::default();
    message.header.index = index;
    match addr {
        Some(IpAddr::V4(_)) => {
            message.header.family = AddressFamily::Inet;
            message.header.prefix_len = 32;
        }
        Some(IpAddr::V6(_)) => {
            message.header.family = AddressFamily::Inet6;
            message.header.prefix_len = 128;
            message.header.flags = AddressHeaderFlags::Nodad;
        }
        None => message.header.family = AddressFamily::Unspec,
    }
    if let Some(addr) = addr {
        message.attributes.push(AddressAttribute::Local(addr));
        message.attributes.push(AddressAttribute::Address(addr));
    }
    message
}

/// The index of interface `name`, if it exists.
pub fn ifindex(name: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(name).ok()
}

impl Dummy {
    pub fn open() -> Result<Self> {
        Ok(Self {
            socket: Socket::open(NETLINK_ROUTE)?,
        })
    }

    /// Sends `message` with `flags`; the answers' payloads.
    fn request(&mut self, message: RouteNetlinkMessage, flags: u16) -> Result<Vec<Vec<u8>>> {
        self.socket.request_encoded(|seq| encode(message, flags, seq))
    }

    /// Creates [`DUMMY`] unless it exists; returns its index.
    pub fn ensure(&mut self) -> Result<u32> {
        if let Some(index) = ifindex(DUMMY) {
            return Ok(index);
        }
        let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
        match self.request(new_link_message(DUMMY), flags) {
            Ok(_) => {}
            Err(e) if errno(&e) == Some(libc::EEXIST) => {}
            Err(e) => return Err(e.context(format!("creating the dummy interface {DUMMY}"))),
        }
        ifindex(DUMMY).with_context(|| format!("{DUMMY} vanished right after it was created"))
    }

    /// The addresses on interface `index` (IPv4, and IPv6 but link-local,
    /// which the kernel adds by itself and the mode never binds).
    pub fn addresses(&mut self, index: u32) -> Result<BTreeSet<IpAddr>> {
        let dump = RouteNetlinkMessage::GetAddress(address(0, None));
        let answers = self
            .request(dump, NLM_F_REQUEST | NLM_F_DUMP)
            .context("listing addresses")?;
        let mut out = BTreeSet::new();
        for answer in answers {
            // Other kinds of answers, or ones this codec cannot read, are
            // not addresses of ours.
            let Ok(message) = AddressMessage::parse(answer.as_slice()) else {
                continue;
            };
            if message.header.index != index {
                continue;
            }
            // An IPv6 address has no IFA_LOCAL, only IFA_ADDRESS.
            out.extend(message.attributes.iter().filter_map(|attr| match attr {
                AddressAttribute::Local(ip @ IpAddr::V4(_)) => Some(*ip),
                AddressAttribute::Address(ip @ IpAddr::V6(v6)) if v6.segments()[0] & 0xffc0 != 0xfe80 => Some(*ip),
                _ => None,
            }));
        }
        Ok(out)
    }

    /// Binds `addr`/32 to `index`; an address already there is fine.
    pub fn add(&mut self, index: u32, addr: IpAddr) -> Result<()> {
        let message = RouteNetlinkMessage::NewAddress(address(index, Some(addr)));
        match self.request(message, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL) {
            Ok(_) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
            Err(e) => Err(e.context(format!("binding {addr} to {DUMMY}"))),
        }
    }

    /// Unbinds `addr` from `index`; an address not there is fine.
    pub fn remove(&mut self, index: u32, addr: IpAddr) -> Result<()> {
        let message = RouteNetlinkMessage::DelAddress(address(index, Some(addr)));
        match self.request(message, NLM_F_REQUEST | NLM_F_ACK) {
            Ok(_) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EADDRNOTAVAIL) => Ok(()),
            Err(e) => Err(e.context(format!("unbinding {addr} from {DUMMY}"))),
        }
    }

    /// Deletes [`DUMMY`] (with its addresses); true if it existed.
    pub fn delete(&mut self) -> Result<bool> {
        let Some(index) = ifindex(DUMMY) else {
            return Ok(false);
        };
        let mut link = LinkMessage::default();
        link.header.index = index;
        match self.request(RouteNetlinkMessage::DelLink(link), NLM_F_REQUEST | NLM_F_ACK) {
            Ok(_) => Ok(true),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(false),
            Err(e) => Err(e.context(format!("deleting {DUMMY}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::sys::{
        fresh_netns::{privileged, run_in_fresh_netns},
        netlink::{Message, attrs},
    };

    const RTM_NEWLINK: u16 = 16;
    const RTM_NEWADDR: u16 = 20;
    const IFLA_IFNAME: u16 = 3;
    const IFLA_LINKINFO: u16 = 18;
    const IFLA_INFO_KIND: u16 = 1;
    const IFA_ADDRESS: u16 = 1;
    const IFA_LOCAL: u16 = 2;

    #[test]
    fn a_new_dummy_link_names_its_kind() {
        let flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
        let bytes = encode(new_link_message(DUMMY), flags, 1);
        assert_eq!(&bytes[4..6], &RTM_NEWLINK.to_ne_bytes());
        assert_eq!(&bytes[6..8], &flags.to_ne_bytes());
        assert_eq!(&bytes[8..12], &1u32.to_ne_bytes());
        let top = attrs(&bytes[32..]);
        assert_eq!(top[0], (IFLA_IFNAME, &b"kube-ipvs0\0"[..]));
        assert_eq!(top[1].0, IFLA_LINKINFO);
        assert_eq!(attrs(top[1].1), vec![(IFLA_INFO_KIND, &b"dummy\0"[..])]);
        // Byte for byte what the hand-built message was.
        let mut by_hand = Message::new(RTM_NEWLINK, flags, &[0; 16]);
        by_hand.string(IFLA_IFNAME, DUMMY).nested(IFLA_LINKINFO, |m| {
            m.string(IFLA_INFO_KIND, "dummy");
        });
        assert_eq!(bytes, by_hand.finish(1));
    }

    #[test]
    fn an_address_is_a_host_route_on_the_index() {
        let message = RouteNetlinkMessage::NewAddress(address(7, Some(Ipv4Addr::new(10, 96, 0, 88).into())));
        let bytes = encode(message, NLM_F_REQUEST | NLM_F_ACK, 1);
        assert_eq!(&bytes[4..6], &RTM_NEWADDR.to_ne_bytes());
        assert_eq!(&bytes[16..20], &[libc::AF_INET as u8, 32, 0, 0]);
        assert_eq!(&bytes[20..24], &7u32.to_ne_bytes());
        let top = attrs(&bytes[24..]);
        assert_eq!(top[0], (IFA_LOCAL, &[10, 96, 0, 88][..]));
        assert_eq!(top[1], (IFA_ADDRESS, &[10, 96, 0, 88][..]));
        let mut header = [libc::AF_INET as u8, 32, 0, 0, 0, 0, 0, 0];
        header[4..].copy_from_slice(&7u32.to_ne_bytes());
        let mut by_hand = Message::new(RTM_NEWADDR, NLM_F_REQUEST | NLM_F_ACK, &header);
        by_hand
            .attr(IFA_LOCAL, &[10, 96, 0, 88])
            .attr(IFA_ADDRESS, &[10, 96, 0, 88]);
        assert_eq!(bytes, by_hand.finish(1));
        // What a dump answers parses back.
        let parsed = AddressMessage::parse(&bytes[16..]).expect("parses");
        assert_eq!(parsed, address(7, Some(Ipv4Addr::new(10, 96, 0, 88).into())));
    }

    /// `ip addr add fd00:96::88/128 dev kube-ipvs0 nodad`.
    #[test]
    fn an_ipv6_address_is_a_host_route_without_dad() {
        let ip: IpAddr = "fd00:96::88".parse().expect("an address");
        let bytes = encode(RouteNetlinkMessage::NewAddress(address(7, Some(ip))), NLM_F_REQUEST, 1);
        const IFA_F_NODAD: u8 = 0x02;
        assert_eq!(&bytes[16..20], &[libc::AF_INET6 as u8, 128, IFA_F_NODAD, 0]);
        let top = attrs(&bytes[24..]);
        let octets = match ip {
            IpAddr::V6(v6) => v6.octets(),
            IpAddr::V4(_) => unreachable!(),
        };
        assert_eq!(top[0], (IFA_LOCAL, &octets[..]));
        assert_eq!(top[1], (IFA_ADDRESS, &octets[..]));
        let dump = encode(RouteNetlinkMessage::GetAddress(address(0, None)), NLM_F_REQUEST, 1);
        assert_eq!(dump[16], libc::AF_UNSPEC as u8, "a dump lists both families");
    }

    /// Binds, lists and unbinds an address through the kernel (on `lo` of
    /// a fresh namespace), then creates and deletes the interface itself
    /// where the kernel has dummy interfaces (not this project's 6.18
    /// build: the IPVS tests in the 6.1 VM cover that).
    fn dummy_round_trip() {
        const LO: u32 = 1;
        let ip = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 88));
        let ip6: IpAddr = "fd00:96::88".parse().expect("an address");
        let mut dummy = Dummy::open().expect("rtnetlink");
        assert!(dummy.addresses(LO).expect("listed").is_empty());
        for addr in [ip, ip6] {
            dummy.add(LO, addr).expect("bound");
            dummy.add(LO, addr).expect("bound again");
        }
        assert_eq!(dummy.addresses(LO).expect("listed"), BTreeSet::from([ip, ip6]));
        assert!(dummy.addresses(LO + 1).expect("listed").is_empty(), "by index");
        for addr in [ip, ip6] {
            dummy.remove(LO, addr).expect("unbound");
            dummy.remove(LO, addr).expect("unbound again");
        }
        assert!(dummy.addresses(LO).expect("listed").is_empty());

        assert!(!dummy.delete().expect("nothing to delete"));
        let index = match dummy.ensure() {
            Ok(index) => index,
            Err(e) if errno(&e) == Some(libc::EOPNOTSUPP) => {
                eprintln!("this kernel has no dummy interfaces: {e:#}");
                return;
            }
            Err(e) => panic!("creating {DUMMY}: {e:#}"),
        };
        assert_eq!(dummy.ensure().expect("already there"), index);
        assert!(dummy.delete().expect("deleted"));
        assert_eq!(ifindex(DUMMY), None);
    }

    #[test]
    fn the_dummy_interface_round_trips_through_the_kernel() {
        if privileged("the_dummy_interface_round_trips_through_the_kernel") {
            run_in_fresh_netns(dummy_round_trip);
        }
    }
}
