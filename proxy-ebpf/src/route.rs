//! tc's own redirects, which skip the stack's routing decision: to where
//! the kernel would forward the translated packet (a FIB lookup), or back
//! where it came from.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, bpf_fib_lookup},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

use crate::{
    context::{Tc, TcHook, ptr_at},
    headers::{IP_OFF, Ipv4Hdr, Ipv6Hdr},
    parse,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Redirects the packet to the interface the kernel would forward it out
/// of, the neighbour resolved there; `TC_ACT_OK` (on through the stack)
/// where it is not forwarded.
#[inline(always)]
pub fn redirect_routed(ctx: &TcContext) -> i32 {
    match ifindex(ctx) {
        // SAFETY: no neighbour parameters (null, length 0): the kernel
        // looks the neighbour up itself; the helper checks the ifindex.
        Some(ifindex) => unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 },
        None => TC_ACT_OK,
    }
}

/// Redirects the packet to the interface it arrived on (`flags` 0: out of
/// it; `BPF_F_INGRESS`: into it, up the stack).
#[inline(always)]
pub fn redirect_back(ctx: &TcContext, flags: u64) -> i32 {
    // SAFETY: the skb is the program's context, valid for its whole run,
    // and a tc program may read its `ifindex`.
    unsafe { bpf_redirect((*ctx.skb.skb).ifindex, flags) as i32 }
}

/// The interface the kernel would forward the (already translated) packet
/// out of, for redirecting it there directly: used where the kernel's own
/// routing decision is stale (egress) or would refuse the packet (replies
/// from a node IP). `None` if it is not forwarded (e.g. it is for this node).
#[inline(always)]
fn ifindex(ctx: &TcContext) -> Option<u32> {
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
    // NO_NEIGH still names the interface: bpf_redirect_neigh resolves the neighbour.
    if rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        Some(params.ifindex)
    } else {
        None
    }
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
