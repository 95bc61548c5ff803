//! Wall-clock harness: best per-call time of `build` (batch 1) or `build_trees`.
//! `time_build [budget] [batch] [width]`; prints ns per call (min of 200 samples).
use ddtree::{build_trees, DraftDistribution, Executor, TreeBuilder};
use std::time::Instant;

#[path = "../synthetic.rs"]
mod synthetic;
use synthetic::{batch_view, tool_args, tool_input, DEPTH};

fn main() {
    let (budget, batch, rest) = tool_args();
    let width = rest.first().copied().unwrap_or(budget.min(1024));
    let threads = rest.get(1).copied().unwrap_or(1);
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
        let dist = batch_view(&lp, &ids, batch, width);
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
