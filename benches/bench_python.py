"""The Rust core (FFI included) against the pure-Python reference, in one run.

    python benches/bench_python.py [--budgets 16 64 256] [--batch 64] [--repeat 7]

For each budget: one request (L = 15, K = min(budget, 1024)) and a batch, timed
for `build` alone and for a whole step (build + compile + accept). Prints the
best time of each and the reference/core ratio. The issue's goals, at budget
64: >= 50x for one request, >= 100x for a batch of 64.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

import ddtree
from ddtree import reference
from ddtree.cli import synthetic_distribution

DEPTH = 15


def drafter_output(rng, requests: int, width: int, vocab: int = 32_000):
    """Top-K of a synthetic drafter that grows less sure with depth (see ddtree.cli)."""
    log_probs = np.empty((requests, DEPTH, width), dtype=np.float32)
    token_ids = np.empty((requests, DEPTH, width), dtype=np.int64)
    for r in range(requests):
        log_probs[r], token_ids[r] = synthetic_distribution(rng, DEPTH, width, vocab)
    return log_probs, token_ids


def best_seconds(fns, repeat: int) -> list[float]:
    """Fastest of `repeat` interleaved timings of each function.

    Interleaving exposes every function to the same machine noise, and the
    minimum is the least noisy estimate of the cost on a shared machine.
    """
    best = [float("inf")] * len(fns)
    for fn, _ in fns:
        fn()  # warm-up
    for _ in range(repeat):
        for i, (fn, inner) in enumerate(fns):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / inner)
    return best


def core_step(lp, ids, budget, starts, targets, executor):
    trees = ddtree.build_trees(lp, ids, budget, executor=executor)
    ddtree.compile_trees(trees, starts, window=3)
    ddtree.accept_trees(trees, targets)


def reference_step(lp, ids, budget, starts, targets_per_request):
    for r in range(lp.shape[0]):
        tree = reference.build_tree(lp[r], ids[r], budget)
        reference.compile_tree(tree, starts[r], window=3)
        reference.accept(tree, targets_per_request[r])


def first_child_targets(tree) -> np.ndarray:
    """A target that agrees with each node's first child: the walk goes deep."""
    out = np.full(len(tree), -1, dtype=np.int64)
    for child in range(len(tree) - 1, 0, -1):
        out[tree.parents[child]] = tree.tokens[child - 1]
    return out


def run(budgets, batch: int, repeat: int, threads: int) -> list:
    results = []
    rng = np.random.default_rng(0)
    executor = ddtree.Executor(threads) if threads > 1 else None
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}, "
        f"numpy {np.__version__}, ddtree {ddtree.__version__}, executor threads {threads}"
    )
    print(f"L = {DEPTH}, K = min(budget, 1024); best of {repeat} interleaved samples\n")
    header = f"{'budget':>6} {'requests':>8} {'what':<22} {'reference':>12} {'ddtree':>12} {'ratio':>8}"
    print(header)
    print("-" * len(header))
    for budget in budgets:
        width = min(budget, 1024)
        for requests in (1, batch):
            lp, ids = drafter_output(rng, requests, width)
            starts = [1000] * requests
            singles = [ddtree.build_tree(lp[r], ids[r], budget) for r in range(requests)]
            targets = [first_child_targets(t) for t in singles]
            flat_targets = np.concatenate(targets)
            if requests == 1:
                core_build = lambda: ddtree.build_tree(lp[0], ids[0], budget).tokens  # noqa: E731
            else:
                core_build = lambda: ddtree.build_trees(lp, ids, budget, executor=executor).tokens  # noqa: E731
            ref_build = lambda: [reference.build_tree(lp[r], ids[r], budget) for r in range(requests)]  # noqa: E731
            rows = [
                ("build", ref_build, core_build),
                (
                    "build+compile+accept",
                    lambda: reference_step(lp, ids, budget, starts, targets),
                    lambda: core_step(lp, ids, budget, starts, flat_targets, executor),
                ),
            ]
            for what, ref_fn, core_fn in rows:
                # The core is ~100x faster: time it over more calls per sample.
                ref_s, core_s = best_seconds([(ref_fn, 1), (core_fn, 50)], repeat)
                print(
                    f"{budget:>6} {requests:>8} {what:<22} {ref_s * 1e6:>10.1f}us {core_s * 1e6:>10.1f}us "
                    f"{ref_s / core_s:>7.0f}x"
                )
                results.append(
                    {
                        "budget": budget,
                        "requests": requests,
                        "what": what,
                        "threads": threads,
                        "reference_us": round(ref_s * 1e6, 2),
                        "ddtree_us": round(core_s * 1e6, 2),
                        "ratio": round(ref_s / core_s, 1),
                    }
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="Executor threads for the batched calls")
    parser.add_argument("--json", help="also write the rows to this file (JSON)")
    args = parser.parse_args()
    rows = run(args.budgets, args.batch, args.repeat, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "machine": platform.platform(), "python": platform.python_version()}, f, indent=1)


if __name__ == "__main__":
    main()
