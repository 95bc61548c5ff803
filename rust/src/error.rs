//! The one error type of the core. The Python layer maps each variant to a
//! Python exception class in one place (`python/mod.rs`).

use thiserror::Error;

/// Everything that can be wrong with the input of the core's entry points.
///
/// Messages name the argument and say what was expected, because they end up
/// in front of a vLLM user who did not write the call.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum DdtreeError {
    /// An argument has the wrong shape (number of dimensions or sizes).
    #[error("{arg}: expected shape {expected}, got {got}")]
    Shape {
        arg: &'static str,
        expected: String,
        got: String,
    },
    /// An argument has an unsupported element type.
    #[error("{arg}: expected {expected}, got {got}")]
    Dtype {
        arg: &'static str,
        expected: &'static str,
        got: String,
    },
    /// A value is outside what the algorithm accepts.
    #[error("{arg}: {message}")]
    Value { arg: &'static str, message: String },
    /// A bug in ddtree itself (a caught panic); never the caller's fault.
    #[error("internal error in ddtree (please report it): {0}")]
    Internal(String),
}

impl DdtreeError {
    pub(crate) fn value(arg: &'static str, message: impl Into<String>) -> Self {
        DdtreeError::Value {
            arg,
            message: message.into(),
        }
    }

    pub(crate) fn shape(
        arg: &'static str,
        expected: impl Into<String>,
        got: impl Into<String>,
    ) -> Self {
        DdtreeError::Shape {
            arg,
            expected: expected.into(),
            got: got.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, DdtreeError>;
