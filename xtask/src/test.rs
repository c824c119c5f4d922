//! `cargo xtask test`: as root sets the machine up for the test bed
//! (`setup`), builds the eBPF object, then runs the workspace tests.

use std::{env, fs, path::Path};

use anyhow::{Context, Result};

use crate::{build_ebpf, command, setup};

/// Set to 1 for the tests when running as root: privileged tests then fail
/// instead of skipping when they cannot run.
const PRIVILEGED_ENV: &str = "XPROXY_PRIVILEGED_TESTS";

#[derive(clap::Args, Debug)]
pub struct Options {
    /// Extra arguments for `cargo test`, after `--` (e.g. `-- -p tests -- --nocapture`).
    #[arg(last = true)]
    pub cargo_args: Vec<String>,
}

/// Builds the release eBPF object (which the agent embeds), runs
/// `cargo test --workspace` and exits with its exit code.
pub fn test(root: &Path, options: &Options) -> Result<()> {
    let root_user = is_root()?;
    if root_user {
        // The privileged tests run the test bed: its programs and bpffs.
        setup::ensure_programs(setup::NAMESPACE_TOOLS)?;
        setup::ensure_bpffs()?;
    }
    build_ebpf::build_ebpf(root, &build_ebpf::Options { debug: false })?;

    let mut cmd = command::workspace_cargo(root);
    // Every test binary runs even after one fails, so a run (and CI's
    // log) shows every failure, not the first.
    cmd.args(["test", "--no-fail-fast"]);
    if !selects_packages(&options.cargo_args) {
        cmd.arg("--workspace");
    }
    cmd.args(&options.cargo_args);
    if root_user && env::var_os(PRIVILEGED_ENV).is_none() {
        eprintln!("xtask: running as root: {PRIVILEGED_ENV}=1");
        cmd.env(PRIVILEGED_ENV, "1");
    }
    let status = command::status(&mut cmd)?;
    if !status.success() {
        std::process::exit(exit_code(status));
    }
    Ok(())
}

/// Whether cargo arguments choose packages (`-p`/`--package`), which
/// `--workspace` would override. Arguments after `--` go to the test binaries.
fn selects_packages(cargo_args: &[String]) -> bool {
    cargo_args
        .iter()
        .take_while(|arg| *arg != "--")
        .any(|arg| arg.starts_with("-p") || arg == "--package" || arg.starts_with("--package="))
}

/// The exit code to pass on: the child's, or 128 + signal like a shell.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|signal| 128 + signal))
        .unwrap_or(1)
}

/// Whether this process's effective user id is 0 (from /proc/self/status).
fn is_root() -> Result<bool> {
    let status = fs::read_to_string("/proc/self/status").context("cannot read /proc/self/status")?;
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .context("no effective uid in /proc/self/status")?;
    Ok(effective == "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|arg| (*arg).to_owned()).collect()
    }

    #[test]
    fn sees_package_selection() {
        assert!(selects_packages(&args(&["-p", "xproxy-tests"])));
        assert!(selects_packages(&args(&["-pxtask", "--", "--nocapture"])));
        assert!(selects_packages(&args(&["--package=xtask"])));
        assert!(!selects_packages(&args(&["--release", "--", "-p"])));
        assert!(!selects_packages(&[]));
    }
}
