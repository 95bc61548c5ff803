"""The drafter's top-K as one host copy: log-probabilities and token ids packed in one ``[rows, 2K]`` float32 tensor.

After the drafter's logits ``[rows, V]`` (rows = requests x depth) and their top-K, the tree build needs each
candidate's log-probability ``value - logsumexp(row)`` and its token id, copied to the host in one transfer: the
first ``K`` columns hold the log-probabilities, the last ``K`` the ids' int32 bits.

In torch that is ``logits.float()`` (a copy of the whole ``[rows, V]``), ``torch.logsumexp`` (a composite of ~9
kernels), a subtraction, a cast and a concatenation: ~13 launches of eager work after the drafter's graph on every
step, each 5-10 us of host time on a GPU host, where a batch-1 step is host-bound (the profiles of
``gpu-h200-pair-profile-77cb2e6``: 76 ``aten::logsumexp`` calls in 38 steps). :func:`pack_top_k_triton` is one
kernel, one program per row: an online logsumexp over the row in float32 (read as bf16 or whatever the logits are),
then the row's ``K`` log-probabilities and ids written in place. :func:`pack_top_k_reference` is the torch
computation it replaces, and its oracle in the tests.

The two differ in the last bits of the log-sum (the reduction order): only the trees' scores move, by ~1e-7
relative, so near-ties between branches can order differently; verification is exact either way.

With ``host_out`` (pinned host memory) the kernel also writes each row there, through the pinned memory's device
address (CUDA maps pinned memory into the device's address space): the host's copy of the top-K needs no copy of
its own, which was ~0.047 ms of host time a step at batch 1 (``gpu-h100-pair-pieces-7672df9``: a copy's launch and
the caching host allocator's bookkeeping). The host reads it once an event recorded after the kernel completed.

A row whose log-probabilities are not finite numbers at most ``LOG_PROB_TOLERANCE`` (NaN logits, an infinite
logit: a request whose numbers ran away) is written as the filler row instead: candidate ``k`` with log-probability
``-k - 1`` and token id ``k``. The tree build refuses such values (one request's numbers would stop every request),
while any drafts verify exactly; the filler is what a request without a proposal verifies
(``ddtree.vllm.step.filler_record``).
"""

from __future__ import annotations

from typing import Optional

import torch

try:  # Triton is optional: CPU installs run the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None
    tl = None

#: Logits read per loop iteration of a program (a power of two).
BLOCK_V = 2048

#: The largest log-probability the tree build takes (the Rust core's ``LOG_PROB_TOLERANCE``: rounding above 0).
LOG_PROB_TOLERANCE = 1e-3


def _check(
    logits: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    host_out: Optional[torch.Tensor] = None,
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {list(logits.shape)}")
    rows = logits.shape[0]
    if values.dim() != 2 or values.shape[0] != rows or ids.shape != values.shape:
        raise ValueError(
            f"values and ids must both be [rows={rows}, K], got {list(values.shape)} and {list(ids.shape)}"
        )
    if values.shape[1] > logits.shape[1]:
        raise ValueError(f"K = {values.shape[1]} exceeds the vocabulary ({logits.shape[1]})")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    wanted = (rows, 2 * values.shape[1])
    for name, buffer in (("out", out), ("host_out", host_out)):
        if buffer is not None and (buffer.shape != wanted or buffer.dtype != torch.float32 or buffer.stride(-1) != 1):
            raise ValueError(
                f"{name} must be a float32 {list(wanted)} tensor with unit stride along its rows, got "
                f"{list(buffer.shape)} {buffer.dtype}"
            )
    if host_out is not None and host_out.device.type != "cpu":
        raise ValueError(f"host_out must be a host tensor, got one on {host_out.device}")
    if host_out is not None and logits.is_cuda and not host_out.is_pinned():
        raise ValueError("host_out must be pinned host memory: the kernel writes it through its device address")


def pack_top_k_reference(
    logits: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    host_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[rows, 2K]`` float32: ``values - logsumexp(logits)`` then the ids' int32 bits, in torch (into ``out``
    when given, and returned; also into ``host_out`` when given, a non-blocking copy)."""
    _check(logits, values, ids, out, host_out)
    log_probs = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    bad = (~(log_probs <= LOG_PROB_TOLERANCE)).any(dim=-1, keepdim=True)  # (NaN compares false)
    candidates = torch.arange(values.shape[1], device=values.device)
    log_probs = torch.where(bad, -(candidates + 1).to(torch.float32), log_probs)
    ids = torch.where(bad, candidates.to(torch.int32), ids)
    packed = torch.cat([log_probs, ids.view(torch.float32)], dim=-1)
    if out is not None:
        packed = out.copy_(packed)
    if host_out is not None:
        host_out.copy_(packed, non_blocking=True)
    return packed


if triton is not None:

    @triton.jit
    def _pack_top_k_kernel(
        logits_ptr,
        values_ptr,
        ids_ptr,
        out_ptr,
        out_ids_ptr,
        host_ptr,
        host_ids_ptr,
        vocab,
        k,
        logits_stride,
        values_stride,
        ids_stride,
        out_stride,
        host_stride,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TOLERANCE: tl.constexpr,
        TO_HOST: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK_V)
        # Online logsumexp: a running maximum and the sum of exp(x - maximum), rescaled when the maximum grows. The
        # lowest finite float32 to start from, not -inf: exp(-inf - -inf) would be NaN on a row of -inf logits.
        running_max = tl.full((), -3.4028234663852886e38, tl.float32)
        running_sum = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK_V):
            columns = start + offsets
            x = tl.load(logits_ptr + row * logits_stride + columns, mask=columns < vocab, other=float("-inf"))
            x = x.to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        log_sum = running_max + tl.log(running_sum)
        candidates = tl.arange(0, BLOCK_K)
        kept = candidates < k
        value = tl.load(values_ptr + row * values_stride + candidates, mask=kept, other=0.0).to(tl.float32)
        log_prob = value - log_sum
        token = tl.load(ids_ptr + row * ids_stride + candidates, mask=kept, other=0).to(tl.int32)
        # A row of values the tree build refuses (NaN compares false) becomes the filler row.
        bad = kept & ~(log_prob <= TOLERANCE)
        row_bad = tl.max(bad.to(tl.int32), axis=0) > 0
        log_prob = tl.where(row_bad, -(candidates + 1).to(tl.float32), log_prob)
        token = tl.where(row_bad, candidates.to(tl.int32), token)
        tl.store(out_ptr + row * out_stride + candidates, log_prob, mask=kept)
        tl.store(out_ids_ptr + row * out_stride + k + candidates, token, mask=kept)
        if TO_HOST:  # the same row into pinned host memory, through its device address (a copy's launch saved)
            tl.store(host_ptr + row * host_stride + candidates, log_prob, mask=kept)
            tl.store(host_ids_ptr + row * host_stride + k + candidates, token, mask=kept)


def pack_top_k_triton(
    logits: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    host_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`pack_top_k_reference` in one Triton kernel (one program per row). ``host_out`` (pinned): the kernel
    writes each row there too, through the pinned memory's device address; the host reads it once an event recorded
    after the kernel has completed."""
    if triton is None:
        raise RuntimeError("pack_top_k_triton needs triton; use pack_top_k_reference")
    _check(logits, values, ids, out, host_out)
    rows, vocab = logits.shape
    k = values.shape[1]
    logits, values, ids = (t if t.stride(-1) == 1 else t.contiguous() for t in (logits, values, ids))
    if out is None:
        out = torch.empty((rows, 2 * k), dtype=torch.float32, device=logits.device)
    # Without host_out the kernel's host pointers are never written (TO_HOST off): the device buffer stands in.
    host = out if host_out is None else host_out
    if rows:
        _pack_top_k_kernel[(rows,)](
            logits,
            values,
            ids,
            out,
            out.view(torch.int32),
            host,
            host.view(torch.int32),
            vocab,
            k,
            logits.stride(0),
            values.stride(0),
            ids.stride(0),
            out.stride(0),
            host.stride(0),
            BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
            BLOCK_K=triton.next_power_of_2(k),
            TOLERANCE=LOG_PROB_TOLERANCE,
            TO_HOST=host_out is not None,
        )
    return out


def pack_top_k(
    logits: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    host_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The packed top-K (into ``out`` when given, and into the pinned ``host_out`` too when given): the Triton
    kernel on a CUDA device where Triton is installed, else torch."""
    if logits.is_cuda and triton is not None:
        return pack_top_k_triton(logits, values, ids, out, host_out)
    return pack_top_k_reference(logits, values, ids, out, host_out)
