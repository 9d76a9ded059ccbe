//! `run_router(config_json)`: runs the Rust router (crates/cleave-router) in this process, for
//! the one-process monolithic baseline (`cleave ranker --with-router`). A router on its own is
//! the `cleave-router` executable (crates/cleave-router/src/bin), which links no Python.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// Serves until SIGTERM or SIGINT, with the GIL released. Prints `ready http://HOST:PORT`
/// once every shard and ranker answered. A bad config raises ValueError; a router that cannot
/// start (bundle, port, backends never ready) raises RuntimeError.
#[pyfunction]
fn run_router(py: Python<'_>, config_json: &str) -> PyResult<()> {
    let config =
        cleave_router::RouterConfig::from_json(config_json).map_err(PyValueError::new_err)?;
    // The router's events (backends ejected, readiness changes) go to stderr as in the
    // executable; a process that already installed a logger keeps its own.
    match cleave_wire::log::init(cleave_wire::log::LogFormat::Text) {
        Ok(()) | Err(cleave_wire::log::LogError::AlreadySet) => {}
        Err(e) => return Err(PyValueError::new_err(e.to_string())),
    }
    let result = py.detach(|| cleave_router::run(config));
    // The stopping SIGINT also reached Python's own handler: it has been dealt with.
    if let Err(e) = py.check_signals() {
        if !e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
            return Err(e);
        }
    }
    result.map_err(PyRuntimeError::new_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_router, m)?)
}
