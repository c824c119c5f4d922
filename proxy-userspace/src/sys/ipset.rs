//! The `ipset` tool: `ipset save` to read every set, `ipset restore -exist`
//! to write.

use anyhow::Result;

use super::tool;

const PROGRAM: &str = "ipset";
const PACKAGE: &str = "ipset";

/// `ipset save`: every set of the calling thread's network namespace.
pub fn save() -> Result<String> {
    let out = tool::run(PROGRAM, &["save"], PACKAGE)?;
    tool::stdout_of(PROGRAM, &["save"], out)
}

/// Feeds `input` to `ipset restore -exist`.
pub fn restore(input: &str) -> Result<()> {
    tool::pipe(PROGRAM, &["restore", "-exist"], input, |stderr| {
        tool::line_after(stderr, "line ")
    })?;
    Ok(())
}
