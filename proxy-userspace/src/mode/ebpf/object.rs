//! The compiled `proxy-ebpf` object, embedded at build time (see build.rs).

use anyhow::{Result, bail};

/// BPF object files are ELF: aya reads them in place, so keep them aligned.
#[repr(C, align(8))]
struct Aligned<T: ?Sized>(T);

static OBJECT: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/proxy-ebpf.o")));

/// The embedded eBPF object, or an error if this binary was built without it.
pub fn object_bytes() -> Result<&'static [u8]> {
    if OBJECT.0.is_empty() {
        bail!("this xproxy was built without its eBPF programs: run `cargo xtask build-ebpf`, then rebuild");
    }
    Ok(&OBJECT.0)
}
