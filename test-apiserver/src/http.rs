//! Request routing: discovery, the resource endpoints, and the `/_test/`
//! control endpoints.

use std::{convert::Infallible, io, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Frame, Incoming},
    header,
};
use serde_json::{Value, json};

use super::{
    Shared,
    resources::{self, ResourceType},
    selector::{FieldSelector, LabelSelector, Selectors},
    store::{ApiError, PatchType, UpdateMode, list_object, list_object_with},
    table,
    watch::{self, WatchRequest},
};

pub type Body = BoxBody<Bytes, io::Error>;

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed()
}

fn json_response(code: u16, v: &Value) -> Response<Body> {
    let body = serde_json::to_vec(v).unwrap_or_default();
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(full(body))
        .unwrap_or_else(|_| Response::new(full("")))
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.status())
}

fn not_found_path() -> ApiError {
    ApiError::new(404, "NotFound", "the server could not find the requested resource")
}

/// Percent-decoding of a query component (`+` is a space).
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The query parameters of a request.
#[derive(Debug, Default)]
pub struct Query(Vec<(String, String)>);

impl Query {
    pub fn parse(q: &str) -> Self {
        Self(
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (decode(k), decode(v))
                })
                .collect(),
        )
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.0.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str())
    }

    fn flag(&self, k: &str) -> Option<bool> {
        self.get(k).map(|v| matches!(v, "true" | "1" | "True" | ""))
    }
}

/// A request for a resource path, parsed.
struct Target {
    resource: &'static ResourceType,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn parse_target(group: &str, version: &str, segs: &[&str]) -> Result<Target, ApiError> {
    let (namespace, rest) = match segs {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() && !matches!(rest, ["status" | "finalize"]) => {
            (Some((*ns).to_string()), rest)
        }
        _ => (None, segs),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(*n), None),
        [p, n, s] => (*p, Some(*n), Some(*s)),
        _ => return Err(not_found_path()),
    };
    let resource = resources::by_path(group, version, plural).ok_or_else(not_found_path)?;
    if namespace.is_some() && !resource.namespaced {
        return Err(not_found_path());
    }
    if resource.namespaced && name.is_some() && namespace.is_none() {
        return Err(not_found_path());
    }
    let status = match sub {
        None => false,
        Some("status") if resource.status_subresource => true,
        // A namespace's finalize subresource: treated as its status.
        Some("finalize") if resource.plural == "namespaces" => true,
        Some(_) => return Err(not_found_path()),
    };
    Ok(Target {
        resource,
        namespace,
        name: name.map(str::to_string),
        status,
    })
}

fn selectors(q: &Query) -> Result<Selectors, ApiError> {
    Ok(Selectors {
        labels: LabelSelector::parse(q.get("labelSelector").unwrap_or("")).map_err(ApiError::bad_request)?,
        fields: FieldSelector::parse(q.get("fieldSelector").unwrap_or("")).map_err(ApiError::bad_request)?,
    })
}

async fn read_json(req: Request<Incoming>) -> Result<(Option<String>, Value), ApiError> {
    let ctype = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
    let bytes = req
        .into_body()
        .collect()
        .await
        .map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok((ctype, Value::Null));
    }
    if ctype.as_deref().is_some_and(|c| c.contains("protobuf")) {
        return Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            "this test server speaks JSON only",
        ));
    }
    let v = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    Ok((ctype, v))
}

fn wants_table(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=Table"))
}

async fn resource_request(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    group: &str,
    version: &str,
    segs: &[&str],
    q: &Query,
) -> Result<Response<Body>, ApiError> {
    let t = parse_target(group, version, segs)?;
    let r = t.resource;
    let store = &shared.store;
    let dry_run = q.get("dryRun").is_some_and(|v| !v.is_empty());
    let ns = t.namespace.clone().unwrap_or_default();
    let method = req.method().clone();
    let watching = q.flag("watch").unwrap_or(false);
    match (method, t.name.as_deref()) {
        (Method::GET, name) if watching => {
            let mut sel = selectors(q)?;
            if let Some(n) = name {
                sel.fields = std::mem::take(&mut sel.fields).and(FieldSelector::name(n));
            }
            let resource_version = match q.get("resourceVersion").unwrap_or("") {
                "" | "0" => None,
                v => Some(
                    v.parse::<u64>()
                        .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {v:?}")))?,
                ),
            };
            let timeout = match q.get("timeoutSeconds") {
                Some(s) => {
                    Some(Duration::from_secs(s.parse().map_err(|_| {
                        ApiError::bad_request(format!("invalid timeoutSeconds {s:?}"))
                    })?))
                }
                None => None,
            };
            let wr = WatchRequest {
                resource: r,
                namespace: t.namespace,
                selectors: sel,
                resource_version,
                bookmarks: q.flag("allowWatchBookmarks").unwrap_or(false),
                send_initial_events: q.flag("sendInitialEvents"),
                timeout,
            };
            let table = wants_table(&req).then(|| table::Include::from_query(q.get("includeObject")));
            let events = watch::stream(shared.clone(), wr)?;
            let body: Body = if let Some(include) = table {
                BodyExt::boxed(StreamBody::new(futures::StreamExt::map(events, move |c| {
                    c.map(|b| Frame::data(table::watch_chunk_as_table(r, &b, include)))
                })))
            } else {
                BodyExt::boxed(StreamBody::new(futures::StreamExt::map(events, |c| c.map(Frame::data))))
            };
            Ok(Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::CACHE_CONTROL, "no-cache, private")
                .body(body)
                .unwrap_or_else(|_| Response::new(full(""))))
        }
        (Method::GET, None) => {
            let sel = selectors(q)?;
            if wants_table(&req) {
                // Tables come whole: kubectl reads a table without `continue` as the end.
                let (items, rv) = store.list(r, t.namespace.as_deref(), &sel);
                let include = table::Include::from_query(q.get("includeObject"));
                return Ok(json_response(200, &table::table(r, &items, Some(rv), include)));
            }
            let limit = match q.get("limit") {
                Some(l) => Some(
                    l.parse::<usize>()
                        .map_err(|_| ApiError::bad_request(format!("invalid limit {l:?}")))?,
                ),
                None => None,
            };
            let continue_token = q.get("continue").filter(|c| !c.is_empty());
            let page = store.list_page(r, t.namespace.as_deref(), &sel, limit, continue_token)?;
            let metadata = page.metadata();
            Ok(json_response(200, &list_object_with(r, page.items, metadata)))
        }
        (Method::GET, Some(name)) => {
            let obj = store.get(r, &ns, name)?;
            if wants_table(&req) {
                let include = table::Include::from_query(q.get("includeObject"));
                return Ok(json_response(200, &table::table(r, &[obj], None, include)));
            }
            Ok(json_response(200, &obj))
        }
        (Method::POST, None) => {
            if r.namespaced && t.namespace.is_none() {
                return Err(ApiError::new(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                ));
            }
            let (_, body) = read_json(req).await?;
            let created = store.create(r, t.namespace.as_deref(), body, dry_run)?;
            Ok(json_response(201, &created))
        }
        (Method::PUT, Some(name)) => {
            let (_, body) = read_json(req).await?;
            let mode = if t.status { UpdateMode::Status } else { UpdateMode::Main };
            Ok(json_response(200, &store.update(r, &ns, name, body, mode, dry_run)?))
        }
        (Method::PATCH, Some(name)) => {
            let (ctype, body) = read_json(req).await?;
            let kind = match ctype.as_deref() {
                Some("application/merge-patch+json") => PatchType::Merge,
                Some("application/strategic-merge-patch+json") => PatchType::Strategic,
                Some("application/json-patch+json") => PatchType::Json,
                Some("application/apply-patch+yaml" | "application/apply-patch+cbor") => PatchType::Apply,
                other => {
                    return Err(ApiError::new(
                        415,
                        "UnsupportedMediaType",
                        format!(
                            "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {other:?})"
                        ),
                    ));
                }
            };
            let patched = store.patch(r, &ns, name, kind, &body, t.status, dry_run)?;
            Ok(json_response(200, &patched))
        }
        (Method::DELETE, Some(name)) => {
            let (_, body) = read_json(req).await?;
            let deleted = store.delete(r, &ns, name, body.get("preconditions"), dry_run)?;
            Ok(json_response(200, &deleted))
        }
        (Method::DELETE, None) => {
            let sel = selectors(q)?;
            let deleted = store.delete_collection(r, t.namespace.as_deref(), &sel);
            let rv = store.resource_version();
            Ok(json_response(200, &list_object(r, deleted, rv)))
        }
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )),
    }
}

async fn control_request(
    shared: &Arc<Shared>,
    method: &Method,
    what: &str,
    q: &Query,
) -> Result<Response<Body>, ApiError> {
    let ok = |v: Value| Ok(json_response(200, &v));
    match (method, what) {
        (&Method::GET, "stats") => ok(shared.stats_json()),
        (&Method::GET, "requests") => ok(shared.requests_json()),
        (&Method::POST, "compact") => ok(json!({"resourceVersion": shared.store.compact().to_string()})),
        (&Method::POST, "drop-watches") => {
            let n = shared.open_watches.load(std::sync::atomic::Ordering::SeqCst);
            shared.drop_watches.send_modify(|g| *g += 1);
            ok(json!({"dropped": n}))
        }
        (&Method::POST, "bookmark-interval") => {
            let secs: f64 = q
                .get("seconds")
                .unwrap_or("0")
                .parse()
                .map_err(|_| ApiError::bad_request("seconds"))?;
            let d = (secs > 0.0).then(|| Duration::from_secs_f64(secs));
            shared.bookmark_interval.send_replace(d);
            ok(json!({"bookmarkIntervalSeconds": secs}))
        }
        (&Method::POST, "outage") => {
            let secs: f64 = q
                .get("seconds")
                .unwrap_or("0")
                .parse()
                .map_err(|_| ApiError::bad_request("seconds"))?;
            let shared = shared.clone();
            tokio::spawn(async move {
                // Let this response leave before the listener goes.
                tokio::time::sleep(Duration::from_millis(50)).await;
                shared.stop().await;
                tokio::time::sleep(Duration::from_secs_f64(secs.max(0.0))).await;
                if let Err(e) = shared.start().await {
                    eprintln!("xproxy-test-apiserver: restart after the outage failed: {e}");
                }
            });
            ok(json!({"outageSeconds": secs}))
        }
        _ => Err(not_found_path()),
    }
}

async fn route(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    path: &str,
    q: &Query,
) -> Result<Response<Body>, ApiError> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let get = req.method() == Method::GET;
    match segs.as_slice() {
        ["version"] if get => Ok(json_response(200, &resources::version_info())),
        ["healthz" | "livez" | "readyz"] if get => Ok(Response::builder()
            .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(full("ok"))
            .unwrap_or_else(|_| Response::new(full("ok")))),
        ["api"] if get => Ok(json_response(200, &resources::api_versions(&shared.addr().to_string()))),
        ["api", "v1"] if get => Ok(json_response(
            200,
            &resources::api_resource_list("", "v1").unwrap_or_default(),
        )),
        ["apis"] if get => Ok(json_response(200, &resources::api_group_list())),
        ["apis", group] if get => resources::api_group(group)
            .map(|g| json_response(200, &g))
            .ok_or_else(not_found_path),
        ["apis", group, version] if get => resources::api_resource_list(group, version)
            .map(|l| json_response(200, &l))
            .ok_or_else(not_found_path),
        ["openapi", "v3"] if get => Ok(json_response(200, &resources::openapi_v3_root())),
        ["openapi", "v3", rest @ ..] if get => resources::openapi_v3_doc(&rest.join("/"))
            .map(|d| json_response(200, &d))
            .ok_or_else(not_found_path),
        ["_test", what] if shared.test_endpoints => {
            let m = req.method().clone();
            control_request(shared, &m, what, q).await
        }
        ["api", "v1", rest @ ..] => {
            let rest: Vec<&str> = rest.to_vec();
            resource_request(shared, req, "", "v1", &rest, q).await
        }
        ["apis", group, version, rest @ ..] => {
            let (group, version, rest) = ((*group).to_string(), (*version).to_string(), rest.to_vec());
            resource_request(shared, req, &group, &version, &rest, q).await
        }
        _ => Err(not_found_path()),
    }
}

/// The service function of every connection.
pub async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let raw_query = req.uri().query().unwrap_or("").to_string();
    let accept = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    shared.record(req.method().as_str(), &path, &raw_query, accept);
    let q = Query::parse(&raw_query);
    let resp = route(&shared, req, &path, &q)
        .await
        .unwrap_or_else(|e| error_response(&e));
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q =
            Query::parse("labelSelector=%21service.kubernetes.io%2Fservice-proxy-name&watch=1&x=a+b&bad=%zz&end=%4");
        assert_eq!(
            q.get("labelSelector"),
            Some("!service.kubernetes.io/service-proxy-name")
        );
        assert_eq!(q.flag("watch"), Some(true));
        assert_eq!(q.get("x"), Some("a b"));
        assert_eq!(q.get("bad"), Some("%zz"));
        assert_eq!(q.get("end"), Some("%4"));
    }

    #[test]
    fn targets() {
        let t = parse_target("", "v1", &["namespaces", "default", "services", "x", "status"]).expect("parses");
        assert_eq!(
            (t.resource.plural, t.namespace.as_deref(), t.name.as_deref(), t.status),
            ("services", Some("default"), Some("x"), true)
        );
        let t = parse_target("", "v1", &["namespaces", "default"]).expect("parses");
        assert_eq!((t.resource.plural, t.name.as_deref()), ("namespaces", Some("default")));
        let t = parse_target("", "v1", &["namespaces", "default", "status"]).expect("parses");
        assert!(t.status);
        assert!(parse_target("", "v1", &["services", "x"]).is_err());
        assert!(parse_target("", "v1", &["namespaces", "d", "nodes"]).is_err());
        assert!(parse_target("", "v1", &["pods"]).is_err());
    }
}
