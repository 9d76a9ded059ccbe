//! Which version of a table's rows a request reads, as the cache keys it. Shards pick a
//! table's version by the request's `as_of` and the switch time T of its last update (as_of
//! < T: the version before; docs/tiers.md, "One version per request"). The router learns T
//! from the update itself: `cleave update` and `cleave stream` announce each switch to the
//! router's admin API (`POST /admin/v1/cache/switch`) *before* they send it to any shard, so
//! by the time a request as of ≥ T exists, the router keys it with a new epoch and none of the
//! entries read before can answer it. A request as of < T keeps the old epoch and reads what
//! the shards serve it, the old version. An announced switch that never happens (an aborted
//! update) only costs a cold table. Epochs are the router's own counter per table name, so a
//! table shared by several served versions (docs/repository.md) is switched for all of them.

use std::collections::HashMap;
use std::sync::Mutex;

/// How long after a switch a request as of before it can still arrive: the shard keeps the old
/// version that long (docs/tiers.md), and no budget is longer.
pub const OLD_VERSION_KEPT_US: u64 = 60_000_000;

#[derive(Default)]
pub struct Versions {
    /// Per table name: (switch time in Unix µs, epoch from then on), in switch order.
    switches: Mutex<HashMap<String, Vec<(u64, u64)>>>,
}

impl Versions {
    /// The epoch of `table` for a request as of `as_of_us` (0 before any switch).
    pub fn epoch(&self, table: &str, as_of_us: u64) -> u64 {
        let switches = self.switches.lock().unwrap_or_else(|p| p.into_inner());
        switches.get(table).map_or(0, |list| {
            list.iter()
                .rev()
                .find(|(at, _)| *at <= as_of_us)
                .map_or(0, |&(_, epoch)| epoch)
        })
    }

    /// Records a switch of `table` at `at_us` (0: now, `now_us`) and returns its epoch. A
    /// switch earlier than one already announced is refused: the shards keep only the newest.
    pub fn switch(&self, table: &str, at_us: u64, now_us: u64) -> Result<u64, String> {
        let at = if at_us == 0 { now_us } else { at_us };
        let mut switches = self.switches.lock().unwrap_or_else(|p| p.into_inner());
        let list = switches.entry(table.to_string()).or_default();
        let last = list.last().copied().unwrap_or((0, 0));
        if at < last.0 {
            return Err(format!(
                "table {table:?}: a switch at {at} µs is earlier than the one announced at {} µs",
                last.0
            ));
        }
        let epoch = last.1 + 1;
        // Switches no request can be as of before any more fold into one entry from time 0
        // (bounded history): an as_of before them reads the newest of them, never an older
        // epoch whose entries might still be held.
        let old = |t: u64| t.saturating_add(OLD_VERSION_KEPT_US) <= now_us;
        if let Some(floor) = list.iter().filter(|(t, _)| old(*t)).map(|&(_, e)| e).max() {
            list.retain(|&(t, _)| !old(t));
            list.insert(0, (0, floor));
        }
        list.push((at, epoch));
        Ok(epoch)
    }

    /// The oldest epoch of `table` a request arriving from `now_us` on can still read.
    pub fn oldest_live(&self, table: &str, now_us: u64) -> u64 {
        self.epoch(table, now_us.saturating_sub(OLD_VERSION_KEPT_US))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_reads_the_epoch_of_its_as_of() {
        let v = Versions::default();
        assert_eq!(v.epoch("t", 5), 0);
        assert_eq!(v.switch("t", 1_000, 10).unwrap(), 1);
        // Announced before T: requests before T keep epoch 0, from T on epoch 1.
        assert_eq!((v.epoch("t", 999), v.epoch("t", 1_000)), (0, 1));
        assert_eq!(v.epoch("other", 2_000), 0, "per table");
        assert_eq!(v.switch("t", 0, 3_000).unwrap(), 2, "0: now");
        assert_eq!(
            (v.epoch("t", 999), v.epoch("t", 2_999), v.epoch("t", 3_000)),
            (0, 1, 2)
        );
        assert!(v
            .switch("t", 2_000, 3_001)
            .unwrap_err()
            .contains("earlier than the one announced"));
    }

    #[test]
    fn old_switches_are_forgotten_once_no_request_can_read_before_them() {
        let v = Versions::default();
        v.switch("t", 1_000, 0).unwrap();
        v.switch("t", 2_000, 1_500).unwrap();
        let later = 2_000 + OLD_VERSION_KEPT_US + 1;
        assert_eq!(v.oldest_live("t", later), 2);
        v.switch("t", later, later).unwrap();
        assert_eq!(v.switches.lock().unwrap()["t"], [(0, 2), (later, 3)]);
        assert_eq!((v.epoch("t", 1_500), v.epoch("t", later)), (2, 3));
    }
}
