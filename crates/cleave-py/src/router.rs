//! `run_router(config_json)`: runs the Rust router (crates/cleave-router) in this process, for
//! the one-process monolithic baseline (`cleave ranker --with-router`). A router on its own is
//! the `cleave-router` executable (crates/cleave-router/src/bin), which links no Python.
//! `time_json_data` and `time_json_request`: the router's JSON parsing timed, for
//! `cleave bench json-parse`.

use std::path::PathBuf;
use std::time::Instant;

use cleave_router::codec::json_tensor::{parse_tensor, parse_tensor_serde};
use cleave_router::codec::kserve::{parse_infer_with, JsonReader};
use cleave_router::{DType, Model};
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

/// The reader named: "scan", the request path's, or "serde", serde_json alone as the router
/// read requests before (the same-run reference).
fn reader(parser: &str) -> PyResult<JsonReader> {
    match parser {
        "scan" => Ok(JsonReader::Scan),
        "serde" => Ok(JsonReader::Serde),
        _ => Err(PyValueError::new_err(format!(
            "parser {parser:?}: expected \"scan\" or \"serde\""
        ))),
    }
}

/// Parses `text` (a KServe v2 `data` array) into a tensor of `datatype` (a KServe name) and
/// `shape`, `rounds` times with `parser`, the GIL released. Returns (seconds, the tensor's
/// bytes); bad input raises ValueError.
#[pyfunction]
fn time_json_data(
    py: Python<'_>,
    text: &str,
    datatype: &str,
    shape: Vec<usize>,
    parser: &str,
    rounds: usize,
) -> PyResult<(f64, Vec<u8>)> {
    let dtype = DType::ALL
        .into_iter()
        .find(|d| d.kserve_name() == datatype)
        .ok_or_else(|| PyValueError::new_err(format!("datatype {datatype:?}: unknown")))?;
    let parse: fn(&str, DType, &[usize]) -> Result<_, String> = match reader(parser)? {
        JsonReader::Scan => parse_tensor,
        JsonReader::Serde => parse_tensor_serde,
    };
    py.detach(|| -> Result<(f64, Vec<u8>), String> {
        let began = Instant::now();
        let mut out = parse(text, dtype, &shape);
        for _ in 1..rounds.max(1) {
            out = parse(text, dtype, &shape);
        }
        Ok((began.elapsed().as_secs_f64(), out?.data))
    })
    .map_err(PyValueError::new_err)
}

/// Parses `body` (a KServe v2 JSON infer request to the bundle's model) as the router does,
/// `rounds` times, its inputs' data read by `parser`, the GIL released. Returns (seconds,
/// each input's bytes in the model's order); a bad bundle or body raises ValueError.
#[pyfunction]
fn time_json_request(
    py: Python<'_>,
    bundle_dir: PathBuf,
    body: &[u8],
    parser: &str,
    rounds: usize,
) -> PyResult<(f64, Vec<Vec<u8>>)> {
    let model = Model::load("model", &bundle_dir).map_err(PyValueError::new_err)?;
    let reader = reader(parser)?;
    py.detach(|| -> Result<(f64, Vec<Vec<u8>>), String> {
        let began = Instant::now();
        let mut out = parse_infer_with(&model, body, None, reader);
        for _ in 1..rounds.max(1) {
            out = parse_infer_with(&model, body, None, reader);
        }
        let seconds = began.elapsed().as_secs_f64();
        let inputs = out.map_err(|e| e.to_string())?.inputs;
        Ok((
            seconds,
            inputs.into_iter().flatten().map(|t| t.data).collect(),
        ))
    })
    .map_err(PyValueError::new_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_router, m)?)?;
    m.add_function(wrap_pyfunction!(time_json_data, m)?)?;
    m.add_function(wrap_pyfunction!(time_json_request, m)?)
}
