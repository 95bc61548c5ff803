//! Instruction-count harness for one build (or one batch of `batch` builds):
//! `valgrind --tool=callgrind target/release/examples/count_build [budget] [batch] [iters] [width]`;
//! the difference between two `iters` values divided by their difference is the cost per call.
use ddtree::{build_trees, DraftDistribution, Executor, TreeBuilder};

#[path = "../synthetic.rs"]
mod synthetic;
use synthetic::{batch_view, tool_args, tool_input, DEPTH};

fn main() {
    let (budget, batch, rest) = tool_args();
    let iters = *rest.first().unwrap_or(&1000);
    let width = rest.get(1).copied().unwrap_or(budget.min(1024));
    let (lp, ids) = tool_input(batch, width);
    let mut checksum = 0i64;
    if batch == 1 {
        let dist = DraftDistribution::new(&lp, &ids, DEPTH, width).unwrap();
        let mut b = TreeBuilder::new();
        for _ in 0..iters {
            let t = b.build(std::hint::black_box(&dist), budget).unwrap();
            checksum += t.tokens.last().copied().unwrap_or(0);
        }
    } else {
        let dist = batch_view(&lp, &ids, batch, width);
        let budgets = vec![budget; batch];
        let ex = Executor::new(1).unwrap();
        for _ in 0..iters {
            let t = build_trees(std::hint::black_box(&dist), &budgets, &ex).unwrap();
            checksum += t.tokens.last().copied().unwrap_or(0);
        }
    }
    println!("{checksum}");
}
