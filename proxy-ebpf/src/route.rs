//! tc's own redirects, which skip the stack's routing decision: to where
//! the kernel would forward the translated packet (a FIB lookup), straight
//! into a pod, or back where it came from.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, bpf_fib_lookup},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_redirect_peer},
    programs::TcContext,
};

use crate::{
    context::{Tc, TcHook, ptr_at},
    headers::{IP_OFF, Ipv4Hdr, Ipv6Hdr},
    maps::POD_VETHS,
    parse,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Redirects the packet to the interface the kernel would forward it out
/// of, the neighbour resolved there; `TC_ACT_OK` (on through the stack)
/// where it is not forwarded.
#[inline(always)]
pub fn redirect_routed(ctx: &TcContext) -> i32 {
    match forwarding(ctx) {
        Some((params, rc)) => redirect_neigh(&params, rc),
        None => TC_ACT_OK,
    }
}

/// As [`redirect_routed`], for a reply the programs reverse-translated at
/// tc ingress; where it is headed for a pod of this node, i.e. the route
/// leads to a pod's veth ([`POD_VETHS`]) and the FIB knows the pod's MAC,
/// the frame is addressed to it and handed into the pod's end of the pair
/// at once (`bpf_redirect_peer`). That skips what `bpf_redirect_neigh`
/// goes through: the node end's egress (its tc program, which has nothing
/// to do for a translated reply) and the backlog queue the veth passes
/// frames through to its peer. Netfilter is skipped either way.
#[inline(always)]
pub fn redirect_reply(ctx: &TcContext) -> i32 {
    let Some((params, rc)) = forwarding(ctx) else {
        return TC_ACT_OK;
    };
    // The map is looked up only where the neighbour is resolved.
    if rc == BPF_FIB_LKUP_RET_SUCCESS && is_pod_veth(params.ifindex) && set_macs(ctx, &params) {
        // SAFETY: a helper call on the program's own context; the kernel
        // checks the ifindex (and drops if the device has no peer or the
        // peer shares this namespace, which the agent's listing rules out).
        return unsafe { bpf_redirect_peer(params.ifindex, 0) as i32 };
    }
    redirect_neigh(&params, rc)
}

/// Whether the agent listed `ifindex` as a pod's veth ([`POD_VETHS`]).
#[inline(always)]
fn is_pod_veth(ifindex: u32) -> bool {
    // SAFETY: a read of a map only user space writes; the value is not kept.
    unsafe { POD_VETHS.get(ifindex) }.is_some()
}

/// Out of the interface the FIB chose, the neighbour resolved by the
/// kernel (also where the FIB had none yet: NO_NEIGH still names the
/// interface); `TC_ACT_OK` for any other answer (not forwarded).
#[inline(always)]
fn redirect_neigh(params: &bpf_fib_lookup, rc: u32) -> i32 {
    if rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        // SAFETY: no neighbour parameters (null, length 0): the kernel
        // looks the neighbour up itself; the helper checks the ifindex.
        unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) as i32 }
    } else {
        TC_ACT_OK
    }
}

/// Writes the Ethernet addresses the FIB resolved (next hop's, then the
/// outgoing interface's) in one store; false if the store failed.
#[inline(always)]
fn set_macs(ctx: &TcContext, params: &bpf_fib_lookup) -> bool {
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&params.dmac);
    macs[6..].copy_from_slice(&params.smac);
    ctx.store(0, &macs, 0).is_ok()
}

/// Redirects the packet to the interface it arrived on (`flags` 0: out of
/// it; `BPF_F_INGRESS`: into it, up the stack).
#[inline(always)]
pub fn redirect_back(ctx: &TcContext, flags: u64) -> i32 {
    // SAFETY: the skb is the program's context, valid for its whole run,
    // and a tc program may read its `ifindex`.
    unsafe { bpf_redirect((*ctx.skb.skb).ifindex, flags) as i32 }
}

/// The FIB's answer for the (already translated) packet, for redirecting
/// it directly where the kernel would forward it: used where the kernel's
/// own routing decision is stale (egress), would refuse the packet
/// (replies from a node IP), or costs more than it must (replies to
/// pods). The parameters (interface, MACs) and the lookup's return code;
/// `None` if the headers are not there.
#[inline(always)]
fn forwarding(ctx: &TcContext) -> Option<(bpf_fib_lookup, u32)> {
    // Reading only: which hook the view says it is does not matter here.
    let mut params = if parse::is_ipv6(&Tc(ctx, TcHook::Egress)) {
        ipv6_params(ctx)?
    } else {
        ipv4_params(ctx)?
    };
    let size = core::mem::size_of::<bpf_fib_lookup>() as i32;
    // SAFETY: the skb is the program's context; `params` is a local of the
    // size passed, which the helper fills in.
    let rc = unsafe { fib_lookup(ctx.skb.skb.cast(), &mut params, size, 0) } as u32;
    Some((params, rc))
}

/// The FIB lookup's input for an IPv6 packet: its addresses and the
/// interface it is on (no length, as for IPv4).
#[inline(always)]
fn ipv6_params(ctx: &TcContext) -> Option<bpf_fib_lookup> {
    let ip: *const Ipv6Hdr = ptr_at(&Tc(ctx, TcHook::Egress), IP_OFF)?;
    // SAFETY: as in `ipv4_params`.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    // SAFETY: as in `ipv4_params`. The L4 protocol stays 0: after
    // extension headers it is not the fixed header's next header, and the
    // FIB looks it up only for policy rules that name one.
    unsafe {
        params.family = AF_INET6;
        params.__bindgen_anon_3.ipv6_src = (*ip).saddr_be;
        params.__bindgen_anon_4.ipv6_dst = (*ip).daddr_be;
        params.ifindex = (*ctx.skb.skb).ifindex;
    }
    Some(params)
}

/// The FIB lookup's input for an IPv4 packet.
#[inline(always)]
fn ipv4_params(ctx: &TcContext) -> Option<bpf_fib_lookup> {
    let ip: *const Ipv4Hdr = ptr_at(&Tc(ctx, TcHook::Egress), IP_OFF)?;
    // SAFETY: a C struct of integers and unions of integers: all zeros is
    // a valid value (and the helper's "no input" for every unset field).
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    // SAFETY: the header is inside the packet (ptr_at), and the skb is the
    // program's context; the union fields written are plain integers.
    unsafe {
        params.family = AF_INET;
        params.l4_protocol = (*ip).proto;
        // tot_len stays 0: with a length given, the kernel compares it with
        // the route's MTU and answers FRAG_NEEDED for every GSO/GRO super
        // packet (a bulk transfer's), whose IPv4 length is the whole
        // train's. Without one it checks the skb itself, segments included
        // (is_skb_forwardable).
        params.__bindgen_anon_3.ipv4_src = (*ip).saddr_be;
        params.__bindgen_anon_4.ipv4_dst = (*ip).daddr_be;
        params.ifindex = (*ctx.skb.skb).ifindex;
    }
    Some(params)
}
