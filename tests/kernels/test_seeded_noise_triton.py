"""Seeded requests' noise in one kernel (``ddtree.kernels.seeded_noise_triton``): equal to the torch definition
(``ddtree.vllm.seeded_noise.position_noise``) under Triton's CPU interpreter (a subprocess: the flag is read when
triton is imported) and, on a CUDA machine, compiled; rows not listed are left alone."""

import os
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent


def run_checks(device: str) -> None:
    from ddtree.kernels.seeded_noise_triton import seeded_noise_rows_
    from ddtree.vllm.seeded_noise import position_noise, seed_key

    # A vocabulary over several blocks and not a multiple of one; positions past 2**32 (their low bits count);
    # a 64-bit seed; rows listed out of order; one row never listed.
    vocab, num_rows = 9000, 7
    positions = torch.tensor([5, 6, 6, 7, 2**32 + 9, 40, 41], dtype=torch.int64, device=device)
    seeds = {0: 3, 1: 3, 2: 3, 3: 3, 4: 2**40 + 17, 6: 123456789}
    noise = torch.full((num_rows, vocab), -1.0, dtype=torch.float32, device=device)
    rows = torch.tensor([6, 0, 1, 2, 3, 4], dtype=torch.int64, device=device)
    keys = torch.tensor([seed_key(seeds[int(r)]) for r in rows.tolist()], dtype=torch.int64, device=device)
    seeded_noise_rows_(noise, rows, keys, positions)
    for row, seed in seeds.items():
        expected = position_noise(seed, positions[row : row + 1].cpu(), vocab)[0]
        torch.testing.assert_close(noise[row].cpu(), expected, rtol=2e-7, atol=0)
    assert torch.equal(noise[5], torch.full((vocab,), -1.0, device=device))  # not listed: untouched
    assert torch.equal(noise[1], noise[2])  # one position, one noise

    # A vocabulary under one block.
    small = torch.zeros((2, 100), dtype=torch.float32, device=device)
    seeded_noise_rows_(small, rows[:1] * 0 + 1, keys[:1], positions[:2])
    expected = position_noise(seeds[6], positions[1:2].cpu(), 100)[0]
    torch.testing.assert_close(small[1].cpu(), expected, rtol=2e-7, atol=0)
    assert not small[0].any()
    empty = rows[:0]
    seeded_noise_rows_(small, empty, empty, positions[:2])
    _check_a_batch_of_trees(device)
    print("seeded noise checks passed on", device)


def _check_a_batch_of_trees(device: str) -> None:
    """The sampler's call with the kernel (rows and keys made on the host, one launch) fills the rows of two
    seeded trees as the torch path does, one vector per depth gathered; an unseeded request's rows keep theirs."""
    from ddtree.vllm.seeded_noise import fill_in_one_launch, fill_seeded_noise

    #   request 0 (seed 8): rows 0-3, a root at 20 and nodes at depths 1, 1, 2; request 1 unseeded: rows 4-5;
    #   request 2 (seed 2**33 + 1): rows 6-8, a chain from 50.
    positions = torch.tensor([21, 22, 22, 23, 31, 32, 51, 52, 53], dtype=torch.int64)
    seeded = [(8, 0, 4), (2**33 + 1, 6, 3)]
    vocab = 700
    expected = fill_seeded_noise(torch.full((9, vocab), -2.0), positions, seeded, max_depth=3)
    got = fill_in_one_launch(torch.full((9, vocab), -2.0, device=device), positions.to(device), seeded)
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-7, atol=0)
    assert (got[4:6] == -2.0).all()


def test_the_kernel_under_the_interpreter_equals_the_torch_noise():
    pytest.importorskip("triton")
    from _triton_interpreter import check_in_interpreter

    check_in_interpreter(TESTS_DIR, "test_seeded_noise_triton", "run_checks", timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_kernel_equals_the_torch_noise():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    run_checks("cuda")


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((3,), (1,), (1,), (3,)), "noise must be"),
        (((3, 4), (2,), (1,), (3,)), "one key per row"),
        (((3, 4), (1,), (1,), (2,)), "positions must be"),
        (((3, 4), (1,), (1,), (3,)), "must be float32"),
    ],
)
def test_bad_shapes_are_refused_with_what_is_wrong(shapes, message):
    pytest.importorskip("triton")
    from ddtree.kernels.seeded_noise_triton import seeded_noise_rows_

    noise, rows, keys, positions = (torch.zeros(s, dtype=torch.int64) for s in shapes)
    with pytest.raises(ValueError, match=message):
        seeded_noise_rows_(noise.double() if "float32" in message else noise.float(), rows, keys, positions)
