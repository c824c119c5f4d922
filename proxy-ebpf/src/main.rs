//! xproxy's kernel side: the XDP and tc entry points. A packet's way
//! through the other files, chained by `pipeline`:
//!
//! `parse` (Ethernet, IPv4, TCP/UDP; the malformed-input policy; IPv6
//! takes `ipv6`'s path, the same steps on the IPv6 maps) ->
//! `fragments` (a later IPv4 fragment gets its first's ports) ->
//! `ports` (could it be Service traffic at all?) -> `conntrack` (a packet
//! of a known flow, either way?) -> `lookup` (else: is it for a Service
//! frontend?) -> `source_range` (may this client use a load balancer IP?)
//! -> `service_port` (a pod's flow to a `Local` external frontend goes to
//! every endpoint; the port's affinity id) -> `affinity` (the client's
//! backend of before, for ClientIP affinity) or `select` (a backend for a
//! new flow) -> `nat` (DNAT,
//! reverse NAT) or `reject` (RST / ICMP when a Service has no backends; a
//! frontend whose `Local` traffic policy finds no backend on this node
//! drops instead, as kube-proxy does).
//! An ICMP error quoting a tracked flow's packet is translated as the
//! flow's packets are (`icmp_error`).
//!
//! Beneath the steps: `headers` (the header layouts and offsets),
//! `context` (the XDP / tc differences: reaching and rewriting the frame),
//! `csum` (checksum arithmetic), `maps` and `stats` (every verdict
//! counted). After the steps, `route` holds tc's own redirects: to the
//! interface the kernel would forward the packet out of, or back where it
//! came from. The entry points below only map the outcome to each hook's
//! return codes. Beside the packet path, `socket_lb` translates the node's
//! own connections to its node ports at the socket (cgroup hooks), and
//! `socket_lb6` the node's IPv6 ones.
#![no_std]
#![no_main]
// One atomic OR on a map value (conntrack's FIN flags): see conntrack.rs.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod affinity;
mod clock;
mod conntrack;
mod context;
mod csum;
mod fragments;
mod headers;
mod icmp_error;
mod ipv6;
mod lookup;
mod maps;
mod nat;
mod notrack;
mod parse;
mod pipeline;
mod pod_network;
mod ports;
mod reject;
mod route;
mod select;
mod service_port;
mod socket_lb;
mod socket_lb6;
mod source_range;
mod stats;

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

use crate::{
    context::{Tc, TcHook, Xdp},
    pipeline::{Outcome, process},
};

/// Node uplink, ingress: NodePort and external traffic, before an skb
/// exists; and replies of backends on other nodes.
#[xdp]
// Inlined into the entry the macro wraps it in: called instead, its frame
// and the entry's (each rounded up to 32 bytes) would count twice on 6.1,
// whose combined stack limit the IPv6 path's frame comes close to.
#[inline(always)]
pub fn xdp_uplink(ctx: XdpContext) -> u32 {
    match process(&Xdp(&ctx)) {
        Outcome::Pass | Outcome::Translated | Outcome::ReverseTranslated => xdp_action::XDP_PASS,
        Outcome::Reply => xdp_action::XDP_TX,
        Outcome::Drop => xdp_action::XDP_DROP,
    }
}

/// Node end of a pod's veth, ingress (= what the pod sends): pod -> Service
/// DNAT, and reverse NAT of replies coming back from backend pods. Also on
/// the uplink's ingress, for flows XDP passed on because they need a mark.
#[classifier]
// Inlined: see `xdp_uplink`.
#[inline(always)]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    // First: pulling headers may move the packet away from its metadata.
    // A packet XDP marked, XDP translated: looking it up again here would
    // find nothing to do, at the cost of a lookup per packet.
    if context::apply_xdp_mark(&ctx) {
        return TC_ACT_OK;
    }
    let tc = Tc(&ctx, TcHook::Ingress);
    tc.pull_headers();
    match process(&tc) {
        Outcome::Pass | Outcome::Translated => TC_ACT_OK,
        // Straight to the interface towards the client. Through the stack, a
        // reply now coming from a node IP (NodePort) would be dropped as a
        // martian (a local source arriving from outside); a destination on
        // this node itself is not forwarded and goes up the stack. To a pod
        // of this node: into the pod directly.
        Outcome::ReverseTranslated => route::redirect_reply(&ctx),
        // Back out of the interface it came in on, i.e. to the pod.
        Outcome::Reply => route::redirect_back(&ctx, 0),
        Outcome::Drop => TC_ACT_SHOT,
    }
}

/// Egress of the uplink and of pod interfaces. On the uplink: what the
/// node's own processes send to a ClusterIP (routed to the uplink by the
/// default route, so after DNAT it is routed again and redirected to the
/// backend's interface). Everywhere: reverse NAT of replies of flows the
/// kernel also source-NATed, which become recognisable only after the
/// kernel has undone its SNAT on the way out.
#[classifier]
// Inlined: see `xdp_uplink`.
#[inline(always)]
pub fn tc_egress(ctx: TcContext) -> i32 {
    let tc = Tc(&ctx, TcHook::Egress);
    tc.pull_headers();
    match process(&tc) {
        Outcome::Pass | Outcome::ReverseTranslated => TC_ACT_OK,
        // Without a route to the backend, the packet leaves where the
        // kernel had routed it (a gateway may know the way).
        Outcome::Translated => route::redirect_routed(&ctx),
        // Up the node's own stack, as if the answer had arrived on the uplink.
        Outcome::Reply => route::redirect_back(&ctx, BPF_F_INGRESS as u64),
        Outcome::Drop => TC_ACT_SHOT,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic; this is never called.
    loop {}
}

/// GPL-compatible, as bpf_fib_lookup and bpf_redirect_neigh require.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
