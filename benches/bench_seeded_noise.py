"""Seeded requests' sampling noise: the torch operations against the one Triton kernel, beside what vLLM pays.

    python benches/bench_seeded_noise.py [--requests 1 8 32] [--rows 64] [--vocab 4096 248320] [--steps 30]
        [--json FILE]

Per batch of seeded requests, each one tree of ``--rows`` rows (64: budget 63) sampled at positions of a depth-15
drafter's tree, the noise of every row ``[requests x rows, vocab]`` float32 is made by

* ``torch``: :func:`ddtree.vllm.seeded_noise.tree_noise` request by request (one vector per depth, gathered: about
  twenty launches each), what :func:`~ddtree.vllm.seeded_noise.fill_seeded_noise` runs without the kernel;
* ``kernel``: :func:`ddtree.vllm.seeded_noise.fill_in_one_launch` (rows and keys in one copy, one launch);
* ``vllm``: one ``exponential_(generator=...)`` per request over its rows, as vLLM's sampler draws a seeded
  request's noise (not position-keyed: the cost to be near, not an alternative).

``host us``: wall time of launching one call (median; the device synchronised between calls); ``gpu us``: device
time of one call (CUDA events). The kernel's noise is checked against the torch path's first (relative 2e-7): a
mismatch stops the bench. Rows are printed and written (``--json``) as measured. CUDA only.
"""

from __future__ import annotations

import argparse

import torch

from bench_draft_top_k import keep_row, timed_call
from ddtree.vllm.seeded_noise import fill_in_one_launch, tree_noise


def tree_positions(requests: int, rows: int, depth: int, device) -> torch.Tensor:
    """Each request's rows sample its root's position + 1 + a depth (a tree's depths, root first, cycling 0..depth)."""
    depths = torch.arange(rows, device=device) % (depth + 1)
    depths[0] = 0
    starts = torch.arange(requests, device=device) * 1000 + 100
    return (starts[:, None] + 1 + depths[None, :]).reshape(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 248320])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_seeded_noise needs a CUDA GPU")
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "rows_per_request": args.rows, "rows": []}
    print(f"{'requests':>9}{'vocab':>8}{'path':>8}{'host us':>10}{'gpu us':>10}")
    for vocab in args.vocab:
        for requests in args.requests:
            positions = tree_positions(requests, args.rows, args.depth, device)
            seeded = [(1234 + r, r * args.rows, args.rows) for r in range(requests)]
            noise = torch.empty((requests * args.rows, vocab), dtype=torch.float32, device=device)
            generators = [torch.Generator(device).manual_seed(1234 + r) for r in range(requests)]

            def vllm_draws():
                for r, gen in enumerate(generators):
                    noise[r * args.rows : (r + 1) * args.rows].exponential_(generator=gen)

            def torch_path():
                for seed, first, count in seeded:
                    rows = positions[first : first + count]
                    noise[first : first + count] = tree_noise(seed, rows, vocab, noise.dtype, args.depth)

            paths = {
                "torch": torch_path,
                "kernel": lambda: fill_in_one_launch(noise, positions, seeded),
                "vllm": vllm_draws,
            }
            torch_path()
            expected = noise.clone()
            got = fill_in_one_launch(torch.zeros_like(noise), positions, seeded)
            torch.testing.assert_close(got, expected, rtol=2e-7, atol=0)
            for name, run in paths.items():
                host, gpu = timed_call(run, args.steps, device)
                row = {"requests": requests, "vocab": vocab, "path": name, "host_us": host, "gpu_us": gpu}
                keep_row(results, row, f"{requests:>9}{vocab:>8}{name:>8}{host:>10.1f}{gpu:>10.1f}", args.json)


if __name__ == "__main__":
    main()
