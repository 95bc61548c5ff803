"""Tree steps under CUDA graphs, the parts that need no GPU: persistent layout, dummy trees, graph dispatch."""

import dataclasses
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


def test_views_of_a_step_shape_are_made_once_and_are_the_buffers_own(monkeypatch):
    """A step shape's views are cached (the buffers never move): the same tensors every step, in a dict of the
    caller's own; the cache starts afresh past its bound."""
    from ddtree.vllm import graphs

    buffers = TreeStepBuffers(CPU, max_requests=4, max_tokens=80, tree_size=65, conv_width=4)
    first = buffers.views(2, 40, 2, conv=True)
    first["row_start"] = None  # the caller's dict: the next call is not affected
    again = buffers.views(2, 40, 2, conv=True)
    assert again["ancestor_bits"] is buffers.views(2, 40, 2, conv=True)["ancestor_bits"]
    assert again["row_start"].data_ptr() == buffers.row_start.data_ptr() and again["row_start"].shape == (2,)
    assert again["node_offsets"].shape == (3,) and again["conv_index"].shape == (40, 4)
    assert set(buffers.views(2, 40)) == {"row_start", "ancestor_bits"}  # another shape, its own views
    monkeypatch.setattr(graphs, "MAX_CACHED_VIEWS", 3)
    for n in range(1, 6):
        buffers.views(1, n)
    assert len(buffers._views) <= 3


def test_the_leading_step_indices_are_one_view_per_count():
    buffers = TreeStepBuffers(CPU, max_requests=4, max_tokens=80, tree_size=65, conv_width=4)
    view = buffers.leading_step_index(65)
    assert view is buffers.leading_step_index(65) and view.tolist() == list(range(65))
    assert view.data_ptr() == buffers.step_index.data_ptr()
    assert buffers.leading_step_index(80).shape == (80,)
    with pytest.raises(ValueError, match="81 step tokens exceed the buffers' 80"):
        buffers.leading_step_index(81)


def test_the_walks_int64_offsets_sit_in_one_buffer_one_view_per_count():
    """``wide_offsets``: a step's int32 offsets as int64 at the buffer's fixed address (the walk graphs key on it),
    the same view object for a count of trees every time."""
    buffers = TreeStepBuffers(CPU, max_requests=4, max_tokens=80, tree_size=65, conv_width=4)
    first = buffers.wide_offsets(torch.tensor([0, 7, 14], dtype=torch.int32))
    again = buffers.wide_offsets(torch.tensor([0, 5, 12], dtype=torch.int32))
    assert again is first and again.dtype == torch.int64 and again.tolist() == [0, 5, 12]
    assert again.data_ptr() == buffers.node_offsets64.data_ptr()
    assert buffers.wide_offsets(torch.arange(5, dtype=torch.int32)).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="5 trees exceed the buffers' 4"):
        buffers.wide_offsets(torch.arange(6, dtype=torch.int32))


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


@pytest.mark.parametrize("budget, depth, smaller", [(64, 15, None), (16, 15, None), (256, 15, 32), (8, 4, 4)])
def test_dummy_trees_are_whole_trees_of_the_engine_budget(budget, depth, smaller):
    """Dummy trees of the engine's budget, or of a schedule's smaller budget for that budget's own graphs."""
    buffers = TreeStepBuffers(CPU, max_requests=3, max_tokens=3 * (budget + 1), tree_size=budget + 1, conv_width=4)
    size = (smaller or budget) + 1
    views = buffers.stage_dummy_trees(3, depth, size if smaller else None)
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


def test_dummy_trees_refuse_sizes_the_buffers_do_not_hold():
    buffers = TreeStepBuffers(CPU, max_requests=2, max_tokens=40, tree_size=17)
    for size in (1, 18):
        with pytest.raises(ValueError, match=f"dummy trees of {size} nodes; the buffers hold 2 to 17"):
            buffers.stage_dummy_trees(2, 4, size)


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
    commits.record((195, 3), step, weak)
    assert not step.pending and len(made) == 5
    replayed = commits.replayed((195, 3))["layer.0"]
    tensors[3].fill_(7.0)  # a replay writes the deltas in place
    assert (replayed.deltas == 7.0).all()
    with pytest.raises(RuntimeError, match="FULL CUDA graph of 130 tokens in 2 trees"):
        commits.replayed((130, 2))
    with pytest.raises(RuntimeError, match="195 tokens in 5 trees"):  # a schedule's other trees of that count
        commits.replayed((195, 5))


def _dispatching_runner(monkeypatch, mode_name, whole_trees, sizes, result_mode):
    """A runner of which only the dispatch override is real; vLLM's dispatch is a stub that records its
    arguments and answers ``result_mode``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    seen = {}

    def dispatch(self, *args, **kwargs):
        seen.update(kwargs)
        descriptor = SimpleNamespace(num_tokens=kwargs["num_tokens"], num_reqs=kwargs["num_tokens"] // 65)
        return CUDAGraphMode[result_mode], descriptor, False, None, None

    monkeypatch.setattr(GPUModelRunner, "_determine_batch_execution_and_padding", dispatch)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode_name], cudagraph_capture_sizes=sizes)
    runner._ddtree_whole_tree_tokens = 65 if whole_trees else 0
    runner._ddtree_in_dummy_run, runner._ddtree_full_graph = False, None
    runner.uniform_decode_query_len, runner._ddtree_schedule_graphs = 65, set()
    return runner, seen


@pytest.mark.parametrize(
    "whole, tokens, result, uniform, full_graph",
    [
        (True, 130, "FULL", True, (130, 2)),  # every request a whole tree, a captured size: FULL
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
    graphs.commit((10, 2), layers, plan(2, 2), commit_layer)
    assert len(captured) == 1 and graphs.replayed == 0 and len(seen) == 2  # eager, then captured
    seen.clear()
    graphs.commit((10, 2), layers, plan(3, 2), commit_layer)  # a replay sees this step's paths
    assert graphs.replayed == 1 and len(captured) == 1
    assert [s[0] for s in seen] == ["pending-0", "pending-1"]
    assert seen[0][1:] == ([[0, 3, 0], [0, 0, 0]], [2, 1], [[1, 7], [2, 3]])
    graphs.commit((10, 1), layers, plan(1, 2), commit_layer)  # another graph: eager and captured on its own
    assert len(captured) == 2 and graphs.replayed == 1
    with pytest.raises(ValueError, match="does not fit"):
        graphs.commit(
            (10, 2), layers, GdnCommitPlan(offsets, torch.zeros(2, 5, dtype=torch.int32), None, None), commit_layer
        )


def test_commit_graphs_read_a_replayed_walks_paths_where_they_are():
    """After a walk that replayed its graph the accepted paths sit at that graph's fixed addresses: the commit graph
    is keyed by those addresses and reads them in place (no copies into its own buffers); the walk's next replay
    rewrites them there, and the commit's replay sees the new paths. Other addresses get a graph of their own."""
    from ddtree.vllm.gdn import GdnCommitPlan
    from ddtree.vllm.graphs import CommitGraphs

    captured, seen = [], []

    def capture(work):
        captured.append(work)
        return work

    def commit_layer(pending, plan):
        seen.append((pending, plan.paths, plan.paths.tolist(), plan.path_lengths.tolist()))

    graphs = CommitGraphs(CPU, max_requests=4, path_width=3, conv_window=2, capture=capture)
    offsets = torch.tensor([0, 5, 9], dtype=torch.int32)
    walk_out = GdnCommitPlan(  # a walk graph's outputs: rewritten in place by each replay
        node_offsets=offsets,
        paths=torch.tensor([[0, 2, 0], [0, 0, 0]], dtype=torch.int32),
        path_lengths=torch.tensor([2, 1], dtype=torch.int32),
        conv_index=torch.tensor([[1, 6], [2, 3]]),
    )
    layers = {"layer.0": "pending-0"}
    graphs.commit((10, 2), layers, walk_out, commit_layer, in_place=True)
    assert len(captured) == 1 and graphs.replayed == 0 and seen[0][1] is walk_out.paths  # the walk's own tensor
    walk_out.paths[0, 1], walk_out.path_lengths[0] = 4, 3  # the walk's next replay
    walk_out.paths[0, 2] = 1
    seen.clear()
    graphs.commit((10, 2), layers, walk_out, commit_layer, in_place=True)
    assert graphs.replayed == 1 and len(captured) == 1
    assert seen == [("pending-0", walk_out.paths, [[0, 4, 1], [0, 0, 0]], [3, 1])]
    assert graphs.paths.abs().sum() == 0  # nothing was copied into the graphs' own buffers
    moved = GdnCommitPlan(offsets, walk_out.paths.clone(), walk_out.path_lengths, walk_out.conv_index)
    graphs.commit((10, 2), layers, moved, commit_layer, in_place=True)  # other addresses: a graph of their own
    assert len(captured) == 2 and graphs.replayed == 1


def test_a_capture_that_runs_out_of_memory_leaves_its_key_eager_and_the_engine_serving(caplog, monkeypatch):
    """ddtree captures while serving, beside a KV cache that fills the memory vLLM was given: a capture that runs
    out of memory is not fatal. That call's result is the eager run's; later calls of the key run eagerly without
    trying again (no replay, no first run counted), with one warning; other keys still capture."""
    import logging

    from ddtree.vllm.graphs import ShapeGraphs

    attempts = []

    def capture(work):
        attempts.append(work)
        if len(attempts) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return work

    graphs, runs = ShapeGraphs(capture), []
    for counter in ("capture_failures", "first_runs"):  # process-wide counts: restored after the test
        monkeypatch.setattr(ShapeGraphs, counter, getattr(ShapeGraphs, counter))
    failures, first_runs = ShapeGraphs.capture_failures, ShapeGraphs.first_runs
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree.graphs"):
        for step in range(3):
            assert graphs.run("big", lambda: runs.append("big") or {"out": torch.ones(1)})["out"].item() == 1.0
    assert runs == ["big"] * 3 and len(attempts) == 1 and graphs.replayed == 0 and not graphs.has("big")
    assert ShapeGraphs.capture_failures == failures + 1 and ShapeGraphs.first_runs == first_runs + 1
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "ran out of device memory" in caplog.text
    graphs.run("small", lambda: None)
    graphs.run("small", lambda: None)
    assert graphs.has("small") and graphs.replayed == 1


def test_captures_count_the_device_memory_their_pools_reserved(monkeypatch):
    """Each successful capture counts once, with the growth of the allocator's reserved bytes across it (the
    graph's own pool); a replay and a failed capture add nothing."""
    from ddtree.vllm import graphs as graphs_module
    from ddtree.vllm.graphs import ShapeGraphs

    reserved = [100]

    def capture(work):  # a capture whose pool takes 2 MiB, then one that runs out of memory
        if reserved[0] > 100 + 2**21:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        reserved[0] += 2**21
        return work

    monkeypatch.setattr(graphs_module, "_reserved_bytes", lambda: reserved[0])
    for counter in ("captures", "capture_reserved_bytes", "capture_failures", "first_runs"):
        monkeypatch.setattr(ShapeGraphs, counter, 0)
    graphs = ShapeGraphs(capture)
    graphs.run("a", lambda: None)
    graphs.run("a", lambda: None)  # a replay
    reserved[0] += 2**22  # memory reserved outside a capture (the eager first run's, vLLM's): not counted
    graphs.run("b", lambda: None)  # its capture fails
    assert ShapeGraphs.captures == 1 and ShapeGraphs.capture_reserved_bytes == 2**21
    assert ShapeGraphs.capture_failures == 1 and graphs.replayed == 1


def test_a_commit_in_place_records_the_kv_moves_in_the_same_graph():
    """In place, the step's K/V moves (the walk's outputs too) are recorded with the GDN layers' commits: one graph,
    keyed by their addresses as well, whose replay moves the walk's new moves; other move tensors get a graph of
    their own, and moves are refused to a commit that copies its paths."""
    from ddtree.vllm.gdn import GdnCommitPlan
    from ddtree.vllm.graphs import CommitGraphs

    captured, ran = [], []

    def capture(work):
        captured.append(work)
        return work

    graphs = CommitGraphs(CPU, max_requests=4, path_width=3, conv_window=2, capture=capture)
    walk_out = GdnCommitPlan(
        node_offsets=torch.tensor([0, 5], dtype=torch.int32),
        paths=torch.tensor([[0, 2, 0]], dtype=torch.int32),
        path_lengths=torch.tensor([2], dtype=torch.int32),
        conv_index=torch.tensor([[1, 6]]),
    )
    src, dst = torch.tensor([2]), torch.tensor([1])

    def move(a, b):
        ran.append(("move", a.tolist(), b.tolist()))

    def commit_layer(pending, plan):
        ran.append(("commit", pending, plan.paths.tolist()))

    graphs.commit((5, 1), {"layer.0": "p0"}, walk_out, commit_layer, True, (src, dst, move))
    assert ran == [("move", [2], [1]), ("commit", "p0", [[0, 2, 0]])] and len(captured) == 1
    ran.clear()
    src[0], walk_out.paths[0, 1] = 3, 3  # the walk's next replay
    graphs.commit((5, 1), {"layer.0": "p0"}, walk_out, commit_layer, True, (src, dst, move))
    assert ran == [("move", [3], [1]), ("commit", "p0", [[0, 3, 0]])] and graphs.replayed == 1
    graphs.commit((5, 1), {"layer.0": "p0"}, walk_out, commit_layer, True, (src.clone(), dst, move))
    assert len(captured) == 2  # other move addresses: a graph of their own
    with pytest.raises(ValueError, match="K/V moves join only a commit that reads the walk's outputs in place"):
        graphs.commit((5, 1), {"layer.0": "p0"}, walk_out, commit_layer, False, (src, dst, move))


def _schedule_runner(schedule=((1, 64), (4, 32), (8, 16))):
    """A runner (no engine) with vLLM's real CUDA-graph dispatcher and dispatch, its keys initialised as vLLM does
    for budget 64 (capture sizes already rounded to multiples of 65), and a budget schedule."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    sizes = [65 * k for k in range(1, 9)]
    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=sizes,
        max_cudagraph_capture_size=sizes[-1],
        splitting_ops=list(CompilationConfig._attention_ops),
    )
    config = SimpleNamespace(
        compilation_config=compilation,
        num_speculative_tokens=64,
        lora_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        parallel_config=SimpleNamespace(data_parallel_size=1),
        observability_config=SimpleNamespace(cudagraph_metrics=False),
    )
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 65)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.vllm_config, runner.compilation_config, runner.cudagraph_dispatcher = config, compilation, dispatcher
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=15, top_k=8, budget_schedule=schedule)
    runner.drafter = SimpleNamespace(top_k=8)
    runner.max_num_reqs, runner.max_num_tokens, runner.lora_config = 8, 8192, None
    runner.uniform_decode_query_len = 65
    runner.model_config = SimpleNamespace(is_encoder_decoder=False)
    runner.input_batch = SimpleNamespace(lora_id_to_lora_request={})
    runner._pad_for_sequence_parallelism = lambda num_tokens: num_tokens
    runner._ddtree_in_dummy_run, runner._ddtree_full_graph, runner._ddtree_whole_tree_tokens = False, None, 0
    runner._ddtree_add_schedule_graphs()
    return runner


def _dispatch(runner, tree_tokens, num_reqs, num_tokens=None):
    runner._ddtree_whole_tree_tokens = tree_tokens
    num_tokens = num_tokens or tree_tokens * num_reqs
    mode, descriptor = runner._determine_batch_execution_and_padding(
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_scheduled_tokens_np=np.full(num_reqs, num_tokens // num_reqs),
        max_num_scheduled_tokens=num_tokens // num_reqs,
        use_cascade_attn=False,
    )[:2]
    return mode.name, (descriptor.num_tokens, descriptor.num_reqs, descriptor.uniform), runner._ddtree_full_graph


def test_a_schedules_smaller_trees_get_full_graphs_of_their_own_in_vllms_dispatch():
    """Budget 64 from 1 request, 32 from 4, 16 from 8: vLLM 0.25 knows FULL graphs of 65-token trees only; the
    smaller budgets' whole-tree steps replay graphs of their own trees (33 tokens at 4-7 requests, 17 at 8),
    dispatched by vLLM's own dispatcher under their query length, which is restored afterwards."""
    runner = _schedule_runner()
    assert runner._ddtree_schedule_graphs == {(33, 4), (33, 5), (33, 6), (33, 7), (17, 8)}
    assert set(runner.compilation_config.cudagraph_capture_sizes) == {65 * k for k in range(1, 9)} | {
        132, 165, 198, 231, 136
    }  # fmt: skip
    assert _dispatch(runner, 33, 7) == ("FULL", (231, 7, True), (231, 7))
    assert _dispatch(runner, 17, 8) == ("FULL", (136, 8, True), (136, 8))
    assert _dispatch(runner, 65, 2) == ("FULL", (130, 2, True), (130, 2))  # the engine's budget, as before
    # 3 trees of 33 tokens: the schedule picks 64 at 3 requests, so no graph; PIECEWISE, padded to 130.
    assert _dispatch(runner, 33, 3) == ("PIECEWISE", (130, None, False), None)
    # 136 tokens that are not 8 whole trees of one size (a prefill among them): PIECEWISE of that size.
    assert _dispatch(runner, 0, 8, num_tokens=136) == ("PIECEWISE", (136, None, False), None)
    assert runner.uniform_decode_query_len == runner.cudagraph_dispatcher.uniform_decode_query_len == 65


def test_each_full_graph_is_captured_under_its_own_query_length(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = _schedule_runner()
    seen = []

    def capture(self, desc, *args, **kwargs):
        seen.append((desc, self.uniform_decode_query_len, self.cudagraph_dispatcher.uniform_decode_query_len))

    monkeypatch.setattr(GPUModelRunner, "_warmup_and_capture", capture)
    for mode, descriptors in runner.cudagraph_dispatcher.get_capture_descs():
        for desc in descriptors:
            runner._warmup_and_capture(desc, mode)
    full = {(d.num_tokens, d.num_reqs): (own, dispatcher) for d, own, dispatcher in seen if d.uniform}
    assert full == {**{(65 * k, k): (65, 65) for k in range(1, 9)}, **{(33 * n, n): (33, 33) for n in range(4, 8)},
                    (136, 8): (17, 17)}  # fmt: skip
    assert {own for d, own, _ in seen if not d.uniform} == {65}
    assert runner.uniform_decode_query_len == runner.cudagraph_dispatcher.uniform_decode_query_len == 65


def test_without_a_schedule_the_graphs_are_vllms_own():
    runner = _schedule_runner(schedule=None)
    assert runner._ddtree_schedule_graphs == set()
    assert runner.compilation_config.cudagraph_capture_sizes == [65 * k for k in range(1, 9)]
    assert _dispatch(runner, 33, 4) == ("PIECEWISE", (195, None, False), None)


@pytest.mark.parametrize("precapture", [False, True])
def test_a_capture_of_smaller_trees_stages_them_and_keeps_their_commit_inputs_by_graph(monkeypatch, precapture):
    """The dummy run of a schedule graph's capture publishes whole trees of that graph's size, tells vLLM's GDN
    builder their draft count, and records the graph's commit inputs under (tokens, trees); with DDTREE_PRECAPTURE
    it then captures that size's step graphs (trees, tokens per tree)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm import context

    runner = _schedule_runner()
    runner.device = CPU
    runner._ddtree_buffers = TreeStepBuffers(CPU, max_requests=8, max_tokens=520, tree_size=65, conv_width=4)
    runner._ddtree_conv_window, runner._ddtree_gdn_step = 3, None
    runner._ddtree_captured = CapturedCommits()
    runner.num_decode_draft_tokens = SimpleNamespace(cpu=torch.full((8,), -1))
    seen = {}

    def dummy_run(self, num_tokens, mode, force_attention, uniform_decode, *args, **kwargs):
        step = context.published()
        seen["offsets"] = step.gdn.node_offsets.tolist()
        seen["drafts"] = self.num_decode_draft_tokens.cpu.tolist()
        step.gdn.pending["layer.0"] = PendingCommit(*(torch.zeros(1) for _ in range(7)))

    monkeypatch.setattr(GPUModelRunner, "_dummy_run", dummy_run)
    monkeypatch.setattr("vllm.utils.torch_utils.weak_ref_tensor", lambda t: t)  # vLLM's op needs its CUDA build
    precaptured = []
    runner._ddtree_precapture = precapture
    runner._ddtree_precapture_step_graphs = lambda trees, tokens: precaptured.append((trees, tokens))
    with runner._ddtree_uniform_query_len(33):
        runner._dummy_run(231, CUDAGraphMode.FULL, False, True, is_graph_capturing=True)
        runner._dummy_run(231, CUDAGraphMode.FULL, False, True)  # a warm-up run, not a capture: nothing captured
    assert precaptured == ([(7, 33)] if precapture else [])
    assert seen["offsets"] == [33 * r for r in range(8)]
    assert seen["drafts"] == [32] * 7 + [-1]
    assert runner.num_decode_draft_tokens.cpu.tolist() == [-1] * 8  # restored
    assert list(runner._ddtree_captured.by_graph) == [(231, 7)] and context.published() is None


def test_walk_graphs_replay_a_shape_on_each_steps_inputs_and_capture_each_shape_once():
    """The first walk of a shape runs eagerly and is captured; later walks of that shape copy their inputs into
    the graph's own and replay it (a stand-in capture that replays by calling the work, as a graph replays its
    kernels on the captured addresses); another shape gets its own graph."""
    from test_device_accept import agreeing_target, device_trees, random_step

    from ddtree.vllm.device_accept import accept_on_device
    from ddtree.vllm.graphs import WalkGraphs

    captured = []

    def capture(work):
        captured.append(work)
        return work

    graphs = WalkGraphs(capture)
    rng = np.random.default_rng(3)
    plan, depth = random_step(rng, conv_window=3)
    trees, args = device_trees(plan), (depth + 2, int(plan.trees.draft_depth) + 1, plan.num_tokens, 3)
    for _ in range(3):
        target = torch.from_numpy(agreeing_target(rng, plan))
        got, want = graphs.walk(trees, target, *args), accept_on_device(trees, target, *args)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert len(captured) == 1 and graphs.replayed == 2
    graphs.walk(trees, target, *args[:3], 0)  # another shape (no GDN conv): its own graph
    assert len(captured) == 2 and graphs.replayed == 2


def test_the_sampler_can_write_a_known_walks_target_in_place_and_the_walk_copies_nothing():
    """``target_for``: None until a walk of the trees object found its graph; then the graph's own target, which a
    walk given it as its target reads without a copy (counted), walking exactly what a fresh tensor would."""
    from test_device_accept import agreeing_target, device_trees, random_step

    from ddtree.vllm.device_accept import accept_on_device
    from ddtree.vllm.graphs import WalkGraphs

    graphs = WalkGraphs(lambda work: work)
    rng = np.random.default_rng(5)
    plan, depth = random_step(rng, conv_window=3)
    trees, args = device_trees(plan), (depth + 2, int(plan.trees.draft_depth) + 1, plan.num_tokens, 3)
    rows = plan.num_tree_tokens
    assert graphs.target_for(trees, rows, *args) is None  # no walk yet
    graphs.walk(trees, torch.from_numpy(agreeing_target(rng, plan)), *args)
    own = graphs.target_for(trees, rows, *args)
    assert own is not None and own.dtype == torch.int64 and tuple(own.shape) == (rows,)
    assert graphs.target_for(trees, rows + 1, *args) is None  # another target shape: another graph's
    assert graphs.target_for(trees, rows, *args[:3], 0) is None  # another walk shape
    for asked_first in (False, True, True):  # (as the sampler does: asked for the step's buffer, then walked)
        if asked_first:
            assert graphs.target_for(trees, rows, *args) is own
        tokens = torch.from_numpy(agreeing_target(rng, plan))
        own.copy_(tokens)  # (what the sampler's argmax does there)
        got, want = graphs.walk(trees, own, *args), accept_on_device(trees, tokens, *args)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert graphs.targets_in_place == 3 and graphs.replayed == 3
    assert graphs.target_for(trees, rows, *args) is own  # handed out, then not used: the walk copies its own in
    tokens = torch.from_numpy(agreeing_target(rng, plan))
    got, want = graphs.walk(trees, tokens, *args), accept_on_device(trees, tokens, *args)
    assert all(torch.equal(got[k], want[k]) for k in want) and graphs.targets_in_place == 3
    assert torch.equal(own, tokens)  # (copied into the graph's own target)
    # Another trees object of the same shapes (its own graph): a buffer handed out for the first trees is not its
    # target, so its walk copies the tokens into its own graph's.
    other = dataclasses.replace(trees, **{f.name: _clone(getattr(trees, f.name)) for f in dataclasses.fields(trees)})
    graphs.walk(other, torch.from_numpy(agreeing_target(rng, plan)), *args)  # its graph found
    other_own = graphs.target_for(other, rows, *args)
    assert other_own is not None and other_own is not own
    assert graphs.target_for(trees, rows, *args) is own
    tokens = torch.from_numpy(agreeing_target(rng, plan))
    own.copy_(tokens)
    got, want = graphs.walk(other, own, *args), accept_on_device(other, tokens, *args)
    assert all(torch.equal(got[k], want[k]) for k in want) and graphs.targets_in_place == 3
    assert torch.equal(other_own, tokens)


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def test_a_walk_writes_its_path_rows_into_the_ring_under_the_serial_uploaded_with_its_trees():
    """With the statistics' ring, every walk (the eager first one and each replay of its graph, which reads the
    serial in place like the trees) puts its path rows in slot ``serial % slots`` with the serial beside them; the
    host, noting each step's serial, reads back exactly each step's rows."""
    import dataclasses

    from test_device_accept import agreeing_target, device_trees, random_step

    from ddtree.vllm.counts import PathRing
    from ddtree.vllm.device_accept import accept_on_device
    from ddtree.vllm.graphs import WalkGraphs

    captured = []

    def capture(work):
        captured.append(work)
        return work

    rng = np.random.default_rng(7)
    plan, depth = random_step(rng, conv_window=3)
    args = (depth + 2, int(plan.trees.draft_depth) + 1, plan.num_tokens, 3)
    num_trees = len(plan.trees)
    ring = PathRing(torch.device("cpu"), max_reqs=num_trees + 1, width=args[1] + 1, slots=2)
    graphs = WalkGraphs(capture, ring)
    trees = dataclasses.replace(device_trees(plan), step_serial=torch.zeros(1, dtype=torch.int64))
    counted, expected = [], []
    for serial in range(5):
        trees.step_serial.fill_(serial)  # the plan's upload writes the step's serial into the same view
        target = torch.from_numpy(agreeing_target(rng, plan))
        got = graphs.walk(trees, target, *args)
        assert torch.equal(got["path_rows"], accept_on_device(trees, target, *args)["path_rows"])
        expected.append((serial, got["path_rows"].tolist()))
        counted += ring.note(serial, num_trees, serial)
    counted += ring.landed(wait=True)
    assert len(captured) == 1 and graphs.replayed == 4  # the ring's writes are inside the graph
    assert [(tag, rows.tolist()) for tag, rows in counted] == expected and ring.lost_steps == 0


def test_walk_graphs_read_the_trees_in_place_and_copy_inputs_that_keep_moving():
    """A graph keyed by the trees' addresses reads them where they are: a later step's trees written into the same
    tensors (the plan's upload views) are what its replay walks. Trees at new addresses get graphs of their own,
    up to ADDRESS_SETS per shape; after that the shape's walks copy their inputs, still exact."""
    import dataclasses

    from test_device_accept import agreeing_target, device_trees, random_step

    from ddtree.vllm.device_accept import accept_on_device
    from ddtree.vllm.graphs import WalkGraphs

    captured = []

    def capture(work):
        captured.append(work)
        return work

    def same_shape_step(seed):
        # Steps of one shape: trees of fixed sizes, different tokens and parents.
        rng = np.random.default_rng(seed)
        while True:
            plan, depth = random_step(rng, conv_window=3)
            if (
                plan.trees.node_offsets.tolist() == first.trees.node_offsets.tolist()
                and plan.num_tokens == first.num_tokens
            ):
                return plan, rng

    first, depth = random_step(np.random.default_rng(11), conv_window=3)
    graphs = WalkGraphs(capture)
    args = (depth + 2, int(first.trees.draft_depth) + 1, first.num_tokens, 3)
    in_place = device_trees(first)
    rng = np.random.default_rng(5)
    for step in range(3):
        plan = first if step == 0 else same_shape_step(100 + step)[0]
        fresh = device_trees(plan)
        for field in dataclasses.fields(fresh):  # the upload rewrites the same views
            if getattr(fresh, field.name) is not None:
                getattr(in_place, field.name).copy_(getattr(fresh, field.name))
        target = torch.from_numpy(agreeing_target(rng, plan))
        got, want = graphs.walk(in_place, target, *args), accept_on_device(fresh, target, *args)
        assert all(torch.equal(got[k], want[k]) for k in want), step
    assert len(captured) == 1 and graphs.replayed == 2
    for step in range(WalkGraphs.ADDRESS_SETS + 2):  # new tensors every step: ADDRESS_SETS - 1 more graphs, then one
        plan = same_shape_step(200 + step)[0]
        moving = device_trees(plan)
        target = torch.from_numpy(agreeing_target(rng, plan))
        got, want = graphs.walk(moving, target, *args), accept_on_device(moving, target, *args)
        assert all(torch.equal(got[k], want[k]) for k in want), step
    assert len(captured) == WalkGraphs.ADDRESS_SETS + 1
    assert graphs.copied_walks == 3  # the six moving walks: three more address sets (four in all), then copies


def test_walk_graphs_find_a_known_trees_objects_graph_without_reading_its_tensors(monkeypatch):
    """A trees object walked before with a graph that reads it in place finds that graph by identity: its next
    walks read no tensor metadata and replay it on the tensors' new contents (exact). Another target shape, or a
    shape whose walks copy their inputs, goes the full way."""
    import dataclasses

    from test_device_accept import agreeing_target, device_trees, random_step

    from ddtree.vllm.device_accept import accept_on_device
    from ddtree.vllm.graphs import WalkGraphs

    graphs = WalkGraphs(lambda work: work)
    first, depth = random_step(np.random.default_rng(11), conv_window=3)
    args = (depth + 2, int(first.trees.draft_depth) + 1, first.num_tokens, 3)
    trees = device_trees(first)
    rng = np.random.default_rng(6)
    graphs.walk(trees, torch.from_numpy(agreeing_target(rng, first)), *args)
    fields = dataclasses.fields
    with monkeypatch.context() as patched:
        patched.setattr(dataclasses, "fields", lambda *a: pytest.fail("a known trees object's metadata was read"))
        for _ in range(2):
            target = torch.from_numpy(agreeing_target(rng, first))
            trees.node_tokens.copy_(trees.node_tokens.flip(0))  # new contents, same tensors
            got, want = graphs.walk(trees, target, *args), accept_on_device(trees, target, *args)
            assert all(torch.equal(got[k], want[k]) for k in want)
    assert graphs.replayed == 2
    read = []
    monkeypatch.setattr(dataclasses, "fields", lambda *a: read.append(1) or fields(*a))
    graphs.walk(trees, torch.from_numpy(agreeing_target(rng, first)).to(torch.int32), *args)  # another dtype
    assert read == [1]


def test_a_capture_while_serving_keeps_the_allocator_and_pinned_caches(monkeypatch):
    """``torch.cuda.graph``'s entry empties the device allocator's and the pinned host memory's caches (as the
    stand-in below does, like torch's own); ddtree's captures run while serving and must not: the steps after would
    allocate anew. The releases are back in place once the capture is over, also when it fails."""
    import contextlib

    from ddtree.vllm import graphs

    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append("device"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: released.append("pinned"), raising=False)

    pools = []

    @contextlib.contextmanager
    def graph(cuda_graph, capture_error_mode, pool=None):
        assert capture_error_mode == "thread_local"
        pools.append(pool)
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        yield

    class Graph:
        def replay(self):
            released.append("replayed")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    ran = []
    replay = graphs.cuda_graph_capture(CPU)(lambda: ran.append("captured"))
    assert ran == ["captured"] and released == []
    replay()
    assert released == ["replayed"]
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    assert released == ["replayed", "device", "pinned"]  # restored after the capture

    def failing():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.cuda_graph_capture(CPU)(failing)
    graphs.cuda_graph_capture(CPU, pool="shared")(lambda: None)  # graphs made with one pool share it
    assert pools == [None, None, "shared"]
    torch.cuda.empty_cache()
    assert released[-1] == "device"


def test_timed_replays_charge_each_replays_host_time_to_its_graphs_name(monkeypatch):
    """A step graph's replays add their host seconds to their graphs' name; the first run of a key (eager, then
    captured) adds none, and graphs of another name keep their own account. The clock is a stand-in that the
    work advances by 3 s a run, so the seconds are exact."""
    import ddtree.vllm.graphs as graphs

    now = [0.0]
    monkeypatch.setattr(graphs.time, "perf_counter", lambda: now[0])

    def work():
        now[0] += 3.0
        return {}

    seconds = {}
    walks = graphs.ShapeGraphs(graphs.timed_replays(lambda recorded: recorded, seconds, "walk"))
    commits = graphs.ShapeGraphs(graphs.timed_replays(lambda recorded: recorded, seconds, "commit"))
    walks.run("shape", work)  # eager; the stand-in capture runs nothing
    assert seconds == {}
    walks.run("shape", work)
    walks.run("shape", work)
    commits.run("shape", work)
    commits.run("shape", work)
    assert (walks.replayed, commits.replayed) == (2, 1)
    assert seconds == {"walk": 6.0, "commit": 3.0}


def test_draft_top_k_graphs_replay_each_row_count_on_each_steps_hidden_states_and_leave_large_logits_eager():
    """The drafter's top-K as a graph per number of rows: the first proposal of a row count runs eagerly and is
    captured, later ones copy their hidden states into the graph's own and replay it (a stand-in capture that
    replays by calling the work), equal to the eager computation every time; a row count whose logits would exceed
    the byte limit runs eagerly and captures nothing."""
    from ddtree.kernels.draft_top_k import pack_top_k
    from ddtree.vllm.graphs import DraftTopKGraphs

    captured = []

    def capture(work):
        captured.append(work)
        return work

    weight = torch.randn(64, 16)  # a stand-in lm_head: vocab 64, hidden 16

    def top_k_of(hidden, host=None):
        logits = hidden @ weight.T
        values, ids = logits.topk(4, dim=-1)
        return {"packed": pack_top_k(logits, values, ids, host_out=host), "top1": ids[:, 0]}

    # 64 x 4-byte logits per row: at most 5 rows under a 1280-byte limit.
    graphs = DraftTopKGraphs(capture, vocab=64, itemsize=4, max_logit_bytes=1280)
    assert graphs.max_rows == 5
    for step in range(3):
        hidden = torch.randn(5, 16)
        got, want = graphs.run(hidden, top_k_of), top_k_of(hidden)
        assert torch.equal(got["packed"], want["packed"]) and torch.equal(got["top1"], want["top1"]), step
    assert len(captured) == 1 and graphs.replayed == 2
    graphs.run(torch.randn(3, 16), top_k_of)  # another row count: its own graph
    assert len(captured) == 2
    big = torch.randn(6, 16)
    got = graphs.run(big, top_k_of)
    assert torch.equal(got["packed"], top_k_of(big)["packed"])
    assert len(captured) == 2 and graphs.eager_steps == 1
    # A host target (late trees' pinned rows) is part of the key: its own graph, whose work writes there.
    host = torch.zeros(5, 8)
    hidden = torch.randn(5, 16)
    graphs.run(hidden, top_k_of, host)
    assert len(captured) == 3 and torch.equal(host, top_k_of(hidden)["packed"])
    hidden = torch.randn(5, 16)
    graphs.run(hidden, top_k_of, host)  # a replay of that graph
    assert len(captured) == 3 and torch.equal(host, top_k_of(hidden)["packed"])
