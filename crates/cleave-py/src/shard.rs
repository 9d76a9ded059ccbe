//! `cleave._native.run_shard`: an embedding shard process (crate cleave-shard) run from
//! `cleave shard`; `encode_lookups` (LOOKUP payloads for tests and tools); and
//! `bench_shard_load`, the load generator of `cleave bench shard`.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use cleave_shard::message::encode_request;
use cleave_shard::{bench, Lookup, RowSpec, Shard, ShardConfig, ShardInfo};
use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::shard_client::parse_requests;
use crate::wire::{duration, parse_address};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_shard, m)?)?;
    m.add_function(wrap_pyfunction!(encode_lookups, m)?)?;
    m.add_function(wrap_pyfunction!(bench_shard_load, m)?)?;
    Ok(())
}

fn info_dict<'py>(py: Python<'py>, info: &ShardInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("address", info.listen.to_string())?;
    d.set_item("metrics", info.metrics.map(|m| format!("http://{m}")))?;
    let tables: Vec<(String, u64, u64)> = info
        .tables
        .iter()
        .map(|(n, r)| (n.clone(), r.start, r.end))
        .collect();
    d.set_item("tables", tables)?;
    d.set_item("line", info.to_string())?;
    Ok(d)
}

/// Serves lookups on `listen` for the tables of `bundle` until SIGTERM or SIGINT, then
/// finishes the requests in flight and returns whether all drained in time. Blocks with the
/// GIL released. `rows`: "START:END" or "NAME=START:END,...". `on_ready(info)` is called once
/// the tables are mapped, with a dict: address, metrics (URL or None), tables
/// [(name, start, end)], line (the text after "ready "). A bad argument raises ValueError; a
/// shard that cannot start (bundle, address) raises RuntimeError.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // Python keyword arguments
#[pyo3(signature = (bundle, listen, *, tables=None, rows=None, metrics_port=None, threads=1,
                    io_threads=1, frame_timeout_s=10.0, resident=false, on_ready=None))]
fn run_shard(
    py: Python<'_>,
    bundle: PathBuf,
    listen: &str,
    tables: Option<Vec<String>>,
    rows: Option<&str>,
    metrics_port: Option<u16>,
    threads: usize,
    io_threads: usize,
    frame_timeout_s: f64,
    resident: bool,
    on_ready: Option<Py<PyAny>>,
) -> PyResult<bool> {
    if threads == 0 || io_threads == 0 {
        return Err(PyValueError::new_err(format!(
            "threads and io_threads must be at least 1, got {threads} and {io_threads}"
        )));
    }
    let mut config = ShardConfig::new(bundle, parse_address(listen)?);
    config.tables = tables;
    config.rows = rows
        .map(RowSpec::parse)
        .transpose()
        .map_err(PyValueError::new_err)?
        .unwrap_or_default();
    config.metrics_port = metrics_port;
    config.threads = threads;
    config.io_threads = io_threads;
    config.frame_timeout = duration(frame_timeout_s, "frame_timeout_s")?;
    config.resident = resident;
    let mut callback_error = None;
    let result = py.detach(|| {
        Shard::run_until_signal(&config, |info| {
            if let Some(f) = &on_ready {
                Python::attach(|py| {
                    if let Err(e) = info_dict(py, info).and_then(|d| f.call1(py, (d,))) {
                        callback_error = Some(e);
                    }
                });
            }
        })
    });
    // The stopping SIGINT also reached Python's own handler: it has been dealt with.
    if let Err(e) = py.check_signals() {
        if !e.is_instance_of::<PyKeyboardInterrupt>(py) {
            return Err(e);
        }
    }
    if let Some(e) = callback_error {
        return Err(e);
    }
    result.map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The LOOKUP payload (frame kind 0x0100) for `requests` (ShardClient.lookup's form).
#[pyfunction]
fn encode_lookups<'py>(
    py: Python<'py>,
    requests: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let batch = parse_requests(requests)?;
    let payload = encode_request(batch.iter().map(Lookup::view));
    Ok(PyBytes::new(py, &payload))
}

/// Drives the shard at `address` with `batches` (each a list of requests in ShardClient.lookup's
/// form, cycled). `mode` "open": Poisson arrivals at `rate` per second for `duration_s`, over
/// `connections`; "closed": `window` requests outstanding per connection. Returns a dict of
/// counts, rates and latency quantiles (µs). Blocks with the GIL released.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // Python keyword arguments
#[pyo3(signature = (address, batches, *, mode="open", rate=0.0, duration_s=1.0, connections=1,
                    window=1, timeout_s=1.0))]
fn bench_shard_load<'py>(
    py: Python<'py>,
    address: &str,
    batches: Vec<Bound<'py, PyAny>>,
    mode: &str,
    rate: f64,
    duration_s: f64,
    connections: usize,
    window: usize,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyDict>> {
    let addr = parse_address(address)?;
    let payloads: Vec<Bytes> = batches
        .iter()
        .map(|b| parse_requests(b).map(|l| encode_request(l.iter().map(Lookup::view))))
        .collect::<PyResult<_>>()?;
    let run: Duration = duration(duration_s, "duration_s")?;
    let timeout = duration(timeout_s, "timeout_s")?;
    let report = match mode {
        "open" => {
            py.detach(|| bench::run_open_loop(&addr, &payloads, rate, run, connections, timeout))
        }
        "closed" => {
            py.detach(|| bench::run_closed_loop(&addr, &payloads, run, connections, window))
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "mode must be \"open\" or \"closed\", got {other:?}"
            )))
        }
    }
    .map_err(|e| PyRuntimeError::new_err(format!("load on {address} failed: {e}")))?;
    let d = PyDict::new(py);
    d.set_item("offered_rps", report.offered_rps)?;
    d.set_item("achieved_rps", report.achieved_rps())?;
    d.set_item("sent", report.sent)?;
    d.set_item("completed", report.completed)?;
    d.set_item("errors", report.errors)?;
    d.set_item("lost", report.lost)?;
    d.set_item("elapsed_s", report.elapsed_s)?;
    let quantiles = [
        ("p50", 0.5),
        ("p90", 0.9),
        ("p99", 0.99),
        ("p999", 0.999),
        ("max", 1.0),
    ];
    for (name, q) in quantiles {
        d.set_item(format!("{name}_us"), report.quantile_us(q))?;
        if mode == "open" {
            // From when requests were written rather than due: the generator's own lag removed.
            d.set_item(format!("sent_{name}_us"), report.sent_quantile_us(q))?;
        }
    }
    let n = report.latencies_ns.len().max(1) as f64;
    d.set_item(
        "mean_us",
        report.latencies_ns.iter().map(|&l| l as f64).sum::<f64>() / n / 1e3,
    )?;
    Ok(d)
}
