//! Best-first construction of the draft tree (DDTree, Ringel et al. 2026).
//!
//! A prefix is a tuple of ranks (r_1, ..., r_d): the r_j-th most likely token at
//! draft position j. Its score is the f64 sum, in depth order, of the
//! log-probabilities of its ranks. A max-heap holds the frontier; popping a
//! prefix emits it as a node and pushes its next sibling (last rank + 1) and its
//! first child (append rank 0). Both have a score no higher than the popped
//! prefix, so pops come out in non-increasing score and the first `budget` pops
//! are exactly the `budget` best prefixes, prefix-closed. Equal scores are broken
//! by the lexicographically smallest rank tuple, as a heap of
//! `(-score, rank_tuple)` tuples would.

use std::cmp::Ordering;

use crate::error::{DdtreeError, Result};
use crate::tree::{DraftDistribution, TokenId, Tree, TreeSlots};

/// Largest positive log-probability accepted: rounding in a log-softmax can
/// leave the top entry a hair above zero, anything more is not a log-prob.
const LOG_PROB_TOLERANCE: f32 = 1e-3;

/// A prefix on the frontier: the node it extends and its last rank, keyed by
/// its score mapped to an order-preserving integer (see [`score_key`]), so
/// that heap comparisons are integer compares the compiler can make branchless.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    key: u64,
    parent: u32,
    rank: u32,
}

/// Maps a score to a `u64` whose order is the score's order (-0.0 == 0.0).
#[inline]
fn score_key(score: f64) -> u64 {
    let bits = (score + 0.0).to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

/// Reusable scratch for building trees; one per thread. Building allocates
/// nothing once the scratch has grown to the largest budget seen.
#[derive(Default)]
pub struct TreeBuilder {
    frontier: Vec<Candidate>,
    nodes: Nodes,
    node_depth: Vec<u32>,
    node_score: Vec<f64>,
    /// Per draft position: how many leading candidates the tree reached.
    row_reached: Vec<usize>,
    seen_tokens: TokenSet,
}

/// Per node (root = 0): its parent and its rank in its row; all that
/// tie-breaking needs to rebuild a candidate's rank tuple.
#[derive(Default)]
struct Nodes {
    parent: Vec<u32>,
    rank: Vec<u32>,
}

impl TreeBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds the tree of the `budget` most probable prefixes.
    pub fn build<T: TokenId>(
        &mut self,
        dist: &DraftDistribution<'_, T>,
        budget: usize,
    ) -> Result<Tree> {
        let mut tree = Tree::with_nodes(dist.node_count(budget));
        self.build_into(dist, budget, TreeSlots::from(&mut tree))?;
        Ok(tree)
    }

    /// Builds into caller-owned slots, which must hold exactly
    /// `dist.node_count(budget)` nodes (+1 for the root); every slot is written.
    pub fn build_into<T: TokenId>(
        &mut self,
        dist: &DraftDistribution<'_, T>,
        budget: usize,
        out: TreeSlots<'_>,
    ) -> Result<()> {
        check_values(dist)?;
        let n = dist.node_count(budget);
        check_slots(&out, n)?;
        self.search(dist, n);
        self.check_reached_tokens_distinct(dist)?;
        self.write(dist, out);
        Ok(())
    }

    /// Pops the `n` best prefixes into the node arrays.
    fn search<T: TokenId>(&mut self, dist: &DraftDistribution<'_, T>, n: usize) {
        self.reset(n, dist.depth);
        if n == 0 {
            return;
        }
        self.frontier.push(Candidate {
            key: score_key(dist.log_prob(0, 0) as f64),
            parent: 0,
            rank: 0,
        });
        for node in 1..=n {
            let c = self.frontier[0];
            let parent = c.parent as usize;
            let depth = self.node_depth[parent] as usize + 1;
            let score = self.node_score[parent] + dist.log_prob(depth - 1, c.rank as usize) as f64;
            self.nodes.parent.push(c.parent);
            self.nodes.rank.push(c.rank);
            self.node_depth.push(depth as u32);
            self.node_score.push(score);
            self.row_reached[depth - 1] = self.row_reached[depth - 1].max(c.rank as usize + 1);
            self.replace_top_with_successors(dist, node as u32, c, depth, score);
        }
    }

    /// Removes the popped top and adds its next sibling and first child, with
    /// one sift down and one push instead of a pop and two pushes.
    fn replace_top_with_successors<T: TokenId>(
        &mut self,
        dist: &DraftDistribution<'_, T>,
        node: u32,
        c: Candidate,
        depth: usize,
        score: f64,
    ) {
        let next_rank = c.rank as usize + 1;
        let sibling = (next_rank < dist.width).then(|| Candidate {
            key: score_key(
                self.node_score[c.parent as usize] + dist.log_prob(depth - 1, next_rank) as f64,
            ),
            parent: c.parent,
            rank: next_rank as u32,
        });
        let child = (depth < dist.depth).then(|| Candidate {
            key: score_key(score + dist.log_prob(depth, 0) as f64),
            parent: node,
            rank: 0,
        });
        let frontier = &mut self.frontier;
        match (child, sibling) {
            (Some(child), Some(sibling)) => {
                // The better of the two is often the next pop: it takes the
                // top and barely sinks; the other joins at the bottom and
                // barely climbs. The other way round both would travel far.
                let (first, second) = if pops_before(&sibling, &child, &self.nodes) {
                    (sibling, child)
                } else {
                    (child, sibling)
                };
                frontier[0] = first;
                sift_down(frontier, &self.nodes);
                push(frontier, second, &self.nodes);
            }
            (Some(only), None) | (None, Some(only)) => {
                frontier[0] = only;
                sift_down(frontier, &self.nodes);
            }
            (None, None) => {
                let last = frontier
                    .pop()
                    .expect("the popped top is still in the frontier");
                if !frontier.is_empty() {
                    frontier[0] = last;
                    sift_down(frontier, &self.nodes);
                }
            }
        }
    }

    fn reset(&mut self, n: usize, depth: usize) {
        self.frontier.clear();
        self.frontier.reserve(n + 2);
        for v in [
            &mut self.nodes.parent,
            &mut self.nodes.rank,
            &mut self.node_depth,
        ] {
            v.clear();
            v.reserve(n + 1);
            v.push(0);
        }
        self.node_score.clear();
        self.node_score.reserve(n + 1);
        self.node_score.push(0.0);
        self.row_reached.clear();
        self.row_reached.resize(depth, 0);
    }

    /// Copies the node arrays into the caller's slots.
    fn write<T: TokenId>(&self, dist: &DraftDistribution<'_, T>, out: TreeSlots<'_>) {
        out.parents[0] = -1;
        out.depths[0] = 0;
        out.scores[0] = 0.0;
        for node in 1..self.nodes.parent.len() {
            let depth = self.node_depth[node];
            out.tokens[node - 1] = dist.token(depth as usize - 1, self.nodes.rank[node] as usize);
            out.parents[node] = self.nodes.parent[node] as i32;
            out.depths[node] = depth as i32;
            out.scores[node] = self.node_score[node] as f32;
        }
    }

    /// Sibling nodes must carry distinct, non-negative tokens, or acceptance
    /// could not tell them apart. The children of any node are a leading run
    /// of candidates of one row, so it is enough (and, unlike checking whole
    /// rows, O(tree) rather than O(L * K)) to check the candidates each row
    /// contributes to the tree: the others cannot change it.
    fn check_reached_tokens_distinct<T: TokenId>(
        &mut self,
        dist: &DraftDistribution<'_, T>,
    ) -> Result<()> {
        for (row, &reached) in self.row_reached.iter().enumerate() {
            self.seen_tokens.start_row(reached);
            for rank in 0..reached {
                let token = dist.token(row, rank);
                if token < 0 {
                    return Err(DdtreeError::value(
                        "token_ids",
                        format!("token_ids[{row}, {rank}] = {token} is negative"),
                    ));
                }
                if let Some(first) = self.seen_tokens.insert(token, rank as u32) {
                    return Err(DdtreeError::value(
                        "token_ids",
                        format!(
                            "row {row} has token {token} twice (ranks {first} and {rank}); \
                             token ids in a row must be distinct"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// True when `a` must pop before `b`: higher score, or on a tie the smaller
/// rank tuple.
#[inline]
fn pops_before(a: &Candidate, b: &Candidate, nodes: &Nodes) -> bool {
    if a.key != b.key {
        return a.key > b.key;
    }
    rank_tuple_cmp(a, b, nodes) == Ordering::Less
}

/// Lexicographic order of two candidates' rank tuples (a proper prefix sorts
/// first). Only reached on exact score ties, so it may allocate.
#[cold]
fn rank_tuple_cmp(a: &Candidate, b: &Candidate, nodes: &Nodes) -> Ordering {
    rank_tuple(a, nodes).cmp(&rank_tuple(b, nodes))
}

/// The rank tuple of candidate `c`, root first.
fn rank_tuple(c: &Candidate, nodes: &Nodes) -> Vec<u32> {
    let mut out = vec![c.rank];
    let mut node = c.parent as usize;
    while node != 0 {
        out.push(nodes.rank[node]);
        node = nodes.parent[node] as usize;
    }
    out.reverse();
    out
}

/// Adds `c` to the max-heap `heap`.
fn push(heap: &mut Vec<Candidate>, c: Candidate, nodes: &Nodes) {
    let mut hole = heap.len();
    heap.push(c);
    while hole > 0 {
        let parent = (hole - 1) / 2;
        if !pops_before(&c, &heap[parent], nodes) {
            break;
        }
        heap[hole] = heap[parent];
        hole = parent;
    }
    heap[hole] = c;
}

/// Restores the heap order after the top was replaced.
fn sift_down(heap: &mut [Candidate], nodes: &Nodes) {
    let len = heap.len();
    let moving = heap[0];
    let mut hole = 0;
    loop {
        let left = 2 * hole + 1;
        if left >= len {
            break;
        }
        let right = left + 1;
        let best = if right < len && pops_before(&heap[right], &heap[left], nodes) {
            right
        } else {
            left
        };
        if !pops_before(&heap[best], &moving, nodes) {
            break;
        }
        heap[hole] = heap[best];
        hole = best;
    }
    heap[hole] = moving;
}

fn check_slots(out: &TreeSlots<'_>, n: usize) -> Result<()> {
    let ok = out.tokens.len() == n
        && out.parents.len() == n + 1
        && out.depths.len() == n + 1
        && out.scores.len() == n + 1;
    if ok {
        Ok(())
    } else {
        Err(DdtreeError::Internal(format!(
            "output slots sized for {} nodes, the tree has {n}",
            out.tokens.len()
        )))
    }
}

/// Rejects NaN, positive log-probs and rows that increase: each would make
/// the tree silently wrong (an unsorted row hides candidates from the
/// search). One branch-free pass over the values; the slow pass that names
/// the culprit runs only on failure.
// `!(b <= a)` rather than `b > a`: the negation is what makes NaN fail.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub fn check_values<T: TokenId>(dist: &DraftDistribution<'_, T>) -> Result<()> {
    let mut bad = 0u32;
    for row in dist.log_probs.chunks_exact(dist.width.max(1)) {
        let (head, tail) = (&row[..row.len() - 1], &row[1..]);
        // `!(b <= a)` is also true when either is NaN. Integer ORs keep the
        // loop free of branches, so it vectorizes.
        bad |= head
            .iter()
            .zip(tail)
            .fold(0u32, |acc, (a, b)| acc | !(b <= a) as u32);
        bad |= !(row[0] <= LOG_PROB_TOLERANCE) as u32;
    }
    if bad != 0 {
        return Err(describe_bad_value(dist));
    }
    Ok(())
}

/// The first offending entry, in row-major order, as an error.
#[cold]
fn describe_bad_value<T: TokenId>(dist: &DraftDistribution<'_, T>) -> DdtreeError {
    for row in 0..dist.depth {
        let mut previous = f32::INFINITY;
        for rank in 0..dist.width {
            let lp = dist.log_prob(row, rank);
            if lp.is_nan() {
                return DdtreeError::value("log_probs", format!("log_probs[{row}, {rank}] is NaN"));
            }
            if lp > LOG_PROB_TOLERANCE {
                return DdtreeError::value(
                    "log_probs",
                    format!("log_probs[{row}, {rank}] = {lp} is positive; expected log-probabilities (<= 0)"),
                );
            }
            if lp > previous {
                return DdtreeError::value(
                    "log_probs",
                    format!(
                        "row {row} is not sorted: log_probs[{row}, {}] = {previous} < log_probs[{row}, {rank}] = {lp}; \
                         each row must be non-increasing (top-k order)",
                        rank - 1
                    ),
                );
            }
            previous = lp;
        }
    }
    DdtreeError::Internal("a bad value was flagged but not found".into())
}

/// An open-addressing set of token ids, cleared in O(1) per row by a
/// generation stamp, so the duplicate check costs O(reached) per row.
#[derive(Default)]
pub struct TokenSet {
    stamps: Vec<u32>,
    keys: Vec<i64>,
    ranks: Vec<u32>,
    stamp: u32,
    mask: usize,
}

impl TokenSet {
    fn start_row(&mut self, width: usize) {
        let capacity = (2 * width).next_power_of_two().max(16);
        if self.stamps.len() < capacity || self.stamp == u32::MAX {
            self.stamps = vec![0; capacity];
            self.keys = vec![0; capacity];
            self.ranks = vec![0; capacity];
            self.stamp = 0;
        }
        self.mask = self.stamps.len() - 1;
        self.stamp += 1;
    }

    /// Inserts `key`; returns the rank it was first seen at if already present.
    fn insert(&mut self, key: i64, rank: u32) -> Option<u32> {
        let hash = (key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut slot = (hash >> 32) as usize & self.mask;
        loop {
            if self.stamps[slot] != self.stamp {
                self.stamps[slot] = self.stamp;
                self.keys[slot] = key;
                self.ranks[slot] = rank;
                return None;
            }
            if self.keys[slot] == key {
                return Some(self.ranks[slot]);
            }
            slot = (slot + 1) & self.mask;
        }
    }
}
