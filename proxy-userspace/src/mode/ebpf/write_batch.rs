//! The writes of a sync, collected per map and sent to the kernel in
//! dependency order (`FLUSH_STAGES`), in batch calls where the kernel has
//! them (Linux 5.6), one entry at a time where not. `service_maps` stages
//! the writes and runs the flush through an [`super::LbMaps`]; the pinned
//! maps write with [`Writer`]. This file knows nothing of Services.

use std::{
    collections::HashMap as StdHashMap,
    hash::Hash,
    os::fd::BorrowedFd,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
};

use anyhow::{Context, Result};
use proxy_common::{
    Backend, Backend6, FrontendPort, MaglevChunk, MaglevKey, MemberKey, RevNat, Service6Key, ServiceKey, ServiceValue,
    SlotChunk, SlotChunkKey, SourceRange6Key, SourceRangeKey,
};
use tracing::info;

use bpf_sys::map::{self as bpf_map, BatchError};

/// The writes of one batch, per map.
#[derive(Default)]
pub struct Staged {
    pub services: Pending<ServiceKey, ServiceValue>,
    pub services6: Pending<Service6Key, ServiceValue>,
    pub slots: Pending<SlotChunkKey, SlotChunk>,
    pub backends: Pending<u32, Backend>,
    pub backends6: Pending<u32, Backend6>,
    pub rev_nat: Pending<u32, RevNat>,
    pub members: Pending<MemberKey, u32>,
    pub source_ranges: Pending<SourceRangeKey, u8>,
    pub source_ranges6: Pending<SourceRange6Key, u8>,
    pub service_ports: Pending<u32, FrontendPort>,
    pub maglev: Pending<MaglevKey, MaglevChunk>,
}

impl Staged {
    pub fn split(self) -> SplitStaged {
        SplitStaged {
            services: self.services.split(),
            services6: self.services6.split(),
            slots: self.slots.split(),
            backends: self.backends.split(),
            backends6: self.backends6.split(),
            rev_nat: self.rev_nat.split(),
            members: self.members.split(),
            source_ranges: self.source_ranges.split(),
            source_ranges6: self.source_ranges6.split(),
            service_ports: self.service_ports.split(),
            maglev: self.maglev.split(),
        }
    }
}

/// [`Staged`] as it goes to the kernel.
pub struct SplitStaged {
    pub services: Split<ServiceKey, ServiceValue>,
    pub services6: Split<Service6Key, ServiceValue>,
    pub slots: Split<SlotChunkKey, SlotChunk>,
    pub backends: Split<u32, Backend>,
    pub backends6: Split<u32, Backend6>,
    pub rev_nat: Split<u32, RevNat>,
    pub members: Split<MemberKey, u32>,
    pub source_ranges: Split<SourceRangeKey, u8>,
    pub source_ranges6: Split<SourceRange6Key, u8>,
    pub service_ports: Split<u32, FrontendPort>,
    pub maglev: Split<MaglevKey, MaglevChunk>,
}

impl SplitStaged {
    /// Entries the steps of `stage` write or delete.
    pub fn entries(&self, stage: &[Step]) -> usize {
        stage.iter().map(|step| self.entries_of(*step)).sum()
    }

    pub fn entries_of(&self, step: Step) -> usize {
        match step.table() {
            Table::Backends => self.backends.entries_of(step),
            Table::Backends6 => self.backends6.entries_of(step),
            Table::Slots => self.slots.entries_of(step),
            Table::RevNat => self.rev_nat.entries_of(step),
            Table::Services => self.services.entries_of(step),
            Table::Services6 => self.services6.entries_of(step),
            Table::Members => self.members.entries_of(step),
            Table::SourceRanges => self.source_ranges.entries_of(step),
            Table::SourceRanges6 => self.source_ranges6.entries_of(step),
            Table::ServicePorts => self.service_ports.entries_of(step),
            Table::Maglev => self.maglev.entries_of(step),
        }
    }
}

/// One map's staged writes, in the order they were staged: `Some` writes
/// the value, `None` deletes the key.
pub struct Pending<K, V> {
    ops: Vec<(K, Option<V>)>,
    deletes: usize,
}

impl<K, V> Default for Pending<K, V> {
    fn default() -> Self {
        Self {
            ops: Vec::new(),
            deletes: 0,
        }
    }
}

/// A map's staged writes as they go to the kernel: the last operation
/// staged per key, writes and deletes apart, each in staging order.
#[derive(Debug, PartialEq, Eq)]
pub struct Split<K, V> {
    keys: Vec<K>,
    values: Vec<V>,
    deletes: Vec<K>,
}

impl<K, V> Split<K, V> {
    /// The entries to write: keys and their values, in staging order.
    pub fn writes(&self) -> (&[K], &[V]) {
        (&self.keys, &self.values)
    }

    /// The keys to delete, in staging order.
    pub fn deletes(&self) -> &[K] {
        &self.deletes
    }

    /// Entries `step` (a step on this map) writes or deletes.
    fn entries_of(&self, step: Step) -> usize {
        match step {
            Step::Write(_) => self.keys.len(),
            Step::Delete(_) => self.deletes.len(),
        }
    }
}

impl<K: Copy + Eq + Hash, V: Copy> Pending<K, V> {
    pub fn write(&mut self, key: K, value: V) {
        self.ops.push((key, Some(value)));
    }

    pub fn delete(&mut self, key: K) {
        self.ops.push((key, None));
        self.deletes += 1;
    }

    /// Writes and deletes go to the kernel in separate steps, so a key
    /// staged both ways (a frontend that moved from a removed Service port
    /// to a new one) must keep only its last operation. Repeated writes
    /// alone, or repeated deletes alone, end the same in staging order.
    fn split(self) -> Split<K, V> {
        let mixed = self.deletes > 0 && self.deletes < self.ops.len();
        let last: StdHashMap<K, usize> = if mixed {
            self.ops.iter().enumerate().map(|(i, (k, _))| (*k, i)).collect()
        } else {
            StdHashMap::new()
        };
        let mut out = Split {
            keys: Vec::with_capacity(self.ops.len() - self.deletes),
            values: Vec::with_capacity(self.ops.len() - self.deletes),
            deletes: Vec::with_capacity(self.deletes),
        };
        for (i, (key, op)) in self.ops.into_iter().enumerate() {
            if mixed && last.get(&key) != Some(&i) {
                continue;
            }
            match op {
                Some(value) => {
                    out.keys.push(key);
                    out.values.push(value);
                }
                None => out.deletes.push(key),
            }
        }
        out
    }
}

/// The Service maps a flush writes: slots name backends, frontends name
/// slots; reverse NAT entries are only deleted (see [`FLUSH_STAGES`]).
/// Members (backend sets with affinity) go with the slots, a frontend's
/// source ranges and its Service port entry with the frontend. Maglev tables
/// (of sets whose frontends select Maglev) go with the slots too: they name
/// backends by id. IPv6 frontends and backends (`Services6`,
/// `Backends6`, `SourceRanges6`) go with their IPv4 twins: slots are
/// shared, one id space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Table {
    Backends,
    Backends6,
    Slots,
    RevNat,
    Services,
    Services6,
    Members,
    SourceRanges,
    SourceRanges6,
    ServicePorts,
    Maglev,
}

/// One map's writes, or its deletes, of a flush.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Write(Table),
    Delete(Table),
}

impl Step {
    pub fn table(self) -> Table {
        match self {
            Step::Write(t) | Step::Delete(t) => t,
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (verb, table) = match self {
            Step::Write(t) => ("writing", t),
            Step::Delete(t) => ("deleting", t),
        };
        let what = match table {
            Table::Backends => "backends",
            Table::Backends6 => "IPv6 backends",
            Table::Slots => "backend slots",
            Table::RevNat => "reverse NAT entries",
            Table::Services => "frontends",
            Table::Services6 => "IPv6 frontends",
            Table::Members => "backend set members",
            Table::SourceRanges => "source ranges",
            Table::SourceRanges6 => "IPv6 source ranges",
            Table::ServicePorts => "service port entries",
            Table::Maglev => "Maglev tables",
        };
        write!(f, "{verb} {what}")
    }
}

/// The order a batch reaches the kernel in: stage after stage, the steps
/// of a stage possibly at the same time. Whatever a frontend will point at
/// is in place before the frontend is written (the first stage writes
/// fresh ids nothing points at yet, so its maps can fill side by side); a
/// frontend stops pointing at something (rewritten or deleted) before that
/// goes: old slots before the backends they name. Reverse NAT entries are
/// only ever deleted (older agents' leftovers: the programs read none).
/// A frontend's source ranges are in place before it is flagged to check
/// them (a missing one would drop an allowed client) and go after it. A
/// Service port entry names a backend set of its own (see
/// `proxy_common::service_port`): it is written and deleted with the
/// frontends, after its slots are in place and before they go.
pub(super) const FLUSH_STAGES: [&[Step]; 6] = [
    &[
        Step::Write(Table::Backends),
        Step::Write(Table::Backends6),
        Step::Write(Table::Slots),
        Step::Write(Table::Members),
        Step::Write(Table::SourceRanges),
        Step::Write(Table::SourceRanges6),
        Step::Write(Table::Maglev),
    ],
    &[
        Step::Write(Table::Services),
        Step::Write(Table::Services6),
        Step::Write(Table::ServicePorts),
    ],
    &[
        Step::Delete(Table::Services),
        Step::Delete(Table::Services6),
        Step::Delete(Table::ServicePorts),
    ],
    &[
        Step::Delete(Table::RevNat),
        Step::Delete(Table::SourceRanges),
        Step::Delete(Table::SourceRanges6),
    ],
    &[
        Step::Delete(Table::Slots),
        Step::Delete(Table::Members),
        Step::Delete(Table::Maglev),
    ],
    &[Step::Delete(Table::Backends), Step::Delete(Table::Backends6)],
];

/// Entries per batch call: enough to make the call's own cost vanish,
/// bounded so one call never holds the CPU in the kernel for long.
const BATCH_CHUNK: usize = 4096;

/// A stage with this many entries runs its steps on threads of their own:
/// the kernel's cost per entry dominates a large sync (an allocation and a
/// hash insert each), and the maps of one stage do not share locks.
pub(super) const SPREAD_FROM: usize = 4 * BATCH_CHUNK;

/// One step of a flush, borrowing the staged entries and the map's fd.
pub(super) type Job<'a> = Box<dyn FnOnce() -> Result<()> + Send + 'a>;

/// Runs the steps of a stage: one after another, or each on a thread if
/// `spread`. The first failure is returned, after every step has ended.
pub(super) fn run_stage(jobs: Vec<(Step, Job<'_>)>, spread: bool) -> Result<()> {
    if !spread || jobs.len() < 2 {
        for (step, job) in jobs {
            job().with_context(|| step.to_string())?;
        }
        return Ok(());
    }
    std::thread::scope(|scope| {
        let running: Vec<_> = jobs.into_iter().map(|(step, job)| (step, scope.spawn(job))).collect();
        let mut outcome = Ok(());
        for (step, thread) in running {
            let result = thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                .with_context(|| step.to_string());
            outcome = outcome.and(result);
        }
        outcome
    })
}

/// Writes entries to the kernel, in batches where it can; shared by the
/// threads of a stage.
#[derive(Default)]
pub(super) struct Writer {
    /// Set when the kernel turns a batch call down (Linux < 5.6).
    no_batches: AtomicBool,
    /// Entries written or deleted so far.
    writes: AtomicU64,
}

impl Writer {
    /// Writes one entry at a time from now on, as on a kernel without
    /// batch operations (for tests of that path on kernels with them).
    #[cfg(test)]
    pub fn without_batches(&self) {
        self.no_batches.store(true, Ordering::Relaxed);
    }

    /// Entries written or deleted so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    fn count(&self, entries: u64) {
        self.writes.fetch_add(entries, Ordering::Relaxed);
    }

    /// Writes the entries of `split` into `map`.
    ///
    /// # Safety
    ///
    /// `K` and `V` must have `map`'s key and value sizes.
    pub unsafe fn write<K: bytemuck::Pod, V: bytemuck::Pod>(
        &self,
        map: BorrowedFd<'_>,
        split: &Split<K, V>,
    ) -> Result<()> {
        let (mut keys, mut values) = split.writes();
        if !self.no_batches.load(Ordering::Relaxed) {
            let mut written = 0;
            let stop = update_in_chunks(keys, values, &mut written, |k, v| {
                // SAFETY: `K` and `V` are the map's sizes (this fn's contract).
                unsafe { bpf_map::update_batch(map, k, v) }
            });
            self.count(written);
            match stop {
                None => return Ok(()),
                Some(stop) if stop.error.unsupported() => {
                    self.batches_unsupported(&stop.error);
                    (keys, values) = (&keys[stop.at..], &values[stop.at..]);
                }
                Some(stop) => return Err(stop.error.into()),
            }
        }
        for (key, value) in keys.iter().zip(values) {
            // SAFETY: as above.
            unsafe { bpf_map::update_elem(map, key, value) }?;
            self.count(1);
        }
        Ok(())
    }

    /// Deletes the keys of `split` from `map`; a key that is not there is
    /// no error (and no write).
    ///
    /// # Safety
    ///
    /// `K` must have `map`'s key size.
    pub unsafe fn delete<K: bytemuck::Pod, V>(&self, map: BorrowedFd<'_>, split: &Split<K, V>) -> Result<()> {
        let mut keys = split.deletes();
        if !self.no_batches.load(Ordering::Relaxed) {
            let mut deleted = 0;
            let stop = delete_in_chunks(keys, &mut deleted, |k| {
                // SAFETY: `K` is the map's key size (this fn's contract).
                unsafe { bpf_map::delete_batch(map, k) }
            });
            self.count(deleted);
            match stop {
                None => return Ok(()),
                Some(stop) if stop.error.unsupported() => {
                    self.batches_unsupported(&stop.error);
                    keys = &keys[stop.at..];
                }
                Some(stop) => return Err(stop.error.into()),
            }
        }
        for key in keys {
            // SAFETY: as above.
            match unsafe { bpf_map::delete_elem(map, key) } {
                Ok(()) => self.count(1),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Deletes the keys of `split` from an array `map`, whose entries
    /// cannot go: each is written back to zeros, which the programs read
    /// as no entry.
    ///
    /// # Safety
    ///
    /// As [`Self::write`].
    pub unsafe fn clear<K: bytemuck::Pod, V: bytemuck::Pod>(
        &self,
        map: BorrowedFd<'_>,
        split: &Split<K, V>,
    ) -> Result<()> {
        let cleared = Split {
            keys: split.deletes.clone(),
            values: vec![V::zeroed(); split.deletes.len()],
            deletes: Vec::new(),
        };
        // SAFETY: the caller's contract.
        unsafe { self.write(map, &cleared) }
    }

    fn batches_unsupported(&self, error: &BatchError) {
        if !self.no_batches.swap(true, Ordering::Relaxed) {
            info!(error = %error.error, "no batch map operations in this kernel: writing entries one at a time");
        }
    }
}

/// Where a run of batch calls stopped: the entry at `at` failed.
#[derive(Debug)]
struct Stopped {
    at: usize,
    error: BatchError,
}

/// Writes `keys[i] -> values[i]` by `BATCH_CHUNK` entries through `call`,
/// counting the entries written into `written`; stops at the first failure.
fn update_in_chunks<K, V>(
    keys: &[K],
    values: &[V],
    written: &mut u64,
    mut call: impl FnMut(&[K], &[V]) -> Result<(), BatchError>,
) -> Option<Stopped> {
    let mut at = 0;
    for (k, v) in keys.chunks(BATCH_CHUNK).zip(values.chunks(BATCH_CHUNK)) {
        match call(k, v) {
            Ok(()) => {
                *written += k.len() as u64;
                at += k.len();
            }
            Err(error) => {
                *written += error.done as u64;
                return Some(Stopped {
                    at: at + error.done,
                    error,
                });
            }
        }
    }
    None
}

/// Deletes `keys` by `BATCH_CHUNK` through `call`, counting the entries
/// deleted into `deleted`. The kernel stops a batch at a key that is not
/// there: that key is stepped over and the batch goes on after it.
fn delete_in_chunks<K>(
    keys: &[K],
    deleted: &mut u64,
    mut call: impl FnMut(&[K]) -> Result<(), BatchError>,
) -> Option<Stopped> {
    let mut at = 0;
    while at < keys.len() {
        let chunk = &keys[at..keys.len().min(at + BATCH_CHUNK)];
        match call(chunk) {
            Ok(()) => {
                *deleted += chunk.len() as u64;
                at += chunk.len();
            }
            Err(error) if error.not_found() => {
                *deleted += error.done as u64;
                at += error.done + 1;
            }
            Err(error) => {
                *deleted += error.done as u64;
                return Some(Stopped {
                    at: at + error.done,
                    error,
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use anyhow::bail;

    use super::*;

    fn pending(ops: &[(u32, Option<u32>)]) -> Pending<u32, u32> {
        let mut p = Pending::default();
        for (k, v) in ops {
            match v {
                Some(v) => p.write(*k, *v),
                None => p.delete(*k),
            }
        }
        p
    }

    /// A frontend deleted (its port removed) and written again (by the port
    /// it moved to) in one batch ends up written, and the other way round.
    #[test]
    fn the_last_operation_staged_per_key_wins() {
        let split = pending(&[(1, None), (2, Some(20)), (1, Some(10)), (3, Some(30)), (3, None)]).split();
        assert_eq!(
            split,
            Split {
                keys: vec![2, 1],
                values: vec![20, 10],
                deletes: vec![3],
            }
        );
    }

    #[test]
    fn writes_alone_keep_their_order() {
        let split = pending(&[(5, Some(1)), (4, Some(2)), (5, Some(3))]).split();
        assert_eq!((split.keys, split.values), (vec![5, 4, 5], vec![1, 2, 3]));
        assert!(split.deletes.is_empty());
    }

    /// Backends and slots are written before the frontends (and Service
    /// port entries) that point at them, frontends go before what they
    /// pointed at, old slots before the backends they name; every step is
    /// there once.
    #[test]
    fn flush_stages_keep_every_frontend_pointing_at_entries_in_place() {
        let stage_of = |step| {
            let stages = FLUSH_STAGES.iter().enumerate();
            let mut found = stages.filter(|(_, steps)| steps.contains(&step)).map(|(i, _)| i);
            let stage = found.next().expect("every step is in a stage");
            assert!(found.next().is_none(), "{step} is in one stage only");
            stage
        };
        let before = |a, b| assert!(stage_of(a) < stage_of(b), "{a} must end before {b} starts");
        let pointed_at = [
            Table::Backends,
            Table::Backends6,
            Table::Slots,
            Table::Members,
            Table::SourceRanges,
            Table::SourceRanges6,
            Table::Maglev,
        ];
        for frontends in [Table::Services, Table::Services6] {
            for table in pointed_at {
                before(Step::Write(table), Step::Write(frontends));
            }
            for table in pointed_at.into_iter().chain([Table::RevNat]) {
                before(Step::Write(frontends), Step::Delete(table));
                before(Step::Delete(frontends), Step::Delete(table));
            }
            before(Step::Write(frontends), Step::Delete(frontends));
        }
        for backends in [Table::Backends, Table::Backends6] {
            before(Step::Delete(Table::Slots), Step::Delete(backends));
            before(Step::Delete(Table::Members), Step::Delete(backends));
            before(Step::Delete(Table::Maglev), Step::Delete(backends));
        }
        // A Service port entry points at slots of its own run.
        for table in [Table::Backends, Table::Slots] {
            before(Step::Write(table), Step::Write(Table::ServicePorts));
            before(Step::Delete(Table::ServicePorts), Step::Delete(table));
        }
        assert_eq!(FLUSH_STAGES.iter().map(|s| s.len()).sum::<usize>(), 21);
    }

    #[test]
    fn a_spread_stage_runs_every_step_and_reports_a_failure() {
        let ran = &AtomicU64::new(0);
        let step = |fails: bool| -> Job<'_> {
            Box::new(move || {
                ran.fetch_add(1, Ordering::Relaxed);
                if fails {
                    bail!("no room")
                }
                Ok(())
            })
        };
        let jobs = vec![
            (Step::Write(Table::Backends), step(false)),
            (Step::Write(Table::Slots), step(true)),
            (Step::Write(Table::RevNat), step(false)),
        ];
        let error = run_stage(jobs, true).expect_err("the slots failed");
        assert_eq!(format!("{error:#}"), "writing backend slots: no room");
        assert_eq!(ran.load(Ordering::Relaxed), 3, "the other steps still ran");
    }

    fn batch_error(done: usize, errno: i32) -> BatchError {
        BatchError {
            done,
            error: std::io::Error::from_raw_os_error(errno),
        }
    }

    #[test]
    fn writes_go_in_chunks_and_stop_at_the_entry_that_failed() {
        let keys: Vec<u32> = (0..(2 * BATCH_CHUNK + 3) as u32).collect();
        let mut calls = Vec::new();
        let mut written = 0;
        let stop = update_in_chunks(&keys, &keys, &mut written, |k, v| {
            assert_eq!(k, v);
            calls.push(k.len());
            Ok(())
        });
        assert!(stop.is_none());
        assert_eq!(calls, vec![BATCH_CHUNK, BATCH_CHUNK, 3]);
        assert_eq!(written, keys.len() as u64);

        let mut written = 0;
        let mut call = 0;
        let stop = update_in_chunks(&keys, &keys, &mut written, |_, _| {
            call += 1;
            if call == 2 {
                Err(batch_error(7, libc::E2BIG))
            } else {
                Ok(())
            }
        })
        .expect("the second call failed");
        assert_eq!((stop.at, written), (BATCH_CHUNK + 7, (BATCH_CHUNK + 7) as u64));
    }

    /// A fake BPF_MAP_DELETE_BATCH over a set: stops with ENOENT at the
    /// first key that is not there, like the kernel.
    fn delete_from(map: &mut BTreeSet<u32>) -> impl FnMut(&[u32]) -> Result<(), BatchError> + '_ {
        |keys| {
            for (done, key) in keys.iter().enumerate() {
                if !map.remove(key) {
                    return Err(batch_error(done, libc::ENOENT));
                }
            }
            Ok(())
        }
    }

    #[test]
    fn deletes_step_over_keys_that_are_gone() {
        let mut map: BTreeSet<u32> = (0..BATCH_CHUNK as u32 + 10).filter(|k| k % 3 != 0).collect();
        let present = map.len() as u64;
        let keys: Vec<u32> = (0..BATCH_CHUNK as u32 + 10).collect();
        let mut deleted = 0;
        assert!(delete_in_chunks(&keys, &mut deleted, delete_from(&mut map)).is_none());
        assert!(map.is_empty());
        assert_eq!(deleted, present, "only keys that were there count");
    }

    #[test]
    fn a_kernel_without_batches_is_found_out_before_anything_is_written() {
        let unsupported = batch_error(0, 524);
        assert!(unsupported.unsupported());
        assert!(
            !batch_error(3, libc::EINVAL).unsupported(),
            "a failure after some entries is real"
        );
        let mut deleted = 0;
        let stop = delete_in_chunks(&[1u32, 2], &mut deleted, |_| Err(batch_error(0, libc::EINVAL))).expect("stopped");
        assert_eq!((stop.at, deleted), (0, 0));
        assert!(stop.error.unsupported());
    }
}
