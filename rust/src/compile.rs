//! Compilation of a tree into what one verification forward pass needs.
//!
//! The target sees the tree flattened in node order, `[root, node 1..n]`:
//! - positions: `start + depth`, so siblings share a rotary position;
//! - visibility: node i attends to the committed prefix and to its ancestors
//!   and itself; stored as packed bit rows (bit j of row i: j is an ancestor of
//!   i or i itself), 32 nodes per `u32` word, little-endian within a word;
//! - conv windows (hybrid GDN layers): the last `w` ancestors of each node,
//!   oldest first, with `-1, -2, ...` naming the newest, next newest, ...
//!   entries of the already-committed conv history once the root path runs out;
//! - after acceptance, the KV move plan: accepted node `path[k]` moves from
//!   verified slot `path[k]` to slot `k`, so the accepted tokens end up in
//!   consecutive cache slots exactly as a chain would have left them.

use crate::error::{DdtreeError, Result};
use crate::limits::{at_most, position, MAX_BIT_WORDS, MAX_DENSE_NODES, MAX_WINDOW};
use crate::tree::TreeView;

/// Number of `u32` words in one visibility row of a tree of `nodes` nodes.
#[inline]
pub fn words_per_row(nodes: usize) -> usize {
    nodes.div_ceil(32)
}

/// Caller-owned output of one tree's compilation; every element is written.
pub struct CompiledSlots<'a> {
    /// `[N]`
    pub positions: &'a mut [i64],
    /// `[N, words]`, `words >= words_per_row(N)`; padding words are zeroed.
    pub ancestor_bits: &'a mut [u32],
    pub words: usize,
    /// `[N, window]`
    pub windows: &'a mut [i32],
    pub window: usize,
}

/// The compiled form of one tree, owned.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledTree {
    pub positions: Vec<i64>,
    pub ancestor_bits: Vec<u32>,
    pub words: usize,
    pub windows: Vec<i32>,
    pub window: usize,
}

impl CompiledTree {
    pub fn new(tree: TreeView<'_>, start: i64, window: usize) -> Result<Self> {
        let n = tree.len();
        let words = words_per_row(n);
        check_compile_sizes(n, words, window)?;
        let mut out = CompiledTree {
            positions: vec![0; n],
            ancestor_bits: vec![0; n * words],
            words,
            windows: vec![0; n * window],
            window,
        };
        compile_into(
            tree,
            start,
            CompiledSlots {
                positions: &mut out.positions,
                ancestor_bits: &mut out.ancestor_bits,
                words,
                windows: &mut out.windows,
                window,
            },
        )?;
        Ok(out)
    }

    /// Dense `[N, N]` visibility (row-major): `true` where node i sees node j; trees of at most
    /// [`MAX_DENSE_NODES`] nodes (the packed bits serve any size).
    pub fn dense_mask(&self) -> Result<Vec<bool>> {
        let n = self.positions.len();
        at_most("tree nodes (for a dense mask)", n, MAX_DENSE_NODES)?;
        let mut mask = vec![false; n * n];
        for (i, row) in mask.chunks_exact_mut(n.max(1)).enumerate().take(n) {
            let bits = &self.ancestor_bits[i * self.words..(i + 1) * self.words];
            for (j, seen) in row.iter_mut().enumerate() {
                *seen = bits[j / 32] >> (j % 32) & 1 == 1;
            }
        }
        Ok(mask)
    }
}

/// Compiles `tree` into `out`; see the module docs for the layout.
pub fn compile_into(tree: TreeView<'_>, start: i64, out: CompiledSlots<'_>) -> Result<()> {
    let n = tree.len();
    let CompiledSlots {
        positions,
        ancestor_bits,
        words,
        windows,
        window,
    } = out;
    if positions.len() != n
        || words < words_per_row(n)
        || ancestor_bits.len() != n * words
        || windows.len() != n * window
    {
        return Err(DdtreeError::Internal(format!(
            "compile output sized wrongly for a tree of {n} nodes"
        )));
    }
    for (p, &d) in positions.iter_mut().zip(tree.depths) {
        *p = position(start, d)?;
    }
    fill_ancestor_bits(tree.parents, ancestor_bits, words);
    fill_conv_windows(tree.parents, windows, window);
    Ok(())
}

/// The limits of one compile call: the window, and the ancestor bits of `nodes` rows of `words` words.
pub(crate) fn check_compile_sizes(nodes: usize, words: usize, window: usize) -> Result<()> {
    at_most("window", window, MAX_WINDOW)?;
    at_most(
        "tree nodes x ancestor-bit words",
        nodes.saturating_mul(words),
        MAX_BIT_WORDS,
    )?;
    Ok(())
}

/// Row i = row(parent(i)) | bit i; parents come first, so one pass suffices.
fn fill_ancestor_bits(parents: &[i32], bits: &mut [u32], words: usize) {
    bits.fill(0);
    for (i, &parent) in parents.iter().enumerate() {
        if parent >= 0 {
            let (done, rest) = bits.split_at_mut(i * words);
            let p = parent as usize;
            rest[..words].copy_from_slice(&done[p * words..(p + 1) * words]);
        }
        bits[i * words + i / 32] |= 1 << (i % 32);
    }
}

/// Row i = row(parent(i)) shifted left by one, with the parent appended as the
/// newest entry; the root's row is the history `[-w, ..., -1]`.
fn fill_conv_windows(parents: &[i32], windows: &mut [i32], w: usize) {
    if w == 0 {
        return;
    }
    for (k, slot) in windows[..w].iter_mut().enumerate() {
        *slot = k as i32 - w as i32;
    }
    for (i, &parent) in parents.iter().enumerate().skip(1) {
        let p = parent as usize;
        let (done, rest) = windows.split_at_mut(i * w);
        rest[..w - 1].copy_from_slice(&done[p * w + 1..(p + 1) * w]);
        rest[w - 1] = parent;
    }
}

/// The KV moves that make an accepted path contiguous: `(src, dst)` pairs of
/// tree-local slots, in path order, identity moves left out. Because
/// `path[k] >= k` and the path is increasing, no move overwrites a later
/// move's source, so the moves may run sequentially or all at once.
pub fn kv_moves(path: &[i32]) -> impl Iterator<Item = (i32, i32)> + '_ {
    path.iter()
        .enumerate()
        .map(|(k, &node)| (node, k as i32))
        .filter(|&(src, dst)| src != dst)
}
