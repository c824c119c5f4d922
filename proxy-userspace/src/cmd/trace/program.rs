//! Finds the live program a trace runs: the one a running agent's pinned
//! link attaches to an interface (`<pin path>/links/<program>/<interface>`,
//! see the ebpf mode's loader), read through the link's `prog_id`. Before
//! Linux 6.6 a tc program is a cls_bpf filter, which leaves no pin: there
//! the loaded program of that name that uses the pinned maps is the one
//! (the agent attaches one program to every interface). Nothing is loaded:
//! the trace runs what the packets of that hook run.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    maps::MapData,
    programs::{ProgramFd, links::FdLink, links::PinnedLink, loaded_programs},
};
use proxy_common::maps;
use serde::Serialize;

use crate::mode::ebpf::{LINKS_DIR, has_tcx, link_pin};

/// Where in the data path the frame is run (`--hook`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HookArg {
    /// The uplink's XDP program (NodePort and external traffic, native XDP).
    Xdp,
    /// tc ingress of an uplink (or, named with `--iface`, of any interface).
    TcIngress,
    /// tc egress (what the node itself sends).
    TcEgress,
    /// tc ingress of a pod's interface (what a pod sends).
    Pod,
}

impl HookArg {
    /// The program the hook runs.
    pub fn program(self) -> &'static str {
        match self {
            HookArg::Xdp => maps::PROG_XDP_UPLINK,
            HookArg::TcIngress | HookArg::Pod => maps::PROG_TC_INGRESS,
            HookArg::TcEgress => maps::PROG_TC_EGRESS,
        }
    }

    pub fn is_xdp(self) -> bool {
        self == HookArg::Xdp
    }
}

/// The program attached at one hook of one interface.
pub struct LiveProgram {
    pub hook: HookArg,
    pub iface: String,
    /// The kernel's id of the program (`bpftool prog show id N`).
    pub id: u32,
    pub fd: ProgramFd,
}

/// Whether an ebpf agent's data path is pinned at `pin_path`: its Service
/// map (links too from Linux 6.6; before, tc programs leave no pin).
pub fn ensure_pinned(pin_path: &Path) -> Result<()> {
    let links = pin_path.join(LINKS_DIR);
    if !pin_path.join(maps::SERVICES).exists() || (has_tcx() && !links.is_dir()) {
        bail!(
            "no ebpf data path is pinned at {}: is an agent running in the ebpf mode \
             (`xproxy run --mode ebpf`) with this --pin-path?",
            pin_path.display()
        );
    }
    Ok(())
}

/// The program `hook` runs on `iface`. Without `iface`: the first interface
/// (by name) with that hook; `pod` takes one that is not an uplink, `xdp`
/// and `tc-ingress` prefer an uplink. Without `hook`: XDP where `iface`
/// has it, else tc ingress.
pub fn find(pin_path: &Path, iface: Option<&str>, hook: Option<HookArg>, uplinks: &[String]) -> Result<LiveProgram> {
    let (hook, iface) = match (iface, hook) {
        (Some(iface), Some(hook)) => (hook, iface.to_owned()),
        (Some(iface), None) => (default_hook(pin_path, iface), iface.to_owned()),
        (None, hook) => {
            let hook = hook.unwrap_or(HookArg::TcIngress);
            (hook, pick_interface(pin_path, hook, uplinks)?)
        }
    };
    let pin = link_pin(pin_path, &iface, hook.program());
    let id = if is_filter(hook) {
        filter_program_id(pin_path, hook.program())?
    } else {
        program_id(&pin).with_context(|| {
            format!(
                "no {} link of the running agent on {iface} (looked for {})",
                hook.program(),
                pin.display()
            )
        })?
    };
    let fd = program_fd(id)?;
    Ok(LiveProgram { hook, iface, id, fd })
}

fn default_hook(pin_path: &Path, iface: &str) -> HookArg {
    if link_pin(pin_path, iface, maps::PROG_XDP_UPLINK).exists() {
        HookArg::Xdp
    } else {
        HookArg::TcIngress
    }
}

/// The interfaces with a pinned link of `program`, sorted by name.
pub fn linked_interfaces(pin_path: &Path, program: &str) -> Result<Vec<String>> {
    let dir: PathBuf = pin_path.join(LINKS_DIR).join(program);
    let Ok(entries) = fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        // The loader writes `.` in interface names as `~` (bpffs refuses dots).
        names.push(entry.file_name().to_string_lossy().replace('~', "."));
    }
    names.sort();
    Ok(names)
}

/// Whether `hook`'s program is a tc filter rather than a pinned link
/// (kernels before 6.6).
fn is_filter(hook: HookArg) -> bool {
    !hook.is_xdp() && !has_tcx()
}

fn pick_interface(pin_path: &Path, hook: HookArg, uplinks: &[String]) -> Result<String> {
    if is_filter(hook) {
        return pick_filtered_interface(hook, uplinks);
    }
    let linked = linked_interfaces(pin_path, hook.program())?;
    let is_uplink = |name: &String| uplinks.contains(name);
    let picked = match hook {
        HookArg::Pod => linked.iter().find(|n| !is_uplink(n)),
        HookArg::Xdp | HookArg::TcIngress => linked.iter().find(|n| is_uplink(n)).or(linked.first()),
        HookArg::TcEgress => linked.first(),
    };
    match picked {
        Some(name) => Ok(name.clone()),
        None if linked.is_empty() => bail!(
            "no {} link is pinned under {}: is the agent attached?",
            hook.program(),
            pin_path.join(LINKS_DIR).display()
        ),
        None => bail!(
            "no pod interface has a {} link (only uplinks: {linked:?})",
            hook.program()
        ),
    }
}

/// [`pick_interface`] where tc programs are filters: no pin says which
/// interfaces have them, so the uplink the addresses show (tc hooks of an
/// uplink), or the one the user names.
fn pick_filtered_interface(hook: HookArg, uplinks: &[String]) -> Result<String> {
    match (hook, uplinks.first()) {
        (HookArg::Pod, _) => bail!(
            "before Linux 6.6 the tc programs are filters, which leave no pin naming the pod \
             interfaces: name the pod's interface with --iface"
        ),
        (_, Some(uplink)) => Ok(uplink.clone()),
        (_, None) => bail!("no uplink found (no interface alone carries a node IP): name one with --iface"),
    }
}

/// The id of the newest loaded program named `name` that uses the maps
/// pinned at `pin_path` (the tc filters' program, before Linux 6.6).
fn filter_program_id(pin_path: &Path, name: &str) -> Result<u32> {
    let pin = pin_path.join(maps::SERVICES);
    let services = MapData::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))?;
    let services_id = services.info().context("reading the Service map's info")?.id();
    // The kernel keeps 15 bytes of a program's name.
    let short = name.get(..15).unwrap_or(name);
    let mut newest = None;
    for info in loaded_programs() {
        let info = info.context("listing the loaded programs")?;
        if info.name_as_str() != Some(short) {
            continue;
        }
        let ids = info
            .map_ids()
            .with_context(|| format!("reading program {}'s maps", info.id()))?;
        if ids.is_some_and(|ids| ids.contains(&services_id)) {
            newest = newest.max(Some(info.id()));
        }
    }
    newest.with_context(|| {
        format!(
            "no loaded {name} program uses the maps pinned at {}: is the agent running?",
            pin_path.display()
        )
    })
}

/// The id of the program the link pinned at `pin` runs.
fn program_id(pin: &Path) -> Result<u32> {
    let link = FdLink::from(PinnedLink::from_pin(pin).context("opening the pinned link")?);
    Ok(link.info().context("reading the link's info")?.program_id())
}

/// A descriptor of the loaded program with id `id`.
fn program_fd(id: u32) -> Result<ProgramFd> {
    for info in loaded_programs() {
        let info = info.context("listing the loaded programs")?;
        if info.id() == id {
            return info.fd().with_context(|| format!("opening program {id}"));
        }
    }
    bail!("program {id} is gone (the agent replaced it meanwhile?)")
}
