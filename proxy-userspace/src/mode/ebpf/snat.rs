//! The kernel half of the SNAT fallback: the programs DNAT and mark flows
//! that must also be source-NATed (hairpin, NodePort to another node,
//! masqueradeAll); these constant rules masquerade marked packets. Their
//! number never grows with the number of Services.

use anyhow::{Context, Result};
use tracing::info;

use crate::sys::iptables::{Iptables, Saved, SystemIptables, remove_chains, rule_chain, rule_target};

/// Our chain in the nat table, jumped to from POSTROUTING.
pub const CHAIN: &str = "XPROXY-SNAT";
const JUMP_COMMENT: &str = "xproxy: masquerade flows the ebpf programs marked";

/// The rules, for `iptables-restore --noflush` (declaring the chain
/// flushes it, so installing again replaces them).
fn rules(mark: u32, with_jump: bool) -> String {
    let mut input = format!(
        "*nat\n:{CHAIN} - [0:0]\n\
         -A {CHAIN} -m mark ! --mark {mark:#x}/{mark:#x} -j RETURN\n\
         -A {CHAIN} -j MARK --xor-mark {mark:#x}\n\
         -A {CHAIN} -j MASQUERADE --random-fully\n"
    );
    if with_jump {
        input.push_str(&format!(
            "-A POSTROUTING -m comment --comment \"{JUMP_COMMENT}\" -j {CHAIN}\n"
        ));
    }
    input.push_str("COMMIT\n");
    input
}

fn jumps(saved: &Saved) -> Vec<String> {
    saved
        .tables
        .get("nat")
        .map(|nat| {
            nat.rules
                .iter()
                .filter(|r| rule_chain(r) != Some(CHAIN) && rule_target(r) == Some(CHAIN))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// Installs the rules for `mark` (idempotent: one jump, whatever was there).
pub fn install(iptables: &mut dyn Iptables, mark: u32) -> Result<()> {
    let saved = Saved::parse(&iptables.save().context("reading the current rules")?);
    let with_jump = jumps(&saved).is_empty();
    iptables
        .restore(&rules(mark, with_jump))
        .context("installing the SNAT fallback rules")
}

/// Removes the chain and every jump to it; false if there was none.
pub fn remove(iptables: &mut dyn Iptables) -> Result<bool> {
    let removed = remove_chains(iptables, |table, chain| table == "nat" && chain == CHAIN)
        .context("removing the SNAT fallback rules")?;
    Ok(removed > 0)
}

/// [`remove`] with the system's iptables; nothing to do without iptables.
pub fn cleanup() -> Result<()> {
    let mut system = SystemIptables::default();
    if system.check().is_err() {
        return Ok(());
    }
    if remove(&mut system)? {
        info!(chain = CHAIN, "removed the ebpf mode's SNAT fallback rules");
    }
    Ok(())
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
        install(&mut fake, 0x4000).unwrap();
        let input = &fake.restored[0];
        assert!(
            input.contains("-A XPROXY-SNAT -m mark ! --mark 0x4000/0x4000 -j RETURN"),
            "{input}"
        );
        assert!(input.contains("-j MASQUERADE --random-fully"));
        assert_eq!(input.matches("-A POSTROUTING").count(), 1);
        // Already jumped to: no second jump.
        fake.saved = format!("*nat\n:POSTROUTING ACCEPT [0:0]\n:{CHAIN} - [0:0]\n-A POSTROUTING -j {CHAIN}\nCOMMIT\n");
        install(&mut fake, 0x4000).unwrap();
        assert_eq!(fake.restored[1].matches("-A POSTROUTING").count(), 0);
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
