//! The backends' server: one multi-threaded process-wide server answering
//! on a TCP port in every pod namespace, fast enough that it is never what
//! a measurement measures.
//!
//! Each pod's listening socket is created by a thread inside the pod's
//! namespace (a socket belongs to the namespace it was created in), then
//! served by the same small tokio runtime. A connection speaks one of:
//! - a line (`hello\n`, or anything up to a half-close): answered with the
//!   pod's name and a newline, then closed (what the testbed's probes and
//!   the latency client send);
//! - HTTP/1.x requests (what `wrk` sends): `200 OK` with the pod's name as
//!   the body, kept alive unless the request says `Connection: close` (or
//!   is HTTP/1.0).
//!
//! The server closes first, so TIME_WAIT stays on the pod side and the
//! clients' ports are free again at once.

use std::{
    net::{Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    time::Duration,
};

use anyhow::{Context, Result};
use testbed::netns::Netns;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

/// Requests larger than this are cut off (nothing here sends one).
const MAX_REQUEST: usize = 16 * 1024;
/// A client that sends nothing for this long is dropped.
const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pending connections per listener: short-connection load must not
/// overflow the accept queue.
const BACKLOG: i32 = 4096;

/// The server; stops (closing its sockets) when dropped.
pub struct PodServers {
    runtime: Option<tokio::runtime::Runtime>,
}

impl PodServers {
    /// A runtime with `workers` threads and no listeners yet.
    pub fn new(workers: usize) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .thread_name("pod-server")
            // Apart from the latency client's CPU (see `placement`).
            .on_thread_start(|| {
                if let Err(e) = crate::placement::pin_server() {
                    eprintln!("warning: pinning a pod server thread: {e}");
                }
            })
            .enable_io()
            .enable_time()
            .build()
            .context("building the pod servers' runtime")?;
        Ok(Self { runtime: Some(runtime) })
    }

    /// Serves `name` on `[::]:port` inside `ns` (every address the
    /// namespace has, of both families, its local routes included).
    pub fn serve(&self, ns: &Netns, port: u16, name: &str) -> Result<()> {
        let std_listener = ns
            .run_in(|| listen(port))?
            .with_context(|| format!("listening on port {port} in {}", ns.name()))?;
        let runtime = self.runtime.as_ref().context("the server is stopped")?;
        let _entered = runtime.enter();
        let listener = TcpListener::from_std(std_listener).context("handing the listener to tokio")?;
        let name: &'static [u8] = Box::leak(format!("{name}\n").into_boxed_str()).as_bytes();
        runtime.spawn(accept_loop(listener, name));
        Ok(())
    }
}

impl Drop for PodServers {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// A non-blocking listener with a deep backlog on every address of both
/// families (`[::]`, IPv4 too), in the calling thread's namespace.
fn listen(port: u16) -> std::io::Result<std::net::TcpListener> {
    let any = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
    let owned = crate::sock::stream_socket(any)?;
    let fd = owned.as_raw_fd();
    let listener = std::net::TcpListener::from(owned);
    crate::sock::set_int_option(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    crate::sock::set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0)?;
    crate::sock::bind(fd, any)?;
    // SAFETY: listen(2) on a socket this function owns.
    if unsafe { libc::listen(fd, BACKLOG) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    listener.set_nonblocking(true)?;
    Ok(listener)
}

async fn accept_loop(listener: TcpListener, name: &'static [u8]) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve_connection(stream, name));
            }
            // Out of descriptors and the like: back off instead of spinning.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// What a connection's buffered bytes hold so far.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    /// Not complete yet.
    Partial,
    /// A line: answer and close.
    Line,
    /// An HTTP request of `len` bytes; keep the connection if `keep_alive`.
    Http { len: usize, keep_alive: bool },
}

/// Classifies the start of `buf` (what a connection sent so far).
fn parse_request(buf: &[u8]) -> Request {
    let Some(line_end) = buf.iter().position(|&b| b == b'\n') else {
        return Request::Partial;
    };
    let first = String::from_utf8_lossy(&buf[..line_end]);
    let version = first.trim_end().rsplit(' ').next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Request::Line;
    }
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Request::Partial;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let close = head
        .lines()
        .any(|l| l.starts_with("connection:") && l.contains("close"));
    Request::Http {
        len: head_end + 4,
        keep_alive: version == "HTTP/1.1" && !close,
    }
}

fn http_response(body: &[u8], keep_alive: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n{}\r\n",
        body.len(),
        if keep_alive { "" } else { "Connection: close\r\n" }
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

async fn serve_connection(mut stream: TcpStream, name: &'static [u8]) {
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 4096];
    loop {
        match parse_request(&buf) {
            Request::Line => {
                let _ = stream.write_all(name).await;
                return;
            }
            Request::Http { len, keep_alive } => {
                if stream.write_all(&http_response(name, keep_alive)).await.is_err() || !keep_alive {
                    return;
                }
                buf.drain(..len);
                continue;
            }
            Request::Partial if buf.len() >= MAX_REQUEST => return,
            Request::Partial => {}
        }
        match tokio::time::timeout(IDLE_TIMEOUT, stream.read(&mut chunk)).await {
            Ok(Ok(0)) => {
                // A half-close ends a line request; anything else just ends.
                if !buf.is_empty() && parse_request(&buf) == Request::Partial && !looks_like_http(&buf) {
                    let _ = stream.write_all(name).await;
                }
                return;
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(_)) | Err(_) => return,
        }
    }
}

fn looks_like_http(buf: &[u8]) -> bool {
    buf.starts_with(b"GET ") || buf.starts_with(b"POST ") || buf.starts_with(b"HEAD ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_lines_from_http() {
        assert_eq!(parse_request(b"hel"), Request::Partial);
        assert_eq!(parse_request(b"hello\n"), Request::Line);
        assert_eq!(parse_request(b"GET / HTTP/1.1\r\nHost: x\r\n"), Request::Partial);
        let get = b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\n";
        assert_eq!(
            parse_request(get),
            Request::Http {
                len: 27,
                keep_alive: true
            }
        );
        let close = b"GET / HTTP/1.1\r\nConnection: Close\r\n\r\n";
        assert_eq!(
            parse_request(close),
            Request::Http {
                len: close.len(),
                keep_alive: false
            }
        );
        let old = b"GET / HTTP/1.0\r\n\r\n";
        assert_eq!(
            parse_request(old),
            Request::Http {
                len: old.len(),
                keep_alive: false
            }
        );
    }

    #[test]
    fn responses_carry_the_length_and_the_close() {
        let kept = String::from_utf8(http_response(b"pod-1\n", true)).expect("text");
        assert!(kept.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(kept.contains("Content-Length: 6\r\n"));
        assert!(!kept.contains("Connection: close"));
        assert!(kept.ends_with("\r\n\r\npod-1\n"));
        let closed = String::from_utf8(http_response(b"pod-1\n", false)).expect("text");
        assert!(closed.contains("Connection: close\r\n"));
    }
}
