//! Destination NAT towards a backend, and reverse NAT of its replies
//! (addresses only in a later fragment, see `fragments`).
//!
//! SCTP: its CRC32c covers the SCTP packet and no IP pseudo-header, so a
//! new address needs no L4 checksum change, but a new port would need the
//! CRC recomputed over the whole packet, which the programs do not do. The
//! agent programs SCTP frontends only where the port stays (the others are
//! left to the kernel); a port change that still arrives is refused.

use proxy_common::proto;

use crate::{context::Ctx, headers::Side, parse::Flow};

/// client -> frontend becomes client -> backend (`(address, port)`,
/// network byte order).
#[inline(always)]
pub fn dnat(ctx: &impl Ctx, flow: &Flow, backend: (u32, u16)) -> Result<(), ()> {
    rewrite(ctx, flow, Side::Destination, (flow.daddr_be, flow.dport_be), backend)
}

/// backend -> client becomes frontend -> client, as the client expects.
#[inline(always)]
pub fn rev_nat(ctx: &impl Ctx, flow: &Flow, frontend: (u32, u16)) -> Result<(), ()> {
    rewrite(ctx, flow, Side::Source, (flow.saddr_be, flow.sport_be), frontend)
}

/// One end of the packet from `old` to `new`, as its protocol allows.
#[inline(always)]
fn rewrite(ctx: &impl Ctx, flow: &Flow, side: Side, old: (u32, u16), new: (u32, u16)) -> Result<(), ()> {
    match what_changes(flow.proto, flow.is_later_fragment(), old.1, new.1)? {
        Change::Address => ctx.rewrite_addr(side, old.0, new.0),
        Change::AddressAndPort => ctx.rewrite(flow.proto, side, old, new),
    }
}

/// What a rewrite of one end may change, for both families.
pub enum Change {
    /// The address alone: a later fragment has no L4 header, and SCTP's
    /// CRC32c covers no address.
    Address,
    /// The address, the port and the L4 checksum.
    AddressAndPort,
}

/// What a rewrite of one end from port `old_port` to `new_port` changes
/// in a packet of `proto`; `Err` for an SCTP port change (see the module
/// doc).
#[inline(always)]
pub fn what_changes(proto: u8, later_fragment: bool, old_port: u16, new_port: u16) -> Result<Change, ()> {
    if proto == proto::SCTP && old_port != new_port {
        return Err(());
    }
    if later_fragment || proto == proto::SCTP {
        return Ok(Change::Address);
    }
    Ok(Change::AddressAndPort)
}
