//! A chain of constant rules the ebpf mode keeps in the kernel's own
//! tables beside its programs (the SNAT fallback's, `snat`; the notrack
//! rule, `notrack`): installed whole with one jump into it from a built-in
//! chain, in iptables and the same in ip6tables, and removed with the
//! jump. Their number never grows with the number of Services.

use anyhow::{Context, Result};
use tracing::info;

use crate::{
    model::IpFamily,
    sys::iptables::{Iptables, Saved, SystemIptables, remove_chains, rule_chain, rule_target},
};

/// Where a chain sits and what jumps to it.
pub struct NodeChain {
    pub table: &'static str,
    pub chain: &'static str,
    /// The built-in chain that jumps to it.
    pub from: &'static str,
    /// The jump's comment, for whoever reads the node's rules.
    pub comment: &'static str,
}

impl NodeChain {
    /// Installs the chain with `rules` (its own lines, `-A <chain> ...`)
    /// and one jump, whatever was there (declaring the chain in
    /// `iptables-restore --noflush` input flushes it).
    pub fn install(&self, iptables: &mut dyn Iptables, rules: &str) -> Result<()> {
        let saved = Saved::parse(&iptables.save().context("reading the current rules")?);
        let Self {
            table,
            chain,
            from,
            comment,
        } = self;
        let mut input = format!("*{table}\n:{chain} - [0:0]\n{rules}");
        if self.jumps(&saved).is_empty() {
            input.push_str(&format!("-A {from} -m comment --comment \"{comment}\" -j {chain}\n"));
        }
        input.push_str("COMMIT\n");
        iptables
            .restore(&input)
            .with_context(|| format!("installing the {table} table's {chain} chain"))
    }

    /// The rules outside the chain that jump to it.
    fn jumps(&self, saved: &Saved) -> Vec<String> {
        saved
            .tables
            .get(self.table)
            .map(|table| {
                table
                    .rules
                    .iter()
                    .filter(|r| rule_chain(r) != Some(self.chain) && rule_target(r) == Some(self.chain))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Removes the chain and every jump to it; false if there was none.
    pub fn remove(&self, iptables: &mut dyn Iptables) -> Result<bool> {
        let removed = remove_chains(iptables, |table, chain| table == self.table && chain == self.chain)
            .with_context(|| format!("removing the {} chain", self.chain))?;
        Ok(removed > 0)
    }

    /// [`Self::remove`] with the system's iptables and ip6tables; nothing
    /// to do for a family without its tool.
    pub fn cleanup(&self) -> Result<()> {
        for family in [IpFamily::V4, IpFamily::V6] {
            let mut system = SystemIptables::for_family(family);
            if system.check().is_err() {
                continue;
            }
            if self.remove(&mut system)? {
                info!(chain = self.chain, ?family, "removed the ebpf mode's rules");
            }
        }
        Ok(())
    }
}
