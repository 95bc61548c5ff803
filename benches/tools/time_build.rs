//! Wall-clock harness: best per-call time of `build` (batch 1) or `build_trees`.
//! `time_build [budget] [batch] [width]`; prints ns per call (min of 200 samples).
use ddtree::{build_trees, BatchDistribution, DraftDistribution, Executor, TreeBuilder};
use std::time::Instant;

#[path = "../synthetic.rs"]
mod synthetic;
use synthetic::{tool_input, DEPTH};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let budget = *args.first().unwrap_or(&64);
    let batch = *args.get(1).unwrap_or(&1);
    let width = args.get(2).copied().unwrap_or(budget.min(1024));
    let threads = args.get(3).copied().unwrap_or(1);
    let (lp, ids) = tool_input(batch, width);
    let inner = (20_000 / batch).max(1);
    let mut best = f64::INFINITY;
    let mut sink = 0i64;
    if batch == 1 {
        let dist = DraftDistribution::new(&lp, &ids, DEPTH, width).unwrap();
        let mut b = TreeBuilder::new();
        for _ in 0..200 {
            let t0 = Instant::now();
            for _ in 0..inner {
                let t = b.build(std::hint::black_box(&dist), budget).unwrap();
                sink += t.tokens.len() as i64;
            }
            best = best.min(t0.elapsed().as_secs_f64() / inner as f64);
        }
    } else {
        let dist = BatchDistribution {
            log_probs: &lp,
            token_ids: &ids,
            requests: batch,
            depth: DEPTH,
            width,
        };
        let budgets = vec![budget; batch];
        let ex = Executor::new(threads).unwrap();
        for _ in 0..200 {
            let t0 = Instant::now();
            for _ in 0..inner {
                let t = build_trees(std::hint::black_box(&dist), &budgets, &ex).unwrap();
                sink += t.tokens.len() as i64;
            }
            best = best.min(t0.elapsed().as_secs_f64() / inner as f64);
        }
    }
    println!("{:.0} ns per call ({sink})", best * 1e9);
}
