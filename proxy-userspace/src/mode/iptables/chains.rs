//! Chain names: kube-proxy's fixed chains and the per-service ones, named
//! the way kube-proxy names them so that `iptables-save` reads the same and
//! tooling written for kube-proxy keeps working.
//!
//! A per-service chain is a prefix plus the first 16 characters of the
//! standard (RFC 4648) base32 form of SHA-256 over
//! `"<namespace>/<service>[:<port name>]" + "<protocol, lowercase>"`, with
//! `"<endpoint ip>:<port>"` appended for an endpoint chain. 16 base32
//! characters are 80 bits: the names stay within iptables' 28-character
//! limit and never collide in practice.

use sha2::{Digest, Sha256};

use crate::model::{Endpoint, Protocol, ServicePort};

/// nat and filter: the entry chain for Service traffic.
pub const SERVICES: &str = "KUBE-SERVICES";
/// filter: rejects external traffic (NodePorts, external and load
/// balancer IPs) of Services without endpoints.
pub const EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
/// nat: NodePort dispatch; filter: accepts health-check node ports.
pub const NODE_PORTS: &str = "KUBE-NODEPORTS";
/// nat: masquerades packets carrying the mark, clears the mark.
pub const POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: sets the masquerade mark.
pub const MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// filter: accepts forwarded Service traffic despite a DROP policy.
pub const FORWARD: &str = "KUBE-FORWARD";
/// filter: drops martian packets to 127.0.0.0/8 when NodePorts answer on
/// localhost (`route_localnet=1`).
pub const FIREWALL: &str = "KUBE-FIREWALL";
/// filter: drops what a `KUBE-FW-` chain let through without a DNAT (load
/// balancer traffic from outside `loadBalancerSourceRanges`).
pub const PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";

/// Per service port: dispatch to the endpoints (`Cluster` traffic policy).
pub const SVC_PREFIX: &str = "KUBE-SVC-";
/// Per service port: dispatch to this node's endpoints (`Local` traffic policy).
pub const SVL_PREFIX: &str = "KUBE-SVL-";
/// Per service port: external traffic (NodePort): marked for masquerade
/// (`Cluster` policy) or kept apart by origin (`Local`).
pub const EXT_PREFIX: &str = "KUBE-EXT-";
/// Per endpoint of a service port: the DNAT.
pub const SEP_PREFIX: &str = "KUBE-SEP-";
/// Per service port with `loadBalancerSourceRanges`: load balancer
/// traffic from the allowed ranges goes on to `KUBE-EXT-`.
pub const FW_PREFIX: &str = "KUBE-FW-";

/// Every fixed chain xproxy's iptables mode may create, by table.
pub const NAT_CHAINS: [&str; 4] = [SERVICES, NODE_PORTS, POSTROUTING, MARK_MASQ];
pub const FILTER_CHAINS: [&str; 6] = [
    NODE_PORTS,
    SERVICES,
    EXTERNAL_SERVICES,
    FORWARD,
    PROXY_FIREWALL,
    FIREWALL,
];

/// Whether `chain` is a per-service chain (of xproxy or kube-proxy): one
/// found in the kernel but not wanted is stale and deleted.
pub fn is_service_chain(chain: &str) -> bool {
    [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX]
        .into_iter()
        .any(|prefix| chain.starts_with(prefix))
}

/// Whether `chain` in `table` belongs to the iptables mode (a fixed chain
/// or a per-service one); everything else is left alone.
pub fn is_ours(table: &str, chain: &str) -> bool {
    match table {
        "nat" => NAT_CHAINS.contains(&chain) || is_service_chain(chain),
        "filter" => FILTER_CHAINS.contains(&chain),
        _ => false,
    }
}

fn hash16(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let mut encoded = data_encoding::BASE32.encode(&digest);
    encoded.truncate(16);
    encoded
}

/// `KUBE-SVC-…` of a service port (`name` as in [`ServicePort::name`]).
pub fn svc_chain(name: &str, protocol: Protocol) -> String {
    format!("{SVC_PREFIX}{}", hash16(&format!("{name}{}", protocol.lowercase())))
}

/// `KUBE-SVL-…`: the same hash as the service's `KUBE-SVC-` chain.
pub fn svl_chain(name: &str, protocol: Protocol) -> String {
    format!("{SVL_PREFIX}{}", hash16(&format!("{name}{}", protocol.lowercase())))
}

/// `KUBE-EXT-…`: the same hash as the service's `KUBE-SVC-` chain.
pub fn ext_chain(name: &str, protocol: Protocol) -> String {
    format!("{EXT_PREFIX}{}", hash16(&format!("{name}{}", protocol.lowercase())))
}

/// `KUBE-FW-…`: the same hash as the service's `KUBE-SVC-` chain.
pub fn fw_chain(name: &str, protocol: Protocol) -> String {
    format!("{FW_PREFIX}{}", hash16(&format!("{name}{}", protocol.lowercase())))
}

/// `KUBE-SEP-…` of one endpoint (`ip:port`) of a service port.
pub fn sep_chain(name: &str, protocol: Protocol, endpoint: &str) -> String {
    format!(
        "{SEP_PREFIX}{}",
        hash16(&format!("{name}{}{endpoint}", protocol.lowercase()))
    )
}

/// The names of one service port's chains.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortChains {
    pub svc: String,
    pub svl: String,
    pub ext: String,
    pub fw: String,
}

impl PortChains {
    pub fn of(port: &ServicePort) -> Self {
        Self {
            svc: svc_chain(&port.name, port.protocol),
            svl: svl_chain(&port.name, port.protocol),
            ext: ext_chain(&port.name, port.protocol),
            fw: fw_chain(&port.name, port.protocol),
        }
    }
}

/// `ip:port` (`[ip]:port` for IPv6), as kube-proxy writes an endpoint
/// (Go's `net.JoinHostPort`: in hashes, comments and DNAT).
pub fn endpoint_string(ep: &Endpoint) -> String {
    std::net::SocketAddr::new(ep.addr, ep.port).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chain names from kube-proxy's own expectations
    /// (`TestOverallIPTablesRules` in pkg/proxy/iptables/proxier_test.go).
    #[test]
    fn names_match_kube_proxy() {
        let cases = [
            ("ns1/svc1:p80", "KUBE-SVC-XPGD46QRK7WJZT7O"),
            ("ns2/svc2:p80", "KUBE-SVC-GNZBNJ2PO5MGZ6GT"),
            ("ns3/svc3:p80", "KUBE-SVC-X27LE4BHSL4DOUIK"),
            ("ns4/svc4:p80", "KUBE-SVC-4SW47YFZTEDKD3PK"),
            ("ns5/svc5:p80", "KUBE-SVC-NUKIZ6OKUXPJNT4C"),
        ];
        for (name, want) in cases {
            assert_eq!(svc_chain(name, Protocol::Tcp), want, "{name}");
        }
        assert_eq!(ext_chain("ns2/svc2:p80", Protocol::Tcp), "KUBE-EXT-GNZBNJ2PO5MGZ6GT");
        assert_eq!(svl_chain("ns2/svc2:p80", Protocol::Tcp), "KUBE-SVL-GNZBNJ2PO5MGZ6GT");
        assert_eq!(fw_chain("ns2/svc2:p80", Protocol::Tcp), "KUBE-FW-GNZBNJ2PO5MGZ6GT");
        let seps = [
            ("ns1/svc1:p80", "10.180.0.1:80", "KUBE-SEP-SXIVWICOYRO3J4NJ"),
            ("ns2/svc2:p80", "10.180.0.2:80", "KUBE-SEP-RS4RBKLTHTF2IUXJ"),
            ("ns3/svc3:p80", "10.180.0.3:80", "KUBE-SEP-OYPFS5VJICHGATKP"),
            ("ns4/svc4:p80", "10.180.0.4:80", "KUBE-SEP-UKSFD7AGPMPPLUHC"),
            ("ns4/svc4:p80", "10.180.0.5:80", "KUBE-SEP-C6EBXVWJJZMIWKLZ"),
            ("ns5/svc5:p80", "10.180.0.3:80", "KUBE-SEP-I77PXRDZVX7PMWMN"),
        ];
        for (name, endpoint, want) in seps {
            assert_eq!(sep_chain(name, Protocol::Tcp, endpoint), want, "{name} {endpoint}");
        }
    }

    /// The protocol is part of the hash: a TCP and a UDP port of the same
    /// name (DNS) get different chains.
    #[test]
    fn protocol_changes_the_name() {
        let tcp = svc_chain("kube-system/kube-dns:dns", Protocol::Tcp);
        let udp = svc_chain("kube-system/kube-dns:dns", Protocol::Udp);
        assert_ne!(tcp, udp);
        for name in [&tcp, &udp] {
            assert_eq!(name.len(), "KUBE-SVC-".len() + 16);
            assert!(name.len() <= 28, "{name} is too long for iptables");
        }
    }

    #[test]
    fn ownership() {
        assert!(is_service_chain("KUBE-SVC-XPGD46QRK7WJZT7O"));
        assert!(is_service_chain("KUBE-SVL-XPGD46QRK7WJZT7O"));
        assert!(is_service_chain("KUBE-FW-XPGD46QRK7WJZT7O"));
        assert!(!is_service_chain("KUBE-SERVICES"));
        assert!(is_ours("nat", "KUBE-MARK-MASQ"));
        assert!(is_ours("nat", "KUBE-SEP-SXIVWICOYRO3J4NJ"));
        assert!(!is_ours("nat", "KUBE-KUBELET-CANARY"));
        assert!(!is_ours("nat", "DOCKER"));
        assert!(is_ours("filter", "KUBE-EXTERNAL-SERVICES"));
        assert!(is_ours("filter", "KUBE-PROXY-FIREWALL"));
        assert!(!is_ours("filter", "KUBE-SEP-SXIVWICOYRO3J4NJ"));
        assert!(!is_ours("mangle", "KUBE-SERVICES"));
    }
}
