//! Where the kernel would send a translated packet: a FIB lookup for tc's
//! redirects, which skip the stack's own routing decision.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup},
    helpers::bpf_fib_lookup as fib_lookup,
    programs::TcContext,
};

use crate::{
    context::{Tc, ptr_at},
    headers::{IP_OFF, Ipv4Hdr},
};

const AF_INET: u8 = 2;

/// The interface the kernel would forward the (already translated) packet
/// out of, for redirecting it there directly: used where the kernel's own
/// routing decision is stale (egress) or would refuse the packet (replies
/// from a node IP). `None` if it is not forwarded (e.g. it is for this node).
#[inline(always)]
pub fn ifindex(ctx: &TcContext) -> Option<u32> {
    let ip: *const Ipv4Hdr = ptr_at(&Tc(ctx), IP_OFF)?;
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
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
    let size = core::mem::size_of::<bpf_fib_lookup>() as i32;
    let rc = unsafe { fib_lookup(ctx.skb.skb.cast(), &mut params, size, 0) } as u32;
    // NO_NEIGH still names the interface: bpf_redirect_neigh resolves the neighbour.
    if rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        Some(params.ifindex)
    } else {
        None
    }
}
