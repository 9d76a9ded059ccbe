//! The incast queue: requests the window delays, in the order of a policy. One file per
//! policy; adding a policy is adding a file and a variant of `Order`.

mod edf;
mod fcfs;

pub use edf::{start_by_ns, Edf};
pub use fcfs::Fcfs;

/// A delayed request-to-send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub id: u64,
    /// Which sender (control connection) asked; its grant goes there.
    pub sender: u32,
    pub bytes: u64,
    /// Prism's deadline: the latest time to start sending (now + SLO − M/B), in ns.
    pub start_by_ns: u64,
    /// Arrival order, given by the scheduler: ties and FCFS use it.
    pub seq: u64,
}

/// A queue policy: which delayed request the window admits next.
pub trait IncastQueue: Send {
    fn push(&mut self, request: Pending);
    /// The request that goes next, without taking it.
    fn peek(&self) -> Option<&Pending>;
    fn pop(&mut self) -> Option<Pending>;
    /// Take out a request (its sender went away); whether it was there.
    fn remove(&mut self, id: u64, sender: u32) -> bool;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    Fcfs,
    Edf,
}

impl Order {
    pub fn queue(self) -> Box<dyn IncastQueue> {
        match self {
            Order::Fcfs => Box::new(Fcfs::default()),
            Order::Edf => Box::new(Edf::default()),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Order::Fcfs => "fcfs",
            Order::Edf => "edf",
        }
    }
}

impl std::str::FromStr for Order {
    type Err = String;
    fn from_str(s: &str) -> Result<Order, String> {
        match s {
            "fcfs" => Ok(Order::Fcfs),
            "edf" => Ok(Order::Edf),
            other => Err(format!("expected fcfs or edf, got {other:?}")),
        }
    }
}
