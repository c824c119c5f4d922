//! Maglev consistent hashing: the lookup table's layout and size, and the
//! hashes the programs and the agent must compute alike.
//!
//! The agent fills one table per backend set (`proxy-userspace`'s
//! `mode::ebpf::maglev`) for the `Cluster` run of its slots; a frontend
//! flagged [`crate::service::FLAG_MAGLEV`] picks a new flow's backend as
//! `table[flow_hash % M]`, where `M = table_size(backend_count)`. The same
//! endpoints give the same table on every node (the fill depends on the
//! endpoints' addresses only), and the same flow the same hash, so a flow
//! reaches the same endpoint whichever node it lands on, and a backend
//! change moves few flows (Maglev's point).
//!
//! Layout: one hash map for all tables, keyed by `(backend set, chunk)`,
//! each value [`CHUNK`] entries of one table. Why chunks: a map's values
//! have one size, and tables range from 251 to 131,071 entries; a fixed
//! value of the largest size would cost 512 KiB per Service. Chunks of
//! 1 KiB waste at most one chunk's tail per table, and a packet still
//! needs one lookup (the chunk holding its entry). Entries are backend
//! ids (the backends map's keys), so a Maglev pick costs the same two
//! lookups as a random one (slot, backend).

use bytemuck::{Pod, Zeroable};

/// Entries per map value.
pub const CHUNK: u32 = 256;

/// Table sizes: for each, the largest prime below a multiple of [`CHUNK`]
/// (so a table fills its chunks) at or above 200 x the backends it serves.
/// `(size, most backends)`. Maglev's fill is within one entry of even at
/// any size; what the size buys is stability: with one of 20 backends
/// removed, the other backends' entries that move were measured at
/// 2.6% of the table for M = 100 N (2,039), 1.6% for 200 N (4,093), 1.0%
/// for 400 N (8,191). 200 N keeps it under the 2% goal at half the memory
/// of 400 N.
pub const TABLE_SIZES: [(u32, u32); 10] = [
    (251, 1),
    (509, 2),
    (1_021, 5),
    (2_039, 10),
    (4_093, 20),
    (8_191, 40),
    (16_381, 81),
    (32_749, 163),
    (65_521, 327),
    (131_071, 655),
];

/// The most backends a Maglev table serves; a larger run is balanced at
/// random.
pub const MAX_BACKENDS: u32 = TABLE_SIZES[TABLE_SIZES.len() - 1].1;

/// The table size for a run of `backends` backends, `None` for an empty
/// run or one larger than [`MAX_BACKENDS`].
pub const fn table_size(backends: u32) -> Option<u32> {
    let size = match backends {
        0 => return None,
        1 => 251,
        2 => 509,
        3..=5 => 1_021,
        6..=10 => 2_039,
        11..=20 => 4_093,
        21..=40 => 8_191,
        41..=81 => 16_381,
        82..=163 => 32_749,
        164..=327 => 65_521,
        328..=655 => 131_071,
        _ => return None,
    };
    Some(size)
}

/// [`table_size`] by run length, 0 where there is no table: the programs
/// read a table's size from this array (one load from read-only data)
/// rather than walk the compares. Why: each compare's branch reaches the
/// rest of the program with another constant size, and the verifier
/// walked the rest once per size (twice the instructions in all).
pub const SIZE_BY_BACKENDS: [u32; MAX_BACKENDS as usize + 1] = {
    let mut sizes = [0; MAX_BACKENDS as usize + 1];
    let mut n = 1;
    while n <= MAX_BACKENDS {
        sizes[n as usize] = match table_size(n) {
            Some(size) => size,
            None => 0,
        };
        n += 1;
    }
    sizes
};

/// Chunks (map entries) a table of `size` entries takes.
pub const fn chunks(size: u32) -> u32 {
    size.div_ceil(CHUNK)
}

/// Key of the Maglev map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable)]
pub struct MaglevKey {
    /// [`crate::ServiceValue::backend_set`] (host order).
    pub backend_set: u32,
    /// `entry / CHUNK`, `0..chunks(size)`.
    pub chunk: u32,
}

/// Value of the Maglev map: entries `chunk * CHUNK ..` of a table, each a
/// backend id (host order); the last chunk's tail past the table size is 0
/// and never read.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct MaglevChunk {
    pub ids: [u32; CHUNK as usize],
}

/// One round of murmur3's 32-bit body: mixes `word` into `h`.
#[inline(always)]
const fn mix(h: u32, word: u32) -> u32 {
    let k = word.wrapping_mul(0xcc9e_2d51).rotate_left(15).wrapping_mul(0x1b87_3593);
    (h ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64)
}

/// murmur3's finaliser: every input bit reaches every output bit.
#[inline(always)]
const fn finish(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// The hash a new flow's table entry is chosen by: its 5-tuple, fields as
/// the packet holds them (the `*_be` fields read as native integers). No
/// per-node seed: every node must pick the same entry for the same flow.
/// The destination is part of it: for a load balancer or external IP it is
/// the same on every node; a node port's flows differ per node IP anyway.
#[inline(always)]
pub const fn flow_hash(saddr_be: u32, daddr_be: u32, sport_be: u16, dport_be: u16, proto: u8) -> u32 {
    let ports = ((sport_be as u32) << 16) | dport_be as u32;
    let h = mix(mix(mix(mix(0x5eed_f10e, saddr_be), daddr_be), ports), proto as u32);
    finish(h ^ 13)
}

/// [`flow_hash`] of an IPv6 flow: both addresses' four words (as
/// `proxy_common::ipv6` holds them), then the ports and the protocol.
#[inline(always)]
pub const fn flow_hash6(saddr_be: &[u32; 4], daddr_be: &[u32; 4], sport_be: u16, dport_be: u16, proto: u8) -> u32 {
    let mut h = 0x5eed_f10e;
    let mut i = 0;
    while i < 4 {
        h = mix(h, saddr_be[i]);
        i += 1;
    }
    let mut i = 0;
    while i < 4 {
        h = mix(h, daddr_be[i]);
        i += 1;
    }
    let ports = ((sport_be as u32) << 16) | dport_be as u32;
    finish(mix(mix(h, ports), proto as u32) ^ 37)
}

/// One of the two hashes of a backend's identity (its address and port as
/// the backends map holds them) that place it in a table: `seed` tells
/// them apart.
pub const fn backend_hash(addr_be: u32, port_be: u16, seed: u32) -> u32 {
    finish(mix(mix(seed, addr_be), port_be as u32) ^ 6)
}

/// [`backend_hash`] of an IPv6 backend: its address's four words.
pub const fn backend_hash6(addr_be: &[u32; 4], port_be: u16, seed: u32) -> u32 {
    let mut h = seed;
    let mut i = 0;
    while i < 4 {
        h = mix(h, addr_be[i]);
        i += 1;
    }
    finish(mix(h, port_be as u32) ^ 18)
}

const _: () = assert!(core::mem::size_of::<MaglevKey>() == 8);
const _: () = assert!(core::mem::size_of::<MaglevChunk>() == 4 * CHUNK as usize);
const _: () = assert!(CHUNK.is_power_of_two());

#[cfg(test)]
mod tests {
    use super::*;

    fn is_prime(n: u32) -> bool {
        n >= 2 && (2..).take_while(|d| d * d <= n).all(|d| !n.is_multiple_of(d))
    }

    /// Every size is prime, at least 200 x its backends, fills its chunks
    /// but the last's tail, and `table_size` agrees with the list.
    #[test]
    fn table_sizes_are_primes_of_at_least_200_per_backend() {
        let mut fewest = 1;
        for (size, most) in TABLE_SIZES {
            assert!(is_prime(size), "{size}");
            assert!(size >= 200 * most, "{size} for {most}");
            assert!(chunks(size) * CHUNK - size < CHUNK / 8, "{size} wastes a chunk");
            for n in fewest..=most {
                assert_eq!(table_size(n), Some(size), "{n} backends");
            }
            fewest = most + 1;
        }
        assert_eq!(table_size(0), None);
        for (n, size) in SIZE_BY_BACKENDS.iter().enumerate() {
            assert_eq!(table_size(n as u32).unwrap_or(0), *size);
        }
        assert_eq!(table_size(MAX_BACKENDS + 1), None);
    }

    /// Flows that differ in one field hash apart, and the hash spreads
    /// sequential source ports evenly over a table.
    #[test]
    fn flow_hash_spreads_source_ports() {
        let size = 1_021;
        let mut hits = [0u32; 1_021];
        for port in 0..u16::MAX {
            hits[(flow_hash(0x0a00_0001, 0x0a60_000a, port.to_be(), 80u16.to_be(), 6) % size) as usize] += 1;
        }
        let (least, most) = (hits.iter().min().copied(), hits.iter().max().copied());
        // 64 a bucket on average; binomial spread stays well inside this.
        assert!(least > Some(25) && most < Some(110), "{least:?}..{most:?}");
        assert_ne!(flow_hash(1, 2, 3, 4, 6), flow_hash(1, 2, 3, 4, 17));
    }
}
