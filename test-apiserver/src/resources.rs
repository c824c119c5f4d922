//! The resource types the test API server serves, and its discovery
//! documents (`/api`, `/api/v1`, `/apis`, `/apis/GROUP/VERSION`).

use serde_json::{Value, json};

/// One served resource type.
#[derive(Debug, PartialEq, Eq)]
pub struct ResourceType {
    /// API group, "" for the core group.
    pub group: &'static str,
    pub version: &'static str,
    /// Plural lower-case name, as in the URL (`services`).
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    pub short_names: &'static [&'static str],
    /// Has a `/status` subresource (and PUT/PATCH of the main resource keeps
    /// the stored status, as the real server does).
    pub status_subresource: bool,
}

impl ResourceType {
    /// `v1` or `discovery.k8s.io/v1`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `ServiceList`.
    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// `services` or `endpointslices.discovery.k8s.io`, as in error messages.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

pub static NAMESPACES: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "namespaces",
    singular: "namespace",
    kind: "Namespace",
    namespaced: false,
    short_names: &["ns"],
    status_subresource: true,
};
pub static NODES: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "nodes",
    singular: "node",
    kind: "Node",
    namespaced: false,
    short_names: &["no"],
    status_subresource: true,
};
pub static SERVICES: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "services",
    singular: "service",
    kind: "Service",
    namespaced: true,
    short_names: &["svc"],
    status_subresource: true,
};
pub static ENDPOINTS: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "endpoints",
    singular: "endpoints",
    kind: "Endpoints",
    namespaced: true,
    short_names: &["ep"],
    status_subresource: false,
};
pub static CORE_EVENTS: ResourceType = ResourceType {
    group: "",
    version: "v1",
    plural: "events",
    singular: "event",
    kind: "Event",
    namespaced: true,
    short_names: &["ev"],
    status_subresource: false,
};
pub static ENDPOINT_SLICES: ResourceType = ResourceType {
    group: "discovery.k8s.io",
    version: "v1",
    plural: "endpointslices",
    singular: "endpointslice",
    kind: "EndpointSlice",
    namespaced: true,
    short_names: &[],
    status_subresource: false,
};
pub static EVENTS: ResourceType = ResourceType {
    group: "events.k8s.io",
    version: "v1",
    plural: "events",
    singular: "event",
    kind: "Event",
    namespaced: true,
    short_names: &[],
    status_subresource: false,
};
/// Stored only (no controller runs): lets `kubectl apply -f` of the seed
/// manifest, which has a Deployment next to its Service, succeed.
pub static DEPLOYMENTS: ResourceType = ResourceType {
    group: "apps",
    version: "v1",
    plural: "deployments",
    singular: "deployment",
    kind: "Deployment",
    namespaced: true,
    short_names: &["deploy"],
    status_subresource: true,
};

/// Every served resource type.
pub static ALL: &[&ResourceType] = &[
    &NAMESPACES,
    &NODES,
    &SERVICES,
    &ENDPOINTS,
    &CORE_EVENTS,
    &ENDPOINT_SLICES,
    &EVENTS,
    &DEPLOYMENTS,
];

/// The served groups other than the core group, in discovery order.
const GROUPS: &[(&str, &str)] = &[("apps", "v1"), ("discovery.k8s.io", "v1"), ("events.k8s.io", "v1")];

/// The resource type at `group/version/plural`.
pub fn by_path(group: &str, version: &str, plural: &str) -> Option<&'static ResourceType> {
    ALL.iter()
        .copied()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// The resource type of an object's `apiVersion` and `kind`.
pub fn by_kind(api_version: &str, kind: &str) -> Option<&'static ResourceType> {
    ALL.iter()
        .copied()
        .find(|r| r.api_version() == api_version && r.kind == kind)
}

/// The resource type named by a kind (`Service`), a plural (`services`), a
/// singular, a short name (`svc`) or `plural.group`, case-insensitively.
/// The core group wins on ambiguity (`events`).
pub fn by_name(name: &str) -> Option<&'static ResourceType> {
    let n = name.to_ascii_lowercase();
    ALL.iter().copied().find(|r| {
        r.kind.eq_ignore_ascii_case(&n)
            || r.plural == n
            || r.singular == n
            || r.short_names.contains(&n.as_str())
            || r.qualified() == n
    })
}

const VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// `APIVersions` for `/api`.
pub fn api_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

fn group_json(name: &str, version: &str) -> Value {
    let gv = json!({"groupVersion": format!("{name}/{version}"), "version": version});
    json!({"name": name, "versions": [gv.clone()], "preferredVersion": gv})
}

/// `APIGroupList` for `/apis`.
pub fn api_group_list() -> Value {
    let groups: Vec<Value> = GROUPS.iter().map(|(g, v)| group_json(g, v)).collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `APIGroup` for `/apis/GROUP`.
pub fn api_group(group: &str) -> Option<Value> {
    let (g, v) = GROUPS.iter().find(|(g, _)| *g == group)?;
    let mut doc = group_json(g, v);
    doc["kind"] = json!("APIGroup");
    doc["apiVersion"] = json!("v1");
    Some(doc)
}

/// `APIResourceList` for `/api/v1` (group "") or `/apis/GROUP/VERSION`.
pub fn api_resource_list(group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in ALL.iter().filter(|r| r.group == group && r.version == version) {
        let mut entry = json!({
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": VERBS,
        });
        if !r.short_names.is_empty() {
            entry["shortNames"] = json!(r.short_names);
        }
        if matches!(r.plural, "services" | "deployments") {
            entry["categories"] = json!(["all"]);
        }
        resources.push(entry);
        if r.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", r.plural),
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    let group_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }))
}

/// `/version`.
pub fn version_info() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-xproxy-test",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

/// The strategic-merge-patch merge key of the list at `path` (field names
/// joined by '.', array indices left out) of a `resource`, where the list
/// merges by key; `Some("")` for a list of scalars that merges as a set.
/// Lists not named here are replaced whole, like JSON merge patch does.
pub fn merge_key(resource: &ResourceType, path: &str) -> Option<&'static str> {
    match path {
        "metadata.ownerReferences" => return Some("uid"),
        "metadata.finalizers" => return Some(""),
        _ => {}
    }
    let pod_spec = |p: &str| -> Option<&'static str> {
        let p = p.strip_prefix("spec.template.spec.")?;
        Some(match p {
            "containers" | "initContainers" | "ephemeralContainers" | "volumes" | "imagePullSecrets" => "name",
            "containers.ports" | "initContainers.ports" => "containerPort",
            "containers.env" | "initContainers.env" => "name",
            "containers.volumeMounts" | "initContainers.volumeMounts" => "mountPath",
            _ => return None,
        })
    };
    match (resource.plural, path) {
        ("services", "spec.ports") => Some("port"),
        ("services", "status.conditions") => Some("type"),
        ("nodes", "status.conditions" | "status.addresses") => Some("type"),
        ("nodes", "spec.podCIDRs") => Some(""),
        ("deployments", "status.conditions") => Some("type"),
        ("deployments", p) => pod_spec(p),
        _ => None,
    }
}

/// The group-version paths of `/openapi/v3` (`api/v1`, `apis/apps/v1`...).
fn openapi_group_versions() -> Vec<(&'static str, &'static str, String)> {
    let mut gvs = vec![("", "v1", "api/v1".to_string())];
    gvs.extend(GROUPS.iter().map(|(g, v)| (*g, *v, format!("apis/{g}/{v}"))));
    gvs
}

/// `/openapi/v3`: the index of the per-group-version documents.
pub fn openapi_v3_root() -> Value {
    let mut paths = serde_json::Map::new();
    for (_, _, p) in openapi_group_versions() {
        paths.insert(
            p.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{p}?hash=0")}),
        );
    }
    json!({"paths": paths})
}

/// `/openapi/v3/api/v1` etc.: just enough OpenAPI for kubectl to learn
/// that the server validates fields itself (the `fieldValidation` query
/// parameter of each PATCH operation), so `kubectl apply` works without
/// `--validate=false`. No schemas and no strategic-merge-patch media type
/// are listed: kubectl then computes strategic merge patches from its
/// compiled-in types, as for a server without OpenAPI.
pub fn openapi_v3_doc(path: &str) -> Option<Value> {
    let (group, version, _) = openapi_group_versions().into_iter().find(|(_, _, p)| p == path)?;
    let mut paths = serde_json::Map::new();
    let params = json!([
        {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
        {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
        {"name": "dryRun", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
    ]);
    for r in ALL.iter().filter(|r| r.group == group && r.version == version) {
        let prefix = if group.is_empty() {
            format!("/api/{version}")
        } else {
            format!("/apis/{group}/{version}")
        };
        let item = if r.namespaced {
            format!("{prefix}/namespaces/{{namespace}}/{}/{{name}}", r.plural)
        } else {
            format!("{prefix}/{}/{{name}}", r.plural)
        };
        let body = json!({"schema": {"type": "object"}});
        paths.insert(
            item,
            json!({"patch": {
                "operationId": format!("patch{}", r.kind),
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": r.kind},
                "parameters": params,
                "requestBody": {"content": {
                    "application/json-patch+json": body,
                    "application/merge-patch+json": body,
                    "application/apply-patch+yaml": body,
                }},
                "responses": {"200": {"description": "OK"}},
            }}),
        );
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0-xproxy-test"},
        "paths": paths,
        "components": {"schemas": {}},
    }))
}
