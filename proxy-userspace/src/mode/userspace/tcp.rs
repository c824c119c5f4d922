//! The TCP proxy of one service port: accept, connect to an endpoint,
//! relay both ways until both sides have closed.
//!
//! Every connection is a task of its own, detached from the accept loop:
//! stopping the loop (the port was removed) or changing the endpoints
//! leaves established connections running, as conntrack does for the
//! kernel modes; they end when the agent exits.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use super::balancer::Balancer;

/// kube-proxy's userspace `EndpointDialTimeouts`: an endpoint that does not
/// accept within its attempt's timeout is given up for the next one.
const DIAL_TIMEOUTS: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

/// After a failed accept (e.g. out of file descriptors), so the loop does
/// not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Accepts connections on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, balancer: Arc<Balancer>, name: Arc<str>) {
    loop {
        match listener.accept().await {
            Ok((client, peer)) => {
                tokio::spawn(relay(client, peer, balancer.clone(), name.clone()));
            }
            Err(e) => {
                warn!(port = %name, error = %e, "accepting a connection failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// Proxies one accepted connection. Without a reachable endpoint the client
/// is reset (not closed cleanly, which would read as an empty answer).
async fn relay(mut client: TcpStream, peer: SocketAddr, balancer: Arc<Balancer>, name: Arc<str>) {
    let Some((mut backend, endpoint)) = connect(&balancer, &name, client_ip(peer)).await else {
        debug!(port = %name, %peer, "no endpoint accepted the connection: resetting it");
        let _ = client.set_zero_linger();
        return;
    };
    // Go, and so kube-proxy, turns Nagle off; a relay must not add delay.
    let _ = client.set_nodelay(true);
    let _ = backend.set_nodelay(true);
    // Copies each direction until its EOF, then shuts the other side's
    // write half down: half-closes pass through.
    match tokio::io::copy_bidirectional(&mut client, &mut backend).await {
        Ok((up, down)) => debug!(port = %name, %peer, %endpoint, up, down, "connection done"),
        Err(e) => {
            debug!(port = %name, %peer, %endpoint, error = %e, "connection failed: resetting the client");
            let _ = client.set_zero_linger();
        }
    }
}

/// The client's address (affinity's key); an IPv4-mapped IPv6 peer
/// counts as its IPv4 address.
fn client_ip(peer: SocketAddr) -> IpAddr {
    peer.ip().to_canonical()
}

/// Connects to the client's endpoint ([`Balancer::pick`]), up to one
/// attempt per [`DIAL_TIMEOUTS`] entry; after a failure the next in turn
/// (and with affinity the client's endpoint from then on, as kube-proxy's
/// userspace mode resets a session whose endpoint failed).
async fn connect(balancer: &Balancer, name: &str, client: IpAddr) -> Option<(TcpStream, SocketAddr)> {
    for (attempt, timeout) in DIAL_TIMEOUTS.into_iter().enumerate() {
        let endpoint = if attempt == 0 {
            balancer.pick(client)?
        } else {
            balancer.pick_again(client)?
        };
        match tokio::time::timeout(timeout, TcpStream::connect(endpoint)).await {
            Ok(Ok(stream)) => return Some((stream, endpoint)),
            Ok(Err(e)) => debug!(port = name, %endpoint, error = %e, "endpoint refused: trying the next"),
            Err(_) => debug!(port = name, %endpoint, ?timeout, "endpoint did not answer: trying the next"),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::{io, net::Ipv4Addr};

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        sync::mpsc,
    };

    use super::*;

    /// A backend on 127.0.0.1 that reads until the client half-closes,
    /// then answers `name` and what it read, and closes.
    async fn backend(name: &'static str) -> SocketAddr {
        backend_telling(name).await.0
    }

    /// [`backend`], also telling of every connection it accepts.
    async fn backend_telling(name: &'static str) -> (SocketAddr, mpsc::UnboundedReceiver<()>) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind backend");
        let addr = listener.local_addr().expect("backend address");
        let (accepted, accepts) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let _ = accepted.send(());
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    conn.read_to_end(&mut request).await.expect("read until half-close");
                    let answer = format!("{name}:{}", String::from_utf8_lossy(&request));
                    conn.write_all(answer.as_bytes()).await.expect("answer");
                });
            }
        });
        (addr, accepts)
    }

    fn is_reset(e: &io::Error) -> bool {
        matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused | io::ErrorKind::BrokenPipe
        )
    }

    /// A port on 127.0.0.1 where nothing listens.
    fn closed_port() -> SocketAddr {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        listener.local_addr().expect("address")
    }

    async fn proxy(balancer: Arc<Balancer>) -> SocketAddr {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        tokio::spawn(serve(listener, balancer, "test/proxy".into()));
        addr
    }

    /// Sends `request`, half-closes, reads the answer to its end.
    async fn request(proxy: SocketAddr, request: &str) -> io::Result<String> {
        let mut conn = TcpStream::connect(proxy).await?;
        conn.write_all(request.as_bytes()).await?;
        conn.shutdown().await?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await?;
        Ok(answer)
    }

    #[tokio::test]
    async fn relays_both_ways_with_half_close_in_turn() {
        let (a, b) = (backend("a").await, backend("b").await);
        let proxy = proxy(Arc::new(Balancer::new(vec![a, b]))).await;
        let mut answers = Vec::new();
        for _ in 0..4 {
            answers.push(request(proxy, "hello").await.expect("request"));
        }
        assert_eq!(answers, ["a:hello", "b:hello", "a:hello", "b:hello"]);
    }

    #[tokio::test]
    async fn a_refusing_endpoint_is_skipped() {
        let live = backend("live").await;
        let proxy = proxy(Arc::new(Balancer::new(vec![closed_port(), live]))).await;
        for _ in 0..3 {
            assert_eq!(request(proxy, "x").await.expect("request"), "live:x");
        }
    }

    #[tokio::test]
    async fn without_endpoints_the_client_is_reset() {
        let proxy = proxy(Arc::new(Balancer::new(vec![]))).await;
        let mut conn = TcpStream::connect(proxy).await.expect("the listener accepts");
        let mut buf = [0u8; 8];
        match conn.read(&mut buf).await {
            Err(e) => assert!(is_reset(&e), "{e}"),
            Ok(n) => panic!("read {n} bytes instead of a reset"),
        }
    }

    #[tokio::test]
    async fn an_established_connection_outlives_its_endpoint_leaving() {
        let ((a, mut a_accepted), b) = (backend_telling("a").await, backend("b").await);
        let balancer = Arc::new(Balancer::new(vec![a]));
        let proxy = proxy(balancer.clone()).await;
        let mut conn = TcpStream::connect(proxy).await.expect("connect");
        conn.write_all(b"before").await.expect("write");
        a_accepted.recv().await.expect("the proxy connected to a");
        balancer.set(vec![b]);
        assert_eq!(request(proxy, "new").await.expect("request"), "b:new");
        conn.write_all(b" and after").await.expect("write after the change");
        conn.shutdown().await.expect("half-close");
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.expect("read");
        assert_eq!(answer, "a:before and after");
    }
}
