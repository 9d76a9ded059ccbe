//! The internal data plane of Cleave: length-prefixed binary frames over TCP or Unix sockets.
//!
//! * [`frame`]: the 40-byte header (deadline and trace id included), kinds, flags (CANCEL),
//!   error codes and their classes, and an incremental decoder.
//! * [`Server`]: accepts connections, hands each to one of its I/O threads (which owns it for
//!   its life) and passes application frames to a [`Handler`]; control frames (PING, READY)
//!   are answered by the server, and control connections live on a thread of their own.
//! * [`Client`]: pipelined calls to one peer over a few data connections and one control
//!   connection, responses matched by request id.
//!
//! * [`shm`]: the shared-memory transport (`shm:/path`): memfd regions of bounded slots
//!   passed over the Unix socket, large payloads sent as slot references.
//! * [`queue`]: the order requests start in (FIFO, EDF), one file per policy.
//! * [`health`]: the readiness schema every role serves.
//! * [`log`]: the one log set-up of the executables (`tracing`, text or JSON lines).
//! * [`cpu`]: a thread's CPU time, and what one path of it costs.
//!
//! The layout, limits and timeouts are specified in docs/protocol.md.

mod addr;
pub mod auth;
pub mod balance;
mod client;
mod conn;
pub mod cpu;
mod credit;
mod error;
pub mod ewma;
pub mod frame;
pub mod health;
mod io;
pub mod log;
pub mod priority;
pub mod queue;
mod serve_conn;
mod server;
pub mod shm;
mod sockets;

pub use addr::Address;
pub use client::{Client, ClientConfig, ClientStats, Payload};
pub use credit::MAX_CREDIT_BALANCE;
pub use error::WireError;
pub use ewma::{Ewma, SURE_AFTER};
pub use frame::{ConnClass, Credit, ErrorBody, ErrorCode, Frame, FrameDecoder, FrameError, Header};
pub use io::IoThreads;
pub use queue::QueuePolicy;
pub use server::{unix_now_us, Handler, Request, Responder, Server, ServerConfig, ServerStats};
pub use shm::ShmConfig;
pub use sockets::mptcp_refused_by_kernel;
