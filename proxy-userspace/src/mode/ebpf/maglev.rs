//! Builds a backend set's Maglev lookup table (see `proxy_common::maglev`
//! for the layout and the hashes the programs use).
//!
//! Maglev's fill: each backend has a permutation of the table's entries,
//! `(offset + j * skip) % M`, from two hashes of its identity; backends
//! take turns claiming the next free entry of their permutation until the
//! table is full. Each backend thus gets `M / N` entries, rounded either
//! way, and a backend leaving frees its entries while the others keep
//! nearly all theirs. Backends take their turns in the order of their
//! identity (address, port), not of the slots: the same endpoints give the
//! same table on every node, whatever order their EndpointSlices arrived in.

use std::net::IpAddr;

use proxy_common::{
    MaglevChunk, MaglevKey,
    ipv6::addr6_be,
    maglev::{CHUNK, backend_hash, backend_hash6, table_size},
};

/// Seeds of the two hashes that place a backend (`offset`, `skip`).
const OFFSET_SEED: u32 = 0x6d61_676c;
const SKIP_SEED: u32 = 0x6576_0001;

/// A backend as the table sees it: the id the table stores, and the
/// identity it is placed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// The backends map's key.
    pub id: u32,
    pub addr: IpAddr,
    pub port: u16,
}

impl Member {
    /// `(offset, skip)` of the backend's permutation of a table of `size`
    /// entries: `skip` in `1..size`, so (size being prime) the permutation
    /// visits every entry.
    fn permutation(&self, size: u32) -> (u32, u32) {
        let port_be = self.port.to_be();
        let hash = |seed| match self.addr {
            IpAddr::V4(addr) => backend_hash(u32::from_ne_bytes(addr.octets()), port_be, seed),
            IpAddr::V6(addr) => backend_hash6(&addr6_be(addr), port_be, seed),
        };
        (hash(OFFSET_SEED) % size, hash(SKIP_SEED) % (size - 1) + 1)
    }
}

/// The table for `members` (the run of slots it serves; an endpoint listed
/// twice counts once), each entry a member's id; `None` if the run is empty
/// or too large for a table (`proxy_common::maglev::MAX_BACKENDS`).
pub fn table(members: &[Member]) -> Option<Vec<u32>> {
    let mut members = members.to_vec();
    members.sort_by_key(|m| (m.addr, m.port));
    members.dedup_by_key(|m| (m.addr, m.port));
    let size = table_size(u32::try_from(members.len()).ok()?)?;
    Some(fill(&members, size))
}

/// Maglev's fill of `size` entries (a prime) by `members` in turn. Each
/// member walks its permutation by adding `skip` (mod `size`, by one
/// compare): no division per step. With one per step, the bench's 10,000
/// tables of 2,039 entries took 1.09 s; without, 0.43 s.
fn fill(members: &[Member], size: u32) -> Vec<u32> {
    let len = size as usize;
    let mut entries = vec![0; len];
    let mut taken = vec![false; len];
    // (next position, skip) per member.
    let mut walks: Vec<(u32, u32)> = members.iter().map(|m| m.permutation(size)).collect();
    let mut filled = 0;
    'rounds: loop {
        for (member, (position, skip)) in members.iter().zip(&mut walks) {
            // The member's next free entry along its permutation; one
            // always exists while the table is not full.
            let entry = loop {
                let candidate = *position as usize;
                *position += *skip;
                if *position >= size {
                    *position -= size;
                }
                if !taken[candidate] {
                    break candidate;
                }
            };
            taken[entry] = true;
            entries[entry] = member.id;
            filled += 1;
            if filled == len {
                break 'rounds;
            }
        }
    }
    entries
}

/// The map entries holding `table` for backend set `set`: chunk by chunk,
/// the last one's tail zero.
pub fn chunks(set: u32, table: &[u32]) -> Vec<(MaglevKey, MaglevChunk)> {
    (0u32..)
        .zip(table.chunks(CHUNK as usize))
        .map(|(chunk, part)| {
            let mut value = MaglevChunk {
                ids: [0; CHUNK as usize],
            };
            value.ids[..part.len()].copy_from_slice(part);
            let key = MaglevKey {
                backend_set: set,
                chunk,
            };
            (key, value)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, net::Ipv4Addr};

    use super::*;

    fn members(n: u32) -> Vec<Member> {
        (1..=n)
            .map(|i| Member {
                id: 100 + i,
                addr: Ipv4Addr::new(10, 244, (i / 200) as u8, (i % 200) as u8 + 1).into(),
                port: 8080,
            })
            .collect()
    }

    fn shares(table: &[u32]) -> BTreeMap<u32, usize> {
        let mut out = BTreeMap::new();
        for id in table {
            *out.entry(*id).or_default() += 1;
        }
        out
    }

    /// Every backend gets `M / N` entries, rounded down or up, for every
    /// run size a table serves.
    #[test]
    fn each_backend_gets_its_share_within_one_entry() {
        for n in [1, 2, 3, 5, 10, 11, 20, 81, 163, 655] {
            let table = table(&members(n)).expect("a table");
            let size = table.len();
            let shares = shares(&table);
            assert_eq!(shares.len(), n as usize, "every backend has entries");
            let even = size / n as usize;
            for (id, count) in shares {
                assert!(
                    count == even || count == even + 1,
                    "{n} backends: {id} has {count}, want {even}(+1)"
                );
            }
        }
    }

    /// The table depends on the endpoints, not on their slot order.
    #[test]
    fn slot_order_does_not_matter() {
        let forward = members(20);
        let mut backward = forward.clone();
        backward.reverse();
        assert_eq!(table(&forward), table(&backward));
    }

    /// One of 20 backends leaves: its entries (1/20) go to the others, and
    /// of the others' entries at most 2% of the table move. It comes back:
    /// the table is as before. Measured: printed with `--nocapture`.
    #[test]
    fn removing_one_of_20_moves_few_entries_and_readding_restores() {
        let all = members(20);
        let before = table(&all).expect("a table");
        let size = before.len() as f64;
        for gone in 0..all.len() {
            let mut rest = all.clone();
            let removed = rest.remove(gone);
            let after = table(&rest).expect("a table");
            assert_eq!(after.len(), before.len(), "19 and 20 backends share a table size");
            let freed = before.iter().filter(|id| **id == removed.id).count();
            let moved = (before.iter().zip(&after))
                .filter(|(b, a)| **b != removed.id && b != a)
                .count();
            println!("removing backend {gone}: {freed} entries freed, {moved} of the others' moved");
            assert!(
                moved as f64 <= 0.02 * size,
                "backend {gone} leaving moved {moved} of the others' {size} entries"
            );
            assert!(!after.contains(&removed.id));
            assert_eq!(table(&all), Some(before.clone()), "re-adding restores the table");
        }
    }

    #[test]
    fn empty_and_oversized_runs_have_no_table() {
        assert_eq!(table(&[]), None);
        assert_eq!(table(&members(proxy_common::maglev::MAX_BACKENDS + 1)), None);
        let twice = [members(1), members(1)].concat();
        assert_eq!(
            table(&twice).map(|t| shares(&t).len()),
            Some(1),
            "one endpoint listed twice"
        );
    }

    #[test]
    fn chunks_hold_the_table_in_order() {
        let table = table(&members(3)).expect("a table");
        let chunks = chunks(7, &table);
        assert_eq!(chunks.len(), table.len().div_ceil(CHUNK as usize));
        let back: Vec<u32> = chunks.iter().flat_map(|(_, c)| c.ids).take(table.len()).collect();
        assert_eq!(back, table);
        assert!(
            chunks
                .iter()
                .enumerate()
                .all(|(i, (k, _))| k.backend_set == 7 && k.chunk as usize == i)
        );
        let tail = chunks.last().expect("a chunk").1.ids[table.len() % CHUNK as usize..].to_vec();
        assert!(tail.iter().all(|id| *id == 0));
    }
}
