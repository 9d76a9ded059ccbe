//! An open-loop HTTP and gRPC load generator (`cleave bench serve`'s client).
//!
//! Send times are given up front and a request goes out at its time whether or not earlier
//! ones have answered; latency counts from the *scheduled* time, so a client that falls behind
//! shows up as latency (no coordinated omission). It runs on one thread of its own: a Python
//! client spent most of a core at a few thousand requests per second, on the same cores as the
//! deployment it measured. Responses are kept whole (when asked) and parsed after the run.
//!
//! A `grpc://HOST:PORT/package.Service/Method` URL sends each body as one unary gRPC call
//! (HTTP/2 with prior knowledge, one multiplexed connection, as gRPC clients do): the bodies are
//! serialized request messages, the replies the serialized response messages. Python's asyncio
//! gRPC client spent more CPU per call than the router it measured.
//!
//! With [`Run::closed`] it runs closed loop instead: a fixed number of clients, each sending its
//! next request when its last one answered (how a deployment's capacity is measured, with no
//! schedule to fall behind).
//!
//! [`shard`] drives one embedding shard over its wire protocol (`cleave bench shard`), open or
//! closed loop.

mod grpc;
pub mod shard;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// What happened to one request.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Which body was sent.
    pub body: usize,
    /// Its send time from the start of the run (closed loop: when it was sent).
    pub scheduled_s: f64,
    /// How late the client sent it.
    pub lag_s: f64,
    /// From the scheduled time to the whole response (or the failure).
    pub latency_s: f64,
    /// HTTP status; 0 when there was none.
    pub status: u16,
    /// "" when a response arrived, else "timeout", "connection: ..." or, for gRPC, the call's
    /// non-OK status as `grpc_` and its lower-case name (`grpc_resource_exhausted`).
    pub error: String,
    /// The response body (for gRPC, the response message), for successes when asked for.
    pub reply: Option<Bytes>,
}

/// One run: POST `bodies[order[i]]` to `url` at `times_s[i]` seconds from the start (or, with
/// `closed`, the bodies of `order` in turn, closed loop). `url` is `http://...` (HTTP/1.1) or
/// `grpc://HOST:PORT/package.Service/Method`.
pub struct Run {
    pub url: String,
    pub bodies: Vec<Bytes>,
    /// Extra request headers per body (indexed like `bodies`; missing = none), e.g. the
    /// `Inference-Header-Content-Length` of a binary-tensor body. A `content-type` here
    /// replaces the default `application/json`.
    pub headers: Vec<Vec<(String, String)>>,
    pub times_s: Vec<f64>,
    pub order: Vec<usize>,
    pub timeout: Duration,
    pub keep_replies: bool,
    /// Closed loop instead of `times_s` (which must then be empty).
    pub closed: Option<ClosedLoop>,
}

/// `clients` clients, each sending its next request when its last one answered, for `duration`.
#[derive(Clone, Copy, Debug)]
pub struct ClosedLoop {
    pub clients: usize,
    pub duration: Duration,
}

impl Run {
    /// Runs the schedule to the end (every request answered or timed out).
    pub fn execute(mut self) -> Result<Vec<Outcome>, String> {
        let (uri, grpc) = parse_url(&self.url)?;
        if let Some(closed) = self.closed {
            if !self.times_s.is_empty() || self.order.is_empty() || closed.clients == 0 {
                return Err(
                    "a closed loop takes no send times, at least one body index and one client"
                        .into(),
                );
            }
        } else if self.times_s.len() != self.order.len() {
            return Err(format!(
                "{} send times but {} body indices",
                self.times_s.len(),
                self.order.len()
            ));
        }
        if let Some(&bad) = self.order.iter().find(|&&i| i >= self.bodies.len()) {
            return Err(format!(
                "body index {bad} out of range: {} bodies",
                self.bodies.len()
            ));
        }
        for (k, v) in self.headers.iter().flatten() {
            hyper::header::HeaderName::try_from(k.as_str())
                .map_err(|e| format!("header name {k:?}: {e}"))?;
            hyper::header::HeaderValue::try_from(v.as_str())
                .map_err(|e| format!("header {k:?} value {v:?}: {e}"))?;
        }
        if self.times_s.iter().any(|t| !t.is_finite() || *t < 0.0) {
            return Err("send times must be finite and >= 0".into());
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the load generator's runtime: {e}"))?;
        if grpc {
            // Framed once here, not per call: the 5-byte gRPC prefix (uncompressed, length).
            for body in &mut self.bodies {
                *body = grpc::frame(body)?;
            }
        }
        let run = Arc::new(self);
        Ok(match run.closed {
            Some(closed) => runtime.block_on(run.drive_closed(uri, grpc, closed)),
            None => runtime.block_on(run.drive(uri, grpc)),
        })
    }

    /// The POST of body `body`, with its headers (checked valid by `execute`).
    fn request(&self, uri: &Uri, body: usize, grpc: bool) -> hyper::Request<Full<Bytes>> {
        let extra = self.headers.get(body).map_or(&[][..], |h| h.as_slice());
        let mut builder = hyper::Request::post(uri.clone());
        if grpc {
            builder = builder
                .header("content-type", "application/grpc")
                .header("te", "trailers");
        } else if !extra
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        {
            builder = builder.header("content-type", "application/json");
        }
        for (k, v) in extra {
            builder = builder.header(k.as_str(), v.as_str());
        }
        builder
            .body(Full::new(self.bodies[body].clone()))
            .expect("a POST of a parsed URI with checked headers is a valid request")
    }

    async fn drive(self: Arc<Self>, uri: Uri, grpc: bool) -> Vec<Outcome> {
        let client = http_client(grpc);
        let start = tokio::time::Instant::now() + Duration::from_millis(50);
        let mut tasks = Vec::with_capacity(self.times_s.len());
        for (&at, &body) in self.times_s.iter().zip(&self.order) {
            let scheduled = start + Duration::from_secs_f64(at);
            tokio::time::sleep_until(scheduled).await;
            let lag_s = scheduled.elapsed().as_secs_f64();
            let request = self.request(&uri, body, grpc);
            let (client, run) = (client.clone(), self.clone());
            tasks.push(tokio::spawn(async move {
                let mut outcome = run.exchange(&client, request, body, scheduled, grpc).await;
                outcome.scheduled_s = at;
                outcome.lag_s = lag_s;
                outcome
            }));
        }
        let mut outcomes = Vec::with_capacity(tasks.len());
        for task in tasks {
            if let Ok(outcome) = task.await {
                outcomes.push(outcome);
            }
        }
        outcomes
    }

    async fn drive_closed(
        self: Arc<Self>,
        uri: Uri,
        grpc: bool,
        closed: ClosedLoop,
    ) -> Vec<Outcome> {
        let client = http_client(grpc);
        let start = tokio::time::Instant::now();
        let end = start + closed.duration;
        let next = Arc::new(AtomicUsize::new(0)); // the clients take `order` in turn
        let clients: Vec<_> = (0..closed.clients)
            .map(|_| {
                let (client, run, uri, next) =
                    (client.clone(), self.clone(), uri.clone(), next.clone());
                tokio::spawn(async move {
                    let mut outcomes = Vec::new();
                    while tokio::time::Instant::now() < end {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let body = run.order[k % run.order.len()];
                        let sent = tokio::time::Instant::now();
                        let mut outcome = run
                            .exchange(&client, run.request(&uri, body, grpc), body, sent, grpc)
                            .await;
                        outcome.scheduled_s = (sent - start).as_secs_f64();
                        outcomes.push(outcome);
                    }
                    outcomes
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for client in clients {
            outcomes.extend(client.await.unwrap_or_default());
        }
        outcomes.sort_by(|a, b| a.scheduled_s.total_cmp(&b.scheduled_s));
        outcomes
    }

    /// Sends one request and waits for the whole answer (or the timeout); latency counts from
    /// `since`.
    async fn exchange(
        &self,
        client: &HttpClient,
        request: hyper::Request<Full<Bytes>>,
        body: usize,
        since: tokio::time::Instant,
        grpc: bool,
    ) -> Outcome {
        let mut outcome = Outcome {
            body,
            scheduled_s: 0.0,
            lag_s: 0.0,
            latency_s: 0.0,
            status: 0,
            error: String::new(),
            reply: None,
        };
        let exchange = async {
            let response = client.request(request).await.map_err(|e| with_causes(&e))?;
            let status = response.status().as_u16();
            let (head, body) = response.into_parts();
            let collected = body.collect().await.map_err(|e| with_causes(&e))?;
            if !grpc {
                return Ok::<_, String>((status, String::new(), collected.to_bytes()));
            }
            let trailers = collected.trailers().cloned();
            let message = grpc::message(collected.to_bytes());
            let failure = grpc::failure(&head.headers, trailers.as_ref());
            Ok((status, failure, message))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok((status, failure, bytes))) => {
                outcome.status = status;
                if self.keep_replies && status == 200 && failure.is_empty() {
                    outcome.reply = Some(bytes);
                }
                outcome.error = failure;
            }
            Ok(Err(e)) => outcome.error = format!("connection: {e}"),
            Err(_) => outcome.error = "timeout".into(),
        }
        outcome.latency_s = since.elapsed().as_secs_f64();
        outcome
    }
}

/// An error and the causes it wraps: hyper's own words are only "client error (SendRequest)",
/// which cannot tell a reset from a refused connect.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let more = e.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        cause = e.source();
    }
    text
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client(grpc: bool) -> HttpClient {
    let mut builder = Client::builder(TokioExecutor::new());
    builder.http2_only(grpc);
    // As gRPC's own clients do: an HTTP/2 request is several frames, and Nagle's algorithm
    // held the last one back until the server's delayed ACK (milliseconds).
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    builder.build(connector)
}

/// The URI to send to and whether the run speaks gRPC.
fn parse_url(url: &str) -> Result<(Uri, bool), String> {
    let (grpc, http_url) = match url.strip_prefix("grpc://") {
        Some(rest) => (true, format!("http://{rest}")),
        None => (false, url.to_string()),
    };
    let uri: Uri = http_url.parse().map_err(|e| format!("url {url:?}: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "url {url:?}: expected http://HOST:PORT/... or grpc://HOST:PORT/package.Service/Method"
        ));
    }
    if grpc && uri.path().trim_matches('/').split('/').count() != 2 {
        return Err(format!(
            "url {url:?}: a gRPC url names the method, grpc://HOST:PORT/package.Service/Method"
        ));
    }
    Ok((uri, grpc))
}
