//! `xproxy status`: the live data path, read from the pinned maps.

use std::path::Path;

use anyhow::anyhow;

use super::{ExitCode, Failure, WithExitCode, is_root};
use crate::{
    dump,
    mode::ebpf::{ServiceMaps, conntrack::read_conntrack_counts},
};

pub fn status(pin_path: &Path) -> Result<(), Failure> {
    if !is_root() {
        return Err(Failure::new(
            ExitCode::NoPrivileges,
            anyhow!("reading BPF maps needs root"),
        ));
    }
    if !pin_path.join(proxy_common::maps::SERVICES).exists() {
        return Err(Failure::new(
            ExitCode::Error,
            anyhow!(
                "no xproxy data path is pinned at {} (is the agent running with this --pin-path?)",
                pin_path.display()
            ),
        ));
    }
    let maps = ServiceMaps::open(pin_path, vec![]).exit_code(ExitCode::Error)?;
    let mut snapshot = maps.snapshot().exit_code(ExitCode::Error)?;
    snapshot.table = read_conntrack_counts(pin_path).exit_code(ExitCode::Error)?;
    print!("{}", dump::render(&snapshot));
    Ok(())
}
