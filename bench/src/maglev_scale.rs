//! Maglev's cost in the control plane at 10,000 Services (issue 15 item
//! 2): building the lookup tables (the agent's `maglev::table`, pure
//! computation), and programming the Services into a loaded data path's
//! maps with Maglev beside the same Services balanced at random (the
//! tables' map writes), with the memory the kernel charges for them.
//! Runs with the per-packet step: one loaded object, no agent, no traffic.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Instant,
};

use anyhow::{Context, Result};
use proxy_common::maps;
use proxy_userspace::{
    mode::ebpf::maglev,
    model::{LbAlgorithm, Protocol, ServicePort},
};
use serde::Serialize;
use testbed::testrun::{Harness, NODE_IP, service};

use crate::perpacket::map_memory;

/// The scale the issue names, with the scale runs' 10 endpoints each.
pub const SERVICES: usize = 10_000;
pub const ENDPOINTS: usize = 10;
/// Table builds are timed this many times; the report gives the fastest
/// and the median (the machine is shared: the fastest is the cost).
const BUILD_ROUNDS: usize = 5;

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct MaglevScale {
    pub services: usize,
    pub endpoints: usize,
    /// Entries per table (`proxy_common::maglev::table_size`).
    pub table_size: u32,
    /// Building every table, ms: fastest and median of [`BUILD_ROUNDS`].
    pub build_min_ms: f64,
    pub build_median_ms: f64,
    /// Programming every Service into empty maps, random and Maglev, ms.
    pub program_random_ms: f64,
    pub program_maglev_ms: f64,
    /// What the kernel charges for `XP_MAGLEV` with every table in it.
    pub maglev_map_bytes: u64,
}

/// Service `i`: a ClusterIP in 10.128.0.0/10 and `ENDPOINTS` endpoints of
/// its own in 10.192.0.0/10, as the scale runs lay them out.
fn services(algorithm: LbAlgorithm) -> Vec<ServicePort> {
    (0..SERVICES)
        .map(|i| {
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            let cluster_ip = Ipv4Addr::from(0x0a80_0000 + i);
            let endpoints: Vec<SocketAddrV4> = (0..ENDPOINTS as u32)
                .map(|e| SocketAddrV4::new(Ipv4Addr::from(0x0ac0_0000 + i * 16 + e), 8080))
                .collect();
            ServicePort {
                lb_algorithm: Some(algorithm),
                ..service(
                    &format!("scale/svc-{i}:http"),
                    Protocol::Tcp,
                    cluster_ip,
                    80,
                    None,
                    &endpoints,
                )
            }
        })
        .collect()
}

/// The agent's table for each Service, as it builds them in a sync.
fn build_all(ports: &[ServicePort]) -> usize {
    let mut entries = 0;
    for port in ports {
        let members: Vec<maglev::Member> = (1..)
            .zip(&port.endpoints)
            .map(|(id, e)| maglev::Member {
                id,
                addr: e.addr,
                port: e.port,
            })
            .collect();
        entries += maglev::table(&members).map_or(0, |t| t.len());
    }
    entries
}

/// Programs `ports` into a fresh data path in one batch; returns the ms it
/// took and the harness (its maps still loaded).
fn program(ports: &[ServicePort]) -> Result<(f64, Harness)> {
    let mut h = Harness::new(vec![NODE_IP]);
    let started = Instant::now();
    h.maps
        .batch(|m| ports.iter().try_for_each(|p| m.sync_service(p)))
        .context("programming the Services")?;
    Ok((started.elapsed().as_secs_f64() * 1e3, h))
}

pub fn measure(progress: &dyn Fn(&str)) -> Result<MaglevScale> {
    progress(&format!("maglev: building {SERVICES} tables of {ENDPOINTS} endpoints"));
    let maglev_ports = services(LbAlgorithm::Maglev);
    let mut builds: Vec<f64> = (0..BUILD_ROUNDS)
        .map(|_| {
            let started = Instant::now();
            std::hint::black_box(build_all(std::hint::black_box(&maglev_ports)));
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    builds.sort_by(f64::total_cmp);
    progress("maglev: programming the Services, random then Maglev");
    let (program_random_ms, random) = program(&services(LbAlgorithm::Random))?;
    drop(random);
    let (program_maglev_ms, h) = program(&maglev_ports)?;
    let maglev_map_bytes = map_memory(h.pin_dir())?
        .into_iter()
        .find(|m| m.name == maps::MAGLEV)
        .map_or(0, |m| m.memlock_bytes);
    Ok(MaglevScale {
        services: SERVICES,
        endpoints: ENDPOINTS,
        table_size: proxy_common::maglev::table_size(ENDPOINTS as u32).unwrap_or(0),
        build_min_ms: builds[0],
        build_median_ms: builds[BUILD_ROUNDS / 2],
        program_random_ms,
        program_maglev_ms,
        maglev_map_bytes,
    })
}

impl MaglevScale {
    pub fn markdown(&self) -> String {
        format!(
            "### Maglev tables at {services} Services\n\n\
             {services} Services x {endpoints} endpoints, tables of {size} entries \
             (>= 200 x endpoints, prime). Building every table (the agent's fill, pure \
             computation): **{min:.0} ms** fastest, {median:.0} ms median of {rounds}. \
             Programming the Services into empty maps in one batch: {random:.0} ms random, \
             {maglev:.0} ms Maglev (tables built and written). `XP_MAGLEV` then holds \
             {mib:.1} MiB (kernel memlock).\n\n",
            services = self.services,
            endpoints = self.endpoints,
            size = self.table_size,
            min = self.build_min_ms,
            median = self.build_median_ms,
            rounds = BUILD_ROUNDS,
            random = self.program_random_ms,
            maglev = self.program_maglev_ms,
            mib = self.maglev_map_bytes as f64 / (1024.0 * 1024.0),
        )
    }
}
