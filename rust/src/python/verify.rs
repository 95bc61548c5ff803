//! `compile_tree(s)`, `accept(_trees)` and `kv_move_plan`.

use super::*;

thread_local! {
    // Reused across calls on a thread: the walk's scratch grows to the largest tree seen.
    static WALKER: std::cell::RefCell<TreeWalker> = std::cell::RefCell::new(TreeWalker::new());
}

// ------------------------------------------------------------ compile/accept

/// compile_tree(tree, start=0, window=0) -> CompiledTree
///
/// Positions `start + depth`, packed ancestor bits, and (window > 0, for
/// hybrid models: conv kernel width - 1) each node's conv-window ancestors.
#[pyfunction]
#[pyo3(signature = (tree, start=None, window=None))]
pub(crate) fn compile_tree(
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
pub(crate) fn compile_trees(
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
pub(crate) fn accept<'py>(
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
pub(crate) fn accept_trees(
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
pub(crate) fn kv_move_plan<'py>(
    py: Python<'py>,
    path: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
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
