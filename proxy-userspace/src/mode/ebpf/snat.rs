//! The kernel half of the SNAT fallback: the programs DNAT and mark flows
//! that must also be source-NATed (hairpin, NodePort to another node,
//! masqueradeAll); these constant rules masquerade marked packets, in
//! iptables and, the same, in ip6tables (see `node_chain`).
//!
//! The masqueraded source ports stay out of the node port range. The
//! programs see a packet before the kernel's conntrack does: a backend's
//! reply to `node IP:port`, where the port the kernel picked happened to
//! be a node port, would be taken for a new connection to that node port
//! and sent to one of its backends (kube-proxy's rules never see it: the
//! kernel knows it as a reply first). Cilium keeps its own SNAT ports
//! above the node port range for the same reason.

use std::ops::RangeInclusive;

use anyhow::{Context, Result};

use super::node_chain::NodeChain;
use crate::sys::iptables::Iptables;

/// Our chain in the nat table, jumped to from POSTROUTING.
pub const CHAIN: &str = "XPROXY-SNAT";
const NAT_CHAIN: NodeChain = NodeChain {
    table: "nat",
    chain: CHAIN,
    from: "POSTROUTING",
    comment: "xproxy: masquerade flows the ebpf programs marked",
};

/// The lowest port masquerading may pick: below are the privileged ones.
const FIRST_UNPRIVILEGED_PORT: u16 = 1024;

/// The source ports to masquerade to: the larger of the two runs of
/// unprivileged ports on either side of `node_ports` (32768-65535 for
/// kube-apiserver's default 30000-32767).
pub fn ports_outside(node_ports: &RangeInclusive<u16>) -> RangeInclusive<u16> {
    let below = FIRST_UNPRIVILEGED_PORT..=node_ports.start().saturating_sub(1);
    let above = node_ports.end().saturating_add(1)..=u16::MAX;
    let len = |r: &RangeInclusive<u16>| (u32::from(*r.end()) + 1).saturating_sub(u32::from(*r.start()));
    if *node_ports.end() == u16::MAX || len(&below) > len(&above) {
        below
    } else {
        above
    }
}

/// Protocols whose ports masquerading picks (`--to-ports` needs one named).
const PORTED_PROTOCOLS: [&str; 3] = ["tcp", "udp", "sctp"];

/// The chain's rules.
fn rules(mark: u32, ports: &RangeInclusive<u16>) -> String {
    let mut rules = format!(
        "-A {CHAIN} -m mark ! --mark {mark:#x}/{mark:#x} -j RETURN\n\
         -A {CHAIN} -j MARK --xor-mark {mark:#x}\n"
    );
    let (first, last) = (ports.start(), ports.end());
    for protocol in PORTED_PROTOCOLS {
        rules.push_str(&format!(
            "-A {CHAIN} -p {protocol} -j MASQUERADE --to-ports {first}-{last} --random-fully\n"
        ));
    }
    // Other protocols (ICMP echo): nothing the programs take for a node port.
    rules.push_str(&format!("-A {CHAIN} -j MASQUERADE --random-fully\n"));
    rules
}

/// Installs the rules for `mark`, masquerading to `ports` (idempotent: one
/// jump, whatever was there).
pub fn install(iptables: &mut dyn Iptables, mark: u32, ports: &RangeInclusive<u16>) -> Result<()> {
    NAT_CHAIN
        .install(iptables, &rules(mark, ports))
        .context("installing the SNAT fallback rules")
}

/// Removes the chain and every jump to it; false if there was none.
pub fn remove(iptables: &mut dyn Iptables) -> Result<bool> {
    NAT_CHAIN.remove(iptables).context("removing the SNAT fallback rules")
}

/// [`remove`] with the system's iptables and ip6tables.
pub fn cleanup() -> Result<()> {
    NAT_CHAIN.cleanup()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies restore input to a list of rules, like the kernel would.
    #[derive(Default)]
    struct FakeIptables {
        saved: String,
        restored: Vec<String>,
    }

    impl Iptables for FakeIptables {
        fn save(&mut self) -> Result<String> {
            Ok(self.saved.clone())
        }
        fn restore(&mut self, input: &str) -> Result<()> {
            self.restored.push(input.to_owned());
            Ok(())
        }
    }

    #[test]
    fn installs_a_constant_chain_and_one_jump() {
        let mut fake = FakeIptables {
            saved: "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n".into(),
            ..Default::default()
        };
        install(&mut fake, 0x4000, &(32768..=65535)).unwrap();
        let input = &fake.restored[0];
        assert!(
            input.contains("-A XPROXY-SNAT -m mark ! --mark 0x4000/0x4000 -j RETURN"),
            "{input}"
        );
        for protocol in ["tcp", "udp", "sctp"] {
            assert!(
                input.contains(&format!(
                    "-A XPROXY-SNAT -p {protocol} -j MASQUERADE --to-ports 32768-65535 --random-fully"
                )),
                "{input}"
            );
        }
        assert!(input.ends_with("-A XPROXY-SNAT -j MASQUERADE --random-fully\n-A POSTROUTING -m comment --comment \"xproxy: masquerade flows the ebpf programs marked\" -j XPROXY-SNAT\nCOMMIT\n"), "{input}");
        assert_eq!(input.matches("-A POSTROUTING").count(), 1);
        // Already jumped to: no second jump.
        fake.saved = format!("*nat\n:POSTROUTING ACCEPT [0:0]\n:{CHAIN} - [0:0]\n-A POSTROUTING -j {CHAIN}\nCOMMIT\n");
        install(&mut fake, 0x4000, &(32768..=65535)).unwrap();
        assert_eq!(fake.restored[1].matches("-A POSTROUTING").count(), 0);
    }

    #[test]
    fn masquerades_to_the_larger_run_of_ports_beside_the_node_ports() {
        assert_eq!(ports_outside(&(30000..=32767)), 32768..=65535);
        assert_eq!(ports_outside(&(40000..=60000)), 1024..=39999);
        assert_eq!(ports_outside(&(30000..=65535)), 1024..=29999);
        assert_eq!(ports_outside(&(1..=1023)), 1024..=65535);
        assert_eq!(ports_outside(&(0..=20000)), 20001..=65535);
    }

    #[test]
    fn removal_deletes_jumps_then_the_chain_and_is_idempotent() {
        let mut fake = FakeIptables {
            saved: format!("*nat\n:POSTROUTING ACCEPT [0:0]\n:{CHAIN} - [0:0]\n-A POSTROUTING -j {CHAIN}\nCOMMIT\n"),
            ..Default::default()
        };
        assert!(remove(&mut fake).unwrap());
        let input = &fake.restored[0];
        assert!(input.contains(&format!("-D POSTROUTING -j {CHAIN}")) && input.contains(&format!("-X {CHAIN}")));
        fake.saved = "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n".into();
        assert!(!remove(&mut fake).unwrap());
        assert_eq!(fake.restored.len(), 1);
    }
}
