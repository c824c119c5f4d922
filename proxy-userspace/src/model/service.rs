//! Service objects -> the ports xproxy programs, with kube-proxy's filters.
//!
//! Hostile or unsupported input never stops the whole sync: a bad Service or
//! port is skipped with a [`Problem`] that the caller logs and counts.

use std::{collections::BTreeSet, net::Ipv4Addr};

use k8s_openapi::api::core::v1::Service;

use super::{Problem, Protocol, TrafficPolicy};

/// Services carrying this label belong to another proxy (kube-proxy skips them too).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";

/// One port of a Service, before endpoints are attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    /// The port's name in the Service ("" for a single unnamed port);
    /// EndpointSlice ports are matched to it by this name.
    pub port_name: String,
    pub protocol: Protocol,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    pub node_port: Option<u16>,
    /// `Cluster` unless the Service is reachable from outside (NodePort,
    /// LoadBalancer) and asks for `Local`.
    pub external_policy: TrafficPolicy,
    pub internal_policy: TrafficPolicy,
}

/// What a Service contributes to the desired state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    pub ports: Vec<PortSpec>,
}

/// Why a whole Service is left out. Not every skip is a problem: headless
/// and ExternalName Services simply have nothing to proxy.
#[derive(Debug, PartialEq, Eq)]
pub enum Skip {
    NotProxied(&'static str),
    Invalid(Problem),
}

/// Reads the ports of `svc` that xproxy programs. Problems with single ports
/// are returned alongside the ports that are fine.
pub fn service_info(svc: &Service) -> Result<(ServiceInfo, Vec<Problem>), Skip> {
    let object = object_name(svc);
    if svc
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL))
    {
        return Err(Skip::NotProxied("labelled for another service proxy"));
    }
    let spec = svc.spec.as_ref().ok_or(Skip::NotProxied("no spec"))?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return Err(Skip::NotProxied("ExternalName"));
    }
    let cluster_ip = match spec.cluster_ip.as_deref() {
        Some("None") => return Err(Skip::NotProxied("headless")),
        // The API server always allocates one; only a hand-written manifest lacks it.
        None | Some("") => {
            return Err(Skip::Invalid(Problem::new(
                &object,
                "no clusterIP (set spec.clusterIP in manifests)",
            )));
        }
        Some(ip) => ip,
    };
    let cluster_ip = match cluster_ip.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) => ip,
        Ok(std::net::IpAddr::V6(_)) => return Err(Skip::NotProxied("IPv6 ClusterIP (IPv4 only for now)")),
        Err(_) => {
            return Err(Skip::Invalid(Problem::new(
                &object,
                format!("clusterIP {cluster_ip:?} is not an IP address"),
            )));
        }
    };

    let mut problems = Vec::new();
    let (external_policy, internal_policy) = traffic_policies(spec, &object, &mut problems);
    let mut ports = Vec::new();
    let mut seen = BTreeSet::new();
    for p in spec.ports.iter().flatten() {
        let port_name = p.name.clone().unwrap_or_default();
        let what = format!("{object} port {port_name:?}");
        let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            other => {
                problems.push(Problem::new(&what, format!("protocol {other} is not supported")));
                continue;
            }
        };
        let Some(port) = valid_port(p.port) else {
            problems.push(Problem::new(&what, format!("port {} is out of range 1-65535", p.port)));
            continue;
        };
        let node_port = match p.node_port {
            None | Some(0) => None,
            Some(n) => match valid_port(n) {
                Some(n) => Some(n),
                None => {
                    problems.push(Problem::new(&what, format!("nodePort {n} is out of range 1-65535")));
                    continue;
                }
            },
        };
        if !seen.insert((port, protocol)) {
            problems.push(Problem::new(&what, format!("duplicate port {port}/{protocol:?}")));
            continue;
        }
        ports.push(PortSpec {
            port_name,
            protocol,
            cluster_ip,
            port,
            node_port,
            external_policy,
            internal_policy,
        });
    }
    Ok((ServiceInfo { ports }, problems))
}

/// `(external, internal)` traffic policy of a Service, as kube-proxy reads
/// them: the external one counts only for Services reachable from outside
/// the cluster. A value the API server would refuse is a problem and taken
/// as `Cluster`.
fn traffic_policies(
    spec: &k8s_openapi::api::core::v1::ServiceSpec,
    object: &str,
    problems: &mut Vec<Problem>,
) -> (TrafficPolicy, TrafficPolicy) {
    let mut policy = |field: &str, value: Option<&str>| match value {
        None | Some("Cluster") => TrafficPolicy::Cluster,
        Some("Local") => TrafficPolicy::Local,
        Some(other) => {
            problems.push(Problem::new(
                object,
                format!("{field} {other:?} is neither Cluster nor Local; using Cluster"),
            ));
            TrafficPolicy::Cluster
        }
    };
    let external = policy("externalTrafficPolicy", spec.external_traffic_policy.as_deref());
    let internal = policy("internalTrafficPolicy", spec.internal_traffic_policy.as_deref());
    let reachable_from_outside = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let external = if reachable_from_outside {
        external
    } else {
        TrafficPolicy::Cluster
    };
    (external, internal)
}

pub fn valid_port(port: i32) -> Option<u16> {
    u16::try_from(port).ok().filter(|p| *p != 0)
}

fn object_name(svc: &Service) -> String {
    format!(
        "Service {}/{}",
        svc.metadata.namespace.as_deref().unwrap_or("default"),
        svc.metadata.name.as_deref().unwrap_or("")
    )
}
