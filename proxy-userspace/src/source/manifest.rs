//! `--manifests DIR`: Service and EndpointSlice YAML files, reloaded when
//! they change.
//!
//! A `v1` `Node` document named like this node stands for this node's Node
//! object, as the API source watches it: its `topology.kubernetes.io/zone`
//! label is the node's zone for topology hints, its addresses give the
//! node IPs when `--node-ip` is not set (see [`ManifestDir::node`]).
//!
//! Every `.yaml`, `.yml` and `.json` file in the directory is read as a
//! multi-document stream. Documents of other kinds (a Deployment in the same
//! file, say) are skipped. A file that cannot be parsed keeps what it
//! contributed before, so a half-saved edit never takes Services down.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::debug;

use super::{SourceEvent, Update};
use crate::model::Problem;

/// What one file contributed.
#[derive(Clone, Debug, Default)]
struct FileObjects {
    services: Vec<Service>,
    slices: Vec<EndpointSlice>,
    nodes: Vec<Node>,
}

/// Name, length and modification time of every manifest file: when it
/// changes, the directory is read again.
type Fingerprint = Vec<(PathBuf, u64, Option<SystemTime>)>;

/// A complete reading of the directory: every Service, every EndpointSlice,
/// and what could not be used.
pub type Reading = (Vec<Service>, Vec<EndpointSlice>, Vec<Problem>);

/// How often the directory is checked for changes.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

pub struct ManifestDir {
    dir: PathBuf,
    files: BTreeMap<PathBuf, FileObjects>,
    fingerprint: Option<Fingerprint>,
    /// This node's name: the Node document it looks for.
    node_name: Option<String>,
}

impl ManifestDir {
    pub fn new(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            anyhow::bail!(
                "manifest directory {} does not exist or is not a directory",
                dir.display()
            );
        }
        Ok(Self {
            dir: dir.to_owned(),
            files: BTreeMap::new(),
            fingerprint: None,
            node_name: None,
        })
    }

    /// Looks for the Node document named `name` (this node's).
    #[must_use]
    pub fn for_node(mut self, name: &str) -> Self {
        self.node_name = Some(name.to_owned());
        self
    }

    /// This node's Node document as of the last reading, if there is one
    /// (the first of that name).
    pub fn node(&self) -> Option<&Node> {
        let name = self.node_name.as_deref()?;
        self.files
            .values()
            .flat_map(|f| &f.nodes)
            .find(|n| n.metadata.name.as_deref() == Some(name))
    }

    fn manifest_files(&self) -> Result<Vec<PathBuf>> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&self.dir).with_context(|| format!("reading {}", self.dir.display()))? {
            let path = entry?.path();
            let is_manifest = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
            if is_manifest && path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        Ok(files)
    }

    fn current_fingerprint(&self) -> Result<Fingerprint> {
        Ok(self
            .manifest_files()?
            .into_iter()
            .map(|p| {
                let meta = std::fs::metadata(&p).ok();
                let len = meta.as_ref().map_or(0, std::fs::Metadata::len);
                let mtime = meta.and_then(|m| m.modified().ok());
                (p, len, mtime)
            })
            .collect())
    }

    /// Reads the directory if it changed since the last call. Returns the
    /// complete lists of Services and EndpointSlices, and the problems met.
    pub fn reload_if_changed(&mut self) -> Result<Option<Reading>> {
        let fingerprint = self.current_fingerprint()?;
        if self.fingerprint.as_ref() == Some(&fingerprint) {
            return Ok(None);
        }
        self.fingerprint = Some(fingerprint.clone());
        let mut problems = Vec::new();
        let mut files = BTreeMap::new();
        for (path, _, _) in fingerprint {
            let parsed = std::fs::read_to_string(&path)
                .map_err(|e| Problem::new(&path.display().to_string(), format!("cannot read: {e}")))
                .and_then(|text| parse_manifest(&path, &text, &mut problems));
            match parsed {
                Ok(objects) => {
                    files.insert(path, objects);
                }
                Err(problem) => {
                    problems.push(problem);
                    // Keep the last good contents of a file that broke.
                    if let Some(previous) = self.files.remove(&path) {
                        files.insert(path, previous);
                    }
                }
            }
        }
        self.files = files;
        let services = self.files.values().flat_map(|f| f.services.iter().cloned()).collect();
        let slices = self.files.values().flat_map(|f| f.slices.iter().cloned()).collect();
        Ok(Some((services, slices, problems)))
    }

    /// Polls the directory and sends a full snapshot whenever it changes,
    /// starting with the first one, until the receiver goes away.
    pub fn spawn(mut self, events: mpsc::Sender<SourceEvent>) {
        tokio::spawn(async move {
            loop {
                match self.reload_if_changed() {
                    Ok(Some((services, slices, problems))) => {
                        debug!(services = services.len(), slices = slices.len(), "manifests loaded");
                        let node: Vec<Node> = self.node().cloned().into_iter().collect();
                        let sent = async {
                            if !problems.is_empty() {
                                events.send(SourceEvent::Problems(problems)).await?;
                            }
                            // The zone first, so the first sync already uses it.
                            events.send(SourceEvent::Node(Update::Replace(node))).await?;
                            events.send(SourceEvent::Services(Update::Replace(services))).await?;
                            events.send(SourceEvent::Slices(Update::Replace(slices))).await
                        };
                        if sent.await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let problem = Problem::new(&self.dir.display().to_string(), format!("{e:#}"));
                        if events.send(SourceEvent::Problems(vec![problem])).await.is_err() {
                            return;
                        }
                    }
                }
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        });
    }
}

/// Parses one file. A YAML syntax error fails the whole file (its earlier
/// contents are kept); a document of a known kind that does not convert is
/// skipped with a problem, the rest of the file is used.
fn parse_manifest(path: &Path, text: &str, problems: &mut Vec<Problem>) -> Result<FileObjects, Problem> {
    let file = path.display().to_string();
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| Problem::new(&file, format!("not valid YAML: {e}")))?;
    let mut objects = FileObjects::default();
    for (i, doc) in docs.into_iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("").to_owned();
        let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("").to_owned();
        let what = format!("{file} document {}", i + 1);
        match (api_version.as_str(), kind.as_str()) {
            ("v1", "Service") => match serde_json::from_value::<Service>(doc) {
                Ok(svc) => objects.services.push(svc),
                Err(e) => problems.push(Problem::new(&what, format!("invalid Service: {e}"))),
            },
            ("discovery.k8s.io/v1", "EndpointSlice") => match serde_json::from_value::<EndpointSlice>(doc) {
                Ok(slice) => objects.slices.push(slice),
                Err(e) => problems.push(Problem::new(&what, format!("invalid EndpointSlice: {e}"))),
            },
            ("v1", "Node") => match serde_json::from_value::<Node>(doc) {
                Ok(node) => objects.nodes.push(node),
                Err(e) => problems.push(Problem::new(&what, format!("invalid Node: {e}"))),
            },
            _ => debug!(file, api_version, kind, "skipping a document of another kind"),
        }
    }
    Ok(objects)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata:
  name: nginx-deployment
spec:
  replicas: 3
---
apiVersion: v1
kind: Service
metadata:
  name: nginx-service
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports:
  - port: 88
    targetPort: 80
    nodePort: 30791
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: nginx-service-1
  labels:
    kubernetes.io/service-name: nginx-service
addressType: IPv4
ports:
- port: 80
endpoints:
- addresses: ["10.244.0.11"]
"#;

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xproxy-manifests-{}-{}", std::process::id(), rand_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::Relaxed)
    }

    #[test]
    fn reads_services_and_slices_and_skips_other_kinds() {
        let dir = temp_dir();
        std::fs::write(dir.join("nginx.yaml"), SEED).unwrap();
        std::fs::write(dir.join("notes.txt"), "not a manifest").unwrap();
        let mut source = ManifestDir::new(&dir).unwrap();
        let (services, slices, problems) = source.reload_if_changed().unwrap().unwrap();
        assert_eq!((services.len(), slices.len()), (1, 1));
        assert!(problems.is_empty(), "{problems:?}");
        assert!(
            source.reload_if_changed().unwrap().is_none(),
            "unchanged directory is not reloaded"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_broken_file_keeps_its_last_good_contents_and_reports_a_problem() {
        let dir = temp_dir();
        let file = dir.join("nginx.yaml");
        std::fs::write(&file, SEED).unwrap();
        let mut source = ManifestDir::new(&dir).unwrap();
        source.reload_if_changed().unwrap().unwrap();
        std::fs::write(&file, "apiVersion: v1\nkind: Service\n  bad: [indent").unwrap();
        let (services, slices, problems) = source.reload_if_changed().unwrap().unwrap();
        assert_eq!((services.len(), slices.len()), (1, 1));
        assert_eq!(problems.len(), 1);
        assert!(problems[0].reason.contains("not valid YAML"), "{problems:?}");
        std::fs::remove_file(&file).unwrap();
        let (services, _, _) = source.reload_if_changed().unwrap().unwrap();
        assert!(services.is_empty(), "a deleted file takes its objects with it");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_document_with_wrong_types_is_skipped_alone() {
        let dir = temp_dir();
        let bad = "apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  ports: 12\n---\n";
        std::fs::write(dir.join("a.yaml"), format!("{bad}{SEED}")).unwrap();
        let mut source = ManifestDir::new(&dir).unwrap();
        let (services, _, problems) = source.reload_if_changed().unwrap().unwrap();
        assert_eq!(services.len(), 1);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].object.ends_with("document 1"), "{problems:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn this_nodes_node_document_is_found_by_name() {
        let dir = temp_dir();
        let nodes = "apiVersion: v1\nkind: Node\nmetadata:\n  name: other\n---\n\
                     apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n  labels:\n    \
                     topology.kubernetes.io/zone: z1\n";
        std::fs::write(dir.join("nodes.yaml"), nodes).unwrap();
        let mut source = ManifestDir::new(&dir).unwrap().for_node("node-a");
        source.reload_if_changed().unwrap().unwrap();
        let node = source.node().expect("node-a is there");
        assert_eq!(super::super::node::zone(node), Some("z1"));
        let mut nameless = ManifestDir::new(&dir).unwrap();
        nameless.reload_if_changed().unwrap().unwrap();
        assert!(nameless.node().is_none());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        assert!(ManifestDir::new(Path::new("/nonexistent/xproxy")).is_err());
    }
}
