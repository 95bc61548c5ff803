//! `build_tree` and `build_trees`.

use super::*;

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
}

/// build_tree(log_probs, token_ids, budget) -> Tree
///
/// The draft tree of the `budget` most probable prefixes under the drafter's
/// factorized distribution. `log_probs`: float32 `[L, K]`, each row
/// non-increasing (top-k order); `token_ids`: int32/int64 `[L, K]`, distinct
/// per row; `budget`: int >= 0, the number of draft nodes (root excluded).
#[pyfunction]
pub(crate) fn build_tree(
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
pub(crate) fn build_trees(
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
