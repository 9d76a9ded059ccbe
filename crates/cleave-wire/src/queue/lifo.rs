//! Last in, first out: the newest request starts first. Under overload the oldest requests are
//! the likeliest to be late already; serving the newest keeps some requests in time instead of
//! making every one of them late ("adaptive LIFO", Facebook's "Fail at Scale"). Not for a
//! server that is not overloaded: an old request waits as long as newer ones keep coming.

use super::{Queued, RequestQueue};

#[derive(Debug)]
pub struct Lifo<T>(Vec<T>);

impl<T> Default for Lifo<T> {
    fn default() -> Lifo<T> {
        Lifo(Vec::new())
    }
}

impl<T: Queued + Send> RequestQueue<T> for Lifo<T> {
    fn push(&mut self, item: T) {
        self.0.push(item);
    }

    fn pop(&mut self) -> Option<T> {
        self.0.pop()
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::QueuePolicy;
    use super::*;

    struct Item(usize);

    impl Queued for Item {
        fn deadline_unix_us(&self) -> u64 {
            0
        }
    }

    #[test]
    fn the_newest_request_starts_first() {
        let mut q = "lifo".parse::<QueuePolicy>().unwrap().queue();
        for id in 0..4 {
            q.push(Item(id));
        }
        assert_eq!(q.pop().map(|i| i.0), Some(3));
        q.push(Item(4));
        let rest: Vec<usize> = std::iter::from_fn(|| q.pop()).map(|i| i.0).collect();
        assert_eq!(rest, [4, 2, 1, 0]);
        assert!(q.is_empty());
    }
}
