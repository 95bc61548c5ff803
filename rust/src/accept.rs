//! Tree-walk acceptance.
//!
//! The target produces one token per node (its argmax at temperature 0, or one
//! sample from the request's own sampling distribution at node i's context).
//! Starting at the root, the walk moves to the child whose draft token equals
//! the target's token at the current node, and stops when no child does.
//!
//! Why this is lossless at any temperature: the token emitted after the
//! accepted path is always the target's own sample at that context, and every
//! accepted draft token *is* the target's sample at its parent's context (it
//! was only accepted because they are equal). Each emitted token is therefore a
//! sample from the target's distribution given everything before it, drawn
//! independently per node, exactly as autoregressive sampling would draw it;
//! the draft only decides how many of those samples one pass can keep.

use crate::error::{DdtreeError, Result};
use crate::tree::TreeView;

/// Reusable child lists (first child / next sibling) for walking trees.
#[derive(Default)]
pub struct TreeWalker {
    first_child: Vec<i32>,
    next_sibling: Vec<i32>,
}

/// Where one acceptance is written: `path` and `output_tokens` have the same
/// width (at least the tree's depth + 1) and are padded with -1.
pub struct AcceptSlots<'a> {
    /// Accepted node indices, starting with the root 0.
    pub path: &'a mut [i32],
    /// Accepted draft tokens followed by the bonus token: vLLM's chain format.
    pub output_tokens: &'a mut [i64],
}

impl TreeWalker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Walks `tree` with the target's per-node tokens `[N]`; returns the path
    /// (root first) and the bonus token.
    pub fn accept(&mut self, tree: TreeView<'_>, target_tokens: &[i64]) -> Result<(Vec<i32>, i64)> {
        let width = tree.max_depth() + 1;
        let mut path = vec![-1; width];
        let mut output_tokens = vec![-1; width];
        let (len, bonus) = self.accept_into(
            tree,
            target_tokens,
            AcceptSlots {
                path: &mut path,
                output_tokens: &mut output_tokens,
            },
        )?;
        path.truncate(len);
        Ok((path, bonus))
    }

    /// Walks into caller-owned, fully rewritten slots; returns the path length
    /// (root included) and the bonus token.
    pub fn accept_into(
        &mut self,
        tree: TreeView<'_>,
        target_tokens: &[i64],
        out: AcceptSlots<'_>,
    ) -> Result<(usize, i64)> {
        if target_tokens.len() != tree.len() {
            return Err(DdtreeError::shape(
                "target_tokens",
                format!("[{}] (one per tree node, root included)", tree.len()),
                format!("[{}]", target_tokens.len()),
            ));
        }
        let width = out.path.len();
        if width < tree.max_depth() + 1 || out.output_tokens.len() != width {
            return Err(DdtreeError::Internal(format!(
                "acceptance slots of width {width} for a tree of depth {}",
                tree.max_depth()
            )));
        }
        self.index_children(tree.parents);
        out.path.fill(-1);
        out.output_tokens.fill(-1);
        out.path[0] = 0;
        let mut node = 0usize;
        let mut len = 1;
        while let Some(child) = self.child_with_token(tree.tokens, node, target_tokens[node]) {
            out.output_tokens[len - 1] = target_tokens[node];
            out.path[len] = child as i32;
            len += 1;
            node = child;
        }
        let bonus = target_tokens[node];
        out.output_tokens[len - 1] = bonus;
        Ok((len, bonus))
    }

    fn index_children(&mut self, parents: &[i32]) {
        let n = parents.len();
        self.first_child.clear();
        self.first_child.resize(n, -1);
        self.next_sibling.clear();
        self.next_sibling.resize(n, -1);
        // Reverse order keeps each child list in node (pop) order.
        for i in (1..n).rev() {
            let p = parents[i] as usize;
            self.next_sibling[i] = self.first_child[p];
            self.first_child[p] = i as i32;
        }
    }

    fn child_with_token(&self, tokens: &[i64], node: usize, token: i64) -> Option<usize> {
        let mut child = self.first_child[node];
        while child >= 0 {
            if tokens[child as usize - 1] == token {
                return Some(child as usize);
            }
            child = self.next_sibling[child as usize];
        }
        None
    }
}
