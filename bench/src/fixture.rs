//! A fixed, made-up results file for the report and chart tests.

use crate::{
    latency::Latency,
    memory::{MapMemory, Memory},
    program_time::{ProgramShare, TargetProgramTime},
    programming::{EndpointChange, Programming},
    results::{
        Baseline, BaselinePaths, Ipv6Latency, Machine, ModeResult, ModeStatus, Parameters, PartTiming, Results, Run,
        RunLatency, RunThroughput,
    },
    stats::Summary,
    throughput::{Throughput, WrkOptions},
};

/// Connect p50 `p50` (rounds 19..22 around 20, say), everything else derived.
fn latency(p50: f64) -> Latency {
    Latency {
        connect_p50_us: Summary {
            median: p50,
            min: p50 - 1.0,
            max: p50 + 2.0,
            rounds: 3,
        },
        connect_p99_us: Summary::one(p50 * 1.5),
        request_p50_us: Summary::one(p50 * 2.0),
        request_p99_us: Summary::one(p50 * 3.0),
        connections_per_round: 2000,
        failures: 0,
    }
}

fn throughput(rps: f64) -> Throughput {
    Throughput {
        requests_per_s: Summary {
            median: rps,
            min: rps * 0.9,
            max: rps * 1.1,
            rounds: 2,
        },
        errors: 0,
        requests: (rps * 6.0) as u64,
    }
}

fn run(services: usize, first: f64, last: f64, rps: f64, sync_s: f64) -> Run {
    let mut run = Run::new(services, services * 5, services / 10 + 1);
    run.programming = Some(Programming {
        delivered_to_answer_s: Some(sync_s * 1.2),
        start_to_answer_s: sync_s * 2.0,
        sync_s: Some(sync_s),
        timed_out_after_s: None,
    });
    run.latency = Some(RunLatency {
        clusterip_first: latency(first),
        clusterip_last: latency(last),
        clusterip_direct: latency(15.0),
        nodeport_first: latency(first + 5.0),
        nodeport_last: latency(last + 5.0),
        nodeport_direct: latency(18.0),
        ipv6: Some(Ipv6Latency {
            clusterip: latency(last + 2.0),
            nodeport: latency(last + 7.0),
        }),
    });
    run.throughput = Some(RunThroughput {
        nodeport_short: throughput(rps),
        nodeport_keepalive: throughput(rps * 3.0),
        clusterip_short: throughput(rps),
        clusterip_keepalive: throughput(rps * 3.0),
    });
    run.memory = Some(Memory {
        agent_rss_bytes: 20 << 20 | (services as u64 * 1000),
        agent_peak_rss_bytes: 30 << 20,
        bpf_maps: vec![MapMemory {
            name: "SERVICES".into(),
            max_entries: 65536,
            bytes: 1 << 20,
            preallocated: true,
        }],
    });
    run.seconds = 10.0;
    run
}

/// A run whose Services were not programmed within 120 s.
pub fn timed_out(services: usize) -> Run {
    let mut run = Run::new(services, services * 5, services / 10 + 1);
    run.programming = Some(Programming {
        delivered_to_answer_s: None,
        start_to_answer_s: 121.0,
        sync_s: None,
        timed_out_after_s: Some(120.0),
    });
    run
}

pub fn results() -> Results {
    let baseline = Baseline {
        bare: BaselinePaths {
            clusterip_path: latency(15.0),
            nodeport_path: latency(18.0),
        },
        cni_masquerade: Some(BaselinePaths {
            clusterip_path: latency(18.5),
            nodeport_path: latency(19.0),
        }),
    };
    let mut ebpf_1000 = run(1000, 20.0, 20.0, 30_000.0, 0.01);
    ebpf_1000.endpoint_change = Some(EndpointChange {
        services: 1000,
        changes: 3,
        p50_ms: 1.0,
        p99_ms: 2.0,
        min_ms: 0.5,
        max_ms: 2.0,
        samples_ms: vec![0.5, 1.0, 2.0],
    });
    ebpf_1000.program_time = Some(vec![TargetProgramTime {
        target: "ClusterIP, last".into(),
        requests: 1000,
        us_per_request: 1.25,
        programs: vec![ProgramShare {
            program: "tc_ingress".into(),
            runs_per_request: 5.0,
            ns_per_run: 250.0,
        }],
    }]);
    Results {
        schema: crate::results::SCHEMA,
        machine: Machine {
            date: "2026-12-02T15:00:00Z".into(),
            host: "bench".into(),
            kernel: "6.18.0".into(),
            cpus: 2,
            cpu_model: "Test CPU".into(),
            memory_bytes: 8 << 30,
            git_commit: "0123456789abcdef".into(),
            git_dirty: false,
            guest: None,
        },
        parameters: Parameters {
            quick: true,
            modes: vec!["ebpf".into(), "iptables".into(), "ipvs".into()],
            services: vec![100, 1000],
            seed: 1,
            endpoints_per_service: (1, 10),
            backend_pods: 10,
            node_port_every: 10,
            latency_connections: 2000,
            latency_rounds: 3,
            wrk: Some(WrkOptions {
                threads: 1,
                connections: 32,
                duration_s: 3,
                rounds: 2,
            }),
            endpoint_changes: 3,
            endpoint_change_services: 1000,
            probe_timeout_ms: 5,
            server_threads: 2,
            agent_config: "kind: KubeProxyConfiguration\n".into(),
            paths: vec![("ClusterIP".into(), "client pod -> ClusterIP".into())],
        },
        modes: vec![
            ModeResult {
                mode: "ebpf".into(),
                status: ModeStatus::Ran,
                baseline: Some(baseline.clone()),
                runs: vec![run(100, 20.0, 20.0, 30_000.0, 0.005), ebpf_1000],
            },
            ModeResult {
                mode: "iptables".into(),
                status: ModeStatus::Ran,
                baseline: Some(baseline),
                runs: vec![
                    run(100, 22.0, 25.0, 10_000.0, 0.05),
                    run(1000, 25.0, 40.0, 10_000.0, 0.5),
                ],
            },
            ModeResult {
                mode: "nftables".into(),
                status: ModeStatus::Ran,
                baseline: None,
                runs: vec![run(100, 18.0, 19.0, 20_000.0, 0.02), timed_out(1000)],
            },
            ModeResult {
                mode: "ipvs".into(),
                status: ModeStatus::Skipped {
                    reason: "no IPVS in this kernel".into(),
                },
                baseline: None,
                runs: vec![],
            },
        ],
        scale: vec![],
        per_packet: None,
        timings: vec![PartTiming {
            part: "ebpf".into(),
            seconds: 12.0,
        }],
    }
}
