//! The ebpf mode read back from its pinned maps: the frontends and
//! backends the programs use, the flows their own conntrack tracks per
//! backend, and the flags of each frontend (affinity, source ranges).
//! The snapshot carries both families (`XP_SERVICES` and `XP_SERVICES6`):
//! every row is listed, with its flows from its family's conntrack table
//! (`XP_CT` or `XP_CT6`).

use std::path::Path;

use anyhow::Result;
use proxy_common::service::{FLAG_AFFINITY_CLIENT_IP, FLAG_SOURCE_RANGES};

use super::table::{Backend, Frontend, Kind, Table};
use crate::{
    dump::{self, FrontendRow, Snapshot},
    mode::ebpf::{ServiceMaps, conntrack::read_conntrack_counts},
    model::Protocol,
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
            let mut frontend = Frontend::new(proto, row.addr, row.port, kind);
            frontend.local_only = row.local_only;
            frontend.source_filtered = flags & FLAG_SOURCE_RANGES != 0;
            frontend.affinity_seconds = (flags & FLAG_AFFINITY_CLIENT_IP != 0).then_some(affinity);
            frontend.backends = row
                .backends
                .iter()
                .map(|b| Backend {
                    addr: b.addr,
                    flows: Some(b.flows),
                    notes: Vec::new(),
                })
                .collect();
            Some(frontend)
        })
        .collect();
    Table::new("ebpf", frontends)
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use proxy_common::proto::TCP;

    use super::*;
    use crate::dump::BackendRow;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("an address")
    }

    fn row(addr: &str, port: u16, node_port: bool, backends: &[(Option<&str>, u64)]) -> FrontendRow {
        FrontendRow {
            proto: TCP,
            addr: ip(addr),
            port,
            node_port,
            local_only: node_port,
            backends: backends
                .iter()
                .map(|&(addr, flows)| BackendRow {
                    addr: addr.map(|a| (ip(a), 80)),
                    flows,
                })
                .collect(),
        }
    }

    /// A dual-stack seed as the pinned maps hold it: the IPv4 ClusterIP
    /// (`XP_SERVICES`), the IPv6 ClusterIP and NodePort on the node's IPv6
    /// address (`XP_SERVICES6`), each with its flows per backend.
    #[test]
    fn lists_the_ipv6_frontends_beside_the_ipv4_ones() {
        let snapshot = Snapshot {
            frontends: vec![
                row("10.96.0.88", 88, false, &[(Some("10.244.0.11"), 2)]),
                row(
                    "fd00:96::88",
                    88,
                    false,
                    &[(Some("fd00:10:244::11"), 1), (Some("fd00:10:244::12"), 3), (None, 0)],
                ),
                row("fd00:30::2", 30791, true, &[(Some("fd00:10:244::11"), 0)]),
            ],
            forward_flows: 6,
            reply_flows: 6,
            flow_states: Vec::new(),
            table: None,
            verdicts: Vec::new(),
        };
        // Affinity on the IPv4 ClusterIP only (the IPv6 path has none).
        let table = table_of(&snapshot, |row| {
            row.addr.is_ipv4().then_some((FLAG_AFFINITY_CLIENT_IP, 10800))
        });
        let expected = "\
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  10.96.0.88:88 ClusterIP [affinity ClientIP 10800s]
  -> 10.244.0.11:80               2
TCP  [fd00:30::2]:30791 NodePort (Local: this node's endpoints)
  -> [fd00:10:244::11]:80         0
TCP  [fd00:96::88]:88 ClusterIP
  -> [fd00:10:244::11]:80         1
  -> [fd00:10:244::12]:80         3
  -> <missing>                    0
";
        assert_eq!(table.render(), expected);
        let json = table.to_json();
        assert_eq!(json["frontends"][2]["address"], "fd00:96::88");
        assert_eq!(json["frontends"][2]["backends"][1]["flows"], 3);
    }
}
