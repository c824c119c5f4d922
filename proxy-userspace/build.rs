//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! When it has not been built (a plain `cargo check`, clippy, CI steps that
//! need no kernel), an empty object is embedded instead and loading the data
//! path fails with an error that says how to build it.

use std::{env, fs, path::PathBuf};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let built = env::var_os("XPROXY_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir.join("../proxy-ebpf/target/bpfel-unknown-none/release/proxy-ebpf"));
    println!("cargo:rerun-if-env-changed=XPROXY_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", built.display());

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("proxy-ebpf.o");
    let bytes = fs::read(&built).unwrap_or_default();
    fs::write(&out, bytes).expect("write the embedded eBPF object into OUT_DIR");
}
