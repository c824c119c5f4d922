//! What the programs' IPv6 path does not do yet (proxy-ebpf's `ipv6`
//! module doc), said per IPv6 Service port as the field it leaves out and
//! what happens instead, for the ebpf mode's report of unhonoured fields
//! (`super::super::unhonoured`). Every case is closed or plainer, never
//! wrong: a flow that cannot be served as asked is refused or balanced at
//! random, never sent somewhere it must not go.

use crate::model::{IpFamily, ServicePort};

/// `(field, how)` for each IPv6 feature `port` asks for that the programs
/// leave out; empty for an IPv4 port.
pub fn unhonoured(port: &ServicePort) -> Vec<(&'static str, &'static str)> {
    if port.family() != IpFamily::V6 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let external = port.node_port.is_some() || !port.external_addresses().is_empty();
    if external {
        out.push((
            "spec.ports[].nodePort",
            "the node's own IPv6 connections to its node ports and external IPs are not translated yet \
             (the socket programs are IPv4's); every other client's are",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv6Addr, time::Duration};

    use super::*;
    use crate::model::{Endpoint, LbAlgorithm, Protocol, SourceRange, TrafficPolicy};

    fn port6() -> ServicePort {
        ServicePort {
            name: "default/web:http (IPv6)".into(),
            cluster_ip: Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 1).into(),
            port: 80,
            endpoints: vec![Endpoint::ready(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 1), 8080)],
            ..ServicePort::default()
        }
    }

    fn fields(port: &ServicePort) -> Vec<&'static str> {
        unhonoured(port).into_iter().map(|(f, _)| f).collect()
    }

    #[test]
    fn a_plain_ipv6_cluster_ip_and_any_ipv4_port_lack_nothing() {
        assert!(fields(&port6()).is_empty());
        let v4 = ServicePort {
            affinity: Some(Duration::from_secs(10)),
            protocol: Protocol::Sctp,
            ..ServicePort::default()
        };
        assert!(fields(&v4).is_empty());
    }

    #[test]
    fn each_missing_feature_is_named_once() {
        let port = ServicePort {
            node_port: Some(30080),
            load_balancer_ips: vec![Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 5).into()],
            source_ranges: vec![
                SourceRange::new(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0).into(), 48).expect("range"),
            ],
            affinity: Some(Duration::from_secs(10)),
            external_policy: TrafficPolicy::Local,
            lb_algorithm: Some(LbAlgorithm::Maglev),
            ..port6()
        };
        assert_eq!(fields(&port), ["spec.ports[].nodePort"]);
        // As IPv4's: by the programs, or reported by the mode (its SCTP
        // fallback).
        let sctp = ServicePort {
            protocol: Protocol::Sctp,
            ..port6()
        };
        assert!(fields(&sctp).is_empty());
        // Without endpoints it is rejected as an IPv4 port is: nothing left out.
        let empty = ServicePort {
            endpoints: Vec::new(),
            ..port6()
        };
        assert!(fields(&empty).is_empty());
    }
}
