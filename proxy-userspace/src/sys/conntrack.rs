//! Deleting UDP flows from the kernel's connection tracking, with the
//! `conntrack` tool (conntrack-tools), one call per filter.

use std::net::Ipv4Addr;

use anyhow::{Result, bail};
use tracing::debug;

use super::tool;

/// UDP flows to delete, by what their conntrack entry holds; a field left
/// `None` matches anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct UdpFlowFilter {
    /// The original destination address (where the client sent to).
    pub orig_dst: Option<Ipv4Addr>,
    /// The original destination port.
    pub orig_dst_port: Option<u16>,
    /// The address the flow was DNATed to (its replies' source).
    pub dst_nat: Option<Ipv4Addr>,
}

impl UdpFlowFilter {
    /// The `conntrack` arguments that delete these flows.
    pub fn conntrack_args(&self) -> Vec<String> {
        let mut args: Vec<String> = ["-D", "-p", "udp"].map(String::from).to_vec();
        let mut push = |flag: &str, value: String| {
            args.push(flag.to_owned());
            args.push(value);
        };
        if let Some(dst) = self.orig_dst {
            push("--orig-dst", dst.to_string());
        }
        if let Some(port) = self.orig_dst_port {
            push("--orig-port-dst", port.to_string());
        }
        if let Some(nat) = self.dst_nat {
            push("--dst-nat", nat.to_string());
        }
        args
    }
}

/// Deletes the flows `filters` match; returns how many `conntrack` calls
/// were made. A filter that matches nothing is fine.
pub fn delete_udp_flows(filters: impl IntoIterator<Item = UdpFlowFilter>) -> Result<u64> {
    let mut calls = 0;
    for filter in filters {
        let args = filter.conntrack_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = tool::run("conntrack", &args, "conntrack-tools")?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        // conntrack exits 1 when nothing matched ("0 flow entries have been deleted").
        let nothing_matched = stderr.contains("0 flow entries");
        if !output.status.success() && !nothing_matched {
            bail!("conntrack {}: {}: {}", args.join(" "), output.status, stderr.trim());
        }
        debug!(args = args.join(" "), result = stderr.trim(), "deleted stale UDP flows");
        calls += 1;
    }
    Ok(calls)
}
