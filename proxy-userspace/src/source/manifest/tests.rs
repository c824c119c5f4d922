//! The manifest directory: what is read, what is kept, what is reported.

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

/// The agent reads the directory once before the source runs when it
/// looks for this node's Node (no `--node-ip`): the source still sends
/// everything first, from that reading, and then only changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_read_before_it_runs_sends_that_reading_first() {
    let dir = temp_dir();
    let (mut source, (services, ..)) = first_reading(&dir, &[("nginx.yaml", SEED)]);
    assert_eq!(services.len(), 1);
    assert!(source.reload_if_changed().unwrap().is_none(), "nothing changed");
    let (events, mut received) = mpsc::channel(16);
    source.spawn(events);
    let mut sent = (None, None);
    let first = async {
        while sent.0.is_none() || sent.1.is_none() {
            match received.recv().await.expect("the source runs") {
                SourceEvent::Services(Update::Replace(all)) => sent.0 = Some(all.len()),
                SourceEvent::Slices(Update::Replace(all)) => sent.1 = Some(all.len()),
                _ => {}
            }
        }
    };
    // Polled every 200 ms: a source that sends nothing fails here.
    tokio::time::timeout(Duration::from_secs(5), first)
        .await
        .expect("the first snapshot is sent");
    assert_eq!(sent, (Some(1), Some(1)));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_missing_directory_is_an_error() {
    assert!(ManifestDir::new(Path::new("/nonexistent/xproxy")).is_err());
}

/// `n` Services, each with its EndpointSlice, as separate documents.
fn many_documents(n: usize) -> String {
    let objects: Vec<serde_json::Value> = (0..n)
        .flat_map(|i| {
            let name = format!("svc-{i:05}");
            let ip = std::net::Ipv4Addr::from(0x0a60_0000 + u32::try_from(i).unwrap());
            [
                testbed::fixtures::service(&name, ip, 80, 8080, None),
                testbed::fixtures::slice(&format!("{name}-1"), &name, 8080, &[ip]),
            ]
        })
        .collect();
    testbed::fixtures::yaml_documents(&objects)
}

/// A source over `dir` holding `files` (name, text), and its first reading.
fn first_reading(dir: &Path, files: &[(&str, &str)]) -> (ManifestDir, Reading) {
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let mut source = ManifestDir::new(dir).unwrap();
    let reading = source.reload_if_changed().unwrap().expect("the first reading");
    (source, reading)
}

#[test]
fn any_number_of_documents_in_one_file() {
    let dir = temp_dir();
    // 1,500 documents: beyond serde_saphyr's default of 1,024 per stream.
    std::fs::write(dir.join("many.yaml"), many_documents(750)).unwrap();
    let mut source = ManifestDir::new(&dir).unwrap();
    let (services, slices, problems) = source.reload_if_changed().unwrap().unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!((services.len(), slices.len()), (750, 750));
    assert_eq!(services[749].metadata.name.as_deref(), Some("svc-00749"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_broken_file_is_reported_by_name_and_keeps_its_objects_beside_the_others() {
    let dir = temp_dir();
    let broken = dir.join("b.yaml");
    std::fs::write(dir.join("a.yaml"), many_documents(2)).unwrap();
    std::fs::write(&broken, SEED).unwrap();
    let mut source = ManifestDir::new(&dir).unwrap();
    let (services, ..) = source.reload_if_changed().unwrap().unwrap();
    assert_eq!(services.len(), 3);
    std::fs::write(&broken, "kind: [Service\n").unwrap();
    let (services, slices, problems) = source.reload_if_changed().unwrap().unwrap();
    assert_eq!((services.len(), slices.len()), (3, 3), "both files' objects stay");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].object, broken.display().to_string());
    assert!(problems[0].reason.starts_with("not valid YAML"), "{problems:?}");
    assert!(
        source.reload_if_changed().unwrap().is_none(),
        "a broken file is reported once, not at every poll"
    );
    std::fs::remove_file(&broken).unwrap();
    let (services, ..) = source.reload_if_changed().unwrap().unwrap();
    assert_eq!(
        services.len(),
        2,
        "a broken file that is deleted takes what it kept with it"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_file_that_turned_into_a_list() {
    let dir = temp_dir();
    let (mut source, (services, ..)) = first_reading(&dir, &[("svc.yaml", SEED)]);
    assert_eq!(services.len(), 1);
    let file = dir.join("svc.yaml");
    let list = "apiVersion: v1\nkind: List\nitems:\n\
                - {apiVersion: v1, kind: Service, metadata: {name: a}, spec: {clusterIP: 10.96.0.1}}\n\
                - {apiVersion: v1, kind: Service, metadata: {name: b}, spec: {clusterIP: 10.96.0.2}}\n\
                metadata: {resourceVersion: \"\"}\n";
    std::fs::write(&file, list).unwrap();
    let (services, slices, problems) = source.reload_if_changed().unwrap().unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let names: Vec<_> = services.iter().filter_map(|s| s.metadata.name.as_deref()).collect();
    assert_eq!(names, ["a", "b"]);
    assert!(slices.is_empty(), "the old slice went with the old contents");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A file whose stamp did not change is not read again: here its text is
/// made invalid behind the poller's back (same length, modification time
/// and inode), and another file's change does not bring that to light.
#[test]
fn only_changed_files_are_read_again() {
    let dir = temp_dir();
    let (mut source, _) = first_reading(&dir, &[("a.yaml", SEED), ("b.yaml", &many_documents(1))]);
    let untouched = dir.join("a.yaml");
    let modified = std::fs::metadata(&untouched).unwrap().modified().unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&untouched).unwrap();
    std::io::Write::write_all(&mut &file, &vec![b'['; SEED.len()]).unwrap();
    file.set_modified(modified).unwrap();
    drop(file);
    std::fs::write(dir.join("b.yaml"), many_documents(2)).unwrap();
    let (services, _, problems) = source.reload_if_changed().unwrap().unwrap();
    assert!(problems.is_empty(), "a.yaml was read again: {problems:?}");
    assert_eq!(services.len(), 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_removed_file_takes_its_objects_with_it() {
    let dir = temp_dir();
    std::fs::write(dir.join("a.yaml"), SEED).unwrap();
    std::fs::write(dir.join("b.yaml"), many_documents(2)).unwrap();
    let mut source = ManifestDir::new(&dir).unwrap();
    let (services, ..) = source.reload_if_changed().unwrap().unwrap();
    assert_eq!(services.len(), 3);
    std::fs::remove_file(dir.join("b.yaml")).unwrap();
    let (services, slices, _) = source.reload_if_changed().unwrap().unwrap();
    assert_eq!((services.len(), slices.len()), (1, 1));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_empty_directory_is_a_reading_too() {
    let dir = temp_dir();
    let mut source = ManifestDir::new(&dir).unwrap();
    let (services, slices, problems) = source.reload_if_changed().unwrap().expect("the first reading");
    assert!(services.is_empty() && slices.is_empty() && problems.is_empty());
    assert!(source.reload_if_changed().unwrap().is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

/// A document that does not parse alone (a directive before the next
/// one) sends the file through the whole-stream parser, which reads it.
#[test]
fn a_file_the_splitter_cannot_cut_is_read_whole() {
    let dir = temp_dir();
    let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n...\n%YAML 1.2\n---\n\
                apiVersion: v1\nkind: Service\nmetadata: {name: b}\n";
    std::fs::write(dir.join("directive.yaml"), text).unwrap();
    let mut source = ManifestDir::new(&dir).unwrap();
    let (services, _, problems) = source.reload_if_changed().unwrap().unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(services.len(), 2);
    std::fs::remove_dir_all(dir).unwrap();
}
