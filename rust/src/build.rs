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

/// A prefix on the frontier: the node it extends, its last rank and its score.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    score: f64,
    parent: u32,
    rank: u32,
    depth: u32,
}

/// Reusable scratch for building trees; one per thread. Building allocates
/// nothing once the scratch has grown to the largest budget seen.
#[derive(Default)]
pub struct TreeBuilder {
    heap: Vec<Candidate>,
    node_parent: Vec<u32>,
    node_rank: Vec<u32>,
    node_score: Vec<f64>,
    ranks_a: Vec<u32>,
    ranks_b: Vec<u32>,
    seen_tokens: TokenSet,
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
        validate_distribution(dist, &mut self.seen_tokens)?;
        let n = dist.node_count(budget);
        check_slots(&out, n)?;
        self.reset(n);
        let TreeSlots {
            tokens,
            parents,
            depths,
            scores,
        } = out;
        parents[0] = -1;
        depths[0] = 0;
        scores[0] = 0.0;
        if n == 0 {
            return Ok(());
        }
        self.push(Candidate {
            score: dist.log_prob(0, 0) as f64,
            parent: 0,
            rank: 0,
            depth: 1,
        });
        for node in 1..=n {
            let c = self.pop();
            let row = c.depth as usize - 1;
            tokens[node - 1] = dist.token(row, c.rank as usize);
            parents[node] = c.parent as i32;
            depths[node] = c.depth as i32;
            scores[node] = c.score as f32;
            self.node_parent.push(c.parent);
            self.node_rank.push(c.rank);
            self.node_score.push(c.score);
            self.push_successors(dist, node as u32, c);
        }
        Ok(())
    }

    fn reset(&mut self, n: usize) {
        self.heap.clear();
        self.heap.reserve(2 * n + 2);
        for v in [&mut self.node_parent, &mut self.node_rank] {
            v.clear();
            v.reserve(n + 1);
            v.push(0);
        }
        self.node_score.clear();
        self.node_score.reserve(n + 1);
        self.node_score.push(0.0);
    }

    fn push_successors<T: TokenId>(
        &mut self,
        dist: &DraftDistribution<'_, T>,
        node: u32,
        c: Candidate,
    ) {
        let row = c.depth as usize - 1;
        let next_rank = c.rank as usize + 1;
        if next_rank < dist.width {
            let parent_score = self.node_score[c.parent as usize];
            self.push(Candidate {
                score: parent_score + dist.log_prob(row, next_rank) as f64,
                parent: c.parent,
                rank: next_rank as u32,
                depth: c.depth,
            });
        }
        if (c.depth as usize) < dist.depth {
            self.push(Candidate {
                score: c.score + dist.log_prob(row + 1, 0) as f64,
                parent: node,
                rank: 0,
                depth: c.depth + 1,
            });
        }
    }

    /// True when `a` must pop before `b`.
    fn pops_before(&mut self, a: &Candidate, b: &Candidate) -> bool {
        match a.score.partial_cmp(&b.score) {
            Some(Ordering::Greater) => true,
            Some(Ordering::Less) => false,
            // Equal (including -inf == -inf): smaller rank tuple first.
            _ => self.rank_tuple_cmp(a, b) == Ordering::Less,
        }
    }

    /// Lexicographic order of the two candidates' rank tuples (a proper
    /// prefix sorts first). Only reached on exact score ties.
    fn rank_tuple_cmp(&mut self, a: &Candidate, b: &Candidate) -> Ordering {
        fill_rank_tuple(&mut self.ranks_a, &self.node_parent, &self.node_rank, a);
        fill_rank_tuple(&mut self.ranks_b, &self.node_parent, &self.node_rank, b);
        self.ranks_a.cmp(&self.ranks_b)
    }

    fn push(&mut self, c: Candidate) {
        self.heap.push(c);
        let mut child = self.heap.len() - 1;
        while child > 0 {
            let parent = (child - 1) / 2;
            let (cv, pv) = (self.heap[child], self.heap[parent]);
            if !self.pops_before(&cv, &pv) {
                break;
            }
            self.heap.swap(child, parent);
            child = parent;
        }
    }

    fn pop(&mut self) -> Candidate {
        let top = self.heap.swap_remove(0);
        let len = self.heap.len();
        let mut parent = 0;
        loop {
            let left = 2 * parent + 1;
            if left >= len {
                break;
            }
            let right = left + 1;
            let mut best = left;
            if right < len {
                let (r, l) = (self.heap[right], self.heap[left]);
                if self.pops_before(&r, &l) {
                    best = right;
                }
            }
            let (bv, pv) = (self.heap[best], self.heap[parent]);
            if !self.pops_before(&bv, &pv) {
                break;
            }
            self.heap.swap(best, parent);
            parent = best;
        }
        top
    }
}

/// Writes the rank tuple of candidate `c` (root first) into `out`.
fn fill_rank_tuple(out: &mut Vec<u32>, node_parent: &[u32], node_rank: &[u32], c: &Candidate) {
    out.clear();
    out.push(c.rank);
    let mut node = c.parent as usize;
    while node != 0 {
        out.push(node_rank[node]);
        node = node_parent[node] as usize;
    }
    out.reverse();
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

/// Rejects NaN, positive log-probs, rows that increase, negative and
/// duplicate token ids: each would make the tree silently wrong.
pub fn validate_distribution<T: TokenId>(
    dist: &DraftDistribution<'_, T>,
    seen: &mut TokenSet,
) -> Result<()> {
    for row in 0..dist.depth {
        let mut previous = f32::INFINITY;
        seen.start_row(dist.width);
        for rank in 0..dist.width {
            let lp = dist.log_prob(row, rank);
            if lp.is_nan() {
                return Err(DdtreeError::value(
                    "log_probs",
                    format!("log_probs[{row}, {rank}] is NaN"),
                ));
            }
            if lp > LOG_PROB_TOLERANCE {
                return Err(DdtreeError::value(
                    "log_probs",
                    format!("log_probs[{row}, {rank}] = {lp} is positive; expected log-probabilities (<= 0)"),
                ));
            }
            if lp > previous {
                return Err(DdtreeError::value(
                    "log_probs",
                    format!(
                        "row {row} is not sorted: log_probs[{row}, {}] = {previous} < log_probs[{row}, {rank}] = {lp}; \
                         each row must be non-increasing (top-k order)",
                        rank - 1
                    ),
                ));
            }
            previous = lp;
            let token = dist.token(row, rank);
            if token < 0 {
                return Err(DdtreeError::value(
                    "token_ids",
                    format!("token_ids[{row}, {rank}] = {token} is negative"),
                ));
            }
            if let Some(first) = seen.insert(token, rank as u32) {
                return Err(DdtreeError::value(
                    "token_ids",
                    format!("row {row} has token {token} twice (ranks {first} and {rank}); token ids in a row must be distinct"),
                ));
            }
        }
    }
    Ok(())
}

/// An open-addressing set of token ids, cleared in O(1) per row by a
/// generation stamp, so the duplicate check costs O(K) per row.
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
