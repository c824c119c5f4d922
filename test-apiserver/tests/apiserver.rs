//! The test API server against the real clients: kube-rs (the agent's
//! client: list, CRUD, `kube::runtime::watcher` through relists, 410s,
//! dropped connections and outages, selectors) and `kubectl` against the
//! `xproxy-test-apiserver` binary. Every wait is on an event, with a
//! timeout; nothing sleeps and hopes.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, Config,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt, watcher},
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use xproxy_test_apiserver::{ServerConfig, TestApiServer};

const WAIT: Duration = Duration::from_secs(30);

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "xproxy-apiserver-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).expect("temp dir");
        Self(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server without periodic bookmarks (tests that want them turn them
/// on), so that a compaction reliably expires the watchers' versions.
async fn server() -> TestApiServer {
    TestApiServer::start_with(ServerConfig {
        bookmark_interval: None,
        ..ServerConfig::default()
    })
    .await
    .expect("server starts")
}

/// A client built the agent's way: a kubeconfig file with
/// `server: http://127.0.0.1:PORT` and no user, read by kube's own loader.
async fn client(server: &TestApiServer) -> Client {
    let dir = TempDir::new("kubeconfig");
    let path = dir.path().join("kubeconfig.yaml");
    server.write_kubeconfig(&path).expect("kubeconfig written");
    let kubeconfig = Kubeconfig::read_from(&path).expect("kubeconfig parses");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("config from kubeconfig");
    assert_eq!(config.cluster_url.to_string(), format!("{}/", server.url()));
    Client::try_from(config).expect("client")
}

fn service(ns: &str, name: &str, port: u16, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"selector": {"app": name}, "ports": [{"port": port, "targetPort": 8080}]},
    })
}

fn node(name: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
    })
}

/// What a watcher consumer saw, as comparable strings:
/// `Init`, `InitApply ns/name`, `InitDone`, `Apply ns/name`,
/// `Delete ns/name`, or `Err ...` (`Err 410` for an expired watch).
#[derive(Debug, Clone)]
struct Seen {
    label: String,
    object: Option<Value>,
}

fn obj_name<K: kube::Resource>(o: &K) -> String {
    let m = o.meta();
    match &m.namespace {
        Some(ns) => format!("{ns}/{}", m.name.clone().unwrap_or_default()),
        None => m.name.clone().unwrap_or_default(),
    }
}

/// Runs `kube::runtime::watcher` (with the default backoff, as an agent
/// would) in a task and forwards what it yields.
fn spawn_watcher<K>(api: Api<K>, config: watcher::Config) -> mpsc::UnboundedReceiver<Seen>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + serde::Serialize + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        while let Some(item) = stream.next().await {
            let seen = match item {
                Ok(watcher::Event::Init) => Seen {
                    label: "Init".into(),
                    object: None,
                },
                Ok(watcher::Event::InitDone) => Seen {
                    label: "InitDone".into(),
                    object: None,
                },
                Ok(watcher::Event::InitApply(o)) => Seen {
                    label: format!("InitApply {}", obj_name(&o)),
                    object: serde_json::to_value(&o).ok(),
                },
                Ok(watcher::Event::Apply(o)) => Seen {
                    label: format!("Apply {}", obj_name(&o)),
                    object: serde_json::to_value(&o).ok(),
                },
                Ok(watcher::Event::Delete(o)) => Seen {
                    label: format!("Delete {}", obj_name(&o)),
                    object: serde_json::to_value(&o).ok(),
                },
                Err(watcher::Error::WatchError(status)) => Seen {
                    label: format!("Err {} {}", status.code, status.message),
                    object: None,
                },
                Err(e) => Seen {
                    label: format!("Err {e}"),
                    object: None,
                },
            };
            if tx.send(seen).is_err() {
                break;
            }
        }
    });
    rx
}

/// Collects what a watcher saw.
struct Watch {
    rx: mpsc::UnboundedReceiver<Seen>,
    errors: Vec<String>,
}

impl Watch {
    fn new(rx: mpsc::UnboundedReceiver<Seen>) -> Self {
        Self { rx, errors: Vec::new() }
    }

    async fn next_any(&mut self) -> Seen {
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no watcher event within {WAIT:?} (errors so far: {:?})", self.errors))
            .expect("the watcher task ended")
    }

    /// The next event that is not an error (errors are kept).
    async fn next(&mut self) -> Seen {
        loop {
            let s = self.next_any().await;
            if s.label.starts_with("Err") {
                self.errors.push(s.label);
            } else {
                return s;
            }
        }
    }

    /// The next error, skipping nothing else: an event first is a failure.
    async fn next_error(&mut self) -> String {
        let s = self.next_any().await;
        assert!(s.label.starts_with("Err"), "expected an error, got {}", s.label);
        s.label
    }

    async fn expect(&mut self, labels: &[&str]) -> Vec<Seen> {
        let mut got = Vec::new();
        for want in labels {
            let s = self.next().await;
            assert_eq!(
                s.label,
                *want,
                "after {:?} (errors: {:?})",
                got.iter().map(|s: &Seen| s.label.clone()).collect::<Vec<_>>(),
                self.errors
            );
            got.push(s);
        }
        got
    }
}

#[tokio::test]
async fn list_and_crud_through_kube_client() {
    let server = server().await;
    server.apply(&service("a", "one", 80, json!({}))).expect("applied");
    server.apply(&service("b", "two", 81, json!({}))).expect("applied");
    let client = client(&server).await;

    let all: Api<Service> = Api::all(client.clone());
    let list = all.list(&ListParams::default()).await.expect("list");
    let names: Vec<String> = list.items.iter().map(obj_name).collect();
    assert_eq!(names, ["a/one", "b/two"]);
    assert_eq!(
        list.metadata.resource_version.as_deref(),
        Some(server.resource_version().to_string().as_str())
    );
    let one = &list.items[0];
    let spec = one.spec.as_ref().expect("spec");
    assert_eq!(
        spec.cluster_ip.as_deref(),
        Some("10.96.0.2"),
        "a cluster IP was allocated"
    );
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    let ports = spec.ports.as_ref().expect("ports");
    assert_eq!(ports[0].protocol.as_deref(), Some("TCP"));
    assert!(one.metadata.uid.is_some() && one.metadata.creation_timestamp.is_some());

    let in_a: Api<Service> = Api::namespaced(client.clone(), "a");
    assert_eq!(in_a.list(&ListParams::default()).await.expect("list").items.len(), 1);

    // Create, conflict, get.
    let svc: Service = serde_json::from_value(service("a", "three", 90, json!({"app": "x"}))).expect("typed");
    let created = in_a.create(&PostParams::default(), &svc).await.expect("create");
    let rv1 = created.metadata.resource_version.clone().expect("rv");
    match in_a.create(&PostParams::default(), &svc).await {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists")),
        other => panic!("expected 409 AlreadyExists, got {other:?}"),
    }
    let got = in_a.get("three").await.expect("get");
    assert_eq!(got.metadata.resource_version.as_deref(), Some(rv1.as_str()));

    // Merge patch bumps the version and the generation on a spec change.
    let patched = in_a
        .patch(
            "three",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ports": [{"port": 91}]}})),
        )
        .await
        .expect("patch");
    let rv2 = patched.metadata.resource_version.clone().expect("rv");
    assert!(rv2.parse::<u64>().expect("numeric") > rv1.parse::<u64>().expect("numeric"));
    assert_eq!(patched.metadata.generation, Some(2));
    assert_eq!(
        patched.spec.as_ref().and_then(|s| s.cluster_ip.clone()),
        got.spec.and_then(|s| s.cluster_ip)
    );

    // A replace with the stale version is a conflict.
    match in_a.replace("three", &PostParams::default(), &created).await {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (409, "Conflict")),
        other => panic!("expected 409 Conflict, got {other:?}"),
    }
    let mut fresh = patched.clone();
    fresh.metadata.labels = Some([("app".to_string(), "y".to_string())].into());
    let replaced = in_a
        .replace("three", &PostParams::default(), &fresh)
        .await
        .expect("replace");
    assert_eq!(
        replaced
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("app"))
            .map(String::as_str),
        Some("y")
    );

    // Delete returns the object; then it is gone.
    let deleted = in_a.delete("three", &DeleteParams::default()).await.expect("delete");
    assert!(deleted.is_left(), "the deleted object comes back");
    match in_a.get("three").await {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (404, "NotFound")),
        other => panic!("expected 404, got {other:?}"),
    }
    assert!(server.get("svc", "a", "three").is_none());

    // Label selectors on list.
    let selected = all
        .list(&ListParams::default().labels("app=y"))
        .await
        .expect("list by label");
    assert!(selected.items.is_empty());
}

#[tokio::test]
async fn watcher_sees_adds_modifications_and_deletes() {
    let server = server().await;
    server.apply(&service("default", "a", 80, json!({}))).expect("applied");
    let client = client(&server).await;
    let mut w = Watch::new(spawn_watcher(Api::<Service>::all(client), watcher::Config::default()));
    w.expect(&["Init", "InitApply default/a", "InitDone"]).await;

    server.apply(&service("default", "b", 81, json!({}))).expect("applied");
    let seen = w.expect(&["Apply default/b"]).await;
    assert_eq!(
        seen[0].object.as_ref().and_then(|o| o.pointer("/spec/ports/0/port")),
        Some(&json!(81))
    );

    server.apply(&service("default", "b", 82, json!({}))).expect("applied");
    let seen = w.expect(&["Apply default/b"]).await;
    let obj = seen[0].object.as_ref().expect("object");
    assert_eq!(obj.pointer("/spec/ports/0/port"), Some(&json!(82)));
    assert_eq!(obj.pointer("/metadata/generation"), Some(&json!(2)));

    server.delete("Service", "default", "a").expect("deleted");
    w.expect(&["Delete default/a"]).await;
    assert!(w.errors.is_empty(), "{:?}", w.errors);

    // The watch asked for what kube-rs asks a real server for.
    let watches: Vec<_> = server
        .requests()
        .into_iter()
        .filter(xproxy_test_apiserver::RequestRecord::is_watch)
        .collect();
    assert_eq!(watches.len(), 1, "{watches:?}");
    assert_eq!(watches[0].path, "/api/v1/services");
    assert_eq!(watches[0].param("allowWatchBookmarks").as_deref(), Some("true"));
    assert!(watches[0].param("resourceVersion").is_some_and(|v| v != "0"));
}

#[tokio::test]
async fn compacted_resume_gets_410_and_relists_without_losing_objects() {
    let server = server().await;
    server.apply(&service("default", "a", 80, json!({}))).expect("applied");
    let client = client(&server).await;
    let mut w = Watch::new(spawn_watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    ));
    w.expect(&["Init", "InitApply default/a", "InitDone"]).await;

    server.compact();
    server.drop_watches();
    // The resume from the listed version gets 410 inside the watch
    // stream; the watcher relists, seeing everything again.
    let err = w.next_error().await;
    assert!(err.starts_with("Err 410"), "{err}");
    w.expect(&["Init", "InitApply default/a", "InitDone"]).await;
    server.apply(&service("default", "b", 81, json!({}))).expect("applied");
    w.expect(&["Apply default/b"]).await;

    // The 410 is an ERROR event in a 200 response, as kube-apiserver sends.
    let api: Api<Service> = Api::all(client);
    let old = "1";
    let mut events = api.watch(&WatchParams::default(), old).await.expect("a 200").boxed();
    match tokio::time::timeout(WAIT, events.try_next())
        .await
        .expect("an event in time")
    {
        Ok(Some(WatchEvent::Error(status))) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"), "{status:?}");
        }
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    let end = tokio::time::timeout(WAIT, events.try_next())
        .await
        .expect("the stream ends");
    assert!(matches!(end, Ok(None)), "{end:?}");
}

#[tokio::test]
async fn dropped_watch_connections_are_resumed() {
    let server = server().await;
    server.apply(&service("default", "a", 80, json!({}))).expect("applied");
    let client = client(&server).await;
    let mut w = Watch::new(spawn_watcher(Api::<Service>::all(client), watcher::Config::default()));
    w.expect(&["Init", "InitApply default/a", "InitDone"]).await;
    assert!(server.wait_for_watches(WAIT, |open, _| open == 1).await);
    let listed_rv = server.resource_version();

    server.drop_watches();
    // A change while the watch is down arrives through the resumed watch,
    // without a relist.
    server.apply(&service("default", "b", 81, json!({}))).expect("applied");
    w.expect(&["Apply default/b"]).await;
    assert!(
        server
            .wait_for_watches(WAIT, |open, started| open == 1 && started == 2)
            .await
    );
    let watches: Vec<_> = server
        .requests()
        .into_iter()
        .filter(xproxy_test_apiserver::RequestRecord::is_watch)
        .collect();
    assert_eq!(watches.len(), 2);
    assert_eq!(watches[1].param("resourceVersion"), Some(listed_rv.to_string()));
    let lists = server
        .requests()
        .into_iter()
        .filter(|r| r.path == "/api/v1/services" && !r.is_watch())
        .count();
    assert_eq!(lists, 1, "no relist after a dropped connection");
}

#[tokio::test]
async fn outage_with_changes_and_compaction_relists() {
    let server = server().await;
    server.apply(&service("default", "a", 80, json!({}))).expect("applied");
    server.apply(&node("n1", "192.0.2.1")).expect("applied");
    let client = client(&server).await;
    let mut w = Watch::new(spawn_watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    ));
    w.expect(&["Init", "InitApply default/a", "InitDone"]).await;

    server.stop().await;
    assert!(!server.is_running());
    // The watcher notices: its watch ends and re-watching fails.
    let err = w.next_error().await;
    assert!(!err.starts_with("Err 410"), "{err}");
    assert!(
        Api::<Node>::all(client.clone())
            .list(&ListParams::default())
            .await
            .is_err()
    );

    // While down: a + b change, and the history goes.
    server.delete("svc", "default", "a").expect("deleted");
    server.apply(&service("default", "b", 81, json!({}))).expect("applied");
    server.compact();
    server.restart().await.expect("restarts on the same address");
    assert!(server.is_running());

    w.expect(&["Init", "InitApply default/b", "InitDone"]).await;
    assert!(w.errors.iter().any(|e| e.starts_with("Err 410")), "{:?}", w.errors);
    let nodes = Api::<Node>::all(client)
        .list(&ListParams::default())
        .await
        .expect("list after restart");
    assert_eq!(nodes.items.len(), 1);

    // And a plain outage without compaction resumes without relisting.
    server.outage(Duration::from_millis(300)).await.expect("outage");
    server.apply(&service("default", "c", 82, json!({}))).expect("applied");
    w.expect(&["Apply default/c"]).await;
}

#[tokio::test]
async fn field_selector_watches_one_node() {
    let server = server().await;
    server.apply(&node("n1", "192.0.2.1")).expect("applied");
    server.apply(&node("n2", "192.0.2.2")).expect("applied");
    let client = client(&server).await;
    let config = watcher::Config::default().fields("metadata.name=n1");
    let mut w = Watch::new(spawn_watcher(Api::<Node>::all(client.clone()), config));
    let seen = w.expect(&["Init", "InitApply n1", "InitDone"]).await;
    let addr = seen[1]
        .object
        .as_ref()
        .and_then(|o| o.pointer("/status/addresses/0/address"));
    assert_eq!(addr, Some(&json!("192.0.2.1")));

    // n2 changes first; the only event is n1's.
    server.apply(&node("n2", "192.0.2.22")).expect("applied");
    server.apply(&node("n1", "192.0.2.11")).expect("applied");
    let seen = w.expect(&["Apply n1"]).await;
    let addr = seen[0]
        .object
        .as_ref()
        .and_then(|o| o.pointer("/status/addresses/0/address"));
    assert_eq!(addr, Some(&json!("192.0.2.11")));
    server.delete("node", "", "n2").expect("deleted");
    server.delete("node", "", "n1").expect("deleted");
    w.expect(&["Delete n1"]).await;

    let nodes: Api<Node> = Api::all(client);
    server.apply(&node("n3", "192.0.2.3")).expect("applied");
    let one = nodes
        .list(&ListParams::default().fields("metadata.name=n3"))
        .await
        .expect("list");
    assert_eq!(one.items.len(), 1);
}

#[tokio::test]
async fn label_selector_skips_services_of_other_proxies() {
    const SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
    let server = server().await;
    server
        .apply(&service("default", "plain", 80, json!({"app": "web"})))
        .expect("applied");
    server
        .apply(&service(
            "default",
            "other",
            81,
            json!({"service.kubernetes.io/service-proxy-name": "foo"}),
        ))
        .expect("applied");
    server
        .apply(&service(
            "default",
            "headless",
            82,
            json!({"service.kubernetes.io/headless": ""}),
        ))
        .expect("applied");
    let client = client(&server).await;
    let api: Api<Service> = Api::all(client);
    let listed = api.list(&ListParams::default().labels(SELECTOR)).await.expect("list");
    assert_eq!(listed.items.iter().map(obj_name).collect::<Vec<_>>(), ["default/plain"]);

    let mut w = Watch::new(spawn_watcher(api, watcher::Config::default().labels(SELECTOR)));
    w.expect(&["Init", "InitApply default/plain", "InitDone"]).await;
    // Labelled away: the watch reports a deletion; labelled back: an add.
    server
        .apply(&service(
            "default",
            "plain",
            80,
            json!({"service.kubernetes.io/service-proxy-name": "foo"}),
        ))
        .expect("applied");
    w.expect(&["Delete default/plain"]).await;
    server
        .apply(&service("default", "other", 81, json!({})))
        .expect("applied");
    w.expect(&["Apply default/other"]).await;
    assert!(w.errors.is_empty(), "{:?}", w.errors);
}

#[tokio::test]
async fn streaming_list_bookmarks_and_timeouts() {
    let server = server().await;
    server.apply(&service("default", "a", 80, json!({}))).expect("applied");
    let client = client(&server).await;
    let api: Api<Service> = Api::all(client.clone());

    // sendInitialEvents=true: ADDED events, then the initial-events-end
    // bookmark, which kube's watcher turns into InitDone.
    let mut w = Watch::new(spawn_watcher(api.clone(), watcher::Config::default().streaming_lists()));
    w.expect(&["Init", "InitApply default/a", "InitDone"]).await;
    server.apply(&service("default", "b", 80, json!({}))).expect("applied");
    w.expect(&["Apply default/b"]).await;

    // Periodic bookmarks carry the newest version.
    server.set_bookmark_interval(Some(Duration::from_millis(100)));
    let rv = server.resource_version().to_string();
    let mut events = api.watch(&WatchParams::default(), &rv).await.expect("watch").boxed();
    match tokio::time::timeout(WAIT, events.try_next())
        .await
        .expect("a bookmark in time")
    {
        Ok(Some(WatchEvent::Bookmark(b))) => assert_eq!(b.metadata.resource_version, rv),
        other => panic!("expected a bookmark, got {other:?}"),
    }
    server.set_bookmark_interval(None);

    // timeoutSeconds ends the stream cleanly.
    let wp = WatchParams::default().timeout(1).disable_bookmarks();
    let mut events = api.watch(&wp, &rv).await.expect("watch").boxed();
    let end = tokio::time::timeout(WAIT, events.try_next())
        .await
        .expect("ends within the timeout");
    assert!(matches!(end, Ok(None)), "{end:?}");
    assert!(w.errors.is_empty(), "{:?}", w.errors);

    // EndpointSlices and namespaced lists through the discovery group.
    server
        .apply(&json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "a-1", "namespace": "default", "labels": {"kubernetes.io/service-name": "a"}},
            "addressType": "IPv4",
            "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.0.5"], "conditions": {"ready": true}}],
        }))
        .expect("applied");
    let slices: Api<EndpointSlice> = Api::namespaced(client, "default");
    let list = slices
        .list(&ListParams::default().labels("kubernetes.io/service-name=a"))
        .await
        .expect("list");
    assert_eq!(list.items.len(), 1);
    let endpoints = list.items[0].endpoints.as_deref().unwrap_or_default();
    assert_eq!(endpoints[0].addresses, ["10.244.0.5"]);
}

// ---- kubectl against the binary ----------------------------------------

/// The binary, killed (by its own pid) when dropped.
struct ServerProcess {
    child: Child,
    url: String,
}

impl ServerProcess {
    fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_xproxy-test-apiserver"))
            .args(["--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(WAIT).expect("the binary says where it listens");
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Self { child, url }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn kubectl_available() -> bool {
    Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success())
}

struct Kubectl {
    kubeconfig: PathBuf,
    cache: PathBuf,
}

impl Kubectl {
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .arg("--request-timeout=20s")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("kubectl runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.run(args);
        assert!(ok, "kubectl {args:?} failed:\n{out}\n{err}");
        out
    }
}

const SLICE: &str = "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: nginx-service-abcde
  namespace: default
  labels:
    kubernetes.io/service-name: nginx-service
addressType: IPv4
ports:
- port: 80
  protocol: TCP
endpoints:
- addresses: [\"10.244.1.10\"]
  conditions: {ready: true}
- addresses: [\"10.244.1.11\"]
  conditions: {ready: true}
";

#[test]
fn kubectl_drives_the_binary() {
    if !kubectl_available() {
        eprintln!("skipping kubectl_drives_the_binary: kubectl is not installed (apt-get install -y kubectl)");
        return;
    }
    let server = ServerProcess::start();
    let dir = TempDir::new("kubectl");
    let kubeconfig = dir.path().join("kubeconfig.yaml");
    // The user's kubeconfig (plain http, no user), pointed at this server.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let seed = std::fs::read_to_string(repo.join("examples/seed/kubeconfig.yaml")).unwrap_or_else(|_| {
        "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: http://127.0.0.1:8080\n  name: mink8s\ncontexts:\n- context:\n    cluster: mink8s\n  name: mink8s\ncurrent-context: mink8s\n".into()
    });
    std::fs::write(&kubeconfig, seed.replace("http://127.0.0.1:8080", &server.url)).expect("kubeconfig");
    let k = Kubectl {
        kubeconfig,
        cache: dir.path().join("cache"),
    };
    let nginx = dir.path().join("nginx.yaml");
    let seed_nginx = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: nginx-deployment
  labels:
    app: nginx
spec:
  replicas: 3
  selector:
    matchLabels:
      app: nginx
  template:
    metadata:
      labels:
        app: nginx
    spec:
      containers:
      - name: nginx
        image: nginx:latest
        ports:
        - containerPort: 80
---
apiVersion: v1
kind: Service
metadata:
  name: nginx-service
  labels:
    app: nginx
spec:
  ports:
  - port: 88
    targetPort: 80
    nodePort: 30791
  selector:
    app: nginx
  type: NodePort
";
    std::fs::write(&nginx, seed_nginx).expect("manifest");
    let slice = dir.path().join("slice.yaml");
    std::fs::write(&slice, SLICE).expect("manifest");

    // Discovery and apply (client-side, with the default validation).
    let out = k.ok(&[
        "apply",
        "-f",
        nginx.to_str().expect("utf-8"),
        "-f",
        slice.to_str().expect("utf-8"),
    ]);
    assert!(out.contains("service/nginx-service created"), "{out}");
    assert!(out.contains("deployment.apps/nginx-deployment created"), "{out}");
    assert!(
        out.contains("endpointslice.discovery.k8s.io/nginx-service-abcde created"),
        "{out}"
    );
    let out = k.ok(&["get", "svc", "-A"]);
    assert!(out.contains("nginx-service") && out.contains("88:30791/TCP"), "{out}");
    let out = k.ok(&["get", "endpointslices"]);
    assert!(
        out.contains("nginx-service-abcde") && out.contains("10.244.1.10,10.244.1.11"),
        "{out}"
    );
    let out = k.ok(&["get", "ns"]);
    assert!(out.contains("kube-system"), "{out}");

    // A second apply with a change sends a strategic merge patch.
    std::fs::write(&nginx, seed_nginx.replace("port: 88", "port: 89")).expect("manifest");
    let out = k.ok(&["apply", "-f", nginx.to_str().expect("utf-8")]);
    assert!(out.contains("service/nginx-service configured"), "{out}");
    assert!(out.contains("deployment.apps/nginx-deployment unchanged"), "{out}");
    let svc: Value = serde_json::from_str(&k.ok(&["get", "svc", "nginx-service", "-o", "json"])).expect("json");
    assert_eq!(
        svc.pointer("/spec/ports"),
        Some(&json!([{"nodePort": 30791, "port": 89, "protocol": "TCP", "targetPort": 80}])),
        "{svc}"
    );
    let patched = k.ok(&[
        "patch",
        "svc",
        "nginx-service",
        "--type=merge",
        "-p",
        r#"{"metadata":{"labels":{"tier":"web"}}}"#,
    ]);
    assert!(patched.contains("patched"), "{patched}");
    let out = k.ok(&["get", "svc", "-l", "tier=web", "-o", "name"]);
    assert_eq!(out.trim(), "service/nginx-service");

    // Delete (kubectl waits for the object to be gone).
    let out = k.ok(&["delete", "-f", slice.to_str().expect("utf-8")]);
    assert!(out.contains("deleted"), "{out}");
    let out = k.ok(&["delete", "svc", "nginx-service"]);
    assert!(out.contains("service \"nginx-service\" deleted"), "{out}");
    let (ok, _, err) = k.run(&["get", "svc", "nginx-service"]);
    assert!(!ok && err.contains("NotFound"), "{err}");

    // The repository's runnable seed manifest (a fixed clusterIP, an
    // EndpointSlice for the three pods) applies as it is.
    let seed_manifest = repo.join("examples/seed/manifests/nginx.yaml");
    if seed_manifest.exists() {
        let out = k.ok(&["apply", "-f", seed_manifest.to_str().expect("utf-8")]);
        assert!(out.contains("service/nginx-service created"), "{out}");
        let svc: Value = serde_json::from_str(&k.ok(&["get", "svc", "nginx-service", "-o", "json"])).expect("json");
        let given = Command::new("grep")
            .arg("clusterIP:")
            .arg(&seed_manifest)
            .output()
            .expect("grep");
        let given = String::from_utf8_lossy(&given.stdout);
        if let Some(ip) = given.split_whitespace().nth(1) {
            assert_eq!(svc.pointer("/spec/clusterIP"), Some(&json!(ip)), "{svc}");
        }
        let out = k.ok(&[
            "get",
            "endpointslices",
            "-l",
            "kubernetes.io/service-name=nginx-service",
            "-o",
            "name",
        ]);
        assert!(
            !out.trim().is_empty(),
            "no EndpointSlice from {}",
            seed_manifest.display()
        );
    }

    // The test controls of the binary.
    let stats: Value = serde_json::from_str(&k.ok(&["get", "--raw", "/_test/stats"])).expect("json");
    assert!(
        stats["requests"]["/api/v1/namespaces/default/services/nginx-service"]
            .as_u64()
            .unwrap_or(0)
            >= 3,
        "{stats}"
    );
    // kubectl asked for aggregated discovery, got the legacy documents
    // and fell back to fetching each group version.
    let requests: Value = serde_json::from_str(&k.ok(&["get", "--raw", "/_test/requests"])).expect("json");
    let requests = requests.as_array().expect("a list");
    let asked = |path: &str| requests.iter().filter(|r| r["path"] == path).collect::<Vec<_>>();
    assert!(
        asked("/apis").iter().any(|r| r["accept"]
            .as_str()
            .is_some_and(|a| a.contains("as=APIGroupDiscoveryList"))),
        "{requests:?}"
    );
    for gv in ["/api/v1", "/apis/discovery.k8s.io/v1", "/apis/apps/v1"] {
        assert!(!asked(gv).is_empty(), "kubectl did not fall back to {gv}");
    }
}
