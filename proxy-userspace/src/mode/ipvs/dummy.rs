//! `kube-ipvs0`: a dummy interface holding every ClusterIP as a /32, so the
//! kernel treats those addresses as local and IPVS (hooked at LOCAL_IN)
//! sees the packets. Like kube-proxy, the interface stays down: the local
//! routes exist anyway and nothing is sent through it.
//!
//! Spoken over rtnetlink with the codec of [`crate::sys::netlink`].

use std::{collections::BTreeSet, ffi::CString, net::Ipv4Addr};

use anyhow::{Context, Result};

use crate::sys::netlink::{
    Message, NETLINK_ROUTE, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, Socket, attrs, errno,
};

/// The interface's name, kube-proxy's.
pub const DUMMY: &str = "kube-ipvs0";

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const RTM_GETADDR: u16 = 22;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;

/// The addresses of [`DUMMY`] in the network namespace the socket was
/// opened in.
pub struct Dummy {
    socket: Socket,
}

/// `struct ifinfomsg` for `index` (0: by name).
fn ifinfomsg(index: u32) -> [u8; 16] {
    let mut header = [0u8; 16];
    header[4..8].copy_from_slice(&index.to_ne_bytes());
    header
}

/// `struct ifaddrmsg` for an IPv4 /32 on `index`.
fn ifaddrmsg(index: u32) -> [u8; 8] {
    let mut header = [libc::AF_INET as u8, 32, 0, 0, 0, 0, 0, 0];
    header[4..8].copy_from_slice(&index.to_ne_bytes());
    header
}

/// `RTM_NEWLINK` creating a dummy interface `name`.
pub fn new_link_message(name: &str) -> Message {
    let mut message = Message::new(
        RTM_NEWLINK,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        &ifinfomsg(0),
    );
    message.string(IFLA_IFNAME, name).nested(IFLA_LINKINFO, |m| {
        m.string(IFLA_INFO_KIND, "dummy");
    });
    message
}

/// `RTM_NEWADDR`/`RTM_DELADDR` of `addr`/32 on `index`.
pub fn addr_message(kind: u16, index: u32, addr: Ipv4Addr) -> Message {
    let flags = if kind == RTM_NEWADDR {
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    } else {
        NLM_F_REQUEST | NLM_F_ACK
    };
    let mut message = Message::new(kind, flags, &ifaddrmsg(index));
    message
        .attr(IFA_LOCAL, &addr.octets())
        .attr(IFA_ADDRESS, &addr.octets());
    message
}

/// The index of interface `name`, if it exists.
pub fn ifindex(name: &str) -> Option<u32> {
    let name = CString::new(name).ok()?;
    // SAFETY: a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

impl Dummy {
    pub fn open() -> Result<Self> {
        Ok(Self {
            socket: Socket::open(NETLINK_ROUTE)?,
        })
    }

    /// Creates [`DUMMY`] unless it exists; returns its index.
    pub fn ensure(&mut self) -> Result<u32> {
        if let Some(index) = ifindex(DUMMY) {
            return Ok(index);
        }
        match self.socket.request(&new_link_message(DUMMY)) {
            Ok(_) => {}
            Err(e) if errno(&e) == Some(libc::EEXIST) => {}
            Err(e) => return Err(e.context(format!("creating the dummy interface {DUMMY}"))),
        }
        ifindex(DUMMY).with_context(|| format!("{DUMMY} vanished right after it was created"))
    }

    /// The IPv4 addresses on interface `index`.
    pub fn addresses(&mut self, index: u32) -> Result<BTreeSet<Ipv4Addr>> {
        let message = Message::new(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, &ifaddrmsg(0));
        let answers = self.socket.request(&message).context("listing addresses")?;
        let mut out = BTreeSet::new();
        for answer in answers {
            if answer.len() < 8 || u32::from_ne_bytes(answer[4..8].try_into().unwrap_or_default()) != index {
                continue;
            }
            for (kind, value) in attrs(&answer[8..]) {
                if kind == IFA_LOCAL
                    && let Ok(octets) = <[u8; 4]>::try_from(value)
                {
                    out.insert(Ipv4Addr::from(octets));
                }
            }
        }
        Ok(out)
    }

    /// Binds `addr`/32 to `index`; an address already there is fine.
    pub fn add(&mut self, index: u32, addr: Ipv4Addr) -> Result<()> {
        match self.socket.request(&addr_message(RTM_NEWADDR, index, addr)) {
            Ok(_) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
            Err(e) => Err(e.context(format!("binding {addr} to {DUMMY}"))),
        }
    }

    /// Unbinds `addr` from `index`; an address not there is fine.
    pub fn remove(&mut self, index: u32, addr: Ipv4Addr) -> Result<()> {
        match self.socket.request(&addr_message(RTM_DELADDR, index, addr)) {
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
        let message = Message::new(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK, &ifinfomsg(index));
        match self.socket.request(&message) {
            Ok(_) => Ok(true),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(false),
            Err(e) => Err(e.context(format!("deleting {DUMMY}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_dummy_link_names_its_kind() {
        let bytes = new_link_message(DUMMY).finish(1);
        assert_eq!(&bytes[4..6], &RTM_NEWLINK.to_ne_bytes());
        let top = attrs(&bytes[32..]);
        assert_eq!(top[0], (IFLA_IFNAME, &b"kube-ipvs0\0"[..]));
        assert_eq!(top[1].0, IFLA_LINKINFO);
        assert_eq!(attrs(top[1].1), vec![(IFLA_INFO_KIND, &b"dummy\0"[..])]);
    }

    #[test]
    fn an_address_is_a_host_route_on_the_index() {
        let bytes = addr_message(RTM_NEWADDR, 7, Ipv4Addr::new(10, 96, 0, 88)).finish(1);
        assert_eq!(&bytes[16..20], &[libc::AF_INET as u8, 32, 0, 0]);
        assert_eq!(&bytes[20..24], &7u32.to_ne_bytes());
        let top = attrs(&bytes[24..]);
        assert_eq!(top[0], (IFA_LOCAL, &[10, 96, 0, 88][..]));
    }
}
