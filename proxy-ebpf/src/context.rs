//! What differs between XDP and tc: how the frame is reached, rewritten,
//! shrunk and grown. Everything else is written once against [`Ctx`].

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, bpf_adj_room_mode},
    helpers::{
        bpf_csum_update, bpf_l4_csum_replace, bpf_skb_adjust_room, bpf_skb_change_tail, bpf_skb_pull_data,
        bpf_xdp_adjust_head, bpf_xdp_adjust_meta, bpf_xdp_adjust_tail,
    },
    programs::{TcContext, XdpContext},
};
use proxy_common::{
    proto,
    xdp_mark::{self, XdpMark},
};

use crate::{
    csum,
    headers::{
        INNER_L4_OFF, IP_CHECK, IP_OFF, L4_OFF, Side, TCP_LEN, addr_in_ip, addr_in_ipv6, check_in_l4, port_in_l4,
    },
};

/// An IPv6 address as the programs hold it (`proxy_common::ipv6`).
pub type Addr6 = [u32; 4];

/// Where an IPv6 packet's L4 header is (after its extension headers) and
/// which protocol it is: what a rewrite of its ports and checksum needs.
#[derive(Clone, Copy)]
pub struct L4At {
    pub off: usize,
    pub proto: u8,
}

impl L4At {
    #[inline(always)]
    fn port(self, side: Side) -> usize {
        self.off + port_in_l4(side)
    }
    #[inline(always)]
    fn check(self) -> usize {
        self.off + check_in_l4(self.proto)
    }
}

#[inline(always)]
fn addr6_off(side: Side) -> usize {
    IP_OFF + addr_in_ipv6(side)
}

/// Where the fields a rewrite changes sit in the frame.
const IP_CHECK_OFF: usize = IP_OFF + IP_CHECK;

#[inline(always)]
fn addr_off(side: Side) -> usize {
    IP_OFF + addr_in_ip(side)
}

#[inline(always)]
fn port_off(side: Side) -> usize {
    L4_OFF + port_in_l4(side)
}

#[inline(always)]
fn l4_check_off(l4_proto: u8) -> usize {
    L4_OFF + check_in_l4(l4_proto)
}

/// Returns a pointer to a `T` at `off`, if the whole `T` is inside the
/// packet's linear data. The comparison is the verifier's bounds proof.
///
/// The pointer may be read and written (through the `SAFETY` comments that
/// cite this function) until the next helper that may move or resize the
/// packet, after which the verifier rejects any use of it. It is aligned
/// only as the frame lays it out (the IPv4 header starts at byte 14): BPF
/// loads and stores take any address, and the kernel's verifier checks
/// packet alignment only on architectures without efficient unaligned
/// access. (`read_unaligned` would make LLVM split every field into bytes.)
#[inline(always)]
pub fn ptr_at<T>(ctx: &impl Ctx, off: usize) -> Option<*mut T> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + off) as *mut T)
}

/// [`ptr_at`] for an offset known only at run time (after IPv6's
/// extension headers), with the linear data's bounds read afresh: LLVM
/// otherwise reuses a `data` loaded before a pull (a helper call) in a
/// 32-bit form, which the verifier takes for a scalar, not a pointer.
#[inline(always)]
pub fn ptr_at_fresh<T>(ctx: &impl Ctx, off: usize) -> Option<*mut T> {
    let (start, end) = ctx.fresh_bounds();
    if start + off + core::mem::size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *mut T)
}

/// The packet as a hook holds it: an XDP frame or a tc skb.
pub trait Ctx {
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// `data` and `data_end` read with volatile loads (see [`ptr_at_fresh`]).
    fn fresh_bounds(&self) -> (usize, usize);
    /// A context field that stays the same for the program's run, read
    /// with a volatile load: two reads are equal, which neither LLVM nor
    /// the verifier can tell (see `ipv6::parse::alike`).
    fn opaque_word(&self) -> usize;
    /// Length of the whole frame (an skb's data may extend past the linear part).
    fn frame_len(&self) -> usize;
    /// Rewrites one end's address and port (both parsed before, so present)
    /// and updates the IPv4 and L4 checksums.
    fn rewrite(&self, l4_proto: u8, side: Side, old: (u32, u16), new: (u32, u16)) -> Result<(), ()>;
    /// Rewrites one end's address only, and the IPv4 checksum: for a later
    /// fragment, which has no L4 header (the IPv4 checksum is never
    /// offloaded, so a direct write is right for XDP and tc alike).
    #[inline(always)]
    fn rewrite_addr(&self, side: Side, old: u32, new: u32) -> Result<(), ()>
    where
        Self: Sized,
    {
        let addr: *mut u32 = ptr_at(self, addr_off(side)).ok_or(())?;
        let ip_check: *mut u16 = ptr_at(self, IP_CHECK_OFF).ok_or(())?;
        // SAFETY: both fields are inside the packet (ptr_at).
        unsafe {
            *addr = new;
            *ip_check = csum::replace32(*ip_check, old, new);
        }
        Ok(())
    }
    /// The IPv6 form of [`Ctx::rewrite`]: one end's address and port, and
    /// the L4 checksum (IPv6 has no header checksum; the L4 one covers
    /// both addresses through the pseudo-header). `old`'s address may be
    /// the packet's own, read before it is written.
    fn rewrite6(&self, l4: L4At, side: Side, old: (&Addr6, u16), new: (&Addr6, u16)) -> Result<(), ()>;
    /// The IPv6 form of [`Ctx::rewrite_addr`], for a later fragment or an
    /// SCTP packet: no checksum in the packet covers the address (IPv6
    /// has no header checksum; a later fragment no L4 header; SCTP's
    /// CRC32c no pseudo-header), only an skb's sum of the packet's bytes.
    #[inline(always)]
    fn rewrite_addr6(&self, side: Side, old: &Addr6, new: &Addr6) -> Result<(), ()>
    where
        Self: Sized,
    {
        let addr: *mut Addr6 = ptr_at_fresh(self, addr6_off(side)).ok_or(())?;
        // Before the write: `old` may be the packet's own address.
        let diff = csum::diff128(old, new);
        // SAFETY: the address is inside the packet (ptr_at_fresh).
        unsafe { *addr = *new };
        self.packet_sum_moved(diff);
        Ok(())
    }
    /// Tells the skb that the packet's bytes now sum `diff` more (a
    /// [`csum::diff128`]), for a rewrite no checksum field balances (an
    /// IPv6 later fragment's address): a CHECKSUM_COMPLETE skb's `csum`
    /// must follow. Nothing to tell on XDP, which has no skb yet.
    fn packet_sum_moved(&self, diff: u16);
    /// Pulls the first `len` bytes (or the whole frame, if shorter) into
    /// the linear part: IPv6's extension headers may reach past what
    /// [`Tc::pull_headers`] pulled. Invalidates every packet pointer.
    fn pull(&self, len: usize);
    /// Cuts the frame to `len` bytes (shorter than it is).
    fn truncate(&self, len: usize) -> Result<(), ()>;
    /// Makes `room` bytes of room right after the Ethernet header, for an
    /// ICMP error around the packet: everything from the IP header on
    /// moves `room` bytes back. The Ethernet header's bytes are kept on
    /// tc only: the caller writes it afresh.
    fn grow_after_eth(&self, room: u32) -> Result<(), ()>;
    /// Sets `mark` bits on the packet's skb, for the agent's rules in the
    /// kernel (masquerade, notrack); on XDP, which has no skb yet, through
    /// the tc hook behind it (see `proxy_common::xdp_mark`). `false` if the
    /// driver keeps no metadata. Invalidates every packet pointer.
    fn add_mark(&self, mark: u32) -> bool;
    /// Whether the hook runs before the kernel's netfilter hooks see the
    /// packet (XDP, tc ingress), not after (tc egress, where the kernel
    /// has seen the untranslated packet already).
    fn before_netfilter(&self) -> bool;
}

/// On tc ingress: ORs the mark XDP left in the metadata into the skb's,
/// and says whether there was one. XDP leaves a mark only on a packet it
/// goes on to translate itself (`Ctx::add_mark` comes before the rewrite,
/// and a failed rewrite drops), so such a packet needs nothing more here.
/// Read before anything pulls or moves the packet.
#[inline(always)]
pub fn apply_xdp_mark(ctx: &TcContext) -> bool {
    let skb = ctx.skb.skb;
    // SAFETY: the program's own skb, valid for its run; a tc program may
    // read `data_meta` and `data`, and the metadata between them.
    unsafe {
        let meta = (*skb).data_meta as usize;
        let data = (*skb).data as usize;
        if meta + xdp_mark::LEN > data {
            return false;
        }
        let left = &*(meta as *const XdpMark);
        if left.magic != xdp_mark::MAGIC {
            return false;
        }
        (*skb).mark |= left.mark;
        true
    }
}

pub struct Xdp<'a>(pub &'a XdpContext);

impl Ctx for Xdp<'_> {
    #[inline(always)]
    fn data(&self) -> usize {
        self.0.data()
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        self.0.data_end()
    }
    #[inline(always)]
    fn opaque_word(&self) -> usize {
        // SAFETY: the program's own context, valid for its run; an XDP
        // program may read `ingress_ifindex`.
        unsafe { core::ptr::read_volatile(&(*self.0.ctx).ingress_ifindex) as usize }
    }
    #[inline(always)]
    fn fresh_bounds(&self) -> (usize, usize) {
        let md = self.0.ctx;
        // SAFETY: the program's own context, valid for its run; volatile
        // only so that LLVM loads the fields here (see `ptr_at_fresh`).
        unsafe {
            (
                core::ptr::read_volatile(&(*md).data) as usize,
                core::ptr::read_volatile(&(*md).data_end) as usize,
            )
        }
    }
    #[inline(always)]
    fn frame_len(&self) -> usize {
        self.0.data_end() - self.0.data()
    }

    /// Direct writes plus incremental checksums. XDP frames come from the
    /// wire with full checksums (there is no CHECKSUM_PARTIAL before an skb).
    #[inline(always)]
    fn rewrite(&self, l4_proto: u8, side: Side, old: (u32, u16), new: (u32, u16)) -> Result<(), ()> {
        let addr: *mut u32 = ptr_at(self, addr_off(side)).ok_or(())?;
        let port: *mut u16 = ptr_at(self, port_off(side)).ok_or(())?;
        let ip_check: *mut u16 = ptr_at(self, IP_CHECK_OFF).ok_or(())?;
        let l4_check: *mut u16 = ptr_at(self, l4_check_off(l4_proto)).ok_or(())?;
        // SAFETY: every field is inside the packet (ptr_at).
        unsafe {
            *addr = new.0;
            *port = new.1;
            *ip_check = csum::replace32(*ip_check, old.0, new.0);
            // The L4 checksum covers the pseudo-header (addresses) and the ports.
            *l4_check = if l4_proto == proto::UDP {
                csum::udp_replace16(csum::udp_replace32(*l4_check, old.0, new.0), old.1, new.1)
            } else {
                csum::replace16(csum::replace32(*l4_check, old.0, new.0), old.1, new.1)
            };
        }
        Ok(())
    }

    /// As `rewrite`: direct writes, incremental checksums.
    #[inline(always)]
    fn rewrite6(&self, l4: L4At, side: Side, old: (&Addr6, u16), new: (&Addr6, u16)) -> Result<(), ()> {
        let addr: *mut Addr6 = ptr_at_fresh(self, addr6_off(side)).ok_or(())?;
        let port: *mut u16 = ptr_at_fresh(self, l4.port(side)).ok_or(())?;
        let l4_check: *mut u16 = ptr_at_fresh(self, l4.check()).ok_or(())?;
        let diff = csum::diff128(old.0, new.0);
        // SAFETY: every field is inside the packet (ptr_at).
        unsafe {
            *addr = *new.0;
            *port = new.1;
            *l4_check = if l4.proto == proto::UDP {
                csum::udp_replace16(csum::udp_replace_diff(*l4_check, diff), old.1, new.1)
            } else {
                csum::replace16(csum::replace_diff(*l4_check, diff), old.1, new.1)
            };
        }
        Ok(())
    }

    #[inline(always)]
    fn packet_sum_moved(&self, _diff: u16) {}

    /// An XDP frame is linear.
    #[inline(always)]
    fn pull(&self, _len: usize) {}

    #[inline(always)]
    fn truncate(&self, len: usize) -> Result<(), ()> {
        // The length through the stack: with a run-time `len`, LLVM
        // otherwise reorders `len - (data_end - data)` into 32-bit
        // arithmetic on the packet pointers, which the verifier refuses.
        let frame_len = self.frame_len();
        // SAFETY: a local, read right after it is written.
        let frame_len = unsafe { core::ptr::read_volatile(&frame_len) };
        let delta = len as i32 - frame_len as i32;
        // SAFETY: the program's own context; the helper checks `delta`, and
        // no packet pointer outlives the call (the verifier sees to that).
        if unsafe { bpf_xdp_adjust_tail(self.0.ctx, delta) } != 0 {
            Err(())
        } else {
            Ok(())
        }
    }

    /// Moves the frame's start `room` bytes to the front: the old frame
    /// begins `room` bytes in, its IP header right after the new
    /// Ethernet header's place when the caller writes that.
    #[inline(always)]
    fn grow_after_eth(&self, room: u32) -> Result<(), ()> {
        // SAFETY: as in `truncate`: the context is the program's own, and
        // the helper checks the headroom.
        if unsafe { bpf_xdp_adjust_head(self.0.ctx, -(room as i32)) } != 0 {
            Err(())
        } else {
            Ok(())
        }
    }

    #[inline(always)]
    fn add_mark(&self, mark: u32) -> bool {
        let md = self.0.ctx;
        // SAFETY: the program's own context; the helper checks the room.
        if unsafe { bpf_xdp_adjust_meta(md.cast(), -(xdp_mark::LEN as i32)) } != 0 {
            return false;
        }
        // SAFETY: as above; the fields are read after the helper moved them.
        let (meta, data) = unsafe {
            (
                core::ptr::read_volatile(&(*md).data_meta) as usize,
                core::ptr::read_volatile(&(*md).data) as usize,
            )
        };
        if meta + xdp_mark::LEN > data {
            return false;
        }
        // SAFETY: the metadata area, inside the frame's buffer (checked).
        unsafe { *(meta as *mut XdpMark) = XdpMark::new(mark) };
        true
    }

    #[inline(always)]
    fn before_netfilter(&self) -> bool {
        true
    }
}

/// Which tc hook a program runs at.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TcHook {
    Ingress,
    Egress,
}

pub struct Tc<'a>(pub &'a TcContext, pub TcHook);

impl Tc<'_> {
    #[inline(always)]
    fn skb(&self) -> *mut aya_ebpf::bindings::__sk_buff {
        self.0.skb.skb
    }

    /// Makes sure the headers `parse` reads are in the linear part of the
    /// skb: up to a TCP header, or an ICMP error's quoted TCP header.
    #[inline(always)]
    pub fn pull_headers(&self) {
        const WANTED: usize = INNER_L4_OFF + TCP_LEN;
        let len = self.frame_len();
        let want = if len < WANTED { len } else { WANTED };
        if self.data_end() - self.data() < want {
            // Best effort: if it fails, parse sees a short frame and passes it.
            // SAFETY: the skb is the program's context; no packet pointer
            // exists yet.
            unsafe { bpf_skb_pull_data(self.skb(), want as u32) };
        }
    }
}

impl Ctx for Tc<'_> {
    #[inline(always)]
    fn data(&self) -> usize {
        self.0.data()
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        self.0.data_end()
    }
    #[inline(always)]
    fn opaque_word(&self) -> usize {
        // SAFETY: the skb is the program's context; a tc program may read
        // its `ifindex`.
        unsafe { core::ptr::read_volatile(&(*self.skb()).ifindex) as usize }
    }
    #[inline(always)]
    fn fresh_bounds(&self) -> (usize, usize) {
        let skb = self.skb();
        // SAFETY: as in `Xdp::fresh_bounds`.
        unsafe {
            (
                core::ptr::read_volatile(&(*skb).data) as usize,
                core::ptr::read_volatile(&(*skb).data_end) as usize,
            )
        }
    }
    #[inline(always)]
    fn frame_len(&self) -> usize {
        self.0.len() as usize
    }

    /// Address, port and IPv4 header checksum written directly (the IPv4
    /// checksum is never offloaded; every helper call saved is some 20 ns);
    /// the L4 checksum through the kernel's helper, which knows the skb's
    /// checksum state: a packet from a local socket carries
    /// CHECKSUM_PARTIAL, whose L4 checksum field holds only the
    /// pseudo-header sum. BPF_F_PSEUDO_HDR updates it for the address change
    /// and leaves it alone for the port.
    #[inline(always)]
    fn rewrite(&self, l4_proto: u8, side: Side, old: (u32, u16), new: (u32, u16)) -> Result<(), ()> {
        let skb = self.skb();
        let l4_check = l4_check_off(l4_proto) as u32;
        let udp_flags = if l4_proto == proto::UDP {
            BPF_F_MARK_MANGLED_0 as u64
        } else {
            0
        };
        let addr: *mut u32 = ptr_at(self, addr_off(side)).ok_or(())?;
        let port: *mut u16 = ptr_at(self, port_off(side)).ok_or(())?;
        let ip_check: *mut u16 = ptr_at(self, IP_CHECK_OFF).ok_or(())?;
        // SAFETY: every field is inside the packet (ptr_at).
        unsafe {
            *addr = new.0;
            *port = new.1;
            *ip_check = csum::replace32(*ip_check, old.0, new.0);
        }
        // The helpers below may move the packet: no pointer is used after.
        // SAFETY: the skb is the program's context; the helper checks that
        // the checksum at `l4_check` lies inside the packet.
        let ok = unsafe {
            bpf_l4_csum_replace(
                skb,
                l4_check,
                old.0 as u64,
                new.0 as u64,
                BPF_F_PSEUDO_HDR as u64 | udp_flags | 4,
            ) == 0
                && bpf_l4_csum_replace(skb, l4_check, old.1 as u64, new.1 as u64, udp_flags | 2) == 0
        };
        if ok { Ok(()) } else { Err(()) }
    }

    /// As `rewrite`, the address's change to the checksum given to the
    /// helper as one difference (its "size 0" form). The helper also adds
    /// that difference to a CHECKSUM_COMPLETE skb's `csum`, right for IPv4
    /// (whose header checksum moved the other way) but not for IPv6, where
    /// the address and the L4 checksum changes cancel out; kernels from
    /// 6.16 take BPF_F_IPV6 for that, older ones need it taken back here
    /// (`bpf_csum_update` changes a CHECKSUM_COMPLETE skb only).
    #[inline(always)]
    fn rewrite6(&self, l4: L4At, side: Side, old: (&Addr6, u16), new: (&Addr6, u16)) -> Result<(), ()> {
        let skb = self.skb();
        let udp_flags = if l4.proto == proto::UDP {
            BPF_F_MARK_MANGLED_0 as u64
        } else {
            0
        };
        let addr: *mut Addr6 = ptr_at_fresh(self, addr6_off(side)).ok_or(())?;
        let port: *mut u16 = ptr_at_fresh(self, l4.port(side)).ok_or(())?;
        // Before the write: `old` may be the packet's own address.
        let diff = u64::from(csum::diff128(old.0, new.0));
        // SAFETY: both fields are inside the packet (ptr_at).
        unsafe {
            *addr = *new.0;
            *port = new.1;
        }
        let check = l4.check() as u32;
        // The helpers below may move the packet: no pointer is used after.
        // SAFETY: the skb is the program's context; the helpers check that
        // the checksum at `check` lies inside the packet.
        let ok = unsafe {
            bpf_l4_csum_replace(skb, check, 0, diff, BPF_F_PSEUDO_HDR as u64 | udp_flags) == 0
                && bpf_l4_csum_replace(skb, check, old.1 as u64, new.1 as u64, udp_flags | 2) == 0
        };
        if !ok {
            return Err(());
        }
        // SAFETY: as above; no pointer argument. `!diff` is minus `diff`
        // in one's complement.
        unsafe { bpf_csum_update(skb, !(diff as u32)) };
        Ok(())
    }

    #[inline(always)]
    fn packet_sum_moved(&self, diff: u16) {
        // SAFETY: the skb is the program's context; no pointer argument.
        unsafe { bpf_csum_update(self.skb(), u32::from(diff)) };
    }

    /// Called only where a header is not in the linear part: no test of
    /// the linear length here (LLVM reused such a test's `data` load,
    /// zero-extended, as the packet pointer after the call, which the
    /// verifier refuses as a scalar).
    #[inline(always)]
    fn pull(&self, len: usize) {
        let len = if self.frame_len() < len { self.frame_len() } else { len };
        // Best effort, as in `pull_headers`.
        // SAFETY: the skb is the program's context; the caller holds no
        // packet pointer.
        unsafe { bpf_skb_pull_data(self.skb(), len as u32) };
    }

    #[inline(always)]
    fn truncate(&self, len: usize) -> Result<(), ()> {
        // SAFETY: the skb is the program's context; the helper checks `len`,
        // and no packet pointer outlives the call.
        if unsafe { bpf_skb_change_tail(self.skb(), len as u32, 0) } != 0 {
            Err(())
        } else {
            Ok(())
        }
    }

    /// Inserts the room between the Ethernet and the IP header; the
    /// kernel keeps the skb's network header offset at the new IP header's
    /// place (right after the Ethernet header).
    #[inline(always)]
    fn grow_after_eth(&self, room: u32) -> Result<(), ()> {
        let mode = bpf_adj_room_mode::BPF_ADJ_ROOM_MAC;
        // SAFETY: as in `truncate`.
        if unsafe { bpf_skb_adjust_room(self.skb(), room as i32, mode, 0) } != 0 {
            Err(())
        } else {
            Ok(())
        }
    }

    #[inline(always)]
    fn add_mark(&self, mark: u32) -> bool {
        // SAFETY: the skb is the program's context, valid for its whole
        // run; a tc program may write `mark` (the verifier checks the field).
        unsafe { (*self.skb()).mark |= mark };
        true
    }

    #[inline(always)]
    fn before_netfilter(&self) -> bool {
        self.1 == TcHook::Ingress
    }
}
