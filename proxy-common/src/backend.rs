//! Backend slots and backends.
//!
//! `(backend set, slot) -> backend id -> (ip, port)`: an endpoint shared by
//! several Service ports is one backend entry, and affinity entries and
//! Maglev tables name backends by a 4-byte id.

use core::net::Ipv4Addr;

use bytemuck::{Pod, Zeroable};

/// One slot of a backend set: where a backend id is found in the slots
/// map, whose entries hold [`SLOTS_PER_CHUNK`] slots each (see
/// [`SlotChunk`]). Older agents keyed their slots map (`XP_SLOTS`, one id
/// per entry) by it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct BackendSlotKey {
    /// [`crate::ServiceValue::backend_set`].
    pub backend_set: u32,
    /// `0..backend_count`.
    pub slot: u32,
}

impl BackendSlotKey {
    /// The key of the slots map entry holding this slot.
    #[inline(always)]
    pub fn chunk_key(&self) -> SlotChunkKey {
        SlotChunkKey {
            backend_set: self.backend_set,
            chunk: self.slot / SLOTS_PER_CHUNK,
        }
    }

    /// This slot's index in its chunk (masked, so provably in bounds).
    #[inline(always)]
    pub fn index_in_chunk(&self) -> usize {
        (self.slot & (SLOTS_PER_CHUNK - 1)) as usize
    }
}

/// Slots per entry of the slots map: a new flow still reads one entry (64
/// bytes, one cache line), and a set of 10 backends is written in one
/// entry, not ten (each a kernel allocation: ~1 us at a sync).
pub const SLOTS_PER_CHUNK: u32 = 16;

/// Key of the slots map: the set's slots `chunk * 16 .. chunk * 16 + 16`.
/// A set of n slots has chunks `0..ceil(n / 16)`, without gaps.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct SlotChunkKey {
    /// [`crate::ServiceValue::backend_set`].
    pub backend_set: u32,
    pub chunk: u32,
}

/// Value of the slots map: the backend ids of 16 slots; 0 (never an id)
/// past the set's last slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SlotChunk {
    pub ids: [u32; SLOTS_PER_CHUNK as usize],
}

impl SlotChunk {
    /// The chunks of a set whose slots hold `ids`, in slot order, with
    /// their chunk numbers.
    pub fn of_set(ids: &[u32]) -> impl Iterator<Item = (u32, SlotChunk)> + '_ {
        (0u32..).zip(ids.chunks(SLOTS_PER_CHUNK as usize)).map(|(chunk, run)| {
            let mut value = SlotChunk::zeroed();
            value.ids[..run.len()].copy_from_slice(run);
            (chunk, value)
        })
    }

    /// How many chunks a set of `slots` slots has.
    pub fn count(slots: usize) -> u32 {
        u32::try_from(slots.div_ceil(SLOTS_PER_CHUNK as usize)).unwrap_or(u32::MAX)
    }
}

/// Value of the backends array (index: backend id, `u32`, never 0); an
/// entry of protocol 0 is no backend (an array has every index).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Backend {
    /// Endpoint IPv4 address, network byte order.
    pub addr_be: u32,
    /// Endpoint port (the Service's targetPort resolved), network byte order.
    pub port_be: u16,
    /// IP protocol number.
    pub proto: u8,
    /// `FLAG_*` bits below.
    pub flags: u8,
}

impl Backend {
    pub fn new(addr: Ipv4Addr, port: u16, proto: u8) -> Self {
        Self {
            addr_be: u32::from_ne_bytes(addr.octets()),
            port_be: port.to_be(),
            proto,
            flags: 0,
        }
    }
    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.addr_be.to_ne_bytes())
    }
    pub fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
    /// Whether the entry holds a backend (an array's unwritten or cleared
    /// entry is all zeros).
    pub fn is_present(&self) -> bool {
        self.proto != 0
    }
}

/// The endpoint is terminating: existing flows keep it, new flows avoid it.
pub const FLAG_TERMINATING: u8 = 1 << 0;
/// The endpoint runs on this node.
pub const FLAG_LOCAL: u8 = 1 << 1;

const _: () = assert!(core::mem::size_of::<BackendSlotKey>() == 8);
const _: () = assert!(core::mem::size_of::<Backend>() == 8);
const _: () = assert!(core::mem::size_of::<SlotChunk>() == 64);
const _: () = assert!(SLOTS_PER_CHUNK.is_power_of_two());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_fills_its_chunks_in_slot_order() {
        let ids: [u32; 20] = core::array::from_fn(|i| i as u32 + 1);
        let mut chunks = SlotChunk::of_set(&ids);
        let (Some(first), Some(second), None) = (chunks.next(), chunks.next(), chunks.next()) else {
            panic!("20 slots are two chunks");
        };
        assert_eq!(SlotChunk::count(ids.len()), 2);
        assert_eq!((first.0, first.1.ids[15]), (0, 16));
        assert_eq!((second.0, &second.1.ids[..5]), (1, &[17, 18, 19, 20, 0][..]));
        let slot = BackendSlotKey {
            backend_set: 3,
            slot: 17,
        };
        assert_eq!(
            slot.chunk_key(),
            SlotChunkKey {
                backend_set: 3,
                chunk: 1
            }
        );
        assert_eq!(second.1.ids[slot.index_in_chunk()], 18);
        assert_eq!(SlotChunk::count(0), 0);
    }
}
