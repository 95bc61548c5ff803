"""Tree causal conv: every node equals the ordinary causal conv along history + its root path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _gdn_testing import chain_parents, random_parents, reference_causal_conv, star_parents, tree_parents
from ddtree.kernels.gdn_reference import commit_conv_history, tree_causal_conv1d, tree_causal_conv1d_batched
from ddtree.kernels.topology import root_path

CHANNELS = 7


def conv_inputs(num_nodes, width, seed, dtype=torch.float64, history_rows=None):
    gen = torch.Generator().manual_seed(seed)
    history_rows = width - 1 if history_rows is None else history_rows
    return (
        torch.randn(num_nodes, CHANNELS, generator=gen, dtype=dtype),
        torch.randn(history_rows, CHANNELS, generator=gen, dtype=dtype),
        torch.randn(CHANNELS, width, generator=gen, dtype=dtype),
        torch.randn(CHANNELS, generator=gen, dtype=dtype),
    )


def assert_matches_root_path_conv(x_nodes, history, parents, weight, bias, activation):
    out = tree_causal_conv1d(x_nodes, history, parents, weight, bias, "silu" if activation else None)
    parents_tensor = torch.tensor(parents)
    for node in range(len(parents)):
        path = root_path(parents_tensor, node)
        sequence = torch.cat([history, x_nodes[path]])  # history in front, like a committed prefix
        expected = reference_causal_conv(sequence, weight, bias, activation)[-1]
        torch.testing.assert_close(out[node], expected, rtol=0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    parents=tree_parents(max_nodes=24),
    width=st.sampled_from([2, 3, 4]),
    seed=st.integers(0, 2**16),
    activation=st.booleans(),
    use_bias=st.booleans(),
)
def test_tree_conv_equals_causal_conv_along_each_root_path(parents, width, seed, activation, use_bias):
    x_nodes, history, weight, bias = conv_inputs(len(parents), width, seed)
    assert_matches_root_path_conv(x_nodes, history, parents, weight, bias if use_bias else None, activation)


@pytest.mark.parametrize("parents", [[-1], [-1, 0], [-1, 0, 0], chain_parents(3), star_parents(5)])
def test_shallow_nodes_read_the_committed_history(parents):
    """Depth < W - 1: part of the window comes from the history, newest history row next to the root."""
    x_nodes, history, weight, bias = conv_inputs(len(parents), 4, seed=3)
    assert_matches_root_path_conv(x_nodes, history, parents, weight, bias, activation=True)
    # The root's window is exactly [h0, h1, h2, x0] (oldest first).
    root = tree_causal_conv1d(x_nodes, history, parents, weight, None, None)[0]
    torch.testing.assert_close(root, (torch.cat([history, x_nodes[:1]]).T * weight).sum(1))


def test_history_matters_and_siblings_do_not_leak():
    """Changing a sibling's input must not change a node's output; changing the history must."""
    parents = [-1, 0, 0, 1]
    x_nodes, history, weight, bias = conv_inputs(4, 4, seed=5)
    base = tree_causal_conv1d(x_nodes, history, parents, weight, bias)
    sibling_changed = x_nodes.clone()
    sibling_changed[2] += 10.0
    changed = tree_causal_conv1d(sibling_changed, history, parents, weight, bias)
    torch.testing.assert_close(changed[[0, 1, 3]], base[[0, 1, 3]], rtol=0, atol=0)
    assert (changed[2] - base[2]).abs().max() > 1e-3
    history_changed = tree_causal_conv1d(x_nodes, history + 1.0, parents, weight, bias)
    assert (history_changed[3] - base[3]).abs().max() > 1e-3  # depth 2 still reads history[-1]


def test_batched_conv_equals_per_request_conv():
    gen = torch.Generator().manual_seed(11)
    trees = [random_parents(n, gen) for n in (5, 1, 9)]
    width = 4
    inputs = [conv_inputs(len(p), width, seed=20 + i) for i, p in enumerate(trees)]
    weight, bias = inputs[0][2], inputs[0][3]
    x_all = torch.cat([x for x, _, _, _ in inputs])
    histories = torch.stack([h for _, h, _, _ in inputs])
    offsets = torch.tensor([0, 5, 6, 15])
    out = tree_causal_conv1d_batched(x_all, histories, torch.tensor(sum(trees, [])), offsets, weight, bias)
    for request, parents in enumerate(trees):
        rows = slice(int(offsets[request]), int(offsets[request + 1]))
        expected = tree_causal_conv1d(inputs[request][0], histories[request], parents, weight, bias)
        torch.testing.assert_close(out[rows], expected, rtol=0, atol=0)


def test_tree_conv_matches_transformers_conv_update_step_by_step():
    """transformers' decode kernel (conv state of W inputs) along a root path gives the same outputs."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    causal_conv1d_update = qwen3_next.causal_conv1d_update

    parents = [-1, 0, 1, 1, 3, 4]
    x_nodes, history, weight, bias = conv_inputs(6, 4, seed=8, dtype=torch.float32)
    out = tree_causal_conv1d(x_nodes, history, parents, weight, bias)
    path = root_path(torch.tensor(parents), 5)
    conv_state = torch.cat([torch.zeros(1, CHANNELS), history]).T[None].clone()  # [1, C, W], oldest row unused
    for node in path:
        step = causal_conv1d_update(x_nodes[node][None, :, None], conv_state, weight, bias, "silu")
        torch.testing.assert_close(out[node], step[0, :, 0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4, 5]])
def test_committed_conv_history_continues_the_sequential_conv(path):
    """After committing a path, the next token's conv equals the ordinary conv over history + path + token."""
    parents = [-1, 0, 0, 1, 3, 4]
    x_nodes, history, weight, bias = conv_inputs(len(parents) + 1, 4, seed=2)
    x_nodes, next_token = x_nodes[:-1], x_nodes[-1:]
    assert path == root_path(torch.tensor(parents), path[-1])
    new_history = commit_conv_history(history, x_nodes, path)
    next_out = tree_causal_conv1d(next_token, new_history, [-1], weight, bias)
    expected = reference_causal_conv(torch.cat([history, x_nodes[path], next_token]), weight, bias, True)[-1]
    torch.testing.assert_close(next_out[0], expected, rtol=0, atol=1e-12)
    # Shorter-than-window paths keep the newest old rows in front.
    if len(path) < 3:
        assert torch.equal(new_history[: 3 - len(path)], history[len(path) :])


def test_conv_bad_shapes_raise_value_error():
    x_nodes, history, weight, bias = conv_inputs(3, 4, seed=0)
    with pytest.raises(ValueError, match=r"conv_history must have shape \[R, W - 1, C\] = \[1, 3, 7\]"):
        tree_causal_conv1d(x_nodes, history[:2], [-1, 0, 1], weight, bias)
    with pytest.raises(ValueError, match=r"weight must have shape \[C, W\]"):
        tree_causal_conv1d(x_nodes, history, [-1, 0, 1], weight[:5], bias)
    with pytest.raises(ValueError, match=r"parents must have shape \[N\] = \[3\]"):
        tree_causal_conv1d(x_nodes, history, [-1, 0], weight, bias)
    with pytest.raises(ValueError, match=r"parents\[i\] must satisfy"):
        tree_causal_conv1d(x_nodes, history, [-1, 2, 0], weight, bias)
    with pytest.raises(ValueError, match=r"bias must have shape \[C\]"):
        tree_causal_conv1d(x_nodes, history, [-1, 0, 1], weight, bias[:3])
