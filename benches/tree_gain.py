"""How much a tree gains over the DFlash chain, and where: per drafter checkpoint, in one run.

    python benches/tree_gain.py --target DIR --drafters DIR [DIR ...] [--prompts FILE] [--num-prompts 16]
        [--new-tokens 128] [--budgets 16 64 256] [--device cpu] [--json FILE] [--plot FILE]

For each drafter (e.g. checkpoints of increasing strength): the reference engine decodes the held-out prompts
greedily in chain mode and in DDTree mode at each budget (lossless: every output must equal the autoregressive
one), and reports the mean acceptance length tau, the tree/chain ratio, and acceptance by depth split by the path
that reached the depth (``ddtree.engine.DepthTrials``): on the drafter's top-1 path (what the chain could also
have accepted) or after the path took a sibling (what only a tree could reach). The question it answers: does
the tree still pay when the chain is already good? ``--plot`` draws the ratio against the chain's tau (needs
matplotlib). Results of each drafter are written as soon as they exist (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rate(accepted, reached, first: int = 0) -> float:
    """Pooled acceptance rate over depths ``first + 1 ..`` (nan when no trial)."""
    hit, tried = sum(accepted[first:]), sum(reached[first:])
    return hit / tried if tried else float("nan")


def summarize(drafter: str, modes: dict) -> dict:
    chain = modes["chain"]["tau"]
    rows = []
    for name, entry in modes.items():
        trials = entry["depth_trials"]
        rows.append(
            {
                "drafter": drafter,
                "mode": name,
                "tau": round(entry["tau"], 4),
                "ratio_to_chain": round(entry["tau"] / chain, 4),
                "lossless": entry["lossless"],
                # Depth >= 2: depth 1 is always tried from the root, on the top-1 path.
                "accept_rate_on_top1_path": round(rate(trials["on_top1_accepted"], trials["on_top1_reached"], 1), 4),
                "accept_rate_after_sibling": round(
                    rate(trials["after_sibling_accepted"], trials["after_sibling_reached"], 1), 4
                ),
                "accepted_off_top1": sum(trials["accepted_off_top1"]),
                "steps": entry["steps"],
                "depth_trials": trials,
            }
        )
    return {"drafter": drafter, "chain_tau": chain, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafters", nargs="+", required=True)
    parser.add_argument("--prompts", help="prompts.json of a pair (default: the target's parent directory's)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the results here (rewritten after each drafter)")
    parser.add_argument("--plot", help="PNG of the tree/chain ratio against the chain's tau")
    args = parser.parse_args()

    sys.path.insert(0, os.path.join(ROOT, "python"))
    from ddtree.engine.pair_demo import load_pair_prompts
    from ddtree.training.evaluate import engine_acceptance, load_pair

    if args.device == "cpu":
        torch.set_num_threads(1)  # a 10M-parameter model's ops are too small for intra-op threads
    prompts_dir = os.path.dirname(args.prompts) if args.prompts else os.path.dirname(os.path.abspath(args.target))
    prompts = load_pair_prompts(prompts_dir)["prompts"][: args.num_prompts]
    results = {"target": args.target, "prompts": len(prompts), "new_tokens": args.new_tokens, "drafters": []}
    for drafter_dir in args.drafters:
        started = time.perf_counter()
        target, drafter = load_pair(args.target, drafter_dir, device=args.device)
        out = engine_acceptance(target, drafter, prompts, args.budgets, args.new_tokens, log=print)
        summary = summarize(drafter_dir, out["modes"])
        results["drafters"].append(summary)
        print(f"{drafter_dir}: {time.perf_counter() - started:.0f} s")
        for row in summary["rows"]:
            print(
                f"  {row['mode']:>11}: tau {row['tau']:.3f} ({row['ratio_to_chain']:.3f}x chain), "
                f"accept rate at depth >= 2: on the top-1 path {row['accept_rate_on_top1_path']:.3f}, "
                f"after a sibling {row['accept_rate_after_sibling']:.3f}; {row['accepted_off_top1']} tokens "
                f"accepted off the top-1; lossless {row['lossless']}",
                flush=True,
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    modes = sorted({r["mode"] for d in results["drafters"] for r in d["rows"] if r["mode"] != "chain"})
    for mode in modes:
        points = [
            (d["chain_tau"], r["ratio_to_chain"]) for d in results["drafters"] for r in d["rows"] if r["mode"] == mode
        ]
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=mode)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("DFlash chain mean acceptance length")
    ax.set_ylabel("DDTree tau / chain tau")
    ax.set_title(f"Tree gain against chain strength ({results['prompts']} prompts)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
