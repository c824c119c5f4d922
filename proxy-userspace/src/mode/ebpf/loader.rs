//! Loads the embedded programs, pins their maps and attaches them to interfaces.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    programs::{
        CgroupSockAddr, Program, SchedClassifier, TcAttachType, Xdp, XdpMode,
        links::{FdLink, LinkError, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
        xdp::XdpLink,
    },
    util::KernelVersion,
};
use proxy_common::maps;
use tracing::{info, warn};

use super::{conntrack::CtSettings, object_bytes};

/// Where on a node an interface sits, which decides the programs it gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// The node's link to the outside: XDP (native) translates NodePort and
    /// external traffic on ingress (tc ingress takes what needs a mark); tc
    /// egress translates packets the node's own processes send to a Service
    /// (routed to the uplink by the default route, redirected to the
    /// backend's interface after DNAT) and reverse-NATs de-masqueraded replies.
    Uplink,
    /// The uplink's programs without XDP: tc ingress does all of it (see
    /// `--xdp`); an XDP link an earlier agent pinned is detached.
    UplinkTc,
    /// The node's end of a pod's veth: tc ingress translates what the pod
    /// sends to a Service and rewrites replies of backends back to the
    /// frontend; tc egress reverse-NATs de-masqueraded replies (hairpin).
    Pod,
}

/// What the programs are loaded with.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// The skb mark bit that asks the kernel to masquerade a flow (0: never).
    pub snat_mark: u32,
    /// The skb mark bit that keeps the kernel's conntrack off a flow (0: never).
    pub notrack_mark: u32,
    /// Conntrack timeouts and size.
    pub conntrack: CtSettings,
}

/// The loaded programs and their maps, pinned under one directory of bpffs.
pub struct Datapath {
    ebpf: Ebpf,
    pin_path: PathBuf,
    /// Whether this load created the backends array (no earlier agent's
    /// was pinned): see [`Datapath::created_backends_array`].
    created_backends_array: bool,
}

/// `statfs(2)` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

impl Datapath {
    /// Loads every program with [`LoadOptions::default`]. Maps already
    /// pinned under `pin_path` (by an earlier agent) are reused as they
    /// are; missing ones are created and pinned.
    pub fn load(pin_path: &Path) -> Result<Self> {
        Self::load_with(pin_path, &LoadOptions::default())
    }

    /// [`Self::load`] with the program constants and the conntrack size of
    /// `options`. A conntrack map pinned by an earlier agent keeps its size
    /// (the kernel cannot resize a map; its flows would be lost): a
    /// different configured size is warned about and takes effect after
    /// `xproxy cleanup`.
    pub fn load_with(pin_path: &Path, options: &LoadOptions) -> Result<Self> {
        ensure_bpffs_dir(pin_path)?;
        let created_backends_array = !pin_path.join(maps::BACKENDS).exists();
        let started = std::time::Instant::now();
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin_path)
            .override_global(maps::GLOBAL_SNAT_MARK, &options.snat_mark, true)
            .override_global(maps::GLOBAL_NOTRACK_MARK, &options.notrack_mark, true)
            .override_global(maps::GLOBAL_CT_TIMEOUTS, &options.conntrack.timeouts, true)
            .map_max_entries(maps::CONNTRACK, options.conntrack.entries)
            .map_max_entries(maps::CONNTRACK6, options.conntrack.entries6)
            .load(object_bytes()?)
            .context("loading the eBPF object (are you root, and is the kernel 6.1 or newer?)")?;
        let maps_ready = started.elapsed();
        let names = [maps::PROG_XDP_UPLINK, maps::PROG_TC_INGRESS, maps::PROG_TC_EGRESS];
        load_programs(&mut ebpf, names.into_iter().chain(proxy_common::socket_lb::PROGRAMS))?;
        info!(
            maps_ms = maps_ready.as_secs_f64() * 1e3,
            programs_ms = (started.elapsed() - maps_ready).as_secs_f64() * 1e3,
            "programs loaded"
        );
        warn_on_adopted_conntrack_size(pin_path, maps::CONNTRACK, options.conntrack.entries);
        warn_on_adopted_conntrack_size(pin_path, maps::CONNTRACK6, options.conntrack.entries6);
        Ok(Self {
            ebpf,
            pin_path: pin_path.to_owned(),
            created_backends_array,
        })
    }

    pub fn pin_path(&self) -> &Path {
        &self.pin_path
    }

    /// Whether the backends array was created by this load, all empty, and
    /// not one an earlier agent pinned (aya reuses a pinned map as it is).
    pub fn created_backends_array(&self) -> bool {
        self.created_backends_array
    }

    /// Attaches the programs `hook` calls for to `iface` (in the calling
    /// thread's network namespace).
    ///
    /// The attachments are bpf links pinned under `<pin path>/links`, so they
    /// outlive this process: the data path keeps forwarding while the agent
    /// restarts, and the next agent swaps its programs into the same links
    /// atomically (`bpf_link_update`) instead of detaching anything.
    pub fn attach(&mut self, iface: &str, hook: Hook) -> Result<()> {
        match hook {
            Hook::Uplink => self.attach_xdp(iface)?,
            Hook::UplinkTc => self.detach_xdp(iface)?,
            Hook::Pod => {}
        }
        // tc on both sides everywhere: ingress for what XDP leaves to it (on
        // the uplink) and what pods send, egress for what the node sends and
        // for replies the kernel de-masqueraded.
        self.attach_tc(iface, maps::PROG_TC_INGRESS, TcAttachType::Ingress)?;
        self.attach_tc(iface, maps::PROG_TC_EGRESS, TcAttachType::Egress)?;
        info!(iface, ?hook, "attached");
        Ok(())
    }

    /// Whether `iface` has both tc programs in pinned links; `None` before
    /// tcx (Linux 6.6), where the programs are filters that leave no pin
    /// (attaching again there only replaces the filters' program).
    pub fn has_tc_links(&self, iface: &str) -> Option<bool> {
        has_tcx().then(|| {
            [maps::PROG_TC_INGRESS, maps::PROG_TC_EGRESS]
                .iter()
                .all(|prog| self.link_pin(iface, prog).exists())
        })
    }

    /// Where the link of program `prog` on `iface` is pinned:
    /// `links/<prog>/<iface>`. bpffs refuses names with a dot, which
    /// interface names may have (`eth0.100`), so dots become `~`.
    pub fn link_pin(&self, iface: &str, prog: &str) -> PathBuf {
        link_pin(&self.pin_path, iface, prog)
    }

    fn attach_xdp(&mut self, iface: &str) -> Result<()> {
        let pin = self.link_pin(iface, maps::PROG_XDP_UPLINK);
        let xdp = self.xdp()?;
        if let Some(link) = open_pinned_link(&pin)? {
            let link = XdpLink::try_from(link).context("pinned XDP link has another type")?;
            let id = xdp
                .attach_to_link(link)
                .with_context(|| format!("updating the XDP link on {iface}"))?;
            // The pin holds the link; dropping our handle only closes its fd.
            drop(xdp.take_link(id)?);
            return Ok(());
        }
        let id = xdp
            .attach(iface, XdpMode::Driver)
            .with_context(|| format!("attaching XDP in native mode to {iface}"))?;
        let link = FdLink::try_from(xdp.take_link(id)?).context("XDP attached without a bpf link")?;
        pin_link(link, &pin)
    }

    /// Detaches and unpins the XDP link on `iface`, if one is pinned.
    fn detach_xdp(&mut self, iface: &str) -> Result<()> {
        let pin = self.link_pin(iface, maps::PROG_XDP_UPLINK);
        if !pin.exists() {
            return Ok(());
        }
        bpf_sys::obj::detach_pinned_link(&pin).with_context(|| format!("detaching XDP from {iface}"))?;
        fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
        info!(iface, "detached XDP (tc only on this uplink now)");
        Ok(())
    }

    fn attach_tc(&mut self, iface: &str, name: &str, attach: TcAttachType) -> Result<()> {
        if !has_tcx() {
            return self.attach_tc_filter(iface, name, attach);
        }
        let pin = self.link_pin(iface, name);
        let prog = self.tc(name)?;
        if let Some(link) = open_pinned_link(&pin)? {
            let link = SchedClassifierLink::try_from(link).context("pinned tc link has another type")?;
            let id = prog
                .attach_to_link(link)
                .with_context(|| format!("updating the {name} link on {iface}"))?;
            drop(prog.take_link(id)?);
            return Ok(());
        }
        let id = prog
            .attach(iface, attach)
            .with_context(|| format!("attaching {name} to {iface}"))?;
        let link = FdLink::try_from(prog.take_link(id)?).context("tc attached without a bpf link")?;
        pin_link(link, &pin)
    }

    /// Kernels before 6.6 have no tcx links: a tc program is a cls_bpf
    /// filter on the interface's clsact qdisc, which stays until deleted and
    /// cannot be pinned. Ours sit at a fixed priority and handle, so a
    /// restarted agent swaps its program into the same filter (atomically,
    /// like a link update) instead of adding a second one, and `cleanup`
    /// finds them by program name ([`detach_tc_filters`]).
    fn attach_tc_filter(&mut self, iface: &str, name: &str, attach: TcAttachType) -> Result<()> {
        if let Err(e) = tc::qdisc_add_clsact(iface)
            && !already_exists(&e)
        {
            return Err(e).with_context(|| format!("adding a clsact qdisc to {iface}"));
        }
        let prog = self.tc(name)?;
        let ours = SchedClassifierLink::attached(iface, attach, TC_FILTER_PRIORITY, TC_FILTER_HANDLE, None)
            .with_context(|| format!("no interface {iface}"))?;
        // Replace the program of our filter if it is there, else create it.
        let id = match prog.attach_to_link(ours) {
            Ok(id) => id,
            Err(_) => prog
                .attach_with_options(
                    iface,
                    attach,
                    TcAttachOptions::Netlink(NlOptions {
                        priority: TC_FILTER_PRIORITY,
                        handle: TC_FILTER_HANDLE,
                        classid: None,
                    }),
                )
                .with_context(|| format!("attaching {name} to {iface} as a tc filter"))?,
        };
        // Dropping aya's handle of a filter deletes the filter; it must
        // outlive the agent, so the handle (a few integers) is forgotten.
        std::mem::forget(prog.take_link(id)?);
        Ok(())
    }

    /// The XDP program, e.g. for `test_run`.
    pub fn xdp(&mut self) -> Result<&mut Xdp> {
        Ok(program(&mut self.ebpf, maps::PROG_XDP_UPLINK)?.try_into()?)
    }

    /// A socket program by name (`proxy_common::socket_lb::PROGRAMS`).
    pub fn socket_program(&mut self, name: &str) -> Result<&mut CgroupSockAddr> {
        Ok(program(&mut self.ebpf, name)?.try_into()?)
    }

    /// A tc program by name ([`maps::PROG_TC_INGRESS`] or [`maps::PROG_TC_EGRESS`]).
    pub fn tc(&mut self, name: &str) -> Result<&mut SchedClassifier> {
        Ok(program(&mut self.ebpf, name)?.try_into()?)
    }
}

/// Subdirectory of the pin path holding the pinned links.
pub const LINKS_DIR: &str = "links";

/// Where the link of program `prog` on `iface` is pinned under `pin_path`
/// (see [`Datapath::link_pin`]).
pub fn link_pin(pin_path: &Path, iface: &str, prog: &str) -> PathBuf {
    pin_path.join(LINKS_DIR).join(prog).join(iface.replace('.', "~"))
}

/// Where our tc filters sit on kernels without tcx (see
/// [`Datapath::attach_tc_filter`]): a priority tc(8) users rarely pick by
/// hand (the kernel's automatic ones count down from 49152), one handle.
const TC_FILTER_PRIORITY: u16 = 0x7870;
const TC_FILTER_HANDLE: TcHandle = TcHandle::new(0, 1);

/// Whether tc programs attach as tcx links (Linux 6.6) rather than as
/// netlink filters; aya makes the same choice in `SchedClassifier::attach`.
pub fn has_tcx() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

/// On kernels without tcx: deletes our tc filters from every interface of
/// the calling thread's network namespace and returns how many programs it
/// took off. On newer kernels the programs are links ([`detach_pinned_links`]).
pub fn detach_tc_filters() -> Result<usize> {
    if has_tcx() {
        return Ok(0);
    }
    let mut detached = 0;
    for iface in interface_names()? {
        for (name, attach) in [
            (maps::PROG_TC_INGRESS, TcAttachType::Ingress),
            (maps::PROG_TC_EGRESS, TcAttachType::Egress),
        ] {
            match tc::qdisc_detach_program(&iface, attach, name) {
                Ok(()) => detached += 1,
                Err(e) => tracing::debug!(iface, name, error = %e, "no filter to detach"),
            }
        }
    }
    Ok(detached)
}

/// Whether `error` comes down to EEXIST (aya reports it as an I/O or a
/// netlink error, depending on where it was seen).
fn already_exists(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EEXIST))
        {
            return true;
        }
        cause = e.source();
    }
    false
}

/// The interfaces of the calling thread's network namespace (if_nameindex
/// asks the kernel over netlink; /sys/class/net would show the namespace
/// sysfs was mounted in).
fn interface_names() -> Result<Vec<String>> {
    // SAFETY: if_nameindex returns a heap array ending with a zeroed entry,
    // or null; it is freed with if_freenameindex below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Err(std::io::Error::last_os_error()).context("listing interfaces");
    }
    let mut names = Vec::new();
    let mut entry = list;
    // SAFETY: entries up to the zeroed terminator are valid; each if_name
    // is a NUL-terminated string owned by the list.
    unsafe {
        while (*entry).if_index != 0 && !(*entry).if_name.is_null() {
            names.push(
                std::ffi::CStr::from_ptr((*entry).if_name)
                    .to_string_lossy()
                    .into_owned(),
            );
            entry = entry.add(1);
        }
        libc::if_freenameindex(list);
    }
    Ok(names)
}

/// Detaches every link pinned under `<pin_path>/links` at once and returns
/// how many it detached. Removing a link's pin (its last reference once the
/// agent is gone) also detaches it, but later, from a kernel work queue:
/// packets would still be translated for a moment after `xproxy cleanup`
/// returned. The pins themselves stay; a link that is gone already (its
/// interface was deleted) is skipped.
pub fn detach_pinned_links(pin_path: &Path) -> Result<usize> {
    let links = pin_path.join(LINKS_DIR);
    let mut detached = 0;
    let Ok(programs) = fs::read_dir(&links) else {
        return Ok(0);
    };
    for program in programs {
        let program = program.with_context(|| format!("listing {}", links.display()))?.path();
        for pin in fs::read_dir(&program).with_context(|| format!("listing {}", program.display()))? {
            let pin = pin.with_context(|| format!("listing {}", program.display()))?.path();
            match bpf_sys::obj::detach_pinned_link(&pin) {
                Ok(()) => detached += 1,
                Err(e) => info!(pin = %pin.display(), error = %e, "link not detached (gone already?)"),
            }
        }
    }
    Ok(detached)
}

pub(super) fn open_pinned_link(pin: &Path) -> Result<Option<FdLink>> {
    match PinnedLink::from_pin(pin) {
        Ok(link) => Ok(Some(FdLink::from(link))),
        Err(LinkError::SyscallError(e)) if e.io_error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("opening pinned link {}", pin.display())),
    }
}

pub(super) fn pin_link(link: FdLink, pin: &Path) -> Result<()> {
    if let Some(dir) = pin.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    link.pin(pin)
        .with_context(|| format!("pinning link at {}", pin.display()))?;
    Ok(())
}

/// Loads the programs `names` into the kernel side by side, one thread
/// each: the verifier's walk of the three packet programs (some 40,000
/// instructions each) is most of the time a start takes, and the kernel
/// verifies programs of separate loads in parallel.
fn load_programs<'a>(ebpf: &mut Ebpf, names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let names: Vec<&str> = names.into_iter().collect();
    let mut found: Vec<(&str, &mut Program)> = ebpf.programs_mut().filter(|(n, _)| names.contains(n)).collect();
    if let Some(missing) = names.iter().find(|n| !found.iter().any(|(f, _)| f == *n)) {
        bail!("program {missing} missing from the eBPF object");
    }
    std::thread::scope(|scope| {
        let loads: Vec<_> = (found.drain(..))
            .map(|(name, prog)| (name, scope.spawn(move || load_program(prog))))
            .collect();
        for (name, load) in loads {
            let loaded = load.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            loaded.with_context(|| format!("verifier rejected {name}"))?;
        }
        Ok(())
    })
}

/// Loads one program of a type the agent attaches.
fn load_program(prog: &mut Program) -> Result<()> {
    match prog {
        Program::Xdp(p) => p.load()?,
        Program::SchedClassifier(p) => p.load()?,
        Program::CgroupSockAddr(p) => p.load()?,
        other => bail!("unexpected program type {:?}", other.prog_type()),
    }
    Ok(())
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut aya::programs::Program> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))
}

/// The pin path is not on bpffs (its own type, so the CLI can exit with a
/// distinct code).
#[derive(Debug, thiserror::Error)]
#[error(
    "{0} is not on a bpf filesystem: mount it (mount -t bpf bpf /sys/fs/bpf); note that `ip netns exec` \
     mounts a fresh /sys without it, `nsenter --net=...` keeps it"
)]
pub struct NotBpffs(pub PathBuf);

/// Pins only work on bpffs: say so plainly instead of failing later with
/// EPERM or ENOENT.
fn ensure_bpffs_dir(pin_path: &Path) -> Result<()> {
    let parent = pin_path.parent().unwrap_or(Path::new("/"));
    if !is_bpffs(parent)? && !is_bpffs(pin_path)? {
        return Err(NotBpffs(parent.to_owned()).into());
    }
    fs::create_dir_all(pin_path).with_context(|| format!("creating pin directory {}", pin_path.display()))
}

fn is_bpffs(path: &Path) -> Result<bool> {
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return Ok(false);
    };
    // SAFETY: an all-zero statfs is a valid value of the plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated; statfs only writes into `st`.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut st) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() == std::io::ErrorKind::NotFound {
            return Ok(false);
        }
        return Err(err).with_context(|| format!("statfs {}", path.display()));
    }
    Ok(st.f_type == BPF_FS_MAGIC)
}

/// Says so when the pinned conntrack map `name` (adopted from an earlier
/// agent) is not `wanted` entries large.
fn warn_on_adopted_conntrack_size(pin_path: &Path, name: &str, wanted: u32) {
    let path = pin_path.join(name);
    match aya::maps::MapInfo::from_pin(&path) {
        Ok(info) if info.max_entries() != wanted => warn!(
            map = name,
            entries = info.max_entries(),
            configured = wanted,
            "the conntrack map pinned by an earlier agent keeps its size (its flows with it); \
             the configured size takes effect after `xproxy cleanup`"
        ),
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot read the conntrack map's size"),
    }
}
