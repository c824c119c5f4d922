//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! When it has not been built, the library still compiles (an empty object is
//! embedded) so that `cargo check`, clippy and the unit tests work without the
//! nightly toolchain; but linking the `xproxy` binary fails, naming the
//! command to run, because an agent without its programs is useless. (A build
//! script cannot tell `cargo check` from `cargo build`; link arguments are the
//! one thing only a real build of the binary uses.)

use std::{env, fs, path::PathBuf};

/// The command that builds the object; named in every message about it.
const BUILD_COMMAND: &str = "cargo xtask build-ebpf";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let built = env::var_os("XPROXY_EBPF_OBJECT").map_or_else(
        || manifest_dir.join("../proxy-ebpf/target/bpfel-unknown-none/release/proxy-ebpf"),
        PathBuf::from,
    );
    println!("cargo:rerun-if-env-changed=XPROXY_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", built.display());

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("proxy-ebpf.o");
    let bytes = fs::read(&built).unwrap_or_default();
    if bytes.is_empty() {
        refuse_to_link_the_agent(&built);
    }
    // A new file, not a write into the old one: a target directory seeded
    // with hard links (one per git worktree) shares the old file's inode,
    // and writing through it would change the object embedded in the
    // other checkouts' binaries.
    let _ = fs::remove_file(&out);
    fs::write(&out, bytes).expect("write the embedded eBPF object into OUT_DIR");
}

/// Makes the link of the `xproxy` binary fail with the fix in its message:
/// the linker reports the library it cannot find by this name.
fn refuse_to_link_the_agent(missing: &std::path::Path) {
    println!(
        "cargo:warning=no eBPF object at {}: run `{BUILD_COMMAND}` first (the xproxy binary will not link without it)",
        missing.display()
    );
    println!("cargo:rustc-link-arg-bins=-l:xproxy-has-no-ebpf-object--run--cargo-xtask-build-ebpf--first");
}
