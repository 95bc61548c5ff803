"""``ddtree demo --pair DIR``: real decoding with the trained test pair, chain against DDTree.

``DIR`` holds ``target/``, ``drafter/`` and ``prompts.json`` (held-out prompts and the target's fp32 greedy
continuations), as ``tests/fixtures/models`` does. For each mode the reference engine decodes the same
held-out prompts greedily; the demo prints the text of the first continuation, tokens per verification step
(tau), wall time, and whether every mode's output equals greedy autoregressive decoding.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Sequence

import torch

from .drafter import DFlashDraftModel
from .engine import GenerationConfig, GenerationResult, SpeculativeEngine
from .validation import EngineInputError

PAIR_FILES = ("target/config.json", "drafter/config.json", "prompts.json")


def load_pair_prompts(pair_dir: str) -> Dict:
    """``prompts.json`` of a pair directory, after checking the directory has what the demo needs."""
    missing = [name for name in PAIR_FILES if not os.path.isfile(os.path.join(pair_dir, name))]
    if missing:
        raise EngineInputError(f"--pair {pair_dir}: missing {missing}; expected a directory like tests/fixtures/models")
    with open(os.path.join(pair_dir, "prompts.json")) as handle:
        data = json.load(handle)
    if not data.get("prompts"):
        raise EngineInputError(f"--pair {pair_dir}: prompts.json has no 'prompts' list")
    return data


def run_modes(
    engine: SpeculativeEngine, prompts: Sequence[Sequence[int]], new_tokens: int, budgets: Sequence[int]
) -> Dict[str, Dict]:
    """Greedy ``ar``, ``chain`` and ``ddtree`` at each budget on the same prompts: outputs, tau, seconds."""
    modes = [("ar", "ar", 0), ("chain", "chain", 0)] + [(f"ddtree-{b}", "ddtree", b) for b in budgets]
    results: Dict[str, Dict] = {}
    for name, mode, budget in modes:
        config = GenerationConfig(mode=mode, budget=budget or 64, max_new_tokens=new_tokens)
        started = time.perf_counter()
        outputs: List[GenerationResult] = engine.generate(list(prompts), config)
        seconds = time.perf_counter() - started
        lengths = [n for r in outputs for n in r.stats.acceptance_lengths]
        results[name] = {
            "outputs": [r.output_ids for r in outputs],
            "tau": sum(lengths) / len(lengths) if lengths and mode != "ar" else 1.0,
            "steps": len(lengths),
            "seconds": seconds,
            "stats": [r.stats for r in outputs],
        }
    return results


def run_pair_demo(pair_dir: str, num_prompts: int, new_tokens: int, budgets: Sequence[int], device: str) -> int:
    data = load_pair_prompts(pair_dir)
    prompts = data["prompts"][:num_prompts]
    target_dir, drafter_dir = os.path.join(pair_dir, "target"), os.path.join(pair_dir, "drafter")
    from transformers import AutoTokenizer

    from ddtree.engine.target import load_causal_lm

    if device == "cpu":
        # A 10M-parameter model's ops are too small for intra-op threads to pay off: on 2 cores one thread
        # decoded the demo ~10x faster than torch's default.
        torch.set_num_threads(1)

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_causal_lm(target_dir, torch.float32).to(device)
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32, device=device)
    engine = SpeculativeEngine(target, drafter)
    print(
        f"pair: {pair_dir} (target {sum(p.numel() for p in target.parameters()):,} parameters, drafter "
        f"{sum(p.numel() for p in drafter.parameters()):,}); {len(prompts)} held-out prompts x {new_tokens} "
        f"new tokens, greedy, fp32 on {device}"
    )
    results = run_modes(engine, prompts, new_tokens, budgets)

    print("=== prompt 0 ===")
    print(tokenizer.decode(prompts[0]))
    print("=== its continuation (every mode) ===")
    print(tokenizer.decode(results["ar"]["outputs"][0]))
    reference = results["ar"]["outputs"]
    chain_tau = results["chain"]["tau"]
    print(f"\n{'mode':<12}{'tau':>7}{'x chain':>9}{'steps':>7}{'seconds':>9}  output = autoregressive greedy")
    for name, entry in results.items():
        same = entry["outputs"] == reference
        ratio = "" if name == "ar" else f"{entry['tau'] / chain_tau:.2f}"
        print(f"{name:<12}{entry['tau']:>7.2f}{ratio:>9}{entry['steps']:>7}{entry['seconds']:>9.2f}  {same}")
    if any(entry["outputs"] != reference for entry in results.values()):
        print("ERROR: a speculative mode's output differs from autoregressive greedy decoding")
        return 1
    return 0
