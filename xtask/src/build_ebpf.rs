//! `cargo xtask build-ebpf`: builds proxy-ebpf for `bpfel-unknown-none`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::{command, toolchain};

/// The eBPF target; proxy-userspace's build.rs embeds the object built for it.
pub const TARGET: &str = "bpfel-unknown-none";

/// The eBPF crate's directory and binary name.
const CRATE: &str = "proxy-ebpf";

#[derive(clap::Args, Debug, Default)]
pub struct Options {
    /// Build with the dev profile (the agent embeds only the release object).
    #[arg(long)]
    pub debug: bool,
}

/// Sets up the toolchain, builds the eBPF object and returns its path.
pub fn build_ebpf(root: &Path, options: &Options) -> Result<PathBuf> {
    let nightly = toolchain::pinned_nightly(root)?;
    toolchain::ensure_nightly(&nightly)?;
    toolchain::ensure_rust_src(&nightly)?;
    let linker = toolchain::ensure_bpf_linker(&nightly)?;
    let crate_dir = root.join(CRATE);
    cargo_build(&nightly, &crate_dir, &linker, options.debug)?;
    let object = object_path(&crate_dir, options.debug);
    if !object.is_file() {
        bail!("the build succeeded but {} is missing", object.display());
    }
    Ok(object)
}

/// Runs the nightly cargo in `crate_dir` (so its own lockfile and
/// `.cargo/config.toml` apply), linking with `linker`.
fn cargo_build(nightly: &str, crate_dir: &Path, linker: &Path, debug: bool) -> Result<()> {
    let mut cmd = toolchain::nightly_command(nightly, "cargo");
    cmd.current_dir(crate_dir).arg("build");
    if !debug {
        cmd.arg("--release");
    }
    cmd.args(["--target", TARGET, "-Z", "build-std=core"])
        .env("CARGO_TARGET_BPFEL_UNKNOWN_NONE_LINKER", linker);
    command::run(&mut cmd).with_context(|| format!("cannot build the eBPF crate in {}", crate_dir.display()))
}

/// Where cargo puts the eBPF object.
pub fn object_path(crate_dir: &Path, debug: bool) -> PathBuf {
    let profile = if debug { "debug" } else { "release" };
    crate_dir.join("target").join(TARGET).join(profile).join(CRATE)
}
