//! Undoing what a traced frame did to the live maps, so that no packet of
//! real traffic ever sees it.
//!
//! A program run by BPF_PROG_TEST_RUN uses the pinned maps like a real
//! packet: it may create or move on the two conntrack entries of the
//! traced flow, remember the client for ClientIP affinity, and count its
//! verdict (and conntrack insertions) in per-CPU arrays. Running a copy of
//! the program against clones of the maps would leave the maps alone, but
//! it would not be the live program (an upgrade may have swapped it) and
//! cloning a conntrack table of a million entries costs more than the
//! trace. A flag the programs check would cost every real packet. So the
//! trace runs the live program on the live maps and puts back, right
//! after, exactly the entries a run of its one frame can touch, whose keys
//! are known from the frame:
//!
//! - conntrack: the frame's own tuple and the other entry of its flow
//!   (before and after the run, through [`partner_key`]), each restored to
//!   what it held before (deleted if it was not there; an entry on the
//!   reply tuple only if it is this flow's);
//! - affinity: the entry of the frame's source at the Service port of the
//!   frontend it is addressed to;
//! - counters: the thread is pinned to one CPU, so the run counts in that
//!   CPU's slot only; one packet of the frame's length is subtracted from
//!   the verdict it moved (the run counts exactly one), and the conntrack
//!   counters the programs write go back to their values before.
//!
//! The fragments map is not touched: the frame is a whole datagram.
//!
//! What is not undone, and why that is acceptable: the per-CPU arrays are
//! written whole (Linux 6.18 cannot write one CPU's slot), so a packet that
//! another CPU counts between reading a slot back and writing it is lost
//! (microseconds; the counters are statistics); a packet counted on the
//! trace's CPU between the two reads of the conntrack counters is also
//! lost. An LRU map refreshes an entry's age on lookup, and inserting into
//! a full conntrack table evicts its oldest flow, as a real new flow would.
//! A real packet of the very tuple traced, sent during the run, would see
//! the trace's entries: the default source port is one no flow uses.

use std::path::Path;

use anyhow::{Context, Result, bail};
use aya::maps::{HashMap, MapData, MapError, PerCpuArray, PerCpuValues};
use proxy_common::{
    AffinityKey, AffinityValue, CtKey, CtValue, FrontendPort, ServiceKey, ServiceValue, Verdict, VerdictCounter,
    affinity::affinity_id, conntrack::partner_key, maps, stats::ct_stat,
};

use crate::mode::ebpf::{open_pinned, pinned, pinned_entry as get};

/// The conntrack counters the programs add to (the agent writes the others).
const CT_STATS_OF_PROGRAMS: [u32; 2] = [ct_stat::INSERTED, ct_stat::REMOVED];

/// The pinned maps a run can change, and the ones it reads to know which
/// affinity entry is the frame's.
pub struct Maps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    /// `None` under the pins of an agent older than the map.
    service_ports: Option<HashMap<MapData, u32, FrontendPort>>,
    conntrack: HashMap<MapData, CtKey, CtValue>,
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    stats: PerCpuArray<MapData, VerdictCounter>,
    ct_stats: PerCpuArray<MapData, u64>,
}

/// What the guarded entries held before the run.
pub struct Before {
    cpu: usize,
    conntrack: Vec<(CtKey, Option<CtValue>)>,
    affinity: Option<(AffinityKey, Option<AffinityValue>)>,
    stats: Vec<Option<PerCpuValues<VerdictCounter>>>,
    ct_stats: Vec<(u32, u64)>,
}

/// What the run did, seen before it was undone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Effect {
    /// The verdict the run counted (`None` if no counter moved on its CPU).
    pub verdict: Option<Verdict>,
    /// The conntrack entry of the frame's tuple after the run.
    pub entry: Option<CtValue>,
    /// Conntrack entries put back (deleted, or restored to before).
    pub conntrack_undone: usize,
    /// Whether the affinity entry had changed and was put back.
    pub affinity_undone: bool,
}

impl Maps {
    pub fn open(pin_path: &Path) -> Result<Self> {
        Ok(Self {
            services: open_pinned(pin_path, maps::SERVICES)?,
            service_ports: open_pinned(pin_path, maps::SERVICE_PORTS).ok(),
            conntrack: open_pinned(pin_path, maps::CONNTRACK)?,
            affinity: open_pinned(pin_path, maps::AFFINITY)?,
            stats: PerCpuArray::try_from(pinned(pin_path, maps::STATS)?)
                .with_context(|| format!("map {} has an unexpected layout", maps::STATS))?,
            ct_stats: PerCpuArray::try_from(pinned(pin_path, maps::CT_STATS)?)
                .with_context(|| format!("map {} has an unexpected layout", maps::CT_STATS))?,
        })
    }

    /// The conntrack entry of `key`, if there is one.
    pub fn conntrack_entry(&self, key: &CtKey) -> Result<Option<CtValue>> {
        get(&self.conntrack, key)
    }

    /// Reads the entries a run of the frame with tuple `key` can change.
    /// Call on the CPU the run will use ([`pin_to_current_cpu`]).
    pub fn before(&self, key: &CtKey, cpu: usize) -> Result<Before> {
        let mut conntrack = vec![(*key, get(&self.conntrack, key)?)];
        if let Some(value) = conntrack[0].1 {
            let partner = partner_key(key, &value);
            conntrack.push((partner, get(&self.conntrack, &partner)?));
        }
        let affinity = match get(&self.services, &frontend_of(key))? {
            Some(svc) => {
                let port = match &self.service_ports {
                    Some(ports) => get(ports, &svc.rev_nat_id)?,
                    None => None,
                };
                let client = AffinityKey {
                    affinity_id: affinity_id(&svc, port.as_ref()),
                    client_be: key.saddr_be,
                };
                Some((client, get(&self.affinity, &client)?))
            }
            None => None,
        };
        // The counters last: the shorter the time to the run, the fewer
        // real packets fall between.
        let ct_stats = CT_STATS_OF_PROGRAMS
            .iter()
            .map(|&index| Ok((index, slot(&self.ct_stats, index, cpu)?)))
            .collect::<Result<_>>()?;
        let stats = Verdict::ALL
            .iter()
            .map(|v| per_cpu(&self.stats, *v as u32))
            .collect::<Result<_>>()?;
        Ok(Before {
            cpu,
            conntrack,
            affinity,
            stats,
            ct_stats,
        })
    }

    /// Puts back what the run of a `frame_len` bytes frame with tuple `key`
    /// changed, and says what that was.
    pub fn undo(&mut self, before: Before, key: &CtKey, frame_len: usize) -> Result<Effect> {
        let verdict = self.undo_counters(&before, frame_len)?;
        let entry = get(&self.conntrack, key)?;
        let conntrack_undone = self.undo_conntrack(&before, key, entry)?;
        let affinity_undone = match before.affinity {
            Some((client, was)) => restore(&mut self.affinity, &client, was)?,
            None => false,
        };
        Ok(Effect {
            verdict,
            entry,
            conntrack_undone,
            affinity_undone,
        })
    }

    /// Takes the run's one packet out of the verdict counter it moved and
    /// puts the conntrack counters of the run's CPU back; returns the verdict.
    fn undo_counters(&mut self, before: &Before, frame_len: usize) -> Result<Option<Verdict>> {
        let counted = VerdictCounter {
            packets: 1,
            bytes: frame_len as u64,
        };
        let mut moved = self.moved_verdicts(before)?;
        // The run counted one packet of the frame's length; a real packet
        // counted on this CPU meanwhile may have moved another verdict.
        let index = moved
            .iter()
            .position(|(_, delta, _)| *delta == counted)
            .or_else(|| (!moved.is_empty()).then_some(0));
        let verdict = match index {
            Some(index) => {
                let (verdict, _, now) = moved.swap_remove(index);
                self.uncount(verdict, now, before.cpu, counted)?;
                Some(verdict)
            }
            None => None,
        };
        self.restore_ct_stats(before)?;
        Ok(verdict)
    }

    /// The verdicts whose counters moved on the run's CPU: each with the
    /// difference there and its per-CPU values now.
    fn moved_verdicts(&self, before: &Before) -> Result<Vec<(Verdict, VerdictCounter, PerCpuValues<VerdictCounter>)>> {
        let mut moved = Vec::new();
        for (verdict, was) in Verdict::ALL.iter().zip(&before.stats) {
            let (Some(was), Some(now)) = (was, per_cpu(&self.stats, *verdict as u32)?) else {
                continue;
            };
            let (was_here, now_here) = (cpu_slot(was, before.cpu)?, cpu_slot(&now, before.cpu)?);
            if now_here.packets > was_here.packets {
                let delta = VerdictCounter {
                    packets: now_here.packets - was_here.packets,
                    bytes: now_here.bytes.wrapping_sub(was_here.bytes),
                };
                moved.push((*verdict, delta, now));
            }
        }
        Ok(moved)
    }

    /// Writes `now` back to `verdict`'s counter less `counted` on `cpu`.
    fn uncount(
        &mut self,
        verdict: Verdict,
        now: PerCpuValues<VerdictCounter>,
        cpu: usize,
        counted: VerdictCounter,
    ) -> Result<()> {
        let mut values = now.to_vec();
        if let Some(here) = values.get_mut(cpu) {
            here.packets = here.packets.saturating_sub(counted.packets);
            here.bytes = here.bytes.saturating_sub(counted.bytes);
        }
        write_per_cpu(&mut self.stats, verdict as u32, values)
    }

    /// Puts the conntrack counters the programs write back to their values
    /// before, on the run's CPU.
    fn restore_ct_stats(&mut self, before: &Before) -> Result<()> {
        for &(index, was) in &before.ct_stats {
            let mut values = per_cpu(&self.ct_stats, index)?
                .with_context(|| format!("no conntrack counter {index}"))?
                .to_vec();
            match values.get_mut(before.cpu) {
                Some(here) if *here != was => *here = was,
                _ => continue,
            }
            write_per_cpu(&mut self.ct_stats, index, values)?;
        }
        Ok(())
    }

    /// Restores every conntrack entry the run may have touched: those read
    /// before, and the partner of the frame's entry after, if the run made
    /// it (its key was unknown before the run picked a backend).
    fn undo_conntrack(&mut self, before: &Before, key: &CtKey, after: Option<CtValue>) -> Result<usize> {
        let mut guarded = before.conntrack.clone();
        if let Some(value) = after {
            let partner = partner_key(key, &value);
            if !guarded.iter().any(|(k, _)| *k == partner) && self.points_back(&partner, key)? {
                guarded.push((partner, None));
            }
        }
        let mut undone = 0;
        for (k, was) in guarded {
            if restore(&mut self.conntrack, &k, was)? {
                undone += 1;
            }
        }
        Ok(undone)
    }

    /// Whether the entry at `partner` is the other half of `key`'s flow.
    /// One that is not belongs to another flow whose tuple happens to be
    /// this flow's reply tuple (see `proxy_common::conntrack`): the
    /// programs did not overwrite it, and neither may the trace delete it.
    fn points_back(&self, partner: &CtKey, key: &CtKey) -> Result<bool> {
        Ok(get(&self.conntrack, partner)?.is_some_and(|value| partner_key(partner, &value) == *key))
    }
}

/// The Service frontend the tuple `key` is addressed to.
fn frontend_of(key: &CtKey) -> ServiceKey {
    ServiceKey {
        addr_be: key.daddr_be,
        port_be: key.dport_be,
        proto: key.proto,
        _pad: 0,
    }
}

/// Pins the calling thread to the CPU it runs on and returns that CPU, so
/// that a program it test-runs counts in that CPU's slots.
pub fn pin_to_current_cpu() -> Result<usize> {
    // SAFETY: no arguments; returns a CPU number or -1.
    let cpu = unsafe { libc::sched_getcpu() };
    let cpu = usize::try_from(cpu).map_err(|_| std::io::Error::last_os_error())?;
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET checks `cpu` against the set's size and writes inside it.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 = this thread.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error()).context("pinning the trace to one CPU");
    }
    Ok(cpu)
}

/// Puts `key` back to `was` (deleting it if it was not there); whether it
/// had changed.
fn restore<K: aya::Pod, V: aya::Pod + PartialEq>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
    was: Option<V>,
) -> Result<bool> {
    let now = get(map, key)?;
    if now == was {
        return Ok(false);
    }
    match was {
        Some(value) => map.insert(key, value, 0).context("restoring a map entry")?,
        None => match map.remove(key) {
            Ok(()) | Err(MapError::KeyNotFound) => {}
            Err(e) => return Err(e).context("deleting a map entry"),
        },
    }
    Ok(true)
}

/// The per-CPU values at `index`; `None` past the array's end (a map
/// pinned by an older agent knows fewer verdicts).
fn per_cpu<V: aya::Pod>(map: &PerCpuArray<MapData, V>, index: u32) -> Result<Option<PerCpuValues<V>>> {
    match map.get(&index, 0) {
        Ok(values) => Ok(Some(values)),
        Err(MapError::OutOfBounds { .. }) => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading counter {index}")),
    }
}

fn slot(map: &PerCpuArray<MapData, u64>, index: u32, cpu: usize) -> Result<u64> {
    let values = per_cpu(map, index)?.with_context(|| format!("no conntrack counter {index}"))?;
    cpu_slot(&values, cpu)
}

fn cpu_slot<V: aya::Pod>(values: &PerCpuValues<V>, cpu: usize) -> Result<V> {
    match values.get(cpu) {
        Some(value) => Ok(*value),
        None => bail!("CPU {cpu} has no slot in a per-CPU map of {} CPUs", values.len()),
    }
}

fn write_per_cpu<V: aya::Pod>(map: &mut PerCpuArray<MapData, V>, index: u32, values: Vec<V>) -> Result<()> {
    let values = PerCpuValues::try_from(values).context("per-CPU values")?;
    map.set(index, values, 0)
        .with_context(|| format!("writing counter {index} back"))
}
