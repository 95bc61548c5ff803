"""Tree gated delta rule: every node's output equals the sequential rule along its root path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from _gdn_testing import (
    chain_parents,
    leaves,
    random_gdn_inputs,
    random_parents,
    root_path_outputs_by_chain,
    root_path_outputs_by_state_walk,
    skip_below_reference_transformers,
    star_parents,
    tree_parents,
)
from ddtree.kernels import gdn_reference as gdn_tree
from ddtree.kernels.gdn_reference import chain_gated_delta_rule, tree_gated_delta_rule, tree_gated_delta_rule_batched
from ddtree.kernels.topology import root_path

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
skip_below_reference_transformers()


def run_tree(inputs, parents, **kwargs):
    return tree_gated_delta_rule(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], parents, inputs["initial_state"], **kwargs
    )


@settings(max_examples=60, deadline=None)
@given(parents=tree_parents(max_nodes=64), seed=st.integers(0, 2**16))
def test_tree_equals_root_path_recurrence_fp64(parents, seed):
    inputs = random_gdn_inputs(len(parents), seed=seed, dtype=torch.float64)
    out = run_tree(inputs, parents)
    expected = root_path_outputs_by_chain(inputs, parents)
    assert (out - expected).abs().max() <= 1e-10


@pytest.mark.parametrize(
    "parents",
    [chain_parents(64), star_parents(64), random_parents(64, torch.Generator().manual_seed(1)), [-1]],
    ids=["chain64", "star64", "random64", "root-only"],
)
def test_tree_equals_transformers_recurrent_rule_fp32(parents):
    """fp32, realistic head dims, GQA ratio 3; the oracle is transformers' own recurrent rule per root-to-leaf path."""
    inputs = random_gdn_inputs(
        len(parents), num_k_heads=2, num_v_heads=6, head_k_dim=32, head_v_dim=32, dtype=torch.float32, seed=7
    )
    out = run_tree(inputs, parents)
    parents_tensor = torch.tensor(parents)
    checked = torch.zeros(len(parents), dtype=torch.bool)
    for leaf in leaves(parents):
        path = root_path(parents_tensor, leaf)
        expected, _ = qwen3_next.torch_recurrent_gated_delta_rule(
            *(inputs[name][path][None] for name in ("q", "k", "v", "g", "beta")),
            initial_state=inputs["initial_state"][None],
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        assert (out[path] - expected[0]).abs().max() <= 1e-4
        checked[path] = True
    assert bool(checked.all())


def test_tree_on_a_chain_equals_transformers_chunked_rule():
    """On a chain the ancestor mask is the causal mask: the tree form is one chunk of the chunked rule."""
    inputs = random_gdn_inputs(40, dtype=torch.float32, seed=3)
    out = run_tree(inputs, chain_parents(40))
    expected, _ = qwen3_next.torch_chunk_gated_delta_rule(
        *(inputs[name][None] for name in ("q", "k", "v", "g", "beta")),
        initial_state=inputs["initial_state"][None],
        use_qk_l2norm_in_kernel=True,
    )
    assert (out - expected[0]).abs().max() <= 1e-5


def test_chain_oracle_equals_transformers_recurrent_rule():
    """Our fp64-capable oracle implements exactly transformers' per-token rule (checked in fp32)."""
    inputs = random_gdn_inputs(20, dtype=torch.float32, seed=5)
    out, state = chain_gated_delta_rule(*(inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")))
    expected, expected_state = qwen3_next.torch_recurrent_gated_delta_rule(
        *(inputs[name][None] for name in ("q", "k", "v", "g", "beta")),
        initial_state=inputs["initial_state"][None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert (out - expected[0]).abs().max() <= 1e-6
    assert (state - expected_state[0]).abs().max() <= 1e-6


def test_causal_mask_instead_of_ancestor_mask_is_detected():
    """Negative control: the plain chunked rule (index-order causal mask) is wrong on a branching tree,
    and the root-path oracle notices. This guards against a test that cannot fail."""
    parents = [-1, 0, 0, 1, 2, 2, 4]
    inputs = random_gdn_inputs(len(parents), seed=9)
    expected = root_path_outputs_by_chain(inputs, parents)
    q, k = gdn_tree._prepare_qk(inputs["q"], inputs["k"], True, torch.float64)
    causal = torch.ones(len(parents), len(parents), dtype=torch.bool).tril()
    wrong, _, _ = gdn_tree._tree_delta_rule_core(
        q, k, inputs["v"], inputs["g"], inputs["beta"], causal, inputs["initial_state"]
    )
    assert (wrong - expected).abs().max() > 1e-2
    assert (run_tree(inputs, parents) - expected).abs().max() <= 1e-10


def test_the_two_oracles_agree():
    parents = random_parents(30, torch.Generator().manual_seed(8))
    inputs = random_gdn_inputs(30, seed=8)
    assert (
        root_path_outputs_by_chain(inputs, parents) - root_path_outputs_by_state_walk(inputs, parents)
    ).abs().max() <= 1e-12


def test_sibling_inputs_do_not_leak():
    parents = [-1, 0, 0, 1, 2]
    inputs = random_gdn_inputs(5, seed=4)
    base = run_tree(inputs, parents)
    perturbed = {name: value.clone() for name, value in inputs.items()}
    for name in ("k", "v"):
        perturbed[name][2] += 3.0  # node 2 and its child 4 are not on node 3's root path
    out = run_tree(perturbed, parents)
    assert (out[[0, 1, 3]] - base[[0, 1, 3]]).abs().max() == 0
    assert (out[[2, 4]] - base[[2, 4]]).abs().max() > 1e-3


@pytest.mark.parametrize("num_k_heads, num_v_heads", [(1, 1), (2, 2), (2, 6), (1, 4)])
def test_head_grouping(num_k_heads, num_v_heads):
    parents = random_parents(17, torch.Generator().manual_seed(num_v_heads))
    inputs = random_gdn_inputs(17, num_k_heads=num_k_heads, num_v_heads=num_v_heads, seed=num_k_heads)
    assert (run_tree(inputs, parents) - root_path_outputs_by_chain(inputs, parents)).abs().max() <= 1e-10


def test_bf16_inputs_are_computed_in_fp32_and_returned_in_bf16():
    parents = random_parents(12, torch.Generator().manual_seed(2))
    inputs = random_gdn_inputs(12, dtype=torch.bfloat16, seed=2)
    inputs["initial_state"] = inputs["initial_state"].float()
    out = run_tree(inputs, parents)
    assert out.dtype == torch.bfloat16
    expected = root_path_outputs_by_chain({n: t.double() for n, t in inputs.items()}, parents)
    assert (out.double() - expected).abs().max() <= 5e-2  # bf16 output rounding only


def test_batched_trees_equal_individual_trees():
    gen = torch.Generator().manual_seed(0)
    trees = [random_parents(n, gen) for n in (9, 1, 30, 4)]
    per_request = [random_gdn_inputs(len(p), seed=100 + i) for i, p in enumerate(trees)]
    stacked = {name: torch.cat([inp[name] for inp in per_request]) for name in ("q", "k", "v", "g", "beta")}
    states = torch.stack([inp["initial_state"] for inp in per_request])
    offsets = torch.tensor([0, 9, 10, 40, 44])
    out = tree_gated_delta_rule_batched(
        stacked["q"], stacked["k"], stacked["v"], stacked["g"], stacked["beta"], sum(trees, []), offsets, states
    )
    for request, parents in enumerate(trees):
        rows = slice(int(offsets[request]), int(offsets[request + 1]))
        expected = root_path_outputs_by_chain(per_request[request], parents)
        assert (out[rows] - expected).abs().max() <= 1e-10


class LargestTensorTracker(TorchDispatchMode):
    """Records the largest tensor any torch op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return result


def test_memory_is_bounded_by_n_squared_plus_n_d_per_head():
    """No intermediate reaches the size of per-node states (N * Hv * Dk * Dv elements)."""
    num_nodes, num_k_heads, num_v_heads, head_dim = 64, 1, 3, 32
    inputs = random_gdn_inputs(num_nodes, num_k_heads, num_v_heads, head_dim, head_dim, torch.float32, seed=1)
    parents = random_parents(num_nodes, torch.Generator().manual_seed(1))
    tracker = LargestTensorTracker()
    with tracker:
        run_tree(inputs, parents, return_cache=True)
    bound = num_v_heads * max(num_nodes * num_nodes, num_nodes * head_dim, head_dim * head_dim)
    per_node_states = num_nodes * num_v_heads * head_dim * head_dim
    assert tracker.largest <= bound
    assert bound * 8 <= per_node_states  # the bound is meaningfully below per-node snapshots


def test_bad_gdn_inputs_raise_value_error():
    inputs = random_gdn_inputs(5, seed=0)
    parents = [-1, 0, 0, 1, 1]

    def call(**overrides):
        args = dict(inputs, parents=parents)
        args.update(overrides)
        return tree_gated_delta_rule(
            args["q"], args["k"], args["v"], args["g"], args["beta"], args["parents"], args["initial_state"]
        )

    with pytest.raises(ValueError, match=r"k must have shape \[N, Hk, Dk\]"):
        call(k=inputs["k"][:, :1])
    with pytest.raises(ValueError, match=r"Hv a multiple of the key heads Hk = 2"):
        call(v=inputs["v"][:, :5], g=inputs["g"][:, :5], beta=inputs["beta"][:, :5])
    with pytest.raises(ValueError, match=r"g must have shape \[N, Hv\] = \[5, 6\]"):
        call(g=inputs["g"][:4])
    with pytest.raises(ValueError, match=r"beta must have shape \[N, Hv\]"):
        call(beta=inputs["beta"][:, :3])
    with pytest.raises(ValueError, match=r"initial_states must have shape \[R, Hv, Dk, Dv\] = \[1, 6, 16, 8\]"):
        call(initial_state=inputs["initial_state"][:, :8])
    with pytest.raises(ValueError, match=r"parents\[i\] must satisfy 0 <= parents\[i\] < i"):
        call(parents=[-1, 0, 3, 1, 1])
    with pytest.raises(ValueError, match=r"parents must have shape \[N\] = \[5\]"):
        call(parents=[-1, 0, 0])
    with pytest.raises(ValueError, match=r"v must have shape \[N, Hv, Dv\] with N = 5"):
        call(v=inputs["v"][:3])


def test_fp32_stays_accurate_on_a_256_node_tree_with_long_memory_and_correlated_keys():
    """Hard case for the triangular solve: beta ~ 1, almost no decay, nearly parallel keys, deep branches."""
    gen = torch.Generator().manual_seed(6)
    parents = [-1] + [max(0, node - 1 - int(torch.randint(0, 3, (1,), generator=gen))) for node in range(1, 256)]
    inputs = random_gdn_inputs(256, head_k_dim=64, head_v_dim=32, seed=6)
    inputs["beta"] = torch.full_like(inputs["beta"], 0.999)
    inputs["g"] = torch.full_like(inputs["g"], -1e-4)
    inputs["k"] = 0.3 * inputs["k"] + torch.randn(1, 2, 64, generator=gen, dtype=torch.float64)
    expected = root_path_outputs_by_state_walk(inputs, parents)
    out32 = run_tree({name: value.float() for name, value in inputs.items()}, parents)
    assert (out32.double() - expected).abs().max() <= 1e-4
