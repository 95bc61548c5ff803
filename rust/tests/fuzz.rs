//! A crash fuzzer of the core on stable Rust: raw inputs (any f32 bit pattern, any token id, sizes that do not
//! match, absurd budgets, windows and starts) through build, compile and accept. The property is that every
//! call returns, `Ok` or an `Err` naming the problem: no panic, no abort. proptest shrinks a failure to a
//! minimal input and keeps it in `fuzz.proptest-regressions`.

use ddtree::{
    accept_trees, build_trees, compile_trees, BatchDistribution, CompiledTree, DraftDistribution,
    Executor, TreeBuilder, TreeWalker,
};
use proptest::prelude::*;

/// Raw draft inputs: `requests x depth x width` values, sometimes a few more or fewer than that.
fn raw_inputs() -> impl Strategy<Value = (usize, usize, usize, Vec<f32>, Vec<i64>)> {
    (0usize..4, 0usize..6, 0usize..6, -2i64..3, -2i64..3).prop_flat_map(
        |(requests, depth, width, lp_extra, id_extra)| {
            let n = requests * depth * width;
            let value = prop_oneof![
                4 => -12.0f32..0.0,
                1 => Just(f32::NEG_INFINITY),
                1 => any::<u32>().prop_map(f32::from_bits),  // NaN, +inf, positive, subnormal
                1 => Just(0.0f32),
            ];
            let token = prop_oneof![4 => 0i64..20, 1 => any::<i64>()];
            (
                Just(requests),
                Just(depth),
                Just(width),
                prop::collection::vec(value, (n as i64 + lp_extra).max(0) as usize),
                prop::collection::vec(token, (n as i64 + id_extra).max(0) as usize),
            )
        },
    )
}

fn sort_rows(lp: &mut [f32], width: usize) {
    if width > 0 {
        for row in lp.chunks_mut(width) {
            row.sort_by(|a, b| b.partial_cmp(a).unwrap_or(std::cmp::Ordering::Equal));
        }
    }
}

fn budget() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0usize..40, 1 => any::<usize>(), 1 => Just(ddtree::limits::MAX_BUDGET + 1)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn raw_inputs_never_panic(
        (requests, depth, width, mut lp, ids) in raw_inputs(),
        sorted in any::<bool>(),
        budgets in prop::collection::vec(budget(), 0..5),
        threads in 1usize..3,
        starts in prop::collection::vec(any::<i64>(), 0..5),
        window in prop_oneof![4 => 0usize..5, 1 => any::<usize>()],
        targets in prop::collection::vec(prop_oneof![3 => 0i64..20, 1 => any::<i64>()], 0..200),
    ) {
        if sorted {
            sort_rows(&mut lp, width);
        }
        // One tree, through the single-request API.
        let one = requests.min(1) * depth * width;
        if lp.len() >= one && ids.len() >= one {
            if let Ok(dist) = DraftDistribution::new(&lp[..one], &ids[..one], depth * requests.min(1), width) {
                if let Ok(tree) = TreeBuilder::new().build(&dist, budgets.first().copied().unwrap_or(8)) {
                    let view = tree.view();
                    let _ = CompiledTree::new(view, starts.first().copied().unwrap_or(0), window)
                        .map(|c| c.dense_mask());
                    let take = targets.len().min(view.len());
                    let _ = TreeWalker::new().accept(view, &targets[..take]);
                    let _ = TreeWalker::new().accept(view, &targets);
                }
            }
        }
        // The batch API, with whatever lengths the inputs have.
        let dist = BatchDistribution { log_probs: &lp, token_ids: &ids, requests, depth, width };
        let executor = Executor::new(threads).unwrap();
        if let Ok(batch) = build_trees(&dist, &budgets, &executor) {
            let _ = compile_trees(&batch, &starts, window).map(|c| c.dense_masks());
            let take = targets.len().min(batch.total_nodes());
            let _ = accept_trees(&batch, &targets[..take]);
            let _ = accept_trees(&batch, &targets);
        }
    }
}
