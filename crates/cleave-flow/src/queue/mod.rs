//! The incast queue: requests the window delays, in the order of a policy. One file per
//! policy; adding a policy is adding a file and a variant of `Order`. The names are the queue
//! policies' of python/cleave/settings/choices.py ("fcfs" is the older name of "fifo").

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
    /// First come, first served: named "fifo" (alias "fcfs").
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

    pub const ALL: [Order; 2] = [Order::Fcfs, Order::Edf];

    pub fn name(self) -> &'static str {
        match self {
            Order::Fcfs => "fifo",
            Order::Edf => "edf",
        }
    }
}

/// A name, or the alias "fcfs" for "fifo".
impl std::str::FromStr for Order {
    type Err = String;
    fn from_str(s: &str) -> Result<Order, String> {
        let name = if s == "fcfs" { "fifo" } else { s };
        Order::ALL
            .into_iter()
            .find(|o| o.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Order::ALL.iter().map(|o| o.name()).collect();
                format!("expected one of {}, got {s:?}", names.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::Order;

    /// The names are python/cleave/settings/choices.py's INCAST_ORDERS (through the generated
    /// settings.json: `python -m cleave.settings --write`).
    #[test]
    fn names_are_the_settings_schemas() {
        let text = include_str!("../../../../deploy/helm/cleave/files/settings.json");
        let settings: serde_json::Value = serde_json::from_str(text).unwrap();
        let listed = &settings["choices"]["incast_order"];
        let names: Vec<&str> = Order::ALL.iter().map(|o| o.name()).collect();
        assert_eq!(listed["names"], serde_json::json!(names));
        assert_eq!(listed["aliases"], serde_json::json!({"fcfs": "fifo"}));
        assert_eq!("fcfs".parse::<Order>(), Ok(Order::Fcfs));
        assert_eq!("fifo".parse::<Order>(), Ok(Order::Fcfs));
        let e = "random".parse::<Order>().unwrap_err();
        assert_eq!(e, "expected one of fifo, edf, got \"random\"");
    }
}
