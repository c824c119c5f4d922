//! The little HTTP/1 server both endpoints share.

use std::{convert::Infallible, net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Request, StatusCode,
    body::Incoming,
    header::{CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, task::JoinSet};
use tracing::{debug, info, warn};

pub(super) type Response = hyper::Response<Full<Bytes>>;

/// A client gets this long to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn response(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response {
    let mut resp = hyper::Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// Go's `http.NotFound`, like kube-proxy's muxes.
pub(super) fn not_found() -> Response {
    response(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "404 page not found\n",
    )
}

/// Binds `addr`; the error names the server and the address, so a port in
/// use is a clear startup error.
pub(super) async fn bind(what: &str, addr: SocketAddr) -> Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to start the {what} server on {addr}"))?;
    let bound = listener
        .local_addr()
        .with_context(|| format!("the {what} server's address"))?;
    info!(address = %bound, "serving {what}");
    Ok((listener, bound))
}

/// Serves `route` on `listener` until dropped; dropping the future also
/// ends every open connection.
pub(super) async fn serve<F>(what: &'static str, listener: TcpListener, route: F)
where
    F: Fn(&Request<Incoming>) -> Response + Clone + Send + Sync + 'static,
{
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off, keep serving.
                warn!(error = %e, "{what}: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        while connections.try_join_next().is_some() {}
        let route = route.clone();
        connections.spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let resp = route(&req);
                async move { Ok::<_, Infallible>(resp) }
            });
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                debug!(%peer, error = %e, "{what}: connection ended with an error");
            }
        });
    }
}
