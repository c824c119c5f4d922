//! Talking to the kernel: `iptables-save` to read, one
//! `iptables-restore --noflush` per sync to write (atomic per table, and
//! never touching chains that are not named in its input).

use std::{
    collections::BTreeMap,
    io::Write,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

/// What the mode needs from iptables; tests use a fake.
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
        Self {
            save: "iptables-save".into(),
            restore: "iptables-restore".into(),
        }
    }
}

/// How long `iptables-restore` waits for the xtables lock (legacy backend).
const LOCK_WAIT_SECONDS: &str = "5";

impl SystemIptables {
    /// Fails if the binaries cannot be run at all.
    pub fn check(&self) -> Result<()> {
        for binary in [&self.save, &self.restore] {
            let out = Command::new(binary)
                .arg("--version")
                .output()
                .with_context(|| format!("running {binary} (is the iptables package installed?)"))?;
            if !out.status.success() {
                bail!(
                    "{binary} --version failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Ok(())
    }
}

impl Iptables for SystemIptables {
    fn save(&mut self) -> Result<String> {
        // Without `-t`: naming a table that does not exist yet would create
        // it (nf_tables backend).
        let out = Command::new(&self.save)
            .output()
            .with_context(|| format!("running {}", self.save))?;
        if !out.status.success() {
            bail!(
                "{} failed ({}): {}",
                self.save,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        String::from_utf8(out.stdout).with_context(|| format!("{} printed invalid UTF-8", self.save))
    }

    fn restore(&mut self, input: &str) -> Result<()> {
        let mut child = Command::new(&self.restore)
            .args(["-w", LOCK_WAIT_SECONDS, "--noflush"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {}", self.restore))?;
        let written = child
            .stdin
            .take()
            .context("no stdin for iptables-restore")?
            .write_all(input.as_bytes());
        let out = child
            .wait_with_output()
            .with_context(|| format!("waiting for {}", self.restore))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            bail!(
                "{} --noflush failed ({}): {}{}",
                self.restore,
                out.status,
                stderr.trim(),
                failed_line_context(input, &stderr)
            );
        }
        written.context("writing to iptables-restore")?;
        Ok(())
    }
}

/// The input lines around the one `iptables-restore` complained about
/// ("line N: ..."), like kube-proxy logs them.
fn failed_line_context(input: &str, stderr: &str) -> String {
    let Some(line) = stderr
        .split("line ")
        .skip(1)
        .find_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse::<usize>().ok())
    else {
        return String::new();
    };
    let lines: Vec<&str> = input.lines().collect();
    let first = line.saturating_sub(3);
    let last = (line + 2).min(lines.len());
    let shown: Vec<String> = (first..last)
        .map(|i| format!("{}{:>6}: {}", if i + 1 == line { "=>" } else { "  " }, i + 1, lines[i]))
        .collect();
    if shown.is_empty() {
        return String::new();
    }
    format!("\ninput around line {line}:\n{}", shown.join("\n"))
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
        for rule in &table.rules {
            let in_ours = rule_chain(rule).is_some_and(|c| is_ours(name, c));
            let into_ours = rule_target(rule).is_some_and(|t| is_ours(name, t));
            if in_ours || into_ours {
                out.push(format!("{name} {rule}"));
            }
        }
    }
    out
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
        let shown = failed_line_context(input, "iptables-restore: line 3 failed");
        assert!(shown.contains("=>     3: -A A -j B"), "{shown}");
        assert!(shown.contains("       2: :A - [0:0]"), "{shown}");
        assert_eq!(failed_line_context(input, "something else"), "");
    }
}
