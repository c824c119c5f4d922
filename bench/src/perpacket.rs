//! Per-packet cost of the eBPF programs through BPF_PROG_TEST_RUN.
//!
//! Every call runs one packet (repeat = 1) and takes the kernel's own
//! measured duration. Each call of a program is paired with a call of a
//! program that only returns "pass" (XDP_PASS for xdp_uplink; TC_ACT_OK for
//! the tc programs, whose test runs pass through another call path) on the
//! same packet: that is the baseline, the cost of the test run itself, and
//! net = gross - baseline. A round takes the median of `calls` calls per
//! case; the report gives median, min and max over `rounds` rounds, the
//! cases interleaved in every round so that noise hits all of them alike,
//! and the rounds spread over several loads of the programs.
//!
//! Every call's return code and output packet are checked against what the
//! case is about (DNAT to the flow's backend, reverse NAT, untouched), and
//! every batch's verdict counters must show exactly its calls under the
//! case's verdict: an error path or a flow on the wrong path fails the run.

mod bed;
mod cases;
mod family;
mod memory;
mod raw;

use std::{
    os::fd::{AsFd, BorrowedFd},
    path::PathBuf,
    time::Instant,
};

use anyhow::{Context, Result, ensure};
use proxy_common::{Verdict, maps::CONNTRACK_MAX};
use serde::Serialize;
use testbed::testrun::Prog;

pub use bed::ProgramInfo;
pub use cases::{Frontend, Kind};
pub use family::Family;
pub use memory::map_memory;

use self::{
    bed::{Bed, Object},
    cases::{Case, Side},
    raw::PassProgram,
};

/// How much to measure.
#[derive(Clone, Debug)]
pub struct Options {
    /// Test runs per case per round (each paired with a baseline run).
    pub calls: usize,
    pub rounds: usize,
    /// Flows in the "working set" cases (issue 15: 1,000,000).
    pub working_set: usize,
}

impl Options {
    /// A few seconds: enough to see the order of magnitude.
    pub fn quick() -> Self {
        Self {
            calls: 200,
            rounds: 5,
            working_set: 100_000,
        }
    }

    /// The report's numbers: about a minute on a quiet machine, most of it
    /// opening the working sets' flows.
    pub fn full() -> Self {
        Self {
            calls: 2000,
            rounds: 99,
            working_set: 1_000_000,
        }
    }

    /// Conntrack entries each data path is loaded with: the agent's default,
    /// or room for the working set, whichever is larger. A node that carries
    /// a million flows is given a table that holds them (kube-proxy's
    /// `conntrack.maxPerCore`, which the agent sizes its table by), so that
    /// is what is measured.
    pub fn conntrack_entries(&self) -> u32 {
        // Two entries per flow (and the few single flows besides), filling
        // at most half the table: a fuller LRU starts evicting before it is
        // full (its per-CPU free lists run dry), and an evicted flow would
        // be measured as a new one.
        let wanted = 2 * (self.working_set + 16) * 2;
        u32::try_from(wanted).unwrap_or(u32::MAX).max(CONNTRACK_MAX)
    }
}

/// kube-proxy's default masquerade bit (14): the SNAT fallback is on, as
/// the agent runs it.
const SNAT_MARK: u32 = 1 << 14;

/// Median, min and max over rounds, in ns.
#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// One round of one case, in ns: medians of its calls, and interquartile
/// means (the mean of the middle half), which resolve steps finer than the
/// clock's. `net = gross - baseline` for both.
#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub struct RoundSample {
    pub gross: f64,
    pub baseline: f64,
    pub net: f64,
    pub gross_iqm: f64,
    pub baseline_iqm: f64,
    pub net_iqm: f64,
}

impl RoundSample {
    fn of(timings: &[cases::Timing]) -> Self {
        let gross: Vec<f64> = timings.iter().map(|t| f64::from(t.gross_ns)).collect();
        let baseline: Vec<f64> = timings.iter().map(|t| f64::from(t.baseline_ns)).collect();
        let (gross_iqm, baseline_iqm) = (interquartile_mean(gross.clone()), interquartile_mean(baseline.clone()));
        let (gross, baseline) = (median(gross), median(baseline));
        Self {
            gross,
            baseline,
            net: gross - baseline,
            gross_iqm,
            baseline_iqm,
            net_iqm: gross_iqm - baseline_iqm,
        }
    }
}

#[derive(Serialize, Clone, Debug)]
pub struct CaseReport {
    /// `xdp_uplink`, `tc_ingress` or `tc_egress`.
    pub program: String,
    pub kind: Kind,
    pub frontend: Frontend,
    /// The family of the case's packets.
    pub family: Family,
    /// Human-readable case name, e.g. "established, 100k flows (NodePort)".
    pub label: String,
    /// The verdict every packet was counted under, and its return code.
    pub verdict: String,
    pub code: u32,
    /// The pass program the case's baseline ran (`XDP_PASS` or `TC_ACT_OK`).
    pub baseline_program: String,
    pub gross: Stats,
    pub baseline: Stats,
    /// Over the rounds' `gross - baseline`.
    pub net: Stats,
    /// Over the rounds' interquartile means' `gross - baseline`.
    pub net_iqm: Stats,
    /// Issue 5's target for the net median, if it sets one.
    pub target_ns: Option<f64>,
    pub rounds: Vec<RoundSample>,
}

impl CaseReport {
    /// Whether the net median meets the target (`None`: no target).
    pub fn meets_target(&self) -> Option<bool> {
        self.target_ns.map(|t| self.net.median <= t)
    }
}

#[derive(Serialize, Clone, Debug)]
pub struct Report {
    pub calls: usize,
    pub rounds: usize,
    pub working_set: usize,
    /// Where the measured eBPF object came from.
    pub object: String,
    pub programs: Vec<ProgramInfo>,
    pub snat_mark: u32,
    /// `uname -r`.
    pub kernel: String,
    /// The CPU the measuring thread was pinned to, if pinning worked.
    pub cpu: Option<usize>,
    /// The step in which the kernel's clock moved (medians move in such
    /// steps; 1 if it looked finer).
    pub clock_step_ns: u32,
    /// Baseline medians over all rounds and cases, per pass program.
    pub xdp_pass_ns: f64,
    pub tc_pass_ns: f64,
    pub cases: Vec<CaseReport>,
    /// Of the whole run (all objects of a comparison).
    pub elapsed_s: f64,
}

/// Measures the eBPF object built into this binary (or the one named by
/// `XPROXY_BENCH_EBPF_OBJECT`): loads its programs (in two data paths: uplink and pod
/// flows in separate maps; and that [`LOADS`] times), sets up every case
/// and measures it. Must run as root.
pub fn measure(options: &Options, progress: &dyn Fn(&str)) -> Result<Report> {
    let object = Object::from_env_or_builtin()?;
    let mut reports = measure_objects(vec![object], options, progress)?;
    reports.pop().context("no report")
}

/// Measures several eBPF objects (e.g. a candidate change against the
/// current build) side by side: each gets its own data paths and cases,
/// and every round runs them all, so the machine's noise hits them alike.
/// One report per object, in order.
// Used by `print_full_report` below; not wired into the binary yet.
#[cfg_attr(not(test), allow(dead_code))]
pub fn compare(objects: &[PathBuf], options: &Options, progress: &dyn Fn(&str)) -> Result<Vec<Report>> {
    let objects = objects.iter().map(|p| Object::from_path(p)).collect::<Result<_>>()?;
    measure_objects(objects, options, progress)
}

/// Times each object is loaded. Where the maps' memory and the JIT image
/// land, and the maps' hash seeds, move a hot case by some 10-20 ns from one
/// load to the next; rounds take the loads in turn, so that a report is
/// not one load's luck.
const LOADS: usize = 3;

/// One object under measurement: its loads and its results so far.
struct ObjectRun {
    object: Object,
    loads: Vec<Loaded>,
    /// Per case (the same cases in every load), one sample per round.
    samples: Vec<Vec<RoundSample>>,
    /// Round medians of the baselines, per pass program (XDP, tc).
    baselines: [Vec<f64>; 2],
}

/// One load of an object: its data paths and its cases set up in them.
struct Loaded {
    beds: [Bed; 2],
    cases: Vec<Case>,
}

fn measure_objects(objects: Vec<Object>, options: &Options, progress: &dyn Fn(&str)) -> Result<Vec<Report>> {
    ensure!(
        options.calls > 0 && options.rounds > 0 && options.working_set > 0,
        "calls, rounds and working set must be positive: {options:?}"
    );
    let started = Instant::now();
    let pin = CpuPin::to_current_cpu();
    let xdp_pass = raw::load_pass(PassProgram::Xdp).context("loading the XDP_PASS baseline")?;
    let tc_pass = raw::load_pass(PassProgram::Tc).context("loading the TC_ACT_OK baseline")?;
    let mut runs = objects
        .into_iter()
        .map(|object| ObjectRun::new(object, options, progress))
        .collect::<Result<Vec<_>>>()?;
    let mut clock = ClockSteps::default();
    for round in 0..options.rounds {
        progress(&format!("per-packet: round {}/{}", round + 1, options.rounds));
        // Another object and another case go first each round, so that none
        // always follows the same neighbour.
        let objects = runs.len();
        for j in 0..objects {
            let run = &mut runs[(j + round) % objects];
            let load = &mut run.loads[round % LOADS];
            let cases = load.cases.len();
            for k in 0..cases {
                let i = (k + round) % cases;
                let case = &mut load.cases[i];
                let baseline = match case.baseline {
                    PassProgram::Xdp => xdp_pass.as_fd(),
                    PassProgram::Tc => tc_pass.as_fd(),
                };
                let timings = run_checked(case, &mut load.beds, baseline, options.calls)?;
                clock.add(&timings);
                let sample = RoundSample::of(&timings);
                run.baselines[usize::from(case.baseline == PassProgram::Tc)].push(sample.baseline);
                run.samples[i].push(sample);
            }
        }
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let cpu = pin.as_ref().map(|p| p.cpu);
    runs.into_iter()
        .map(|run| run.report(options, cpu, clock.step(), elapsed_s))
        .collect()
}

impl ObjectRun {
    fn new(object: Object, options: &Options, progress: &dyn Fn(&str)) -> Result<Self> {
        let mut loads = Vec::with_capacity(LOADS);
        for load in 1..=LOADS {
            progress(&format!(
                "per-packet: loading the programs, {load} of {LOADS} ({})",
                object.source
            ));
            let beds = [
                Bed::load(&object, SNAT_MARK, family::node_ips(), options.conntrack_entries())?,
                Bed::load(&object, SNAT_MARK, family::node_ips(), options.conntrack_entries())?,
            ];
            let cases = cases::build(&beds, options.working_set, progress)?;
            loads.push(Loaded { beds, cases });
        }
        Ok(Self {
            object,
            samples: vec![Vec::new(); loads[0].cases.len()],
            loads,
            baselines: [Vec::new(), Vec::new()],
        })
    }

    fn report(self, options: &Options, cpu: Option<usize>, clock_step_ns: u32, elapsed_s: f64) -> Result<Report> {
        let first = &self.loads[0];
        let programs = [Prog::XdpUplink, Prog::TcIngress, Prog::TcEgress]
            .into_iter()
            .map(|p| first.beds[0].info(p))
            .collect::<Result<_>>()?;
        let [xdp_baselines, tc_baselines] = self.baselines;
        Ok(Report {
            calls: options.calls,
            rounds: options.rounds,
            working_set: options.working_set,
            object: self.object.source,
            programs,
            snat_mark: SNAT_MARK,
            kernel: kernel_release(),
            cpu,
            clock_step_ns,
            xdp_pass_ns: median(xdp_baselines),
            tc_pass_ns: median(tc_baselines),
            cases: first
                .cases
                .iter()
                .zip(self.samples)
                .map(|(c, s)| case_report(c, s))
                .collect(),
            elapsed_s,
        })
    }
}

/// One batch of a case, its verdict counters checked.
fn run_checked(
    case: &mut Case,
    beds: &mut [Bed; 2],
    baseline: BorrowedFd<'_>,
    calls: usize,
) -> Result<Vec<cases::Timing>> {
    let bed = &mut beds[side_index(case.side)];
    let before = bed.packets()?;
    let timings = case.run_batch(bed, baseline, calls)?;
    let after = bed.packets()?;
    check_counted(case, &before, &after, calls)?;
    Ok(timings)
}

fn side_index(side: Side) -> usize {
    Side::ALL.iter().position(|s| *s == side).unwrap_or(0)
}

/// Exactly `calls` packets, all under the case's verdict.
fn check_counted(case: &Case, before: &[u64], after: &[u64], calls: usize) -> Result<()> {
    let want = case.kind.verdict();
    for verdict in Verdict::ALL {
        let counted = after[verdict as usize] - before[verdict as usize];
        let expected = if verdict == want { calls as u64 } else { 0 };
        ensure!(
            counted == expected,
            "{} / {}: {counted} packets counted as {} in a batch of {calls} (want {expected})",
            case.prog.name(),
            case.label,
            verdict.name()
        );
    }
    Ok(())
}

fn case_report(case: &Case, rounds: Vec<RoundSample>) -> CaseReport {
    let stats = |f: fn(&RoundSample) -> f64| Stats::of(rounds.iter().map(f).collect());
    CaseReport {
        program: case.prog.name().to_owned(),
        kind: case.kind,
        frontend: case.frontend,
        family: case.family,
        label: case.label.clone(),
        verdict: case.kind.verdict().name().to_owned(),
        code: case.code,
        baseline_program: case.baseline.name().to_owned(),
        gross: stats(|r| r.gross),
        baseline: stats(|r| r.baseline),
        net: stats(|r| r.net),
        net_iqm: stats(|r| r.net_iqm),
        target_ns: case.kind.target_ns(),
        rounds,
    }
}

impl Stats {
    fn of(values: Vec<f64>) -> Self {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Self {
            median: median(values),
            min,
            max,
        }
    }
}

/// The median (the mean of the middle two for an even count); NaN if empty.
fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The mean of the middle half of the sorted values; NaN if empty.
fn interquartile_mean(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let quarter = values.len() / 4;
    let middle = &values[quarter..values.len() - quarter];
    middle.iter().sum::<f64>() / middle.len() as f64
}

/// How often each baseline duration was seen, to tell the clock's step.
#[derive(Default)]
struct ClockSteps {
    counts: std::collections::BTreeMap<u32, u64>,
}

impl ClockSteps {
    fn add(&mut self, timings: &[cases::Timing]) {
        for t in timings {
            *self.counts.entry(t.baseline_ns).or_default() += 1;
        }
    }

    /// The largest step `s` (4 to 50 ns) such that nine in ten baseline
    /// durations lie within 1 ns of a multiple of `s` (the clock converts
    /// its ticks to ns with rounding); 1 if there is none. Steps under 4
    /// cannot be told apart from a 1 ns clock this way.
    fn step(&self) -> u32 {
        let total: u64 = self.counts.values().sum();
        (4..=50)
            .rev()
            .find(|s| {
                let near: u64 = self
                    .counts
                    .iter()
                    .filter(|(d, _)| {
                        let r = *d % s;
                        r <= 1 || r + 1 >= *s
                    })
                    .map(|(_, n)| n)
                    .sum();
                total > 0 && near * 10 >= total * 9
            })
            .unwrap_or(1)
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|_| "unknown".into(), |s| s.trim().to_owned())
}

/// Keeps the calling thread on one CPU while it measures (a migration
/// would start the next calls with cold caches); the old mask comes back
/// on drop.
struct CpuPin {
    cpu: usize,
    old: libc::cpu_set_t,
}

impl CpuPin {
    fn to_current_cpu() -> Option<Self> {
        // SAFETY: sched_getcpu has no preconditions; the sets are plain
        // bitmaps, zeroed, and passed with their size.
        unsafe {
            let cpu = usize::try_from(libc::sched_getcpu()).ok()?;
            let size = std::mem::size_of::<libc::cpu_set_t>();
            let mut old: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size, &mut old) != 0 {
                return None;
            }
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            if libc::sched_setaffinity(0, size, &one) != 0 {
                return None;
            }
            Some(Self { cpu, old })
        }
    }
}

impl Drop for CpuPin {
    fn drop(&mut self) {
        // SAFETY: restores the mask read in `to_current_cpu`.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.old) };
    }
}

impl Report {
    /// The report's section: one row per case, and how it was measured.
    pub fn markdown(&self) -> String {
        let mut out = String::from("### Per-packet cost of the eBPF programs\n\n");
        out += &format!(
            "BPF_PROG_TEST_RUN, one packet per call (repeat = 1), the kernel's duration per call. \
             Per round the median of {} calls per case; median (min-max) over {} rounds, which take \
             {LOADS} loads of the programs in turn (placement in memory moves hot cases by 10-20 ns). \
             Each call is paired with a call of a program that only returns pass \
             (XDP_PASS for xdp_uplink: median {:.0} ns; TC_ACT_OK for the tc programs: median {:.0} ns) \
             on the same packet: net = gross - that baseline, per round. The kernel's clock moved in \
             steps of {} ns here, and so do medians; the interquartile mean (IQM, the mean of the \
             middle half of the calls) resolves finer. Kernel {}, SNAT fallback on (mark {:#x}), \
             measured on CPU {}, in {:.0} s.\n\n",
            self.calls,
            self.rounds,
            self.xdp_pass_ns,
            self.tc_pass_ns,
            self.clock_step_ns,
            self.kernel,
            self.snat_mark,
            self.cpu.map_or("(not pinned)".to_owned(), |c| c.to_string()),
            self.elapsed_s,
        );
        out += "| program | case | gross ns | baseline ns | **net ns** | net IQM ns | target | |\n\
                |---|---|---:|---:|---:|---:|---:|---|\n";
        for case in &self.cases {
            let (target, verdict) = match case.meets_target() {
                Some(ok) => (
                    format!("<= {:.0}", case.target_ns.unwrap_or_default()),
                    if ok { "met" } else { "**missed**" },
                ),
                None => ("-".to_owned(), ""),
            };
            out += &format!(
                "| {} | {} | {} | {} | **{}** | {:.1} | {} | {} |\n",
                case.program,
                case.label,
                range(&case.gross),
                range(&case.baseline),
                range(&case.net),
                case.net_iqm.median,
                target,
                verdict
            );
        }
        out += &format!(
            "\nNew flow: a TCP SYN from a client address and port never used before, every call \
             (lookup, backend selection, two conntrack inserts, DNAT); the flows a batch opened are \
             removed after it, so conntrack holds the same flows for every batch. Established: the \
             next packet of one flow, again and again. {} flows: that many flows opened first, \
             their next packets sent in a shuffled order, so each call finds its conntrack entry \
             cold. Reply: the backend's answer, reverse-NATed on the pod's egress. Miss: a packet \
             to no Service (SSH to the node; pod to pod; node to pod), of one flow or of many (then \
             the conntrack lookup for a reply is cold). Cases ending in \"IPv6\" send the same \
             packets in IPv6 (40-byte header, no extension header) to the seed Service's IPv6 twin \
             (ClusterIP [fd00:10:96::a]:88, NodePort [fd00:192:168:50::10]:30791, the same three \
             backends' IPv6 addresses), tracked in the IPv6 conntrack (XP_CT6); affinity, source \
             ranges, Maglev and the working sets are measured in IPv4 only, so an IPv6 new flow \
             inserts into a nearly empty XP_CT6 where an IPv4 one meets the working sets' flows in \
             XP_CT. Every call's return \
             code and output packet (checksums included) and every batch's verdict counters were \
             checked.\n\n\
             Programs measured ({}): {}.\n",
            self.working_set,
            self.object,
            self.programs
                .iter()
                .map(|p| format!(
                    "{} tag {} ({} B xlated, {} B JIT)",
                    p.name, p.tag, p.xlated_bytes, p.jited_bytes
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
        out + &self.families_markdown()
    }

    /// The IPv4 case of the same program, kind and frontend as `v6`.
    fn ipv4_twin(&self, v6: &CaseReport) -> Option<&CaseReport> {
        let same = |v4: &&CaseReport| (&v4.program, v4.kind, v4.frontend) == (&v6.program, v6.kind, v6.frontend);
        self.cases.iter().filter(|c| c.family == Family::Ipv4).find(same)
    }

    /// Each IPv6 case beside its IPv4 twin.
    fn families_markdown(&self) -> String {
        let pairs: Vec<(&CaseReport, &CaseReport)> = (self.cases.iter())
            .filter(|c| c.family == Family::Ipv6)
            .filter_map(|v6| self.ipv4_twin(v6).map(|v4| (v4, v6)))
            .collect();
        if pairs.is_empty() {
            return String::new();
        }
        let mut out = "\nIPv4 and IPv6 side by side: net ns per packet, median over the rounds \
                       (IQM in brackets), and IPv6's extra cost (IQM):\n\n\
                       | program | case | IPv4 | IPv6 | IPv6 - IPv4 |\n|---|---|---:|---:|---:|\n"
            .to_owned();
        for (v4, v6) in pairs {
            out += &format!(
                "| {} | {} | {:.0} [{:.0}] | {:.0} [{:.0}] | {:+.0} |\n",
                v4.program,
                v4.label,
                v4.net.median,
                v4.net_iqm.median,
                v6.net.median,
                v6.net_iqm.median,
                v6.net_iqm.median - v4.net_iqm.median
            );
        }
        out
    }
}

/// A table of several reports of one [`compare`] run: the net median (and
/// IQM) of every case per object, and the difference to the first object.
#[cfg_attr(not(test), allow(dead_code))]
pub fn comparison_markdown(reports: &[Report]) -> String {
    let Some(first) = reports.first() else {
        return String::new();
    };
    let mut out = format!(
        "Net ns per packet, median over {} rounds of {} calls (IQM in brackets); objects measured side by side:\n\n",
        first.rounds, first.calls
    );
    for (i, r) in reports.iter().enumerate() {
        out += &format!("{}. {}\n", i + 1, r.object);
    }
    out += "\n| program | case |";
    for i in 0..reports.len() {
        out += &format!(" {} |", i + 1);
    }
    out += "\n|---|---|";
    out += &"---:|".repeat(reports.len());
    out += "\n";
    for (k, case) in first.cases.iter().enumerate() {
        out += &format!("| {} | {} |", case.program, case.label);
        for r in reports {
            let Some(c) = r.cases.get(k) else {
                out += " - |";
                continue;
            };
            let delta = if std::ptr::eq(r, first) {
                String::new()
            } else {
                format!(" ({:+.0})", c.net_iqm.median - case.net_iqm.median)
            };
            out += &format!(" {:.0} [{:.0}]{delta} |", c.net.median, c.net_iqm.median);
        }
        out += "\n";
    }
    out
}

fn range(stats: &Stats) -> String {
    format!("{:.0} ({:.0}-{:.0})", stats.median, stats.min, stats.max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
        let s = Stats::of(vec![5.0, 9.0, 1.0]);
        assert_eq!((s.median, s.min, s.max), (5.0, 1.0, 9.0));
    }

    #[test]
    fn conntrack_holds_the_working_set_at_half_fill() {
        // The smoke test's 100,000 flows fit the agent's default table.
        assert_eq!(Options::quick().conntrack_entries(), CONNTRACK_MAX);
        let full = Options::full();
        assert_eq!(full.working_set, 1_000_000, "issue 15 measures a million flows");
        assert!(u64::from(full.conntrack_entries()) >= 4 * full.working_set as u64);
    }

    #[test]
    fn clock_step_is_told_from_baseline_durations() {
        let timings = |ns: &[u32]| -> Vec<cases::Timing> {
            ns.iter()
                .map(|&n| cases::Timing {
                    baseline_ns: n,
                    gross_ns: 0,
                })
                .collect()
        };
        let mut tens = ClockSteps::default();
        tens.add(&timings(&[70, 70, 80, 71, 60, 90, 81, 70, 69, 100]));
        assert_eq!(tens.step(), 10);
        let mut fine = ClockSteps::default();
        fine.add(&timings(&(60..=99).collect::<Vec<_>>()));
        assert_eq!(fine.step(), 1);
    }

    /// Every case is there with its program and verdict, the statistics are
    /// consistent, and `measure` really checked codes and counters (a run
    /// whose new flows hit conntrack would have failed).
    #[test]
    fn measure_reports_every_case_consistently() {
        if !testbed::privileged::require_root("measure_reports_every_case_consistently") {
            return;
        }
        let options = Options {
            calls: 20,
            rounds: 3,
            working_set: 500,
        };
        let messages = std::cell::RefCell::new(Vec::new());
        let report = measure(&options, &|m| messages.borrow_mut().push(m.to_owned())).expect("measure");
        assert_eq!((report.calls, report.rounds, report.working_set), (20, 3, 500));
        assert!(
            messages.borrow().iter().any(|m| m.contains("round 3/3")),
            "{messages:?}"
        );

        let present: Vec<(&str, Kind, Frontend, Family)> = report
            .cases
            .iter()
            .map(|c| (c.program.as_str(), c.kind, c.frontend, c.family))
            .collect();
        // The main kinds in both families; Service features and working
        // sets in IPv4.
        let both_families = [
            ("xdp_uplink", Kind::NewFlow, Frontend::NodePort),
            ("xdp_uplink", Kind::NewFlow, Frontend::ClusterIp),
            ("xdp_uplink", Kind::Established, Frontend::NodePort),
            ("xdp_uplink", Kind::Established, Frontend::ClusterIp),
            ("xdp_uplink", Kind::Miss, Frontend::None),
            ("tc_ingress", Kind::NewFlow, Frontend::ClusterIp),
            ("tc_ingress", Kind::Established, Frontend::ClusterIp),
            ("tc_ingress", Kind::Miss, Frontend::None),
            ("tc_egress", Kind::Reply, Frontend::ClusterIp),
            ("tc_egress", Kind::Miss, Frontend::None),
        ];
        let ipv4_only = [
            ("xdp_uplink", Kind::EstablishedWorkingSet, Frontend::NodePort),
            ("xdp_uplink", Kind::MissWorkingSet, Frontend::None),
            ("xdp_uplink", Kind::AffinityHit, Frontend::AffinityClusterIp),
            ("xdp_uplink", Kind::AffinityMiss, Frontend::AffinityClusterIp),
            ("xdp_uplink", Kind::NewFlow, Frontend::LoadBalancerIp),
            ("xdp_uplink", Kind::NewFlow, Frontend::MaglevClusterIp),
            ("tc_ingress", Kind::EstablishedWorkingSet, Frontend::ClusterIp),
            ("tc_ingress", Kind::MissWorkingSet, Frontend::None),
            ("tc_ingress", Kind::BackendPortMiss, Frontend::None),
            ("tc_egress", Kind::ReplyWorkingSet, Frontend::ClusterIp),
        ];
        let of = |family| move |&(p, k, f): &(&'static str, Kind, Frontend)| (p, k, f, family);
        let want: Vec<_> = (both_families.iter().map(of(Family::Ipv4)))
            .chain(ipv4_only.iter().map(of(Family::Ipv4)))
            .chain(both_families.iter().map(of(Family::Ipv6)))
            .collect();
        for case in &want {
            assert!(present.contains(case), "{case:?} missing from {present:?}");
        }
        assert_eq!(present.len(), want.len(), "{present:?}");

        for case in &report.cases {
            let ctx = format!("{} / {}", case.program, case.label);
            assert_eq!(case.rounds.len(), 3, "{ctx}");
            for r in &case.rounds {
                assert_eq!(r.net, r.gross - r.baseline, "{ctx}");
                assert_eq!(r.net_iqm, r.gross_iqm - r.baseline_iqm, "{ctx}");
                assert!(r.gross > 0.0 && r.baseline > 0.0, "{ctx}: {r:?}");
            }
            let all = [
                ("gross", case.gross),
                ("baseline", case.baseline),
                ("net", case.net),
                ("net IQM", case.net_iqm),
            ];
            for (what, s) in all {
                assert!(s.min <= s.median && s.median <= s.max, "{ctx}: {what} {s:?}");
            }
            assert_eq!(case.verdict, case.kind.verdict().name(), "{ctx}");
            let pass = if case.program == "xdp_uplink" { 2 } else { 0 };
            assert_eq!(case.code, pass, "{ctx}");
            let baseline = if case.program == "xdp_uplink" {
                "XDP_PASS"
            } else {
                "TC_ACT_OK"
            };
            assert_eq!(case.baseline_program, baseline, "{ctx}");
            assert_eq!(case.target_ns, case.kind.target_ns(), "{ctx}");
            assert!(case.target_ns.is_some(), "{ctx}: issue 15 sets a target for every kind");
        }
        assert_eq!(report.programs.len(), 3);
        let markdown = report.markdown();
        for case in &report.cases {
            assert!(markdown.contains(&case.label), "{} not in\n{markdown}", case.label);
        }
        // Every IPv6 case has its IPv4 twin's row in the side-by-side table.
        let side_by_side = markdown.split("IPv4 and IPv6 side by side").nth(1).expect("the table");
        for case in report.cases.iter().filter(|c| c.family == Family::Ipv6) {
            let twin = case.label.trim_end_matches(", IPv6");
            assert!(
                side_by_side.contains(&format!("| {} | {twin} |", case.program)),
                "{twin}: {side_by_side}"
            );
        }
        serde_json::to_string(&report).expect("the report serialises");
    }

    /// Two objects side by side (here the same one twice): a report each,
    /// the same cases in the same order, and a table comparing them.
    #[test]
    fn compare_reports_each_object() {
        if !testbed::privileged::require_root("compare_reports_each_object") {
            return;
        }
        let bytes = proxy_userspace::mode::ebpf::object_bytes().expect("the object is built in");
        let path = std::env::temp_dir().join(format!("xproxy-bench-object-{}.o", std::process::id()));
        std::fs::write(&path, bytes).expect("writing the object");
        let options = Options {
            calls: 5,
            rounds: 2,
            working_set: 50,
        };
        let result = compare(&[path.clone(), path.clone()], &options, &|_| {});
        std::fs::remove_file(&path).expect("removing the object");
        let reports = result.expect("compare");
        assert_eq!(reports.len(), 2);
        let labels = |r: &Report| r.cases.iter().map(|c| c.label.clone()).collect::<Vec<_>>();
        assert_eq!(labels(&reports[0]), labels(&reports[1]));
        assert_eq!(reports[0].object, path.display().to_string());
        assert!(reports.iter().all(|r| r.cases.iter().all(|c| c.rounds.len() == 2)));
        let table = comparison_markdown(&reports);
        for case in &reports[0].cases {
            assert!(
                table.contains(&format!("| {} | {} |", case.program, case.label)),
                "{table}"
            );
        }
    }

    /// The maps of a loaded data path, as created: conntrack preallocated
    /// in full, the others growing with what they hold.
    #[test]
    fn map_memory_lists_every_map() {
        if !testbed::privileged::require_root("map_memory_lists_every_map") {
            return;
        }
        let object = Object::from_env_or_builtin().expect("object");
        let bed = Bed::load(&object, SNAT_MARK, family::node_ips(), CONNTRACK_MAX).expect("load");
        let maps = map_memory(bed.pin_dir()).expect("map memory");
        let names: Vec<&str> = maps.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "XP_AFFINITY",
                "XP_AFFINITY6",
                "XP_BACKENDS6",
                "XP_BACKENDS_ARR",
                "XP_CT",
                "XP_CT6",
                "XP_CT_STATS",
                "XP_FRAGS",
                "XP_FRAGS6",
                "XP_MAGLEV",
                "XP_MEMBERS",
                "XP_NODE_ADDRS",
                "XP_NODE_ADDRS6",
                "XP_POD_CIDRS",
                "XP_POD_CIDRS6",
                "XP_POD_VETHS",
                "XP_PORTS",
                "XP_REV_NAT",
                "XP_SERVICES",
                "XP_SERVICES6",
                "XP_SLOT_CHUNKS",
                "XP_SOCK_CFG",
                "XP_SOCK_CFG6",
                "XP_SOCK_REV",
                "XP_SOCK_REV6",
                "XP_SRC_RANGES",
                "XP_SRC_RANGES6",
                "XP_STATS",
                "XP_SVC_PORTS"
            ]
        );
        let named = |name: &str| maps.iter().find(|m| m.name == name).expect("listed above");
        let ct = named("XP_CT");
        assert_eq!((ct.map_type.as_str(), ct.key_size, ct.value_size), ("lru_hash", 16, 24));
        assert_eq!(ct.max_entries, CONNTRACK_MAX);
        assert_eq!(ct.payload_bytes, 40 * u64::from(CONNTRACK_MAX));
        assert!(ct.memlock_bytes >= ct.payload_bytes, "{ct:?}");
        let services = named("XP_SERVICES");
        assert_eq!(services.map_flags & 1, 1, "XP_SERVICES is not preallocated");
        assert!(services.memlock_bytes < services.payload_bytes, "{services:?}");
    }
}

/// `cargo test -p xproxy-bench --release print_full_report -- --ignored --nocapture`
/// as root: the full measurement on its own, printed as markdown and JSON;
/// with `XPROXY_BENCH_COMPARE=a.o,b.o` a comparison of those objects.
#[cfg(test)]
mod full {
    #[test]
    #[ignore = "about a minute of measuring; run by hand"]
    fn print_full_report() {
        let number = |var: &str| std::env::var(var).ok().map(|v| v.parse().expect("a number"));
        let full = super::Options::full();
        let options = super::Options {
            calls: number("XPROXY_BENCH_CALLS").unwrap_or(full.calls),
            rounds: number("XPROXY_BENCH_ROUNDS").unwrap_or(full.rounds),
            working_set: full.working_set,
        };
        let progress = |m: &str| eprintln!("{m}");
        let reports = match std::env::var("XPROXY_BENCH_COMPARE") {
            Ok(list) => {
                let paths: Vec<std::path::PathBuf> = list.split(',').map(Into::into).collect();
                super::compare(&paths, &options, &progress).expect("compare")
            }
            Err(_) => vec![super::measure(&options, &progress).expect("measure")],
        };
        for report in &reports {
            println!("{}", report.markdown());
        }
        if reports.len() > 1 {
            println!("{}", super::comparison_markdown(&reports));
        }
        println!("{}", serde_json::to_string(&reports).expect("json"));
    }
}
