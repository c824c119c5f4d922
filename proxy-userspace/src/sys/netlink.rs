//! Netlink, as the agent speaks it by hand where no crate in the build
//! covers a family (IPVS over generic netlink, conntrack over
//! nfnetlink): a blocking socket of one protocol that sends a request and
//! collects the answers, and the message and attribute codec (a netlink
//! header, a family header, attributes padded to 4 bytes). The codec is
//! pure and unit-tested; the socket is `netlink-sys`'s, bound in the
//! network namespace of the thread that opened it.

use std::{io, net::Ipv4Addr};

use anyhow::{Context, Result, bail};
use netlink_sys::SocketAddr;
pub use netlink_sys::protocols::{NETLINK_GENERIC, NETLINK_NETFILTER, NETLINK_ROUTE};

// Netlink message types and flags (linux/netlink.h).
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLMSG_HDRLEN: usize = 16;
pub const NLA_HDRLEN: usize = 4;

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
    pub fn genl(family: u16, cmd: u8, version: u8, flags: u16) -> Self {
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

pub fn find(attrs: &[(u16, &[u8])], kind: u16) -> Option<Vec<u8>> {
    attrs.iter().find(|(k, _)| *k == kind).map(|(_, v)| v.to_vec())
}

pub fn read_u16(bytes: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(bytes.get(..2)?.try_into().ok()?))
}

pub fn read_u32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?))
}

pub fn read_ipv4(bytes: &[u8]) -> Option<Ipv4Addr> {
    let octets: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
    Some(Ipv4Addr::from(octets))
}

/// A netlink socket of one protocol, in the network namespace of the
/// thread that opened it.
pub struct Socket {
    socket: netlink_sys::Socket,
    seq: u32,
    buf: Vec<u8>,
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

/// Room for one datagram of answers: dumps fill at most a page or two.
const RECV_BUFFER: usize = 1 << 16;

impl Socket {
    /// A socket of netlink `protocol` ([`NETLINK_GENERIC`], ...).
    pub fn open(protocol: isize) -> Result<Self> {
        let socket = netlink_sys::Socket::new(protocol).context("opening a netlink socket")?;
        Ok(Self {
            socket,
            seq: 1,
            buf: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// Sends the message `encode` makes for the next sequence number;
    /// returns that number.
    fn send(&mut self, encode: impl FnOnce(u32) -> Vec<u8>) -> Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let bytes = encode(self.seq);
        self.socket
            .send_to(&bytes, &SocketAddr::new(0, 0), 0)
            .context("sending a netlink message")?;
        Ok(self.seq)
    }

    /// Sends `message` and returns the payloads (after the netlink header)
    /// of the answers, until the ACK or the end of the dump. A kernel error
    /// is returned as [`KernelError`].
    pub fn request(&mut self, message: &Message) -> Result<Vec<Vec<u8>>> {
        self.request_encoded(|seq| message.finish(seq))
    }

    /// [`Socket::request`], handing each answer's payload to `each` as it
    /// arrives instead of collecting them (a dump of a large table).
    pub fn request_each(&mut self, message: &Message, each: impl FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let seq = self.send(|seq| message.finish(seq))?;
        self.receive(seq, each)
    }

    /// [`Socket::request`] of a message a crate encodes (`encode` gets the
    /// sequence number to put in its header).
    pub fn request_encoded(&mut self, encode: impl FnOnce(u32) -> Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let seq = self.send(encode)?;
        let mut out = Vec::new();
        self.receive(seq, |payload| {
            out.push(payload.to_vec());
            Ok(())
        })?;
        Ok(out)
    }

    /// Hands the payloads of the answers to request `seq` to `each`, until
    /// the ACK or the end of the dump.
    fn receive(&mut self, seq: u32, mut each: impl FnMut(&[u8]) -> Result<()>) -> Result<()> {
        loop {
            self.buf.clear();
            self.socket.recv(&mut self.buf, 0).context("receiving from netlink")?;
            let mut data = &self.buf[..];
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
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => return ack(payload),
                    _ => each(payload)?,
                }
            }
        }
    }
}

/// What an `NLMSG_ERROR` payload says: 0 is the ACK, else a negative errno.
fn ack(payload: &[u8]) -> Result<()> {
    match payload
        .get(..4)
        .map(|b| i32::from_ne_bytes(b.try_into().unwrap_or([0; 4])))
    {
        Some(0) => Ok(()),
        Some(errno) => Err(KernelError {
            source: io::Error::from_raw_os_error(-errno),
        }
        .into()),
        None => bail!("a truncated netlink error"),
    }
}

/// The kernel's errno in `error`, if it is a [`KernelError`].
pub fn errno(error: &anyhow::Error) -> Option<i32> {
    error.downcast_ref::<KernelError>().and_then(KernelError::errno)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_to_four_bytes() {
        let mut message = Message::new(1, 0, &[]);
        message.string(1, "abcde").u16(2, 9);
        let bytes = message.finish(0);
        assert_eq!(bytes.len(), 16 + 12 + 8);
        let parsed = attrs(&bytes[16..]);
        assert_eq!(parsed, vec![(1, &b"abcde\0"[..]), (2, &9u16.to_ne_bytes()[..])]);
    }

    #[test]
    fn an_error_answer_carries_the_errno() {
        assert!(ack(&0i32.to_ne_bytes()).is_ok());
        let error = ack(&(-libc::ENOENT).to_ne_bytes()).unwrap_err();
        assert_eq!(errno(&error), Some(libc::ENOENT));
        assert!(ack(&[0]).is_err());
    }
}
