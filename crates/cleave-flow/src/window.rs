//! The incast window: bytes granted and not yet received. A grant is given only while it keeps
//! the bytes in flight within the limit, with one exception: when nothing is in flight, one
//! message is admitted whatever its size, or a message larger than the window would wait
//! forever.

#[derive(Debug, Clone)]
pub struct IncastWindow {
    limit: u64,
    in_flight: u64,
    messages: usize,
}

impl IncastWindow {
    /// `limit` in bytes; `u64::MAX` is no control (every request granted at once).
    pub fn new(limit: u64) -> IncastWindow {
        IncastWindow {
            limit: limit.max(1),
            in_flight: 0,
            messages: 0,
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    pub fn messages_in_flight(&self) -> usize {
        self.messages
    }

    /// Whether `bytes` more may be granted now.
    pub fn fits(&self, bytes: u64) -> bool {
        self.messages == 0 || self.in_flight.saturating_add(bytes) <= self.limit
    }

    /// Take the space of a grant; the caller checked `fits`.
    pub fn admit(&mut self, bytes: u64) {
        debug_assert!(self.fits(bytes));
        self.in_flight = self.in_flight.saturating_add(bytes);
        self.messages += 1;
    }

    /// A granted message has fully arrived (or its sender went away).
    pub fn release(&mut self, bytes: u64) {
        self.in_flight = self.in_flight.saturating_sub(bytes);
        self.messages = self.messages.saturating_sub(1);
    }

    /// A new limit; what is in flight stays, and a smaller limit takes effect as it drains.
    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit.max(1);
    }
}
