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
//! `(-score, rank_tuple)` tuples would. (With log-probs up to the tolerance
//! above zero a child can outscore its parent; the pop order is still that of
//! such a heap, which `ddtree.reference` is.) First children wait in per-depth
//! queues (`FirstChildren`) rather than in the heap; the pop order is the same.

use std::cmp::Ordering;

use crate::error::{DdtreeError, Result};
use crate::limits::{at_most, MAX_BUDGET};
use crate::tree::{DraftDistribution, TokenId, Tree, TreeSlots};

/// Largest positive log-probability accepted: rounding in a log-softmax can
/// leave the top entry a hair above zero, anything more is not a log-prob.
const LOG_PROB_TOLERANCE: f32 = 1e-3;

/// A prefix on the frontier: the node it extends, its last rank and its
/// score. Scores are never NaN (the values are checked) nor `-0.0` (see
/// [`search`]), so `==` and `>` on them are the order of the prefixes' scores.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    score: f64,
    parent: u32,
    rank: u32,
}

/// Reusable scratch for building trees; one per thread. Building allocates
/// nothing once the scratch has grown to the largest budget seen.
#[derive(Default)]
pub struct TreeBuilder {
    /// The search's heap storage.
    frontier: Vec<Candidate>,
    /// The search's first-child queues, one per depth.
    queues: Vec<FirstChildren>,
    /// The emitted nodes, root first.
    nodes: Vec<Node>,
    /// Per draft position: how many leading candidates the tree reached.
    row_reached: Vec<u32>,
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
    /// The next node in its [`FirstChildren`] queue, or [`NONE`].
    next: u32,
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
        at_most("budget", budget, MAX_BUDGET)?;
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
        at_most("budget", budget, MAX_BUDGET)?;
        check_values(dist)?;
        let n = dist.node_count(budget);
        check_slots(&out, n)?;
        if self.nodes.len() <= n {
            self.nodes.resize(n + 1, Node::default());
        }
        let rows = Rows {
            log_probs: dist.log_probs,
            depth: dist.depth,
            width: dist.width,
        };
        let nodes = &mut self.nodes[..=n];
        search(&mut self.frontier, &mut self.queues, nodes, rows);
        write(nodes, dist, out, &mut self.row_reached);
        self.check_reached_tokens_distinct(dist)
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
            let tokens = &dist.token_ids[row * dist.width..][..reached as usize];
            let fault = match tokens {
                [] => None,
                // Nothing to be distinct from.
                [only] => (only.to_i64() < 0).then(|| TokenFault::Negative {
                    rank: 0,
                    token: only.to_i64(),
                }),
                _ => self.seen_tokens.check_row(tokens),
            };
            if let Some(fault) = fault {
                return Err(token_error(row, fault));
            }
        }
        Ok(())
    }
}

#[cold]
fn token_error(row: usize, fault: TokenFault) -> DdtreeError {
    let message = match fault {
        TokenFault::Negative { rank, token } => {
            format!("token_ids[{row}, {rank}] = {token} is negative")
        }
        TokenFault::Repeated { first, rank, token } => format!(
            "row {row} has token {token} twice (ranks {first} and {rank}); \
             token ids in a row must be distinct"
        ),
    };
    DdtreeError::value("token_ids", message)
}

/// The log-probabilities the search reads, without the token ids, so that
/// the search is compiled once rather than once per token id type.
#[derive(Clone, Copy)]
struct Rows<'a> {
    log_probs: &'a [f32],
    depth: usize,
    width: usize,
}

/// Pops the best prefixes into `nodes[1..]` (one per slot after the
/// root's): each pop emits a node and queues its next sibling (last rank + 1)
/// and its first child (append rank 0), the latter in a [`FirstChildren`]
/// queue where it can.
fn search(
    frontier: &mut Vec<Candidate>,
    queues: &mut Vec<FirstChildren>,
    nodes: &mut [Node],
    rows: Rows<'_>,
) {
    let Rows {
        log_probs,
        depth,
        width,
    } = rows;
    nodes[0] = Node::default();
    if nodes.len() == 1 {
        return;
    }
    queues.clear();
    queues.extend((0..depth).map(|row| FirstChildren::new(log_probs[row * width])));
    // The root's 0.0 plus the first log-prob, like every other score: a sum
    // that starts from 0.0 is never -0.0, so equal scores have equal bits.
    let mut heap = Heap::new(frontier, nodes.len() - 1, queues[0].candidate(0, nodes));
    for node in 1..nodes.len() {
        let c = heap.top();
        let parent = nodes[c.parent as usize];
        let d = parent.depth + 1;
        nodes[node] = Node {
            score: c.score,
            parent: c.parent,
            rank: c.rank,
            depth: d,
            next: NONE,
        };
        let row = d as usize - 1;
        let next = c.rank as usize + 1;
        let sibling = (next < width).then(|| Candidate {
            score: parent.score + log_probs[row * width + next] as f64,
            parent: c.parent,
            rank: next as u32,
        });
        let queued = if c.rank == 0 {
            queues[row].pop(c.parent, nodes)
        } else {
            None
        };
        let child = match queues.get_mut(row + 1) {
            Some(queue) => queue.push(node as u32, nodes),
            None => None,
        };
        heap.replace_top([sibling, queued, child], nodes);
    }
}

/// No node.
const NONE: u32 = u32::MAX;

/// The first-child candidates of the nodes at one depth, best first, linked
/// through [`Node::next`]; only the head is in the heap. Nodes of a depth
/// mostly pop in the order of their first children (the same log-prob added
/// to each), so most first children wait here instead of in the heap, which
/// stays about half as large. One that would not sort last goes to the heap
/// directly.
#[derive(Clone, Copy)]
struct FirstChildren {
    head: u32,
    tail: u32,
    /// The log-prob of rank 0 at the children's depth.
    log_prob: f32,
}

impl FirstChildren {
    fn new(log_prob: f32) -> Self {
        FirstChildren {
            head: NONE,
            tail: NONE,
            log_prob,
        }
    }

    /// The first child of `node` as a candidate, scored as the search scores
    /// every candidate (so the same on every call).
    #[inline(always)]
    fn candidate(&self, node: u32, nodes: &[Node]) -> Candidate {
        Candidate {
            score: nodes[node as usize].score + self.log_prob as f64,
            parent: node,
            rank: 0,
        }
    }

    /// Queues the first child of `node`, just popped; returns it when it
    /// must go to the heap instead: as the new head, or out of order.
    #[inline(always)]
    fn push(&mut self, node: u32, nodes: &mut [Node]) -> Option<Candidate> {
        let child = self.candidate(node, nodes);
        if self.head == NONE {
            (self.head, self.tail) = (node, node);
            return Some(child);
        }
        if !pops_before(&self.candidate(self.tail, nodes), &child, nodes) {
            return Some(child);
        }
        nodes[self.tail as usize].next = node;
        self.tail = node;
        None
    }

    /// Called when the first child of `parent` pops: if it was the head,
    /// dequeues it and returns the next head, which joins the heap.
    #[inline(always)]
    fn pop(&mut self, parent: u32, nodes: &[Node]) -> Option<Candidate> {
        if self.head != parent {
            return None;
        }
        self.head = nodes[parent as usize].next;
        (self.head != NONE).then(|| self.candidate(self.head, nodes))
    }
}

/// Copies the nodes into the caller's slots and counts, per row, the
/// candidates the tree reached.
fn write<T: TokenId>(
    nodes: &[Node],
    dist: &DraftDistribution<'_, T>,
    out: TreeSlots<'_>,
    row_reached: &mut Vec<u32>,
) {
    row_reached.clear();
    row_reached.resize(dist.depth, 0);
    (out.parents[0], out.depths[0], out.scores[0]) = (-1, 0, 0.0);
    let slots = out.parents[1..]
        .iter_mut()
        .zip(&mut out.depths[1..])
        .zip(&mut out.scores[1..])
        .zip(out.tokens.iter_mut());
    for (node, (((parent, depth), score), token)) in nodes[1..].iter().zip(slots) {
        *parent = node.parent as i32;
        *depth = node.depth as i32;
        *score = node.score as f32;
        let row = node.depth as usize - 1;
        *token = dist.token(row, node.rank as usize);
        let reached = &mut row_reached[row];
        *reached = (*reached).max(node.rank + 1);
    }
}

/// The search's priority queue: a binary max-heap of candidates, higher
/// score first, equal scores by the smaller rank tuple (which the nodes
/// emitted so far give), in a slice sized up front: it holds part of the
/// frontier, which n pops grow to at most n + 1 candidates (each pop takes
/// one and adds at most two). Slots past the last candidate hold the
/// [`EMPTY`] sentinel, so that every candidate has a right child to compare
/// with.
struct Heap<'a> {
    slots: &'a mut [Candidate],
    len: usize,
}

/// No candidate: NaN is neither above nor equal to any score, so the
/// sentinel never wins a comparison (it only ever appears as the first
/// operand of [`pops_before`], in [`Heap::sift_down`]'s choice of a child).
const EMPTY: Candidate = Candidate {
    score: f64::NAN,
    parent: 0,
    rank: 0,
};

impl<'a> Heap<'a> {
    /// A heap holding `first`, for a search of `pops` pops, in `storage`.
    fn new(storage: &'a mut Vec<Candidate>, pops: usize, first: Candidate) -> Self {
        storage.clear();
        // The most candidates, and the sentinel after them.
        storage.resize(pops + 2, EMPTY);
        storage[0] = first;
        Heap {
            slots: storage,
            len: 1,
        }
    }

    /// The next candidate; the search never pops more than it pushed.
    #[inline]
    fn top(&self) -> Candidate {
        self.slots[0]
    }

    /// Removes the top and adds `new` (up to three candidates), the best in
    /// its place with one sift down, the others by pushes.
    #[inline(always)]
    fn replace_top(&mut self, new: [Option<Candidate>; 3], nodes: &[Node]) {
        match new {
            [Some(a), None, None] | [None, Some(a), None] | [None, None, Some(a)] => {
                self.sift_down(a, nodes)
            }
            [Some(a), None, Some(b)] | [Some(a), Some(b), None] | [None, Some(a), Some(b)] => {
                // The better of the two is often the next pop: it takes the
                // top and barely sinks; the other joins at the bottom and
                // barely climbs. The other way round both would travel far.
                let (first, second) = if pops_before(&a, &b, nodes) {
                    (a, b)
                } else {
                    (b, a)
                };
                self.sift_down(first, nodes);
                self.push(second, nodes);
            }
            [Some(a), Some(b), Some(c)] => {
                self.sift_down(a, nodes);
                self.push(b, nodes);
                self.push(c, nodes);
            }
            [None, None, None] => {
                self.len -= 1;
                let last = std::mem::replace(&mut self.slots[self.len], EMPTY);
                self.sift_down(last, nodes);
            }
        }
    }

    /// Puts `moving` at the top and sinks it to its place.
    #[inline(always)]
    fn sift_down(&mut self, moving: Candidate, nodes: &[Node]) {
        let heap = &mut self.slots[..=self.len];
        let len = heap.len() - 1;
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

    /// Adds `c` where the sentinel was and climbs it up.
    #[inline(always)]
    fn push(&mut self, c: Candidate, nodes: &[Node]) {
        let heap = &mut self.slots[..=self.len];
        let mut hole = self.len;
        self.len += 1;
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
    if a.score == b.score {
        return rank_tuple_cmp(a, b, nodes) == Ordering::Less;
    }
    a.score > b.score
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
pub fn check_values<T: TokenId>(dist: &DraftDistribution<'_, T>) -> Result<()> {
    if values_ok(dist.log_probs, dist.width) {
        Ok(())
    } else {
        Err(describe_bad_value(dist))
    }
}

/// Whether each row is non-increasing and starts at most at the tolerance
/// (false on NaN). With AVX2, where the CPU has it: the check reads every
/// value of every row, and eight lanes cut its cost.
fn values_ok(log_probs: &[f32], width: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if width > avx2::LANES && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, as just checked.
        return unsafe { avx2::values_ok(log_probs, width) };
    }
    values_ok_any_cpu(log_probs, width)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub const LANES: usize = 8;

    /// [`super::values_ok_any_cpu`] for rows longer than [`LANES`]: each
    /// step compares eight pairs `(row[i], row[i + 1])`, the row's last step
    /// overlapping the one before rather than leaving a scalar tail.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    pub unsafe fn values_ok(log_probs: &[f32], width: usize) -> bool {
        assert!(width > LANES);
        let steps = (width - 1) / LANES;
        let last = width - 1 - LANES;
        let mut unsorted = _mm256_setzero_ps();
        let mut bad_start = false;
        for row in log_probs.chunks_exact(width) {
            bad_start |= !(row[0] <= super::LOG_PROB_TOLERANCE);
            let row = row.as_ptr();
            // SAFETY: every step reads LANES + 1 values from `row[i]` with
            // i <= last = width - 1 - LANES.
            unsafe {
                for step in 0..steps {
                    unsorted = _mm256_or_ps(unsorted, unsorted_pairs(row.add(step * LANES)));
                }
                unsorted = _mm256_or_ps(unsorted, unsorted_pairs(row.add(last)));
            }
        }
        _mm256_movemask_ps(unsorted) == 0 && !bad_start
    }

    /// Lanes where `!(at[i + 1] <= at[i])` (not-less-or-equal: true on NaN,
    /// like the scalar check), for i < LANES.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unsorted_pairs(at: *const f32) -> __m256 {
        // SAFETY: the caller provides LANES + 1 readable values at `at`.
        unsafe { _mm256_cmp_ps::<_CMP_NLE_UQ>(_mm256_loadu_ps(at.add(1)), _mm256_loadu_ps(at)) }
    }
}

// `!(b <= a)` rather than `b > a`: the negation is what makes NaN fail.
#[inline(always)]
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn values_ok_any_cpu(log_probs: &[f32], width: usize) -> bool {
    let mut bad = false;
    for row in log_probs.chunks_exact(width.max(1)) {
        bad |= !row_non_increasing(row);
        bad |= !(row[0] <= LOG_PROB_TOLERANCE);
    }
    !bad
}

/// Whether every `row[i + 1] <= row[i]` (false on NaN). Compares blocks of
/// [`BLOCK`] pairs into lane flags with no branch but the loop's, the last
/// block overlapping its predecessor rather than leaving a scalar tail, so
/// that the compiler vectorizes it.
#[inline(always)]
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
    /// A power-of-two number of slots; a slot whose stamp is not the
    /// current row's is empty.
    slots: Vec<TokenSlot>,
    stamp: u32,
}

/// One slot of a [`TokenSet`]: a token and the rank it was first seen at,
/// side by side so that a probe touches one cache line.
#[derive(Clone, Copy, Default)]
struct TokenSlot {
    token: i64,
    stamp: u32,
    rank: u32,
}

/// What is wrong with a row's tokens.
enum TokenFault {
    Negative { rank: usize, token: i64 },
    Repeated { first: u32, rank: usize, token: i64 },
}

impl TokenSet {
    /// The first negative or repeated token of a row, if any.
    fn check_row<T: TokenId>(&mut self, tokens: &[T]) -> Option<TokenFault> {
        let mask = self.start_row(tokens.len());
        let slots = &mut self.slots[..=mask];
        for (rank, token) in tokens.iter().enumerate() {
            let token = token.to_i64();
            if token < 0 {
                return Some(TokenFault::Negative { rank, token });
            }
            let hash = (token as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut slot = (hash >> 32) as usize;
            loop {
                let probe = &mut slots[slot & mask];
                if probe.stamp != self.stamp {
                    *probe = TokenSlot {
                        token,
                        stamp: self.stamp,
                        rank: rank as u32,
                    };
                    break;
                }
                if probe.token == token {
                    let first = probe.rank;
                    return Some(TokenFault::Repeated { first, rank, token });
                }
                slot += 1;
            }
        }
        None
    }

    /// Empties the set for a row of `len` tokens (at most half full, so
    /// probes stay short); returns the slot mask.
    fn start_row(&mut self, len: usize) -> usize {
        let capacity = (2 * len).next_power_of_two().max(16);
        if self.slots.len() < capacity || self.stamp == u32::MAX {
            self.slots = vec![TokenSlot::default(); capacity];
            self.stamp = 0;
        }
        self.stamp += 1;
        self.slots.len() - 1
    }
}
