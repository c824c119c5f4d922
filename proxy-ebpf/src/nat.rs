//! Destination NAT towards a backend, and reverse NAT of its replies.

use proxy_common::{Backend, RevNat};

use crate::{
    context::{Ctx, Side},
    parse::Flow,
};

/// client -> frontend becomes client -> backend.
#[inline(always)]
pub fn dnat(ctx: &impl Ctx, flow: &Flow, backend: &Backend) -> Result<(), ()> {
    ctx.rewrite(
        flow.proto,
        Side::Destination,
        (flow.daddr_be, flow.dport_be),
        (backend.addr_be, backend.port_be),
    )
}

/// backend -> client becomes frontend -> client, as the client expects.
#[inline(always)]
pub fn rev_nat(ctx: &impl Ctx, flow: &Flow, frontend: &RevNat) -> Result<(), ()> {
    ctx.rewrite(
        flow.proto,
        Side::Source,
        (flow.saddr_be, flow.sport_be),
        (frontend.addr_be, frontend.port_be),
    )
}
