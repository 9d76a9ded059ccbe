//! Incast control at the ranker (docs/traffic.md): before a sender moves a payload to a ranker
//! it asks on a control connection (`control`), the ranker grants within an incast window of
//! bytes in flight (`window`), requests the window delays wait in a queue whose order is a
//! policy (`queue`: FCFS or EDF by Prism's start-by deadline), and the window follows
//! congestion read from the receiving sockets' TCP_INFO (`adaptive`, `tcp_info`).

pub mod adaptive;
pub mod control;
pub mod error;
pub mod queue;
pub mod scheduler;
pub mod tcp_info;
pub mod window;

pub use adaptive::{AdaptiveWindow, Thresholds};
pub use control::{ControlMessage, ErrorCode};
pub use error::ControlError;
pub use queue::{IncastQueue, Order, Pending};
pub use scheduler::{Grant, IncastScheduler};
pub use window::IncastWindow;
