//! What a run measures: the command line turned into numbers.

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::{results::ScaleSource, services::EndpointCount, throughput::WrkOptions};

/// `iptables` is the iptables mode on the nft backend, `iptables-legacy`
/// on the legacy one (see `agent::IPTABLES_BACKENDS`).
pub const ALL_MODES: [&str; 6] = ["ebpf", "iptables", "iptables-legacy", "nftables", "ipvs", "userspace"];
const FULL_SERVICES: [usize; 4] = [100, 1_000, 10_000, 20_000];
const QUICK_SERVICES: [usize; 2] = [100, 1_000];
/// A probe of a Service that is not programmed yet gets no answer at all
/// (its ClusterIP is routed out of the node and dropped): give up on it
/// this soon and try again. A connection through the node takes well under
/// a millisecond here.
const DEFAULT_PROBE_TIMEOUT_MS: u64 = 5;
/// The endpoint-change measurement runs at this many Services (or the
/// largest number below it).
const CHANGE_AT: usize = 10_000;

#[derive(clap::Args, Debug, Clone)]
pub struct RunOptions {
    /// Modes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = ALL_MODES.map(String::from))]
    pub modes: Vec<String>,
    /// Numbers of Services, comma-separated [default: 100,1000,10000,20000; --quick: 100,1000].
    #[arg(long, value_delimiter = ',')]
    pub services: Option<Vec<usize>>,
    /// A smoke test: N = 100 and 1,000, few rounds, a few minutes.
    #[arg(long)]
    pub quick: bool,
    /// Sequential new connections per latency round [default: 2000; --quick: 300].
    #[arg(long)]
    pub connections: Option<usize>,
    /// Latency rounds per target [default: 5; --quick: 2].
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Endpoint changes to time [default: 100; --quick: 20].
    #[arg(long)]
    pub changes: Option<usize>,
    /// Seconds the agent may take to program N Services before the mode is
    /// given up at this N and above [default: 300; --quick: 120].
    #[arg(long)]
    pub program_timeout: Option<u64>,
    /// Seconds per wrk run [default: 3; --quick: 1].
    #[arg(long)]
    pub wrk_seconds: Option<u64>,
    /// Seed of the Services' endpoint counts.
    #[arg(long, default_value_t = crate::services::DEFAULT_SEED)]
    pub seed: u64,
    /// Milliseconds a probe of a Service that is not programmed yet waits
    /// for an answer before trying again [default: 5]. Raise it where a
    /// connection takes longer to set up (`cargo xtask bench --vm`: an
    /// emulated guest).
    #[arg(long)]
    pub probe_timeout_ms: Option<u64>,
    /// Skip the ebpf scale runs (10,000 x 10 endpoints, 100,000 Services); --quick skips them.
    #[arg(long)]
    pub no_scale: bool,
    /// Where the scale runs take the Services from, comma-separated: the
    /// API server, a manifest directory.
    #[arg(long, value_delimiter = ',', default_values_t = [ScaleSource::Api, ScaleSource::Manifests])]
    pub scale_sources: Vec<ScaleSource>,
    /// Agents started one after another at each scale point, each on fresh
    /// maps against the same loaded source; the report gives their median
    /// (a single start's time moves by tens of milliseconds between starts).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..))]
    pub scale_repeats: u16,
    /// Only the scale runs: no per-mode runs, no per-packet part.
    #[arg(long, conflicts_with = "no_scale")]
    pub only_scale: bool,
    /// Skip the per-packet measurement (BPF_PROG_TEST_RUN).
    #[arg(long)]
    pub no_per_packet: bool,
    /// Only the per-packet measurement (and Maglev's table costs, measured
    /// with it): no per-mode runs, no scale runs.
    #[arg(long, conflicts_with_all = ["no_per_packet", "only_scale"])]
    pub only_per_packet: bool,
    /// The agent binary [default: `xproxy` next to this binary].
    #[arg(long)]
    pub xproxy: Option<PathBuf>,
    /// Where the results go [default: bench/results in the workspace].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One extra ebpf run for a scale target: programming and memory only.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalePoint {
    pub services: usize,
    pub endpoints: EndpointCount,
    pub source: ScaleSource,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub quick: bool,
    pub modes: Vec<String>,
    pub services: Vec<usize>,
    pub seed: u64,
    pub connections: usize,
    pub rounds: usize,
    pub changes: usize,
    /// The number of Services the endpoint changes run at (one of `services`).
    pub change_at: usize,
    pub wrk: WrkOptions,
    /// How long the agent may take to program the Services.
    pub program_timeout: std::time::Duration,
    /// How long a probe of a Service not programmed yet waits for an answer.
    pub probe_timeout: std::time::Duration,
    pub scale: Vec<ScalePoint>,
    /// Agents started at each scale point (`--scale-repeats`).
    pub scale_repeats: usize,
    /// Measure the modes at each N (else only the scale runs).
    pub mode_runs: bool,
    pub per_packet: bool,
}

impl Plan {
    pub fn from_options(o: &RunOptions) -> Result<Self> {
        let quick = o.quick;
        let mut services = o.services.clone().unwrap_or_else(|| {
            if quick {
                QUICK_SERVICES.to_vec()
            } else {
                FULL_SERVICES.to_vec()
            }
        });
        services.sort_unstable();
        services.dedup();
        if services.is_empty() || services[0] == 0 {
            bail!("--services needs numbers above 0");
        }
        for mode in &o.modes {
            if !ALL_MODES.contains(&mode.as_str()) {
                bail!("unknown mode {mode:?} (modes: {})", ALL_MODES.join(", "));
            }
        }
        let change_at = services
            .iter()
            .copied()
            .filter(|&n| n <= CHANGE_AT)
            .max()
            .unwrap_or(services[0]);
        let pick = |given: Option<usize>, full: usize, quick_value: usize| {
            given.unwrap_or(if quick { quick_value } else { full })
        };
        let scale = if quick || o.no_scale || o.only_per_packet || !o.modes.iter().any(|m| m == "ebpf") {
            Vec::new()
        } else {
            vec![
                ScalePoint {
                    services: 10_000,
                    endpoints: EndpointCount::Fixed(10),
                    source: ScaleSource::Api,
                },
                ScalePoint {
                    services: 100_000,
                    endpoints: EndpointCount::Random,
                    source: ScaleSource::Api,
                },
                // The same 10,000 x 10 read from YAML files: the manifests
                // source's parsing is what this one measures.
                ScalePoint {
                    services: 10_000,
                    endpoints: EndpointCount::Fixed(10),
                    source: ScaleSource::Manifests,
                },
            ]
            .into_iter()
            .filter(|p| o.scale_sources.contains(&p.source))
            .collect()
        };
        Ok(Self {
            quick,
            modes: o.modes.clone(),
            services,
            seed: o.seed,
            connections: pick(o.connections, 2000, 300).max(1),
            rounds: pick(o.rounds, 5, 2).max(1),
            changes: pick(o.changes, 100, 20).max(1),
            change_at,
            wrk: WrkOptions {
                threads: 1,
                connections: 32,
                duration_s: o.wrk_seconds.unwrap_or(if quick { 1 } else { 3 }).max(1),
                rounds: if quick { 1 } else { 2 },
            },
            program_timeout: std::time::Duration::from_secs(
                o.program_timeout.unwrap_or(if quick { 120 } else { 300 }).max(1),
            ),
            probe_timeout: std::time::Duration::from_millis(
                o.probe_timeout_ms.unwrap_or(DEFAULT_PROBE_TIMEOUT_MS).max(1),
            ),
            scale,
            scale_repeats: usize::from(o.scale_repeats),
            mode_runs: !o.only_scale && !o.only_per_packet,
            per_packet: !o.no_per_packet && !o.only_scale,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunOptions,
    }

    fn plan(args: &[&str]) -> Result<Plan> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))?;
        Plan::from_options(&cli.run)
    }

    #[test]
    fn defaults_are_the_full_run() {
        let p = plan(&[]).expect("plan");
        assert_eq!(p.modes, ALL_MODES.map(String::from));
        assert_eq!(p.services, [100, 1000, 10_000, 20_000]);
        assert_eq!(
            (p.connections, p.rounds, p.changes, p.change_at),
            (2000, 5, 100, 10_000)
        );
        assert_eq!(p.scale.len(), 3);
        assert_eq!(p.scale[2].source, ScaleSource::Manifests);
        assert!(p.per_packet);
    }

    #[test]
    fn quick_is_small() {
        let p = plan(&["--quick", "--modes", "ebpf,iptables"]).expect("plan");
        assert_eq!(p.services, [100, 1000]);
        assert_eq!(p.change_at, 1000);
        assert!(p.scale.is_empty());
        assert_eq!(p.wrk.duration_s, 1);
        let p = plan(&["--quick", "--services", "1000,100,1000"]).expect("plan");
        assert_eq!(p.services, [100, 1000]);
    }

    #[test]
    fn only_the_manifests_scale_run() {
        let p = plan(&["--modes", "ebpf", "--only-scale", "--scale-sources", "manifests"]).expect("plan");
        assert!(!p.mode_runs && !p.per_packet);
        assert_eq!(p.scale.len(), 1);
        assert_eq!(
            (p.scale[0].services, p.scale[0].source),
            (10_000, ScaleSource::Manifests)
        );
        assert!(plan(&["--only-scale", "--no-scale"]).is_err());
    }

    #[test]
    fn refuses_unknown_modes_and_zero_services() {
        assert!(plan(&["--modes", "ebpf,bogus"]).is_err());
        assert!(plan(&["--services", "0"]).is_err());
        let p = plan(&["--modes", "iptables"]).expect("plan");
        assert!(p.scale.is_empty(), "scale runs are ebpf's");
    }

    #[test]
    fn only_the_per_packet_part() {
        let p = plan(&["--modes", "ebpf", "--only-per-packet"]).expect("plan");
        assert!(!p.mode_runs && p.per_packet && p.scale.is_empty());
        assert!(plan(&["--only-per-packet", "--no-per-packet"]).is_err());
    }
}
