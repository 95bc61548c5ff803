//! The Python extension module `ddtree._core` (cargo feature `python`).
//!
//! Everything Python-specific lives here: argument checking with messages that
//! name the argument, conversion between numpy arrays and the core's slices,
//! the GIL released around the work, panics caught before they reach Python
//! (a panic must not take down a vLLM worker), and the mapping of
//! [`DdtreeError`] to Python exceptions, in one place.

use std::borrow::Cow;
use std::panic::{catch_unwind, AssertUnwindSafe};

use numpy::{
    Element, PyArray1, PyArray2, PyArray3, PyArrayDyn, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyTuple};

use crate::accept::TreeWalker;
use crate::batch::{self, AcceptedBatch, BatchDistribution, CompiledBatch, Executor, TreeBatch};
use crate::build::TreeBuilder;
use crate::compile::{kv_moves, CompiledTree};
use crate::error::DdtreeError;
use crate::limits;
use crate::tree::{DraftDistribution, TokenId, Tree};

mod args;
mod build;
mod classes;
mod layout;
mod verify;

use args::*;
use build::*;
use classes::*;
use layout::*;
use verify::*;

impl From<DdtreeError> for PyErr {
    fn from(err: DdtreeError) -> PyErr {
        let message = err.to_string();
        match err {
            DdtreeError::Shape { .. } | DdtreeError::Value { .. } => PyValueError::new_err(message),
            DdtreeError::Dtype { .. } => PyTypeError::new_err(message),
            DdtreeError::Internal(_) => PyRuntimeError::new_err(message),
        }
    }
}

/// Below this many input elements the work takes about a microsecond, less
/// than releasing and re-taking the GIL costs, so it runs with the GIL held.
const DETACH_MIN_ELEMENTS: usize = 16_384;

/// Runs `work` with panics turned into errors, without the GIL when it is
/// big enough (`elements`: the size of its input) for that to pay.
pub(crate) fn run_core<T: Send>(
    py: Python<'_>,
    elements: usize,
    work: impl FnOnce() -> crate::Result<T> + Send,
) -> PyResult<T> {
    let guarded = || {
        catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(DdtreeError::Internal(what))
        })
    };
    let result = if elements < DETACH_MIN_ELEMENTS {
        guarded()
    } else {
        py.detach(guarded)
    };
    result.map_err(PyErr::from)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTree>()?;
    m.add_class::<PyTreeBatch>()?;
    m.add_class::<PyCompiledTree>()?;
    m.add_class::<PyCompiledBatch>()?;
    m.add_class::<PyAcceptedBatch>()?;
    m.add_class::<PyExecutor>()?;
    m.add_function(wrap_pyfunction!(build_tree, m)?)?;
    m.add_function(wrap_pyfunction!(build_trees, m)?)?;
    m.add_function(wrap_pyfunction!(compile_tree, m)?)?;
    m.add_function(wrap_pyfunction!(compile_trees, m)?)?;
    m.add_function(wrap_pyfunction!(accept, m)?)?;
    m.add_function(wrap_pyfunction!(accept_trees, m)?)?;
    m.add_function(wrap_pyfunction!(kv_move_plan, m)?)?;
    m.add_function(wrap_pyfunction!(verify_layout_into, m)?)?;
    m.add_function(wrap_pyfunction!(acceptance_layout_into, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_BUDGET", limits::MAX_BUDGET)?;
    m.add("MAX_BATCH_NODES", limits::MAX_BATCH_NODES)?;
    m.add("MAX_WINDOW", limits::MAX_WINDOW)?;
    m.add("MAX_THREADS", limits::MAX_THREADS)?;
    m.add("MAX_BIT_WORDS", limits::MAX_BIT_WORDS)?;
    m.add("MAX_DENSE_NODES", limits::MAX_DENSE_NODES)?;
    Ok(())
}
