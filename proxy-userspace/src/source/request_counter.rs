//! A tower layer for the API client that counts every request by method,
//! response code and API server host: kube-proxy's (client-go's)
//! `rest_client_requests_total`, so a dashboard sees the agent's load on
//! the API server and its errors.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::future::BoxFuture;
use http::{Request, Response};
use tower::{Layer, Service};

/// Called once per finished request with `(method, code, host)`; the code
/// is `<error>` when no response came (client-go's spelling).
pub type CountRequest = Arc<dyn Fn(&str, &str, &str) + Send + Sync>;

/// Wraps the client's service stack with [`Counted`].
#[derive(Clone)]
pub struct RequestCounterLayer {
    count: CountRequest,
    host: Arc<str>,
}

impl RequestCounterLayer {
    /// `host` is the API server's `host:port`, as the label shows it.
    pub fn new(host: &str, count: CountRequest) -> Self {
        Self {
            count,
            host: Arc::from(host),
        }
    }
}

impl<S> Layer<S> for RequestCounterLayer {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            layer: self.clone(),
        }
    }
}

/// The inner service, with each request counted when it finishes.
#[derive(Clone)]
pub struct Counted<S> {
    inner: S,
    layer: RequestCounterLayer,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Counted<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let method = request.method().as_str().to_owned();
        let layer = self.layer.clone();
        let response = self.inner.call(request);
        Box::pin(async move {
            let result = response.await;
            let code = match &result {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => "<error>".to_owned(),
            };
            (layer.count)(&method, &code, &layer.host);
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[tokio::test]
    async fn counts_method_code_and_host_of_each_finished_request() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let count: CountRequest = Arc::new(move |m: &str, c: &str, h: &str| {
            sink.lock().unwrap().push(format!("{m} {c} {h}"));
        });
        let inner = tower::service_fn(|req: Request<()>| async move {
            if req.uri().path() == "/fail" {
                return Err("refused");
            }
            Ok(Response::builder().status(410).body(()).unwrap())
        });
        let mut svc = RequestCounterLayer::new("10.0.0.1:6443", count).layer(inner);
        let get = Request::get("/api/v1/services").body(()).unwrap();
        assert!(svc.call(get).await.is_ok());
        let fail = Request::post("/fail").body(()).unwrap();
        assert!(svc.call(fail).await.is_err());
        assert_eq!(
            *seen.lock().unwrap(),
            ["GET 410 10.0.0.1:6443", "POST <error> 10.0.0.1:6443"]
        );
    }
}
