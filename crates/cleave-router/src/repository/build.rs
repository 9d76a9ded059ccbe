//! Building one version's `Router` from its config: its manifest, the shard client of its
//! routing table and its ranker pool, on the router's I/O threads.

use std::sync::Arc;
use std::time::Duration;

use cleave_wire::{ClientConfig, IoThreads};

use crate::backend::ranker::RankerPool;
use crate::config::{ConfigMode, RouterConfig, VersionConfig};
use crate::metrics::Metrics;
use crate::model::{Mode, Model};
use crate::pipeline::cache::policy::PolicyConfig;
use crate::pipeline::cache::EmbedCache;
use crate::pipeline::held::HeldShards;
use crate::pipeline::router::Router;
use crate::pipeline::sparse::Shards;

/// What every version's router is built with: the router's settings and its I/O threads.
pub struct Builder {
    pub io: IoThreads,
    pub mode: ConfigMode,
    pub connect_timeout: Duration,
    pub call_cap: Duration,
    pub attempt: Option<Duration>,
    pub response_credits: Option<u64>,
    pub ranker_connections: usize,
    pub held_threads: usize,
    /// Incast control's threshold in bytes, when it is on.
    pub incast: Option<u64>,
    pub metrics: Arc<Metrics>,
    /// The embedding cache, shared by every version (each keys its own tables).
    pub cache: Arc<EmbedCache>,
}

impl Builder {
    pub fn new(config: &RouterConfig, io: IoThreads, metrics: Arc<Metrics>) -> Builder {
        let cache = Arc::new(EmbedCache::new(PolicyConfig::of(config)));
        if cache.enabled() {
            // A second builder of the same metrics keeps the first's cache.
            let _ = metrics
                .cache
                .set(cache.clone() as Arc<dyn crate::metrics::CacheHandle>);
        }
        Builder {
            cache,
            io,
            mode: config.mode,
            connect_timeout: Duration::from_millis(config.connect_timeout_ms),
            call_cap: Duration::from_secs_f64(config.max_budget_ms / 1e3),
            attempt: (config.shard_timeout_ms > 0)
                .then(|| Duration::from_millis(config.shard_timeout_ms)),
            response_credits: config.response_credits,
            ranker_connections: config.ranker_connections,
            held_threads: config.held_threads,
            incast: config
                .incast_control
                .then_some(config.incast_threshold_bytes),
            metrics,
        }
    }

    /// The version's router; errors name the bundle or the route that is wrong.
    pub fn build(&self, v: &VersionConfig) -> Result<Router, String> {
        v.check(self.incast.is_some())?;
        let mode: Mode = self.mode.into();
        let mut model = Model::load(&v.model, &v.bundle)?;
        model.version = v.version.to_string();
        let shards = match (mode, self.mode) {
            (_, ConfigMode::RouterHeld) => {
                Shards::held(HeldShards::open(&v.bundle, self.held_threads)?)
            }
            (Mode::Disaggregated, _) => Shards::new(
                &model,
                &v.shards,
                &self.io,
                self.connect_timeout,
                self.call_cap,
                self.attempt,
                self.response_credits,
            )?
            .with_cache(&model, &self.cache),
            (Mode::Monolithic, _) => Shards::none(),
        };
        let client = ClientConfig {
            connections: self.ranker_connections.max(1),
            connect_timeout: self.connect_timeout,
            send_cpu: Some(self.metrics.ranker_send_cpu.clone()),
            ..ClientConfig::default()
        };
        let rankers = RankerPool::new(&v.rankers, &self.io, client)?;
        if let Some(threshold) = self.incast {
            rankers.start_incast(&v.ranker_control, threshold);
        }
        let served = self.metrics.version(&model.name, &model.version);
        Ok(Router {
            model,
            mode,
            shards,
            rankers,
            metrics: self.metrics.clone(),
            served,
        })
    }
}
