//! The versions the router serves: model → version → its `Router` and state, with each
//! model's rollout. Requests take an `Arc<Router>` from here and hold it while they run;
//! an unload waits until none does.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::config::Version;
use crate::error::{ErrorKind, RequestError};
use crate::pipeline::router::Router;
use crate::repository::rollout::Rollout;
use crate::repository::Refusal;

/// A version's state, by Triton's names; a version not here is `UNAVAILABLE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Ready,
    Loading,
    Unloading,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Ready => "READY",
            State::Loading => "LOADING",
            State::Unloading => "UNLOADING",
        }
    }
}

pub const UNAVAILABLE: &str = "UNAVAILABLE";

struct Served {
    router: Arc<Router>,
    state: State,
}

#[derive(Default)]
struct Versions {
    versions: BTreeMap<Version, Served>,
    /// Versions draining: out of `versions`, so that only requests hold their router.
    unloading: std::collections::BTreeSet<Version>,
    /// None until a version of the model is ready.
    rollout: Option<Rollout>,
}

impl Versions {
    fn ready(&self) -> impl Iterator<Item = Version> + '_ {
        (self.versions.iter())
            .filter(|(_, s)| s.state == State::Ready)
            .map(|(v, _)| *v)
    }
}

#[derive(Default)]
pub struct Registry {
    models: RwLock<BTreeMap<String, Versions>>,
}

fn unknown(message: String) -> RequestError {
    RequestError::new(ErrorKind::UnknownModel, message)
}

impl Registry {
    /// Every router READY; each model's default is its largest version.
    pub fn new(routers: Vec<Router>) -> Registry {
        let registry = Registry::default();
        let mut loaded: BTreeMap<String, Vec<Version>> = BTreeMap::new();
        for router in routers {
            let (model, version) = key(&router);
            registry
                .insert_loading(router)
                .expect("the config checked versions are unique");
            loaded.entry(model).or_default().push(version);
        }
        for (model, versions) in loaded {
            registry.mark_ready(&model, &versions);
        }
        registry
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Versions>> {
        self.models.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Versions>> {
        self.models.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The version a request runs on: the one it names (READY), else its model's rollout's
    /// choice for `key`.
    pub fn choose(
        &self,
        model: &str,
        version: Option<&str>,
        key: Option<&str>,
    ) -> Result<Arc<Router>, RequestError> {
        let models = self.read();
        let versions = find(&models, model)?;
        let chosen = match version {
            Some(v) => v.parse::<Version>().ok(),
            None => versions.rollout.as_ref().map(|r| r.pick(model, key)),
        };
        let ready = |v: &Version| {
            (versions.versions.get(v))
                .filter(|s| s.state == State::Ready)
                .map(|s| s.router.clone())
        };
        if let Some(router) = chosen.as_ref().and_then(ready) {
            return Ok(router);
        }
        let loaded: Vec<String> = versions.ready().map(|v| v.to_string()).collect();
        Err(unknown(match version {
            Some(v) => format!(
                "model {model:?} has no version {v:?} ready; its ready versions are {loaded:?}"
            ),
            None => format!("model {model:?} has no version ready"),
        }))
    }

    /// A READY version for metadata and admin calls: the one named, else the default.
    pub fn ready(&self, model: &str, version: Option<&str>) -> Result<Arc<Router>, RequestError> {
        match version {
            Some(_) => self.choose(model, version, None),
            None => {
                let models = self.read();
                let versions = find(&models, model)?;
                let default = versions.rollout.as_ref().map(|r| r.default);
                (default.and_then(|v| versions.versions.get(&v)))
                    .map(|s| s.router.clone())
                    .ok_or_else(|| unknown(format!("model {model:?} has no version ready")))
            }
        }
    }

    /// A model's READY versions, in numeric order.
    pub fn ready_versions(&self, model: &str) -> Vec<Version> {
        let models = self.read();
        models
            .get(model)
            .map_or(Vec::new(), |v| v.ready().collect())
    }

    /// Every READY version's router.
    pub fn all_ready(&self) -> Vec<Arc<Router>> {
        let models = self.read();
        (models.values())
            .flat_map(|v| v.versions.values())
            .filter(|s| s.state == State::Ready)
            .map(|s| s.router.clone())
            .collect()
    }

    /// (model, version, state) of every version held, in order.
    pub fn states(&self) -> Vec<(String, Version, State)> {
        let models = self.read();
        let mut out = Vec::new();
        for (name, versions) in models.iter() {
            let held = versions.versions.iter().map(|(v, s)| (*v, s.state));
            let unloading = versions.unloading.iter().map(|v| (*v, State::Unloading));
            let mut all: Vec<(Version, State)> = held.chain(unloading).collect();
            all.sort_by_key(|(v, _)| *v);
            out.extend(all.into_iter().map(|(v, s)| (name.clone(), v, s)));
        }
        out
    }

    /// The version an admin call means: the one named, else the only one served.
    pub fn target(
        &self,
        model: Option<&str>,
        version: Option<&str>,
    ) -> Result<Arc<Router>, String> {
        match (model, version) {
            (Some(m), v) => self.ready(m, v).map_err(|e| e.message),
            (None, Some(_)) => Err("\"version\" needs \"model\" beside it".into()),
            (None, None) => {
                let all = self.all_ready();
                match all.as_slice() {
                    [one] => Ok(one.clone()),
                    _ => Err(format!(
                        "name the model and version: this router serves {}",
                        all.iter()
                            .map(|r| format!("{}/{}", r.model.name, r.model.version))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
                }
            }
        }
    }

    /// Adds a version being loaded; it takes no request until `mark_ready`.
    pub fn insert_loading(&self, router: Router) -> Result<Arc<Router>, String> {
        let (model, version) = key(&router);
        let mut models = self.write();
        let versions = models.entry(model.clone()).or_default();
        if versions.versions.contains_key(&version) || versions.unloading.contains(&version) {
            return Err(format!("{model}/{version} is already loaded"));
        }
        let router = Arc::new(router);
        let state = State::Loading;
        let served = Served {
            router: router.clone(),
            state,
        };
        versions.versions.insert(version, served);
        Ok(router)
    }

    /// The versions loaded take requests; a model with none ready before gets the largest as
    /// its default. A version loaded later is the default only once promoted.
    pub fn mark_ready(&self, model: &str, loaded: &[Version]) {
        let mut models = self.write();
        let Some(versions) = models.get_mut(model) else {
            return;
        };
        for v in loaded {
            if let Some(s) = versions.versions.get_mut(v) {
                s.state = State::Ready;
            }
        }
        if versions.rollout.is_none() {
            versions.rollout = loaded.iter().max().map(|v| Rollout::new(*v));
        }
    }

    /// Forgets a version (one that failed to load, or one drained); the model goes with its
    /// last version.
    pub fn remove(&self, model: &str, version: Version) {
        let mut models = self.write();
        let Some(versions) = models.get_mut(model) else {
            return;
        };
        versions.versions.remove(&version);
        versions.unloading.remove(&version);
        if versions.versions.is_empty() && versions.unloading.is_empty() {
            models.remove(model);
        }
    }

    /// Starts unloading: no new request picks the version, the rollout forgets it (a
    /// default that goes becomes the largest version left), and what the requests hold is
    /// returned, for `drain`.
    pub fn begin_unload(&self, model: &str, version: Version) -> Result<Arc<Router>, RequestError> {
        let mut models = self.write();
        let versions = find_mut(&mut models, model)?;
        let Some(served) = versions.versions.remove(&version) else {
            let held: Vec<String> = (versions.versions.keys()).map(|v| v.to_string()).collect();
            return Err(unknown(format!(
                "model {model:?} has no version {version} loaded; its versions are {held:?}"
            )));
        };
        versions.unloading.insert(version);
        let router = served.router;
        let successor = versions.ready().last();
        if let Some(rollout) = versions.rollout.as_mut() {
            let was = rollout.default;
            rollout.forget(version, successor);
            if successor.is_none() && was == version {
                versions.rollout = None;
            } else if rollout.default != was {
                tracing::info!(model, from = %was, to = %rollout.default, "default version changed: the default was unloaded");
            }
        }
        Ok(router)
    }

    /// Applies `change` to a model's rollout, given the versions READY.
    pub fn with_rollout<T>(
        &self,
        model: &str,
        change: impl FnOnce(&mut Rollout, &[Version]) -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let mut models = self.write();
        let versions = find_mut(&mut models, model)?;
        let ready: Vec<Version> = versions.ready().collect();
        let rollout = (versions.rollout.as_mut())
            .ok_or_else(|| unknown(format!("model {model:?} has no version ready")))?;
        change(rollout, &ready)
    }

    /// Every model's rollout.
    pub fn rollouts(&self) -> BTreeMap<String, Rollout> {
        let models = self.read();
        (models.iter())
            .filter_map(|(m, v)| Some((m.clone(), v.rollout.clone()?)))
            .collect()
    }
}

fn key(router: &Router) -> (String, Version) {
    let version = router.model.version.parse().unwrap_or_default();
    (router.model.name.clone(), version)
}

fn find<'a>(
    models: &'a BTreeMap<String, Versions>,
    model: &str,
) -> Result<&'a Versions, RequestError> {
    models
        .get(model)
        .ok_or_else(|| unknown_model(models, model))
}

fn find_mut<'a>(
    models: &'a mut BTreeMap<String, Versions>,
    model: &str,
) -> Result<&'a mut Versions, RequestError> {
    if !models.contains_key(model) {
        return Err(unknown_model(models, model));
    }
    Ok(models.get_mut(model).expect("checked above"))
}

fn unknown_model(models: &BTreeMap<String, Versions>, model: &str) -> RequestError {
    let names: Vec<&String> = models.keys().collect();
    match names.as_slice() {
        [one] => unknown(format!(
            "unknown model {model:?}; this router serves {one:?}"
        )),
        _ => unknown(format!(
            "unknown model {model:?}; this router serves {names:?}"
        )),
    }
}

/// Waits until no request holds `router` (begin_unload's) any more, checking every `tick`,
/// for `bound` at most; false when requests still held it then.
pub async fn drain(router: Arc<Router>, tick: Duration, bound: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    while Arc::strong_count(&router) > 1 {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(tick).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ranker::RankerPool;
    use crate::metrics::Metrics;
    use crate::model::Mode;
    use crate::pipeline::sparse::Shards;
    use cleave_wire::{ClientConfig, IoThreads};

    fn router(io: &IoThreads, metrics: &Arc<Metrics>, version: u64) -> Router {
        let mut model = crate::model::tests::model();
        model.version = version.to_string();
        let rankers = RankerPool::new(&["127.0.0.1:1".into()], io, ClientConfig::default());
        Router {
            served: metrics.version(&model.name, &model.version),
            model,
            mode: Mode::Disaggregated,
            shards: Shards::none(),
            rankers: rankers.unwrap(),
            metrics: metrics.clone(),
        }
    }

    fn registry(versions: &[u64]) -> (Registry, IoThreads) {
        let io = IoThreads::new("test-io", 1).unwrap();
        let metrics = Arc::new(Metrics::default());
        let routers = versions.iter().map(|v| router(&io, &metrics, *v)).collect();
        (Registry::new(routers), io)
    }

    fn chosen(r: &Registry, version: Option<&str>, key: Option<&str>) -> Result<String, String> {
        (r.choose("dlrm", version, key))
            .map(|r| r.model.version.clone())
            .map_err(|e| e.message)
    }

    #[test]
    fn the_default_is_the_largest_version_and_a_named_one_must_be_ready() {
        let (r, _io) = registry(&[1, 3, 2]);
        assert_eq!(chosen(&r, None, None).unwrap(), "3");
        assert_eq!(chosen(&r, Some("2"), None).unwrap(), "2");
        let e = chosen(&r, Some("7"), None).unwrap_err();
        assert!(
            e.contains("no version \"7\" ready; its ready versions are [\"1\", \"2\", \"3\"]"),
            "{e}"
        );
        let e = r.choose("other", None, None).map(|_| ()).unwrap_err();
        assert_eq!(e.kind, ErrorKind::UnknownModel);
        assert!(
            e.message.contains("this router serves \"dlrm\""),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_loaded_version_takes_unversioned_traffic_only_through_rollout() {
        let (r, io) = registry(&[1]);
        let metrics = Arc::new(Metrics::default());
        r.insert_loading(router(&io, &metrics, 2)).unwrap();
        assert!(
            chosen(&r, Some("2"), None).is_err(),
            "LOADING takes no request"
        );
        r.mark_ready("dlrm", &[Version(2)]);
        assert_eq!(chosen(&r, None, None).unwrap(), "1");
        r.with_rollout("dlrm", |ro, _| {
            ro.set(Version(2), 50.0);
            Ok(())
        })
        .unwrap();
        let picks: std::collections::BTreeSet<String> = (0..200)
            .map(|i| chosen(&r, None, Some(&format!("k{i}"))).unwrap())
            .collect();
        assert_eq!(picks.len(), 2);
        for i in 0..50 {
            let k = format!("k{i}");
            assert_eq!(chosen(&r, None, Some(&k)), chosen(&r, None, Some(&k)));
        }
    }

    #[test]
    fn unloading_the_default_moves_it_and_clears_the_canary() {
        let (r, _io) = registry(&[1, 2, 3]);
        r.with_rollout("dlrm", |ro, _| {
            ro.set(Version(2), 10.0);
            Ok(())
        })
        .unwrap();
        r.begin_unload("dlrm", Version(2)).unwrap();
        assert_eq!(r.rollouts()["dlrm"].canary, None);
        assert!(
            chosen(&r, Some("2"), None).is_err(),
            "UNLOADING takes no request"
        );
        r.begin_unload("dlrm", Version(3)).unwrap();
        assert_eq!(r.rollouts()["dlrm"].default, Version(1));
        let states: Vec<&str> = r.states().iter().map(|s| s.2.as_str()).collect();
        assert_eq!(states, ["READY", "UNLOADING", "UNLOADING"]);
        r.remove("dlrm", Version(2));
        r.remove("dlrm", Version(3));
        r.begin_unload("dlrm", Version(1)).unwrap();
        r.remove("dlrm", Version(1));
        assert!(r.states().is_empty() && r.rollouts().is_empty());
    }

    #[test]
    fn an_admin_call_must_name_the_version_when_several_serve() {
        let (one, _io) = registry(&[1]);
        assert!(one.target(None, None).is_ok());
        let (two, _io2) = registry(&[1, 2]);
        let e = two.target(None, None).map(|_| ()).unwrap_err();
        assert_eq!(
            e,
            "name the model and version: this router serves dlrm/1, dlrm/2"
        );
        let r = two.target(Some("dlrm"), Some("1")).unwrap();
        assert_eq!(r.model.version, "1");
    }

    #[tokio::test(start_paused = true)]
    async fn an_unload_waits_for_the_requests_holding_the_version() {
        let (r, _io) = registry(&[1, 2]);
        let held = r.choose("dlrm", Some("1"), None).unwrap();
        let router = r.begin_unload("dlrm", Version(1)).unwrap();
        let bound = Duration::from_secs(60);
        let mut waiting = tokio::spawn(drain(router, Duration::from_millis(5), bound));
        // Paused time runs ahead: the drain is still waiting a virtual second later.
        let early = tokio::time::timeout(Duration::from_secs(1), &mut waiting).await;
        assert!(
            early.is_err(),
            "the drain ended while a request held the version"
        );
        drop(held);
        assert!(waiting.await.unwrap(), "drained once the request let go");
        let router = r.begin_unload("dlrm", Version(2)).unwrap();
        let _held = router.clone();
        assert!(
            !drain(router, Duration::from_millis(5), bound).await,
            "bounded"
        );
    }
}
