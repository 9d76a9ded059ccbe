//! What every part of the router shares: `App` (the served versions, budgets, body limits,
//! admission, health, the front door's counters, the admin settings) and the health probe
//! that keeps its readiness current.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_wire::health::Health;

use crate::admission::{Admission, ShedReason};
use crate::budget::Budget;
use crate::error::RequestError;
use crate::metrics::{DoorStats, FrontStats, Metrics};
use crate::repository::{Refusal, Repository, Why};

/// What the handlers share.
pub struct App {
    /// The versions served (each with its own `Router`).
    pub repo: Repository,
    /// The router's one set of metrics (each version's `Router` shares it).
    pub metrics: Arc<Metrics>,
    pub default_budget_ms: f64,
    pub max_budget_ms: f64,
    pub body: BodyLimits,
    pub admission: Admission,
    pub door: Arc<DoorStats>,
    /// The last probe's findings (docs/api.md, "Health").
    pub health: Mutex<Health>,
    pub admin: AdminConfig,
}

impl App {
    /// Runs a repository change (a load or an unload) in a task of its own and waits for it.
    /// A client that leaves, or a gRPC deadline that passes, then drops only the waiting:
    /// dropped halfway, the change itself would leave a version LOADING or UNLOADING for good
    /// and what the controller started never released.
    pub async fn change_repository<F, R>(self: &Arc<Self>, change: F) -> Result<(), Refusal>
    where
        F: FnOnce(Arc<App>) -> R,
        R: std::future::Future<Output = Result<(), Refusal>> + Send + 'static,
    {
        (tokio::spawn(change(self.clone())).await).unwrap_or_else(|e| {
            let message = format!("the repository change failed: {e}");
            Err(Refusal::new(Why::Internal, message))
        })
    }

    /// Sets the budget a request asked for, within the router's largest.
    pub fn set_budget(&self, budget: &mut Budget, asked: Option<f64>) -> Result<(), RequestError> {
        let Some(ms) = asked else { return Ok(()) };
        if ms > self.max_budget_ms {
            return Err(RequestError::invalid(format!(
                "budget_ms is {ms}, more than this router allows ({})",
                self.max_budget_ms
            )));
        }
        budget.budget = Duration::from_secs_f64(ms / 1e3);
        Ok(())
    }

    pub fn health(&self) -> Health {
        self.health
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn front_stats(&self) -> FrontStats {
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let refused = load(&self.door.refused);
        FrontStats {
            in_flight: self.admission.in_flight(),
            max_in_flight: self.admission.max_in_flight(),
            limit: self.admission.limit(),
            connections: self.door.open.load(std::sync::atomic::Ordering::Relaxed),
            shed: ShedReason::ALL
                .iter()
                .map(|&r| match r {
                    ShedReason::Connections => (r.as_str(), refused),
                    _ => (r.as_str(), self.admission.shed_total(r)),
                })
                .collect(),
            closed: vec![
                ("header_timeout", load(&self.door.header_timeouts)),
                ("idle_timeout", load(&self.door.idle_timeouts)),
            ],
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    pub max_bytes: usize,
    pub min_bytes_per_s: u64,
    pub grace: Duration,
}

impl BodyLimits {
    /// When a body that started at `start` and has `received` bytes so far falls below the
    /// minimum rate, unless more arrives first.
    pub fn rate_deadline(&self, start: Instant, received: usize) -> Instant {
        let rate = self.min_bytes_per_s.max(1) as f64;
        start + self.grace + Duration::from_secs_f64(received as f64 / rate)
    }
}

/// What the admin API needs besides the router.
pub struct AdminConfig {
    /// The bearer token admin calls must carry (read from `admin_token_env` at start).
    pub token: Option<String>,
    /// How long the probe after a change waits for the backends.
    pub probe_timeout: Duration,
}

impl AdminConfig {
    /// Reads the token from the environment variable `env` names; a variable named but unset
    /// or empty is an error, so that the API is never open by mistake.
    pub fn new(token_env: Option<&str>, probe_timeout: Duration) -> Result<AdminConfig, String> {
        let token = match token_env {
            None => None,
            Some(name) => match std::env::var(name) {
                Ok(v) if !v.is_empty() => Some(v),
                _ => {
                    return Err(format!(
                        "router config: admin_token_env names {name:?}, but that environment \
                         variable is unset or empty"
                    ))
                }
            },
        };
        Ok(AdminConfig {
            token,
            probe_timeout,
        })
    }
}

pub const ROLE: &str = "router";
pub const STARTING: &str = "starting: backends not probed yet";

/// Probes the backends of every READY version once: (degraded, problems), each prefixed
/// with `model/version: ` when several versions serve.
pub async fn probe(app: &App, timeout: Duration) -> (Vec<String>, Vec<String>) {
    let routers = app.repo.registry.all_ready();
    if routers.is_empty() {
        return (vec![], vec!["no model version is ready".into()]);
    }
    let probes: Vec<_> = (routers.iter().cloned())
        .map(|r| tokio::spawn(async move { r.probe(timeout).await }))
        .collect();
    let mut reports = Vec::with_capacity(probes.len());
    for probe in probes {
        let failed = |e: tokio::task::JoinError| (vec![], vec![format!("probe failed: {e}")]);
        reports.push(probe.await.unwrap_or_else(failed));
    }
    if let [(degraded, problems)] = reports.as_slice() {
        return (degraded.clone(), problems.clone());
    }
    let (mut degraded, mut problems) = (Vec::new(), Vec::new());
    for (router, (d, p)) in routers.iter().zip(reports) {
        let at = |m: String| format!("{}/{}: {m}", router.model.name, router.model.version);
        degraded.extend(d.into_iter().map(at));
        problems.extend(p.into_iter().map(at));
    }
    (degraded, problems)
}

/// Records the probe's findings; logs when readiness changes, so an operator sees
/// a backend leave and come back.
pub fn set_health(app: &App, degraded: Vec<String>, problems: Vec<String>) {
    let health = Health::new(ROLE, degraded, problems);
    let mut current = app.health.lock().unwrap_or_else(|p| p.into_inner());
    let starting = current.problems.iter().any(|p| p == STARTING);
    if (current.degraded != health.degraded || current.problems != health.problems) && !starting {
        if !health.problems.is_empty() {
            tracing::warn!(problems = %health.problems.join("; "), "router not ready");
        } else if !health.degraded.is_empty() {
            tracing::warn!(
                degraded = %health.degraded.join("; "),
                "router degraded (still serving)"
            );
        } else {
            tracing::info!("router ready: every shard and ranker answers again");
        }
    }
    *current = health;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admin_token_variable_must_be_set() {
        let cfg = AdminConfig::new(Some("CLEAVE_TEST_SURELY_UNSET_VARIABLE"), Duration::ZERO);
        assert!(cfg.err().unwrap().contains("unset or empty"));
        assert!(AdminConfig::new(None, Duration::ZERO)
            .unwrap()
            .token
            .is_none());
    }
}
