//! Names inside the `ip xproxy` table: the fixed chains, maps and sets, and
//! the per-service ones, derived the way kube-proxy's nftables mode derives
//! them so that `nft list table` reads the same on both.
//!
//! A per-service chain is a prefix plus `HASH-namespace/service/protocol/port`
//! (`service-ULMVA6XW-ns1/svc1/tcp/p80`); an endpoint chain appends
//! `__IP/PORT`. HASH is the first 8 characters of the standard base32 form
//! of SHA-256 over the part after it, so names stay distinct even when a
//! long one has to be cut short. Only `/` tells a per-service chain from a
//! fixed one.

use sha2::{Digest, Sha256};

use crate::model::{Endpoint, IPV6_SUFFIX, IpFamily, ServicePort};

/// The IPv4 table's family and the name of both tables: not kube-proxy's
/// `kube-proxy`, so both can run side by side and cleaning up one never
/// touches the other.
pub const FAMILY: &str = "ip";
pub const TABLE: &str = "xproxy";

/// The nft family of the table for ports of `family` (`ip`, `ip6`), which
/// is also the keyword of its address matches (`ip saddr`, `ip6 daddr`).
pub fn nft_family(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => FAMILY,
        IpFamily::V6 => "ip6",
    }
}

// Base chains, named `TYPE-HOOK` like kube-proxy's.
pub const FILTER_PREROUTING: &str = "filter-prerouting";
pub const FILTER_INPUT: &str = "filter-input";
pub const FILTER_FORWARD: &str = "filter-forward";
pub const FILTER_OUTPUT: &str = "filter-output";
pub const NAT_PREROUTING: &str = "nat-prerouting";
pub const NAT_OUTPUT: &str = "nat-output";
pub const NAT_POSTROUTING: &str = "nat-postrouting";

/// Service dispatch: ClusterIPs and NodePorts through the maps below.
pub const SERVICES: &str = "services";
/// Rejects new connections to Services without endpoints.
pub const ENDPOINTS_CHECK: &str = "endpoints-check";
/// Drops new connections to load balancer IPs from outside their
/// Service's `loadBalancerSourceRanges` (before DNAT, so it still sees the
/// LB IP).
pub const FIREWALL_CHECK: &str = "firewall-check";
/// Where the no-endpoint maps send packets.
pub const REJECT_CHAIN: &str = "reject-chain";
/// Where `@no-endpoint-nodeports` sends node-port packets of Services
/// whose `Local` external traffic policy finds no endpoint on this node:
/// dropped, unless they come from the node itself (the filter chains run
/// before the DNAT of `nat-output`, which sends those to any endpoint).
pub const DROP_EXTERNAL_CHAIN: &str = "drop-external-chain";
/// Sets the masquerade bit.
pub const MARK_MASQ: &str = "mark-for-masquerade";
/// postrouting: masquerades marked packets.
pub const MASQUERADING: &str = "masquerading";

/// `ClusterIP . protocol . port` -> `goto service-…`.
pub const SERVICE_IPS: &str = "service-ips";
/// `protocol . nodePort` -> `goto external-…`.
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
/// `ClusterIP . protocol . port` -> `goto reject-chain` for Services without endpoints.
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
/// `protocol . nodePort` -> `goto reject-chain` for Services without endpoints.
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
/// `LB IP . protocol . port` -> `goto firewall-…` for Services with
/// `loadBalancerSourceRanges`.
pub const FIREWALL_IPS: &str = "firewall-ips";
/// The addresses NodePorts answer on, when they are listed (`[primary]`).
pub const NODEPORT_IPS: &str = "nodeport-ips";
/// The networks NodePorts answer in (nodePortAddresses CIDRs).
pub const NODEPORT_CIDRS: &str = "nodeport-cidrs";

/// Per service port: picks an endpoint (`Cluster` traffic policy).
pub const SERVICE_PREFIX: &str = "service-";
/// Per service port: picks one of this node's endpoints (`Local` policy).
pub const LOCAL_PREFIX: &str = "local-";
/// Per service port: NodePort, external IP and LB IP traffic.
pub const EXTERNAL_PREFIX: &str = "external-";
/// Per service port: drops LB IP traffic from outside the source ranges.
pub const FIREWALL_PREFIX: &str = "firewall-";
/// Per endpoint of a service port: the DNAT.
pub const ENDPOINT_PREFIX: &str = "endpoint-";
/// Per endpoint of a service port with ClientIP affinity: the clients it
/// served lately (a set with the Service's timeout).
pub const AFFINITY_PREFIX: &str = "affinity-";

/// nftables' limit on names is 256 bytes with the terminating NUL; kube-proxy
/// keeps the part after the prefix within 240 and so does this.
const BASE_MAX: usize = 240;
const HASH_LEN: usize = 8;

/// Whether `chain` is a per-service chain (only those contain a `/`).
pub fn is_service_chain(chain: &str) -> bool {
    chain.contains('/')
}

/// `namespace/service/protocol/port` of a port named `namespace/service[:port]`.
fn port_path(port: &ServicePort) -> String {
    // The IPv6 half of a dual-stack Service lives in a table of its own:
    // its chains are named as in the IPv4 table, as kube-proxy names them.
    let name = port.name.strip_suffix(IPV6_SUFFIX).unwrap_or(&port.name);
    let (ns, rest) = name.split_once('/').unwrap_or(("", name));
    // Service names cannot hold ':', so the first one starts the port name.
    let (service, port_name) = rest.split_once(':').unwrap_or((rest, ""));
    format!("{ns}/{service}/{}/{port_name}", port.protocol.lowercase())
}

/// `HASH-name`, cut to [`BASE_MAX`]. Characters nftables does not take in
/// an unquoted name become `_` (after hashing, so names stay distinct);
/// the API server never lets such a name through, a manifest might.
fn hashed(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    let mut out = data_encoding::BASE32.encode(&digest);
    out.truncate(HASH_LEN);
    out.push('-');
    out.extend(name.chars().map(|c| {
        if c.is_ascii_alphanumeric() || matches!(c, '/' | '_' | '.' | '-') {
            c
        } else {
            '_'
        }
    }));
    if out.len() > BASE_MAX {
        out.truncate(BASE_MAX - 3);
        out.push_str("...");
    }
    out
}

/// `service-HASH-ns/svc/proto/port`.
pub fn service_chain(port: &ServicePort) -> String {
    format!("{SERVICE_PREFIX}{}", hashed(&port_path(port)))
}

/// `local-HASH-ns/svc/proto/port`: the same HASH as the service chain.
pub fn local_chain(port: &ServicePort) -> String {
    format!("{LOCAL_PREFIX}{}", hashed(&port_path(port)))
}

/// `external-HASH-ns/svc/proto/port`: the same HASH as the service chain.
pub fn external_chain(port: &ServicePort) -> String {
    format!("{EXTERNAL_PREFIX}{}", hashed(&port_path(port)))
}

/// `firewall-HASH-ns/svc/proto/port`: the same HASH as the service chain.
pub fn firewall_chain(port: &ServicePort) -> String {
    format!("{FIREWALL_PREFIX}{}", hashed(&port_path(port)))
}

/// `HASH-ns/svc/proto/port__IP/PORT`, shared by an endpoint's chain and set.
fn endpoint_base(port: &ServicePort, endpoint: &Endpoint) -> String {
    hashed(&format!("{}__{}/{}", port_path(port), endpoint.addr, endpoint.port))
}

/// `endpoint-HASH-ns/svc/proto/port__IP/PORT`.
pub fn endpoint_chain(port: &ServicePort, endpoint: &Endpoint) -> String {
    format!("{ENDPOINT_PREFIX}{}", endpoint_base(port, endpoint))
}

/// `affinity-HASH-ns/svc/proto/port__IP/PORT`: the same HASH as the
/// endpoint chain (kube-proxy names both from one base).
pub fn affinity_set(port: &ServicePort, endpoint: &Endpoint) -> String {
    format!("{AFFINITY_PREFIX}{}", endpoint_base(port, endpoint))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::Protocol;

    fn port(name: &str) -> ServicePort {
        ServicePort {
            name: name.into(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(172, 30, 0, 41).into(),
            port: 80,
            node_port: None,
            endpoints: vec![],
            ..ServicePort::default()
        }
    }

    /// Names from kube-proxy's own expectations (pkg/proxy/nftables tests).
    #[test]
    fn names_match_kube_proxy() {
        let services = [
            ("ns1/svc1:p80", "service-ULMVA6XW-ns1/svc1/tcp/p80"),
            ("ns2/svc2:p80", "service-42NFTM6N-ns2/svc2/tcp/p80"),
            ("ns3/svc3:p80", "service-4AT6LBPK-ns3/svc3/tcp/p80"),
            ("ns4/svc4:p80", "service-LAUZTJTB-ns4/svc4/tcp/p80"),
            ("ns5/svc5:p80", "service-HVFWP5L3-ns5/svc5/tcp/p80"),
        ];
        for (name, want) in services {
            assert_eq!(service_chain(&port(name)), want, "{name}");
        }
        assert_eq!(
            external_chain(&port("ns2/svc2:p80")),
            "external-42NFTM6N-ns2/svc2/tcp/p80"
        );
        assert_eq!(local_chain(&port("ns2/svc2:p80")), "local-42NFTM6N-ns2/svc2/tcp/p80");
        let endpoints = [
            (
                "ns1/svc1:p80",
                [10, 180, 0, 1],
                "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80",
            ),
            (
                "ns2/svc2:p80",
                [10, 180, 0, 2],
                "endpoint-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80",
            ),
            (
                "ns3/svc3:p80",
                [10, 180, 0, 3],
                "endpoint-UEIP74TE-ns3/svc3/tcp/p80__10.180.0.3/80",
            ),
            (
                "ns4/svc4:p80",
                [10, 180, 0, 4],
                "endpoint-UNZV3OEC-ns4/svc4/tcp/p80__10.180.0.4/80",
            ),
            (
                "ns4/svc4:p80",
                [10, 180, 0, 5],
                "endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80",
            ),
            (
                "ns5/svc5:p80",
                [10, 180, 0, 3],
                "endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80",
            ),
        ];
        for (name, ip, want) in endpoints {
            let ep = Endpoint::ready(Ipv4Addr::from(ip), 80);
            assert_eq!(endpoint_chain(&port(name), &ep), want, "{name}");
        }
    }

    #[test]
    fn unnamed_ports_and_protocols() {
        let seed = port("default/nginx-service");
        assert!(service_chain(&seed).ends_with("-default/nginx-service/tcp/"));
        let udp = ServicePort {
            protocol: Protocol::Udp,
            ..port("kube-system/kube-dns:dns")
        };
        let tcp = port("kube-system/kube-dns:dns");
        assert_ne!(service_chain(&udp)[..16], service_chain(&tcp)[..16]);
        assert!(is_service_chain(&service_chain(&udp)));
        assert!(!is_service_chain(SERVICES) && !is_service_chain(MARK_MASQ));
    }

    #[test]
    fn odd_and_long_names_stay_valid_and_distinct() {
        let a = service_chain(&port("default/we ird\"name"));
        let b = service_chain(&port("default/we_ird_name"));
        assert_ne!(a, b);
        assert!(
            a.chars().all(|c| c.is_ascii_alphanumeric() || "/_.-".contains(c)),
            "{a}"
        );
        let long = format!("{}/{}:{}", "n".repeat(63), "s".repeat(200), "p".repeat(63));
        let name = endpoint_chain(&port(&long), &Endpoint::ready(Ipv4Addr::new(10, 0, 0, 1), 80));
        assert!(name.len() < 256, "{} bytes", name.len());
        assert!(name.ends_with("..."));
    }
}
