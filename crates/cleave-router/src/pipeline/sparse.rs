//! The sparse side of a request: every feature's lookup goes to the shards through
//! cleave-shard's client (range routing table, replica choice and fail-over, fan-out, merge of
//! partial pools), and the results become boundary tensors shaped as the sparse reference
//! shapes them: pooled `[bags, dim]`, gathered `ids.shape + [dim]`. The shard membership
//! (replicas joining, draining, leaving) changes here, for the admin API. A router-held
//! deployment looks the same batch up in-process instead (held.rs). With the router's cache
//! on (cache/, docs/cache.md), only what it does not hold is sent.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use cleave_shard::{ClientError, Lookup as ShardLookup, Op, Route, RoutingTable};
use cleave_shard::{Member, MembershipError, ProbeReport, ShardClient, ShardClientConfig};
use cleave_wire::{Address, ErrorCode, IoThreads, WireError};

use crate::budget::Budget;
use crate::config::ShardRoute;
use crate::error::{ErrorKind, RequestError, Stage};
use crate::model::Model;
use crate::pipeline::cache::EmbedCache;
use crate::pipeline::held::HeldShards;
use crate::pipeline::validate::Lookup;
use crate::tensor::{numel, Tensor};

/// The shards of a disaggregated router (none in monolithic mode), or the tables it holds.
pub struct Shards {
    client: Option<ShardClient>,
    held: Option<HeldShards>,
    /// Caps one lookup's wait below the request's budget.
    call_timeout: Duration,
    /// Caps one replica's wait when another could take a retry (None: half the budget left).
    attempt_timeout: Option<Duration>,
    /// The router's cache (shared by every served version) and this version's table ids in it.
    cache: Option<(Arc<EmbedCache>, HashMap<String, u32>)>,
}

impl Shards {
    /// Checks that the routes cover every row of every table a feature reads, exactly once,
    /// and builds the client. Connections open on the first probe.
    pub fn new(
        model: &Model,
        routes: &[ShardRoute],
        io: &IoThreads,
        connect_timeout: Duration,
        call_timeout: Duration,
        attempt_timeout: Option<Duration>,
        response_credits: Option<u64>,
    ) -> Result<Shards, String> {
        check_coverage(model, routes)?;
        let table = RoutingTable::new(
            routes
                .iter()
                .map(|r| {
                    let addr = r.addr.parse().map_err(|e| format!("shard route: {e}"))?;
                    Ok(Route {
                        table: r.table.clone(),
                        rows: r.row_start..r.row_end,
                        addr,
                    })
                })
                .collect::<Result<Vec<_>, String>>()?,
        )?;
        let config = ShardClientConfig {
            // The request's own budget bounds each call; this only caps a runaway one.
            timeout: call_timeout,
            connect_timeout,
            response_credits,
            ..ShardClientConfig::default()
        };
        Ok(Shards {
            client: Some(ShardClient::with_io(table, io.clone(), &config)),
            held: None,
            call_timeout,
            attempt_timeout,
            cache: None,
        })
    }

    /// Looks up through `cache` (when it is on): this version's tables get their own ids.
    pub fn with_cache(mut self, model: &Model, cache: &Arc<EmbedCache>) -> Shards {
        if cache.enabled() && self.client.is_some() {
            let mut ids = HashMap::new();
            for f in &model.features {
                ids.entry(f.table.clone())
                    .or_insert_with(|| cache.table(&f.table));
            }
            self.cache = Some((cache.clone(), ids));
        }
        self
    }

    pub fn none() -> Shards {
        Shards {
            client: None,
            held: None,
            call_timeout: Duration::ZERO,
            attempt_timeout: None,
            cache: None,
        }
    }

    /// Every table of the bundle held in this process (router-held mode).
    pub fn held(held: HeldShards) -> Shards {
        Shards {
            held: Some(held),
            ..Shards::none()
        }
    }

    /// One boundary tensor per feature (indexed like `model.features`). The shards get the
    /// request's trace id and its deadline (what is left of the budget, capped by the
    /// configured call timeout).
    pub async fn lookup(
        &self,
        model: &Model,
        lookups: Vec<Lookup>,
        budget: &Budget,
    ) -> Result<Vec<Tensor>, RequestError> {
        let mut dims = Vec::with_capacity(lookups.len());
        let mut row_dims = Vec::with_capacity(lookups.len());
        let batch = lookups
            .into_iter()
            .map(|l| {
                let f = &model.features[l.feature];
                dims.push(l.out_dims);
                row_dims.push(f.dim);
                to_shard_lookup(&f.table, f.pooling, l.ids, l.bags, l.weights)
                    .map_err(|e| RequestError::input(&model.inputs[f.ids].name, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let values: Vec<Vec<f32>> = match (&self.held, &self.client, &self.cache) {
            (None, Some(_), Some((cache, ids))) if cache.holds() => {
                let tables: Vec<u32> = batch.iter().map(|l| ids[&l.table]).collect();
                let split = cache.split(&batch, &tables, budget.start_unix_us());
                let fetched = if split.misses.is_empty() {
                    Vec::new()
                } else {
                    self.fetch(&split.misses, budget).await?
                };
                cache
                    .finish(split, fetched, &row_dims)
                    .map_err(|e| RequestError::new(ErrorKind::Shard, e).at(Stage::Lookup))?
            }
            _ => {
                if let Some((cache, _)) = &self.cache {
                    cache.passed(&batch);
                }
                (self.fetch(&batch, budget).await?)
                    .into_iter()
                    .map(|p| p.values)
                    .collect()
            }
        };
        values
            .into_iter()
            .zip(dims)
            .zip(&model.features)
            .map(|((values, dims), f)| {
                if Some(values.len()) != numel(&dims) {
                    return Err(RequestError::new(
                        ErrorKind::Shard,
                        format!(
                            "feature {:?}: the shards returned {} values, expected {dims:?}",
                            f.name,
                            values.len()
                        ),
                    ));
                }
                Ok(Tensor::from_f32(dims, &values))
            })
            .collect()
    }

    /// The shards' (or the held tables') answer to `batch`.
    async fn fetch(
        &self,
        batch: &[ShardLookup],
        budget: &Budget,
    ) -> Result<Vec<cleave_shard::Pooled>, RequestError> {
        Ok(match (&self.held, &self.client) {
            (Some(held), _) => held.lookup(batch)?,
            (None, None) => {
                return Err(RequestError::new(
                    ErrorKind::Unavailable,
                    "this router has no shards",
                ))
            }
            (None, Some(client)) => {
                let timeout = budget.left().min(self.call_timeout);
                // By default a replica gets half of what is left, so a retry elsewhere fits.
                let attempt = self.attempt_timeout.map_or(timeout / 2, |a| a.min(timeout));
                client
                    .lookup_within(
                        batch,
                        timeout,
                        attempt,
                        budget.trace_id,
                        Some(budget.start_unix_us()),
                    )
                    .await
                    .map_err(shard_error)?
            }
        })
    }

    /// Probes every shard replica once (ejecting the silent, readmitting the ready): replicas
    /// down while their ranges have another (`degraded`), ranges with none (`problems`).
    pub async fn probe(&self, timeout: Duration) -> ProbeReport {
        match &self.client {
            Some(client) => client.probe(timeout).await,
            None => ProbeReport::default(),
        }
    }

    /// Every shard replica with its ranges, state and load (none in monolithic mode).
    pub fn members(&self) -> Vec<Member> {
        self.client.as_ref().map_or_else(Vec::new, |c| c.members())
    }

    fn client(&self) -> Result<&ShardClient, MembershipError> {
        self.client.as_ref().ok_or_else(|| {
            let why = if self.held.is_some() {
                "holds its tables in-process"
            } else {
                "is monolithic"
            };
            MembershipError::Conflict(format!("this router {why}: it has no shard processes"))
        })
    }

    /// Adds a replica holding exactly the ranges of an existing replica group.
    pub fn add(
        &self,
        addr: &str,
        ranges: Vec<(String, Range<u64>)>,
    ) -> Result<(), MembershipError> {
        let addr = parse_addr(addr)?;
        self.client()?.add_replica(addr, ranges)
    }

    pub fn drain(&self, addr: &str) -> Result<(), MembershipError> {
        self.client()?.drain(&parse_addr(addr)?)
    }

    pub fn remove(&self, addr: &str) -> Result<(), MembershipError> {
        self.client()?.remove(&parse_addr(addr)?)
    }
}

fn parse_addr(addr: &str) -> Result<Address, MembershipError> {
    addr.parse()
        .map_err(|e| MembershipError::Invalid(format!("addr: {e}")))
}

/// The shard client's lookup for one feature: pooled bags as u32 offsets, ids after the last
/// bag (ignored with `include_last_offset`) dropped.
fn to_shard_lookup(
    table: &str,
    pooling: Option<cleave_embed::Pooling>,
    mut ids: Vec<i64>,
    bags: Option<Vec<usize>>,
    mut weights: Option<Vec<f32>>,
) -> Result<ShardLookup, String> {
    let (op, offsets) = match (pooling, bags) {
        (Some(p), Some(bags)) => {
            let end = bags.last().copied().unwrap_or(0);
            ids.truncate(end);
            if let Some(w) = weights.as_mut() {
                w.truncate(end);
            }
            let offsets = bags
                .iter()
                .map(|&b| u32::try_from(b))
                .collect::<Result<Vec<u32>, _>>()
                .map_err(|_| format!("{} ids in one lookup, at most {}", ids.len(), u32::MAX))?;
            (Op::Pool(p), offsets)
        }
        _ => (Op::Gather, Vec::new()),
    };
    Ok(ShardLookup {
        table: table.to_string(),
        op,
        ids,
        offsets,
        weights,
    })
}

fn shard_error(e: ClientError) -> RequestError {
    let kind = match (&e, e.wire()) {
        // Out of time: waiting for a shard, dropped by one before it started, or not sent
        // because less time was left than the shard's lookups take.
        (ClientError::Late { .. }, _)
        | (_, Some(WireError::Timeout { .. }))
        | (
            _,
            Some(WireError::Remote {
                code: ErrorCode::Deadline,
                ..
            }),
        ) => return RequestError::new(ErrorKind::Deadline, format!("{e}")).at(Stage::Lookup),
        (ClientError::Unavailable { .. }, _)
        | (_, Some(WireError::Connect { .. } | WireError::Handshake { .. })) => {
            ErrorKind::Unavailable
        }
        _ => ErrorKind::Shard,
    };
    RequestError::new(kind, e.to_string()).at(Stage::Lookup)
}

/// Every table a feature reads must be covered from row 0 to its last row by replica groups,
/// each row by exactly one group (replicas hold identical ranges; partial overlaps are
/// refused); routes may only name the bundle's tables and rows.
fn check_coverage(model: &Model, routes: &[ShardRoute]) -> Result<(), String> {
    let mut by_table: BTreeMap<&str, Vec<&ShardRoute>> = BTreeMap::new();
    for r in routes {
        let Some(f) = model.features.iter().find(|f| f.table == r.table) else {
            return Err(format!(
                "shard route {} names table {:?}, which no feature of the bundle reads",
                r.addr, r.table
            ));
        };
        if r.row_end > f.rows {
            return Err(format!(
                "shard route {} for table {:?}: rows [{}, {}) go past the table's {} rows",
                r.addr, r.table, r.row_start, r.row_end, f.rows
            ));
        }
        by_table.entry(&r.table).or_default().push(r);
    }
    for f in &model.features {
        let mut ranges = by_table.get(f.table.as_str()).cloned().unwrap_or_default();
        ranges.sort_by_key(|r| (r.row_start, r.row_end));
        // Identical ranges are replicas of one group: they cover their rows once.
        ranges.dedup_by_key(|r| (r.row_start, r.row_end));
        let mut next = 0;
        let mut last: Option<&ShardRoute> = None;
        for r in &ranges {
            if r.row_start > next {
                return Err(format!(
                    "table {:?}: rows [{next}, {}) are on no shard",
                    f.table, r.row_start
                ));
            }
            if let Some(prev) = last.filter(|_| r.row_start < next) {
                return Err(format!(
                    "table {:?}: rows [{}, {}) are on two shards that are not replicas: \
                     [{}, {}) at {} and [{}, {}) at {} (replicas hold identical ranges)",
                    f.table,
                    r.row_start,
                    next.min(r.row_end),
                    prev.row_start,
                    prev.row_end,
                    prev.addr,
                    r.row_start,
                    r.row_end,
                    r.addr
                ));
            }
            next = r.row_end;
            last = Some(r);
        }
        if next < f.rows {
            return Err(format!(
                "table {:?}: rows [{next}, {}) are on no shard",
                f.table, f.rows
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::model;
    use cleave_embed::Pooling;

    fn route(table: &str, a: u64, b: u64) -> ShardRoute {
        ShardRoute {
            table: table.into(),
            row_start: a,
            row_end: b,
            addr: "h:1".into(),
        }
    }

    fn full() -> Vec<ShardRoute> {
        vec![
            route("t_user", 0, 10),
            route("t_item", 0, 12),
            route("t_item", 12, 20),
            route("t_cat", 0, 7),
        ]
    }

    #[test]
    fn routes_must_cover_every_table_once() {
        let m = model();
        assert!(check_coverage(&m, &full()).is_ok());
        let mut gap = full();
        gap[2].row_start = 13;
        assert!(check_coverage(&m, &gap)
            .unwrap_err()
            .contains("rows [12, 13) are on no shard"));
        let mut overlap = full();
        overlap[2].row_start = 11;
        assert!(check_coverage(&m, &overlap)
            .unwrap_err()
            .contains("rows [11, 12) are on two shards that are not replicas"));
        // Identical ranges at other addresses are replicas, covering their rows once.
        let mut replicated = full();
        for r in full() {
            replicated.push(ShardRoute {
                addr: "h:2".into(),
                ..r
            });
        }
        assert!(check_coverage(&m, &replicated).is_ok());
        replicated.push(ShardRoute {
            addr: "h:3".into(),
            ..route("t_item", 0, 11)
        });
        assert!(check_coverage(&m, &replicated)
            .unwrap_err()
            .contains("rows [0, 11) are on two shards that are not replicas"));
        let mut short = full();
        short[3].row_end = 6;
        assert!(check_coverage(&m, &short)
            .unwrap_err()
            .contains("rows [6, 7) are on no shard"));
        let mut long = full();
        long[3].row_end = 8;
        assert!(check_coverage(&m, &long)
            .unwrap_err()
            .contains("past the table's 7 rows"));
        let mut extra = full();
        extra.push(route("t_nope", 0, 1));
        assert!(check_coverage(&m, &extra)
            .unwrap_err()
            .contains("\"t_nope\""));
        assert!(check_coverage(&m, &full()[1..])
            .unwrap_err()
            .contains("\"t_user\": rows [0, 10)"));
    }

    #[test]
    fn shard_lookups_drop_ids_after_the_last_bag() {
        let l = to_shard_lookup(
            "t",
            Some(Pooling::Sum),
            vec![1, 2, 3],
            Some(vec![0, 1, 2]),
            Some(vec![0.5; 3]),
        )
        .unwrap();
        assert_eq!(
            (l.ids, l.offsets, l.weights),
            (vec![1, 2], vec![0, 1, 2], Some(vec![0.5, 0.5]))
        );
        let g = to_shard_lookup("t", None, vec![4, 5], None, None).unwrap();
        assert_eq!((g.op, g.offsets.len()), (Op::Gather, 0));
    }
}
