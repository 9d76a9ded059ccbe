//! `encode_lookups` (LOOKUP payloads for tests and tools) and `bench_shard_load`, the load
//! generator of `cleave bench shard`. The shard process itself is the `cleave-shard`
//! executable (crates/cleave-shard/src/bin), which links no Python.

use std::time::Duration;

use bytes::Bytes;
use cleave_loadgen::shard::{run_closed_loop, run_open_loop};
use cleave_shard::message::encode_request;
use cleave_shard::Lookup;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::shard_client::parse_requests;
use crate::wire::{duration, parse_address};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_lookups, m)?)?;
    m.add_function(wrap_pyfunction!(bench_shard_load, m)?)?;
    // Frame kinds of the shard's messages, for tools that call a shard with FrameClient.
    m.add("KIND_LOOKUP", cleave_shard::LOOKUP)?;
    m.add("KIND_UPDATE", cleave_shard::UPDATE)?;
    Ok(())
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
        "open" => py.detach(|| run_open_loop(&addr, &payloads, rate, run, connections, timeout)),
        "closed" => py.detach(|| run_closed_loop(&addr, &payloads, run, connections, window)),
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
