//! `cargo xtask bench`: builds the release binaries (the eBPF object, the
//! agent `xproxy`, `xproxy-bench`) and runs `xproxy-bench run` as root,
//! which measures every mode and writes `bench/results/<date>-<host>.*`.
//! With `--vm` the bench runs in the Debian guest of `cargo xtask vm`
//! instead, for IPVS (`vm::bench_in_vm`).

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::{build_ebpf, command, setup, vm};

#[derive(clap::Args, Debug)]
pub struct Options {
    /// Modes, comma-separated (ebpf,iptables,iptables-legacy,nftables,ipvs,userspace;
    /// `iptables` is the nft backend).
    #[arg(long)]
    pub modes: Option<String>,
    /// Numbers of Services, comma-separated [default: 100,1000,10000,20000].
    #[arg(long)]
    pub services: Option<String>,
    /// A smoke test: N = 100 and 1,000, few rounds, a few minutes.
    #[arg(long)]
    pub quick: bool,
    /// Run in the Debian 6.1 guest under qemu instead, where IPVS is
    /// [default modes: ebpf,iptables,ipvs; Services: 100,1000]; writes
    /// bench/results/<date>-<host>-guest.* (software emulation: slow).
    #[arg(long)]
    pub vm: bool,
    #[command(flatten)]
    pub guest: vm::BenchOptions,
    /// More arguments for `xproxy-bench run`, after `--` (see `xproxy-bench run --help`).
    #[arg(last = true)]
    pub bench_args: Vec<String>,
}

pub fn bench(root: &Path, options: &Options) -> Result<()> {
    if !testbed::privileged::is_root() {
        bail!("the bench creates network namespaces and loads eBPF programs: run it as root");
    }
    if options.vm {
        let mut extra = options.bench_args.clone();
        if options.quick {
            extra.push("--quick".into());
        }
        return vm::bench_in_vm(
            root,
            &options.guest,
            (options.modes.as_deref(), options.services.as_deref()),
            &extra,
        );
    }
    setup::ensure_programs(setup::NAMESPACE_TOOLS)?;
    setup::ensure_programs(setup::BENCH_TOOLS)?;
    setup::ensure_bpffs()?;
    build_ebpf::build_ebpf(root, &build_ebpf::Options::default())?;
    build_release(root)?;
    let release = root.join("target/release");
    let mut cmd = std::process::Command::new(release.join("xproxy-bench"));
    cmd.current_dir(root)
        .arg("run")
        .arg("--xproxy")
        .arg(release.join("xproxy"));
    if let Some(modes) = &options.modes {
        cmd.args(["--modes", modes]);
    }
    if let Some(services) = &options.services {
        cmd.args(["--services", services]);
    }
    if options.quick {
        cmd.arg("--quick");
    }
    cmd.args(&options.bench_args);
    command::run(&mut cmd)
}

/// The agent and the bench, release builds (the eBPF object is built first).
pub fn build_release(root: &Path) -> Result<()> {
    command::run(command::workspace_cargo(root).args([
        "build",
        "--release",
        "-p",
        "proxy-userspace",
        "-p",
        "xproxy-bench",
        "--bin",
        "xproxy",
        "--bin",
        "xproxy-bench",
    ]))
    .context("building xproxy and xproxy-bench")
}
