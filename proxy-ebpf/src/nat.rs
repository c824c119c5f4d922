//! Destination NAT towards a backend, and reverse NAT of its replies
//! (addresses only in a later fragment, see `fragments`).

use crate::{context::Ctx, headers::Side, parse::Flow};

/// client -> frontend becomes client -> backend (`(address, port)`,
/// network byte order).
#[inline(always)]
pub fn dnat(ctx: &impl Ctx, flow: &Flow, backend: (u32, u16)) -> Result<(), ()> {
    if flow.is_later_fragment() {
        return ctx.rewrite_addr(Side::Destination, flow.daddr_be, backend.0);
    }
    ctx.rewrite(flow.proto, Side::Destination, (flow.daddr_be, flow.dport_be), backend)
}

/// backend -> client becomes frontend -> client, as the client expects.
#[inline(always)]
pub fn rev_nat(ctx: &impl Ctx, flow: &Flow, frontend: (u32, u16)) -> Result<(), ()> {
    if flow.is_later_fragment() {
        return ctx.rewrite_addr(Side::Source, flow.saddr_be, frontend.0);
    }
    ctx.rewrite(flow.proto, Side::Source, (flow.saddr_be, flow.sport_be), frontend)
}
