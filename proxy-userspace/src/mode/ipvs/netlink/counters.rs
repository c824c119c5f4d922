//! What `ipvsadm -Ln` shows beyond the table the mode programs: each
//! virtual server's persistence (ClientIP affinity) and each real server's
//! connection counters (active, inactive, persistent), read over the same
//! generic netlink socket. `xproxy status` prints them.

use std::net::IpAddr;

use anyhow::Result;

use super::{IPVS_CMD_ATTR_DEST, IPVS_DEST_ATTR_PORT, IPVS_DEST_ATTR_WEIGHT, Ipvs, VirtualKey, dest_addr};
use crate::sys::netlink::{attrs, find, read_u32};

// linux/ip_vs.h.
const IPVS_DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const IPVS_DEST_ATTR_INACT_CONNS: u16 = 8;
const IPVS_DEST_ATTR_PERSIST_CONNS: u16 = 9;

/// A virtual server with its counters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualCounters {
    pub key: VirtualKey,
    pub scheduler: String,
    /// Persistence timeout in seconds, if the service is persistent.
    pub persistent_seconds: Option<u32>,
    pub reals: Vec<RealCounters>,
}

/// A real server with its connection counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RealCounters {
    pub addr: IpAddr,
    pub port: u16,
    pub weight: u32,
    /// Connections established (TCP) or in use.
    pub active: u32,
    /// Other connections (TCP not established, UDP).
    pub inactive: u32,
    /// Persistence templates (affinity entries) pointing here.
    pub persistent: u32,
}

impl Ipvs {
    /// Every TCP/UDP virtual server (IPv4 and IPv6) with its real servers'
    /// counters.
    pub fn list_counters(&mut self) -> Result<Vec<VirtualCounters>> {
        let mut out = Vec::new();
        for (key, scheduler, persistent_seconds) in self.dump_services()? {
            let reals = self.real_counters(&key)?;
            out.push(VirtualCounters {
                key,
                scheduler,
                persistent_seconds,
                reals,
            });
        }
        Ok(out)
    }

    fn real_counters(&mut self, key: &VirtualKey) -> Result<Vec<RealCounters>> {
        self.dump_reals(key, parse_real)
    }
}

/// A real server and its counters from a payload holding a destination;
/// a counter the kernel leaves out is 0. `service_af`: the virtual
/// server's family.
fn parse_real(payload: &[u8], service_af: u16) -> Option<RealCounters> {
    let top = attrs(payload.get(4..)?);
    let dest = find(&top, IPVS_CMD_ATTR_DEST)?;
    let fields = attrs(&dest);
    let counter = |kind| find(&fields, kind).and_then(|v| read_u32(&v)).unwrap_or(0);
    Some(RealCounters {
        addr: dest_addr(&fields, service_af)?,
        port: u16::from_be_bytes(find(&fields, IPVS_DEST_ATTR_PORT)?.get(..2)?.try_into().ok()?),
        weight: read_u32(&find(&fields, IPVS_DEST_ATTR_WEIGHT)?)?,
        active: counter(IPVS_DEST_ATTR_ACTIVE_CONNS),
        inactive: counter(IPVS_DEST_ATTR_INACT_CONNS),
        persistent: counter(IPVS_DEST_ATTR_PERSIST_CONNS),
    })
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        mode::ipvs::netlink::{IPVS_CMD_NEW_DEST, IPVS_DEST_ATTR_ADDR, IPVS_VERSION, dest_message},
        model::Protocol,
        sys::netlink::Message,
    };

    const KEY: VirtualKey = VirtualKey {
        protocol: Protocol::Tcp,
        addr: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 88)),
        port: 88,
    };

    #[test]
    fn reads_counters_and_takes_missing_ones_as_zero() {
        let real = (IpAddr::V4(Ipv4Addr::new(10, 244, 0, 11)), 80);
        let mut message = dest_message(0x22, IPVS_CMD_NEW_DEST, &KEY, real, 1);
        assert_eq!(
            parse_real(&message.finish(1)[16..], libc::AF_INET as u16),
            Some(RealCounters {
                addr: real.0,
                port: 80,
                weight: 1,
                active: 0,
                inactive: 0,
                persistent: 0,
            })
        );
        message = Message::genl(0x22, IPVS_CMD_NEW_DEST, IPVS_VERSION, 0);
        message.nested(IPVS_CMD_ATTR_DEST, |m| {
            m.attr(IPVS_DEST_ATTR_ADDR, &super::super::inet_addr(real.0))
                .attr(IPVS_DEST_ATTR_PORT, &80u16.to_be_bytes())
                .u32(IPVS_DEST_ATTR_WEIGHT, 0)
                .u32(IPVS_DEST_ATTR_ACTIVE_CONNS, 3)
                .u32(IPVS_DEST_ATTR_INACT_CONNS, 2)
                .u32(IPVS_DEST_ATTR_PERSIST_CONNS, 1);
        });
        let got = parse_real(&message.finish(1)[16..], libc::AF_INET as u16).expect("parses");
        assert_eq!((got.weight, got.active, got.inactive, got.persistent), (0, 3, 2, 1));
    }
}
