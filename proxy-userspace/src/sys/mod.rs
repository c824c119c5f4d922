//! The system layer below every mode: the kernel's command-line tools
//! (`iptables-save`/`iptables-restore`, `nft`, `ipset`) run through one
//! helper ([`tool`]), netlink ([`netlink`]: the kernel's conntrack table,
//! IPVS, rtnetlink) and the local addresses ([`addrs`]).
//! Every call acts in the calling thread's network namespace. A mode
//! imports from here and from the model, never from another mode.

pub mod addrs;
pub mod conntrack;
#[cfg(test)]
pub mod fake_iptables;
#[cfg(test)]
pub mod fresh_netns;
pub mod ipset;
pub mod iptables;
pub mod netlink;
pub mod nft;
pub mod sysctl;
pub mod tool;
