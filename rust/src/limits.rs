//! The documented limits of the core's inputs.
//!
//! Past them a call returns [`DdtreeError::Value`] naming the argument, the limit and the value, instead of
//! attempting an allocation that cannot succeed: Rust aborts the whole process when an allocation fails,
//! which inside an inference server would take every request down with it. Each limit is far above what
//! speculative decoding uses (budgets of 16-1024, conv windows of 3).

use crate::error::{DdtreeError, Result};

/// Largest tree budget (draft nodes per tree, root excluded).
pub const MAX_BUDGET: usize = 1 << 16;
/// Largest number of nodes in one batch of trees, roots included.
pub const MAX_BATCH_NODES: usize = 1 << 24;
/// Largest conv window (ancestors kept per node for hybrid GDN layers).
pub const MAX_WINDOW: usize = 64;
/// Most threads an `Executor` may run.
pub const MAX_THREADS: usize = 1024;
/// Largest ancestor-bit matrix of one compile call, in 32-bit words (1 GiB).
pub const MAX_BIT_WORDS: usize = 1 << 28;
/// Largest tree a dense `[n, n]` mask or bias is made for (the packed bits have no such limit).
pub const MAX_DENSE_NODES: usize = 1 << 13;

/// `value <= limit`, else an error naming `arg`.
pub(crate) fn at_most(arg: &'static str, value: usize, limit: usize) -> Result<usize> {
    if value > limit {
        return Err(DdtreeError::value(
            arg,
            format!("must be at most {limit}, got {value}"),
        ));
    }
    Ok(value)
}

/// `start + depth` for a position, or an error when it leaves `i64`.
pub(crate) fn position(start: i64, depth: i32) -> Result<i64> {
    start.checked_add(i64::from(depth)).ok_or_else(|| {
        DdtreeError::value(
            "start",
            format!("start + depth overflows a 64-bit position (start {start}, depth {depth})"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_name_the_argument_the_limit_and_the_value() {
        assert_eq!(at_most("budget", 5, 5), Ok(5));
        let err = at_most("budget", 6, 5).unwrap_err().to_string();
        assert_eq!(err, "budget: must be at most 5, got 6");
        assert_eq!(position(10, 3), Ok(13));
        assert!(position(i64::MAX, 1)
            .unwrap_err()
            .to_string()
            .contains("overflows"));
        assert_eq!(position(i64::MAX, 0), Ok(i64::MAX));
    }
}
