//! The Python classes: `Executor`, `Tree`, `TreeBatch`, `CompiledTree`, `CompiledBatch`, `AcceptedBatch`.

use super::*;

// ------------------------------------------------------------ classes

/// A thread pool for batched calls, created on first use (never at import,
/// and anew after a fork). Frozen: safe to share between threads.
#[pyclass(frozen, name = "Executor", module = "ddtree._core")]
pub(crate) struct PyExecutor {
    pub(crate) inner: Executor,
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
pub(crate) struct PyTree {
    pub(crate) inner: Tree,
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
pub(crate) struct PyTreeBatch {
    pub(crate) inner: TreeBatch,
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
pub(crate) struct PyCompiledTree {
    pub(crate) inner: CompiledTree,
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
pub(crate) struct PyCompiledBatch {
    pub(crate) inner: CompiledBatch,
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
pub(crate) struct PyAcceptedBatch {
    pub(crate) inner: AcceptedBatch,
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
