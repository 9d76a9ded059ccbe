//! The range routing table (FlexEMR §3.1.2): per table, sorted row ranges and the replica
//! group that holds each. Locating an id is a binary search over the range starts of its table.
//!
//! Several addresses holding *identical* ranges of a table are replicas of those rows; ranges
//! held by the same set of addresses form one replica group, which the client sends one frame
//! to (through one of its replicas). Ranges that overlap without being identical are an error.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use cleave_wire::Address;

/// Rows `rows` of `table` live on the shard at `addr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub table: String,
    pub rows: Range<u64>,
    pub addr: Address,
}

/// Which shards hold which rows. Ranges of a table may leave gaps (ids there are errors);
/// they may repeat (replicas) but not partially overlap.
#[derive(Clone, Debug)]
pub struct RoutingTable {
    tables: HashMap<String, TableRoutes>,
    shards: Vec<Address>,
    /// Per replica group, indices into `shards`, sorted.
    groups: Vec<Vec<usize>>,
    /// The non-empty routes given, deduplicated, for describing and rebuilding the table.
    routes: Vec<Route>,
}

#[derive(Clone, Debug)]
pub(crate) struct TableRoutes {
    starts: Vec<u64>,
    ends: Vec<u64>,
    /// Index into `RoutingTable::groups`.
    group: Vec<usize>,
}

impl TableRoutes {
    /// The replica group holding `id`, if any.
    pub(crate) fn locate(&self, id: i64) -> Option<usize> {
        let id = u64::try_from(id).ok()?;
        let i = self.starts.partition_point(|&s| s <= id).checked_sub(1)?;
        (id < self.ends[i]).then(|| self.group[i])
    }

    /// The only group of this table, if it has one range.
    pub(crate) fn single(&self) -> Option<(usize, Range<u64>)> {
        (self.group.len() == 1).then(|| (self.group[0], self.starts[0]..self.ends[0]))
    }

    /// The group of the first range (asked for results that need no rows, to learn the dim).
    pub(crate) fn first_group(&self) -> usize {
        self.group[0]
    }

    pub(crate) fn describe(&self, table: &RoutingTable) -> String {
        let parts: Vec<String> = (0..self.group.len())
            .map(|i| {
                format!(
                    "[{}, {}) at {}",
                    self.starts[i],
                    self.ends[i],
                    table.group_addrs(self.group[i])
                )
            })
            .collect();
        parts.join(", ")
    }
}

impl RoutingTable {
    /// Builds the table; empty ranges are dropped, a repeated route counts once, partial
    /// overlaps are an error naming both routes and the rows they share.
    pub fn new(routes: impl IntoIterator<Item = Route>) -> Result<RoutingTable, String> {
        let mut shards: Vec<Address> = Vec::new();
        let mut kept: Vec<Route> = Vec::new();
        // table → (start, end) → replica addresses (indices into `shards`).
        let mut by_table: BTreeMap<String, BTreeMap<(u64, u64), Vec<usize>>> = BTreeMap::new();
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
            let ranges = by_table.entry(r.table.clone()).or_default();
            if r.rows.is_empty() {
                continue;
            }
            let replicas = ranges.entry((r.rows.start, r.rows.end)).or_default();
            if !replicas.contains(&shard) {
                replicas.push(shard);
                kept.push(r);
            }
        }
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut tables = HashMap::new();
        for (table, ranges) in by_table {
            if ranges.is_empty() {
                continue;
            }
            // BTreeMap order: by start, then end; distinct ranges must not overlap.
            let ranges: Vec<((u64, u64), Vec<usize>)> = ranges.into_iter().collect();
            for w in ranges.windows(2) {
                let ((a0, a1), ra) = &w[0];
                let ((b0, b1), rb) = &w[1];
                if *b0 < *a1 {
                    return Err(format!(
                        "routes for table {table:?} overlap without being replicas: [{a0}, {a1}) \
                         at {} and [{b0}, {b1}) at {} share rows [{b0}, {}); replicas must hold \
                         identical ranges",
                        shards[ra[0]],
                        shards[rb[0]],
                        a1.min(b1)
                    ));
                }
            }
            let mut group = Vec::with_capacity(ranges.len());
            for (_, mut replicas) in ranges.iter().cloned() {
                replicas.sort_unstable();
                let g = match groups.iter().position(|g| *g == replicas) {
                    Some(g) => g,
                    None => {
                        groups.push(replicas);
                        groups.len() - 1
                    }
                };
                group.push(g);
            }
            let routes = TableRoutes {
                starts: ranges.iter().map(|((s, _), _)| *s).collect(),
                ends: ranges.iter().map(|((_, e), _)| *e).collect(),
                group,
            };
            tables.insert(table, routes);
        }
        Ok(RoutingTable {
            tables,
            shards,
            groups,
            routes: kept,
        })
    }

    /// Every shard address, each once; a group's replica index points here.
    pub fn shards(&self) -> &[Address] {
        &self.shards
    }

    /// Per replica group, the indices of its replicas in [`shards`](Self::shards).
    pub fn groups(&self) -> &[Vec<usize>] {
        &self.groups
    }

    /// The routes the table was built from (non-empty, each once).
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// The (table, rows) a shard holds, sorted.
    pub fn ranges_of(&self, addr: &Address) -> Vec<(String, Range<u64>)> {
        let mut v: Vec<(String, Range<u64>)> = self
            .routes
            .iter()
            .filter(|r| r.addr == *addr)
            .map(|r| (r.table.clone(), r.rows.clone()))
            .collect();
        v.sort_by(|a, b| (&a.0, a.1.start).cmp(&(&b.0, b.1.start)));
        v
    }

    /// The (table, rows) every replica of group `g` holds, sorted.
    pub fn group_ranges(&self, g: usize) -> Vec<(String, Range<u64>)> {
        self.ranges_of(&self.shards[self.groups[g][0]])
            .into_iter()
            .filter(|(t, rows)| {
                self.tables
                    .get(t)
                    .and_then(|tr| tr.locate(rows.start as i64))
                    == Some(g)
            })
            .collect()
    }

    /// "table t rows [0, 10), table u rows [0, 5)": what group `g` holds, for errors.
    pub fn describe_group(&self, g: usize) -> String {
        let parts: Vec<String> = self
            .group_ranges(g)
            .iter()
            .map(|(t, r)| format!("table {t:?} rows [{}, {})", r.start, r.end))
            .collect();
        parts.join(", ")
    }

    /// "h:1|h:2": the replicas of group `g`.
    pub fn group_addrs(&self, g: usize) -> String {
        let addrs: Vec<String> = self.groups[g]
            .iter()
            .map(|&s| self.shards[s].to_string())
            .collect();
        addrs.join("|")
    }

    /// The address of the first replica holding row `id` of `table`.
    pub fn locate(&self, table: &str, id: i64) -> Option<&Address> {
        let g = self.tables.get(table)?.locate(id)?;
        Some(&self.shards[self.groups[g][0]])
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
    fn refuses_partial_overlaps_and_reversed_ranges() {
        let err =
            RoutingTable::new([route("t", 0, 10, "h:1"), route("t", 5, 15, "h:2")]).unwrap_err();
        assert!(
            err.contains("[0, 10) at h:1 and [5, 15) at h:2 share rows [5, 10)"),
            "{err}"
        );
        let err = RoutingTable::new([
            route("t", 0, 10, "h:1"),
            route("t", 0, 10, "h:2"),
            route("t", 0, 4, "h:3"),
        ])
        .unwrap_err();
        assert!(err.contains("share rows [0, 4)"), "{err}");
        let err = RoutingTable::new([route("t", 9, 3, "h:1")]).unwrap_err();
        assert!(err.contains("row_start 9 is after row_end 3"), "{err}");
    }

    #[test]
    fn identical_ranges_form_replica_groups() {
        let rt = RoutingTable::new([
            route("t", 0, 10, "h:1"),
            route("u", 0, 5, "h:1"),
            route("t", 0, 10, "h:2"),
            route("u", 0, 5, "h:2"),
            route("t", 0, 10, "h:2"), // a repeat counts once
            route("t", 10, 20, "h:3"),
        ])
        .unwrap();
        assert_eq!(rt.shards().len(), 3);
        assert_eq!(rt.groups(), [vec![0, 1], vec![2]]);
        assert_eq!(rt.routes().len(), 5);
        assert_eq!(
            rt.describe_group(0),
            "table \"t\" rows [0, 10), table \"u\" rows [0, 5)"
        );
        assert_eq!(rt.group_addrs(0), "h:1|h:2");
        assert_eq!(
            rt.locate("t", 3).map(|a| a.to_string()).as_deref(),
            Some("h:1")
        );
        assert_eq!(
            rt.locate("t", 13).map(|a| a.to_string()).as_deref(),
            Some("h:3")
        );
    }

    proptest::proptest! {
        /// Cutting [0, n) anywhere and giving every piece to k replicas routes every row to a
        /// group that holds it, and each piece forms exactly one group of k.
        #[test]
        fn replicated_cuts_route_every_row(
            cuts in proptest::collection::btree_set(1u64..100, 0..6),
            k in 1usize..4,
        ) {
            let mut bounds: Vec<u64> = vec![0];
            bounds.extend(cuts.iter().copied());
            bounds.push(100);
            let mut routes = Vec::new();
            for (p, w) in bounds.windows(2).enumerate() {
                for r in 0..k {
                    routes.push(route("t", w[0], w[1], &format!("h:{}", p * 10 + r + 1)));
                }
            }
            let rt = RoutingTable::new(routes).unwrap();
            proptest::prop_assert_eq!(rt.groups().len(), bounds.len() - 1);
            proptest::prop_assert!(rt.groups().iter().all(|g| g.len() == k));
            let t = rt.table("t").unwrap();
            for id in 0..100i64 {
                let g = t.locate(id).unwrap();
                let piece = bounds.windows(2).position(|w| (w[0]..w[1]).contains(&(id as u64)));
                let held = rt.group_ranges(g);
                proptest::prop_assert_eq!(held.len(), 1);
                let want = piece.map(|p| bounds[p]..bounds[p + 1]);
                proptest::prop_assert_eq!(Some(held[0].1.clone()), want);
            }
            proptest::prop_assert_eq!(t.locate(100), None);
        }
    }
}
