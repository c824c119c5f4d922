//! `xproxy cleanup`: removes what it is asked to (`--scope`).
//!
//! - `own` (the default): what no one but xproxy makes: the ebpf mode's
//!   programs, links and maps (the pinned links are detached first, at
//!   once, since unpinning alone detaches them only a moment later; on
//!   kernels before 6.6 the tc programs are filters on the interfaces'
//!   clsact qdiscs, deleted from every interface), its `XPROXY-SNAT`
//!   and `XPROXY-NOTRACK` chains and `inet xproxy-sctp` table (and an
//!   older agent's `ip` one), and the nftables mode's `ip xproxy` table.
//! - `kube-proxy`: what carries kube-proxy's names. The iptables, IPVS
//!   and userspace modes lay their rules out as kube-proxy does (KUBE-*
//!   chains and ipsets, `kube-ipvs0`), and the IPVS table has no owner
//!   field: this removes a kube-proxy's rules too, and every IPVS virtual
//!   server on the host, as `kube-proxy --cleanup` does. Run on a node
//!   after the ebpf mode took over from kube-proxy, it leaves the ebpf
//!   data path alone.
//! - `all`: both.

use std::path::Path;

use anyhow::{Context, anyhow};
use tracing::info;

use super::{ExitCode, Failure, WithExitCode, is_root};

/// What `xproxy cleanup` removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scope {
    /// The ebpf and nftables modes' state: names only xproxy uses.
    Own,
    /// The iptables, IPVS and userspace modes' state, which carries
    /// kube-proxy's names (a kube-proxy's rules and every IPVS virtual
    /// server on the host go too).
    KubeProxy,
    /// Both.
    All,
}

pub fn cleanup(pin_path: &Path, scope: Scope) -> Result<(), Failure> {
    if !is_root() {
        return Err(Failure::new(ExitCode::NoPrivileges, anyhow!("cleanup needs root")));
    }
    if scope != Scope::KubeProxy {
        remove_ebpf(pin_path).exit_code(ExitCode::Error)?;
        crate::mode::nftables::cleanup().exit_code(ExitCode::Error)?;
    }
    if scope == Scope::Own {
        info!(
            "left the KUBE-* iptables chains, IPVS virtual servers and ipsets alone \
             (the iptables, IPVS and userspace modes' and kube-proxy's): \
             `xproxy cleanup --scope kube-proxy` removes them"
        );
    } else {
        crate::mode::iptables::cleanup().exit_code(ExitCode::Error)?;
        crate::mode::ipvs::cleanup().exit_code(ExitCode::Error)?;
        crate::mode::userspace::cleanup().exit_code(ExitCode::Error)?;
    }
    Ok(())
}

/// The ebpf mode: links, pins, pre-6.6 tc filters, the notrack and SNAT
/// fallback chains, the SCTP fallback table.
fn remove_ebpf(pin_path: &Path) -> anyhow::Result<()> {
    if pin_path.exists() {
        let detached = crate::mode::ebpf::detach_pinned_links(pin_path)?;
        info!(links = detached, "detached the eBPF programs");
        std::fs::remove_dir_all(pin_path).with_context(|| format!("removing {}", pin_path.display()))?;
        info!(pin_path = %pin_path.display(), "removed the pinned eBPF programs, links and maps");
    } else {
        info!(pin_path = %pin_path.display(), "nothing pinned");
    }
    let filters = crate::mode::ebpf::detach_tc_filters()?;
    if filters > 0 {
        info!(filters, "deleted the tc filters of the eBPF programs");
    }
    crate::mode::ebpf::sctp_fallback::cleanup()?;
    crate::mode::ebpf::notrack::cleanup()?;
    crate::mode::ebpf::snat::cleanup()
}
