//! The addresses on this network namespace's interfaces, and those of the
//! interface its IPv4 default route leaves by.

use std::net::{IpAddr, Ipv4Addr};

use anyhow::{Context, Result};

/// Every IPv4 address on the calling thread's network namespace's
/// interfaces (`getifaddrs`).
pub fn local_ipv4() -> Result<Vec<Ipv4Addr>> {
    let addrs = nix::ifaddrs::getifaddrs().context("getifaddrs")?;
    Ok(addrs
        .filter_map(|ifa| Some(ifa.address?.as_sockaddr_in()?.ip()))
        .collect())
}

/// Every address of either family on the calling thread's network
/// namespace's interfaces (`getifaddrs`).
pub fn local_ips() -> Result<Vec<IpAddr>> {
    let addrs = nix::ifaddrs::getifaddrs().context("getifaddrs")?;
    Ok(addrs
        .filter_map(|ifa| {
            let addr = ifa.address?;
            addr.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| addr.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect())
}

/// The IPv4 addresses of the interface the IPv4 default route leaves by
/// (the first one listed in `/proc/net/route`, which shows the calling
/// thread's network namespace); empty without a default route.
pub fn default_route_ipv4() -> Result<Vec<Ipv4Addr>> {
    let routes =
        std::fs::read_to_string("/proc/thread-self/net/route").context("reading /proc/thread-self/net/route")?;
    let Some(iface) = default_route_interface(&routes) else {
        return Ok(Vec::new());
    };
    let addrs = nix::ifaddrs::getifaddrs().context("getifaddrs")?;
    Ok(addrs
        .filter(|ifa| ifa.interface_name == iface)
        .filter_map(|ifa| Some(ifa.address?.as_sockaddr_in()?.ip()))
        .collect())
}

/// The interface of the first default route (destination and mask 0, up)
/// in the text of `/proc/net/route`.
fn default_route_interface(routes: &str) -> Option<String> {
    routes.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (iface, destination, flags, mask) = (fields.first()?, fields.get(1)?, fields.get(3)?, fields.get(7)?);
        // RTF_UP is bit 0 of the hexadecimal flags.
        let up = u16::from_str_radix(flags, 16).is_ok_and(|f| f & 1 == 1);
        (up && *destination == "00000000" && *mask == "00000000").then(|| (*iface).to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_routes_interface_is_found() {
        let routes = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                      eth1\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                      eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(default_route_interface(routes).as_deref(), Some("eth0"));
        assert_eq!(default_route_interface("Iface\tDestination\n"), None);
    }

    /// Two interfaces (veths: this kernel has no dummy ones), the default
    /// route by one of them: its address only.
    #[test]
    fn the_default_routes_interface_gives_its_addresses() {
        use crate::sys::fresh_netns::{privileged, run_in_fresh_netns};
        if !privileged("the_default_routes_interface_gives_its_addresses") {
            return;
        }
        run_in_fresh_netns(|| {
            assert!(
                default_route_ipv4().expect("no route").is_empty(),
                "no default route yet"
            );
            for cmd in [
                "link add up0 type veth peer name up0p",
                "link add other0 type veth peer name other0p",
                "addr add 10.9.0.2/24 dev up0",
                "addr add 10.8.0.2/24 dev other0",
                "link set up0 up",
                "link set other0 up",
                "route add default via 10.9.0.1 dev up0",
            ] {
                let status = std::process::Command::new("ip")
                    .args(cmd.split(' '))
                    .status()
                    .expect("running ip");
                assert!(status.success(), "ip {cmd}");
            }
            assert_eq!(default_route_ipv4().expect("routes"), [Ipv4Addr::new(10, 9, 0, 2)]);
        });
    }

    #[test]
    fn loopback_is_local() {
        assert!(local_ipv4().expect("listing").contains(&Ipv4Addr::LOCALHOST));
    }
}
