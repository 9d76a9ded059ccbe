//! The range routing table (FlexEMR §3.1.2): per table, sorted row ranges and the shard that
//! holds each. Locating an id is a binary search over the range starts of its table.

use std::collections::HashMap;
use std::ops::Range;

use cleave_wire::Address;

/// Rows `rows` of `table` live on the shard at `addr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub table: String,
    pub rows: Range<u64>,
    pub addr: Address,
}

/// Which shard holds which rows. Ranges of a table may leave gaps (ids there are errors) but
/// may not overlap.
#[derive(Clone, Debug)]
pub struct RoutingTable {
    tables: HashMap<String, TableRoutes>,
    shards: Vec<Address>,
}

#[derive(Clone, Debug)]
pub(crate) struct TableRoutes {
    starts: Vec<u64>,
    ends: Vec<u64>,
    /// Index into `RoutingTable::shards`.
    shard: Vec<usize>,
}

impl TableRoutes {
    /// The shard holding `id`, if any.
    pub(crate) fn locate(&self, id: i64) -> Option<usize> {
        let id = u64::try_from(id).ok()?;
        let i = self.starts.partition_point(|&s| s <= id).checked_sub(1)?;
        (id < self.ends[i]).then(|| self.shard[i])
    }

    /// The only shard of this table, if it has one range.
    pub(crate) fn single(&self) -> Option<(usize, Range<u64>)> {
        (self.shard.len() == 1).then(|| (self.shard[0], self.starts[0]..self.ends[0]))
    }

    /// The shard of the first range (asked for results that need no rows, to learn the dim).
    pub(crate) fn first_shard(&self) -> usize {
        self.shard[0]
    }

    pub(crate) fn describe(&self, shards: &[Address]) -> String {
        let parts: Vec<String> = (0..self.shard.len())
            .map(|i| {
                format!(
                    "[{}, {}) at {}",
                    self.starts[i], self.ends[i], shards[self.shard[i]]
                )
            })
            .collect();
        parts.join(", ")
    }
}

impl RoutingTable {
    /// Builds the table; empty ranges are dropped, overlaps are an error naming both routes.
    pub fn new(routes: impl IntoIterator<Item = Route>) -> Result<RoutingTable, String> {
        let mut shards: Vec<Address> = Vec::new();
        let mut by_table: HashMap<String, Vec<(Range<u64>, usize)>> = HashMap::new();
        for r in routes {
            if r.rows.start > r.rows.end {
                return Err(format!(
                    "route for table {:?} at {}: row_start {} is after row_end {}",
                    r.table, r.addr, r.rows.start, r.rows.end
                ));
            }
            let shard = match shards.iter().position(|a| *a == r.addr) {
                Some(i) => i,
                None => {
                    shards.push(r.addr.clone());
                    shards.len() - 1
                }
            };
            let ranges = by_table.entry(r.table).or_default();
            if !r.rows.is_empty() {
                ranges.push((r.rows, shard));
            }
        }
        let mut tables = HashMap::new();
        for (table, mut ranges) in by_table {
            if ranges.is_empty() {
                continue;
            }
            ranges.sort_by_key(|(r, _)| r.start);
            for w in ranges.windows(2) {
                if w[1].0.start < w[0].0.end {
                    return Err(format!(
                        "routes for table {table:?} overlap: [{}, {}) at {} and [{}, {}) at {}",
                        w[0].0.start,
                        w[0].0.end,
                        shards[w[0].1],
                        w[1].0.start,
                        w[1].0.end,
                        shards[w[1].1]
                    ));
                }
            }
            let routes = TableRoutes {
                starts: ranges.iter().map(|(r, _)| r.start).collect(),
                ends: ranges.iter().map(|(r, _)| r.end).collect(),
                shard: ranges.iter().map(|(_, s)| *s).collect(),
            };
            tables.insert(table, routes);
        }
        Ok(RoutingTable { tables, shards })
    }

    /// Every shard address, each once; a route's shard index points here.
    pub fn shards(&self) -> &[Address] {
        &self.shards
    }

    /// The address of the shard holding row `id` of `table`.
    pub fn locate(&self, table: &str, id: i64) -> Option<&Address> {
        self.tables.get(table)?.locate(id).map(|s| &self.shards[s])
    }

    pub(crate) fn table(&self, name: &str) -> Option<&TableRoutes> {
        self.tables.get(name)
    }

    /// Names of the tables routed, sorted.
    pub fn table_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tables.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(t: &str, a: u64, b: u64, addr: &str) -> Route {
        Route {
            table: t.into(),
            rows: a..b,
            addr: addr.parse().unwrap(),
        }
    }

    #[test]
    fn locates_ids_at_range_boundaries_and_gaps() {
        let rt = RoutingTable::new([
            route("t", 10, 20, "h:2"),
            route("t", 0, 10, "h:1"),
            route("t", 25, 30, "h:1"),
            route("u", 0, 5, "h:3"),
            route("v", 3, 3, "h:3"),
        ])
        .unwrap();
        let at = |t, id| rt.locate(t, id).map(|a| a.to_string());
        assert_eq!(at("t", 0).as_deref(), Some("h:1"));
        assert_eq!(at("t", 9).as_deref(), Some("h:1"));
        assert_eq!(at("t", 10).as_deref(), Some("h:2"));
        assert_eq!(at("t", 19).as_deref(), Some("h:2"));
        assert_eq!(at("t", 20), None);
        assert_eq!(at("t", 24), None);
        assert_eq!(at("t", 25).as_deref(), Some("h:1"));
        assert_eq!(at("t", 30), None);
        assert_eq!(at("t", -1), None);
        assert_eq!(at("x", 0), None);
        assert_eq!(rt.shards().len(), 3);
        assert_eq!(rt.table_names(), ["t", "u"]);
    }

    #[test]
    fn refuses_overlaps_and_reversed_ranges() {
        let err =
            RoutingTable::new([route("t", 0, 10, "h:1"), route("t", 5, 15, "h:2")]).unwrap_err();
        assert!(
            err.contains("overlap: [0, 10) at h:1 and [5, 15) at h:2"),
            "{err}"
        );
        let err = RoutingTable::new([route("t", 9, 3, "h:1")]).unwrap_err();
        assert!(err.contains("row_start 9 is after row_end 3"), "{err}");
    }
}
