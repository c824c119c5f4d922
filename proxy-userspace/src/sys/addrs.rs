//! The addresses on this network namespace's interfaces.

use std::net::Ipv4Addr;

use anyhow::{Context, Result};

/// Every IPv4 address on the calling thread's network namespace's
/// interfaces (`getifaddrs`).
pub fn local_ipv4() -> Result<Vec<Ipv4Addr>> {
    let addrs = nix::ifaddrs::getifaddrs().context("getifaddrs")?;
    Ok(addrs
        .filter_map(|ifa| Some(ifa.address?.as_sockaddr_in()?.ip()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_local() {
        assert!(local_ipv4().expect("listing").contains(&Ipv4Addr::LOCALHOST));
    }
}
