//! The guest's `/init` and the markers it prints on the serial console.
//!
//! `/init` is a busybox shell script: it mounts proc, sysfs, devtmpfs,
//! bpffs, debugfs and tmpfs on /run (not on /tmp: the initramfs is writable
//! already, and the test executables sit at their host paths, which may be
//! under /tmp in a CI clone), loads the modules, prints the
//! kernel release, then runs each step between a `BEGIN` and an `END` marker
//! (with the step's exit code) and powers off. The host reads the markers
//! (`run::Parser`); everything else on the console is the steps' own output.

use std::fmt::Write as _;

use super::Plan;

/// Every marker line starts with this (after whatever the console put
/// before it on the same line).
pub const MARK: &str = "XPROXY-VM:";
/// `XPROXY-VM: KERNEL <uname -r>`
pub const KERNEL: &str = "KERNEL";
/// `XPROXY-VM: MODPROBE-FAILED <module>`
pub const MODPROBE_FAILED: &str = "MODPROBE-FAILED";
/// `XPROXY-VM: BEGIN <step>`
pub const BEGIN: &str = "BEGIN";
/// `XPROXY-VM: END <step> <exit code>`
pub const END: &str = "END";
/// `XPROXY-VM: DONE`: every step ran; the guest powers off next.
pub const DONE: &str = "DONE";
/// `XPROXY-VM: FILE <name>`, the file's bytes in base64 lines, then
/// `XPROXY-VM: FILE-END`: a result the guest hands to the host (it has no
/// other way out: no network, no shared directory).
pub const FILE: &str = "FILE";
pub const FILE_END: &str = "FILE-END";

/// Where the guest's bench writes its results (on tmpfs).
pub const BENCH_OUT: &str = "/run/bench";

/// The smoke check that IPVS works in the guest (after `modprobe ip_vs`).
pub const IPVS_SMOKE: (&str, &[&str]) = ("ipvsadm -Ln", &["ipvsadm", "-Ln"]);

/// The `/init` script running `plan` after loading `modules`.
pub fn script(plan: &Plan, modules: &[String]) -> String {
    let mut s = String::new();
    s.push_str(
        r#"#!/bin/sh
# /init of `cargo xtask vm` (generated): mounts, loads the modules, runs each
# step between markers on the serial console, then powers off.
export PATH=/usr/sbin:/usr/bin HOME=/root
mark() { echo "XPROXY-VM: $*"; }
step() {
    name=$1
    shift
    mark BEGIN "$name"
    "$@"
    rc=$?
    mark END "$name" "$rc"
}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /tmp
mount -t tmpfs tmpfs /run
mount -t bpf bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug
mkdir -p /run/netns /dev/shm
ip link set lo up
mark KERNEL "$(uname -r)"
"#,
    );
    if !modules.is_empty() {
        let _ = writeln!(
            s,
            "for module in {}; do\n    modprobe \"$module\" && [ -d \"/sys/module/$module\" ] || mark MODPROBE-FAILED \"$module\"\ndone",
            modules.join(" ")
        );
    }
    let (name, argv) = IPVS_SMOKE;
    let _ = writeln!(s, "step {} {}", quote(name), join_quoted(argv.iter().copied()));
    s.push_str("cd /tmp\n");
    let env: Vec<String> = plan.env.iter().map(|(key, value)| format!("{key}={value}")).collect();
    for test in &plan.tests {
        let path = test.path.to_string_lossy();
        let argv = std::iter::once("env")
            .chain(env.iter().map(String::as_str))
            .chain(std::iter::once(path.as_ref()))
            .chain(plan.args.iter().map(String::as_str))
            .chain(test.filter.as_deref());
        let _ = writeln!(s, "step {} {}", quote(&test.name), join_quoted(argv));
    }
    if let Some(bench) = &plan.bench {
        let argv = std::iter::once("env")
            .chain(env.iter().map(String::as_str))
            .chain(bench.iter().map(String::as_str))
            .chain(["--out", BENCH_OUT]);
        let _ = writeln!(s, "step bench {}", join_quoted(argv));
        let _ = writeln!(
            s,
            "for file in {BENCH_OUT}/*.json; do\n    [ -f \"$file\" ] || continue\n    \
             mark {FILE} \"${{file##*/}}\"\n    base64 \"$file\"\n    mark {FILE_END}\ndone"
        );
    }
    s.push_str("mark DONE\npoweroff -f\nsleep 5\necho o > /proc/sysrq-trigger\n");
    s
}

fn join_quoted<'a>(words: impl Iterator<Item = &'a str>) -> String {
    words.map(quote).collect::<Vec<_>>().join(" ")
}

/// `word` as one shell word.
fn quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::vm::Executable;

    #[test]
    fn quotes_words_for_the_shell() {
        assert_eq!(quote("--test-threads=1"), "--test-threads=1");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
    }

    #[test]
    fn runs_every_test_between_markers() {
        let plan = Plan {
            tests: vec![
                Executable {
                    name: "packet".into(),
                    path: PathBuf::from("/w/target/debug/deps/packet-1"),
                    filter: None,
                },
                Executable {
                    name: "modes:ipvs".into(),
                    path: PathBuf::from("/w/target/debug/deps/modes-2"),
                    filter: Some("ipvs".into()),
                },
            ],
            helpers: vec![],
            env: vec![("XPROXY_PRIVILEGED_TESTS".into(), "1".into())],
            args: vec!["--test-threads=1".into(), "some filter".into()],
            bench: None,
        };
        let script = script(&plan, &["veth".into(), "ip_vs".into()]);
        assert!(script.starts_with("#!/bin/sh\n"));
        assert!(script.contains("for module in veth ip_vs; do"));
        assert!(script.contains(
            "step packet env XPROXY_PRIVILEGED_TESTS=1 /w/target/debug/deps/packet-1 --test-threads=1 'some filter'\n"
        ));
        assert!(script.contains(
            "step modes:ipvs env XPROXY_PRIVILEGED_TESTS=1 /w/target/debug/deps/modes-2 --test-threads=1 'some filter' ipvs\n"
        ));
        assert!(script.contains("step 'ipvsadm -Ln' ipvsadm -Ln\n"));
        assert!(script.contains("mark DONE\npoweroff -f\n"));
        assert!(!script.contains("step bench"));
    }

    #[test]
    fn a_bench_step_hands_its_results_out_in_base64() {
        let plan = Plan {
            tests: vec![],
            helpers: vec![],
            env: vec![("XPROXY_BENCH_GUEST".into(), "a guest".into())],
            args: vec![],
            bench: Some(vec!["/w/target/release/xproxy-bench".into(), "run".into()]),
        };
        let script = script(&plan, &[]);
        assert!(script.contains(
            "step bench env 'XPROXY_BENCH_GUEST=a guest' /w/target/release/xproxy-bench run --out /run/bench\n"
        ));
        assert!(script.contains("mark FILE \"${file##*/}\"\n    base64 \"$file\"\n    mark FILE-END\n"));
        let bench_at = script.find("step bench").expect("the bench step");
        assert!(bench_at < script.find("mark DONE").expect("the end"));
    }
}
