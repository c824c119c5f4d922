//! Picks a backend for a new flow: from the backend set's Maglev table
//! for a frontend flagged so, else at random.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    Backend, BackendSlotKey, MaglevKey, ServiceValue,
    maglev::{CHUNK, MAX_BACKENDS, SIZE_BY_BACKENDS, flow_hash},
    service::FLAG_MAGLEV,
};

use crate::{
    maps::{BACKEND_SLOTS, BACKENDS, MAGLEV},
    parse::Flow,
};

/// A new flow's backend: Maglev's for a frontend flagged [`FLAG_MAGLEV`],
/// else (or if its table is missing, which the agent's write order rules
/// out) a random one. Both ways end in one backend id before the backend
/// is read: the verifier walks what follows once.
#[inline(always)]
pub fn new_flow_backend(flow: &Flow, svc: &ServiceValue) -> Option<(u32, Backend)> {
    let id = new_flow_id(svc, || {
        flow_hash(flow.saddr_be, flow.daddr_be, flow.sport_be, flow.dport_be, flow.proto)
    })?;
    Some((id, backend(id)?))
}

/// A new flow's backend id, of either family: Maglev's entry for the flow's
/// hash (`flow_hash`, asked only for a frontend flagged [`FLAG_MAGLEV`]),
/// else a random slot's.
#[inline(always)]
pub fn new_flow_id(svc: &ServiceValue, flow_hash: impl FnOnce() -> u32) -> Option<u32> {
    let maglev = if svc.flags & FLAG_MAGLEV != 0 {
        maglev_id(flow_hash(), svc)
    } else {
        None
    };
    match maglev {
        Some(id) => Some(id),
        None => random_id(svc),
    }
}

/// Entries of [`SIZES`]: a power of two above `MAX_BACKENDS`, so that an
/// index masked to it is in bounds for the verifier whatever LLVM made of
/// an earlier range check (merged with another, it once dropped it and the
/// verifier refused the program).
const SIZES_LEN: usize = 1024;
const _: () = assert!((MAX_BACKENDS as usize) < SIZES_LEN);

/// Table sizes by run length (`proxy_common::maglev::SIZE_BY_BACKENDS`,
/// 0 past its end), in read-only data.
static SIZES: [u32; SIZES_LEN] = {
    let mut sizes = [0; SIZES_LEN];
    let mut i = 0;
    while i < SIZE_BY_BACKENDS.len() {
        sizes[i] = SIZE_BY_BACKENDS[i];
        i += 1;
    }
    sizes
};

/// The backend id in the frontend's table entry `hash % M`: one lookup,
/// of the chunk holding the entry. The table holds backend ids (not
/// slots), so a Maglev pick costs what a random one does.
#[inline(always)]
fn maglev_id(hash: u32, svc: &ServiceValue) -> Option<u32> {
    if svc.backend_count > MAX_BACKENDS {
        return None;
    }
    // Volatile: LLVM may not carry the check above over to the index and
    // drop the mask, which the verifier needs to see (it lost the check).
    // SAFETY: a field of a valid reference.
    let count = unsafe { core::ptr::read_volatile(&svc.backend_count) };
    let size = &SIZES[count as usize & (SIZES_LEN - 1)];
    // Volatile: a load the verifier sees as some size, not one branch per
    // constant (see `SIZE_BY_BACKENDS`).
    // SAFETY: a reference into a static: valid, aligned and initialised.
    let size = unsafe { core::ptr::read_volatile(size) };
    if size == 0 {
        return None;
    }
    let entry = hash % size;
    let key = MaglevKey {
        backend_set: svc.backend_set,
        chunk: entry / CHUNK,
    };
    let chunk = MAGLEV.get_ptr(key)?;
    // The mask keeps the index provably inside the chunk for the verifier
    // (`% CHUNK` is the same, CHUNK being a power of two).
    let index = (entry & (CHUNK - 1)) as usize;
    // SAFETY: a map value pointer is valid for the program's run; one
    // entry is copied out at once.
    Some(unsafe { (*chunk).ids[index] })
}

/// A uniformly random slot of the frontend's run of its backend set
/// (`backend_offset..backend_offset + backend_count`; the modulo bias of a
/// 32-bit random number over a few thousand slots is negligible). `None` if
/// the run is empty, or if the maps disagree, which user space's write
/// order is meant to rule out.
#[inline(always)]
pub fn random_backend(svc: &ServiceValue) -> Option<(u32, Backend)> {
    let id = random_id(svc)?;
    Some((id, backend(id)?))
}

/// The backend id in a random slot of the frontend's run, as
/// [`random_backend`] (for either family: the slots hold ids).
#[inline(always)]
pub fn random_id(svc: &ServiceValue) -> Option<u32> {
    if svc.backend_count == 0 {
        return None;
    }
    // SAFETY: a helper without pointer arguments.
    let slot = svc
        .backend_offset
        .wrapping_add(unsafe { bpf_get_prandom_u32() } % svc.backend_count);
    slot_id(&BackendSlotKey {
        backend_set: svc.backend_set,
        slot,
    })
}

/// The backend id in slot `key`: one lookup, of the chunk holding it;
/// `None` if the chunk is missing or the slot is past the set's end (0).
#[inline(always)]
pub fn slot_id(key: &BackendSlotKey) -> Option<u32> {
    let chunk = BACKEND_SLOTS.get_ptr(key.chunk_key())?;
    // SAFETY: a map value pointer is valid for the program's run; one id
    // is copied out at once, at an index masked into the chunk.
    let id = unsafe { (*chunk).ids[key.index_in_chunk()] };
    (id != 0).then_some(id)
}

/// The backend with id `id`, `None` if it is gone (an array entry of
/// protocol 0) or `id` is past the array.
#[inline(always)]
pub fn backend(id: u32) -> Option<Backend> {
    BACKENDS.get(id).copied().filter(Backend::is_present)
}
