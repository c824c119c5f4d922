//! Watch responses: a 200 with a chunked body of newline-delimited JSON
//! events, like the real server's.

use std::{
    collections::VecDeque,
    io,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::{sync::watch, time::Instant};

use super::{
    Shared,
    resources::ResourceType,
    selector::Selectors,
    store::{ApiError, EventType},
};

/// What a watch request asked for.
#[derive(Debug, Clone)]
pub struct WatchRequest {
    pub resource: &'static ResourceType,
    pub namespace: Option<String>,
    pub selectors: Selectors,
    /// `None` for "" and "0": start with the current state as ADDED events.
    pub resource_version: Option<u64>,
    pub bookmarks: bool,
    pub send_initial_events: Option<bool>,
    pub timeout: Option<Duration>,
}

/// Decrements the open-watch count when the response body goes away, for
/// whatever reason (end, timeout, dropped connection, server stop).
struct OpenWatch(Arc<Shared>);

impl OpenWatch {
    fn new(shared: Arc<Shared>) -> Self {
        shared.open_watches.fetch_add(1, Ordering::SeqCst);
        shared.watches_started.fetch_add(1, Ordering::SeqCst);
        shared.watch_count_changed.send_modify(|n| *n += 1);
        Self(shared)
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
        self.0.watch_count_changed.send_modify(|n| *n += 1);
    }
}

struct WatchStream {
    shared: Arc<Shared>,
    req: WatchRequest,
    cursor: u64,
    /// Chunks to send before looking at the store again.
    queued: VecDeque<Bytes>,
    deadline: Option<Instant>,
    changed: watch::Receiver<u64>,
    drop_generation: u64,
    drops: watch::Receiver<u64>,
    interval: watch::Receiver<Option<Duration>>,
    next_bookmark: Option<Instant>,
    done: bool,
    _open: OpenWatch,
}

pub fn event_line(ty: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": ty, "object": object})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

impl WatchStream {
    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        let object = json!({
            "kind": self.req.resource.kind,
            "apiVersion": self.req.resource.api_version(),
            "metadata": metadata,
        });
        event_line("BOOKMARK", &object)
    }

    fn schedule_bookmark(&mut self) {
        self.next_bookmark = match *self.interval.borrow_and_update() {
            Some(d) if self.req.bookmarks && !d.is_zero() => Some(Instant::now() + d),
            _ => None,
        };
    }

    async fn next_chunk(&mut self) -> Option<Result<Bytes, io::Error>> {
        if self.done {
            return None;
        }
        loop {
            if let Some(chunk) = self.queued.pop_front() {
                return Some(Ok(chunk));
            }
            if *self.drops.borrow_and_update() != self.drop_generation {
                // An error from the body makes hyper cut the connection
                // without the closing chunk: an abrupt end mid-stream.
                self.done = true;
                return Some(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "watch dropped by the test",
                )));
            }
            self.changed.borrow_and_update();
            let r = self.req.resource;
            match self
                .shared
                .store
                .events_since(self.cursor, r, self.req.namespace.as_deref(), &self.req.selectors)
            {
                Err(e) => {
                    // The real server's answer to a too old resourceVersion:
                    // one ERROR event with a 410 Status, then the end.
                    self.done = true;
                    return Some(Ok(event_line("ERROR", &e.status())));
                }
                Ok((events, cursor)) => {
                    self.cursor = cursor;
                    if !events.is_empty() {
                        let mut chunk = Vec::new();
                        for (ty, obj) in events {
                            chunk.extend_from_slice(&event_line(ty.as_str(), &obj));
                        }
                        return Some(Ok(Bytes::from(chunk)));
                    }
                }
            }
            let far = Instant::now() + Duration::from_secs(86_400 * 365);
            let bookmark_at = self.next_bookmark.unwrap_or(far);
            let deadline = self.deadline.unwrap_or(far);
            tokio::select! {
                res = self.changed.changed() => {
                    if res.is_err() {
                        self.done = true;
                        return None;
                    }
                }
                _ = self.drops.changed() => {}
                _ = self.interval.changed() => self.schedule_bookmark(),
                _ = tokio::time::sleep_until(bookmark_at), if self.next_bookmark.is_some() => {
                    self.schedule_bookmark();
                    return Some(Ok(self.bookmark(self.cursor, false)));
                }
                _ = tokio::time::sleep_until(deadline), if self.deadline.is_some() => {
                    // timeoutSeconds: a clean end of the stream.
                    self.done = true;
                    return None;
                }
            }
        }
    }
}

/// The body stream of a watch response.
pub fn stream(
    shared: Arc<Shared>,
    req: WatchRequest,
) -> Result<impl futures::Stream<Item = Result<Bytes, io::Error>> + Send + 'static, ApiError> {
    let store = &shared.store;
    let changed = store.subscribe();
    let drops = shared.drop_watches.subscribe();
    let drop_generation = *drops.borrow();
    let mut queued = VecDeque::new();
    let initial = match (req.resource_version, req.send_initial_events) {
        (_, Some(false)) => false,
        (None, _) | (_, Some(true)) => true,
        (Some(_), None) => false,
    };
    let cursor = if initial {
        let (objects, rv) = store.snapshot(req.resource, req.namespace.as_deref(), &req.selectors);
        if !objects.is_empty() {
            let mut chunk = Vec::new();
            for o in &objects {
                chunk.extend_from_slice(&event_line(EventType::Added.as_str(), o));
            }
            queued.push_back(Bytes::from(chunk));
        }
        rv
    } else {
        req.resource_version.unwrap_or_else(|| store.resource_version())
    };
    let deadline = req.timeout.map(|t| Instant::now() + t);
    let interval = shared.bookmark_interval.subscribe();
    let mut ws = WatchStream {
        shared: shared.clone(),
        cursor,
        queued,
        deadline,
        changed,
        drop_generation,
        drops,
        interval,
        next_bookmark: None,
        done: false,
        _open: OpenWatch::new(shared.clone()),
        req,
    };
    if ws.req.send_initial_events == Some(true) && ws.req.bookmarks {
        let b = ws.bookmark(cursor, true);
        ws.queued.push_back(b);
    }
    ws.schedule_bookmark();
    Ok(futures::stream::unfold(ws, |mut ws| async move {
        let item = ws.next_chunk().await?;
        Some((item, ws))
    }))
}
