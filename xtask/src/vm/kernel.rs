//! The guest kernel: the newest Debian cloud kernel of a series, cached.
//!
//! `apt-cache search` lists the `linux-image-<release>-cloud-amd64-unsigned`
//! packages apt knows (`apt-get update` runs only when it knows none, or when
//! the download fails because the lists are stale). The newest is downloaded
//! into `<cache>/debs`, extracted with `dpkg -x` into
//! `<cache>/kernels/<release>` and given its `modules.dep` with `depmod -b`.
//! The extracted tree appears under its final name only when complete, so an
//! interrupted run starts over; older releases of the series are removed.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::command;

/// Kernel options the tests need, and whether a module (`m`) is enough.
const REQUIRED_CONFIG: &[(&str, bool, &str)] = &[
    ("BPF_SYSCALL", false, "the bpf() syscall and bpffs"),
    ("DEBUG_INFO_BTF", false, "BTF at /sys/kernel/btf/vmlinux"),
    ("NET_NS", false, "network namespaces"),
    ("VETH", true, "veth pairs (XDP in driver mode)"),
    ("BRIDGE", true, "the two-node test bed's L2 segment"),
    ("NET_CLS_ACT", false, "tc actions (direct-action BPF)"),
    ("NET_SCH_INGRESS", true, "the tc clsact qdisc"),
    ("NET_CLS_BPF", true, "tc BPF classifiers"),
    ("IP_VS", true, "IPVS"),
    ("IP_VS_RR", true, "the IPVS round-robin scheduler"),
    ("BLK_DEV_INITRD", false, "booting from an initramfs"),
    ("DEVTMPFS", false, "/dev"),
    ("TMPFS", false, "/tmp and /run"),
    ("SERIAL_8250_CONSOLE", false, "the serial console the host reads"),
];

/// The flavour: the smallest Debian kernel, with everything above.
const FLAVOUR: &str = "cloud-amd64";

#[derive(Debug)]
pub struct Kernel {
    /// The series asked for, e.g. `6.12`.
    pub series: String,
    /// `uname -r`, e.g. `6.1.0-54-cloud-amd64`.
    pub release: String,
    /// The Debian package version, e.g. `6.1.190-1`.
    pub package_version: String,
    /// The extracted package (`boot/`, `lib/modules/<release>/`).
    pub root: PathBuf,
    pub vmlinuz: PathBuf,
}

impl Kernel {
    /// `lib/modules/<release>` in the extracted package.
    pub fn modules(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }
}

/// The newest kernel of `series` (e.g. `6.1`), downloaded and extracted
/// once, its configuration checked.
pub fn ensure(cache: &Path, series: &str) -> Result<Kernel> {
    if series.is_empty() || !series.chars().all(|c| c.is_ascii_digit() || c == '.') {
        bail!("--kernel takes a kernel series such as 6.1, not {series:?}");
    }
    let mut packages = search(series)?;
    if packages.is_empty() {
        eprintln!("xtask vm: apt knows no {FLAVOUR} kernel {series}: apt-get update");
        apt_get_update()?;
        packages = search(series)?;
    }
    let package = newest(&packages)
        .with_context(|| format!("no package linux-image-{series}.*-{FLAVOUR}-unsigned in this machine's apt sources"))?
        .to_owned();
    let release = release_of(&package).context("package name without a release")?;
    eprintln!("xtask vm: newest available: {package}");

    let kernels = cache.join("kernels");
    let root = kernels.join(&release);
    if !root.is_dir() {
        let deb = download(&cache.join("debs"), &package)?;
        extract(&deb, &root, &release)?;
    }
    let kernel = Kernel {
        series: series.to_owned(),
        package_version: package_version(&cache.join("debs"), &package)?,
        vmlinuz: root.join("boot").join(format!("vmlinuz-{release}")),
        root,
        release,
    };
    if !kernel.vmlinuz.is_file() {
        bail!("{} has no {}", package, kernel.vmlinuz.display());
    }
    check_config(&kernel.root.join("boot").join(format!("config-{}", kernel.release)))?;
    prune(cache, series, &kernel.release, &package);
    Ok(kernel)
}

/// The cloud kernel packages of `series` that apt knows.
fn search(series: &str) -> Result<Vec<String>> {
    let pattern = format!(
        "^linux-image-{}\\.[0-9]+[-+][^ ]*-{FLAVOUR}-unsigned$",
        series.replace('.', "\\.")
    );
    let out = command::stdout(Command::new("apt-cache").args(["search", "--names-only", &pattern]))?;
    Ok(out
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| release_of(name).is_some())
        .map(str::to_owned)
        .collect())
}

/// `6.1.0-54-cloud-amd64` from `linux-image-6.1.0-54-cloud-amd64-unsigned`
/// (backports name theirs `6.12.118+deb12-cloud-amd64`).
fn release_of(package: &str) -> Option<String> {
    let release = package.strip_prefix("linux-image-")?.strip_suffix("-unsigned")?;
    release.ends_with(&format!("-{FLAVOUR}")).then(|| release.to_owned())
}

/// The package with the highest release: Debian numbers kernel ABIs upwards
/// (`6.1.0-54` after `6.1.0-50`, `6.12.118+deb12` after `6.12.117+deb12`),
/// so comparing the numbers in order is enough.
fn newest(packages: &[String]) -> Option<&str> {
    packages
        .iter()
        .max_by_key(|package| release_numbers(package))
        .map(String::as_str)
}

fn release_numbers(package: &str) -> Vec<u64> {
    package
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|part| part.parse().ok())
        .collect()
}

fn apt_get_update() -> Result<()> {
    command::run(Command::new("apt-get").args(["update", "-q"]))
}

/// The cached `.deb` of `package`, downloaded if missing.
fn download(debs: &Path, package: &str) -> Result<PathBuf> {
    fs::create_dir_all(debs).with_context(|| format!("cannot create {}", debs.display()))?;
    if let Some(deb) = cached_deb(debs, package)? {
        return Ok(deb);
    }
    let mut get = Command::new("apt-get");
    // As root apt drops to the `_apt` user to download, which cannot write
    // into root's cache directory: download as root, without the warning.
    get.current_dir(debs)
        .args(["download", "-q", "-o", "APT::Sandbox::User=root", package]);
    if command::run(&mut get).is_err() {
        eprintln!("xtask vm: the download failed; the package lists may be stale: apt-get update");
        apt_get_update()?;
        command::run(&mut get)?;
    }
    cached_deb(debs, package)?
        .with_context(|| format!("apt-get download left no {package}_*.deb in {}", debs.display()))
}

fn cached_deb(debs: &Path, package: &str) -> Result<Option<PathBuf>> {
    let prefix = format!("{package}_");
    let entries = fs::read_dir(debs).with_context(|| format!("cannot list {}", debs.display()))?;
    for entry in entries {
        let path = entry?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

fn package_version(debs: &Path, package: &str) -> Result<String> {
    match cached_deb(debs, package)? {
        Some(deb) => Ok(
            command::stdout(Command::new("dpkg-deb").arg("-f").arg(&deb).arg("Version"))?
                .trim()
                .to_owned(),
        ),
        None => Ok("version unknown: its .deb was removed".to_owned()),
    }
}

/// `dpkg -x` and `depmod -b` into a temporary directory, renamed to `root`
/// when complete.
fn extract(deb: &Path, root: &Path, release: &str) -> Result<()> {
    let partial = root.with_file_name(format!("{release}.partial-{}", std::process::id()));
    if partial.exists() {
        fs::remove_dir_all(&partial).with_context(|| format!("cannot remove {}", partial.display()))?;
    }
    if let Some(parent) = root.parent() {
        fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    eprintln!("xtask vm: extracting {}", deb.display());
    command::run(Command::new("dpkg").arg("-x").arg(deb).arg(&partial))?;
    let modules = partial.join("lib/modules").join(release);
    if !modules.is_dir() {
        bail!("{} has no lib/modules/{release}", deb.display());
    }
    command::run(Command::new("depmod").arg("-b").arg(&partial).arg(release))?;
    if let Err(error) = fs::rename(&partial, root) {
        // Another run extracted the same release meanwhile: use that one.
        let _ = fs::remove_dir_all(&partial);
        if !root.is_dir() {
            return Err(error).with_context(|| format!("cannot rename {} to {}", partial.display(), root.display()));
        }
    }
    Ok(())
}

/// Fails, naming every missing option, unless `config` has all of
/// [`REQUIRED_CONFIG`].
fn check_config(config: &Path) -> Result<()> {
    let text = fs::read_to_string(config).with_context(|| format!("cannot read {}", config.display()))?;
    let missing = missing_options(&text);
    if !missing.is_empty() {
        bail!("{} lacks what the tests need: {}", config.display(), missing.join("; "));
    }
    Ok(())
}

fn missing_options(config: &str) -> Vec<String> {
    REQUIRED_CONFIG
        .iter()
        .filter_map(|(option, module_ok, what)| {
            let value = config
                .lines()
                .find_map(|line| line.strip_prefix(&format!("CONFIG_{option}=")));
            match value {
                Some("y") => None,
                Some("m") if *module_ok => None,
                Some(other) => Some(format!("CONFIG_{option}={other} ({what})")),
                None => Some(format!("CONFIG_{option} unset ({what})")),
            }
        })
        .collect()
}

/// Removes other releases of `series` and their packages; failures only warn.
fn prune(cache: &Path, series: &str, release: &str, package: &str) {
    let prefixes = [
        (cache.join("kernels"), format!("{series}.")),
        (cache.join("debs"), format!("linux-image-{series}.")),
    ];
    for (dir, prefix) in prefixes {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let current = name == release || name.starts_with(&format!("{package}_"));
            // `.partial-<pid>`: another run may be extracting it now.
            if !name.starts_with(&prefix) || current || name.contains(".partial-") {
                continue;
            }
            let path = entry.path();
            eprintln!("xtask vm: removing the older {}", path.display());
            let removed = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            if let Err(error) = removed {
                eprintln!("xtask vm: cannot remove {}: {error}", path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_highest_abi() {
        let packages: Vec<String> = [
            "linux-image-6.1.0-50-cloud-amd64-unsigned",
            "linux-image-6.1.0-54-cloud-amd64-unsigned",
            "linux-image-6.1.0-9-cloud-amd64-unsigned",
            "linux-image-6.1.0-47-cloud-amd64-unsigned",
        ]
        .map(str::to_owned)
        .to_vec();
        assert_eq!(newest(&packages), Some("linux-image-6.1.0-54-cloud-amd64-unsigned"));
        assert_eq!(newest(&[]), None);
        let backports: Vec<String> = [
            "linux-image-6.12.99+deb12-cloud-amd64-unsigned",
            "linux-image-6.12.118+deb12-cloud-amd64-unsigned",
        ]
        .map(str::to_owned)
        .to_vec();
        assert_eq!(
            newest(&backports),
            Some("linux-image-6.12.118+deb12-cloud-amd64-unsigned")
        );
    }

    #[test]
    fn derives_the_release() {
        assert_eq!(
            release_of("linux-image-6.1.0-54-cloud-amd64-unsigned").as_deref(),
            Some("6.1.0-54-cloud-amd64")
        );
        assert_eq!(release_of("linux-image-6.1.0-54-cloud-amd64-dbg"), None);
        assert_eq!(release_of("linux-image-6.1.0-54-amd64-unsigned"), None);
    }

    #[test]
    fn names_missing_options() {
        let config = "CONFIG_BPF_SYSCALL=y\nCONFIG_DEBUG_INFO_BTF=y\nCONFIG_NET_NS=y\nCONFIG_VETH=m\nCONFIG_BRIDGE=m\n\
                      CONFIG_NET_CLS_ACT=y\nCONFIG_NET_SCH_INGRESS=m\nCONFIG_NET_CLS_BPF=m\nCONFIG_IP_VS=m\n\
                      CONFIG_BLK_DEV_INITRD=y\nCONFIG_DEVTMPFS=m\nCONFIG_TMPFS=y\nCONFIG_SERIAL_8250_CONSOLE=y\n";
        let missing = missing_options(config);
        assert_eq!(missing.len(), 2, "{missing:?}");
        assert!(missing[0].starts_with("CONFIG_IP_VS_RR unset"), "{missing:?}");
        assert!(missing[1].starts_with("CONFIG_DEVTMPFS=m"), "{missing:?}");
    }
}
