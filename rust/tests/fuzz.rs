//! A crash fuzzer of the core on stable Rust: raw inputs (any f32 bit pattern, any token id, sizes that do not
//! match, absurd budgets, windows and starts) through build, compile and accept. The property is that every
//! call returns, `Ok` or an `Err` naming the problem: no panic, no abort. proptest shrinks a failure to a
//! minimal input and keeps it in `fuzz.proptest-regressions`.

use ddtree::{
    accept_trees, acceptance_layout_into, build_trees, compile_trees, verify_layout_into,
    AcceptanceLayout, BatchDistribution, CompiledTree, DraftDistribution, Executor, StepPlacement,
    TreeBuilder, TreeWalker, VerifyLayout,
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

/// An output length near `n`: exact, one short, one long or empty.
fn near(n: usize, how: u8) -> usize {
    match how % 4 {
        0 => n,
        1 => n.saturating_sub(1),
        2 => n + 1,
        _ => 0,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// The step layouts with raw placements (any row, start and index) and outputs sized right, wrong or empty:
    /// `Ok` or an `Err`, never a panic.
    #[test]
    fn layouts_never_panic(
        (requests, depth, width, mut lp) in (1usize..4, 1usize..5, 1usize..5).prop_flat_map(|(r, d, w)| {
            (Just(r), Just(d), Just(w), prop::collection::vec(-12.0f32..0.0, r * d * w))
        }),
        budgets in prop::collection::vec(0usize..40, 1..4),
        place in prop::collection::vec(prop_oneof![6 => 0i64..40, 1 => any::<i64>()], 0..20),
        sizing in prop::collection::vec(prop_oneof![3 => Just(0u8), 1 => any::<u8>()], 12),
        words in 0usize..4,
        window in prop_oneof![4 => 0usize..5, 1 => 60usize..70],
        num_rows in 0usize..8,
        out_width in 0usize..8,
        num_tokens in 0usize..300,
        targets in prop::collection::vec(prop_oneof![3 => 0i64..20, 1 => any::<i64>()], 0..200),
    ) {
        sort_rows(&mut lp, width);
        // Valid drafts (distinct ids per row), so the layouts' own checks are what the raw parts hit.
        let ids: Vec<i64> = (0..requests * depth * width).map(|i| (i % width) as i64 * 3 + (i / width % 3) as i64).collect();
        let budgets: Vec<usize> = (0..requests).map(|i| budgets[i % budgets.len()]).collect();
        let dist = BatchDistribution { log_probs: &lp, token_ids: &ids, requests, depth, width };
        let Ok(batch) = build_trees(&dist, &budgets, &Executor::new(1).unwrap()) else { return Ok(()) };
        let (r, t) = (batch.requests(), batch.total_nodes());
        let pick = |k: usize| -> Vec<i64> { (0..r).map(|i| place.get(k * 5 + i).copied().unwrap_or(i as i64)).collect() };
        let (rows, starts, query, logit) = (pick(0), pick(1), pick(2), pick(3));
        let conv_width = if window > 0 { window + 1 } else { 0 };
        let mut token_index = vec![0; near(t, sizing[0])];
        let mut logit_rows = vec![0; near(t, sizing[1])];
        let mut positions = vec![0; near(t, sizing[2])];
        let mut bits = vec![0u32; near(t, sizing[3]) * words];
        let mut row_start = vec![0; num_rows];
        let mut offsets = vec![0; near(r + 1, sizing[4])];
        let mut conv = vec![0; near(t, sizing[5]) * conv_width];
        let place = StepPlacement { rows: &rows, starts: &starts, query_starts: &query, logit_starts: &logit };
        let out = VerifyLayout {
            token_index: &mut token_index,
            logit_rows: &mut logit_rows,
            positions: &mut positions,
            ancestor_bits: &mut bits,
            words,
            row_start: &mut row_start,
            node_offsets: &mut offsets,
            conv_index: &mut conv,
            window,
            nodes: Default::default(),
        };
        let _ = verify_layout_into(&batch, place, out);

        let take = targets.len().min(t);
        let Ok(accepted) = accept_trees(&batch, &targets[..take]) else { return Ok(()) };
        let m = accepted.kv_src.len();
        let mut output_tokens = vec![0; near(r, sizing[6]) * out_width];
        let (mut src, mut dst) = (vec![0; near(m, sizing[7])], vec![0; near(m, sizing[8])]);
        let mut order = vec![0; num_tokens];
        let path_width = accepted.width;
        let mut paths = vec![0; near(r, sizing[9]) * path_width];
        let mut lengths = vec![0; near(r, sizing[10])];
        let commit_window = window.min(8);
        let mut commit = vec![0; near(r, sizing[11]) * commit_window];
        let out = AcceptanceLayout {
            output_tokens: &mut output_tokens,
            out_width,
            kv_src: &mut src,
            kv_dst: &mut dst,
            context_order: &mut order,
            paths: &mut paths,
            path_width,
            path_lengths: &mut lengths,
            commit_conv_index: &mut commit,
            window: commit_window,
        };
        let _ = acceptance_layout_into(&batch, &accepted, &query, out);
    }
}
