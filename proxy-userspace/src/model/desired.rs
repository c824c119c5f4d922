//! The objects the sources delivered, converted, and the desired state
//! joined from them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::SystemTime,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::{
    Endpoint, IPV6_SUFFIX, IpFamily, Problem, ServicePort,
    endpoint::{SliceInfo, slice_info},
    join::Joined,
    service::{ServiceInfo, Skip, service_info},
};

/// (namespace, name) of an object.
pub type ObjectKey = (String, String);

/// The Services and EndpointSlices known now, one entry per object, so an
/// update replaces exactly what the object said before; and the Service
/// ports joined from them, brought up to date by [`Cluster::refresh`] for
/// the Services whose objects changed since.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    services: BTreeMap<ObjectKey, ServiceInfo>,
    slices: BTreeMap<ObjectKey, SliceInfo>,
    /// The slices of each Service (a slice names its Service by label).
    slices_of: BTreeMap<ObjectKey, BTreeSet<ObjectKey>>,
    /// Services whose ports must be joined again.
    dirty: BTreeSet<ObjectKey>,
    joined: Joined,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of the slice
    /// changes not programmed yet: when the change that led to them
    /// happened (a pod became ready, ...), for kube-proxy's network
    /// programming latency.
    trigger_times: Vec<SystemTime>,
    /// This node's zone, for the endpoints' zone hints.
    node_zone: Option<Arc<str>>,
    /// The objects a list in progress has named so far (see
    /// [`crate::source::Update`]): at its end, the others are gone.
    listed_services: Option<BTreeSet<ObjectKey>>,
    listed_slices: Option<BTreeSet<ObjectKey>>,
    /// A list of every Service has ended: a Service not known now does
    /// not exist (yet).
    services_listed: bool,
}

/// The annotation the EndpointSlice controller sets to the time of the
/// change (pod, Service) that the slice's last update reflects.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

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
        self.dirty.insert(key.clone());
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
        self.dirty.insert(key.clone());
    }

    /// A list of every Service begins (a relist); one begun before and
    /// not ended is abandoned.
    pub fn begin_services_list(&mut self) {
        self.listed_services = Some(BTreeSet::new());
    }

    /// Takes in a part of the list in progress.
    pub fn list_services(&mut self, part: &[Service]) -> Vec<Problem> {
        let listed = self.listed_services.get_or_insert_default();
        listed.extend(part.iter().map(|svc| object_key(&svc.metadata)));
        part.iter().flat_map(|svc| self.upsert_service(svc)).collect()
    }

    /// Ends the list with its last objects (all of them if no list was
    /// begun): Services not listed were deleted while nobody was watching.
    pub fn replace_services(&mut self, rest: &[Service]) -> Vec<Problem> {
        let problems = self.list_services(rest);
        let listed = self.listed_services.take().unwrap_or_default();
        for key in not_listed(&self.services, &listed) {
            self.delete_service(&key);
        }
        self.services_listed = true;
        if self.listed_slices.is_some() {
            // The slices' list is still arriving: join what it brought so far.
            let with_slices: Vec<ObjectKey> = (self.dirty.iter())
                .filter(|key| self.slices_of.contains_key(*key))
                .cloned()
                .collect();
            self.join_ahead(with_slices);
        }
        problems
    }

    pub fn upsert_slice(&mut self, slice: &EndpointSlice) -> Vec<Problem> {
        let key = object_key(&slice.metadata);
        self.trigger_times.extend(trigger_time(slice));
        let (info, problems) = slice_info(slice);
        self.remove_slice(&key);
        if let Some(info) = info {
            let service = (key.0.clone(), info.service.clone());
            self.slices_of.entry(service.clone()).or_default().insert(key.clone());
            self.dirty.insert(service);
            self.slices.insert(key, info);
        }
        problems
    }

    pub fn delete_slice(&mut self, key: &ObjectKey) {
        self.remove_slice(key);
    }

    /// [`Cluster::begin_services_list`] for EndpointSlices.
    pub fn begin_slices_list(&mut self) {
        self.listed_slices = Some(BTreeSet::new());
    }

    /// [`Cluster::list_services`] for EndpointSlices; once every Service is
    /// known, the Services of the part are joined right away, while the
    /// source receives the next part, instead of all at the first sync.
    pub fn list_slices(&mut self, part: &[EndpointSlice]) -> Vec<Problem> {
        let keys: Vec<ObjectKey> = part.iter().map(|slice| object_key(&slice.metadata)).collect();
        self.listed_slices.get_or_insert_default().extend(keys.iter().cloned());
        let problems = part.iter().flat_map(|slice| self.upsert_slice(slice)).collect();
        if self.services_listed && self.listed_services.is_none() {
            let services: BTreeSet<ObjectKey> = (keys.into_iter())
                .filter_map(|key| {
                    let service = self.slices.get(&key)?.service.clone();
                    Some((key.0, service))
                })
                .collect();
            self.join_ahead(services);
        }
        problems
    }

    /// [`Cluster::replace_services`] for EndpointSlices.
    pub fn replace_slices(&mut self, rest: &[EndpointSlice]) -> Vec<Problem> {
        let problems = self.list_slices(rest);
        let listed = self.listed_slices.take().unwrap_or_default();
        for key in not_listed(&self.slices, &listed) {
            self.remove_slice(&key);
        }
        problems
    }

    /// Forgets a slice and marks the Service it belonged to.
    fn remove_slice(&mut self, key: &ObjectKey) {
        let Some(old) = self.slices.remove(key) else { return };
        let service = (key.0.clone(), old.service);
        if let Some(slices) = self.slices_of.get_mut(&service) {
            slices.remove(key);
            if slices.is_empty() {
                self.slices_of.remove(&service);
            }
        }
        self.dirty.insert(service);
    }

    /// The trigger times of the slice changes since the last call; the
    /// agent takes them once the changes are programmed.
    pub fn take_trigger_times(&mut self) -> Vec<SystemTime> {
        std::mem::take(&mut self.trigger_times)
    }

    /// Sets this node's zone (`topology.kubernetes.io/zone` of its Node;
    /// `None`: unknown). The Services whose endpoints carry topology hints
    /// are joined again; returns whether there are any.
    pub fn set_node_zone(&mut self, zone: Option<&str>) -> bool {
        if self.node_zone.as_deref() == zone {
            return false;
        }
        self.node_zone = zone.map(Arc::from);
        let hinted: Vec<ObjectKey> = self
            .slices
            .iter()
            .filter(|(_, slice)| slice.endpoints.iter().any(|e| e.hints.is_some()))
            .map(|((ns, _), slice)| (ns.clone(), slice.service.clone()))
            .collect();
        let any = !hinted.is_empty();
        self.dirty.extend(hinted);
        any
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// Joins the Services marked since the last call again; returns the
    /// names of the ports that changed (added, changed or removed).
    pub fn refresh(&mut self) -> BTreeSet<String> {
        while let Some(key) = self.dirty.pop_first() {
            self.join(&key);
        }
        self.joined.take_changed()
    }

    /// Joins those of `services` that are marked now rather than at the
    /// next refresh (which reports them as changed all the same).
    fn join_ahead(&mut self, services: impl IntoIterator<Item = ObjectKey>) {
        for key in services {
            if self.dirty.remove(&key) {
                self.join(&key);
            }
        }
    }

    /// Joins one Service's ports again; marks the Services whose
    /// frontends changed hands with it.
    fn join(&mut self, key: &ObjectKey) {
        let ports = self.ports_of(key);
        let displaced = self.joined.replace(key, ports);
        self.dirty.extend(displaced);
    }

    /// The joined ports as of the last [`Cluster::refresh`].
    pub fn ports(&self) -> &BTreeMap<String, ServicePort> {
        self.joined.ports()
    }

    /// Ports left out as of the last [`Cluster::refresh`].
    pub fn problems(&self) -> Vec<Problem> {
        self.joined.problems()
    }

    /// Brings everything up to date and returns a copy (for tests and
    /// one-shot commands; the agent uses `refresh` and `ports`).
    pub fn desired(&mut self) -> Desired {
        self.refresh();
        Desired {
            ports: self.ports().clone(),
            problems: self.problems(),
        }
    }

    /// One Service's ports with the endpoints of its slices.
    fn ports_of(&self, key: &ObjectKey) -> Vec<ServicePort> {
        let Some(info) = self.services.get(key) else {
            return Vec::new();
        };
        let slices: Vec<&SliceInfo> = self
            .slices_of
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|slice| self.slices.get(slice))
            .collect();
        info.cluster_ips
            .iter()
            .flat_map(|cluster_ip| info.ports.iter().map(move |spec| (*cluster_ip, spec)))
            .map(|(cluster_ip, spec)| {
                let family = IpFamily::of(cluster_ip);
                let endpoints = endpoints_for(&slices, family, &spec.port_name, spec.protocol);
                // Only a port with hints depends on the zone (see the field).
                let node_zone = self
                    .node_zone
                    .clone()
                    .filter(|_| endpoints.iter().any(|e| e.hints.is_some()));
                let of_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
                    ips.iter().copied().filter(|ip| IpFamily::of(*ip) == family).collect()
                };
                ServicePort {
                    name: port_name(key, &spec.port_name, family),
                    protocol: spec.protocol,
                    cluster_ip,
                    port: spec.port,
                    node_port: spec.node_port,
                    endpoints,
                    external_policy: spec.external_policy,
                    internal_policy: spec.internal_policy,
                    external_ips: of_family(&info.external_ips),
                    load_balancer_ips: of_family(&info.load_balancer_ips),
                    source_ranges: info
                        .source_ranges
                        .iter()
                        .copied()
                        .filter(|r| r.family() == family)
                        .collect(),
                    affinity: info.affinity,
                    health_check_node_port: info.health_check_node_port,
                    node_zone,
                    lb_algorithm: info.lb_algorithm,
                }
            })
            .collect()
    }
}

/// The keys of `known` that `listed` lacks.
fn not_listed<V>(known: &BTreeMap<ObjectKey, V>, listed: &BTreeSet<ObjectKey>) -> Vec<ObjectKey> {
    known.keys().filter(|key| !listed.contains(*key)).cloned().collect()
}

/// A slice's trigger time; one that does not parse is ignored, as
/// kube-proxy ignores it (the latency is a measurement, not state).
fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    let text = slice.metadata.annotations.as_ref()?.get(TRIGGER_TIME_ANNOTATION)?;
    let at: jiff::Timestamp = text.parse().ok()?;
    Some(SystemTime::from(at))
}

/// kube-proxy's ServicePortName: `namespace/name`, then `:port` if named;
/// an IPv6 port's name ends in [`IPV6_SUFFIX`].
fn port_name((ns, name): &ObjectKey, port: &str, family: IpFamily) -> String {
    let suffix = if family == IpFamily::V6 { IPV6_SUFFIX } else { "" };
    if port.is_empty() {
        format!("{ns}/{name}{suffix}")
    } else {
        format!("{ns}/{name}:{port}{suffix}")
    }
}

/// Endpoints of all slices that offer the named port, one per address and
/// port (a pod listed by two slices during a rollout counts once, ready wins).
fn endpoints_for(slices: &[&SliceInfo], family: IpFamily, port_name: &str, protocol: super::Protocol) -> Vec<Endpoint> {
    let mut endpoints = Vec::new();
    for slice in slices.iter().filter(|s| s.family == family) {
        let Some(port) = slice
            .ports
            .iter()
            .find(|p| p.name == port_name && p.protocol == protocol)
        else {
            continue;
        };
        endpoints.extend(slice.endpoints.iter().map(|ep| Endpoint {
            port: port.port,
            ..ep.clone()
        }));
    }
    // By address, a ready copy first, else the first one seen (the sort is
    // stable); then one per address.
    endpoints.sort_by_key(|ep| (ep.addr, ep.port, !ep.ready));
    endpoints.dedup_by_key(|ep| (ep.addr, ep.port));
    endpoints
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::model::{IpFamily, Protocol};

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

    #[test]
    fn slice_trigger_times_are_kept_until_taken() {
        let mut cluster = Cluster::default();
        let mut annotated = slice(
            "web-1",
            "web",
            json!([{"port": 80}]),
            json!([{"addresses": ["10.244.0.11"]}]),
        );
        annotated.metadata.annotations = Some(
            [(TRIGGER_TIME_ANNOTATION.to_owned(), "2026-01-01T00:00:00Z".to_owned())]
                .into_iter()
                .collect(),
        );
        let plain = slice("web-2", "web", json!([{"port": 80}]), json!([]));
        let mut garbled = plain.clone();
        garbled.metadata.annotations = Some(
            [(TRIGGER_TIME_ANNOTATION.to_owned(), "soon".to_owned())]
                .into_iter()
                .collect(),
        );
        for s in [&annotated, &plain, &garbled] {
            cluster.upsert_slice(s);
        }
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_767_225_600);
        assert_eq!(cluster.take_trigger_times(), [at]);
        assert!(cluster.take_trigger_times().is_empty());
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
            (IpAddr::from([10, 96, 0, 10]), 88, Some(30791))
        );
        assert_eq!(port.protocol, Protocol::Tcp);
        let eps: Vec<_> = port
            .endpoints
            .iter()
            .map(|e| (super::super::last_octet(e.addr), e.port, e.ready, e.terminating))
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
                {"name": "quic", "port": 7000, "protocol": "QUIC"}]}),
        );
        let problems = cluster.upsert_service(&svc);
        let reasons: Vec<_> = problems.iter().map(std::string::ToString::to_string).collect();
        assert_eq!(problems.len(), 5, "{reasons:#?}");
        assert!(reasons.iter().any(|r| r.contains("port 70000 is out of range")));
        assert!(reasons.iter().any(|r| r.contains("duplicate port 8080")));
        assert!(reasons.iter().any(|r| r.contains("protocol QUIC is not supported")));
        let names: Vec<_> = cluster.desired().ports.into_keys().collect();
        assert_eq!(names, vec!["default/bad:ok".to_string()]);
    }

    /// A slice of `family` ("IPv4"/"IPv6") for Service `service`.
    fn slice_of(family: &str, name: &str, service: &str, addresses: &[&str]) -> EndpointSlice {
        let mut s = slice(
            name,
            service,
            json!([{"name": "http", "port": 8080}]),
            addresses.iter().map(|a| json!({"addresses": [a]})).collect(),
        );
        s.address_type = family.to_owned();
        s
    }

    #[test]
    fn a_dual_stack_service_is_a_port_per_family_each_with_its_own_addresses() {
        let mut cluster = Cluster::default();
        let svc = service(
            "web",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.20",
                   "clusterIPs": ["10.96.0.20", "fd00:96::20"], "ipFamilies": ["IPv4", "IPv6"],
                   "ports": [{"name": "http", "port": 80, "nodePort": 30080}],
                   "externalIPs": ["198.51.100.7", "2001:db8::7"],
                   "loadBalancerSourceRanges": ["203.0.113.0/24", "2001:db8:1::/48"]}),
        );
        assert!(cluster.upsert_service(&svc).is_empty());
        for s in [
            slice_of("IPv4", "web-v4", "web", &["10.244.0.5"]),
            slice_of("IPv6", "web-v6", "web", &["fd00:244::5", "fd00:244::6"]),
        ] {
            assert!(cluster.upsert_slice(&s).is_empty());
        }
        let desired = cluster.desired();
        assert!(desired.problems.is_empty(), "{:?}", desired.problems);
        let names: Vec<&str> = desired.ports.keys().map(String::as_str).collect();
        assert_eq!(names, ["default/web:http", "default/web:http (IPv6)"]);
        let (v4, v6) = (
            &desired.ports["default/web:http"],
            &desired.ports["default/web:http (IPv6)"],
        );
        let addrs = |port: &ServicePort| -> Vec<String> {
            let mut out = vec![port.cluster_ip.to_string()];
            out.extend(port.external_ips.iter().map(ToString::to_string));
            out.extend(port.source_ranges.iter().map(ToString::to_string));
            out.extend(port.endpoints.iter().map(|e| format!("{}:{}", e.addr, e.port)));
            out
        };
        assert_eq!(
            addrs(v4),
            ["10.96.0.20", "198.51.100.7", "203.0.113.0/24", "10.244.0.5:8080"]
        );
        assert_eq!(
            addrs(v6),
            [
                "fd00:96::20",
                "2001:db8::7",
                "2001:db8:1::/48",
                "fd00:244::5:8080",
                "fd00:244::6:8080"
            ]
        );
        // Both families answer on the node port: no conflict between them.
        assert_eq!((v4.node_port, v6.node_port), (Some(30080), Some(30080)));
        assert_eq!((v4.family(), v6.family()), (IpFamily::V4, IpFamily::V6));
    }

    #[test]
    fn an_ipv6_only_service_is_named_as_such_and_a_second_address_of_a_family_is_a_problem() {
        let mut cluster = Cluster::default();
        let v6 = service(
            "v6",
            json!({"clusterIP": "fd00:96::30", "ports": [{"port": 53, "protocol": "UDP"}]}),
        );
        assert!(cluster.upsert_service(&v6).is_empty());
        let twice = service(
            "twice",
            json!({"clusterIPs": ["10.96.0.31", "10.96.0.32"], "ports": [{"port": 80}]}),
        );
        let problems = cluster.upsert_service(&twice);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].reason.contains("second IPv4 address 10.96.0.32"),
            "{problems:?}"
        );
        let ports = cluster.desired().ports;
        assert_eq!(ports.keys().collect::<Vec<_>>(), ["default/twice", "default/v6 (IPv6)"]);
        assert_eq!(ports["default/twice"].cluster_ip, IpAddr::from([10, 96, 0, 31]));
        // An address of the wrong family in a slice is a problem, not an endpoint.
        let problems = cluster.upsert_slice(&slice_of("IPv6", "v6-1", "v6", &["10.244.0.9"]));
        assert_eq!(problems.len(), 1, "{problems:?}");
    }

    /// SCTP ports (protocol 132) join their slices' SCTP ports like TCP's
    /// and UDP's; a slice port of another protocol with the same name does
    /// not feed them.
    #[test]
    fn sctp_service_ports_take_the_slices_sctp_endpoints() {
        let mut cluster = Cluster::default();
        let svc = service(
            "sig",
            json!({"clusterIP": "10.96.0.9", "ports": [
                {"name": "sig", "port": 3868, "protocol": "SCTP", "targetPort": 3869}]}),
        );
        assert!(cluster.upsert_service(&svc).is_empty());
        let problems = cluster.upsert_slice(&slice(
            "sig-1",
            "sig",
            json!([{"name": "sig", "port": 3869, "protocol": "SCTP"}, {"name": "sig", "port": 80, "protocol": "TCP"}]),
            json!([{"addresses": ["10.244.0.5"]}]),
        ));
        assert!(problems.is_empty(), "{problems:?}");
        let ports = cluster.desired().ports;
        let port = &ports["default/sig:sig"];
        assert_eq!(
            (port.protocol, port.protocol.number(), port.port),
            (Protocol::Sctp, 132, 3868)
        );
        let endpoints: Vec<_> = port.endpoints.iter().map(|e| (e.addr.to_string(), e.port)).collect();
        assert_eq!(endpoints, [("10.244.0.5".to_owned(), 3869)]);
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

    /// A zone change re-joins the Services with hinted endpoints, and
    /// only those: the others' ports stay as they are.
    #[test]
    fn a_zone_change_rejoins_only_services_with_hints() {
        let mut cluster = seed();
        cluster.upsert_service(&service(
            "zonal",
            json!({"clusterIP": "10.96.0.20", "trafficDistribution": "PreferClose", "ports": [{"port": 80}]}),
        ));
        cluster.upsert_slice(&slice(
            "zonal-1",
            "zonal",
            json!([{"port": 8080}]),
            json!([
                {"addresses": ["10.244.1.1"], "zone": "z1", "hints": {"forZones": [{"name": "z1"}]}},
                {"addresses": ["10.244.1.2"], "zone": "z2", "hints": {"forZones": [{"name": "z2"}]}},
            ]),
        ));
        cluster.refresh();
        let cluster_set = |c: &Cluster| -> Vec<String> {
            crate::model::EndpointSets::of(&c.ports()["default/zonal"], Some("node-1"))
                .cluster
                .iter()
                .map(|e| e.addr.to_string())
                .collect()
        };
        assert_eq!(cluster_set(&cluster), ["10.244.1.1", "10.244.1.2"], "zone unknown");
        assert!(cluster.set_node_zone(Some("z2")));
        assert_eq!(cluster.refresh(), BTreeSet::from(["default/zonal".to_string()]));
        assert_eq!(cluster_set(&cluster), ["10.244.1.2"]);
        assert_eq!(
            cluster.ports()["default/nginx-service"].node_zone,
            None,
            "no hints: no zone"
        );
        assert!(!cluster.set_node_zone(Some("z2")), "no change");
        assert!(cluster.set_node_zone(None));
        cluster.refresh();
        assert_eq!(cluster_set(&cluster), ["10.244.1.1", "10.244.1.2"]);
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
        // A pod in two slices (a rollout): one endpoint, the ready copy.
        cluster.upsert_slice(&slice(
            "nginx-ghi",
            "nginx-service",
            json!([{"port": 80}]),
            json!([{"addresses": ["10.244.0.13"], "conditions": {"ready": true}}]),
        ));
        let endpoints = &cluster.desired().ports["default/nginx-service"].endpoints;
        let copies: Vec<_> = endpoints
            .iter()
            .filter(|e| e.addr.to_string() == "10.244.0.13")
            .collect();
        assert_eq!(copies.len(), 1);
        assert!(copies[0].ready);
        cluster.replace_slices(&[]);
        assert!(cluster.desired().ports["default/nginx-service"].endpoints.is_empty());
        cluster.replace_services(&[]);
        assert!(cluster.desired().ports.is_empty());
    }

    #[test]
    fn a_list_in_parts_forgets_what_it_did_not_name_and_an_abandoned_one_counts_for_nothing() {
        let web = |name: &str, ip: &str| service(name, json!({"clusterIP": ip, "ports": [{"port": 80}]}));
        let one_slice = |name: &str, service: &str, ip: &str| {
            slice(name, service, json!([{"port": 8080}]), json!([{"addresses": [ip]}]))
        };
        let mut cluster = Cluster::default();
        cluster.replace_services(&[web("a", "10.96.0.1"), web("b", "10.96.0.2"), web("c", "10.96.0.3")]);
        cluster.replace_slices(&[one_slice("a-1", "a", "10.244.0.1"), one_slice("c-1", "c", "10.244.0.3")]);
        let names = |cluster: &mut Cluster| cluster.desired().ports.into_keys().collect::<Vec<_>>();
        assert_eq!(names(&mut cluster), ["default/a", "default/b", "default/c"]);

        // A relist that breaks off after naming a, d and c-1, then starts again.
        cluster.begin_services_list();
        assert!(
            cluster
                .list_services(&[web("a", "10.96.0.1"), web("d", "10.96.0.4")])
                .is_empty()
        );
        cluster.begin_slices_list();
        cluster.list_slices(&[one_slice("c-1", "c", "10.244.0.3")]);
        // Until a list ends, what it has not named yet stays.
        assert_eq!(
            names(&mut cluster),
            ["default/a", "default/b", "default/c", "default/d"]
        );
        cluster.begin_services_list();
        cluster.list_services(&[web("a", "10.96.0.1")]);
        cluster.replace_services(&[web("b", "10.96.0.2")]);
        cluster.begin_slices_list();
        cluster.replace_slices(&[one_slice("a-1", "a", "10.244.0.9")]);
        // c and d were named only by the abandoned list; c-1 likewise.
        let desired = cluster.desired();
        assert_eq!(desired.ports.keys().collect::<Vec<_>>(), ["default/a", "default/b"]);
        assert_eq!(desired.ports["default/a"].endpoints[0].addr.to_string(), "10.244.0.9");

        // A Replace alone is a whole list (the manifests source's).
        cluster.replace_services(&[web("b", "10.96.0.2")]);
        assert_eq!(names(&mut cluster), ["default/b"]);
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

    /// The join done the plain way, as a reference: every Service in key
    /// order, the first to claim a ClusterIP keeps it; then, among the
    /// ports placed, in the same order, the first to claim an external IP,
    /// LB IP or node port keeps it, unless it is any port's ClusterIP.
    fn joined_afresh(services: &BTreeMap<String, Service>, slices: &BTreeMap<String, EndpointSlice>) -> Desired {
        use crate::model::Protocol;
        /// A frontend as (kind, address, port, protocol), sorted as the
        /// join sorts them; node ports have kind 1 and no address.
        type Key = (u8, IpAddr, u16, Protocol);
        // A node port's "address": the unspecified one of its family.
        let unspecified = |ip: IpAddr| {
            if ip.is_ipv4() {
                IpAddr::from([0; 4])
            } else {
                IpAddr::from([0; 16])
            }
        };
        let show = |(kind, ip, port, protocol): &Key| match kind {
            0 => format!("{ip}:{port}/{protocol}"),
            _ if ip.is_ipv4() => format!("node port {port}/{protocol}"),
            _ => format!("IPv6 node port {port}/{protocol}"),
        };
        let mut objects = Cluster::default();
        objects.replace_services(&services.values().cloned().collect::<Vec<_>>());
        objects.replace_slices(&slices.values().cloned().collect::<Vec<_>>());
        let mut desired = Desired::default();
        let mut clusters = BTreeSet::new();
        let mut placed = Vec::new();
        for key in objects.services.keys() {
            for port in objects.ports_of(key) {
                if clusters.insert((0, port.cluster_ip, port.port, port.protocol)) {
                    placed.push(port);
                } else {
                    let reason = format!(
                        "{}:{}/{} is already used by another Service",
                        port.cluster_ip, port.port, port.protocol
                    );
                    desired.problems.push(Problem::new(&port.name, reason));
                }
            }
        }
        let mut externals = BTreeSet::new();
        for mut port in placed {
            let own = (0, port.cluster_ip, port.port, port.protocol);
            let mut wanted: BTreeSet<Key> = port
                .external_ips
                .iter()
                .chain(&port.load_balancer_ips)
                .map(|ip| (0, *ip, port.port, port.protocol))
                .collect();
            wanted.extend(
                port.node_port
                    .map(|n| (1, unspecified(port.cluster_ip), n, port.protocol)),
            );
            wanted.remove(&own);
            let lost: BTreeSet<Key> = wanted
                .into_iter()
                .filter(|k| clusters.contains(k) || !externals.insert(*k))
                .collect();
            if !lost.is_empty() {
                let list: Vec<String> = lost.iter().map(show).collect();
                let reason = format!(
                    "{} already used by another Service: not served for this one",
                    list.join(", ")
                );
                desired.problems.push(Problem::new(&port.name, reason));
                let (number, protocol) = (port.port, port.protocol);
                port.external_ips
                    .retain(|ip| !lost.contains(&(0, *ip, number, protocol)));
                port.load_balancer_ips
                    .retain(|ip| !lost.contains(&(0, *ip, number, protocol)));
                if port
                    .node_port
                    .is_some_and(|n| lost.contains(&(1, unspecified(port.cluster_ip), n, protocol)))
                {
                    port.node_port = None;
                }
            }
            desired.ports.insert(port.name.clone(), port);
        }
        desired.problems.sort_by(|a, b| a.object.cmp(&b.object));
        desired
    }

    /// Random updates, deletions and relists (a fixed seed): after each
    /// refresh the incremental state equals a fresh join, and replaying
    /// only the changed names onto a copy yields it too (what the
    /// reconciler relies on). Few ClusterIPs, external IPs (some of them
    /// ClusterIPs) and node ports, so frontends collide often.
    #[test]
    fn incremental_join_equals_a_fresh_join_after_every_change() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut cluster = Cluster::default();
        let mut services: BTreeMap<String, Service> = BTreeMap::new();
        let mut slices: BTreeMap<String, EndpointSlice> = BTreeMap::new();
        let mut replayed: BTreeMap<String, ServicePort> = BTreeMap::new();
        let mut conflicts_seen = 0;
        let mut external_conflicts_seen = 0;
        // Deletions of (Services, slices) the cluster missed, and how often
        // a relist put such a state right.
        let mut missed = (false, false);
        let mut relists_that_healed = 0;
        for step in 0..600 {
            let healing = missed != (false, false);
            let svc_name = format!("s{}", next(6));
            match next(7) {
                0 | 1 => {
                    let external = [format!("10.96.0.{}", next(3)), format!("198.51.100.{}", next(2))];
                    let spec = json!({"clusterIP": format!("10.96.0.{}", next(3)), "type": "NodePort",
                        "externalIPs": &external[..next(3) as usize],
                        "ports": [{"name": "a", "port": 80 + next(2), "nodePort": 30000 + next(3)},
                                  {"name": "b", "port": 90}]});
                    let svc = service(&svc_name, spec);
                    cluster.upsert_service(&svc);
                    services.insert(svc_name, svc);
                }
                2 => {
                    // Some deletions are missed (as while disconnected):
                    // only a relist of the kind brings the state back.
                    if next(4) == 0 {
                        missed.0 |= services.contains_key(&svc_name);
                    } else {
                        cluster.delete_service(&("default".into(), svc_name.clone()));
                    }
                    services.remove(&svc_name);
                }
                3 | 4 => {
                    let name = format!("{svc_name}-{}", next(2));
                    let eps: Vec<_> = (0..next(4))
                        .map(|i| json!({"addresses": [format!("10.244.0.{}", i + next(3))]}))
                        .collect();
                    let sl = slice(
                        &name,
                        &svc_name,
                        json!([{"name": "a", "port": 8080}, {"name": "b", "port": 9090}]),
                        json!(eps),
                    );
                    cluster.upsert_slice(&sl);
                    slices.insert(name, sl);
                }
                5 => {
                    if let Some(name) = slices.keys().nth(next(slices.len().max(1) as u64) as usize).cloned() {
                        if next(4) == 0 {
                            missed.1 = true;
                        } else {
                            cluster.delete_slice(&("default".into(), name.clone()));
                        }
                        slices.remove(&name);
                    }
                }
                _ => {
                    let mut svc_list: &[Service] = &services.values().cloned().collect::<Vec<_>>();
                    let mut slice_list: &[EndpointSlice] = &slices.values().cloned().collect::<Vec<_>>();
                    match next(3) {
                        0 => {
                            cluster.replace_services(svc_list);
                            missed.0 = false;
                        }
                        1 => {
                            cluster.replace_slices(slice_list);
                            missed.1 = false;
                        }
                        _ => {
                            missed = (false, false);
                            // Both relisted in parts, interleaved as the two
                            // watchers deliver them; each list ends with its rest.
                            cluster.begin_services_list();
                            cluster.begin_slices_list();
                            let (mut services_ended, mut slices_ended) = (false, false);
                            while !(services_ended && slices_ended) {
                                let take = next(3) as usize;
                                let last = next(3) == 0;
                                if !services_ended && (slices_ended || next(2) == 0) {
                                    let (part, rest) = svc_list.split_at(take.min(svc_list.len()));
                                    svc_list = rest;
                                    services_ended = last || rest.is_empty();
                                    cluster.list_services(part);
                                    if services_ended {
                                        cluster.replace_services(svc_list);
                                    }
                                } else {
                                    let (part, rest) = slice_list.split_at(take.min(slice_list.len()));
                                    slice_list = rest;
                                    slices_ended = last || rest.is_empty();
                                    cluster.list_slices(part);
                                    if slices_ended {
                                        cluster.replace_slices(slice_list);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            if next(3) > 0 {
                continue; // let changes pile up between refreshes too
            }
            let changed = cluster.refresh();
            for name in &changed {
                match cluster.ports().get(name) {
                    Some(port) => replayed.insert(name.clone(), port.clone()),
                    None => replayed.remove(name),
                };
            }
            if missed != (false, false) {
                continue; // wrong until the next relist, as in a cluster
            }
            relists_that_healed += usize::from(healing);
            let fresh = joined_afresh(&services, &slices);
            assert_eq!(cluster.ports(), &fresh.ports, "step {step}");
            assert_eq!(cluster.problems(), fresh.problems, "step {step}");
            assert_eq!(&replayed, cluster.ports(), "step {step}: a change was not reported");
            conflicts_seen += fresh.problems.len();
            external_conflicts_seen += fresh
                .problems
                .iter()
                .filter(|p| p.reason.contains("not served"))
                .count();
        }
        assert!(
            relists_that_healed > 0,
            "no relist ever had a missed deletion to make good"
        );
        assert!(conflicts_seen > 0, "the run never made two Services share a frontend");
        assert!(
            external_conflicts_seen > 0,
            "the run never made two Services share an external frontend"
        );
    }
}

#[cfg(test)]
mod scale {
    use std::time::Instant;

    use serde_json::json;

    use super::*;

    /// Taking in and joining the lists of 10,000 Services x 10 endpoints
    /// (the bench's shape), timed step by step (what the agent does while
    /// the slices still arrive, and what is left for its first sync):
    /// `cargo test --release -p proxy-userspace --lib -- --ignored join_at_scale --nocapture`.
    #[test]
    #[ignore = "a measurement"]
    fn join_at_scale() {
        let services: Vec<Service> = (0..10_000u32)
            .map(|i| {
                let ip = std::net::Ipv4Addr::from(0x0a60_0000 + i);
                serde_json::from_value(json!({
                    "metadata": {"name": format!("svc-{i}"), "namespace": "default", "labels": {"app": format!("svc-{i}")}},
                    "spec": {"type": if i % 4 == 0 { "NodePort" } else { "ClusterIP" }, "clusterIP": ip.to_string(),
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP",
                            "nodePort": if i % 4 == 0 { json!(30000 + i / 4) } else { json!(null) }}],
                        "selector": {"app": format!("svc-{i}")}}
                }))
                .expect("service")
            })
            .collect();
        let slices: Vec<EndpointSlice> = (0..10_000u32)
            .map(|i| {
                let endpoints: Vec<serde_json::Value> = (0..10)
                    .map(|e| {
                        let ip = std::net::Ipv4Addr::from(0x0af4_0000 + i * 16 + e);
                        json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "node-a"})
                    })
                    .collect();
                serde_json::from_value(json!({
                    "metadata": {"name": format!("svc-{i}-1"), "namespace": "default",
                        "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
                    "addressType": "IPv4",
                    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                    "endpoints": endpoints,
                }))
                .expect("slice")
            })
            .collect();
        for round in 0..3 {
            let mut cluster = Cluster::default();
            let ms = |at: Instant| at.elapsed().as_secs_f64() * 1e3;
            let at = Instant::now();
            assert!(cluster.replace_services(&services).is_empty());
            let took_services = ms(at);
            // As the API source sends them: in parts, each joined on arrival.
            let at = Instant::now();
            cluster.begin_slices_list();
            for part in slices.chunks(500) {
                assert!(cluster.list_slices(part).is_empty());
            }
            assert!(cluster.replace_slices(&[]).is_empty());
            let took_slices = ms(at);
            let at = Instant::now();
            let changed = cluster.refresh();
            let took_refresh = ms(at);
            assert_eq!(changed.len(), 10_000);
            eprintln!(
                "round {round}: Services {took_services:.1} ms, slices in parts (joined) {took_slices:.1} ms, \
                 the refresh left to the sync {took_refresh:.1} ms"
            );
        }
    }
}
