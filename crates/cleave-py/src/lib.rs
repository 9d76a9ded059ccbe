//! `cleave._native`: the Rust half of the Python package.
//!
//! One file per exposed concept; this file only registers them.

use pyo3::prelude::*;

mod embed;
mod health;
mod incast;
mod loadgen;
mod router;
mod shard;
mod shard_client;
mod wire;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    embed::register(m)?;
    health::register(m)?;
    incast::register(m)?;
    loadgen::register(m)?;
    router::register(m)?;
    wire::register(m)?;
    shard::register(m)?;
    shard_client::register(m)?;
    Ok(())
}
