//! Root checks, unique names and bpffs pin directories for privileged tests.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

/// Returns true if the test may go on; false means "skip" (not root and
/// privileged tests were not demanded). Panics if they were demanded but
/// cannot run.
pub fn require_root(test: &str) -> bool {
    let root = is_root();
    let demanded = std::env::var("XPROXY_PRIVILEGED_TESTS").is_ok_and(|v| v == "1");
    match (root, demanded) {
        (true, _) => true,
        (false, true) => panic!("{test}: XPROXY_PRIVILEGED_TESTS=1 but not running as root"),
        (false, false) => {
            eprintln!("skipping {test}: needs root (run `cargo xtask test` as root)");
            false
        }
    }
}

/// Like [`require_root`], for tests that need IPVS, which this machine's
/// kernel may lack: they run where `XPROXY_IPVS_TESTS=1` (set by `cargo
/// xtask vm`, whose 6.1 guest loads `ip_vs`) and fail there if IPVS is
/// missing; elsewhere they run only when `/proc/net/ip_vs` exists and are
/// skipped with a message otherwise.
pub fn require_ipvs(test: &str) -> bool {
    if !require_root(test) {
        return false;
    }
    let demanded = std::env::var("XPROXY_IPVS_TESTS").is_ok_and(|v| v == "1");
    let present = std::path::Path::new("/proc/net/ip_vs").exists();
    match (present, demanded) {
        (true, _) => true,
        (false, true) => panic!("{test}: XPROXY_IPVS_TESTS=1 but this kernel has no IPVS (/proc/net/ip_vs is missing)"),
        (false, false) => {
            eprintln!("skipping {test}: this kernel has no IPVS (/proc/net/ip_vs is missing); run `cargo xtask vm`");
            false
        }
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A name unique to this process and call, at most `15 - prefix.len()`
/// characters longer than `prefix` would allow for interface names: keep
/// prefixes short (e.g. "xc", "xn").
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // pid modulo 100000 keeps names short; with the counter it is unique
    // among concurrently running test processes in practice.
    format!("{prefix}{}{n}", std::process::id() % 100_000)
}

/// A directory on bpffs for one test's pins, removed (with every pin in
/// it) when dropped, also when the test panics.
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    pub fn new() -> Self {
        let path = Path::new("/sys/fs/bpf").join(unique_name("xproxy-test-"));
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Default for PinDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if self.path.exists()
            && let Err(e) = std::fs::remove_dir_all(&self.path)
        {
            eprintln!("warning: could not remove {}: {e}", self.path.display());
        }
    }
}
