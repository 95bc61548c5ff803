//! Property tests of the core against brute-force oracles.

use ddtree::{
    accept_trees, build_trees, compile_trees, kv_moves, BatchDistribution, CompiledTree,
    DraftDistribution, Executor, TreeBuilder, TreeWalker,
};
use proptest::prelude::*;

/// A random draft distribution: rows sorted non-increasing, with ties and
/// `-inf` common so tie-breaking is exercised; tokens distinct per row.
fn distribution(
    max_depth: usize,
    max_width: usize,
) -> impl Strategy<Value = (usize, usize, Vec<f32>, Vec<i64>)> {
    (0..=max_depth, 0..=max_width).prop_flat_map(|(depth, width)| {
        let value = prop_oneof![
            4 => (0u8..6).prop_map(|k| -0.5 * k as f32),
            1 => Just(f32::NEG_INFINITY),
            3 => -8.0f32..0.0,
        ];
        let rows = prop::collection::vec(prop::collection::vec(value, width), depth);
        let tokens = prop::collection::vec(
            Just((0..width as i64 * 3).collect::<Vec<_>>()).prop_shuffle(),
            depth,
        );
        (Just(depth), Just(width), rows, tokens).prop_map(|(depth, width, rows, tokens)| {
            let mut lp = Vec::new();
            let mut ids = Vec::new();
            for (mut row, tok) in rows.into_iter().zip(tokens) {
                row.sort_by(|a, b| b.partial_cmp(a).unwrap());
                lp.extend(row);
                ids.extend(&tok[..width]);
            }
            (depth, width, lp, ids)
        })
    })
}

/// Every prefix as (score, rank tuple), sorted best first: the oracle order.
fn all_prefixes_sorted(lp: &[f32], depth: usize, width: usize) -> Vec<(f64, Vec<u32>)> {
    let mut out: Vec<(f64, Vec<u32>)> = Vec::new();
    let mut level: Vec<(f64, Vec<u32>)> = vec![(0.0, vec![])];
    for d in 0..depth {
        let mut next = Vec::new();
        for (score, ranks) in &level {
            for r in 0..width {
                let mut t = ranks.clone();
                t.push(r as u32);
                next.push((score + lp[d * width + r] as f64, t));
            }
        }
        out.extend(next.iter().cloned());
        level = next;
    }
    out.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then_with(|| a.1.cmp(&b.1)));
    out
}

/// The rank tuple of every node, recovered from tokens and parents.
fn rank_tuples(tree: &ddtree::Tree, ids: &[i64], width: usize) -> Vec<Vec<u32>> {
    let mut tuples: Vec<Vec<u32>> = vec![vec![]];
    for i in 1..tree.len() {
        let depth = tree.depths[i] as usize;
        let row = &ids[(depth - 1) * width..depth * width];
        let rank = row.iter().position(|&t| t == tree.tokens[i - 1]).unwrap() as u32;
        let mut t = tuples[tree.parents[i] as usize].clone();
        t.push(rank);
        tuples.push(t);
    }
    tuples
}

fn is_ancestor_or_self(parents: &[i32], ancestor: usize, mut node: usize) -> bool {
    loop {
        if node == ancestor {
            return true;
        }
        if node == 0 {
            return false;
        }
        node = parents[node] as usize;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, .. ProptestConfig::default() })]

    #[test]
    fn tree_is_the_top_budget_prefixes_in_heap_order(
        (depth, width, lp, ids) in distribution(4, 4),
        budget in 0usize..50,
    ) {
        let dist = DraftDistribution::new(&lp, &ids, depth, width).unwrap();
        let tree = TreeBuilder::new().build(&dist, budget).unwrap();
        let oracle = all_prefixes_sorted(&lp, depth, width);
        let n = budget.min(oracle.len());
        prop_assert_eq!(tree.tokens.len(), n);
        let tuples = rank_tuples(&tree, &ids, width);
        for i in 1..=n {
            prop_assert_eq!(&tuples[i], &oracle[i - 1].1, "node {} differs", i);
            prop_assert_eq!(tree.scores[i], oracle[i - 1].0 as f32);
            prop_assert!(tree.parents[i] >= 0 && (tree.parents[i] as usize) < i);
            prop_assert_eq!(tree.depths[i] as usize, tuples[i].len());
        }
        prop_assert_eq!(tree.parents[0], -1);
        prop_assert!(tree.view().validate().is_ok());
    }

    #[test]
    fn compiled_tree_matches_naive_ancestry(
        (depth, width, lp, ids) in distribution(5, 3),
        budget in 0usize..70,
        start in 0i64..1000,
        window in 0usize..5,
    ) {
        let dist = DraftDistribution::new(&lp, &ids, depth, width).unwrap();
        let tree = TreeBuilder::new().build(&dist, budget).unwrap();
        let compiled = CompiledTree::new(tree.view(), start, window).unwrap();
        let n = tree.len();
        let mask = compiled.dense_mask().unwrap();
        for i in 0..n {
            prop_assert_eq!(compiled.positions[i], start + tree.depths[i] as i64);
            for j in 0..n {
                prop_assert_eq!(mask[i * n + j], is_ancestor_or_self(&tree.parents, j, i));
            }
            // Conv window: walk up w steps, then count into the history.
            let mut expected = Vec::new();
            let mut node = i as i32;
            let mut history = 0;
            for _ in 0..window {
                if node > 0 {
                    node = tree.parents[node as usize];
                    expected.push(node);
                } else {
                    history -= 1;
                    expected.push(history);
                    node = -1;
                }
            }
            expected.reverse();
            prop_assert_eq!(&compiled.windows[i * window..(i + 1) * window], &expected[..]);
        }
    }

    #[test]
    fn acceptance_walks_matching_children(
        (depth, width, lp, ids) in distribution(5, 3),
        budget in 0usize..70,
        choices in prop::collection::vec(0u8..4, 128),
    ) {
        let dist = DraftDistribution::new(&lp, &ids, depth, width).unwrap();
        let tree = TreeBuilder::new().build(&dist, budget).unwrap();
        let n = tree.len();
        // Target token per node: often one of the node's children, else junk.
        let target: Vec<i64> = (0..n).map(|i| {
            let children: Vec<i64> = (1..n).filter(|&c| tree.parents[c] as usize == i).map(|c| tree.tokens[c - 1]).collect();
            let pick = choices[i % choices.len()] as usize;
            if pick < children.len() { children[pick] } else { 1_000_000 + i as i64 }
        }).collect();
        let (path, bonus) = TreeWalker::new().accept(tree.view(), &target).unwrap();
        prop_assert_eq!(path[0], 0);
        for k in 1..path.len() {
            let (p, c) = (path[k - 1] as usize, path[k] as usize);
            prop_assert_eq!(tree.parents[c] as usize, p);
            prop_assert_eq!(tree.tokens[c - 1], target[p]);
        }
        let last = *path.last().unwrap() as usize;
        prop_assert_eq!(bonus, target[last]);
        let stuck = (1..n).any(|c| tree.parents[c] as usize == last && tree.tokens[c - 1] == target[last]);
        prop_assert!(!stuck, "walk stopped although a child matched");
        // KV moves make the path contiguous, applied sequentially in place.
        let mut slots: Vec<i32> = (0..n as i32).collect();
        for (src, dst) in kv_moves(&path) {
            slots[dst as usize] = slots[src as usize];
        }
        prop_assert_eq!(&slots[..path.len()], &path[..]);
    }

    #[test]
    fn batch_equals_loop_of_singles(
        trees in prop::collection::vec((distribution(3, 3), 0usize..20, 0i64..50), 1..6),
        threads in 1usize..3,
    ) {
        // One depth and width for the batch: pad every request to the largest.
        let depth = trees.iter().map(|t| t.0.0).max().unwrap();
        let width = trees.iter().map(|t| t.0.1).max().unwrap();
        let mut lp = Vec::new();
        let mut ids = Vec::new();
        for ((d, w, l, i), _, _) in &trees {
            for row in 0..depth {
                for rank in 0..width {
                    let inside = row < *d && rank < *w;
                    lp.push(if inside { l[row * w + rank] } else { f32::NEG_INFINITY });
                    ids.push(if inside { i[row * w + rank] } else { 10_000 + rank as i64 });
                }
            }
        }
        let budgets: Vec<usize> = trees.iter().map(|t| t.1).collect();
        let starts: Vec<i64> = trees.iter().map(|t| t.2).collect();
        let dist = BatchDistribution { log_probs: &lp, token_ids: &ids, requests: trees.len(), depth, width };
        let batch = build_trees(&dist, &budgets, &Executor::new(threads).unwrap()).unwrap();
        let compiled = compile_trees(&batch, &starts, 3).unwrap();
        // Target agrees with each node's first child where it has one.
        let target: Vec<i64> = (0..trees.len()).flat_map(|r| {
            let view = batch.tree(r);
            (0..view.len()).map(move |i| {
                (1..view.len()).find(|&c| view.parents[c] as usize == i).map_or(-7, |c| view.tokens[c - 1])
            })
        }).collect();
        let accepted = accept_trees(&batch, &target).unwrap();
        let size = depth * width;
        for r in 0..trees.len() {
            let single_dist = DraftDistribution::new(&lp[r * size..(r + 1) * size], &ids[r * size..(r + 1) * size], depth, width).unwrap();
            let single = TreeBuilder::new().build(&single_dist, budgets[r]).unwrap();
            let view = batch.tree(r);
            prop_assert_eq!(view.tokens, &single.tokens[..]);
            prop_assert_eq!(view.parents, &single.parents[..]);
            prop_assert_eq!(view.depths, &single.depths[..]);
            prop_assert_eq!(view.scores, &single.scores[..]);
            let c = CompiledTree::new(single.view(), starts[r], 3).unwrap();
            let nodes = batch.node_offsets[r] as usize..batch.node_offsets[r + 1] as usize;
            prop_assert_eq!(&compiled.positions[nodes.clone()], &c.positions[..]);
            prop_assert_eq!(&compiled.windows[nodes.start * 3..nodes.end * 3], &c.windows[..]);
            for (row, i) in nodes.clone().enumerate() {
                let got = &compiled.ancestor_bits[i * compiled.words..i * compiled.words + c.words];
                prop_assert_eq!(got, &c.ancestor_bits[row * c.words..(row + 1) * c.words]);
                prop_assert!(compiled.ancestor_bits[i * compiled.words + c.words..(i + 1) * compiled.words].iter().all(|&w| w == 0));
            }
            let (path, bonus) = TreeWalker::new().accept(single.view(), &target[nodes]).unwrap();
            let w = accepted.width;
            prop_assert_eq!(&accepted.paths[r * w..r * w + path.len()], &path[..]);
            prop_assert!(accepted.paths[r * w + path.len()..(r + 1) * w].iter().all(|&p| p == -1));
            prop_assert_eq!(accepted.bonus[r], bonus);
            prop_assert_eq!(accepted.accepted[r] as usize, path.len() - 1);
            prop_assert_eq!(accepted.output_tokens[r * w + path.len() - 1], bonus);
        }
    }
}

/// A batch past the parallel threshold (64 trees of 64 nodes), with request
/// `bad` (if any) given a repeated token; depth 2, width 64.
fn large_batch(bad: &[usize]) -> (Vec<f32>, Vec<i64>) {
    let (requests, depth, width) = (64, 2, 64);
    let mut lp = Vec::new();
    let mut ids = Vec::new();
    for r in 0..requests {
        for row in 0..depth {
            lp.extend((0..width).map(|k| -0.01 * (k + r + row) as f32));
            ids.extend((0..width as i64).map(|k| if bad.contains(&r) && k == 1 { 0 } else { k }));
        }
    }
    (lp, ids)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Threads split a large batch between them yet report what a serial
    /// loop does: the trees, or the first failing request's error.
    #[test]
    fn threaded_batch_equals_serial(
        bad in prop::collection::vec(0usize..64, 0..4),
        threads in 2usize..5,
    ) {
        let (lp, ids) = large_batch(&bad);
        let dist = BatchDistribution { log_probs: &lp, token_ids: &ids, requests: 64, depth: 2, width: 64 };
        let budgets = vec![64; 64];
        let serial = build_trees(&dist, &budgets, &Executor::new(1).unwrap());
        let threaded = build_trees(&dist, &budgets, &Executor::new(threads).unwrap());
        prop_assert_eq!(serial.is_ok(), bad.is_empty());
        prop_assert_eq!(threaded, serial);
    }
}

proptest! {
    /// The value check (vectorized for rows wider than eight) accepts
    /// exactly the rows that start at most at the tolerance and never
    /// increase, NaN nowhere.
    #[test]
    fn value_check_equals_naive(
        depth in 0usize..4,
        width in 0usize..40,
        seed in prop::collection::vec((0u8..8, 0u8..16), 160),
        sort in any::<bool>(),
        nan_at in prop::option::of(0usize..160),
    ) {
        let pick = |(kind, k): (u8, u8)| match kind {
            0 => 0.5,
            1 => f32::NEG_INFINITY,
            2 => 0.0,
            _ => -0.25 * k as f32,
        };
        let mut lp: Vec<f32> = seed.into_iter().cycle().take(depth * width).map(pick).collect();
        if sort {
            for row in lp.chunks_mut(width.max(1)) {
                row.sort_by(|a, b| b.total_cmp(a));
            }
        }
        if let Some(at) = nan_at.filter(|&at| at < lp.len()) {
            lp[at] = f32::NAN;
        }
        let ids: Vec<i64> = (0..(depth * width) as i64).collect();
        let dist = DraftDistribution::new(&lp, &ids, depth, width).unwrap();
        let naive = lp.chunks(width.max(1)).all(|row| {
            row[0] <= 1e-3 && row.windows(2).all(|w| w[1] <= w[0])
        });
        prop_assert_eq!(ddtree::build::check_values(&dist).is_ok(), naive);
    }
}
