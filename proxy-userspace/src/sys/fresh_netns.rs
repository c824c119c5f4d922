//! For the system layer's privileged unit tests: running a check in a
//! network namespace of its own, made for one thread and gone with it.

/// Whether a test that needs root runs: as root; without root it is
/// skipped, unless `XPROXY_PRIVILEGED_TESTS=1`, where a skip would hide a
/// broken environment and fails instead.
pub fn privileged(name: &str) -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    let required = std::env::var("XPROXY_PRIVILEGED_TESTS").is_ok_and(|v| v == "1");
    assert!(!required, "{name} needs root (XPROXY_PRIVILEGED_TESTS=1)");
    eprintln!("skipping {name}: needs root");
    false
}

/// Runs `check` on a thread of its own in a fresh network namespace (only
/// `lo`, down); the namespace and everything in it end with the thread.
/// Its panic is the caller's.
pub fn run_in_fresh_netns(check: fn()) {
    let thread = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("a fresh network namespace");
        check();
    });
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}
