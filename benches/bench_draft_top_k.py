"""The drafter's packed top-K: the torch computation the proposer ran against the one Triton kernel that replaces it.

    python benches/bench_draft_top_k.py [--rows 15 120 480] [--vocab 4096 151936] [--top-k 255] [--steps 50]
        [--json FILE]

Per row count (requests x drafter depth: 15 is one request of the test pair's depth-15 drafter) and vocabulary
(4096: the test pair; 151936: Qwen3's), from bf16 logits already on the device and their top-K:

* ``host us``: wall time of launching one call (no synchronisation inside the timed loop; the median over
  ``--steps`` calls, the device synchronised after each so queues do not fill): what the engine loop pays, since at
  batch 1 a step is host-bound;
* ``gpu us``: the device time of one call (CUDA events), CUDA only.

Both paths are compared first (log-probabilities within 2e-5, ids equal): a mismatch stops the bench. Needs CUDA for
the Triton row (on CPU only the torch row is timed). Rows are printed and written (``--json``) as measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from ddtree.kernels.draft_top_k import pack_top_k_reference, pack_top_k_triton


def timed_call(run, steps: int, device: torch.device):
    """(median host us per launch, median device us per call or None)."""
    cuda = device.type == "cuda"
    host, gpu = [], []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
        began = time.perf_counter()
        run()
        host.append((time.perf_counter() - began) * 1e6)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host), (statistics.median(gpu) if gpu else None)


def keep_row(results: dict, row: dict, line: str, json_path) -> None:
    """Adds a measured row, prints its line and rewrites ``json_path`` (if any): a run cut short keeps its rows."""
    results["rows"].append(row)
    print(line, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[15, 120, 480])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936])
    parser.add_argument("--top-k", type=int, default=255)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = {"torch": pack_top_k_reference}
    if device.type == "cuda":
        paths["triton"] = pack_top_k_triton
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(), "rows": []}
    print(f"{'rows':>6}{'vocab':>8}{'path':>8}{'host us':>10}{'gpu us':>10}")
    for vocab in args.vocab:
        for rows in args.rows:
            gen = torch.Generator().manual_seed(rows)
            logits = (torch.randn(rows, vocab, generator=gen) * 4).to(torch.bfloat16).to(device)
            values, ids = logits.topk(min(args.top_k, vocab), dim=-1)
            expected = pack_top_k_reference(logits, values, ids)
            for name, path in paths.items():
                got = path(logits, values, ids)
                k = values.shape[1]
                torch.testing.assert_close(got[:, :k], expected[:, :k], rtol=1e-6, atol=2e-5)
                if not torch.equal(got[:, k:].view(torch.int32), expected[:, k:].view(torch.int32)):
                    raise SystemExit(f"{name}: ids differ from the reference at rows={rows} vocab={vocab}")
                host, gpu = timed_call(lambda: path(logits, values, ids), args.steps, device)
                row = {"rows": rows, "vocab": vocab, "top_k": k, "path": name, "host_us": host, "gpu_us": gpu}
                line = f"{rows:>6}{vocab:>8}{name:>8}{host:>10.1f}{(f'{gpu:.1f}' if gpu else '-'):>10}"
                keep_row(results, row, line, args.json)


if __name__ == "__main__":
    main()
