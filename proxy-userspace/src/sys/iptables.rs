//! iptables, as every mode that writes rules uses it: `iptables-save` to
//! read, `iptables-restore --noflush` to write (atomic per table, and never
//! touching chains that are not named in its input), the parsed form of a
//! save, and the removal of a mode's chains with the jumps into them.

use std::collections::BTreeMap;

use anyhow::{Context, Result};

use super::tool;
use crate::model::IpFamily;

/// What the modes need from iptables; tests use a fake.
pub trait Iptables: Send {
    /// The whole ruleset, as `iptables-save` prints it.
    fn save(&mut self) -> Result<String>;
    /// Feeds `input` to `iptables-restore --noflush`.
    fn restore(&mut self, input: &str) -> Result<()>;
}

/// The iptables binaries of the running system (legacy or nf_tables
/// backend alike), run in the calling thread's network namespace.
#[derive(Clone, Debug)]
pub struct SystemIptables {
    save: String,
    restore: String,
}

impl Default for SystemIptables {
    fn default() -> Self {
        Self::for_family(IpFamily::V4)
    }
}

/// How long `iptables-restore` waits for the xtables lock (legacy backend).
const LOCK_WAIT_SECONDS: &str = "5";
const PACKAGE: &str = "the iptables package";

impl SystemIptables {
    /// `iptables-*` for IPv4, `ip6tables-*` for IPv6: the same binary name
    /// found in `PATH` either way, so whatever picks the backend (the
    /// `iptables` alternative, a wrapper earlier in `PATH`) picks it for
    /// both families.
    pub fn for_family(family: IpFamily) -> Self {
        let prefix = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        Self {
            save: format!("{prefix}-save"),
            restore: format!("{prefix}-restore"),
        }
    }

    /// The legacy (x_tables) backend's binaries of `family` by their own
    /// names (`ip6tables-legacy-save`, ...), whatever `PATH` picks: for
    /// tests and benches that compare the two backends on one machine.
    pub fn legacy(family: IpFamily) -> Self {
        let plain = Self::for_family(family);
        let legacy = |name: &str| name.replacen("tables-", "tables-legacy-", 1);
        Self {
            save: legacy(&plain.save),
            restore: legacy(&plain.restore),
        }
    }

    /// `ip6tables-save` and `ip6tables-restore`: the IPv6 twin.
    pub fn ipv6() -> Self {
        Self::for_family(IpFamily::V6)
    }

    /// Fails if the binaries cannot be run at all.
    pub fn check(&self) -> Result<()> {
        tool::check_runs(&self.save, PACKAGE)?;
        tool::check_runs(&self.restore, PACKAGE)
    }
}

impl Iptables for SystemIptables {
    fn save(&mut self) -> Result<String> {
        // Without `-t`: naming a table that does not exist yet would create
        // it (nf_tables backend).
        let out = tool::run(&self.save, &[], PACKAGE)?;
        tool::stdout_of(&self.save, &[], out)
    }

    fn restore(&mut self, input: &str) -> Result<()> {
        tool::pipe(
            &self.restore,
            &["-w", LOCK_WAIT_SECONDS, "--noflush"],
            input,
            |stderr| tool::line_after(stderr, "line "),
        )?;
        Ok(())
    }
}

/// One table of `iptables-save` output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    /// Chain names in the order declared (built-in chains included).
    pub chains: Vec<String>,
    /// `-A CHAIN ...` lines in order.
    pub rules: Vec<String>,
}

impl SavedTable {
    pub fn has_chain(&self, chain: &str) -> bool {
        self.chains.iter().any(|c| c == chain)
    }
}

/// `iptables-save` output by table name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    pub tables: BTreeMap<String, SavedTable>,
}

impl Saved {
    pub fn parse(text: &str) -> Self {
        let mut saved = Saved::default();
        let mut current: Option<&mut SavedTable> = None;
        for line in text.lines() {
            if let Some(name) = line.strip_prefix('*') {
                current = Some(saved.tables.entry(name.trim().to_owned()).or_default());
            } else if line == "COMMIT" {
                current = None;
            } else if let Some(table) = current.as_deref_mut() {
                if let Some(decl) = line.strip_prefix(':') {
                    if let Some(name) = decl.split_whitespace().next() {
                        table.chains.push(name.to_owned());
                    }
                } else if line.starts_with("-A ") {
                    table.rules.push(line.to_owned());
                }
            }
        }
        saved
    }

    pub fn table(&self, name: &str) -> Option<&SavedTable> {
        self.tables.get(name)
    }

    /// Whether some rule of `table` is one `is` recognises.
    pub fn holds_rule(&self, table: &str, is: impl Fn(&str) -> bool) -> bool {
        self.table(table).is_some_and(|t| t.rules.iter().any(|r| is(r)))
    }
}

/// Whether the saved rule `-A FROM ...` is the jump from `from` to `to`
/// carrying `comment` (any comment if ""), as iptables-save prints it: the
/// matches in between may be spelled differently from what was written.
pub fn is_saved_jump(saved: &str, from: &str, to: &str, comment: &str) -> bool {
    saved.starts_with(&format!("-A {from} "))
        && saved.ends_with(&format!(" -j {to}"))
        && (comment.is_empty() || saved.contains(comment))
}

/// The chain a saved `-A CHAIN ...` rule is in.
pub fn rule_chain(rule: &str) -> Option<&str> {
    rule.strip_prefix("-A ")?.split_whitespace().next()
}

/// The `-j TARGET` of a saved rule, if any.
pub fn rule_target(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    while let Some(word) = words.next() {
        if word == "-j" {
            return words.next();
        }
    }
    None
}

/// The lines of `saved` that belong to a mode: the chains `is_ours(table,
/// chain)` accepts, their rules, and the rules jumping into them, by table.
/// A mode compares them before and after a write to see whether anyone
/// else changed its rules.
pub fn owned_lines(saved: &Saved, is_ours: impl Fn(&str, &str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    for (name, table) in &saved.tables {
        for chain in table.chains.iter().filter(|c| is_ours(name, c)) {
            out.push(format!("{name} :{chain}"));
        }
        out.extend(owned_rules(name, table, &is_ours).map(|rule| format!("{name} {rule}")));
    }
    out
}

/// How many rules of `tables` are in chains `is_ours` accepts or jump into
/// them (0 for a table without any).
pub fn owned_rule_counts(
    saved: &Saved,
    tables: &[&'static str],
    is_ours: impl Fn(&str, &str) -> bool,
) -> Vec<(&'static str, u64)> {
    tables
        .iter()
        .map(|name| {
            let count = saved
                .table(name)
                .map_or(0, |table| owned_rules(name, table, &is_ours).count());
            (*name, count as u64)
        })
        .collect()
}

/// The rules of `table` in chains `is_ours` accepts or jumping into them.
fn owned_rules<'a>(
    name: &'a str,
    table: &'a SavedTable,
    is_ours: &'a impl Fn(&str, &str) -> bool,
) -> impl Iterator<Item = &'a String> {
    table.rules.iter().filter(move |rule| {
        rule_chain(rule).is_some_and(|c| is_ours(name, c)) || rule_target(rule).is_some_and(|t| is_ours(name, t))
    })
}

/// Removes the chains `is_ours` accepts and the jumps into them through
/// `iptables` ([`removal`]); returns how many chains went.
pub fn remove_chains(iptables: &mut dyn Iptables, is_ours: impl Fn(&str, &str) -> bool) -> Result<usize> {
    let saved = Saved::parse(&iptables.save().context("reading the current rules")?);
    let (input, removed) = removal(&saved, is_ours);
    if input.is_empty() {
        return Ok(0);
    }
    iptables.restore(&input).context("removing the chains")?;
    Ok(removed)
}

/// `iptables-restore --noflush` input that removes the chains `is_ours`
/// picks (by table and chain name) and every rule elsewhere that jumps to
/// them: chains are flushed first so none is referenced when deleted.
/// Returns the input (empty if there is nothing to remove) and how many
/// chains it removes. Every mode's cleanup goes through this.
pub fn removal(saved: &Saved, is_ours: impl Fn(&str, &str) -> bool) -> (String, usize) {
    let mut input = String::new();
    let mut removed = 0;
    for (name, table) in &saved.tables {
        let ours: Vec<&String> = table.chains.iter().filter(|c| is_ours(name, c)).collect();
        let jumps: Vec<&String> = table
            .rules
            .iter()
            .filter(|r| {
                !rule_chain(r).is_some_and(|c| is_ours(name, c)) && rule_target(r).is_some_and(|t| is_ours(name, t))
            })
            .collect();
        if ours.is_empty() && jumps.is_empty() {
            continue;
        }
        input.push_str(&format!("*{name}\n"));
        for chain in &ours {
            input.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for rule in &jumps {
            if let Some(spec) = rule.strip_prefix("-A ") {
                input.push_str(&format!("-D {spec}\n"));
            }
        }
        for chain in &ours {
            input.push_str(&format!("-X {chain}\n"));
        }
        input.push_str("COMMIT\n");
        removed += ours.len();
    }
    (input, removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVED: &str = "\
# Generated by iptables-save v1.8.9 (nf_tables)
*filter
:INPUT ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
COMMIT
# Completed
*nat
:PREROUTING ACCEPT [12:720]
:KUBE-SVC-AAA - [0:0]
-A KUBE-SVC-AAA -j KUBE-SEP-BBB
COMMIT
";

    #[test]
    fn parses_tables_chains_and_rules() {
        let saved = Saved::parse(SAVED);
        let filter = saved.table("filter").expect("filter");
        assert_eq!(filter.chains, ["INPUT", "KUBE-SERVICES"]);
        assert_eq!(filter.rules.len(), 1);
        assert_eq!(rule_chain(&filter.rules[0]), Some("INPUT"));
        assert_eq!(rule_target(&filter.rules[0]), Some("KUBE-SERVICES"));
        let nat = saved.table("nat").expect("nat");
        assert!(nat.has_chain("KUBE-SVC-AAA"));
        assert!(saved.table("mangle").is_none());
    }

    #[test]
    fn shows_the_failed_line() {
        let input = "*nat\n:A - [0:0]\n-A A -j B\n-X A\nCOMMIT\n";
        let line = tool::line_after("iptables-restore: line 3 failed", "line ").expect("a line");
        let shown = tool::lines_around(input, line);
        assert!(shown.contains("=>     3: -A A -j B"), "{shown}");
        assert!(shown.contains("       2: :A - [0:0]"), "{shown}");
    }
}
