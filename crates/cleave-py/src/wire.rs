//! `cleave._native.FrameServer` and `FrameClient`: the internal data plane (crate cleave-wire)
//! for Python. A Python ranker serves frames with `FrameServer`: `recv` hands over requests
//! (GIL released while waiting), `reply` answers them from any thread, `cancelled` says which
//! of those handed over their callers gave up on. `FrameClient` makes calls (tests, tools).
//! Transport failures and error frames raise `cleave._native.WireError` with a message naming
//! the peer. The wire's error codes are module constants `ERR_<NAME>` and the dict
//! `ERROR_CODES` (name -> code); response credits' kind, HELLO option and limit are
//! `KIND_CREDIT`, `HELLO_CREDITS` and `MAX_CREDIT_BALANCE`.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_flow::tcp_info::receiver_stats;
use cleave_wire::{
    Address, Client, ClientConfig, ErrorCode, Handler, IoThreads, Request, Responder, Server,
    ServerConfig,
};
use numpy::ndarray::ArrayView1;
use numpy::npyffi::flags::NPY_ARRAY_WRITEABLE;
use numpy::{PyArray1, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

pyo3::create_exception!(
    _native,
    WireError,
    PyException,
    "A call over the internal protocol failed: connect, timeout, closed connection, or an \
     error frame from the peer. The message names the peer's address."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("WireError", m.py().get_type::<WireError>())?;
    m.add_class::<FrameServer>()?;
    m.add_class::<FrameClient>()?;
    let codes = PyDict::new(m.py());
    for code in ErrorCode::all() {
        let name = code.name();
        m.add(
            format!("ERR_{}", name.to_uppercase()).as_str(),
            code.to_u16(),
        )?;
        codes.set_item(name, code.to_u16())?;
    }
    m.add("ERROR_CODES", codes)?;
    m.add("KIND_CREDIT", cleave_wire::frame::kind::CREDIT)?;
    m.add("CONTROL_DSCP", cleave_wire::priority::CONTROL_DSCP)?;
    m.add("HELLO_CREDITS", cleave_wire::frame::hello_options::CREDITS)?;
    m.add("MAX_CREDIT_BALANCE", cleave_wire::MAX_CREDIT_BALANCE)?;
    m.add("SURE_AFTER", cleave_wire::SURE_AFTER)?;
    Ok(())
}

pub(crate) fn parse_address(address: &str) -> PyResult<Address> {
    address.parse().map_err(PyValueError::new_err)
}

pub(crate) fn duration(seconds: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("{what} must be > 0 seconds, got {seconds}")))
}

/// The bytes of a bytes-like object: `bytes` without a copy, `bytearray`, a C-contiguous
/// numpy array (any dtype, its raw memory) or anything `bytes()` accepts with one copy.
pub(crate) fn bytes_like(obj: &Bound<'_, PyAny>) -> PyResult<Bytes> {
    if let Ok(b) = obj.extract::<PyBackedBytes>() {
        return Ok(Bytes::from_owner(b));
    }
    if let Ok(a) = obj.cast::<PyUntypedArray>() {
        if !a.is_c_contiguous() {
            return Err(PyValueError::new_err(
                "payload array must be C-contiguous (use numpy.ascontiguousarray)",
            ));
        }
        let n = a.len() * a.dtype().itemsize();
        if n == 0 {
            return Ok(Bytes::new());
        }
        // SAFETY: a C-contiguous array's data pointer addresses `len * itemsize` bytes, alive
        // while we hold `a` (and the GIL) during this copy.
        let data = unsafe { std::slice::from_raw_parts((*a.as_array_ptr()).data as *const u8, n) };
        return Ok(Bytes::copy_from_slice(data));
    }
    // Anything else with the buffer protocol (memoryview, array.array, ...): one copy. Not
    // `bytes(obj)`, which would turn an int n into n zero bytes.
    let view = obj
        .py()
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,));
    match view.and_then(|v| v.call_method0("tobytes")) {
        Ok(b) => Ok(Bytes::from_owner(b.extract::<PyBackedBytes>()?)),
        Err(_) => Err(PyTypeError::new_err(format!(
            "payload must be bytes, bytearray, memoryview or a numpy array, got {}",
            obj.get_type().name()?
        ))),
    }
}

/// One request waiting for Python.
struct Item {
    conn_id: u64,
    request_id: u64,
    kind: u16,
    payload: Bytes,
    deadline_us: u64,
    trace_id: u64,
    /// When the I/O thread put it here: `recv` counts how long it waited for Python.
    queued_at: Instant,
}

/// Requests handed from the I/O threads to Python, and the responders for their replies.
#[derive(Default)]
struct Inbox {
    items: Mutex<VecDeque<Item>>,
    arrived: Condvar,
    responders: Mutex<HashMap<(u64, u64), Responder>>,
    /// Requests handed to Python whose callers have cancelled them since the last look.
    cancelled: Mutex<Vec<(u64, u64)>>,
    /// Requests `recv` handed out, and their waits here summed (ns): the pickup, what a
    /// request waits for a Python thread busy elsewhere (a batch), whatever the transport.
    picked_up: AtomicU64,
    pickup_ns: AtomicU64,
}

impl Handler for Inbox {
    fn handle(&self, request: Request, responder: Responder) {
        let key = (request.conn_id, request.request_id);
        {
            let mut responders = self.responders.lock().unwrap_or_else(|e| e.into_inner());
            if responders.contains_key(&key) {
                drop(responders);
                let msg = format!(
                    "request id {} is already in flight on this connection",
                    key.1
                );
                return responder.error(ErrorCode::BadRequest, &msg);
            }
            responders.insert(key, responder);
        }
        let item = Item {
            conn_id: request.conn_id,
            request_id: request.request_id,
            kind: request.kind,
            payload: request.payload,
            deadline_us: request.deadline_unix_us,
            trace_id: request.trace_id,
            queued_at: Instant::now(),
        };
        self.items
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(item);
        self.arrived.notify_one();
    }

    /// Still queued: dropped here, Python never sees it. Handed out: Python learns it from
    /// `FrameServer.cancelled()`. Either way the server sends no reply for it.
    fn cancelled(&self, conn_id: u64, request_id: u64) {
        let key = (conn_id, request_id);
        let queued = {
            let mut q = self.items.lock().unwrap_or_else(|e| e.into_inner());
            let at = q.iter().position(|it| (it.conn_id, it.request_id) == key);
            at.and_then(|i| q.remove(i)).is_some()
        };
        let mut responders = self.responders.lock().unwrap_or_else(|e| e.into_inner());
        if queued {
            responders.remove(&key);
        } else if responders.contains_key(&key) {
            drop(responders);
            self.cancelled
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(key);
        }
    }
}

/// The owner of a payload handed to Python in place: the base object of its numpy array.
/// On `shm:` the payload is a slot of the peer's shared-memory region, freed when this drops
/// (when the array and every tensor made from it are gone); elsewhere it is the frame's buffer.
#[pyclass(module = "cleave._native", frozen)]
struct PayloadOwner {
    payload: Bytes,
}

/// `payload` as a read-only uint8 numpy array over its own memory, no copy. The array's base
/// is a `PayloadOwner`, so the memory lives as long as anything Python made from it.
fn in_place<'py>(py: Python<'py>, payload: Bytes) -> PyResult<Bound<'py, PyAny>> {
    let owner = Bound::new(py, PayloadOwner { payload })?;
    let bytes: &[u8] = &owner.get().payload;
    let view = ArrayView1::from(bytes);
    // SAFETY: `owner` becomes the array's base and is frozen: its `Bytes` is never replaced
    // or mutated, and a `Bytes`' memory does not move while it lives.
    let array = unsafe { PyArray1::<u8>::borrow_from_array(&view, owner.clone().into_any()) };
    // SAFETY: the array was just made and no reference into it exists yet. Read-only: the
    // memory is the peer's slot (or a frame shared with nothing else), never written here.
    unsafe { (*array.as_array_ptr()).flags &= !NPY_ARRAY_WRITEABLE };
    Ok(array.into_any())
}

/// Serves frames to Python code.
///
/// `FrameServer(address, *, io_threads=1, max_payload=64 MiB, frame_timeout_s=10.0)` binds
/// `host:port` (port 0 picks one), `mptcp:host:port`, `unix:/path` or `shm:/path`; `address`
/// is the bound address. On `shm:` `recv` hands payloads over in place (read-only uint8 numpy
/// arrays over the shared-memory slot: the ranker decodes its tensors from the slot itself);
/// on every other transport as `bytes`, as before.
#[pyclass(module = "cleave._native", frozen)]
pub struct FrameServer {
    inbox: Arc<Inbox>,
    server: Mutex<Option<Server>>,
    address: String,
    /// Whether `recv` hands payloads over in place (the server listens on `shm:`).
    in_place: bool,
}

#[pymethods]
impl FrameServer {
    #[new]
    #[pyo3(signature = (address, *, io_threads=1, max_payload=64 << 20, frame_timeout_s=10.0))]
    fn new(
        py: Python<'_>,
        address: &str,
        io_threads: usize,
        max_payload: u32,
        frame_timeout_s: f64,
    ) -> PyResult<FrameServer> {
        let addr = parse_address(address)?;
        let config = ServerConfig {
            io_threads,
            max_payload,
            frame_timeout: duration(frame_timeout_s, "frame_timeout_s")?,
            ..ServerConfig::default()
        };
        let inbox = Arc::new(Inbox::default());
        let handler = inbox.clone();
        let server = py
            .detach(|| Server::bind(&addr, handler, config))
            .map_err(|e| WireError::new_err(format!("cannot listen on {address}: {e}")))?;
        let address = server.local_addr().to_string();
        Ok(FrameServer {
            inbox,
            server: Mutex::new(Some(server)),
            address,
            in_place: matches!(addr, Address::Shm(_)),
        })
    }

    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// Waits up to `timeout_s` (forever if None) for requests and returns up to `max_items`
    /// of them as `(conn_id, request_id, kind, payload, deadline_us, trace_id, waited_ns)`
    /// (`waited_ns`: how long it waited here for a `recv`, the pickup; `payload`:
    /// `bytes`, or on `shm:` a read-only uint8 numpy array over the slot, which stays taken
    /// while the array or a tensor over it lives)
    /// (`deadline_us`: Unix µs, 0 = none; `trace_id`: 0 = none); empty on timeout. Requests
    /// cancelled while queued are not returned.
    #[pyo3(signature = (max_items=64, timeout_s=None))]
    fn recv<'py>(
        &self,
        py: Python<'py>,
        max_items: usize,
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let timeout =
            timeout_s.map(|t| Duration::try_from_secs_f64(t.max(0.0)).unwrap_or(Duration::MAX));
        let items: Vec<Item> = py.detach(|| {
            let mut q = self.inbox.items.lock().unwrap_or_else(|e| e.into_inner());
            q = match timeout {
                None => self
                    .inbox
                    .arrived
                    .wait_while(q, |q| q.is_empty())
                    .unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    self.inbox
                        .arrived
                        .wait_timeout_while(q, t, |q| q.is_empty())
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
            let n = q.len().min(max_items.max(1));
            q.drain(..n).collect()
        });
        let now = Instant::now();
        let waits: Vec<u64> = items
            .iter()
            .map(|it| (now - it.queued_at).as_nanos() as u64)
            .collect();
        let inbox = &self.inbox;
        inbox
            .picked_up
            .fetch_add(items.len() as u64, Ordering::Relaxed);
        inbox
            .pickup_ns
            .fetch_add(waits.iter().sum::<u64>(), Ordering::Relaxed);
        let tuples = items.into_iter().zip(waits).map(|(it, waited_ns)| {
            let payload = if self.in_place {
                in_place(py, it.payload)?
            } else {
                PyBytes::new(py, &it.payload).into_any()
            };
            PyTuple::new(
                py,
                [
                    it.conn_id.into_pyobject(py)?.into_any(),
                    it.request_id.into_pyobject(py)?.into_any(),
                    it.kind.into_pyobject(py)?.into_any(),
                    payload,
                    it.deadline_us.into_pyobject(py)?.into_any(),
                    it.trace_id.into_pyobject(py)?.into_any(),
                    waited_ns.into_pyobject(py)?.into_any(),
                ],
            )
        });
        PyList::new(py, tuples.collect::<PyResult<Vec<_>>>()?)
    }

    /// Answers request `request_id` of connection `conn_id` with `payload` (bytes-like).
    /// `kind` must be the request's kind. A reply to a connection that has closed is dropped.
    fn reply(
        &self,
        conn_id: u64,
        request_id: u64,
        kind: u16,
        payload: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let responder = self.take(conn_id, request_id)?;
        if responder.kind() != kind {
            let expected = responder.kind();
            self.put_back(conn_id, request_id, responder);
            return Err(PyValueError::new_err(format!(
                "reply kind {kind:#06x} for request {request_id} of kind {expected:#06x}; a reply \
                 carries its request's kind"
            )));
        }
        let payload = match bytes_like(payload) {
            Ok(p) => p,
            Err(e) => {
                self.put_back(conn_id, request_id, responder);
                return Err(e);
            }
        };
        responder.reply(payload);
        Ok(())
    }

    /// Answers a request with an error frame: `code` (see docs/protocol.md) and a message.
    fn reply_error(&self, conn_id: u64, request_id: u64, code: u16, message: &str) -> PyResult<()> {
        self.take(conn_id, request_id)?
            .error(ErrorCode::from_u16(code), message);
        Ok(())
    }

    /// `[(conn_id, request_id)]` of requests returned by `recv` whose callers have cancelled
    /// them since the last call: drop them if not started. A reply to one is accepted and not
    /// sent (the caller has forgotten it), so every received request still gets one reply.
    fn cancelled(&self) -> Vec<(u64, u64)> {
        std::mem::take(
            &mut *self
                .inbox
                .cancelled
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Counts of the server: `{"connections", "cancelled", "expired", "responses_held",
    /// "credit_expired", "migrations", "picked_up", "pickup_seconds"}` (held and
    /// credit_expired: docs/protocol.md, "Response credits"; migrations: docs/serving.md, "I/O
    /// threads"; cancelled: CANCEL frames that found their request unanswered; expired:
    /// requests answered `deadline` on arrival, never returned by `recv`; picked_up: requests
    /// `recv` returned, pickup_seconds: their waits summed, from the I/O thread queueing one
    /// to `recv` taking it).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let inbox = &self.inbox;
        d.set_item("picked_up", inbox.picked_up.load(Ordering::Relaxed))?;
        let pickup_ns = inbox.pickup_ns.load(Ordering::Relaxed);
        d.set_item("pickup_seconds", pickup_ns as f64 / 1e9)?;
        let guard = self.server.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = guard.as_ref() {
            let s = server.stats();
            d.set_item("connections", s.connections())?;
            d.set_item("cancelled", s.cancelled())?;
            d.set_item("expired", s.expired())?;
            d.set_item("responses_held", s.responses_held())?;
            d.set_item("credit_expired", s.credit_expired())?;
            d.set_item("migrations", s.migrations())?;
        }
        Ok(d)
    }

    /// `[(conn_id, out_of_order_segments, bytes_received)]`: the kernel's counters (TCP_INFO)
    /// of each live TCP data connection, cumulative since it opened; what the ranker's
    /// adaptive incast window reads (docs/traffic.md). Empty once closed.
    fn receiver_stats(&self) -> Vec<(u64, u32, u64)> {
        let mut out = Vec::new();
        let guard = self.server.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = guard.as_ref() {
            server.for_each_data_socket(|id, fd| {
                // A socket that closes meanwhile has no counters left to read: skipped.
                if let Ok(s) = receiver_stats(fd.as_raw_fd()) {
                    out.push((id, s.rcv_ooopack, s.bytes_received));
                }
            });
        }
        out
    }

    /// Requests received and not answered yet.
    fn pending(&self) -> usize {
        self.inbox
            .responders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Stops accepting, waits for connections to finish (requests still unanswered get an
    /// `internal` error), and closes. Idempotent.
    fn close(&self, py: Python<'_>) {
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(server) = server {
            server.shutdown();
            // Unanswered requests would hold the drain up to its timeout: answer them now.
            self.inbox
                .responders
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
            py.detach(|| server.join());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "FrameServer({:?}, pending={})",
            self.address,
            self.pending()
        )
    }
}

impl FrameServer {
    fn take(&self, conn_id: u64, request_id: u64) -> PyResult<Responder> {
        self.inbox
            .responders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(conn_id, request_id))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "no request {request_id} of connection {conn_id} is waiting for a reply \
                     (already answered, or never received)"
                ))
            })
    }

    fn put_back(&self, conn_id: u64, request_id: u64, responder: Responder) {
        let mut r = self
            .inbox
            .responders
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.insert((conn_id, request_id), responder);
    }
}

/// Calls a frame server: `FrameClient(address, timeout_s=5.0, connections=1)`.
#[pyclass(module = "cleave._native", frozen)]
pub struct FrameClient {
    rt: tokio::runtime::Runtime,
    client: Client,
    timeout: Duration,
}

#[pymethods]
impl FrameClient {
    #[new]
    #[pyo3(signature = (address, timeout_s=5.0, connections=1))]
    fn new(address: &str, timeout_s: f64, connections: usize) -> PyResult<FrameClient> {
        let addr = parse_address(address)?;
        let timeout = duration(timeout_s, "timeout_s")?;
        let io = IoThreads::new("cleave-frame-client", 1)
            .map_err(|e| WireError::new_err(e.to_string()))?;
        let config = ClientConfig {
            connections,
            connect_timeout: timeout,
            ..ClientConfig::default()
        };
        let rt = runtime()?;
        Ok(FrameClient {
            rt,
            client: Client::new(addr, io, config),
            timeout,
        })
    }

    /// Sends a request of `kind` and returns the response payload as bytes. Its deadline on
    /// the wire is now + the timeout; `trace_id` (0: none) travels in the header.
    #[pyo3(signature = (kind, payload, timeout_s=None, trace_id=0))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        kind: u16,
        payload: &Bound<'py, PyAny>,
        timeout_s: Option<f64>,
        trace_id: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let payload = bytes_like(payload)?;
        let timeout = timeout_s.map_or(Ok(self.timeout), |t| duration(t, "timeout_s"))?;
        let call = self.client.call_traced(kind, payload, timeout, trace_id);
        let reply = py
            .detach(|| self.rt.block_on(call))
            .map_err(|e| WireError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &reply))
    }

    /// `{"orphan_responses", "cancels_sent"}` so far (docs/protocol.md, "CANCEL").
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.client.stats();
        let d = PyDict::new(py);
        d.set_item("orphan_responses", s.orphan_responses)?;
        d.set_item("cancels_sent", s.cancels_sent)?;
        Ok(d)
    }

    /// PING over the control connection.
    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.rt.block_on(self.client.ping(self.timeout)))
            .map_err(|e| WireError::new_err(e.to_string()))
    }

    /// READY over the control connection.
    fn ready(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.rt.block_on(self.client.ready(self.timeout)))
            .map_err(|e| WireError::new_err(e.to_string()))
    }

    fn __repr__(&self) -> String {
        format!("FrameClient({:?})", self.client.addr().to_string())
    }
}

/// The runtime a blocking Python call waits on: timers run on its one worker, the call's future
/// on the calling thread.
pub(crate) fn runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("cleave-py-rt")
        .enable_all()
        .build()
        .map_err(|e| WireError::new_err(format!("cannot start a runtime: {e}")))
}
