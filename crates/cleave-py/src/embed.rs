//! `cleave._native.TableSet`: the embedding engine (crate cleave-embed) for Python.
//!
//! Lookups take numpy arrays, run with the GIL released on the set's worker threads, and
//! return new numpy arrays. Engine errors become `cleave._native.EmbedError` (a ValueError)
//! carrying the engine's message.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_embed as engine;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

pyo3::create_exception!(
    _native,
    EmbedError,
    PyValueError,
    "A bundle or a lookup the embedding engine refuses; the message says what and where."
);

fn embed_err(err: engine::EmbedError) -> PyErr {
    EmbedError::new_err(err.to_string())
}

/// Registers the classes of this file in `cleave._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("EmbedError", m.py().get_type::<EmbedError>())?;
    m.add_class::<TableSet>()?;
    m.add_function(wrap_pyfunction!(belady_hit_rate, m)?)?;
    m.add_function(wrap_pyfunction!(device_read_iops, m)?)?;
    Ok(())
}

/// The tables of a bundle a process holds, memory-mapped, with a pool of lookup threads.
#[pyclass(module = "cleave._native", frozen)]
pub struct TableSet {
    set: engine::TableSet,
    engine: engine::Engine,
    /// The SSD tier the tables are served from, if opened with a DRAM budget.
    tier: Option<Arc<engine::Tier>>,
}

#[pymethods]
impl TableSet {
    /// Opens `tables` (all if None) of the bundle at `bundle_dir`, restricted to the global
    /// rows `rows = (start, end)` (all if None). `threads`: lookup threads (default: all
    /// cores). `kernel`: "scalar", "avx2" or "avx512" to force one (default: the best).
    /// `resident`: copy rows into huge-page memory instead of mapping the files.
    /// `prefetch_distance`: prefetch rows this many ids ahead (default: about 8 KiB ahead).
    /// `dram_budget`: serve the tables from SSD behind DRAM caches of this many bytes
    /// (docs/tiers.md), with eviction `cache_policy` ("sieve" or "lru"), I/O backend `io`
    /// ("auto", "uring", "pread") and `pooled_fraction` of the budget for pooled results.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    #[pyo3(signature = (bundle_dir, tables=None, rows=None, *, threads=None, kernel=None,
                        verify_checksums=false, resident=false, prefetch_distance=None,
                        dram_budget=None, cache_policy="sieve", io="auto",
                        pooled_fraction=0.0))]
    fn open(
        py: Python<'_>,
        bundle_dir: PathBuf,
        tables: Option<Vec<String>>,
        rows: Option<(u64, u64)>,
        threads: Option<usize>,
        kernel: Option<&str>,
        verify_checksums: bool,
        resident: bool,
        prefetch_distance: Option<usize>,
        dram_budget: Option<u64>,
        cache_policy: &str,
        io: &str,
        pooled_fraction: f64,
    ) -> PyResult<TableSet> {
        let kernel = match kernel {
            None => engine::Kernel::best(),
            Some(name) => name.parse().map_err(PyValueError::new_err)?,
        };
        kernel.require().map_err(embed_err)?;
        let threads = match threads {
            Some(0) => return Err(PyValueError::new_err("threads must be at least 1, got 0")),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let tier = match dram_budget {
            None => None,
            Some(budget) => {
                let mut config = engine::TierConfig::new(budget);
                config.policy = cache_policy.parse().map_err(PyValueError::new_err)?;
                config.io = io.parse().map_err(PyValueError::new_err)?;
                config.pooled_fraction = pooled_fraction;
                Some(engine::Tier::new(config).map_err(embed_err)?)
            }
        };
        let options = engine::OpenOptions {
            verify_checksums,
            residency: if resident {
                engine::Residency::Resident
            } else {
                engine::Residency::Mapped
            },
            prefetch_distance,
            tier: tier.clone(),
        };
        let rows: Option<Range<u64>> = rows.map(|(start, end)| start..end);
        let set = py
            .detach(|| engine::TableSet::open_with(&bundle_dir, tables.as_deref(), rows, &options))
            .map_err(embed_err)?;
        Ok(TableSet {
            set,
            engine: engine::Engine::with_kernel(threads, kernel),
            tier,
        })
    }

    /// Names of the tables held, in manifest order.
    #[getter]
    fn tables(&self) -> Vec<String> {
        self.set.names().map(str::to_string).collect()
    }

    /// Lookup threads (the calling thread included).
    #[getter]
    fn threads(&self) -> usize {
        self.engine.threads()
    }

    /// The kernel in use: "scalar", "avx2" or "avx512".
    #[getter]
    fn kernel(&self) -> &'static str {
        self.engine.kernel().name()
    }

    /// Kernels this CPU can run, slowest first.
    #[staticmethod]
    fn kernels() -> Vec<&'static str> {
        engine::Kernel::available()
            .iter()
            .map(|k| k.name())
            .collect()
    }

    /// Width of `table`'s rows.
    fn dim(&self, table: &str) -> PyResult<usize> {
        Ok(self.table(table)?.dim())
    }

    /// Global row range `(start, end)` held of `table`.
    fn row_range(&self, table: &str) -> PyResult<(u64, u64)> {
        let r = self.table(table)?.row_range();
        Ok((r.start, r.end))
    }

    /// How many ids ahead lookups on `table` prefetch rows.
    fn prefetch_distance(&self, table: &str) -> PyResult<usize> {
        Ok(self.table(table)?.prefetch_distance())
    }

    /// Storage dtype of `table`: "float32", "float16" or "int8_rowwise".
    fn dtype(&self, table: &str) -> PyResult<&'static str> {
        Ok(self.table(table)?.dtype().as_str())
    }

    /// Pooled lookup. `ids`: int64 (or int32) ids; `offsets`: bags + 1 entries (uint32 or
    /// int64), starting at 0 and ending at len(ids); `weights`: float32 per id (sum only);
    /// `pooling`: "sum", "mean" or "max". Returns (float32[bags, dim], uint32[bags] counts).
    #[pyo3(signature = (table, ids, offsets, weights=None, pooling="sum"))]
    fn pool<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
        weights: Option<&Bound<'py, PyAny>>,
        pooling: &str,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyArray1<u32>>)> {
        let t = self.table(table)?;
        let pooling: engine::Pooling = pooling.parse().map_err(EmbedError::new_err)?;
        let ids = Ints::<i64>::extract(ids, "ids")?;
        self.engine.expect(ids.as_slice().len());
        let offsets = Ints::<u32>::extract(offsets, "offsets")?;
        let weights = weights.map(|w| Floats::extract(w, "weights")).transpose()?;
        let bags = offsets.as_slice().len().saturating_sub(1);
        let mut out = vec![0.0f32; bags * t.dim()];
        let mut counts = vec![0u32; bags];
        let (ids, offsets) = (ids.as_slice(), offsets.as_slice());
        let weights = weights.as_ref().map(Floats::as_slice);
        py.detach(|| {
            let bags = engine::Bags {
                ids,
                offsets,
                weights,
            };
            self.engine.pool(t, &bags, pooling, &mut out, &mut counts)
        })
        .map_err(embed_err)?;
        let out = PyArray1::from_vec(py, out)
            .reshape([bags, t.dim()])?
            .into_any();
        Ok((out, PyArray1::from_vec(py, counts)))
    }

    /// Unpooled gather: float32[len(ids), dim], row `ids[i]` at position i.
    fn gather<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let t = self.table(table)?;
        let ids = Ints::<i64>::extract(ids, "ids")?;
        let ids = ids.as_slice();
        let mut out = vec![0.0f32; ids.len() * t.dim()];
        py.detach(|| engine::gather_with(self.engine.kernel(), t, ids, &mut out))
            .map_err(embed_err)?;
        Ok(PyArray1::from_vec(py, out)
            .reshape([ids.len(), t.dim()])?
            .into_any())
    }

    /// The memory limit loop of `cleave bench lookup`: reads the rows of `ids` with software
    /// prefetch and no pooling, on `threads` threads (default: this set's). Returns a word
    /// folded from the rows (to keep the reads).
    #[pyo3(signature = (table, ids, threads=None, distance=None))]
    fn gather_sum_prefetch(
        &self,
        py: Python<'_>,
        table: &str,
        ids: &Bound<'_, PyAny>,
        threads: Option<usize>,
        distance: Option<usize>,
    ) -> PyResult<u64> {
        let t = self.table(table)?;
        let ids = Ints::<i64>::extract(ids, "ids")?;
        let ids = ids.as_slice();
        let threads = threads.unwrap_or(self.engine.threads());
        py.detach(|| engine::limit::gather_sum_prefetch(t, ids, threads, distance))
            .map_err(embed_err)
    }

    /// Where `table`'s rows live: "mapped", "resident" or "ssd".
    fn store_kind(&self, table: &str) -> PyResult<&'static str> {
        Ok(self.table(table)?.store_kind())
    }

    /// The SSD tier's counters and shape (None without a DRAM budget): ids, rows (distinct
    /// per call), row_hits, device_reads, device_bytes, row_bytes_read, pooled_lookups,
    /// pooled_hits, the derived rates, io ("io_uring" or "pread"), policy, and row_caches
    /// as [row_bytes, capacity_rows, held_rows] per internal cache.
    fn tier_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(tier) = &self.tier else {
            return Ok(None);
        };
        let s = tier.stats();
        let d = PyDict::new(py);
        d.set_item("ids", s.ids)?;
        d.set_item("rows", s.rows)?;
        d.set_item("row_hits", s.row_hits)?;
        d.set_item("device_reads", s.device_reads)?;
        d.set_item("device_bytes", s.device_bytes)?;
        d.set_item("row_bytes_read", s.row_bytes_read)?;
        d.set_item("pooled_lookups", s.pooled_lookups)?;
        d.set_item("pooled_hits", s.pooled_hits)?;
        d.set_item("row_hit_rate", s.row_hit_rate())?;
        d.set_item("pooled_hit_rate", s.pooled_hit_rate())?;
        d.set_item("read_amplification", s.read_amplification())?;
        d.set_item("io", tier.io_backend())?;
        d.set_item("policy", tier.config().policy.as_str())?;
        d.set_item("row_caches", tier.row_cache_shape())?;
        Ok(Some(d))
    }

    /// Zeroes the tier's counters (a benchmark reads the steady state after warming up).
    fn reset_tier_stats(&self) {
        if let Some(tier) = &self.tier {
            tier.reset_stats();
        }
    }

    /// Runs requests one after another on the engine and returns each one's latency in
    /// microseconds (float64). Request `r` is bags `bounds[r]..bounds[r + 1]` of the bags
    /// `ids`/`offsets` describe. With `interval_us`, request `r` is due at `r * interval_us`
    /// after the start (open loop) and its latency counts from then; without, back to back.
    #[pyo3(signature = (table, ids, offsets, bounds, pooling="sum", interval_us=None))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    fn run_requests<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
        bounds: &Bound<'py, PyAny>,
        pooling: &str,
        interval_us: Option<f64>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let t = self.table(table)?;
        let pooling: engine::Pooling = pooling.parse().map_err(EmbedError::new_err)?;
        let ids = Ints::<i64>::extract(ids, "ids")?;
        let offsets = Ints::<u32>::extract(offsets, "offsets")?;
        let bounds = Ints::<i64>::extract(bounds, "bounds")?;
        let (ids, offsets, bounds) = (ids.as_slice(), offsets.as_slice(), bounds.as_slice());
        let bags = offsets.len().saturating_sub(1) as i64;
        if bounds.windows(2).any(|w| w[1] < w[0]) || bounds.iter().any(|&b| b < 0 || b > bags) {
            return Err(PyValueError::new_err(format!(
                "bounds must be non-decreasing bag indices in [0, {bags}]"
            )));
        }
        let latencies = py
            .detach(|| -> Result<Vec<f64>, engine::EmbedError> {
                let mut out = Vec::with_capacity(bounds.len().saturating_sub(1));
                let mut pooled = Vec::new();
                let mut counts = Vec::new();
                let start = Instant::now();
                for (r, w) in bounds.windows(2).enumerate() {
                    let (b0, b1) = (w[0] as usize, w[1] as usize);
                    let due = match interval_us {
                        Some(us) => {
                            let due = start + Duration::from_secs_f64(us * r as f64 / 1e6);
                            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                                std::thread::sleep(wait);
                            }
                            due
                        }
                        None => Instant::now(),
                    };
                    // Offsets of these bags, relative to their first id.
                    let first = offsets[b0];
                    let local: Vec<u32> = offsets[b0..=b1].iter().map(|&o| o - first).collect();
                    let these = &ids[first as usize..offsets[b1] as usize];
                    pooled.resize((b1 - b0) * t.dim(), 0.0);
                    counts.resize(b1 - b0, 0);
                    let bags = engine::Bags {
                        ids: these,
                        offsets: &local,
                        weights: None,
                    };
                    self.engine
                        .pool(t, &bags, pooling, &mut pooled, &mut counts)?;
                    out.push(due.elapsed().as_secs_f64() * 1e6);
                }
                Ok(out)
            })
            .map_err(embed_err)?;
        Ok(PyArray1::from_vec(py, latencies))
    }

    fn __repr__(&self) -> String {
        format!(
            "TableSet(tables={:?}, threads={}, kernel={:?})",
            self.tables(),
            self.engine.threads(),
            self.engine.kernel().name()
        )
    }
}

/// Hit rate of Belady's optimal offline policy with `capacity` rows on `trace` (row keys in
/// access order), counted from position `start` on.
#[pyfunction]
#[pyo3(signature = (trace, capacity, start=0))]
fn belady_hit_rate(
    py: Python<'_>,
    trace: &Bound<'_, PyAny>,
    capacity: usize,
    start: usize,
) -> PyResult<f64> {
    let trace = Ints::<i64>::extract(trace, "trace")?;
    let keys: Vec<u64> = trace.as_slice().iter().map(|&k| k as u64).collect();
    Ok(py.detach(|| engine::cache::belady::belady_hit_rate(&keys, capacity, start)))
}

/// Random O_DIRECT reads of `read_bytes` (block-aligned) at aligned offsets of the file at
/// `path`, `reads` of them in batches of `queue_depth` in flight, through the tier's I/O
/// backend `io`. Returns (reads per second, backend name).
#[pyfunction]
#[pyo3(signature = (path, read_bytes, reads, queue_depth=64, io="auto", threads=1))]
fn device_read_iops(
    py: Python<'_>,
    path: PathBuf,
    read_bytes: usize,
    reads: usize,
    queue_depth: usize,
    io: &str,
    threads: usize,
) -> PyResult<(f64, &'static str)> {
    let io: engine::IoMode = io.parse().map_err(PyValueError::new_err)?;
    py.detach(|| {
        engine::tier::measure_read_iops(&path, read_bytes, reads, queue_depth, io, threads)
    })
    .map_err(embed_err)
}

impl TableSet {
    fn table(&self, name: &str) -> PyResult<&engine::Table> {
        self.set.require(name).map_err(embed_err)
    }
}

/// A 1-D integer array as a slice of `T`: borrowed when it already is a contiguous `T`
/// array, converted (with range checks) from the other integer dtypes otherwise.
enum Ints<'py, T: numpy::Element> {
    Borrowed(PyReadonlyArray1<'py, T>),
    Owned(Vec<T>),
}

impl<'py, T> Ints<'py, T>
where
    T: numpy::Element + TryFrom<i64> + Copy,
{
    fn extract(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, T>>() {
            if a.is_contiguous() {
                return Ok(Ints::Borrowed(a));
            }
        }
        let values: Vec<i64> = if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i64>>() {
            a.as_array().to_vec()
        } else if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i32>>() {
            a.as_array().iter().map(|&v| v as i64).collect()
        } else if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, u32>>() {
            a.as_array().iter().map(|&v| v as i64).collect()
        } else {
            return Err(PyTypeError::new_err(format!(
                "{what} must be a 1-D numpy array of int64, int32 or uint32, got {}",
                describe(obj)
            )));
        };
        let converted = values
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                T::try_from(v).map_err(|_| {
                    EmbedError::new_err(format!(
                        "{what}[{i}] is {v}, which does not fit in {}",
                        std::any::type_name::<T>()
                    ))
                })
            })
            .collect::<PyResult<Vec<T>>>()?;
        Ok(Ints::Owned(converted))
    }

    fn as_slice(&self) -> &[T] {
        match self {
            // Contiguity was checked when borrowing.
            Ints::Borrowed(a) => a.as_slice().unwrap_or(&[]),
            Ints::Owned(v) => v,
        }
    }
}

/// A 1-D float array as f32: borrowed if contiguous float32, converted from float64.
enum Floats<'py> {
    Borrowed(PyReadonlyArray1<'py, f32>),
    Owned(Vec<f32>),
}

impl<'py> Floats<'py> {
    fn extract(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, f32>>() {
            return Ok(if a.is_contiguous() {
                Floats::Borrowed(a)
            } else {
                Floats::Owned(a.as_array().to_vec())
            });
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, f64>>() {
            return Ok(Floats::Owned(
                a.as_array().iter().map(|&v| v as f32).collect(),
            ));
        }
        Err(PyTypeError::new_err(format!(
            "{what} must be a 1-D numpy array of float32 or float64, got {}",
            describe(obj)
        )))
    }

    fn as_slice(&self) -> &[f32] {
        match self {
            Floats::Borrowed(a) => a.as_slice().unwrap_or(&[]),
            Floats::Owned(v) => v,
        }
    }
}

/// "numpy.ndarray of float16 with shape (3, 4)" or the Python type's name.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        return format!("an array of {} with shape {:?}", a.dtype(), a.shape());
    }
    obj.get_type()
        .name()
        .map_or_else(|_| "an object".to_string(), |n| n.to_string())
}
