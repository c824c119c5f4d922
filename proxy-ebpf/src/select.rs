//! Picks a backend for a new flow.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{Backend, BackendSlotKey, ServiceValue};

use crate::maps::{BACKEND_SLOTS, BACKENDS};

/// A uniformly random slot of the frontend's run of its backend set
/// (`backend_offset..backend_offset + backend_count`; the modulo bias of a
/// 32-bit random number over a few thousand slots is negligible). `None` if
/// the run is empty, or if the maps disagree, which user space's write
/// order is meant to rule out.
#[inline(always)]
pub fn random_backend(svc: &ServiceValue) -> Option<(u32, Backend)> {
    if svc.backend_count == 0 {
        return None;
    }
    // SAFETY: a helper without pointer arguments.
    let slot = svc
        .backend_offset
        .wrapping_add(unsafe { bpf_get_prandom_u32() } % svc.backend_count);
    let key = BackendSlotKey {
        backend_set: svc.backend_set,
        slot,
    };
    // SAFETY: copied out at once, as in `lookup::frontend`.
    let id = unsafe { *BACKEND_SLOTS.get(key)? };
    let backend = backend(id)?;
    Some((id, backend))
}

/// The backend with id `id`, `None` if it is gone.
#[inline(always)]
pub fn backend(id: u32) -> Option<Backend> {
    // SAFETY: copied out at once, as in `lookup::frontend`.
    unsafe { BACKENDS.get(id).copied() }
}
