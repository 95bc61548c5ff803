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
/// that queue comparisons are integer compares.
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

/// The score a key was made from (`-0.0` comes back as `0.0`, which a score
/// never is: sums that start from the root's `0.0` cannot give `-0.0`).
#[inline]
fn key_score(key: u64) -> f64 {
    f64::from_bits(if key >> 63 == 1 { key ^ 1 << 63 } else { !key })
}

/// Reusable scratch for building trees; one per thread. Building allocates
/// nothing once the scratch has grown to the largest budget seen.
#[derive(Default)]
pub struct TreeBuilder {
    frontier: Frontier,
    /// The emitted nodes, root first.
    nodes: Vec<Node>,
    /// Per draft position: how many leading candidates the tree reached.
    row_reached: Vec<usize>,
    seen_tokens: TokenSet,
}

/// An emitted node: what its children's scores, the output and
/// tie-breaking (which rebuilds rank tuples from parents and ranks) need.
#[derive(Clone, Copy, Debug, Default)]
struct Node {
    score: f64,
    parent: u32,
    rank: u32,
    depth: u32,
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
        if self.nodes.len() <= n {
            self.nodes.resize(n + 1, Node::default());
        }
        search(
            &mut self.frontier,
            &mut self.nodes[..=n],
            &mut self.row_reached,
            dist,
        );
        self.check_reached_tokens_distinct(dist)?;
        write(&self.nodes[..=n], dist, out);
        Ok(())
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
            let tokens = &dist.token_ids[row * dist.width..][..reached];
            if reached == 0 {
                continue;
            }
            if let [only] = tokens {
                // Nothing to be distinct from.
                if only.to_i64() < 0 {
                    return Err(negative_token(row, 0, only.to_i64()));
                }
                continue;
            }
            self.seen_tokens.start_row(reached);
            for (rank, token) in tokens.iter().enumerate() {
                let token = token.to_i64();
                if token < 0 {
                    return Err(negative_token(row, rank, token));
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

#[cold]
fn negative_token(row: usize, rank: usize, token: i64) -> DdtreeError {
    DdtreeError::value(
        "token_ids",
        format!("token_ids[{row}, {rank}] = {token} is negative"),
    )
}

/// Pops the best prefixes into `nodes[1..]` (one per slot after the root's):
/// each pop emits a node and queues its next sibling (last rank + 1) and its
/// first child (append rank 0).
fn search<T: TokenId>(
    frontier: &mut Frontier,
    nodes: &mut [Node],
    row_reached: &mut Vec<usize>,
    dist: &DraftDistribution<'_, T>,
) {
    let (width, depth, log_probs) = (dist.width, dist.depth, dist.log_probs);
    nodes[0] = Node::default();
    row_reached.clear();
    row_reached.resize(depth, 0);
    if nodes.len() == 1 {
        return;
    }
    let first = Candidate {
        key: score_key(log_probs[0] as f64),
        parent: 0,
        rank: 0,
    };
    frontier.start(first);
    for node in 1..nodes.len() {
        let c = frontier.top();
        let parent = nodes[c.parent as usize];
        let d = parent.depth as usize + 1;
        let score = key_score(c.key);
        nodes[node] = Node {
            score,
            parent: c.parent,
            rank: c.rank,
            depth: d as u32,
        };
        let reached = &mut row_reached[d - 1];
        *reached = (*reached).max(c.rank as usize + 1);
        let row = &log_probs[(d - 1) * width..];
        let next = c.rank as usize + 1;
        let sibling = (next < width).then(|| Candidate {
            key: score_key(parent.score + row[next] as f64),
            parent: c.parent,
            rank: next as u32,
        });
        let child = (d < depth).then(|| Candidate {
            key: score_key(score + row[width] as f64),
            parent: node as u32,
            rank: 0,
        });
        frontier.replace_top(sibling, child, nodes);
    }
}

/// Copies the nodes into the caller's slots.
fn write<T: TokenId>(nodes: &[Node], dist: &DraftDistribution<'_, T>, out: TreeSlots<'_>) {
    out.parents[0] = -1;
    out.depths[0] = 0;
    out.scores[0] = 0.0;
    let slots = out.parents[1..]
        .iter_mut()
        .zip(&mut out.depths[1..])
        .zip(&mut out.scores[1..])
        .zip(out.tokens.iter_mut());
    for (node, (((parent, depth), score), token)) in nodes[1..].iter().zip(slots) {
        *parent = node.parent as i32;
        *depth = node.depth as i32;
        *score = node.score as f32;
        *token = dist.token(node.depth as usize - 1, node.rank as usize);
    }
}

/// The search's priority queue: a binary max-heap of candidates, higher
/// score first, equal scores by the smaller rank tuple (which the nodes
/// emitted so far give). An [`EMPTY`] sentinel follows the last candidate,
/// so that every node of the heap has a right child to compare with.
#[derive(Default)]
struct Frontier {
    heap: Vec<Candidate>,
}

/// No candidate: key 0 is below every score's key (that of `-inf` included).
const EMPTY: Candidate = Candidate {
    key: 0,
    parent: 0,
    rank: 0,
};

impl Frontier {
    fn start(&mut self, first: Candidate) {
        self.heap.clear();
        self.heap.extend([first, EMPTY]);
    }

    /// The next candidate; the search never pops more than it pushed.
    #[inline]
    fn top(&self) -> Candidate {
        self.heap[0]
    }

    /// Removes the top and adds the popped prefix's successors, with one
    /// sift down and one push instead of a pop and two pushes.
    #[inline(always)]
    fn replace_top(
        &mut self,
        sibling: Option<Candidate>,
        child: Option<Candidate>,
        nodes: &[Node],
    ) {
        match (child, sibling) {
            (Some(child), Some(sibling)) => {
                // The better of the two is often the next pop: it takes the
                // top and barely sinks; the other joins at the bottom and
                // barely climbs. The other way round both would travel far.
                let (first, second) = if pops_before(&sibling, &child, nodes) {
                    (sibling, child)
                } else {
                    (child, sibling)
                };
                self.heap[0] = first;
                sift_down(&mut self.heap, nodes);
                self.push(second, nodes);
            }
            (Some(only), None) | (None, Some(only)) => {
                self.heap[0] = only;
                sift_down(&mut self.heap, nodes);
            }
            (None, None) => {
                let len = self.heap.len() - 1;
                self.heap.swap(0, len - 1);
                self.heap[len - 1] = EMPTY;
                self.heap.truncate(len);
                sift_down(&mut self.heap, nodes);
            }
        }
    }

    /// Adds `c` where the sentinel was and climbs it up.
    #[inline(always)]
    fn push(&mut self, c: Candidate, nodes: &[Node]) {
        let mut hole = self.heap.len() - 1;
        self.heap.push(EMPTY);
        let heap = &mut self.heap[..];
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
}

/// True when `a` must pop before `b`: higher score, or on a tie the smaller
/// rank tuple.
#[inline]
fn pops_before(a: &Candidate, b: &Candidate, nodes: &[Node]) -> bool {
    if a.key != b.key {
        return a.key > b.key;
    }
    rank_tuple_cmp(a, b, nodes) == Ordering::Less
}

/// Lexicographic order of two candidates' rank tuples (a proper prefix sorts
/// first). Only reached on exact score ties, so it may allocate.
#[cold]
fn rank_tuple_cmp(a: &Candidate, b: &Candidate, nodes: &[Node]) -> Ordering {
    rank_tuple(a, nodes).cmp(&rank_tuple(b, nodes))
}

/// The rank tuple of candidate `c`, root first.
fn rank_tuple(c: &Candidate, nodes: &[Node]) -> Vec<u32> {
    let mut out = vec![c.rank];
    let mut node = c.parent as usize;
    while node != 0 {
        out.push(nodes[node].rank);
        node = nodes[node].parent as usize;
    }
    out.reverse();
    out
}

/// Restores the heap order after the top was replaced; `heap` ends with the
/// sentinel, which loses every match.
#[inline(always)]
fn sift_down(heap: &mut [Candidate], nodes: &[Node]) {
    let len = heap.len() - 1;
    let moving = heap[0];
    let mut hole = 0;
    loop {
        let left = 2 * hole + 1;
        if left >= len {
            break;
        }
        // The better child by arithmetic, not a branch: its outcome is a
        // coin flip that a branch predictor would mostly miss.
        let best = left + pops_before(&heap[left + 1], &heap[left], nodes) as usize;
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
    let mut bad = false;
    for row in dist.log_probs.chunks_exact(dist.width.max(1)) {
        bad |= !row_non_increasing(row);
        bad |= !(row[0] <= LOG_PROB_TOLERANCE);
    }
    if bad {
        return Err(describe_bad_value(dist));
    }
    Ok(())
}

/// Whether every `row[i + 1] <= row[i]` (false on NaN). Compares blocks of
/// [`BLOCK`] pairs into lane flags with no branch but the loop's, the last
/// block overlapping its predecessor rather than leaving a scalar tail, so
/// that the compiler vectorizes it.
#[inline]
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn row_non_increasing(row: &[f32]) -> bool {
    const BLOCK: usize = 16;
    let pairs = row.len().saturating_sub(1);
    if pairs < BLOCK {
        return row.windows(2).fold(true, |ok, w| ok & (w[1] <= w[0]));
    }
    let mut unsorted = [false; BLOCK];
    let last = pairs - BLOCK;
    let mut start = 0;
    loop {
        let x: &[f32; BLOCK + 1] = row[start..].first_chunk().expect("start <= pairs - BLOCK");
        for lane in 0..BLOCK {
            unsorted[lane] |= !(x[lane + 1] <= x[lane]);
        }
        if start == last {
            break;
        }
        start = (start + BLOCK).min(last);
    }
    !unsorted.iter().any(|&u| u)
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
