//! The Kubernetes API as a source: kube-rs watchers on Services and
//! EndpointSlices, with kube-proxy's filters.
//!
//! A watcher (re)list arrives as Init / InitApply... / InitDone and is sent on
//! as [`Update::ListBegin`], parts of [`LIST_PART`] objects and a closing
//! [`Update::Replace`], so deletions missed while disconnected still
//! disappear, a relist after "410 Gone" replaces state without ever
//! flushing it, and the agent takes in a large list while the rest of it
//! is still being received and decoded. Errors (API server down,
//! connection dropped) are retried with backoff; the data path keeps what
//! it has meanwhile.

use std::{path::Path, time::Duration};

use anyhow::{Context, Result};
use futures_util::{Stream, StreamExt};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, Config, Resource,
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt, utils::Backoff, watcher},
};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{
    SourceEvent, Update,
    request_counter::{CountRequest, RequestCounterLayer},
};

/// Services kube-proxy ignores: those another proxy implements, and headless ones.
const SERVICE_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
/// EndpointSlices of headless Services are of no use to a proxy.
const SLICE_SELECTOR: &str = "!service.kubernetes.io/headless";

/// A client from a kubeconfig file, or the in-cluster config if `None`.
/// Plain `http://` servers without credentials work (as in a test cluster).
/// Every request is reported to `count` (`rest_client_requests_total`).
pub async fn client(kubeconfig: Option<&Path>, count: Option<CountRequest>) -> Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => Config::incluster().context("no kubeconfig given and not running in a cluster")?,
    };
    let host = config
        .cluster_url
        .authority()
        .map(ToString::to_string)
        .unwrap_or_default();
    let builder = ClientBuilder::try_from(config).context("creating the Kubernetes client")?;
    Ok(match count {
        Some(count) => builder.with_layer(&RequestCounterLayer::new(&host, count)).build(),
        None => builder.build(),
    })
}

/// Starts the watchers (Services, EndpointSlices, and the Node named
/// `node_name`); they run until the receiver is dropped.
pub fn spawn(client: Client, node_name: &str, events: mpsc::Sender<SourceEvent>) {
    let services = Api::<Service>::all(client.clone());
    let slices = Api::<EndpointSlice>::all(client.clone());
    let nodes = Api::<Node>::all(client);
    tokio::spawn(forward(
        watcher(
            nodes,
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        ),
        events.clone(),
        SourceEvent::Node,
    ));
    tokio::spawn(forward(
        watcher(services, watcher::Config::default().labels(SERVICE_SELECTOR)).modify(slim_service),
        events.clone(),
        SourceEvent::Services,
    ));
    tokio::spawn(forward(
        watcher(slices, watcher::Config::default().labels(SLICE_SELECTOR)).modify(slim_slice),
        events,
        SourceEvent::Slices,
    ));
}

/// Drops, as it arrives, what of a Service no proxy reads: the parts of a
/// (re)list wait for the agent in the channel (see [`forward`]).
fn slim_service(svc: &mut Service) {
    svc.metadata.managed_fields = None;
}

/// Drops, as it arrives, what of an EndpointSlice no proxy reads (kube-proxy
/// neither): the server's field bookkeeping and, per endpoint, the
/// reference to its Pod, its hostname and the deprecated topology; and
/// gives back the spare capacity decoding left in the lists. The endpoints
/// of a (re)list are its bulk (100,000 at 10,000 Services x 10), and the
/// parts not yet taken in wait in the channel.
fn slim_slice(slice: &mut EndpointSlice) {
    slice.metadata.managed_fields = None;
    for endpoint in slice.endpoints.iter_mut().flatten() {
        endpoint.target_ref = None;
        endpoint.hostname = None;
        endpoint.deprecated_topology = None;
        endpoint.addresses.shrink_to_fit();
    }
    if let Some(endpoints) = slice.endpoints.as_mut() {
        endpoints.shrink_to_fit();
    }
}

/// How a failed watch is retried: from 0.2 s, doubling up to 5 s, with
/// jitter so that many nodes do not return to a recovered API server in
/// step. (kube-rs's default grows to 30 s plus jitter, which keeps a change
/// made during an outage waiting a minute or more after the server is back:
/// one backoff for the failed resume, another for the relist after 410.)
struct WatchBackoff {
    next: Duration,
}

const WATCH_RETRY_MIN: Duration = Duration::from_millis(200);
const WATCH_RETRY_MAX: Duration = Duration::from_secs(5);

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: WATCH_RETRY_MIN }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(WATCH_RETRY_MAX);
        // Up to +50%, from the clock: enough to spread nodes apart.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Some(delay + delay.mul_f64(f64::from(nanos % 1000) / 2000.0))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = WATCH_RETRY_MIN;
    }
}

/// How many objects of a list are sent on at a time. The agent turns each
/// part into its model on its own task while this one decodes the next:
/// at 10,000 Services x 10 endpoints that work no longer waits for the
/// whole list. (kube's watcher lists in pages of 500.)
const LIST_PART: usize = 500;

/// Turns watcher events into source events, a (re)list in parts.
async fn forward<K>(
    stream: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    events: mpsc::Sender<SourceEvent>,
    wrap: fn(Update<K>) -> SourceEvent,
) where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let kind = K::kind(&()).into_owned();
    let mut stream = std::pin::pin!(stream.backoff(WatchBackoff::default()));
    let mut part: Vec<K> = Vec::new();
    let mut listed = 0;
    while let Some(event) = stream.next().await {
        let update = match event {
            Ok(watcher::Event::Init) => {
                part.clear();
                listed = 0;
                Update::ListBegin
            }
            Ok(watcher::Event::InitApply(obj)) => {
                part.push(obj);
                listed += 1;
                if part.len() < LIST_PART {
                    continue;
                }
                Update::Listed(std::mem::replace(&mut part, Vec::with_capacity(LIST_PART)))
            }
            Ok(watcher::Event::InitDone) => {
                info!(kind, objects = listed, "listed");
                Update::Replace(std::mem::take(&mut part))
            }
            Ok(watcher::Event::Apply(obj)) => Update::Apply(obj),
            Ok(watcher::Event::Delete(obj)) => Update::Delete(obj),
            Err(e) => {
                // The watcher relists by itself (410 Gone included); the
                // data path keeps its state in the meantime.
                warn!(kind, error = %e, "watch failed; retrying");
                continue;
            }
        };
        if events.send(wrap(update)).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_objects_keep_what_the_model_reads() {
        let mut slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-1", "namespace": "default",
                "labels": {"kubernetes.io/service-name": "web"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z"},
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}]},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.0.1"], "nodeName": "node-a", "zone": "z1",
                "hostname": "web-0", "conditions": {"ready": true, "serving": true, "terminating": false},
                "hints": {"forZones": [{"name": "z1"}]},
                "deprecatedTopology": {"kubernetes.io/hostname": "node-a"},
                "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "default", "uid": "1234"}}]
        }))
        .unwrap();
        let mut want = slice.clone();
        want.metadata.managed_fields = None;
        for endpoint in want.endpoints.iter_mut().flatten() {
            endpoint.target_ref = None;
            endpoint.hostname = None;
            endpoint.deprecated_topology = None;
        }
        slim_slice(&mut slice);
        // Everything else stays: labels, annotations (the trigger time),
        // ports, addresses, conditions, node, zone, hints.
        assert_eq!(slice, want);
        assert!(want.endpoints.as_ref().unwrap()[0].hints.is_some());
    }

    /// A list of 1,200 Services broken off after 700, then listed again
    /// whole, then a watch event: each list begins afresh and goes on in
    /// parts, and what it named arrives exactly once.
    #[tokio::test]
    async fn a_list_is_sent_on_in_parts_and_a_broken_one_begins_again() {
        let svc = |i: usize| -> Service {
            serde_json::from_value(
                serde_json::json!({"metadata": {"name": format!("svc-{i}"), "namespace": "default"}}),
            )
            .unwrap()
        };
        let list = |count: usize| (0..count).map(move |i| Ok(watcher::Event::InitApply(svc(i))));
        let events = std::iter::once(Ok(watcher::Event::Init))
            .chain(list(700))
            .chain(std::iter::once(Ok(watcher::Event::Init)))
            .chain(list(1200))
            .chain([Ok(watcher::Event::InitDone), Ok(watcher::Event::Apply(svc(7)))]);
        let (tx, mut rx) = mpsc::channel(64);
        forward(futures_util::stream::iter(events), tx, SourceEvent::Services).await;

        let mut received = Vec::new();
        while let Some(SourceEvent::Services(update)) = rx.recv().await {
            received.push(match update {
                Update::ListBegin => "begin".to_owned(),
                Update::Listed(part) => format!("part {}", part.len()),
                Update::Replace(rest) => format!("end {}", rest.len()),
                Update::Apply(svc) => format!("apply {}", svc.metadata.name.unwrap_or_default()),
                Update::Delete(_) => "delete".to_owned(),
            });
        }
        assert_eq!(
            received,
            [
                "begin",
                "part 500",
                "begin",
                "part 500",
                "part 500",
                "end 200",
                "apply svc-7"
            ]
        );
    }

    #[test]
    fn watch_retries_start_fast_grow_to_a_cap_and_reset() {
        let mut backoff = WatchBackoff::default();
        let delays: Vec<Duration> = (0..8).map(|_| backoff.next().unwrap()).collect();
        assert!(delays[0] >= WATCH_RETRY_MIN && delays[0] <= WATCH_RETRY_MIN.mul_f64(1.5));
        assert!(delays.iter().all(|d| *d <= WATCH_RETRY_MAX.mul_f64(1.5)), "{delays:?}");
        assert!(delays[7] >= WATCH_RETRY_MAX, "{delays:?}");
        backoff.reset();
        assert!(backoff.next().unwrap() <= WATCH_RETRY_MIN.mul_f64(1.5));
    }
}
