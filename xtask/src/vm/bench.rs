//! `cargo xtask bench --vm`: the bench in the Debian guest, for the modes
//! this machine's kernel cannot run (IPVS).
//!
//! The guest is the one `cargo xtask vm` boots (same kernel, initramfs and
//! console protocol); instead of tests, `/init` runs `xproxy-bench run` and
//! hands its results file out on the console. The host writes it to
//! `bench/results/<date>-<host>-guest.json` and renders its report and charts.
//! The guest runs under software emulation: its numbers compare with each
//! other (IPVS next to ebpf and iptables on one kernel), not with a run on
//! the host; the results say so (`guest`, shown at the top of the report).

use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::{Executable, Guest, Plan, cache_dir, check_host_programs, guest_kernel, phase};
use crate::{build_ebpf, command};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchOptions {
    /// Debian kernel series of the guest.
    #[arg(long = "vm-kernel", default_value = "6.1")]
    pub kernel: String,
    /// Guest memory in MiB.
    #[arg(long = "vm-memory", default_value_t = 3072)]
    pub memory: u32,
    /// Give up after this many seconds of guest run time.
    #[arg(long = "vm-timeout", default_value_t = 3600)]
    pub timeout: u64,
}

/// What the guest measures unless told otherwise: IPVS beside the modes
/// the host also measures, at the two smaller Ns, in rounds short enough
/// for an emulated CPU; probes get 100 ms (a connection set up under
/// emulation takes milliseconds).
const DEFAULT_MODES: &str = "ebpf,iptables,ipvs";
const DEFAULT_SERVICES: &str = "100,1000";
const DEFAULT_ARGS: &[&str] = &[
    "--rounds",
    "3",
    "--connections",
    "500",
    "--changes",
    "20",
    "--wrk-seconds",
    "2",
    "--program-timeout",
    "900",
    "--probe-timeout-ms",
    "100",
    "--no-scale",
    "--no-per-packet",
];

/// Builds the release binaries, runs the bench in the guest and writes
/// its results under `bench/results`.
pub fn bench_in_vm(
    root: &Path,
    options: &BenchOptions,
    (modes, services): (Option<&str>, Option<&str>),
    extra_args: &[String],
) -> Result<()> {
    check_host_programs()?;
    let cache = cache_dir()?;
    fs::create_dir_all(&cache).with_context(|| format!("cannot create {}", cache.display()))?;
    let kernel = guest_kernel(&cache, &options.kernel)?;

    phase("building the eBPF object, xproxy and xproxy-bench (release)");
    build_ebpf::build_ebpf(root, &build_ebpf::Options::default())?;
    crate::bench::build_release(root)?;
    let release = root.join("target/release");
    let (bench, agent) = (release.join("xproxy-bench"), release.join("xproxy"));

    let mut argv: Vec<String> = vec![
        bench.display().to_string(),
        "run".into(),
        "--xproxy".into(),
        agent.display().to_string(),
        "--modes".into(),
        modes.unwrap_or(DEFAULT_MODES).into(),
        "--services".into(),
        services.unwrap_or(DEFAULT_SERVICES).into(),
    ];
    argv.extend(DEFAULT_ARGS.iter().map(|a| (*a).to_owned()));
    // Later flags win in clap only for repeatable ones: the caller's
    // replace the defaults instead.
    argv = with_overrides(argv, extra_args);

    let guest_name = format!(
        "Debian kernel {} ({}) under qemu with software emulation (TCG, 2 vCPUs, {} MiB), \
         started by `cargo xtask bench --vm` on {}",
        kernel.release,
        kernel.package_version,
        options.memory,
        host_name()
    );
    let plan = Plan {
        tests: Vec::new(),
        helpers: vec![executable("xproxy-bench", &bench), executable("xproxy", &agent)],
        env: vec![
            ("XPROXY_BENCH_GUEST".to_owned(), guest_name),
            ("XPROXY_BENCH_COMMIT".to_owned(), git_commit(root)),
            ("RUST_BACKTRACE".to_owned(), "1".to_owned()),
            // The serial console cannot redraw a progress bar.
            ("TERM".to_owned(), "dumb".to_owned()),
        ],
        args: Vec::new(),
        bench: Some(argv),
    };
    let guest = Guest {
        memory_mib: options.memory,
        timeout: Duration::from_secs(options.timeout),
        keep: false,
    };
    let outcome = guest.boot(root, &cache, &kernel, &plan)?;
    let written = save_results(root, &outcome.files)?;
    // A bench whose parts partly failed still wrote results: keep them,
    // then fail like the bench on the host does.
    if let Some(problem) = outcome.problem(&["bench"]) {
        bail!("the bench in the VM failed: {problem} (results kept: {written:?})");
    }
    if written.is_empty() {
        bail!("the guest handed out no results (see the console log)");
    }
    Ok(())
}

fn executable(name: &str, path: &Path) -> Executable {
    Executable {
        name: name.to_owned(),
        filter: None,
        path: path.to_owned(),
    }
}

/// `argv` with each `--flag value` of `extra` replacing the same flag's
/// default (or added), and bare flags added once.
fn with_overrides(mut argv: Vec<String>, extra: &[String]) -> Vec<String> {
    let mut i = 0;
    while i < extra.len() {
        let flag = &extra[i];
        let value = extra.get(i + 1).filter(|v| !v.starts_with("--"));
        match (argv.iter().position(|a| a == flag), value) {
            (Some(at), Some(value)) if argv.get(at + 1).is_some_and(|v| !v.starts_with("--")) => {
                argv[at + 1] = value.clone();
            }
            (Some(_), None) => {}
            (_, value) => {
                argv.push(flag.clone());
                argv.extend(value.cloned());
            }
        }
        i += if value.is_some() { 2 } else { 1 };
    }
    argv
}

/// Writes the results files the guest handed out as
/// `bench/results/<date>-<host>-guest.json` and renders their reports; returns
/// what was written.
fn save_results(root: &Path, files: &[(String, Result<Vec<u8>, String>)]) -> Result<Vec<PathBuf>> {
    let dir = root.join("bench/results");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut written = Vec::new();
    for (name, bytes) in files {
        let bytes = bytes
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("the guest's {name}"))?;
        let path = dir.join(results_name(name, &host_name()));
        fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        command::run(
            std::process::Command::new(root.join("target/release/xproxy-bench"))
                .arg("report")
                .arg(&path),
        )
        .with_context(|| format!("rendering the report of {}", path.display()))?;
        eprintln!("xtask bench --vm: wrote {} and its report", path.display());
        written.push(path);
    }
    Ok(written)
}

/// `2026-12-03-_none_.json` from the guest -> `2026-12-03-<host>-guest.json`:
/// the guest's own host name means nothing here.
fn results_name(guest_file: &str, host: &str) -> String {
    let stem = guest_file.strip_suffix(".json").unwrap_or(guest_file);
    let date = stem.get(..10).filter(|d| d.bytes().filter(|b| *b == b'-').count() == 2);
    let quick = if stem.ends_with("-quick") { "-quick" } else { "" };
    match date {
        Some(date) => format!("{date}-{host}-guest{quick}.json"),
        None => format!("{stem}-guest.json"),
    }
}

fn host_name() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "unknown".into(), |h| h.trim().to_owned())
}

fn git_commit(root: &Path) -> String {
    let rev_parse = command::stdout(
        std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(["rev-parse", "HEAD"]),
    );
    rev_parse.map_or_else(|_| "unknown".into(), |commit| commit.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn the_callers_flags_replace_the_defaults() {
        let defaults = args(&["bench", "run", "--rounds", "3", "--no-scale"]);
        assert_eq!(
            with_overrides(defaults.clone(), &args(&["--rounds", "1", "--quick", "--seed", "7"])),
            args(&["bench", "run", "--rounds", "1", "--no-scale", "--quick", "--seed", "7"])
        );
        assert_eq!(with_overrides(defaults.clone(), &args(&["--no-scale"])), defaults);
    }

    #[test]
    fn results_are_named_for_this_host_and_marked() {
        assert_eq!(results_name("2026-12-03-_none_.json", "vm"), "2026-12-03-vm-guest.json");
        assert_eq!(
            results_name("2026-12-03-_none_-quick.json", "host"),
            "2026-12-03-host-guest-quick.json"
        );
        assert_eq!(results_name("odd.json", "host"), "odd-guest.json");
    }
}
