//! The `nft` tool: one `nft -f -` per sync (a single netlink transaction:
//! all of it or nothing), `nft list table` to read back.

use anyhow::{Context, Result};

use super::tool;

/// What the nftables mode needs from nftables; tests use a fake.
pub trait Nft: Send {
    /// Runs `script` as one transaction (`nft -f -`).
    fn run(&mut self, script: &str) -> Result<()>;
    /// `nft list table FAMILY TABLE`, or `None` if there is no such table.
    fn list_table(&mut self, family: &str, table: &str) -> Result<Option<String>>;
}

/// The system's `nft`.
#[derive(Clone, Debug)]
pub struct SystemNft {
    binary: String,
}

impl Default for SystemNft {
    fn default() -> Self {
        Self { binary: "nft".into() }
    }
}

const PACKAGE: &str = "the nftables package";

impl SystemNft {
    /// Fails if `nft` cannot be run at all.
    pub fn check(&self) -> Result<()> {
        tool::check_runs(&self.binary, PACKAGE)
    }

    /// Fails if nft cannot talk to the kernel's nf_tables (no privileges,
    /// a kernel without it): lists the tables of `family`.
    pub fn check_kernel(&self, family: &str) -> Result<()> {
        let args = ["list", "tables", family];
        let out = tool::run(&self.binary, &args, PACKAGE)?;
        tool::stdout_of(&self.binary, &args, out).map(drop)
    }
}

impl Nft for SystemNft {
    fn run(&mut self, script: &str) -> Result<()> {
        tool::pipe(&self.binary, &["-f", "-"], script, |stderr| {
            tool::line_after(stderr, "/dev/stdin:")
        })?;
        Ok(())
    }

    fn list_table(&mut self, family: &str, table: &str) -> Result<Option<String>> {
        let args = ["list", "table", family, table];
        let out = tool::run(&self.binary, &args, PACKAGE)?;
        if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No such file or directory") {
            return Ok(None);
        }
        tool::stdout_of(&self.binary, &args, out).map(Some)
    }
}

/// Deletes the table `family table` in one transaction, and everything in
/// it. `add` first: if the table is not there (or vanished since it was
/// listed), `delete` still succeeds.
pub fn delete_table(nft: &mut dyn Nft, family: &str, table: &str) -> Result<()> {
    nft.run(&format!("add table {family} {table}\ndelete table {family} {table}\n"))
        .with_context(|| format!("deleting the table {family} {table}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_context_points_at_the_line() {
        let script = "a\nb\nc\nd\ne\nf\n";
        let stderr = "/dev/stdin:4:5-9: Error: Could not process rule: No such file or directory\nd\n    ^^^^\n";
        let context = tool::lines_around(script, tool::line_after(stderr, "/dev/stdin:").expect("a line"));
        assert!(context.contains("=>     4: d"), "{context}");
        assert!(
            context.contains("       2: b") && context.contains("       5: e"),
            "{context}"
        );
    }
}
