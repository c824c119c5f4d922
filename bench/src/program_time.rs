//! Where a connection's microseconds go in the programs (issue 15 item 3):
//! one extra round of requests per target with the kernel's BPF run-time
//! statistics on (`BPF_ENABLE_STATS`), and each of the agent's programs'
//! run count and run time over the round, per request.
//!
//! The statistics cost two clock reads per program run while they are on,
//! so the round is separate from the timed ones and its latencies are not
//! reported. A mode that loads none of the programs measures nothing here.

use std::{collections::BTreeMap, net::SocketAddr};

use anyhow::{Context, Result, ensure};
use aya::{
    programs::loaded_programs,
    sys::{Stats, enable_stats},
};
use proxy_common::{maps, socket_lb};
use serde::{Deserialize, Serialize};
use testbed::netns::Netns;

use crate::latency::{self, Target};

/// One program's share of a round's requests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgramShare {
    /// The program's name (as the kernel keeps it, 15 characters at most).
    pub program: String,
    /// Runs per request (every interface it is attached to counted).
    pub runs_per_request: f64,
    /// Nanoseconds per run, the kernel's clock around the program.
    pub ns_per_run: f64,
}

/// What the programs cost the requests to one target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetProgramTime {
    /// Which target (`ClusterIP, last`, ...).
    pub target: String,
    pub requests: usize,
    /// Every program's time per request, summed, in microseconds.
    pub us_per_request: f64,
    /// The programs that ran, busiest first.
    pub programs: Vec<ProgramShare>,
}

/// The names of the programs the ebpf mode loads.
fn agent_programs() -> impl Iterator<Item = &'static str> {
    [maps::PROG_XDP_UPLINK, maps::PROG_TC_INGRESS, maps::PROG_TC_EGRESS]
        .into_iter()
        .chain(socket_lb::PROGRAMS)
}

/// Run count and run time (ns) of each loaded program of the agent's, by
/// name (summed if two are loaded under one name).
fn snapshot() -> Result<BTreeMap<String, (u64, u64)>> {
    let wanted: Vec<&str> = agent_programs().collect();
    let mut out = BTreeMap::new();
    for info in loaded_programs() {
        let info = info.context("reading a loaded program's info")?;
        let Some(name) = info.name_as_str() else { continue };
        if wanted.contains(&name) {
            let entry = out.entry(name.to_owned()).or_insert((0u64, 0u64));
            entry.0 += info.run_count();
            entry.1 += u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX);
        }
    }
    Ok(out)
}

/// Each program's runs and time between two snapshots, per request;
/// programs that did not run are left out.
fn shares(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
    requests: usize,
) -> Vec<ProgramShare> {
    let mut out: Vec<ProgramShare> = after
        .iter()
        .filter_map(|(name, &(runs, ns))| {
            let (runs0, ns0) = before.get(name).copied().unwrap_or_default();
            let (runs, ns) = (runs.saturating_sub(runs0), ns.saturating_sub(ns0));
            (runs > 0).then(|| ProgramShare {
                program: name.clone(),
                runs_per_request: runs as f64 / requests as f64,
                ns_per_run: ns as f64 / runs as f64,
            })
        })
        .collect();
    out.sort_by(|a, b| (b.runs_per_request * b.ns_per_run).total_cmp(&(a.runs_per_request * a.ns_per_run)));
    out
}

/// `requests` requests from each `(label, namespace, address)` in turn,
/// with the statistics on; `None` if none of the agent's programs is loaded
/// or none ran (the mode has none).
pub fn measure(targets: &[(&str, &Netns, SocketAddr)], requests: usize) -> Result<Option<Vec<TargetProgramTime>>> {
    if snapshot()?.is_empty() {
        return Ok(None);
    }
    // Held until the end of the round: the kernel counts while it is open.
    let _stats = enable_stats(Stats::RunTime).context("BPF_ENABLE_STATS")?;
    let mut out = Vec::with_capacity(targets.len());
    for (slot, (label, ns, addr)) in targets.iter().enumerate() {
        // The top share of the local ports, away from the timed rounds'.
        let mut target = Target::new(*addr, targets.len() * 2 - 1 - slot, targets.len() * 2);
        let before = snapshot()?;
        let round = latency::round(ns, &mut target, requests)?;
        let after = snapshot()?;
        ensure!(
            round.failures == 0,
            "{label}: {} of {requests} requests failed, first: {}",
            round.failures,
            round.first_failure.unwrap_or_default()
        );
        let programs = shares(&before, &after, requests);
        out.push(TargetProgramTime {
            target: (*label).to_owned(),
            requests,
            us_per_request: programs.iter().map(|p| p.runs_per_request * p.ns_per_run).sum::<f64>() / 1e3,
            programs,
        });
    }
    // Programs left loaded by another mode's agent run nothing here.
    Ok(out.iter().any(|t| !t.programs.is_empty()).then_some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(entries: &[(&str, u64, u64)]) -> BTreeMap<String, (u64, u64)> {
        entries.iter().map(|(n, r, t)| ((*n).to_owned(), (*r, *t))).collect()
    }

    #[test]
    fn shares_are_per_request_and_busiest_first() {
        let before = stats(&[("tc_ingress", 100, 10_000), ("tc_egress", 50, 5_000)]);
        let after = stats(&[
            ("tc_ingress", 140, 14_000),
            ("tc_egress", 70, 15_000),
            ("sock_connect4", 0, 0),
            ("xdp_uplink", 10, 3_000),
        ]);
        let got = shares(&before, &after, 10);
        let names: Vec<&str> = got.iter().map(|s| s.program.as_str()).collect();
        // tc_egress 2 runs x 500 ns = 1000 ns a request, tc_ingress 4 x 100,
        // xdp_uplink 1 x 300; the program that did not run is left out.
        assert_eq!(names, ["tc_egress", "tc_ingress", "xdp_uplink"]);
        assert_eq!((got[0].runs_per_request, got[0].ns_per_run), (2.0, 500.0));
        assert_eq!((got[1].runs_per_request, got[1].ns_per_run), (4.0, 100.0));
        assert_eq!((got[2].runs_per_request, got[2].ns_per_run), (1.0, 300.0));
    }

    #[test]
    fn the_agent_programs_are_named_as_the_kernel_keeps_them() {
        for name in agent_programs() {
            assert!(name.len() <= 15, "{name} would be cut short by the kernel");
        }
    }
}
