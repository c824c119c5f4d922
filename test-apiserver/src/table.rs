//! `meta.k8s.io/v1` Table responses (what `kubectl get` asks for with
//! `Accept: application/json;as=Table;v=v1;g=meta.k8s.io`), with the
//! columns kubectl shows for the real server.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde_json::{Value, json};

use super::resources::ResourceType;

/// What each row carries (`includeObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Include {
    None,
    Metadata,
    Object,
}

impl Include {
    pub fn from_query(v: Option<&str>) -> Self {
        match v {
            Some("None") => Self::None,
            Some("Object") => Self::Object,
            _ => Self::Metadata,
        }
    }
}

/// Seconds since the epoch of an RFC 3339 UTC time `YYYY-MM-DDTHH:MM:SS...`.
fn parse_time(s: &str) -> Option<i64> {
    let n = |a: usize, b: usize| s.get(a..b)?.parse::<i64>().ok();
    let (y, mo, d, h, mi, se) = (n(0, 4)?, n(5, 7)?, n(8, 10)?, n(11, 13)?, n(14, 16)?, n(17, 19)?);
    // days_from_civil.
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + mi * 60 + se)
}

/// kubectl's HumanDuration.
fn human(secs: i64) -> String {
    if secs < -1 {
        return "<invalid>".into();
    }
    let s = secs.max(0);
    if s < 120 {
        return format!("{s}s");
    }
    let m = s / 60;
    if m < 10 {
        return if s % 60 == 0 {
            format!("{m}m")
        } else {
            format!("{m}m{}s", s % 60)
        };
    }
    if m < 180 {
        return format!("{m}m");
    }
    let h = m / 60;
    if h < 8 {
        return if m % 60 == 0 {
            format!("{h}h")
        } else {
            format!("{h}h{}m", m % 60)
        };
    }
    if h < 48 {
        return format!("{h}h");
    }
    if h < 24 * 8 {
        return if h % 24 == 0 {
            format!("{}d", h / 24)
        } else {
            format!("{}d{}h", h / 24, h % 24)
        };
    }
    if h < 24 * 365 * 2 {
        return format!("{}d", h / 24);
    }
    if h < 24 * 365 * 8 {
        let d = h / 24;
        return if d % 365 == 0 {
            format!("{}y", d / 365)
        } else {
            format!("{}y{}d", d / 365, d % 365)
        };
    }
    format!("{}y", h / 24 / 365)
}

fn age(obj: &Value) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    obj.pointer("/metadata/creationTimestamp")
        .and_then(Value::as_str)
        .and_then(parse_time)
        .map_or_else(|| "<unknown>".into(), |t| human(now - t))
}

fn s<'a>(obj: &'a Value, ptr: &str) -> &'a str {
    obj.pointer(ptr).and_then(Value::as_str).unwrap_or("")
}

fn arr<'a>(obj: &'a Value, ptr: &str) -> &'a [Value] {
    obj.pointer(ptr).and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

fn or_none(v: String) -> String {
    if v.is_empty() { "<none>".into() } else { v }
}

/// Column names (with their types) and the cells of one object.
fn columns(r: &ResourceType) -> Vec<(&'static str, &'static str, i32)> {
    match r.plural {
        "services" => vec![
            ("Name", "string", 0),
            ("Type", "string", 0),
            ("Cluster-IP", "string", 0),
            ("External-IP", "string", 0),
            ("Port(s)", "string", 0),
            ("Age", "string", 0),
            ("Selector", "string", 1),
        ],
        "nodes" => vec![
            ("Name", "string", 0),
            ("Status", "string", 0),
            ("Roles", "string", 0),
            ("Age", "string", 0),
            ("Version", "string", 0),
            ("Internal-IP", "string", 1),
        ],
        "namespaces" => vec![("Name", "string", 0), ("Status", "string", 0), ("Age", "string", 0)],
        "endpoints" => vec![("Name", "string", 0), ("Endpoints", "string", 0), ("Age", "string", 0)],
        "endpointslices" => vec![
            ("Name", "string", 0),
            ("AddressType", "string", 0),
            ("Ports", "string", 0),
            ("Endpoints", "string", 0),
            ("Age", "string", 0),
        ],
        "deployments" => vec![
            ("Name", "string", 0),
            ("Ready", "string", 0),
            ("Up-to-date", "integer", 0),
            ("Available", "integer", 0),
            ("Age", "string", 0),
        ],
        _ => vec![("Name", "string", 0), ("Age", "string", 0)],
    }
}

fn first_three(list: Vec<String>) -> String {
    let n = list.len();
    if n > 3 {
        format!("{} + {} more...", list[..3].join(","), n - 3)
    } else {
        or_none(list.join(","))
    }
}

fn cells(r: &ResourceType, o: &Value) -> Vec<Value> {
    let name = json!(s(o, "/metadata/name"));
    match r.plural {
        "services" => {
            let ty = s(o, "/spec/type");
            let ports: Vec<String> = arr(o, "/spec/ports")
                .iter()
                .map(|p| {
                    let port = p["port"].as_u64().unwrap_or(0);
                    let proto = p["protocol"].as_str().unwrap_or("TCP");
                    match p.get("nodePort").and_then(Value::as_u64) {
                        Some(np) => format!("{port}:{np}/{proto}"),
                        None => format!("{port}/{proto}"),
                    }
                })
                .collect();
            let mut external: Vec<String> = arr(o, "/spec/externalIPs")
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            external.extend(arr(o, "/status/loadBalancer/ingress").iter().filter_map(|i| {
                i.get("ip")
                    .or(i.get("hostname"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            }));
            let external = match (ty, external.is_empty()) {
                ("ExternalName", _) => s(o, "/spec/externalName").to_string(),
                ("LoadBalancer", true) => "<pending>".into(),
                (_, true) => "<none>".into(),
                (_, false) => external.join(","),
            };
            let selector: Vec<String> = o
                .pointer("/spec/selector")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                        .collect()
                })
                .unwrap_or_default();
            vec![
                name,
                json!(ty),
                json!(or_none(s(o, "/spec/clusterIP").to_string())),
                json!(external),
                json!(or_none(ports.join(","))),
                json!(age(o)),
                json!(or_none(selector.join(","))),
            ]
        }
        "nodes" => {
            let ready = arr(o, "/status/conditions")
                .iter()
                .find(|c| c["type"] == "Ready")
                .map_or("Unknown", |c| if c["status"] == "True" { "Ready" } else { "NotReady" });
            let roles: Vec<String> = o
                .pointer("/metadata/labels")
                .and_then(Value::as_object)
                .map(|m| {
                    m.keys()
                        .filter_map(|k| k.strip_prefix("node-role.kubernetes.io/").map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            let internal = arr(o, "/status/addresses")
                .iter()
                .find(|a| a["type"] == "InternalIP")
                .and_then(|a| a["address"].as_str())
                .unwrap_or("<none>");
            vec![
                name,
                json!(ready),
                json!(or_none(roles.join(","))),
                json!(age(o)),
                json!(s(o, "/status/nodeInfo/kubeletVersion")),
                json!(internal),
            ]
        }
        "namespaces" => vec![name, json!(s(o, "/status/phase")), json!(age(o))],
        "endpoints" => {
            let mut eps = Vec::new();
            for subset in arr(o, "/subsets") {
                for a in arr(subset, "/addresses") {
                    for p in arr(subset, "/ports") {
                        eps.push(format!(
                            "{}:{}",
                            a["ip"].as_str().unwrap_or(""),
                            p["port"].as_u64().unwrap_or(0)
                        ));
                    }
                }
            }
            vec![name, json!(first_three(eps)), json!(age(o))]
        }
        "endpointslices" => {
            let ports: Vec<String> = arr(o, "/ports")
                .iter()
                .map(|p| {
                    p.get("port")
                        .and_then(Value::as_u64)
                        .map_or("<unset>".into(), |p| p.to_string())
                })
                .collect();
            let addrs: Vec<String> = arr(o, "/endpoints")
                .iter()
                .flat_map(|e| {
                    arr(e, "/addresses")
                        .iter()
                        .filter_map(|a| a.as_str().map(str::to_string))
                })
                .collect();
            vec![
                name,
                json!(s(o, "/addressType")),
                json!(or_none(ports.join(","))),
                json!(first_three(addrs)),
                json!(age(o)),
            ]
        }
        "deployments" => {
            let n = |p: &str| o.pointer(p).and_then(Value::as_i64).unwrap_or(0);
            let want = o.pointer("/spec/replicas").and_then(Value::as_i64).unwrap_or(1);
            vec![
                name,
                json!(format!("{}/{want}", n("/status/readyReplicas"))),
                json!(n("/status/updatedReplicas")),
                json!(n("/status/availableReplicas")),
                json!(age(o)),
            ]
        }
        _ => vec![name, json!(age(o))],
    }
}

fn row(r: &ResourceType, o: &Value, include: Include) -> Value {
    let mut row = json!({"cells": cells(r, o)});
    match include {
        Include::None => {}
        Include::Metadata => {
            row["object"] = json!({
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": o.get("metadata").cloned().unwrap_or(Value::Null),
            });
        }
        Include::Object => {
            let mut full = o.clone();
            full["kind"] = json!(r.kind);
            full["apiVersion"] = json!(r.api_version());
            row["object"] = full;
        }
    }
    row
}

/// A Table of objects (`rv` is the list's resourceVersion, if a list).
pub fn table(r: &ResourceType, objects: &[Value], rv: Option<u64>, include: Include) -> Value {
    let defs: Vec<Value> = columns(r)
        .into_iter()
        .map(|(name, ty, priority)| {
            let mut d = json!({"name": name, "type": ty, "format": "", "description": name, "priority": priority});
            if name == "Name" {
                d["format"] = json!("name");
            }
            d
        })
        .collect();
    let metadata = rv.map_or_else(|| json!({}), |rv| json!({"resourceVersion": rv.to_string()}));
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": defs,
        "rows": objects.iter().map(|o| row(r, o, include)).collect::<Vec<_>>(),
    })
}

/// A chunk of watch events with each object turned into a one-row Table
/// (bookmarks and errors stay as they are).
pub fn watch_chunk_as_table(r: &ResourceType, chunk: &Bytes, include: Include) -> Bytes {
    let mut out = Vec::with_capacity(chunk.len());
    for line in chunk.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let Ok(mut ev) = serde_json::from_slice::<Value>(line) else {
            out.extend_from_slice(line);
            out.push(b'\n');
            continue;
        };
        if matches!(ev["type"].as_str(), Some("ADDED" | "MODIFIED" | "DELETED")) {
            let rv = ev
                .pointer("/object/metadata/resourceVersion")
                .and_then(Value::as_str)
                .and_then(|v| v.parse().ok());
            ev["object"] = table(r, std::slice::from_ref(&ev["object"]), rv, include);
        }
        out.extend_from_slice(&serde_json::to_vec(&ev).unwrap_or_default());
        out.push(b'\n');
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_times() {
        assert_eq!(human(5), "5s");
        assert_eq!(human(150), "2m30s");
        assert_eq!(human(3600 * 5), "5h");
        assert_eq!(human(86_400 * 3), "3d");
        assert_eq!(parse_time("1970-01-02T00:00:01Z"), Some(86_401));
        assert_eq!(parse_time("2024-03-01T00:00:00Z"), Some(1_709_251_200));
    }
}
