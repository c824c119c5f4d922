//! One manifest file's text turned into the Services, EndpointSlices and
//! Nodes in it.
//!
//! A file is a stream of YAML documents (`.yaml`, `.yml`) or of JSON values
//! (`.json`). A document is an object, or a list of objects the way kubectl
//! writes them (`kubectl get svc,endpointslices -A -o yaml`: `v1` `List`
//! whose items carry their own kind; the typed lists `ServiceList`,
//! `EndpointSliceList`, `NodeList`, whose items may not). Objects of other
//! kinds are skipped; an object of a known kind that does not convert is
//! skipped with a [`Problem`]; text that is not YAML (or JSON) at all makes
//! the whole file unusable ([`FileError`]).

use std::path::Path;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde::{Deserialize, de::DeserializeOwned};
use serde_json::Value;
use tracing::debug;

use crate::model::Problem;

/// What one file contributed.
#[derive(Clone, Debug, Default)]
pub struct FileObjects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
}

impl FileObjects {
    /// Adds `other`'s objects after these.
    pub fn append(&mut self, mut other: Self) {
        self.services.append(&mut other.services);
        self.slices.append(&mut other.slices);
        self.nodes.append(&mut other.nodes);
    }
}

/// How a file's text is read, from its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Json,
}

impl Format {
    /// The format of a manifest file; `None` for a file that is not one.
    pub fn of(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()? {
            "yaml" | "yml" => Some(Self::Yaml),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

/// Why a whole file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read: {0}")]
    Read(#[from] std::io::Error),
    #[error("not valid YAML: {0}")]
    Yaml(#[from] serde_saphyr::Error),
    /// A document parsed alone ([`parse_yaml_document`]); the file is then
    /// parsed whole, and that verdict is the one reported.
    #[error("not valid YAML: {0}")]
    YamlDocument(#[from] serde_yaml_ng::Error),
    #[error("not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Limits on one file's YAML that still stop a pathological input (an
/// alias bomb, nesting that would exhaust the stack) but not a large
/// honest one: the count of documents is not limited, and the counts that
/// grow with the text (events, nodes, scalar bytes) are allowed as much as
/// the text could hold without aliases, which keep their own limits.
fn yaml_options(text_len: usize) -> serde_saphyr::Options {
    let defaults = serde_saphyr::Budget::default();
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_documents: usize::MAX,
            max_events: defaults.max_events.max(text_len),
            max_nodes: defaults.max_nodes.max(text_len),
            max_total_scalar_bytes: defaults.max_total_scalar_bytes.max(text_len),
        },
    }
}

/// Parses the text of the file `file` (its name, for the problems) in one
/// go: a JSON file, and a YAML file whose documents could not be parsed
/// one by one (the whole stream's error has the right line numbers).
pub fn parse(text: &str, format: Format, file: &str) -> Result<(FileObjects, Vec<Problem>), FileError> {
    let mut reading = Reading::new(file);
    match format {
        Format::Yaml => {
            let docs: Vec<Value> = serde_saphyr::from_multiple_with_options(text, yaml_options(text.len()))?;
            for (i, doc) in docs.into_iter().enumerate() {
                reading.document(doc, &document_name(file, i));
            }
        }
        Format::Json => {
            for (i, doc) in serde_json::Deserializer::from_str(text)
                .into_iter::<Value>()
                .enumerate()
            {
                reading.document(doc?, &document_name(file, i));
            }
        }
    }
    Ok(reading.finish())
}

/// Parses document `index` (0-based) of the YAML file `file`, one of
/// [`yaml_documents`]: documents are independent in YAML (anchors do not
/// cross them), so a file's documents can be parsed apart, in parallel.
///
/// A document in the plain block style goes through [`super::block`],
/// the others through libyaml's parser (`serde_yaml_ng`), which takes
/// about half the time serde-saphyr takes (at 10,000 Services x 10 endpoints, 16 MB of
/// YAML: 1.1 s against 2.2 s on one core); it refuses alias bombs too
/// (its repetition limit). A document it refuses is parsed again by
/// [`parse`], with the whole file, for serde-saphyr's verdict. Services
/// and EndpointSlices go straight to their types ([`super::direct`]).
pub fn parse_yaml_document(
    text: &str,
    file: &str,
    index: usize,
) -> Result<(FileObjects, Vec<Problem>), serde_yaml_ng::Error> {
    if let Some(objects) = super::block::objects(text).or_else(|| super::direct::objects(text)) {
        return Ok((objects, Vec::new()));
    }
    let mut reading = Reading::new(file);
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        reading.document(Value::deserialize(doc)?, &document_name(file, index));
    }
    Ok(reading.finish())
}

/// The documents of a YAML stream: split before every line that starts
/// with the document marker `---` (which YAML forbids as content at the
/// start of a line). Pieces without content (only comments, say) are left
/// out, so the numbers are those of the documents as a reader counts them.
pub fn yaml_documents(text: &str) -> Vec<&str> {
    let mut starts = vec![0];
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let marker = line
            .strip_prefix("---")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\n', '\r']));
        if marker && offset > 0 {
            starts.push(offset);
        }
        offset += line.len();
    }
    starts.push(text.len());
    starts
        .windows(2)
        .map(|w| &text[w[0]..w[1]])
        .filter(|doc| has_content(doc))
        .collect()
}

/// Whether a piece of a YAML stream holds more than markers, comments and
/// blank lines.
fn has_content(doc: &str) -> bool {
    doc.lines().any(|line| {
        let line = line.trim();
        let body = line.strip_prefix("---").unwrap_or(line).trim_start();
        !(body.is_empty() || body.starts_with('#') || line == "...")
    })
}

fn document_name(file: &str, index: usize) -> String {
    format!("{file} document {}", index + 1)
}

/// The objects and problems of one file as its documents are read.
struct Reading<'a> {
    file: &'a str,
    objects: FileObjects,
    problems: Vec<Problem>,
}

impl<'a> Reading<'a> {
    fn new(file: &'a str) -> Self {
        Self {
            file,
            objects: FileObjects::default(),
            problems: Vec::new(),
        }
    }

    fn finish(self) -> (FileObjects, Vec<Problem>) {
        (self.objects, self.problems)
    }

    /// One document, or one item of a list (`what` names it).
    fn document(&mut self, mut doc: Value, what: &str) {
        if doc.is_null() {
            return;
        }
        let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_owned();
        let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("").to_owned();
        match (api_version.as_str(), kind.as_str()) {
            ("v1", "Service") => self.push(doc, what, |o| &mut o.services),
            ("discovery.k8s.io/v1", "EndpointSlice") => self.push(doc, what, |o| &mut o.slices),
            ("v1", "Node") => self.push(doc, what, |o| &mut o.nodes),
            // kubectl's mixed list: every item says what it is.
            ("v1", "List") => {
                for (j, item) in take_items(&mut doc).into_iter().enumerate() {
                    self.document(item, &format!("{what} item {}", j + 1));
                }
            }
            ("v1", "ServiceList") => self.push_items(&mut doc, what, |o| &mut o.services),
            ("discovery.k8s.io/v1", "EndpointSliceList") => self.push_items(&mut doc, what, |o| &mut o.slices),
            ("v1", "NodeList") => self.push_items(&mut doc, what, |o| &mut o.nodes),
            _ => debug!(
                file = self.file,
                what, api_version, kind, "skipping a document of another kind"
            ),
        }
    }

    /// The items of a typed list: each one of the list's kind, whether it
    /// says so or not.
    fn push_items<K: DeserializeOwned + k8s_openapi::Resource>(
        &mut self,
        doc: &mut Value,
        what: &str,
        into: fn(&mut FileObjects) -> &mut Vec<K>,
    ) {
        for (j, item) in take_items(doc).into_iter().enumerate() {
            self.push(item, &format!("{what} item {}", j + 1), into);
        }
    }

    /// Converts `doc` to a `K` and keeps it, or reports why not.
    fn push<K: DeserializeOwned + k8s_openapi::Resource>(
        &mut self,
        doc: Value,
        what: &str,
        into: fn(&mut FileObjects) -> &mut Vec<K>,
    ) {
        match serde_json::from_value::<K>(doc) {
            Ok(object) => into(&mut self.objects).push(object),
            Err(e) => self
                .problems
                .push(Problem::new(what, format!("invalid {}: {e}", K::KIND))),
        }
    }
}

/// The `items` of a list document (none if it has no such array).
fn take_items(doc: &mut Value) -> Vec<Value> {
    match doc.get_mut("items").map(Value::take) {
        Some(Value::Array(items)) => items,
        _ => Vec::new(),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn names<K: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>>(
        objects: &[K],
    ) -> Vec<&str> {
        objects.iter().filter_map(|o| o.metadata().name.as_deref()).collect()
    }

    fn yaml(text: &str) -> (FileObjects, Vec<Problem>) {
        parse(text, Format::Yaml, "f.yaml").expect("usable")
    }

    /// What `kubectl get svc,endpointslices,deploy -o yaml` writes: keys in
    /// alphabetical order, so an EndpointSlice's `kind` comes after its
    /// endpoints.
    const KUBECTL_LIST: &str = "\
apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: default}
  spec: {clusterIP: 10.96.0.20, ports: [{port: 80, protocol: TCP, targetPort: 8080}]}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses: [10.244.0.5]
    conditions: {ready: true}
  kind: EndpointSlice
  metadata:
    labels: {kubernetes.io/service-name: web}
    name: web-abc12
    namespace: default
  ports: [{port: 8080, protocol: TCP}]
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: web}
kind: List
metadata:
  resourceVersion: \"\"
";

    /// A `ServiceList`, an `EndpointSliceList` and a `NodeList`, items
    /// with and without their kind.
    pub(in crate::source::manifest) const TYPED_LISTS: &str = "\
apiVersion: v1
kind: ServiceList
items:
- metadata: {name: a}
  spec: {clusterIP: 10.96.0.1}
- apiVersion: v1
  kind: Service
  metadata: {name: b}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
items:
- {addressType: IPv4, metadata: {name: a-1}, endpoints: []}
---
apiVersion: v1
kind: NodeList
items:
- metadata: {name: node-a}
";

    #[test]
    fn a_v1_list_gives_its_items_and_skips_other_kinds() {
        let (objects, problems) = yaml(KUBECTL_LIST);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(names(&objects.services), ["web"]);
        assert_eq!(names(&objects.slices), ["web-abc12"]);
    }

    #[test]
    fn typed_lists_give_their_items_with_or_without_a_kind() {
        let text = TYPED_LISTS;
        let (objects, problems) = yaml(text);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(names(&objects.services), ["a", "b"]);
        assert_eq!(names(&objects.slices), ["a-1"]);
        assert_eq!(names(&objects.nodes), ["node-a"]);
    }

    #[test]
    fn a_bad_item_is_skipped_alone_and_named_by_its_place() {
        let text = "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: a}\n- spec: {ports: 12}\n";
        let (objects, problems) = yaml(text);
        assert_eq!(names(&objects.services), ["a"]);
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].object, "f.yaml document 1 item 2");
        assert!(problems[0].reason.starts_with("invalid Service"), "{problems:?}");
    }

    #[test]
    fn kubectl_json_and_a_stream_of_json_objects() {
        let list: Value = serde_saphyr::from_str(KUBECTL_LIST).expect("the list as a value");
        let (objects, problems) = parse(&list.to_string(), Format::Json, "f.json").expect("usable");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!((objects.services.len(), objects.slices.len()), (1, 1));
        let stream = format!("{}\n{}", list["items"][0], list["items"][1]);
        let (objects, _) = parse(&stream, Format::Json, "f.json").expect("usable");
        assert_eq!((objects.services.len(), objects.slices.len()), (1, 1));
        let broken = parse("{\"kind\": ", Format::Json, "f.json");
        assert!(matches!(broken, Err(FileError::Json(_))), "{broken:?}");
    }

    /// The budget is lifted for honest size, not for aliases: a "billion
    /// laughs" document is still refused before it is expanded.
    #[test]
    fn an_alias_bomb_is_refused() {
        let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for level in b'b'..=b'j' {
            let prev = char::from(level - 1);
            let refs = format!("*{prev}, ").repeat(10);
            text.push_str(&format!(
                "{}: &{} [{}]\n",
                char::from(level),
                char::from(level),
                refs.trim_end_matches(", ")
            ));
        }
        let refused = parse(&text, Format::Yaml, "bomb.yaml");
        assert!(matches!(refused, Err(FileError::Yaml(_))), "{refused:?}");
        // libyaml's path, a document at a time, refuses it as well.
        let refused = parse_yaml_document(&text, "bomb.yaml", 0);
        assert!(refused.is_err(), "{refused:?}");
    }

    #[test]
    fn documents_are_split_at_markers_only() {
        let text = "# a comment before anything\n---\na: 1\nb: |\n  --- not a marker, indented\n--- {c: 2}\n---\n# only a comment\n...\n---\nd: 3\n";
        let docs = yaml_documents(text);
        assert_eq!(docs.len(), 3, "{docs:?}");
        assert!(docs[0].contains("not a marker"), "{docs:?}");
        assert_eq!(docs[1], "--- {c: 2}\n");
        assert_eq!(docs[2], "---\nd: 3\n");
    }

    /// A stream the document splitter cannot cut (a directive belongs to the
    /// document after it) is parsed whole, as one stream.
    #[test]
    fn a_directive_between_documents() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n...\n%YAML 1.2\n---\n\
                    apiVersion: v1\nkind: Service\nmetadata: {name: b}\n";
        let pieces = yaml_documents(text);
        assert!(parse_yaml_document(pieces[0], "f.yaml", 0).is_err(), "{pieces:?}");
        let (objects, problems) = yaml(text);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(names(&objects.services), ["a", "b"]);
    }

    #[test]
    fn formats_by_extension() {
        assert_eq!(Format::of(Path::new("a/b.yml")), Some(Format::Yaml));
        assert_eq!(Format::of(Path::new("b.yaml")), Some(Format::Yaml));
        assert_eq!(Format::of(Path::new("b.json")), Some(Format::Json));
        assert_eq!(Format::of(Path::new("notes.txt")), None);
        assert_eq!(Format::of(Path::new("yaml")), None);
    }
}
