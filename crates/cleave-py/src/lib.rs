//! `cleave._native`: the Rust half of the Python package.
//!
//! One file per exposed concept; this file only registers them.

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
