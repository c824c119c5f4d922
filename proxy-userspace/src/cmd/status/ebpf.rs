//! The ebpf mode read back from its pinned maps: the frontends and
//! backends the programs use, the flows their own conntrack tracks per
//! backend, and the flags of each frontend (affinity, source ranges).

use std::path::Path;

use anyhow::Result;
use proxy_common::service::{FLAG_AFFINITY_CLIENT_IP, FLAG_SOURCE_RANGES};

use super::table::{Backend, Frontend, Kind, Table};
use crate::{
    dump::{self, FrontendRow, Snapshot},
    mode::ebpf::{ServiceMaps, conntrack::read_conntrack_counts},
    model::{Protocol, ipv4},
};

/// Whether an ebpf data path is pinned at `pin_path`.
pub fn in_use(pin_path: &Path) -> bool {
    pin_path.join(proxy_common::maps::SERVICES).exists()
}

/// The table and, below it, the flow totals and verdict counters.
pub fn read_back(pin_path: &Path) -> Result<(Table, String)> {
    let maps = ServiceMaps::open(pin_path, Vec::new())?;
    let mut snapshot = maps.snapshot()?;
    snapshot.table = read_conntrack_counts(pin_path)?;
    let table = table_of(&snapshot, |row| {
        maps.frontend(row.addr, row.port, row.proto)
            .map(|v| (v.flags, v.affinity_timeout_s))
    });
    Ok((table, dump::render_totals(&snapshot)))
}

/// The table of a snapshot; `flags_of` gives a frontend's flags and
/// affinity timeout.
pub fn table_of(snapshot: &Snapshot, flags_of: impl Fn(&FrontendRow) -> Option<(u32, u32)>) -> Table {
    let frontends = snapshot
        .frontends
        .iter()
        .filter_map(|row| {
            let proto = Protocol::from_number(row.proto)?;
            // The shared table is IPv4's for now (every mode's status
            // reads IPv4 rules only): IPv6 frontends are `dump`'s rows.
            let addr = ipv4(row.addr)?;
            let (flags, affinity) = flags_of(row).unwrap_or_default();
            // The maps do not tell an external or load balancer IP from a
            // ClusterIP; a frontend filtering its sources is a load
            // balancer IP.
            let kind = if row.node_port {
                Kind::NodePort
            } else if flags & FLAG_SOURCE_RANGES != 0 {
                Kind::LoadBalancer
            } else {
                Kind::ClusterIp
            };
            let mut frontend = Frontend::new(proto, addr, row.port, kind);
            frontend.local_only = row.local_only;
            frontend.source_filtered = flags & FLAG_SOURCE_RANGES != 0;
            frontend.affinity_seconds = (flags & FLAG_AFFINITY_CLIENT_IP != 0).then_some(affinity);
            frontend.backends = row
                .backends
                .iter()
                .map(|b| Backend {
                    addr: b.addr.and_then(|(ip, port)| Some((ipv4(ip)?, port))),
                    flows: Some(b.flows),
                    notes: Vec::new(),
                })
                .collect();
            Some(frontend)
        })
        .collect();
    Table::new("ebpf", frontends)
}
