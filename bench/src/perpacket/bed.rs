//! A loaded data path to time: the real programs in a fresh pin directory,
//! with the seed Services programmed through the agent's own map code.

use std::{
    net::IpAddr,
    os::fd::{AsFd, BorrowedFd},
    path::Path,
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, Map, MapData},
    programs::{SchedClassifier, Xdp},
};
use proxy_common::{CtKey, CtKey6, CtValue, CtValue6, Verdict, maps};
use proxy_userspace::{
    config::Cidr,
    mode::ebpf::{ServiceMaps, notrack, object_bytes, pod_cidrs},
};
use serde::Serialize;
use testbed::privileged::PinDir;
use testbed::testrun::{Prog, seed_services};

use super::family::{FlowKey, seed_service6};

/// Names an eBPF object to measure instead of the one built into this
/// binary (e.g. a candidate change built elsewhere), read at run time.
pub const OBJECT_ENV: &str = "XPROXY_BENCH_EBPF_OBJECT";

/// The programs as the kernel holds them, to say which build was measured.
#[derive(Serialize, Clone, Debug)]
pub struct ProgramInfo {
    pub name: String,
    /// The kernel's tag (a hash of the instructions), as bpftool prints it.
    pub tag: String,
    /// Size of the instructions after the verifier, bytes.
    pub xlated_bytes: u32,
    /// Size of the JIT-compiled code, bytes.
    pub jited_bytes: u32,
}

/// The object's bytes, 8-byte aligned (aya parses the ELF in place), and
/// where they came from.
pub struct Object {
    words: Vec<u64>,
    len: usize,
    pub source: String,
}

impl Object {
    /// The object named by [`OBJECT_ENV`], else the built-in one.
    pub fn from_env_or_builtin() -> Result<Self> {
        match std::env::var_os(OBJECT_ENV) {
            Some(path) => Self::from_path(Path::new(&path)),
            None => Ok(Self::new(object_bytes()?, "built into this binary".into())),
        }
    }

    pub fn from_path(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading the eBPF object {}", path.display()))?;
        Ok(Self::new(&bytes, path.display().to_string()))
    }

    fn new(bytes: &[u8], source: String) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (word, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_ne_bytes(buf);
        }
        Self {
            words,
            len: bytes.len(),
            source,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes; u8 has no
        // alignment or validity requirements.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// One data path: its maps (as the agent opens them), programs and pins.
/// Fields drop in order: maps and programs before the pin directory.
pub struct Bed {
    pub maps: ServiceMaps,
    /// Second handles on conntrack (IPv4's, IPv6's), to remove flows a
    /// case opened.
    conntrack: HashMap<MapData, CtKey, CtValue>,
    conntrack6: HashMap<MapData, CtKey6, CtValue6>,
    ebpf: Ebpf,
    /// Removes every pin when dropped.
    _pin: PinDir,
}

/// The pod networks the bed's backends and pod clients are in, as a node
/// whose configuration names `clusterCIDR`: new flows to them are kept off
/// the kernel's conntrack (the notrack mark), the path real nodes run.
const POD_NETWORKS: [&str; 2] = ["10.244.0.0/16", "fd00:10:244::/48"];

impl Bed {
    /// Loads `object` into a fresh pin directory the way the agent does
    /// (maps pinned by name, `snat_mark` and the notrack mark patched in,
    /// the pod networks written) and programs the seed Services (and the
    /// seed's IPv6 twin), with NodePorts on `node_ips`; the IPv4 conntrack
    /// holds `conntrack_entries`.
    pub fn load(object: &Object, snat_mark: u32, node_ips: Vec<IpAddr>, conntrack_entries: u32) -> Result<Self> {
        let pin = PinDir::new();
        std::fs::create_dir_all(pin.path()).with_context(|| format!("creating {}", pin.path().display()))?;
        // The agent's, for kube-proxy's default masquerade bit.
        let notrack_mark = notrack::mark_for(14);
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pin.path())
            .override_global(maps::GLOBAL_SNAT_MARK, &snat_mark, true)
            // Not required: objects from before it (compared side by side)
            // have no such constant.
            .override_global(maps::GLOBAL_NOTRACK_MARK, &notrack_mark, false)
            .map_max_entries(maps::CONNTRACK, conntrack_entries)
            .load(object.bytes())
            .with_context(|| format!("loading the eBPF object ({})", object.source))?;
        let xdp: &mut Xdp = program(&mut ebpf, maps::PROG_XDP_UPLINK)?.try_into()?;
        xdp.load().context("verifier rejected xdp_uplink")?;
        for name in [maps::PROG_TC_INGRESS, maps::PROG_TC_EGRESS] {
            let tc: &mut SchedClassifier = program(&mut ebpf, name)?.try_into()?;
            tc.load().with_context(|| format!("verifier rejected {name}"))?;
        }
        let networks: Vec<Cidr> = POD_NETWORKS.iter().map(|c| c.parse()).collect::<Result<_, _>>()?;
        pod_cidrs::write(pin.path(), &pod_cidrs::trie_entries(&networks))?;
        let mut maps = ServiceMaps::open(pin.path(), node_ips)?;
        let services = seed_services().into_iter().chain(super::cases::api_services());
        for svc in services.chain([seed_service6()]) {
            maps.sync_service(&svc)
                .with_context(|| format!("programming {}", svc.name))?;
        }
        Ok(Self {
            maps,
            conntrack: open_conntrack(pin.path(), maps::CONNTRACK)?,
            conntrack6: open_conntrack(pin.path(), maps::CONNTRACK6)?,
            ebpf,
            _pin: pin,
        })
    }

    /// Removes conntrack entries; all of them must exist.
    pub fn forget(&mut self, keys: &[FlowKey]) -> Result<()> {
        for key in keys {
            let removed = match key {
                FlowKey::V4(key) => self.conntrack.remove(key),
                FlowKey::V6(key) => self.conntrack6.remove(key),
            };
            removed.with_context(|| format!("removing conntrack entry {key:?}"))?;
        }
        Ok(())
    }

    #[cfg(test)]
    pub fn pin_dir(&self) -> &Path {
        self._pin.path()
    }

    /// The descriptor of one of the three programs.
    pub fn fd(&self, prog: Prog) -> Result<BorrowedFd<'_>> {
        let program = self
            .ebpf
            .program(prog.name())
            .with_context(|| format!("{} is not in the object", prog.name()))?;
        Ok(program.fd()?.as_fd())
    }

    pub fn info(&self, prog: Prog) -> Result<ProgramInfo> {
        let program = self
            .ebpf
            .program(prog.name())
            .with_context(|| format!("{} is not in the object", prog.name()))?;
        let info = program.info()?;
        Ok(ProgramInfo {
            name: prog.name().to_owned(),
            tag: format!("{:016x}", info.tag()),
            xlated_bytes: info.size_translated().unwrap_or(0),
            jited_bytes: info.size_jitted(),
        })
    }

    /// Packets counted so far per verdict (summed over CPUs).
    pub fn packets(&self) -> Result<[u64; Verdict::COUNT as usize]> {
        let mut out = [0; Verdict::COUNT as usize];
        for (verdict, counter) in self.maps.verdict_counts()? {
            out[verdict as usize] = counter.packets;
        }
        Ok(out)
    }
}

/// A handle on the pinned conntrack map `name` with keys `K`.
fn open_conntrack<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &str) -> Result<HashMap<MapData, K, V>> {
    let pin = pin_dir.join(name);
    let data = MapData::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))?;
    HashMap::try_from(Map::from_map_data(data)?).with_context(|| format!("{name} has an unexpected layout"))
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut aya::programs::Program> {
    match ebpf.program_mut(name) {
        Some(p) => Ok(p),
        None => bail!("program {name} is not in the eBPF object"),
    }
}
