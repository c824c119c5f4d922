//! A small Kubernetes API server for tests: it speaks the real wire protocol
//! (discovery, list, watch with resourceVersion / bookmarks / 410 Expired,
//! create / update / patch / delete, selectors) for the resources xproxy
//! reads, over plain HTTP/1.1 without auth, so the agent's kube-rs client
//! and `kubectl` talk to it as to kube-apiserver, which cannot be installed
//! here.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use xproxy_test_apiserver::TestApiServer;
//! let server = TestApiServer::start("127.0.0.1:0".parse().unwrap()).await?;
//! server.apply(&serde_json::json!({
//!     "apiVersion": "v1", "kind": "Service",
//!     "metadata": {"name": "web", "namespace": "default"},
//!     "spec": {"ports": [{"port": 80}]},
//! })).unwrap();
//! // kubeconfig with `server: http://127.0.0.1:PORT`, no auth:
//! server.write_kubeconfig(std::path::Path::new("/tmp/kubeconfig"))?;
//! server.compact();        // the next watch resume gets 410 Expired
//! server.drop_watches();   // cut every open watch mid-stream
//! server.outage(std::time::Duration::from_secs(2)).await?; // down, then up again
//! # Ok(()) }
//! ```
//!
//! Resources: core/v1 namespaces, nodes, services, endpoints, events;
//! discovery.k8s.io/v1 endpointslices; events.k8s.io/v1 events; apps/v1
//! deployments (stored only). The binary `xproxy-test-apiserver` serves the
//! same, with the controls under `/_test/` (see [`http`]).

pub mod http;
mod patch;
pub mod resources;
pub mod selector;
pub mod store;
mod table;
pub mod watch;

use std::{
    collections::{BTreeMap, VecDeque},
    io,
    net::SocketAddr,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use serde::Serialize;
use serde_json::{Value, json};
use tokio::{
    net::TcpListener,
    sync::{oneshot, watch as tokio_watch},
    task::{JoinHandle, JoinSet},
};

pub use store::{Allocation, ApiError, Store};

/// How a server starts.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen; port 0 picks a free port (kept across restarts).
    pub addr: SocketAddr,
    /// Bookmarks on watches that allow them, this often; `None`: never.
    pub bookmark_interval: Option<Duration>,
    /// Change events kept for watch resumes; an older resourceVersion gets
    /// 410 Expired.
    pub history_limit: usize,
    pub allocation: Allocation,
    /// Serve the `/_test/` control endpoints.
    pub test_endpoints: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            bookmark_interval: Some(Duration::from_secs(60)),
            history_limit: 10_000,
            allocation: Allocation::default(),
            test_endpoints: true,
        }
    }
}

/// One request, as recorded for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    /// The raw (still percent-encoded) query string.
    pub query: String,
    /// The Accept header ("" if none).
    pub accept: String,
}

impl RequestRecord {
    /// Whether the request was a watch (`watch=true` or `watch=1`).
    pub fn is_watch(&self) -> bool {
        http::Query::parse(&self.query)
            .get("watch")
            .is_some_and(|v| matches!(v, "true" | "1"))
    }

    /// A decoded query parameter.
    pub fn param(&self, name: &str) -> Option<String> {
        http::Query::parse(&self.query).get(name).map(str::to_string)
    }
}

const REQUEST_LOG: usize = 10_000;

#[derive(Default)]
struct Stats {
    by_path: BTreeMap<String, u64>,
    log: VecDeque<RequestRecord>,
}

struct Running {
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// State shared by the handle, the accept loop and every connection.
pub struct Shared {
    pub store: Store,
    addr: Mutex<SocketAddr>,
    bookmark_interval: tokio_watch::Sender<Option<Duration>>,
    drop_watches: tokio_watch::Sender<u64>,
    open_watches: AtomicUsize,
    watches_started: AtomicU64,
    /// Bumped whenever a watch opens or closes.
    watch_count_changed: tokio_watch::Sender<u64>,
    stats: Mutex<Stats>,
    test_endpoints: bool,
    running: Mutex<Option<Running>>,
}

impl Shared {
    fn addr(&self) -> SocketAddr {
        *self.addr.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record(&self, method: &str, path: &str, query: &str, accept: &str) {
        let mut st = self.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *st.by_path.entry(path.to_string()).or_default() += 1;
        if st.log.len() >= REQUEST_LOG {
            st.log.pop_front();
        }
        st.log.push_back(RequestRecord {
            method: method.into(),
            path: path.into(),
            query: query.into(),
            accept: accept.into(),
        });
    }

    fn stats_json(&self) -> Value {
        let st = self.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        json!({
            "openWatches": self.open_watches.load(Ordering::SeqCst),
            "watchesStarted": self.watches_started.load(Ordering::SeqCst),
            "resourceVersion": self.store.resource_version().to_string(),
            "requests": st.by_path,
        })
    }

    fn requests_json(&self) -> Value {
        let st = self.stats.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        st.log
            .iter()
            .map(|r| json!({"method": r.method, "path": r.path, "query": r.query, "accept": r.accept}))
            .collect()
    }

    fn take_running(&self) -> Option<Running> {
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Binds the address (the same one after a stop) and serves. (Boxed:
    /// the control endpoint `/_test/outage` calls it from inside a
    /// connection, which makes the future type recursive.)
    fn start(self: &Arc<Self>) -> futures::future::BoxFuture<'static, io::Result<SocketAddr>> {
        let this = self.clone();
        Box::pin(async move { this.start_inner().await })
    }

    async fn start_inner(self: &Arc<Self>) -> io::Result<SocketAddr> {
        if self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
        {
            return Ok(self.addr());
        }
        let listener = bind_retrying(self.addr()).await?;
        let addr = listener.local_addr()?;
        *self.addr.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = addr;
        let (shutdown, mut stop) = oneshot::channel::<()>();
        let shared = self.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    _ = &mut stop => break,
                    accepted = listener.accept() => {
                        let Ok((tcp, _)) = accepted else { continue };
                        let shared = shared.clone();
                        conns.spawn(async move {
                            let service = hyper::service::service_fn(move |req| http::handle(shared.clone(), req));
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                                .await;
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
            drop(listener);
            // Every connection, watches included, goes down at once.
            conns.shutdown().await;
        });
        let mut running = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if running.is_some() {
            // Lost a race with another start: keep the first.
            task.abort();
        } else {
            *running = Some(Running { shutdown, task });
        }
        Ok(addr)
    }

    async fn stop(&self) {
        if let Some(r) = self.take_running() {
            let _ = r.shutdown.send(());
            let _ = r.task.await;
        }
    }
}

/// Binding the port of a server that just stopped can fail for a moment;
/// retry briefly.
async fn bind_retrying(addr: SocketAddr) -> io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && tries < 50 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Stops the server when the last handle goes.
struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(r) = self.0.take_running() {
            let _ = r.shutdown.send(());
            r.task.abort();
        }
    }
}

/// A running (or stopped) test API server. Clones share the server; it
/// stops when the last clone is dropped.
#[derive(Clone)]
pub struct TestApiServer {
    shared: Arc<Shared>,
    _stop: Arc<StopOnDrop>,
}

impl TestApiServer {
    /// Starts on `addr` (`127.0.0.1:0` for a free port) with defaults.
    pub async fn start(addr: SocketAddr) -> io::Result<Self> {
        Self::start_with(ServerConfig {
            addr,
            ..ServerConfig::default()
        })
        .await
    }

    pub async fn start_with(config: ServerConfig) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            store: Store::new(config.history_limit, &config.allocation),
            addr: Mutex::new(config.addr),
            bookmark_interval: tokio_watch::Sender::new(config.bookmark_interval),
            drop_watches: tokio_watch::Sender::new(0),
            open_watches: AtomicUsize::new(0),
            watches_started: AtomicU64::new(0),
            watch_count_changed: tokio_watch::Sender::new(0),
            stats: Mutex::default(),
            test_endpoints: config.test_endpoints,
            running: Mutex::new(None),
        });
        shared.start().await?;
        Ok(Self {
            _stop: Arc::new(StopOnDrop(shared.clone())),
            shared,
        })
    }

    /// The bound address (the real port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// A kubeconfig for this server: plain http, no auth, like the seed's.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: {}\n  name: xproxy-test\ncontexts:\n- context:\n    cluster: xproxy-test\n    namespace: default\n  name: xproxy-test\ncurrent-context: xproxy-test\nusers: []\n",
            self.url()
        )
    }

    pub fn write_kubeconfig(&self, path: &Path) -> io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml())
    }

    /// The store, for direct reads.
    pub fn store(&self) -> &Store {
        &self.shared.store
    }

    /// Creates or replaces an object given as JSON or as any serializable
    /// Kubernetes type (its apiVersion and kind pick the resource; a
    /// namespaced object without namespace goes to "default"). Status is
    /// stored as given. Returns the stored object.
    pub fn apply<T: Serialize + ?Sized>(&self, object: &T) -> Result<Value, ApiError> {
        let obj = serde_json::to_value(object).map_err(|e| ApiError::bad_request(e.to_string()))?;
        let r = Self::resource_of(&obj)?;
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let ns = if r.namespaced {
            obj.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        if name.is_empty() {
            return self
                .shared
                .store
                .create(r, Some(&ns).filter(|n| !n.is_empty()).map(String::as_str), obj, false);
        }
        self.shared
            .store
            .update(r, &ns, &name, obj, store::UpdateMode::Replace, false)
    }

    fn resource_of(obj: &Value) -> Result<&'static resources::ResourceType, ApiError> {
        let av = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        resources::by_kind(av, kind)
            .ok_or_else(|| ApiError::bad_request(format!("no resource served for apiVersion {av:?} kind {kind:?}")))
    }

    fn resource_named(kind: &str) -> Result<&'static resources::ResourceType, ApiError> {
        resources::by_name(kind).ok_or_else(|| ApiError::bad_request(format!("unknown resource {kind:?}")))
    }

    /// Deletes an object; `kind` is a kind, plural or short name
    /// (`Service`, `endpointslices`, `svc`), `namespace` is ignored for
    /// cluster-scoped types. Returns its last state.
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) -> Result<Value, ApiError> {
        let r = Self::resource_named(kind)?;
        let ns = if r.namespaced { namespace } else { "" };
        self.shared.store.delete(r, ns, name, None, false)
    }

    /// Deletes the object a value (JSON or typed) names.
    pub fn delete_object<T: Serialize + ?Sized>(&self, object: &T) -> Result<Value, ApiError> {
        let obj = serde_json::to_value(object).map_err(|e| ApiError::bad_request(e.to_string()))?;
        let r = Self::resource_of(&obj)?;
        let name = obj.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("");
        let ns = if r.namespaced {
            obj.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or("default")
        } else {
            ""
        };
        self.shared.store.delete(r, ns, name, None, false)
    }

    /// One object, if stored.
    pub fn get(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let r = Self::resource_named(kind).ok()?;
        let ns = if r.namespaced { namespace } else { "" };
        self.shared.store.get(r, ns, name).ok()
    }

    /// The objects of a type, in a namespace or (None) all.
    pub fn list(&self, kind: &str, namespace: Option<&str>) -> Vec<Value> {
        let Ok(r) = Self::resource_named(kind) else {
            return Vec::new();
        };
        self.shared.store.list(r, namespace, &selector::Selectors::default()).0
    }

    /// The newest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store.resource_version()
    }

    /// Drops the event history: any watch that resumes from a
    /// resourceVersion handed out so far gets a 410 Expired ERROR event.
    /// Returns the new resourceVersion.
    pub fn compact(&self) -> u64 {
        self.shared.store.compact()
    }

    /// Cuts every open watch connection mid-stream (no closing chunk).
    pub fn drop_watches(&self) {
        self.shared.drop_watches.send_modify(|g| *g += 1);
    }

    /// Stops listening and closes every connection. The store is kept.
    pub async fn stop(&self) {
        self.shared.stop().await;
    }

    /// Starts again on the same address after [`Self::stop`].
    pub async fn restart(&self) -> io::Result<()> {
        self.shared.start().await.map(|_| ())
    }

    pub fn is_running(&self) -> bool {
        self.shared
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// An API server outage: stop, wait `down`, restart.
    pub async fn outage(&self, down: Duration) -> io::Result<()> {
        self.stop().await;
        tokio::time::sleep(down).await;
        self.restart().await
    }

    /// Bookmarks this often on watches that allow them (`None`: never);
    /// open watches follow the change.
    pub fn set_bookmark_interval(&self, interval: Option<Duration>) {
        self.shared.bookmark_interval.send_replace(interval);
    }

    /// Watches open right now.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// Watches opened since the start.
    pub fn watches_started(&self) -> u64 {
        self.shared.watches_started.load(Ordering::SeqCst)
    }

    /// Waits until `cond(open watches, watches started)` holds; false on
    /// timeout.
    pub async fn wait_for_watches(&self, timeout: Duration, mut cond: impl FnMut(usize, u64) -> bool) -> bool {
        let mut rx = self.shared.watch_count_changed.subscribe();
        tokio::time::timeout(timeout, async {
            loop {
                rx.borrow_and_update();
                if cond(self.open_watches(), self.watches_started()) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await
        .is_ok()
    }

    /// Requests so far to a path (any method, query ignored).
    pub fn request_count(&self, path: &str) -> u64 {
        let st = self
            .shared
            .stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.by_path.get(path).copied().unwrap_or(0)
    }

    /// Request counts by path.
    pub fn request_counts(&self) -> BTreeMap<String, u64> {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .by_path
            .clone()
    }

    /// The last requests (up to 10 000), oldest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        let st = self
            .shared
            .stats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.log.iter().cloned().collect()
    }
}
