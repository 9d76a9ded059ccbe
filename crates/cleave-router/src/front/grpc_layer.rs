//! What wraps every gRPC call before tonic's service sees it, as its HEADERS frame arrives
//! and before its message is read: the call is stamped with that instant (`Arrival`), where
//! its budget starts, as the REST door stamps a request's first byte; the bearer token, when
//! the router has one (auth.rs), is checked (UNAUTHENTICATED without it); tonic refuses a
//! message over the size limit with OUT_OF_RANGE and a terse message; the protocol's clients
//! expect RESOURCE_EXHAUSTED, so that answer is rewritten with the limit and how to stay
//! under it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::codegen::http;
use tonic::{Code, Status};
use tower_layer::Layer;
use tower_service::Service;

use crate::front::auth::BearerToken;
use crate::front::conn::Arrival;

/// The layer for `tonic::transport::Server::layer`.
#[derive(Clone, Debug)]
pub struct GrpcFront {
    /// The largest request message accepted (bytes): the router's body limit.
    pub max_message_bytes: usize,
    /// Every call must carry it; none: no authentication.
    pub token: Option<Arc<BearerToken>>,
}

impl<S> Layer<S> for GrpcFront {
    type Service = GrpcFrontService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcFrontService {
            inner,
            front: self.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct GrpcFrontService<S> {
    inner: S,
    front: GrpcFront,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> Service<http::Request<B>> for GrpcFrontService<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        request.extensions_mut().insert(Arrival(Instant::now()));
        if let Some(token) = &self.front.token {
            if let Err(e) = token.check_headers(request.headers()) {
                tracing::warn!(path = request.uri().path(), error = %e, "gRPC call refused");
                let refused = Status::unauthenticated(e.to_string()).into_http();
                return Box::pin(async move { Ok(refused) });
            }
        }
        let response = self.inner.call(request);
        let limit = self.front.max_message_bytes;
        Box::pin(async move {
            let mut response = response.await?;
            too_large(response.headers_mut(), limit);
            Ok(response)
        })
    }
}

/// Rewrites tonic's OUT_OF_RANGE for an oversized request into RESOURCE_EXHAUSTED.
fn too_large(headers: &mut http::HeaderMap, limit: usize) {
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    if status.code() != Code::OutOfRange
        || !status
            .message()
            .contains("decoded message length too large")
    {
        return;
    }
    let found = status
        .message()
        .split("found ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap_or("?");
    let better = Status::resource_exhausted(format!(
        "the request message has {found} bytes, more than this router accepts ({limit} bytes, \
         its body_limit_bytes); send fewer candidates per request"
    ));
    headers.remove(Status::GRPC_MESSAGE);
    let _ = better.add_header(headers);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_becomes_resource_exhausted() {
        let mut h = http::HeaderMap::new();
        let tonic_says = Status::out_of_range(
            "Error, decoded message length too large: found 200 bytes, the limit is: 100 bytes",
        );
        tonic_says.add_header(&mut h).unwrap();
        too_large(&mut h, 100);
        let s = Status::from_header_map(&h).unwrap();
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert!(
            s.message().starts_with(
                "the request message has 200 bytes, more than this router accepts (100 bytes"
            ),
            "{}",
            s.message()
        );
        // Anything else is left alone.
        let mut h = http::HeaderMap::new();
        Status::out_of_range("other").add_header(&mut h).unwrap();
        too_large(&mut h, 100);
        assert_eq!(Status::from_header_map(&h).unwrap().message(), "other");
    }
}
