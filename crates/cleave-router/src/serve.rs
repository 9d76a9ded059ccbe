//! Starting and stopping a router: load the model, connect the backends, serve HTTP, wait for
//! every shard and ranker to answer, then report ready; stop on the shutdown signal.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_wire::health::Health;
use cleave_wire::IoThreads;
use tokio::sync::watch;

use crate::admission::Admission;
use crate::app::{probe, set_health, AdminConfig, App, BodyLimits, ROLE, STARTING};
use crate::config::RouterConfig;
use crate::front::auth::{self, BearerToken};
use crate::front::conn::Timeouts;
use crate::front::door::{self, DoorConfig};
use crate::front::grpc_layer::GrpcFront;
use crate::front::rest::routes;
use crate::front::tls::TlsFiles;
use crate::metrics::{DoorStats, Metrics};
use crate::repository::build::Builder;
use crate::repository::{Repository, Settings, PROBE_TICK};

/// Serves until `shutdown` completes. `on_ready` gets the HTTP address once every backend
/// answered. Errors (bad bundle, port taken, backends never ready) say what and where.
pub async fn serve(
    config: RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    let io = IoThreads::new("cleave-router-io", config.threads_here(cores()))
        .map_err(|e| format!("cannot start I/O threads: {e}"))?;
    let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
    let metrics = Arc::new(Metrics::default());
    let builder = Builder::new(&config, io.clone(), metrics.clone());
    let routers = (config.served().iter())
        .map(|v| builder.build(v))
        .collect::<Result<Vec<_>, String>>()?;
    let settings = Settings {
        controller: config.repository_controller.clone(),
        rollout_file: config.rollout_file.clone(),
        ready_timeout: Duration::from_millis(config.ready_timeout_ms),
        probe_timeout: connect_timeout,
        max_budget: Duration::from_secs_f64(config.max_budget_ms / 1e3),
    };
    let app = Arc::new(App {
        repo: Repository::new(routers, builder, settings)?,
        metrics,
        default_budget_ms: config.budget_ms,
        max_budget_ms: config.max_budget_ms,
        body: BodyLimits {
            max_bytes: config.body_limit_bytes,
            min_bytes_per_s: config.body_min_bytes_per_s,
            grace: Duration::from_millis(config.body_grace_ms),
        },
        admission: Admission::new(
            config.max_in_flight,
            config.shed,
            config.admission,
            config.admit_share,
            config.max_retry_after_s,
        ),
        door: Arc::new(DoorStats::default()),
        health: Mutex::new(Health::new(ROLE, vec![], vec![STARTING.into()])),
        admin: AdminConfig::new(config.admin_token_env.as_deref(), connect_timeout)?,
    });
    check_open_files(config.max_connections);

    let where_ = format!("{}:{}", config.host, config.http_port);
    let listener = door::listen(&where_)
        .await
        .map_err(|e| format!("cannot listen on {where_}: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("{where_}: {e}"))?;

    let tls = TlsFiles::load(config.tls_cert.as_deref(), config.tls_key.as_deref())
        .map_err(|e| e.to_string())?;
    let rest_tls = match (&tls, &config.tls_cert, &config.tls_key) {
        (Some(files), Some(cert), Some(key)) => {
            Some(files.rest_acceptor(cert, key).map_err(|e| e.to_string())?)
        }
        _ => None,
    };
    let token = match &config.auth_token_file {
        Some(path) => Some(Arc::new(BearerToken::from_file(path)?)),
        None => None,
    };
    let mut rest = routes(app.clone());
    if let Some(token) = &token {
        let check = axum::middleware::from_fn_with_state(token.clone(), auth::require_token);
        rest = rest.layer(check);
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let door = DoorConfig {
        timeouts: Timeouts {
            header: Duration::from_millis(config.header_timeout_ms),
            idle: Duration::from_millis(config.idle_timeout_ms),
        },
        max_connections: config.max_connections,
    };
    let server = tokio::spawn(door::serve(
        listener,
        rest,
        door,
        app.door.clone(),
        stop_rx.clone(),
        rest_tls,
    ));
    // What it bound, on stdout before it is ready: a launcher that passed port 0 reads the
    // ports here (and probes /ready on them).
    let mut listening = format!("listening http://{addr}");
    let grpc = match config.grpc_port {
        Some(port) => {
            let (listener, grpc_addr) = crate::front::grpc::bind(&config.host, port).await?;
            tracing::info!(addr = %grpc_addr, "KServe v2 gRPC listening");
            listening.push_str(&format!(" grpc={grpc_addr}"));
            let front = GrpcFront {
                max_message_bytes: config.body_limit_bytes,
                token: token.clone(),
            };
            let stop = wait_stop(stop_rx.clone());
            let tls = tls.as_ref().map(|f| f.grpc_config());
            Some(tokio::spawn(crate::front::grpc::serve(
                app.clone(),
                listener,
                front,
                tls,
                stop,
            )))
        }
        None => None,
    };
    tokio::spawn(crate::shed_log::summarise(app.clone(), stop_rx.clone()));
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{listening}");
        let _ = out.flush();
    }
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    // Ready only once every backend answered; /v2/health/live works meanwhile.
    let probe_timeout = connect_timeout;
    let deadline = Instant::now() + Duration::from_millis(config.ready_timeout_ms);
    let ready = loop {
        let (degraded, problems) = probe(&app, probe_timeout).await;
        let done = degraded.is_empty() && problems.is_empty();
        set_health(&app, degraded, problems);
        if done {
            break true;
        }
        if *stop_rx.borrow() {
            break false;
        }
        if Instant::now() >= deadline {
            server.abort();
            if let Some(grpc) = &grpc {
                grpc.abort();
            }
            return Err(format!(
                "backends not ready after {} ms: {}",
                config.ready_timeout_ms,
                app.health().problems.join("; ")
            ));
        }
        tokio::select! {
            _ = tokio::time::sleep(PROBE_TICK) => {}
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
                let (degraded, problems) = probe(&health_app, probe_timeout).await;
                set_health(&health_app, degraded, problems);
            }
        });
    }
    let result = server.await;
    let grpc = match grpc {
        Some(task) => task
            .await
            .map_err(|e| format!("gRPC server stopped: {e}"))
            .and_then(|r| r),
        None => Ok(()),
    };
    io.stop();
    result.map_err(|e| format!("HTTP server on {addr} stopped: {e}"))?;
    grpc
}

/// Raises the open-file limit so that `max_connections` can be reached; warns when
/// the system does not allow that many.
fn check_open_files(max_connections: usize) {
    // Descriptors besides client connections: backends, the listener, the runtime, stdio.
    const SPARE: libc::rlim_t = 256;
    match door::raise_open_files_limit() {
        Ok(limit) if limit < max_connections as libc::rlim_t + SPARE => tracing::warn!(
            "the open-file limit is {limit}, below max_connections ({max_connections}) + \
             {SPARE}; connections beyond about {} will fail to be accepted (raise `ulimit -Hn` \
             or lower max_connections)",
            limit.saturating_sub(SPARE)
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
    }
}

async fn wait_stop(mut rx: watch::Receiver<bool>) {
    // An error means the sender is gone: nobody can ask to stop any more, so stop now.
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Runs a router on its own runtime until SIGTERM or SIGINT; prints `ready http://ADDR` on
/// stdout once every backend answered. For the `cleave._native.run_router` binding.
pub fn run(config: RouterConfig) -> Result<(), String> {
    let threads = config.threads_here(cores());
    if threads < config.threads {
        tracing::info!(
            threads,
            configured = config.threads,
            "threads capped at the cores this process may run on"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
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

/// The cores this process may run on: its CPU affinity and cgroup quota, as the standard
/// library reads them (1 when it cannot tell).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
