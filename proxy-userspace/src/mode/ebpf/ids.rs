//! The ids the Service maps are keyed by, handed out and taken back:
//! backend ids (shared by every Service port with the same endpoint,
//! counted by reference; dense, as they index an array), backend set ids
//! and reverse NAT ids.
//!
//! Nothing here touches a map: the writer (`service_maps`) stages the
//! writes an id's first use and last release call for.

use std::{collections::BTreeSet, net::IpAddr};

use anyhow::{Result, bail};
use proxy_common::maps::BACKENDS_MAX;

/// Hands out map ids (backend sets, reverse NAT entries).
///
/// Ids move forward and wrap only after 2^32 - 1 of them: a freed id is not
/// handed out again soon, because conntrack entries of old flows may still
/// name it, and such a flow must not land on whatever got the id next.
#[derive(Clone, Debug, Default)]
pub(super) struct IdAllocator {
    used: BTreeSet<u32>,
    /// The next candidate (0 is never an id).
    next: u32,
}

impl IdAllocator {
    /// Marks an id found in the maps as taken; allocation continues after
    /// the highest one seen.
    pub fn reserve(&mut self, id: u32) {
        self.used.insert(id);
        self.next = self.next.max(id.wrapping_add(1));
    }

    pub fn allocate(&mut self) -> Result<u32> {
        if self.used.len() >= u32::MAX as usize {
            bail!("id space exhausted");
        }
        loop {
            let id = self.next.max(1);
            self.next = id.wrapping_add(1);
            if self.used.insert(id) {
                return Ok(id);
            }
        }
    }

    pub fn release(&mut self, id: u32) {
        self.used.remove(&id);
    }

    /// Forgets which ids are taken (before reading the maps back), but not
    /// where allocation got to: freed ids stay out of reach.
    pub fn forget_used(&mut self) {
        self.used.clear();
    }
}

/// Hands out backend ids densely, the lowest free one first, below
/// `limit` (they index the backends array, `proxy_common::maps::BACKENDS`).
///
/// A released id is handed out again only after [`Self::reuse_released`],
/// which the writer calls once the flush that deleted its entry is done:
/// by then no frontend leads to it, so a program that read it from an old
/// slot a moment ago is long finished. Conntrack entries name backends by
/// address, so a reused id moves no flow; they keep the id only for the
/// per-backend counts of `xproxy status`.
#[derive(Clone, Debug)]
pub(super) struct DenseIds {
    limit: u32,
    /// Bit `id` set: the id is taken (held, or released and cooling). Bit
    /// 0 is always set: 0 is never an id.
    taken: Vec<u64>,
    /// Released since the last [`Self::reuse_released`]: still taken.
    cooling: Vec<u32>,
    /// No word before this one has a free bit.
    first_free_word: usize,
}

impl Default for DenseIds {
    fn default() -> Self {
        Self::with_limit(BACKENDS_MAX)
    }
}

impl DenseIds {
    pub fn with_limit(limit: u32) -> Self {
        Self {
            limit,
            taken: vec![1],
            cooling: Vec::new(),
            first_free_word: 0,
        }
    }

    /// Marks an id found in the maps as taken (one at or past the limit,
    /// left by an older agent, can never be handed out anyway).
    pub fn reserve(&mut self, id: u32) {
        if id < self.limit {
            self.set(id, true);
        }
    }

    pub fn allocate(&mut self) -> Result<u32> {
        let mut word = self.first_free_word;
        loop {
            if word == self.taken.len() {
                self.taken.push(0);
            }
            let free = !self.taken[word];
            if free != 0 {
                let id = word as u64 * 64 + u64::from(free.trailing_zeros());
                let Ok(id) = u32::try_from(id) else { break };
                if id >= self.limit {
                    break;
                }
                self.set(id, true);
                self.first_free_word = word;
                return Ok(id);
            }
            word += 1;
        }
        bail!(
            "backend ids exhausted: {} distinct endpoints are programmed, the most the backends map holds",
            self.limit - 1
        )
    }

    /// Takes `id` back; it is handed out again after the next
    /// [`Self::reuse_released`].
    pub fn release(&mut self, id: u32) {
        if id < self.limit {
            self.cooling.push(id);
        }
    }

    /// Makes the ids released so far available again (see the type's doc).
    pub fn reuse_released(&mut self) {
        for id in std::mem::take(&mut self.cooling) {
            self.set(id, false);
        }
    }

    /// Forgets which ids are taken (before reading the maps back), except
    /// the cooling ones: they stay out of reach until their time.
    pub fn forget_used(&mut self) {
        self.taken = vec![1];
        self.first_free_word = 0;
        for id in self.cooling.clone() {
            self.set(id, true);
        }
    }

    fn set(&mut self, id: u32, taken: bool) {
        let (word, bit) = ((id / 64) as usize, id % 64);
        if word >= self.taken.len() {
            self.taken.resize(word + 1, 0);
        }
        if taken {
            self.taken[word] |= 1 << bit;
        } else if id != 0 {
            self.taken[word] &= !(1 << bit);
            self.first_free_word = self.first_free_word.min(word);
        }
    }
}

/// A backend as the maps key it for sharing: `(ip, port, protocol)`.
pub(super) type BackendAddr = (IpAddr, u16, u8);

/// What [`BackendRefs::acquire`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Acquired {
    /// The address had an id already: one more Service port uses it.
    Shared(u32),
    /// A fresh id: its backend entry must be written.
    New(u32),
}

impl Acquired {
    pub fn id(self) -> u32 {
        match self {
            Acquired::Shared(id) | Acquired::New(id) => id,
        }
    }
}

/// Backend ids by address, each counted by the Service ports using it: an
/// endpoint in several Service ports is one backend entry, deleted when
/// the last of them lets go.
#[derive(Debug, Default)]
pub(super) struct BackendRefs {
    /// address -> (backend id, number of Service ports using it).
    /// foldhash, not SipHash: a full sync at 10,000 x 10 endpoints looks up
    /// and inserts 100,000 of each, and SipHash was 8% of it; the keys are
    /// addresses from the API server, not from packets.
    by_addr: foldhash::HashMap<BackendAddr, (u32, u32)>,
    /// backend id -> address, the reverse of `by_addr`.
    by_id: foldhash::HashMap<u32, BackendAddr>,
    ids: DenseIds,
}

impl BackendRefs {
    /// Takes a reference on the backend at `addr`, with a new id if no
    /// Service port uses it yet.
    pub fn acquire(&mut self, addr: BackendAddr) -> Result<Acquired> {
        if let Some((id, refs)) = self.by_addr.get_mut(&addr) {
            *refs += 1;
            return Ok(Acquired::Shared(*id));
        }
        let id = self.ids.allocate()?;
        self.by_addr.insert(addr, (id, 1));
        self.by_id.insert(id, addr);
        Ok(Acquired::New(id))
    }

    /// Lets go of one reference on `id`; returns whether it was the last
    /// (then the id is free and its backend entry must go).
    pub fn release(&mut self, id: u32) -> Result<bool> {
        let Some(&addr) = self.by_id.get(&id) else {
            bail!("backend id {id} released but not held");
        };
        let Some(entry) = self.by_addr.get_mut(&addr) else {
            bail!("backend id {id} has no reference count");
        };
        entry.1 -= 1;
        if entry.1 > 0 {
            return Ok(false);
        }
        self.by_addr.remove(&addr);
        self.by_id.remove(&id);
        self.ids.release(id);
        Ok(true)
    }

    /// Adopts `id` for `addr` from the maps, taking one reference (check
    /// [`Self::aliased`] first: an address is held under one id).
    pub fn adopt(&mut self, id: u32, addr: BackendAddr) {
        self.by_addr.entry(addr).or_insert((id, 0)).1 += 1;
        self.by_id.insert(id, addr);
    }

    /// Whether `addr` is held under an id other than `id`.
    pub fn aliased(&self, id: u32, addr: BackendAddr) -> bool {
        self.by_addr.get(&addr).is_some_and(|(held, _)| *held != id)
    }

    /// The address `id` is held for, if some Service port holds it.
    pub fn addr_of(&self, id: u32) -> Option<BackendAddr> {
        self.by_id.get(&id).copied()
    }

    /// Whether some Service port holds `id`.
    pub fn holds(&self, id: u32) -> bool {
        self.by_id.contains_key(&id)
    }

    /// The allocator, to reserve ids found in the maps or free leftovers.
    pub fn ids(&mut self) -> &mut DenseIds {
        &mut self.ids
    }

    /// Forgets every reference and which ids are taken (before reading the
    /// maps back); allocation goes on where it got to.
    pub fn forget(&mut self) {
        self.by_addr.clear();
        self.by_id.clear();
        self.ids.forget_used();
    }

    /// References held on `id`, 0 if none.
    #[cfg(test)]
    pub fn refs(&self, id: u32) -> u32 {
        self.by_id
            .get(&id)
            .and_then(|a| self.by_addr.get(a))
            .map_or(0, |(_, n)| *n)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn freed_ids_are_not_handed_out_again_soon() {
        let mut ids = IdAllocator::default();
        assert_eq!(ids.allocate().unwrap(), 1);
        assert_eq!(ids.allocate().unwrap(), 2);
        ids.release(1);
        assert_eq!(ids.allocate().unwrap(), 3, "a freed id may still be named by old flows");
    }

    #[test]
    fn ids_found_in_the_maps_are_skipped_and_allocation_wraps_past_them() {
        let mut ids = IdAllocator::default();
        ids.reserve(7);
        assert_eq!(ids.allocate().unwrap(), 8);
        let mut ids = IdAllocator {
            next: u32::MAX,
            ..Default::default()
        };
        ids.reserve(1);
        assert_eq!(ids.allocate().unwrap(), u32::MAX);
        assert_eq!(ids.allocate().unwrap(), 2, "wraps to the smallest free id, never 0");
    }

    const A: BackendAddr = (IpAddr::V4(Ipv4Addr::new(10, 244, 0, 1)), 80, 6);
    const B: BackendAddr = (IpAddr::V4(Ipv4Addr::new(10, 244, 0, 2)), 80, 6);

    #[test]
    fn a_backend_shared_by_two_ports_goes_with_the_last() {
        let mut refs = BackendRefs::default();
        let first = refs.acquire(A).unwrap();
        assert!(matches!(first, Acquired::New(_)));
        assert_eq!(refs.acquire(A).unwrap(), Acquired::Shared(first.id()));
        assert_eq!(refs.refs(first.id()), 2);
        assert!(!refs.release(first.id()).unwrap(), "one port still uses it");
        assert!(refs.release(first.id()).unwrap(), "the last one let go");
        assert!(!refs.holds(first.id()));
        assert!(refs.release(first.id()).is_err(), "released but not held");
        let again = refs.acquire(A).unwrap();
        assert_ne!(
            again.id(),
            first.id(),
            "a freed backend id is not reused before a flush"
        );
        assert!(refs.release(again.id()).unwrap());
        refs.ids().reuse_released();
        assert_eq!(
            refs.acquire(B).unwrap(),
            Acquired::New(first.id()),
            "the lowest free id"
        );
    }

    #[test]
    fn backend_ids_are_dense_and_cool_off_before_reuse() {
        let mut ids = DenseIds::with_limit(200);
        let first: Vec<u32> = (0..130).map(|_| ids.allocate().unwrap()).collect();
        assert_eq!(first, (1..=130).collect::<Vec<_>>(), "lowest first, never 0");
        ids.release(5);
        ids.release(70);
        assert_eq!(ids.allocate().unwrap(), 131, "released ids cool off");
        ids.forget_used();
        ids.reserve(1);
        assert_eq!(ids.allocate().unwrap(), 2, "forgotten, but not the cooling ones");
        ids.reserve(3);
        ids.reserve(4);
        assert_eq!(ids.allocate().unwrap(), 6, "5 is still cooling");
        ids.reuse_released();
        assert_eq!(ids.allocate().unwrap(), 5);
        ids.reserve(5_000);
        ids.release(5_000);
        ids.reuse_released();
        assert_eq!(ids.allocate().unwrap(), 7, "ids past the limit are never handed out");
    }

    #[test]
    fn backend_ids_stop_at_the_limit() {
        let mut ids = DenseIds::with_limit(65);
        for want in 1..65 {
            assert_eq!(ids.allocate().unwrap(), want);
        }
        let error = ids.allocate().unwrap_err().to_string();
        assert!(error.contains("64 distinct endpoints"), "{error}");
        ids.release(9);
        ids.reuse_released();
        assert_eq!(ids.allocate().unwrap(), 9);
    }

    #[test]
    fn adopted_backends_are_counted_and_aliases_seen() {
        let mut refs = BackendRefs::default();
        refs.adopt(5, A);
        refs.adopt(5, A);
        assert_eq!(refs.refs(5), 2, "the same id again: one more reference");
        assert!(refs.aliased(6, A) && !refs.aliased(5, A) && !refs.aliased(6, B));
        refs.forget();
        assert!(!refs.holds(5) && !refs.aliased(6, A), "forgotten");
    }
}
