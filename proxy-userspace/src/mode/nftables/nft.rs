//! Talking to the kernel through the `nft` tool: one `nft -f -` per sync
//! (a single netlink transaction: all of it or nothing), `nft list table`
//! to read back. Runs in the calling thread's network namespace.

use std::{
    io::Write,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use super::names::{FAMILY, TABLE};

/// What the mode needs from nftables; tests use a fake.
pub trait Nft: Send {
    /// Runs `script` as one transaction (`nft -f -`).
    fn run(&mut self, script: &str) -> Result<()>;
    /// `nft list table ip xproxy`, or `None` if there is no such table.
    fn list_table(&mut self) -> Result<Option<String>>;
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

impl SystemNft {
    /// Fails if `nft` cannot be run at all.
    pub fn check(&self) -> Result<()> {
        let out = Command::new(&self.binary)
            .arg("--version")
            .output()
            .with_context(|| format!("running {} (is the nftables package installed?)", self.binary))?;
        if !out.status.success() {
            bail!(
                "{} --version failed: {}",
                self.binary,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Fails if nft cannot talk to the kernel's nf_tables (no privileges,
    /// a kernel without it).
    pub fn check_kernel(&self) -> Result<()> {
        let out = Command::new(&self.binary)
            .args(["list", "tables", FAMILY])
            .output()
            .with_context(|| format!("running {}", self.binary))?;
        if !out.status.success() {
            bail!(
                "{} list tables failed ({}): {}",
                self.binary,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl Nft for SystemNft {
    fn run(&mut self, script: &str) -> Result<()> {
        let mut child = Command::new(&self.binary)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {}", self.binary))?;
        let written = child
            .stdin
            .take()
            .context("no stdin for nft")?
            .write_all(script.as_bytes());
        let out = child
            .wait_with_output()
            .with_context(|| format!("waiting for {}", self.binary))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            bail!(
                "{} -f - failed ({}): {}{}",
                self.binary,
                out.status,
                stderr.trim(),
                failed_line_context(script, &stderr)
            );
        }
        written.context("writing to nft")?;
        Ok(())
    }

    fn list_table(&mut self) -> Result<Option<String>> {
        let out = Command::new(&self.binary)
            .args(["list", "table", FAMILY, TABLE])
            .output()
            .with_context(|| format!("running {}", self.binary))?;
        if out.status.success() {
            return String::from_utf8(out.stdout)
                .map(Some)
                .context("nft printed invalid UTF-8");
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No such file or directory") {
            return Ok(None);
        }
        bail!(
            "{} list table {FAMILY} {TABLE} failed ({}): {}",
            self.binary,
            out.status,
            stderr.trim()
        )
    }
}

/// The script lines around the first one nft complained about
/// (`/dev/stdin:LINE:COLUMNS: Error: ...`).
fn failed_line_context(script: &str, stderr: &str) -> String {
    let Some(line) = stderr
        .split("/dev/stdin:")
        .skip(1)
        .find_map(|rest| rest.split(':').next()?.parse::<usize>().ok())
    else {
        return String::new();
    };
    let lines: Vec<&str> = script.lines().collect();
    let first = line.saturating_sub(3);
    let last = (line + 2).min(lines.len());
    let shown: Vec<String> = (first..last)
        .map(|i| format!("{}{:>6}: {}", if i + 1 == line { "=>" } else { "  " }, i + 1, lines[i]))
        .collect();
    format!("\ninput around line {line}:\n{}", shown.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_context_points_at_the_line() {
        let script = "a\nb\nc\nd\ne\nf\n";
        let stderr = "/dev/stdin:4:5-9: Error: Could not process rule: No such file or directory\nd\n    ^^^^\n";
        let context = failed_line_context(script, stderr);
        assert!(context.contains("=>     4: d"), "{context}");
        assert!(
            context.contains("       2: b") && context.contains("       5: e"),
            "{context}"
        );
        assert_eq!(failed_line_context(script, "Error: something else"), "");
    }
}
