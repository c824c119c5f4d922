//! EndpointSlice objects -> the endpoints of a Service's ports.

use std::{net::IpAddr, sync::Arc};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{Endpoint, Hints, IpFamily, Problem, Protocol, service::valid_port};

/// The label naming the Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// One port an EndpointSlice offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    /// Matches the Service port's name.
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// What an EndpointSlice contributes: endpoints listening on `ports`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceInfo {
    /// Name of the owning Service (same namespace).
    pub service: String,
    /// `addressType`: every endpoint's address is of this family.
    pub family: IpFamily,
    pub ports: Vec<SlicePort>,
    /// Endpoints with `port` left 0: each slice port gives the real one.
    pub endpoints: Vec<Endpoint>,
}

/// An endpoint's topology hints; `None` if it names no zone and no node.
fn hints(hints: &k8s_openapi::api::discovery::v1::EndpointHints) -> Option<Arc<Hints>> {
    let names = |names: Vec<&String>| -> Vec<Arc<str>> { names.into_iter().map(|n| Arc::from(n.as_str())).collect() };
    let zones = names(hints.for_zones.iter().flatten().map(|z| &z.name).collect());
    let nodes = names(hints.for_nodes.iter().flatten().map(|n| &n.name).collect());
    (!zones.is_empty() || !nodes.is_empty()).then(|| Arc::new(Hints { zones, nodes }))
}

/// Reads an EndpointSlice. `None` for slices xproxy does not use (no
/// owning Service, FQDN addresses); problems are returned for the
/// parts that were skipped.
pub fn slice_info(slice: &EndpointSlice) -> (Option<SliceInfo>, Vec<Problem>) {
    // Only a slice with a problem needs its name spelled out.
    let object = || {
        format!(
            "EndpointSlice {}/{}",
            slice.metadata.namespace.as_deref().unwrap_or("default"),
            slice.metadata.name.as_deref().unwrap_or("")
        )
    };
    let Some(service) = slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)) else {
        return (None, vec![]);
    };
    let family = match slice.address_type.as_str() {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        // FQDN slices are for other consumers; kube-proxy skips them too.
        _ => return (None, vec![]),
    };
    let mut problems = Vec::new();
    let mut ports = Vec::new();
    for p in slice.ports.iter().flatten() {
        let name = p.name.clone().unwrap_or_default();
        let Some(protocol) = Protocol::from_api(p.protocol.as_deref().unwrap_or("TCP")) else {
            continue;
        };
        match p.port.and_then(valid_port) {
            Some(port) => ports.push(SlicePort { name, protocol, port }),
            None => problems.push(Problem::new(
                &object(),
                format!("port {name:?} has no valid port number ({:?})", p.port),
            )),
        }
    }
    let mut endpoints = Vec::new();
    for ep in slice.endpoints.iter().flatten() {
        // kube-proxy uses the first address of an endpoint.
        let Some(addr) = ep.addresses.first() else { continue };
        let Some(addr) = addr.parse::<IpAddr>().ok().filter(|a| IpFamily::of(*a) == family) else {
            problems.push(Problem::new(
                &object(),
                format!("address {addr:?} is not an {} address", family.name()),
            ));
            continue;
        };
        let conditions = ep.conditions.as_ref();
        // Unset conditions mean ready/serving and not terminating (API defaults).
        let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
        let serving = conditions.and_then(|c| c.serving).unwrap_or(ready);
        let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
        endpoints.push(Endpoint {
            addr,
            port: 0,
            ready,
            serving,
            terminating,
            node_name: ep.node_name.as_deref().map(Arc::from),
            zone: ep.zone.as_deref().map(Arc::from),
            hints: ep.hints.as_ref().and_then(hints),
        });
    }
    (
        Some(SliceInfo {
            service: service.clone(),
            family,
            ports,
            endpoints,
        }),
        problems,
    )
}
