"""Plots of recorded measurements, for docs/ (PNG): read from the records' JSON, never typed in.

    pip install matplotlib
    python benches/plot_records.py [--out docs/img]

* ``acceptance_vs_budget.png``: the trained pair's held-out mean acceptance length for the DFlash chain and DDTree
  at each budget (``benches/results/gpu-pair-8cea999/train/metrics.json``);
* ``acceptance_by_depth.png``: per mode, the fraction of verification steps whose accepted path reached each
  depth (same record);
* ``tokens_per_s_vs_batch.png``: tokens/s against batch size per engine, vLLM under CUDA graphs
  (``benches/results/gpu-h200-9b8a8dc/bench_vllm_ddtree.json``).
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR_METRICS = os.path.join(ROOT, "benches/results/gpu-pair-8cea999/train/metrics.json")
GRAPH_BENCH = os.path.join(ROOT, "benches/results/gpu-h200-9b8a8dc/bench_vllm_ddtree.json")


def budget_of(mode: str) -> int | None:
    """The budget of a ``ddtree-B`` mode name (None: not a tree mode)."""
    head, _, tail = mode.rpartition("-")
    return int(tail) if head == "ddtree" and tail.isdigit() else None


def acceptance_series(metrics: dict) -> tuple[float, list[tuple[int, float]]]:
    """(chain acceptance length, [(budget, DDTree acceptance length)] sorted by budget)."""
    modes = metrics["eval"]["modes"]
    trees = sorted((budget_of(name), mode["tau"]) for name, mode in modes.items() if budget_of(name) is not None)
    return modes["chain"]["tau"], trees


def depth_fractions(mode: dict) -> list[float]:
    """Fraction of steps whose accepted path reached depth 1, 2, ... (``accepted_at_depth`` / steps)."""
    return [count / mode["steps"] for count in mode["accepted_at_depth"]]


def throughput_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Engine -> [(batch, tokens/s)] sorted by batch."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        series.setdefault(row["engine"], []).append((row["batch"], row["tokens_per_s"]))
    return {engine: sorted(points) for engine, points in series.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    with open(PAIR_METRICS) as f:
        metrics = json.load(f)
    chain, trees = acceptance_series(metrics)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([b for b, _ in trees], [t for _, t in trees], "o-", label="DDTree")
    ax.axhline(chain, color="gray", linestyle="--", label=f"DFlash chain ({chain:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (draft nodes)")
    ax.set_ylabel("mean acceptance length")
    ax.set_title("Trained test pair, 16 held-out prompts, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "acceptance_vs_budget.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    modes = metrics["eval"]["modes"]
    for name in ["chain"] + [f"ddtree-{b}" for b, _ in trees]:
        fractions = depth_fractions(modes[name])
        ax.plot(range(1, len(fractions) + 1), fractions, marker=".", label=name)
    ax.set_xlabel("depth")
    ax.set_ylabel("fraction of steps reaching it")
    ax.set_title("Acceptance by depth, trained test pair")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "acceptance_by_depth.png"), dpi=120)

    with open(GRAPH_BENCH) as f:
        rows = json.load(f)
    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, points in throughput_series(rows).items():
        label = {"none": "no speculation", "dflash": "vLLM dflash (chain)"}.get(engine, engine)
        ax.plot([b for b, _ in points], [t for _, t in points], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s")
    ax.set_title("vLLM 0.25.1 under CUDA graphs, one H200, trained pair")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "tokens_per_s_vs_batch.png"), dpi=120)
    print(f"wrote 3 plots to {args.out}")


if __name__ == "__main__":
    main()
