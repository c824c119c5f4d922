//! The packet's way through the steps, the same for every hook: parse ->
//! fragments (a later fragment gets its first's ports) -> ports (the port
//! filter) -> conntrack -> (new flows: lookup -> source_range ->
//! service_port (pods' short-circuit, the affinity id) -> affinity or
//! select) -> nat or reject;
//! an ICMP error of a tracked flow goes to icmp_error. Each step is its own
//! module; this one only chains them and names the verdict and the outcome.
//! IPv6 packets take `ipv6`'s path, the same steps on the IPv6 maps.

use proxy_common::{
    Backend, ServiceValue, Verdict,
    backend::FLAG_LOCAL,
    conntrack::forward_flags,
    service::{
        FLAG_AFFINITY_CLIENT_IP, FLAG_EXTERNAL_LOCAL, FLAG_NEEDS_SNAT, FLAG_SOURCE_RANGES, FLAGS_EXTERNAL, FLAGS_LOCAL,
    },
};

use crate::{
    affinity,
    conntrack::{self, Tracked},
    context::Ctx,
    fragments,
    headers::Side,
    icmp_error, ipv6, lookup, maps, nat, notrack,
    parse::{self, Flow},
    pod_network, ports,
    reject::{self, Rejection},
    select, service_port, source_range, stats,
};

/// What the hook should do with the packet.
pub enum Outcome {
    /// Untouched (not ours, or malformed).
    Pass,
    /// DNATed towards a backend: continue on the normal path.
    Translated,
    /// A backend's reply, its source rewritten back to the frontend.
    ReverseTranslated,
    /// Rewritten into an answer: send it back where it came from.
    Reply,
    /// Must not go anywhere: half-rewritten after a helper failed, for a
    /// frontend whose `Local` traffic policy finds no backend on this node,
    /// or from a source outside a load balancer IP's source ranges.
    Drop,
}

/// Every hook sees both directions. The packet's own tuple is looked up
/// once in conntrack: a tracked flow's packets are DNATed (forward) or
/// reverse-NATed (reply) from the entry alone; only an untracked packet to
/// a Service frontend is a new flow. Packets whose ports no Service uses
/// pass before any hash lookup.
#[inline(always)]
pub fn process(ctx: &impl Ctx) -> Outcome {
    let len = ctx.frame_len();
    let (verdict, outcome) = match parse::parse(ctx).map(fragments::with_ports) {
        // Tested only once IPv4's parse gave up: an IPv4 packet pays nothing.
        Err(Verdict::PassNotIpv4OrL4) if parse::is_ipv6(ctx) => ipv6::process(ctx),
        Err(verdict) => (verdict, Outcome::Pass),
        Ok(None) => (Verdict::PassFragmentUntracked, Outcome::Pass),
        Ok(Some(flow)) if !ports::may_be_service(flow.sport_be, flow.dport_be) => {
            (Verdict::PassNotService, Outcome::Pass)
        }
        Ok(Some(flow)) => {
            fragments::remember(&flow);
            service_traffic(ctx, &flow)
        }
    };
    stats::count(len, verdict);
    outcome
}

/// A packet that may be Service traffic: of a tracked flow, or a new one.
/// Only a packet with an L4 header opens a flow (a later fragment of an
/// untracked one is passed as it is).
#[inline(always)]
fn service_traffic(ctx: &impl Ctx, flow: &Flow) -> (Verdict, Outcome) {
    if flow.icmp_error {
        return icmp_error(ctx, flow);
    }
    match conntrack::lookup(flow) {
        Some(tracked) if tracked.reply => reverse(ctx, flow, &tracked),
        Some(tracked) => established(ctx, flow, &tracked),
        None if flow.is_later_fragment() => (Verdict::PassFragmentUntracked, Outcome::Pass),
        // It passed the filter on its source port (a backend's), but no
        // frontend has its destination port: pod-to-pod traffic on a port
        // Services also target, spared a frontend lookup that cannot match.
        None if !ports::to_frontend(flow.dport_be) => (Verdict::PassNotService, Outcome::Pass),
        None => match lookup::frontend(flow) {
            Some(svc) => new_flow(ctx, flow, &svc),
            None => (Verdict::PassNotService, Outcome::Pass),
        },
    }
}

/// An ICMP error about a packet of a tracked flow, translated as the
/// flow's packets going its way (see `icmp_error`); one about anything
/// else is not ours.
#[inline(always)]
fn icmp_error(ctx: &impl Ctx, flow: &Flow) -> (Verdict, Outcome) {
    let Some(tracked) = conntrack::lookup_related(flow) else {
        return (Verdict::PassNotService, Outcome::Pass);
    };
    let (quoted, outer, old, outcome) = if tracked.reply {
        let backend = (flow.saddr_be, flow.sport_be);
        (Side::Destination, Side::Source, backend, Outcome::ReverseTranslated)
    } else {
        let frontend = (flow.daddr_be, flow.dport_be);
        (Side::Source, Side::Destination, frontend, Outcome::Translated)
    };
    if tracked.notrack && !notrack::mark(ctx) {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    match icmp_error::translate(ctx, flow.proto, quoted, outer, old, tracked.nat) {
        Ok(()) => (Verdict::IcmpError, outcome),
        Err(()) => (Verdict::Error, Outcome::Drop),
    }
}

/// A packet of a tracked flow, client -> frontend: to the flow's backend,
/// whatever happened to the Service since (the agent deletes the entries
/// of flows that must not go on).
#[inline(always)]
fn established(ctx: &impl Ctx, flow: &Flow, tracked: &Tracked) -> (Verdict, Outcome) {
    if !marked(ctx, tracked.snat, tracked.notrack) {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    if tracked.handed_to_tc {
        // The first packet of a flow XDP picked a backend for: new.
        conntrack::taken_over(tracked);
        return translated(nat::dnat(ctx, flow, tracked.nat), Verdict::DnatNew);
    }
    translated(nat::dnat(ctx, flow, tracked.nat), Verdict::DnatEstablished)
}

/// A backend's reply of a tracked flow: its source back to the frontend.
#[inline(always)]
fn reverse(ctx: &impl Ctx, flow: &Flow, tracked: &Tracked) -> (Verdict, Outcome) {
    if tracked.notrack && !notrack::mark(ctx) {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    match nat::rev_nat(ctx, flow, tracked.nat) {
        Ok(()) => (Verdict::RevNat, Outcome::ReverseTranslated),
        Err(()) => (Verdict::Error, Outcome::Drop),
    }
}

#[inline(always)]
fn new_flow(ctx: &impl Ctx, flow: &Flow, svc: &ServiceValue) -> (Verdict, Outcome) {
    // Only new flows are filtered: an established one was allowed at its
    // first packet (kube-proxy's KUBE-FW chain is in the nat table, which
    // sees only a connection's first packet, too).
    if svc.flags & FLAG_SOURCE_RANGES != 0 && !source_range::allowed(flow, svc) {
        return (Verdict::DropSourceRange, Outcome::Drop);
    }
    let view = service_port::view(svc, || pod_network::contains(flow.saddr_be));
    let svc = &view.svc;
    let Some((id, backend)) = pick_backend(flow, svc, view.affinity_id) else {
        return no_backend(svc, || reject::reject(ctx, flow));
    };
    let snat = needs_snat(flow, svc, &backend);
    let notrack = notrack::wanted(ctx, snat, || pod_network::contains(backend.addr_be));
    // Where XDP cannot mark the packet (a driver without metadata), the tc
    // hook behind finds the flow tracked, marks and DNATs it. The backend
    // picked here must be kept: picking again in tc would re-roll every
    // pick that needs SNAT (a backend on another node) and so favour local
    // backends, 3:1 with half the backends remote.
    let handed_to_tc = !marked(ctx, snat, notrack);
    let flags = forward_flags(snat, handed_to_tc, notrack);
    // Untracked, the flow's replies would not be recognised: pass it as is.
    if conntrack::create(flow, id, &backend, svc.rev_nat_id, flags).is_err() {
        return (Verdict::Error, Outcome::Pass);
    }
    if handed_to_tc {
        return (Verdict::PassToTc, Outcome::Pass);
    }
    translated(
        nat::dnat(ctx, flow, (backend.addr_be, backend.port_be)),
        Verdict::DnatNew,
    )
}

/// Gives a packet of a flow the mark the flow needs (SNAT's, notrack's
/// or none); `false` if it needs one XDP cannot give it.
#[inline(always)]
pub fn marked(ctx: &impl Ctx, snat: bool, notrack: bool) -> bool {
    if snat {
        ctx.add_mark(maps::snat_mark())
    } else if notrack {
        notrack::mark(ctx)
    } else {
        true
    }
}

/// A new flow to a frontend without a backend to pick, for either family
/// (`answer` rewrites the packet into the family's answer).
#[inline(always)]
pub fn no_backend(svc: &ServiceValue, answer: impl FnOnce() -> Rejection) -> (Verdict, Outcome) {
    if svc.backend_count != 0 {
        return (Verdict::Error, Outcome::Pass);
    }
    // kube-proxy drops what a Local policy leaves without endpoints
    // (the Service has some elsewhere), and rejects only Services
    // without any.
    if svc.flags & FLAGS_LOCAL != 0 {
        return (Verdict::DropNoLocalBackend, Outcome::Drop);
    }
    match answer() {
        Rejection::Answered => (Verdict::RejectNoBackend, Outcome::Reply),
        Rejection::NotAnswered => (Verdict::RejectNoBackend, Outcome::Pass),
        Rejection::Failed => (Verdict::Error, Outcome::Drop),
    }
}

/// The backend of a new flow: the client's of before under ClientIP
/// affinity (kept per Service port: `affinity_id`), else Maglev's or a
/// random one of the frontend's run (remembered under affinity). One call
/// site of `new_flow_backend`: the verifier walks it once.
#[inline(always)]
fn pick_backend(flow: &Flow, svc: &ServiceValue, affinity_id: u32) -> Option<(u32, Backend)> {
    let sticky = svc.flags & FLAG_AFFINITY_CLIENT_IP != 0;
    if sticky && let Some(kept) = affinity::kept_backend(flow, svc, affinity_id) {
        return Some(kept);
    }
    let picked = select::new_flow_backend(flow, svc)?;
    if sticky {
        affinity::remember(flow, affinity_id, picked.0);
    }
    Some(picked)
}

/// Whether the kernel must also source-NAT the flow, for its replies to come
/// back through this node: a pod reaching itself through its Service
/// (hairpin), external traffic (node port, external or LB IP) to a
/// backend on another node (never with the `Local` external policy, which
/// keeps the client's address), or
/// masqueradeAll. Off when the agent configured no mark.
#[inline(always)]
fn needs_snat(flow: &Flow, svc: &ServiceValue, backend: &Backend) -> bool {
    snat_wanted(svc, backend.flags, flow.saddr_be == backend.addr_be)
}

/// [`needs_snat`] for either family: `backend_flags` the backend's,
/// `hairpin` whether the client is the backend itself.
#[inline(always)]
pub fn snat_wanted(svc: &ServiceValue, backend_flags: u8, hairpin: bool) -> bool {
    if maps::snat_mark() == 0 {
        return false;
    }
    let external_cluster = svc.flags & FLAGS_EXTERNAL != 0 && svc.flags & FLAG_EXTERNAL_LOCAL == 0;
    svc.flags & FLAG_NEEDS_SNAT != 0 || hairpin || (external_cluster && backend_flags & FLAG_LOCAL == 0)
}

#[inline(always)]
pub fn translated(result: Result<(), ()>, verdict: Verdict) -> (Verdict, Outcome) {
    match result {
        Ok(()) => (verdict, Outcome::Translated),
        Err(()) => (Verdict::Error, Outcome::Drop),
    }
}
