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
fn run_core<T: Send>(
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

// ---------------------------------------------------------------- arguments

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .qualname()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// An ndarray argument with its expected number of dimensions checked.
fn ndarray<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    arg: &'static str,
    expected: &str,
) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    let array = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{arg}: expected a numpy.ndarray {expected}, got {}",
            type_name(obj)
        ))
    })?;
    let dims = expected.matches(',').count() + 1;
    if array.ndim() != dims {
        return Err(DdtreeError::shape(arg, expected, format!("{:?}", array.shape())).into());
    }
    Ok(array)
}

/// The array's elements in C order: borrowed when C-contiguous, else copied.
/// (rust-numpy's `as_slice` also accepts Fortran-contiguous arrays, whose
/// memory order is not C order.)
fn slice_of<'a, T: Element + Copy>(array: &'a Bound<'_, PyArrayDyn<T>>) -> Cow<'a, [T]> {
    // SAFETY: the slice is only read, and only during this call, while the
    // caller holds a reference to the array. rust-numpy's borrow registry
    // (`readonly()`) would cost more than building a small tree, and guards
    // only against Rust-side mutable borrows, of which ddtree makes none; a
    // Python thread writing the array during the call is a caller bug either way.
    match array.is_c_contiguous().then(|| unsafe { array.as_slice() }) {
        Some(Ok(slice)) => Cow::Borrowed(slice),
        _ => Cow::Owned(array.to_owned_array().iter().copied().collect()),
    }
}

fn typed<'a, 'py, T: Element>(
    array: &'a Bound<'py, PyUntypedArray>,
    arg: &'static str,
    expected: &'static str,
) -> PyResult<&'a Bound<'py, PyArrayDyn<T>>> {
    array.cast::<PyArrayDyn<T>>().map_err(|_| {
        DdtreeError::Dtype {
            arg,
            expected,
            got: array.dtype().to_string(),
        }
        .into()
    })
}

/// A non-negative integer (a Python int or numpy integer scalar).
fn count(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<usize> {
    let value: i64 = obj.extract().map_err(|_| out_of_range_or_type(obj, arg))?;
    usize::try_from(value)
        .map_err(|_| DdtreeError::value(arg, format!("must be >= 0, got {value}")).into())
}

/// A signed 64-bit integer argument (a Python int or numpy integer scalar).
fn int64(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<i64> {
    obj.extract().map_err(|_| out_of_range_or_type(obj, arg))
}

/// Why an int argument did not convert to i64: too large for 64 bits (ValueError), or not an int.
fn out_of_range_or_type(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyErr {
    if obj.is_instance_of::<PyInt>() {
        return DdtreeError::value(arg, format!("{obj} does not fit in a 64-bit integer")).into();
    }
    PyTypeError::new_err(format!("{arg}: expected an int, got {}", type_name(obj)))
}

/// An int broadcast to `n` entries, or a sequence/array of exactly `n` ints.
fn per_request_ints(obj: &Bound<'_, PyAny>, arg: &'static str, n: usize) -> PyResult<Vec<i64>> {
    if let Ok(value) = obj.extract::<i64>() {
        return Ok(vec![value; n]);
    }
    if obj.is_instance_of::<PyInt>() {
        return Err(out_of_range_or_type(obj, arg));
    }
    let values: Vec<i64> = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{arg}: expected an int or a sequence of {n} ints, got {}",
            type_name(obj)
        ))
    })?;
    if values.len() != n {
        return Err(DdtreeError::shape(
            arg,
            format!("an int or [{n}] (one per request)"),
            format!("[{}]", values.len()),
        )
        .into());
    }
    Ok(values)
}

fn array_1d<'py, T: Element>(py: Python<'py>, v: Vec<T>) -> Bound<'py, PyArray1<T>> {
    PyArray1::from_vec(py, v)
}

/// A `[rows, cols]` array from row-major values (rows given: cols may be 0).
fn array_2d<'py, T: Element>(
    py: Python<'py>,
    v: Vec<T>,
    rows: usize,
    cols: usize,
) -> PyResult<Bound<'py, PyArray2<T>>> {
    PyArray1::from_vec(py, v).reshape([rows, cols])
}

// ------------------------------------------------------------ build entry

/// Token ids arrive as int32 or int64; the core is generic over both.
enum TokenIds<'a, 'py> {
    I32(&'a Bound<'py, PyArrayDyn<i32>>),
    I64(&'a Bound<'py, PyArrayDyn<i64>>),
}

/// Borrowed `log_probs` and `token_ids` arrays and their common shape
/// (2 or 3 dimensions, checked; unused ones 0), kept off the heap.
type DistributionArrays<'a, 'py> = (
    &'a Bound<'py, PyArrayDyn<f32>>,
    TokenIds<'a, 'py>,
    [usize; 3],
);

/// Reads `log_probs` and `token_ids`, both of the `expected` shape (`dims`
/// dimensions). The usual, valid case takes one type check per array; any
/// other input takes the checks that name what is wrong.
fn read_distribution<'a, 'py>(
    log_probs: &'a Bound<'py, PyAny>,
    token_ids: &'a Bound<'py, PyAny>,
    expected: &'static str,
    dims: usize,
) -> PyResult<DistributionArrays<'a, 'py>> {
    match typed_distribution(log_probs, token_ids, dims) {
        Some(arrays) => Ok(arrays),
        None => checked_distribution(log_probs, token_ids, expected),
    }
}

/// `log_probs` and `token_ids` when both are arrays of element types the
/// core takes, with `dims` dimensions and the same shape.
fn typed_distribution<'a, 'py>(
    log_probs: &'a Bound<'py, PyAny>,
    token_ids: &'a Bound<'py, PyAny>,
    dims: usize,
) -> Option<DistributionArrays<'a, 'py>> {
    let values = log_probs.cast::<PyArrayDyn<f32>>().ok()?;
    let (ids, ids_shape) = match token_ids.cast::<PyArrayDyn<i64>>() {
        Ok(a) => (TokenIds::I64(a), a.shape()),
        Err(_) => {
            let a = token_ids.cast::<PyArrayDyn<i32>>().ok()?;
            (TokenIds::I32(a), a.shape())
        }
    };
    let shape = padded_shape(values.shape())?;
    (values.ndim() == dims && padded_shape(ids_shape)? == shape).then_some((values, ids, shape))
}

/// A shape of at most 3 dimensions as a fixed-size array (unused ones 0).
fn padded_shape(shape: &[usize]) -> Option<[usize; 3]> {
    let mut out = [0; 3];
    out.get_mut(..shape.len())?.copy_from_slice(shape);
    Some(out)
}

/// Reads `log_probs` and `token_ids` check by check, so that the error names
/// the argument and what is wrong with it.
#[cold]
fn checked_distribution<'a, 'py>(
    log_probs: &'a Bound<'py, PyAny>,
    token_ids: &'a Bound<'py, PyAny>,
    expected: &'static str,
) -> PyResult<DistributionArrays<'a, 'py>> {
    let lp = ndarray(log_probs, "log_probs", expected)?;
    let ids = ndarray(token_ids, "token_ids", expected)?;
    if lp.shape() != ids.shape() {
        return Err(DdtreeError::shape(
            "token_ids",
            format!("{:?} (the shape of log_probs)", lp.shape()),
            format!("{:?}", ids.shape()),
        )
        .into());
    }
    let mut shape = [0; 3];
    shape[..lp.ndim()].copy_from_slice(lp.shape());
    let values = typed::<f32>(lp, "log_probs", "float32")?;
    let ids = match ids.cast::<PyArrayDyn<i64>>() {
        Ok(a) => TokenIds::I64(a),
        Err(_) => TokenIds::I32(typed::<i32>(ids, "token_ids", "int32 or int64")?),
    };
    Ok((values, ids, shape))
}

fn build_one<T: TokenId>(
    lp: &[f32],
    ids: &[T],
    shape: &[usize],
    budget: usize,
) -> crate::Result<Tree> {
    let dist = DraftDistribution::new(lp, ids, shape[0], shape[1])?;
    BUILDER.with_borrow_mut(|b| b.build(&dist, budget))
}

thread_local! {
    static BUILDER: std::cell::RefCell<TreeBuilder> = std::cell::RefCell::new(TreeBuilder::new());
    static WALKER: std::cell::RefCell<TreeWalker> = std::cell::RefCell::new(TreeWalker::new());
}

/// build_tree(log_probs, token_ids, budget) -> Tree
///
/// The draft tree of the `budget` most probable prefixes under the drafter's
/// factorized distribution. `log_probs`: float32 `[L, K]`, each row
/// non-increasing (top-k order); `token_ids`: int32/int64 `[L, K]`, distinct
/// per row; `budget`: int >= 0, the number of draft nodes (root excluded).
#[pyfunction]
fn build_tree(
    py: Python<'_>,
    log_probs: &Bound<'_, PyAny>,
    token_ids: &Bound<'_, PyAny>,
    budget: &Bound<'_, PyAny>,
) -> PyResult<PyTree> {
    let budget = count(budget, "budget")?;
    let (lp, ids, shape) = read_distribution(log_probs, token_ids, "[L, K]", 2)?;
    let lp = slice_of(lp);
    let tree = match &ids {
        TokenIds::I32(ids) => {
            let ids = slice_of(ids);
            run_core(py, lp.len(), || build_one(&lp, &ids, &shape, budget))?
        }
        TokenIds::I64(ids) => {
            let ids = slice_of(ids);
            run_core(py, lp.len(), || build_one(&lp, &ids, &shape, budget))?
        }
    };
    Ok(PyTree { inner: tree })
}

/// build_trees(log_probs, token_ids, budgets, executor=None) -> TreeBatch
///
/// One tree per request in one call: `log_probs`/`token_ids` `[R, L, K]`,
/// `budgets` an int or `[R]` ints. With an `Executor`, large batches are built
/// on its threads.
#[pyfunction]
#[pyo3(signature = (log_probs, token_ids, budgets, executor=None))]
fn build_trees(
    py: Python<'_>,
    log_probs: &Bound<'_, PyAny>,
    token_ids: &Bound<'_, PyAny>,
    budgets: &Bound<'_, PyAny>,
    executor: Option<&PyExecutor>,
) -> PyResult<PyTreeBatch> {
    let (lp, ids, shape) = read_distribution(log_probs, token_ids, "[R, L, K]", 3)?;
    let requests = shape[0];
    let budgets = per_request_ints(budgets, "budgets", requests)?
        .into_iter()
        .map(|b| {
            usize::try_from(b)
                .map_err(|_| DdtreeError::value("budgets", format!("must be >= 0, got {b}")))
        })
        .collect::<crate::Result<Vec<_>>>()?;
    let serial;
    let executor = match executor {
        Some(e) => &e.inner,
        None => {
            serial = Executor::new(1)?;
            &serial
        }
    };
    let lp = slice_of(lp);
    let batch = match &ids {
        TokenIds::I32(ids) => {
            let ids = slice_of(ids);
            run_core(py, lp.len(), || {
                build_batch(&lp, &ids, &shape, &budgets, executor)
            })?
        }
        TokenIds::I64(ids) => {
            let ids = slice_of(ids);
            run_core(py, lp.len(), || {
                build_batch(&lp, &ids, &shape, &budgets, executor)
            })?
        }
    };
    Ok(PyTreeBatch { inner: batch })
}

fn build_batch<T: TokenId>(
    lp: &[f32],
    ids: &[T],
    shape: &[usize],
    budgets: &[usize],
    executor: &Executor,
) -> crate::Result<TreeBatch> {
    let dist = BatchDistribution {
        log_probs: lp,
        token_ids: ids,
        requests: shape[0],
        depth: shape[1],
        width: shape[2],
    };
    batch::build_trees(&dist, budgets, executor)
}

// ------------------------------------------------------------ classes

/// A thread pool for batched calls, created on first use (never at import,
/// and anew after a fork). Frozen: safe to share between threads.
#[pyclass(frozen, name = "Executor", module = "ddtree._core")]
struct PyExecutor {
    inner: Executor,
}

#[pymethods]
impl PyExecutor {
    #[new]
    fn new(num_threads: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self {
            inner: Executor::new(count(num_threads, "num_threads")?)?,
        })
    }

    #[getter]
    fn num_threads(&self) -> usize {
        self.inner.num_threads()
    }

    fn __repr__(&self) -> String {
        format!("Executor(num_threads={})", self.inner.num_threads())
    }
}

/// A draft tree: node 0 is the root, nodes 1..n the draft tokens in
/// best-first order (`parents[i] < i`, scores non-increasing).
#[pyclass(frozen, name = "Tree", module = "ddtree._core")]
struct PyTree {
    inner: Tree,
}

#[pymethods]
impl PyTree {
    /// int64 `[n]`: the token of node i is `tokens[i - 1]`.
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.tokens)
    }

    /// int32 `[n + 1]`, `parents[0] == -1`.
    #[getter]
    fn parents<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, &self.inner.parents)
    }

    /// int32 `[n + 1]`, `depths[0] == 0`.
    #[getter]
    fn depths<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, &self.inner.depths)
    }

    /// float32 `[n + 1]`: cumulative draft log-probability (root 0).
    #[getter]
    fn scores<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        PyArray1::from_slice(py, &self.inner.scores)
    }

    /// n, the number of draft nodes (root excluded).
    #[getter]
    fn num_draft_nodes(&self) -> usize {
        self.inner.tokens.len()
    }

    #[getter]
    fn max_depth(&self) -> usize {
        self.inner.view().max_depth()
    }

    /// Expected tokens per verification step (accepted nodes + bonus) if the
    /// target agreed with the drafter's factorized distribution.
    fn expected_acceptance(&self) -> f64 {
        self.inner.view().expected_acceptance()
    }

    /// n + 1: the number of verified positions, root included.
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Tree(num_draft_nodes={}, max_depth={})",
            self.inner.tokens.len(),
            self.inner.view().max_depth()
        )
    }
}

/// The trees of a batch in flat arrays: request r owns nodes
/// `node_offsets[r]:node_offsets[r+1]` of parents/depths/scores (root first)
/// and `token_offsets[r]:token_offsets[r+1]` of tokens.
#[pyclass(frozen, name = "TreeBatch", module = "ddtree._core")]
struct PyTreeBatch {
    inner: TreeBatch,
}

#[pymethods]
impl PyTreeBatch {
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.tokens)
    }
    #[getter]
    fn parents<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, &self.inner.parents)
    }
    #[getter]
    fn depths<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, &self.inner.depths)
    }
    #[getter]
    fn scores<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        PyArray1::from_slice(py, &self.inner.scores)
    }
    /// int64 `[R + 1]` into parents/depths/scores and compiled arrays.
    #[getter]
    fn node_offsets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.node_offsets)
    }
    /// int64 `[R + 1]` into tokens.
    #[getter]
    fn token_offsets<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.token_offsets)
    }
    /// L: the drafter's number of positions.
    #[getter]
    fn draft_depth(&self) -> usize {
        self.inner.draft_depth
    }
    /// float64 `[R]`: each tree's expected acceptance (see Tree).
    fn expected_acceptance<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f64>> {
        let values = (0..self.inner.requests())
            .map(|r| self.inner.tree(r).expected_acceptance())
            .collect();
        array_1d(py, values)
    }
    fn __len__(&self) -> usize {
        self.inner.requests()
    }
    /// Request r's tree as a Tree (a copy; not for the hot path).
    fn __getitem__(&self, r: isize) -> PyResult<PyTree> {
        let n = self.inner.requests() as isize;
        let index = if r < 0 { r + n } else { r };
        if index < 0 || index >= n {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "request {r} out of range for a batch of {n}"
            )));
        }
        let view = self.inner.tree(index as usize);
        Ok(PyTree {
            inner: Tree {
                tokens: view.tokens.to_vec(),
                parents: view.parents.to_vec(),
                depths: view.depths.to_vec(),
                scores: view.scores.to_vec(),
            },
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "TreeBatch(requests={}, total_nodes={})",
            self.inner.requests(),
            self.inner.total_nodes()
        )
    }
}

/// What one tree's verification pass needs.
#[pyclass(frozen, name = "CompiledTree", module = "ddtree._core")]
struct PyCompiledTree {
    inner: CompiledTree,
}

#[pymethods]
impl PyCompiledTree {
    /// int64 `[N]`: `start + depth`.
    #[getter]
    fn positions<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.positions)
    }
    /// uint32 `[N, words]`: bit j of row i (word j // 32, bit j % 32) is set
    /// when node j is an ancestor of node i or i itself.
    #[getter]
    fn ancestor_bits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<u32>>> {
        array_2d(
            py,
            self.inner.ancestor_bits.clone(),
            self.inner.positions.len(),
            self.inner.words,
        )
    }
    /// int32 `[N, window]`: each node's last `window` ancestors, oldest
    /// first; -1, -2, ... name the newest committed history entries.
    #[getter]
    fn windows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        array_2d(
            py,
            self.inner.windows.clone(),
            self.inner.positions.len(),
            self.inner.window,
        )
    }
    /// bool `[N, N]`: `mask[i, j]` when node i sees node j.
    fn dense_mask<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<bool>>> {
        array_2d(
            py,
            self.inner.dense_mask()?,
            self.inner.positions.len(),
            self.inner.positions.len(),
        )
    }
    /// float32 `[N, N]`: 0 where visible, -inf elsewhere (an additive bias).
    fn attention_bias<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let bias = self
            .inner
            .dense_mask()?
            .into_iter()
            .map(|seen| if seen { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        array_2d(
            py,
            bias,
            self.inner.positions.len(),
            self.inner.positions.len(),
        )
    }
    fn __len__(&self) -> usize {
        self.inner.positions.len()
    }
}

/// A batch's compiled trees in the batch's flat node layout.
#[pyclass(frozen, name = "CompiledBatch", module = "ddtree._core")]
struct PyCompiledBatch {
    inner: CompiledBatch,
}

#[pymethods]
impl PyCompiledBatch {
    /// int64 `[T]`.
    #[getter]
    fn positions<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.positions)
    }
    /// uint32 `[T, words]`, rows index their own request's nodes locally;
    /// one `words` for the whole batch.
    #[getter]
    fn ancestor_bits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<u32>>> {
        array_2d(
            py,
            self.inner.ancestor_bits.clone(),
            self.inner.positions.len(),
            self.inner.words,
        )
    }
    /// bool `[R, N, N]` (N: the largest tree): `masks[r, i, j]` when node i of
    /// request r sees its node j; padding is False.
    fn dense_masks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray3<bool>>> {
        let n = self.inner.max_nodes();
        let requests = self.inner.node_offsets.len() - 1;
        PyArray1::from_vec(py, self.inner.dense_masks()?).reshape([requests, n, n])
    }
    /// int32 `[T, window]`, tree-local indices; negative: committed history.
    #[getter]
    fn windows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        array_2d(
            py,
            self.inner.windows.clone(),
            self.inner.positions.len(),
            self.inner.window,
        )
    }
}

/// The outcome of one verification step for a batch.
#[pyclass(frozen, name = "AcceptedBatch", module = "ddtree._core")]
struct PyAcceptedBatch {
    inner: AcceptedBatch,
}

#[pymethods]
impl PyAcceptedBatch {
    /// int32 `[R, L + 1]`: accepted node indices (tree-local), root first, -1 padded.
    #[getter]
    fn paths<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        array_2d(
            py,
            self.inner.paths.clone(),
            self.inner.bonus.len(),
            self.inner.width,
        )
    }
    /// int64 `[R, L + 1]`: accepted draft tokens then the bonus, -1 padded.
    #[getter]
    fn output_tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        array_2d(
            py,
            self.inner.output_tokens.clone(),
            self.inner.bonus.len(),
            self.inner.width,
        )
    }
    /// int32 `[R]`: accepted draft tokens per request.
    #[getter]
    fn accepted<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, &self.inner.accepted)
    }
    /// int64 `[R]`.
    #[getter]
    fn bonus<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.bonus)
    }
    /// int64 `[M]`: KV sources, as indices into the batch's flat verified tokens.
    #[getter]
    fn kv_src<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.kv_src)
    }
    /// int64 `[M]`: KV destinations, same indexing.
    #[getter]
    fn kv_dst<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.inner.kv_dst)
    }
}

// ------------------------------------------------------------ compile/accept

/// compile_tree(tree, start=0, window=0) -> CompiledTree
///
/// Positions `start + depth`, packed ancestor bits, and (window > 0, for
/// hybrid models: conv kernel width - 1) each node's conv-window ancestors.
#[pyfunction]
#[pyo3(signature = (tree, start=None, window=None))]
fn compile_tree(
    py: Python<'_>,
    tree: &PyTree,
    start: Option<&Bound<'_, PyAny>>,
    window: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyCompiledTree> {
    let start = start.map(|s| int64(s, "start")).transpose()?.unwrap_or(0);
    let window = window.map(|w| count(w, "window")).transpose()?.unwrap_or(0);
    let inner = run_core(
        py,
        tree.inner.len().saturating_mul(window.saturating_add(1)),
        || CompiledTree::new(tree.inner.view(), start, window),
    )?;
    Ok(PyCompiledTree { inner })
}

/// compile_trees(batch, starts=0, window=0) -> CompiledBatch
#[pyfunction]
#[pyo3(signature = (batch, starts=None, window=None))]
fn compile_trees(
    py: Python<'_>,
    batch: &PyTreeBatch,
    starts: Option<&Bound<'_, PyAny>>,
    window: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyCompiledBatch> {
    let requests = batch.inner.requests();
    let starts = match starts {
        Some(s) => per_request_ints(s, "starts", requests)?,
        None => vec![0; requests],
    };
    let window = window.map(|w| count(w, "window")).transpose()?.unwrap_or(0);
    let inner = run_core(
        py,
        batch
            .inner
            .total_nodes()
            .saturating_mul(window.saturating_add(1)),
        || batch::compile_trees(&batch.inner, &starts, window),
    )?;
    Ok(PyCompiledBatch { inner })
}

fn target_tokens(obj: &Bound<'_, PyAny>, expected: &'static str) -> PyResult<Vec<i64>> {
    let array = ndarray(obj, "target_tokens", expected)?;
    if let Ok(a) = array.cast::<PyArrayDyn<i64>>() {
        return Ok(slice_of(a).into_owned());
    }
    let a = typed::<i32>(array, "target_tokens", "int32 or int64")?;
    Ok(slice_of(a).iter().map(|&t| t as i64).collect())
}

/// accept(tree, target_tokens) -> (path, bonus)
///
/// `target_tokens` int32/int64 `[n + 1]`: the target's token at each node
/// (argmax at temperature 0, else a sample with the request's own sampling
/// parameters). Walks from the root while the target's token is one of the
/// current node's children. `path`: int32 accepted node indices, root first;
/// `bonus`: the target's token at the last accepted node.
///
/// Lossless at any temperature: every emitted token is the target's own
/// sample at its context (an accepted draft token equals it), so the output
/// is distributed exactly as autoregressive sampling from the target.
#[pyfunction]
fn accept<'py>(
    py: Python<'py>,
    tree: &PyTree,
    target_tokens: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
    let target = self::target_tokens(target_tokens, "[n + 1]")?;
    let (path, bonus) = run_core(py, target.len(), || {
        WALKER.with_borrow_mut(|w| w.accept(tree.inner.view(), &target))
    })?;
    let path = array_1d(py, path).into_any();
    let bonus = bonus.into_pyobject(py)?.into_any();
    PyTuple::new(py, [path, bonus])
}

/// accept_trees(batch, target_tokens) -> AcceptedBatch
///
/// `target_tokens` int32/int64 `[T]`, one per node of the batch (flat layout).
#[pyfunction]
fn accept_trees(
    py: Python<'_>,
    batch: &PyTreeBatch,
    target_tokens: &Bound<'_, PyAny>,
) -> PyResult<PyAcceptedBatch> {
    let target = self::target_tokens(target_tokens, "[T]")?;
    let inner = run_core(py, target.len(), || {
        batch::accept_trees(&batch.inner, &target)
    })?;
    Ok(PyAcceptedBatch { inner })
}

/// kv_move_plan(path) -> (src, dst)
///
/// The moves (tree-local slots, int64) that put an accepted path's K/V into
/// consecutive slots; safe to apply in order or all at once.
#[pyfunction]
fn kv_move_plan<'py>(py: Python<'py>, path: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
    let array = ndarray(path, "path", "[m]")?;
    let path = slice_of(typed::<i32>(array, "path", "int32")?).into_owned();
    check_path(&path)?;
    let (src, dst): (Vec<i64>, Vec<i64>) =
        kv_moves(&path).map(|(s, d)| (s as i64, d as i64)).unzip();
    PyTuple::new(py, [array_1d(py, src), array_1d(py, dst)])
}

fn check_path(path: &[i32]) -> PyResult<()> {
    if path.first() != Some(&0) {
        return Err(DdtreeError::value("path", "must start with the root, node 0").into());
    }
    if path.windows(2).any(|w| w[1] <= w[0]) {
        return Err(DdtreeError::value("path", "node indices must be strictly increasing").into());
    }
    Ok(())
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
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_BUDGET", limits::MAX_BUDGET)?;
    m.add("MAX_BATCH_NODES", limits::MAX_BATCH_NODES)?;
    m.add("MAX_WINDOW", limits::MAX_WINDOW)?;
    m.add("MAX_THREADS", limits::MAX_THREADS)?;
    m.add("MAX_BIT_WORDS", limits::MAX_BIT_WORDS)?;
    m.add("MAX_DENSE_NODES", limits::MAX_DENSE_NODES)?;
    Ok(())
}
