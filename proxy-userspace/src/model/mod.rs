//! The desired state every data-plane mode programs: Service ports and their
//! endpoints, already filtered and resolved (targetPort -> number).
//!
//! `service` and `endpoint` turn API objects into plain facts, `desired`
//! keeps those facts per object and joins them into [`ServicePort`]s.

mod desired;
pub mod endpoint;
pub mod service;

use std::{fmt, net::Ipv4Addr};

pub use desired::{Cluster, Desired, ObjectKey, object_key};

/// An object (or a part of one) that was skipped, and why. Logged and counted
/// by whoever feeds the model; the rest of the state is programmed as usual.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub object: String,
    pub reason: String,
}

impl Problem {
    pub fn new(object: &str, reason: impl Into<String>) -> Self {
        Self {
            object: object.to_owned(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

impl Protocol {
    /// IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::proto::TCP,
            Protocol::Udp => proxy_common::proto::UDP,
        }
    }
}

/// One port of one Service, with the endpoints that serve it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// `namespace/name:portname`, as kube-proxy names it in logs and comments.
    pub name: String,
    pub protocol: Protocol,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    /// Set for NodePort (and LoadBalancer) Services.
    pub node_port: Option<u16>,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    pub addr: Ipv4Addr,
    /// The resolved targetPort.
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
}

impl Endpoint {
    /// A ready endpoint on no particular node (what tests and manifests without
    /// conditions mean).
    pub fn ready(addr: Ipv4Addr, port: u16) -> Self {
        Self {
            addr,
            port,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
        }
    }
}
