//! The iptables mode read back from `iptables-save`: the frontends are the
//! nat table's `KUBE-SERVICES` and `KUBE-NODEPORTS` rules (and the filter
//! table's REJECT/DROP rules for ports without endpoints); each one's
//! backends are found by following its jump through `KUBE-FW-*` (source
//! ranges), `KUBE-EXT-*`, `KUBE-SVC-*`/`KUBE-SVL-*` (affinity: `-m recent
//! --rcheck --seconds`) to the `KUBE-SEP-*` DNATs. Flow counts come from
//! the kernel's conntrack table. The IPv6 half of dual-stack Services is
//! the same layout in `ip6tables-save`, read the same way.
//!
//! kube-proxy's rule shapes are read by their parts (`-d`, `--dport`,
//! `-j`, `--to-destination`, ...), never matched whole: a rule or chain
//! this file does not know is skipped, so a future rule shape adds
//! nothing rather than breaking the table.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use anyhow::Result;

use super::{
    saved_rules, saved_table,
    table::{Frontends, Kind, Leads, Table, any_address, kernel_flows},
};
use crate::{
    model::{IpFamily, Protocol},
    sys::iptables::Saved,
};

/// Reads both families' rules and the conntrack tables of the calling
/// thread's network namespace.
pub fn read_back() -> Result<Table> {
    let mut table = parse_families(&saved_rules(IpFamily::V4)?, &saved_rules(IpFamily::V6)?);
    table.count_flows(&kernel_flows()?);
    Ok(table)
}

/// Whether `saved` holds the iptables mode's chains (not the IPVS mode's
/// constant ones, which share `KUBE-SERVICES`).
pub fn in_use(saved: &Saved) -> bool {
    saved
        .table("nat")
        .is_some_and(|nat| nat.chains.iter().any(|c| is_dispatch_chain(c)))
}

/// The table of the IPv4 rules in `saved` (`iptables-save` output), flows
/// unknown.
pub fn parse(saved: &str) -> Table {
    parse_families(saved, "")
}

/// The table of both families' rules (`iptables-save` and
/// `ip6tables-save` output), flows unknown.
pub fn parse_families(saved_v4: &str, saved_v6: &str) -> Table {
    saved_table("iptables", saved_v4, saved_v6, add_saved)
}

/// The frontends of one family's saved rules.
fn add_saved(frontends: &mut Frontends, saved: &str, family: IpFamily) {
    let saved = Saved::parse(saved);
    let nat = Chains::of(&saved, "nat");
    let filter = Chains::of(&saved, "filter");
    for (chain, kind_of_nodeports) in [("KUBE-SERVICES", false), ("KUBE-NODEPORTS", true)] {
        for rule in nat.rules(chain) {
            add_dispatch(frontends, &nat, rule, kind_of_nodeports, family);
        }
    }
    for chain in ["KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-NODEPORTS"] {
        for rule in filter.rules(chain) {
            add_refusal(frontends, rule, chain, family);
        }
    }
}

/// Per-service chains whose rules lead to endpoints.
fn is_dispatch_chain(chain: &str) -> bool {
    ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-"]
        .iter()
        .any(|p| chain.starts_with(p))
}

/// A nat rule jumping from a fixed chain into a service's chains: one
/// frontend, with what those chains lead to.
fn add_dispatch(frontends: &mut Frontends, nat: &Chains, rule: &Rule, node_ports: bool, family: IpFamily) {
    let (Some(proto), Some(port), Some(target)) = (rule.proto, rule.dport, rule.target.as_deref()) else {
        return;
    };
    if !is_dispatch_chain(target) {
        return;
    }
    let addr = rule.dst.unwrap_or(any_address(family));
    let kind = if node_ports {
        Kind::NodePort
    } else {
        Kind::of_address(
            rule.comment.as_deref(),
            target.starts_with("KUBE-FW-"),
            target.starts_with("KUBE-EXT-"),
        )
    };
    let found = nat.resolve(target);
    frontends.entry(proto, addr, port, kind).add(found, rule.service());
}

/// A filter rule refusing a port without endpoints: REJECT (none at all)
/// or DROP (none on this node, `Local`).
fn add_refusal(frontends: &mut Frontends, rule: &Rule, chain: &str, family: IpFamily) {
    let (Some(proto), Some(port), Some(target)) = (rule.proto, rule.dport, rule.target.as_deref()) else {
        return;
    };
    let dropped = match target {
        "REJECT" => false,
        "DROP" => true,
        _ => return,
    };
    let (addr, kind) = match (rule.dst, chain) {
        (Some(addr), "KUBE-SERVICES") => (addr, Kind::ClusterIp),
        (Some(addr), _) => (addr, Kind::External),
        (None, _) if rule.dst_local => (any_address(family), Kind::NodePort),
        (None, _) => return,
    };
    let frontend = frontends.entry_any_kind(proto, addr, port, kind);
    frontend.local_only |= dropped;
    frontend.service = frontend.service.take().or_else(|| rule.service());
}

/// One table's rules by chain.
struct Chains<'a> {
    rules: BTreeMap<&'a str, Vec<Rule>>,
}

/// How deep a jump chain may go: kube-proxy's is FW -> EXT -> SVL -> SEP.
const MAX_DEPTH: usize = 8;

impl<'a> Chains<'a> {
    fn of(saved: &'a Saved, table: &str) -> Self {
        let mut rules: BTreeMap<&str, Vec<Rule>> = BTreeMap::new();
        for line in saved.table(table).map(|t| t.rules.as_slice()).unwrap_or_default() {
            if let Some(rule) = Rule::parse(line) {
                rules
                    .entry(crate::sys::iptables::rule_chain(line).unwrap_or_default())
                    .or_default()
                    .push(rule);
            }
        }
        Self { rules }
    }

    fn rules(&self, chain: &str) -> &[Rule] {
        self.rules.get(chain).map_or(&[], Vec::as_slice)
    }

    fn resolve(&self, chain: &str) -> Leads {
        let mut found = Leads::default();
        self.walk(chain, 0, &mut BTreeSet::new(), &mut found);
        found
    }

    fn walk(&self, chain: &str, depth: usize, seen: &mut BTreeSet<String>, found: &mut Leads) {
        if depth > MAX_DEPTH || !seen.insert(chain.to_owned()) {
            return;
        }
        found.local_only |= chain.starts_with("KUBE-SVL-");
        let rules = self.rules(chain);
        // An external chain of a `Local` Service sends pods and the node
        // to the cluster-wide chain, everyone else to this node's: the
        // frontend's backends are the latter.
        let local = chain
            .starts_with("KUBE-EXT-")
            .then(|| {
                rules
                    .iter()
                    .find_map(|r| r.target.as_deref().filter(|t| t.starts_with("KUBE-SVL-")))
            })
            .flatten();
        found.local_only |= local.is_some();
        for rule in rules {
            if let Some(to) = rule.to_destination {
                found.backends.push(to);
            }
            if rule.recent_seconds.is_some() {
                found.affinity_seconds = rule.recent_seconds;
            }
            let Some(target) = rule.target.as_deref() else {
                continue;
            };
            if target == "KUBE-MARK-DROP" || target == "DROP" {
                found.source_filtered |= chain.starts_with("KUBE-FW-");
            }
            if chain.starts_with("KUBE-FW-")
                && let Some(source) = &rule.src
                && is_dispatch_chain(target)
            {
                found.source_filtered = true;
                found.source_ranges.push(source.clone());
            }
            if local.is_some_and(|l| l != target) || !self.rules.contains_key(target) {
                continue;
            }
            self.walk(target, depth + 1, seen, found);
        }
    }
}

/// The parts of a saved rule the read-back looks at (the userspace
/// mode's read-back too).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Rule {
    pub proto: Option<Protocol>,
    /// `-d ADDR/32` (`ADDR/128`).
    pub dst: Option<IpAddr>,
    /// `-m addrtype --dst-type LOCAL`.
    pub dst_local: bool,
    /// `-s CIDR` (not negated).
    src: Option<String>,
    pub dport: Option<u16>,
    comment: Option<String>,
    pub target: Option<String>,
    /// `--to-destination IP:PORT` (`[IP]:PORT`) of a DNAT.
    pub to_destination: Option<(IpAddr, u16)>,
    /// `--to-ports PORT` of a REDIRECT.
    pub to_ports: Option<u16>,
    /// `-m recent --rcheck --seconds N`: ClientIP affinity.
    recent_seconds: Option<u32>,
}

impl Rule {
    pub fn parse(line: &str) -> Option<Self> {
        let words = words(line.strip_prefix("-A ")?);
        let mut rule = Rule::default();
        let mut negated = false;
        let mut rcheck = false;
        let mut seconds = None;
        let mut i = 1;
        while i < words.len() {
            let value = words.get(i + 1).map(String::as_str);
            let mut took = 1;
            match (words[i].as_str(), value) {
                ("!", _) => {
                    negated = true;
                    i += 1;
                    continue;
                }
                ("-p", Some(v)) => {
                    rule.proto = Protocol::from_lowercase(v);
                    took = 2;
                }
                ("-d", Some(v)) => {
                    rule.dst = (!negated).then(|| host(v)).flatten();
                    took = 2;
                }
                ("-s", Some(v)) => {
                    rule.src = (!negated).then(|| v.to_owned());
                    took = 2;
                }
                ("--dport", Some(v)) => {
                    rule.dport = v.parse().ok();
                    took = 2;
                }
                ("--dst-type", Some(v)) => {
                    rule.dst_local = !negated && v == "LOCAL";
                    took = 2;
                }
                ("--comment", Some(v)) => {
                    rule.comment = Some(v.to_owned());
                    took = 2;
                }
                ("-j" | "-g", Some(v)) => {
                    rule.target = Some(v.to_owned());
                    took = 2;
                }
                ("--to-destination", Some(v)) => {
                    rule.to_destination = socket_addr(v);
                    took = 2;
                }
                ("--to-ports", Some(v)) => {
                    rule.to_ports = v.parse().ok();
                    took = 2;
                }
                ("--seconds", Some(v)) => {
                    seconds = v.parse().ok();
                    took = 2;
                }
                ("--rcheck", _) => rcheck = true,
                _ => {}
            }
            negated = false;
            i += took;
        }
        rule.recent_seconds = seconds.filter(|_| rcheck);
        Some(rule)
    }

    /// `namespace/name[:port]`: the first word of kube-proxy's comment.
    pub fn service(&self) -> Option<String> {
        let first = self.comment.as_deref()?.split_whitespace().next()?;
        first.contains('/').then(|| first.to_owned())
    }
}

/// `A.B.C.D/32`, `X::Y/128` (or a bare address): one host; a wider
/// network is no frontend.
fn host(cidr: &str) -> Option<IpAddr> {
    let (addr, bits) = match cidr.split_once('/') {
        Some((addr, bits)) => (addr.parse::<IpAddr>().ok()?, Some(bits)),
        None => (cidr.parse().ok()?, None),
    };
    let one_host = IpFamily::of(addr).bits().to_string();
    bits.is_none_or(|b| b == one_host).then_some(addr)
}

/// `A.B.C.D:PORT` or `[X::Y]:PORT`.
fn socket_addr(text: &str) -> Option<(IpAddr, u16)> {
    let addr: SocketAddr = text.parse().ok()?;
    Some((addr.ip(), addr.port()))
}

/// The words of a saved rule, a double-quoted comment as one word (with
/// `\"` inside it), as `iptables-save` quotes them.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut chars = line.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut word = String::new();
        if c == '"' {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => word.extend(chars.next()),
                    '"' => break,
                    c => word.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                word.push(c);
                chars.next();
            }
        }
        words.push(word);
    }
    words
}

#[cfg(test)]
mod tests;
