"""DDTree's spec-decode metrics in vLLM's front end, on CPU: microseconds per engine step.

    python benches/bench_metrics.py [--budgets 15 63 127 255] [--depth 16] [--batch 1] [--steps 500]
        [--json FILE]

Once per engine step, vLLM's front end hands the step's ``SpecDecodingStats`` to its Prometheus logger's
spec-decoding part and, when logging stats, to its log line's; for a ddtree engine those are
``ddtree.vllm.metrics``'s ``DDTreeSpecDecodingProm`` and ``DDTreeSpecDecodingLogging``. vLLM sizes the stats'
per-position lists, and its own per-position counters, by ``num_speculative_tokens``, which for ddtree is the tree
budget ``B``; the accepted path is at most the drafter's depth ``L`` long. Three numbers per budget, each the
``observe`` of one step's stats:

* ``vllm prom``: vLLM's own ``SpecDecodingProm.observe`` (what a ddtree engine would cost without DDTree's
  metrics; one prometheus ``Counter.inc`` per position, ``B`` per step);
* ``ddtree prom``: ``DDTreeSpecDecodingProm.observe``, vLLM's counters included (what a ddtree engine costs);
* ``ddtree log``: ``DDTreeSpecDecodingLogging.observe`` (the periodic log line's per-step part).

The stats are made as vLLM's scheduler makes them (``SpecDecodingStats.new(B)``, ``observe_draft`` per tree):
``--batch`` whole trees of ``B`` nodes per step, accepted paths of random lengths in ``0..L`` (mostly short,
as measured). Each number is the best of 5 rounds' means over ``--steps`` distinct steps (a shared machine's
noise only adds time), after a warm-up round.

What it is not: the engine loop's whole ``record_stats`` (vLLM's other loggers, the stats' msgpack decoding), nor
a GPU host's CPU, nor prometheus_client in multiprocess mode (each ``inc`` then also writes an mmap'd file).
Numbers are printed, not asserted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import time
from types import SimpleNamespace

import numpy as np
import prometheus_client

LABELNAMES = ["model_name", "engine"]
PER_ENGINE_LABELVALUES = {0: ["bench", "0"]}


def step_stats(rng, budget: int, depth: int, batch: int, steps: int) -> list:
    """``steps`` steps' stats: ``batch`` whole trees each, accepted lengths drawn mostly short."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    out = []
    for _ in range(steps):
        stats = SpecDecodingStats.new(budget)
        for accepted in np.minimum(rng.geometric(0.4, size=batch) - 1, min(depth, budget)):
            stats.observe_draft(num_draft_tokens=budget, num_accepted_tokens=int(accepted))
        out.append(stats)
    return out


def fresh(build):
    """``build()`` with the collectors a previous one registered removed from prometheus_client's global
    registry (a second construction would otherwise be refused as duplicated timeseries)."""
    registry = prometheus_client.REGISTRY
    for collector in list(registry._collector_to_names):
        if any(name.startswith("vllm:") for name in registry._collector_to_names[collector]):
            registry.unregister(collector)
    return build()


def per_step_us(observe, steps: list, rounds: int = 5) -> float:
    """Best of ``rounds`` rounds' mean microseconds per ``observe(stats)`` over the steps, after a warm-up."""
    for stats in steps:
        observe(stats)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for stats in steps:
            observe(stats)
        best = min(best, (time.perf_counter() - start) / len(steps))
    return 1e6 * best


def measure(budget: int, depth: int, batch: int, steps: int, seed: int = 0) -> dict:
    from ddtree.vllm import metrics
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    stats = step_stats(np.random.default_rng(seed), budget, depth, batch, steps)
    speculative_config = SimpleNamespace(num_speculative_tokens=budget)
    vllm_prom = fresh(lambda: SpecDecodingProm(speculative_config, LABELNAMES, PER_ENGINE_LABELVALUES))
    vllm_us = per_step_us(vllm_prom.observe, stats)
    ddtree_prom = fresh(
        lambda: metrics.DDTreeSpecDecodingProm(
            speculative_config, LABELNAMES, PER_ENGINE_LABELVALUES, budget=budget, depth=depth
        )
    )
    prom_us = per_step_us(ddtree_prom.observe, stats)
    logging = metrics.DDTreeSpecDecodingLogging(budget, depth)
    log_us = per_step_us(logging.observe, stats)
    return {
        "budget": budget,
        "depth": depth,
        "batch": batch,
        "vllm_prom_us": vllm_us,
        "ddtree_prom_us": prom_us,
        "ddtree_log_us": log_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[15, 63, 127, 255])
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="whole trees per step")
    parser.add_argument("--steps", type=int, default=500, help="distinct steps per round (5 rounds)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(
        f"{platform.machine()}, python {platform.python_version()}, "
        f"prometheus_client {importlib.metadata.version('prometheus_client')}",
        flush=True,
    )
    rows = []
    for budget in args.budgets:
        row = measure(budget, args.depth, args.batch, args.steps)
        rows.append(row)
        print(
            f"budget {budget:4d} depth {args.depth:3d} batch {args.batch:3d}: vllm prom {row['vllm_prom_us']:7.1f} us, "
            f"ddtree prom {row['ddtree_prom_us']:7.1f} us, ddtree log {row['ddtree_log_us']:6.1f} us per step",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
