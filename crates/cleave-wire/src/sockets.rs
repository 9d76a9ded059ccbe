//! The server's TCP data connections, listed for readers of their kernel counters (TCP_INFO:
//! the ranker's adaptive incast window, docs/traffic.md). Each entry holds a duplicate of its
//! connection's descriptor, so a listed descriptor is always that connection's socket, never
//! a number the kernel has since given to another file.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use crate::addr::Stream;

#[derive(Default)]
pub(crate) struct DataSockets(Mutex<HashMap<u64, OwnedFd>>);

/// A connection's place in the list, removed when dropped (the connection ended).
pub(crate) struct Listed {
    sockets: Arc<DataSockets>,
    conn_id: u64,
}

impl DataSockets {
    /// Lists a TCP connection; Unix sockets have no TCP counters, and a failed `dup` (out of
    /// descriptors) only leaves this connection out of the counts.
    pub(crate) fn list(self: &Arc<Self>, conn_id: u64, stream: &Stream) -> Option<Listed> {
        let Stream::Tcp(tcp) = stream else {
            return None;
        };
        let fd = tcp.as_fd().try_clone_to_owned().ok()?;
        self.lock().insert(conn_id, fd);
        Some(Listed {
            sockets: self.clone(),
            conn_id,
        })
    }

    /// Calls `f` with each listed connection's id and socket.
    pub(crate) fn for_each(&self, mut f: impl FnMut(u64, BorrowedFd<'_>)) {
        for (id, fd) in self.lock().iter() {
            f(*id, fd.as_fd());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, OwnedFd>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.sockets.lock().remove(&self.conn_id);
    }
}
