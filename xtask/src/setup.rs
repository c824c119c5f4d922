//! The machine's share of `demo`, `test`, `bench` and `vm`: the programs
//! the test bed, the modes and the tools run, and bpffs on /sys/fs/bpf.
//!
//! Checked on every run (a few `stat`s when everything is there). As root,
//! missing Debian packages are installed with apt-get and bpffs is
//! mounted; otherwise the error says in one line what to run. `.ci/run`
//! prepares the same before it calls these commands, so in CI they find
//! everything in place.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Result, bail};

use crate::command;

/// What the namespace test bed and the agent's modes run, and the
/// Debian package of each (kube-proxy's tools, `bpftool` and `ethtool`
/// for the test bed's checks, `cc` for crates that build C).
pub const NAMESPACE_TOOLS: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("tc", "iproute2"),
    ("iptables", "iptables"),
    ("ipset", "ipset"),
    ("nft", "nftables"),
    ("ipvsadm", "ipvsadm"),
    ("bpftool", "bpftool"),
    ("conntrack", "conntrack"),
    ("ethtool", "ethtool"),
    ("mount", "mount"),
    ("cc", "gcc"),
];

/// What `cargo xtask bench` runs on top: the load generator.
pub const BENCH_TOOLS: &[(&str, &str)] = &[("wrk", "wrk")];

/// What `cargo xtask vm` runs on the host to pack and boot its guests.
pub const VM_TOOLS: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("busybox", "busybox-static"),
    ("cpio", "cpio"),
    ("depmod", "kmod"),
    ("dpkg", "dpkg"),
    ("apt-get", "apt"),
    ("ldd", "libc-bin"),
    ("strip", "binutils"),
    ("sha256sum", "coreutils"),
];

/// bpffs, where programs and maps are pinned.
const BPFFS: &str = "/sys/fs/bpf";
/// `statfs(2)` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// `cargo xtask setup`: everything the other commands would set up on
/// their way, at once (what `.ci/run` calls before the tests).
pub fn everything() -> Result<()> {
    if !testbed::privileged::is_root() {
        bail!("setup installs Debian packages and mounts bpffs: run it as root");
    }
    let all: Vec<(&str, &str)> = [NAMESPACE_TOOLS, BENCH_TOOLS, VM_TOOLS].concat();
    ensure_programs(&all)?;
    ensure_bpffs()?;
    eprintln!("xtask: the machine has everything demo, test, vm and bench run");
    Ok(())
}

/// Makes sure every program of `needs` is there: installs the missing
/// ones' packages as root, else fails saying which to install.
pub fn ensure_programs(needs: &[(&str, &str)]) -> Result<()> {
    let missing = missing_packages(needs, |program| find_program(program).is_some());
    if missing.is_empty() {
        return Ok(());
    }
    if !testbed::privileged::is_root() {
        bail!(
            "missing programs; as root: apt-get install --no-install-recommends {}",
            missing.join(" ")
        );
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    command::run(Command::new("apt-get").args(["update", "-q"]))?;
    command::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing),
    )
}

/// The packages of the programs of `needs` that `present` does not find,
/// each once, sorted.
fn missing_packages(needs: &[(&str, &str)], present: impl Fn(&str) -> bool) -> Vec<String> {
    let mut packages: Vec<String> = needs
        .iter()
        .filter(|(program, _)| !present(program))
        .map(|(_, package)| (*package).to_owned())
        .collect();
    packages.sort();
    packages.dedup();
    packages
}

/// Mounts bpffs on /sys/fs/bpf unless it is there (as root; else fails
/// saying so).
pub fn ensure_bpffs() -> Result<()> {
    if is_bpffs(Path::new(BPFFS)) {
        return Ok(());
    }
    if !testbed::privileged::is_root() {
        bail!("bpffs is not mounted on {BPFFS}; as root: mount -t bpf bpf {BPFFS}");
    }
    eprintln!("xtask: mounting bpffs on {BPFFS}");
    fs::create_dir_all(BPFFS).map_err(|e| anyhow::anyhow!("creating {BPFFS}: {e}"))?;
    command::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))
}

fn is_bpffs(path: &Path) -> bool {
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs is plain old data; all zeroes is a valid value.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statfs buffer we own.
    let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut stat) };
    rc == 0 && stat.f_type as i64 == BPF_FS_MAGIC
}

/// Where `program` is: on `PATH`, or in the sbin directories a non-root
/// `PATH` often lacks.
pub fn find_program(program: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_each_missing_package_once() {
        let needs = [
            ("ip", "iproute2"),
            ("tc", "iproute2"),
            ("nft", "nftables"),
            ("wrk", "wrk"),
        ];
        let missing = missing_packages(&needs, |program| program == "nft");
        assert_eq!(missing, ["iproute2", "wrk"]);
        assert!(missing_packages(&needs, |_| true).is_empty());
    }

    #[test]
    fn finds_programs_on_the_path() {
        assert!(find_program("sh").is_some());
        assert!(find_program("no-such-program-xproxy").is_none());
    }
}
