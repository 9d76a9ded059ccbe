//! The shard's HTTP side: `/metrics` (Prometheus text), `/ready` (the shared health JSON) and
//! `/live`, on a thread of its own so that probes never wait behind lookups.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use cleave_wire::health::Health;
use cleave_wire::ServerStats;
use tokio::sync::oneshot;

use crate::service::ShardService;

/// A running HTTP server; stops when dropped.
pub struct HttpServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Clone)]
struct Probe {
    service: Arc<ShardService>,
    stats: Arc<ServerStats>,
}

impl HttpServer {
    /// Binds `addr` (port 0 picks one) and serves until dropped.
    pub fn start(
        addr: SocketAddr,
        service: Arc<ShardService>,
        stats: Arc<ServerStats>,
    ) -> io::Result<HttpServer> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/ready", get(ready))
            .route("/live", get(|| async { "live\n" }))
            .with_state(Probe { service, stats });
        let thread = std::thread::Builder::new()
            .name("cleave-http".into())
            .spawn(move || {
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                        return;
                    };
                    let serve = axum::serve(listener, app).with_graceful_shutdown(async {
                        let _ = stopped.await;
                    });
                    if let Err(e) = serve.await {
                        eprintln!("cleave shard: metrics server failed: {e}");
                    }
                });
            })?;
        Ok(HttpServer {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn metrics(State(p): State<Probe>) -> impl IntoResponse {
    let text = p
        .service
        .render_metrics(p.stats.connections(), p.stats.frames_receiving());
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text)
}

/// The health schema every role shares (cleave_wire::health): 200 while ready, 503 with the
/// reason otherwise.
async fn ready(State(p): State<Probe>) -> impl IntoResponse {
    let health = Health::new("shard", Vec::new(), p.service.problems());
    let status = StatusCode::from_u16(health.http_status()).unwrap_or(StatusCode::OK);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        health.to_json(),
    )
}
