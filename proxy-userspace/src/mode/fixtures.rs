//! Service ports and configuration the modes' unit tests share.

use std::net::{IpAddr, Ipv4Addr};

use crate::{
    config::{Cidr, Config, Environment, RunFlags, resolve},
    model::{Endpoint, Protocol, ServicePort},
};

/// kube-proxy's defaults for the node `node`, no node IP known.
pub fn default_config() -> Config {
    let env = Environment {
        kubeconfig: None,
        hostname: Some("node".into()),
    };
    resolve(&RunFlags::default(), None, &env).expect("resolve").config
}

/// A port of `default/NAME` on 10.96.1.IP:80 with ready endpoints
/// `(last octet, node)`: 10.244.1.x on node-a, 10.244.2.x on node-b.
pub fn policy_port(name: &str, ip: u8, node_port: Option<u16>, endpoints: &[(u8, &str)]) -> ServicePort {
    ServicePort {
        name: format!("default/{name}"),
        cluster_ip: Ipv4Addr::new(10, 96, 1, ip).into(),
        port: 80,
        node_port,
        endpoints: endpoints
            .iter()
            .map(|(last, node)| {
                let subnet = if *node == "node-a" { 1 } else { 2 };
                Endpoint {
                    node_name: Some((*node).into()),
                    ..Endpoint::ready(Ipv4Addr::new(10, 244, subnet, *last), 8080)
                }
            })
            .collect(),
        ..ServicePort::default()
    }
}

/// The seed Service's port: `default/nginx-service`, TCP
/// 10.96.0.88:88, NodePort 30791, with `endpoints`.
pub fn seed_port(endpoints: Vec<Endpoint>) -> ServicePort {
    ServicePort {
        name: "default/nginx-service".into(),
        protocol: Protocol::Tcp,
        cluster_ip: Ipv4Addr::new(10, 96, 0, 88).into(),
        port: 88,
        node_port: Some(30791),
        endpoints,
        ..ServicePort::default()
    }
}

pub fn cidr(text: &str) -> Cidr {
    text.parse().expect("cidr")
}

pub fn ips(texts: &[&str]) -> Vec<IpAddr> {
    texts.iter().map(|t| t.parse().expect("an address")).collect()
}
