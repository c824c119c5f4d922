//! One text form of the live data path, read like `ipvsadm -Ln`: what
//! `xproxy status` prints and what golden tests compare.

use std::{
    fmt::Write,
    net::{IpAddr, SocketAddr},
};

use proxy_common::{Verdict, VerdictCounter, conntrack::state, stats::ct_stat};

use crate::mode::ebpf::conntrack::ConntrackCounts;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendRow {
    /// `None` if the slot or backend is missing (maps out of step).
    pub addr: Option<(IpAddr, u16)>,
    /// Tracked flows pinned to this backend through this frontend.
    pub flows: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendRow {
    pub proto: u8,
    pub addr: IpAddr,
    pub port: u16,
    pub node_port: bool,
    /// A `Local` traffic policy: the backends are this node's; with none,
    /// new flows are dropped (not rejected).
    pub local_only: bool,
    pub backends: Vec<BackendRow>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Sorted by protocol, address, port.
    pub frontends: Vec<FrontendRow>,
    pub forward_flows: u64,
    pub reply_flows: u64,
    /// Tracked flows per state (`proxy_common::conntrack::state`), by
    /// their forward entries.
    pub flow_states: Vec<(u8, u64)>,
    /// The conntrack table's counters, where the data path has them.
    pub table: Option<ConntrackCounts>,
    pub verdicts: Vec<(Verdict, VerdictCounter)>,
}

fn proto_name(p: u8) -> String {
    crate::model::Protocol::from_number(p).map_or_else(|| p.to_string(), |p| p.to_string())
}

/// Frontends and backends only: stable for golden tests.
pub fn render_services(snapshot: &Snapshot) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Prot LocalAddress:Port Kind");
    let _ = writeln!(out, "  -> RemoteAddress:Port           Flows");
    for f in &snapshot.frontends {
        let kind = if f.node_port { "NodePort" } else { "ClusterIP" };
        let empty = match (f.local_only, f.backends.is_empty()) {
            (false, true) => " (no endpoints: reject)",
            (true, true) => " (Local, no endpoint on this node: drop)",
            (true, false) => " (Local: this node's endpoints)",
            (false, false) => "",
        };
        let frontend = SocketAddr::new(f.addr, f.port);
        let _ = writeln!(out, "{:<4} {frontend} {kind}{empty}", proto_name(f.proto));
        for b in &f.backends {
            let addr = (b.addr).map_or_else(|| "<missing>".to_string(), |addr| SocketAddr::from(addr).to_string());
            let _ = writeln!(out, "  -> {addr:<28} {}", b.flows);
        }
    }
    out
}

/// Everything: services, flow totals and verdict counters.
pub fn render(snapshot: &Snapshot) -> String {
    render_services(snapshot) + &render_totals(snapshot)
}

/// Flow totals, the conntrack table's fill and the verdict counters: what
/// `xproxy status` prints below the ebpf mode's table.
pub fn render_totals(snapshot: &Snapshot) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "\nTracked flows: {} ({} reply entries)",
        snapshot.forward_flows, snapshot.reply_flows
    );
    let states: Vec<String> = snapshot
        .flow_states
        .iter()
        .map(|(s, n)| format!("{} {n}", state::name(*s)))
        .collect();
    if states.is_empty() {
        let _ = writeln!(out);
    } else {
        let _ = writeln!(out, ": {}", states.join(", "));
    }
    if let Some(t) = &snapshot.table {
        let _ = writeln!(
            out,
            "Conntrack table: {} of {} entries; {} inserted, {} removed by the programs, {} expired, \
             {} evicted",
            snapshot.forward_flows + snapshot.reply_flows,
            t.max_entries,
            t.get(ct_stat::INSERTED),
            t.get(ct_stat::REMOVED),
            t.get(ct_stat::EXPIRED),
            t.get(ct_stat::EVICTED)
        );
    }
    let _ = writeln!(out, "Verdicts:");
    for (verdict, counter) in &snapshot.verdicts {
        let _ = writeln!(
            out,
            "  {:<24} {:>12} packets {:>14} bytes",
            verdict.name(),
            counter.packets,
            counter.bytes
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn renders_like_ipvsadm() {
        let snapshot = Snapshot {
            frontends: vec![
                FrontendRow {
                    proto: proxy_common::proto::TCP,
                    addr: Ipv4Addr::new(10, 96, 0, 10).into(),
                    port: 88,
                    node_port: false,
                    local_only: false,
                    backends: vec![
                        BackendRow {
                            addr: Some((Ipv4Addr::new(10, 244, 0, 11).into(), 80)),
                            flows: 2,
                        },
                        BackendRow { addr: None, flows: 0 },
                    ],
                },
                FrontendRow {
                    proto: proxy_common::proto::UDP,
                    addr: Ipv4Addr::new(10, 96, 0, 20).into(),
                    port: 53,
                    node_port: false,
                    local_only: false,
                    backends: vec![],
                },
            ],
            forward_flows: 2,
            reply_flows: 2,
            flow_states: vec![(state::TCP_ESTABLISHED, 1), (state::TCP_TIME_WAIT, 1)],
            table: Some(ConntrackCounts {
                counters: [10, 2, 4, 4, 4, 0],
                max_entries: 262_144,
            }),
            verdicts: vec![(Verdict::DnatNew, VerdictCounter { packets: 2, bytes: 148 })],
        };
        let expected = "\
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  10.96.0.10:88 ClusterIP
  -> 10.244.0.11:80               2
  -> <missing>                    0
UDP  10.96.0.20:53 ClusterIP (no endpoints: reject)

Tracked flows: 2 (2 reply entries): established 1, time_wait 1
Conntrack table: 4 of 262144 entries; 10 inserted, 2 removed by the programs, 4 expired, 0 evicted
Verdicts:
  dnat_new                            2 packets            148 bytes
";
        assert_eq!(render(&snapshot), expected);
    }
}
