//! Instruction-count harness for one build (or one batch of `batch` builds):
//! `valgrind --tool=callgrind target/release/examples/count_build [budget] [batch] [iters] [width]`;
//! the difference between two `iters` values divided by their difference is the cost per call.
use ddtree::{build_trees, BatchDistribution, DraftDistribution, Executor, TreeBuilder};

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
    let iters = *args.get(2).unwrap_or(&1000);
    let width = args.get(3).copied().unwrap_or(budget.min(1024));
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
        let dist = BatchDistribution {
            log_probs: &lp,
            token_ids: &ids,
            requests: batch,
            depth: DEPTH,
            width,
        };
        let budgets = vec![budget; batch];
        let ex = Executor::new(1).unwrap();
        for _ in 0..iters {
            let t = build_trees(std::hint::black_box(&dist), &budgets, &ex).unwrap();
            checksum += t.tokens.last().copied().unwrap_or(0);
        }
    }
    println!("{checksum}");
}
