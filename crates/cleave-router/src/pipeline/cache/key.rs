//! What a cached result is keyed by. Exactness comes from the key holding everything the shard
//! computes from: the table (as one served version of the deployment sees it, `ns`), the
//! table's version at the request's `as_of` (`epoch`), and the item itself — a row's id, or a
//! bag's ids in their order, its per-sample weights (as bits) and the pooling mode. Unlike the
//! shard's pooled cache (an order-invariant multiset key, docs/tiers.md), a bag's order is part
//! of its key: a float sum's bits depend on the order it adds in, and a hit must return the
//! bytes the shards would.

use cleave_embed::Pooling;

/// One cached item.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Item {
    /// A gathered row.
    Row(i64),
    /// A pooled bag.
    Bag {
        pooling: u8,
        ids: Box<[i64]>,
        /// `f32::to_bits` of each weight (bit equality: NaN and -0.0 stay distinct).
        weights: Option<Box<[u32]>>,
    },
}

impl Item {
    pub fn bag(pooling: Pooling, ids: &[i64], weights: Option<&[f32]>) -> Item {
        Item::Bag {
            pooling: pooling_code(pooling),
            ids: ids.into(),
            weights: weights.map(|w| w.iter().map(|x| x.to_bits()).collect()),
        }
    }

    /// Bytes the key holds beyond its fixed part (counted against the cache's size).
    pub fn heap_bytes(&self) -> usize {
        match self {
            Item::Row(_) => 0,
            Item::Bag { ids, weights, .. } => {
                ids.len() * 8 + weights.as_ref().map_or(0, |w| w.len() * 4)
            }
        }
    }
}

fn pooling_code(p: Pooling) -> u8 {
    match p {
        Pooling::Sum => 0,
        Pooling::Mean => 1,
        Pooling::Max => 2,
    }
}

/// A cache key: which table of which served version, at which version of its rows, and what.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// The table as one `Shards` (one served model version) names it: see `EmbedCache::table`.
    pub table: u32,
    /// The table's row version for the request's `as_of` (versions.rs).
    pub epoch: u64,
    pub item: Item,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn bag_order_weights_and_pooling_are_part_of_the_key() {
        let k = |item| Key {
            table: 1,
            epoch: 0,
            item,
        };
        let a = k(Item::bag(Pooling::Sum, &[1, 2, 3], None));
        let mut seen = HashSet::new();
        for other in [
            k(Item::bag(Pooling::Sum, &[3, 2, 1], None)),
            k(Item::bag(Pooling::Mean, &[1, 2, 3], None)),
            k(Item::bag(Pooling::Sum, &[1, 2, 3], Some(&[1.0, 1.0, 1.0]))),
            k(Item::bag(Pooling::Sum, &[1, 2, 3], Some(&[1.0, 1.0, -0.0]))),
            k(Item::bag(Pooling::Sum, &[1, 2, 3], Some(&[1.0, 1.0, 0.0]))),
            Key {
                epoch: 1,
                ..a.clone()
            },
            Key {
                table: 2,
                ..a.clone()
            },
            k(Item::Row(1)),
        ] {
            assert_ne!(a, other);
            assert!(
                seen.insert(other),
                "keys must be distinct from each other too"
            );
        }
        assert_eq!(a, k(Item::bag(Pooling::Sum, &[1, 2, 3], None)));
        assert_eq!(a.item.heap_bytes(), 24);
    }
}
