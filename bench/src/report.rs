//! The Markdown report: ratios first, then the targets and how far each
//! is, then the tables, the charts, the noise, the parameters.

use std::fmt::Write as _;

use crate::{
    latency::Latency,
    programming::Programming,
    results::{Baseline, BaselinePaths, ModeStatus, Results, Run, RunLatency, ScaleRun, ScaleSource},
    stats::{Summary, ratio},
};

/// The mode every ratio is about, and the ones it is compared with.
const SUBJECT: &str = "ebpf";
const OTHERS: [&str; 5] = ["iptables", "iptables-legacy", "nftables", "ipvs", "userspace"];

/// A chart to show: its title and its file name (next to the report).
pub struct Chart {
    pub title: String,
    pub file: String,
}

pub fn render(results: &Results, charts: &[Chart]) -> String {
    let mut out = String::new();
    header(&mut out, results);
    ratios(&mut out, results);
    targets_section(&mut out, results);
    tables(&mut out, results);
    charts_section(&mut out, charts);
    noise(&mut out, results);
    parameters(&mut out, results);
    out
}

// ---------------------------------------------------------------------------
// Formatting.

fn us(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// A difference in µs, with its sign.
fn signed_us(v: f64) -> String {
    if v < 0.0 {
        format!("−{}", us(-v))
    } else {
        format!("+{}", us(v))
    }
}

fn summary_us(s: &Summary) -> String {
    if s.rounds > 1 {
        format!("{} [{}–{}]", us(s.median), us(s.min), us(s.max))
    } else {
        us(s.median)
    }
}

/// A ratio with two significant digits at least: 1.52×, 0.048×, 0.00012×.
fn times(r: Option<f64>) -> String {
    match r {
        None => "–".into(),
        Some(r) => {
            let decimals = if r >= 0.1 || r <= 0.0 {
                2
            } else {
                (1.0 - r.log10().floor()).clamp(2.0, 8.0) as usize
            };
            format!("{r:.decimals$}×")
        }
    }
}

fn seconds(v: Option<f64>) -> String {
    match v {
        None => "–".into(),
        Some(v) if v < 1.0 => format!("{:.1} ms", v * 1e3),
        Some(v) => format!("{v:.2} s"),
    }
}

fn rate(s: &Summary) -> String {
    let k = |v: f64| format!("{:.1}k", v / 1e3);
    if s.rounds > 1 {
        format!("{} [{}–{}]", k(s.median), k(s.min), k(s.max))
    } else {
        k(s.median)
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
}

fn table(out: &mut String, head: &[&str], rows: &[Vec<String>]) {
    let _ = writeln!(out, "| {} |", head.join(" | "));
    let _ = writeln!(out, "|{}", head.iter().map(|_| "---|").collect::<String>());
    for row in rows {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
    out.push('\n');
}

// ---------------------------------------------------------------------------
// Accessors.

fn latency(run: &Run) -> Option<&RunLatency> {
    run.latency.as_ref()
}

fn connect_p50(l: &Latency) -> f64 {
    l.connect_p50_us.median
}

/// Delivered -> answering; `true` if only a lower bound (timed out).
fn programming_s(run: &Run) -> Option<(f64, bool)> {
    run.programming.as_ref().and_then(Programming::seconds)
}

/// `subject / other` programming time at `n`, with `<` or `>` where one
/// of them timed out and the ratio is a bound.
fn programming_ratio(r: &Results, other: &str, n: usize) -> String {
    let find = |mode: &str| {
        r.mode(mode)?
            .runs
            .iter()
            .find(|run| run.services == n && run.error.is_none())
            .and_then(programming_s)
    };
    match (find(SUBJECT), find(other)) {
        (Some((a, false)), Some((b, false))) => times(ratio(a, b)),
        (Some((a, false)), Some((b, true))) => format!("< {}", times(ratio(a, b))),
        (Some((a, true)), Some((b, false))) => format!("> {}", times(ratio(a, b))),
        _ => "–".into(),
    }
}

fn programming_cell(p: &Programming) -> String {
    match p.seconds() {
        Some((s, true)) => format!("> {} (not programmed in time)", seconds(Some(s))),
        Some((s, false)) => seconds(Some(s)),
        None => "–".into(),
    }
}

/// A scale run's programming: its median repeat's, with the spread of the
/// repeats when there were several.
fn scale_programming_cell(s: &ScaleRun) -> String {
    let Some(p) = &s.programming else {
        return "–".into();
    };
    let times: Vec<f64> = s
        .repeats
        .iter()
        .filter_map(Programming::seconds)
        .map(|(t, _)| t)
        .collect();
    if times.len() < 2 {
        return programming_cell(p);
    }
    let low = times.iter().copied().fold(f64::INFINITY, f64::min);
    let high = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(
        "{} (median of {}: {}–{})",
        programming_cell(p),
        times.len(),
        seconds(Some(low)),
        seconds(Some(high))
    )
}

/// The numbers of Services measured, ascending.
fn service_counts(results: &Results) -> Vec<usize> {
    let mut counts: Vec<usize> = results
        .modes
        .iter()
        .flat_map(|m| m.runs.iter().map(|r| r.services))
        .collect();
    counts.sort_unstable();
    counts.dedup();
    counts
}

fn ran_modes(results: &Results) -> Vec<&str> {
    results
        .modes
        .iter()
        .filter(|m| m.status == ModeStatus::Ran)
        .map(|m| m.mode.as_str())
        .collect()
}

fn run_of<'a>(results: &'a Results, mode: &str, services: usize) -> Option<&'a Run> {
    results.mode(mode)?.run(services)
}

/// `f(subject run) / f(other run)` at `services`.
fn mode_ratio(results: &Results, other: &str, services: usize, f: impl Fn(&Run) -> Option<f64>) -> Option<f64> {
    let a = f(run_of(results, SUBJECT, services)?)?;
    let b = f(run_of(results, other, services)?)?;
    ratio(a, b)
}

// ---------------------------------------------------------------------------
// Sections.

fn header(out: &mut String, r: &Results) {
    let m = &r.machine;
    let _ = writeln!(out, "# xproxy benchmark: {} on {}\n", m.date, m.host);
    let _ = writeln!(
        out,
        "Kernel {}, {} CPUs ({}), {:.1} GiB memory; commit `{}`{}; {}. \
         Every mode ran through the real agent (`xproxy run --mode MODE`) fed by the \
         test API server, on one machine, one mode after the other.\n",
        m.kernel,
        m.cpus,
        m.cpu_model,
        m.memory_bytes as f64 / f64::from(1u32 << 30),
        m.git_commit.get(..12).unwrap_or(&m.git_commit),
        if m.git_dirty { " (with uncommitted changes)" } else { "" },
        if r.parameters.quick {
            "a `--quick` run (a smoke test: few rounds, the numbers are indicative only)"
        } else {
            "a full run"
        },
    );
    if let Some(guest) = &m.guest {
        let _ = writeln!(
            out,
            "**Measured in a VM**: {guest}. Compare the modes of this report with each other; \
             its absolute numbers are not the host's.\n"
        );
    }
    let skipped: Vec<String> = r
        .modes
        .iter()
        .filter_map(|m| match &m.status {
            ModeStatus::Skipped { reason } => Some(format!("- **{}** skipped: {reason}", m.mode)),
            ModeStatus::Ran => None,
        })
        .collect();
    if !skipped.is_empty() {
        let _ = writeln!(out, "{}\n", skipped.join("\n"));
    }
    let notes: Vec<String> = r
        .modes
        .iter()
        .flat_map(|m| {
            m.runs.iter().filter_map(move |run| {
                Some(format!(
                    "- {} at {} Services: {}",
                    m.mode,
                    run.services,
                    run.note.as_ref()?
                ))
            })
        })
        .chain(r.scale.iter().filter_map(|s| {
            Some(format!(
                "- {} scale run at {} Services: {}",
                s.mode,
                s.services,
                s.note.as_ref()?
            ))
        }))
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(out, "{}\n", notes.join("\n"));
    }
    let errors = r.errors();
    if !errors.is_empty() {
        let _ = writeln!(out, "**Failed parts** (their numbers are missing below):\n");
        for e in errors {
            let first_line = e.lines().next().unwrap_or_default();
            let _ = writeln!(out, "- {first_line}");
        }
        out.push('\n');
    }
}

fn ratios(out: &mut String, r: &Results) {
    let _ = writeln!(out, "## Ratios\n");
    let _ = writeln!(
        out,
        "Latency and time: below 1× means {SUBJECT} is faster. Requests/s: above 1× means {SUBJECT} \
         serves more. All to the last Service programmed (the one a linear rule walk reaches last), \
         medians of the rounds.\n"
    );
    let counts = service_counts(r);
    let modes = ran_modes(r);
    for other in OTHERS.iter().filter(|o| modes.contains(o)) {
        if !modes.contains(&SUBJECT) {
            break;
        }
        let _ = writeln!(out, "### {SUBJECT} / {other}\n");
        let rows: Vec<Vec<String>> = counts
            .iter()
            .map(|&n| {
                let cell = |f: &dyn Fn(&Run) -> Option<f64>| times(mode_ratio(r, other, n, f));
                vec![
                    n.to_string(),
                    cell(&|run| latency(run).map(|l| connect_p50(&l.clusterip_last))),
                    cell(&|run| latency(run).map(|l| connect_p50(&l.nodeport_last))),
                    cell(&|run| latency(run).map(|l| l.clusterip_last.request_p50_us.median)),
                    programming_ratio(r, other, n),
                    cell(&|run| run.throughput.as_ref().map(|t| t.nodeport_short.requests_per_s.median)),
                    cell(&|run| {
                        run.throughput
                            .as_ref()
                            .map(|t| t.clusterip_keepalive.requests_per_s.median)
                    }),
                ]
            })
            .collect();
        table(
            out,
            &[
                "Services",
                "connect p50, ClusterIP",
                "connect p50, NodePort",
                "request p50, ClusterIP",
                "programming",
                "req/s NodePort, new conns",
                "req/s ClusterIP, keep-alive",
            ],
            &rows,
        );
    }

    let _ = writeln!(out, "### Last / first Service (connect p50, ClusterIP path)\n");
    let rows: Vec<Vec<String>> = counts
        .iter()
        .map(|&n| {
            std::iter::once(n.to_string())
                .chain(modes.iter().map(|mode| {
                    times(
                        run_of(r, mode, n)
                            .and_then(latency)
                            .and_then(|l| ratio(connect_p50(&l.clusterip_last), connect_p50(&l.clusterip_first))),
                    )
                }))
                .collect()
        })
        .collect();
    let head: Vec<&str> = std::iter::once("Services").chain(modes.iter().copied()).collect();
    table(out, &head, &rows);

    over_baseline_table(out, r, &counts, &modes, "the no-proxy baseline", |b| Some(&b.bare));
    if r.modes
        .iter()
        .any(|m| m.baseline.as_ref().is_some_and(|b| b.cni_masquerade.is_some()))
    {
        over_baseline_table(
            out,
            r,
            &counts,
            &modes,
            "no proxy on a node with a CNI's masquerade rule",
            |b| b.cni_masquerade.as_ref(),
        );
    }
}

/// Connect p50 to the last Service minus straight to a pod, per mode and N,
/// against the baseline `pick` chooses.
fn over_baseline_table(
    out: &mut String,
    r: &Results,
    counts: &[usize],
    modes: &[&str],
    what: &str,
    pick: fn(&Baseline) -> Option<&BaselinePaths>,
) {
    let _ = writeln!(
        out,
        "### Over {what} (connect p50 to the last Service minus straight to a pod, µs)\n"
    );
    let rows: Vec<Vec<String>> = counts
        .iter()
        .map(|&n| {
            std::iter::once(n.to_string())
                .chain(modes.iter().map(|mode| {
                    let (Some(run), Some(base)) = (
                        run_of(r, mode, n).and_then(latency),
                        r.mode(mode).and_then(|m| m.baseline.as_ref()).and_then(pick),
                    ) else {
                        return "–".into();
                    };
                    format!(
                        "{} / {}",
                        signed_us(connect_p50(&run.clusterip_last) - connect_p50(&base.clusterip_path)),
                        signed_us(connect_p50(&run.nodeport_last) - connect_p50(&base.nodeport_path)),
                    )
                }))
                .collect()
        })
        .collect();
    let head: Vec<String> = std::iter::once("Services".to_owned())
        .chain(modes.iter().map(|m| format!("{m} (ClusterIP / NodePort)")))
        .collect();
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    table(out, &head, &rows);
}

/// How a target stands.
#[derive(Clone, Debug, PartialEq)]
pub enum Standing {
    Met,
    /// Missed; by how much, in words.
    Missed(String),
    /// Not measured in this run; why.
    NotMeasured(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct TargetCheck {
    pub target: &'static str,
    pub measured: String,
    pub standing: Standing,
}

fn check(target: &'static str, measured: String, met: bool, missed_by: impl FnOnce() -> String) -> TargetCheck {
    TargetCheck {
        target,
        measured,
        standing: if met {
            Standing::Met
        } else {
            Standing::Missed(missed_by())
        },
    }
}

fn not_measured(target: &'static str, why: &str) -> TargetCheck {
    not_measured_owned(target, why.to_owned())
}

fn not_measured_owned(target: &'static str, why: String) -> TargetCheck {
    TargetCheck {
        target,
        measured: "–".into(),
        standing: Standing::NotMeasured(why),
    }
}

/// Whether the ClusterIP connect p50 to the last Service stays within 2 µs
/// of `base` at every N.
fn within_2us_of(target: &'static str, base: Option<&BaselinePaths>, runs: &[&RunLatency]) -> TargetCheck {
    let Some(base) = base.filter(|_| !runs.is_empty()) else {
        return not_measured(target, "no ebpf latency or baseline");
    };
    let added = runs
        .iter()
        .map(|l| connect_p50(&l.clusterip_last) - connect_p50(&base.clusterip_path))
        .fold(f64::NEG_INFINITY, f64::max);
    check(
        target,
        format!(
            "at most {} µs over {} µs (ClusterIP path, any N)",
            signed_us(added),
            us(connect_p50(&base.clusterip_path))
        ),
        added <= 2.0,
        || format!("{} µs over", us(added - 2.0)),
    )
}

/// The issue's targets, each against this run's numbers.
pub fn targets(r: &Results) -> Vec<TargetCheck> {
    let counts = service_counts(r);
    let ebpf = r.mode(SUBJECT);
    let run = |n: usize| ebpf.and_then(|m| m.run(n));
    let mut checks = Vec::new();

    // Connect p50 to the last of the largest N within 5% of the first of the smallest.
    const FLAT: &str = "ebpf connect p50 to the last of 20,000 Services within 5% of the first of 100";
    match (counts.first(), counts.last()) {
        (Some(&small), Some(&large)) if large > small => {
            match (run(small).and_then(latency), run(large).and_then(latency)) {
                (Some(a), Some(b)) => {
                    let (first, last) = (connect_p50(&a.clusterip_first), connect_p50(&b.clusterip_last));
                    let growth = last / first - 1.0;
                    let at = if large == 20_000 && small == 100 {
                        String::new()
                    } else {
                        format!(" (measured: last of {large} vs first of {small})")
                    };
                    // The direct connect (no Service) of the same two runs
                    // tells the lookup's share from the runs' drift.
                    let (direct_a, direct_b) = (connect_p50(&a.clusterip_direct), connect_p50(&b.clusterip_direct));
                    checks.push(check(
                        FLAT,
                        format!(
                            "{} µs vs {} µs: {:+.1}%{at}; straight to a pod in the same runs {} vs {} µs: {:+.1}%",
                            us(last),
                            us(first),
                            growth * 100.0,
                            us(direct_b),
                            us(direct_a),
                            (direct_b / direct_a - 1.0) * 100.0
                        ),
                        growth <= 0.05,
                        || format!("{:.1} points over", (growth - 0.05) * 100.0),
                    ));
                }
                _ => checks.push(not_measured(FLAT, "no ebpf latency at both ends")),
            }
        }
        _ => checks.push(not_measured(FLAT, "only one number of Services measured")),
    }

    // No higher than nftables at any N.
    const NFT: &str = "ebpf connect p50 no higher than nftables at any N";
    let pairs: Vec<(usize, f64, f64)> = counts
        .iter()
        .filter_map(|&n| {
            let a = run(n).and_then(latency)?;
            let b = run_of(r, "nftables", n).and_then(latency)?;
            Some((n, connect_p50(&a.clusterip_last), connect_p50(&b.clusterip_last)))
        })
        .collect();
    if pairs.is_empty() {
        checks.push(not_measured(NFT, "ebpf and nftables not both measured"));
    } else {
        let worse: Vec<String> = pairs
            .iter()
            .filter(|(_, e, n)| e > n)
            .map(|(count, e, n)| format!("{count}: {} > {} µs", us(*e), us(*n)))
            .collect();
        let measured = pairs
            .iter()
            .map(|(count, e, n)| format!("{count}: {}/{}", us(*e), us(*n)))
            .collect::<Vec<_>>()
            .join(", ");
        checks.push(check(
            NFT,
            format!("ebpf/nftables µs {measured}"),
            worse.is_empty(),
            || worse.join("; "),
        ));
    }

    // Within 2 µs of the no-proxy baseline: the bare node's, and a node's
    // with a CNI's masquerade rule (what a node in a cluster looks like).
    let base = ebpf.and_then(|m| m.baseline.as_ref());
    let runs: Vec<&RunLatency> = counts.iter().filter_map(|&n| run(n).and_then(latency)).collect();
    checks.push(within_2us_of(
        "ebpf connect p50 within 2 µs of the no-proxy baseline",
        base.map(|b| &b.bare),
        &runs,
    ));
    if let Some(cni) = base.and_then(|b| b.cni_masquerade.as_ref()) {
        checks.push(within_2us_of(
            "ebpf connect p50 within 2 µs of no proxy on a node with a CNI's masquerade rule",
            Some(cni),
            &runs,
        ));
    }

    // Programming at scale.
    let scale_from = |source: ScaleSource, services: usize, fixed: Option<usize>| {
        r.scale.iter().find(move |s| {
            s.mode == SUBJECT
                && s.source == source
                && s.services == services
                && s.error.is_none()
                && fixed.is_none_or(|e| s.endpoints == services * e)
        })
    };
    let scale = |services: usize, fixed: Option<usize>| scale_from(ScaleSource::Api, services, fixed);
    let within = |target: &'static str, run: Option<&ScaleRun>, limit: f64, missing: &str| match run
        .and_then(|run| Some((run, run.programming.as_ref()?.seconds()?)))
    {
        Some((run, (s, bound))) => check(target, scale_programming_cell(run), !bound && s <= limit, || {
            format!(
                "{}{} over",
                if bound { "more than " } else { "" },
                seconds(Some(s - limit))
            )
        }),
        None => not_measured(target, missing),
    };
    checks.push(within(
        "10,000 Services × 10 endpoints programmed in ≤ 0.25 s",
        scale(10_000, Some(10)),
        0.25,
        "no scale run at 10,000 × 10 (full runs do one)",
    ));
    checks.push(within(
        "100,000 Services programmed in ≤ 3 s",
        scale(100_000, None),
        3.0,
        "no scale run at 100,000 (full runs do one)",
    ));
    checks.push(manifests_target(scale_from(ScaleSource::Manifests, 10_000, Some(10))));

    // One endpoint change.
    const CHANGE: &str = "one endpoint change at 10,000 Services applied in ≤ 10 ms p99";
    let change = ebpf.and_then(|m| m.runs.iter().rev().find_map(|run| run.endpoint_change.as_ref()));
    match change {
        Some(c) => {
            let at = if c.services == 10_000 {
                String::new()
            } else {
                format!(" (at {} Services)", c.services)
            };
            checks.push(check(
                CHANGE,
                format!(
                    "p99 {:.2} ms, p50 {:.2} ms over {} changes{at}",
                    c.p99_ms, c.p50_ms, c.changes
                ),
                c.p99_ms <= 10.0,
                || format!("{:.2} ms over", c.p99_ms - 10.0),
            ));
        }
        None => checks.push(not_measured(CHANGE, "no endpoint changes measured")),
    }

    // Per packet.
    const PACKET: &str = "per packet, net: new flow ≤ 150 ns, established ≤ 40 ns, \
                          established among 1,000,000 flows ≤ 200 ns, no Service's ≤ 10 ns";
    match &r.per_packet {
        Some(p) if p.error.is_none() && !p.targets.is_empty() => {
            let worst = |kinds: &[&str]| {
                p.targets
                    .iter()
                    .filter(|t| kinds.contains(&t.kind.as_str()))
                    .map(|t| t.net_ns)
                    .fold(f64::NEG_INFINITY, f64::max)
            };
            let missed: Vec<String> = p
                .targets
                .iter()
                .filter(|t| !t.met())
                .map(|t| format!("{} {} {:.0} ns > {:.0}", t.program, t.label, t.net_ns, t.target_ns))
                .collect();
            checks.push(check(
                PACKET,
                format!(
                    "worst new flow {:.0} ns, established {:.0} ns, of a working set {:.0} ns, no Service's {:.0} ns",
                    worst(&["new_flow", "affinity_hit", "affinity_miss"]),
                    worst(&["established", "reply"]),
                    worst(&["established_working_set", "reply_working_set"]),
                    worst(&["miss", "miss_working_set", "backend_port_miss"]),
                ),
                missed.is_empty(),
                || missed.join("; "),
            ));
        }
        Some(p) => checks.push(not_measured(
            PACKET,
            p.error.as_deref().unwrap_or("no cases with targets"),
        )),
        None => checks.push(not_measured(PACKET, "not run")),
    }

    // Throughput, against iptables on either backend (the nft one is
    // `iptables`): a backend that did not program N Services in time
    // served none of them, which the check says rather than hides.
    const RPS: &str = "new-connection requests/s through NodePort at 10,000 Services ≥ 1.5× iptables";
    let n = if counts.contains(&10_000) {
        Some(10_000)
    } else {
        counts.last().copied()
    };
    checks.push(match n {
        Some(n) => rps_against_iptables(r, n, RPS),
        None => not_measured(RPS, "no numbers of Services"),
    });

    // Memory.
    const RSS: &str = "agent RSS ≤ 150 MiB at 10,000 × 10";
    match scale(10_000, Some(10)).and_then(|s| s.memory.as_ref()) {
        Some(m) => {
            let mib_used = m.agent_rss_bytes as f64 / (1024.0 * 1024.0);
            checks.push(check(
                RSS,
                format!("{mib_used:.1} MiB (peak {} MiB)", mib(m.agent_peak_rss_bytes)),
                mib_used <= 150.0,
                || format!("{:.1} MiB over", mib_used - 150.0),
            ));
        }
        None => checks.push(not_measured(RSS, "no scale run at 10,000 × 10 (full runs do one)")),
    }
    checks
}

/// ebpf's NodePort new-connection requests/s over each iptables backend's
/// at `n` Services.
fn rps_against_iptables(r: &Results, n: usize, target: &'static str) -> TargetCheck {
    let at = if n == 10_000 {
        String::new()
    } else {
        format!(" (at {n} Services)")
    };
    let (mut ratios, mut unprogrammed) = (Vec::new(), Vec::new());
    for backend in ["iptables", "iptables-legacy"] {
        let rps = |run: &Run| run.throughput.as_ref().map(|t| t.nodeport_short.requests_per_s.median);
        if let Some(x) = mode_ratio(r, backend, n, rps) {
            ratios.push((backend, x));
        } else if let Some(t) = run_of(r, backend, n)
            .and_then(|run| run.programming.as_ref())
            .and_then(|p| p.timed_out_after_s)
        {
            unprogrammed.push(format!("{backend} did not program {n} Services in {t:.0} s"));
        }
    }
    if ratios.is_empty() {
        let why = if unprogrammed.is_empty() {
            "no throughput of both ebpf and iptables".to_owned()
        } else {
            unprogrammed.join("; ")
        };
        return not_measured_owned(target, why);
    }
    let measured: Vec<String> = ratios
        .iter()
        .map(|(backend, x)| format!("{backend} {x:.2}×"))
        .chain(unprogrammed)
        .collect();
    let short: Vec<String> = ratios
        .iter()
        .filter(|(_, x)| *x < 1.5)
        .map(|(backend, x)| format!("{backend}: {:.2}× short", 1.5 - x))
        .collect();
    check(target, format!("{}{at}", measured.join("; ")), short.is_empty(), || {
        short.join("; ")
    })
}

/// 10,000 Services x 10 endpoints from a manifest directory: answering
/// within 1 s of the agent's start, with the agent at most 150 MiB.
fn manifests_target(run: Option<&ScaleRun>) -> TargetCheck {
    const TARGET: &str =
        "10,000 Services × 10 endpoints from YAML manifests: answering ≤ 1 s from agent start, RSS ≤ 150 MiB";
    let Some((p, m)) = run.and_then(|s| Some((s.programming.as_ref()?, s.memory.as_ref()?))) else {
        return not_measured(TARGET, "no manifests scale run (full runs do one)");
    };
    let rss = m.agent_rss_bytes as f64 / (1024.0 * 1024.0);
    let start = p.start_to_answer_s;
    let answered = p.timed_out_after_s.is_none();
    check(
        TARGET,
        format!(
            "{} from start (read -> answering {}), {rss:.1} MiB (peak {} MiB)",
            seconds(Some(start)),
            programming_cell(p),
            mib(m.agent_peak_rss_bytes)
        ),
        answered && start <= 1.0 && rss <= 150.0,
        || {
            let mut over = Vec::new();
            if !answered || start > 1.0 {
                over.push(format!("{} over", seconds(Some(start - 1.0))));
            }
            if rss > 150.0 {
                over.push(format!("{:.1} MiB over", rss - 150.0));
            }
            over.join(", ")
        },
    )
}

/// A scale run's row label: the mode, and the source when not the API.
fn scale_label(s: &ScaleRun) -> String {
    match s.source {
        ScaleSource::Api => format!("{} (scale run)", s.mode),
        ScaleSource::Manifests => format!("{} (scale run, manifests)", s.mode),
    }
}

fn targets_section(out: &mut String, r: &Results) {
    let _ = writeln!(out, "## Targets\n");
    let rows: Vec<Vec<String>> = targets(r)
        .into_iter()
        .map(|c| {
            let standing = match c.standing {
                Standing::Met => "met".to_owned(),
                Standing::Missed(by) => format!("**missed**: {by}"),
                Standing::NotMeasured(why) => format!("not measured: {why}"),
            };
            vec![c.target.to_owned(), c.measured, standing]
        })
        .collect();
    table(out, &["Target", "Measured", "Standing"], &rows);
}

fn latency_cell(l: &Latency, pick: fn(&Latency) -> (&Summary, &Summary)) -> String {
    let (p50, p99) = pick(l);
    format!("{} / {}", summary_us(p50), us(p99.median))
}

fn latency_table(out: &mut String, r: &Results, title: &str, pick: fn(&Latency) -> (&Summary, &Summary)) {
    let _ = writeln!(out, "### {title}, µs: p50 [min–max over rounds] / p99\n");
    let mut rows = Vec::new();
    for m in r.modes.iter().filter(|m| m.status == ModeStatus::Ran) {
        if let Some(b) = &m.baseline {
            let settings = [(Some(&b.bare), ""), (b.cni_masquerade.as_ref(), ", CNI masquerade")];
            for (paths, setting) in settings {
                let Some(paths) = paths else { continue };
                rows.push(vec![
                    format!("no proxy{setting} (before {})", m.mode),
                    "–".into(),
                    latency_cell(&paths.clusterip_path, pick),
                    "".into(),
                    latency_cell(&paths.nodeport_path, pick),
                    "".into(),
                ]);
            }
        }
        for run in &m.runs {
            let Some(l) = latency(run) else { continue };
            rows.push(vec![
                m.mode.clone(),
                run.services.to_string(),
                format!(
                    "{} <br> direct {}",
                    latency_cell(&l.clusterip_first, pick),
                    summary_us(pick(&l.clusterip_direct).0)
                ),
                latency_cell(&l.clusterip_last, pick),
                format!(
                    "{} <br> direct {}",
                    latency_cell(&l.nodeport_first, pick),
                    summary_us(pick(&l.nodeport_direct).0)
                ),
                latency_cell(&l.nodeport_last, pick),
            ]);
            if let Some(v6) = &l.ipv6 {
                rows.push(vec![
                    format!("{}, IPv6", m.mode),
                    run.services.to_string(),
                    "–".into(),
                    latency_cell(&v6.clusterip, pick),
                    "–".into(),
                    latency_cell(&v6.nodeport, pick),
                ]);
            }
        }
    }
    table(
        out,
        &[
            "Mode",
            "Services",
            "ClusterIP, first",
            "ClusterIP, last",
            "NodePort, first",
            "NodePort, last",
        ],
        &rows,
    );
}

fn tables(out: &mut String, r: &Results) {
    let _ = writeln!(out, "## Tables\n");
    let _ = writeln!(
        out,
        "\"no proxy\" is straight to a pod's address before any agent ran, on the bare node; \
         \"no proxy, CNI masquerade\" is the same with a CNI's masquerade rule in the node's nat \
         table (flannel, Calico's natOutgoing and kindnet install one; it rewrites none of these \
         flows, but makes the kernel track every one), rounds of the two alternating. The modes \
         run on the bare node. \"direct\" is the same \
         with the mode in place (what the mode costs traffic that is no Service's). The \
         \"IPv6\" row under a mode's row is the same last Service over IPv6 (it is dual-stack: an \
         IPv6 ClusterIP and the node's IPv6 address with its NodePort, the same pods' IPv6 addresses \
         as endpoints), from the same clients, in the same interleaved rounds; first and direct are \
         not measured over IPv6.\n"
    );
    latency_table(out, r, "Connect latency (socket + connect)", |l| {
        (&l.connect_p50_us, &l.connect_p99_us)
    });
    latency_table(out, r, "Request latency (connect, a line out, the answer back)", |l| {
        (&l.request_p50_us, &l.request_p99_us)
    });
    program_time_table(out, r);

    let _ = writeln!(out, "### Programming time\n");
    let _ = writeln!(
        out,
        "From the source delivering the Services (the agent's list complete, from its log) to the \
         last one answering; the agent's own sync time; and from starting the agent.\n"
    );
    let mut rows = Vec::new();
    for m in r.modes.iter().filter(|m| m.status == ModeStatus::Ran) {
        for run in &m.runs {
            let Some(p) = &run.programming else { continue };
            rows.push(vec![
                m.mode.clone(),
                run.services.to_string(),
                run.endpoints.to_string(),
                programming_cell(p),
                seconds(p.sync_s),
                seconds(Some(p.start_to_answer_s)),
            ]);
        }
    }
    for s in &r.scale {
        let Some(p) = &s.programming else { continue };
        rows.push(vec![
            scale_label(s),
            s.services.to_string(),
            s.endpoints.to_string(),
            scale_programming_cell(s),
            seconds(p.sync_s),
            seconds(Some(p.start_to_answer_s)),
        ]);
    }
    table(
        out,
        &[
            "Mode",
            "Services",
            "Endpoints",
            "delivered → answering",
            "agent's sync",
            "start → answering",
        ],
        &rows,
    );

    let changes: Vec<Vec<String>> = r
        .modes
        .iter()
        .flat_map(|m| {
            m.runs.iter().filter_map(move |run| {
                let c = run.endpoint_change.as_ref()?;
                Some(vec![
                    m.mode.clone(),
                    c.services.to_string(),
                    c.changes.to_string(),
                    format!("{:.2}", c.p50_ms),
                    format!("{:.2}", c.p99_ms),
                    format!("{:.2}–{:.2}", c.min_ms, c.max_ms),
                ])
            })
        })
        .collect();
    if !changes.is_empty() {
        let _ = writeln!(
            out,
            "### One endpoint change (API write → new connections reach the new pod), ms\n"
        );
        table(out, &["Mode", "Services", "Changes", "p50", "p99", "min–max"], &changes);
    }

    throughput_table(out, r);
    memory_table(out, r);

    if let Some(p) = &r.per_packet {
        let _ = writeln!(out, "### Per packet (BPF_PROG_TEST_RUN)\n");
        match &p.error {
            Some(e) => {
                let _ = writeln!(out, "Not measured: {e}\n");
            }
            None => {
                let _ = writeln!(out, "{}\n", p.markdown.trim_end());
            }
        }
    }
}

/// The programs' share of a request (issue 15 item 3: where a connection's
/// microseconds go), for the modes that have programs.
fn program_time_table(out: &mut String, r: &Results) {
    let mut rows = Vec::new();
    for m in r.modes.iter().filter(|m| m.status == ModeStatus::Ran) {
        for run in &m.runs {
            for t in run.program_time.iter().flatten() {
                let programs = t
                    .programs
                    .iter()
                    .map(|p| format!("{} {:.1} × {:.0} ns", p.program, p.runs_per_request, p.ns_per_run))
                    .collect::<Vec<_>>()
                    .join(", ");
                rows.push(vec![
                    m.mode.clone(),
                    run.services.to_string(),
                    t.target.clone(),
                    format!("{:.2}", t.us_per_request),
                    programs,
                ]);
            }
        }
    }
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "### The programs' time per request (BPF run-time statistics)\n");
    let _ = writeln!(
        out,
        "One more round of requests per target after the timed ones, with the kernel's BPF \
         statistics on (`BPF_ENABLE_STATS`; they add two clock reads per run, so this round is \
         not timed): every run of the agent's programs over the round, per request (connect, a \
         line each way, close), as runs per request × ns per run. Set against the request \
         latency's distance from the no-proxy baseline, it says how much of that the programs \
         themselves are.\n"
    );
    table(
        out,
        &["Mode", "Services", "Target", "µs per request", "runs × ns per run"],
        &rows,
    );
}

fn throughput_table(out: &mut String, r: &Results) {
    let rows: Vec<Vec<String>> = r
        .modes
        .iter()
        .flat_map(|m| {
            m.runs.iter().filter_map(move |run| {
                let t = run.throughput.as_ref()?;
                let errors = t.nodeport_short.errors
                    + t.nodeport_keepalive.errors
                    + t.clusterip_short.errors
                    + t.clusterip_keepalive.errors;
                Some(vec![
                    m.mode.clone(),
                    run.services.to_string(),
                    rate(&t.nodeport_short.requests_per_s),
                    rate(&t.nodeport_keepalive.requests_per_s),
                    rate(&t.clusterip_short.requests_per_s),
                    rate(&t.clusterip_keepalive.requests_per_s),
                    errors.to_string(),
                ])
            })
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "### Throughput (wrk), requests/s to the last Service\n");
    table(
        out,
        &[
            "Mode",
            "Services",
            "NodePort, new conns",
            "NodePort, keep-alive",
            "ClusterIP, new conns",
            "ClusterIP, keep-alive",
            "errors",
        ],
        &rows,
    );
}

fn memory_table(out: &mut String, r: &Results) {
    let mut rows = Vec::new();
    for m in r.modes.iter().filter(|m| m.status == ModeStatus::Ran) {
        let measured: Vec<&Run> = m.runs.iter().filter(|run| run.memory.is_some()).collect();
        for run in &measured {
            let Some(mem) = &run.memory else { continue };
            rows.push(vec![
                m.mode.clone(),
                run.services.to_string(),
                run.endpoints.to_string(),
                mib(mem.agent_rss_bytes),
                mib(mem.agent_peak_rss_bytes),
                mib(mem.bpf_map_bytes()),
            ]);
        }
        // Bytes per Service and per backend: the growth between the
        // smallest and the largest run.
        if let (Some(a), Some(b)) = (measured.first(), measured.last())
            && b.services > a.services
            && let (Some(ma), Some(mb)) = (&a.memory, &b.memory)
        {
            let rss = mb.agent_rss_bytes as f64 - ma.agent_rss_bytes as f64;
            let maps = mb.bpf_map_bytes() as f64 - ma.bpf_map_bytes() as f64;
            let per = |total: f64, n: usize| format!("{:.0}", total / n as f64);
            rows.push(vec![
                format!("{} growth per Service / per backend, bytes", m.mode),
                format!("{}→{}", a.services, b.services),
                format!("{}→{}", a.endpoints, b.endpoints),
                format!(
                    "{} / {}",
                    per(rss, b.services - a.services),
                    per(rss, b.endpoints.saturating_sub(a.endpoints).max(1))
                ),
                "".into(),
                format!(
                    "{} / {}",
                    per(maps, b.services - a.services),
                    per(maps, b.endpoints.saturating_sub(a.endpoints).max(1))
                ),
            ]);
        }
    }
    for s in &r.scale {
        let Some(mem) = &s.memory else { continue };
        rows.push(vec![
            scale_label(s),
            s.services.to_string(),
            s.endpoints.to_string(),
            mib(mem.agent_rss_bytes),
            mib(mem.agent_peak_rss_bytes),
            mib(mem.bpf_map_bytes()),
        ]);
    }
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "### Memory, MiB\n");
    let _ = writeln!(
        out,
        "Agent RSS after the measurements (peak: VmHWM); BPF maps: what the kernel charges for the \
         maps the agent pinned (ebpf only; the kernel modes' rules are kernel memory not counted here).\n"
    );
    table(
        out,
        &["Mode", "Services", "Endpoints", "agent RSS", "agent peak", "BPF maps"],
        &rows,
    );
}

fn charts_section(out: &mut String, charts: &[Chart]) {
    if charts.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Charts\n");
    for c in charts {
        let _ = writeln!(out, "![{}]({})\n", c.title, c.file);
    }
}

fn noise(out: &mut String, r: &Results) {
    let _ = writeln!(out, "## Noise\n");
    let mut widest: Option<(f64, String)> = None;
    for m in &r.modes {
        for run in &m.runs {
            let Some(l) = latency(run) else { continue };
            for (what, s) in [
                ("ClusterIP first", &l.clusterip_first.connect_p50_us),
                ("ClusterIP last", &l.clusterip_last.connect_p50_us),
                ("NodePort first", &l.nodeport_first.connect_p50_us),
                ("NodePort last", &l.nodeport_last.connect_p50_us),
            ] {
                let spread = s.spread();
                if widest.as_ref().is_none_or(|(w, _)| spread > *w) {
                    widest = Some((spread, format!("{} at {} Services, {what}", m.mode, run.services)));
                }
            }
        }
    }
    let _ = writeln!(
        out,
        "Every latency is the median over {} rounds of {} sequential connections, with the \
         rounds' min–max in brackets; rounds of all targets are interleaved, so a slow moment \
         of the machine falls on all of them. Requests/s are over {} wrk run(s) per cell.",
        r.parameters.latency_rounds,
        r.parameters.latency_connections,
        r.parameters.wrk.as_ref().map_or(0, |w| w.rounds),
    );
    if let Some((spread, where_)) = widest {
        let _ = writeln!(
            out,
            "The widest spread of a connect p50 in this run is {:.0}% of its median ({where_}).",
            spread * 100.0
        );
    }
    let _ = writeln!(
        out,
        "The machine has {} CPUs shared by the client, the node's kernel path, the pods' server \
         and the agent; anything else running at the time shows up here.\n",
        r.machine.cpus
    );
}

fn parameters(out: &mut String, r: &Results) {
    let p = &r.parameters;
    let _ = writeln!(out, "## Parameters\n");
    let _ = writeln!(
        out,
        "- Services: {:?}, each with {}..={} endpoints (seed {:#x}) on {} backend pods, every \
         {}th a NodePort (and the last); one more Service for the endpoint changes.",
        p.services, p.endpoints_per_service.0, p.endpoints_per_service.1, p.seed, p.backend_pods, p.node_port_every
    );
    let _ = writeln!(
        out,
        "- Latency: {} rounds × {} connections per target; endpoint changes: {} at {} Services; \
         programming probes wait {} ms for an answer.",
        p.latency_rounds, p.latency_connections, p.endpoint_changes, p.endpoint_change_services, p.probe_timeout_ms
    );
    match &p.wrk {
        Some(w) => {
            let _ = writeln!(
                out,
                "- wrk: {} thread(s), {} connections, {} s × {} round(s) per cell.",
                w.threads, w.connections, w.duration_s, w.rounds
            );
        }
        None => {
            let _ = writeln!(out, "- wrk: not installed, no throughput measured.");
        }
    }
    let _ = writeln!(out, "- The pods' server: {} threads.", p.server_threads);
    let backends: Vec<String> = crate::agent::IPTABLES_BACKENDS
        .iter()
        .map(|(mode, backend)| format!("`{mode}` on the {backend} backend (`iptables-{backend}-restore`)"))
        .collect();
    let _ = writeln!(
        out,
        "- The iptables mode runs twice: {} (kube-proxy uses whichever backend the node's rules use).",
        backends.join(", ")
    );
    for (path, meaning) in &p.paths {
        let _ = writeln!(out, "- {path}: {meaning}");
    }
    let _ = writeln!(out, "- The agent's configuration:\n\n```yaml\n{}```\n", p.agent_config);
    if !r.timings.is_empty() {
        let _ = writeln!(out, "### How long each part took\n");
        let rows: Vec<Vec<String>> = r
            .timings
            .iter()
            .map(|t| vec![t.part.clone(), format!("{:.1} s", t.seconds)])
            .collect();
        table(out, &["Part", "Time"], &rows);
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::fixture;

    #[test]
    fn ratios_come_first_and_read_right() {
        let results = fixture::results();
        let text = render(&results, &[]);
        let ratios = text.find("## Ratios").expect("a ratios section");
        let tables = text.find("## Tables").expect("tables");
        assert!(ratios < tables);
        assert!(text.find("## Targets").expect("targets") < tables);
        // ebpf 20 µs vs iptables 40 µs to the last of 1,000: 0.50×.
        assert!(text.contains("| 1000 | 0.50× |"), "{text}");
        // Last / first: ebpf 20/20, iptables 40/25.
        assert!(text.contains("| 1000 | 1.00× | 1.60× |"), "{text}");
        // Over the baseline (15 µs on the ClusterIP path), and over the
        // node with a CNI's masquerade rule (18.5 µs).
        assert!(text.contains("+5.0 / +"), "{text}");
        assert!(
            text.contains("### Over no proxy on a node with a CNI's masquerade rule"),
            "{text}"
        );
        assert!(text.contains("+1.5 / +"), "{text}");
        assert!(text.contains("| no proxy, CNI masquerade (before ebpf) |"), "{text}");
        assert!(text.contains("- **ipvs** skipped: no IPVS in this kernel"), "{text}");
    }

    #[test]
    fn targets_say_how_far() {
        let results = fixture::results();
        let checks = targets(&results);
        let by_name = |prefix: &str| {
            checks
                .iter()
                .find(|c| c.target.starts_with(prefix))
                .unwrap_or_else(|| panic!("no target {prefix}"))
                .clone()
        };
        // 20 µs at 100 first and 20 µs at 1,000 last: flat.
        let flat = by_name("ebpf connect p50 to the last");
        assert_eq!(flat.standing, Standing::Met);
        assert!(
            flat.measured
                .ends_with("straight to a pod in the same runs 15.0 vs 15.0 µs: +0.0%"),
            "{}",
            flat.measured
        );
        assert_eq!(
            by_name("ebpf connect p50 no higher").standing,
            Standing::Missed("100: 20.0 > 19.0 µs".into())
        );
        // 5 µs over the baseline: missed by 3 µs.
        assert_eq!(
            by_name("ebpf connect p50 within 2 µs of the no-proxy").standing,
            Standing::Missed("3.0 µs over".into())
        );
        // 1.5 µs over the node with a CNI's rule.
        assert_eq!(
            by_name("ebpf connect p50 within 2 µs of no proxy on a node").standing,
            Standing::Met
        );
        assert_eq!(by_name("one endpoint change").standing, Standing::Met);
        assert!(matches!(by_name("10,000 Services").standing, Standing::NotMeasured(_)));
        // 30k vs 10k req/s: 3×.
        let rps = by_name("new-connection requests/s");
        assert_eq!(rps.standing, Standing::Met);
        assert!(rps.measured.starts_with("iptables 3.00×"), "{}", rps.measured);
    }

    /// iptables on the nft backend did not program the Services in time:
    /// the legacy backend's ratio stands, and the check says so.
    #[test]
    fn requests_per_s_against_either_iptables_backend() {
        let mut results = fixture::results();
        let iptables = results
            .modes
            .iter_mut()
            .find(|m| m.mode == "iptables")
            .expect("iptables");
        let mut legacy = iptables.clone();
        legacy.mode = "iptables-legacy".into();
        iptables.runs[1] = fixture::timed_out(1000);
        results.modes.push(legacy);
        let rps = rps_against_iptables(&results, 1000, "rps");
        assert_eq!(rps.standing, Standing::Met);
        assert_eq!(
            rps.measured,
            "iptables-legacy 3.00×; iptables did not program 1000 Services in 120 s (at 1000 Services)"
        );
        results.modes.retain(|m| m.mode != "iptables-legacy");
        let rps = rps_against_iptables(&results, 1000, "rps");
        assert_eq!(
            rps.standing,
            Standing::NotMeasured("iptables did not program 1000 Services in 120 s".into())
        );
    }

    fn scale_run(source: ScaleSource, start_s: f64, rss_mib: u64) -> ScaleRun {
        ScaleRun {
            mode: "ebpf".into(),
            source,
            services: 10_000,
            endpoints: 100_000,
            programming: Some(Programming {
                delivered_to_answer_s: Some(0.2),
                start_to_answer_s: start_s,
                sync_s: Some(0.2),
                timed_out_after_s: None,
            }),
            repeats: Vec::new(),
            memory: Some(crate::memory::Memory {
                agent_rss_bytes: rss_mib << 20,
                agent_peak_rss_bytes: rss_mib << 20,
                bpf_maps: Vec::new(),
            }),
            note: None,
            error: None,
        }
    }

    #[test]
    fn the_manifests_target_reads_the_manifests_run_only() {
        const TARGET: &str = "10,000 Services × 10 endpoints from YAML";
        let standing = |results: &Results| {
            targets(results)
                .into_iter()
                .find(|c| c.target.starts_with(TARGET))
                .expect("the manifests target")
                .standing
        };
        let mut results = fixture::results();
        results.scale = vec![scale_run(ScaleSource::Api, 0.4, 100)];
        assert!(matches!(standing(&results), Standing::NotMeasured(_)));
        assert_eq!(
            by_prefix(&targets(&results), "10,000 Services × 10 endpoints programmed").standing,
            Standing::Met,
            "the API run is the one the programming target reads"
        );
        results.scale.push(scale_run(ScaleSource::Manifests, 0.8, 120));
        assert_eq!(standing(&results), Standing::Met);
        results.scale[1] = scale_run(ScaleSource::Manifests, 1.5, 160);
        assert_eq!(
            standing(&results),
            Standing::Missed("500.0 ms over, 10.0 MiB over".into())
        );
        let text = render(&results, &[]);
        assert!(text.contains("| ebpf (scale run, manifests) | 10000 |"), "{text}");
    }

    #[test]
    fn the_programming_target_reads_the_median_of_the_repeats() {
        let took = |s: f64| Programming {
            delivered_to_answer_s: Some(s),
            start_to_answer_s: 1.0,
            sync_s: Some(s - 0.05),
            timed_out_after_s: None,
        };
        let mut run = scale_run(ScaleSource::Api, 0.4, 100);
        run.repeats = vec![took(0.31), took(0.22), took(0.24)];
        run.programming = crate::programming::median(&run.repeats);
        let mut results = fixture::results();
        results.scale = vec![run];
        let check = by_prefix(&targets(&results), "10,000 Services × 10 endpoints programmed");
        assert_eq!(check.standing, Standing::Met, "the median, 240 ms, not the slowest");
        assert_eq!(check.measured, "240.0 ms (median of 3: 220.0 ms–310.0 ms)");
        assert!(render(&results, &[]).contains("240.0 ms (median of 3: 220.0 ms–310.0 ms)"));
    }

    fn by_prefix(checks: &[TargetCheck], prefix: &str) -> TargetCheck {
        checks
            .iter()
            .find(|c| c.target.starts_with(prefix))
            .unwrap_or_else(|| panic!("no target {prefix}"))
            .clone()
    }

    #[test]
    fn a_mode_that_did_not_program_in_time() {
        let text = render(&fixture::results(), &[]);
        assert!(text.contains("> 120.00 s (not programmed in time)"), "{text}");
        // ebpf programmed 1,000 in 12 ms: less than 0.0001× of nftables' > 120 s.
        assert!(text.contains("| 1000 | – | – | – | < 0.00010× |"), "{text}");
        assert_eq!(times(Some(0.048)), "0.048×");
        assert_eq!(times(Some(1.5)), "1.50×");
    }

    #[test]
    fn renders_tables_charts_and_noise() {
        let results = fixture::results();
        let charts = [Chart {
            title: "Connect latency".into(),
            file: "x-latency.svg".into(),
        }];
        let text = render(&results, &charts);
        assert!(text.contains("![Connect latency](x-latency.svg)"));
        assert!(text.contains("| ebpf | 1000 | "), "{text}");
        assert!(text.contains("20.0 [19.0–22.0] / 30.0"), "{text}");
        assert!(text.contains("### Throughput (wrk)"));
        assert!(text.contains("30.0k"));
        assert!(text.contains("widest spread"));
        assert!(text.contains("### One endpoint change"));
        assert!(
            text.contains("| ebpf | 1000 | ClusterIP, last | 1.25 | tc_ingress 5.0 × 250 ns |"),
            "{text}"
        );
    }
}
