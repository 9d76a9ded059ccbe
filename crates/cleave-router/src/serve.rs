//! Starting and stopping a router: load the model, connect the backends, serve HTTP, wait for
//! every shard and ranker to answer, then report ready; stop on the shutdown signal.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_wire::{ClientConfig, IoThreads};
use tokio::sync::watch;

use crate::config::RouterConfig;
use crate::http::{routes, App};
use crate::metrics::Metrics;
use crate::model::{Mode, Model};
use crate::ranker::RankerPool;
use crate::router::Router;
use crate::sparse::Shards;

/// How often start-up re-probes backends that have not answered yet.
const STARTUP_PROBE: Duration = Duration::from_millis(100);

/// Serves until `shutdown` completes. `on_ready` gets the HTTP address once every backend
/// answered. Errors (bad bundle, port taken, backends never ready) say what and where.
pub async fn serve(
    config: RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    let mode: Mode = config.mode.into();
    let model = Model::load(&config.model, &config.bundle)?;
    let io = IoThreads::new("cleave-router-io", config.threads)
        .map_err(|e| format!("cannot start I/O threads: {e}"))?;
    let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
    let shards = match mode {
        Mode::Disaggregated => {
            let cap = Duration::from_secs_f64(config.max_budget_ms / 1e3);
            Shards::new(&model, &config.shards, &io, connect_timeout, cap)?
        }
        Mode::Monolithic => Shards::none(),
    };
    let client = ClientConfig {
        connections: config.ranker_connections.max(1),
        connect_timeout,
        ..ClientConfig::default()
    };
    let rankers = RankerPool::new(&config.rankers, &io, client)?;
    let app = Arc::new(App {
        router: Router {
            model,
            mode,
            shards,
            rankers,
            metrics: Metrics::default(),
        },
        default_budget_ms: config.budget_ms,
        max_budget_ms: config.max_budget_ms,
        body_limit: config.body_limit_bytes,
        problems: Mutex::new(vec!["starting: backends not probed yet".into()]),
    });

    let where_ = format!("{}:{}", config.host, config.http_port);
    let listener = tokio::net::TcpListener::bind(&where_)
        .await
        .map_err(|e| format!("cannot listen on {where_}: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("{where_}: {e}"))?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = wait_stop(stop_rx.clone());
    let http = axum::serve(listener, routes(app.clone())).with_graceful_shutdown(stopped);
    let server = tokio::spawn(std::future::IntoFuture::into_future(http));
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    // Ready only once every backend answered; /v2/health/live works meanwhile.
    let probe_timeout = connect_timeout;
    let deadline = Instant::now() + Duration::from_millis(config.ready_timeout_ms);
    let ready = loop {
        let problems = probe(&app, probe_timeout).await;
        let done = problems.is_empty();
        set_problems(&app, problems);
        if done {
            break true;
        }
        if *stop_rx.borrow() {
            break false;
        }
        if Instant::now() >= deadline {
            server.abort();
            return Err(format!(
                "backends not ready after {} ms: {}",
                config.ready_timeout_ms,
                app.problems().join("; ")
            ));
        }
        tokio::select! {
            _ = tokio::time::sleep(STARTUP_PROBE) => {}
            _ = wait_stop(stop_rx.clone()) => break false,
        }
    };
    if ready {
        on_ready(addr);
        let interval = Duration::from_millis(config.health_interval_ms.max(10));
        let health_app = app.clone();
        let health_stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = wait_stop(health_stop.clone()) => return,
                }
                let problems = probe(&health_app, probe_timeout).await;
                set_problems(&health_app, problems);
            }
        });
    }
    let result = server.await;
    io.stop();
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("HTTP server on {addr} failed: {e}")),
        Err(e) => Err(format!("HTTP server on {addr} stopped: {e}")),
    }
}

async fn wait_stop(mut rx: watch::Receiver<bool>) {
    // An error means the sender is gone: nobody can ask to stop any more, so stop now.
    let _ = rx.wait_for(|stop| *stop).await;
}

async fn probe(app: &App, timeout: Duration) -> Vec<String> {
    let (mut shards, rankers) = tokio::join!(
        app.router.shards.probe(timeout),
        app.router.rankers.probe(timeout)
    );
    shards.extend(rankers);
    shards
}

/// Records the probe's findings; says on stderr when readiness changes, so an operator sees
/// a backend leave and come back.
fn set_problems(app: &App, problems: Vec<String>) {
    let mut current = app.problems.lock().unwrap_or_else(|p| p.into_inner());
    if *current != problems && !current.iter().any(|p| p.starts_with("starting")) {
        if problems.is_empty() {
            eprintln!("cleave router: every shard and ranker answers again");
        } else {
            eprintln!("cleave router: not ready: {}", problems.join("; "));
        }
    }
    *current = problems;
}

/// Runs a router on its own runtime until SIGTERM or SIGINT; prints `ready http://ADDR` on
/// stdout once every backend answered. For the `cleave._native.run_router` binding.
pub fn run(config: RouterConfig) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.threads.max(1))
        .thread_name("cleave-router")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the router runtime: {e}"))?;
    runtime.block_on(async {
        let signals = shutdown_signal()?;
        serve(config, signals, |addr| {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "ready http://{addr}");
            let _ = out.flush();
        })
        .await
    })
}

/// Completes on the first SIGTERM or SIGINT.
fn shutdown_signal() -> Result<impl Future<Output = ()> + Send + 'static, String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT handler: {e}"))?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
