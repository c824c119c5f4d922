//! The nftables mode read back from `nft -j list table ip xproxy` (and
//! `ip6 xproxy`, the IPv6 half of dual-stack Services, read the same way): the
//! frontends are the elements of its verdict maps keyed by `address .
//! protocol . port` (ClusterIPs, external and load balancer IPs) or by
//! `protocol . port` (NodePorts, on every local address); each element's
//! chain is followed (`external-*` -> `service-*`/`local-*` ->
//! `endpoint-*`) to the `dnat to` of every endpoint. A referenced set with
//! a timeout named `affinity-*` is ClientIP affinity; a `firewall-*`
//! chain's `ip saddr != {...} drop` lists the source ranges. Flow counts
//! come from the kernel's conntrack table.
//!
//! The JSON is walked by what it holds, not by a fixed layout: objects
//! and chains it does not know are skipped.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::table::{Frontend, Frontends, Kind, Leads, Table, any_address, kernel_flows};
use crate::{
    mode::nftables::names::{TABLE, nft_family},
    model::{IpFamily, Protocol},
    sys::tool,
};

const NFT: &str = "nft";
const PACKAGE: &str = "the nftables package";
const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

/// The JSON listing of the mode's table of `family`, `None` if there is
/// none.
fn list_json(family: IpFamily) -> Result<Option<String>> {
    let args = ["-j", "list", "table", nft_family(family), TABLE];
    let out = tool::run(NFT, &args, PACKAGE)?;
    if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No such file or directory") {
        return Ok(None);
    }
    tool::stdout_of(NFT, &args, out).map(Some)
}

/// Whether the mode has a table of either family.
pub fn in_use() -> Result<bool> {
    for family in FAMILIES {
        if list_json(family)?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Reads the tables of both families and the conntrack tables of the
/// calling thread's network namespace.
pub fn read_back() -> Result<Table> {
    let mut listed = Vec::new();
    for family in FAMILIES {
        if let Some(json) = list_json(family)? {
            listed.push((family, json));
        }
    }
    if listed.is_empty() {
        bail!(
            "there is no table {} {TABLE} nor {} {TABLE}",
            nft_family(IpFamily::V4),
            nft_family(IpFamily::V6)
        );
    }
    let tables: Vec<(IpFamily, &str)> = listed.iter().map(|(f, json)| (*f, json.as_str())).collect();
    let mut table = parse_tables(&tables)?;
    table.count_flows(&kernel_flows()?);
    Ok(table)
}

/// The table of an `nft -j list table ip xproxy` output, flows unknown.
pub fn parse(json: &str) -> Result<Table> {
    parse_tables(&[(IpFamily::V4, json)])
}

/// The table of the `nft -j list` outputs of each family's table, flows
/// unknown.
pub fn parse_tables(tables: &[(IpFamily, &str)]) -> Result<Table> {
    let mut frontends = Frontends::default();
    for (family, json) in tables {
        add_table(&mut frontends, json, *family)
            .with_context(|| format!("reading the table {} {TABLE}", nft_family(*family)))?;
    }
    Ok(frontends.into_table("nftables"))
}

/// The frontends of one family's table.
fn add_table(frontends: &mut Frontends, json: &str, family: IpFamily) -> Result<()> {
    let value: Value = serde_json::from_str(json).context("parsing the output of nft -j")?;
    let ruleset = Ruleset::of(&value);
    let mut elements: Vec<(bool, &VerdictMap, &Element, Resolved)> = Vec::new();
    for map in &ruleset.maps {
        for element in &map.elements {
            let found = element.target.as_deref().map_or_else(
                // A plain drop: `Local` without a local endpoint.
                || Resolved {
                    dispatches: false,
                    leads: Leads {
                        local_only: true,
                        ..Leads::default()
                    },
                },
                |target| ruleset.resolve(target),
            );
            elements.push((!found.dispatches, map, element, found));
        }
    }
    // Dispatches first: they give each frontend its kind; refusals and
    // filters join them.
    elements.sort_by_key(|(refusal, ..)| *refusal);
    for (_, map, element, found) in elements {
        add_element(frontends, map, element, found, family);
    }
    Ok(())
}

/// One verdict map element: its key, comment and verdict (a chain, or
/// `None` for a plain `drop`).
struct Element {
    key: Vec<Value>,
    comment: Option<String>,
    target: Option<String>,
}

/// A verdict map whose key names frontends.
struct VerdictMap {
    /// `true`: `address . protocol . port`; `false`: `protocol . port`.
    with_address: bool,
    elements: Vec<Element>,
}

/// What the read-back uses of the table.
#[derive(Default)]
struct Ruleset {
    maps: Vec<VerdictMap>,
    /// Set name -> its timeout in seconds (dynamic sets).
    timeouts: BTreeMap<String, u32>,
    /// Set name -> its elements, as written.
    set_elements: BTreeMap<String, Vec<String>>,
    /// Chain name -> the expressions of each of its rules.
    chains: BTreeMap<String, Vec<Vec<Value>>>,
}

impl Ruleset {
    fn of(value: &Value) -> Self {
        let mut ruleset = Ruleset::default();
        let objects = value.get("nftables").and_then(Value::as_array);
        for object in objects.map(Vec::as_slice).unwrap_or_default() {
            if let Some(map) = object.get("map") {
                ruleset.maps.extend(verdict_map(map));
            } else if let Some(set) = object.get("set") {
                ruleset.add_set(set);
            } else if let Some(rule) = object.get("rule") {
                let chain = rule.get("chain").and_then(Value::as_str);
                let expr = rule.get("expr").and_then(Value::as_array);
                if let (Some(chain), Some(expr)) = (chain, expr) {
                    ruleset.chains.entry(chain.to_owned()).or_default().push(expr.clone());
                }
            }
        }
        ruleset
    }

    fn add_set(&mut self, set: &Value) {
        let Some(name) = set.get("name").and_then(Value::as_str) else {
            return;
        };
        if let Some(timeout) = set.get("timeout").and_then(Value::as_u64) {
            self.timeouts
                .insert(name.to_owned(), u32::try_from(timeout).unwrap_or(u32::MAX));
        }
        let elements = set.get("elem").and_then(Value::as_array);
        let elements = elements
            .map(|e| e.iter().filter_map(address_text).collect())
            .unwrap_or_default();
        self.set_elements.insert(name.to_owned(), elements);
    }
}

/// A map of verdicts keyed by `[ipv4_addr|ipv6_addr .] inet_proto .
/// inet_service`.
fn verdict_map(map: &Value) -> Option<VerdictMap> {
    if map.get("map").and_then(Value::as_str) != Some("verdict") {
        return None;
    }
    let types: Vec<&str> = map.get("type")?.as_array()?.iter().filter_map(Value::as_str).collect();
    let with_address = match types.as_slice() {
        ["ipv4_addr" | "ipv6_addr", "inet_proto", "inet_service"] => true,
        ["inet_proto", "inet_service"] => false,
        _ => return None,
    };
    let elements = map
        .get("elem")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    Some(VerdictMap {
        with_address,
        elements: elements.iter().filter_map(element).collect(),
    })
}

/// `[key, verdict]`, the key perhaps wrapped as `{"elem": {"val": key,
/// "comment": ...}}`.
fn element(pair: &Value) -> Option<Element> {
    let [key, verdict] = pair.as_array()?.as_slice() else {
        return None;
    };
    let (key, comment) = match key.get("elem") {
        Some(elem) => (elem.get("val")?, elem.get("comment").and_then(Value::as_str)),
        None => (key, None),
    };
    let target = verdict_target(verdict).map(str::to_owned);
    if target.is_none() && verdict.get("drop").is_none() {
        return None;
    }
    Some(Element {
        key: key.get("concat")?.as_array()?.clone(),
        comment: comment.map(str::to_owned),
        target,
    })
}

/// The chain of a `jump`/`goto` verdict.
fn verdict_target(verdict: &Value) -> Option<&str> {
    ["goto", "jump"]
        .iter()
        .find_map(|kind| verdict.get(kind)?.get("target")?.as_str())
}

fn add_element(frontends: &mut Frontends, map: &VerdictMap, element: &Element, found: Resolved, family: IpFamily) {
    let parts: Vec<&Value> = element.key.iter().collect();
    let (addr, proto, port) = match (map.with_address, parts.as_slice()) {
        (true, [addr, proto, port]) => (addr.as_str().and_then(|a| a.parse().ok()), *proto, *port),
        (false, [proto, port]) => (Some(any_address(family)), *proto, *port),
        _ => return,
    };
    let Some(proto) = proto.as_str().and_then(Protocol::from_lowercase) else {
        return;
    };
    let (Some(addr), Some(port)) = (addr, port.as_u64().and_then(|p| u16::try_from(p).ok())) else {
        return;
    };
    let target = element.target.as_deref().unwrap_or_default();
    let kind = if map.with_address {
        Kind::of_address(
            element.comment.as_deref(),
            target.starts_with("firewall-"),
            target.starts_with("external-"),
        )
    } else {
        Kind::NodePort
    };
    let frontend: &mut Frontend = if found.dispatches {
        frontends.entry(proto, addr, port, kind)
    } else {
        // A refusal, or a filter before the dispatch: joins the frontend
        // the dispatch maps list.
        frontends.entry_any_kind(proto, addr, port, kind)
    };
    frontend.add(found.leads, service_of(element));
}

/// `namespace/name[:port]` from the element's comment, or the
/// `service-HASH-namespace/name/proto/port` chain name.
fn service_of(element: &Element) -> Option<String> {
    if let Some(first) = element.comment.as_deref().and_then(|c| c.split_whitespace().next()) {
        return first.contains('/').then(|| first.to_owned());
    }
    let (_, rest) = element.target.as_deref()?.split_once('-')?.1.split_once('-')?;
    let mut parts = rest.split('/');
    let (namespace, name, _proto, port) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    Some(if port.is_empty() {
        format!("{namespace}/{name}")
    } else {
        format!("{namespace}/{name}:{port}")
    })
}

/// What a chain leads to.
#[derive(Default)]
struct Resolved {
    /// Whether the chain leads to an endpoint (or is a service chain
    /// without any): the element is a dispatch, not a refusal or filter.
    dispatches: bool,
    leads: Leads,
}

/// How deep a goto chain may go: the mode's is external -> local -> endpoint.
const MAX_DEPTH: usize = 8;

impl Ruleset {
    fn resolve(&self, chain: &str) -> Resolved {
        let mut found = Resolved::default();
        self.walk(chain, 0, &mut BTreeSet::new(), &mut found);
        found
    }

    fn walk(&self, chain: &str, depth: usize, seen: &mut BTreeSet<String>, found: &mut Resolved) {
        if depth > MAX_DEPTH || !seen.insert(chain.to_owned()) {
            return;
        }
        found.dispatches |= ["service-", "local-", "external-", "endpoint-"]
            .iter()
            .any(|p| chain.starts_with(p));
        found.leads.local_only |= chain.starts_with("local-") || self.drops_everything(chain);
        let rules = self.chains.get(chain).map(Vec::as_slice).unwrap_or_default();
        let mut targets = Vec::new();
        for expr in rules {
            for part in expr {
                self.read_expression(chain, part, expr, found);
                collect_targets(part, &mut targets);
            }
        }
        // An external chain of a `Local` Service sends pods and the node
        // to the cluster-wide chain, everyone else to this node's: the
        // frontend's backends are the latter.
        let local = chain
            .starts_with("external-")
            .then(|| targets.iter().find(|t| t.starts_with("local-")));
        if let Some(Some(local)) = local {
            found.leads.local_only = true;
            let local = local.clone();
            self.walk(&local, depth + 1, seen, found);
            return;
        }
        for target in targets {
            if self.chains.contains_key(&target) || target.starts_with("local-") {
                self.walk(&target, depth + 1, seen, found);
            }
        }
    }

    /// Reads a DNAT, an affinity set or a source filter from one
    /// expression of a rule (`rule`: all of that rule's expressions).
    fn read_expression(&self, chain: &str, part: &Value, rule: &[Value], found: &mut Resolved) {
        if let Some(dnat) = part.get("dnat")
            && let Some(addr) = dnat.get("addr").and_then(Value::as_str).and_then(|a| a.parse().ok())
            && let Some(port) = dnat
                .get("port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
        {
            found.leads.backends.push((addr, port));
        }
        for name in set_references(part) {
            if name.starts_with("affinity")
                && let Some(timeout) = self.timeouts.get(name)
            {
                found.leads.affinity_seconds = Some(*timeout);
            }
        }
        let drops = rule.iter().any(|p| p.get("drop").is_some());
        if chain.starts_with("firewall-")
            && drops
            && let Some(ranges) = self.negated_sources(part)
        {
            found.leads.source_filtered = true;
            found.leads.source_ranges.extend(ranges);
        }
    }

    /// The sources of `ip saddr != {...}` / `!= @set`.
    fn negated_sources(&self, part: &Value) -> Option<Vec<String>> {
        let matched = part.get("match")?;
        if matched.get("op")?.as_str()? != "!="
            || matched.get("left")?.get("payload")?.get("field")?.as_str()? != "saddr"
        {
            return None;
        }
        let right = matched.get("right")?;
        if let Some(name) = right.as_str().and_then(|r| r.strip_prefix('@')) {
            return Some(self.set_elements.get(name).cloned().unwrap_or_default());
        }
        let listed = right.get("set").and_then(Value::as_array);
        Some(match listed {
            Some(items) => items.iter().filter_map(address_text).collect(),
            None => address_text(right).into_iter().collect(),
        })
    }

    /// A chain whose last rule drops everything left (the mode's
    /// `drop-external-chain`: `Local` without a local endpoint).
    fn drops_everything(&self, chain: &str) -> bool {
        self.chains
            .get(chain)
            .and_then(|rules| rules.last())
            .is_some_and(|last| last.len() == 1 && last[0].get("drop").is_some())
    }
}

/// Every `jump`/`goto` target inside `value` (a verdict, a vmap's
/// elements), in order.
fn collect_targets(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(object) => {
            if let Some(target) = verdict_target(value) {
                out.push(target.to_owned());
                return;
            }
            for inner in object.values() {
                collect_targets(inner, out);
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect_targets(i, out)),
        _ => {}
    }
}

/// Every `@set` named inside `value`.
fn set_references(value: &Value) -> Vec<&str> {
    match value {
        Value::String(s) => s.strip_prefix('@').into_iter().collect(),
        Value::Object(object) => object.values().flat_map(set_references).collect(),
        Value::Array(items) => items.iter().flat_map(set_references).collect(),
        _ => Vec::new(),
    }
}

/// `"A.B.C.D"` or `{"prefix": {"addr": ..., "len": N}}` as text.
fn address_text(value: &Value) -> Option<String> {
    if let Some(text) = value.as_str() {
        return Some(text.to_owned());
    }
    let prefix = value.get("prefix")?;
    Some(format!(
        "{}/{}",
        prefix.get("addr")?.as_str()?,
        prefix.get("len")?.as_u64()?
    ))
}

#[cfg(test)]
mod tests;
