//! Keeping the kernel's conntrack off flows it would see only half of.
//! The replies of a flow to a pod backend that no one source-NATs are
//! reverse-NATed by the programs: tc redirects them to the client's
//! interface, past the kernel's hooks; XDP passes them up the stack
//! already rewritten, a tuple the kernel never saw. Its conntrack would
//! see the forward packets alone: it would call the client's ACK invalid
//! (no SYN-ACK seen), and any `--ctstate INVALID -j DROP` rule (Calico's,
//! many host firewalls') would drop it; and it would cost every
//! connection an entry.
//! So such a flow's packets carry the notrack mark, which the agent's
//! raw-table rule turns into `CT --notrack` before conntrack runs.
//! Flows the kernel source-NATs stay tracked (its SNAT is conntrack), as do
//! flows to addresses outside the pod networks (a node's, or outside the
//! cluster), whose replies may pass the kernel's hooks or need another
//! masquerade rule of the node's.

use crate::{context::Ctx, maps};

/// Whether a new flow is kept out of the kernel's conntrack: translated
/// before the kernel's hooks see it (XDP, tc ingress; at tc egress the
/// kernel has tracked the untranslated packet already), not source-NATed,
/// to a backend that is a pod (`backend_is_pod`, asked only when it
/// matters).
#[inline(always)]
pub fn wanted(ctx: &impl Ctx, snat: bool, backend_is_pod: impl FnOnce() -> bool) -> bool {
    maps::notrack_mark() != 0 && !snat && ctx.before_netfilter() && backend_is_pod()
}

/// Marks a packet of a flow kept off the kernel's conntrack, either way
/// (a reply XDP reverse-NATs goes up the stack, where the kernel would
/// take it for an invalid packet of an unknown flow). `false` on XDP over
/// a driver that keeps no metadata: the caller leaves the packet to tc.
#[inline(always)]
pub fn mark(ctx: &impl Ctx) -> bool {
    ctx.add_mark(maps::notrack_mark())
}
