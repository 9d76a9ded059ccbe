//! One request's way through the router, whatever JSON form it came in:
//! check → lookups on the shards → one fused payload to a ranker → outputs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::payload::{RankPayload, RANK, RANK_FULL};
use crate::backend::ranker::RankerPool;
use crate::budget::Budget;
use crate::error::{ErrorKind, RequestError, Stage};
use crate::metrics::{Metrics, VersionMetrics};
use crate::model::{DenseSource, Mode, Model};
use crate::pipeline::kjt;
use crate::pipeline::sparse::Shards;
use crate::pipeline::validate::{check_request, show_shape, Symbols};
use crate::tensor::Tensor;

/// Past the budget, how long the lookup backstop waits for the shard client's own deadline
/// error: a few of the timer's 1 ms ticks.
const LOOKUP_BACKSTOP_GRACE: Duration = Duration::from_millis(5);

/// What the ranker answered, with where the time went.
#[derive(Debug)]
pub struct Inference {
    /// The model's flat outputs, in manifest order.
    pub outputs: Vec<Tensor>,
    pub ranker: String,
    pub lookup: Duration,
    pub transfer: Duration,
    pub queue: Duration,
    pub compute: Duration,
    pub batch_requests: u32,
}

/// The request pipeline of one served model version: its manifest, routing table and
/// rankers.
pub struct Router {
    pub model: Model,
    pub mode: Mode,
    pub shards: Shards,
    pub rankers: RankerPool,
    /// The router's one set of metrics, shared by every version.
    pub metrics: Arc<Metrics>,
    /// This version's own series.
    pub served: VersionMetrics,
}

impl Router {
    /// Probes this version's backends once: (degraded, problems). A shard replica down is
    /// only degraded while another replica serves its ranges, a range with no replica is a
    /// problem (the probe also ejects the silent replicas and readmits the ready ones); a
    /// ranker down is only degraded while another ranker answers.
    pub async fn probe(&self, timeout: Duration) -> (Vec<String>, Vec<String>) {
        let (shards, rankers) =
            tokio::join!(self.shards.probe(timeout), self.rankers.probe(timeout));
        split_health(shards, rankers, self.rankers.rankers().len())
    }

    /// Runs checked-to-be inputs (indexed like `model.inputs`) through lookups and a ranker.
    /// `budget` started when the request arrived; parsing has already spent part of it.
    pub async fn infer(
        &self,
        inputs: Vec<Option<Tensor>>,
        budget: &Budget,
    ) -> Result<Inference, RequestError> {
        let mut checked = check_request(&self.model, inputs)?;
        self.metrics.observe(Stage::Parse, budget.start.elapsed());
        budget.check(Stage::Parse)?;

        let lookup_start = Instant::now();
        let pooled = match self.mode {
            Mode::Monolithic => Vec::new(),
            Mode::Disaggregated => {
                let lookups = std::mem::take(&mut checked.lookups);
                let lookup = self.shards.lookup(&self.model, lookups, budget);
                // A backstop: the shard client keeps the budget's deadline itself and says
                // which shard was late. The grace lets its timer, armed a little later than
                // this one, fire first, so its error (naming the shard) is the one returned.
                let pooled = tokio::time::timeout(budget.left() + LOOKUP_BACKSTOP_GRACE, lookup)
                    .await
                    .map_err(|_| budget.expired(Stage::Lookup))??;
                self.metrics.observe(Stage::Lookup, lookup_start.elapsed());
                pooled
            }
        };
        let lookup = lookup_start.elapsed();
        // The fused payload: every tensor the ranker needs, in one buffer, written by the
        // ranker's connection where it travels from (on shm, straight into a slot: once).
        let cut: Vec<Option<Tensor>>;
        let (kind, payload) = match self.mode {
            Mode::Monolithic => (RANK_FULL, RankPayload::new(&checked.inputs, 0)),
            Mode::Disaggregated => {
                // A KJT's lengths cut by key are made here; the other tensors are sent as held.
                let model = &self.model;
                cut = (model.dense.iter())
                    .map(|source| match *source {
                        DenseSource::KeyLengths { kjt, key } => {
                            Some(kjt::key_lengths(&model.kjts[kjt], &checked.inputs, key))
                        }
                        _ => None,
                    })
                    .collect();
                let tensors = model
                    .dense
                    .iter()
                    .zip(&cut)
                    .map(|(source, cut)| match *source {
                        DenseSource::Input(i) => &checked.inputs[i],
                        DenseSource::Feature(f) => &pooled[f],
                        DenseSource::KeyLengths { .. } => cut.as_ref().expect("cut above"),
                    });
                // The largest batch the memory budget leaves beside the cache: the ranker
                // runs none larger (docs/cache.md, "Size follows load").
                let cap = (self.metrics.cache.get())
                    .map_or(0, |c| c.max_batch().min(u32::MAX as usize) as u32);
                (RANK, RankPayload::new(tensors, cap))
            }
        };
        budget.check(Stage::Lookup)?;

        // The deadline on the wire is now + what is left: the budget's own deadline.
        let ranked = self
            .rankers
            .rank(kind, &payload, budget.left(), budget.trace_id)
            .await?;
        let r = &ranked.response;
        let batch_requests = r.batch_requests;
        if let Some(cache) = self.metrics.cache.get() {
            // The batch the ranker ran this request in, in rows: its requests times this
            // one's rows (the first feature's leading dim), and the queue behind it.
            let rows = pooled
                .first()
                .and_then(|t| t.dims.first())
                .copied()
                .unwrap_or(1);
            cache.observe(batch_requests as u64, rows as u64, r.queue_depth as u64);
        }
        let (queue, compute) = (
            Duration::from_micros(r.queue_us as u64),
            Duration::from_micros(r.compute_us as u64),
        );
        let transfer = ranked.transfer();
        self.metrics.observe(Stage::Transfer, transfer);
        self.metrics.observe(Stage::Queue, queue);
        self.metrics.observe(Stage::Compute, compute);
        let mut symbols = checked.symbols;
        check_outputs(&self.model, &r.outputs, &mut symbols, &ranked.ranker)?;
        Ok(Inference {
            outputs: ranked.response.outputs,
            ranker: ranked.ranker,
            lookup,
            transfer,
            queue,
            compute,
            batch_requests,
        })
    }
}

fn split_health(
    shards: cleave_shard::ProbeReport,
    rankers: Vec<String>,
    n_rankers: usize,
) -> (Vec<String>, Vec<String>) {
    let (mut degraded, mut problems) = (shards.degraded, shards.problems);
    if rankers.len() < n_rankers {
        degraded.extend(rankers);
        (degraded, problems)
    } else {
        problems.extend(rankers);
        problems.push("no ranker answers".into());
        (degraded, problems)
    }
}

/// A ranker's outputs must be the manifest's, sized by this request's symbols.
fn check_outputs(
    model: &Model,
    outputs: &[Tensor],
    symbols: &mut Symbols,
    ranker: &str,
) -> Result<(), RequestError> {
    let bad = |m: String| RequestError::new(ErrorKind::Ranker, format!("ranker {ranker}: {m}"));
    if outputs.len() != model.outputs.len() {
        return Err(bad(format!(
            "returned {} outputs, the model has {}",
            outputs.len(),
            model.outputs.len()
        )));
    }
    for (spec, t) in model.outputs.iter().zip(outputs) {
        if t.dtype != spec.dtype {
            return Err(bad(format!(
                "output {:?} is {}, expected {}",
                spec.name, t.dtype, spec.dtype
            )));
        }
        let what = format!("output {:?}", spec.name);
        symbols
            .check(&spec.shape, &t.dims, &what)
            .and_then(|()| symbols.resolve())
            .map_err(|e| {
                bad(format!(
                    "output {:?} ({}): {e}",
                    spec.name,
                    show_shape(&spec.shape)
                ))
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_shard::ProbeReport;

    #[test]
    fn a_ranker_or_replica_down_degrades_a_range_down_is_a_problem() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let shards = |degraded: &[&str], problems: &[&str]| ProbeReport {
            degraded: s(degraded),
            problems: s(problems),
        };
        assert_eq!(split_health(shards(&[], &[]), s(&[]), 2), (s(&[]), s(&[])));
        assert_eq!(
            split_health(shards(&[], &[]), s(&["ranker a: down"]), 2),
            (s(&["ranker a: down"]), s(&[]))
        );
        assert_eq!(
            split_health(shards(&[], &["range b: none"]), s(&["ranker a: down"]), 2),
            (s(&["ranker a: down"]), s(&["range b: none"]))
        );
        assert_eq!(
            split_health(
                shards(&["replica c: ejected"], &[]),
                s(&["ranker a: down"]),
                2
            ),
            (s(&["replica c: ejected", "ranker a: down"]), s(&[]))
        );
        assert_eq!(
            split_health(shards(&[], &[]), s(&["ranker a: down"]), 1),
            (s(&[]), s(&["ranker a: down", "no ranker answers"]))
        );
    }
}
