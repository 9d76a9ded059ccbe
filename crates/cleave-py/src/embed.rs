//! `cleave._native.TableSet`: the embedding engine (crate cleave-embed) for Python.
//!
//! Lookups take numpy arrays, run with the GIL released on the set's worker threads, and
//! return new numpy arrays. Engine errors become `cleave._native.EmbedError` (a ValueError)
//! carrying the engine's message.

use std::ops::Range;
use std::path::PathBuf;

use cleave_embed as engine;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

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
    Ok(())
}

/// The tables of a bundle a process holds, memory-mapped, with a pool of lookup threads.
#[pyclass(module = "cleave._native", frozen)]
pub struct TableSet {
    set: engine::TableSet,
    engine: engine::Engine,
}

#[pymethods]
impl TableSet {
    /// Opens `tables` (all if None) of the bundle at `bundle_dir`, restricted to the global
    /// rows `rows = (start, end)` (all if None). `threads`: lookup threads (default: all
    /// cores). `kernel`: "scalar", "avx2" or "avx512" to force one (default: the best).
    /// `resident`: copy rows into huge-page memory instead of mapping the files.
    /// `prefetch_distance`: prefetch rows this many ids ahead (default: about 8 KiB ahead).
    #[staticmethod]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    #[pyo3(signature = (bundle_dir, tables=None, rows=None, *, threads=None, kernel=None,
                        verify_checksums=false, resident=false, prefetch_distance=None))]
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
        let options = engine::OpenOptions {
            verify_checksums,
            residency: if resident {
                engine::Residency::Resident
            } else {
                engine::Residency::Mapped
            },
            prefetch_distance,
        };
        let rows: Option<Range<u64>> = rows.map(|(start, end)| start..end);
        let set = py
            .detach(|| engine::TableSet::open_with(&bundle_dir, tables.as_deref(), rows, &options))
            .map_err(embed_err)?;
        Ok(TableSet {
            set,
            engine: engine::Engine::with_kernel(threads, kernel),
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

    fn __repr__(&self) -> String {
        format!(
            "TableSet(tables={:?}, threads={}, kernel={:?})",
            self.tables(),
            self.engine.threads(),
            self.engine.kernel().name()
        )
    }
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
