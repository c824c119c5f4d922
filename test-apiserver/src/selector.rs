//! Label and field selectors, with the grammar of the real API server:
//! `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)` for labels;
//! `path=v`, `path==v`, `path!=v` for fields (any dotted path of the object,
//! e.g. `metadata.name`).

use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

/// A parsed field selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

/// Splits on commas that are not inside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 316
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_set(rest: &str) -> Result<Vec<String>, String> {
    let inner = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("expected a parenthesised set, found {rest:?}"))?;
    let values: Vec<String> = inner.split(',').map(|v| v.trim().to_string()).collect();
    if let Some(bad) = values.iter().find(|v| !valid_value(v)) {
        return Err(format!("invalid label value: {bad:?}"));
    }
    Ok(values)
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for part in split_top(s) {
            let part = part.trim();
            let req = if let Some(key) = part.strip_prefix('!') {
                Requirement::NotExists(key.trim().to_string())
            } else if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Equals(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Equals(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                Requirement::NotIn(k.trim().to_string(), parse_set(rest)?)
            } else if let Some((k, rest)) = part.split_once(" in ") {
                Requirement::In(k.trim().to_string(), parse_set(rest)?)
            } else {
                Requirement::Exists(part.to_string())
            };
            let (key, value) = match &req {
                Requirement::Equals(k, v) | Requirement::NotEquals(k, v) => (k, Some(v)),
                Requirement::Exists(k)
                | Requirement::NotExists(k)
                | Requirement::In(k, _)
                | Requirement::NotIn(k, _) => (k, None),
            };
            if !valid_key(key) {
                return Err(format!("invalid label key {key:?} in selector {s:?}"));
            }
            if let Some(v) = value.filter(|v| !valid_value(v)) {
                return Err(format!("invalid label value {v:?} in selector {s:?}"));
            }
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object (its `metadata.labels`) matches.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
        })
    }
}

/// The string form of the field at a dotted path, as field selectors compare
/// it ("" when absent).
fn field_value(object: &Value, path: &str) -> String {
    let mut cur = object;
    for seg in path.split('.') {
        match cur.get(seg) {
            Some(v) => cur = v,
            None => return String::new(),
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

impl FieldSelector {
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for part in s.split(',') {
            let (field, equal, value) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!("invalid field selector {s:?}: {part:?} is not FIELD=VALUE"));
            };
            let field = field.trim();
            if field.is_empty() || !field.chars().all(|c| c.is_ascii_alphanumeric() || c == '.') {
                return Err(format!("invalid field selector {s:?}: bad field {field:?}"));
            }
            reqs.push((field.to_string(), equal, value.trim().to_string()));
        }
        Ok(Self(reqs))
    }

    /// A selector for one name (`metadata.name=NAME`).
    pub fn name(name: &str) -> Self {
        Self(vec![("metadata.name".into(), true, name.into())])
    }

    pub fn and(mut self, other: Self) -> Self {
        self.0.extend(other.0);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.0
            .iter()
            .all(|(field, equal, value)| (field_value(object, field) == *value) == *equal)
    }
}

/// Both selectors of a list or watch request.
#[derive(Debug, Clone, Default)]
pub struct Selectors {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Selectors {
    pub fn matches(&self, object: &Value) -> bool {
        self.labels.matches(object) && self.fields.matches(object)
    }

    /// Whether every object matches.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}})
    }

    #[test]
    fn label_selectors() {
        let headless = svc(json!({"service.kubernetes.io/headless": ""}));
        let proxied = svc(json!({"service.kubernetes.io/service-proxy-name": "other", "app": "x"}));
        let plain = svc(json!({"app": "nginx"}));
        let sel = LabelSelector::parse("!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless")
            .expect("parses");
        assert!(!sel.matches(&headless));
        assert!(!sel.matches(&proxied));
        assert!(sel.matches(&plain));
        let sel = LabelSelector::parse("app in (nginx, web),app!=x").expect("parses");
        assert!(sel.matches(&plain));
        assert!(!sel.matches(&proxied));
        assert!(LabelSelector::parse("app notin (x)").expect("parses").matches(&plain));
        assert!(LabelSelector::parse("app").expect("parses").matches(&plain));
        assert!(!LabelSelector::parse("app==web").expect("parses").matches(&plain));
        assert!(LabelSelector::parse("a b=c").is_err());
    }

    #[test]
    fn field_selectors() {
        let obj = json!({"metadata": {"name": "node-1"}, "spec": {"unschedulable": true}});
        assert!(
            FieldSelector::parse("metadata.name=node-1")
                .expect("parses")
                .matches(&obj)
        );
        assert!(
            !FieldSelector::parse("metadata.name!=node-1")
                .expect("parses")
                .matches(&obj)
        );
        assert!(
            FieldSelector::parse("spec.unschedulable==true")
                .expect("parses")
                .matches(&obj)
        );
        assert!(FieldSelector::parse("metadata.name").is_err());
    }
}
