"""The drafter's packed top-K (``ddtree.kernels.draft_top_k``): the Triton kernel equals the torch computation it
replaces, under Triton's CPU interpreter (a subprocess: the flag is read when triton is imported) and, on a CUDA
machine, compiled."""

import os
from pathlib import Path

import pytest
import torch

from ddtree.kernels.draft_top_k import pack_top_k, pack_top_k_reference

TESTS_DIR = Path(__file__).resolve().parent

#: (rows, vocab, K, dtype): a vocabulary under one block, one over several blocks (not a multiple of the block),
#: K of one and of a whole power of two, K = 255 (the test pair's), float32 and bf16 logits.
SHAPES = (
    (3, 1000, 255, torch.bfloat16),
    (2, 5000, 64, torch.bfloat16),
    (4, 300, 1, torch.float32),
    (1, 4097, 16, torch.float32),
)


def _inputs(rows: int, vocab: int, k: int, dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, vocab + 7, generator=gen) * 6).to(dtype)
    logits = wide[:, 3 : 3 + vocab].to(device)  # a strided view: rows do not start where the last one ended
    values, ids = logits.topk(k, dim=-1)
    return logits, values, ids


def run_checks(device: str) -> None:
    from ddtree.kernels.draft_top_k import pack_top_k_triton

    for seed, (rows, vocab, k, dtype) in enumerate(SHAPES):
        logits, values, ids = _inputs(rows, vocab, k, dtype, device, seed)
        if seed == 0:
            logits[0, : vocab // 2] = float("-inf")  # masked logits count for nothing, as in torch
            values, ids = logits.topk(k, dim=-1)  # (the top-K of the logits as they are)
        got, expected = pack_top_k_triton(logits, values, ids), pack_top_k_reference(logits, values, ids)
        assert got.shape == (rows, 2 * k) and got.dtype == torch.float32
        torch.testing.assert_close(got[:, :k], expected[:, :k], rtol=1e-6, atol=2e-5)
        assert torch.equal(got[:, k:].view(torch.int32), expected[:, k:].view(torch.int32))
        assert torch.equal(got[:, k:].view(torch.int32).long(), ids.long())
    empty = pack_top_k_triton(*_inputs(0, 10, 2, torch.float32, device, 9))
    assert empty.shape == (0, 4)
    # Into the leading rows of a larger buffer (the device plan's): the same values, the rest untouched.
    logits, values, ids = _inputs(5, 300, 7, torch.bfloat16, device, 11)
    buffer = torch.full((9, 14), 7.0, device=device)
    packed = pack_top_k_triton(logits, values, ids, out=buffer[:5])
    assert packed.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:5], pack_top_k_triton(logits, values, ids)) and bool((buffer[5:] == 7.0).all())
    # And into the leading rows of a host buffer beside it (pinned on a GPU: the kernel writes it through its device
    # address), the device buffer unchanged: the same rows in both.
    host = torch.full((9, 14), 3.0, pin_memory=device == "cuda")
    buffer.fill_(7.0)
    packed = pack_top_k_triton(logits, values, ids, out=buffer[:5], host_out=host[:5])
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host[:5], buffer[:5].cpu()) and torch.equal(buffer[:5], pack_top_k_triton(logits, values, ids))
    assert bool((host[5:] == 3.0).all()) and bool((buffer[5:] == 7.0).all())
    # Rows of numbers that ran away (a NaN logit, an infinite one, all -inf) become the filler row in both.
    for k in (4, 1):
        logits, values, ids = _poisoned(device, k)
        got, expected = pack_top_k_triton(logits, values, ids), pack_top_k_reference(logits, values, ids)
        assert torch.equal(got, expected), k
    print("draft top-K checks passed on", device)


def _poisoned(device: str, k: int = 4):
    """Six rows of 50 logits: rows 1, 3 and 4 ran away (NaN, +inf, every logit -inf); the others are fine, row 5
    with only two finite logits (its top-K holds -inf values, which the build takes)."""
    logits, _, _ = _inputs(6, 50, k, torch.float32, device, 21)
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    logits[4] = float("-inf")
    logits[5, 2:] = float("-inf")
    values, ids = logits.topk(k, dim=-1)
    return logits, values, ids


def test_the_kernel_under_the_interpreter_equals_the_reference():
    pytest.importorskip("triton")
    from _triton_interpreter import check_in_interpreter

    check_in_interpreter(TESTS_DIR, "test_draft_top_k", "run_checks", timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_kernel_equals_the_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    run_checks("cuda")


def test_the_reference_is_log_softmax_at_the_top_k():
    logits, values, ids = _inputs(3, 50, 5, torch.float32, "cpu", 1)
    packed = pack_top_k(logits, values, ids)  # CPU tensors: the reference
    expected = torch.log_softmax(logits, dim=-1).gather(1, ids)
    torch.testing.assert_close(packed[:, :5], expected)
    assert torch.equal(packed[:, 5:].view(torch.int32).long(), ids)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4,), (1, 2), (1, 2)), "logits must be \\[rows, vocab\\]"),
        (((2, 10), (3, 2), (3, 2)), "values and ids must both be \\[rows=2, K\\]"),
        (((2, 10), (2, 2), (2, 3)), "values and ids must both be"),
        (((2, 3), (2, 4), (2, 4)), "K = 4 exceeds the vocabulary \\(3\\)"),
    ],
)
def test_bad_shapes_are_refused_with_what_is_wrong(shapes, message):
    logits, values, ids = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        pack_top_k(logits, values, ids.long())


def test_ids_of_a_float_dtype_are_refused():
    with pytest.raises(ValueError, match="ids must be int32 or int64, got torch.float32"):
        pack_top_k(torch.zeros(1, 4), torch.zeros(1, 2), torch.zeros(1, 2))


def test_the_reference_packs_into_the_callers_buffer_and_refuses_a_wrong_one():
    logits, values, ids = _inputs(3, 50, 5, torch.float32, "cpu", 2)
    buffer = torch.zeros(4, 10)
    packed = pack_top_k_reference(logits, values, ids, out=buffer[:3])
    assert packed.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:3], pack_top_k_reference(logits, values, ids)) and bool((buffer[3] == 0).all())
    with pytest.raises(ValueError, match=r"out must be a float32 \[3, 10\] tensor"):
        pack_top_k_reference(logits, values, ids, out=torch.zeros(3, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out must be a float32 \[3, 10\] tensor"):
        pack_top_k_reference(logits, values, ids, out=torch.zeros(4, 10))


def test_the_reference_also_packs_into_a_host_buffer_and_refuses_a_wrong_one():
    logits, values, ids = _inputs(3, 50, 5, torch.float32, "cpu", 3)
    buffer, host = torch.zeros(4, 10), torch.full((4, 10), 2.0)
    pack_top_k_reference(logits, values, ids, out=buffer[:3], host_out=host[:3])
    expected = pack_top_k_reference(logits, values, ids)
    assert torch.equal(host[:3], expected) and torch.equal(buffer[:3], expected) and bool((host[3] == 2.0).all())
    with pytest.raises(ValueError, match=r"host_out must be a float32 \[3, 10\] tensor"):
        pack_top_k_reference(logits, values, ids, host_out=torch.zeros(3, 5))
    meta = torch.zeros(3, 10, device="meta")
    with pytest.raises(ValueError, match="host_out must be a host tensor, got one on meta"):
        pack_top_k_reference(logits, values, ids, host_out=meta)


def test_rows_whose_numbers_ran_away_are_packed_as_the_filler_row_the_tree_build_takes():
    """A NaN or infinite drafter logit gives log-probabilities the tree build refuses (one request would stop every
    request); such a row is the filler row (candidate k at -k - 1, token k), the other rows are untouched, and the
    Rust core builds trees from the result."""
    import numpy as np

    import ddtree

    logits, values, ids = _poisoned("cpu")
    raw = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    assert bool(torch.isnan(raw[[1, 3, 4]]).any(dim=-1).all())  # what the build would have been given
    packed = pack_top_k_reference(logits, values, ids)
    log_probs, tokens = packed[:, :4], packed[:, 4:].view(torch.int32)
    filler = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    for row in (1, 3, 4):
        assert torch.equal(log_probs[row], filler) and tokens[row].tolist() == [0, 1, 2, 3]
    for row in (0, 2, 5):
        assert torch.equal(log_probs[row], raw[row]) and torch.equal(tokens[row], ids[row].int())
    assert torch.isinf(log_probs[5, 2:]).all()  # fewer finite logits than K: kept, the build takes -inf
    lp = np.ascontiguousarray(log_probs.numpy().reshape(2, 3, 4))
    tok = np.ascontiguousarray(tokens.numpy().reshape(2, 3, 4))
    trees = ddtree.build_trees(lp, tok, 6)
    assert trees.token_offsets.tolist() == [0, 6, 12]
