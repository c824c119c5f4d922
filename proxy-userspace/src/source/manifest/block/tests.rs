//! The block-style path reads what it accepts exactly as the general path
//! does, and refuses what it does not cover.

use serde_json::Value;

use super::*;
use crate::source::manifest::{
    direct::tests::assert_path_agrees,
    parse::{tests::TYPED_LISTS, yaml_documents},
};

fn assert_same_as_general(text: &str) {
    assert_path_agrees("block", objects, text);
}

/// The JSON written for `text` (which must be in the style).
fn json(text: &str) -> Value {
    let mut out = String::new();
    to_json(text, &mut out).unwrap_or_else(|| panic!("refused:\n{text}"));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// What the bench's generator writes: every scalar quoted, an item's `-`
/// alone on its line.
const GENERATED: &str = "\
---
apiVersion: \"v1\"
kind: \"Service\"
metadata:
  labels:
    app: \"svc-000000\"
  name: \"svc-000000\"
  namespace: \"default\"
spec:
  clusterIP: \"10.96.0.10\"
  ports:
    -
      nodePort: 30000
      port: 80
      protocol: \"TCP\"
      targetPort: 80
  selector:
    app: \"svc-000000\"
  type: \"NodePort\"
";

const GENERATED_SLICE: &str = "\
---
addressType: \"IPv4\"
apiVersion: \"discovery.k8s.io/v1\"
endpoints:
  -
    addresses:
      - \"10.166.0.1\"
    conditions:
      ready: true
    nodeName: \"xproxy-node\"
  -
    addresses:
      - \"10.167.0.1\"
    conditions:
      ready: false
kind: \"EndpointSlice\"
metadata:
  labels:
    kubernetes.io/service-name: \"svc-000000\"
  name: \"svc-000000-abcde\"
  namespace: \"default\"
ports:
  -
    port: 80
    protocol: \"TCP\"
";

/// What kubectl writes: plain scalars, sequences at their key's column,
/// `{}` for an empty object, comments.
const KUBECTL: &str = "\
apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    annotations:
      example.com/note: 'it''s #1: \"quoted\"'
    creationTimestamp: \"2026-12-01T10:00:00Z\"
    labels:
      app.kubernetes.io/name: web
      version: \"1.0\"
    name: web   # a comment
    namespace: default
  spec:
    clusterIP: 10.96.0.20
    clusterIPs:
    - 10.96.0.20
    internalTrafficPolicy: Cluster
    ipFamilies:
    - IPv4
    ports:
    - name: http
      port: 80
      protocol: TCP
      targetPort: http
    - name: dns
      port: 53
      protocol: UDP
      targetPort: 5353
    selector:
      app: web
    sessionAffinity: None
    type: ClusterIP
  status:
    loadBalancer: {}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses:
    - 10.244.0.5
    conditions:
      ready: true
      serving: true
      terminating: false
    nodeName: node-a
    targetRef:
      kind: Pod
      name: web-1
      namespace: default
    zone: zone-a
  - addresses:
    - 10.244.0.6
    conditions:
      ready: false
    hints: null
  kind: EndpointSlice
  metadata:
    labels:
      kubernetes.io/service-name: web
    name: web-abc12
    namespace: default
  ports:
  - name: http
    port: 8080
    protocol: TCP
kind: List
metadata:
  resourceVersion: \"\"
";

#[test]
fn generated_and_kubectl_documents_read_as_the_general_path_reads_them() {
    assert_same_as_general(GENERATED);
    assert_same_as_general(GENERATED_SLICE);
    assert_same_as_general(KUBECTL);
    for list in &yaml_documents(TYPED_LISTS)[..2] {
        // Flow mappings: not this path's.
        assert!(objects(list).is_none(), "{list}");
    }
    assert_same_as_general("apiVersion: v1\nkind: Service\nmetadata:\nspec:\n");
    assert_same_as_general("apiVersion: v1\nkind: Service\nmetadata: null\nspec: ~\n");
}

#[test]
fn the_json_of_the_block_forms() {
    let text = "\
a: 1
b:
c:
  - x
  -
  - \"y\\u00e9\\\"\"
  -
    d: -2
    e: true
f:
- g: 'h'
  i: [] # empty
j: {}
k: 10.96.0.1
l: a#b # comment
";
    let expected = serde_json::json!({
        "a": 1, "b": null, "c": ["x", null, "y\u{e9}\"", {"d": -2, "e": true}],
        "f": [{"g": "h", "i": []}], "j": {}, "k": "10.96.0.1", "l": "a#b"
    });
    assert_eq!(json(text), expected);
    assert_eq!(json("---\n# only\n\nz:\n"), serde_json::json!({"z": null}));
    assert_eq!(json("a: 1\r\nb: x\r\n"), serde_json::json!({"a": 1, "b": "x"}));
}

/// What this path does not read as every YAML reader would is left to
/// libyaml's.
#[test]
fn other_forms_are_refused() {
    for text in [
        "a: &x 1\nb: *x\n",
        "a: !!str 1\n",
        "a: |\n  text\n",
        "a: >-\n  text\n",
        "a: [1, 2]\n",
        "a: {b: 1}\n",
        "a: plain\n  continued\n",
        "a: \"quoted\n  on two lines\"\n",
        "a: \"\\x41\"\n",
        "a: 0x1F\n",
        "a: 0o17\n",
        "a: 007\n",
        "a: 1.5\n",
        "a: 1e3\n",
        "a: .inf\n",
        "a: +1\n",
        "a: 1_000\n",
        "a: 1:30\n",
        "a: yes\n",
        "a: Off\n",
        "a: nan\n",
        "a: -b\n",
        "a: b: c\n",
        "a:\tb\n",
        "a: b\rc: d\n",
        "a: 1\na: 2\n",
        "\"a\\n\": 1\n",
        "true: 1\n",
        "1: a\n",
        "? a\n: b\n",
        "a: 1\n  b: 2\n",
        "a:\n    b: 1\n  c: 2\n",
        "- a\nb: 1\n",
        "- a\n- - b\n",
        "just a scalar\n",
        "[1, 2]\n",
        "--- {a: 1}\n",
        "a: 1\n...\n",
        "%YAML 1.2\n---\na: 1\n",
        "",
    ] {
        let mut out = String::new();
        assert!(to_json(text, &mut out).is_none(), "accepted:\n{text}\nas {out}");
    }
}

/// A document of the style that is not a Service or an EndpointSlice
/// (a Node, another kind, a field of the wrong type) is left to the
/// other paths, which know what to report.
#[test]
fn other_kinds_and_bad_fields_are_left_to_the_other_paths() {
    for text in [
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: web\n",
        "apiVersion: v1\nkind: Service\nspec:\n  ports: 12\n",
        "apiVersion: v1\nkind: Service\nmetadata:\n  labels:\n    a: 1\n",
    ] {
        assert!(objects(text).is_none(), "{text}");
    }
}
