//! Developer tasks for xproxy: `cargo xtask <command>`.
//!
//! The eBPF crate (proxy-ebpf) needs a nightly toolchain, `rust-src` and a
//! `bpf-linker` built against the nightly's own LLVM; `build-ebpf` sets all of
//! that up itself, idempotently, so a fresh machine needs only rustup. The
//! commands that run the test bed check the machine's programs and bpffs
//! first and, as root, install and mount what is missing (`setup`).

mod bench;
mod build_ebpf;
mod command;
mod demo;
mod lint;
mod setup;
mod test;
mod toolchain;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about = "xproxy developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build the eBPF object (installs nightly rust-src and bpf-linker if needed).
    BuildEbpf(build_ebpf::Options),
    /// Build the eBPF object, then run `cargo test --workspace` (privileged tests enabled as root).
    Test(test::Options),
    /// The seed scenario on a simulated cluster in network namespaces.
    Demo,
    /// Run tests in Debian's 6.1 and 6.12 kernels under qemu (IPVS, older verifiers).
    Vm(vm::Options),
    /// Measure every mode side by side; writes bench/results/<date>-<host>.{json,md,*.svg}.
    Bench(bench::Options),
    /// Install what demo, test, vm and bench run (Debian packages) and mount bpffs; as root.
    Setup,
    /// rustfmt and clippy (warnings denied) for the workspace and the eBPF crate.
    Lint,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // `{:#}` prints the context chain on one line, without the
            // backtrace anyhow adds under RUST_BACKTRACE=1.
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let root = workspace_root();
    match cli.command {
        Command::BuildEbpf(options) => {
            let object = build_ebpf::build_ebpf(&root, &options)?;
            println!("{}", object.display());
            Ok(())
        }
        Command::Test(options) => test::test(&root, &options),
        Command::Demo => demo::demo(&root),
        Command::Vm(options) => vm::vm(&root, &options),
        Command::Bench(options) => bench::bench(&root, &options),
        Command::Setup => setup::everything(),
        Command::Lint => lint::lint(&root),
    }
}

/// The workspace root: the parent of this crate's directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}
