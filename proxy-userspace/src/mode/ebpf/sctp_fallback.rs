//! The ebpf mode's kernel fallback for the SCTP Service ports its programs
//! leave alone: those whose port changes on the way to an endpoint (a node
//! port, a `targetPort` other than the port). SCTP's CRC32c covers the
//! ports, and recomputing it over the whole packet is the kernel's NAT's
//! job, not the programs': such ports are DNATed by a small nftables table
//! of the ebpf mode's own, `inet xproxy-sctp` (one table for both families:
//! each rule matches its port's family). The programs pass their
//! packets untouched (no map holds them), both ways; the kernel's conntrack
//! turns the replies back.
//!
//! What the table does, per port: its ClusterIP, external and load
//! balancer IPs on the port, and its node port on the node's addresses,
//! to a random usable endpoint. Traffic to the node port, external and
//! load balancer IPs, hairpin traffic and (with `masqueradeAll`) all of it
//! gets the SNAT mark, which the ebpf mode's `XPROXY-SNAT` rules
//! and `ip6tables` twin masquerade. Not applied here, and reported: the `Local` traffic
//! policies, ClientIP affinity, `loadBalancerSourceRanges`, topology; a
//! port without endpoints is left out (not rejected).
//!
//! SCTP Services with a changing port are rare: the table is rewritten
//! whole (one `nft -f -` transaction) when it changes, and never touched on
//! a node that has none.

use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr};

use anyhow::{Context, Result};
use tracing::{debug, info};

use crate::{
    model::{ServicePort, usable_endpoints},
    sys::nft::{self, Nft},
};

pub const FAMILY: &str = "inet";
pub const TABLE: &str = "xproxy-sctp";
/// The family of the table before it served IPv6 too: an agent of that
/// time leaves `ip xproxy-sctp`, which would DNAT beside the new table.
const EARLIER_FAMILY: &str = "ip";

/// What the fallback leaves out of a port it serves, for the mode's report.
pub const NOT_APPLIED: &str = "SCTP through the ebpf mode's kernel fallback (inet xproxy-sctp): \
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
    pub fn set(&mut self, name: &str, port: Option<&ServicePort>) {
        match port {
            Some(port) => self.ports.insert(name.to_owned(), port.clone()),
            None => self.ports.remove(name),
        };
    }

    /// Serves exactly `ports`.
    pub fn replace<'a>(&mut self, ports: impl IntoIterator<Item = &'a ServicePort>) {
        self.ports = ports.into_iter().map(|p| (p.name.clone(), p.clone())).collect();
    }

    /// Writes the table for the ports taken in, node ports on `node_ips`
    /// (of either family), if it differs from what was written last. The
    /// first sync removes an earlier agent's tables; with no port to serve
    /// it does nothing else (nft is not needed on a node without such
    /// ports).
    pub fn sync(&mut self, node_ips: &[IpAddr]) -> Result<()> {
        let script = render(self.ports.values(), node_ips, self.mark, self.masquerade_all);
        if self.written.as_deref() == Some(script.as_str()) {
            return Ok(());
        }
        if self.written.is_none() {
            self.remove_leftovers()?;
            if self.ports.is_empty() {
                self.written = Some(script);
                return Ok(());
            }
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
    /// Removes an earlier agent's tables, of this layout and the IPv4-only
    /// one before it, if there are any.
    fn remove_leftovers(&mut self) -> Result<()> {
        for family in [FAMILY, EARLIER_FAMILY] {
            self.remove_leftover(family)?;
        }
        Ok(())
    }

    /// Removes `family`'s table, if there is one. A node without nft (or
    /// nf_tables) has none: that is no error.
    fn remove_leftover(&mut self, family: &str) -> Result<()> {
        match self.nft.list_table(family, TABLE) {
            Ok(Some(_)) => {
                nft::delete_table(self.nft.as_mut(), family, TABLE)?;
                info!(family, table = TABLE, "removed an earlier agent's SCTP fallback table");
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
    node_ips: &[IpAddr],
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
/// external and load balancer IPs and its node port (on the node's
/// addresses of the port's family) to its external chain.
fn frontend_rules(i: usize, port: &ServicePort, node_ips: &[IpAddr]) -> Vec<String> {
    let mut rules = vec![format!(
        "{} daddr {} sctp dport {} goto service-{i}",
        family_of(port.cluster_ip),
        port.cluster_ip,
        port.port
    )];
    for ip in port.external_ips.iter().chain(&port.load_balancer_ips) {
        rules.push(format!(
            "{} daddr {ip} sctp dport {} goto external-{i}",
            family_of(*ip),
            port.port
        ));
    }
    let own_family = |ip: &&IpAddr| ip.is_ipv4() == port.cluster_ip.is_ipv4();
    let ips: Vec<String> = node_ips.iter().filter(own_family).map(ToString::to_string).collect();
    if let Some(node_port) = port.node_port
        && !ips.is_empty()
    {
        rules.push(format!(
            "{} daddr {{ {} }} sctp dport {node_port} goto external-{i}",
            family_of(port.cluster_ip),
            ips.join(", ")
        ));
    }
    rules
}

/// The nft keyword of `ip`'s family, for matches and NAT in an `inet`
/// table.
fn family_of(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { "ip" } else { "ip6" }
}

/// `ip` and `port` as a NAT target (an IPv6 address in brackets).
fn nat_target(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{ip}:{port}"),
        IpAddr::V6(ip) => format!("[{ip}]:{port}"),
    }
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
            let _ = writeln!(
                out,
                "\t\t{} saddr {} {set_mark}",
                family_of(endpoint.addr),
                endpoint.addr
            );
        }
        let _ = writeln!(
            out,
            "\t\tmeta l4proto sctp dnat {} to {}\n\t}}",
            family_of(endpoint.addr),
            nat_target(endpoint.addr, endpoint.port)
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
    SctpFallback::new(Box::new(system), 0, false).remove_leftovers()
}

/// Whether `port` needs more than the fallback does, for the report.
pub fn leaves_out(port: &ServicePort) -> bool {
    port.external_local() || port.internal_local() || port.affinity.is_some() || !port.source_ranges.is_empty()
}

#[cfg(test)]
#[path = "sctp_fallback_tests.rs"]
mod tests;
