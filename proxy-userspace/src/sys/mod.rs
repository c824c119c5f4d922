//! The system layer below every mode: the kernel's command-line tools
//! (`iptables-save`/`iptables-restore`, `nft`, `ipset`) run through one
//! helper ([`tool`]), and the kernel's conntrack table over netlink.
//! Every call acts in the calling thread's network namespace. A mode
//! imports from here and from the model, never from another mode.

pub mod conntrack;
#[cfg(test)]
pub mod fresh_netns;
pub mod ipset;
pub mod iptables;
pub mod netlink;
pub mod nft;
pub mod tool;
