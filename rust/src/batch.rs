//! Batched entry points: one call per decoding step for every request.
//!
//! Trees of a batch live in flat (CSR) buffers: request r owns nodes
//! `node_offsets[r]..node_offsets[r + 1]` of `parents`, `depths`, `scores` and
//! the compiled arrays (root included), and draft tokens
//! `token_offsets[r]..token_offsets[r + 1]` of `tokens`. This is the layout
//! vLLM uses for a batch's flattened query tokens.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::accept::{AcceptSlots, TreeWalker};
use crate::build::TreeBuilder;
use crate::compile::{check_compile_sizes, compile_into, words_per_row, CompiledSlots};
use crate::error::{DdtreeError, Result};
use crate::limits::{at_most, MAX_BATCH_NODES, MAX_BUDGET, MAX_DENSE_NODES, MAX_THREADS};
use crate::tree::{DraftDistribution, TokenId, TreeSlots, TreeView};

/// Below this many nodes in a batch, threads cost more than they save.
const PARALLEL_MIN_NODES: usize = 4096;

/// The drafter's output for a whole batch: `[requests, depth, width]`.
#[derive(Clone, Copy)]
pub struct BatchDistribution<'a, T: TokenId> {
    pub log_probs: &'a [f32],
    pub token_ids: &'a [T],
    pub requests: usize,
    pub depth: usize,
    pub width: usize,
}

impl<'a, T: TokenId> BatchDistribution<'a, T> {
    fn request(&self, r: usize) -> Result<DraftDistribution<'a, T>> {
        let expected = || {
            format!(
                "[{}, {}, {}] (requests x depth x width values)",
                self.requests, self.depth, self.width
            )
        };
        let size = self.depth.checked_mul(self.width);
        let range = size.and_then(|size| Some(r.checked_mul(size)?..(r + 1).checked_mul(size)?));
        let slices = range.and_then(|range| {
            Some((
                self.log_probs.get(range.clone())?,
                self.token_ids.get(range)?,
            ))
        });
        let (log_probs, token_ids) = slices.ok_or_else(|| {
            DdtreeError::shape(
                "log_probs",
                expected(),
                format!(
                    "{} log-probs and {} token ids",
                    self.log_probs.len(),
                    self.token_ids.len()
                ),
            )
        })?;
        DraftDistribution::new(log_probs, token_ids, self.depth, self.width)
    }
}

/// Trees of a batch in flat buffers (see the module docs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TreeBatch {
    pub tokens: Vec<i64>,
    pub parents: Vec<i32>,
    pub depths: Vec<i32>,
    pub scores: Vec<f32>,
    /// `[R + 1]` into the root-included arrays.
    pub node_offsets: Vec<i64>,
    /// `[R + 1]` into `tokens`.
    pub token_offsets: Vec<i64>,
    /// L, the drafter's number of positions; no tree is deeper.
    pub draft_depth: usize,
}

impl TreeBatch {
    pub fn requests(&self) -> usize {
        self.node_offsets.len().saturating_sub(1)
    }

    pub fn total_nodes(&self) -> usize {
        self.parents.len()
    }

    pub fn tree(&self, r: usize) -> TreeView<'_> {
        let nodes = self.node_offsets[r] as usize..self.node_offsets[r + 1] as usize;
        let tokens = self.token_offsets[r] as usize..self.token_offsets[r + 1] as usize;
        TreeView {
            tokens: &self.tokens[tokens],
            parents: &self.parents[nodes.clone()],
            depths: &self.depths[nodes.clone()],
            scores: &self.scores[nodes],
        }
    }
}

/// Runs a batch's work on the calling thread and, for large batches, on
/// helper threads from a pool created on first use, never at import. vLLM
/// forks its workers; a pool inherited through `fork` has no threads, so a
/// pool made in another process is abandoned and a new one made in this
/// process.
pub struct Executor {
    num_threads: usize,
    /// `num_threads - 1` helpers: the calling thread is the last one.
    pool: Mutex<Option<(u32, Arc<rayon::ThreadPool>)>>,
}

impl Executor {
    pub fn new(num_threads: usize) -> Result<Self> {
        if num_threads == 0 {
            return Err(DdtreeError::value("num_threads", "must be at least 1"));
        }
        at_most("num_threads", num_threads, MAX_THREADS)?;
        Ok(Self {
            num_threads,
            pool: Mutex::new(None),
        })
    }

    pub fn num_threads(&self) -> usize {
        self.num_threads
    }

    fn pool(&self) -> Result<Arc<rayon::ThreadPool>> {
        let mut guard = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        if let Some((owner, pool)) = guard.as_ref() {
            if *owner == pid {
                return Ok(Arc::clone(pool));
            }
        }
        if let Some(stale) = guard.take() {
            // Its threads live in the parent process; dropping would wait on them.
            std::mem::forget(stale);
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.num_threads - 1)
            .thread_name(|i| format!("ddtree-{i}"))
            .build()
            .map_err(|e| DdtreeError::Internal(format!("cannot start the thread pool: {e}")))?;
        let pool = Arc::new(pool);
        *guard = Some((pid, Arc::clone(&pool)));
        Ok(pool)
    }

    /// Runs `work` for each item; with helpers when the batch is big enough.
    /// Returns the error of the first failing item, as a serial loop would.
    ///
    /// The calling thread works rather than waiting for the pool, and items
    /// go out in chunks that threads claim in order from a shared counter:
    /// a helper asleep since the last call takes microseconds to wake, and
    /// one that starts late just claims fewer chunks.
    fn for_each<I: Send, F>(&self, items: Vec<I>, total_nodes: usize, work: F) -> Result<()>
    where
        F: Fn(I) -> Result<()> + Sync + Send,
    {
        if self.num_threads == 1 || total_nodes < PARALLEL_MIN_NODES {
            return items.into_iter().try_for_each(work);
        }
        let min_len = (items.len() * MIN_CHUNK_NODES).div_ceil(total_nodes);
        let mut items: Vec<Option<I>> = items.into_iter().map(Some).collect();
        let claims = Claims::new(&mut items, self.num_threads, min_len);
        let pool = self.pool()?;
        pool.in_place_scope(|scope| {
            for _ in 0..pool.current_num_threads() {
                scope.spawn(|_| claims.run(&work));
            }
            claims.run(&work);
        });
        claims.into_result()
    }
}

/// The fewest nodes a thread claims at a time (a few trees at budget 64):
/// every claim passes the shared counter's cache line between cores.
const MIN_CHUNK_NODES: usize = 128;

/// A batch's items in chunks that threads claim in order (see
/// [`Executor::for_each`]), and the first error met.
struct Claims<'a, I> {
    chunks: Vec<Padded<Mutex<&'a mut [Option<I>]>>>,
    /// The next chunk to claim; moved past the last one on an error, as
    /// the chunks after a failed one need not run.
    next: Padded<AtomicUsize>,
    /// The failing chunk with the lowest index and its error.
    first_error: Mutex<Option<(usize, DdtreeError)>>,
}

/// Keeps a value alone in its cache line, so that threads using neighbours
/// do not pass the line back and forth.
#[repr(align(64))]
struct Padded<T>(T);

impl<'a, I> Claims<'a, I> {
    /// Chunks that shrink as the batch does ("guided" scheduling): each is
    /// a share of what is left, so the first claims are large (few trips
    /// through the counter) and the last small (threads finish together).
    fn new(mut items: &'a mut [Option<I>], threads: usize, min_len: usize) -> Self {
        let mut chunks = Vec::new();
        while !items.is_empty() {
            let len = (items.len() / threads).max(min_len).min(items.len());
            let (chunk, rest) = std::mem::take(&mut items).split_at_mut(len);
            chunks.push(Padded(Mutex::new(chunk)));
            items = rest;
        }
        Claims {
            chunks,
            next: Padded(AtomicUsize::new(0)),
            first_error: Mutex::new(None),
        }
    }

    /// Claims and runs chunks until none is left or one has failed. Chunks
    /// are claimed in index order, so when chunk i fails every chunk before
    /// it has been claimed and runs to its end: the lowest failing chunk,
    /// the first error of a serial loop, is always recorded.
    fn run(&self, work: &(impl Fn(I) -> Result<()> + Sync)) {
        loop {
            let index = self.next.0.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = self.chunks.get(index) else {
                return;
            };
            let mut chunk = chunk.0.lock().unwrap_or_else(|e| e.into_inner());
            let result = chunk.iter_mut().filter_map(Option::take).try_for_each(work);
            if let Err(err) = result {
                self.record(index, err);
            }
        }
    }

    #[cold]
    fn record(&self, index: usize, err: DdtreeError) {
        self.next.0.store(self.chunks.len(), Ordering::Relaxed);
        let mut first = self.first_error.lock().unwrap_or_else(|e| e.into_inner());
        if first.as_ref().is_none_or(|(i, _)| index < *i) {
            *first = Some((index, err));
        }
    }

    fn into_result(self) -> Result<()> {
        let first = self.first_error.into_inner();
        match first.unwrap_or_else(|e| e.into_inner()) {
            Some((_, err)) => Err(err),
            None => Ok(()),
        }
    }
}

/// Prefixes errors with the request they concern.
fn in_request(r: usize, err: DdtreeError) -> DdtreeError {
    match err {
        DdtreeError::Value { arg, message } => DdtreeError::Value {
            arg,
            message: format!("request {r}: {message}"),
        },
        other => other,
    }
}

fn offsets(sizes: impl Iterator<Item = usize>) -> Vec<i64> {
    let mut out = vec![0i64];
    let mut total = 0i64;
    for size in sizes {
        total += size as i64;
        out.push(total);
    }
    out
}

/// Splits `buf` into consecutive pieces of the given sizes.
fn split_sizes<T>(mut buf: &mut [T], sizes: impl Iterator<Item = usize>) -> Vec<&mut [T]> {
    sizes
        .map(|size| {
            let (head, tail) = std::mem::take(&mut buf).split_at_mut(size);
            buf = tail;
            head
        })
        .collect()
}

/// Builds one tree per request. `budgets` has one entry per request.
pub fn build_trees<T: TokenId>(
    dist: &BatchDistribution<'_, T>,
    budgets: &[usize],
    executor: &Executor,
) -> Result<TreeBatch> {
    if budgets.len() != dist.requests {
        return Err(DdtreeError::shape(
            "budgets",
            format!("an int or [{}] (one per request)", dist.requests),
            format!("[{}]", budgets.len()),
        ));
    }
    let requests: Vec<_> = (0..dist.requests)
        .map(|r| dist.request(r))
        .collect::<Result<_>>()?;
    for &budget in budgets {
        at_most("budgets", budget, MAX_BUDGET)?;
    }
    let counts: Vec<usize> = requests
        .iter()
        .zip(budgets)
        .map(|(d, &b)| d.node_count(b))
        .collect();
    let nodes = counts.iter().sum::<usize>() + dist.requests; // each at most MAX_BUDGET: no overflow
    at_most(
        "the batch's tree nodes (budgets summed, roots included)",
        nodes,
        MAX_BATCH_NODES,
    )?;
    let mut batch = TreeBatch {
        node_offsets: offsets(counts.iter().map(|c| c + 1)),
        token_offsets: offsets(counts.iter().copied()),
        draft_depth: dist.depth,
        ..TreeBatch::default()
    };
    let total: usize = counts.iter().sum();
    batch.tokens = vec![0; total];
    batch.parents = vec![0; total + dist.requests];
    batch.depths = vec![0; total + dist.requests];
    batch.scores = vec![0.0; total + dist.requests];
    let slots = split_sizes(&mut batch.tokens, counts.iter().copied())
        .into_iter()
        .zip(split_sizes(
            &mut batch.parents,
            counts.iter().map(|c| c + 1),
        ))
        .zip(split_sizes(&mut batch.depths, counts.iter().map(|c| c + 1)))
        .zip(split_sizes(&mut batch.scores, counts.iter().map(|c| c + 1)))
        .map(|(((tokens, parents), depths), scores)| TreeSlots {
            tokens,
            parents,
            depths,
            scores,
        });
    let items: Vec<_> = slots.zip(requests).zip(budgets).enumerate().collect();
    executor.for_each(items, total, |(r, ((slots, dist), &budget))| {
        BUILDER
            .with_borrow_mut(|b| b.build_into(&dist, budget, slots))
            .map_err(|e| in_request(r, e))
    })?;
    Ok(batch)
}

thread_local! {
    static BUILDER: std::cell::RefCell<TreeBuilder> = std::cell::RefCell::new(TreeBuilder::new());
    static WALKER: std::cell::RefCell<TreeWalker> = std::cell::RefCell::new(TreeWalker::new());
}

/// A batch's compiled trees, in the batch's flat node layout.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledBatch {
    /// `[T]` with T the batch's total node count.
    pub positions: Vec<i64>,
    /// `[T, words]`: rows of request r index that request's nodes locally.
    pub ancestor_bits: Vec<u32>,
    /// One row width for the whole batch, enough for its largest tree.
    pub words: usize,
    /// `[T, window]`, tree-local node indices (negative: committed history).
    pub windows: Vec<i32>,
    pub window: usize,
    /// `[R + 1]`, the batch's node offsets.
    pub node_offsets: Vec<i64>,
}

impl CompiledBatch {
    /// Largest tree of the batch, root included.
    pub fn max_nodes(&self) -> usize {
        self.node_offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    }

    /// Dense visibility per request, `[R, N, N]` row-major with N the largest
    /// tree: `true` where node i of request r sees its node j; padding rows and
    /// columns are `false`.
    pub fn dense_masks(&self) -> Result<Vec<bool>> {
        let n = self.max_nodes();
        let requests = self.node_offsets.len().saturating_sub(1);
        at_most(
            "requests x nodes^2 (for dense masks)",
            requests.saturating_mul(n.saturating_mul(n)),
            MAX_DENSE_NODES * MAX_DENSE_NODES,
        )?;
        let mut masks = vec![false; requests * n * n];
        for r in 0..requests {
            let (first, last) = (
                self.node_offsets[r] as usize,
                self.node_offsets[r + 1] as usize,
            );
            for (i, node) in (first..last).enumerate() {
                let bits = &self.ancestor_bits[node * self.words..(node + 1) * self.words];
                let row = &mut masks[(r * n + i) * n..(r * n + i + 1) * n];
                for (j, seen) in row.iter_mut().enumerate().take(last - first) {
                    *seen = bits[j / 32] >> (j % 32) & 1 == 1;
                }
            }
        }
        Ok(masks)
    }
}

/// Compiles every tree; `starts[r]` is request r's first verified position
/// (its number of committed tokens minus one: the root is the last of them).
pub fn compile_trees(batch: &TreeBatch, starts: &[i64], window: usize) -> Result<CompiledBatch> {
    let r_count = batch.requests();
    if starts.len() != r_count {
        return Err(DdtreeError::shape(
            "starts",
            format!("an int or [{r_count}] (one per request)"),
            format!("[{}]", starts.len()),
        ));
    }
    let sizes: Vec<usize> = (0..r_count).map(|r| batch.tree(r).len()).collect();
    let words = words_per_row(sizes.iter().copied().max().unwrap_or(0));
    let total = batch.total_nodes();
    check_compile_sizes(total, words, window)?;
    let mut out = CompiledBatch {
        positions: vec![0; total],
        ancestor_bits: vec![0; total * words],
        words,
        windows: vec![0; total * window],
        window,
        node_offsets: batch.node_offsets.clone(),
    };
    let positions = split_sizes(&mut out.positions, sizes.iter().copied());
    let bits = split_sizes(&mut out.ancestor_bits, sizes.iter().map(|s| s * words));
    let windows = split_sizes(&mut out.windows, sizes.iter().map(|s| s * window));
    for (r, ((positions, ancestor_bits), windows)) in
        positions.into_iter().zip(bits).zip(windows).enumerate()
    {
        let slots = CompiledSlots {
            positions,
            ancestor_bits,
            words,
            windows,
            window,
        };
        compile_into(batch.tree(r), starts[r], slots)?;
    }
    Ok(out)
}

/// The outcome of one verification step for every request.
#[derive(Clone, Debug, PartialEq)]
pub struct AcceptedBatch {
    /// `[R, L + 1]`: accepted tree-local node indices, root first, -1 padded.
    pub paths: Vec<i32>,
    /// `[R, L + 1]`: accepted draft tokens then the bonus token, -1 padded
    /// (vLLM's `sampled_token_ids` layout).
    pub output_tokens: Vec<i64>,
    /// `[R]`: accepted draft tokens (path length - 1).
    pub accepted: Vec<i32>,
    /// `[R]`: the target's token after the accepted path.
    pub bonus: Vec<i64>,
    /// KV moves as indices into the batch's flat verified tokens.
    pub kv_src: Vec<i64>,
    pub kv_dst: Vec<i64>,
    /// L + 1.
    pub width: usize,
}

/// Walks every tree with the target's per-node tokens (flat `[T]`).
pub fn accept_trees(batch: &TreeBatch, target_tokens: &[i64]) -> Result<AcceptedBatch> {
    let total = batch.total_nodes();
    if target_tokens.len() != total {
        return Err(DdtreeError::shape(
            "target_tokens",
            format!("[{total}] (one per node of the batch, roots included)"),
            format!("[{}]", target_tokens.len()),
        ));
    }
    let r_count = batch.requests();
    let width = batch.draft_depth + 1;
    let mut out = AcceptedBatch {
        paths: vec![-1; r_count * width],
        output_tokens: vec![-1; r_count * width],
        accepted: vec![0; r_count],
        bonus: vec![0; r_count],
        kv_src: Vec::new(),
        kv_dst: Vec::new(),
        width,
    };
    WALKER.with_borrow_mut(|walker| -> Result<()> {
        for r in 0..r_count {
            let nodes = batch.node_offsets[r] as usize..batch.node_offsets[r + 1] as usize;
            let row = r * width..(r + 1) * width;
            let slots = AcceptSlots {
                path: &mut out.paths[row.clone()],
                output_tokens: &mut out.output_tokens[row.clone()],
            };
            let (len, bonus) =
                walker.accept_into(batch.tree(r), &target_tokens[nodes.clone()], slots)?;
            out.accepted[r] = len as i32 - 1;
            out.bonus[r] = bonus;
            let base = nodes.start as i64;
            for (src, dst) in crate::compile::kv_moves(&out.paths[row][..len]) {
                out.kv_src.push(base + src as i64);
                out.kv_dst.push(base + dst as i64);
            }
        }
        Ok(())
    })?;
    Ok(out)
}
