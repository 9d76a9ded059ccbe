//! `cleave._native.http_load`: the open-loop HTTP load generator of `cleave bench serve`
//! (crate cleave-loadgen), run with the GIL released.

use std::time::Duration;

use bytes::Bytes;
use cleave_loadgen::{ClosedLoop, Run};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::wire::duration;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(http_load, m)?)?;
    Ok(())
}

/// One outcome per request, in schedule order:
/// `(body, scheduled_s, lag_s, latency_s, status, error, reply)`; `error` is "" on a response,
/// "timeout" or "connection: ..."; `reply` is the body of a 200 when `keep_replies`, else None.
type Row = (usize, f64, f64, f64, u16, String, Option<Py<PyBytes>>);

/// POSTs `bodies[order[i]]` to `url` at `times_s[i]` seconds from the start, whether or not
/// earlier requests have answered; each request may take `timeout_s`. `headers[i]` are extra
/// request headers of `bodies[i]`. With `clients` > 0 it runs closed loop instead for
/// `closed_s` seconds: `clients` clients sending the bodies of `order` in turn, each when its
/// last request answered (`times_s` empty).
// The arguments are Python keyword arguments; a struct would only move them.
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (url, bodies, times_s, order, timeout_s=10.0, keep_replies=false, headers=None, clients=0, closed_s=0.0))]
fn http_load(
    py: Python<'_>,
    url: String,
    bodies: Vec<Vec<u8>>,
    times_s: Vec<f64>,
    order: Vec<usize>,
    timeout_s: f64,
    keep_replies: bool,
    headers: Option<Vec<Vec<(String, String)>>>,
    clients: usize,
    closed_s: f64,
) -> PyResult<Vec<Row>> {
    let timeout: Duration = duration(timeout_s, "timeout_s")?;
    let closed = if clients > 0 {
        Some(ClosedLoop {
            clients,
            duration: duration(closed_s, "closed_s")?,
        })
    } else {
        None
    };
    let run = Run {
        url,
        bodies: bodies.into_iter().map(Bytes::from).collect(),
        headers: headers.unwrap_or_default(),
        times_s,
        order,
        timeout,
        keep_replies,
        closed,
    };
    let outcomes = py.detach(|| run.execute()).map_err(PyValueError::new_err)?;
    Ok(outcomes
        .into_iter()
        .map(|o| {
            let reply = o.reply.map(|b| PyBytes::new(py, &b).unbind());
            (
                o.body,
                o.scheduled_s,
                o.lag_s,
                o.latency_s,
                o.status,
                o.error,
                reply,
            )
        })
        .collect())
}
