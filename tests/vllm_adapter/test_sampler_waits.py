"""The sampler's work for a sampled (temperature > 0) step is queued without waiting for the GPU: per-row settings,
seeded noise, min_p, top-k / top-p, logit_bias and min_tokens' stop tokens. A wait there would hold the host until
the verification it follows is done, and the walk, the commit and the drafter would be launched only after it.

On a CUDA machine the checks run under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing call raises);
on CPU the same calls are checked for their values only."""

import contextlib
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")


def _bias_processor(biases):
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    processor = object.__new__(LogitBiasLogitsProcessor)
    processor.biases = biases
    return processor


def run_checks(device: str) -> None:
    from ddtree.vllm.node_sampling import sample_rows
    from ddtree.vllm.sampler import DDTreeRejectionSampler, PerRow

    device = torch.device(device)
    counts = np.array([3, 1, 4], dtype=np.int64)  # logits rows per request: two trees and a plain row
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    vocab = 50
    logits = torch.randn((8, vocab), generator=torch.Generator().manual_seed(0)).to(device)
    temperature = torch.tensor([1.0, 0.0, 0.7], device=device)
    top_k = torch.tensor([10, 0, 5], device=device)
    top_p = torch.tensor([0.9, 1.0, 0.8], device=device)
    min_p = torch.tensor([0.05, 0.0, 0.1], device=device)
    positions = torch.tensor([11, 12, 12, 30, 41, 42, 43, 43], device=device)
    sampling = SimpleNamespace(
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        no_penalties=True,
        logitsprocs=SimpleNamespace(non_argmax_invariant=[_bias_processor({2: {7: 5.0, 9: -3.0}})]),
    )
    checking = torch.cuda.set_sync_debug_mode if device.type == "cuda" else None
    with _sync_errors(checking):
        per_row = PerRow(counts, device)
        constrained = DDTreeRejectionSampler._constrained(
            logits, None, sampling, per_row, starts, counts, 3, [(0, 2, [4, 6])]
        )
        tokens = sample_rows(
            constrained,
            per_row(temperature),
            per_row(top_k),
            per_row(top_p),
            generators={2: torch.Generator(device).manual_seed(5)},
            row_ranges=[(int(s), int(c)) for s, c in zip(starts, counts)],
            min_p=per_row(min_p),
            row_positions=positions,
            max_depth=3,
        )
    assert per_row(temperature).tolist() == pytest.approx([1.0] * 3 + [0.0] + [0.7] * 4)
    expected = logits.clone()
    expected[4:8, 7] += 5.0
    expected[4:8, 9] -= 3.0
    expected[0, 4] = expected[0, 6] = float("-inf")  # request 0's plain row (no plan): its stop tokens masked
    assert torch.equal(constrained, expected)
    assert tokens.shape == (8,) and tokens[3].item() == int(logits[3].argmax())  # the greedy request
    assert tokens[0].item() not in (4, 6)
    print("sampler wait checks passed on", device)


@contextlib.contextmanager
def _sync_errors(set_mode):
    if set_mode is None:
        yield
        return
    set_mode("error")
    try:
        yield
    finally:
        set_mode("default")


def test_the_sampling_calls_give_the_expected_rows_on_cpu():
    run_checks("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sampling_calls_never_wait_for_the_gpu():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("a compiled GPU check")
    run_checks("cuda")
