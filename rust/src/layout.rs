//! One engine step's flat layouts of a batch of trees, written into caller-owned buffers.
//!
//! An engine that runs a batch as one flat list of query tokens (vLLM does) verifies tree r as the step's
//! tokens `query_starts[r] .. query_starts[r] + n_r` (root first, then the nodes in pop order) and reads
//! their logits at rows `logit_starts[r] ..`. Two calls per step cover everything the engine's GPU side needs:
//!
//! - [`verify_layout_into`], before the forward pass: where each node sits in the step, its position, its
//!   ancestor bits, the CSR node offsets, and the rows of each node's GDN conv window;
//! - [`acceptance_layout_into`], after the walk: the chain-format output rows, the KV moves in step-token
//!   indices, the row order that conditions the drafter on the accepted paths, and the GDN commit plan.
//!
//! Each writes every element of its output slices, so the slices may be views of one reused (in vLLM:
//! pinned) host buffer that is then copied to the device in one transfer; nothing is allocated per step
//! beyond a small scratch vector.
//!
//! Conv rows (hybrid GDN targets, window `w` = conv kernel width - 1) index the matrix
//! `cat(histories, tree inputs)`: request r's committed conv history is rows `r*w .. r*w + w - 1`, oldest
//! first, and node t of the flat batch is row `R*w + t`.

use crate::batch::{AcceptedBatch, TreeBatch};
use crate::compile::{compile_into, kv_moves, words_per_row, CompiledSlots};
use crate::error::{DdtreeError, Result};
use crate::limits::{at_most, MAX_WINDOW};
use crate::tree::TreeView;

/// Where each tree of a batch sits in the engine's step (all `[R]`, R = the batch's trees).
#[derive(Clone, Copy, Debug)]
pub struct StepPlacement<'a> {
    /// The tree's row in the engine's batch of requests (rows without a tree have none).
    pub rows: &'a [i64],
    /// The root's position: the request's committed tokens minus one.
    pub starts: &'a [i64],
    /// Index of the root among the step's flat query tokens.
    pub query_starts: &'a [i64],
    /// Logits row of the root.
    pub logit_starts: &'a [i64],
}

/// The verification's buffers; T = the batch's nodes, roots included.
pub struct VerifyLayout<'a> {
    /// `[T]`: each node's index among the step's query tokens.
    pub token_index: &'a mut [i64],
    /// `[T]`: each node's logits row.
    pub logit_rows: &'a mut [i64],
    /// `[T]`: `start + depth`.
    pub positions: &'a mut [i64],
    /// `[T, words]`, tree-local ancestor-or-self bits; `words` may exceed what the largest tree needs
    /// (a fixed row width), the extra words are zero.
    pub ancestor_bits: &'a mut [u32],
    pub words: usize,
    /// `[num_rows]`: each engine row's first `ancestor_bits` row, -1 for rows without a tree.
    pub row_start: &'a mut [i32],
    /// `[R + 1]`: the batch's node offsets.
    pub node_offsets: &'a mut [i32],
    /// `[T, window + 1]`: conv rows of each node's window, oldest first, the node itself last
    /// (empty when `window` is 0).
    pub conv_index: &'a mut [i64],
    pub window: usize,
    /// What an engine's device side needs per node besides the above (each written when given).
    pub nodes: NodeArrays<'a>,
}

/// Per-node arrays of a step for an engine that places the tree tokens and walks the trees on its device,
/// in the batch's node order (T nodes, R trees); each is written when given.
#[derive(Default)]
pub struct NodeArrays<'a> {
    /// `[T]`: the node's depth.
    pub depths: Option<&'a mut [i64]>,
    /// `[T]`: the step index of its tree's root (`query_starts[r]`).
    pub root_index: Option<&'a mut [i64]>,
    /// `[T]`: its parent as a node of the batch (a root: itself).
    pub parents: Option<&'a mut [i64]>,
    /// `[T]`: its tree.
    pub tree: Option<&'a mut [i64]>,
    /// `[T]`: its index within its tree (the root 0).
    pub local: Option<&'a mut [i64]>,
    /// `[T]`: its draft token (a root: 0).
    pub tokens: Option<&'a mut [i64]>,
    /// `[T - R]`: each draft node's index among the step's query tokens ...
    pub draft_step_index: Option<&'a mut [i64]>,
    /// `[T - R]`: ... and its token, for an engine that scheduled placeholders in their place.
    pub draft_tokens: Option<&'a mut [i32]>,
}

impl NodeArrays<'_> {
    fn check(&self, total: usize, r_count: usize) -> Result<()> {
        let per_node = [
            ("depths", &self.depths),
            ("root_index", &self.root_index),
            ("node_parents", &self.parents),
            ("node_tree", &self.tree),
            ("node_local", &self.local),
            ("node_tokens", &self.tokens),
        ];
        for (arg, slot) in per_node {
            if let Some(slot) = slot {
                expect_len(arg, slot.len(), total, "[T]")?;
            }
        }
        let drafts = total - r_count;
        if let Some(slot) = &self.draft_step_index {
            expect_len("draft_step_index", slot.len(), drafts, "[T - R]")?;
        }
        if let Some(slot) = &self.draft_tokens {
            expect_len("draft_tokens", slot.len(), drafts, "[T - R]")?;
        }
        Ok(())
    }

    /// Tree `r`'s nodes (batch nodes `first ..`, its root at step index `first_query`).
    fn fill_tree(
        &mut self,
        tree: TreeView<'_>,
        r: usize,
        first: usize,
        first_query: i64,
    ) -> Result<()> {
        let nodes = first..first + tree.len();
        if let Some(out) = self.depths.as_deref_mut() {
            for (slot, &depth) in out[nodes.clone()].iter_mut().zip(tree.depths) {
                *slot = i64::from(depth);
            }
        }
        if let Some(out) = self.root_index.as_deref_mut() {
            out[nodes.clone()].fill(first_query);
        }
        if let Some(out) = self.parents.as_deref_mut() {
            for (i, (slot, &parent)) in out[nodes.clone()].iter_mut().zip(tree.parents).enumerate()
            {
                let local = if parent >= 0 { parent as usize } else { i };
                *slot = (first + local) as i64;
            }
        }
        if let Some(out) = self.tree.as_deref_mut() {
            out[nodes.clone()].fill(r as i64);
        }
        if let Some(out) = self.local.as_deref_mut() {
            for (i, slot) in out[nodes.clone()].iter_mut().enumerate() {
                *slot = i as i64;
            }
        }
        if let Some(out) = self.tokens.as_deref_mut() {
            out[first] = 0;
            out[first + 1..nodes.end].copy_from_slice(tree.tokens);
        }
        // Tree r's drafts are the batch's draft slots first - r .. (every earlier tree has one root).
        let drafts = first - r..first - r + tree.tokens.len();
        if let Some(out) = self.draft_step_index.as_deref_mut() {
            for (j, slot) in out[drafts.clone()].iter_mut().enumerate() {
                *slot = first_query + 1 + j as i64;
            }
        }
        if let Some(out) = self.draft_tokens.as_deref_mut() {
            for (slot, &token) in out[drafts].iter_mut().zip(tree.tokens) {
                *slot = i32::try_from(token).map_err(|_| {
                    DdtreeError::value(
                        "draft_tokens",
                        format!("tree {r}: token {token} does not fit int32"),
                    )
                })?;
            }
        }
        Ok(())
    }
}

/// Writes one step's verification layout; see the module docs.
pub fn verify_layout_into(
    batch: &TreeBatch,
    place: StepPlacement<'_>,
    out: VerifyLayout<'_>,
) -> Result<()> {
    let r_count = batch.requests();
    let total = batch.total_nodes();
    check_placement(&place, r_count)?;
    at_most("window", out.window, MAX_WINDOW)?;
    let largest = (0..r_count).map(|r| batch.tree(r).len()).max().unwrap_or(0);
    if out.words < words_per_row(largest) {
        return Err(DdtreeError::value(
            "ancestor_bits",
            format!(
                "rows of {} words cannot hold a tree of {largest} nodes (needs {})",
                out.words,
                words_per_row(largest)
            ),
        ));
    }
    let conv_width = if out.window > 0 { out.window + 1 } else { 0 };
    expect_len("token_index", out.token_index.len(), total, "[T]")?;
    expect_len("logit_rows", out.logit_rows.len(), total, "[T]")?;
    expect_len("positions", out.positions.len(), total, "[T]")?;
    expect_len(
        "ancestor_bits",
        out.ancestor_bits.len(),
        total * out.words,
        "[T, words]",
    )?;
    expect_len(
        "node_offsets",
        out.node_offsets.len(),
        r_count + 1,
        "[R + 1]",
    )?;
    expect_len(
        "conv_index",
        out.conv_index.len(),
        total * conv_width,
        "[T, window + 1]",
    )?;
    mark_tree_rows(place.rows, batch, out.row_start)?;
    let mut node_arrays = out.nodes;
    node_arrays.check(total, r_count)?;

    let history_rows = (r_count * out.window) as i64;
    let mut windows = Vec::new(); // one tree's tree-local windows, reused across the batch
    for r in 0..r_count {
        let tree = batch.tree(r);
        let nodes = batch.node_offsets[r] as usize..batch.node_offsets[r + 1] as usize;
        let n = nodes.len();
        out.node_offsets[r] = nodes.start as i32;
        let first_query = place.query_starts[r];
        let first_logit = place.logit_starts[r];
        step_index("query_starts", first_query, n)?;
        step_index("logit_starts", first_logit, n)?;
        node_arrays.fill_tree(tree, r, nodes.start, first_query)?;
        for (i, (query, logit)) in out.token_index[nodes.clone()]
            .iter_mut()
            .zip(&mut out.logit_rows[nodes.clone()])
            .enumerate()
        {
            *query = first_query + i as i64;
            *logit = first_logit + i as i64;
        }
        windows.clear();
        windows.resize(n * out.window, 0);
        compile_into(
            tree,
            place.starts[r],
            CompiledSlots {
                positions: &mut out.positions[nodes.clone()],
                ancestor_bits: &mut out.ancestor_bits
                    [nodes.start * out.words..nodes.end * out.words],
                words: out.words,
                windows: &mut windows,
                window: out.window,
            },
        )?;
        if conv_width > 0 {
            let rows = &mut out.conv_index[nodes.start * conv_width..nodes.end * conv_width];
            fill_conv_rows(
                &windows,
                rows,
                out.window,
                r as i64,
                nodes.start as i64,
                history_rows,
            );
        }
    }
    out.node_offsets[r_count] = total as i32;
    Ok(())
}

/// One tree's conv rows from its tree-local windows (`>= 0`: an ancestor; `-1 .. -w`: the newest ..
/// oldest history entry), with the node's own row appended.
fn fill_conv_rows(
    windows: &[i32],
    rows: &mut [i64],
    w: usize,
    request: i64,
    first: i64,
    history_rows: i64,
) {
    let own_history = request * w as i64 + w as i64;
    for (i, (window, row)) in windows
        .chunks_exact(w)
        .zip(rows.chunks_exact_mut(w + 1))
        .enumerate()
    {
        for (slot, &entry) in row.iter_mut().zip(window) {
            let entry = i64::from(entry);
            *slot = if entry >= 0 {
                history_rows + first + entry
            } else {
                own_history + entry
            };
        }
        row[w] = history_rows + first + i as i64;
    }
}

/// The acceptance's buffers; R = the batch's trees, M = the acceptance's KV moves.
pub struct AcceptanceLayout<'a> {
    /// `[R, out_width]`: accepted draft tokens, then the bonus token, then -1 (vLLM's chain rows).
    pub output_tokens: &'a mut [i32],
    pub out_width: usize,
    /// `[M]` each: the step-token indices whose K/V move, and where to.
    pub kv_src: &'a mut [i64],
    pub kv_dst: &'a mut [i64],
    /// `[num_tokens]`: a permutation of the step's tokens putting each tree's root and accepted path first
    /// (in path order) and its other nodes after (in node order); other tokens stay in place.
    pub context_order: &'a mut [i64],
    /// `[R, path_width]`: accepted tree-local nodes, root first, padded with 0.
    pub paths: &'a mut [i32],
    pub path_width: usize,
    /// `[R]`: accepted nodes, root included.
    pub path_lengths: &'a mut [i32],
    /// `[R, window]`: conv rows of each request's new history (the last `window` entries of its old
    /// history followed by its accepted path), oldest first (empty when `window` is 0).
    pub commit_conv_index: &'a mut [i64],
    pub window: usize,
}

/// Writes what follows one step's acceptance; `accepted` must come from this `batch`.
pub fn acceptance_layout_into(
    batch: &TreeBatch,
    accepted: &AcceptedBatch,
    query_starts: &[i64],
    out: AcceptanceLayout<'_>,
) -> Result<()> {
    let r_count = batch.requests();
    let width = accepted.width;
    if accepted.accepted.len() != r_count || accepted.paths.len() != r_count * width {
        return Err(DdtreeError::shape(
            "accepted",
            format!("the acceptance of this batch's {r_count} trees"),
            format!("an acceptance of {} trees", accepted.accepted.len()),
        ));
    }
    expect_len("query_starts", query_starts.len(), r_count, "[R]")?;
    at_most("window", out.window, MAX_WINDOW)?;
    expect_len(
        "output_tokens",
        out.output_tokens.len(),
        r_count * out.out_width,
        "[R, width]",
    )?;
    expect_len(
        "kv_src",
        out.kv_src.len(),
        accepted.kv_src.len(),
        "[M] (the acceptance's KV moves)",
    )?;
    expect_len(
        "kv_dst",
        out.kv_dst.len(),
        accepted.kv_dst.len(),
        "[M] (the acceptance's KV moves)",
    )?;
    expect_len(
        "paths",
        out.paths.len(),
        r_count * out.path_width,
        "[R, path width]",
    )?;
    expect_len("path_lengths", out.path_lengths.len(), r_count, "[R]")?;
    expect_len(
        "commit_conv_index",
        out.commit_conv_index.len(),
        r_count * out.window,
        "[R, window]",
    )?;
    for (i, slot) in out.context_order.iter_mut().enumerate() {
        *slot = i as i64;
    }

    let history_rows = (r_count * out.window) as i64;
    let mut moves = 0;
    for (r, &first_query) in query_starts.iter().enumerate() {
        let n = batch.tree(r).len();
        step_index("query_starts", first_query, n)?;
        if first_query as usize + n > out.context_order.len() {
            return Err(DdtreeError::value(
                "context_order",
                format!(
                    "{} step tokens cannot hold tree {r} at {first_query}..{}",
                    out.context_order.len(),
                    first_query as usize + n
                ),
            ));
        }
        let row = &accepted.paths[r * width..(r + 1) * width];
        let len = row.iter().take_while(|&&node| node >= 0).count();
        let path = &row[..len];
        if len == 0 || path.iter().any(|&node| node as usize >= n) {
            return Err(DdtreeError::value(
                "accepted",
                format!("tree {r}: the path {path:?} is not in its tree of {n} nodes"),
            ));
        }
        write_output_row(
            &accepted.output_tokens[r * width..(r + 1) * width],
            &mut out.output_tokens[r * out.out_width..(r + 1) * out.out_width],
            r,
        )?;
        for (src, dst) in kv_moves(path) {
            if moves >= out.kv_src.len() {
                return Err(DdtreeError::value(
                    "accepted",
                    "more KV moves than the acceptance recorded",
                ));
            }
            out.kv_src[moves] = first_query + i64::from(src);
            out.kv_dst[moves] = first_query + i64::from(dst);
            moves += 1;
        }
        write_context_order(path, n, first_query, out.context_order);
        let padded = &mut out.paths[r * out.path_width..(r + 1) * out.path_width];
        if len > out.path_width {
            return Err(DdtreeError::value(
                "paths",
                format!(
                    "rows of {} cannot hold a path of {len} nodes",
                    out.path_width
                ),
            ));
        }
        padded.fill(0);
        padded[..len].copy_from_slice(path);
        out.path_lengths[r] = len as i32;
        let commit = &mut out.commit_conv_index[r * out.window..(r + 1) * out.window];
        let first_node = batch.node_offsets[r];
        fill_commit_rows(path, commit, r as i64, history_rows + first_node);
    }
    if moves != out.kv_src.len() {
        return Err(DdtreeError::value(
            "accepted",
            "fewer KV moves than the acceptance recorded",
        ));
    }
    Ok(())
}

/// One chain row, narrowed to the engine's width (int32 token ids, -1 padded).
fn write_output_row(tokens: &[i64], row: &mut [i32], tree: usize) -> Result<()> {
    row.fill(-1);
    let width = row.len();
    for (k, &token) in tokens.iter().enumerate().take_while(|(_, &t)| t >= 0) {
        let slot = row.get_mut(k).ok_or_else(|| {
            DdtreeError::value(
                "output_tokens",
                format!(
                    "tree {tree}: {} emitted tokens do not fit rows of width {}",
                    k + 1,
                    width
                ),
            )
        })?;
        *slot = i32::try_from(token).map_err(|_| {
            DdtreeError::value(
                "output_tokens",
                format!("token id {token} does not fit in int32"),
            )
        })?;
    }
    Ok(())
}

/// The accepted path's step tokens first (in path order), then the tree's other nodes (in node order).
fn write_context_order(path: &[i32], n: usize, first_query: i64, order: &mut [i64]) {
    let base = first_query as usize;
    for (k, &node) in path.iter().enumerate() {
        order[base + k] = first_query + i64::from(node);
    }
    let mut next = base + path.len();
    let mut on_path = path.iter().peekable();
    for node in 0..n as i32 {
        if on_path.peek() == Some(&&node) {
            on_path.next(); // paths are strictly increasing
            continue;
        }
        order[next] = first_query + i64::from(node);
        next += 1;
    }
}

/// The last `w` entries of `history (w rows) ++ path`, as conv rows: history rows `r*w + i`, path node p
/// at `first_tree_row + p`.
fn fill_commit_rows(path: &[i32], rows: &mut [i64], request: i64, first_tree_row: i64) {
    let w = rows.len();
    for (k, slot) in rows.iter_mut().enumerate() {
        let entry = path.len() + k; // index in the w + len(path) long sequence
        *slot = if entry >= w {
            first_tree_row + i64::from(path[entry - w])
        } else {
            request * w as i64 + entry as i64
        };
    }
}

fn check_placement(place: &StepPlacement<'_>, r_count: usize) -> Result<()> {
    expect_len("rows", place.rows.len(), r_count, "[R] (one per tree)")?;
    expect_len("starts", place.starts.len(), r_count, "[R] (one per tree)")?;
    expect_len(
        "query_starts",
        place.query_starts.len(),
        r_count,
        "[R] (one per tree)",
    )?;
    expect_len(
        "logit_starts",
        place.logit_starts.len(),
        r_count,
        "[R] (one per tree)",
    )
}

/// `row_start`: -1 everywhere but the tree rows, which get their first node; rows must be distinct.
fn mark_tree_rows(rows: &[i64], batch: &TreeBatch, row_start: &mut [i32]) -> Result<()> {
    row_start.fill(-1);
    let num_rows = row_start.len();
    for (r, &row) in rows.iter().enumerate() {
        let slot = usize::try_from(row)
            .ok()
            .and_then(|row| row_start.get_mut(row))
            .ok_or_else(|| {
                DdtreeError::value(
                    "rows",
                    format!(
                        "row {row} of tree {r} is outside the {} rows of row_start",
                        num_rows
                    ),
                )
            })?;
        if *slot >= 0 {
            return Err(DdtreeError::value(
                "rows",
                format!("row {row} holds two trees"),
            ));
        }
        *slot = batch.node_offsets[r] as i32;
    }
    Ok(())
}

fn expect_len(arg: &'static str, got: usize, expected: usize, shape: &str) -> Result<()> {
    if got != expected {
        return Err(DdtreeError::shape(
            arg,
            format!("{shape}: {expected} elements"),
            format!("{got} elements"),
        ));
    }
    Ok(())
}

/// A tree's first step index, checked so that the tree's `n` indices stay non-negative `i64`s.
fn step_index(arg: &'static str, first: i64, n: usize) -> Result<()> {
    if first < 0 || first.checked_add(n as i64).is_none() {
        return Err(DdtreeError::value(
            arg,
            format!("must be >= 0 and leave room for {n} nodes, got {first}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{accept_trees, build_trees, compile_trees};

    /// Two trees from a fixed distribution (budgets 4 and 3, depth 3, width 2).
    fn batch() -> TreeBatch {
        let log_probs: Vec<f32> = [-0.1, -2.0, -0.3, -1.5, -0.2, -1.9].repeat(2);
        let ids: Vec<i64> = [5, 6, 7, 8, 9, 10, 15, 16, 17, 18, 19, 20].to_vec();
        let dist = crate::batch::BatchDistribution {
            log_probs: &log_probs,
            token_ids: &ids,
            requests: 2,
            depth: 3,
            width: 2,
        };
        build_trees(&dist, &[4, 3], &crate::batch::Executor::new(1).unwrap()).unwrap()
    }

    #[test]
    fn verify_layout_matches_the_compiled_batch_placed_in_the_step() {
        let batch = batch();
        let total = batch.total_nodes();
        let (rows, starts, query, logit) = ([3i64, 0], [10i64, 20], [7i64, 1], [2i64, 9]);
        let words = 2;
        let (mut token_index, mut logit_rows, mut positions) =
            (vec![0; total], vec![0; total], vec![0; total]);
        let mut bits = vec![7u32; total * words];
        let (mut row_start, mut offsets, mut conv) =
            (vec![9i32; 5], vec![0i32; 3], vec![0i64; total * 4]);
        let place = StepPlacement {
            rows: &rows,
            starts: &starts,
            query_starts: &query,
            logit_starts: &logit,
        };
        let out = VerifyLayout {
            token_index: &mut token_index,
            logit_rows: &mut logit_rows,
            positions: &mut positions,
            ancestor_bits: &mut bits,
            words,
            row_start: &mut row_start,
            node_offsets: &mut offsets,
            conv_index: &mut conv,
            window: 3,
            nodes: NodeArrays::default(),
        };
        verify_layout_into(&batch, place, out).unwrap();
        let compiled = compile_trees(&batch, &starts, 3).unwrap();
        assert_eq!(positions, compiled.positions);
        let n0 = batch.tree(0).len();
        assert_eq!(
            token_index[..n0],
            (7..7 + n0 as i64).collect::<Vec<_>>()[..]
        );
        assert_eq!(
            logit_rows[n0..],
            (9..9 + (total - n0) as i64).collect::<Vec<_>>()[..]
        );
        assert_eq!(row_start, vec![n0 as i32, -1, -1, 0, -1]);
        assert_eq!(offsets, vec![0, n0 as i32, total as i32]);
        for t in 0..total {
            assert_eq!(bits[t * 2], compiled.ancestor_bits[t]);
            assert_eq!(bits[t * 2 + 1], 0, "padding words are zeroed");
        }
        // Tree 1's root: its own history rows (3..6 for request 1 of 2, w = 3), then itself (row 6 + n0).
        assert_eq!(conv[n0 * 4..n0 * 4 + 4], [3, 4, 5, 6 + n0 as i64]);
    }

    #[test]
    fn node_arrays_follow_their_definitions_and_refuse_wrong_sizes() {
        let batch = batch();
        let (total, r_count) = (batch.total_nodes(), batch.requests());
        let (rows, starts, query, logit) = ([1i64, 0], [10i64, 20], [7i64, 1], [0i64, 5]);
        let run = |drafts: usize, depths: &mut Vec<i64>| {
            let (mut ti, mut lr, mut pos) = (vec![0; total], vec![0; total], vec![0; total]);
            let (mut bits, mut row_start, mut offsets) =
                (vec![0u32; total], vec![0i32; 2], vec![0i32; 3]);
            let (mut root, mut parents, mut tree, mut local, mut tokens) = (
                vec![-9; total],
                vec![-9; total],
                vec![-9; total],
                vec![-9; total],
                vec![-9; total],
            );
            let (mut step, mut draft) = (vec![-9i64; drafts], vec![-9i32; drafts]);
            let place = StepPlacement {
                rows: &rows,
                starts: &starts,
                query_starts: &query,
                logit_starts: &logit,
            };
            let out = VerifyLayout {
                token_index: &mut ti,
                logit_rows: &mut lr,
                positions: &mut pos,
                ancestor_bits: &mut bits,
                words: 1,
                row_start: &mut row_start,
                node_offsets: &mut offsets,
                conv_index: &mut [],
                window: 0,
                nodes: NodeArrays {
                    depths: Some(depths),
                    root_index: Some(&mut root),
                    parents: Some(&mut parents),
                    tree: Some(&mut tree),
                    local: Some(&mut local),
                    tokens: Some(&mut tokens),
                    draft_step_index: Some(&mut step),
                    draft_tokens: Some(&mut draft),
                },
            };
            verify_layout_into(&batch, place, out)
                .map(|()| (ti, root, parents, tree, local, tokens, step, draft))
        };
        let mut depths = vec![-9; total];
        let (ti, root_index, parents, tree, local, tokens, step, draft) =
            run(total - r_count, &mut depths).unwrap();
        let (mut drafts_seen, mut k) = (Vec::new(), 0);
        for (r, &root) in query.iter().enumerate() {
            let view = batch.tree(r);
            let first = batch.node_offsets[r] as usize;
            for i in 0..view.len() {
                let t = first + i;
                assert_eq!(depths[t], i64::from(view.depths[i]));
                assert_eq!(root_index[t], root);
                let parent = if i == 0 {
                    t
                } else {
                    first + view.parents[i] as usize
                };
                assert_eq!(parents[t], parent as i64);
                assert_eq!((tree[t], local[t]), (r as i64, i as i64));
                assert_eq!(tokens[t], if i == 0 { 0 } else { view.tokens[i - 1] });
                if i > 0 {
                    // Draft k of the batch is node t: its step index is the node's, its token the node's.
                    assert_eq!((step[k], i64::from(draft[k])), (ti[t], view.tokens[i - 1]));
                    drafts_seen.push(k);
                    k += 1;
                }
            }
        }
        assert_eq!(drafts_seen.len(), total - r_count);
        let err = run(total, &mut vec![0; total]).expect_err("a [T] draft array is refused");
        assert!(err.to_string().contains("draft_step_index"), "{err}");
        let err =
            run(total - r_count, &mut vec![0; total + 1]).expect_err("a wrong depths is refused");
        assert!(err.to_string().contains("depths"), "{err}");
    }

    #[test]
    fn acceptance_layout_places_the_walk_in_the_step() {
        let batch = batch();
        // Accept the first child everywhere: each node's target token is its first child's token.
        let mut targets = vec![-5i64; batch.total_nodes()];
        for r in 0..batch.requests() {
            let tree = batch.tree(r);
            let base = batch.node_offsets[r] as usize;
            for (i, &p) in tree.parents.iter().enumerate().skip(1).rev() {
                targets[base + p as usize] = tree.tokens[i - 1];
            }
        }
        let accepted = accept_trees(&batch, &targets).unwrap();
        let m = accepted.kv_src.len();
        let query = [0i64, 10];
        let (mut tokens, mut src, mut dst, mut order) =
            (vec![0i32; 2 * 3], vec![0; m], vec![0; m], vec![0i64; 16]);
        let (mut paths, mut lengths, mut commit) =
            (vec![9i32; 2 * 4], vec![0i32; 2], vec![0i64; 2 * 3]);
        let out = AcceptanceLayout {
            output_tokens: &mut tokens,
            out_width: 3,
            kv_src: &mut src,
            kv_dst: &mut dst,
            context_order: &mut order,
            paths: &mut paths,
            path_width: 4,
            path_lengths: &mut lengths,
            commit_conv_index: &mut commit,
            window: 3,
        };
        acceptance_layout_into(&batch, &accepted, &query, out).unwrap();
        for r in 0..2 {
            let len = lengths[r] as usize;
            assert_eq!(len as i32, accepted.accepted[r] + 1);
            assert_eq!(
                paths[r * 4..r * 4 + len],
                accepted.paths[r * accepted.width..r * accepted.width + len]
            );
            assert!(paths[r * 4 + len..(r + 1) * 4].iter().all(|&p| p == 0));
        }
        let expected_src: Vec<i64> = accepted
            .kv_src
            .iter()
            .map(|&s| {
                if s < batch.node_offsets[1] {
                    s
                } else {
                    s - batch.node_offsets[1] + 10
                }
            })
            .collect();
        assert_eq!(src, expected_src);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            (0..16).collect::<Vec<_>>(),
            "context_order is a permutation"
        );
        assert_eq!(order[10], 10, "a root stays first");
    }

    #[test]
    fn wrong_sizes_name_the_buffer() {
        let batch = batch();
        let total = batch.total_nodes();
        let (rows, starts) = ([0i64, 1], [0i64, 0]);
        let place = StepPlacement {
            rows: &rows,
            starts: &starts,
            query_starts: &starts,
            logit_starts: &starts,
        };
        let (mut a, mut b, mut c, mut bits) = (
            vec![0; total],
            vec![0; total],
            vec![0; total - 1],
            vec![0u32; total],
        );
        let (mut row_start, mut offsets) = (vec![0i32; 2], vec![0i32; 3]);
        let out = VerifyLayout {
            token_index: &mut a,
            logit_rows: &mut b,
            positions: &mut c,
            ancestor_bits: &mut bits,
            words: 1,
            row_start: &mut row_start,
            node_offsets: &mut offsets,
            conv_index: &mut [],
            window: 0,
            nodes: NodeArrays::default(),
        };
        let err = verify_layout_into(&batch, place, out)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("positions: expected shape [T]"), "{err}");
    }
}
