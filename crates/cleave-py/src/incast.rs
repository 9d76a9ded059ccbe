//! `cleave._native.IncastScheduler` and the control codec (`encode_control`, `decode_control`):
//! crate cleave-flow for the Python ranker, so the window, the queue policies and the codec
//! have one implementation (docs/traffic.md). Every call returns the decisions it allows now
//! as `[("grant" | "expired", sender, id), ...]`; the caller sends each to its sender.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use cleave_flow::adaptive::Sample;
use cleave_flow::control::{self, ControlMessage, ErrorCode};
use cleave_flow::{
    AdaptiveWindow as Adaptive, Grant, IncastScheduler as Scheduler, Order, Thresholds,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<IncastScheduler>()?;
    m.add_class::<AdaptiveWindow>()?;
    m.add_function(wrap_pyfunction!(encode_control, m)?)?;
    m.add_function(wrap_pyfunction!(decode_control, m)?)?;
    Ok(())
}

/// Nanoseconds on one monotonic clock: requests' deadlines and expiry both read it.
fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

type Decisions = Vec<(&'static str, u32, u64)>;

/// The ranker's incast window and queue. `window_bytes`: bytes granted and not yet received
/// at most (one message alone always goes); `order`: "fcfs" or "edf"; `link_bytes_per_s`: B
/// in EDF's start-by deadline d = now + SLO − M/B; `drop_expired`: a request whose start-by
/// deadline passed while it waited is answered "expired" instead of granted; `measure_rate`
/// (with `drop_expired`): B is learnt from granted messages' transfers once there is one.
#[pyclass(module = "cleave._native")]
pub struct IncastScheduler {
    inner: Mutex<(Scheduler, bool)>,
}

impl IncastScheduler {
    fn with<F: FnOnce(&mut Scheduler) -> Vec<Grant>>(&self, f: F) -> PyResult<Decisions> {
        let mut guard = self
            .inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("incast scheduler: a call panicked earlier"))?;
        let (scheduler, _) = &mut *guard;
        let grants = f(scheduler);
        let mut out: Decisions = grants.iter().map(|g| ("grant", g.sender, g.id)).collect();
        out.extend(
            scheduler
                .take_expired()
                .iter()
                .map(|p| ("expired", p.sender, p.id)),
        );
        Ok(out)
    }
}

#[pymethods]
impl IncastScheduler {
    #[new]
    #[pyo3(signature = (window_bytes, order="edf", link_bytes_per_s=125e6, drop_expired=true, measure_rate=false))]
    fn new(
        window_bytes: u64,
        order: &str,
        link_bytes_per_s: f64,
        drop_expired: bool,
        measure_rate: bool,
    ) -> PyResult<IncastScheduler> {
        let order: Order = order
            .parse()
            .map_err(|e: String| PyValueError::new_err(format!("order: {e}")))?;
        if window_bytes == 0 {
            return Err(PyValueError::new_err(
                "window_bytes must be at least 1, got 0",
            ));
        }
        if !(link_bytes_per_s.is_finite() && link_bytes_per_s > 0.0) {
            return Err(PyValueError::new_err(format!(
                "link_bytes_per_s must be a positive rate, got {link_bytes_per_s}"
            )));
        }
        let mut scheduler = Scheduler::new(window_bytes, order, link_bytes_per_s);
        if drop_expired {
            scheduler = scheduler.with_expiry(now_ns);
            if measure_rate {
                scheduler = scheduler.with_measured_rate();
            }
        }
        Ok(IncastScheduler {
            inner: Mutex::new((scheduler, drop_expired)),
        })
    }

    /// A request-to-send from `sender` for message `id` of `bytes`, with `slo_left_us` of its
    /// SLO left now.
    fn request(&self, sender: u32, id: u64, bytes: u64, slo_left_us: u64) -> PyResult<Decisions> {
        let now = now_ns();
        self.with(|s| s.request(sender, id, bytes, slo_left_us.saturating_mul(1000), now))
    }

    /// Every byte of message `id` from `sender` arrived; unknown ids change nothing.
    fn complete(&self, sender: u32, id: u64) -> PyResult<Decisions> {
        self.with(|s| s.complete(sender, id))
    }

    /// The sender will not send `id` (a `done` frame from it): out of the queue or the window.
    fn withdraw(&self, sender: u32, id: u64) -> PyResult<Decisions> {
        self.with(|s| s.withdraw(sender, id))
    }

    /// The sender's control connection went: its queued requests and in-flight bytes go.
    fn sender_gone(&self, sender: u32) -> PyResult<Decisions> {
        self.with(|s| s.sender_gone(sender))
    }

    /// A new window limit in bytes (at least 1).
    fn set_limit(&self, limit: u64) -> PyResult<Decisions> {
        self.with(|s| s.set_limit(limit))
    }

    /// Bytes granted and not yet received.
    #[getter]
    fn in_flight(&self) -> PyResult<u64> {
        self.with_ref(|s| s.window().in_flight())
    }

    #[getter]
    fn limit(&self) -> PyResult<u64> {
        self.with_ref(|s| s.window().limit())
    }

    /// B in the start-by deadline now, bytes/s (measured, or the configured link rate).
    #[getter]
    fn rate_bytes_per_s(&self) -> PyResult<f64> {
        self.with_ref(|s| s.rate_bytes_per_s())
    }

    /// Requests waiting for window space.
    #[getter]
    fn queued(&self) -> PyResult<usize> {
        self.with_ref(|s| s.queued())
    }

    #[getter]
    fn drop_expired(&self) -> PyResult<bool> {
        let guard = self
            .inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("incast scheduler: a call panicked earlier"))?;
        Ok(guard.1)
    }
}

impl IncastScheduler {
    fn with_ref<T, F: FnOnce(&Scheduler) -> T>(&self, f: F) -> PyResult<T> {
        let guard = self
            .inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("incast scheduler: a call panicked earlier"))?;
        Ok(f(&guard.0))
    }
}

/// The incast window that follows congestion (crate cleave-flow, docs/traffic.md "Which way
/// the window moves"): starts at `min_bytes`, halves (not below `min_bytes`) when out-of-order
/// segments per MiB received reach `high`, grows by `step_bytes` (not above `max_bytes`) after
/// `grow_after` intervals in a row with congestion at most `low`, requests waiting and the
/// link used below `target_utilization`.
#[pyclass(module = "cleave._native")]
pub struct AdaptiveWindow {
    inner: Mutex<Adaptive>,
}

#[pymethods]
impl AdaptiveWindow {
    #[new]
    #[pyo3(signature = (min_bytes, max_bytes, step_bytes, *, high=None, low=None, target_utilization=None, grow_after=None))]
    fn new(
        min_bytes: u64,
        max_bytes: u64,
        step_bytes: u64,
        high: Option<f64>,
        low: Option<f64>,
        target_utilization: Option<f64>,
        grow_after: Option<u32>,
    ) -> PyResult<AdaptiveWindow> {
        let d = Thresholds::default();
        let t = Thresholds {
            high: high.unwrap_or(d.high),
            low: low.unwrap_or(d.low),
            target_utilization: target_utilization.unwrap_or(d.target_utilization),
            grow_after: grow_after.unwrap_or(d.grow_after),
        };
        if min_bytes == 0 || step_bytes == 0 || max_bytes < min_bytes {
            return Err(PyValueError::new_err(format!(
                "expected 0 < min_bytes <= max_bytes and step_bytes > 0, got min {min_bytes}, \
                 max {max_bytes}, step {step_bytes}"
            )));
        }
        if !(t.low.is_finite() && t.high.is_finite() && 0.0 <= t.low && t.low < t.high) {
            return Err(PyValueError::new_err(format!(
                "expected thresholds 0 <= low < high, got low {}, high {}",
                t.low, t.high
            )));
        }
        Ok(AdaptiveWindow {
            inner: Mutex::new(Adaptive::new(min_bytes, max_bytes, step_bytes, t)),
        })
    }

    /// The window after one interval: `congestion` (out-of-order segments per MiB received),
    /// `utilization` (bytes received / what the link could carry), `backlog` (requests waited).
    fn observe(&self, congestion: f64, utilization: f64, backlog: bool) -> u64 {
        self.lock().observe(Sample {
            congestion,
            utilization,
            backlog,
        })
    }

    #[getter]
    fn limit(&self) -> u64 {
        self.lock().limit()
    }
}

impl AdaptiveWindow {
    fn lock(&self) -> std::sync::MutexGuard<'_, Adaptive> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn field(d: &Bound<'_, PyDict>, key: &str) -> PyResult<u64> {
    d.get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("control message needs {key:?}")))?
        .extract()
}

/// One control frame from a dict: `{"kind": "grant", "id": 5}`; kinds and fields as in
/// docs/traffic.md ("request-to-send": id, bytes, slo_left_us, stamp_ns; "grant", "done",
/// "expired": id; "credit": conn, bytes, stamp_ns; "error": code, message).
#[pyfunction]
fn encode_control<'py>(
    py: Python<'py>,
    message: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyBytes>> {
    let kind: String = message
        .get_item("kind")?
        .ok_or_else(|| PyValueError::new_err("control message needs \"kind\""))?
        .extract()?;
    let m = match kind.as_str() {
        "request-to-send" => ControlMessage::RequestToSend {
            id: field(message, "id")?,
            bytes: field(message, "bytes")?,
            slo_left_us: field(message, "slo_left_us")?,
            stamp_ns: field(message, "stamp_ns").unwrap_or(0),
        },
        "grant" => ControlMessage::Grant {
            id: field(message, "id")?,
        },
        "done" => ControlMessage::Done {
            id: field(message, "id")?,
        },
        "expired" => ControlMessage::Expired {
            id: field(message, "id")?,
        },
        "credit" => ControlMessage::Credit {
            conn: field(message, "conn")? as u32,
            bytes: field(message, "bytes")?,
            stamp_ns: field(message, "stamp_ns").unwrap_or(0),
        },
        "error" => {
            let code = match field(message, "code")? {
                1 => ErrorCode::Malformed,
                2 => ErrorCode::Oversized,
                3 => ErrorCode::Unexpected,
                _ => ErrorCode::Internal,
            };
            let text: String = message
                .get_item("message")?
                .map(|v| v.extract())
                .transpose()?
                .unwrap_or_default();
            ControlMessage::Error {
                code,
                message: text,
            }
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "control message kind: expected request-to-send, grant, done, expired, credit \
                 or error, got {other:?}"
            )))
        }
    };
    Ok(PyBytes::new(py, &m.encode()))
}

/// The first control frame of `buf`: `None` while it is incomplete, else `(message dict,
/// bytes it took)`. A malformed frame raises ValueError whose text is what the error frame
/// that answers it says (`control frame: grant needs a body of 8 bytes, got 4`).
#[pyfunction]
fn decode_control<'py>(
    py: Python<'py>,
    buf: &[u8],
) -> PyResult<Option<(Bound<'py, PyDict>, usize)>> {
    let Some((m, used)) = control::decode(buf).map_err(|e| PyValueError::new_err(e.to_string()))?
    else {
        return Ok(None);
    };
    let d = PyDict::new(py);
    match m {
        ControlMessage::RequestToSend {
            id,
            bytes,
            slo_left_us,
            stamp_ns,
        } => {
            d.set_item("kind", "request-to-send")?;
            d.set_item("id", id)?;
            d.set_item("bytes", bytes)?;
            d.set_item("slo_left_us", slo_left_us)?;
            d.set_item("stamp_ns", stamp_ns)?;
        }
        ControlMessage::Grant { id } => {
            d.set_item("kind", "grant")?;
            d.set_item("id", id)?;
        }
        ControlMessage::Done { id } => {
            d.set_item("kind", "done")?;
            d.set_item("id", id)?;
        }
        ControlMessage::Expired { id } => {
            d.set_item("kind", "expired")?;
            d.set_item("id", id)?;
        }
        ControlMessage::Credit {
            conn,
            bytes,
            stamp_ns,
        } => {
            d.set_item("kind", "credit")?;
            d.set_item("conn", conn)?;
            d.set_item("bytes", bytes)?;
            d.set_item("stamp_ns", stamp_ns)?;
        }
        ControlMessage::Error { code, message } => {
            d.set_item("kind", "error")?;
            d.set_item("code", code as u16)?;
            d.set_item("message", message)?;
        }
    }
    Ok(Some((d, used)))
}
