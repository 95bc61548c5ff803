//! `verify_layout_into` and `acceptance_layout_into`: one step's layouts written into caller-owned arrays.

use numpy::PyReadwriteArrayDyn;

use super::*;
use crate::layout::{self, AcceptanceLayout, NodeArrays, StepPlacement, VerifyLayout};

/// A C-contiguous, writable output array of `dims` dimensions and element type `T`, borrowed for this call
/// (rust-numpy's borrow registry refuses two outputs that share memory).
fn output<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    arg: &'static str,
    expected: &'static str,
    dtype: &'static str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    let array = ndarray(obj, arg, expected)?;
    let typed = typed::<T>(array, arg, dtype)?;
    if !typed.is_c_contiguous() {
        return Err(DdtreeError::value(arg, "must be a C-contiguous array").into());
    }
    typed.try_readwrite().map_err(|_| {
        DdtreeError::value(
            arg,
            "must be writable and share no memory with another argument",
        )
        .into()
    })
}

/// [`output`] of an argument that may be None.
fn optional_output<'py, T: Element>(
    obj: Option<&Bound<'py, PyAny>>,
    arg: &'static str,
    expected: &'static str,
    dtype: &'static str,
) -> PyResult<Option<PyReadwriteArrayDyn<'py, T>>> {
    obj.map(|o| output::<T>(o, arg, expected, dtype))
        .transpose()
}

fn slice_mut<'a, T: Element>(array: &'a mut PyReadwriteArrayDyn<'_, T>) -> &'a mut [T] {
    array
        .as_slice_mut()
        .expect("checked C-contiguous in output()")
}

/// The last dimension of a 2-D output (its row width).
fn width(array: &PyReadwriteArrayDyn<'_, impl Element>) -> usize {
    array.shape()[1]
}

/// `ancestor_bits`: uint32 or int32 (the GPU kernels read int32 words), `[T, words]`.
enum Bits<'py> {
    Unsigned(PyReadwriteArrayDyn<'py, u32>),
    Signed(PyReadwriteArrayDyn<'py, i32>),
}

impl<'py> Bits<'py> {
    fn new(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        let (arg, expected) = ("ancestor_bits", "[T, words]");
        let array = ndarray(obj, arg, expected)?;
        if array.cast::<PyArrayDyn<i32>>().is_ok() {
            return Ok(Bits::Signed(output(obj, arg, expected, "uint32 or int32")?));
        }
        Ok(Bits::Unsigned(output(
            obj,
            arg,
            expected,
            "uint32 or int32",
        )?))
    }

    fn words(&self) -> usize {
        match self {
            Bits::Unsigned(a) => width(a),
            Bits::Signed(a) => width(a),
        }
    }

    fn as_u32(&mut self) -> &mut [u32] {
        match self {
            Bits::Unsigned(a) => slice_mut(a),
            Bits::Signed(a) => {
                let words = slice_mut(a);
                // SAFETY: i32 and u32 have one size and alignment; every bit pattern is valid for both.
                unsafe {
                    std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u32>(), words.len())
                }
            }
        }
    }
}

/// verify_layout_into(batch, rows, starts, query_starts, logit_starts, *, token_index, logit_rows,
/// positions, ancestor_bits, row_start, node_offsets, conv_index=None, depths=None, root_index=None,
/// node_parents=None, node_tree=None, node_local=None, node_tokens=None, draft_step_index=None,
/// draft_tokens=None) -> None
#[pyfunction]
#[pyo3(signature = (
    batch, rows, starts, query_starts, logit_starts, *,
    token_index, logit_rows, positions, ancestor_bits, row_start, node_offsets, conv_index=None,
    depths=None, root_index=None, node_parents=None, node_tree=None, node_local=None, node_tokens=None,
    draft_step_index=None, draft_tokens=None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn verify_layout_into(
    py: Python<'_>,
    batch: &PyTreeBatch,
    rows: &Bound<'_, PyAny>,
    starts: &Bound<'_, PyAny>,
    query_starts: &Bound<'_, PyAny>,
    logit_starts: &Bound<'_, PyAny>,
    token_index: &Bound<'_, PyAny>,
    logit_rows: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    ancestor_bits: &Bound<'_, PyAny>,
    row_start: &Bound<'_, PyAny>,
    node_offsets: &Bound<'_, PyAny>,
    conv_index: Option<&Bound<'_, PyAny>>,
    depths: Option<&Bound<'_, PyAny>>,
    root_index: Option<&Bound<'_, PyAny>>,
    node_parents: Option<&Bound<'_, PyAny>>,
    node_tree: Option<&Bound<'_, PyAny>>,
    node_local: Option<&Bound<'_, PyAny>>,
    node_tokens: Option<&Bound<'_, PyAny>>,
    draft_step_index: Option<&Bound<'_, PyAny>>,
    draft_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let requests = batch.inner.requests();
    let rows = per_request_ints(rows, "rows", requests)?;
    let starts = per_request_ints(starts, "starts", requests)?;
    let query_starts = per_request_ints(query_starts, "query_starts", requests)?;
    let logit_starts = per_request_ints(logit_starts, "logit_starts", requests)?;
    let (t, dtype) = ("[T]", "int64");
    let mut token_index = output::<i64>(token_index, "token_index", t, dtype)?;
    let mut logit_rows = output::<i64>(logit_rows, "logit_rows", t, dtype)?;
    let mut positions = output::<i64>(positions, "positions", t, dtype)?;
    let mut bits = Bits::new(ancestor_bits)?;
    let mut row_start = output::<i32>(row_start, "row_start", "[num_rows]", "int32")?;
    let mut node_offsets = output::<i32>(node_offsets, "node_offsets", "[R + 1]", "int32")?;
    let mut conv = optional_output::<i64>(conv_index, "conv_index", "[T, window + 1]", dtype)?;
    let window = match &conv {
        Some(c) if width(c) < 2 => {
            return Err(
                DdtreeError::value("conv_index", "needs at least 2 columns (window + 1)").into(),
            )
        }
        Some(c) => width(c) - 1,
        None => 0,
    };
    let mut depths = optional_output::<i64>(depths, "depths", t, dtype)?;
    let mut root_index = optional_output::<i64>(root_index, "root_index", t, dtype)?;
    let mut node_parents = optional_output::<i64>(node_parents, "node_parents", t, dtype)?;
    let mut node_tree = optional_output::<i64>(node_tree, "node_tree", t, dtype)?;
    let mut node_local = optional_output::<i64>(node_local, "node_local", t, dtype)?;
    let mut node_tokens = optional_output::<i64>(node_tokens, "node_tokens", t, dtype)?;
    let mut draft_step_index =
        optional_output::<i64>(draft_step_index, "draft_step_index", "[T - R]", dtype)?;
    let mut draft_tokens =
        optional_output::<i32>(draft_tokens, "draft_tokens", "[T - R]", "int32")?;
    let words = bits.words();
    let place = StepPlacement {
        rows: &rows,
        starts: &starts,
        query_starts: &query_starts,
        logit_starts: &logit_starts,
    };
    let out = VerifyLayout {
        token_index: slice_mut(&mut token_index),
        logit_rows: slice_mut(&mut logit_rows),
        positions: slice_mut(&mut positions),
        ancestor_bits: bits.as_u32(),
        words,
        row_start: slice_mut(&mut row_start),
        node_offsets: slice_mut(&mut node_offsets),
        conv_index: conv.as_mut().map(slice_mut).unwrap_or_default(),
        window,
        nodes: NodeArrays {
            depths: depths.as_mut().map(slice_mut),
            root_index: root_index.as_mut().map(slice_mut),
            parents: node_parents.as_mut().map(slice_mut),
            tree: node_tree.as_mut().map(slice_mut),
            local: node_local.as_mut().map(slice_mut),
            tokens: node_tokens.as_mut().map(slice_mut),
            draft_step_index: draft_step_index.as_mut().map(slice_mut),
            draft_tokens: draft_tokens.as_mut().map(slice_mut),
        },
    };
    let elements = batch
        .inner
        .total_nodes()
        .saturating_mul(words + window + 12);
    run_core(py, elements, || {
        layout::verify_layout_into(&batch.inner, place, out)
    })
}

/// acceptance_layout_into(batch, accepted, query_starts, *, output_tokens, kv_src, kv_dst, context_order,
/// paths, path_lengths, commit_conv_index=None) -> None
#[pyfunction]
#[pyo3(signature = (
    batch, accepted, query_starts, *,
    output_tokens, kv_src, kv_dst, context_order, paths, path_lengths, commit_conv_index=None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn acceptance_layout_into(
    py: Python<'_>,
    batch: &PyTreeBatch,
    accepted: &PyAcceptedBatch,
    query_starts: &Bound<'_, PyAny>,
    output_tokens: &Bound<'_, PyAny>,
    kv_src: &Bound<'_, PyAny>,
    kv_dst: &Bound<'_, PyAny>,
    context_order: &Bound<'_, PyAny>,
    paths: &Bound<'_, PyAny>,
    path_lengths: &Bound<'_, PyAny>,
    commit_conv_index: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let query_starts = per_request_ints(query_starts, "query_starts", batch.inner.requests())?;
    let mut output_tokens = output::<i32>(output_tokens, "output_tokens", "[R, width]", "int32")?;
    let mut kv_src = output::<i64>(kv_src, "kv_src", "[M]", "int64")?;
    let mut kv_dst = output::<i64>(kv_dst, "kv_dst", "[M]", "int64")?;
    let mut context_order = output::<i64>(context_order, "context_order", "[num_tokens]", "int64")?;
    let mut paths = output::<i32>(paths, "paths", "[R, path width]", "int32")?;
    let mut path_lengths = output::<i32>(path_lengths, "path_lengths", "[R]", "int32")?;
    let mut commit = commit_conv_index
        .map(|c| output::<i64>(c, "commit_conv_index", "[R, window]", "int64"))
        .transpose()?;
    let (out_width, path_width) = (width(&output_tokens), width(&paths));
    let window = commit.as_ref().map(width).unwrap_or(0);
    let out = AcceptanceLayout {
        output_tokens: slice_mut(&mut output_tokens),
        out_width,
        kv_src: slice_mut(&mut kv_src),
        kv_dst: slice_mut(&mut kv_dst),
        context_order: slice_mut(&mut context_order),
        paths: slice_mut(&mut paths),
        path_width,
        path_lengths: slice_mut(&mut path_lengths),
        commit_conv_index: commit.as_mut().map(slice_mut).unwrap_or_default(),
        window,
    };
    let elements = out.context_order.len() + out.output_tokens.len() + out.paths.len();
    run_core(py, elements, || {
        layout::acceptance_layout_into(&batch.inner, &accepted.inner, &query_starts, out)
    })
}
