//! PATCH bodies: JSON merge patch (RFC 7386), a strategic merge patch good
//! enough for kubectl's client-side apply on the served types, and JSON
//! patch (RFC 6902).

use serde_json::{Map, Value};

use super::resources::{self, ResourceType};

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else { unreachable!() };
    for (k, v) in patch {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// Strategic merge patch: JSON merge patch, except that the lists
/// [`resources::merge_key`] names merge element by element on their key,
/// and kubectl's directives (`$patch`, `$setElementOrder/`, `$retainKeys`,
/// `$deleteFromPrimitiveList/`) are obeyed.
pub fn strategic_merge_patch(resource: &ResourceType, target: &mut Value, patch: &Value) -> Result<(), String> {
    smp_value(resource, target, patch, "")
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// A copy of `v` without `$` directive keys (for values that are inserted
/// rather than merged).
fn strip_directives(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(strip_directives).collect()),
        other => other.clone(),
    }
}

fn smp_value(resource: &ResourceType, target: &mut Value, patch: &Value, path: &str) -> Result<(), String> {
    let Value::Object(pm) = patch else {
        *target = patch.clone();
        return Ok(());
    };
    match pm.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            *target = strip_directives(patch);
            return Ok(());
        }
        Some("delete") => {
            *target = Value::Null;
            return Ok(());
        }
        Some(other) if other != "merge" => return Err(format!("unknown $patch directive {other:?}")),
        _ => {}
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else { unreachable!() };
    for (k, v) in pm {
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Value::Array(gone)) = (t.get_mut(field), v) {
                list.retain(|x| !gone.contains(x));
            }
            continue;
        }
        if k.starts_with('$') {
            continue;
        }
        let sub = join(path, k);
        match v {
            Value::Null => {
                t.remove(k);
            }
            Value::Array(items) => {
                let merged = match (resources::merge_key(resource, &sub), t.get_mut(k)) {
                    (Some(key), Some(Value::Array(existing))) => {
                        merge_list(resource, existing, items, key, &sub)?;
                        None
                    }
                    _ => Some(Value::Array(
                        items
                            .iter()
                            .filter(|i| i.get("$patch").is_none())
                            .map(strip_directives)
                            .collect(),
                    )),
                };
                if let Some(value) = merged {
                    t.insert(k.clone(), value);
                }
            }
            Value::Object(_) => {
                let slot = t.entry(k.clone()).or_insert(Value::Null);
                smp_value(resource, slot, v, &sub)?;
                if slot.is_null() {
                    t.remove(k);
                }
            }
            scalar => {
                t.insert(k.clone(), scalar.clone());
            }
        }
    }
    // Orders from `$setElementOrder/FIELD` apply after the merge.
    for (k, order) in pm {
        let Some(field) = k.strip_prefix("$setElementOrder/") else {
            continue;
        };
        let (Some(key), Some(Value::Array(list)), Value::Array(order)) = (
            resources::merge_key(resource, &join(path, field)),
            t.get_mut(field),
            order,
        ) else {
            continue;
        };
        let rank = |item: &Value| -> usize {
            let id = if key.is_empty() { Some(item) } else { item.get(key) };
            order
                .iter()
                .position(|o| {
                    let oid = if key.is_empty() { Some(o) } else { o.get(key) };
                    oid == id
                })
                .unwrap_or(usize::MAX)
        };
        list.sort_by_key(rank);
    }
    if let Some(Value::Array(keep)) = pm.get("$retainKeys") {
        t.retain(|k, _| keep.iter().any(|x| x.as_str() == Some(k)));
    }
    Ok(())
}

fn merge_list(
    resource: &ResourceType,
    existing: &mut Vec<Value>,
    items: &[Value],
    key: &str,
    path: &str,
) -> Result<(), String> {
    if items
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"))
    {
        *existing = items
            .iter()
            .filter(|i| i.get("$patch").is_none())
            .map(strip_directives)
            .collect();
        return Ok(());
    }
    if key.is_empty() {
        // A set of scalars.
        for item in items {
            if !existing.contains(item) {
                existing.push(item.clone());
            }
        }
        return Ok(());
    }
    for item in items {
        let id = item.get(key);
        let pos = existing.iter().position(|e| id.is_some() && e.get(key) == id);
        if item.get("$patch").and_then(Value::as_str) == Some("delete") {
            if let Some(p) = pos {
                existing.remove(p);
            }
            continue;
        }
        match pos {
            Some(p) => smp_value(resource, &mut existing[p], item, path)?,
            None => existing.push(strip_directives(item)),
        }
    }
    Ok(())
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// The parent container of a JSON pointer and the last token.
fn parent<'a>(doc: &'a mut Value, pointer: &str) -> Result<(&'a mut Value, String), String> {
    let (head, last) = pointer
        .rsplit_once('/')
        .ok_or_else(|| format!("invalid JSON pointer {pointer:?}"))?;
    let parent = if head.is_empty() {
        doc
    } else {
        doc.pointer_mut(head)
            .ok_or_else(|| format!("path {head:?} does not exist"))?
    };
    Ok((parent, unescape(last)))
}

fn index(list: &[Value], token: &str, allow_end: bool) -> Result<usize, String> {
    if allow_end && token == "-" {
        return Ok(list.len());
    }
    let i: usize = token.parse().map_err(|_| format!("invalid array index {token:?}"))?;
    let max = if allow_end {
        list.len()
    } else {
        list.len().saturating_sub(1)
    };
    if i > max || (!allow_end && list.is_empty()) {
        return Err(format!("array index {i} out of range"));
    }
    Ok(i)
}

fn add(doc: &mut Value, pointer: &str, value: Value) -> Result<(), String> {
    if pointer.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = parent(doc, pointer)?;
    match parent {
        Value::Object(m) => {
            m.insert(last, value);
            Ok(())
        }
        Value::Array(a) => {
            let i = index(a, &last, true)?;
            a.insert(i, value);
            Ok(())
        }
        _ => Err(format!("cannot add at {pointer:?}: parent is not a container")),
    }
}

fn remove(doc: &mut Value, pointer: &str) -> Result<Value, String> {
    let (parent, last) = parent(doc, pointer)?;
    match parent {
        Value::Object(m) => m
            .remove(&last)
            .ok_or_else(|| format!("path {pointer:?} does not exist")),
        Value::Array(a) => {
            let i = index(a, &last, false)?;
            Ok(a.remove(i))
        }
        _ => Err(format!("cannot remove {pointer:?}")),
    }
}

/// RFC 6902 JSON patch.
pub fn json_patch(doc: &mut Value, ops: &Value) -> Result<(), String> {
    let ops = ops.as_array().ok_or("a JSON patch must be an array of operations")?;
    for op in ops {
        let name = op.get("op").and_then(Value::as_str).ok_or("operation without \"op\"")?;
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or("operation without \"path\"")?;
        let value = || op.get("value").cloned().ok_or(format!("{name} without \"value\""));
        let from = || {
            op.get("from")
                .and_then(Value::as_str)
                .ok_or(format!("{name} without \"from\""))
        };
        match name {
            "add" => add(doc, path, value()?)?,
            "remove" => {
                remove(doc, path)?;
            }
            "replace" => {
                let slot = doc.pointer_mut(path).ok_or(format!("path {path:?} does not exist"))?;
                *slot = value()?;
            }
            "move" => {
                let v = remove(doc, from()?)?;
                add(doc, path, v)?;
            }
            "copy" => {
                let v = doc
                    .pointer(from()?)
                    .cloned()
                    .ok_or(format!("path {path:?} does not exist"))?;
                add(doc, path, v)?;
            }
            "test" => {
                if doc.pointer(path) != Some(&value()?) {
                    return Err(format!("test of {path:?} failed"));
                }
            }
            other => return Err(format!("unknown JSON patch operation {other:?}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::SERVICES;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(&mut doc, &json!({"a": "z", "c": {"f": null}, "l": [3]}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));
    }

    #[test]
    fn strategic_merge_of_service_ports() {
        let mut svc = json!({"spec": {"ports": [
            {"name": "a", "port": 80, "targetPort": 8080, "protocol": "TCP"},
            {"name": "b", "port": 81, "protocol": "TCP"},
        ], "selector": {"app": "x"}}});
        // What kubectl apply sends when port 81 goes away and 80 changes
        // its target port.
        let patch = json!({"spec": {
            "$setElementOrder/ports": [{"port": 80}],
            "ports": [{"port": 80, "targetPort": 9090}, {"$patch": "delete", "port": 81}],
        }});
        strategic_merge_patch(&SERVICES, &mut svc, &patch).expect("applies");
        assert_eq!(
            svc,
            json!({"spec": {"ports": [{"name": "a", "port": 80, "targetPort": 9090, "protocol": "TCP"}],
                "selector": {"app": "x"}}})
        );
    }

    #[test]
    fn json_patch_rfc6902() {
        let mut doc = json!({"metadata": {"labels": {"a": "1"}}, "l": [1, 2]});
        json_patch(
            &mut doc,
            &json!([
                {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
                {"op": "remove", "path": "/metadata/labels/a"},
                {"op": "add", "path": "/l/-", "value": 3},
                {"op": "replace", "path": "/l/0", "value": 0},
                {"op": "test", "path": "/l/2", "value": 3},
            ]),
        )
        .expect("applies");
        assert_eq!(doc, json!({"metadata": {"labels": {"b/c": "2"}}, "l": [0, 2, 3]}));
    }
}
