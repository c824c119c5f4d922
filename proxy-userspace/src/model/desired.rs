//! The objects the sources delivered, converted, and the desired state
//! joined from them.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::{
    Endpoint, Problem, ServicePort,
    endpoint::{SliceInfo, slice_info},
    service::{ServiceInfo, Skip, service_info},
};

/// (namespace, name) of an object.
pub type ObjectKey = (String, String);

/// The Services and EndpointSlices known now, one entry per object, so an
/// update replaces exactly what the object said before.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    services: BTreeMap<ObjectKey, ServiceInfo>,
    slices: BTreeMap<ObjectKey, SliceInfo>,
}

/// Service ports by name (`namespace/service:port`), plus what was left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub ports: BTreeMap<String, ServicePort>,
    pub problems: Vec<Problem>,
}

pub fn object_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjectKey {
    (
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

impl Cluster {
    /// Adds or replaces a Service; returns what was wrong with it.
    pub fn upsert_service(&mut self, svc: &Service) -> Vec<Problem> {
        let key = object_key(&svc.metadata);
        match service_info(svc) {
            Ok((info, problems)) => {
                self.services.insert(key, info);
                problems
            }
            Err(skip) => {
                self.services.remove(&key);
                match skip {
                    Skip::NotProxied(_) => vec![],
                    Skip::Invalid(problem) => vec![problem],
                }
            }
        }
    }

    pub fn delete_service(&mut self, key: &ObjectKey) {
        self.services.remove(key);
    }

    /// Replaces every Service at once (a relist): objects missing from
    /// `all` were deleted while nobody was watching.
    pub fn replace_services(&mut self, all: &[Service]) -> Vec<Problem> {
        self.services.clear();
        all.iter().flat_map(|svc| self.upsert_service(svc)).collect()
    }

    pub fn upsert_slice(&mut self, slice: &EndpointSlice) -> Vec<Problem> {
        let key = object_key(&slice.metadata);
        let (info, problems) = slice_info(slice);
        match info {
            Some(info) => self.slices.insert(key, info),
            None => self.slices.remove(&key),
        };
        problems
    }

    pub fn delete_slice(&mut self, key: &ObjectKey) {
        self.slices.remove(key);
    }

    pub fn replace_slices(&mut self, all: &[EndpointSlice]) -> Vec<Problem> {
        self.slices.clear();
        all.iter().flat_map(|slice| self.upsert_slice(slice)).collect()
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// Joins Services with their EndpointSlices into Service ports.
    pub fn desired(&self) -> Desired {
        let mut slices_of: BTreeMap<ObjectKey, Vec<&SliceInfo>> = BTreeMap::new();
        for ((ns, _), slice) in &self.slices {
            slices_of
                .entry((ns.clone(), slice.service.clone()))
                .or_default()
                .push(slice);
        }
        let mut desired = Desired::default();
        let mut frontends = BTreeSet::new();
        for (key, info) in &self.services {
            let slices = slices_of.get(key).map(Vec::as_slice).unwrap_or_default();
            for spec in &info.ports {
                let name = port_name(key, &spec.port_name);
                // Two Services cannot share a ClusterIP:port; the API server
                // prevents it, a hand-written manifest may not.
                if !frontends.insert((spec.cluster_ip, spec.port, spec.protocol)) {
                    desired.problems.push(Problem::new(
                        &name,
                        format!(
                            "{}:{}/{} is already used by another Service",
                            spec.cluster_ip, spec.port, spec.protocol
                        ),
                    ));
                    continue;
                }
                let port = ServicePort {
                    name: name.clone(),
                    protocol: spec.protocol,
                    cluster_ip: spec.cluster_ip,
                    port: spec.port,
                    node_port: spec.node_port,
                    endpoints: endpoints_for(slices, &spec.port_name, spec.protocol),
                    external_policy: spec.external_policy,
                    internal_policy: spec.internal_policy,
                };
                desired.ports.insert(name, port);
            }
        }
        desired
    }
}

/// kube-proxy's ServicePortName: `namespace/name`, then `:port` if named.
fn port_name((ns, name): &ObjectKey, port: &str) -> String {
    if port.is_empty() {
        format!("{ns}/{name}")
    } else {
        format!("{ns}/{name}:{port}")
    }
}

/// Endpoints of all slices that offer the named port, one per address and
/// port (a pod listed by two slices during a rollout counts once, ready wins).
fn endpoints_for(slices: &[&SliceInfo], port_name: &str, protocol: super::Protocol) -> Vec<Endpoint> {
    let mut by_addr: BTreeMap<(std::net::Ipv4Addr, u16), Endpoint> = BTreeMap::new();
    for slice in slices {
        let Some(port) = slice
            .ports
            .iter()
            .find(|p| p.name == port_name && p.protocol == protocol)
        else {
            continue;
        };
        for ep in &slice.endpoints {
            let ep = Endpoint {
                port: port.port,
                ..ep.clone()
            };
            by_addr
                .entry((ep.addr, ep.port))
                .and_modify(|old| {
                    if ep.ready && !old.ready {
                        *old = ep.clone();
                    }
                })
                .or_insert(ep);
        }
    }
    by_addr.into_values().collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use serde_json::json;

    use super::*;
    use crate::model::Protocol;

    fn service(name: &str, spec: serde_json::Value) -> Service {
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": "default"}, "spec": spec})).unwrap()
    }

    fn slice(name: &str, service: &str, ports: serde_json::Value, endpoints: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": ports, "endpoints": endpoints,
        }))
        .unwrap()
    }

    fn seed() -> Cluster {
        let mut cluster = Cluster::default();
        let svc = service(
            "nginx-service",
            json!({"type": "NodePort", "clusterIP": "10.96.0.10",
                   "ports": [{"port": 88, "targetPort": 80, "nodePort": 30791}]}),
        );
        assert!(cluster.upsert_service(&svc).is_empty());
        let eps = json!([
            {"addresses": ["10.244.0.11"], "nodeName": "node-1"},
            {"addresses": ["10.244.0.12"], "conditions": {"ready": true}},
            {"addresses": ["10.244.0.13"], "conditions": {"ready": false, "serving": true, "terminating": true}},
        ]);
        assert!(
            cluster
                .upsert_slice(&slice("nginx-abc", "nginx-service", json!([{"port": 80}]), eps))
                .is_empty()
        );
        cluster
    }

    #[test]
    fn seed_service_joins_its_slice() {
        let desired = seed().desired();
        assert!(desired.problems.is_empty());
        let port = &desired.ports["default/nginx-service"];
        assert_eq!(
            (port.cluster_ip, port.port, port.node_port),
            (Ipv4Addr::new(10, 96, 0, 10), 88, Some(30791))
        );
        assert_eq!(port.protocol, Protocol::Tcp);
        let eps: Vec<_> = port
            .endpoints
            .iter()
            .map(|e| (e.addr.octets()[3], e.port, e.ready, e.terminating))
            .collect();
        assert_eq!(
            eps,
            vec![(11, 80, true, false), (12, 80, true, false), (13, 80, false, true)]
        );
        assert_eq!(port.endpoints[0].node_name.as_deref(), Some("node-1"));
    }

    #[test]
    fn headless_external_name_and_foreign_proxy_services_are_skipped_quietly() {
        let mut cluster = Cluster::default();
        let headless = service("h", json!({"clusterIP": "None", "ports": [{"port": 80}]}));
        let external = service("e", json!({"type": "ExternalName", "externalName": "example.com"}));
        let mut foreign = service("f", json!({"clusterIP": "10.96.0.5", "ports": [{"port": 80}]}));
        foreign.metadata.labels =
            Some([(crate::model::service::SERVICE_PROXY_NAME_LABEL.into(), "other".into())].into());
        for svc in [headless, external, foreign] {
            assert!(cluster.upsert_service(&svc).is_empty());
        }
        assert!(cluster.desired().ports.is_empty());
    }

    #[test]
    fn hostile_ports_are_skipped_with_a_problem_and_the_rest_kept() {
        let mut cluster = Cluster::default();
        let svc = service(
            "bad",
            json!({"clusterIP": "10.96.0.7", "ports": [
                {"name": "zero", "port": 0}, {"name": "huge", "port": 70000},
                {"name": "ok", "port": 8080}, {"name": "dup", "port": 8080},
                {"name": "badnode", "port": 9090, "nodePort": 70000},
                {"name": "sctp", "port": 7000, "protocol": "SCTP"}]}),
        );
        let problems = cluster.upsert_service(&svc);
        let reasons: Vec<_> = problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(problems.len(), 5, "{reasons:#?}");
        assert!(reasons.iter().any(|r| r.contains("port 70000 is out of range")));
        assert!(reasons.iter().any(|r| r.contains("duplicate port 8080")));
        let names: Vec<_> = cluster.desired().ports.into_keys().collect();
        assert_eq!(names, vec!["default/bad:ok".to_string()]);
    }

    #[test]
    fn invalid_cluster_ip_and_endpoint_addresses_are_problems() {
        let mut cluster = Cluster::default();
        let problems = cluster.upsert_service(&service(
            "x",
            json!({"clusterIP": "10.96.0.300", "ports": [{"port": 80}]}),
        ));
        assert_eq!(problems.len(), 1);
        assert!(problems[0].reason.contains("not an IP address"));
        let problems = cluster.upsert_slice(&slice(
            "x-1",
            "x",
            json!([{"port": 80}]),
            json!([{"addresses": ["not-an-ip"]}, {"addresses": ["10.0.0.1"]}]),
        ));
        assert_eq!(problems.len(), 1);
    }

    #[test]
    fn two_services_claiming_one_frontend_keep_the_first() {
        let mut cluster = Cluster::default();
        cluster.upsert_service(&service(
            "a",
            json!({"clusterIP": "10.96.0.9", "ports": [{"port": 80}]}),
        ));
        cluster.upsert_service(&service(
            "b",
            json!({"clusterIP": "10.96.0.9", "ports": [{"port": 80}]}),
        ));
        let desired = cluster.desired();
        assert_eq!(desired.ports.keys().collect::<Vec<_>>(), vec!["default/a"]);
        assert_eq!(desired.problems.len(), 1);
    }

    #[test]
    fn slices_merge_and_a_relist_forgets_deleted_objects() {
        let mut cluster = seed();
        cluster.upsert_slice(&slice(
            "nginx-def",
            "nginx-service",
            json!([{"port": 80}]),
            json!([{"addresses": ["10.244.0.14"]}, {"addresses": ["10.244.0.11"]}]),
        ));
        assert_eq!(cluster.desired().ports["default/nginx-service"].endpoints.len(), 4);
        cluster.replace_slices(&[]);
        assert!(cluster.desired().ports["default/nginx-service"].endpoints.is_empty());
        cluster.replace_services(&[]);
        assert!(cluster.desired().ports.is_empty());
    }

    #[test]
    fn named_ports_match_slice_ports_by_name_and_protocol() {
        let mut cluster = Cluster::default();
        cluster.upsert_service(&service(
            "dns",
            json!({"clusterIP": "10.96.0.53", "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}),
        ));
        cluster.upsert_slice(&slice(
            "dns-1",
            "dns",
            json!([{"name": "dns", "port": 5353, "protocol": "UDP"}, {"name": "dns-tcp", "port": 5354, "protocol": "TCP"}]),
            json!([{"addresses": ["10.244.0.20"]}]),
        ));
        let desired = cluster.desired();
        assert_eq!(desired.ports["default/dns:dns"].endpoints[0].port, 5353);
        assert_eq!(desired.ports["default/dns:dns-tcp"].endpoints[0].port, 5354);
    }

    #[test]
    fn traffic_policies_are_read_and_the_external_one_only_where_it_counts() {
        use crate::model::TrafficPolicy::{Cluster as C, Local as L};
        let mut cluster = Cluster::default();
        let cases = [
            (
                "np-local",
                json!({"type": "NodePort", "externalTrafficPolicy": "Local"}),
                (L, C),
            ),
            (
                "lb-local",
                json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local"}),
                (L, L),
            ),
            // The API server refuses eTP on a ClusterIP Service; a manifest may not.
            (
                "cip",
                json!({"externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local"}),
                (C, L),
            ),
            ("defaults", json!({"type": "NodePort"}), (C, C)),
        ];
        for (i, (name, mut spec, _)) in cases.clone().into_iter().enumerate() {
            spec["clusterIP"] = json!(format!("10.96.0.{}", 100 + i));
            let node_port = if spec.get("type").is_some() {
                json!(30100 + i)
            } else {
                json!(null)
            };
            spec["ports"] = json!([{"port": 80, "nodePort": node_port}]);
            assert!(cluster.upsert_service(&service(name, spec)).is_empty(), "{name}");
        }
        let desired = cluster.desired();
        for (name, _, (external, internal)) in cases {
            let port = &desired.ports[&format!("default/{name}")];
            assert_eq!(
                (port.external_policy, port.internal_policy),
                (external, internal),
                "{name}"
            );
        }

        let problems = cluster.upsert_service(&service(
            "typo",
            json!({"type": "NodePort", "clusterIP": "10.96.0.120", "externalTrafficPolicy": "Locale",
                   "ports": [{"port": 80, "nodePort": 30120}]}),
        ));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].reason.contains("\"Locale\""), "{}", problems[0]);
        assert_eq!(cluster.desired().ports["default/typo"].external_policy, C);
    }
}
