//! The kernel half of keeping the kernel's conntrack off flows to pods
//! (the programs' `notrack`): the programs mark the packets of such flows
//! (XDP through the packet's metadata, which tc ingress copies into the
//! skb), and this raw-table rule untracks marked packets before conntrack
//! sees them (the raw table's PREROUTING runs first, right after tc
//! ingress).
//!
//! Why: the programs reverse-NAT such a flow's replies and redirect them to
//! the client's interface, past the kernel's hooks. Tracked, its forward
//! half alone would make the client's ACK invalid to the kernel (it saw
//! no SYN-ACK), and a `--ctstate INVALID -j DROP` rule (Calico's, many
//! host firewalls') would drop it; each connection would also cost a
//! kernel conntrack entry, measured at several microseconds of its
//! connect (bench/notes/perpacket-findings.md).

use anyhow::{Context, Result};

use super::node_chain::NodeChain;
use crate::sys::iptables::Iptables;

/// Our chain in the raw table, jumped to from PREROUTING.
pub const CHAIN: &str = "XPROXY-NOTRACK";
const RAW_CHAIN: NodeChain = NodeChain {
    table: "raw",
    chain: CHAIN,
    from: "PREROUTING",
    comment: "xproxy: keep conntrack off flows the ebpf programs translate alone",
};

/// The mark bit the programs use: 13 (`0x2000`), beside kube-proxy's
/// masquerade (14) and drop (15) bits and below the 16 bits Calico keeps;
/// 12 if the masquerade bit was configured to be 13.
pub fn mark_for(masquerade_bit: u8) -> u32 {
    if masquerade_bit == 13 { 1 << 12 } else { 1 << 13 }
}

/// Installs the rule for `mark` (idempotent: one jump, whatever was there).
pub fn install(iptables: &mut dyn Iptables, mark: u32) -> Result<()> {
    let rule = format!("-A {CHAIN} -m mark --mark {mark:#x}/{mark:#x} -j CT --notrack\n");
    RAW_CHAIN
        .install(iptables, &rule)
        .context("installing the notrack rule")
}

/// Removes the chain and every jump to it; false if there was none.
pub fn remove(iptables: &mut dyn Iptables) -> Result<bool> {
    RAW_CHAIN.remove(iptables).context("removing the notrack rule")
}

/// [`remove`] with the system's iptables and ip6tables.
pub fn cleanup() -> Result<()> {
    RAW_CHAIN.cleanup()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::fake_iptables::FakeKernel;

    #[test]
    fn installs_one_rule_and_one_jump_and_removes_both() {
        let kernel = FakeKernel::default();
        for _ in 0..2 {
            install(&mut kernel.clone(), 0x2000).unwrap();
            assert_eq!(
                kernel.rules("raw", CHAIN),
                ["-m mark --mark 0x2000/0x2000 -j CT --notrack"]
            );
            let jumps = kernel.rules("raw", "PREROUTING");
            assert_eq!(jumps.len(), 1, "{jumps:?}");
            assert!(jumps[0].ends_with(&format!("-j {CHAIN}")), "{jumps:?}");
        }
        assert!(remove(&mut kernel.clone()).unwrap());
        assert_eq!(kernel.chain("raw", CHAIN), None);
        assert!(kernel.rules("raw", "PREROUTING").is_empty());
        assert!(!remove(&mut kernel.clone()).unwrap());
    }

    #[test]
    fn the_mark_stays_off_the_masquerade_bit() {
        assert_eq!(mark_for(14), 0x2000);
        assert_eq!(mark_for(13), 0x1000);
    }
}
