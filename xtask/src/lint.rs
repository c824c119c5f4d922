//! `cargo xtask lint`: rustfmt and clippy for the workspace and for the
//! eBPF crate, warnings denied, as `.ci/run` runs them.
//!
//! Which lints apply is written in the `[workspace.lints]` table of the
//! workspace's Cargo.toml; proxy-ebpf, outside the workspace, has its own
//! `[lints]` (the base lints and SAFETY comments; the pedantic ones fight
//! the packet code's deliberate casts). This command only runs the tools.

use std::{path::Path, process::Command};

use anyhow::{Result, bail};

use crate::{build_ebpf, command, toolchain};

/// Runs every check, then fails naming the ones that failed (all run, so
/// one run shows every finding).
pub fn lint(root: &Path) -> Result<()> {
    // Lint may run first on a fresh machine: the pinned nightly (with
    // rust-src, for build-std) must be there before its clippy runs.
    let nightly = toolchain::pinned_nightly(root)?;
    toolchain::ensure_nightly(&nightly)?;
    toolchain::ensure_components(None, &["clippy", "rustfmt"])?;
    toolchain::ensure_components(Some(&nightly), &["rust-src", "clippy"])?;

    let ebpf_dir = root.join("proxy-ebpf");
    let checks: [(&str, Command); 4] = [
        ("rustfmt (workspace)", rustfmt_check(command::workspace_cargo(root))),
        ("rustfmt (proxy-ebpf)", ebpf_rustfmt(root)),
        ("clippy (workspace)", workspace_clippy(root)),
        ("clippy (proxy-ebpf)", ebpf_clippy(&nightly, &ebpf_dir)),
    ];
    let mut failed = Vec::new();
    for (name, mut cmd) in checks {
        if !command::status(&mut cmd)?.success() {
            failed.push(name);
        }
    }
    if !failed.is_empty() {
        bail!("lint failed: {}", failed.join(", "));
    }
    eprintln!("xtask: lint clean");
    Ok(())
}

/// `cargo fmt --all --check`: lists every file rustfmt would change.
fn rustfmt_check(mut cargo: Command) -> Command {
    cargo.args(["fmt", "--all", "--check"]);
    cargo
}

/// The stable rustfmt on the eBPF crate (from its root file, following its
/// `mod`s), so both crates have one style: the nightly's rustfmt formats
/// differently.
fn ebpf_rustfmt(root: &Path) -> Command {
    let mut cmd = Command::new("rustfmt");
    cmd.current_dir(root)
        .args(["--check", "--edition", "2024", "proxy-ebpf/src/main.rs"]);
    cmd
}

/// Clippy on every workspace crate and target (tests, benches, binaries).
fn workspace_clippy(root: &Path) -> Command {
    let mut cmd = command::workspace_cargo(root);
    cmd.args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]);
    cmd
}

/// Clippy on the eBPF crate, built as `build-ebpf` builds it (its
/// `.cargo/config.toml` sets the target and `build-std`); checking needs no
/// linker.
fn ebpf_clippy(nightly: &str, ebpf_dir: &Path) -> Command {
    let mut cmd = toolchain::nightly_command(nightly, "cargo");
    cmd.current_dir(ebpf_dir).args([
        "clippy",
        "--release",
        "--target",
        build_ebpf::TARGET,
        "--",
        "-D",
        "warnings",
    ]);
    cmd
}
