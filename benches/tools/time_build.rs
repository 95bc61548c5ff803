//! Wall-clock harness: best per-call time of `build` (batch 1) or `build_trees`.
//! `time_build [budget] [batch] [width]`; prints ns per call (min of 200 samples).
use ddtree::{build_trees, BatchDistribution, DraftDistribution, Executor, TreeBuilder};
use std::time::Instant;

const DEPTH: usize = 15;
const VOCAB: i64 = 151_936;
struct Rng(u64);
impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}
fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let budget = *args.first().unwrap_or(&64);
    let batch = *args.get(1).unwrap_or(&1);
    let width = args.get(2).copied().unwrap_or(budget.min(1024));
    let threads = args.get(3).copied().unwrap_or(1);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut lp = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..batch * DEPTH {
        let mut w: Vec<f64> = (0..width).map(|_| rng.next_f64().powi(6)).collect();
        w.sort_by(|a, b| b.partial_cmp(a).unwrap());
        let total: f64 = w.iter().sum::<f64>() / 0.9;
        lp.extend(w.iter().map(|x| ((x / total).max(1e-30)).ln() as f32));
        let base = (rng.next_f64() * VOCAB as f64) as i64;
        ids.extend((0..width as i64).map(|k| (base + 7919 * k) % VOCAB));
    }
    // DDTREE_DATA=prefix: raw f32 log-probs and i64 ids from prefix.lp / prefix.ids
    // ([batch, 15, width] row-major, e.g. dumped from Python) instead of the generator.
    if let Some(prefix) = std::env::var_os("DDTREE_DATA") {
        let prefix = prefix.into_string().unwrap();
        let raw = std::fs::read(format!("{prefix}.lp")).unwrap();
        lp = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let raw = std::fs::read(format!("{prefix}.ids")).unwrap();
        ids = raw
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        lp.truncate(batch * DEPTH * width);
        ids.truncate(batch * DEPTH * width);
    }
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
