"""The one-kernel tree build (``ddtree.kernels.tree_build_triton``) against the Rust core's ``build_trees``: the same
nodes in the same order (parents, depths, tokens), with bf16 ties and with the slightly positive log-probabilities
the core's tolerance lets through; and against the torch build's scores and ranks. Under Triton's CPU interpreter
(a subprocess: the flag is read when triton is imported) and, on a CUDA machine, compiled."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent


def top_k(num_reqs: int, depth: int, k: int, vocab: int, seed: int, bf16: bool, sharp: float):
    """A drafter's top-K as ``torch.topk`` of log-softmaxed logits gives it (rows sorted descending)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * sharp
    if bf16:  # few distinct values: many exactly equal log-probabilities
        logits = logits.to(torch.bfloat16).float()
    values, ids = torch.log_softmax(logits, dim=-1).clamp(max=0.0).topk(k, dim=-1)
    return values, ids.to(torch.int32)


def core_trees(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int):
    import ddtree

    batch = ddtree.build_trees(log_probs.numpy(), token_ids.numpy(), budget)
    size = budget + 1
    tokens = np.full((len(batch), size), -1, dtype=np.int64)
    tokens[:, 1:] = batch.tokens.reshape(-1, budget)
    return (
        batch.parents.astype(np.int64).reshape(-1, size),
        batch.depths.astype(np.int64).reshape(-1, size),
        tokens,
    )


def _cases():
    """(R, L, K, budget, seed, bf16, sharp): small random shapes, then the serving shapes (the interpreter's time
    goes by pops: ~0.5 ms each)."""
    rng = np.random.default_rng(0)
    for seed in range(12):
        depth, k = int(rng.integers(1, 7)), int(rng.integers(2, 13))
        budget = int(min(rng.integers(1, 41), sum(k**d for d in range(1, depth + 1))))
        yield 4, depth, k, budget, seed, bool(seed % 2), [0.5, 2.0, 6.0][seed % 3]
    yield 3, 15, 64, 63, 7, True, 3.0  # the pair's drafter depth and the README's budget, bf16 ties in the tails
    yield 1, 15, 255, 255, 8, True, 3.0  # auto's largest candidate, K = 255 (8-bit keys)
    yield 1, 16, 128, 127, 9, False, 1.0


def check_against_core(device: str) -> None:
    from ddtree.kernels.device_tree import build_trees
    from ddtree.kernels.tree_build_triton import build_trees_triton

    for num_reqs, depth, k, budget, seed, bf16, sharp in _cases():
        log_probs, token_ids = top_k(num_reqs, depth, k, vocab=max(64, 2 * k), seed=seed, bf16=bf16, sharp=sharp)
        trees = build_trees_triton(log_probs.to(device), token_ids.to(device), budget)
        parents, depths, tokens = core_trees(log_probs, token_ids, budget)
        where = f"R={num_reqs} L={depth} K={k} budget={budget} seed={seed}"
        np.testing.assert_array_equal(trees.parents.cpu().numpy(), parents, err_msg=where)
        np.testing.assert_array_equal(trees.depths.cpu().numpy(), depths, err_msg=where)
        np.testing.assert_array_equal(trees.tokens.cpu().numpy(), tokens, err_msg=where)
        reference = build_trees(log_probs, token_ids, budget)  # log-probs <= 0 here: the torch build is exact too
        assert torch.equal(trees.scores.cpu(), reference.scores), where
        assert torch.equal(trees.ranks.cpu(), reference.ranks), where
    # Log-probabilities a hair above 0 (a log-softmax's rounding; the core accepts up to 1e-3): a child may outscore
    # its parent, and the pop order is still the core's heap's. The torch build clamps them; this one does not.
    log_probs, token_ids = top_k(2, 5, 6, vocab=64, seed=11, bf16=True, sharp=0.3)
    log_probs[:, :, 0] = 5e-4
    trees = build_trees_triton(log_probs.to(device), token_ids.to(device), 30)
    parents, depths, tokens = core_trees(log_probs, token_ids, 30)
    np.testing.assert_array_equal(trees.parents.cpu().numpy(), parents)
    np.testing.assert_array_equal(trees.tokens.cpu().numpy(), tokens)
    # Straight from the drafter's packed top-K ([R * L, 2K]: log-probs, then the ids' int32 bits), read through
    # strided views as the runner would hold them, without a copy.
    from ddtree.kernels.draft_top_k import pack_top_k_reference

    num_reqs, depth, k = 2, 6, 8
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn(num_reqs * depth, 300, generator=gen) * 2).to(torch.bfloat16)
    values, ids = logits.topk(k, dim=-1)
    packed = pack_top_k_reference(logits, values, ids).to(device).view(num_reqs, depth, 2 * k)
    log_probs, token_ids = packed[..., :k], packed.view(torch.int32)[..., k:]
    assert log_probs.stride(-1) == 1 and not log_probs.is_contiguous()
    trees = build_trees_triton(log_probs, token_ids, 20)
    parents, depths, tokens = core_trees(log_probs.cpu().contiguous(), token_ids.cpu().contiguous(), 20)
    np.testing.assert_array_equal(trees.parents.cpu().numpy(), parents)
    np.testing.assert_array_equal(trees.tokens.cpu().numpy(), tokens)
    empty = build_trees_triton(*(t.to(device) for t in top_k(1, 2, 3, 8, 0, False, 1.0)), 2)
    assert empty.parents.shape == (1, 3)
    print("tree build checks passed on", device)


def test_the_kernel_under_the_interpreter_is_the_cores_tree():
    pytest.importorskip("triton")
    from _triton_interpreter import check_in_interpreter

    check_in_interpreter(TESTS_DIR, "test_tree_build_triton", "check_against_core", timeout=900)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_kernel_is_the_cores_tree():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    check_against_core("cuda")


def test_keys_hold_a_rank_tuple_in_whole_words():
    from ddtree.kernels.tree_build_triton import key_layout

    assert key_layout(15, 64) == (7, 9, 2)  # ranks 1..64 in 7 bits, 9 a word
    assert key_layout(15, 255) == (8, 7, 3)
    assert key_layout(16, 256) == (9, 7, 3)  # rank + 1 = 256 needs the ninth bit
    assert key_layout(1, 2) == (2, 31, 1)


def test_bad_input_is_refused_as_the_torch_build_refuses_it():
    pytest.importorskip("triton")
    from ddtree.kernels.tree_build_triton import build_trees_triton

    with pytest.raises(ValueError, match=r"budget must be in \[1, 12\]"):
        build_trees_triton(-torch.rand(1, 2, 3), torch.zeros((1, 2, 3), dtype=torch.int32), 13)
    with pytest.raises(ValueError, match=r"must both be \[R, L, K\]"):
        build_trees_triton(-torch.rand(2, 3), torch.zeros((2, 3), dtype=torch.int32), 2)


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("parents", torch.empty(2, 6, dtype=torch.int64), r"out.parents must be a contiguous \[2, 5\]"),
        ("scores", torch.empty(2, 5, dtype=torch.float32), r"out.scores must be a contiguous \[2, 5\] torch.float64"),
        ("ranks", torch.empty(5, 2, dtype=torch.int64).t(), r"out.ranks must be a contiguous"),
    ],
)
def test_an_out_of_the_wrong_shape_or_dtype_is_refused(name, bad, message):
    pytest.importorskip("triton")
    from ddtree.kernels.device_tree import DeviceTrees
    from ddtree.kernels.tree_build_triton import build_trees_triton

    out = DeviceTrees(*(torch.empty(2, 5, dtype=torch.int64) for _ in range(3)), torch.empty(2, 5, dtype=torch.float64),
                      torch.empty(2, 5, dtype=torch.int64))  # fmt: skip
    setattr(out, name, bad)
    log_probs = torch.full((2, 3, 4), -1.0)
    with pytest.raises(ValueError, match=message):
        build_trees_triton(log_probs, torch.zeros(2, 3, 4, dtype=torch.int32), 4, out=out)


@pytest.mark.parametrize("block_n, key_words", [(64, 2), (128, 2), (256, 2), (256, 4)])
def test_the_kernel_keeps_its_state_in_registers(block_n, key_words):
    """The build kernel compiled for an H200 (sm_90a) without a GPU (``benches/ptxas_report.py``): ptxas spills
    nothing at any block size the budgets use. Budget 255 once took 14 ms (``gpu-h200-device-tree-e9e09b0``): with
    node-major keys ``[BLOCK_N, KEY_WORDS]`` Triton laid a 256-row block out with every row in every thread, and
    ptxas spilled ~6.5 KB a thread; the keys are word-major now."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's ptxas is not installed")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
    try:
        import ptxas_report
    except ImportError as exc:  # pragma: no cover - a triton that cannot name a compile target
        pytest.skip(f"cannot compile for sm_90a here: {exc}")
    from ddtree.kernels import tree_build_triton

    constants = {"BLOCK_N": block_n, "KEY_WORDS": key_words, "KEY_BITS": 7, "RANKS_PER_WORD": 9}
    report = ptxas_report.ptxas_report(tree_build_triton._best_first_kernel, ptxas_report.BUILD, constants, {})
    assert report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0, report


def check_the_benchs_plan_work(device: str) -> None:
    """``bench_device_tree.plan_work`` (the device plan's launches the bench graphs) with one and four warps a
    build program: the core's trees."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
    import bench_device_tree

    log_probs, token_ids = bench_device_tree.drafter_top_k(3, 4, 8, torch.device(device))
    for warps in (1, 4):
        work, scratch = bench_device_tree.plan_work(log_probs, token_ids, 20, warps)
        work()
        bench_device_tree.check(scratch, log_probs, token_ids, 20)
    print("plan work checks passed on", device)


def test_the_benchs_plan_work_under_the_interpreter():
    pytest.importorskip("triton")
    from _triton_interpreter import check_in_interpreter

    check_in_interpreter(TESTS_DIR, "test_tree_build_triton", "check_the_benchs_plan_work", timeout=600)


def test_a_build_of_an_unsupported_warp_count_is_refused():
    pytest.importorskip("triton")
    from ddtree.kernels.tree_build_triton import build_trees_triton

    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4 or 8, got 3"):
        build_trees_triton(torch.full((1, 2, 2), -1.0), torch.zeros(1, 2, 2, dtype=torch.int32), 2, num_warps=3)
