"""The device layout of whole-tree steps (``ddtree.kernels.tree_layout_triton``) against the Rust core's
``verify_layout_into`` on the same trees and placement: every array equal. Under Triton's CPU interpreter (a
subprocess: the flag is read when triton is imported) and, on a CUDA machine, compiled."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent


def core_layout(batch, rows, starts, query_starts, logit_starts, num_rows: int, words: int, window: int) -> dict:
    import ddtree

    total, num_trees = int(batch.node_offsets[-1]), len(batch)
    out = {
        "token_index": np.empty(total, np.int64),
        "logit_rows": np.empty(total, np.int64),
        "positions": np.empty(total, np.int64),
        "ancestor_bits": np.empty((total, words), np.int32),
        "row_start": np.empty(num_rows, np.int32),
        "node_offsets": np.empty(num_trees + 1, np.int32),
        "depths": np.empty(total, np.int64),
        "root_index": np.empty(total, np.int64),
        "node_parents": np.empty(total, np.int64),
        "node_tree": np.empty(total, np.int64),
        "node_local": np.empty(total, np.int64),
        "node_tokens": np.empty(total, np.int64),
        "draft_step_index": np.empty(total - num_trees, np.int64),
        "draft_tokens": np.empty(total - num_trees, np.int32),
    }
    if window:
        out["conv_index"] = np.empty((total, window + 1), np.int64)
    ddtree.verify_layout_into(batch, rows, starts, query_starts, logit_starts, **out)
    return out


def _case(num_trees: int, depth: int, k: int, budget: int, window: int, seed: int, device: str):
    import ddtree

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_trees, depth, 512, generator=gen) * 2).to(torch.bfloat16).float()
    log_probs, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    batch = ddtree.build_trees(log_probs.numpy(), ids.to(torch.int32).numpy(), budget)
    size = budget + 1
    rng = np.random.default_rng(seed)
    num_rows = num_trees + 3
    rows = rng.permutation(num_rows)[:num_trees].astype(np.int64)
    starts = rng.integers(0, 5000, num_trees).astype(np.int64)
    query_starts = np.arange(num_trees, dtype=np.int64) * size + int(rng.integers(0, 3))
    logit_starts = np.arange(num_trees, dtype=np.int64) * size
    words = -(-size // 32) + int(seed % 2)  # sometimes a spare word, which must come out zero
    expected = core_layout(batch, rows, starts, query_starts, logit_starts, num_rows, words, window)
    parents = torch.from_numpy(batch.parents.astype(np.int64).reshape(num_trees, size))
    depths = torch.from_numpy(batch.depths.astype(np.int64).reshape(num_trees, size))
    tokens = torch.full((num_trees, size), -1, dtype=torch.int64)
    tokens[:, 1:] = torch.from_numpy(batch.tokens.astype(np.int64).reshape(num_trees, budget))
    placement = [torch.from_numpy(a).to(device) for a in (rows, starts, query_starts, logit_starts)]
    trees = [t.to(device) for t in (parents, depths, tokens)]
    return expected, trees, placement, num_rows, words


def check_against_core(device: str) -> None:
    from ddtree.kernels.tree_layout_triton import whole_tree_layout

    cases = [(1, 4, 3, 5, 0), (3, 6, 4, 40, 3), (2, 15, 64, 63, 3), (4, 15, 64, 127, 0), (2, 16, 255, 255, 4)]
    for seed, (num_trees, depth, k, budget, window) in enumerate(cases):
        expected, trees, placement, num_rows, words = _case(num_trees, depth, k, budget, window, seed, device)
        layout = whole_tree_layout(*trees, *placement, num_rows=num_rows, words=words, window=window, max_depth=depth)
        for name, want in expected.items():
            got = getattr(layout, name).cpu().numpy()
            np.testing.assert_array_equal(got, want, err_msg=f"{name}: trees={num_trees} budget={budget} w={window}")
        assert (layout.conv_index is None) == (window == 0)
    print("tree layout checks passed on", device)


def test_the_kernel_under_the_interpreter_is_the_cores_layout():
    pytest.importorskip("triton")
    from _triton_interpreter import check_in_interpreter

    check_in_interpreter(TESTS_DIR, "test_tree_layout_triton", "check_against_core", timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_kernel_is_the_cores_layout():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    check_against_core("cuda")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(depths=torch.zeros(2, 4, dtype=torch.int64)), r"must all be \[R, N\]"),
        (dict(rows=torch.zeros(3, dtype=torch.int64)), r"rows must be \[R\] = \[2\]"),
        (dict(logit_starts=torch.zeros(1, dtype=torch.int64)), r"logit_starts must be \[R\] = \[2\]"),
        (dict(words=0), r"rows of 0 words cannot hold a tree of 5 nodes \(needs 1\)"),
        (dict(window=-1), "window and max_depth must be >= 0"),
    ],
)
def test_bad_input_names_the_problem(change, message):
    pytest.importorskip("triton")
    from ddtree.kernels.tree_layout_triton import whole_tree_layout

    tree = torch.zeros(2, 5, dtype=torch.int64)
    args = dict(
        parents=tree,
        depths=tree,
        tokens=tree,
        rows=torch.arange(2),
        starts=torch.zeros(2, dtype=torch.int64),
        query_starts=torch.zeros(2, dtype=torch.int64),
        logit_starts=torch.zeros(2, dtype=torch.int64),
        num_rows=2,
        words=1,
        window=0,
        max_depth=4,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        whole_tree_layout(**args)


def test_the_in_place_layout_names_missing_outputs():
    pytest.importorskip("triton")
    from ddtree.kernels.tree_layout_triton import whole_tree_layout_into

    tree = torch.zeros(2, 5, dtype=torch.int64)
    placement = torch.zeros(2, dtype=torch.int64)
    out = {"token_index": torch.empty(10, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"out lacks \['logit_rows', 'positions', 'ancestor_bits', 'conv_index'"):
        whole_tree_layout_into(tree, tree, tree, placement, placement, placement, 1, 3, 4, out=out)
