//! `cargo xtask vm`: runs chosen tests inside Debian kernels under qemu.
//!
//! This machine's kernel (6.18) has no IPVS and is much newer than what
//! many nodes run, so the programs are also checked on Debian 12's kernels:
//! 6.1 (its own, with IPVS modules) and 6.12 (its security and backports
//! suites'), listed in [`KERNELS`] with the test targets each runs. For
//! each kernel chosen, four steps, each cached under `~/.cache/xproxy/vm/`:
//!
//! 1. [`kernel`]: the newest `linux-image-<series>.*-cloud-amd64-unsigned`
//!    apt knows, downloaded, extracted and `depmod`ed once per release; its
//!    `/boot/config-*` must have what the tests need.
//! 2. The eBPF object (`build-ebpf`), the chosen test executables of
//!    `xproxy-tests` (`cargo test --no-run`) and the agent `xproxy`, built
//!    once for every kernel.
//! 3. [`initramfs`]: busybox, the kernel modules with their dependencies, the
//!    test executables, `ip`/`bpftool`/`ipvsadm` and every library they
//!    load, and an `/init` that runs the tests; packed into a cpio archive
//!    named by the hash of its contents, so an unchanged set is not repacked.
//! 4. [`run`]: boots it with `qemu-system-x86_64 -accel tcg` (KVM guests crash
//!    on these machines), streams the serial console, reads the markers
//!    `/init` prints and libtest's `test result:` lines, and prints a summary
//!    per test executable. Fails if a test failed or the VM timed out.
//!
//! With several kernels, every guest runs (a failure on one does not skip
//! the next) and a line per kernel closes the output.

mod bench;
mod init;
mod initramfs;
mod kernel;
mod run;

pub use bench::{BenchOptions, bench_in_vm};

use std::{
    env, fs,
    io::BufRead,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{build_ebpf, command, setup};
pub use setup::find_program;

/// The package whose test executables run in the VM.
const TEST_PACKAGE: &str = "xproxy-tests";

/// The agent (package, binary): the agent tests start it from
/// `target/<profile>/`, which the guest has at the host's path.
const AGENT: (&str, &str) = ("proxy-userspace", "xproxy");

/// Mutated frames per program for the fuzz test in the VM: the full million
/// takes hours under software emulation.
const DEFAULT_FUZZ_FRAMES: u64 = 20_000;

/// The test targets every guest kernel runs: every program loads and
/// pins its maps (`verifier`), the frame-by-frame tests through
/// `BPF_PROG_TEST_RUN` (`packet`, `fuzz`) and the namespace end-to-end
/// tests (`e2e`).
const EVERY_KERNEL: &[&str] = &["verifier", "packet", "fuzz", "e2e"];

/// A Debian kernel series `--kernel` takes, and the heavier suites its
/// guest runs after [`EVERY_KERNEL`].
#[derive(Debug)]
pub struct GuestKernel {
    /// `6.1`: the newest `linux-image-6.1.*-cloud-amd64-unsigned` is used.
    pub series: &'static str,
    /// `TARGET` or `TARGET:FILTER` (see [`Options::tests`]).
    pub suites: &'static [&'static str],
}

/// The kernels tested besides the host's, oldest first, and what each
/// runs: the one place that names the test targets of the VM. Under
/// software emulation every suite on both would take over 20 minutes, so the
/// heavier ones are split (README.md, "Kernels tested", says why):
/// - 6.1, the oldest: the IPVS suites, the two-node bed in every kernel
///   mode (remote backends and SNAT through the oldest netfilter, nftables
///   and verifier), `xproxy trace` where tc programs are filters (before
///   tcx) and Maglev through the agent.
/// - 6.12: what changes with the attach API (tcx links from 6.6): the
///   two-node bed in the ebpf mode, the agent switching between every mode
///   (links detached and replaced) and the IPVS mode's own tests.
pub const KERNELS: &[GuestKernel] = &[
    GuestKernel {
        series: "6.1",
        suites: &[
            "mode_ipvs",
            "dual_stack_ipvs_userspace:ipvs",
            "modes:ipvs",
            "service_api:ipvs",
            "modes:switching",
            "mode_golden:ipvs",
            "traffic:ipvs",
            "bulk:ipvs",
            "status:ipvs",
            "trace",
            "maglev",
            "two_node:two_node_ebpf",
            "two_node:two_node_iptables",
            "two_node:two_node_nftables",
        ],
    },
    GuestKernel {
        series: "6.12",
        suites: &["two_node:two_node_ebpf", "modes:switching", "mode_ipvs"],
    },
];

impl GuestKernel {
    /// The targets this kernel's guest runs unless `--tests` says otherwise.
    pub fn default_tests(&self) -> Vec<String> {
        EVERY_KERNEL
            .iter()
            .chain(self.suites)
            .map(|name| (*name).to_owned())
            .collect()
    }
}

#[derive(clap::Args, Debug)]
pub struct Options {
    /// Debian kernel series, comma-separated, or `all`: 6.1, 6.12 (the
    /// newest `linux-image-<SERIES>.*-cloud-amd64-unsigned` is used). Each
    /// boots in turn.
    #[arg(long, value_delimiter = ',', default_value = "6.1")]
    pub kernel: Vec<String>,
    /// Test targets of xproxy-tests to run in the VM, comma-separated;
    /// `TARGET:FILTER` runs only the tests of TARGET whose name contains
    /// FILTER (`modes:ipvs`: the per-mode suite's IPVS tests). Default:
    /// each kernel's list (`KERNELS` in xtask/src/vm.rs).
    #[arg(long, value_delimiter = ',')]
    pub tests: Option<Vec<String>>,
    /// Keep the unpacked initramfs tree next to the archive (for inspection).
    #[arg(long)]
    pub keep: bool,
    /// Give up (and fail) after this many seconds of run time of one guest
    /// (the 6.1 guest runs ~11 minutes on an idle machine, three times that
    /// on a busy one).
    #[arg(long, default_value_t = 3600)]
    pub timeout: u64,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 1024)]
    pub memory: u32,
    /// `XPROXY_FUZZ_FRAMES` for the fuzz test in the VM (the host's value wins if set).
    #[arg(long, default_value_t = DEFAULT_FUZZ_FRAMES)]
    pub fuzz_frames: u64,
    /// Arguments for every test executable, after `--` (e.g. `-- --nocapture`).
    /// `--test-threads=1` is always passed first.
    #[arg(last = true)]
    pub test_args: Vec<String>,
}

/// The kernels named by `--kernel`, in the order given (`all`: every one
/// of [`KERNELS`]).
fn chosen_kernels(names: &[String]) -> Result<Vec<&'static GuestKernel>> {
    let mut chosen: Vec<&'static GuestKernel> = Vec::new();
    for name in names {
        let found: Vec<&'static GuestKernel> = if name == "all" {
            KERNELS.iter().collect()
        } else {
            vec![find_kernel(name)?]
        };
        for kernel in found {
            if !chosen.iter().any(|k| k.series == kernel.series) {
                chosen.push(kernel);
            }
        }
    }
    if chosen.is_empty() {
        bail!("no kernel chosen (--kernel)");
    }
    Ok(chosen)
}

/// The [`KERNELS`] entry of `series`.
fn find_kernel(series: &str) -> Result<&'static GuestKernel> {
    KERNELS.iter().find(|k| k.series == series).with_context(|| {
        let known: Vec<&str> = KERNELS.iter().map(|k| k.series).collect();
        format!(
            "--kernel {series:?}: the kernels tested are {} (or all)",
            known.join(", ")
        )
    })
}

/// A test executable of [`TEST_PACKAGE`], or a binary the tests start.
#[derive(Debug, Clone)]
pub struct Executable {
    /// The cargo target name (`packet`, `xproxy-test-apiserver`, ...), or
    /// for a filtered test run `TARGET:FILTER`.
    pub name: String,
    /// For a test run: only the tests whose name contains this.
    pub filter: Option<String>,
    /// Its path on the host; the VM has it at the same path, so paths the
    /// tests compile in (`CARGO_BIN_EXE_*`, `target/<profile>/...`) resolve.
    pub path: PathBuf,
}

/// What the guest runs: the test executables and the arguments and
/// environment they get.
#[derive(Debug)]
pub struct Plan {
    pub tests: Vec<Executable>,
    /// Binaries the tests may start: the tests package's own and the agent.
    pub helpers: Vec<Executable>,
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
    /// A bench run after the tests (its argv, without `--out`): its
    /// results are handed out on the console ([`init::FILE`]).
    pub bench: Option<Vec<String>>,
}

/// Fetches the kernels, builds the tests once, then packs and boots them
/// for each kernel in turn; fails unless every step in every guest passed.
pub fn vm(root: &Path, options: &Options) -> Result<()> {
    let started = Instant::now();
    check_host_programs()?;
    let cache = cache_dir()?;
    fs::create_dir_all(&cache).with_context(|| format!("cannot create {}", cache.display()))?;

    // Every kernel first: a missing package fails before the long build.
    let mut runs = Vec::new();
    for spec in chosen_kernels(&options.kernel)? {
        let tests = options.tests.clone().unwrap_or_else(|| spec.default_tests());
        runs.push((guest_kernel(&cache, spec.series)?, tests));
    }

    phase("building the eBPF object and the test executables");
    let t = Instant::now();
    build_ebpf::build_ebpf(root, &build_ebpf::Options::default())?;
    let every_test = union(runs.iter().map(|(_, tests)| tests.as_slice()));
    let (built, helpers) = build_tests(root, &every_test)?;
    phase(&format!("built in {:.1} s", t.elapsed().as_secs_f64()));

    let guest = Guest {
        memory_mib: options.memory,
        timeout: Duration::from_secs(options.timeout),
        keep: options.keep,
    };
    let mut verdicts = Vec::new();
    for (kernel, names) in &runs {
        let guest_started = Instant::now();
        let plan = Plan {
            tests: names
                .iter()
                .filter_map(|name| built.iter().find(|test| &test.name == name).cloned())
                .collect(),
            helpers: helpers.clone(),
            env: guest_env(options),
            args: std::iter::once("--test-threads=1".to_owned())
                .chain(options.test_args.iter().cloned())
                .collect(),
            bench: None,
        };
        let problem = match guest.boot(root, &cache, kernel, &plan) {
            Ok(outcome) => outcome.problem(&names.iter().map(String::as_str).collect::<Vec<_>>()),
            Err(error) => Some(format!("{error:#}")),
        };
        verdicts.push((kernel.release.clone(), problem, guest_started.elapsed()));
    }
    for (release, problem, took) in &verdicts {
        let verdict = problem.as_deref().unwrap_or("every step passed");
        println!("xtask vm: kernel {release}: {verdict} ({:.1} s)", took.as_secs_f64());
    }
    println!("xtask vm: total {:.1} s", started.elapsed().as_secs_f64());
    let failed: Vec<&str> = verdicts
        .iter()
        .filter(|(_, problem, _)| problem.is_some())
        .map(|(release, _, _)| release.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("VM tests failed on {}", failed.join(", "));
    }
    Ok(())
}

/// Every name of `lists`, each once, in the order first seen.
fn union<'a>(lists: impl Iterator<Item = &'a [String]>) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for name in lists.flatten() {
        if !all.contains(name) {
            all.push(name.clone());
        }
    }
    all
}

/// The newest Debian kernel of `series`, fetched once into `cache`.
fn guest_kernel(cache: &Path, series: &str) -> Result<kernel::Kernel> {
    find_kernel(series)?;
    phase(&format!("kernel: the newest Debian {series} cloud kernel"));
    let t = Instant::now();
    let kernel = kernel::ensure(cache, series)?;
    phase(&format!(
        "kernel {} ({}) ready in {:.1} s",
        kernel.release,
        kernel.package_version,
        t.elapsed().as_secs_f64()
    ));
    Ok(kernel)
}

/// How the guest is booted.
struct Guest {
    memory_mib: u32,
    timeout: Duration,
    keep: bool,
}

impl Guest {
    /// Packs `plan` for `kernel`, boots it and prints the summary.
    fn boot(&self, root: &Path, cache: &Path, kernel: &kernel::Kernel, plan: &Plan) -> Result<run::Outcome> {
        phase("initramfs");
        let t = Instant::now();
        let initrd = initramfs::ensure(root, cache, kernel, plan, self.keep)?;
        phase(&format!(
            "initramfs {} ready in {:.1} s",
            initrd.display(),
            t.elapsed().as_secs_f64()
        ));
        phase(&format!(
            "booting {} under qemu (TCG, {} MiB, timeout {} s)",
            kernel.release,
            self.memory_mib,
            self.timeout.as_secs()
        ));
        // One log per series: the last run on each kernel stays readable.
        let log = cache.join(format!("console-{}.log", kernel.series));
        let boot = run::Boot {
            kernel: &kernel.vmlinuz,
            initrd: &initrd,
            memory_mib: self.memory_mib,
            timeout: self.timeout,
            log: &log,
        };
        let mut outcome = run::boot(&boot)?;
        for attempt in 2..=BOOT_ATTEMPTS {
            if !died_while_booting(&outcome) {
                break;
            }
            let kept = cache.join(format!("console-{}.boot-failure.log", kernel.series));
            std::fs::rename(&log, &kept).with_context(|| format!("keeping {}", log.display()))?;
            phase(&format!(
                "the guest kernel died before its /init ran (console log in {}); boot {attempt} of {BOOT_ATTEMPTS}",
                kept.display()
            ));
            outcome = run::boot(&boot)?;
        }
        println!();
        print!("{}", outcome.summary());
        println!("xtask vm: console log in {}", log.display());
        Ok(outcome)
    }
}

/// Boots per kernel when the guest dies before its /init runs. Under
/// software emulation with two vCPUs, Debian's 6.12 kernel now and then
/// oopses at boot on an int3 of its own code patching (seen once in about
/// ten boots, in `sched_clock_cpu`): a flaw of the emulation, not of what
/// is tested, so a boot that never reached /init is tried again. A guest
/// that reached /init and then failed is never retried.
const BOOT_ATTEMPTS: u32 = 3;

/// Whether the guest died before /init reported anything (no kernel line,
/// no step, no timeout).
fn died_while_booting(outcome: &run::Outcome) -> bool {
    outcome.kernel.is_none() && outcome.steps.is_empty() && !outcome.timed_out
}

fn phase(text: &str) {
    eprintln!("xtask vm: {text}");
}

/// Installs the host programs the VM step needs (as root), or says which.
fn check_host_programs() -> Result<()> {
    setup::ensure_programs(setup::VM_TOOLS)
}

/// `$XDG_CACHE_HOME/xproxy/vm`, else `$HOME/.cache/xproxy/vm`.
fn cache_dir() -> Result<PathBuf> {
    let base = match env::var_os("XDG_CACHE_HOME").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set")?).join(".cache"),
    };
    Ok(base.join("xproxy").join("vm"))
}

/// The environment of every test in the guest.
fn guest_env(options: &Options) -> Vec<(String, String)> {
    let fuzz_frames = env::var("XPROXY_FUZZ_FRAMES").unwrap_or_else(|_| options.fuzz_frames.to_string());
    let mut vars = vec![
        ("XPROXY_PRIVILEGED_TESTS".to_owned(), "1".to_owned()),
        // The guest loads ip_vs: the IPVS tests must run, not skip.
        ("XPROXY_IPVS_TESTS".to_owned(), "1".to_owned()),
        ("XPROXY_FUZZ_FRAMES".to_owned(), fuzz_frames),
        ("RUST_BACKTRACE".to_owned(), "1".to_owned()),
    ];
    if let Ok(seed) = env::var("XPROXY_FUZZ_SEED") {
        vars.push(("XPROXY_FUZZ_SEED".to_owned(), seed));
    }
    vars
}

/// Builds the chosen test targets of [`TEST_PACKAGE`] without running them,
/// and the agent; returns the test executables (in the order asked for) and
/// the binaries the tests may start (the package's own and the agent).
fn build_tests(root: &Path, names: &[String]) -> Result<(Vec<Executable>, Vec<Executable>)> {
    if names.is_empty() {
        bail!("no tests chosen (--tests)");
    }
    let chosen: Vec<(&str, Option<&str>)> = names
        .iter()
        .map(|name| match name.split_once(':') {
            Some((target, filter)) => (target, Some(filter)),
            None => (name.as_str(), None),
        })
        .collect();
    let mut args = vec!["test", "-p", TEST_PACKAGE, "--no-run"];
    for (target, _) in &chosen {
        args.extend(["--test", target]);
    }
    let (tests, mut helpers) = cargo_executables(root, &args)?;
    let (_, agent) = cargo_executables(root, &["build", "-p", AGENT.0, "--bin", AGENT.1])?;
    helpers.extend(agent);
    let mut ordered = Vec::new();
    for (name, (target, filter)) in names.iter().zip(chosen) {
        let found = tests
            .iter()
            .find(|test| test.name == target)
            .with_context(|| format!("cargo built no test executable named {target}"))?;
        ordered.push(Executable {
            name: name.clone(),
            path: found.path.clone(),
            filter: filter.map(str::to_owned),
        });
    }
    helpers.sort_by(|a, b| a.path.cmp(&b.path));
    helpers.dedup_by(|a, b| a.path == b.path);
    Ok((ordered, helpers))
}

/// Runs `cargo ARGS --message-format=json-render-diagnostics` and returns
/// the test executables and the binaries it built.
fn cargo_executables(root: &Path, args: &[&str]) -> Result<(Vec<Executable>, Vec<Executable>)> {
    let mut cmd = command::workspace_cargo(root);
    cmd.args(args).arg("--message-format=json-render-diagnostics");
    let text = command::describe(&cmd);
    eprintln!("xtask: running {text}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("failed to start `{text}`"))?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut tests = Vec::new();
    let mut binaries = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.with_context(|| format!("reading the output of `{text}`"))?;
        match artifact(&line)? {
            Some((executable, true)) => tests.push(executable),
            Some((executable, false)) => binaries.push(executable),
            None => {}
        }
    }
    let status = child.wait().with_context(|| format!("waiting for `{text}`"))?;
    if !status.success() {
        bail!("`{text}` failed: {status}");
    }
    Ok((tests, binaries))
}

/// An executable from one line of cargo's JSON messages: `Some((it, true))`
/// for an integration test, `Some((it, false))` for a binary target.
fn artifact(line: &str) -> Result<Option<(Executable, bool)>> {
    let message: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("cargo printed a line that is not JSON: {line}"))?;
    if message["reason"] != "compiler-artifact" {
        return Ok(None);
    }
    let Some(path) = message["executable"].as_str() else {
        return Ok(None);
    };
    let name = message["target"]["name"].as_str().unwrap_or_default().to_owned();
    let kinds: Vec<&str> = message["target"]["kind"]
        .as_array()
        .map(|kinds| kinds.iter().filter_map(|kind| kind.as_str()).collect())
        .unwrap_or_default();
    let is_test_profile = message["profile"]["test"].as_bool().unwrap_or(false);
    let executable = Executable {
        name,
        filter: None,
        path: PathBuf::from(path),
    };
    if kinds.contains(&"test") {
        Ok(Some((executable, true)))
    } else if kinds.contains(&"bin") && !is_test_profile {
        Ok(Some((executable, false)))
    } else {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_guest_that_never_reached_init_is_booted_again() {
        assert!(died_while_booting(&run::Outcome::default()));
        let reported = run::Outcome {
            kernel: Some("6.12.118+deb12-cloud-amd64".into()),
            ..Default::default()
        };
        assert!(!died_while_booting(&reported), "/init ran: its failure counts");
        let timed_out = run::Outcome {
            timed_out: true,
            ..Default::default()
        };
        assert!(!died_while_booting(&timed_out));
    }

    #[test]
    fn every_kernel_loads_the_programs_and_runs_the_packet_tests() {
        for kernel in KERNELS {
            let tests = kernel.default_tests();
            for name in EVERY_KERNEL {
                assert!(tests.iter().any(|test| test == name), "{} lacks {name}", kernel.series);
            }
            assert_eq!(
                union([tests.as_slice()].into_iter()),
                tests,
                "{} repeats a target",
                kernel.series
            );
        }
    }

    #[test]
    fn chooses_kernels_by_series() {
        let names = |list: &[&str]| list.iter().map(|name| (*name).to_owned()).collect::<Vec<_>>();
        let series = |chosen: Vec<&GuestKernel>| chosen.iter().map(|k| k.series).collect::<Vec<_>>();
        assert_eq!(series(chosen_kernels(&names(&["6.12"])).expect("known")), ["6.12"]);
        assert_eq!(
            series(chosen_kernels(&names(&["all"])).expect("known")),
            ["6.1", "6.12"]
        );
        assert_eq!(
            series(chosen_kernels(&names(&["6.12", "all", "6.1"])).expect("known")),
            ["6.12", "6.1"]
        );
        let error = chosen_kernels(&names(&["6.2"])).expect_err("unknown");
        assert!(format!("{error:#}").contains("6.1, 6.12"), "{error:#}");
        assert!(chosen_kernels(&[]).is_err());
    }

    #[test]
    fn builds_each_target_once() {
        let a = ["verifier".to_owned(), "two_node".to_owned()];
        let b = ["verifier".to_owned(), "two_node:two_node_ebpf".to_owned()];
        assert_eq!(
            union([a.as_slice(), b.as_slice()].into_iter()),
            ["verifier", "two_node", "two_node:two_node_ebpf"]
        );
    }

    #[test]
    fn reads_test_and_bin_artifacts() {
        let test = r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"packet"},"profile":{"test":true},"executable":"/w/target/debug/deps/packet-1"}"#;
        let bin = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"api"},"profile":{"test":false},"executable":"/w/target/debug/api"}"#;
        let bin_test = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"api"},"profile":{"test":true},"executable":"/w/target/debug/deps/api-2"}"#;
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"x"},"profile":{"test":false},"executable":null}"#;
        let (packet, is_test) = artifact(test).expect("json").expect("an executable");
        assert!(is_test);
        assert_eq!(packet.name, "packet");
        assert_eq!(packet.path, Path::new("/w/target/debug/deps/packet-1"));
        let (api, is_test) = artifact(bin).expect("json").expect("an executable");
        assert!(!is_test);
        assert_eq!(api.name, "api");
        assert!(artifact(bin_test).expect("json").is_none());
        assert!(artifact(lib).expect("json").is_none());
        assert!(
            artifact(r#"{"reason":"build-finished","success":true}"#)
                .expect("json")
                .is_none()
        );
    }
}
