//! Per-CPU verdict counters (no atomics needed: each CPU owns its slot).

use proxy_common::Verdict;

use crate::maps::{CT_STATS, STATS};

#[inline(always)]
pub fn count(frame_len: usize, verdict: Verdict) {
    if let Some(counter) = STATS.get_ptr_mut(verdict as u32) {
        // SAFETY: this CPU's slot of an array map, which is never freed. No
        // other CPU writes it, and on this one the hooks run with bottom
        // halves off, so none interrupts another between read and write.
        unsafe {
            (*counter).packets += 1;
            (*counter).bytes += frame_len as u64;
        }
    }
}

/// Adds one to a conntrack counter (`proxy_common::stats::ct_stat`).
#[inline(always)]
pub fn count_ct(index: u32) {
    if let Some(counter) = CT_STATS.get_ptr_mut(index) {
        // SAFETY: this CPU's slot of an array map, as in `count`.
        unsafe { *counter += 1 };
    }
}
