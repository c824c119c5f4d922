//! The one table `xproxy status` prints for every mode: each frontend
//! (protocol, address, port, kind) with its backends and, where the mode
//! knows them, the flows on each. Every mode's read-back fills it from
//! what that mode programmed in the kernel; this file only holds, merges,
//! counts and prints it.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::{
    model::{IpFamily, Protocol},
    sys::conntrack::{self, Entry, Tuple},
};

/// What kind of address a frontend is. The rule-based modes cannot
/// always tell an external IP from a load balancer IP: [`Kind::External`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    ClusterIp,
    NodePort,
    ExternalIp,
    LoadBalancer,
    /// An external IP or a load balancer IP (the rules do not say which).
    External,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::ClusterIp => "ClusterIP",
            Kind::NodePort => "NodePort",
            Kind::ExternalIp => "ExternalIP",
            Kind::LoadBalancer => "LoadBalancer",
            Kind::External => "External",
        }
    }
}

/// One backend of a frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backend {
    /// `None` where the mode's state is out of step (an ebpf slot without
    /// its backend).
    pub addr: Option<(IpAddr, u16)>,
    /// Flows on this backend through this frontend; `None` where the mode
    /// cannot tell.
    pub flows: Option<u64>,
    /// Anything else the mode says about it (an IPVS weight of 0, ...).
    pub notes: Vec<String>,
}

impl Backend {
    pub fn new(addr: impl Into<IpAddr>, port: u16) -> Self {
        Self {
            addr: Some((addr.into(), port)),
            flows: None,
            notes: Vec::new(),
        }
    }
}

/// One address and port a client can reach a Service port on.
/// `0.0.0.0` (`::` for IPv6) stands for "every local address" of its
/// family (a NodePort the rules match by `--dst-type LOCAL` / `fib daddr
/// type local`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    pub proto: Protocol,
    pub addr: IpAddr,
    pub port: u16,
    pub kind: Kind,
    /// A `Local` traffic policy: only this node's endpoints.
    pub local_only: bool,
    /// ClientIP session affinity, its timeout in seconds.
    pub affinity_seconds: Option<u32>,
    /// loadBalancerSourceRanges, as the mode wrote them (empty: the mode
    /// filters nothing, or does not say what).
    pub source_ranges: Vec<String>,
    /// The mode restricts the sources but its rules do not list them.
    pub source_filtered: bool,
    /// The Service port's name (`namespace/name:port`) where the rules
    /// carry it.
    pub service: Option<String>,
    pub backends: Vec<Backend>,
    /// Anything else the mode says about it (a scheduler, ...).
    pub notes: Vec<String>,
}

impl Frontend {
    pub fn new(proto: Protocol, addr: impl Into<IpAddr>, port: u16, kind: Kind) -> Self {
        Self {
            proto,
            addr: addr.into(),
            port,
            kind,
            local_only: false,
            affinity_seconds: None,
            source_ranges: Vec::new(),
            source_filtered: false,
            service: None,
            backends: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Whether a connection to `dst:dport` over `proto` is addressed to
    /// this frontend (`0.0.0.0` taking any IPv4 address, `::` any IPv6 one).
    fn serves(&self, proto: u8, dst: IpAddr, dport: u16) -> bool {
        let any_of_family = self.addr.is_unspecified() && self.addr.is_ipv4() == dst.is_ipv4();
        self.proto.number() == proto && self.port == dport && (self.addr == dst || any_of_family)
    }
}

/// Every frontend of one mode, sorted by protocol, address, port, kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    pub mode: &'static str,
    pub frontends: Vec<Frontend>,
}

impl Table {
    pub fn new(mode: &'static str, mut frontends: Vec<Frontend>) -> Self {
        frontends.sort_by_key(|f| (f.proto.number(), f.addr, f.port, f.kind));
        Self { mode, frontends }
    }

    /// The frontend `(proto, addr, port)`, if listed.
    pub fn find(&self, proto: Protocol, addr: impl Into<IpAddr>, port: u16) -> Option<&Frontend> {
        let addr = addr.into();
        self.frontends
            .iter()
            .find(|f| f.proto == proto && f.addr == addr && f.port == port)
    }

    /// Counts the kernel's DNATed connections per backend: a connection
    /// belongs to the most specific frontend it was addressed to (its own
    /// address before `0.0.0.0` or `::`) and to the backend its replies
    /// come from. Every backend of every frontend gets a count, 0 if it has
    /// none.
    pub fn count_flows<A: Copy + Into<IpAddr>>(&mut self, entries: &[Entry<A>]) {
        let mut counts: BTreeMap<(usize, (IpAddr, u16)), u64> = BTreeMap::new();
        for entry in entries.iter().filter(|e| e.dst_nat) {
            let (proto, dst, dport) = (entry.orig.proto, entry.orig.dst.into(), entry.orig.dport);
            let exact = self
                .frontends
                .iter()
                .position(|f| f.serves(proto, dst, dport) && f.addr == dst);
            let Some(index) = exact.or_else(|| self.frontends.iter().position(|f| f.serves(proto, dst, dport))) else {
                continue;
            };
            *counts
                .entry((index, (entry.reply.src.into(), entry.reply.sport)))
                .or_default() += 1;
        }
        for (index, frontend) in self.frontends.iter_mut().enumerate() {
            for backend in &mut frontend.backends {
                backend.flows = Some(
                    backend
                        .addr
                        .map_or(0, |a| counts.get(&(index, a)).copied().unwrap_or(0)),
                );
            }
        }
    }

    /// The table as text, laid out like `ipvsadm -Ln`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "Prot LocalAddress:Port Kind");
        let _ = writeln!(out, "  -> RemoteAddress:Port           Flows");
        for f in &self.frontends {
            let _ = writeln!(
                out,
                "{:<4} {} {}{}{}",
                f.proto.to_string(),
                SocketAddr::new(f.addr, f.port),
                f.kind.name(),
                empty_note(f),
                details(f)
            );
            for b in &f.backends {
                let addr = b.addr.map_or_else(
                    || "<missing>".to_string(),
                    |(ip, port)| SocketAddr::new(ip, port).to_string(),
                );
                let flows = b.flows.map_or_else(|| "-".to_string(), |n| n.to_string());
                let notes = if b.notes.is_empty() {
                    String::new()
                } else {
                    format!(" [{}]", b.notes.join("; "))
                };
                let _ = writeln!(out, "  -> {addr:<28} {flows}{notes}");
            }
        }
        out
    }

    /// The table as JSON: `{"mode": ..., "frontends": [...]}`.
    pub fn to_json(&self) -> Value {
        let frontends: Vec<Value> = self.frontends.iter().map(frontend_json).collect();
        json!({ "mode": self.mode, "frontends": frontends })
    }
}

/// What happens to new flows of a frontend without backends, or that its
/// backends are this node's only; as the ebpf table always said it.
fn empty_note(f: &Frontend) -> &'static str {
    match (f.local_only, f.backends.is_empty()) {
        (false, true) => " (no endpoints: reject)",
        (true, true) => " (Local, no endpoint on this node: drop)",
        (true, false) => " (Local: this node's endpoints)",
        (false, false) => "",
    }
}

/// Affinity, source ranges, the Service's name and the mode's notes, in
/// brackets after the frontend.
fn details(f: &Frontend) -> String {
    let mut parts = Vec::new();
    if let Some(seconds) = f.affinity_seconds {
        parts.push(format!("affinity ClientIP {seconds}s"));
    }
    if !f.source_ranges.is_empty() {
        parts.push(format!("source ranges {}", f.source_ranges.join(",")));
    } else if f.source_filtered {
        parts.push("source ranges".to_string());
    }
    parts.extend(f.notes.iter().cloned());
    if let Some(service) = &f.service {
        parts.push(service.clone());
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" [{}]", parts.join("; "))
    }
}

fn frontend_json(f: &Frontend) -> Value {
    let backends: Vec<Value> = f
        .backends
        .iter()
        .map(|b| {
            json!({
                "address": b.addr.map(|(ip, _)| ip.to_string()),
                "port": b.addr.map(|(_, port)| port),
                "flows": b.flows,
                "notes": b.notes,
            })
        })
        .collect();
    json!({
        "protocol": f.proto.to_string(),
        "address": f.addr.to_string(),
        "port": f.port,
        "kind": f.kind.name(),
        "localOnly": f.local_only,
        "affinitySeconds": f.affinity_seconds,
        "sourceRanges": f.source_ranges,
        "sourceFiltered": f.source_filtered,
        "service": f.service,
        "notes": f.notes,
        "backends": backends,
    })
}

/// What a frontend's rules lead to, as a mode's chain walk finds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leads {
    pub backends: Vec<(IpAddr, u16)>,
    pub local_only: bool,
    pub affinity_seconds: Option<u32>,
    pub source_ranges: Vec<String>,
    pub source_filtered: bool,
}

impl Frontend {
    /// Adds what a walk from one of the frontend's rules found, and the
    /// Service's name if it has none yet.
    pub fn add(&mut self, leads: Leads, service: Option<String>) {
        self.service = self.service.take().or(service);
        self.local_only |= leads.local_only;
        self.affinity_seconds = self.affinity_seconds.or(leads.affinity_seconds);
        self.source_filtered |= leads.source_filtered;
        self.source_ranges.extend(leads.source_ranges);
        add_backends(self, leads.backends);
    }
}

impl Kind {
    /// The kind of an address frontend in kube-proxy's rule layouts: its
    /// comment says which external address it is (`... external IP`,
    /// `... loadbalancer IP`); else a firewall chain means a load
    /// balancer IP, an external chain an external or load balancer IP,
    /// anything else a ClusterIP.
    pub fn of_address(comment: Option<&str>, to_firewall: bool, to_external: bool) -> Kind {
        let comment = comment.unwrap_or_default();
        if to_firewall || comment.ends_with("loadbalancer IP") {
            Kind::LoadBalancer
        } else if comment.ends_with("external IP") {
            Kind::ExternalIp
        } else if to_external {
            Kind::External
        } else {
            Kind::ClusterIp
        }
    }
}

/// `(frontend, backends)` per frontend, for tests comparing tables.
#[cfg(test)]
pub fn rows(table: &Table) -> Vec<(String, Vec<String>)> {
    table
        .frontends
        .iter()
        .map(|f| {
            let backends = f
                .backends
                .iter()
                .filter_map(|b| b.addr.map(|(a, p)| SocketAddr::new(a, p).to_string()))
                .collect();
            (
                format!("{} {} {}", f.proto, SocketAddr::new(f.addr, f.port), f.kind.name()),
                backends,
            )
        })
        .collect()
}

/// A dual-stack table split by family: the IPv4 frontends, and the IPv6
/// ones as a table of their own (for tests checking that the IPv4 half is
/// what an IPv4-only read-back gives).
#[cfg(test)]
pub fn split_families(table: &Table) -> (Vec<Frontend>, Table) {
    let (ipv4, ipv6) = table.frontends.iter().cloned().partition(|f| f.addr.is_ipv4());
    (ipv4, Table::new(table.mode, ipv6))
}

/// Frontends gathered from several places of one mode's state (a rule
/// with endpoints in one table, a REJECT in another), merged by protocol,
/// address, port and kind: later facts add to earlier ones.
#[derive(Default)]
pub struct Frontends {
    by_key: BTreeMap<(u8, IpAddr, u16, Kind), Frontend>,
}

impl Frontends {
    /// The frontend of that key, created empty on first use.
    pub fn entry(&mut self, proto: Protocol, addr: impl Into<IpAddr>, port: u16, kind: Kind) -> &mut Frontend {
        let addr = addr.into();
        self.by_key
            .entry((proto.number(), addr, port, kind))
            .or_insert_with(|| Frontend::new(proto, addr, port, kind))
    }

    /// The frontend of that address and port whatever its kind (a
    /// refusal found apart from the dispatch rules joins the frontend they
    /// gave a kind), else a new one of `kind`.
    pub fn entry_any_kind(&mut self, proto: Protocol, addr: impl Into<IpAddr>, port: u16, kind: Kind) -> &mut Frontend {
        let addr = addr.into();
        let known = self
            .by_key
            .keys()
            .find(|(p, a, o, _)| *p == proto.number() && *a == addr && *o == port)
            .map(|k| k.3);
        self.entry(proto, addr, port, known.unwrap_or(kind))
    }

    pub fn into_table(self, mode: &'static str) -> Table {
        Table::new(mode, self.by_key.into_values().collect())
    }
}

/// Adds `backends` to `frontend`, each once, in order.
pub fn add_backends<A: Into<IpAddr>>(frontend: &mut Frontend, backends: impl IntoIterator<Item = (A, u16)>) {
    let mut seen: BTreeSet<(IpAddr, u16)> = frontend.backends.iter().filter_map(|b| b.addr).collect();
    for (ip, port) in backends {
        let ip = ip.into();
        if seen.insert((ip, port)) {
            frontend.backends.push(Backend::new(ip, port));
        }
    }
}

/// "Every local address" of `family` in a frontend (`0.0.0.0`, `::`).
pub fn any_address(family: IpFamily) -> IpAddr {
    match family {
        IpFamily::V4 => Ipv4Addr::UNSPECIFIED.into(),
        IpFamily::V6 => Ipv6Addr::UNSPECIFIED.into(),
    }
}

/// The kernel's conntrack entries of both families (the rule-based
/// modes count their flows from them), addresses widened to [`IpAddr`].
pub fn kernel_flows() -> Result<Vec<Entry<IpAddr>>> {
    let v4 = conntrack::list_entries_of::<Ipv4Addr>().context("listing the IPv4 conntrack table")?;
    let v6 = conntrack::list_entries_of::<Ipv6Addr>().context("listing the IPv6 conntrack table")?;
    Ok(v4.into_iter().map(widen).chain(v6.into_iter().map(widen)).collect())
}

pub(super) fn widen<A: Into<IpAddr>>(entry: Entry<A>) -> Entry<IpAddr> {
    let tuple = |t: Tuple<A>| Tuple {
        src: t.src.into(),
        dst: t.dst.into(),
        proto: t.proto,
        sport: t.sport,
        dport: t.dport,
    };
    Entry::new(tuple(entry.orig), tuple(entry.reply), entry.dst_nat)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::conntrack::Tuple;

    const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 88);
    const POD1: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
    const POD2: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 12);
    const NODE: Ipv4Addr = Ipv4Addr::new(172, 30, 0, 2);

    fn flow(dst: Ipv4Addr, dport: u16, backend: Ipv4Addr) -> Entry {
        let client = Ipv4Addr::new(172, 30, 0, 9);
        Entry::new(
            Tuple {
                src: client,
                dst,
                proto: 6,
                sport: 40000,
                dport,
            },
            Tuple {
                src: backend,
                dst: client,
                proto: 6,
                sport: 80,
                dport: 40000,
            },
            true,
        )
    }

    fn seed() -> Table {
        let mut cluster = Frontend::new(Protocol::Tcp, VIP, 88, Kind::ClusterIp);
        add_backends(&mut cluster, [(POD1, 80), (POD2, 80)]);
        cluster.affinity_seconds = Some(10800);
        cluster.service = Some("default/nginx-service".into());
        let mut node_port = Frontend::new(Protocol::Tcp, Ipv4Addr::UNSPECIFIED, 30791, Kind::NodePort);
        add_backends(&mut node_port, [(POD1, 80), (POD2, 80), (POD1, 80)]);
        node_port.local_only = true;
        let mut lb = Frontend::new(Protocol::Tcp, Ipv4Addr::new(192, 0, 2, 10), 88, Kind::LoadBalancer);
        lb.source_ranges = vec!["198.51.100.0/24".into()];
        lb.local_only = true;
        Table::new("iptables", vec![node_port, lb, cluster])
    }

    #[test]
    fn flows_go_to_the_most_specific_frontend_and_its_backend() {
        let mut table = seed();
        table.count_flows(&[
            flow(VIP, 88, POD1),
            flow(VIP, 88, POD1),
            flow(NODE, 30791, POD2),
            // Not DNATed, or to nothing listed: not counted.
            Entry::new(flow(VIP, 88, POD2).orig, flow(VIP, 88, POD2).reply, false),
            flow(VIP, 99, POD2),
        ]);
        let flows = |addr, port| -> Vec<Option<u64>> {
            let f = table.find(Protocol::Tcp, addr, port).expect("listed");
            f.backends.iter().map(|b| b.flows).collect()
        };
        assert_eq!(flows(VIP, 88), [Some(2), Some(0)]);
        assert_eq!(flows(Ipv4Addr::UNSPECIFIED, 30791), [Some(0), Some(1)]);
    }

    #[test]
    fn renders_one_layout_for_every_mode() {
        let expected = "\
Prot LocalAddress:Port Kind
  -> RemoteAddress:Port           Flows
TCP  0.0.0.0:30791 NodePort (Local: this node's endpoints)
  -> 10.244.0.11:80               -
  -> 10.244.0.12:80               -
TCP  10.96.0.88:88 ClusterIP [affinity ClientIP 10800s; default/nginx-service]
  -> 10.244.0.11:80               -
  -> 10.244.0.12:80               -
TCP  192.0.2.10:88 LoadBalancer (Local, no endpoint on this node: drop) [source ranges 198.51.100.0/24]
";
        assert_eq!(seed().render(), expected);
    }

    #[test]
    fn json_names_every_field() {
        let json = seed().to_json();
        assert_eq!(json["mode"], "iptables");
        let cluster = &json["frontends"][1];
        assert_eq!(cluster["kind"], "ClusterIP");
        assert_eq!(cluster["affinitySeconds"], 10800);
        assert_eq!(cluster["backends"][1]["address"], "10.244.0.12");
        assert_eq!(cluster["backends"][1]["flows"], Value::Null);
        assert_eq!(json["frontends"][2]["sourceRanges"][0], "198.51.100.0/24");
    }
}
