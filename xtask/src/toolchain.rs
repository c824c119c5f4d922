//! The nightly toolchain and the `bpf-linker` the eBPF crate needs.
//!
//! The nightly is pinned by proxy-ebpf/rust-toolchain.toml (a dated channel),
//! so a new nightly cannot break the build; bpf-linker is pinned to
//! [`BPF_LINKER_VERSION`].
//!
//! No prebuilt bpf-linker matches the nightly's LLVM, so it is built from
//! crates.io against the libLLVM shipped in the nightly's own sysroot and
//! rebuilt whenever `ldd` shows it no longer resolves exactly that file
//! (e.g. after the nightly was updated).

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::command;

/// The file that pins the eBPF crate's toolchain, relative to the workspace.
const TOOLCHAIN_FILE: &str = "proxy-ebpf/rust-toolchain.toml";

/// The pinned nightly channel (`nightly-YYYY-MM-DD`) from [`TOOLCHAIN_FILE`].
pub fn pinned_nightly(root: &Path) -> Result<String> {
    let path = root.join(TOOLCHAIN_FILE);
    let text = fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    toolchain_channel(&text).with_context(|| format!("{} names no `channel = \"...\"`", path.display()))
}

/// The `channel = "..."` value of a rust-toolchain.toml.
fn toolchain_channel(toml: &str) -> Option<String> {
    toml.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        (key.trim() == "channel").then(|| value.trim().trim_matches('"').to_owned())
    })
}

/// Variables that would make a child cargo/rustc use flags or compilers
/// meant for the toolchain that runs this xtask.
const INHERITED_RUST_ENV: &[&str] = &[
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "RUSTC",
    "RUSTDOC",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTUP_TOOLCHAIN",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET_DIR",
    "CARGO_BUILD_TARGET",
];

/// `rustup run <nightly> <program>`, with inherited toolchain variables removed.
///
/// Going through rustup (not `$CARGO`, which is the stable cargo running this
/// xtask) is what makes the nightly cargo and rustc the ones that run.
pub fn nightly_command(nightly: &str, program: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", nightly, program]);
    for key in INHERITED_RUST_ENV {
        cmd.env_remove(key);
    }
    cmd
}

/// Installs the nightly toolchain (with rust-src) if rustup does not have it.
pub fn ensure_nightly(nightly: &str) -> Result<()> {
    let list = command::stdout(Command::new("rustup").args(["toolchain", "list"]))
        .context("rustup is needed: install it from https://rustup.rs")?;
    if has_toolchain(&list, nightly) {
        return Ok(());
    }
    eprintln!("xtask: installing the {nightly} toolchain");
    command::run(Command::new("rustup").args([
        "toolchain",
        "install",
        nightly,
        "--profile",
        "minimal",
        "--component",
        "rust-src",
    ]))
}

/// Whether `rustup toolchain list` output names the toolchain `name`.
fn has_toolchain(list: &str, name: &str) -> bool {
    list.lines()
        .filter_map(|line| line.split_whitespace().next())
        .any(|toolchain| toolchain == name || toolchain.starts_with(&format!("{name}-")))
}

/// Adds `rust-src` to the nightly (needed by `-Z build-std=core`) if missing.
pub fn ensure_rust_src(nightly: &str) -> Result<()> {
    ensure_components(Some(nightly), &["rust-src"])
}

/// Adds `components` to a toolchain (the default one when `None`) where
/// missing: rustup's minimal profile has neither rust-src nor clippy nor
/// rustfmt.
pub fn ensure_components(toolchain: Option<&str>, components: &[&str]) -> Result<()> {
    let mut list = Command::new("rustup");
    list.args(["component", "list", "--installed"]);
    if let Some(name) = toolchain {
        list.args(["--toolchain", name]);
    }
    let installed = command::stdout(&mut list)?;
    let missing: Vec<&str> = components
        .iter()
        .copied()
        .filter(|component| !has_component(&installed, component))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!(
        "xtask: adding {missing:?} to the {} toolchain",
        toolchain.unwrap_or("default")
    );
    let mut add = Command::new("rustup");
    add.args(["component", "add"]).args(&missing);
    if let Some(name) = toolchain {
        add.args(["--toolchain", name]);
    }
    command::run(&mut add)
}

/// Whether `rustup component list --installed` output names `component`
/// (`rust-src`, or `clippy-x86_64-unknown-linux-gnu` for `clippy`).
fn has_component(installed: &str, component: &str) -> bool {
    installed
        .lines()
        .map(str::trim)
        .any(|line| line == component || line.starts_with(&format!("{component}-")))
}

/// The nightly's own LLVM, as bpf-linker must link it.
#[derive(Debug)]
pub struct NightlyLlvm {
    /// `$SYSROOT/lib`, where the nightly's libLLVM lives.
    pub lib_dir: PathBuf,
    /// The name to link, e.g. `LLVM-22-rust-1.97.0-nightly` (`-l dylib=` form).
    pub link_name: String,
    /// LLVM's major version, e.g. 22 (bpf-linker feature `llvm-22`).
    pub major: u32,
    /// The real shared-library files that name stands for (canonical paths).
    pub files: Vec<PathBuf>,
}

/// Finds the nightly's libLLVM from `rustc -vV` and `rustc --print sysroot`.
pub fn nightly_llvm(nightly: &str) -> Result<NightlyLlvm> {
    let version = command::stdout(nightly_command(nightly, "rustc").arg("-vV"))?;
    let major = llvm_major(&version)?;
    let sysroot = command::stdout(nightly_command(nightly, "rustc").args(["--print", "sysroot"]))?;
    let lib_dir = PathBuf::from(sysroot.trim()).join("lib");
    let link_name = llvm_link_name(&lib_dir, major)?;
    let files = llvm_library_files(&lib_dir, &link_name)?;
    Ok(NightlyLlvm {
        lib_dir,
        link_name,
        major,
        files,
    })
}

/// The LLVM major version from `rustc -vV` ("LLVM version: 22.1.4" -> 22).
fn llvm_major(rustc_version: &str) -> Result<u32> {
    let version = rustc_version
        .lines()
        .find_map(|line| line.strip_prefix("LLVM version:"))
        .context("`rustc -vV` printed no \"LLVM version:\" line")?;
    let major = version.trim().split('.').next().unwrap_or_default();
    major
        .parse()
        .with_context(|| format!("cannot read an LLVM major version from {:?}", version.trim()))
}

/// The name of `lib_dir/libLLVM-<major>-*.so` without `lib` and `.so`.
fn llvm_link_name(lib_dir: &Path, major: u32) -> Result<String> {
    let entries = fs::read_dir(lib_dir).with_context(|| format!("cannot list {}", lib_dir.display()))?;
    let prefix = format!("LLVM-{major}");
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", lib_dir.display()))?;
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str() else {
            continue;
        };
        if let Some(name) = name.strip_prefix("lib").and_then(|name| name.strip_suffix(".so"))
            && (name == prefix || name.starts_with(&format!("{prefix}-")))
        {
            names.push(name.to_owned());
        }
    }
    names.sort();
    match names.as_slice() {
        [name] => Ok(name.clone()),
        [] => bail!(
            "no libLLVM-{major}*.so in {}: is the nightly's LLVM {major} library installed?",
            lib_dir.display()
        ),
        _ => bail!("several libLLVM-{major}*.so in {}: {names:?}", lib_dir.display()),
    }
}

/// The shared-library files `-l dylib=<link_name>` resolves to.
///
/// `lib<link_name>.so` is either the library itself or (as in rustup's
/// toolchains) a linker script `INPUT(libLLVM.so.22.1-rust-...)`.
fn llvm_library_files(lib_dir: &Path, link_name: &str) -> Result<Vec<PathBuf>> {
    let dev_link = lib_dir.join(format!("lib{link_name}.so"));
    let bytes = fs::read(&dev_link).with_context(|| format!("cannot read {}", dev_link.display()))?;
    let candidates = if bytes.starts_with(b"\x7fELF") {
        vec![dev_link.clone()]
    } else {
        linker_script_inputs(&String::from_utf8_lossy(&bytes))
            .into_iter()
            .map(|input| lib_dir.join(input))
            .collect()
    };
    let files: Vec<PathBuf> = candidates.iter().filter_map(|path| path.canonicalize().ok()).collect();
    if files.is_empty() {
        bail!(
            "{} names no library file that exists ({candidates:?})",
            dev_link.display()
        );
    }
    Ok(files)
}

/// The file names inside `INPUT(...)` / `GROUP(...)` of a GNU ld script.
fn linker_script_inputs(script: &str) -> Vec<String> {
    let mut inputs = Vec::new();
    for keyword in ["INPUT(", "GROUP("] {
        let mut rest = script;
        while let Some(start) = rest.find(keyword) {
            let after = &rest[start + keyword.len()..];
            let end = after.find(')').unwrap_or(after.len());
            inputs.extend(
                after[..end]
                    .split(|c: char| c.is_whitespace() || c == ',')
                    .filter(|name| !name.is_empty() && *name != "AS_NEEDED(")
                    .map(str::to_owned),
            );
            rest = &after[end..];
        }
    }
    inputs
}

/// Where `cargo install` puts binaries: `$CARGO_INSTALL_ROOT`, `$CARGO_HOME` or `~/.cargo`.
fn install_root() -> Result<PathBuf> {
    if let Some(root) = env::var_os("CARGO_INSTALL_ROOT") {
        return Ok(PathBuf::from(root));
    }
    if let Some(home) = env::var_os("CARGO_HOME") {
        return Ok(PathBuf::from(home));
    }
    let home = env::var_os("HOME").context("none of CARGO_INSTALL_ROOT, CARGO_HOME, HOME is set")?;
    Ok(PathBuf::from(home).join(".cargo"))
}

/// The libLLVM libraries `ldd` resolves for `binary`: (soname, resolved path).
fn ldd_llvm_libraries(ldd_output: &str) -> Vec<(String, Option<PathBuf>)> {
    ldd_output
        .lines()
        .filter_map(|line| {
            let (name, target) = line.trim().split_once(" => ")?;
            if !name.starts_with("libLLVM") {
                return None;
            }
            let path = target.split_whitespace().next().filter(|path| path.starts_with('/'));
            Some((name.to_owned(), path.map(PathBuf::from)))
        })
        .collect()
}

/// Whether `linker` is dynamically linked against exactly the nightly's libLLVM.
fn links_nightly_llvm(linker: &Path, llvm: &NightlyLlvm) -> Result<bool> {
    if !linker.exists() {
        eprintln!("xtask: {} does not exist", linker.display());
        return Ok(false);
    }
    let output = Command::new("ldd")
        .arg(linker)
        .output()
        .with_context(|| format!("failed to run `ldd {}`", linker.display()))?;
    let libraries = ldd_llvm_libraries(&String::from_utf8_lossy(&output.stdout));
    if libraries.is_empty() {
        eprintln!("xtask: {} is not linked against a shared libLLVM", linker.display());
        return Ok(false);
    }
    for (name, path) in &libraries {
        let resolved = path.as_ref().and_then(|path| path.canonicalize().ok());
        if !resolved.as_ref().is_some_and(|path| llvm.files.contains(path)) {
            eprintln!(
                "xtask: {} resolves {name} to {}, not {:?}",
                linker.display(),
                path.as_ref()
                    .map_or_else(|| "nothing".into(), |path| path.display().to_string()),
                llvm.files
            );
            return Ok(false);
        }
    }
    Ok(true)
}

/// The bpf-linker release the eBPF build is known to work with: a newer
/// one must not arrive unasked (`cargo install` takes the newest).
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Whether `linker --version` names [`BPF_LINKER_VERSION`].
fn is_pinned_version(linker: &Path) -> bool {
    std::process::Command::new(linker)
        .arg("--version")
        .output()
        .is_ok_and(|out| says_version(&String::from_utf8_lossy(&out.stdout), BPF_LINKER_VERSION))
}

/// Whether a `--version` line (`bpf-linker 0.13.0`) names `version`.
fn says_version(output: &str, version: &str) -> bool {
    output.split_whitespace().nth(1) == Some(version)
}

/// `cargo install bpf-linker` linked against the nightly's libLLVM, into `root`.
fn install_bpf_linker(nightly: &str, root: &Path, llvm: &NightlyLlvm) -> Result<()> {
    let lib_dir = llvm.lib_dir.display();
    let rustflags = format!(
        "-L {lib_dir} -l dylib={} -C link-args=-Wl,-rpath,{lib_dir}",
        llvm.link_name
    );
    let features = format!("llvm-{},no-llvm-linking", llvm.major);
    eprintln!(
        "xtask: building bpf-linker against {lib_dir}/lib{}.so (about a minute)",
        llvm.link_name
    );
    let mut cmd = nightly_command(nightly, "cargo");
    cmd.args([
        "install",
        "bpf-linker",
        "--version",
        &format!("={BPF_LINKER_VERSION}"),
        "--no-default-features",
        "--features",
        &features,
        "--force",
        "--root",
    ])
    .arg(root)
    .env("RUSTFLAGS", rustflags);
    command::run(&mut cmd).context("cannot build bpf-linker")
}

/// Makes sure a bpf-linker linked against the nightly's libLLVM is installed;
/// returns its path.
pub fn ensure_bpf_linker(nightly: &str) -> Result<PathBuf> {
    let llvm = nightly_llvm(nightly)?;
    let root = install_root()?;
    let linker = root.join("bin").join("bpf-linker");
    if links_nightly_llvm(&linker, &llvm)? && is_pinned_version(&linker) {
        return Ok(linker);
    }
    install_bpf_linker(nightly, &root, &llvm)?;
    if !links_nightly_llvm(&linker, &llvm)? {
        bail!(
            "the bpf-linker just installed at {} does not use {:?}",
            linker.display(),
            llvm.files
        );
    }
    Ok(linker)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_llvm_major() -> Result<()> {
        let version = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\nrelease: 1.97.0-nightly\nLLVM version: 22.1.4\n";
        assert_eq!(llvm_major(version)?, 22);
        assert!(llvm_major("rustc 1.0\n").is_err());
        Ok(())
    }

    #[test]
    fn reads_linker_script() {
        assert_eq!(
            linker_script_inputs("INPUT(libLLVM.so.22.1-rust-1.97.0-nightly)\n"),
            ["libLLVM.so.22.1-rust-1.97.0-nightly"]
        );
        assert_eq!(linker_script_inputs("GROUP(a.so, b.so)"), ["a.so", "b.so"]);
    }

    #[test]
    fn reads_the_pinned_channel() -> Result<()> {
        let toml = "# pinned\n[toolchain]\nchannel = \"nightly-2026-05-20\"\ncomponents = [\"rust-src\"]\n";
        assert_eq!(toolchain_channel(toml).as_deref(), Some("nightly-2026-05-20"));
        assert_eq!(toolchain_channel("[toolchain]\n"), None);
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        assert!(pinned_nightly(&root)?.starts_with("nightly-"));
        Ok(())
    }

    #[test]
    fn finds_toolchain() {
        let list = "stable-x86_64-unknown-linux-gnu (default)\nnightly-x86_64-unknown-linux-gnu\n";
        assert!(has_toolchain(list, "nightly"));
        assert!(!has_toolchain("stable-x86_64-unknown-linux-gnu (default)\n", "nightly"));
    }

    #[test]
    fn reads_installed_components() {
        let list = "cargo-x86_64-unknown-linux-gnu\nclippy-x86_64-unknown-linux-gnu\nrust-src\n";
        assert!(has_component(list, "clippy"));
        assert!(has_component(list, "rust-src"));
        assert!(!has_component(list, "rustfmt"));
    }

    #[test]
    fn reads_the_linkers_version() {
        assert!(says_version("bpf-linker 0.13.0\n", "0.13.0"));
        assert!(!says_version("bpf-linker 0.13.1\n", "0.13.0"));
        assert!(!says_version("", "0.13.0"));
    }

    #[test]
    fn reads_ldd() {
        let out = "\tlinux-vdso.so.1 (0x00007f553f478000)\n\
            \tlibLLVM.so.22.1-rust-1.97.0-nightly => /root/.rustup/toolchains/nightly/lib/libLLVM.so.22.1-rust-1.97.0-nightly (0x00007f5534a00000)\n\
            \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f553481e000)\n\
            \tlibLLVM.so.21.1-rust-1.96.0-nightly => not found\n";
        assert_eq!(
            ldd_llvm_libraries(out),
            [
                (
                    "libLLVM.so.22.1-rust-1.97.0-nightly".to_owned(),
                    Some(PathBuf::from(
                        "/root/.rustup/toolchains/nightly/lib/libLLVM.so.22.1-rust-1.97.0-nightly"
                    ))
                ),
                ("libLLVM.so.21.1-rust-1.96.0-nightly".to_owned(), None),
            ]
        );
    }
}
