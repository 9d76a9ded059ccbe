//! Belady's optimal offline policy (evict the row whose next use is furthest away, and do not
//! cache a row whose next use is later than every cached row's): the hit rate no online
//! policy can beat on a trace, which `cleave bench tier` reports next to the row cache's.

use std::collections::BinaryHeap;

use super::IdMap;

/// Hit rate of Belady's policy with `capacity` rows on `trace` (row keys in access order),
/// counted over the accesses from position `start` on (the earlier ones warm the cache).
pub fn belady_hit_rate(trace: &[u64], capacity: usize, start: usize) -> f64 {
    if trace.len() <= start || capacity == 0 {
        return 0.0;
    }
    // next[i]: position of the next access to trace[i] (usize::MAX if none).
    let mut next = vec![usize::MAX; trace.len()];
    let mut seen: IdMap<u64, usize> = IdMap::default();
    for (i, &key) in trace.iter().enumerate().rev() {
        if let Some(&later) = seen.get(&key) {
            next[i] = later;
        }
        seen.insert(key, i);
    }
    // Cached keys with their next use; the heap holds (next use, key) with stale entries
    // skipped lazily.
    let mut cached: IdMap<u64, usize> = IdMap::default();
    let mut heap: BinaryHeap<(usize, u64)> = BinaryHeap::new();
    let mut hits = 0usize;
    for (i, &key) in trace.iter().enumerate() {
        if let Some(n) = cached.get_mut(&key) {
            hits += usize::from(i >= start);
            *n = next[i];
            heap.push((next[i], key));
            continue;
        }
        if next[i] == usize::MAX {
            continue; // never used again: caching it cannot help
        }
        if cached.len() >= capacity {
            // The furthest next use among the cached rows (skipping stale heap entries).
            let furthest = loop {
                match heap.peek() {
                    Some(&(n, k)) if cached.get(&k) == Some(&n) => break Some((n, k)),
                    Some(_) => {
                        heap.pop();
                    }
                    None => break None,
                }
            };
            match furthest {
                Some((n, _)) if n < next[i] => continue, // bypass: the new row is used later
                Some((_, k)) => {
                    heap.pop();
                    cached.remove(&k);
                }
                None => {}
            }
        }
        cached.insert(key, next[i]);
        heap.push((next[i], key));
    }
    hits as f64 / (trace.len() - start) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn belady_matches_hand_computed_cases() {
        // Capacity 2 on a b c a b: a, b cached; c bypassed (used never again); a, b hit.
        assert_eq!(belady_hit_rate(&[1, 2, 3, 1, 2], 2, 0), 2.0 / 5.0);
        // The same, counted from position 3 on: both remaining accesses hit.
        assert_eq!(belady_hit_rate(&[1, 2, 3, 1, 2], 2, 3), 1.0);
        // Capacity 1 on a b a b: keep a, bypass b (b's next use is later): one hit.
        assert_eq!(belady_hit_rate(&[1, 2, 1, 2], 1, 0), 1.0 / 4.0);
        assert_eq!(belady_hit_rate(&[7; 10], 1, 0), 0.9);
        assert_eq!(belady_hit_rate(&[], 4, 0), 0.0);
    }
}
