//! Service objects -> the ports xproxy programs, with kube-proxy's filters.
//!
//! Hostile or unsupported input never stops the whole sync: a bad Service or
//! port is skipped with a [`Problem`] that the caller logs and counts.

use std::{collections::BTreeSet, net::IpAddr, time::Duration};

use k8s_openapi::api::core::v1::{Service, ServiceSpec};

use super::{IpFamily, LB_ALGORITHM_ANNOTATION, LbAlgorithm, Problem, Protocol, SourceRange, TrafficPolicy};

/// Services carrying this label belong to another proxy (kube-proxy skips them too).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";

/// One port of a Service, before endpoints are attached; one per family
/// the Service has a ClusterIP of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    /// The port's name in the Service ("" for a single unnamed port);
    /// EndpointSlice ports are matched to it by this name.
    pub port_name: String,
    pub protocol: Protocol,
    pub port: u16,
    pub node_port: Option<u16>,
    /// `Cluster` unless the Service is reachable from outside (NodePort,
    /// LoadBalancer) and asks for `Local`.
    pub external_policy: TrafficPolicy,
    pub internal_policy: TrafficPolicy,
}

/// What a Service contributes to the desired state: its ports, and what
/// holds for all of them (see the fields of the same names on
/// [`super::ServicePort`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// One ClusterIP per family, the primary family first (`spec.clusterIPs`).
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<PortSpec>,
    /// Of every family; each port takes those of its own.
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ips: Vec<IpAddr>,
    pub source_ranges: Vec<SourceRange>,
    pub affinity: Option<Duration>,
    pub health_check_node_port: Option<u16>,
    pub lb_algorithm: Option<LbAlgorithm>,
}

/// kube-proxy's (and the API server's) default for
/// `sessionAffinityConfig.clientIP.timeoutSeconds`: three hours.
pub const DEFAULT_AFFINITY_TIMEOUT: Duration = Duration::from_secs(10_800);

/// The longest affinity timeout the API server accepts: one day.
pub const MAX_AFFINITY_TIMEOUT_SECONDS: i32 = 86_400;

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
    if spec.cluster_ip.as_deref() == Some("None") {
        return Err(Skip::NotProxied("headless"));
    }
    let mut problems = Vec::new();
    let cluster_ips = cluster_ips(spec, &object, &mut problems)?;
    let (external_policy, internal_policy) = traffic_policies(spec, &object, &mut problems);
    let mut ports = Vec::new();
    let mut seen = BTreeSet::new();
    for p in spec.ports.iter().flatten() {
        let port_name = p.name.clone().unwrap_or_default();
        let what = format!("{object} port {port_name:?}");
        let protocol_name = p.protocol.as_deref().unwrap_or("TCP");
        let Some(protocol) = Protocol::from_api(protocol_name) else {
            problems.push(Problem::new(
                &what,
                format!("protocol {protocol_name} is not supported"),
            ));
            continue;
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
            port,
            node_port,
            external_policy,
            internal_policy,
        });
    }
    let info = ServiceInfo {
        cluster_ips,
        ports,
        external_ips: external_ips(spec, &object, &mut problems),
        load_balancer_ips: load_balancer_ips(svc, &object, &mut problems),
        source_ranges: source_ranges(spec, &object, &mut problems),
        affinity: affinity(spec, &object, &mut problems),
        health_check_node_port: health_check_node_port(spec, &object, &mut problems),
        lb_algorithm: lb_algorithm(svc, &object, &mut problems),
    };
    Ok((info, problems))
}

/// `spec.clusterIPs` (or `spec.clusterIP` where a hand-written manifest
/// has only that): one address per family, the primary first. An entry
/// that is no address, or a second one of a family, is a problem and
/// skipped; a Service left without any is skipped whole.
fn cluster_ips(spec: &ServiceSpec, object: &str, problems: &mut Vec<Problem>) -> Result<Vec<IpAddr>, Skip> {
    let texts: Vec<&str> = match spec.cluster_ips.as_deref() {
        Some(list) if !list.is_empty() => list.iter().map(String::as_str).collect(),
        _ => spec.cluster_ip.as_deref().into_iter().collect(),
    };
    if texts.iter().all(|t| t.is_empty()) {
        // The API server always allocates one; only a hand-written manifest lacks it.
        return Err(Skip::Invalid(Problem::new(
            object,
            "no clusterIP (set spec.clusterIP in manifests)",
        )));
    }
    let mut out: Vec<IpAddr> = Vec::new();
    for text in &texts {
        match text.trim().parse::<IpAddr>() {
            Ok(ip) if out.iter().any(|o| IpFamily::of(*o) == IpFamily::of(ip)) => problems.push(Problem::new(
                object,
                format!(
                    "clusterIPs lists a second {} address {ip}; skipped",
                    IpFamily::of(ip).name()
                ),
            )),
            Ok(ip) => out.push(ip),
            Err(_) => problems.push(Problem::new(object, format!("clusterIP {text:?} is not an IP address"))),
        }
    }
    if out.is_empty() {
        return Err(Skip::Invalid(Problem::new(
            object,
            format!("clusterIP {:?} is not an IP address", texts.join(",")),
        )));
    }
    Ok(out)
}

/// The [`LB_ALGORITHM_ANNOTATION`]; an unknown name is a problem and the
/// agent's default applies.
fn lb_algorithm(svc: &Service, object: &str, problems: &mut Vec<Problem>) -> Option<LbAlgorithm> {
    let text = svc.metadata.annotations.as_ref()?.get(LB_ALGORITHM_ANNOTATION)?;
    let parsed = LbAlgorithm::parse(text);
    if parsed.is_none() {
        problems.push(Problem::new(
            object,
            format!("{LB_ALGORITHM_ANNOTATION} {text:?} is neither random nor maglev; the default applies"),
        ));
    }
    parsed
}

/// `spec.externalIPs`; an entry that is no address is a problem and skipped.
fn external_ips(spec: &ServiceSpec, object: &str, problems: &mut Vec<Problem>) -> Vec<IpAddr> {
    let texts = spec.external_ips.iter().flatten().map(|t| t.trim());
    distinct_addresses(texts, "externalIP", object, problems)
}

/// The load balancer's ingress IPs of a `LoadBalancer` Service, without
/// those with `ipMode: Proxy` (kube-proxy leaves them to the load balancer)
/// and without hostname-only entries.
fn load_balancer_ips(svc: &Service, object: &str, problems: &mut Vec<Problem>) -> Vec<IpAddr> {
    let is_load_balancer = svc.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer");
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    let texts = (ingress.into_iter().flatten())
        .filter(|_| is_load_balancer)
        .filter(|entry| entry.ip_mode.as_deref() != Some("Proxy"))
        .filter_map(|entry| entry.ip.as_deref());
    distinct_addresses(texts, "load balancer IP", object, problems)
}

/// The addresses among `texts`, each once; text that is no address is a
/// problem and skipped.
fn distinct_addresses<'a>(
    texts: impl Iterator<Item = &'a str>,
    what: &str,
    object: &str,
    problems: &mut Vec<Problem>,
) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for text in texts {
        match text.parse::<IpAddr>() {
            Ok(ip) if !out.contains(&ip) => out.push(ip),
            Ok(_) => {}
            Err(_) => problems.push(Problem::new(
                object,
                format!("{what} {text:?} is not an IP address; skipped"),
            )),
        }
    }
    out
}

/// `spec.loadBalancerSourceRanges`, of both families (each port keeps
/// those of its own). The API server allows spaces around a range; a range
/// that does not parse is skipped with a problem (the others still apply,
/// as in kube-proxy).
fn source_ranges(spec: &ServiceSpec, object: &str, problems: &mut Vec<Problem>) -> Vec<SourceRange> {
    let mut out = Vec::new();
    for text in spec.load_balancer_source_ranges.iter().flatten() {
        match parse_source_range(text.trim()) {
            Some(range) if !out.contains(&range) => out.push(range),
            Some(_) => {}
            None => problems.push(Problem::new(
                object,
                format!("loadBalancerSourceRange {text:?} is not a CIDR; skipped"),
            )),
        }
    }
    out
}

fn parse_source_range(text: &str) -> Option<SourceRange> {
    let (addr, len) = text.split_once('/')?;
    SourceRange::new(addr.parse().ok()?, len.parse().ok()?)
}

/// `sessionAffinity: ClientIP` and its timeout (default three hours; a
/// value the API server refuses is a problem and taken as the default).
fn affinity(spec: &ServiceSpec, object: &str, problems: &mut Vec<Problem>) -> Option<Duration> {
    match spec.session_affinity.as_deref() {
        None | Some("None") => return None,
        Some("ClientIP") => {}
        Some(other) => {
            problems.push(Problem::new(
                object,
                format!("sessionAffinity {other:?} is neither None nor ClientIP; using None"),
            ));
            return None;
        }
    }
    let seconds = spec
        .session_affinity_config
        .as_ref()
        .and_then(|c| c.client_ip.as_ref())
        .and_then(|c| c.timeout_seconds);
    match seconds {
        None => Some(DEFAULT_AFFINITY_TIMEOUT),
        Some(s) if (1..=MAX_AFFINITY_TIMEOUT_SECONDS).contains(&s) => {
            Some(Duration::from_secs(u64::from(s.unsigned_abs())))
        }
        Some(s) => {
            problems.push(Problem::new(
                object,
                format!("sessionAffinityConfig.clientIP.timeoutSeconds {s} is outside 1-86400; using 10800"),
            ));
            Some(DEFAULT_AFFINITY_TIMEOUT)
        }
    }
}

/// `spec.healthCheckNodePort`, which only a LoadBalancer Service with
/// `externalTrafficPolicy: Local` has.
fn health_check_node_port(spec: &ServiceSpec, object: &str, problems: &mut Vec<Problem>) -> Option<u16> {
    let port = spec.health_check_node_port.filter(|p| *p != 0)?;
    let applies =
        spec.type_.as_deref() == Some("LoadBalancer") && spec.external_traffic_policy.as_deref() == Some("Local");
    if !applies {
        return None;
    }
    let valid = valid_port(port);
    if valid.is_none() {
        problems.push(Problem::new(
            object,
            format!("healthCheckNodePort {port} is out of range 1-65535; no health check served"),
        ));
    }
    valid
}

/// `(external, internal)` traffic policy of a Service, as kube-proxy reads
/// them: the external one counts only for Services reachable from outside
/// the cluster. A value the API server would refuse is a problem and taken
/// as `Cluster`.
fn traffic_policies(spec: &ServiceSpec, object: &str, problems: &mut Vec<Problem>) -> (TrafficPolicy, TrafficPolicy) {
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
    let reachable_from_outside = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"))
        || spec.external_ips.as_ref().is_some_and(|ips| !ips.is_empty());
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn info(service: serde_json::Value) -> (ServiceInfo, Vec<Problem>) {
        let mut object = json!({"metadata": {"name": "web", "namespace": "default"}});
        object
            .as_object_mut()
            .unwrap()
            .extend(service.as_object().unwrap().clone());
        service_info(&serde_json::from_value(object).unwrap()).unwrap()
    }

    fn lb_spec(extra: serde_json::Value) -> serde_json::Value {
        let mut spec = json!({"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                              "ports": [{"port": 80, "nodePort": 30080}]});
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        spec
    }

    #[test]
    fn load_balancer_ips_leave_out_proxy_mode_hostnames_and_other_types() {
        let status = json!({"loadBalancer": {"ingress": [
            {"ip": "192.0.2.10"}, {"ip": "192.0.2.11", "ipMode": "VIP"},
            {"ip": "192.0.2.12", "ipMode": "Proxy"}, {"hostname": "lb.example"}, {"ip": "bogus"}]}});
        let (lb, problems) = info(json!({"spec": lb_spec(json!({})), "status": status}));
        assert_eq!(
            lb.load_balancer_ips,
            [IpAddr::from([192, 0, 2, 10]), IpAddr::from([192, 0, 2, 11])]
        );
        assert_eq!(problems.len(), 1, "{problems:?}");
        // A NodePort Service keeps a stale status from its LoadBalancer days: unused.
        let spec = json!({"type": "NodePort", "clusterIP": "10.96.0.10", "ports": [{"port": 80}]});
        let (np, _) = info(json!({"spec": spec, "status": status}));
        assert!(np.load_balancer_ips.is_empty());
    }

    #[test]
    fn external_ips_make_the_external_policy_count_without_a_node_port() {
        let spec = json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80}],
                          "externalIPs": ["198.51.100.7", "198.51.100.7", "2001:db8::1", "nope"],
                          "externalTrafficPolicy": "Local"});
        let (svc, problems) = info(json!({"spec": spec}));
        assert_eq!(
            svc.external_ips,
            [IpAddr::from([198, 51, 100, 7]), "2001:db8::1".parse().unwrap()]
        );
        assert_eq!(svc.ports[0].external_policy, TrafficPolicy::Local);
        assert_eq!(problems.len(), 1, "{problems:?}");
    }

    #[test]
    fn source_ranges_take_spaces_skip_garbage_and_keep_both_families() {
        let spec = lb_spec(json!({"loadBalancerSourceRanges":
            [" 203.0.113.0/24 ", "10.1.2.3/8", "2001:db8::/32", "300.1.1.1/8", "10.0.0.0/33", "x"]}));
        let (svc, problems) = info(json!({"spec": spec}));
        let ranges: Vec<String> = svc.source_ranges.iter().map(ToString::to_string).collect();
        assert_eq!(ranges, ["203.0.113.0/24", "10.0.0.0/8", "2001:db8::/32"]);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(svc.source_ranges[0].contains(IpAddr::from([203, 0, 113, 9])));
        assert!(!svc.source_ranges[0].contains(IpAddr::from([203, 0, 114, 9])));
    }

    #[test]
    fn affinity_defaults_to_three_hours_and_refuses_out_of_range_timeouts() {
        let none = info(json!({"spec": lb_spec(json!({}))})).0;
        assert_eq!(none.affinity, None);
        let default = info(json!({"spec": lb_spec(json!({"sessionAffinity": "ClientIP"}))})).0;
        assert_eq!(default.affinity, Some(DEFAULT_AFFINITY_TIMEOUT));
        let short = lb_spec(json!({"sessionAffinity": "ClientIP",
                                   "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}}));
        assert_eq!(info(json!({"spec": short})).0.affinity, Some(Duration::from_secs(30)));
        let bad = lb_spec(json!({"sessionAffinity": "ClientIP",
                                 "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}));
        let (svc, problems) = info(json!({"spec": bad}));
        assert_eq!((svc.affinity, problems.len()), (Some(DEFAULT_AFFINITY_TIMEOUT), 1));
    }

    #[test]
    fn health_check_node_port_only_for_local_load_balancers() {
        let local = lb_spec(json!({"externalTrafficPolicy": "Local", "healthCheckNodePort": 32000}));
        assert_eq!(info(json!({"spec": local})).0.health_check_node_port, Some(32000));
        let cluster = lb_spec(json!({"healthCheckNodePort": 32000}));
        assert_eq!(info(json!({"spec": cluster})).0.health_check_node_port, None);
    }

    #[test]
    fn lb_algorithm_annotation_names_random_or_maglev() {
        let with = |value: &str| {
            let metadata = json!({"name": "web", "namespace": "default",
                                  "annotations": {LB_ALGORITHM_ANNOTATION: value}});
            info(json!({"metadata": metadata, "spec": lb_spec(json!({}))}))
        };
        assert_eq!(info(json!({"spec": lb_spec(json!({}))})).0.lb_algorithm, None);
        assert_eq!(with("maglev").0.lb_algorithm, Some(LbAlgorithm::Maglev));
        assert_eq!(with(" Random ").0.lb_algorithm, Some(LbAlgorithm::Random));
        let (svc, problems) = with("round-robin");
        assert_eq!((svc.lb_algorithm, problems.len()), (None, 1), "{problems:?}");
    }
}
