//! `cleave._native.health`: the one health schema (crate cleave-wire's `health`), so that the
//! Python roles answer `/ready` exactly as the Rust ones do.

use cleave_wire::health::Health;
use pyo3::prelude::*;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(health, m)?)?;
    Ok(())
}

/// `(http_status, json_body)` of a role's readiness: `degraded` lists parts that are down
/// while the role still serves, `problems` why it cannot serve.
#[pyfunction]
fn health(role: &str, degraded: Vec<String>, problems: Vec<String>) -> (u16, String) {
    let h = Health::new(role, degraded, problems);
    (h.http_status(), h.to_json())
}
