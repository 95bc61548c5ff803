//! Synthetic drafter output shared by the criterion benches and the builder tools
//! (`#[path]`-included: benches and examples are separate crates).
#![allow(dead_code)] // each includer uses a different part

pub const DEPTH: usize = 15;
pub const VOCAB: i64 = 151_936;

/// Deterministic xorshift so that benches need no RNG crate.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Peaked top-K rows like a trained drafter's: sorted log-probs, distinct ids, `[requests, DEPTH, width]`.
pub fn drafter_output(requests: usize, width: usize, rng: &mut Rng) -> (Vec<f32>, Vec<i64>) {
    let mut log_probs = Vec::with_capacity(requests * DEPTH * width);
    let mut ids = Vec::with_capacity(requests * DEPTH * width);
    for _ in 0..requests * DEPTH {
        let mut weights: Vec<f64> = (0..width).map(|_| rng.next_f64().powi(6)).collect();
        weights.sort_by(|a, b| b.partial_cmp(a).unwrap());
        let total: f64 = weights.iter().sum::<f64>() / 0.9; // 10% mass outside the top-K
        log_probs.extend(weights.iter().map(|w| ((w / total).max(1e-30)).ln() as f32));
        let base = (rng.next_f64() * VOCAB as f64) as i64;
        ids.extend((0..width as i64).map(|k| (base + 7919 * k) % VOCAB));
    }
    (log_probs, ids)
}

/// The tools' input: the generator's, or with `DDTREE_DATA=prefix` raw f32 log-probs and i64 ids
/// from `prefix.lp` / `prefix.ids` (`[batch, 15, width]` row-major, e.g. dumped from Python).
pub fn tool_input(batch: usize, width: usize) -> (Vec<f32>, Vec<i64>) {
    let Some(prefix) = std::env::var_os("DDTREE_DATA") else {
        return drafter_output(batch, width, &mut Rng(0x9E37_79B9_7F4A_7C15));
    };
    let prefix = prefix.into_string().unwrap();
    let raw = std::fs::read(format!("{prefix}.lp")).unwrap();
    let mut lp: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let raw = std::fs::read(format!("{prefix}.ids")).unwrap();
    let mut ids: Vec<i64> = raw
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    lp.truncate(batch * DEPTH * width);
    ids.truncate(batch * DEPTH * width);
    (lp, ids)
}

/// A `[batch, DEPTH, width]` batch view over flat buffers.
pub fn batch_view<'a>(
    log_probs: &'a [f32],
    token_ids: &'a [i64],
    batch: usize,
    width: usize,
) -> ddtree::BatchDistribution<'a, i64> {
    ddtree::BatchDistribution {
        log_probs,
        token_ids,
        requests: batch,
        depth: DEPTH,
        width,
    }
}

/// The tools' positional arguments `[budget] [batch] [third] [fourth]` as integers (defaults 64 and 1).
pub fn tool_args() -> (usize, usize, Vec<usize>) {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments are integers"))
        .collect();
    let budget = *args.first().unwrap_or(&64);
    let batch = *args.get(1).unwrap_or(&1);
    (budget, batch, args.into_iter().skip(2).collect())
}
