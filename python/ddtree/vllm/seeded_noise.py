"""The sampling noise of a seeded request as a function of its seed and the position being sampled.

Every verified node samples the token one position past it with an exponential race (``argmax p / E``, see
:func:`ddtree.vllm.node_sampling.sample_rows`). Drawing ``E`` from the request's generator row by row ties a seeded
request's samples to the sizes of its trees: under ``ddtree_budget: "auto"``, whose budgets follow measured step
times, two runs of one seeded request came out different (``gpu-h200-e2e-94baa94``). Here ``E`` for vocabulary
entry ``v`` at absolute position ``p`` is a hash of ``(seed, p, v)``: the same whatever the tree, the budget or the
batch, so a seeded request repeats exactly. Its every token: a step in which no request verifies drafts is sampled
by ddtree's sampler too when a request in it is seeded (``runner._ddtree_samples_draftless_step``), not by vLLM's,
which draws from the generator.

Still exact: nodes of one depth share their position, hence their noise, but only one of them can be on the
accepted path, which the samples of the positions before it choose; a position's noise decides nothing that is
kept before that position is reached, so drawing it again in a later step (a rejected branch's deeper node sampled
it once) is as good as a fresh draw.

The hash is a two-round 32-bit xorshift-multiply mix (shifts 16 / 15 / 15, odd multipliers 0x21F0AAAD and
0x735A2D97, both below 2**31 so that a product of a 32-bit value stays below 2**63: int64 tensor arithmetic without
overflow, two operations a multiply); ``E = -log U`` with ``U`` 24-bit uniform in (0, 1). :func:`fill_seeded_noise`
is what the sampler calls: on a CUDA device one Triton kernel writes every seeded row of the step
(:mod:`ddtree.kernels.seeded_noise_triton`); elsewhere the torch operations here (about twenty elementwise
launches per request and pass of up to ``CHUNK_ENTRIES`` entries), which are also the kernel's oracle in the tests.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
#: Entries of noise made at a time (each pass holds a few int64 temporaries of this many entries: ~32 MB each), so
#: a 248K-token vocabulary takes 16 rows a pass and a small one all its rows at once.
CHUNK_ENTRIES = 1 << 22


#: The mix's shifts and multipliers (both multipliers odd, so each step is a bijection of 32-bit values).
_ROUNDS = ((16, 0x21F0AAAD), (15, 0x735A2D97))
_LAST_SHIFT = 15


def mix32(x):
    """A bijective 32-bit mix of ``x``: an int64 tensor of values in ``[0, 2**32)``, or one Python integer (the
    seed's part of a key is made on the host: a tensor made from it would be a host-to-device copy, which waits for
    the GPU)."""
    for shift, multiplier in _ROUNDS:
        x = ((x ^ (x >> shift)) * multiplier) & _MASK32
    return x ^ (x >> _LAST_SHIFT)


#: Each vocabulary entry's part of the keys, by (vocabulary size, device): made once.
_ENTRIES: Dict[Tuple[int, str], torch.Tensor] = {}


def _entries(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    entries = _ENTRIES.get(key)
    if entries is None:
        entries = _ENTRIES[key] = mix32(torch.arange(vocab, dtype=torch.int64, device=device) + 0x9E3779B9)[None, :]
    return entries


def seed_key(seed: int) -> int:
    """The seed's part of every key of its request (a 32-bit Python integer; 64-bit seeds fold their halves)."""
    return mix32((seed ^ (seed >> 32)) & _MASK32)


def _key(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]`` per-row keys of ``(seed, position)``."""
    return mix32(mix32(positions.to(torch.int64) & _MASK32) ^ seed_key(seed))[:, None]


def position_noise(seed: int, positions: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[len(positions), vocab]`` Exp(1) noise: row ``i`` is a function of ``(seed, positions[i])`` only."""
    out = torch.empty((positions.shape[0], vocab), dtype=dtype, device=positions.device)
    entries = _entries(vocab, positions.device)
    chunk = max(1, CHUNK_ENTRIES // max(vocab, 1))
    for lo in range(0, positions.shape[0], chunk):
        hi = min(lo + chunk, positions.shape[0])
        bits = mix32(_key(seed, positions[lo:hi]) ^ entries) >> 8  # 24 bits
        uniform = (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 24))
        out[lo:hi] = (-torch.log(uniform)).to(dtype)
    return out


def tree_noise(
    seed: int, positions: torch.Tensor, vocab: int, dtype: torch.dtype, max_depth: Optional[int] = None
) -> torch.Tensor:
    """:func:`position_noise` for one request's rows, ``positions`` from its root's (its first row, the smallest)
    on: a tree's nodes sample ``root + 1 + depth``, so one vector per depth is made (at most ``max_depth + 1``, the
    drafter's depth plus one; else as many as rows) and gathered into the rows, on the device (no wait)."""
    count = positions.shape[0]
    width = count if max_depth is None else min(count, max_depth + 1)
    base = positions[:1]
    vectors = position_noise(
        seed, base + torch.arange(width, dtype=positions.dtype, device=positions.device), vocab, dtype
    )
    return vectors[positions - base]


def fill_seeded_noise(
    noise: torch.Tensor,
    positions: torch.Tensor,
    seeded: Sequence[Tuple[int, int, int]],
    max_depth: Optional[int] = None,
) -> torch.Tensor:
    """Overwrites the rows of seeded requests in ``noise [N, V]`` with their position-keyed noise; returns ``noise``.

    ``positions``: ``[N]`` the position each row samples; ``seeded``: ``(seed, first row, rows)`` per seeded request
    (its rows one tree, root first: see :func:`tree_noise`). On a CUDA device with Triton, one kernel launch for
    all of them (row indices and seed keys in one small copy); else :func:`tree_noise` request by request.
    """
    seeded = [(seed, first, count) for seed, first, count in seeded if count]
    if not seeded:
        return noise
    if noise.is_cuda and noise.dtype == torch.float32 and noise.stride(1) == 1 and _kernel() is not None:
        return fill_in_one_launch(noise, positions, seeded)
    for seed, first, count in seeded:
        noise[first : first + count] = tree_noise(
            seed, positions[first : first + count], noise.shape[1], noise.dtype, max_depth
        )
    return noise


def _kernel():
    """The one-launch kernel's module, or None without Triton."""
    from ddtree.kernels import seeded_noise_triton

    return seeded_noise_triton if seeded_noise_triton.triton is not None else None


def fill_in_one_launch(
    noise: torch.Tensor, positions: torch.Tensor, seeded: Sequence[Tuple[int, int, int]]
) -> torch.Tensor:
    """:func:`fill_seeded_noise` by the Triton kernel: every seeded row's index and seed key in one small copy (from
    pageable memory without a stream wait: the driver stages it before returning), then one launch."""
    host = seeded_rows_and_keys(seeded)
    device = torch.from_numpy(host).to(noise.device, non_blocking=True)
    return _kernel().seeded_noise_rows_(noise, device[0], device[1], positions)


def seeded_rows_and_keys(seeded: Sequence[Tuple[int, int, int]]) -> np.ndarray:
    """``[2, rows]`` int64: every row of the ``(seed, first row, rows)`` requests, and its request's seed key."""
    counts = np.fromiter((count for _, _, count in seeded), dtype=np.int64, count=len(seeded))
    firsts = np.fromiter((first for _, first, _ in seeded), dtype=np.int64, count=len(seeded))
    keys = np.fromiter((seed_key(seed) for seed, _, _ in seeded), dtype=np.int64, count=len(seeded))
    out = np.empty((2, int(counts.sum())), dtype=np.int64)
    # Row i of a request is its first row + i: each request's first row, less the rows before it, plus a count.
    out[0] = np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(out.shape[1])
    out[1] = np.repeat(keys, counts)
    return out
