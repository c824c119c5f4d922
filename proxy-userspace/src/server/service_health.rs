//! Health check node ports (`spec.healthCheckNodePort`), the way
//! kube-proxy's service health server answers them.
//!
//! The API server gives a LoadBalancer Service with `externalTrafficPolicy:
//! Local` a health check node port; a cloud load balancer asks every node
//! on it whether to send the Service's traffic there. Each node answers
//! 200 when it has a ready endpoint of the Service (and the proxy is
//! healthy), 503 otherwise, with a JSON body naming the Service and the
//! count, on any path. Listeners open and close as such Services come and
//! go, after each successful sync; a port that cannot be bound is logged
//! and counted and tried again at the next full sync, never fatal.
//!
//! Works the same in every mode: it reads the desired state, not a mode's
//! kernel state.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex, PoisonError},
};

use hyper::{StatusCode, header::HeaderValue};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::{
    JSON, Telemetry,
    http::{self, Response},
};
use crate::{
    config::{Config, NodePortAddresses},
    model::{IPV6_SUFFIX, ServicePort},
};

/// A Service, as `(namespace, name)`.
type ServiceKey = (String, String);

/// Local ready endpoint counts, shared with the listeners' handlers.
type Counts = Arc<Mutex<BTreeMap<ServiceKey, usize>>>;

/// What one health-checked port contributes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PortHealth {
    service: ServiceKey,
    health_check_port: u16,
    /// Addresses of this node's ready endpoints.
    local_ready: BTreeSet<IpAddr>,
}

/// The listeners of one Service's health check port.
struct Listener {
    port: u16,
    /// Empty when binding failed (retried at the next full sync).
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The health check node port servers of one agent.
pub struct ServiceHealth {
    node: Option<String>,
    /// Where each port listens (kube-proxy: every address, or the node's
    /// addresses that `nodePortAddresses` allows).
    addresses: Vec<IpAddr>,
    telemetry: Telemetry,
    /// Every joined port with a health check node port, by port name.
    ports: BTreeMap<String, PortHealth>,
    listeners: BTreeMap<ServiceKey, Listener>,
    counts: Counts,
}

impl ServiceHealth {
    /// Servers for a node named `node` (`None`: no endpoint is local, so
    /// every check answers 503), listening on `addresses`. The answers
    /// also say whether the proxy is healthy (`telemetry`), and bind
    /// failures are counted there.
    pub fn new(node: Option<String>, addresses: Vec<IpAddr>, telemetry: Telemetry) -> Self {
        Self {
            node,
            addresses,
            telemetry,
            ports: BTreeMap::new(),
            listeners: BTreeMap::new(),
            counts: Counts::default(),
        }
    }

    /// Takes in the desired state after a successful sync: `changed` names
    /// the ports that changed since the last call; `full` re-reads every
    /// port and retries ports that could not be bound.
    pub fn update(&mut self, desired: &BTreeMap<String, ServicePort>, changed: &BTreeSet<String>, full: bool) {
        let before = self.ports.len();
        if full {
            self.ports = desired
                .iter()
                .filter_map(|(name, port)| Some((name.clone(), self.port_health(port)?)))
                .collect();
        } else {
            for name in changed {
                match desired.get(name).and_then(|port| self.port_health(port)) {
                    Some(health) => self.ports.insert(name.clone(), health),
                    None => self.ports.remove(name),
                };
            }
            if before == 0 && self.ports.is_empty() {
                return;
            }
        }
        let wanted = self.wanted();
        self.sync_listeners(&wanted, full);
        let counts = wanted.into_iter().map(|(key, (_, count))| (key, count)).collect();
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner) = counts;
    }

    /// The ports listening now, by Service (for tests and logs).
    pub fn listening(&self) -> BTreeMap<ServiceKey, u16> {
        self.listeners
            .iter()
            .filter(|(_, l)| !l.tasks.is_empty())
            .map(|(key, l)| (key.clone(), l.port))
            .collect()
    }

    fn port_health(&self, port: &ServicePort) -> Option<PortHealth> {
        let health_check_port = port.health_check_node_port?;
        let service = service_of(&port.name)?;
        let node = self.node.as_deref();
        let local_ready = port
            .endpoints
            .iter()
            .filter(|e| e.ready && e.is_on(node))
            .map(|e| e.addr)
            .collect();
        Some(PortHealth {
            service,
            health_check_port,
            local_ready,
        })
    }

    /// Per Service: its health check port (the first port's, should two
    /// ports disagree) and its local ready endpoints, each address once
    /// across the Service's ports (a pod is one endpoint).
    fn wanted(&self) -> BTreeMap<ServiceKey, (u16, usize)> {
        let mut per_service: BTreeMap<ServiceKey, (u16, BTreeSet<IpAddr>)> = BTreeMap::new();
        for health in self.ports.values() {
            let entry = per_service
                .entry(health.service.clone())
                .or_insert_with(|| (health.health_check_port, BTreeSet::new()));
            entry.1.extend(&health.local_ready);
        }
        per_service
            .into_iter()
            .map(|(key, (port, local))| (key, (port, local.len())))
            .collect()
    }

    /// Closes the listeners no Service wants any more (or on another port)
    /// and opens the new ones; with `retry`, also those that failed.
    fn sync_listeners(&mut self, wanted: &BTreeMap<ServiceKey, (u16, usize)>, retry: bool) {
        self.listeners.retain(|key, listener| {
            let keep = wanted.get(key).is_some_and(|(port, _)| *port == listener.port)
                && (!retry || !listener.tasks.is_empty());
            if !keep && !listener.tasks.is_empty() {
                info!(service = %format_key(key), port = listener.port, "closing the health check node port");
            }
            keep
        });
        for (key, (port, _)) in wanted {
            if !self.listeners.contains_key(key) {
                let listener = self.open(key, *port);
                self.listeners.insert(key.clone(), listener);
            }
        }
    }

    /// Binds `port` on every address; if one fails, none is kept (kube-proxy
    /// too: the port is tried again as a whole).
    fn open(&self, key: &ServiceKey, port: u16) -> Listener {
        let mut tasks = Vec::new();
        for addr in &self.addresses {
            let addr = SocketAddr::new(*addr, port);
            match bind_now(addr) {
                Ok(listener) => {
                    let route = route(key.clone(), self.counts.clone(), self.telemetry.clone());
                    tasks.push(tokio::spawn(http::serve("health check node port", listener, route)));
                }
                Err(e) => {
                    warn!(service = %format_key(key), %addr, error = %e,
                        "cannot open the health check node port; retrying at the next full sync");
                    self.telemetry.health_check_bind_failed();
                    for task in &tasks {
                        task.abort();
                    }
                    return Listener {
                        port,
                        tasks: Vec::new(),
                    };
                }
            }
        }
        info!(service = %format_key(key), port, addresses = ?self.addresses, "serving the health check node port");
        Listener { port, tasks }
    }
}

/// Where health check node ports listen: every address, unless
/// `nodePortAddresses` names some (then this node's addresses it allows,
/// as NodePorts); IPv4 only for now.
pub fn listen_addresses(config: &Config) -> Vec<IpAddr> {
    let any = vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)];
    match &config.node_port_addresses {
        NodePortAddresses::All => any,
        NodePortAddresses::Primary => {
            let ips: Vec<IpAddr> = config.ipv4_node_ips().into_iter().map(IpAddr::V4).collect();
            if ips.is_empty() { any } else { ips }
        }
        NodePortAddresses::Cidrs(cidrs) => match crate::sys::addrs::local_ipv4() {
            Ok(local) => {
                let ips: Vec<IpAddr> = local
                    .into_iter()
                    .map(IpAddr::V4)
                    .filter(|ip| cidrs.iter().any(|c| c.contains(*ip)))
                    .collect();
                if ips.is_empty() {
                    warn!(
                        ?cidrs,
                        "no address of this node is in nodePortAddresses: health check node ports listen nowhere"
                    );
                }
                ips
            }
            Err(e) => {
                // kube-proxy does the same when it cannot list addresses.
                warn!(error = %format!("{e:#}"), "cannot list this node's addresses: health check node ports listen on every address");
                any
            }
        },
    }
}

/// Binds at once, so a failure is known in the sync that asked for it.
fn bind_now(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(listener)
}

/// The Service of a port named `namespace/name` or `namespace/name:port`.
fn service_of(port_name: &str) -> Option<ServiceKey> {
    let port_name = port_name.strip_suffix(IPV6_SUFFIX).unwrap_or(port_name);
    let (namespace, rest) = port_name.split_once('/')?;
    let name = rest.split_once(':').map_or(rest, |(name, _)| name);
    Some((namespace.to_owned(), name.to_owned()))
}

fn format_key((namespace, name): &ServiceKey) -> String {
    format!("{namespace}/{name}")
}

/// Answers every request for `key` from the shared counts.
fn route(
    key: ServiceKey,
    counts: Counts,
    telemetry: Telemetry,
) -> impl Fn(&hyper::Request<hyper::body::Incoming>) -> Response + Clone + Send + Sync + 'static {
    let counts_and_key = Arc::new((counts, key));
    move |_req| {
        let (counts, key) = &*counts_and_key;
        let count = counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .copied()
            .unwrap_or(0);
        answer(key, count, telemetry.is_healthy())
    }
}

/// kube-proxy's answer: 200 with local endpoints and a healthy proxy, else
/// 503; the same headers and body either way.
fn answer((namespace, name): &ServiceKey, count: usize, proxy_healthy: bool) -> Response {
    let status = if count > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    // kube-proxy's layout, tab-indented.
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}",
        quote(namespace),
        quote(name),
    );
    let mut resp = http::response(status, JSON, body);
    let headers = resp.headers_mut();
    headers.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    headers.insert("x-load-balancing-endpoint-weight", HeaderValue::from(count));
    resp
}

#[cfg(test)]
mod tests;
