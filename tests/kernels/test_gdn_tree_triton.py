"""The Triton tree WY kernel equals the torch reference.

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess because the flag is read
when kernels are decorated); on a CUDA machine the compiled kernel is checked too.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from _gdn_testing import chain_parents, random_gdn_inputs, random_parents, root_path_outputs_by_state_walk, star_parents  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
PYTHON_DIR = TESTS_DIR.parent.parent / "python"
GDN_ARGS = ("q", "k", "v", "g", "beta")


def compare_triton_with_reference(device: str) -> None:
    from ddtree.kernels.gdn_tree import tree_gated_delta_rule_batched
    from ddtree.kernels.gdn_tree_triton import tree_gated_delta_rule_triton

    gen = torch.Generator().manual_seed(0)
    trees = [random_parents(64, gen), [-1], chain_parents(17), star_parents(9), random_parents(30, gen)]
    # Dv = 24 is not a power of two: exercises the padded head-dim blocks.
    requests = [random_gdn_inputs(len(p), 2, 6, 32, 24, dtype=torch.float64, seed=i) for i, p in enumerate(trees)]
    stacked = {name: torch.cat([r[name] for r in requests]) for name in GDN_ARGS}
    states = torch.stack([r["initial_state"] for r in requests])
    sizes = torch.tensor([len(p) for p in trees])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    parents = sum(trees, [])

    fp32 = {name: value.float().to(device) for name, value in stacked.items()}
    out, deltas, cum_log_decay = tree_gated_delta_rule_triton(
        *(fp32[name] for name in GDN_ARGS), parents, offsets, states.float().to(device)
    )
    reference, cache = tree_gated_delta_rule_batched(
        *(fp32[name] for name in GDN_ARGS), parents, offsets, states.float().to(device), return_cache=True
    )
    assert (out - reference).abs().max() <= 1e-5
    assert (deltas - cache.deltas).abs().max() <= 1e-5
    assert (cum_log_decay - cache.cumulative_log_decay).abs().max() <= 1e-5
    for request, tree in enumerate(trees):  # and against the fp64 sequential oracle
        rows = slice(int(offsets[request]), int(offsets[request + 1]))
        expected = root_path_outputs_by_state_walk(requests[request], tree)
        assert (out[rows].cpu().double() - expected).abs().max() <= 1e-4


def test_triton_kernel_in_interpreter_mode_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), str(TESTS_DIR)]))
    script = "from test_gdn_tree_triton import compare_triton_with_reference as c; c('cpu')"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernel_on_gpu_matches_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    compare_triton_with_reference("cuda")


def test_triton_wrapper_rejects_trees_that_do_not_fit_one_program():
    from ddtree.kernels.gdn_tree_triton import MAX_TREE_NODES, tree_gated_delta_rule_triton

    num_nodes = MAX_TREE_NODES + 1
    inputs = random_gdn_inputs(num_nodes, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"at most {MAX_TREE_NODES} nodes"):
        tree_gated_delta_rule_triton(*(inputs[n] for n in GDN_ARGS), chain_parents(num_nodes), [0, num_nodes],
                                     inputs["initial_state"][None])
