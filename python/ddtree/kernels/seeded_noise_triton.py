"""Seeded requests' sampling noise in one Triton kernel per step.

:mod:`ddtree.vllm.seeded_noise` defines the noise of a seeded request: for vocabulary entry ``v`` of a row that
samples absolute position ``p``, ``-log U`` with ``U`` from a 32-bit hash of ``(seed, p, v)``. In torch that is
about twenty elementwise launches per request and pass (int64 arithmetic, then a float64 log), launched from the
host on every step: ~0.1-0.3 ms of host work per seeded request. :func:`seeded_noise_rows_` writes the noise of
every seeded row of a step in one launch: one program per (row, block of the vocabulary), the hash in uint32
arithmetic (a uint32 product wraps: the torch version's ``& 0xFFFFFFFF``), the log in float64 as there.

The seeds' part of each key is made on the host (a Python integer per request) and travels with the row indices
in one small copy; the positions are read on the device. :func:`ddtree.vllm.seeded_noise.position_noise` is the
oracle of the tests (equal within 2e-7 relative, under Triton's interpreter and compiled: two libraries' float64
logs, rounded to float32).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU installs run the torch version
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None

#: Vocabulary entries per program (a power of two).
BLOCK_V = 4096


if triton is not None:

    @triton.jit
    def _mix32(x):
        # ddtree.vllm.seeded_noise.mix32 on uint32 values (shifts 16 / 15 / 15, the same odd multipliers).
        x = (x ^ (x >> 16)) * 0x21F0AAAD
        x = (x ^ (x >> 15)) * 0x735A2D97
        return x ^ (x >> 15)

    @triton.jit
    def _seeded_noise_kernel(
        noise_ptr,
        rows_ptr,
        seed_keys_ptr,
        positions_ptr,
        vocab,
        noise_stride,
        BLOCK_V: tl.constexpr,
    ):
        entry = tl.program_id(0)
        row = tl.load(rows_ptr + entry).to(tl.int64)
        seed_key = tl.load(seed_keys_ptr + entry).to(tl.uint32)
        position = tl.load(positions_ptr + row).to(tl.uint32)  # the low 32 bits, as the torch version's mask
        row_key = _mix32(_mix32(position) ^ seed_key)
        columns = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        kept = columns < vocab
        entry_key = _mix32(columns.to(tl.uint32) + 0x9E3779B9)
        bits = _mix32(row_key ^ entry_key) >> 8  # 24 bits
        uniform = (bits.to(tl.float64) + 0.5) * (1.0 / 16777216.0)
        noise = -tl.log(uniform)
        tl.store(noise_ptr + row * noise_stride + columns, noise.to(tl.float32), mask=kept)


def seeded_noise_rows_(
    noise: torch.Tensor, rows: torch.Tensor, seed_keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Writes ``noise[rows[i], :]`` (``noise`` ``[N, V]`` float32, rows contiguous) with the noise of
    ``(seed_keys[i], positions[rows[i]])`` in one launch; other rows are left as they are. ``seed_keys``: each
    row's seed part of the key (:func:`ddtree.vllm.seeded_noise.seed_key`), int64 on the device beside ``rows``
    (int64); ``positions``: ``[N]`` the position each row samples. Returns ``noise``."""
    if triton is None:
        raise RuntimeError("seeded_noise_rows_ needs triton; use ddtree.vllm.seeded_noise.position_noise")
    if noise.dim() != 2 or noise.stride(1) != 1:
        raise ValueError(f"noise must be [rows, vocab] with contiguous rows, got shape {list(noise.shape)}")
    if noise.dtype != torch.float32:  # the sampler's probabilities are float32; one rounding, as in torch
        raise ValueError(f"noise must be float32, got {noise.dtype}")
    if rows.dim() != 1 or seed_keys.shape != rows.shape:
        raise ValueError(
            f"rows and seed_keys must be one key per row, got {list(rows.shape)} and {list(seed_keys.shape)}"
        )
    if positions.dim() != 1 or positions.shape[0] != noise.shape[0]:
        raise ValueError(f"positions must be [{noise.shape[0]}] (one per noise row), got {list(positions.shape)}")
    count, vocab = rows.shape[0], noise.shape[1]
    if count and vocab:
        block = min(BLOCK_V, triton.next_power_of_2(vocab))
        _seeded_noise_kernel[(count, triton.cdiv(vocab, block))](
            noise, rows, seed_keys, positions, vocab, noise.stride(0), BLOCK_V=block
        )
    return noise
