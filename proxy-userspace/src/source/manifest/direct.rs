//! The fast way from a YAML document to Services and EndpointSlices: in
//! one pass, straight into the objects, without a `serde_json::Value` in
//! between.
//!
//! A document's kind is not known before it is read (kubectl writes
//! `kind` after the fields), so it is read into [`Fields`], the fields of
//! a Service and of an EndpointSlice side by side, and becomes one of the
//! two afterwards. Whatever this does not cover exactly as the general
//! path ([`super::parse`]) does (Nodes, other kinds, a field of an
//! unexpected type, a list item of another kind) gives `None`, and the
//! document takes the general path: the outcome, problems included, is
//! the general path's. At 10,000 Services x 10 endpoints this saves a
//! third of the parsing time and most of its allocations (which the
//! agent's single malloc arena serializes between threads).

use k8s_openapi::{
    Resource,
    api::{
        core::v1::{Service, ServiceSpec, ServiceStatus},
        discovery::v1::{Endpoint, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::Deserialize;

use super::parse::FileObjects;

/// The objects in one YAML document (a single document: `text` is one of
/// [`super::parse::yaml_documents`]), or `None` for the general path.
pub fn objects(text: &str) -> Option<FileObjects> {
    let fields: Fields = serde_yaml_ng::from_str(text).ok()?;
    let mut objects = FileObjects::default();
    fields.collect(&mut objects)?;
    Some(objects)
}

/// The objects in one document's JSON (as [`super::block`] writes it),
/// or `None` for libyaml's path.
pub fn objects_from_json(json: &str) -> Option<FileObjects> {
    let fields: Fields = serde_json::from_str(json).ok()?;
    let mut objects = FileObjects::default();
    fields.collect(&mut objects)?;
    Some(objects)
}

/// The top-level fields of a Service, an EndpointSlice and a list of them,
/// typed as k8s-openapi types them (which ignore unknown fields, as this
/// does).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Fields {
    api_version: Option<String>,
    kind: Option<String>,
    metadata: Option<ObjectMeta>,
    // A Service's.
    spec: Option<ServiceSpec>,
    status: Option<ServiceStatus>,
    // An EndpointSlice's.
    address_type: Option<String>,
    endpoints: Option<Vec<Endpoint>>,
    ports: Option<Vec<EndpointPort>>,
    // A list's.
    items: Option<Vec<Fields>>,
}

impl Fields {
    /// Adds this document's objects to `objects`; `None` if it is not
    /// one this path covers.
    fn collect(self, objects: &mut FileObjects) -> Option<()> {
        match (self.api_version.as_deref()?, self.kind.as_deref()?) {
            ("v1", "Service") => objects.services.push(self.service()),
            ("discovery.k8s.io/v1", "EndpointSlice") => objects.slices.push(self.slice()),
            ("v1", "List") => {
                for item in self.items.unwrap_or_default() {
                    item.collect(objects)?;
                }
            }
            ("v1", "ServiceList") => {
                for item in self.items.unwrap_or_default() {
                    objects.services.push(item.of_kind::<Service>()?.service());
                }
            }
            ("discovery.k8s.io/v1", "EndpointSliceList") => {
                for item in self.items.unwrap_or_default() {
                    objects.slices.push(item.of_kind::<EndpointSlice>()?.slice());
                }
            }
            _ => return None,
        }
        Some(())
    }

    /// An item of a typed list, which is a `K` if it does not say
    /// otherwise (k8s-openapi refuses an `apiVersion` or a `kind` that is
    /// not `K`'s).
    fn of_kind<K: Resource>(self) -> Option<Self> {
        let fits = |said: Option<&str>, expected: &str| said.is_none_or(|said| said == expected);
        (fits(self.api_version.as_deref(), K::API_VERSION) && fits(self.kind.as_deref(), K::KIND)).then_some(self)
    }

    fn service(self) -> Service {
        let mut spec = self.spec;
        if let Some(spec) = &mut spec {
            shrink(&mut spec.ports);
            shrink(&mut spec.cluster_ips);
            shrink(&mut spec.ip_families);
        }
        Service {
            metadata: self.metadata.unwrap_or_default(),
            spec,
            status: self.status,
        }
    }

    fn slice(self) -> EndpointSlice {
        let mut endpoints = self.endpoints;
        shrink(&mut endpoints);
        for endpoint in endpoints.iter_mut().flatten() {
            endpoint.addresses.shrink_to_fit();
        }
        let mut ports = self.ports;
        shrink(&mut ports);
        EndpointSlice {
            address_type: self.address_type.unwrap_or_default(),
            endpoints,
            metadata: self.metadata.unwrap_or_default(),
            ports,
        }
    }
}

/// Gives back a list's growth room. libyaml's deserializer does not say
/// how long a sequence is, so a list grows by doubling (10 endpoints take
/// room for 16, one address room for 4): at 10,000 Services x 10
/// endpoints that was ~30 MiB more at the peak and in the agent's RSS
/// after the first sync than through a value, whose lists say their
/// length.
fn shrink<T>(list: &mut Option<Vec<T>>) {
    if let Some(list) = list {
        list.shrink_to_fit();
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::source::manifest::parse::{Format, parse, tests::TYPED_LISTS, yaml_documents};

    /// What the general path (serde-saphyr, through a value) makes of `text`.
    fn general(text: &str) -> FileObjects {
        let (objects, problems) = parse(text, Format::Yaml, "f.yaml").expect("valid YAML");
        assert!(problems.is_empty(), "{problems:?}");
        objects
    }

    /// `path` (a faster path, `name`d) reads `text`, and gives the
    /// Services and EndpointSlices that the general path gives.
    pub(in crate::source::manifest) fn assert_path_agrees(
        name: &str,
        path: fn(&str) -> Option<FileObjects>,
        text: &str,
    ) {
        let fast = path(text).unwrap_or_else(|| panic!("refused by the {name} path:\n{text}"));
        let general = general(text);
        assert!(
            !(general.services.is_empty() && general.slices.is_empty()),
            "no objects in:\n{text}"
        );
        assert_eq!(fast.services, general.services, "{text}");
        assert_eq!(fast.slices, general.slices, "{text}");
        assert!(fast.nodes.is_empty());
    }

    fn assert_same_as_general(text: &str) {
        assert_path_agrees("direct", objects, text);
    }

    #[test]
    fn services_and_slices_come_out_as_the_general_path_makes_them() {
        let service = "\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default, labels: {app: web}, annotations: {a: b}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  externalTrafficPolicy: Local
  healthCheckNodePort: 31000
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}
  loadBalancerSourceRanges: [10.0.0.0/8]
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: http, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
  selector: {app: web}
  unknownField: [1, 2]
status:
  loadBalancer: {ingress: [{ip: 192.0.2.1}]}
";
        // kubectl's key order: `kind` after the endpoints.
        let slice = "\
addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses: [10.244.0.5]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: node-a
  zone: zone-a
  hints: {forZones: [{name: zone-a}]}
- addresses: [10.244.0.6]
  conditions: {ready: false}
kind: EndpointSlice
metadata:
  labels: {kubernetes.io/service-name: web}
  name: web-abc12
  namespace: default
ports: [{name: http, port: 8080, protocol: TCP}]
";
        assert_same_as_general(service);
        assert_same_as_general(slice);
        assert_same_as_general("apiVersion: v1\nkind: Service\nmetadata: null\nspec: null\n");
        let indented = |doc: &str| {
            doc.lines()
                .map(|l| format!("  {l}\n"))
                .collect::<String>()
                .replacen("  ", "- ", 1)
        };
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n{}{}",
            indented(service),
            indented(slice)
        );
        assert_same_as_general(&list);
        // The ServiceList and the EndpointSliceList (the NodeList is not
        // this path's).
        for list in &yaml_documents(TYPED_LISTS)[..2] {
            assert_same_as_general(list);
        }
    }

    /// What the direct path does not make exactly as the general path does
    /// is left to it.
    #[test]
    fn other_documents_take_the_general_path() {
        for text in [
            "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec: {replicas: 3}\n",
            // Problems are the general path's to report.
            "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: 12}\n",
            "apiVersion: v1\nkind: ServiceList\nitems:\n- {kind: EndpointSlice, metadata: {name: a}}\n",
            "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Node, metadata: {name: a}}\n",
            "kind: Service\nmetadata: {name: a}\n",
            "apiVersion: v1\nkind: Service\nkind: Service\n",
            "",
            "[1, 2]",
        ] {
            assert!(objects(text).is_none(), "{text}");
        }
    }
}
