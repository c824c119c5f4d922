//! The API objects the beds serve, built here once: the seed Service
//! (examples/seed/manifests/nginx.yaml: `nginx-service`, port 88 -> 80,
//! NodePort 30791), the Service without endpoints beside it, their
//! EndpointSlices, the Node, and any other Service a test describes with
//! [`PortDef`]s. They are JSON, applied to the fake API server as they are
//! or written to a manifest directory as YAML ([`yaml_documents`]).
//!
//! With the feature `progs`, [`ports`] builds the same Services as the
//! agent's model has them (`ServicePort`), for the tests that program the
//! maps or render a mode's rules without the agent.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
};

use serde_json::{Value, json};

use crate::{
    probe::Protocol,
    topology::{BACKENDS, NODE_IP, NODE_IP6, TARGET_PORT, pod_ipv6},
};

#[cfg(feature = "progs")]
pub mod ports;

/// The seed Service's name, and its EndpointSlice's.
pub const SEED_NAME: &str = "nginx-service";
pub const SEED_SLICE: &str = "nginx-service-demo";
pub const SEED_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 88);
pub const SEED_PORT: u16 = 88;
pub const SEED_NODE_PORT: u16 = 30791;
/// The dual-stack seed's IPv6 ClusterIP and EndpointSlice
/// ([`seed_objects_dual_stack`]).
pub const SEED_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x88);
pub const SEED_SLICE6: &str = "nginx-service-demo-v6";
/// A Service without endpoints beside it.
pub const EMPTY_NAME: &str = "empty-service";
pub const EMPTY_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 89);
pub const EMPTY_PORT: u16 = 89;
pub const EMPTY_NODE_PORT: u16 = 30792;

/// The Node object the one-node bed's agent runs as (`--hostname-override`).
pub const NODE_NAME: &str = "xproxy-node";

/// The seed's one TCP port, as the seed manifest has it (unnamed).
pub const SEED_TCP: PortDef = PortDef::tcp(SEED_PORT, TARGET_PORT, Some(SEED_NODE_PORT));

/// One port of a Service.
#[derive(Clone, Copy, Debug)]
pub struct PortDef {
    /// Required by Kubernetes where a Service has more than one port; it
    /// ends the agent's name of the service port (`default/NAME:PORT`).
    pub name: Option<&'static str>,
    pub protocol: Protocol,
    pub port: u16,
    pub target_port: u16,
    pub node_port: Option<u16>,
}

impl PortDef {
    /// An unnamed TCP port.
    pub const fn tcp(port: u16, target_port: u16, node_port: Option<u16>) -> Self {
        Self {
            name: None,
            protocol: Protocol::Tcp,
            port,
            target_port,
            node_port,
        }
    }

    /// `port` over TCP and UDP, named `tcp_name` and `udp_name`.
    pub const fn tcp_udp(
        names: (&'static str, &'static str),
        port: u16,
        targets: (u16, u16),
        node_port: Option<u16>,
    ) -> [Self; 2] {
        [
            Self {
                name: Some(names.0),
                protocol: Protocol::Tcp,
                port,
                target_port: targets.0,
                node_port,
            },
            Self {
                name: Some(names.1),
                protocol: Protocol::Udp,
                port,
                target_port: targets.1,
                node_port,
            },
        ]
    }

    fn service_spec(&self) -> Value {
        let mut spec = json!({"port": self.port, "targetPort": self.target_port, "protocol": self.protocol.name()});
        if let Some(name) = self.name {
            spec["name"] = json!(name);
        }
        if let Some(node_port) = self.node_port {
            spec["nodePort"] = json!(node_port);
        }
        spec
    }

    fn slice_spec(&self) -> Value {
        let mut spec = json!({"port": self.target_port, "protocol": self.protocol.name()});
        if let Some(name) = self.name {
            spec["name"] = json!(name);
        }
        spec
    }
}

/// The seed's ports over TCP and UDP (`http` and `udp`), as the per-mode
/// suite serves it.
pub fn seed_tcp_udp() -> [PortDef; 2] {
    PortDef::tcp_udp(
        ("http", "udp"),
        SEED_PORT,
        (TARGET_PORT, TARGET_PORT),
        Some(SEED_NODE_PORT),
    )
}

/// kube-proxy's `spec.externalTrafficPolicy` of a NodePort Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrafficPolicy {
    Cluster,
    Local,
}

/// A Service with `ports`, labelled and selecting `app: NAME`: of type
/// NodePort if any port has a node port, else ClusterIP. `policy`, if
/// given, is its `externalTrafficPolicy` (NodePort Services only).
pub fn service_with(name: &str, cluster_ip: Ipv4Addr, ports: &[PortDef], policy: Option<TrafficPolicy>) -> Value {
    let node_port = ports.iter().any(|p| p.node_port.is_some());
    let mut spec = json!({
        "type": if node_port { "NodePort" } else { "ClusterIP" },
        "clusterIP": cluster_ip.to_string(),
        "ports": ports.iter().map(PortDef::service_spec).collect::<Vec<_>>(),
        "selector": {"app": name},
    });
    if let (true, Some(policy)) = (node_port, policy) {
        spec["externalTrafficPolicy"] = json!(match policy {
            TrafficPolicy::Cluster => "Cluster",
            TrafficPolicy::Local => "Local",
        });
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": spec,
    })
}

/// `svc` as a LoadBalancer Service whose load balancer reports `ingress`
/// (`(ip, ipMode)`).
pub fn load_balancer(mut svc: Value, ingress: &[(Ipv4Addr, Option<&str>)]) -> Value {
    svc["spec"]["type"] = json!("LoadBalancer");
    let ingress: Vec<Value> = ingress
        .iter()
        .map(|(ip, mode)| match mode {
            Some(mode) => json!({"ip": ip.to_string(), "ipMode": mode}),
            None => json!({"ip": ip.to_string()}),
        })
        .collect();
    svc["status"] = json!({"loadBalancer": {"ingress": ingress}});
    svc
}

/// A Service of type NodePort (if `node_port`) or ClusterIP, one TCP port.
pub fn service(name: &str, cluster_ip: Ipv4Addr, port: u16, target_port: u16, node_port: Option<u16>) -> Value {
    service_with(name, cluster_ip, &[PortDef::tcp(port, target_port, node_port)], None)
}

/// The EndpointSlice `name` of Service `service` with the ports of `ports`
/// (by name, targetPort) and a ready endpoint per `(address, nodeName)`.
pub fn slice_with(name: &str, service: &str, ports: &[PortDef], endpoints: &[(Ipv4Addr, &str)]) -> Value {
    let endpoints: Vec<(String, &str)> = endpoints.iter().map(|(ip, node)| (ip.to_string(), *node)).collect();
    slice_of_family("IPv4", name, service, ports, &endpoints)
}

/// [`slice_with`] for IPv6 endpoints (`addressType: IPv6`).
pub fn slice6_with(name: &str, service: &str, ports: &[PortDef], endpoints: &[(Ipv6Addr, &str)]) -> Value {
    let endpoints: Vec<(String, &str)> = endpoints.iter().map(|(ip, node)| (ip.to_string(), *node)).collect();
    slice_of_family("IPv6", name, service, ports, &endpoints)
}

fn slice_of_family(
    address_type: &str,
    name: &str,
    service: &str,
    ports: &[PortDef],
    endpoints: &[(String, &str)],
) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, node)| json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": node}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": address_type,
        "ports": ports.iter().map(PortDef::slice_spec).collect::<Vec<_>>(),
        "endpoints": endpoints,
    })
}

/// An EndpointSlice of Service `service`: ready endpoints `ips` of the
/// one-node bed's node on TCP `port`.
pub fn slice(name: &str, service: &str, port: u16, ips: &[Ipv4Addr]) -> Value {
    slice_with(name, service, &[PortDef::tcp(0, port, None)], &on_node(ips))
}

/// `(address, nodeName)` of the one-node bed's node for each of `ips`.
pub fn on_node(ips: &[Ipv4Addr]) -> Vec<(Ipv4Addr, &'static str)> {
    ips.iter().map(|ip| (*ip, NODE_NAME)).collect()
}

/// The one-node bed's backends' addresses.
pub fn backend_ips() -> Vec<Ipv4Addr> {
    BACKENDS.iter().map(|(_, ip)| *ip).collect()
}

/// The one-node bed's backends' IPv6 addresses.
pub fn backend_ips6() -> Vec<Ipv6Addr> {
    BACKENDS.iter().map(|(_, ip)| pod_ipv6(*ip)).collect()
}

/// `svc` made dual-stack, IPv4 first: `ip6` as its second ClusterIP
/// (`clusterIPs`, `ipFamilies`, `ipFamilyPolicy: RequireDualStack`, as the
/// API server fills them in).
pub fn dual_stack(mut svc: Value, ip6: Ipv6Addr) -> Value {
    let ip4 = svc["spec"]["clusterIP"].clone();
    svc["spec"]["clusterIPs"] = json!([ip4, ip6.to_string()]);
    svc["spec"]["ipFamilies"] = json!(["IPv4", "IPv6"]);
    svc["spec"]["ipFamilyPolicy"] = json!("RequireDualStack");
    svc
}

/// The Node the one-node bed's agent runs as.
pub fn node() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME}},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP.to_string()}]},
    })
}

/// [`node`] with its IPv6 address too ([`NODE_IP6`]): a dual-stack node.
pub fn node_dual_stack() -> Value {
    let mut node = node();
    if let Some(addresses) = node["status"]["addresses"].as_array_mut() {
        addresses.push(json!({"type": "InternalIP", "address": NODE_IP6.to_string()}));
    }
    node
}

/// The seed Service with `ports` (labelled and selecting `app: nginx`, as
/// the seed manifest has it) and its EndpointSlice with `endpoints`.
pub fn seed_objects_with(ports: &[PortDef], endpoints: &[(Ipv4Addr, &str)]) -> Vec<Value> {
    vec![
        with_app(service_with(SEED_NAME, SEED_CLUSTER_IP, ports, None), "nginx"),
        slice_with(SEED_SLICE, SEED_NAME, ports, endpoints),
    ]
}

/// `service` labelled and selecting `app: APP` instead of its own name.
pub fn with_app(mut service: Value, app: &str) -> Value {
    service["metadata"]["labels"] = json!({"app": app});
    service["spec"]["selector"] = json!({"app": app});
    service
}

/// The seed Service and its EndpointSlice, as the seed manifest has them:
/// one TCP port, the three backends of the one-node bed.
pub fn seed_objects() -> Vec<Value> {
    seed_objects_with(&[SEED_TCP], &on_node(&backend_ips()))
}

/// The seed as a dual-stack Service ([`dual_stack`], [`SEED_CLUSTER_IP6`])
/// with `ports`, its IPv4 EndpointSlice and an IPv6 one ([`SEED_SLICE6`]),
/// the three backends of the one-node bed in each.
pub fn seed_objects_dual_stack(ports: &[PortDef]) -> Vec<Value> {
    let mut objects = seed_objects_with(ports, &on_node(&backend_ips()));
    objects[0] = dual_stack(objects[0].clone(), SEED_CLUSTER_IP6);
    let endpoints6: Vec<(Ipv6Addr, &str)> = backend_ips6().into_iter().map(|ip| (ip, NODE_NAME)).collect();
    objects.push(slice6_with(SEED_SLICE6, SEED_NAME, ports, &endpoints6));
    objects
}

/// Block-style YAML documents (separated by `---`) for JSON objects.
pub fn yaml_documents(objects: &[Value]) -> String {
    let mut out = String::new();
    for object in objects {
        out.push_str("---\n");
        yaml_block(object, 0, &mut out);
    }
    out
}

fn yaml_block(value: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, child) in map {
                let _ = write!(out, "{pad}{}:", yaml_key(key));
                yaml_child(child, indent, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for item in items {
                let _ = write!(out, "{pad}-");
                yaml_child(item, indent, out);
            }
        }
        // Scalars, `{}` and `[]` are JSON, which is YAML (flow style).
        other => {
            let _ = writeln!(out, "{pad}{other}");
        }
    }
}

fn yaml_child(child: &Value, indent: usize, out: &mut String) {
    match child {
        Value::Object(m) if !m.is_empty() => {
            out.push('\n');
            yaml_block(child, indent + 2, out);
        }
        Value::Array(a) if !a.is_empty() => {
            out.push('\n');
            yaml_block(child, indent + 2, out);
        }
        other => {
            let _ = writeln!(out, " {other}");
        }
    }
}

fn yaml_key(key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '/' | '-' | '_'));
    if plain {
        key.to_owned()
    } else {
        Value::from(key).to_string()
    }
}

/// Writes `text` to `path` atomically (a temporary file in the same
/// directory, renamed over it) and returns the moment the rename was done.
/// The temporary name does not end in `.yaml`, so a directory watcher never
/// reads it half-written.
pub fn write_atomically(path: &std::path::Path, text: &str) -> anyhow::Result<std::time::Instant> {
    use anyhow::Context as _;
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(std::time::Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_is_the_seed_manifest() {
        let [svc, slice] = seed_objects().try_into().expect("two objects");
        assert_eq!(
            svc["spec"]["ports"],
            json!([{"port": 88, "targetPort": 80, "protocol": "TCP", "nodePort": 30791}])
        );
        assert_eq!(svc["spec"]["selector"], json!({"app": "nginx"}));
        assert_eq!(slice["ports"], json!([{"port": 80, "protocol": "TCP"}]));
        assert_eq!(slice["endpoints"].as_array().map(Vec::len), Some(3));
    }
}
