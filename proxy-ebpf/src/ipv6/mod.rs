//! IPv6 Service traffic: the IPv4 path's steps (`crate::pipeline`) for
//! packets with 16-byte addresses, on the IPv6 maps (`XP_SERVICES6`,
//! `XP_BACKENDS6`, `XP_CT6`; why apart: `proxy_common::ipv6`). parse
//! (extension headers walked) -> ports (the shared port filter) ->
//! conntrack -> lookup -> select -> nat or reject (a RST or an ICMPv6
//! port unreachable for a Service without endpoints, as IPv4's; a `Local`
//! frontend without local endpoints drops), with the verdicts and outcomes
//! IPv4's use.
//!
//! Fragments as IPv4's (`fragments`: a later one is translated as its
//! first's flow, addresses only), and ICMPv6 errors quoting a translated
//! flow (`icmp_error`).
//!
//! SCTP as IPv4's: the address rewritten where the port stays (the agent
//! gives the programs no other SCTP port).

mod conntrack;
mod fragments;
mod icmp_error;
mod parse;
mod reject;

use proxy_common::{
    AffinityKey6, Backend6, Service6Key, ServiceValue, Verdict,
    conntrack::forward_flags,
    maglev::flow_hash6,
    service::{FLAG_AFFINITY_CLIENT_IP, FLAG_SOURCE_RANGES},
};

use self::{
    conntrack::{NewFlow6, Tracked6},
    parse::Flow6,
};
use crate::{
    affinity,
    context::{Addr6, Ctx, L4At},
    headers::Side,
    maps::{AFFINITY6, BACKENDS6, SERVICES6},
    nat::{self, Change},
    notrack,
    parse::Fragment,
    pipeline::{self, Outcome, snat_wanted, translated},
    pod_network, ports, select, service_port, source_range,
};

/// The IPv6 packet's way, from parsing to the rewrite (see the module doc).
#[inline(always)]
pub fn process(ctx: &impl Ctx) -> (Verdict, Outcome) {
    let mut flow = match parse::parse(ctx) {
        Ok(flow) => flow,
        Err(verdict) => return (verdict, Outcome::Pass),
    };
    if !fragments::fill_ports(&mut flow) {
        return (Verdict::PassFragmentUntracked, Outcome::Pass);
    }
    if !ports::may_be_service(flow.sport_be, flow.dport_be) {
        return (Verdict::PassNotService, Outcome::Pass);
    }
    if flow.icmp_error {
        return related(ctx, &flow);
    }
    fragments::remember(&flow);
    match conntrack::lookup(&flow) {
        Some(tracked) if tracked.reply => reverse(ctx, &flow, &tracked),
        Some(tracked) => established(ctx, &flow, &tracked),
        // Only a packet with an L4 header opens a flow.
        None if flow.fragment == Fragment::Later => (Verdict::PassFragmentUntracked, Outcome::Pass),
        // A backend port's packet of no flow: no frontend has its
        // destination port (see `crate::pipeline`).
        None if !ports::to_frontend(flow.dport_be) => (Verdict::PassNotService, Outcome::Pass),
        None => match frontend(&flow) {
            Some(svc) => new_flow(ctx, &flow, &svc),
            None => (Verdict::PassNotService, Outcome::Pass),
        },
    }
}

#[inline(always)]
fn frontend(flow: &Flow6) -> Option<ServiceValue> {
    let key = Service6Key {
        addr_be: *flow.daddr(),
        port_be: flow.dport_be,
        proto: flow.proto,
        _pad: 0,
    };
    // SAFETY: copied out at once, as in `crate::lookup::frontend`.
    unsafe { SERVICES6.get(key).copied() }
}

/// An ICMPv6 error about a packet of a tracked flow, translated as the
/// flow's packets going its way (see `icmp_error`); one about anything
/// else is not ours.
#[inline(always)]
fn related(ctx: &impl Ctx, flow: &Flow6) -> (Verdict, Outcome) {
    let Some(tracked) = conntrack::lookup_related(flow) else {
        return (Verdict::PassNotService, Outcome::Pass);
    };
    let (quoted, outer, old, outcome) = if tracked.reply {
        let backend = (flow.saddr(), flow.sport_be);
        (Side::Destination, Side::Source, backend, Outcome::ReverseTranslated)
    } else {
        let frontend = (flow.daddr(), flow.dport_be);
        (Side::Source, Side::Destination, frontend, Outcome::Translated)
    };
    if tracked.notrack && !notrack::mark(ctx) {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    match icmp_error::translate(ctx, flow, quoted, outer, old, tracked.nat()) {
        Ok(()) => (Verdict::IcmpError, outcome),
        Err(()) => (Verdict::Error, Outcome::Drop),
    }
}

/// A packet of a tracked flow, client -> frontend (see
/// `crate::pipeline::established`).
#[inline(always)]
fn established(ctx: &impl Ctx, flow: &Flow6, tracked: &Tracked6) -> (Verdict, Outcome) {
    if !pipeline::marked(ctx, tracked.snat, tracked.notrack) {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    let verdict = if tracked.handed_to_tc {
        conntrack::taken_over(tracked);
        Verdict::DnatNew
    } else {
        Verdict::DnatEstablished
    };
    translated(dnat(ctx, flow, tracked.nat()), verdict)
}

/// A backend's reply of a tracked flow: its source back to the frontend.
#[inline(always)]
fn reverse(ctx: &impl Ctx, flow: &Flow6, tracked: &Tracked6) -> (Verdict, Outcome) {
    if tracked.notrack && !notrack::mark(ctx) {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    match rewrite(ctx, flow, Side::Source, (flow.saddr(), flow.sport_be), tracked.nat()) {
        Ok(()) => (Verdict::RevNat, Outcome::ReverseTranslated),
        Err(()) => (Verdict::Error, Outcome::Drop),
    }
}

#[inline(always)]
fn new_flow(ctx: &impl Ctx, flow: &Flow6, svc: &ServiceValue) -> (Verdict, Outcome) {
    // Only new flows are filtered, as IPv4's (`crate::pipeline::new_flow`).
    if svc.flags & FLAG_SOURCE_RANGES != 0 && !source_range::allowed6(flow.saddr(), svc) {
        return (Verdict::DropSourceRange, Outcome::Drop);
    }
    let view = service_port::view(svc, || pod_network::contains6(flow.saddr()));
    let svc = &view.svc;
    let Some((backend_id, backend)) = pick_backend(flow, svc, view.affinity_id) else {
        return pipeline::no_backend(svc, || reject::reject(ctx, flow));
    };
    let snat = snat_wanted(svc, backend.flags, *flow.saddr() == backend.addr_be);
    let notrack = notrack::wanted(ctx, snat, || pod_network::contains6(&backend.addr_be));
    // Left to tc where XDP cannot mark, as IPv4's (`crate::pipeline::new_flow`).
    let handed_to_tc = !pipeline::marked(ctx, snat, notrack);
    let new = NewFlow6 {
        backend_id,
        backend: (backend.addr_be, backend.port_be),
        rev_nat_id: svc.rev_nat_id,
        forward_flags: forward_flags(snat, handed_to_tc, notrack),
    };
    if conntrack::create(flow, &new).is_err() {
        return (Verdict::Error, Outcome::Pass);
    }
    if handed_to_tc {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    translated(dnat(ctx, flow, (&new.backend.0, new.backend.1)), Verdict::DnatNew)
}

/// The backend of a new flow, from `XP_BACKENDS6`: the client's of before
/// under ClientIP affinity (kept per Service port in `XP_AFFINITY6`), else
/// Maglev's (the IPv6 tuple hashed) or a random one of the frontend's run
/// (remembered under affinity), as IPv4's.
#[inline(always)]
fn pick_backend(flow: &Flow6, svc: &ServiceValue, affinity_id: u32) -> Option<(u32, Backend6)> {
    let sticky = (svc.flags & FLAG_AFFINITY_CLIENT_IP != 0).then(|| AffinityKey6 {
        affinity_id,
        client_be: *flow.saddr(),
    });
    if let Some(key) = &sticky
        && let Some(kept) = affinity::kept_id(&AFFINITY6, key, svc).and_then(backend6)
    {
        return Some(kept);
    }
    let id = select::new_flow_id(svc, || {
        flow_hash6(flow.saddr(), flow.daddr(), flow.sport_be, flow.dport_be, flow.proto)
    })?;
    if let Some(key) = &sticky {
        affinity::remember_in(&AFFINITY6, key, id);
    }
    backend6(id)
}

/// The IPv6 backend `id` with its id, `None` if it is gone.
#[inline(always)]
fn backend6(id: u32) -> Option<(u32, Backend6)> {
    // SAFETY: copied out at once, as in `crate::lookup::frontend`.
    let backend = unsafe { BACKENDS6.get(id).copied()? };
    Some((id, backend))
}

/// client -> frontend becomes client -> backend.
#[inline(always)]
fn dnat(ctx: &impl Ctx, flow: &Flow6, backend: (&Addr6, u16)) -> Result<(), ()> {
    rewrite(ctx, flow, Side::Destination, (flow.daddr(), flow.dport_be), backend)
}

/// One end's address and port from `old` to `new`, as the protocol
/// allows (decided as IPv4's: see `crate::nat`).
#[inline(always)]
fn rewrite(ctx: &impl Ctx, flow: &Flow6, side: Side, old: (&Addr6, u16), new: (&Addr6, u16)) -> Result<(), ()> {
    let later_fragment = flow.fragment == Fragment::Later;
    match nat::what_changes(flow.proto, later_fragment, old.1, new.1)? {
        Change::Address => ctx.rewrite_addr6(side, old.0, new.0),
        Change::AddressAndPort => {
            let l4 = L4At {
                off: flow.l4_off,
                proto: flow.proto,
            };
            ctx.rewrite6(l4, side, old, new)
        }
    }
}
