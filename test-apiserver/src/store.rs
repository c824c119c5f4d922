//! The object store: objects by (resource, namespace, name), one global
//! monotonically increasing resourceVersion, and a bounded history of
//! change events that watches replay from.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    net::Ipv4Addr,
    ops::Bound,
    sync::{Arc, Mutex, MutexGuard},
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::{Map, Value, json};
use tokio::sync::watch;

use super::{
    patch,
    resources::{self, ResourceType},
    selector::Selectors,
};

/// An API error, answered as a `Status` object with `code` as HTTP status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Invalid`, `BadRequest`,
    /// `MethodNotAllowed`, `Expired`, `UnsupportedMediaType`, ...
    pub reason: &'static str,
    pub message: String,
    details: Option<Box<(String, String, String)>>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn with_details(mut self, r: &ResourceType, name: &str) -> Self {
        let group = r.group.to_string();
        self.details = Some(Box::new((name.to_string(), group, r.plural.to_string())));
        self
    }

    pub fn not_found(r: &ResourceType, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{} \"{name}\" not found", r.qualified())).with_details(r, name)
    }

    pub fn already_exists(r: &ResourceType, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", r.qualified()),
        )
        .with_details(r, name)
    }

    pub fn conflict(r: &ResourceType, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {} \"{name}\": {why}", r.qualified()),
        )
        .with_details(r, name)
    }

    pub fn invalid(r: &ResourceType, name: &str, why: impl std::fmt::Display) -> Self {
        Self::new(422, "Invalid", format!("{} \"{name}\" is invalid: {why}", r.kind)).with_details(r, name)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// The 410 a watch or list gets for a resourceVersion older than the
    /// history.
    pub fn expired(rv: u64, oldest: u64) -> Self {
        Self::new(410, "Expired", format!("too old resource version: {rv} ({oldest})"))
    }

    /// The `Status` object.
    pub fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some((name, group, kind)) = self.details.as_deref() {
            let mut details = json!({"name": name, "kind": kind});
            if !group.is_empty() {
                details["group"] = json!(group);
            }
            status["details"] = details;
        }
        status
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change, as kept in the history.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub rv: u64,
    pub resource: &'static ResourceType,
    pub namespace: String,
    pub kind: EventType,
    /// The new object (the last state, with the deletion's
    /// resourceVersion, for a deletion).
    pub object: Arc<Value>,
    /// The object before a modification.
    pub prev: Option<Arc<Value>>,
}

/// What a watcher receives for an event, given its selectors: a change
/// that makes an object match (stop matching) is an ADDED (DELETED), as
/// the real server's watch cache reports it.
pub fn filter_event(ev: &StoredEvent, namespace: Option<&str>, sel: &Selectors) -> Option<(EventType, Value)> {
    if namespace.is_some_and(|ns| ns != ev.namespace) {
        return None;
    }
    let now = sel.matches(&ev.object);
    match ev.kind {
        EventType::Added | EventType::Deleted => now.then(|| (ev.kind, (*ev.object).clone())),
        EventType::Modified => {
            let before = ev.prev.as_deref().is_some_and(|p| sel.matches(p));
            match (before, now) {
                (true, true) => Some((EventType::Modified, (*ev.object).clone())),
                (false, true) => Some((EventType::Added, (*ev.object).clone())),
                (true, false) => {
                    let mut gone = ev.prev.as_deref().cloned().unwrap_or(Value::Null);
                    gone["metadata"]["resourceVersion"] = json!(ev.rv.to_string());
                    Some((EventType::Deleted, gone))
                }
                (false, false) => None,
            }
        }
    }
}

/// How an update treats the stored object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateMode {
    /// PUT/PATCH of the main resource: the stored status is kept for types
    /// with a status subresource.
    Main,
    /// PUT/PATCH of `/status`: only the status changes.
    Status,
    /// The test handle's apply: the whole object is replaced.
    Replace,
}

/// The body of a PATCH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    Strategic,
    Json,
    /// Server-side apply, approximated as a merge patch that may create.
    Apply,
}

type Key = (String, String, String);

fn key(r: &ResourceType, ns: &str, name: &str) -> Key {
    (r.qualified(), ns.to_string(), name.to_string())
}

struct State {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<StoredEvent>,
    history_limit: usize,
    /// A watch from a resourceVersion below this has lost events: 410.
    floor: u64,
    service_cidr: (u32, u32),
    node_ports: (u16, u16),
    /// Who holds which cluster IP and node port: checking or allocating
    /// one must not scan every object (the bench stores 100,000 Services).
    allocated: Allocated,
}

/// The cluster IPs and node ports of the stored Services, by (namespace, name).
#[derive(Default)]
struct Allocated {
    cluster_ips: HashMap<String, (String, String)>,
    node_ports: HashMap<u64, (String, String)>,
}

impl Allocated {
    fn cluster_ip(service: &Value) -> Option<&str> {
        service.pointer("/spec/clusterIP").and_then(Value::as_str)
    }

    fn node_ports(service: &Value) -> impl Iterator<Item = u64> + '_ {
        service
            .pointer("/spec/ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("nodePort").and_then(Value::as_u64))
    }

    fn add(&mut self, owner: (&str, &str), service: &Value) {
        let owner = (owner.0.to_string(), owner.1.to_string());
        if let Some(ip) = Self::cluster_ip(service) {
            self.cluster_ips.insert(ip.to_string(), owner.clone());
        }
        for port in Self::node_ports(service) {
            self.node_ports.insert(port, owner.clone());
        }
    }

    fn remove(&mut self, owner: (&str, &str), service: &Value) {
        let owned = |o: &(String, String)| (o.0.as_str(), o.1.as_str()) == owner;
        if let Some(ip) = Self::cluster_ip(service)
            && self.cluster_ips.get(ip).is_some_and(owned)
        {
            self.cluster_ips.remove(ip);
        }
        for port in Self::node_ports(service) {
            if self.node_ports.get(&port).is_some_and(owned) {
                self.node_ports.remove(&port);
            }
        }
    }
}

/// Where Services get their cluster IPs and node ports.
#[derive(Debug, Clone)]
pub struct Allocation {
    /// Cluster IPs come from this IPv4 network (first and last address and
    /// the network's .1 excluded).
    pub service_cidr: (Ipv4Addr, u8),
    pub node_ports: (u16, u16),
}

impl Default for Allocation {
    fn default() -> Self {
        Self {
            service_cidr: (Ipv4Addr::new(10, 96, 0, 0), 12),
            node_ports: (30000, 32767),
        }
    }
}

/// The object store. Cheap to share behind an `Arc`.
pub struct Store {
    state: Mutex<State>,
    changed: watch::Sender<u64>,
}

/// RFC 3339 UTC time, seconds precision, as Kubernetes writes it.
pub fn now_rfc3339() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn new_uid() -> String {
    let b: u128 = rand::random();
    let b = (b & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let h = format!("{b:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn random_suffix() -> String {
    const CHARS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| CHARS[rand::random::<usize>() % CHARS.len()] as char)
        .collect()
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

/// The object without the fields every write changes, to tell no-op writes
/// and spec changes.
fn without(obj: &Value, fields: &[&str], meta_fields: &[&str]) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        for f in fields {
            m.remove(*f);
        }
    }
    if let Some(m) = o.get_mut("metadata").and_then(Value::as_object_mut) {
        for f in meta_fields {
            m.remove(*f);
        }
    }
    o
}

impl Store {
    pub fn new(history_limit: usize, alloc: &Allocation) -> Self {
        let (ip, prefix) = alloc.service_cidr;
        let prefix = u32::from(prefix.min(30));
        let base = u32::from(ip) & (u32::MAX << (32 - prefix));
        let size = 1u32 << (32 - prefix);
        let (changed, _) = watch::channel(0);
        let store = Self {
            state: Mutex::new(State {
                rv: 0,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                history_limit: history_limit.max(1),
                floor: 0,
                service_cidr: (base, size),
                node_ports: alloc.node_ports,
                allocated: Allocated::default(),
            }),
            changed,
        };
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            let created = store.create(&resources::NAMESPACES, None, json!({"metadata": {"name": ns}}), false);
            debug_assert!(created.is_ok());
        }
        store
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A receiver that sees the newest resourceVersion after every change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// The lowest resourceVersion a watch can still resume from.
    pub fn oldest_resumable(&self) -> u64 {
        self.lock().floor
    }

    /// Drops the history: a watch resuming from any resourceVersion handed
    /// out so far gets 410 Expired (open watches keep going).
    pub fn compact(&self) -> u64 {
        let mut st = self.lock();
        st.rv += 1;
        st.floor = st.rv;
        st.history.clear();
        let rv = st.rv;
        drop(st);
        self.changed.send_replace(rv);
        rv
    }

    fn commit(
        &self,
        st: &mut State,
        r: &'static ResourceType,
        kind: EventType,
        mut obj: Value,
        prev: Option<Value>,
    ) -> Value {
        st.rv += 1;
        let rv = st.rv;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let ns = meta_str(&obj, "namespace").unwrap_or("").to_string();
        let name = meta_str(&obj, "name").unwrap_or("").to_string();
        let k = key(r, &ns, &name);
        if r.qualified() == resources::SERVICES.qualified() {
            if let Some(stored) = st.objects.get(&k) {
                st.allocated.remove((&ns, &name), stored);
            }
            if kind != EventType::Deleted {
                st.allocated.add((&ns, &name), &obj);
            }
        }
        if kind == EventType::Deleted {
            st.objects.remove(&k);
        } else {
            st.objects.insert(k, obj.clone());
        }
        let mut event_obj = obj.clone();
        event_obj["kind"] = json!(r.kind);
        event_obj["apiVersion"] = json!(r.api_version());
        st.history.push_back(StoredEvent {
            rv,
            resource: r,
            namespace: ns,
            kind,
            object: Arc::new(event_obj),
            prev: prev.map(Arc::new),
        });
        while st.history.len() > st.history_limit {
            if let Some(old) = st.history.pop_front() {
                st.floor = st.floor.max(old.rv);
            }
        }
        self.changed.send_replace(rv);
        obj
    }

    /// Fills in metadata and type defaults of an object about to be
    /// written; `old` is the stored object on update.
    fn prepare(
        st: &State,
        r: &'static ResourceType,
        path_ns: Option<&str>,
        path_name: Option<&str>,
        mut obj: Value,
        old: Option<&Value>,
    ) -> Result<Value, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        let name_hint = path_name.unwrap_or("");
        if let Some(av) = obj.get("apiVersion").and_then(Value::as_str)
            && av != r.api_version()
        {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({})",
                r.api_version()
            )));
        }
        if let Some(kind) = obj.get("kind").and_then(Value::as_str)
            && kind != r.kind
        {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({kind}) does not match the expected kind ({})",
                r.kind
            )));
        }
        if !obj.get("metadata").is_some_and(Value::is_object) {
            obj["metadata"] = json!({});
        }
        let meta = obj["metadata"]
            .as_object_mut()
            .ok_or_else(|| ApiError::bad_request("metadata"))?;
        // Name.
        let mut name = meta.get("name").and_then(Value::as_str).unwrap_or("").to_string();
        if name.is_empty() {
            if let Some(p) = path_name {
                name = p.to_string();
            } else if let Some(prefix) = meta.get("generateName").and_then(Value::as_str) {
                name = format!("{prefix}{}", random_suffix());
            }
        }
        if name.is_empty() {
            return Err(ApiError::invalid(
                r,
                name_hint,
                "metadata.name: Required value: name or generateName is required",
            ));
        }
        if let Some(p) = path_name
            && p != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({name}) does not match the name on the URL ({p})"
            )));
        }
        if !valid_name(&name) {
            return Err(ApiError::invalid(
                r,
                &name,
                "metadata.name: Invalid value: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'",
            ));
        }
        meta.insert("name".into(), json!(name));
        // Namespace.
        if r.namespaced {
            let body_ns = meta.get("namespace").and_then(Value::as_str).filter(|s| !s.is_empty());
            let ns = match (body_ns, path_ns) {
                (Some(b), Some(p)) if b != p => {
                    return Err(ApiError::bad_request(format!(
                        "the namespace of the provided object ({b}) does not match the namespace sent on the request ({p})"
                    )));
                }
                (Some(b), _) => b.to_string(),
                (None, Some(p)) => p.to_string(),
                (None, None) => "default".to_string(),
            };
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
        meta.remove("selfLink");
        meta.remove("resourceVersion");
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        match old {
            Some(old) => {
                for f in ["uid", "creationTimestamp"] {
                    if let Some(v) = old["metadata"].get(f) {
                        meta.insert(f.into(), v.clone());
                    }
                }
                if let Some(v) = old["metadata"].get("generation") {
                    meta.insert("generation".into(), v.clone());
                }
            }
            None => {
                meta.insert("uid".into(), json!(new_uid()));
                meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
                meta.insert("generation".into(), json!(1));
            }
        }
        if let Some(old) = old {
            let spec_of = |o: &Value| without(o, &["metadata", "status", "kind", "apiVersion"], &[]);
            if spec_of(&obj) != spec_of(old) {
                let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
                obj["metadata"]["generation"] = json!(g + 1);
            }
        }
        obj["kind"] = json!(r.kind);
        obj["apiVersion"] = json!(r.api_version());
        match r.plural {
            "services" => default_service(st, &mut obj, old, &name)?,
            "namespaces" => {
                if obj.pointer("/spec/finalizers").is_none() {
                    obj["spec"]["finalizers"] = json!(["kubernetes"]);
                }
                if obj.pointer("/status/phase").is_none() {
                    obj["status"]["phase"] = json!("Active");
                }
                obj["metadata"]["labels"]["kubernetes.io/metadata.name"] = json!(name);
            }
            "endpointslices" => {
                if obj.get("addressType").and_then(Value::as_str).is_none() {
                    return Err(ApiError::invalid(r, &name, "addressType: Required value"));
                }
                if !obj.get("endpoints").is_some_and(Value::is_array) {
                    obj["endpoints"] = json!([]);
                }
            }
            _ => {}
        }
        Ok(obj)
    }

    /// Creates an object (POST). `ns` is the namespace of the URL.
    pub fn create(
        &self,
        r: &'static ResourceType,
        ns: Option<&str>,
        obj: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let mut st = self.lock();
        let obj = Self::prepare(&st, r, ns, None, obj, None)?;
        let name = meta_str(&obj, "name").unwrap_or("").to_string();
        let ns = meta_str(&obj, "namespace").unwrap_or("").to_string();
        if st.objects.contains_key(&key(r, &ns, &name)) {
            return Err(ApiError::already_exists(r, &name));
        }
        if dry_run {
            return Ok(obj);
        }
        Ok(self.commit(&mut st, r, EventType::Added, obj, None))
    }

    pub fn get(&self, r: &'static ResourceType, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.lock()
            .objects
            .get(&key(r, ns, name))
            .cloned()
            .ok_or_else(|| ApiError::not_found(r, name))
    }

    /// Objects of a type (in one namespace or all) that match, sorted by
    /// namespace and name, and the resourceVersion of the list.
    pub fn list(&self, r: &'static ResourceType, ns: Option<&str>, sel: &Selectors) -> (Vec<Value>, u64) {
        let page = page_of(&self.lock(), r, ns, sel, usize::MAX, None);
        (page.items, page.rv)
    }

    /// One page of [`Store::list`]: at most `limit` objects (all if `None`
    /// or 0), after the one `continue_token` names. The API server serves
    /// every page from the snapshot of the first; this store keeps no
    /// snapshots, so a token from before any later change gets what the
    /// API server answers once the snapshot is compacted: 410 Expired (the
    /// client lists again from the start).
    pub fn list_page(
        &self,
        r: &'static ResourceType,
        ns: Option<&str>,
        sel: &Selectors,
        limit: Option<usize>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, ApiError> {
        let st = self.lock();
        let after = continue_token.map(ContinueToken::parse).transpose()?;
        if after.as_ref().is_some_and(|token| token.rv != st.rv) {
            return Err(ApiError::new(
                410,
                "Expired",
                "the provided continue parameter is too old to display a consistent list result; list again",
            ));
        }
        let limit = limit.filter(|&l| l > 0).unwrap_or(usize::MAX);
        Ok(page_of(&st, r, ns, sel, limit, after.as_ref()))
    }

    /// Replaces an object (PUT); with a resourceVersion in the body it must
    /// be the stored one (409 otherwise).
    pub fn update(
        &self,
        r: &'static ResourceType,
        ns: &str,
        name: &str,
        obj: Value,
        mode: UpdateMode,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let mut st = self.lock();
        let old = st.objects.get(&key(r, ns, name)).cloned();
        let Some(old) = old else {
            if mode == UpdateMode::Replace {
                drop(st);
                return self.create(r, Some(ns).filter(|n| !n.is_empty()), obj, dry_run);
            }
            return Err(ApiError::not_found(r, name));
        };
        if mode != UpdateMode::Replace
            && let Some(want) = meta_str(&obj, "resourceVersion").filter(|s| !s.is_empty())
            && Some(want) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiError::conflict(
                r,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        self.write(&mut st, r, ns, name, old, obj, mode, dry_run)
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        st: &mut State,
        r: &'static ResourceType,
        ns: &str,
        name: &str,
        old: Value,
        obj: Value,
        mode: UpdateMode,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let obj = match mode {
            UpdateMode::Status => {
                let mut merged = old.clone();
                merged["status"] = obj.get("status").cloned().unwrap_or(Value::Null);
                if merged["status"].is_null() {
                    merged.as_object_mut().map(|m| m.remove("status"));
                }
                merged
            }
            UpdateMode::Main if r.status_subresource => {
                let mut o = obj;
                match old.get("status") {
                    Some(s) if o.is_object() => o["status"] = s.clone(),
                    _ => {
                        o.as_object_mut().map(|m| m.remove("status"));
                    }
                }
                o
            }
            UpdateMode::Main | UpdateMode::Replace => obj,
        };
        let path_ns = Some(ns).filter(|n| !n.is_empty());
        let new = Self::prepare(st, r, path_ns, Some(name), obj, Some(&old))?;
        let strip = |o: &Value| without(o, &[], &["resourceVersion", "managedFields"]);
        if strip(&new) == strip(&old) {
            return Ok(old);
        }
        if dry_run {
            let mut new = new;
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
            return Ok(new);
        }
        Ok(self.commit(st, r, EventType::Modified, new, Some(old)))
    }

    /// Patches an object; an apply patch creates it when absent.
    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &self,
        r: &'static ResourceType,
        ns: &str,
        name: &str,
        kind: PatchType,
        body: &Value,
        status: bool,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let mut st = self.lock();
        let Some(old) = st.objects.get(&key(r, ns, name)).cloned() else {
            if kind == PatchType::Apply && !status {
                drop(st);
                return self.create(r, Some(ns).filter(|n| !n.is_empty()), body.clone(), dry_run);
            }
            return Err(ApiError::not_found(r, name));
        };
        let mut new = old.clone();
        match kind {
            PatchType::Merge | PatchType::Apply => patch::merge_patch(&mut new, body),
            PatchType::Strategic => {
                patch::strategic_merge_patch(r, &mut new, body).map_err(|e| ApiError::bad_request(e.clone()))?;
            }
            PatchType::Json => patch::json_patch(&mut new, body).map_err(|e| ApiError::new(422, "Invalid", e))?,
        }
        // A resourceVersion in the patch is a precondition.
        if let Some(want) = meta_str(&new, "resourceVersion")
            && Some(want) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiError::conflict(
                r,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        let mode = if status { UpdateMode::Status } else { UpdateMode::Main };
        self.write(&mut st, r, ns, name, old, new, mode, dry_run)
    }

    /// Deletes an object and returns its last state. `preconditions` is
    /// DeleteOptions.preconditions (`uid`, `resourceVersion`).
    pub fn delete(
        &self,
        r: &'static ResourceType,
        ns: &str,
        name: &str,
        preconditions: Option<&Value>,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let mut st = self.lock();
        let old = st
            .objects
            .get(&key(r, ns, name))
            .cloned()
            .ok_or_else(|| ApiError::not_found(r, name))?;
        if let Some(pre) = preconditions {
            for (field, what) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
                if let Some(want) = pre.get(field).and_then(Value::as_str)
                    && Some(want) != meta_str(&old, field)
                {
                    return Err(ApiError::conflict(
                        r,
                        name,
                        &format!(
                            "Precondition failed: {what} in precondition: {want}, {what} in object meta: {}",
                            meta_str(&old, field).unwrap_or("")
                        ),
                    ));
                }
            }
        }
        if dry_run {
            return Ok(old);
        }
        if r.plural == "namespaces" {
            // The real server empties a namespace in the background; this
            // one does it at once.
            let inner: Vec<(&'static ResourceType, String)> = st
                .objects
                .keys()
                .filter(|(_, ons, _)| ons == name)
                .filter_map(|(res, _, oname)| {
                    resources::ALL
                        .iter()
                        .copied()
                        .find(|t| t.namespaced && t.qualified() == *res)
                        .map(|t| (t, oname.clone()))
                })
                .collect();
            for (t, oname) in inner {
                if let Some(obj) = st.objects.get(&key(t, name, &oname)).cloned() {
                    self.commit(&mut st, t, EventType::Deleted, obj, None);
                }
            }
        }
        Ok(self.commit(&mut st, r, EventType::Deleted, old, None))
    }

    /// Deletes every matching object of a type; returns them.
    pub fn delete_collection(&self, r: &'static ResourceType, ns: Option<&str>, sel: &Selectors) -> Vec<Value> {
        let (items, _) = self.list(r, ns, sel);
        items
            .into_iter()
            .filter_map(|o| {
                let ns = meta_str(&o, "namespace").unwrap_or("").to_string();
                let name = meta_str(&o, "name").unwrap_or("").to_string();
                self.delete(r, &ns, &name, None, false).ok()
            })
            .collect()
    }

    /// Events after `cursor` (filtered) and the new cursor; `Err` if the
    /// history no longer reaches back to `cursor`.
    pub fn events_since(
        &self,
        cursor: u64,
        r: &'static ResourceType,
        ns: Option<&str>,
        sel: &Selectors,
    ) -> Result<(Vec<(EventType, Value)>, u64), ApiError> {
        let st = self.lock();
        if cursor < st.floor {
            return Err(ApiError::expired(cursor, st.floor));
        }
        let start = st.history.partition_point(|e| e.rv <= cursor);
        let events = st
            .history
            .range(start..)
            .filter(|e| std::ptr::eq(e.resource, r))
            .filter_map(|e| filter_event(e, ns, sel))
            .collect();
        Ok((events, st.rv.max(cursor)))
    }

    /// The matching objects (with kind and apiVersion) and the current
    /// resourceVersion, atomically: the initial events of a watch.
    pub fn snapshot(&self, r: &'static ResourceType, ns: Option<&str>, sel: &Selectors) -> (Vec<Value>, u64) {
        let (mut items, rv) = self.list(r, ns, sel);
        for i in &mut items {
            i["kind"] = json!(r.kind);
            i["apiVersion"] = json!(r.api_version());
        }
        (items, rv)
    }

    /// Number of stored objects of a type.
    pub fn count(&self, r: &'static ResourceType) -> usize {
        let q = r.qualified();
        self.lock().objects.keys().filter(|(res, _, _)| *res == q).count()
    }
}

/// Whether a Service other than `except` holds cluster IP `ip`.
fn service_ip_taken(st: &State, except: (&str, &str), ip: &str) -> bool {
    st.allocated
        .cluster_ips
        .get(ip)
        .is_some_and(|(ns, name)| (ns.as_str(), name.as_str()) != except)
}

fn node_ports_in_use(st: &State, except: (&str, &str)) -> BTreeSet<u64> {
    st.allocated
        .node_ports
        .iter()
        .filter(|(_, (ns, name))| (ns.as_str(), name.as_str()) != except)
        .map(|(port, _)| *port)
        .collect()
}

/// Service defaulting and allocation, as the real server does it:
/// type, sessionAffinity, protocols, targetPorts, a cluster IP and node
/// ports (kept from the stored object on update when left out).
/// A dual-stack Service's IPv6 ClusterIP (`spec.clusterIPs[1]`), as given
/// or as stored: kept, not allocated (this server allocates IPv4 only).
fn secondary_ipv6(spec: &Map<String, Value>, old_spec: &Value) -> Option<String> {
    let second = |ips: Option<&Value>| {
        let ip = ips?.get(1)?.as_str()?;
        ip.parse::<std::net::Ipv6Addr>().is_ok().then(|| ip.to_owned())
    };
    second(spec.get("clusterIPs")).or_else(|| second(old_spec.get("clusterIPs")))
}

fn default_service(st: &State, obj: &mut Value, old: Option<&Value>, name: &str) -> Result<(), ApiError> {
    let r = &resources::SERVICES;
    let ns = meta_str(obj, "namespace").unwrap_or("").to_string();
    if !obj.get("spec").is_some_and(Value::is_object) {
        obj["spec"] = json!({});
    }
    let old_spec = old.and_then(|o| o.get("spec")).cloned().unwrap_or(Value::Null);
    let spec = obj["spec"]
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("spec"))?;
    let ty = spec
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("ClusterIP")
        .to_string();
    if !matches!(ty.as_str(), "ClusterIP" | "NodePort" | "LoadBalancer" | "ExternalName") {
        return Err(ApiError::invalid(
            r,
            name,
            format!("spec.type: Unsupported value: \"{ty}\""),
        ));
    }
    spec.insert("type".into(), json!(ty));
    spec.entry("sessionAffinity").or_insert(json!("None"));
    let mut ports = spec.get("ports").and_then(Value::as_array).cloned().unwrap_or_default();
    if ports.is_empty() && ty != "ExternalName" {
        return Err(ApiError::invalid(r, name, "spec.ports: Required value"));
    }
    if ty != "ExternalName" {
        // Cluster IP.
        let old_ip = old_spec
            .get("clusterIP")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty());
        let given = spec.get("clusterIP").and_then(Value::as_str).filter(|s| !s.is_empty());
        let ip = match (given, old_ip) {
            (Some(g), Some(o)) if g != o => {
                return Err(ApiError::invalid(
                    r,
                    name,
                    "spec.clusterIPs[0]: Invalid value: field is immutable",
                ));
            }
            (Some(g), _) => {
                if g != "None" {
                    if g.parse::<Ipv4Addr>().is_err() {
                        return Err(ApiError::invalid(
                            r,
                            name,
                            format!("spec.clusterIP: Invalid value: \"{g}\""),
                        ));
                    }
                    if old_ip.is_none() && service_ip_taken(st, (&ns, name), g) {
                        return Err(ApiError::invalid(
                            r,
                            name,
                            format!(
                                "spec.clusterIPs: Invalid value: []string{{\"{g}\"}}: failed to allocate IP {g}: provided IP is already allocated"
                            ),
                        ));
                    }
                }
                g.to_string()
            }
            (None, Some(o)) => o.to_string(),
            (None, None) => {
                let (base, size) = st.service_cidr;
                (2..size.saturating_sub(1))
                    .map(|i| Ipv4Addr::from(base + i).to_string())
                    .find(|ip| !service_ip_taken(st, (&ns, name), ip))
                    .ok_or_else(|| ApiError::new(500, "InternalError", "no cluster IP left to allocate"))?
            }
        };
        spec.insert("clusterIP".into(), json!(ip));
        let ips = match secondary_ipv6(spec, &old_spec) {
            Some(ip6) => json!([ip, ip6]),
            None => json!([ip]),
        };
        spec.insert("clusterIPs".into(), ips);
        spec.entry("ipFamilies").or_insert(json!(["IPv4"]));
        spec.entry("ipFamilyPolicy").or_insert(json!("SingleStack"));
        spec.entry("internalTrafficPolicy").or_insert(json!("Cluster"));
        if matches!(ty.as_str(), "NodePort" | "LoadBalancer") {
            spec.entry("externalTrafficPolicy").or_insert(json!("Cluster"));
        }
    }
    // Ports.
    let node_ports = matches!(ty.as_str(), "NodePort" | "LoadBalancer");
    let mut used = if node_ports {
        node_ports_in_use(st, (&ns, name))
    } else {
        BTreeSet::new()
    };
    let old_ports = old_spec
        .get("ports")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let multi = ports.len() > 1;
    for (i, p) in ports.iter_mut().enumerate() {
        let Some(port) = p
            .get("port")
            .and_then(Value::as_u64)
            .filter(|p| (1..=65535).contains(p))
        else {
            return Err(ApiError::invalid(
                r,
                name,
                format!("spec.ports[{i}].port: Required value"),
            ));
        };
        if multi && p.get("name").and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(ApiError::invalid(
                r,
                name,
                format!("spec.ports[{i}].name: Required value"),
            ));
        }
        let proto = p.get("protocol").and_then(Value::as_str).unwrap_or("TCP").to_string();
        p["protocol"] = json!(proto);
        if p.get("targetPort").is_none() {
            p["targetPort"] = json!(port);
        }
        if !node_ports {
            if p.get("nodePort").is_some_and(|n| n.as_u64().unwrap_or(0) != 0) {
                return Err(ApiError::invalid(
                    r,
                    name,
                    format!("spec.ports[{i}].nodePort: Forbidden: may not be used when `type` is '{ty}'"),
                ));
            }
            continue;
        }
        let np = match p.get("nodePort").and_then(Value::as_u64).filter(|n| *n != 0) {
            Some(n) => {
                let (lo, hi) = st.node_ports;
                if n < u64::from(lo) || n > u64::from(hi) {
                    return Err(ApiError::invalid(
                        r,
                        name,
                        format!(
                            "spec.ports[{i}].nodePort: Invalid value: {n}: provided port is not in the valid range. The range of valid ports is {lo}-{hi}"
                        ),
                    ));
                }
                if used.contains(&n) {
                    return Err(ApiError::invalid(
                        r,
                        name,
                        format!("spec.ports[{i}].nodePort: Invalid value: {n}: provided port is already allocated"),
                    ));
                }
                n
            }
            None => {
                let same = old_ports.iter().find(|o| {
                    o.get("port").and_then(Value::as_u64) == Some(port)
                        && o.get("protocol").and_then(Value::as_str).unwrap_or("TCP") == proto
                });
                match same.and_then(|o| o.get("nodePort")).and_then(Value::as_u64) {
                    Some(n) if !used.contains(&n) => n,
                    _ => {
                        let (lo, hi) = st.node_ports;
                        (u64::from(lo)..=u64::from(hi))
                            .find(|n| !used.contains(n))
                            .ok_or_else(|| ApiError::new(500, "InternalError", "no node port left to allocate"))?
                    }
                }
            }
        };
        used.insert(np);
        p["nodePort"] = json!(np);
    }
    if !ports.is_empty() {
        spec.insert("ports".into(), Value::Array(ports));
    }
    if !obj.get("status").is_some_and(Value::is_object) {
        obj["status"] = json!({"loadBalancer": {}});
    }
    Ok(())
}

/// The object as a list item (list responses carry no kind/apiVersion per
/// item, like the real server's).
pub fn as_list_item(mut obj: Value) -> Value {
    if let Some(m) = obj.as_object_mut() {
        m.remove("kind");
        m.remove("apiVersion");
    }
    obj
}

/// Up to `limit` matching objects of type `r` after `after`, in key order.
fn page_of(
    st: &State,
    r: &'static ResourceType,
    ns: Option<&str>,
    sel: &Selectors,
    limit: usize,
    after: Option<&ContinueToken>,
) -> ListPage {
    let q = r.qualified();
    let start = match after {
        Some(token) => Bound::Excluded(key(r, &token.namespace, &token.name)),
        None => Bound::Included((q.clone(), String::new(), String::new())),
    };
    let mut matching = st
        .objects
        .range((start, Bound::Unbounded))
        .take_while(|((res, _, _), _)| *res == q)
        .filter(|((_, ons, _), obj)| ns.is_none_or(|n| n == ons) && sel.matches(obj))
        .peekable();
    let mut items = Vec::new();
    let mut last = None;
    for ((_, namespace, name), obj) in matching.by_ref().take(limit) {
        items.push(obj.clone());
        last = Some((namespace, name));
    }
    // The API server counts what is left only for lists without selectors
    // (it would have to filter the rest): the agent's lists have label
    // selectors, and counting the rest at every page made a 100,000-object
    // list quadratic.
    let more = matching.peek().is_some();
    let remaining = if more && sel.is_empty() { matching.count() } else { 0 };
    let next = last.filter(|_| more).map(|(namespace, name)| {
        ContinueToken {
            rv: st.rv,
            namespace: namespace.clone(),
            name: name.clone(),
        }
        .encode()
    });
    ListPage {
        items,
        rv: st.rv,
        next,
        remaining,
    }
}

/// One page of a list: its objects, the list's resourceVersion, and the
/// token for the next page if there is one.
pub struct ListPage {
    pub items: Vec<Value>,
    pub rv: u64,
    pub next: Option<String>,
    /// How many objects come after this page; counted (as by the API
    /// server) only for lists without selectors, 0 otherwise.
    pub remaining: usize,
}

impl ListPage {
    /// The list's `metadata`: `continue` and `remainingItemCount` only
    /// while there is more.
    pub fn metadata(&self) -> Value {
        let mut metadata = json!({"resourceVersion": self.rv.to_string()});
        if let Some(next) = &self.next {
            metadata["continue"] = json!(next);
            if self.remaining > 0 {
                metadata["remainingItemCount"] = json!(self.remaining);
            }
        }
        metadata
    }
}

/// Where the next page of a list starts: after `namespace/name`, in the
/// list as it was at `rv`. Opaque to clients, as the API server's is.
struct ContinueToken {
    rv: u64,
    namespace: String,
    name: String,
}

impl ContinueToken {
    fn encode(&self) -> String {
        format!("{}:{}/{}", self.rv, self.namespace, self.name)
    }

    fn parse(token: &str) -> Result<Self, ApiError> {
        let invalid = || ApiError::bad_request(format!("invalid continue token {token:?}"));
        let (rv, rest) = token.split_once(':').ok_or_else(invalid)?;
        let (namespace, name) = rest.split_once('/').ok_or_else(invalid)?;
        Ok(Self {
            rv: rv.parse().map_err(|_| invalid())?,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

/// A `...List` object.
pub fn list_object(r: &ResourceType, items: Vec<Value>, rv: u64) -> Value {
    list_object_with(r, items, json!({"resourceVersion": rv.to_string()}))
}

/// A `...List` object with `metadata` as given (a page of a list).
pub fn list_object_with(r: &ResourceType, items: Vec<Value>, metadata: Value) -> Value {
    let items: Vec<Value> = items.into_iter().map(as_list_item).collect();
    let mut list = Map::new();
    list.insert("kind".into(), json!(r.list_kind()));
    list.insert("apiVersion".into(), json!(r.api_version()));
    list.insert("metadata".into(), metadata);
    list.insert("items".into(), Value::Array(items));
    Value::Object(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_format() {
        let t = now_rfc3339();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z'), "{t}");
    }

    #[test]
    fn service_defaults_and_allocation() {
        let store = Store::new(100, &Allocation::default());
        let svc = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "nginx-service"},
            "spec": {"type": "NodePort", "ports": [{"port": 88, "targetPort": 80, "nodePort": 30791}]}});
        let created = store
            .create(&resources::SERVICES, Some("default"), svc, false)
            .expect("created");
        assert_eq!(created["spec"]["clusterIP"], "10.96.0.2");
        assert_eq!(created["spec"]["ports"][0]["protocol"], "TCP");
        assert_eq!(created["metadata"]["namespace"], "default");
        let other = json!({"metadata": {"name": "b"}, "spec": {"type": "NodePort", "ports": [{"port": 1}]}});
        let b = store
            .create(&resources::SERVICES, Some("default"), other, false)
            .expect("created");
        assert_eq!(b["spec"]["clusterIP"], "10.96.0.3");
        assert_eq!(b["spec"]["ports"][0]["nodePort"], 30000);
        let clash =
            json!({"metadata": {"name": "c"}, "spec": {"type": "NodePort", "ports": [{"port": 1, "nodePort": 30791}]}});
        let err = store
            .create(&resources::SERVICES, Some("default"), clash, false)
            .expect_err("clash");
        assert_eq!(err.code, 422);
        // An update without clusterIP/nodePort keeps them.
        let upd =
            json!({"metadata": {"name": "b"}, "spec": {"type": "NodePort", "ports": [{"port": 1, "targetPort": 2}]}});
        let b2 = store
            .update(&resources::SERVICES, "default", "b", upd, UpdateMode::Main, false)
            .expect("updated");
        assert_eq!(b2["spec"]["clusterIP"], "10.96.0.3");
        assert_eq!(b2["spec"]["ports"][0]["nodePort"], 30000);
        assert_eq!(b2["metadata"]["generation"], 2);
        assert_eq!(b2["metadata"]["uid"], b["metadata"]["uid"]);
        // A dual-stack Service keeps its IPv6 ClusterIP, also through an
        // update that does not repeat it.
        let dual = json!({"metadata": {"name": "d"}, "spec": {"type": "ClusterIP", "ports": [{"port": 1}],
            "clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9", "fd00:96::9"],
            "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack"}});
        let d = store
            .create(&resources::SERVICES, Some("default"), dual, false)
            .expect("created");
        assert_eq!(d["spec"]["clusterIPs"], json!(["10.96.0.9", "fd00:96::9"]));
        let upd = json!({"metadata": {"name": "d"}, "spec": {"type": "ClusterIP", "ports": [{"port": 2}]}});
        let d2 = store
            .update(&resources::SERVICES, "default", "d", upd, UpdateMode::Main, false)
            .expect("updated");
        assert_eq!(d2["spec"]["clusterIPs"], json!(["10.96.0.9", "fd00:96::9"]));
    }

    #[test]
    fn history_bound_expires_old_versions() {
        let store = Store::new(2, &Allocation::default());
        let rv0 = store.resource_version();
        for i in 0..3 {
            let ep = json!({"metadata": {"name": format!("e{i}")}, "subsets": []});
            store
                .create(&resources::ENDPOINTS, Some("default"), ep, false)
                .expect("created");
        }
        let sel = Selectors::default();
        let err = store
            .events_since(rv0, &resources::ENDPOINTS, None, &sel)
            .expect_err("expired");
        assert_eq!(err.code, 410);
        let (events, _) = store
            .events_since(rv0 + 1, &resources::ENDPOINTS, None, &sel)
            .expect("still in history");
        assert_eq!(events.len(), 2);
    }

    fn names(items: &[Value]) -> Vec<&str> {
        items.iter().filter_map(|o| o["metadata"]["name"].as_str()).collect()
    }

    #[test]
    fn paged_lists_go_on_where_the_last_page_ended() {
        let store = Store::new(100, &Allocation::default());
        for name in ["a", "b", "c", "d", "e"] {
            let ep = json!({"metadata": {"name": name}, "subsets": []});
            store
                .create(&resources::ENDPOINTS, Some("default"), ep, false)
                .expect("created");
        }
        let sel = Selectors::default();
        let list = |limit, token: Option<&str>| store.list_page(&resources::ENDPOINTS, None, &sel, limit, token);

        let first = list(Some(2), None).expect("first page");
        assert_eq!(names(&first.items), ["a", "b"]);
        assert_eq!(first.remaining, 3);
        assert_eq!(first.metadata()["remainingItemCount"], 3);
        let second = list(Some(2), first.next.as_deref()).expect("second page");
        assert_eq!(names(&second.items), ["c", "d"]);
        let last = list(Some(2), second.next.as_deref()).expect("last page");
        assert_eq!(names(&last.items), ["e"]);
        assert_eq!(last.next, None);
        assert!(last.metadata().get("continue").is_none());
        assert_eq!(last.rv, first.rv, "every page is the list at one resourceVersion");

        let whole = list(Some(0), None).expect("limit 0 is no limit");
        assert_eq!(names(&whole.items), ["a", "b", "c", "d", "e"]);
        assert_eq!(whole.next, None);
    }

    #[test]
    fn a_continue_token_from_before_a_change_expires() {
        let store = Store::new(100, &Allocation::default());
        for name in ["a", "b", "c"] {
            let ep = json!({"metadata": {"name": name}, "subsets": []});
            store
                .create(&resources::ENDPOINTS, Some("default"), ep, false)
                .expect("created");
        }
        let sel = Selectors::default();
        let first = store
            .list_page(&resources::ENDPOINTS, None, &sel, Some(1), None)
            .expect("first page");
        let ep = json!({"metadata": {"name": "z"}, "subsets": []});
        store
            .create(&resources::ENDPOINTS, Some("default"), ep, false)
            .expect("created");
        let err = store
            .list_page(&resources::ENDPOINTS, None, &sel, Some(1), first.next.as_deref())
            .err()
            .expect("the snapshot of the first page is gone");
        assert_eq!((err.code, err.reason), (410, "Expired"));
        let err = store
            .list_page(&resources::ENDPOINTS, None, &sel, Some(1), Some("garbage"))
            .err()
            .expect("a token this server never gave");
        assert_eq!(err.code, 400);
    }
}
