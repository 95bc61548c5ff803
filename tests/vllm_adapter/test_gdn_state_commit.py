"""DDTree's GDN verification and commit in vLLM's cache layout equal the token-by-token rule.

``ddtree.vllm.gdn`` is what the patched ``QwenGatedDeltaNetAttention._forward_core`` runs for tree tokens:
conv windows gathered along root paths from the committed history, the Triton tree kernel reading the
request's one state slot, then (after acceptance) the accepted path written back into that slot. The
oracle runs each node's root path through the plain causal conv and the sequential delta rule. Prefix caching's
boundary commits (a path's prefix into another slot, before the main commit) are checked against it too.

Layouts are vLLM's: conv state ``[S, C, W - 1]`` (checked both stored that way and as a transposed
``[S, W - 1, C]`` view, vLLM's "SD" layout), recurrent state ``[S, Hv, Dv, Dk]``. On CPU the kernels run
under Triton's interpreter in a subprocess (the flag is read when triton is imported).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

TESTS_DIR = Path(__file__).resolve().parent
KERNEL_TESTS_DIR = TESTS_DIR.parent / "kernels"
if str(KERNEL_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(KERNEL_TESTS_DIR))
from _triton_interpreter import child_env  # noqa: E402

NUM_K_HEADS, NUM_V_HEADS, HEAD_K, HEAD_V, WIDTH = 2, 4, 16, 16, 4
CHANNELS = 2 * NUM_K_HEADS * HEAD_K + NUM_V_HEADS * HEAD_V


def _trees(budgets, seed):
    import ddtree

    rng = np.random.default_rng(seed)
    depth, width = 4, 3
    logits = rng.normal(size=(len(budgets), depth, width)).astype(np.float32)
    log_probs = np.sort(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), axis=-1)[..., ::-1].copy()
    ids = np.tile(np.arange(width, dtype=np.int64), (len(budgets), depth, 1))
    return ddtree.build_trees(log_probs, ids, np.asarray(budgets, dtype=np.int64))


def _root_path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def _oracle(history, x_path, weight, bias, a_path, b_path, a_log, dt_bias, state):
    """Outputs along one root path and the final state (fp64, token by token)."""
    from ddtree.kernels.gdn_reference import chain_gated_delta_rule

    seq = torch.cat([history.T, x_path]).double()  # [W - 1 + P, C], oldest first
    conv = torch.stack([(seq[i : i + WIDTH].T * weight.double()).sum(-1) for i in range(x_path.shape[0])])
    conv = F.silu(conv + bias.double())
    key = NUM_K_HEADS * HEAD_K
    q, k, v = conv.split([key, key, NUM_V_HEADS * HEAD_V], dim=-1)
    g = -a_log.double().exp() * F.softplus(a_path.double() + dt_bias.double())
    beta = torch.sigmoid(b_path.double())
    out, final = chain_gated_delta_rule(
        q.reshape(-1, NUM_K_HEADS, HEAD_K),
        k.reshape(-1, NUM_K_HEADS, HEAD_K),
        v.reshape(-1, NUM_V_HEADS, HEAD_V),
        g,
        beta,
        state.transpose(-1, -2).double(),
    )
    return out, final.transpose(-1, -2)


def _check(device: str, sd_layout: bool, seed: int) -> None:
    from ddtree.vllm.gdn import (
        GdnCommitPlan,
        GdnTreeStep,
        boundary_commit_plan,
        commit_layer,
        commit_pending,
        verify_tree_tokens,
    )
    from layout_oracle import commit_paths, conv_commit_index, conv_gather_index
    import ddtree

    gen = torch.Generator().manual_seed(seed)
    budgets = [6, 0, 11]  # a root-only tree too
    trees = _trees(budgets, seed)
    offsets = trees.node_offsets
    parents = trees.parents
    num_nodes, num_requests, slots_count = int(offsets[-1]), len(budgets), 6
    compiled = ddtree.compile_trees(trees, np.zeros(num_requests, dtype=np.int64), window=WIDTH - 1)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    if sd_layout:
        conv_storage = rand(slots_count, WIDTH - 1, CHANNELS)
        conv_state = conv_storage.transpose(-1, -2)
    else:
        conv_storage = rand(slots_count, CHANNELS, WIDTH - 1)
        conv_state = conv_storage
    ssm_state = rand(slots_count, NUM_V_HEADS, HEAD_V, HEAD_K, scale=0.3)
    conv_before, ssm_before = conv_state.clone(), ssm_state.clone()
    slots = torch.tensor([4, 1, 2], device=device)
    # The tree rows are a view of the layer's input, as in vLLM.
    layer_input, a, b = rand(num_nodes + 2, CHANNELS), rand(num_nodes, NUM_V_HEADS), rand(num_nodes, NUM_V_HEADS)
    x = layer_input[:num_nodes]
    weight, bias = rand(CHANNELS, WIDTH, scale=0.5), rand(CHANNELS, scale=0.1)
    a_log, dt_bias = rand(NUM_V_HEADS, scale=0.5), rand(NUM_V_HEADS, scale=0.5)

    bits = torch.from_numpy(np.ascontiguousarray(compiled.ancestor_bits).view(np.int32)).to(device)
    step = GdnTreeStep(
        token_index=torch.arange(num_nodes, device=device),
        other_index=None,
        node_offsets=torch.from_numpy(offsets.astype(np.int32)).to(device),
        ancestor_bits=bits,
        conv_index=torch.from_numpy(conv_gather_index(compiled.windows, offsets)).to(device),
        num_requests=num_requests,
        num_tree_tokens=num_nodes,
    )
    out = verify_tree_tokens(
        step,
        "layer.0",
        x,
        a,
        b,
        conv_state,
        ssm_state,
        slots,
        weight,
        bias,
        "silu",
        a_log,
        dt_bias,
        HEAD_K,
        HEAD_V,
        torch.float32,
    )
    assert torch.equal(conv_state, conv_before) and torch.equal(ssm_state, ssm_before), "verify wrote the caches"
    # Under CUDA graphs later pieces reuse the layer input's memory before the commit runs.
    x = x.clone()
    layer_input.fill_(1e4)

    paths = np.full((num_requests, 5), -1, dtype=np.int64)
    for r in range(num_requests):
        first, last = int(offsets[r]), int(offsets[r + 1])
        local = parents[first:last]
        for node in range(last - first):
            path = _root_path(local, node)
            rows = [first + p for p in path]
            slot = int(slots[r])
            expected, _ = _oracle(
                conv_before[slot].cpu(),
                x[rows].cpu(),
                weight.cpu(),
                bias.cpu(),
                a[rows].cpu(),
                b[rows].cpu(),
                a_log.cpu(),
                dt_bias.cpu(),
                ssm_before[slot].cpu(),
            )
            got = out[first + node].double().cpu()
            err = float((got - expected[-1]).abs().max() / expected[-1].abs().max())
            assert err < 1e-4, f"request {r} node {node}: relative error {err}"
        deepest = int(np.argmax(trees.depths[first:last]))
        accepted = _root_path(local, deepest)
        paths[r, : len(accepted)] = accepted

    padded, lengths = commit_paths(paths)
    plan = GdnCommitPlan(
        node_offsets=step.node_offsets,
        paths=torch.from_numpy(padded).to(device),
        path_lengths=torch.from_numpy(lengths).to(device),
        conv_index=torch.from_numpy(conv_commit_index(paths, offsets, WIDTH - 1)).to(device),
    )
    # Prefix caching (boundary commits, before the main commit): request 0's path without its last node, request
    # 1's whole (root-only) path, and for request 2 a prefix longer than its path, which writes nothing.
    lengths_np = (paths >= 0).sum(axis=1)
    prefix = torch.tensor([max(1, int(lengths_np[0]) - 1), 1, int(lengths_np[2]) + 1], dtype=torch.int32)
    boundary_slots = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    boundary, writes = boundary_commit_plan(plan, prefix.to(device), WIDTH - 1)
    assert writes.tolist() == [True, True, False]
    for pending in step.pending.values():
        commit_layer(pending, boundary, torch.where(writes, boundary_slots, -1))

    def expect_committed(r: int, into: int, entries: int, what: str) -> None:
        """Slot ``into`` holds request ``r``'s conv history and state after its path's first ``entries`` entries."""
        slot, first = int(slots[r]), int(offsets[r])
        rows = [first + int(p) for p in paths[r][:entries] if p >= 0]
        history = torch.cat([conv_before[slot].T, x[rows]])[-(WIDTH - 1) :].T
        assert torch.equal(conv_state[into], history), f"request {r}: {what} conv history"
        inputs = (x[rows], weight, bias, a[rows], b[rows], a_log, dt_bias)
        _, final = _oracle(conv_before[slot].cpu(), *(t.cpu() for t in inputs), ssm_before[slot].cpu())
        err = float((ssm_state[into].double().cpu() - final).abs().max() / final.abs().max())
        assert err < 1e-4, f"request {r}: {what} state relative error {err}"

    for r in range(2):
        expect_committed(r, int(boundary_slots[r]), int(prefix[r]), "boundary")
    assert torch.equal(conv_state[5], conv_before[5]) and torch.equal(ssm_state[5], ssm_before[5])
    assert torch.equal(conv_state[slots.long()], conv_before[slots.long()]), "a boundary commit wrote a source slot"

    assert commit_pending(step, plan) == 1 and not step.pending
    for r in range(num_requests):
        expect_committed(r, int(slots[r]), paths.shape[1], "committed")
    untouched = [s for s in range(slots_count) if s not in slots.tolist() + boundary_slots.tolist()[:2]]
    assert torch.equal(conv_state[untouched], conv_before[untouched])
    assert torch.equal(ssm_state[untouched], ssm_before[untouched])


def run_all_checks(device: str) -> None:
    for sd_layout in (False, True):
        for seed in (0, 1):
            _check(device, sd_layout, seed)


def test_gdn_verify_and_commit_in_vllm_layout_match_the_sequential_rule():
    env = child_env(TESTS_DIR, KERNEL_TESTS_DIR, interpret=True)
    script = (
        "import _triton_interpreter; _triton_interpreter.patch_triton_interpreter_for_numpy2(); "
        "import torch; torch.set_num_threads(1); import test_gdn_state_commit as t; t.run_all_checks('cpu')"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gdn_verify_and_commit_on_gpu():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    run_all_checks("cuda")


def test_conv_commit_index_takes_the_last_window_of_history_and_path():
    from layout_oracle import conv_commit_index

    offsets = np.array([0, 5, 6, 10])
    paths = np.array([[0, 1, 3, -1], [0, -1, -1, -1], [0, 1, 2, 3]])
    w = 3
    index = conv_commit_index(paths, offsets, w)
    tree = 3 * w  # first tree row
    assert index.tolist() == [
        [tree + 0, tree + 1, tree + 3],  # path of 3 fills the window
        [1 * w + 1, 1 * w + 2, tree + 5],  # root only: two newest history entries, then the root
        [tree + 6 + 1, tree + 6 + 2, tree + 6 + 3],
    ]


@pytest.mark.parametrize("seed", range(4))
def test_a_boundary_commit_plan_is_the_commit_plan_of_the_paths_prefixes(seed):
    """``gdn.boundary_commit_plan``: the conv rows of each path's first ``prefix`` entries (the oracle's rows of the
    truncated paths), those entries' lengths, and writes only where the path holds that many entries."""
    from layout_oracle import commit_paths, conv_commit_index

    from ddtree.vllm.gdn import GdnCommitPlan, boundary_commit_plan

    rng = np.random.default_rng(seed)
    w, width, num_trees = 3, 6, 5
    sizes = rng.integers(width, 12, size=num_trees)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    lengths = rng.integers(1, width + 1, size=num_trees)
    paths = np.full((num_trees, width), -1, dtype=np.int64)
    for r in range(num_trees):  # any distinct local nodes, the root first (the index only reads node numbers)
        paths[r, : lengths[r]] = np.concatenate([[0], rng.permutation(np.arange(1, sizes[r]))[: lengths[r] - 1]])
    padded, path_lengths = commit_paths(paths)
    plan = GdnCommitPlan(
        node_offsets=torch.from_numpy(offsets.astype(np.int32)),
        paths=torch.from_numpy(padded),
        path_lengths=torch.from_numpy(path_lengths),
        conv_index=torch.from_numpy(conv_commit_index(paths, offsets, w)),
    )
    prefix = rng.integers(0, width + 2, size=num_trees).astype(np.int32)
    boundary, writes = boundary_commit_plan(plan, torch.from_numpy(prefix), w)
    expected_writes = (prefix > 0) & (prefix <= lengths)
    assert writes.tolist() == expected_writes.tolist()
    truncated = np.where(np.arange(width)[None, :] < prefix[:, None], paths, -1)
    expected = conv_commit_index(truncated, offsets, w)
    for r in np.flatnonzero(expected_writes):
        assert boundary.conv_index[r].tolist() == expected[r].tolist(), f"tree {r}"
        assert int(boundary.path_lengths[r]) == prefix[r]
    assert torch.equal(boundary.paths, plan.paths) and torch.equal(boundary.node_offsets, plan.node_offsets)
