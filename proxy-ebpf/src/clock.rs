//! The programs' clock: CLOCK_MONOTONIC_COARSE in nanoseconds, the clock of
//! conntrack's and affinity's timestamps (the agent's sweep compares them
//! with its own reading of the same clock).
//!
//! `bpf_ktime_get_coarse_ns()` is a helper call that reads the timekeeper
//! under its sequence count: 3-10 ns a packet on this project's machines
//! (bench/notes/perpacket-findings.md). The coarse clock
//! only moves when the tick updates the timekeeper, and the tick moves
//! `jiffies` in the same step; the verifier inlines `bpf_jiffies64()` into
//! one load. So each CPU keeps the last reading with the jiffies it was
//! taken at, and reads the clock again only once jiffies moved: once a
//! tick, not once a packet.
//!
//! The tick increments jiffies just before it advances the timekeeper, so
//! a reading taken in between is the previous tick's time kept for the
//! new tick: at most one tick late, for one tick, which timestamps
//! refreshed once a second and timeouts of seconds do not notice.

use aya_ebpf::helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns};

use crate::maps::CLOCK;

/// CLOCK_MONOTONIC_COARSE, in nanoseconds.
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: a helper without arguments (inlined into a load of jiffies_64).
    let jiffies = unsafe { bpf_jiffies64() };
    let Some(cache) = CLOCK.get_ptr_mut(0) else {
        return read_clock();
    };
    // SAFETY: a per-CPU map value, valid for the run and this CPU's alone.
    // A program that interrupts this one on the same CPU writes a pair of
    // its own; mixed halves of two pairs read within one tick agree, and
    // pairs of different ticks differ in jiffies, so the next packet reads
    // the clock again: no stale time outlives a tick.
    let cache = unsafe { &mut *cache };
    if cache.jiffies != jiffies {
        cache.now_ns = read_clock();
        cache.jiffies = jiffies;
    }
    cache.now_ns
}

#[inline(always)]
fn read_clock() -> u64 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_ktime_get_coarse_ns() }
}
