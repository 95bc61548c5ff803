//! Argument conversion: numpy arrays and ints, with errors that name the argument.

use super::*;

// ---------------------------------------------------------------- arguments

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .qualname()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// An ndarray argument with its expected number of dimensions checked.
pub(crate) fn ndarray<'a, 'py>(
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
pub(crate) fn slice_of<'a, T: Element + Copy>(array: &'a Bound<'_, PyArrayDyn<T>>) -> Cow<'a, [T]> {
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

pub(crate) fn typed<'a, 'py, T: Element>(
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
pub(crate) fn count(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<usize> {
    let value: i64 = obj.extract().map_err(|_| out_of_range_or_type(obj, arg))?;
    usize::try_from(value)
        .map_err(|_| DdtreeError::value(arg, format!("must be >= 0, got {value}")).into())
}

/// A signed 64-bit integer argument (a Python int or numpy integer scalar).
pub(crate) fn int64(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyResult<i64> {
    obj.extract().map_err(|_| out_of_range_or_type(obj, arg))
}

/// Why an int argument did not convert to i64: too large for 64 bits (ValueError), or not an int.
pub(crate) fn out_of_range_or_type(obj: &Bound<'_, PyAny>, arg: &'static str) -> PyErr {
    if obj.is_instance_of::<PyInt>() {
        return DdtreeError::value(arg, format!("{obj} does not fit in a 64-bit integer")).into();
    }
    PyTypeError::new_err(format!("{arg}: expected an int, got {}", type_name(obj)))
}

/// An int broadcast to `n` entries, or a sequence/array of exactly `n` ints.
pub(crate) fn per_request_ints(
    obj: &Bound<'_, PyAny>,
    arg: &'static str,
    n: usize,
) -> PyResult<Vec<i64>> {
    if let Ok(value) = obj.extract::<i64>() {
        return Ok(vec![value; n]);
    }
    if obj.is_instance_of::<PyInt>() {
        return Err(out_of_range_or_type(obj, arg));
    }
    // The common case inside an engine's step: a 1-D int64 array, read without a Python object per element.
    let int64_array = obj.cast::<PyArrayDyn<i64>>().ok().filter(|a| a.ndim() == 1);
    let values: Vec<i64> = match int64_array {
        Some(array) => slice_of(array).into_owned(),
        None => obj.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{arg}: expected an int or a sequence of {n} ints, got {}",
                type_name(obj)
            ))
        })?,
    };
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

pub(crate) fn array_1d<'py, T: Element>(py: Python<'py>, v: Vec<T>) -> Bound<'py, PyArray1<T>> {
    PyArray1::from_vec(py, v)
}

/// A `[rows, cols]` array from row-major values (rows given: cols may be 0).
pub(crate) fn array_2d<'py, T: Element>(
    py: Python<'py>,
    v: Vec<T>,
    rows: usize,
    cols: usize,
) -> PyResult<Bound<'py, PyArray2<T>>> {
    PyArray1::from_vec(py, v).reshape([rows, cols])
}
