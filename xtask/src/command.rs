//! Running child processes with their command line in every error.

use std::process::{Command, ExitStatus, Output};

use anyhow::{Context, Result, bail};

/// The workspace's cargo (`$CARGO`, the one running this xtask), in `root`.
///
/// `cargo run` gives the xtask the variables of its own package
/// (CARGO_MANIFEST_DIR, CARGO_PKG_*, ...). They must not reach the child
/// cargo: some build scripts (ring's) rerun when they change, so every
/// switch between `cargo xtask ...` and a plain `cargo ...` would rebuild
/// ring, rustls and kube.
pub fn workspace_cargo(root: &std::path::Path) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let per_package = key.starts_with("CARGO_PKG_")
            || matches!(
                key.as_ref(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
            );
        if per_package {
            cmd.env_remove(key.as_ref());
        }
    }
    cmd
}

/// A printable form of `cmd`: its program and arguments.
pub fn describe(cmd: &Command) -> String {
    let mut text = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Runs `cmd` with inherited stdio and returns its exit status.
pub fn status(cmd: &mut Command) -> Result<ExitStatus> {
    let text = describe(cmd);
    eprintln!("xtask: running {text}");
    cmd.status().with_context(|| format!("failed to start `{text}`"))
}

/// Runs `cmd` with inherited stdio and fails unless it succeeds.
pub fn run(cmd: &mut Command) -> Result<()> {
    let text = describe(cmd);
    let status = status(cmd)?;
    if !status.success() {
        bail!("`{text}` failed: {status}");
    }
    Ok(())
}

/// Runs `cmd`, captures its output and fails unless it succeeds.
pub fn output(cmd: &mut Command) -> Result<Output> {
    let text = describe(cmd);
    let output = cmd.output().with_context(|| format!("failed to start `{text}`"))?;
    if !output.status.success() {
        bail!(
            "`{text}` failed: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        );
    }
    Ok(output)
}

/// Runs `cmd` and returns its stdout as text; fails unless it succeeds.
pub fn stdout(cmd: &mut Command) -> Result<String> {
    let text = describe(cmd);
    let output = output(cmd)?;
    String::from_utf8(output.stdout).with_context(|| format!("`{text}` printed non-UTF-8 output"))
}
