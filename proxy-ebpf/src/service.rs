//! The packet's way: parse -> lookup -> conntrack/select -> nat or reject.

use proxy_common::Verdict;

use crate::{
    conntrack,
    context::Ctx,
    lookup,
    maps::REV_NAT,
    nat,
    parse::{self, Flow},
    reject::{self, Rejection},
    select, stats,
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
    /// Half-rewritten after a helper failed: must not go anywhere.
    Drop,
}

/// Whether this hook sees replies of backends it must reverse-NAT.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Replies {
    ReverseNat,
    Ignore,
}

#[inline(always)]
pub fn process(ctx: &impl Ctx, replies: Replies) -> Outcome {
    let len = ctx.frame_len();
    let (verdict, outcome) = match parse::parse(ctx) {
        Err(verdict) => (verdict, Outcome::Pass),
        Ok(flow) => match lookup::frontend(&flow) {
            Some(svc) => to_service(ctx, &flow, &svc),
            None if replies == Replies::ReverseNat => from_backend(ctx, &flow),
            None => (Verdict::PassNotService, Outcome::Pass),
        },
    };
    stats::count(len, verdict);
    outcome
}

#[inline(always)]
fn to_service(ctx: &impl Ctx, flow: &Flow, svc: &proxy_common::ServiceValue) -> (Verdict, Outcome) {
    // A tracked flow keeps its backend while that backend exists, whatever
    // happened to the Service's backend set since.
    if let Some(id) = conntrack::forward_backend(flow)
        && let Some(backend) = select::backend(id)
    {
        return translated(nat::dnat(ctx, flow, &backend), Verdict::DnatEstablished);
    }
    let Some((id, backend)) = select::random_backend(svc) else {
        if svc.backend_count != 0 {
            return (Verdict::Error, Outcome::Pass);
        }
        return match reject::reject(ctx, flow) {
            Rejection::Answered => (Verdict::RejectNoBackend, Outcome::Reply),
            Rejection::NotAnswered => (Verdict::RejectNoBackend, Outcome::Pass),
            Rejection::Failed => (Verdict::Error, Outcome::Drop),
        };
    };
    if conntrack::create(flow, id, backend.addr_be, backend.port_be, svc.rev_nat_id).is_err() {
        return (Verdict::Error, Outcome::Pass);
    }
    translated(nat::dnat(ctx, flow, &backend), Verdict::DnatNew)
}

#[inline(always)]
fn from_backend(ctx: &impl Ctx, flow: &Flow) -> (Verdict, Outcome) {
    let Some(rev_nat_id) = conntrack::reply_rev_nat(flow) else {
        return (Verdict::PassNotService, Outcome::Pass);
    };
    let Some(frontend) = (unsafe { REV_NAT.get(&rev_nat_id) }) else {
        return (Verdict::Error, Outcome::Pass);
    };
    match nat::rev_nat(ctx, flow, frontend) {
        Ok(()) => (Verdict::RevNat, Outcome::ReverseTranslated),
        Err(()) => (Verdict::Error, Outcome::Drop),
    }
}

#[inline(always)]
fn translated(result: Result<(), ()>, verdict: Verdict) -> (Verdict, Outcome) {
    match result {
        Ok(()) => (verdict, Outcome::Translated),
        Err(()) => (Verdict::Error, Outcome::Drop),
    }
}
