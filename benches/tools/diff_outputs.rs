//! Differential check: hashes every output (trees and error messages) over many
//! random inputs, so two versions of the core can be compared exactly.
use ddtree::{build_trees, BatchDistribution, DraftDistribution, Executor, TreeBuilder};
use std::hash::{Hash, Hasher};

#[path = "../synthetic.rs"]
mod synthetic;
use synthetic::Rng;

fn main() {
    let cases: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse().unwrap())
        .unwrap_or(20000);
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut builder = TreeBuilder::new();
    let serial = Executor::new(1).unwrap();
    let mut errors = 0;
    for case in 0..cases {
        let depth = rng.below(7) as usize;
        let width = rng.below(if case % 10 == 0 { 40 } else { 9 }) as usize;
        let style = rng.below(6);
        let mut lp = Vec::new();
        let mut ids = Vec::new();
        for _ in 0..depth {
            let mut row: Vec<f32> = (0..width)
                .map(|_| match style {
                    0 => -0.5 * rng.below(4) as f32,
                    1 => {
                        if rng.below(4) == 0 {
                            f32::NEG_INFINITY
                        } else {
                            -(rng.below(1000) as f32) / 100.0
                        }
                    }
                    2 => -(rng.below(1 << 20) as f32) / 1e5,
                    3 => {
                        if rng.below(3) == 0 {
                            0.0
                        } else if rng.below(2) == 0 {
                            -0.0
                        } else {
                            0.0005 - rng.below(3) as f32 * 0.25
                        }
                    }
                    4 => {
                        if rng.below(50) == 0 {
                            f32::NAN
                        } else if rng.below(50) == 0 {
                            0.5
                        } else {
                            -(rng.below(100) as f32) / 7.0
                        }
                    }
                    _ => -(rng.below(8) as f32) * 0.125,
                })
                .collect();
            row.sort_by(|a, b| b.total_cmp(a));
            if style == 4 && rng.below(30) == 0 && width > 1 {
                row.swap(0, width - 1);
            }
            lp.extend(row);
            let base = rng.below(100) as i64;
            for k in 0..width as i64 {
                let mut t = base + 3 * k;
                if style >= 4 && rng.below(40) == 0 {
                    t = if rng.below(2) == 0 { -1 } else { base };
                }
                ids.push(t);
            }
        }
        let budget = rng.below(if case % 10 == 0 { 300 } else { 60 }) as usize;
        let dist = DraftDistribution::new(&lp, &ids, depth, width).unwrap();
        match builder.build(&dist, budget) {
            Ok(t) => {
                t.tokens.hash(&mut h);
                t.parents.hash(&mut h);
                t.depths.hash(&mut h);
                for s in &t.scores {
                    s.to_bits().hash(&mut h);
                }
            }
            Err(e) => {
                errors += 1;
                e.to_string().hash(&mut h);
            }
        }
        // The same input through the batch API, twice over, int32 ids.
        let lp2: Vec<f32> = lp.iter().chain(lp.iter()).copied().collect();
        let ids2: Vec<i32> = ids.iter().chain(ids.iter()).map(|&t| t as i32).collect();
        let bd = BatchDistribution {
            log_probs: &lp2,
            token_ids: &ids2,
            requests: 2,
            depth,
            width,
        };
        match build_trees(&bd, &[budget, budget / 2], &serial) {
            Ok(b) => {
                b.tokens.hash(&mut h);
                b.parents.hash(&mut h);
                b.node_offsets.hash(&mut h);
                for s in &b.scores {
                    s.to_bits().hash(&mut h);
                }
            }
            Err(e) => e.to_string().hash(&mut h),
        }
    }
    println!("cases {cases} errors {errors} hash {:016x}", h.finish());
}
