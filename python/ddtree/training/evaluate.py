"""Evaluation of the saved pair on the held-out prompts, with the reference engine.

Everything is measured on the checkpoints as saved (reloaded from disk by transformers and by
``DFlashDraftModel.from_pretrained``), so the numbers describe the shipped files:

* autoregressive greedy output of the target in fp32 on CPU: the reference;
* DFlash chain and DDTree (each budget): mean acceptance length tau (accepted drafts + bonus,
  pooled over every verification step of every prompt), and that their greedy output equals the
  reference (the engine is lossless; a mismatch would be a bug and is reported);
* the target's top-1/top-2 logit margin along the reference (how confident the greedy path is);
* bf16 on the GPU (plain transformers ``generate``) against the fp32 CPU reference: per prompt,
  the length of the common prefix, and how many prompts agree on >= 128 tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch


def load_pair(target_dir: str, drafter_dir: Optional[str], device="cpu", dtype=torch.float32):
    from ddtree.engine import DFlashDraftModel

    from .model import load_target

    target = load_target(target_dir, dtype=dtype, device=device)
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=dtype, device=device) if drafter_dir else None
    return target, drafter


def engine_acceptance(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    new_tokens: int,
    log,
    deadline: Optional[float] = None,
) -> Dict:
    """Reference output (AR), chain and DDTree acceptance on ``prompts`` with ``ddtree.engine``.

    Returns ``{"reference": [[ids]], "modes": {name: {...}}}``; each mode has ``tau`` (pooled
    mean), ``tau_per_prompt``, ``steps``, ``seconds``, ``lossless`` (outputs equal the reference)
    and ``accepted_at_depth``. Budgets left when ``deadline`` passes are skipped (reported).
    """
    from ddtree.engine import DepthTrials, GenerationConfig, SpeculativeEngine

    engine = SpeculativeEngine(target, drafter)
    results: Dict = {"modes": {}, "skipped": []}
    started = time.perf_counter()
    reference = engine.generate(list(prompts), GenerationConfig(mode="ar", max_new_tokens=new_tokens))
    results["reference"] = [r.output_ids for r in reference]
    log(f"[eval] AR reference: {len(prompts)} prompts x {new_tokens} tokens in {time.perf_counter() - started:.1f} s")
    runs = [("chain", "chain", 0)] + [(f"ddtree-{b}", "ddtree", b) for b in budgets]
    for name, mode, budget in runs:
        if deadline is not None and time.monotonic() >= deadline:
            results["skipped"].append(name)
            log(f"[eval] {name}: skipped (time box)")
            continue
        started = time.perf_counter()
        out = engine.generate(list(prompts), GenerationConfig(mode=mode, budget=budget, max_new_tokens=new_tokens))
        lengths = [length for r in out for length in r.stats.acceptance_lengths]
        depth = np.zeros(drafter.num_draft_positions, dtype=np.int64)
        trials = DepthTrials(drafter.num_draft_positions)
        for r in out:
            depth[: len(r.stats.accepted_at_depth)] += np.asarray(r.stats.accepted_at_depth, dtype=np.int64)
            trials.add(r.stats.depth_trials)
        entry = {
            "tau": float(np.mean(lengths)),
            "tau_per_prompt": [round(r.stats.mean_acceptance_length, 3) for r in out],
            "steps": len(lengths),
            "seconds": round(time.perf_counter() - started, 2),
            "lossless": all(r.output_ids == ref for r, ref in zip(out, results["reference"])),
            "accepted_at_depth": depth.tolist(),
            "depth_trials": dataclasses.asdict(trials),
        }
        results["modes"][name] = entry
        log(
            f"[eval] {name}: tau {entry['tau']:.3f} over {entry['steps']} steps, lossless {entry['lossless']}, "
            f"{entry['seconds']} s"
        )
    chain = results["modes"].get("chain", {}).get("tau")
    for name, entry in results["modes"].items():
        if chain and name != "chain":
            entry["ratio_to_chain"] = entry["tau"] / chain
    return results


@torch.no_grad()
def greedy_margins(target, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> Dict:
    """Top-1 minus top-2 logit along each reference continuation (teacher-forced, the model's dtype).

    Also checks that the argmax along the way reproduces the reference (the AR engine and a plain
    full-sequence forward must agree in fp32).
    """
    device = next(target.parameters()).device
    margins, agree = [], True
    rows = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    same_length = len({len(r) for r in rows}) == 1 and len({len(p) for p in prompts}) == 1
    groups = [list(range(len(rows)))] if same_length else [[i] for i in range(len(rows))]
    for group in groups:  # one batched forward when every row has the same length
        ids = torch.tensor([rows[i] for i in group], device=device)
        all_logits = target(input_ids=ids).logits.float()
        for row, i in enumerate(group):
            logits = all_logits[row, len(prompts[i]) - 1 : -1]
            top = logits.topk(2, dim=-1)
            margins.append((top.values[:, 0] - top.values[:, 1]).cpu())
            agree &= bool((top.indices[:, 0].cpu() == torch.tensor(list(outputs[i]))).all())
    flat = torch.cat(margins)
    return {
        "min": float(flat.min()),
        "p01": float(flat.quantile(0.01)),
        "median": float(flat.median()),
        "below_tenth": int((flat < 0.1).sum()),
        "count": int(flat.numel()),
        "per_prompt_min": [round(float(m.min()), 4) for m in margins],
        "teacher_forced_argmax_matches_reference": agree,
    }


@torch.no_grad()
def hf_greedy(
    target_dir: str, prompts: Sequence[Sequence[int]], new_tokens: int, device: str, dtype, pad_id: int
) -> List[List[int]]:
    """Greedy continuations by plain transformers ``generate`` (no stop, no EOS suppression).

    Prompts of one length run as one batch without padding; otherwise one by one.
    """
    from .model import load_target
    from .train import greedy_continuations

    model = load_target(target_dir, dtype=dtype, device=device)
    batches = [list(prompts)] if len({len(p) for p in prompts}) == 1 else [[p] for p in prompts]
    outputs: List[List[int]] = []
    for batch in batches:
        outputs.extend(greedy_continuations(model, batch, new_tokens, pad_id, torch.device(device)))
    del model
    return outputs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], horizon: int = 128) -> Dict:
    """Per prompt, the common prefix with the reference; how many agree on ``horizon`` tokens."""
    common = [common_prefix(o, r) for o, r in zip(outputs, reference)]
    return {
        "common_prefix": common,
        "prompts_agreeing_128": sum(c >= horizon for c in common),
        "prompts": len(common),
        "horizon": horizon,
    }


def gpu_bf16_agreement(
    target_dir: str, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], new_tokens: int, pad_id: int
) -> Dict:
    """Greedy output of the target in bf16 on CUDA (transformers ``generate``) vs the fp32 CPU reference."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    outputs = hf_greedy(target_dir, prompts, new_tokens, "cuda", torch.bfloat16, pad_id)
    torch.cuda.empty_cache()
    return agreement(outputs, reference, min(128, new_tokens))
