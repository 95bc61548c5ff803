"""What ddtree's reference engine accepts with the pair's drafter made to mix sliding-window and full-attention
layers, against the drafter as trained: the expectation the e2e engine ``ddtree64-async-sliding-drafter`` is held to.

    python benches/sliding_drafter_reference.py [--windows 64 16 8] [--json FILE]

The reference engine (fp32, any device; a CPU does) decodes the e2e harness's batch16 prompts (``batch32[:16]`` of
``tests/fixtures/models/prompts.json``) greedily, budget 64, 48 new tokens, once with the pair's drafter and once per
window with its copy whose layers but the last are ``sliding_attention`` of that window (the e2e harness's
``sliding_drafter_copy``). It prints each mean acceptance length, its ratio to the drafter's own, and whether the
outputs are the same (they must be: greedy decoding is the target's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
from vllm_ddtree_e2e import sliding_drafter_copy  # noqa: E402

from ddtree.engine.drafter import DFlashDraftModel  # noqa: E402
from ddtree.engine.engine import GenerationConfig, SpeculativeEngine  # noqa: E402
from ddtree.engine.target import load_causal_lm  # noqa: E402

PAIR = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models")


def acceptance(target, drafter_dir: str, prompts) -> dict:
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
    config = GenerationConfig(mode="ddtree", budget=64, max_new_tokens=48)
    results = SpeculativeEngine(target, drafter).generate(prompts, config)
    lengths = [n for r in results for n in r.stats.acceptance_lengths]
    return {
        "mean_acceptance_length": sum(lengths) / len(lengths),
        "steps": len(lengths),
        "layers": [[layer.self_attn.causal, layer.self_attn.window] for layer in drafter.layers],
        "outputs": [r.output_ids for r in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, nargs="+", default=[64, 16, 8])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # (a 10M-parameter pair: one thread is fastest on a CPU)
    with open(os.path.join(PAIR, "prompts.json")) as handle:
        prompts = json.load(handle)["batch32"][:16]
    target = load_causal_lm(os.path.join(PAIR, "target"), torch.float32)
    rows = {"full": acceptance(target, os.path.join(PAIR, "drafter"), prompts)}
    with tempfile.TemporaryDirectory() as work:
        for window in args.windows:
            copy = sliding_drafter_copy(os.path.join(PAIR, "drafter"), window, os.path.join(work, f"w{window}"))
            rows[f"sliding{window}"] = acceptance(target, copy, prompts)
    full = rows["full"]
    for name, row in rows.items():
        row["ratio_to_full"] = row["mean_acceptance_length"] / full["mean_acceptance_length"]
        row["same_outputs_as_full"] = row["outputs"] == full["outputs"]
        print(
            f"{name:>10}: layers {row['layers']}, acceptance {row['mean_acceptance_length']:.3f} "
            f"({row['ratio_to_full']:.3f} of the drafter's own), {row['steps']} steps, "
            f"outputs {'the same' if row['same_outputs_as_full'] else 'DIFFERENT'}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({name: {k: v for k, v in row.items() if k != "outputs"} for name, row in rows.items()}, handle,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
