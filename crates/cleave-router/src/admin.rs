//! The membership admin API under `/admin/v1/` (docs/serving.md, "Replicas and membership"):
//! list the shard replicas and rankers, add, drain and remove them while the router serves.
//! A malformed call changes nothing and gets 400 naming the field; a change that would leave
//! a range or the router without a backend gets 409. With `admin_token_env` set, every call
//! needs `Authorization: Bearer <the variable's value>`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use cleave_shard::MembershipError;
use cleave_wire::auth::constant_time_eq;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::app::App;
use crate::app::{probe, set_health};
use crate::codec::json::json_bytes;
use crate::pipeline::router::Router;
use crate::repository::{parse_version, Refusal};

pub fn routes() -> axum::Router<Arc<App>> {
    axum::Router::new()
        .route("/admin/v1/members", get(members))
        .route("/admin/v1/shards", post(add_shard))
        .route("/admin/v1/shards/drain", post(drain_shard))
        .route("/admin/v1/shards/remove", post(remove_shard))
        .route("/admin/v1/rankers", post(add_ranker))
        .route("/admin/v1/rankers/drain", post(drain_ranker))
        .route("/admin/v1/rankers/remove", post(remove_ranker))
        .route("/admin/v1/rollout", get(rollout).post(set_rollout))
        .route("/admin/v1/rollback", post(rollback))
        .route("/admin/v1/cache", get(cache_stats))
        .route("/admin/v1/cache/switch", post(cache_switch))
}

/// `{"table": T, "switch_at_unix_us": N}`: an update of T switches at N (docs/cache.md).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheSwitch {
    table: String,
    #[serde(default)]
    switch_at_unix_us: u64,
}

/// The cache's counters and sizes (the /metrics series, as JSON).
async fn cache_stats(State(app): State<Arc<App>>, headers: HeaderMap) -> Reply {
    authorize(&app, &headers)?;
    let body = match app.metrics.cache.get() {
        None => json!({"mode": "off"}),
        Some(c) => {
            let s = c.stats();
            json!({"mode": s.mode, "hits": s.hits, "misses": s.misses,
                   "lookups_avoided": s.ids_avoided, "bytes_not_sent": s.bytes_not_sent,
                   "bytes": s.bytes, "limit_bytes": s.limit, "entries": s.entries,
                   "ranker_max_batch": s.ranker_max_batch, "budget_bytes": s.budget_bytes,
                   "activation_bytes_per_sample": s.activation_bytes_per_sample})
        }
    };
    Ok(json_bytes(StatusCode::OK, body.to_string().into_bytes()))
}

/// Announced by `cleave update` and `cleave stream` before they switch any shard: requests
/// as of the switch time on are keyed with the table's next epoch. Accepted (a no-op) with the
/// cache off, so that the tools need not know how the router is configured.
async fn cache_switch(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    authorize(&app, &headers)?;
    let s: CacheSwitch = parse(&body, r#"{"table": T, "switch_at_unix_us": N}"#)?;
    let epoch = match app.metrics.cache.get() {
        None => None,
        Some(c) => Some(
            c.switch(&s.table, s.switch_at_unix_us)
                .map_err(|m| error(StatusCode::CONFLICT, m))?,
        ),
    };
    let body = json!({"table": s.table, "epoch": epoch});
    Ok(json_bytes(StatusCode::OK, body.to_string().into_bytes()))
}

/// `{"addr": ..., "control": ...}`
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddRanker {
    addr: String,
    /// Which served version it changes; optional while only one serves.
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    version: Option<String>,
    /// Its incast control port, when the router has incast control on (docs/traffic.md).
    control: Option<String>,
}

/// `{"addr": ..., "ranges": [{"table", "row_start", "row_end"}, ...]}`
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddShard {
    addr: String,
    /// Which served version it changes; optional while only one serves.
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    version: Option<String>,
    ranges: Vec<RangeSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RangeSpec {
    table: String,
    row_start: u64,
    row_end: u64,
}

/// `{"addr": ...}`
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Addr {
    addr: String,
    /// Which served version it changes; optional while only one serves.
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    version: Option<String>,
}

/// `{"model", "version", "percent"}`
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetRollout {
    model: String,
    version: String,
    percent: f64,
}

/// `{"model"}`
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rollback {
    model: String,
}

/// A refused admin call: its status and what was wrong.
#[derive(Debug)]
pub struct AdminError {
    status: StatusCode,
    message: String,
}

fn error(status: StatusCode, message: impl Into<String>) -> AdminError {
    AdminError {
        status,
        message: message.into(),
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        json_bytes(
            self.status,
            json!({"error": self.message}).to_string().into_bytes(),
        )
    }
}

impl From<MembershipError> for AdminError {
    fn from(e: MembershipError) -> AdminError {
        let status = match e {
            MembershipError::Invalid(_) => StatusCode::BAD_REQUEST,
            MembershipError::Conflict(_) => StatusCode::CONFLICT,
            MembershipError::Unknown(_) => StatusCode::NOT_FOUND,
        };
        error(status, e.to_string())
    }
}

type Reply = Result<Response, AdminError>;

/// 401 unless the call carries the configured bearer token (or none is configured).
pub fn authorize(app: &App, headers: &HeaderMap) -> Result<(), AdminError> {
    let Some(token) = &app.admin.token else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
        Ok(())
    } else {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "admin calls need the header \"Authorization: Bearer <token>\" with the token of \
             the router's admin_token_env variable",
        ))
    }
}

fn parse<T: DeserializeOwned>(body: &[u8], expected: &str) -> Result<T, AdminError> {
    serde_json::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("admin request body: {e}; expected {expected}"),
        )
    })
}

const ADDR_BODY: &str = r#"{"addr": "HOST:PORT"}"#;
const RANKER_BODY: &str = r#"{"addr": "HOST:PORT", "control": "HOST:PORT" (with incast control)}"#;
const SHARD_BODY: &str =
    r#"{"addr": "HOST:PORT", "ranges": [{"table": T, "row_start": A, "row_end": B}, ...]}"#;

/// The membership as JSON: one version's, or with several served, each version's (each
/// names its model and version).
pub fn members_json(app: &App) -> Value {
    let routers = app.repo.registry.all_ready();
    match routers.as_slice() {
        [one] => router_members(one),
        _ => json!({ "versions": routers.iter().map(router_members).collect::<Vec<_>>() }),
    }
}

fn router_members(router: &Arc<Router>) -> Value {
    let shards: Vec<Value> = router
        .shards
        .members()
        .into_iter()
        .map(|m| {
            let ranges: Vec<Value> = m
                .ranges
                .iter()
                .map(|(t, r)| json!({"table": t, "row_start": r.start, "row_end": r.end}))
                .collect();
            json!({"addr": m.addr.to_string(), "ranges": ranges, "state": m.state.as_str(),
                   "outstanding": m.outstanding, "ewma_ms": m.ewma_ms})
        })
        .collect();
    let rankers: Vec<Value> = router
        .rankers
        .rankers()
        .iter()
        .map(|r| {
            json!({"addr": r.addr(), "state": r.state(), "outstanding": r.outstanding(),
                   "ewma_ms": r.ewma_us() / 1e3})
        })
        .collect();
    json!({"model": router.model.name, "version": router.model.version,
           "shards": shards, "rankers": rankers})
}

/// The version a membership call names; 400 when it names none and several serve.
fn target(
    app: &App,
    model: Option<&str>,
    version: Option<&str>,
) -> Result<Arc<Router>, AdminError> {
    app.repo
        .registry
        .target(model, version)
        .map_err(|m| error(StatusCode::BAD_REQUEST, m))
}

fn ok_members(app: &App) -> Response {
    json_bytes(StatusCode::OK, members_json(app).to_string().into_bytes())
}

/// After a change: probe at once (a new member is admitted as soon as it answers ready) and
/// report the membership.
async fn changed(app: &App) -> Response {
    let (degraded, problems) = probe(app, app.admin.probe_timeout).await;
    set_health(app, degraded, problems);
    ok_members(app)
}

async fn members(State(app): State<Arc<App>>, headers: HeaderMap) -> Reply {
    authorize(&app, &headers)?;
    Ok(ok_members(&app))
}

async fn add_shard(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    authorize(&app, &headers)?;
    let add: AddShard = parse(&body, SHARD_BODY)?;
    if add.ranges.is_empty() {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "ranges: empty; expected at least one range",
        ));
    }
    for (i, r) in add.ranges.iter().enumerate() {
        if r.row_start >= r.row_end {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!(
                    "ranges[{i}]: rows [{}, {}) of table {:?} are empty; expected row_start < row_end",
                    r.row_start, r.row_end, r.table
                ),
            ));
        }
    }
    let ranges = add
        .ranges
        .into_iter()
        .map(|r| (r.table, r.row_start..r.row_end))
        .collect();
    let router = target(&app, add.model.as_deref(), add.version.as_deref())?;
    router.shards.add(&add.addr, ranges)?;
    Ok(changed(&app).await)
}

/// Parses `{"addr"}` and applies `change` to it.
async fn on_addr(
    app: Arc<App>,
    headers: HeaderMap,
    body: Bytes,
    change: impl FnOnce(&Router, &str) -> Result<(), MembershipError>,
) -> Reply {
    authorize(&app, &headers)?;
    let a: Addr = parse(&body, ADDR_BODY)?;
    let router = target(&app, a.model.as_deref(), a.version.as_deref())?;
    change(&router, &a.addr)?;
    Ok(changed(&app).await)
}

async fn drain_shard(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    on_addr(app, headers, body, |router, a| router.shards.drain(a)).await
}

async fn remove_shard(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    on_addr(app, headers, body, |router, a| router.shards.remove(a)).await
}

async fn add_ranker(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    authorize(&app, &headers)?;
    let add: AddRanker = parse(&body, RANKER_BODY)?;
    let router = target(&app, add.model.as_deref(), add.version.as_deref())?;
    router.rankers.add(&add.addr, add.control.as_deref())?;
    Ok(changed(&app).await)
}

async fn drain_ranker(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    on_addr(app, headers, body, |router, a| router.rankers.drain(a)).await
}

async fn remove_ranker(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    on_addr(app, headers, body, |router, a| router.rankers.remove(a)).await
}

async fn rollout(State(app): State<Arc<App>>, headers: HeaderMap) -> Reply {
    authorize(&app, &headers)?;
    let state = serde_json::to_vec(&app.repo.rollouts()).expect("a rollout state serializes");
    Ok(json_bytes(StatusCode::OK, state))
}

const ROLLOUT_BODY: &str = r#"{"model": NAME, "version": "V", "percent": P (0 to 100)}"#;

async fn set_rollout(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    authorize(&app, &headers)?;
    let set: SetRollout = parse(&body, ROLLOUT_BODY)?;
    let version = parse_version(&set.version).map_err(refused)?;
    (app.repo)
        .set_rollout(&set.model, version, set.percent)
        .map_err(refused)?;
    rollout(State(app), headers).await
}

async fn rollback(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Reply {
    authorize(&app, &headers)?;
    let back: Rollback = parse(&body, r#"{"model": NAME}"#)?;
    app.repo.rollback(&back.model).map_err(refused)?;
    rollout(State(app), headers).await
}

fn refused(r: Refusal) -> AdminError {
    let status = StatusCode::from_u16(r.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
    error(status, r.message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_bodies_are_400() {
        assert!(parse::<AddShard>(br#"{"addr": "h:1", "ranges": []}"#, SHARD_BODY).is_ok());
        for body in [
            &br#"{"#[..],
            br#"{"addr": 5}"#,
            br#"{"addr": "h:1", "x": 1}"#,
            br#"{}"#,
        ] {
            let status = parse::<Addr>(body, ADDR_BODY)
                .map(|_| ())
                .unwrap_err()
                .status;
            assert_eq!(status, StatusCode::BAD_REQUEST);
        }
        let bad_range = br#"{"addr": "h:1", "ranges": [{"table": "t", "row_start": -1}]}"#;
        assert!(parse::<AddShard>(bad_range, SHARD_BODY).is_err());
    }
}
