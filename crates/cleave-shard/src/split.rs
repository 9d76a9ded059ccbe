//! Splitting a batch of lookups by replica group, and merging the groups' partial answers
//! (hierarchical pooling, FlexEMR §3.1.2): sums add, means add sums and divide by the total
//! count, maxima take the max over the shards that pooled at least one id.

use cleave_embed::lookup::finish;
use cleave_embed::{merge, Pooling};

use crate::client::ClientError;
use crate::message::{Lookup, LookupView, Op, Pooled};
use crate::routes::{RoutingTable, TableRoutes};

/// One lookup of a shard's frame: a request of the batch sent whole, or one group's part.
pub(crate) enum Sub {
    Whole(usize),
    Part {
        req: usize,
        lookup: Lookup,
        positions: Vec<u32>,
    },
}

/// Splits every lookup by replica group: per group, the lookups to send.
pub(crate) fn plan(routes: &RoutingTable, batch: &[Lookup]) -> Result<Vec<Vec<Sub>>, ClientError> {
    let groups = routes.groups().len();
    let mut plan: Vec<Vec<Sub>> = (0..groups).map(|_| Vec::new()).collect();
    for (i, l) in batch.iter().enumerate() {
        let bad =
            |m: String| ClientError::BadRequest(format!("lookup {i} (table {:?}): {m}", l.table));
        l.view().check().map_err(bad)?;
        let table = routes.table(&l.table).ok_or_else(|| {
            bad(format!(
                "no shard holds this table; routed tables are {:?}",
                routes.table_names()
            ))
        })?;
        let group_of = locate_all(l, table, routes).map_err(bad)?;
        let Some(group_of) = group_of else {
            // One group holds every id (or there are none): send the lookup as it is.
            let g = table.single().map_or_else(
                || {
                    l.ids
                        .first()
                        .and_then(|&id| table.locate(id))
                        .unwrap_or(table.first_group())
                },
                |(g, _)| g,
            );
            plan[g].push(Sub::Whole(i));
            continue;
        };
        for (g, lookup, positions) in split(l, &group_of, groups) {
            plan[g].push(Sub::Part {
                req: i,
                lookup,
                positions,
            });
        }
    }
    Ok(plan)
}

/// The group of every id, or None when one group holds them all. Errors name the first id
/// that no route covers.
fn locate_all(
    l: &Lookup,
    routes: &TableRoutes,
    table: &RoutingTable,
) -> Result<Option<Vec<usize>>, String> {
    let outside = |p: usize, id: i64| {
        format!(
            "id {id} at position {p} is outside every route ({})",
            routes.describe(table)
        )
    };
    if let Some((_, range)) = routes.single() {
        return match l
            .ids
            .iter()
            .position(|&id| id < 0 || !range.contains(&(id as u64)))
        {
            Some(p) => Err(outside(p, l.ids[p])),
            None => Ok(None),
        };
    }
    let mut group_of = Vec::with_capacity(l.ids.len());
    for (p, &id) in l.ids.iter().enumerate() {
        group_of.push(routes.locate(id).ok_or_else(|| outside(p, id))?);
    }
    let first = group_of.first().copied();
    if group_of.iter().all(|&g| Some(g) == first) {
        return Ok(None);
    }
    Ok(Some(group_of))
}

/// Cuts a lookup into one lookup per replica group. Every part keeps all bags (empty where
/// the group holds none of a bag's ids) and pools partially (a mean becomes a sum); a gather part
/// remembers where its rows go.
fn split(l: &Lookup, shard_of: &[usize], shards: usize) -> Vec<(usize, Lookup, Vec<u32>)> {
    let mut slot = vec![usize::MAX; shards];
    let mut parts: Vec<(usize, Lookup, Vec<u32>)> = Vec::new();
    let op = match l.op {
        Op::Pool(p) => Op::Pool(p.partial()),
        Op::Gather => Op::Gather,
    };
    for &s in shard_of {
        if slot[s] == usize::MAX {
            slot[s] = parts.len();
            let offsets = if op == Op::Gather {
                Vec::new()
            } else {
                vec![0]
            };
            let weights = l.weights.as_ref().map(|_| Vec::new());
            let part = Lookup {
                table: l.table.clone(),
                op,
                ids: Vec::new(),
                offsets,
                weights,
            };
            parts.push((s, part, Vec::new()));
        }
    }
    let push = |parts: &mut Vec<(usize, Lookup, Vec<u32>)>, p: usize| {
        let (_, part, positions) = &mut parts[slot[shard_of[p]]];
        part.ids.push(l.ids[p]);
        if let (Some(w), Some(from)) = (part.weights.as_mut(), l.weights.as_ref()) {
            w.push(from[p]);
        }
        if op == Op::Gather {
            positions.push(p as u32);
        }
    };
    if op == Op::Gather {
        (0..l.ids.len()).for_each(|p| push(&mut parts, p));
    } else {
        for bag in l.offsets.windows(2) {
            (bag[0] as usize..bag[1] as usize).for_each(|p| push(&mut parts, p));
            for (_, part, _) in parts.iter_mut() {
                part.offsets.push(part.ids.len() as u32);
            }
        }
    }
    parts
}

pub(crate) fn sub_view<'a>(sub: &'a Sub, batch: &'a [Lookup]) -> LookupView<'a> {
    match sub {
        Sub::Whole(i) => batch[*i].view(),
        Sub::Part { lookup, .. } => lookup.view(),
    }
}

/// A lookup's result being assembled from shards' answers.
pub(crate) enum Merged {
    None,
    Done(Pooled),
    Pool(Pooled),
    Gather(Pooled),
}

impl Merged {
    pub(crate) fn add(&mut self, l: &Lookup, sub: &Sub, part: Pooled) -> Result<(), String> {
        let positions = match sub {
            Sub::Whole(_) => {
                *self = Merged::Done(part);
                return Ok(());
            }
            Sub::Part { positions, .. } => positions,
        };
        let dim = part.dim;
        let fresh = |rows| Pooled {
            rows,
            dim,
            values: vec![0.0; rows * dim],
            counts: Vec::new(),
        };
        if let Merged::None = self {
            *self = match l.op {
                Op::Gather => Merged::Gather(fresh(l.ids.len())),
                Op::Pool(_) => {
                    let mut acc = fresh(l.rows());
                    acc.counts = vec![0; l.rows()];
                    Merged::Pool(acc)
                }
            };
        }
        match (self, l.op) {
            (Merged::Pool(acc), Op::Pool(pooling)) => {
                if acc.dim != dim {
                    return Err(format!("shards disagree on the dim: {} and {dim}", acc.dim));
                }
                merge(
                    pooling,
                    dim,
                    &mut acc.values,
                    &mut acc.counts,
                    &part.values,
                    &part.counts,
                )
                .map_err(|e| e.to_string())
            }
            (Merged::Gather(acc), Op::Gather) => {
                if acc.dim != dim {
                    return Err(format!("shards disagree on the dim: {} and {dim}", acc.dim));
                }
                for (row, &p) in part.values.chunks_exact(dim.max(1)).zip(positions) {
                    let p = p as usize;
                    acc.values[p * dim..(p + 1) * dim].copy_from_slice(row);
                }
                Ok(())
            }
            _ => Err("a result arrived for a lookup already answered whole".to_owned()),
        }
    }

    pub(crate) fn finish(self, l: &Lookup) -> Option<Pooled> {
        match self {
            Merged::None => None,
            Merged::Done(p) | Merged::Gather(p) => Some(p),
            Merged::Pool(mut p) => {
                if let Op::Pool(pooling @ Pooling::Mean) = l.op {
                    finish(pooling, p.dim, &mut p.values, &p.counts);
                }
                Some(p)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_bags_and_positions() {
        let l = Lookup {
            table: "t".into(),
            op: Op::Pool(Pooling::Mean),
            ids: vec![1, 7, 2, 8, 9],
            offsets: vec![0, 2, 2, 5],
            weights: None,
        };
        // ids < 5 on shard 0, others on shard 2.
        let shard_of: Vec<usize> = l.ids.iter().map(|&i| if i < 5 { 0 } else { 2 }).collect();
        let parts = split(&l, &shard_of, 3);
        assert_eq!(parts.len(), 2);
        let (s0, p0, _) = &parts[0];
        let (s2, p2, _) = &parts[1];
        assert_eq!((*s0, *s2), (0, 2));
        assert_eq!(p0.op, Op::Pool(Pooling::Sum));
        assert_eq!(
            (p0.ids.clone(), p0.offsets.clone()),
            (vec![1, 2], vec![0, 1, 1, 2])
        );
        assert_eq!(
            (p2.ids.clone(), p2.offsets.clone()),
            (vec![7, 8, 9], vec![0, 1, 1, 3])
        );

        let g = Lookup {
            op: Op::Gather,
            offsets: vec![],
            ..l
        };
        let parts = split(&g, &shard_of, 3);
        assert_eq!(parts[0].2, vec![0, 2]);
        assert_eq!(parts[1].2, vec![1, 3, 4]);
    }

    #[test]
    fn merge_of_parts_matches_pooling_the_whole() {
        let l = Lookup {
            table: "t".into(),
            op: Op::Pool(Pooling::Max),
            ids: vec![0, 1, 2],
            offsets: vec![0, 2, 3, 3],
            weights: None,
        };
        let a = Pooled {
            rows: 3,
            dim: 1,
            values: vec![-5.0, 0.0, 0.0],
            counts: vec![1, 0, 0],
        };
        let b = Pooled {
            rows: 3,
            dim: 1,
            values: vec![-7.0, 4.0, 0.0],
            counts: vec![1, 1, 0],
        };
        let sub = Sub::Part {
            req: 0,
            lookup: l.clone(),
            positions: vec![],
        };
        let mut m = Merged::None;
        m.add(&l, &sub, a).unwrap();
        m.add(&l, &sub, b).unwrap();
        let out = m.finish(&l).unwrap();
        // -5 beats -7 and the empty shard's 0 does not win; an empty bag stays 0.
        assert_eq!(out.values, vec![-5.0, 4.0, 0.0]);
        assert_eq!(out.counts, vec![2, 1, 0]);
    }
}
