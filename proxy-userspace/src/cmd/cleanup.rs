//! `xproxy cleanup`: removes what xproxy installed.
//!
//! ebpf mode: the pinned links are detached first (at once; unpinning alone
//! detaches them only a moment later), then the pins of links, programs and
//! maps are removed, which frees them once nothing uses them. On kernels
//! before 6.6 the tc programs are filters on the interfaces' clsact qdiscs
//! instead of links: those are deleted from every interface.

use std::path::Path;

use anyhow::{Context, anyhow};
use tracing::info;

use super::{ExitCode, Failure, WithExitCode, is_root};

pub fn cleanup(pin_path: &Path) -> Result<(), Failure> {
    if !is_root() {
        return Err(Failure::new(ExitCode::NoPrivileges, anyhow!("cleanup needs root")));
    }
    if pin_path.exists() {
        let detached = crate::mode::ebpf::detach_pinned_links(pin_path).exit_code(ExitCode::Error)?;
        info!(links = detached, "detached the eBPF programs");
        std::fs::remove_dir_all(pin_path)
            .with_context(|| format!("removing {}", pin_path.display()))
            .exit_code(ExitCode::Error)?;
        info!(pin_path = %pin_path.display(), "removed the pinned eBPF programs, links and maps");
    } else {
        info!(pin_path = %pin_path.display(), "nothing pinned");
    }
    // Kernels before 6.6: the tc programs are filters, not pinned links.
    let filters = crate::mode::ebpf::detach_tc_filters().exit_code(ExitCode::Error)?;
    if filters > 0 {
        info!(filters, "deleted the tc filters of the eBPF programs");
    }
    crate::mode::ebpf::snat::cleanup().exit_code(ExitCode::Error)?;
    crate::mode::iptables::cleanup().exit_code(ExitCode::Error)?;
    crate::mode::nftables::cleanup().exit_code(ExitCode::Error)?;
    crate::mode::ipvs::cleanup().exit_code(ExitCode::Error)?;
    crate::mode::userspace::cleanup().exit_code(ExitCode::Error)?;
    Ok(())
}
