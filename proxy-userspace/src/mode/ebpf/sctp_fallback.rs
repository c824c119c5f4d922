//! The ebpf mode's kernel fallback for the SCTP Service ports its programs
//! leave alone: those whose port changes on the way to an endpoint (a node
//! port, a `targetPort` other than the port). SCTP's CRC32c covers the
//! ports, and recomputing it over the whole packet is the kernel's NAT's
//! job, not the programs': such ports are DNATed by a small nftables table
//! of the ebpf mode's own, `ip xproxy-sctp`. The programs pass their
//! packets untouched (no map holds them), both ways; the kernel's conntrack
//! turns the replies back.
//!
//! What the table does, per port: its ClusterIP, external and load
//! balancer IPs on the port, and its node port on the node's addresses,
//! to a random usable endpoint. Traffic to the node port, external and
//! load balancer IPs, hairpin traffic and (with `masqueradeAll`) all of it
//! gets the SNAT mark, which the ebpf mode's `XPROXY-SNAT` rules
//! masquerade. Not applied here, and reported: the `Local` traffic
//! policies, ClientIP affinity, `loadBalancerSourceRanges`, topology; a
//! port without endpoints is left out (not rejected).
//!
//! SCTP Services with a changing port are rare: the table is rewritten
//! whole (one `nft -f -` transaction) when it changes, and never touched on
//! a node that has none.

use std::{collections::BTreeMap, fmt::Write as _, net::Ipv4Addr};

use anyhow::{Context, Result};
use tracing::{debug, info};

use crate::{
    model::{IpFamily, ServicePort, usable_endpoints},
    sys::nft::{self, Nft},
};

pub const FAMILY: &str = "ip";
pub const TABLE: &str = "xproxy-sctp";

/// What the fallback leaves out of a port it serves, for the mode's report.
pub const NOT_APPLIED: &str = "SCTP through the ebpf mode's kernel fallback (ip xproxy-sctp): \
     the Local traffic policies, ClientIP affinity, loadBalancerSourceRanges and topology are not applied";

/// The ports the table serves and what was last written.
pub struct SctpFallback {
    nft: Box<dyn Nft>,
    /// The SNAT mark (0: no masquerading).
    mark: u32,
    masquerade_all: bool,
    ports: BTreeMap<String, ServicePort>,
    /// The script last run; `None` before the first (which also removes
    /// an earlier agent's table).
    written: Option<String>,
}

impl SctpFallback {
    pub fn new(nft: Box<dyn Nft>, mark: u32, masquerade_all: bool) -> Self {
        Self {
            nft,
            mark,
            masquerade_all,
            ports: BTreeMap::new(),
            written: None,
        }
    }

    /// Takes `port` in (or keeps it out, if it is `None`: the programs serve
    /// it, or it went).
    /// Only IPv4 ports are taken: the table is `ip` ([`serves`]).
    pub fn set(&mut self, name: &str, port: Option<&ServicePort>) {
        match port.filter(|p| serves(p)) {
            Some(port) => self.ports.insert(name.to_owned(), port.clone()),
            None => self.ports.remove(name),
        };
    }

    /// Serves exactly those of `ports` it can ([`serves`]).
    pub fn replace<'a>(&mut self, ports: impl IntoIterator<Item = &'a ServicePort>) {
        self.ports = ports
            .into_iter()
            .filter(|p| serves(p))
            .map(|p| (p.name.clone(), p.clone()))
            .collect();
    }

    /// Writes the table for the ports taken in, node ports on `node_ips`,
    /// if it differs from what was written last. Before anything was ever
    /// written and with no port to serve, only an earlier agent's table is
    /// removed (nft is not needed on a node without such ports).
    pub fn sync(&mut self, node_ips: &[Ipv4Addr]) -> Result<()> {
        let script = render(self.ports.values(), node_ips, self.mark, self.masquerade_all);
        if self.written.as_deref() == Some(script.as_str()) {
            return Ok(());
        }
        if self.written.is_none() && self.ports.is_empty() {
            self.remove_leftover()?;
            self.written = Some(script);
            return Ok(());
        }
        self.nft
            .run(&script)
            .with_context(|| format!("writing the SCTP fallback table {FAMILY} {TABLE}"))?;
        debug!(ports = self.ports.len(), "SCTP fallback table written");
        self.written = Some(script);
        Ok(())
    }
}

impl SctpFallback {
    /// Removes an earlier agent's table, if there is one. A node without
    /// nft (or nf_tables) has none: that is no error.
    fn remove_leftover(&mut self) -> Result<()> {
        match self.nft.list_table(FAMILY, TABLE) {
            Ok(Some(_)) => {
                nft::delete_table(self.nft.as_mut(), FAMILY, TABLE)?;
                info!(table = TABLE, "removed an earlier agent's SCTP fallback table");
            }
            Ok(None) => {}
            Err(e) => debug!(
                error = format!("{e:#}"),
                "nft cannot list tables: no SCTP fallback table to remove"
            ),
        }
        Ok(())
    }
}

/// The transaction that replaces the table with one serving `ports` (or
/// only removes it, for none).
pub fn render<'a>(
    ports: impl IntoIterator<Item = &'a ServicePort>,
    node_ips: &[Ipv4Addr],
    mark: u32,
    masquerade_all: bool,
) -> String {
    let mut out = format!("add table {FAMILY} {TABLE}\ndelete table {FAMILY} {TABLE}\n");
    let served: Vec<&ServicePort> = ports
        .into_iter()
        .filter(|p| !usable_endpoints(&p.endpoints).is_empty())
        .collect();
    if served.is_empty() {
        return out;
    }
    let mut frontends = Vec::new();
    let mut chains = String::new();
    for (i, port) in served.iter().enumerate() {
        frontends.extend(frontend_rules(i, port, node_ips));
        chains.push_str(&port_chains(i, port, mark, masquerade_all));
    }
    let _ = write!(
        out,
        "table {FAMILY} {TABLE} {{\n{}{}",
        hook_chain("prerouting"),
        hook_chain("output")
    );
    out.push_str("\tchain services {\n");
    for rule in frontends {
        let _ = writeln!(out, "\t\t{rule}");
    }
    out.push_str("\t}\n");
    out.push_str(&chains);
    out.push_str("}\n");
    out
}

/// A NAT base chain at `hook` that sends SCTP to the frontends, at
/// `dstnat`'s priority (-100; older nft names it only for prerouting).
fn hook_chain(hook: &str) -> String {
    format!(
        "\tchain {hook} {{\n\t\ttype nat hook {hook} priority -100; policy accept;\n\
         \t\tmeta l4proto sctp jump services\n\t}}\n"
    )
}

/// The frontends of port `i`: its ClusterIP to its service chain, its
/// external and load balancer IPs and its node port to its external chain.
fn frontend_rules(i: usize, port: &ServicePort, node_ips: &[Ipv4Addr]) -> Vec<String> {
    let mut rules = vec![format!(
        "ip daddr {} sctp dport {} goto service-{i}",
        port.cluster_ip, port.port
    )];
    for ip in port.external_ips.iter().chain(&port.load_balancer_ips) {
        rules.push(format!("ip daddr {ip} sctp dport {} goto external-{i}", port.port));
    }
    if let Some(node_port) = port.node_port
        && !node_ips.is_empty()
    {
        let ips: Vec<String> = node_ips.iter().map(ToString::to_string).collect();
        rules.push(format!(
            "ip daddr {{ {} }} sctp dport {node_port} goto external-{i}",
            ips.join(", ")
        ));
    }
    rules
}

/// Port `i`'s chains: external (marked for masquerading), service (a
/// random endpoint), one per endpoint (hairpin marked, DNAT).
fn port_chains(i: usize, port: &ServicePort, mark: u32, masquerade_all: bool) -> String {
    let set_mark = format!("meta mark set meta mark | {mark:#010x}");
    let marks = mark != 0;
    let mut out = format!("\tchain external-{i} {{\n");
    if marks {
        let _ = writeln!(out, "\t\t{set_mark}");
    }
    let _ = writeln!(out, "\t\tgoto service-{i}\n\t}}");
    let endpoints = usable_endpoints(&port.endpoints);
    let _ = writeln!(out, "\tchain service-{i} {{");
    if marks && masquerade_all {
        let _ = writeln!(out, "\t\t{set_mark}");
    }
    let targets: Vec<String> = (0..endpoints.len())
        .map(|j| format!("{j} : goto endpoint-{i}-{j}"))
        .collect();
    let _ = writeln!(
        out,
        "\t\tnumgen random mod {} vmap {{ {} }}\n\t}}",
        endpoints.len(),
        targets.join(", ")
    );
    for (j, endpoint) in endpoints.iter().enumerate() {
        let _ = writeln!(out, "\tchain endpoint-{i}-{j} {{");
        if marks {
            let _ = writeln!(out, "\t\tip saddr {} {set_mark}", endpoint.addr);
        }
        let _ = writeln!(
            out,
            "\t\tmeta l4proto sctp dnat to {}:{}\n\t}}",
            endpoint.addr, endpoint.port
        );
    }
    out
}

/// Removes the table, if there is one (`xproxy cleanup`). Does nothing
/// where nft is missing.
pub fn cleanup() -> Result<()> {
    let system = nft::SystemNft::default();
    if system.check().is_err() {
        return Ok(());
    }
    SctpFallback::new(Box::new(system), 0, false).remove_leftover()
}

/// Whether the fallback can serve `port`: an IPv4 one (the table is of
/// the `ip` family; IPv6 SCTP ports whose port changes are not served yet).
pub fn serves(port: &ServicePort) -> bool {
    port.family() == IpFamily::V4
}

/// What the ebpf mode reports for an IPv6 SCTP port whose port changes.
pub const NOT_SERVED_IPV6: &str = "SCTP over IPv6 with a nodePort or a targetPort other than the port \
     is not served by the ebpf mode yet (its kernel fallback table is IPv4 only)";

/// Whether `port` needs more than the fallback does, for the report.
pub fn leaves_out(port: &ServicePort) -> bool {
    port.external_local() || port.internal_local() || port.affinity.is_some() || !port.source_ranges.is_empty()
}

#[cfg(test)]
#[path = "sctp_fallback_tests.rs"]
mod tests;
