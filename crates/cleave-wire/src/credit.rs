//! Response credits (docs/protocol.md, "Response credits"): a client that opened a data
//! connection with the HELLO option CREDITS grants it response bytes with CREDIT frames on a
//! control connection; the server writes a response on that connection only when its credit
//! covers the payload, holding it (in arrival order) until then, or until the request's
//! deadline, when it becomes a `deadline` error frame instead.
//!
//! Error frames and control replies need no credit: they are small, and a held error would
//! turn a refusal into a hang.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::frame::{kind, Credit, ErrorCode, Frame};

/// The largest credit balance a connection may hold (1 TiB): a grant past it is refused as
/// overflowing, so that a runaway client cannot wrap the counter.
pub const MAX_CREDIT_BALANCE: u64 = 1 << 40;

/// One data connection's credit, shared by its I/O thread (which spends it) and the control
/// thread (which adds grants).
#[derive(Debug, Default)]
pub(crate) struct ConnCredit {
    balance: AtomicU64,
    /// Wakes the connection's loop when a grant arrives.
    pub(crate) granted: Notify,
}

impl ConnCredit {
    /// Adds `bytes`; refuses (returning the balance) a grant that would pass the maximum.
    fn grant(&self, bytes: u64) -> Result<(), u64> {
        self.balance
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                b.checked_add(bytes).filter(|&n| n <= MAX_CREDIT_BALANCE)
            })
            .map(|_| self.granted.notify_one())
    }

    /// Spends `bytes` if the balance covers them.
    fn take(&self, bytes: u64) -> bool {
        self.balance
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                b.checked_sub(bytes)
            })
            .is_ok()
    }
}

/// The credit of every data connection that asked for credits, by connection id.
#[derive(Debug, Default)]
pub(crate) struct CreditTable {
    conns: Mutex<HashMap<u64, Arc<ConnCredit>>>,
}

/// Keeps a connection in its table; removes it when dropped (the connection ended).
pub(crate) struct Registration {
    table: Arc<CreditTable>,
    conn_id: u64,
    pub(crate) credit: Arc<ConnCredit>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.table.lock().remove(&self.conn_id);
    }
}

impl CreditTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnCredit>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers data connection `conn_id` with no credit.
    pub(crate) fn register(self: &Arc<Self>, conn_id: u64) -> Registration {
        let credit = Arc::new(ConnCredit::default());
        self.lock().insert(conn_id, credit.clone());
        Registration {
            table: self.clone(),
            conn_id,
            credit,
        }
    }

    /// Applies a CREDIT payload; the error code and message of its error frame otherwise.
    pub(crate) fn apply(&self, payload: &[u8]) -> Result<(), (ErrorCode, String)> {
        let c = Credit::decode(payload).map_err(|m| (ErrorCode::BadRequest, m))?;
        let Some(conn) = self.lock().get(&c.conn_id).cloned() else {
            return Err((
                ErrorCode::NotFound,
                format!(
                    "CREDIT names data connection {}, which this server does not have open with \
                     credits (closed, never opened, or opened without the CREDITS option)",
                    c.conn_id
                ),
            ));
        };
        conn.grant(c.grant).map_err(|balance| {
            (
                ErrorCode::OutOfRange,
                format!(
                    "CREDIT of {} bytes for connection {} overflows: its balance is {balance} \
                     bytes and may not pass {MAX_CREDIT_BALANCE}",
                    c.grant, c.conn_id
                ),
            )
        })
    }
}

/// The replies of one credit-controlled connection that wait for credit, oldest first.
pub(crate) struct HeldReplies {
    credit: Arc<ConnCredit>,
    held: VecDeque<Frame>,
}

/// The credit a reply needs: the payload of an application response; none for the rest.
pub(crate) fn cost(f: &Frame) -> Option<u64> {
    (f.is_response() && !f.is_error() && !kind::is_control(f.kind))
        .then_some(f.payload.len() as u64)
}

impl HeldReplies {
    pub(crate) fn new(credit: Arc<ConnCredit>) -> HeldReplies {
        HeldReplies {
            credit,
            held: VecDeque::new(),
        }
    }

    /// The frame to write now, or `None` when it is held: a reply that needs credit waits
    /// behind those already held, so that a large one is not starved by small ones.
    pub(crate) fn offer(&mut self, f: Frame) -> Option<Frame> {
        match cost(&f) {
            Some(n) if !self.held.is_empty() || !self.credit.take(n) => {
                self.held.push_back(f);
                None
            }
            _ => Some(f),
        }
    }

    /// The held replies the credit now covers, in order.
    pub(crate) fn release(&mut self) -> Vec<Frame> {
        let mut out = Vec::new();
        while let Some(f) = self.held.front() {
            if !self.credit.take(cost(f).unwrap_or(0)) {
                break;
            }
            out.extend(self.held.pop_front());
        }
        out
    }

    /// Replaces the held replies whose deadline passed by `deadline` error frames (which need
    /// no credit), then whatever the credit now covers.
    pub(crate) fn expire(&mut self, now_unix_us: u64) -> Vec<Frame> {
        let mut out = Vec::new();
        self.held.retain(|f| {
            let late = f.deadline_unix_us != 0 && f.deadline_unix_us <= now_unix_us;
            if late {
                let msg = format!(
                    "deadline passed while the response ({} bytes) waited for credit from the \
                     caller; dropped",
                    f.payload.len()
                );
                out.push(
                    Frame::error(f.kind, f.request_id, ErrorCode::Deadline, &msg)
                        .with_context(f.deadline_unix_us, f.trace_id),
                );
            }
            !late
        });
        out.extend(self.release());
        out
    }

    /// Drops the held reply to `request_id` (its caller cancelled it); whether one was held.
    pub(crate) fn remove(&mut self, request_id: u64) -> bool {
        let before = self.held.len();
        self.held.retain(|f| f.request_id != request_id);
        self.held.len() != before
    }

    /// The earliest deadline of a held reply (Unix µs), if any has one.
    pub(crate) fn next_deadline(&self) -> Option<u64> {
        self.held
            .iter()
            .map(|f| f.deadline_unix_us)
            .filter(|&d| d != 0)
            .min()
    }

    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;

    /// A CREDIT frame's payload of `bytes` for connection `conn_id`, applied to `table`.
    fn grant(table: &CreditTable, conn_id: u64, bytes: u64) -> Result<(), (ErrorCode, String)> {
        table.apply(
            &Credit {
                conn_id,
                grant: bytes,
            }
            .encode(),
        )
    }

    fn reply(id: u64, len: usize) -> Frame {
        Frame::response(kind::FIRST_APP, id, Bytes::from(vec![0u8; len]))
    }

    #[test]
    fn held_until_credit_then_in_order() {
        let table = Arc::new(CreditTable::default());
        let reg = table.register(7);
        let mut held = HeldReplies::new(reg.credit.clone());
        assert!(held.offer(reply(1, 10)).is_none());
        assert!(held.offer(reply(2, 1)).is_none()); // behind the first, though it is small
        let err = Frame::error(kind::FIRST_APP, 3, ErrorCode::NotFound, "x");
        assert!(held.offer(err).is_some()); // errors need no credit
        grant(&table, 7, 10).unwrap();
        let out: Vec<u64> = held.release().iter().map(|f| f.request_id).collect();
        assert_eq!(out, [1]);
        grant(&table, 7, 1).unwrap();
        assert_eq!(held.release()[0].request_id, 2);
        assert_eq!(held.len(), 0);
    }

    #[test]
    fn malformed_unknown_and_overflowing_credits_are_refused() {
        let table = Arc::new(CreditTable::default());
        let reg = table.register(1);
        let (code, msg) = table.apply(&[0; 15]).unwrap_err();
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(msg.contains("16 bytes") && msg.contains("got 15"), "{msg}");
        let (code, _) = grant(&table, 2, 1).unwrap_err();
        assert_eq!(code, ErrorCode::NotFound);
        grant(&table, 1, MAX_CREDIT_BALANCE).unwrap();
        let (code, msg) = grant(&table, 1, 1).unwrap_err();
        assert_eq!(code, ErrorCode::OutOfRange);
        assert!(msg.contains("overflows"), "{msg}");
        let (code, _) = grant(&table, 1, u64::MAX).unwrap_err();
        assert_eq!(code, ErrorCode::OutOfRange);
        drop(reg);
        let (code, _) = grant(&table, 1, 1).unwrap_err();
        assert_eq!(code, ErrorCode::NotFound); // gone with its connection
    }

    #[test]
    fn late_held_replies_become_deadline_errors() {
        let table = Arc::new(CreditTable::default());
        let reg = table.register(1);
        let mut held = HeldReplies::new(reg.credit.clone());
        assert!(held.offer(reply(1, 5).with_context(100, 9)).is_none());
        assert!(held.offer(reply(2, 5).with_context(300, 9)).is_none());
        assert_eq!(held.next_deadline(), Some(100));
        let out = held.expire(200);
        assert_eq!(out.len(), 1);
        assert!(out[0].is_error() && out[0].request_id == 1 && out[0].trace_id == 9);
        assert_eq!(held.next_deadline(), Some(300));
        assert!(held.remove(2));
        assert_eq!(held.len(), 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Grant(u64),
        Reply(usize),
        Expire(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..5_000).prop_map(Op::Grant),
            (0usize..3_000).prop_map(Op::Reply),
            (0u64..50).prop_map(Op::Expire),
        ]
    }

    proptest! {
        /// Response bytes written never exceed bytes granted, whatever the interleaving; and
        /// every reply comes out once (as itself or as a deadline error) or stays held.
        #[test]
        fn bytes_sent_never_exceed_bytes_granted(ops in proptest::collection::vec(op(), 1..60)) {
            let table = Arc::new(CreditTable::default());
            let reg = table.register(1);
            let mut held = HeldReplies::new(reg.credit.clone());
            let (mut granted, mut sent, mut offered, mut out_count) = (0u64, 0u64, 0usize, 0usize);
            let mut seen = std::collections::HashSet::new();
            let mut account = |frames: Vec<Frame>, sent: &mut u64| {
                for f in frames {
                    *sent += cost(&f).unwrap_or(0);
                    assert!(seen.insert(f.request_id), "request {} out twice", f.request_id);
                    out_count += 1;
                }
            };
            for (i, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Grant(n) => {
                        table.apply(&Credit { conn_id: 1, grant: n }.encode()).unwrap();
                        granted += n;
                        account(held.release(), &mut sent);
                    }
                    Op::Reply(len) => {
                        offered += 1;
                        let f = reply(i as u64, len).with_context(i as u64 + 20, 0);
                        account(held.offer(f).into_iter().collect(), &mut sent);
                    }
                    Op::Expire(t) => account(held.expire(t), &mut sent),
                }
                prop_assert!(sent <= granted, "sent {sent} > granted {granted}");
            }
            prop_assert_eq!(out_count + held.len(), offered);
        }
    }
}
