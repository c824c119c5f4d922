//! The oracle's record of the first fragments' ports the programs
//! remember, and of what the kernel's LRU may have evicted since.
//!
//! A first fragment that passes the port filter has its ports remembered
//! under (source, destination, IP id, protocol) in an LRU hash of
//! [`FRAGMENTS_MAX`] entries; a later fragment looks them up. The oracle
//! keeps every key it saw remembered, with its ports, and says for a key
//! whether the kernel may have evicted it by now.
//!
//! "More than FRAGMENTS_MAX insertions old" is not that bound: the kernel's
//! LRU (kernel/bpf/bpf_lru_list.c, the common LRU the programs' map uses)
//! gives an entry a lookup found a second chance (it moves to the active
//! list and comes back to the inactive list's head, behind younger
//! entries), so an entry nobody looked up can be evicted while fewer than
//! FRAGMENTS_MAX keys were inserted after it. What does hold: an entry is
//! evicted only when the map has no free node for an insert. Then all
//! nodes are in use except up to `LOCAL_FREE_TARGET` (128) free ones in
//! each other CPU's local list, and the eviction takes up to 128 nodes from
//! the inactive list's tail at once. The entries still there that are
//! older than the evicted key got ahead of it by a lookup, or sat in
//! another CPU's pending list (up to 128 each). So a key can have been
//! evicted only if
//!
//! ```text
//! younger + looked_up_older + 128 * (2 * possible_cpus - 1) >= FRAGMENTS_MAX
//! ```
//!
//! where `younger` counts the keys last inserted after it and
//! `looked_up_older` the keys inserted before it that a later fragment
//! looked up since their insertion (counted generously: every later
//! fragment of a key the oracle knows, found or not, which only widens
//! the bound).

use std::{collections::HashMap, net::Ipv4Addr};

use proxy_common::maps::FRAGMENTS_MAX;

/// (source, destination, IP id, protocol) of a datagram. An IPv6 one's:
/// its addresses' fakes (see `ipv6::Fake4`) and the fragment header's
/// 32-bit id; kept in a memory of its own, as the programs keep them in a
/// map of their own (`XP_FRAGS6`) of the same size.
pub type FragKey = (Ipv4Addr, Ipv4Addr, u32, u8);

/// The kernel's `LOCAL_FREE_TARGET`: the most free nodes a CPU's local
/// list holds, and the most an eviction takes at once.
const LOCAL_FREE_TARGET: usize = 128;

struct Record {
    /// The ports of the last first fragment remembered.
    ports: (u16, u16),
    /// When it was last remembered (an insertion count).
    seq: u64,
    /// A later fragment looked it up since.
    looked_up: bool,
    /// Not seen forgotten since (a later fragment the program did not
    /// translate while the oracle expected it to).
    present: bool,
}

pub struct FragMemory {
    records: HashMap<FragKey, Record>,
    /// Every record's `seq`, ascending; and those of the looked-up ones.
    seqs: Vec<u64>,
    looked_up_seqs: Vec<u64>,
    next_seq: u64,
    /// Keys evicted with fewer insertions after them than this, at most.
    slack: usize,
    /// Evictions seen, and the fewest keys inserted after an evicted one.
    pub evictions: u64,
    pub youngest_evicted: Option<usize>,
}

/// Removes `seq` from the ascending `seqs`.
fn remove_seq(seqs: &mut Vec<u64>, seq: u64) {
    if let Ok(i) = seqs.binary_search(&seq) {
        seqs.remove(i);
    }
}

impl FragMemory {
    pub fn new(possible_cpus: usize) -> Self {
        Self {
            records: HashMap::new(),
            seqs: Vec::new(),
            looked_up_seqs: Vec::new(),
            next_seq: 0,
            slack: LOCAL_FREE_TARGET * (2 * possible_cpus.max(1) - 1),
            evictions: 0,
            youngest_evicted: None,
        }
    }

    /// Distinct keys remembered so far.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// A first fragment's ports are remembered (an insert or an update).
    pub fn remember(&mut self, key: FragKey, ports: (u16, u16)) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let record = Record {
            ports,
            seq,
            looked_up: false,
            present: true,
        };
        if let Some(old) = self.records.insert(key, record) {
            remove_seq(&mut self.seqs, old.seq);
            if old.looked_up {
                remove_seq(&mut self.looked_up_seqs, old.seq);
            }
        }
        self.seqs.push(seq);
    }

    /// The ports the program holds for `key`, unless it never had them
    /// (or was seen to have lost them since).
    pub fn ports(&self, key: &FragKey) -> Option<(u16, u16)> {
        self.records.get(key).filter(|r| r.present).map(|r| r.ports)
    }

    /// A later fragment of `key` ran: the lookup marks the entry used.
    pub fn looked_up(&mut self, key: &FragKey) {
        if let Some(r) = self.records.get_mut(key)
            && !r.looked_up
        {
            r.looked_up = true;
            let at = self.looked_up_seqs.partition_point(|&s| s < r.seq);
            self.looked_up_seqs.insert(at, r.seq);
        }
    }

    /// Keys last remembered after `key`.
    pub fn younger(&self, key: &FragKey) -> usize {
        let seq = self.records[key].seq;
        self.seqs.len() - self.seqs.partition_point(|&s| s <= seq)
    }

    /// Whether the kernel may have evicted `key` by now (see the module doc).
    pub fn may_be_evicted(&self, key: &FragKey) -> bool {
        let seq = self.records[key].seq;
        let looked_up_older = self.looked_up_seqs.partition_point(|&s| s < seq);
        self.younger(key) + looked_up_older + self.slack >= FRAGMENTS_MAX as usize
    }

    /// The program no longer has `key`.
    pub fn evicted(&mut self, key: &FragKey) {
        let younger = self.younger(key);
        self.youngest_evicted = Some(self.youngest_evicted.map_or(younger, |y| y.min(younger)));
        self.evictions += 1;
        if let Some(r) = self.records.get_mut(key) {
            r.present = false;
        }
    }
}

/// The kernel's `num_possible_cpus()`, from sysfs ("0-3,6"), else the
/// CPUs this process may run on.
pub fn possible_cpus() -> usize {
    let fallback = || std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let Ok(text) = std::fs::read_to_string("/sys/devices/system/cpu/possible") else {
        return fallback();
    };
    let count = text.trim().split(',').try_fold(0, |n, range| {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        let (first, last): (usize, usize) = (first.parse().ok()?, last.parse().ok()?);
        Some(n + last.checked_sub(first)? + 1)
    });
    count.unwrap_or_else(fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> FragKey {
        (Ipv4Addr::from(0x0a00_0000 + i), Ipv4Addr::new(10, 96, 0, 10), 7, 17)
    }

    #[test]
    fn a_key_may_be_evicted_only_once_the_map_can_be_full() {
        let mut m = FragMemory::new(2);
        let n = FRAGMENTS_MAX as usize;
        let slack = 128 * 3;
        for i in 0..(n - slack) as u32 {
            m.remember(key(i), (40000, 88));
        }
        assert!(!m.may_be_evicted(&key(0)), "{} keys after it", n - slack - 1);
        m.remember(key(n as u32), (40000, 88));
        assert!(m.may_be_evicted(&key(0)));
        assert!(!m.may_be_evicted(&key(1)));
        // Looked-up older keys count: they may have got ahead of it.
        m.looked_up(&key(0));
        assert!(m.may_be_evicted(&key(1)));
        assert!(!m.may_be_evicted(&key(2)));
        // A key remembered again is young again.
        m.remember(key(0), (40001, 88));
        assert!(!m.may_be_evicted(&key(0)));
        assert_eq!(m.ports(&key(0)), Some((40001, 88)));
        m.evicted(&key(5));
        assert_eq!((m.ports(&key(5)), m.evictions), (None, 1));
    }
}
