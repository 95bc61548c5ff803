"""Host work of the vLLM adapter's tree step, the layouts by the Rust core against the numpy layouts, in one run.

    python benches/bench_host_path.py [--budgets 64 256] [--batches 1 8 32] [--repeat 7] [--json FILE]

Per verification step the adapter lays out the scheduled trees for the GPU (positions, ancestor bits, logits
rows, the GDN conv gather index, ...) and, after the walk, what follows the acceptance (vLLM's chain rows, the
KV moves, the drafter's row order, the GDN commit plan), and copies each phase to the device in one transfer
from a reused staging buffer (``ddtree.vllm.staging.StepStaging``; on CPU its "device" is host memory, so the
copy is a memcpy, not an asynchronous DMA launch, and is left out of the timings). Timed per step, best of
``--repeat`` interleaved rounds:

* ``numpy``: the layouts the adapter computed in numpy until this change (``tests/vllm_adapter/layout_oracle.py``,
  still the tests' oracle), packed into the staging buffer array by array (as ``StepStaging.upload`` does);
* ``rust``: ``ddtree.verify_layout_into`` / ``ddtree.acceptance_layout_into`` writing straight into the staging
  buffer's views (what ``plan_verify`` and ``accept`` do now);
* ``step``: the adapter's whole host path of a step as it runs now: ``plan_verify`` (the scheduled drafts
  checked against the recorded trees, the trees reused) and ``accept`` (the walk and its layout).

A hybrid GDN target is assumed (conv window 3), trees of the full budget, drafter depth 16, K = 64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

import ddtree
from ddtree.vllm.staging import StepStaging
from ddtree.vllm.step import TreeStore, accept, acceptance_specs, layout_specs, plan_verify

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "vllm_adapter"))
import layout_oracle  # noqa: E402

DEPTH, WIDTH, WINDOW = 16, 64, 3
CPU = torch.device("cpu")


def drafts(rng, requests: int):
    logits = rng.normal(size=(requests, DEPTH, 2048)) * 3.0
    ids = np.argsort(-logits, axis=-1)[..., :WIDTH]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return np.take_along_axis(log_probs, ids, axis=-1).astype(np.float32), ids.astype(np.int64)


def best_ms(fns, repeat: int):
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(20):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / 20 * 1e3)
    return best


def run(budget: int, batch: int, repeat: int, rng) -> dict:
    lp, ids = drafts(rng, batch)
    req_ids = [f"r{i}" for i in range(batch)]
    store = TreeStore(budget)
    lists = store.propose(req_ids, lp, ids)
    scheduled = dict(zip(req_ids, lists))
    computed = rng.integers(100, 4000, size=batch)
    num_scheduled = np.array([len(d) + 1 for d in lists])
    trees = store.last_batch[1]
    plan = plan_verify(store, req_ids, computed, num_scheduled, scheduled, conv_window=WINDOW)
    rows, starts, query, logit = plan.batch_index, computed, plan.query_starts, plan.query_starts
    words, total, nodes = plan.words, plan.num_tokens, plan.num_tree_tokens
    targets = np.where(rng.random(nodes) < 0.7, 0, -1)  # filled below: mostly the first child's token
    for r in range(batch):
        lo, hi = trees.node_offsets[r], trees.node_offsets[r + 1]
        first_child = {int(p): int(t) for p, t in zip(trees.parents[lo + 1 : hi][::-1], lists[r][::-1])}
        targets[lo:hi] = [first_child.get(i, -1) if targets[lo + i] == 0 else -1 for i in range(hi - lo)]
    accepted = ddtree.accept_trees(trees, targets)
    width = DEPTH + 1
    plan_staging, accept_staging = StepStaging(CPU), StepStaging(CPU)

    def pack(staging, arrays):
        views = staging.host_arrays({name: (a.dtype, a.shape) for name, a in arrays.items()})
        for name, a in arrays.items():
            views[name][...] = a

    def numpy_layouts():
        layout = layout_oracle.verify_layout(trees, rows, starts, query, logit, batch, words, WINDOW)
        pack(plan_staging, layout)
        after = layout_oracle.acceptance_layout(layout["token_index"], trees, accepted, total, width, WINDOW)
        pack(accept_staging, after)

    def rust_layouts():
        out = plan_staging.host_arrays(layout_specs(batch, batch, nodes, words, WINDOW))
        ddtree.verify_layout_into(trees, rows, starts, query, logit, **out)
        specs = acceptance_specs(accepted, width, total, WINDOW)
        ddtree.acceptance_layout_into(trees, accepted, query, **accept_staging.host_arrays(specs))

    def whole_step():
        store.propose(req_ids, lp, ids)  # not timed below: the drafter phase's build, timed apart
        step_plan = plan_verify(
            store, req_ids, computed, num_scheduled, scheduled, conv_window=WINDOW, words=words,
            arrays=plan_staging.host_arrays,
        )  # fmt: skip
        accept(step_plan, targets, width, arrays=accept_staging.host_arrays)

    def propose_only():
        store.propose(req_ids, lp, ids)
        store.records.clear()

    numpy_ms, rust_ms, step_with_build_ms, build_ms = best_ms(
        [numpy_layouts, rust_layouts, whole_step, propose_only], repeat
    )
    row = {
        "budget": budget,
        "batch": batch,
        "numpy_layout_ms": round(numpy_ms, 4),
        "rust_layout_ms": round(rust_ms, 4),
        "numpy_over_rust": round(numpy_ms / rust_ms, 2),
        "step_ms": round(step_with_build_ms - build_ms, 4),
    }
    print(
        f"budget {budget:4d} batch {batch:3d}: layouts numpy {numpy_ms:.3f} ms, rust {rust_ms:.3f} ms "
        f"({row['numpy_over_rust']:.1f}x); whole host step now {row['step_ms']:.3f} ms",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    rng = np.random.default_rng(0)
    rows = [run(b, n, args.repeat, rng) for b in args.budgets for n in args.batches]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "machine": platform.platform(), "cores": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    main()
