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

On CUDA two more rows time what the late trees' deferral pays to bring the rows to the host, each ending with the
event the host later waits on: ``copy`` (the kernel into a device buffer, then a non-blocking copy into pinned host
memory: the deferral until the thirty-fourth session) and ``to-host`` (the kernel writing the pinned rows itself, no
copy). Their rows come from ``--rounds`` alternating rounds (the host's drift falls on both), each the median of
``--steps`` calls; ``to-host / copy`` is the ratio of their medians, measured in the same run. Both are checked
first: the host rows equal the device rows after the event.
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


def deferral_paths(logits, values, ids):
    """``copy`` and ``to-host``: the packed top-K brought to pinned host memory, each ending with an event record."""
    rows, k = values.shape[0], values.shape[1]
    device_out = torch.empty((rows, 2 * k), dtype=torch.float32, device=logits.device)
    host = torch.empty((rows, 2 * k), dtype=torch.float32, pin_memory=True)
    landed = torch.cuda.Event()

    def copy() -> None:
        pack_top_k_triton(logits, values, ids, device_out)
        host.copy_(device_out, non_blocking=True)
        landed.record()

    def to_host() -> None:
        pack_top_k_triton(logits, values, ids, device_out, host)
        landed.record()

    for path in (copy, to_host):  # (each checked: the host's rows are the device's once the event has landed)
        host.fill_(-7.0)
        path()
        landed.synchronize()
        if not torch.equal(host, device_out.cpu()):
            raise SystemExit(f"{path.__name__}: the host's rows differ from the device's")
    return {"copy": copy, "to-host": to_host}


def time_deferral(results, logits, values, ids, args, device) -> None:
    """The two deferral rows, alternating round by round, and their ratio."""
    paths = deferral_paths(logits, values, ids)
    per_round = {name: [] for name in paths}
    for round_index in range(args.rounds):  # (which path goes first alternates too)
        order = list(paths.items())[:: 1 if round_index % 2 == 0 else -1]
        for name, path in order:
            per_round[name].append(timed_call(path, args.steps, device))
    rows, vocab, k = logits.shape[0], logits.shape[1], values.shape[1]
    medians = {}
    for name, measured in per_round.items():
        host = statistics.median(m[0] for m in measured)
        gpu = statistics.median(m[1] for m in measured)
        medians[name] = host
        row = {
            "rows": rows,
            "vocab": vocab,
            "top_k": k,
            "path": name,
            "host_us": host,
            "gpu_us": gpu,
            "host_us_by_round": [m[0] for m in measured],
        }
        keep_row(results, row, f"{rows:>6}{vocab:>8}{name:>8}{host:>10.1f}{gpu:>10.1f}", args.json)
    ratio = medians["to-host"] / medians["copy"]
    results.setdefault("deferral_ratios", []).append({"rows": rows, "vocab": vocab, "to_host_over_copy": ratio})
    if args.json:  # (rewritten with the ratio: a run cut short keeps it)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{rows:>6}{vocab:>8}  to-host / copy host us: {ratio:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[15, 120, 480])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936])
    parser.add_argument("--top-k", type=int, default=255)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the two deferral rows (CUDA)")
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
            if device.type == "cuda":
                time_deferral(results, logits, values, ids, args, device)


if __name__ == "__main__":
    main()
