"""Tree steps under CUDA graphs, the parts that need no GPU: persistent layout, dummy trees, graph dispatch."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ddtree
from ddtree.vllm.gdn import GdnTreeStep, PendingCommit
from ddtree.vllm.graphs import CapturedCommits, TreeStepBuffers, ancestor_words
from layout_oracle import conv_gather_index

CPU = torch.device("cpu")


def _trees(budgets, depth=3, width=4, seed=0):
    rng = np.random.default_rng(seed)
    lp = np.sort(rng.normal(size=(len(budgets), depth, width)).astype(np.float32), axis=-1)[..., ::-1] - 3.0
    ids = rng.integers(0, 100, size=(len(budgets), depth, width)).astype(np.int64)
    return ddtree.build_trees(np.ascontiguousarray(lp), ids, np.asarray(budgets, dtype=np.int64))


def test_load_writes_in_place_and_pads_the_bit_words():
    buffers = TreeStepBuffers(CPU, max_requests=4, max_tokens=80, tree_size=65, conv_width=4)
    assert buffers.words == 3 == ancestor_words(65) and ancestor_words(64) == 2
    addresses = (buffers.row_start.data_ptr(), buffers.ancestor_bits.data_ptr(), buffers.conv_index.data_ptr())
    trees = _trees([5, 9])
    compiled = ddtree.compile_trees(trees, np.array([10, 20]), window=3)
    bits = torch.from_numpy(np.ascontiguousarray(compiled.ancestor_bits).view(np.int32))
    buffers.ancestor_bits.fill_(-1)  # a previous step's wider rows
    conv = torch.from_numpy(conv_gather_index(compiled.windows, trees.node_offsets))
    views = buffers.load(
        torch.tensor([0, 6, -1], dtype=torch.int32), bits, torch.from_numpy(trees.node_offsets.astype(np.int32)), conv
    )
    num_tokens = int(trees.node_offsets[-1])
    assert views["ancestor_bits"].shape == (num_tokens, 3)
    assert torch.equal(views["ancestor_bits"][:, : bits.shape[1]], bits)
    assert (views["ancestor_bits"][:, bits.shape[1] :] == 0).all()
    assert views["row_start"].tolist() == [0, 6, -1]
    assert torch.equal(views["conv_index"], conv)
    assert views["node_offsets"].tolist() == trees.node_offsets.tolist()
    # Same addresses every step: a graph captured on them reads the new layout.
    assert (buffers.row_start.data_ptr(), buffers.ancestor_bits.data_ptr(), buffers.conv_index.data_ptr()) == addresses
    assert views["ancestor_bits"].data_ptr() == addresses[1]


def test_load_refuses_what_does_not_fit():
    buffers = TreeStepBuffers(CPU, max_requests=2, max_tokens=10, tree_size=17)
    with pytest.raises(ValueError, match="3 requests"):
        buffers.load(torch.zeros(3, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="11 tree tokens"):
        buffers.load(torch.zeros(1, dtype=torch.int32), torch.zeros(11, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="without GDN"):
        buffers.load(
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(2, 4, dtype=torch.int64),
        )


@pytest.mark.parametrize("budget, depth", [(64, 15), (16, 15), (256, 15), (8, 4)])
def test_dummy_trees_are_whole_trees_of_the_engine_budget(budget, depth):
    buffers = TreeStepBuffers(CPU, max_requests=3, max_tokens=3 * (budget + 1), tree_size=budget + 1, conv_width=4)
    views = buffers.stage_dummy_trees(3, depth)
    size = budget + 1
    assert views["node_offsets"].tolist() == [0, size, 2 * size, 3 * size]
    assert views["row_start"].tolist() == [0, size, 2 * size]
    bits = views["ancestor_bits"].numpy().view(np.uint32)
    for row in range(3 * size):  # tree-local bits: every node sees itself and its tree's root
        local = row % size
        assert bits[row, local // 32] >> (local % 32) & 1
        assert bits[row, 0] & 1
    conv = views["conv_index"]
    assert conv.shape == (3 * size, 4) and int(conv.min()) >= 0 and int(conv.max()) < 3 * 3 + 3 * size
    assert conv[:, -1].tolist() == [9 + t for t in range(3 * size)]  # each node's own input, last


def test_captured_commits_hold_references_that_the_replay_rewrites():
    step = GdnTreeStep(
        token_index=torch.arange(3),
        other_index=None,
        node_offsets=torch.tensor([0, 3]),
        ancestor_bits=torch.zeros(3, 1, dtype=torch.int32),
        conv_index=torch.zeros(3, 4),
        num_requests=1,
        num_tree_tokens=3,
    )
    tensors = [torch.zeros(3) for _ in range(5)]
    step.pending["layer.0"] = PendingCommit(torch.zeros(1), torch.zeros(1), *tensors)
    made = []

    def weak(t):
        made.append(t)
        return t.view_as(t)

    commits = CapturedCommits()
    commits.record(195, step, weak)
    assert not step.pending and len(made) == 5
    replayed = commits.replayed(195)["layer.0"]
    tensors[3].fill_(7.0)  # a replay writes the deltas in place
    assert (replayed.deltas == 7.0).all()
    with pytest.raises(RuntimeError, match="FULL CUDA graph of 130 tokens"):
        commits.replayed(130)


def _dispatching_runner(monkeypatch, mode_name, whole_trees, sizes, result_mode):
    """A runner of which only the dispatch override is real; vLLM's dispatch is a stub that records its
    arguments and answers ``result_mode``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    seen = {}

    def dispatch(self, *args, **kwargs):
        seen.update(kwargs)
        return CUDAGraphMode[result_mode], SimpleNamespace(num_tokens=kwargs["num_tokens"]), False, None, None

    monkeypatch.setattr(GPUModelRunner, "_determine_batch_execution_and_padding", dispatch)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode_name], cudagraph_capture_sizes=sizes)
    runner._ddtree_whole_trees, runner._ddtree_in_dummy_run, runner._ddtree_full_graph = whole_trees, False, None
    return runner, seen


@pytest.mark.parametrize(
    "whole, tokens, result, uniform, full_graph",
    [
        (True, 130, "FULL", True, 130),  # every request a whole tree, a captured size: FULL
        (False, 130, "PIECEWISE", False, None),  # 130 tokens of prefill chunks look uniform to vLLM: not FULL
        (True, 195, "PIECEWISE", False, None),  # whole trees, but no graph of that size: no padded FULL replay
    ],
)
def test_only_whole_tree_steps_of_a_captured_size_replay_full_graphs(
    monkeypatch, whole, tokens, result, uniform, full_graph
):
    runner, seen = _dispatching_runner(monkeypatch, "FULL_AND_PIECEWISE", whole, [65, 130, 260], result)
    runner._determine_batch_execution_and_padding(num_tokens=tokens, num_reqs=2)
    assert seen["force_uniform_decode"] is uniform
    assert runner._ddtree_full_graph == full_graph


def test_dispatch_is_vllms_own_in_piecewise_mode_and_in_dummy_runs(monkeypatch):
    runner, seen = _dispatching_runner(monkeypatch, "PIECEWISE", True, [65], "PIECEWISE")
    runner._determine_batch_execution_and_padding(num_tokens=65, num_reqs=1)
    assert "force_uniform_decode" not in seen and runner._ddtree_full_graph is None
    runner, seen = _dispatching_runner(monkeypatch, "FULL_AND_PIECEWISE", False, [65], "FULL")
    runner._ddtree_in_dummy_run = True
    runner._determine_batch_execution_and_padding(num_tokens=65, num_reqs=1, force_uniform_decode=True)
    assert seen["force_uniform_decode"] is True and runner._ddtree_full_graph is None


def test_commit_graphs_commit_eagerly_once_per_size_then_replay_with_each_steps_paths():
    """The first FULL commit of a size runs (and compiles) eagerly, then is captured; later steps of that size
    replay it, reading the accepted paths copied into the graphs' own buffers (a stand-in capture records the work
    and replays it by calling it, as a graph replays its kernels on the captured addresses)."""
    from ddtree.vllm.gdn import GdnCommitPlan
    from ddtree.vllm.graphs import CommitGraphs

    captured, seen = [], []

    def capture(work):
        captured.append(work)
        return work

    def commit_layer(pending, plan):
        seen.append((pending, plan.paths.tolist(), plan.path_lengths.tolist(), plan.conv_index.tolist()))

    graphs = CommitGraphs(CPU, max_requests=4, path_width=3, conv_window=2, capture=capture)
    offsets = torch.tensor([0, 5, 9], dtype=torch.int32)

    def plan(first, length):
        return GdnCommitPlan(
            node_offsets=offsets,
            paths=torch.tensor([[0, first, 0], [0, 0, 0]], dtype=torch.int32),
            path_lengths=torch.tensor([length, 1], dtype=torch.int32),
            conv_index=torch.tensor([[1, 4 + first], [2, 3]]),
        )

    layers = {"layer.0": "pending-0", "layer.1": "pending-1"}
    graphs.commit(10, layers, plan(2, 2), commit_layer)
    assert len(captured) == 1 and graphs.replayed == 0 and len(seen) == 2  # eager, then captured
    seen.clear()
    graphs.commit(10, layers, plan(3, 2), commit_layer)  # a replay sees this step's paths
    assert graphs.replayed == 1 and len(captured) == 1
    assert [s[0] for s in seen] == ["pending-0", "pending-1"]
    assert seen[0][1:] == ([[0, 3, 0], [0, 0, 0]], [2, 1], [[1, 7], [2, 3]])
    graphs.commit(5, layers, plan(1, 2), commit_layer)  # another size: eager and captured on its own
    assert len(captured) == 2 and graphs.replayed == 1
    with pytest.raises(ValueError, match="does not fit"):
        graphs.commit(
            10, layers, GdnCommitPlan(offsets, torch.zeros(2, 5, dtype=torch.int32), None, None), commit_layer
        )
