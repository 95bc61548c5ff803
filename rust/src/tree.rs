//! The draft tree and the drafter's per-position distributions it is built from.
//!
//! Node 0 is the root (the last committed token, whose successor the drafter
//! predicts); nodes 1..=n are draft tokens in the order the best-first search
//! emitted them, so `parents[i] < i` and scores never increase along the order.

use crate::error::{DdtreeError, Result};

/// A token id type the core accepts from callers (`int32` or `int64` arrays).
pub trait TokenId: Copy + Send + Sync + 'static {
    fn to_i64(self) -> i64;
}

impl TokenId for i32 {
    #[inline]
    fn to_i64(self) -> i64 {
        self as i64
    }
}

impl TokenId for i64 {
    #[inline]
    fn to_i64(self) -> i64 {
        self
    }
}

/// The drafter's top-K candidates for each of the next `depth` positions:
/// row-major `[depth, width]` log-probabilities (each row non-increasing) and
/// the matching token ids.
#[derive(Clone, Copy, Debug)]
pub struct DraftDistribution<'a, T: TokenId> {
    pub log_probs: &'a [f32],
    pub token_ids: &'a [T],
    /// L: the number of draft positions.
    pub depth: usize,
    /// K: candidates kept per position.
    pub width: usize,
}

impl<'a, T: TokenId> DraftDistribution<'a, T> {
    /// Wraps row-major buffers, checking only that the sizes agree.
    pub fn new(
        log_probs: &'a [f32],
        token_ids: &'a [T],
        depth: usize,
        width: usize,
    ) -> Result<Self> {
        let expected = depth.checked_mul(width).ok_or_else(|| {
            DdtreeError::value("log_probs", format!("[{depth}, {width}] is too large"))
        })?;
        if log_probs.len() != expected {
            return Err(DdtreeError::shape(
                "log_probs",
                format!("[{depth}, {width}] ({expected} values)"),
                format!("{} values", log_probs.len()),
            ));
        }
        if token_ids.len() != expected {
            return Err(DdtreeError::shape(
                "token_ids",
                format!("[{depth}, {width}] like log_probs ({expected} values)"),
                format!("{} values", token_ids.len()),
            ));
        }
        Ok(Self {
            log_probs,
            token_ids,
            depth,
            width,
        })
    }

    #[inline]
    pub fn log_prob(&self, position: usize, rank: usize) -> f32 {
        self.log_probs[position * self.width + rank]
    }

    #[inline]
    pub fn token(&self, position: usize, rank: usize) -> i64 {
        self.token_ids[position * self.width + rank].to_i64()
    }

    /// Number of nodes (root excluded) the tree gets for `budget`: every
    /// prefix counts, `-inf` ones included, so this is known before building.
    pub fn node_count(&self, budget: usize) -> usize {
        let mut total = 0usize;
        let mut level = 1usize;
        for _ in 0..self.depth {
            level = level.saturating_mul(self.width);
            total = total.saturating_add(level);
            if total >= budget || level == 0 {
                break;
            }
        }
        total.min(budget)
    }
}

/// A borrowed tree: the layout shared by [`Tree`] and one request of a
/// [`crate::batch::TreeBatch`].
#[derive(Clone, Copy, Debug)]
pub struct TreeView<'a> {
    /// `[n]`: token of node i is `tokens[i - 1]`.
    pub tokens: &'a [i64],
    /// `[n + 1]`: `parents[0] == -1`, `parents[i] < i`.
    pub parents: &'a [i32],
    /// `[n + 1]`: `depths[0] == 0`.
    pub depths: &'a [i32],
    /// `[n + 1]`: cumulative draft log-probability, `scores[0] == 0`.
    pub scores: &'a [f32],
}

impl TreeView<'_> {
    /// Number of nodes including the root.
    #[inline]
    pub fn len(&self) -> usize {
        self.parents.len()
    }

    /// A tree always has its root.
    #[inline]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Deepest node's depth.
    pub fn max_depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0) as usize
    }

    /// Expected number of tokens one verification step yields under the
    /// drafter's own (factorized) distribution: one per accepted node plus the
    /// target's bonus token. DDTree's objective; the paper's Eq. for E[tau].
    pub fn expected_acceptance(&self) -> f64 {
        1.0 + self.scores[1..]
            .iter()
            .map(|&s| (s as f64).exp())
            .sum::<f64>()
    }

    /// Checks the structural invariants; used on trees that come from callers.
    pub fn validate(&self) -> Result<()> {
        let n = self.tokens.len();
        if self.parents.len() != n + 1 || self.depths.len() != n + 1 || self.scores.len() != n + 1 {
            return Err(DdtreeError::shape(
                "tree",
                format!("parents, depths and scores of length n + 1 = {}", n + 1),
                format!(
                    "parents {}, depths {}, scores {}",
                    self.parents.len(),
                    self.depths.len(),
                    self.scores.len()
                ),
            ));
        }
        if self.parents[0] != -1 || self.depths[0] != 0 {
            return Err(DdtreeError::value(
                "tree",
                "node 0 must be the root (parent -1, depth 0)",
            ));
        }
        for i in 1..=n {
            let p = self.parents[i];
            if p < 0 || p as usize >= i {
                return Err(DdtreeError::value(
                    "tree",
                    format!("parents[{i}] = {p}, expected 0 <= parent < {i}"),
                ));
            }
            if self.depths[i] != self.depths[p as usize] + 1 {
                return Err(DdtreeError::value(
                    "tree",
                    format!(
                        "depths[{i}] = {} is not its parent's depth + 1",
                        self.depths[i]
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// An owned draft tree (see the module docs for the layout).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tree {
    pub tokens: Vec<i64>,
    pub parents: Vec<i32>,
    pub depths: Vec<i32>,
    pub scores: Vec<f32>,
}

impl Tree {
    /// A tree with `n` non-root nodes, every field zeroed except the root.
    pub fn with_nodes(n: usize) -> Self {
        let mut tree = Tree {
            tokens: zeroed(n),
            parents: zeroed(n + 1),
            depths: zeroed(n + 1),
            scores: zeroed(n + 1),
        };
        tree.parents[0] = -1;
        tree
    }

    pub fn view(&self) -> TreeView<'_> {
        TreeView {
            tokens: &self.tokens,
            parents: &self.parents,
            depths: &self.depths,
            scores: &self.scores,
        }
    }

    /// Number of nodes including the root.
    pub fn len(&self) -> usize {
        self.parents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }
}

/// `len` zeros, allocated by `malloc` and then filled rather than by
/// `calloc` (what `vec![0; len]` asks for): for the small buffers of a tree,
/// `calloc` bypasses the allocator's per-thread cache and costs several
/// times more than the fill.
fn zeroed<T: Copy + Default>(len: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    v.resize(len, T::default());
    v
}

/// Mutable destination for one tree: disjoint slices of flat batch buffers,
/// or the fields of a [`Tree`]. Every slot is rewritten by a build.
pub struct TreeSlots<'a> {
    pub tokens: &'a mut [i64],
    pub parents: &'a mut [i32],
    pub depths: &'a mut [i32],
    pub scores: &'a mut [f32],
}

impl<'a> From<&'a mut Tree> for TreeSlots<'a> {
    fn from(tree: &'a mut Tree) -> Self {
        TreeSlots {
            tokens: &mut tree.tokens,
            parents: &mut tree.parents,
            depths: &mut tree.depths,
            scores: &mut tree.scores,
        }
    }
}
