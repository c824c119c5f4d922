//! The guest's root file system: an uncompressed cpio archive, cached by the
//! hash of everything in it.
//!
//! The tree is merged-/usr like the host (`/bin`, `/sbin`, `/lib`, `/lib64`
//! link into `/usr`), so every path `ldd` prints resolves in the guest. It
//! holds:
//! - busybox at `/usr/bin/busybox`, with a link for each applet the real
//!   tools below do not provide;
//! - `ip`, `tc`, `bpftool`, `ipvsadm` (and `ethtool` if installed);
//! - the test executables, the tests package's binaries and the agent at
//!   their host paths,
//!   debug info stripped (180 MB -> 7 MB each; symbols stay for backtraces);
//! - every shared library and the dynamic loader `ldd` lists for these;
//! - files the tests read: the repository's `examples/` (at its host path),
//!   the system's CA bundle, an `/etc/hosts` for localhost;
//! - [`MODULES`] with their dependencies from `modules.dep`, and a
//!   `modules.dep` for exactly that set (`depmod -b` on the tree);
//! - `/init` ([`init::script`]).
//!
//! The archive is `<cache>/initramfs/<hash>.cpio`, the hash over a manifest
//! of every entry (destination, kind, sha256 of the source or text), so an
//! unchanged set is not repacked. The newest few archives are kept.
//! Uncompressed: decompressing tens of megabytes under TCG costs seconds.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs,
    io::Write,
    os::unix::fs::{PermissionsExt, symlink},
    path::{Component, Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use super::{Plan, find_program, init, kernel::Kernel};
use crate::command;

/// Kernel modules put into the guest and loaded by `/init` (with their
/// dependencies; built-in ones are skipped). The first group is what the
/// tests need, the second what the IPVS mode and its masquerade rules use.
const MODULES: &[&str] = &[
    // veth pairs, the clsact qdisc and tc BPF (aya falls back to netlink tc
    // where there is no tcx, as on 6.1), dummy devices.
    "veth",
    "dummy",
    "sch_ingress",
    "cls_bpf",
    "act_bpf",
    // The two-node test bed's shared L2 segment (`testbed::two_node`): a
    // bridge; `stp` and `llc` come with it from `modules.dep`.
    "bridge",
    // IPVS and its schedulers, conntrack, ipsets.
    "ip_vs",
    "ip_vs_rr",
    "ip_vs_wrr",
    "ip_vs_lc",
    "ip_vs_wlc",
    "ip_vs_sh",
    "nf_conntrack",
    "nf_nat",
    "ip_set",
    "ip_set_hash_ip",
    "ip_set_hash_ipport",
    "ip_set_hash_ipportip",
    "ip_set_hash_ipportnet",
    "ip_set_hash_net",
    "ip_set_bitmap_port",
    "xt_set",
    // The IPVS mode's constant iptables rules (iptables-nft: nf_tables with
    // the xtables matches and targets through nft_compat).
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "nft_ct",
    "nft_nat",
    "nft_masq",
    "xt_comment",
    "xt_addrtype",
    "xt_mark",
    "xt_conntrack",
    "xt_MASQUERADE",
    // The ebpf mode's notrack rule (`-j CT --notrack` in the raw table).
    "xt_CT",
    // The other modes, for `modes:switching` (the agent in every mode on
    // one test bed): the iptables and userspace modes' matches and
    // targets, the nftables mode's expressions, conntrack over netlink.
    "nf_conntrack_netlink",
    "xt_tcpudp",
    "xt_statistic",
    "xt_nat",
    "xt_REDIRECT",
    "ipt_REJECT",
    "nft_numgen",
    "nft_fib_ipv4",
    "nft_reject_ipv4",
    // The nftables mode's `ip6` table (written in every run, IPv6 ports or
    // not): `fib` and ICMPv6 rejects.
    "nft_fib_ipv6",
    "nft_reject_ipv6",
    // The IPVS and userspace modes' IPv6 rules (ip6tables-nft).
    "ip6t_REJECT",
    // SCTP sockets for the live SCTP Services (`sctp`) and iptables'
    // `-m sctp`; conntrack's and IPVS's SCTP are built in.
    "sctp",
    "xt_sctp",
];

/// Modules the tests cannot do without: missing ones fail the build of the
/// initramfs instead of a test in the guest.
const REQUIRED_MODULES: &[&str] = &["veth", "bridge", "sch_ingress", "cls_bpf", "ip_vs", "ip_vs_rr"];

/// Tools in the guest: required, then used if the host has them.
const TOOLS: &[&str] = &["ip", "tc", "bpftool", "ipvsadm"];
const OPTIONAL_TOOLS: &[&str] = &[
    "ethtool",
    "ipset",
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
    "nft",
    "ss",
    // The kernel modes delete stale UDP flows with it.
    "conntrack",
    // The load generator of `cargo xtask bench --vm`.
    "wrk",
];
/// The iptables extensions (`libxt_*.so`, loaded with dlopen, so `ldd`
/// does not list them), copied whole when present.
const XTABLES_DIR: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// Repository directories the tests read files from (the seed manifests).
const REPO_DATA: &[&str] = &["examples"];

/// The system's CA bundle (Debian's ca-certificates).
const CA_CERTIFICATES: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Archives kept in the cache (the newest by modification time): one per
/// kernel of a `--kernel all` run, and room for a second checkout's.
const KEEP_ARCHIVES: usize = 4;

/// Bumped when the layout changes in a way the manifest does not show.
const FORMAT: &str = "xproxy-vm-initramfs 1";

/// How a host file goes into the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    Copy,
    /// Without debug info (`strip --strip-debug`).
    StripDebug,
    /// Decompressed with this program's `-dc` (a compressed kernel module:
    /// busybox modprobe first hands those to the kernel as they are, which
    /// logs "Invalid ELF header magic" for each).
    Decompress(&'static str),
}

/// One entry of the tree, by its path relative to the root.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Dir,
    /// A host file, copied as `how` says.
    File {
        source: PathBuf,
        how: How,
    },
    Symlink(PathBuf),
    /// A generated file.
    Text {
        text: String,
        mode: u32,
    },
}

#[derive(Debug, Default)]
struct Tree {
    entries: BTreeMap<PathBuf, Entry>,
}

impl Tree {
    fn add(&mut self, dest: PathBuf, entry: Entry) {
        self.entries.entry(dest).or_insert(entry);
    }

    /// A host executable at its (merged-/usr) host path, with its libraries.
    fn add_program(&mut self, source: &Path, how: How) -> Result<()> {
        self.add(
            merged(source),
            Entry::File {
                source: source.to_owned(),
                how,
            },
        );
        for library in libraries(source)? {
            self.add(
                merged(&library),
                Entry::File {
                    source: library,
                    how: How::Copy,
                },
            );
        }
        Ok(())
    }
}

/// The archive for `plan` on `kernel`: the cached one if its contents are
/// unchanged, else a new one.
pub fn ensure(root: &Path, cache: &Path, kernel: &Kernel, plan: &Plan, keep: bool) -> Result<PathBuf> {
    let mut tree = Tree::default();
    for dir in [
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "root",
        "etc",
        "usr/bin",
        "usr/sbin",
        "usr/lib",
        "usr/lib64",
    ] {
        tree.add(dir.into(), Entry::Dir);
    }
    for (link, target) in [
        ("bin", "usr/bin"),
        ("sbin", "usr/sbin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ] {
        tree.add(link.into(), Entry::Symlink(target.into()));
    }
    tree.add("var".into(), Entry::Dir);
    tree.add("var/run".into(), Entry::Symlink("../run".into()));

    for tool in TOOLS {
        let path = find_program(tool).with_context(|| format!("the guest needs {tool}: install it on this machine"))?;
        tree.add_program(&path, How::Copy)?;
    }
    for tool in OPTIONAL_TOOLS {
        match find_program(tool) {
            Some(path) => tree.add_program(&path, How::Copy)?,
            None => eprintln!("xtask vm: {tool} is not installed: the guest has none"),
        }
    }
    if let Ok(dir) = fs::read_dir(XTABLES_DIR) {
        for file in dir.flatten() {
            let source = file.path();
            tree.add(merged(&source), Entry::File { source, how: How::Copy });
        }
    }
    for executable in plan.tests.iter().chain(&plan.helpers) {
        tree.add_program(&executable.path, How::StripDebug)?;
    }
    let boot_modules = add_modules(&mut tree, kernel)?;
    tree.add(
        "init".into(),
        Entry::Text {
            text: init::script(plan, &boot_modules),
            mode: 0o755,
        },
    );
    tree.add(
        "etc/hosts".into(),
        Entry::Text {
            text: "127.0.0.1 localhost\n::1 localhost\n".into(),
            mode: 0o644,
        },
    );
    for (file, required) in data_files(root)? {
        match (file.is_file(), required) {
            (true, _) => tree.add(
                merged(&file),
                Entry::File {
                    source: file,
                    how: How::Copy,
                },
            ),
            (false, true) => bail!("{} is missing", file.display()),
            (false, false) => eprintln!("xtask vm: {} is missing: the guest has none", file.display()),
        }
    }
    let busybox = find_program("busybox").context("busybox is not installed (apt-get install busybox-static)")?;
    tree.add_program(&busybox, How::Copy)?;
    for applet in applets(&busybox)? {
        tree.add(merged(&applet), Entry::Symlink("/usr/bin/busybox".into()));
    }

    let key = hash(&manifest(&tree, &kernel.release)?)?;
    let dir = cache.join("initramfs");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let archive = dir.join(format!("{}.cpio", &key[..16]));
    // The kept tree has the archive's name; a tree only packed has this
    // process's, so concurrent runs do not write into each other's.
    let kept = dir.join(format!("{}.tree", &key[..16]));
    let staging = dir.join(format!("{}.tree-{}", &key[..16], std::process::id()));
    let cached = archive.is_file();
    if cached {
        eprintln!("xtask vm: contents unchanged: reusing {}", archive.display());
        // Mark it as the newest for pruning.
        if let Ok(file) = fs::File::options().append(true).open(&archive) {
            let _ = file.set_modified(std::time::SystemTime::now());
        }
    }
    if !cached || (keep && !kept.is_dir()) {
        stage(&tree, &staging, &kernel.release)?;
        if !cached {
            pack(&staging, &archive)?;
        }
        if keep {
            if kept.exists() {
                fs::remove_dir_all(&kept).with_context(|| format!("cannot remove {}", kept.display()))?;
            }
            fs::rename(&staging, &kept).with_context(|| format!("cannot rename {}", staging.display()))?;
        } else {
            fs::remove_dir_all(&staging).with_context(|| format!("cannot remove {}", staging.display()))?;
        }
    }
    if keep {
        eprintln!("xtask vm: the unpacked tree is kept in {}", kept.display());
    }
    prune(&dir, &archive);
    Ok(archive)
}

/// Files the tests read, at their host paths, and whether they must exist:
/// the repository's [`REPO_DATA`] and the system's CA certificates (the
/// agent's Kubernetes client loads them even when the kubeconfig brings its
/// own CA, and fails without any).
fn data_files(root: &Path) -> Result<Vec<(PathBuf, bool)>> {
    // /etc/protocols: ipset (and iptables) name protocols through it.
    let mut files = vec![
        (PathBuf::from(CA_CERTIFICATES), false),
        (PathBuf::from("/etc/protocols"), false),
    ];
    for dir in REPO_DATA {
        let mut relative = Vec::new();
        walk(&root.join(dir), Path::new(""), &mut relative)?;
        files.extend(relative.into_iter().map(|file| (root.join(dir).join(file), true)));
    }
    files.retain(|(file, _)| !file.is_dir());
    Ok(files)
}

/// `path` inside the merged-/usr tree, relative: `/lib64/x` -> `usr/lib64/x`.
fn merged(path: &Path) -> PathBuf {
    let relative: PathBuf = path
        .components()
        .filter(|component| matches!(component, Component::Normal(_)))
        .collect();
    let first = relative.components().next().map(|c| c.as_os_str().to_owned());
    match first.as_ref().and_then(|c| c.to_str()) {
        Some("bin" | "sbin" | "lib" | "lib64") => Path::new("usr").join(relative),
        _ => relative,
    }
}

/// The shared libraries and the dynamic loader `program` loads, as `ldd`
/// lists them (none for a static executable).
fn libraries(program: &Path) -> Result<Vec<PathBuf>> {
    let output = Command::new("ldd")
        .arg(program)
        .output()
        .with_context(|| format!("cannot run ldd {}", program.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stdout.contains("not a dynamic executable") || stderr.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    if !output.status.success() {
        bail!("ldd {} failed: {}", program.display(), stderr.trim_end());
    }
    parse_ldd(&stdout).with_context(|| format!("ldd {}", program.display()))
}

fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut libraries = Vec::new();
    for line in text.lines().map(str::trim).filter(|line| !line.is_empty()) {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)",
        // "/lib64/ld-linux-x86-64.so.2 (0x...)", "linux-vdso.so.1 (0x...)"
        let target = match line.split_once("=>") {
            Some((name, target)) => {
                let target = target.trim();
                if target.starts_with("not found") {
                    bail!("{} is not found", name.trim());
                }
                target
            }
            None => line,
        };
        let path = target.split_whitespace().next().unwrap_or_default();
        if path.starts_with('/') {
            libraries.push(PathBuf::from(path));
        }
    }
    Ok(libraries)
}

/// Where busybox's applets go (`usr/bin/ash`, `sbin/modprobe`, ...).
fn applets(busybox: &Path) -> Result<Vec<PathBuf>> {
    let list = command::stdout(Command::new(busybox).arg("--list-full"))?;
    Ok(list
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(|line| Path::new("/").join(line))
        .collect())
}

/// Adds [`MODULES`] and their dependencies; returns the ones `/init` loads.
fn add_modules(tree: &mut Tree, kernel: &Kernel) -> Result<Vec<String>> {
    let modules = kernel.modules();
    let dep_file = modules.join("modules.dep");
    let deps = parse_modules_dep(
        &fs::read_to_string(&dep_file).with_context(|| format!("cannot read {}", dep_file.display()))?,
    );
    let builtin_file = modules.join("modules.builtin");
    let builtin: BTreeSet<String> = fs::read_to_string(&builtin_file)
        .with_context(|| format!("cannot read {}", builtin_file.display()))?
        .lines()
        .map(module_name)
        .collect();

    let dest = Path::new("usr/lib/modules").join(&kernel.release);
    for file in ["modules.builtin", "modules.builtin.modinfo", "modules.order"] {
        if modules.join(file).is_file() {
            tree.add(
                dest.join(file),
                Entry::File {
                    source: modules.join(file),
                    how: How::Copy,
                },
            );
        }
    }
    let mut load = Vec::new();
    let mut missing = Vec::new();
    for name in MODULES {
        if builtin.contains(*name) {
            continue;
        }
        let Some((path, needs)) = deps.get(*name) else {
            if REQUIRED_MODULES.contains(name) {
                missing.push(*name);
            } else {
                eprintln!("xtask vm: kernel {} has no module {name}", kernel.release);
            }
            continue;
        };
        for file in std::iter::once(path).chain(needs) {
            let (name, how) = uncompressed(file);
            tree.add(
                dest.join(name),
                Entry::File {
                    source: modules.join(file),
                    how,
                },
            );
        }
        load.push((*name).to_owned());
    }
    if !missing.is_empty() {
        bail!(
            "kernel {} has neither a module nor a built-in {}",
            kernel.release,
            missing.join(", ")
        );
    }
    Ok(load)
}

/// Where a module file goes (without a compression suffix) and how.
fn uncompressed(file: &str) -> (&str, How) {
    for (suffix, program) in [(".xz", "xz"), (".zst", "zstd"), (".gz", "gzip")] {
        if let Some(name) = file.strip_suffix(suffix) {
            return (name, How::Decompress(program));
        }
    }
    (file, How::Copy)
}

/// Module name -> (its file, the files it needs), from `modules.dep`.
fn parse_modules_dep(text: &str) -> HashMap<String, (String, Vec<String>)> {
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(file, needs)| {
            (
                module_name(file),
                (file.to_owned(), needs.split_whitespace().map(str::to_owned).collect()),
            )
        })
        .collect()
}

/// `ip_vs_rr` from `kernel/net/netfilter/ipvs/ip_vs_rr.ko(.xz)`; `-` and `_`
/// are the same in module names.
fn module_name(file: &str) -> String {
    let base = file.rsplit('/').next().unwrap_or(file);
    let base = base.split(".ko").next().unwrap_or(base);
    base.replace('-', "_")
}

/// One line per entry: path, kind and content hash.
fn manifest(tree: &Tree, release: &str) -> Result<String> {
    let sources: Vec<&Path> = tree
        .entries
        .values()
        .filter_map(|entry| match entry {
            Entry::File { source, .. } => Some(source.as_path()),
            _ => None,
        })
        .collect();
    let sums = sha256_files(&sources)?;
    let mut text = format!("{FORMAT}\nkernel {release}\n");
    for (dest, entry) in &tree.entries {
        let line = match entry {
            Entry::Dir => "dir".to_owned(),
            Entry::File { source, how } => format!("file {} {how:?}", sums[source.as_path()]),
            Entry::Symlink(target) => format!("symlink {}", target.display()),
            Entry::Text { text, mode } => format!("text {} {mode:o}", hash(text)?),
        };
        text.push_str(&format!("{} {line}\n", dest.display()));
    }
    Ok(text)
}

/// sha256 of each file, with coreutils' `sha256sum`.
fn sha256_files<'a>(files: &[&'a Path]) -> Result<HashMap<&'a Path, String>> {
    let mut sums = HashMap::new();
    let unique: BTreeSet<&Path> = files.iter().copied().collect();
    let unique: Vec<&Path> = unique.into_iter().collect();
    for chunk in unique.chunks(500) {
        let out = command::stdout(Command::new("sha256sum").arg("--").args(chunk))?;
        let lines: Vec<&str> = out.lines().collect();
        if lines.len() != chunk.len() {
            bail!("sha256sum printed {} lines for {} files", lines.len(), chunk.len());
        }
        for (file, line) in chunk.iter().zip(lines) {
            let sum = line
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .trim_start_matches('\\');
            sums.insert(*file, sum.to_owned());
        }
    }
    Ok(sums)
}

/// sha256 of `text`, in hex.
fn hash(text: &str) -> Result<String> {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot run sha256sum")?;
    child
        .stdin
        .take()
        .context("sha256sum's stdin")?
        .write_all(text.as_bytes())
        .context("writing to sha256sum")?;
    let output = child.wait_with_output().context("waiting for sha256sum")?;
    let out = String::from_utf8_lossy(&output.stdout);
    let sum = out.split_whitespace().next().unwrap_or_default();
    if !output.status.success() || sum.len() != 64 {
        bail!("sha256sum failed: {}", output.status);
    }
    Ok(sum.to_owned())
}

/// Writes `tree` into `staging` (replacing it) and runs `depmod` there.
fn stage(tree: &Tree, staging: &Path, release: &str) -> Result<()> {
    if staging.exists() {
        fs::remove_dir_all(staging).with_context(|| format!("cannot remove {}", staging.display()))?;
    }
    eprintln!(
        "xtask vm: staging {} entries in {}",
        tree.entries.len(),
        staging.display()
    );
    // Directories and links first, so files land behind the /usr links.
    let mut ordered: Vec<_> = tree.entries.iter().collect();
    ordered.sort_by_key(|(dest, entry)| {
        (
            !matches!(entry, Entry::Dir | Entry::Symlink(_)),
            dest.components().count(),
        )
    });
    for (dest, entry) in ordered {
        let path = staging.join(dest);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        match entry {
            Entry::Dir => fs::create_dir_all(&path).with_context(|| format!("cannot create {}", path.display()))?,
            Entry::Symlink(target) => {
                if path.symlink_metadata().is_err() {
                    symlink(target, &path).with_context(|| format!("cannot link {}", path.display()))?;
                }
            }
            Entry::Text { text, mode } => {
                fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
                fs::set_permissions(&path, fs::Permissions::from_mode(*mode))?;
            }
            Entry::File {
                source,
                how: How::StripDebug,
            } => {
                command::output(
                    Command::new("strip")
                        .arg("--strip-debug")
                        .arg("-o")
                        .arg(&path)
                        .arg(source),
                )?;
                fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
            }
            Entry::File {
                source,
                how: How::Decompress(program),
            } => {
                let out = fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
                command::output(Command::new(program).arg("-dc").arg(source).stdout(out))?;
            }
            Entry::File { source, how: How::Copy } => {
                fs::copy(source, &path)
                    .with_context(|| format!("cannot copy {} to {}", source.display(), path.display()))?;
            }
        }
    }
    command::output(Command::new("depmod").arg("-b").arg(staging).arg(release))?;
    Ok(())
}

/// Packs `staging` into a newc cpio archive owned by root.
fn pack(staging: &Path, archive: &Path) -> Result<()> {
    let mut paths = Vec::new();
    walk(staging, Path::new(""), &mut paths)?;
    paths.sort();
    let partial = archive.with_extension(format!("cpio.partial-{}", std::process::id()));
    let out = fs::File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let mut child = Command::new("cpio")
        .current_dir(staging)
        .args(["--create", "--null", "--format=newc", "--owner=0:0", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(out)
        .spawn()
        .context("cannot run cpio")?;
    {
        let mut stdin = child.stdin.take().context("cpio's stdin")?;
        for path in &paths {
            stdin.write_all(path.as_os_str().as_encoded_bytes())?;
            stdin.write_all(b"\0")?;
        }
    }
    let status = child.wait().context("waiting for cpio")?;
    if !status.success() {
        bail!("cpio failed: {status}");
    }
    fs::rename(&partial, archive).with_context(|| format!("cannot rename {}", partial.display()))?;
    let size = fs::metadata(archive).map_or(0, |m| m.len());
    eprintln!(
        "xtask vm: packed {} ({} entries, {:.1} MB)",
        archive.display(),
        paths.len(),
        size as f64 / 1e6
    );
    Ok(())
}

/// Every path under `root/relative`, relative to `root`, links not followed.
fn walk(root: &Path, relative: &Path, paths: &mut Vec<PathBuf>) -> Result<()> {
    let dir = root.join(relative);
    for entry in fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let entry = entry?;
        let path = relative.join(entry.file_name());
        paths.push(path.clone());
        if entry.file_type()?.is_dir() {
            walk(root, &path, paths)?;
        }
    }
    Ok(())
}

/// Removes all but the newest [`KEEP_ARCHIVES`] archives (and trees of the
/// removed ones); failures only warn.
fn prune(dir: &Path, current: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let mut archives: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cpio") && path != current)
        .filter_map(|path| Some((fs::metadata(&path).ok()?.modified().ok()?, path)))
        .collect();
    archives.sort();
    let excess = (archives.len() + 1).saturating_sub(KEEP_ARCHIVES);
    for (_, path) in archives.into_iter().take(excess) {
        eprintln!("xtask vm: removing the older {}", path.display());
        if let Err(error) = fs::remove_file(&path) {
            eprintln!("xtask vm: cannot remove {}: {error}", path.display());
        }
        let tree = path.with_extension("tree");
        if tree.is_dir() {
            let _ = fs::remove_dir_all(tree);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_usr() {
        assert_eq!(
            merged(Path::new("/lib64/ld-linux-x86-64.so.2")),
            Path::new("usr/lib64/ld-linux-x86-64.so.2")
        );
        assert_eq!(merged(Path::new("/sbin/modprobe")), Path::new("usr/sbin/modprobe"));
        assert_eq!(merged(Path::new("/usr/sbin/ip")), Path::new("usr/sbin/ip"));
        assert_eq!(
            merged(Path::new("/work/target/debug/x")),
            Path::new("work/target/debug/x")
        );
        assert_eq!(merged(Path::new("/linuxrc")), Path::new("linuxrc"));
    }

    #[test]
    fn reads_ldd_output() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f01)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f02)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f03)\n";
        assert_eq!(
            parse_ldd(text).expect("parses"),
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
        assert!(parse_ldd("\tlibnope.so.1 => not found\n").is_err());
    }

    #[test]
    fn reads_modules_dep() {
        let deps = parse_modules_dep(
            "kernel/net/netfilter/ipvs/ip_vs_rr.ko: kernel/net/netfilter/ipvs/ip_vs.ko kernel/lib/libcrc32c.ko\n\
             kernel/drivers/net/veth.ko:\n\
             kernel/net/sched/sch-x.ko.xz:\n",
        );
        let (file, needs) = &deps["ip_vs_rr"];
        assert_eq!(file, "kernel/net/netfilter/ipvs/ip_vs_rr.ko");
        assert_eq!(
            needs,
            &["kernel/net/netfilter/ipvs/ip_vs.ko", "kernel/lib/libcrc32c.ko"]
        );
        assert!(deps["veth"].1.is_empty());
        assert_eq!(deps["sch_x"].0, "kernel/net/sched/sch-x.ko.xz");
    }

    #[test]
    fn decompresses_modules() {
        assert_eq!(
            uncompressed("kernel/a/veth.ko.xz"),
            ("kernel/a/veth.ko", How::Decompress("xz"))
        );
        assert_eq!(
            uncompressed("kernel/a/veth.ko.zst"),
            ("kernel/a/veth.ko", How::Decompress("zstd"))
        );
        assert_eq!(uncompressed("kernel/a/veth.ko"), ("kernel/a/veth.ko", How::Copy));
    }
}
