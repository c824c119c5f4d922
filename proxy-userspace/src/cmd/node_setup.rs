//! What kube-proxy does to the node before its proxier starts, in every
//! mode: its own OOM score, and the conntrack table's size and timeouts.
//! None of it is fatal: a container without a writable /proc/sys, or a
//! network namespace where `nf_conntrack_max` is read-only (only the
//! initial namespace may change it), gets a warning per setting.

use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::{config::ConntrackConfig, sys::sysctl};

const NETFILTER: &str = "/proc/sys/net/netfilter";
const CONNTRACK_HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// Applies `oom_score_adj` and the conntrack settings.
pub fn prepare(oom_score_adj: i32, conntrack: &ConntrackConfig) {
    set_oom_score_adj(oom_score_adj);
    for (name, value) in conntrack_sysctls(conntrack, available_cpus()) {
        apply(&Path::new(NETFILTER).join(name), value);
        if name == "nf_conntrack_max" {
            grow_hashsize(value);
        }
    }
}

/// kube-proxy keeps itself alive under memory pressure (-999 by default):
/// without it every Service on the node stops being updated.
fn set_oom_score_adj(value: i32) {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        warn!(value, error = %e, "could not set the agent's oom_score_adj");
    }
}

/// The sysctls kube-proxy sets, with their values; a setting of zero (or
/// `false`) leaves the kernel's value alone, as in kube-proxy.
fn conntrack_sysctls(ct: &ConntrackConfig, cpus: u64) -> Vec<(&'static str, u64)> {
    let mut out = Vec::new();
    if ct.max_per_core > 0 {
        let scaled = u64::from(ct.max_per_core) * cpus;
        out.push(("nf_conntrack_max", scaled.max(u64::from(ct.min))));
    }
    let timeouts = [
        ("nf_conntrack_tcp_timeout_established", ct.tcp_established_timeout),
        ("nf_conntrack_tcp_timeout_close_wait", ct.tcp_close_wait_timeout),
        ("nf_conntrack_udp_timeout", ct.udp_timeout),
        ("nf_conntrack_udp_timeout_stream", ct.udp_stream_timeout),
    ];
    for (name, timeout) in timeouts {
        if !timeout.is_zero() {
            out.push((name, timeout.as_secs()));
        }
    }
    if ct.tcp_be_liberal {
        out.push(("nf_conntrack_tcp_be_liberal", 1));
    }
    out
}

fn apply(path: &Path, value: u64) {
    match sysctl::set(path, value) {
        Ok(sysctl::Outcome::Unchanged) => {}
        Ok(sysctl::Outcome::Written { was }) => info!(sysctl = %path.display(), was, now = value, "set"),
        Err(e) => warn!(sysctl = %path.display(), value, error = %e, "could not set"),
    }
}

/// A larger table needs a larger hash (kube-proxy keeps a quarter of the
/// maximum); the module parameter is global, so only a written maximum
/// (the initial network namespace) leads here to a change.
fn grow_hashsize(max: u64) {
    let path = PathBuf::from(CONNTRACK_HASHSIZE);
    let wanted = max / 4;
    let applied = sysctl::read(&Path::new(NETFILTER).join("nf_conntrack_max")).is_ok_and(|now| now == max);
    match sysctl::read(&path) {
        Ok(size) if size >= wanted || !applied => {}
        Ok(_) => apply(&path, wanted),
        Err(e) => warn!(parameter = %path.display(), error = %e, "could not read the conntrack hash size"),
    }
}

fn available_cpus() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn kube_proxys_defaults_scale_the_table_with_the_cpus_above_the_floor() {
        let defaults = ConntrackConfig::default();
        let set = conntrack_sysctls(&defaults, 2);
        assert_eq!(
            set,
            [
                ("nf_conntrack_max", 131_072),
                ("nf_conntrack_tcp_timeout_established", 86_400),
                ("nf_conntrack_tcp_timeout_close_wait", 3_600),
            ]
        );
        assert_eq!(conntrack_sysctls(&defaults, 16)[0], ("nf_conntrack_max", 524_288));
    }

    #[test]
    fn zero_leaves_a_setting_alone() {
        let ct = ConntrackConfig {
            max_per_core: 0,
            min: 0,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::ZERO,
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(30),
            udp_stream_timeout: Duration::ZERO,
        };
        assert_eq!(
            conntrack_sysctls(&ct, 4),
            [("nf_conntrack_udp_timeout", 30), ("nf_conntrack_tcp_be_liberal", 1)]
        );
    }
}
