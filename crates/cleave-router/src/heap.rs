//! The router's live heap bytes: the allocator its binary installs (`Counting` around
//! mimalloc) adds what it hands out and subtracts what comes back, and `/metrics` reports the
//! difference (`cleave_router_heap_live_bytes`). RSS and private memory cannot tell a leak
//! from pages an allocator keeps for reuse; this can (docs/benchmarks.md, "What grows in the
//! router").

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

static LIVE: AtomicUsize = AtomicUsize::new(0);

/// `A`, counting the bytes it has handed out and not had back.
pub struct Counting<A>(pub A);

// SAFETY: every call goes to `A` unchanged; the counter is only arithmetic beside it.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { self.0.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Wrapping: the two updates may interleave with other threads' in either order.
            LIVE.fetch_add(new_size.wrapping_sub(layout.size()), Relaxed);
        }
        p
    }
}

/// Bytes allocated and not freed, when the process counts them (`Counting` installed as its
/// global allocator): the router's binary does, a test or an embedding process may not.
pub fn live_bytes() -> Option<usize> {
    match LIVE.load(Relaxed) {
        0 => None,
        n => Some(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;

    #[test]
    fn counts_what_is_held_through_alloc_realloc_and_free() {
        // The counter is the process's: this test's allocator is not installed, so only its
        // own calls move it.
        let heap = Counting(System);
        let before = LIVE.load(Relaxed);
        unsafe {
            let layout = Layout::from_size_align(100, 8).unwrap();
            let p = heap.alloc(layout);
            assert_eq!(LIVE.load(Relaxed) - before, 100);
            let p = heap.realloc(p, layout, 300);
            assert_eq!(LIVE.load(Relaxed) - before, 300);
            let bigger = Layout::from_size_align(300, 8).unwrap();
            let p = heap.realloc(p, bigger, 40);
            assert_eq!(LIVE.load(Relaxed) - before, 40);
            heap.dealloc(p, Layout::from_size_align(40, 8).unwrap());
            let z = heap.alloc_zeroed(layout);
            assert_eq!(LIVE.load(Relaxed) - before, 100);
            heap.dealloc(z, layout);
        }
        assert_eq!(LIVE.load(Relaxed), before);
    }
}
