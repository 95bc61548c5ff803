//! Criterion benchmarks of one decoding step's CPU work, L = 15 (DFlash b16).
//!
//! `cargo bench --bench tree` runs budgets {16..1024} x batch {1, 8, 64};
//! throughput is in tree nodes. Settings are explicit so runs are comparable.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ddtree::{accept_trees, build_trees, compile_trees, Executor};

const BUDGETS: [usize; 7] = [16, 32, 64, 128, 256, 512, 1024];
const BATCHES: [usize; 3] = [1, 8, 64];

#[path = "synthetic.rs"]
mod synthetic;
use synthetic::{batch_view, drafter_output, Rng, VOCAB};

fn bench_step(c: &mut Criterion) {
    let serial = Executor::new(1).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for (group_name, stage) in [("build", 0), ("build+compile+accept", 1)] {
        let mut group = c.benchmark_group(group_name);
        group
            .sample_size(20)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(800));
        for &batch in &BATCHES {
            for &budget in &BUDGETS {
                let width = budget.min(VOCAB as usize);
                let (lp, ids) = drafter_output(batch, width, &mut rng);
                let dist = batch_view(&lp, &ids, batch, width);
                let budgets = vec![budget; batch];
                let starts = vec![1000i64; batch];
                let trees = build_trees(&dist, &budgets, &serial).unwrap();
                // A target that agrees with the first child: the walk goes deep.
                let target: Vec<i64> = (0..trees.total_nodes())
                    .map(|i| trees.tokens.get(i).copied().unwrap_or(-1))
                    .collect();
                group.throughput(Throughput::Elements((trees.total_nodes()) as u64));
                let id = BenchmarkId::new(format!("batch{batch}"), budget);
                group.bench_with_input(id, &budget, |b, _| {
                    b.iter(|| {
                        let trees = build_trees(&dist, &budgets, &serial).unwrap();
                        if stage == 1 {
                            let compiled = compile_trees(&trees, &starts, 3).unwrap();
                            let accepted = accept_trees(&trees, &target).unwrap();
                            std::hint::black_box((compiled, accepted));
                        }
                        trees
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench_step);
criterion_main!(benches);
