//! The model repository on the router (docs/api.md, "Model repository"): the versions it
//! serves (registry.rs), how unversioned requests split between them (rollout.rs), and
//! loading and unloading versions staged by the repository controller (controller.rs),
//! each version's `Router` built by build.rs; the index (index.rs) and why a call is
//! refused (refusal.rs).

pub mod build;
pub mod controller;
pub mod index;
pub mod refusal;
pub mod registry;
pub mod rollout;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::{Version, VersionConfig};
use crate::pipeline::router::Router;
use build::Builder;
use controller::Controller;
pub use index::IndexEntry;
use index::{disk_versions, merge_index};
pub use refusal::{Refusal, Why};
use registry::{drain, Registry};
use rollout::RolloutFile;

/// What the controller answers a load: the versions it staged, those to drop.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadPlan {
    add: Vec<VersionConfig>,
    #[serde(default)]
    remove: Vec<Version>,
}

/// The versions served, and how they change.
pub struct Repository {
    pub registry: Registry,
    builder: Builder,
    controller: Option<Controller>,
    /// Models with a load or unload in progress.
    busy: Mutex<HashSet<String>>,
    rollout_file: Option<PathBuf>,
    /// Serialises writes of the rollout file.
    writing: Mutex<()>,
    ready_timeout: Duration,
    probe_timeout: Duration,
    /// How long an unload waits for the requests that hold the version.
    drain_bound: Duration,
}

/// How often start-up and loads re-probe backends that have not answered yet, and how often
/// an unload checks whether its version's requests are done.
pub const PROBE_TICK: Duration = Duration::from_millis(100);
const DRAIN_TICK: Duration = Duration::from_millis(5);
/// Index and release calls to the controller (a load may take `ready_timeout_ms`).
const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Settings {
    pub controller: Option<String>,
    pub rollout_file: Option<PathBuf>,
    pub ready_timeout: Duration,
    pub probe_timeout: Duration,
    pub max_budget: Duration,
}

impl Repository {
    /// The versions configured at start, READY, with the rollout file's state applied.
    pub fn new(
        routers: Vec<Router>,
        builder: Builder,
        settings: Settings,
    ) -> Result<Repository, String> {
        let controller = settings
            .controller
            .as_deref()
            .map(Controller::new)
            .transpose()?;
        let repo = Repository {
            registry: Registry::new(routers),
            builder,
            controller,
            busy: Mutex::default(),
            rollout_file: settings.rollout_file,
            writing: Mutex::default(),
            ready_timeout: settings.ready_timeout,
            probe_timeout: settings.probe_timeout,
            drain_bound: settings.max_budget + Duration::from_secs(1),
        };
        repo.restore()?;
        // Written at once: a restart then keeps each model's default even before any rollout
        // (the default at start is the highest version configured, which a restart may change).
        repo.persist().map_err(|r| r.message)?;
        Ok(repo)
    }

    /// Applies the saved rollout of each model whose versions all serve.
    fn restore(&self) -> Result<(), String> {
        let Some(path) = &self.rollout_file else {
            return Ok(());
        };
        for (model, saved) in RolloutFile::read(path)?.models {
            let ready = self.registry.ready_versions(&model);
            if let Some(v) = saved.versions().iter().find(|v| !ready.contains(v)) {
                tracing::warn!(model, version = %v, file = %path.display(), "saved rollout ignored: it names a version this router does not serve");
                continue;
            }
            let applied = self.registry.with_rollout(&model, |r, _| {
                *r = saved.clone();
                Ok(())
            });
            if let Err(e) = applied {
                tracing::warn!(model, file = %path.display(), "saved rollout ignored: {}", e.message);
            }
        }
        Ok(())
    }

    fn controller(&self) -> Result<&Controller, Refusal> {
        self.controller.as_ref().ok_or_else(|| {
            Refusal::new(
                Why::Precondition,
                "this deployment's versions are fixed at start (no repository controller)",
            )
        })
    }

    /// Marks `model` busy until the guard drops; a second load or unload gets 409.
    fn hold(&self, model: &str) -> Result<Busy<'_>, Refusal> {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        if !busy.insert(model.to_string()) {
            return Err(Refusal::new(
                Why::Conflict,
                format!("model {model} is loading"),
            ));
        }
        Ok(Busy {
            repo: self,
            model: model.to_string(),
        })
    }

    /// Every version on disk (the controller's index) with its state here.
    pub async fn index(&self, ready_only: bool) -> Result<Vec<IndexEntry>, Refusal> {
        let on_disk = match &self.controller {
            Some(c) => disk_versions(&c.call("index", &json!({}), CONTROLLER_TIMEOUT).await?)?,
            None => Vec::new(),
        };
        let index = merge_index(&on_disk, &self.registry.states());
        Ok(index
            .into_iter()
            .filter(|e| !ready_only || e.state == "READY")
            .collect())
    }

    /// Loads what the controller stages for `model` (`policy`: Triton's `version_policy`,
    /// `version`: one more version), READY once every backend of it answers; then drops the
    /// versions the controller says the policy no longer selects.
    pub async fn load(
        &self,
        model: &str,
        policy: Option<Value>,
        version: Option<Version>,
    ) -> Result<(), Refusal> {
        let controller = self.controller()?;
        let _busy = self.hold(model)?;
        let loaded: Vec<String> = (self.registry.ready_versions(model).iter())
            .map(|v| v.to_string())
            .collect();
        let body = json!({"model": model, "config": policy, "version": version, "loaded": loaded});
        let answer = controller.call("load", &body, self.ready_timeout).await?;
        let plan: LoadPlan = serde_json::from_value(answer).map_err(|e| {
            Refusal::new(
                Why::Internal,
                format!("the repository controller's load answer: {e}"),
            )
        })?;
        let mut added = Vec::new();
        if let Err(e) = self.stage(model, &plan.add, &mut added).await {
            for v in &added {
                self.registry.remove(model, *v);
            }
            // What was staged for this load, never a version that served before.
            let staged: Vec<Version> = (plan.add.iter().map(|v| v.version))
                .filter(|v| !loaded.contains(&v.to_string()))
                .collect();
            self.release(model, &staged).await;
            return Err(e);
        }
        self.registry.mark_ready(model, &added);
        tracing::info!(model, versions = ?added.iter().map(|v| v.to_string()).collect::<Vec<_>>(), "versions loaded");
        if !plan.remove.is_empty() {
            self.drop_versions(model, &plan.remove).await?;
        }
        Ok(())
    }

    /// Builds each version as LOADING (into `added`) and waits until its backends answer.
    async fn stage(
        &self,
        model: &str,
        add: &[VersionConfig],
        added: &mut Vec<Version>,
    ) -> Result<(), Refusal> {
        let mut routers = Vec::new();
        for v in add {
            let failed = |m: String| {
                Refusal::new(
                    Why::Invalid,
                    format!("loading {}/{} failed: {m}", v.model, v.version),
                )
            };
            if v.model != model {
                return Err(failed(format!(
                    "the controller staged it for model {model}"
                )));
            }
            let router = self.builder.build(v).map_err(failed)?;
            routers.push(self.registry.insert_loading(router).map_err(failed)?);
            added.push(v.version);
        }
        let deadline = Instant::now() + self.ready_timeout;
        for router in routers {
            loop {
                let (degraded, problems) = router.probe(self.probe_timeout).await;
                if degraded.is_empty() && problems.is_empty() {
                    break;
                }
                if Instant::now() >= deadline {
                    let m = &router.model;
                    let mut all = problems;
                    all.extend(degraded);
                    return Err(Refusal::new(
                        Why::Unavailable,
                        format!(
                            "loading {}/{} failed: backends not ready after {} ms: {}",
                            m.name,
                            m.version,
                            self.ready_timeout.as_millis(),
                            all.join("; ")
                        ),
                    ));
                }
                tokio::time::sleep(PROBE_TICK).await;
            }
        }
        Ok(())
    }

    /// Unloads `version` of `model`, or every version of it.
    pub async fn unload(&self, model: &str, version: Option<Version>) -> Result<(), Refusal> {
        self.controller()?;
        let _busy = self.hold(model)?;
        let versions = match version {
            Some(v) => vec![v],
            None => {
                let held: Vec<Version> = (self.registry.states().into_iter())
                    .filter(|(m, _, _)| m == model)
                    .map(|(_, v, _)| v)
                    .collect();
                if held.is_empty() {
                    self.registry.ready(model, None)?;
                }
                held
            }
        };
        self.drop_versions(model, &versions).await
    }

    /// Unload: no new request picks them, the rollout forgets them; once the requests that
    /// hold them are done they go, and the controller releases them.
    async fn drop_versions(&self, model: &str, versions: &[Version]) -> Result<(), Refusal> {
        let mut draining = Vec::new();
        for v in versions {
            draining.push((*v, self.registry.begin_unload(model, *v)?));
        }
        self.persist()?;
        for (v, router) in draining {
            if !drain(router, DRAIN_TICK, self.drain_bound).await {
                tracing::warn!(model, version = %v, "unloading with requests still in flight after {} ms", self.drain_bound.as_millis());
            }
            self.registry.remove(model, v);
        }
        self.release(model, versions).await;
        tracing::info!(model, versions = ?versions.iter().map(|v| v.to_string()).collect::<Vec<_>>(), "versions unloaded");
        Ok(())
    }

    /// Tells the controller what no longer serves; a failure is logged (nothing serves
    /// from those versions any more either way).
    async fn release(&self, model: &str, versions: &[Version]) {
        let Some(c) = &self.controller else { return };
        if versions.is_empty() {
            return;
        }
        let body = json!({"model": model, "versions": versions});
        if let Err(e) = c.call("release", &body, CONTROLLER_TIMEOUT).await {
            tracing::warn!(
                model,
                "the repository controller did not release: {}",
                e.message
            );
        }
    }

    /// `GET /admin/v1/rollout`.
    pub fn rollouts(&self) -> RolloutFile {
        RolloutFile {
            models: self.registry.rollouts(),
        }
    }

    /// `percent` of `model`'s unversioned requests to `version`; 100 promotes it.
    pub fn set_rollout(&self, model: &str, version: Version, percent: f64) -> Result<(), Refusal> {
        if !(0.0..=100.0).contains(&percent) {
            return Err(Refusal::new(
                Why::Invalid,
                format!("percent is {percent}, expected a number in [0, 100]"),
            ));
        }
        self.registry.with_rollout(model, |r, ready| {
            if !ready.contains(&version) {
                return Err(not_ready(model, version, ready));
            }
            r.set(version, percent);
            Ok(())
        })?;
        self.persist()
    }

    /// Clears the canary, or with none returns to the previous default.
    pub fn rollback(&self, model: &str) -> Result<(), Refusal> {
        self.registry.with_rollout(model, |r, ready| {
            let mut next = r.clone();
            next.rollback()
                .map_err(|m| Refusal::new(Why::Conflict, m))?;
            if !ready.contains(&next.default) {
                return Err(not_ready(model, next.default, ready));
            }
            *r = next;
            Ok(())
        })?;
        self.persist()
    }

    fn persist(&self) -> Result<(), Refusal> {
        let Some(path) = &self.rollout_file else {
            return Ok(());
        };
        let _one = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        self.rollouts()
            .write(path)
            .map_err(|m| Refusal::new(Why::Internal, m))
    }
}

fn not_ready(model: &str, version: Version, ready: &[Version]) -> Refusal {
    let ready: Vec<String> = ready.iter().map(|v| v.to_string()).collect();
    Refusal::new(
        Why::Conflict,
        format!(
            "version {version} of model {model} is not ready; its ready versions are {ready:?}"
        ),
    )
}

struct Busy<'a> {
    repo: &'a Repository,
    model: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut busy = self.repo.busy.lock().unwrap_or_else(|p| p.into_inner());
        busy.remove(&self.model);
    }
}

/// The version a request names (`?version=` or a `"version"` parameter).
pub fn parse_version(text: &str) -> Result<Version, Refusal> {
    text.parse().map_err(|m| Refusal::new(Why::Invalid, m))
}
