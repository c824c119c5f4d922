//! Per-CPU verdict counters (no atomics needed: each CPU owns its slot).

use proxy_common::Verdict;

use crate::maps::STATS;

#[inline(always)]
pub fn count(frame_len: usize, verdict: Verdict) {
    if let Some(counter) = STATS.get_ptr_mut(verdict as u32) {
        unsafe {
            (*counter).packets += 1;
            (*counter).bytes += frame_len as u64;
        }
    }
}
