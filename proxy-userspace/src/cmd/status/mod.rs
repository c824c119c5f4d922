//! `xproxy status`: the live data path of whichever mode programmed this
//! node, read back from the kernel (the pinned maps, `iptables-save`,
//! `nft -j list table`, IPVS over netlink, the userspace mode's rules and
//! agent), printed as one table for every mode (`table`), or as JSON.
//! Each mode's read-back is a file of its own.

pub mod ebpf;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod table;
pub mod userspace;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use tracing::{debug, warn};

use super::{ExitCode, Failure, WithExitCode, is_root};
use crate::{
    config::Mode,
    model::IpFamily,
    sys::iptables::{Iptables, Saved, SystemIptables},
};

/// What `xproxy status` was asked for.
#[derive(Clone, Debug)]
pub struct Options {
    pub pin_path: PathBuf,
    /// `None`: the mode found programmed ([`detect`]).
    pub mode: Option<Mode>,
    pub json: bool,
}

pub fn status(options: &Options) -> Result<(), Failure> {
    if !is_root() {
        return Err(Failure::new(
            ExitCode::NoPrivileges,
            anyhow!("reading the kernel's Service state needs root"),
        ));
    }
    let mode = match options.mode {
        Some(mode) => mode,
        None => detect(&options.pin_path)?.ok_or_else(|| {
            Failure::new(
                ExitCode::Error,
                anyhow!(
                    "no xproxy data path found: nothing pinned at {}, no table ip/ip6 xproxy, no KUBE-* \
                     Service rules, no IPVS virtual server (is the agent running, in this network \
                     namespace, with this --pin-path?)",
                    options.pin_path.display()
                ),
            )
        })?,
    };
    let report = read_back(mode, &options.pin_path).exit_code(ExitCode::Error)?;
    if options.json {
        println!("{:#}", report.table.to_json());
    } else {
        print!("Mode: {}\n{}{}", mode.as_str(), report.table.render(), report.footer);
    }
    Ok(())
}

/// One mode's read-back: the table, and what the mode adds below it.
pub struct Report {
    pub table: table::Table,
    pub footer: String,
}

/// Reads `mode`'s state from the kernel of the calling thread's network
/// namespace.
pub fn read_back(mode: Mode, pin_path: &Path) -> Result<Report> {
    let (table, footer) = match mode {
        Mode::Ebpf => {
            if !ebpf::in_use(pin_path) {
                return Err(anyhow!(
                    "no xproxy data path is pinned at {} (is the agent running with this --pin-path?)",
                    pin_path.display()
                ));
            }
            ebpf::read_back(pin_path)?
        }
        Mode::Iptables => (iptables::read_back()?, String::new()),
        Mode::Nftables => (nftables::read_back()?, String::new()),
        Mode::Ipvs => (ipvs::read_back()?, String::new()),
        Mode::Userspace => (
            userspace::read_back()?,
            "\nThe agent relays each connection to an endpoint it picks: the endpoints are in its state, not in the kernel's.\n".into(),
        ),
    };
    Ok(Report { table, footer })
}

/// The mode whose state is in the kernel, in the order the modes' own
/// markers are unmistakable: pinned maps, the nftables tables, the
/// iptables mode's per-service chains, IPVS, the userspace portals (the
/// rule modes' in either family: a node may have IPv6 Services only).
/// Several found (a mode switched without `xproxy cleanup`): the first,
/// with a warning.
pub fn detect(pin_path: &Path) -> Result<Option<Mode>> {
    let saved = Saved::parse(&saved_rules(IpFamily::V4)?);
    let saved6 = Saved::parse(&saved_rules(IpFamily::V6)?);
    let in_either = |in_use: fn(&Saved) -> bool| in_use(&saved) || in_use(&saved6);
    let found: Vec<Mode> = [
        (Mode::Ebpf, ebpf::in_use(pin_path)),
        (Mode::Nftables, nftables::in_use()?),
        (Mode::Iptables, in_either(iptables::in_use)),
        (Mode::Ipvs, ipvs::in_use()),
        (Mode::Userspace, in_either(userspace::in_use)),
    ]
    .into_iter()
    .filter_map(|(mode, used)| used.then_some(mode))
    .collect();
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|m| m.as_str()).collect();
        warn!(modes = ?names, "the state of several modes is programmed; showing the first (--mode picks one)");
    }
    Ok(found.first().copied())
}

/// `iptables-save` or `ip6tables-save` output (the iptables and userspace
/// modes' read-back). A node without `ip6tables` has no IPv6 rules: empty.
fn saved_rules(family: IpFamily) -> Result<String> {
    let mut system = SystemIptables::for_family(family);
    if family == IpFamily::V6 && system.check().is_err() {
        debug!("ip6tables is not installed: no IPv6 rules to read");
        return Ok(String::new());
    }
    let tool = match family {
        IpFamily::V4 => "iptables-save",
        IpFamily::V6 => "ip6tables-save",
    };
    system.save().with_context(|| format!("running {tool}"))
}

/// The table of both families' saved rules, each family's frontends read
/// by `add_saved` (the iptables and userspace modes' read-back).
fn saved_table(
    mode: &'static str,
    saved_v4: &str,
    saved_v6: &str,
    add_saved: fn(&mut table::Frontends, &str, IpFamily),
) -> table::Table {
    let mut frontends = table::Frontends::default();
    add_saved(&mut frontends, saved_v4, IpFamily::V4);
    add_saved(&mut frontends, saved_v6, IpFamily::V6);
    frontends.into_table(mode)
}
