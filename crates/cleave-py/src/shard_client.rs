//! `cleave._native.ShardClient`: lookups on embedding shards (crate cleave-shard) from Python,
//! routed by row range, fanned out, and merged in Rust with the GIL released.
//!
//! A request is a tuple `(table, pooling, ids, offsets)` or `(table, pooling, ids, offsets,
//! weights)`: `pooling` is "sum", "mean", "max" or "none" (a gather, `offsets` None), `ids` a
//! 1-D integer numpy array of global row ids, `offsets` bags + 1 integers (PyTorch's
//! `include_last_offset=True` form), `weights` float32 per id (sum only).

use cleave_shard::{ClientError, Lookup, Op, Route, RoutingTable, ShardClientConfig};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::wire::{duration, parse_address, runtime};

pyo3::create_exception!(
    _native,
    ShardError,
    PyException,
    "A shard failed, refused a lookup, or did not answer in time; the message names its address."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ShardError", m.py().get_type::<ShardError>())?;
    m.add_class::<ShardClient>()?;
    Ok(())
}

fn client_err(e: ClientError) -> PyErr {
    match e {
        ClientError::BadRequest(m) => PyValueError::new_err(m),
        other => ShardError::new_err(other.to_string()),
    }
}

/// Routes from `(table, row_start, row_end, address)` tuples or dicts with those keys
/// (`addr` also accepted, as in the router's config).
fn parse_routes(routes: &Bound<'_, PyAny>) -> PyResult<RoutingTable> {
    let mut out = Vec::new();
    for (i, r) in routes.try_iter()?.enumerate() {
        let r = r?;
        let (table, start, end, addr): (String, u64, u64, String) = if let Ok(d) =
            r.cast::<PyDict>()
        {
            let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
                d.get_item(k)?
                    .ok_or_else(|| PyValueError::new_err(format!("route {i}: missing key {k:?}")))
            };
            let addr = match d.get_item("address")? {
                Some(a) => a,
                None => get("addr")?,
            };
            (
                get("table")?.extract()?,
                get("row_start")?.extract()?,
                get("row_end")?.extract()?,
                addr.extract()?,
            )
        } else {
            r.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "route {i}: expected (table, row_start, row_end, address) or a dict, got {r}"
                ))
            })?
        };
        out.push(Route {
            table,
            rows: start..end,
            addr: parse_address(&addr)?,
        });
    }
    RoutingTable::new(out).map_err(PyValueError::new_err)
}

/// A 1-D integer array as i64, any integer dtype; anything else is a TypeError naming `what`.
fn ints(obj: &Bound<'_, PyAny>, what: &dyn Fn() -> String) -> PyResult<Vec<i64>> {
    macro_rules! try_dtype {
        ($($t:ty),*) => {$(
            if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, $t>>() {
                return a.as_array().iter().map(|&v| i64::try_from(v).map_err(|_| {
                    PyValueError::new_err(format!("{}: value {v} does not fit in int64", what()))
                })).collect();
            }
        )*};
    }
    try_dtype!(i64, i32, u32, i16, u16, i8, u8, u64);
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .extract()
            .map_err(|_| PyTypeError::new_err(format!("{}: a list of ints expected", what())));
    }
    Err(PyTypeError::new_err(format!(
        "{} must be a 1-D integer numpy array, got {}",
        what(),
        describe(obj)
    )))
}

fn floats(obj: &Bound<'_, PyAny>, what: &dyn Fn() -> String) -> PyResult<Vec<f32>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, f32>>() {
        return Ok(a.as_array().to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, f64>>() {
        return Ok(a.as_array().iter().map(|&v| v as f32).collect());
    }
    Err(PyTypeError::new_err(format!(
        "{} must be a 1-D float32 numpy array, got {}",
        what(),
        describe(obj)
    )))
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    if let Ok(a) = obj.cast::<PyUntypedArray>() {
        return format!("an array of {} with shape {:?}", a.dtype(), a.shape());
    }
    obj.get_type()
        .name()
        .map_or_else(|_| "an object".to_owned(), |n| n.to_string())
}

/// Requests in the tuple form of this module's doc.
pub(crate) fn parse_requests(requests: &Bound<'_, PyAny>) -> PyResult<Vec<Lookup>> {
    let mut out = Vec::new();
    for (i, r) in requests.try_iter()?.enumerate() {
        let r = r?;
        let t = r.cast::<PyTuple>().map_err(|_| {
            PyTypeError::new_err(format!(
                "request {i}: expected a tuple (table, pooling, ids, offsets[, weights])"
            ))
        })?;
        if !(4..=5).contains(&t.len()) {
            return Err(PyTypeError::new_err(format!(
                "request {i}: expected 4 or 5 items (table, pooling, ids, offsets[, weights]), got {}",
                t.len()
            )));
        }
        let table: String = t.get_item(0)?.extract()?;
        let op = Op::parse(&t.get_item(1)?.extract::<String>()?)
            .map_err(|e| PyValueError::new_err(format!("request {i} (table {table:?}): {e}")))?;
        let ids = ints(&t.get_item(2)?, &|| {
            format!("request {i} (table {table:?}): ids")
        })?;
        let offsets_obj = t.get_item(3)?;
        let offsets = if offsets_obj.is_none() {
            Vec::new()
        } else {
            let what = || format!("request {i} (table {table:?}): offsets");
            ints(&offsets_obj, &what)?
                .into_iter()
                .map(|o| {
                    u32::try_from(o).map_err(|_| {
                        PyValueError::new_err(format!("{}: {o} is not a valid offset", what()))
                    })
                })
                .collect::<PyResult<Vec<u32>>>()?
        };
        let weights = match t.get_item(4) {
            Ok(w) if !w.is_none() => Some(floats(&w, &|| {
                format!("request {i} (table {table:?}): weights")
            })?),
            _ => None,
        };
        if op != Op::Gather && offsets.is_empty() {
            return Err(PyValueError::new_err(format!(
                "request {i} (table {table:?}): pooling {} needs offsets (bags + 1 entries)",
                op.name()
            )));
        }
        out.push(Lookup {
            table,
            op,
            ids,
            offsets,
            weights,
        });
    }
    Ok(out)
}

/// Client of the shards of a routing table:
/// `ShardClient(routes, timeout_s=1.0, connect_timeout_s=1.0, connections=2)`.
#[pyclass(module = "cleave._native", frozen)]
pub struct ShardClient {
    rt: tokio::runtime::Runtime,
    client: cleave_shard::ShardClient,
}

#[pymethods]
impl ShardClient {
    #[new]
    #[pyo3(signature = (routes, timeout_s=1.0, connect_timeout_s=1.0, connections=2))]
    fn new(
        routes: &Bound<'_, PyAny>,
        timeout_s: f64,
        connect_timeout_s: f64,
        connections: usize,
    ) -> PyResult<ShardClient> {
        let routes = parse_routes(routes)?;
        let config = ShardClientConfig {
            timeout: duration(timeout_s, "timeout_s")?,
            connect_timeout: duration(connect_timeout_s, "connect_timeout_s")?,
            connections: connections.max(1),
            ..ShardClientConfig::default()
        };
        let client = cleave_shard::ShardClient::new(routes, &config)
            .map_err(|e| ShardError::new_err(format!("cannot start I/O threads: {e}")))?;
        Ok(ShardClient {
            rt: runtime()?,
            client,
        })
    }

    /// Looks up a batch; returns one float32 array per request: [bags, dim] pooled, or
    /// [len(ids), dim] for a gather. With `counts=True`, (values, counts) pairs instead.
    #[pyo3(signature = (requests, counts=false))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
        counts: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let batch = parse_requests(requests)?;
        let results = py
            .detach(|| self.rt.block_on(self.client.lookup(&batch)))
            .map_err(client_err)?;
        let arrays = results.into_iter().map(|p| -> PyResult<Bound<'py, PyAny>> {
            let values = PyArray1::from_vec(py, p.values)
                .reshape([p.rows, p.dim])?
                .into_any();
            if counts {
                Ok(
                    PyTuple::new(py, [values, PyArray1::from_vec(py, p.counts).into_any()])?
                        .into_any(),
                )
            } else {
                Ok(values)
            }
        });
        PyList::new(py, arrays.collect::<PyResult<Vec<_>>>()?)
    }

    /// Raises ShardError naming the first shard that is unreachable or not ready.
    fn ready(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.rt.block_on(self.client.ready()))
            .map_err(client_err)
    }

    /// Every shard address, each once.
    #[getter]
    fn shards(&self) -> Vec<String> {
        self.client
            .routes()
            .shards()
            .iter()
            .map(|a| a.to_string())
            .collect()
    }

    fn __repr__(&self) -> String {
        format!("ShardClient(shards={:?})", self.shards())
    }
}
