//! The UDP proxy of one service port: one session per client, each with a
//! socket of its own connected to the endpoint chosen for it. Datagrams
//! from the client go out through the session's socket; the endpoint's
//! answers come back to the session's socket and are sent to the client
//! from the service socket, from the address the client's datagram was
//! NATed to ([`super::pktinfo`]), so conntrack maps them back to the
//! Service address.
//!
//! A session ends when it has seen no datagram either way for the idle
//! timeout (kube-proxy's `udpIdleTimeout`), when its endpoint answers with
//! an error (ICMP: the port is closed), or at once when its endpoint leaves
//! the Service: the client's next datagram then starts a session with a
//! remaining endpoint.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{net::UdpSocket, sync::mpsc, task::JoinHandle, time::Instant};
use tracing::{debug, warn};

use super::{
    balancer::{Balancer, Endpoints},
    pktinfo,
};

/// kube-proxy's default `udpIdleTimeout` (a field of its userspace mode,
/// gone from `KubeProxyConfiguration` together with that mode, so there
/// is nothing to read it from).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_millis(250);

/// The largest UDP payload over IPv4.
const MAX_DATAGRAM: usize = 65_535;

/// After an unexpected receive error, so the loop does not spin.
const RECV_BACKOFF: Duration = Duration::from_millis(100);

/// Sessions are per client address and the local address it reached us on.
type SessionKey = (SocketAddr, IpAddr);

/// Relays datagrams arriving on `socket` (bound, with pktinfo enabled)
/// until the task is aborted; aborting it ends every session.
pub async fn serve(socket: UdpSocket, balancer: Arc<Balancer>, idle: Duration, name: Arc<str>) {
    let service = Arc::new(socket);
    let mut changes = balancer.subscribe();
    let (ended_tx, mut ended) = mpsc::unbounded_channel();
    let mut sessions = Sessions {
        service: service.clone(),
        balancer,
        idle,
        name,
        by_client: HashMap::new(),
        next_id: 0,
        ended: ended_tx,
    };
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        tokio::select! {
            received = pktinfo::recv(&service, &mut buf) => match received {
                Ok(datagram) => sessions.forward(&buf[..datagram.len], (datagram.from, datagram.to)),
                Err(e) => {
                    warn!(port = %sessions.name, error = %e, "receiving a datagram failed");
                    tokio::time::sleep(RECV_BACKOFF).await;
                }
            },
            Some((key, id)) = ended.recv() => sessions.end(key, id),
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
                let endpoints = changes.borrow_and_update().clone();
                sessions.close_gone(&endpoints);
            }
        }
    }
}

/// When a session last saw a datagram, in either direction.
struct Activity {
    start: Instant,
    /// Milliseconds after `start`.
    last: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }

    /// When the session expires unless a datagram comes first.
    fn expiry(&self, idle: Duration) -> Instant {
        self.start + Duration::from_millis(self.last.load(Ordering::Relaxed)) + idle
    }
}

struct Session {
    id: u64,
    endpoint: SocketAddr,
    socket: Arc<UdpSocket>,
    activity: Arc<Activity>,
    replies: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.replies.abort();
    }
}

struct Sessions {
    service: Arc<UdpSocket>,
    balancer: Arc<Balancer>,
    idle: Duration,
    name: Arc<str>,
    by_client: HashMap<SessionKey, Session>,
    next_id: u64,
    /// Where reply tasks report that their session ended by itself.
    ended: mpsc::UnboundedSender<(SessionKey, u64)>,
}

impl Sessions {
    /// Sends a client's datagram to its session's endpoint, opening the
    /// session first if there is none (or its endpoint left).
    fn forward(&mut self, data: &[u8], key: SessionKey) {
        let stale = self
            .by_client
            .get(&key)
            .is_some_and(|s| !self.balancer.contains(s.endpoint));
        if stale {
            self.by_client.remove(&key);
        }
        if !self.by_client.contains_key(&key) {
            match self.open(key) {
                Ok(Some(session)) => {
                    self.by_client.insert(key, session);
                }
                Ok(None) => {
                    debug!(port = %self.name, client = %key.0, "no endpoint: datagram dropped");
                    return;
                }
                Err(e) => {
                    warn!(port = %self.name, client = %key.0, error = %e, "cannot open a UDP session");
                    return;
                }
            }
        }
        let Some(session) = self.by_client.get(&key) else {
            return;
        };
        session.activity.touch();
        // UDP may drop: a full send buffer loses this datagram, it does not
        // stall every other client.
        if let Err(e) = send_now(&session.socket, data) {
            debug!(port = %self.name, endpoint = %session.endpoint, error = %e, "datagram to the endpoint dropped");
        }
    }

    /// A session with the client's endpoint ([`Balancer::pick`]: the next
    /// in turn, or with affinity the one the client had); `None` if there
    /// is none.
    fn open(&mut self, key: SessionKey) -> io::Result<Option<Session>> {
        let Some(endpoint) = self.balancer.pick(key.0.ip()) else {
            return Ok(None);
        };
        let any: IpAddr = if endpoint.is_ipv6() {
            Ipv6Addr::UNSPECIFIED.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        };
        let socket = std::net::UdpSocket::bind((any, 0))?;
        socket.connect(endpoint)?;
        socket.set_nonblocking(true)?;
        let socket = Arc::new(UdpSocket::from_std(socket)?);
        let activity = Arc::new(Activity::new());
        self.next_id += 1;
        let id = self.next_id;
        let replies = tokio::spawn(relay_replies(Reply {
            socket: socket.clone(),
            service: self.service.clone(),
            client: key.0,
            local: key.1,
            activity: activity.clone(),
            idle: self.idle,
            ended: self.ended.clone(),
            key,
            id,
        }));
        debug!(port = %self.name, client = %key.0, %endpoint, "UDP session opened");
        Ok(Some(Session {
            id,
            endpoint,
            socket,
            activity,
            replies,
        }))
    }

    /// Forgets a session that ended by itself, unless a newer one for the
    /// same client took its place meanwhile.
    fn end(&mut self, key: SessionKey, id: u64) {
        if self.by_client.get(&key).is_some_and(|s| s.id == id) {
            self.by_client.remove(&key);
        }
    }

    /// Closes the sessions whose endpoint is no longer in `endpoints`.
    fn close_gone(&mut self, endpoints: &Endpoints) {
        let before = self.by_client.len();
        self.by_client.retain(|_, s| endpoints.contains(&s.endpoint));
        let closed = before - self.by_client.len();
        if closed > 0 {
            debug!(port = %self.name, closed, "closed UDP sessions whose endpoint left");
        }
    }
}

/// Sends on a connected socket without waiting. Not tokio's `try_send`:
/// that reports WouldBlock until the reactor has seen the new socket
/// writable once, which would lose every session's first datagram.
fn send_now(socket: &UdpSocket, data: &[u8]) -> io::Result<usize> {
    let sent = nix::sys::socket::send(socket.as_raw_fd(), data, nix::sys::socket::MsgFlags::MSG_DONTWAIT)?;
    Ok(sent)
}

/// What a session's reply task needs.
struct Reply {
    socket: Arc<UdpSocket>,
    service: Arc<UdpSocket>,
    client: SocketAddr,
    local: IpAddr,
    activity: Arc<Activity>,
    idle: Duration,
    ended: mpsc::UnboundedSender<(SessionKey, u64)>,
    key: SessionKey,
    id: u64,
}

/// Sends the endpoint's answers to the client until the session idles
/// out or the endpoint reports an error.
async fn relay_replies(reply: Reply) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let expiry = reply.activity.expiry(reply.idle);
        tokio::select! {
            received = reply.socket.recv(&mut buf) => match received {
                Ok(n) => {
                    reply.activity.touch();
                    if let Err(e) = pktinfo::send(&reply.service, &buf[..n], reply.local, reply.client).await {
                        debug!(client = %reply.client, error = %e, "answer to the client dropped");
                    }
                }
                Err(e) => {
                    debug!(client = %reply.client, error = %e, "the endpoint failed: session ends");
                    break;
                }
            },
            () = tokio::time::sleep_until(expiry) => {
                if reply.activity.expiry(reply.idle) <= Instant::now() {
                    break;
                }
            }
        }
    }
    let _ = reply.ended.send((reply.key, reply.id));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UDP server on 127.0.0.1 answering every datagram with `name`.
    async fn backend(name: &'static str) -> SocketAddr {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind backend");
        let addr = socket.local_addr().expect("backend address");
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((_, peer)) = socket.recv_from(&mut buf).await {
                let _ = socket.send_to(name.as_bytes(), peer).await;
            }
        });
        addr
    }

    async fn proxy(balancer: Arc<Balancer>, idle: Duration) -> (SocketAddr, JoinHandle<()>) {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind proxy");
        pktinfo::enable(&socket, false).expect("IP_PKTINFO");
        let addr = socket.local_addr().expect("proxy address");
        (addr, tokio::spawn(serve(socket, balancer, idle, "test/udp".into())))
    }

    /// A client socket connected to the proxy: it only accepts answers
    /// from the proxy's address.
    async fn client(proxy: SocketAddr) -> UdpSocket {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind client");
        socket.connect(proxy).await.expect("connect");
        socket
    }

    async fn ask(client: &UdpSocket) -> String {
        client.send(b"hello").await.expect("send");
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(2), client.recv(&mut buf))
            .await
            .expect("an answer within 2 s")
            .expect("recv");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    const LONG_IDLE: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn a_client_stays_with_its_endpoint_and_new_clients_take_turns() {
        let (a, b) = (backend("a").await, backend("b").await);
        let (proxy, _task) = proxy(Arc::new(Balancer::new(vec![a, b])), LONG_IDLE).await;
        let first = client(proxy).await;
        let second = client(proxy).await;
        assert_eq!(ask(&first).await, "a");
        assert_eq!(ask(&second).await, "b");
        for _ in 0..3 {
            assert_eq!(ask(&first).await, "a");
            assert_eq!(ask(&second).await, "b");
        }
    }

    #[tokio::test]
    async fn a_session_whose_endpoint_left_moves_to_a_remaining_one() {
        let (a, b) = (backend("a").await, backend("b").await);
        let balancer = Arc::new(Balancer::new(vec![a, b]));
        let (proxy, _task) = proxy(balancer.clone(), LONG_IDLE).await;
        let (on_a, on_b) = (client(proxy).await, client(proxy).await);
        assert_eq!(ask(&on_a).await, "a");
        assert_eq!(ask(&on_b).await, "b");
        balancer.set(vec![b]);
        assert_eq!(ask(&on_a).await, "b", "the session on a was closed");
        assert_eq!(ask(&on_b).await, "b");
        balancer.set(vec![a, b]);
        assert_eq!(ask(&on_b).await, "b", "a session whose endpoint stays keeps it");
    }

    #[tokio::test]
    async fn an_idle_session_expires() {
        let (a, b) = (backend("a").await, backend("b").await);
        let idle = Duration::from_millis(400);
        let (proxy, _task) = proxy(Arc::new(Balancer::new(vec![a, b])), idle).await;
        let conn = client(proxy).await;
        assert_eq!(ask(&conn).await, "a");
        assert_eq!(ask(&conn).await, "a", "within the idle timeout: the same session");
        tokio::time::sleep(idle * 3).await;
        assert_eq!(ask(&conn).await, "b", "a new session, the next endpoint in turn");
    }

    #[tokio::test]
    async fn without_endpoints_datagrams_are_dropped_and_later_ones_served() {
        let balancer = Arc::new(Balancer::new(vec![]));
        let (proxy, _task) = proxy(balancer.clone(), LONG_IDLE).await;
        let conn = client(proxy).await;
        conn.send(b"lost").await.expect("send");
        let mut buf = [0u8; 16];
        let waited = tokio::time::timeout(Duration::from_millis(300), conn.recv(&mut buf)).await;
        assert!(waited.is_err(), "no answer without endpoints: {waited:?}");
        balancer.set(vec![backend("a").await]);
        assert_eq!(ask(&conn).await, "a");
    }

    #[tokio::test]
    async fn aborting_the_proxy_closes_its_socket_and_sessions() {
        let (proxy, task) = proxy(Arc::new(Balancer::new(vec![backend("a").await])), LONG_IDLE).await;
        let conn = client(proxy).await;
        assert_eq!(ask(&conn).await, "a");
        task.abort();
        let _ = task.await;
        // The sessions' tasks, which share the service socket, are aborted
        // with it; once they are gone the port is free again.
        let rebound = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                match UdpSocket::bind(proxy).await {
                    Ok(socket) => return socket,
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        })
        .await;
        assert!(rebound.is_ok(), "the proxy's port is still in use");
    }
}
