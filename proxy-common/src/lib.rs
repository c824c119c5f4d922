//! Map layouts shared by the eBPF programs (`proxy-ebpf`) and the agent.
//!
//! Every type here is `#[repr(C)]`, made of integers and byte arrays only, with
//! its padding written out, so that the kernel and user space agree on every
//! byte. Each module asserts its sizes at compile time: changing a layout is a
//! breaking change for pinned maps that a running node already has.
//!
//! Byte order: fields named `*_be` hold network byte order, i.e. the bytes
//! exactly as they appear in the packet (build them with the `new`
//! constructors, which take host-order values). Everything else is host order.
#![no_std]

pub mod affinity;
pub mod backend;
pub mod conntrack;
pub mod fragment;
pub mod ipv6;
pub mod maglev;
pub mod maps;
pub mod nat;
pub mod ports;
pub mod sctp;
pub mod service;
pub mod service_port;
pub mod socket_lb;
pub mod source_range;
pub mod stats;
pub mod xdp_mark;

pub use affinity::{AffinityKey, AffinityValue, MemberKey};
pub use backend::{Backend, BackendSlotKey, SlotChunk, SlotChunkKey};
pub use conntrack::{CtKey, CtTimeouts, CtValue};
pub use fragment::{Frag6Key, FragKey, FragPorts};
pub use ipv6::{AffinityKey6, Backend6, CtKey6, CtValue6, Service6Key};
pub use maglev::{MaglevChunk, MaglevKey};
pub use nat::RevNat;
pub use ports::PortBits;
pub use service::{ServiceKey, ServiceValue};
pub use service_port::FrontendPort;
pub use source_range::{SourceRange6Data, SourceRange6Key, SourceRangeData, SourceRangeKey};
pub use stats::{Verdict, VerdictCounter};

/// IP protocol numbers of the L4 protocols a Service can use.
pub mod proto {
    pub const ICMP: u8 = 1;
    pub const ICMPV6: u8 = 58;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
}

/// Implements `aya::Pod` for map types so the agent can read and write them.
/// Only plain-old-data structs go here: no enums, no `Option`s.
#[cfg(feature = "user")]
macro_rules! impl_aya_pod {
    // SAFETY: every type listed is `#[repr(C)]` plain old data (bytemuck's
    // `Pod` is derived for each, which checks that it has no padding and
    // that every bit pattern is valid), as aya's `Pod` requires.
    ($($t:ty),* $(,)?) => { $( unsafe impl aya::Pod for $t {} )* };
}
#[cfg(feature = "user")]
impl_aya_pod!(
    ServiceKey,
    ServiceValue,
    BackendSlotKey,
    SlotChunkKey,
    SlotChunk,
    Backend,
    CtKey,
    CtValue,
    CtTimeouts,
    FragKey,
    Frag6Key,
    FragPorts,
    RevNat,
    PortBits,
    VerdictCounter,
    AffinityKey,
    AffinityValue,
    MemberKey,
    SourceRangeKey,
    SourceRangeData,
    SourceRange6Key,
    SourceRange6Data,
    FrontendPort,
    socket_lb::SockLbConfig,
    socket_lb::SockRevKey,
    socket_lb::SockLbConfig6,
    socket_lb::SockRev6Key,
    socket_lb::SockRev6Value,
    MaglevKey,
    MaglevChunk,
    Service6Key,
    Backend6,
    CtKey6,
    CtValue6,
    AffinityKey6
);
