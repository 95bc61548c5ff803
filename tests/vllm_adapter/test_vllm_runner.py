"""DDTree's model runner: the parts that need no GPU."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")


def test_drafting_continues_near_max_model_len_while_the_drafters_depth_fits():
    """vLLM skips the drafter for the whole batch when a request's ``seq_len + num_speculative_tokens + 1``
    passes max_model_len; for ddtree that count is the budget, so requests within budget + 1 tokens of the end
    verified no tree. The drafter queries depth + 1 positions: it drafts while those fit."""
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=15, top_k=None)
    runner.effective_drafter_max_model_len = 1024
    runner.use_async_scheduling, runner._ddtree_plan = False, None
    fits = runner._input_fits_in_drafter
    assert fits(SimpleNamespace(max_seq_len=1024 - 16)) is True  # 16 queries end exactly at max_model_len
    assert fits(SimpleNamespace(max_seq_len=1024 - 15)) is False
    assert fits(SimpleNamespace(max_seq_len=1024 - 40)) is True  # vLLM's own rule (budget 64) said no here
    assert fits(None) is False
    # Under asynchronous scheduling the metadata's lengths are optimistic (the last step's 64 placeholders all
    # accepted); the counts vLLM corrected before sampling decide.
    runner.use_async_scheduling = True
    runner.input_batch = SimpleNamespace(num_reqs=2, num_computed_tokens_cpu=np.array([900, 1024 - 16 - 65]))
    runner.num_scheduled_tokens = SimpleNamespace(np=np.array([65, 65, 7]))
    assert fits(SimpleNamespace(max_seq_len=1024 - 16 + 60)) is True
    runner.input_batch.num_computed_tokens_cpu[1] += 1
    assert fits(SimpleNamespace(max_seq_len=1024 - 16 + 60)) is False


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_request_verifying_a_tree_grows_at_most_by_its_depth_before_drafting(asynchronous):
    """Once its tree is verified a request is at most its root plus the tree's deepest path longer, not all its
    scheduled nodes: the drafter's fit below max_model_len counts that (for budget 64 up to 48 tokens earlier
    drafting stopped; for 256, 240). Requests without a tree count what was scheduled."""
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.step import TreeStore, plan_verify

    rng = np.random.default_rng(3)
    store = TreeStore(budget=20)
    lp = np.sort(rng.normal(size=(1, 6, 4)), axis=-1)[..., ::-1]
    lp = (lp - np.log(np.exp(lp).sum(-1, keepdims=True))).astype(np.float32)
    lists = store.propose(["t"], lp, np.tile(np.arange(4, dtype=np.int32), (1, 6, 1)))
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=20, draft_len=6, top_k=None)
    runner.effective_drafter_max_model_len = 1000
    runner.use_async_scheduling = asynchronous
    # Request 0 prefills 30 tokens from 0; request 1 verifies a whole tree of 20 drafts from `start`.
    start = 900
    runner._ddtree_plan = plan_verify(store, ["p", "t"], np.array([0, start]), np.array([30, 21]), {"t": lists[0]})
    deepest = int(runner._ddtree_plan.trees.depths.max())
    assert deepest < 20  # the bound below is tighter than the scheduled count
    runner.input_batch = SimpleNamespace(num_reqs=2, num_computed_tokens_cpu=np.array([0, start]))
    runner.num_scheduled_tokens = SimpleNamespace(np=np.array([30, 21]))
    metadata = SimpleNamespace(max_seq_len=start + 21)  # what vLLM's check reads: every node accepted
    fits = runner._input_fits_in_drafter
    limit = start + 1 + deepest + 6 + 1  # the longest request after the step, then the drafter's L + 1 queries
    runner.effective_drafter_max_model_len = limit
    assert fits(metadata) is True and limit < start + 21 + 6 + 1  # vLLM's count would have stopped drafting
    runner.effective_drafter_max_model_len = limit - 1
    assert fits(metadata) is False


def test_kv_moves_share_one_index_across_the_layers_of_a_group():
    """The runner moves the accepted nodes' K/V in every target attention layer with one block/offset index
    per KV-cache group; each layer ends as a move of its own would leave it."""
    from ddtree.kernels.kv_moves import apply_kv_moves_paged
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(6, 2, 4, 2, 8, generator=gen) for _ in range(3)]  # [blocks, K/V, page, heads, dim]
    initial = [c.clone() for c in caches]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([17, 18, 19, 20, 21, 22, 23, 4, 5])  # flat scheduled token -> slot
    src, dst = torch.tensor([3, 6]), torch.tensor([1, 2])  # accepted nodes 3 and 6 to positions 1 and 2
    for c in expected:
        apply_kv_moves_paged(c, mapping[src], mapping[dst])
    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_kv_layers = [(0, caches[0]), (0, caches[1]), (1, caches[2])]
    table = SimpleNamespace(slot_mapping=SimpleNamespace(gpu=mapping))
    runner.input_batch = SimpleNamespace(block_table=[table, table])
    runner._ddtree_accept, runner._ddtree_walk_replayed = None, False
    runner._ddtree_move_kv(src, dst)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    assert not torch.equal(caches[0], caches[1])  # the layers really differ

    # After a step whose walk replayed its graph the moves replay one graph per shape and addresses (a stand-in
    # capture on CPU): the same caches again, from fresh copies, by the capture's eager run and then by replays.
    from ddtree.vllm.graphs import ShapeGraphs

    runner._ddtree_full_graph, runner._ddtree_walk_replayed = (9, 2), True
    runner._ddtree_kv_move_graphs = ShapeGraphs(lambda work: work)
    for _ in range(3):
        for cache, start in zip(caches, initial):
            cache.copy_(start)
        runner._ddtree_move_kv(src, dst)
        for got, want in zip(caches, expected):
            assert torch.equal(got, want)
    assert runner._ddtree_kv_move_graphs.replayed == 2


def test_kv_moves_after_vllm_replaces_its_kv_cache_go_into_the_new_one(monkeypatch):
    """With ``gpu_memory_utilization`` vLLM allocates a minimal KV cache for its CUDA-graph memory profile, frees
    it, and allocates the real one (``initialize_kv_cache`` twice). Whatever ddtree made on the first (the target
    layers' caches, K/V-move and commit graphs, captured commit inputs) is dropped with it: a move after the second
    lands in the new cache, and the freed one is not written."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.attention import DDTreeAttentionBackend
    from ddtree.vllm.graphs import CapturedCommits, ShapeGraphs
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    layer = SimpleNamespace(kv_cache=None)
    gen = torch.Generator().manual_seed(0)

    def allocate(self, kv_cache_config, is_profiling=False):  # vLLM's: a new cache tensor for the layer
        layer.kv_cache = torch.randn(6, 2, 4, 2, 8, generator=gen)

    monkeypatch.setattr(GPUModelRunner, "initialize_kv_cache", allocate)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.compilation_config = SimpleNamespace(static_forward_context={"layer.0": layer})
    group = SimpleNamespace(backend=DDTreeAttentionBackend, layer_names=["layer.0"], kv_cache_group_id=0)
    runner.attn_groups = [[group]]
    runner._ddtree_kv_move_graphs = old_graphs = ShapeGraphs(lambda work: work)
    old_captured = CapturedCommits()
    runner._ddtree_commit_graphs, runner._ddtree_captured = object(), old_captured
    runner.ddtree_stats = SimpleNamespace(graph_launch_seconds={})
    runner.device = torch.device("cpu")
    runner._ddtree_kv_layers = None
    mapping = torch.tensor([17, 18, 19, 20, 21, 22, 23, 4, 5])
    runner.input_batch = SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=mapping))])
    runner._ddtree_accept, runner._ddtree_walk_replayed = None, False
    src, dst = torch.tensor([3, 6]), torch.tensor([1, 2])

    runner.initialize_kv_cache("profiling", is_profiling=True)
    profiling_cache = layer.kv_cache
    runner._ddtree_move_kv(src, dst)  # (a move on the profiling cache: the layers are looked up from it)
    runner.initialize_kv_cache("real")
    real_cache, freed = layer.kv_cache, profiling_cache.clone()
    before = real_cache.clone()
    runner._ddtree_move_kv(src, dst)
    assert not torch.equal(real_cache, before)  # moved in the new cache
    assert torch.equal(profiling_cache, freed)  # the freed one untouched
    assert runner._ddtree_kv_move_graphs is not old_graphs and runner._ddtree_commit_graphs is None
    assert runner._ddtree_captured is not old_captured


def _tree_lists(store, req_ids, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(req_ids), 3, 30)) * 2.0
    ids = np.argsort(-logits, axis=-1)[..., :4]
    log_probs = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), ids, axis=-1)
    return store.propose(req_ids, log_probs.astype(np.float32), ids.astype(np.int64))


def _mixed_hybrid_step(mrope=False, device_accept=False, cut=True):
    """A runner (no vLLM engine) about to prepare a prefill, a whole tree and a cut tree of a hybrid target (``cut``
    False: two whole trees). The step's scheduled tokens per request are ``_mixed_step_tokens(cut)``."""
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.graphs import TreeStepBuffers
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.staging import StepStaging
    from ddtree.vllm.step import TreeStore

    cpu = torch.device("cpu")
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=6, draft_len=3, top_k=None)
    runner.drafter = SimpleNamespace(store=TreeStore(6), draft_len=3, top_k=4)
    lists = _tree_lists(runner.drafter.store, ["a", "b"])
    runner.input_batch = SimpleNamespace(req_ids=["p", "a", "b"], num_computed_tokens_cpu=np.array([0, 20, 30]))
    runner.num_decode_draft_tokens = SimpleNamespace(np=np.array([-1, 6, 4 if cut else 6]))
    runner._ddtree_conv_window = 3
    runner._ddtree_buffers = TreeStepBuffers(cpu, max_requests=4, max_tokens=40, tree_size=7, conv_width=4)
    runner._ddtree_trees_by_tensors = {}
    runner._ddtree_plan_staging = StepStaging(cpu)
    runner._ddtree_gdn_step = None
    runner._ddtree_device_accept = device_accept
    runner.use_async_scheduling, runner._ddtree_early_token_index = False, None
    runner._ddtree_full_graph, runner._ddtree_step_graphs_on, runner._ddtree_walk_graphs = None, True, None
    runner._ddtree_plan_graphs, runner.device = None, cpu
    runner.ddtree_stats = DDTreeStats(3)
    total = int(_mixed_step_tokens(cut).sum())
    runner.positions = torch.arange(total)
    runner.uses_mrope = mrope
    if mrope:
        runner.mrope_positions = SimpleNamespace(gpu=torch.stack([torch.arange(total) * k for k in (1, 2, 3)]))
    scheduled = {"a": lists[0], "b": lists[1][:4] if cut else lists[1]}  # b's tree cut to 4 drafts by the scheduler
    output = SimpleNamespace(
        total_num_scheduled_tokens=total, scheduled_spec_decode_tokens=scheduled, scheduled_new_reqs=[]
    )
    return runner, scheduled, output


def _mixed_step_tokens(cut=True):
    """Scheduled tokens of ``_mixed_hybrid_step``'s requests: a 5-token prefill, a whole tree of 7, then b's tree (cut
    to 5, or whole)."""
    return np.array([5, 7, 5 if cut else 7])


@pytest.mark.parametrize("mrope", [False, True])
def test_prepare_lays_out_a_mixed_hybrid_step_in_the_persistent_buffers(mrope):
    """A prefill, a whole tree and a cut tree in one step: the Rust layout lands in the fixed-address buffers,
    positions become start + depth for tree tokens only, the published step names the tree and other tokens."""
    from ddtree.vllm import context
    from ddtree.vllm.step import TreeStore, plan_verify

    runner, scheduled, output = _mixed_hybrid_step(mrope)
    try:
        runner._ddtree_prepare(output, np.array([5, 7, 5]), "indices", "metadata", 3)
        plan = runner._ddtree_plan
        runner.drafter.store = TreeStore(6)
        _tree_lists(runner.drafter.store, ["a", "b"])
        want = plan_verify(
            runner.drafter.store, ["p", "a", "b"], np.array([0, 20, 30]), np.array([5, 7, 5]), scheduled,
            conv_window=3, words=1,
        )  # fmt: skip
        depths = np.concatenate([want.trees.depths[:7], want.trees.depths[7:]])
        expected = np.arange(17)
        expected[5:12], expected[12:17] = 20 + depths[:7], 30 + depths[7:]
        assert runner.positions.tolist() == expected.tolist()
        assert runner._ddtree_flat_positions.tolist() == list(range(17))
        buffers = runner._ddtree_buffers
        assert buffers.row_start[:3].tolist() == [-1, 0, 7]
        assert torch.equal(buffers.ancestor_bits[:12], torch.from_numpy(want.ancestor_bits))
        assert torch.equal(buffers.conv_index[:12], torch.from_numpy(want.conv_index))
        step = context.published()
        assert (step.attention.num_reqs, step.attention.num_tokens) == (3, 17)
        assert step.gdn.token_index.tolist() == list(range(5, 17)) and step.gdn.other_index.tolist() == list(range(5))
        assert runner._ddtree_gdn_step is step.gdn and runner._ddtree_whole_tree_tokens == 0
        assert plan.logit_rows_gpu.tolist() == list(range(1, 13)) and plan.batch_index_gpu.tolist() == [1, 2]
        if mrope:
            sections = runner.mrope_positions.gpu
            for k in range(3):
                roots = np.repeat([5 * (k + 1), 12 * (k + 1)], [7, 5])
                assert sections[k, 5:17].tolist() == (roots + depths).tolist()
                assert sections[k, :5].tolist() == [i * (k + 1) for i in range(5)]
    finally:
        context.withdraw()


def test_a_first_decode_vllm_padded_with_placeholders_verifies_a_filler_tree_in_synchronous_scheduling():
    """vLLM pads a request's first decode to a whole tree of placeholders (beside running requests; on 0.33 also
    alone, after a prefix hit that leaves one token): under synchronous scheduling too it verifies a filler tree,
    not an error (the engine would stop); real drafts without a proposal are still refused."""
    from ddtree.vllm import context
    from ddtree.vllm.step import PLACEHOLDER, DraftMismatchError

    runner, scheduled, output = _mixed_hybrid_step()
    assert runner.use_async_scheduling is False
    runner.input_batch.req_ids = ["p", "a", "n"]  # n: never proposed for (its prefill just ended)
    runner.num_decode_draft_tokens.np[:] = [-1, 6, 6]
    output.scheduled_spec_decode_tokens = {"a": scheduled["a"], "n": [PLACEHOLDER] * 6}
    output.total_num_scheduled_tokens = 19
    runner.positions = torch.arange(19)
    runner.input_ids = SimpleNamespace(gpu=torch.full((19,), -1, dtype=torch.int32))  # vLLM's placeholders
    runner.input_ids.gpu[:7] = 1000
    try:
        runner._ddtree_prepare(output, np.array([5, 7, 7]), "indices", "metadata", 3)
        plan = runner._ddtree_plan
        assert plan.batch_index.tolist() == [1, 2] and plan.num_filler_trees == 1 and plan.num_cut_trees == 0
        assert plan.num_tree_tokens == 14
        # The filler's drafts written over n's placeholders (its root, vLLM's sampled token, left as it is).
        assert runner.input_ids.gpu[13:19].tolist() == plan.draft_tokens[-6:].tolist()
        assert (runner.input_ids.gpu[13:19] >= 0).all()
    finally:
        context.withdraw()
    runner.drafter.store.take("a")
    output.scheduled_spec_decode_tokens = {"n": [5, 6]}  # real drafts without a record: a bug, refused
    runner.input_batch.req_ids = ["n"]
    runner.num_decode_draft_tokens.np[:] = [2, -1, -1]
    output.total_num_scheduled_tokens = 3
    with pytest.raises(DraftMismatchError, match="no DDTree proposal"):
        runner._ddtree_prepare(output, np.array([3]), "indices", "metadata", 1)


def test_the_gdn_commit_reads_the_step_the_runner_kept_after_the_forward_withdrew_it(monkeypatch):
    from ddtree.vllm import context, runner as runner_module
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    committed = []
    monkeypatch.setattr(runner_module, "commit_pending", lambda step, plan: committed.append((step, plan.paths)))
    monkeypatch.setattr(runner_module, "commit_layer", lambda pending, plan: committed.append((pending, plan.paths)))
    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_conv_window, runner._ddtree_full_graph, runner._ddtree_commit_graphs = 3, None, None
    runner._ddtree_commit_graphs_on = False  # DDTREE_COMMIT_GRAPHS=0
    step = SimpleNamespace(node_offsets="offsets", pending={"layer.0": "recorded"})
    runner._ddtree_gdn_step = step
    context.withdraw()  # the forward is over: only the runner's reference remains
    gpu = {"paths": "paths", "path_lengths": "lengths", "commit_conv_index": "conv"}
    runner._ddtree_commit_gdn(gpu)
    assert committed == [(step, "paths")] and runner._ddtree_gdn_step is None
    # A FULL replay commits what the graph's capture recorded, layer by layer.
    runner._ddtree_gdn_step, runner._ddtree_full_graph = step, (130, 2)
    runner._ddtree_captured = SimpleNamespace(replayed=lambda graph: {"layer.0": f"captured-{graph[0]}-{graph[1]}"})
    runner._ddtree_commit_gdn(gpu)
    assert committed[-1] == ("captured-130-2", "paths")
    # Commit graphs (the default) need CUDA graphs: off a GPU the commit stays layer by layer.
    runner._ddtree_commit_graphs_on = True
    runner.device = torch.device("cpu")
    runner._ddtree_gdn_step = step
    runner._ddtree_commit_gdn(gpu)
    assert committed[-1] == ("captured-130-2", "paths") and len(committed) == 3 and runner._ddtree_commit_graphs is None
    # A hybrid step without a GDN step is a bug, said as such.
    with pytest.raises(RuntimeError, match="without a GDN tree step"):
        runner._ddtree_commit_gdn(gpu)


def test_stats_count_cut_trees_against_their_proposal_and_steps_by_budget():
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.step import TreeStore, accept, plan_verify

    rng = np.random.default_rng(1)
    store = TreeStore(budget=10)
    lp = rng.normal(size=(2, 5, 4)).astype(np.float32)
    lp = -np.sort(-(lp - np.log(np.exp(lp).sum(-1, keepdims=True) + 1.0)), axis=-1)  # top-k order, below 0
    ids = np.tile(np.arange(4, dtype=np.int32), (2, 5, 1))
    lists = store.propose(["a", "b"], lp, ids, budget=6)  # a schedule's smaller budget: whole trees of 7 nodes
    stats = DDTreeStats(5)
    plan = plan_verify(store, ["a", "b"], np.array([3, 3]), np.array([7, 4]), {"a": lists[0], "b": lists[1][:3]})
    stats.observe(plan, accept(plan, np.zeros(plan.num_tokens, dtype=np.int64), 7))
    summary = stats.summary()
    assert summary["trees"] == 2 and summary["partial_trees"] == 1  # b was cut; a is whole at budget 6
    assert summary["steps_by_budget"] == {6: 1}


def _inside_a_timed_block():
    return sum(range(10))


def _outside_every_timed_block():
    return sum(range(10))


def _inside_another_part():
    return sum(range(10))


def test_the_host_profile_covers_ddtrees_timed_blocks_only_and_stops_when_read():
    from ddtree.vllm.stats import DDTreeStats

    stats = DDTreeStats(4)
    with pytest.raises(RuntimeError, match="no host profile was started"):
        stats.stop_host_profile()
    stats.start_host_profile()
    stats.steps += 3  # three verify steps inside the window
    with stats.timed("plan"):
        with stats.timed("plan"):  # a nested block leaves the outer one profiled
            _inside_a_timed_block()
        _inside_a_timed_block()
    _outside_every_timed_block()
    with stats.timed("accept"):
        _inside_another_part()
    text = stats.stop_host_profile()
    assert text.startswith("ddtree's timed host work, 3 verify steps")
    assert "_inside_a_timed_block" in text and "_outside_every_timed_block" not in text
    # One profile per part, each by time with callees, then by own time: a function shows under its part only.
    accept, plan = text.split("=== plan: by cumulative time ===")
    assert "=== accept: by cumulative time ===" in accept and "=== accept: by tottime time ===" in accept
    assert "_inside_another_part" in accept and "_inside_a_timed_block" not in accept
    assert "=== plan: by tottime time ===" in plan and "_inside_another_part" not in plan
    assert stats.host_seconds["plan"] > 0 and stats.host_profile is None
    with stats.timed("plan"):  # profiling stopped: a plain block again
        _outside_every_timed_block()
    stats.start_host_profile()
    assert "_outside_every_timed_block" not in stats.stop_host_profile()


def test_the_host_pieces_switch_reaches_the_runners_statistics_through_the_worker():
    """``llm.collective_rpc("ddtree_host_pieces", args=(on,))``: the worker hands it to the runner, which turns the
    pieces' timers on or off and says what they were."""
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.worker import DDTreeWorker

    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_stats = DDTreeStats(3)
    worker = object.__new__(DDTreeWorker)
    worker.model_runner = runner
    with runner.ddtree_stats.detail("plan: before"):
        pass
    assert worker.ddtree_host_pieces(True) is False and runner.ddtree_stats.detail_on
    with runner.ddtree_stats.detail("plan: x"):
        pass
    assert worker.ddtree_host_pieces(False) is True and not runner.ddtree_stats.detail_on
    assert list(runner.ddtree_stats.detail_seconds) == ["plan: x"]  # timed only while on


def test_the_host_profile_counts_the_garbage_collections_inside_timed_blocks_only():
    import gc

    from ddtree.vllm.stats import DDTreeStats

    stats = DDTreeStats(4)
    callbacks = len(gc.callbacks)
    stats.start_host_profile()
    gc.collect(2)  # outside every block: not counted
    with stats.timed("stats"):
        gc.collect(1)
    text = stats.stop_host_profile()
    assert "garbage collections inside the timed blocks: gen0 0, gen1 1, gen2 0;" in text
    assert len(gc.callbacks) == callbacks  # the window's callback is gone with it
    stats.start_host_profile()
    stats.start_host_profile()  # a window left open is ended, not leaked
    stats.stop_host_profile()
    assert len(gc.callbacks) == callbacks


def test_steps_that_run_a_graph_shape_first_keep_their_host_seconds_apart():
    """A step in which a step graph ran a shape for the first time (a capture: tens of ms once) has its host
    seconds moved out of the per-step parts, which then average the steady steps only; the launches with them."""
    from ddtree.vllm.stats import DDTreeStats

    stats = DDTreeStats(3)
    plan = SimpleNamespace(num_nodes=np.array([4]), proposed_budgets=np.array([3]), num_filler_trees=0)

    def step(first_runs, plan_s, launch_s):
        stats.close_step(first_runs)
        stats.host_seconds["plan"] = stats.host_seconds.get("plan", 0.0) + plan_s
        stats.graph_launch_seconds["walk"] = stats.graph_launch_seconds.get("walk", 0.0) + launch_s
        stats.detail_seconds["plan: upload"] = stats.detail_seconds.get("plan: upload", 0.0) + plan_s / 2
        stats.observe_counts(plan, np.array([1]))

    stats.detail_seconds["plan: upload"] = 0.5  # a start-up capture's piece: no step's, dropped
    stats.close_step(2)  # start-up captures (DDTREE_PRECAPTURE): first runs without a step's host work, no step
    step(2, 0.001, 0.0001)  # steady
    step(2, 0.020, 0.0050)  # ran a new shape: first_runs goes 2 -> 3 before the next step starts
    step(3, 0.001, 0.0001)
    step(3, 0.001, 0.0001)
    stats.close_step(3)
    summary = stats.summary()
    assert summary["verify_steps"] == 4 and summary["first_run_steps"] == 1 and summary["steady_verify_steps"] == 3
    assert summary["host_ms_per_verify_step"]["plan"] == pytest.approx(1.0)
    assert summary["graph_launch_ms_per_verify_step"]["walk"] == pytest.approx(0.1)
    assert summary["host_detail_ms_per_verify_step"]["plan: upload"] == pytest.approx(0.5)  # the steady steps'
    assert summary["first_run_host_ms"] == {"plan": pytest.approx(20.0)}


def test_a_summary_closes_the_last_step_so_two_summaries_bracket_their_steps(monkeypatch):
    """Read between generates, the summary puts the last step's host seconds where they belong (a first run's
    apart) without waiting for the next step to start."""
    from ddtree.vllm.counts import PathRing
    from ddtree.vllm.graphs import ShapeGraphs
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats

    monkeypatch.setattr(ShapeGraphs, "first_runs", 0)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_stats = DDTreeStats(3)
    runner._ddtree_counts = PathRing(torch.device("cpu"), 2, width=5)
    runner.use_async_scheduling = True
    plan = SimpleNamespace(num_nodes=np.array([4]), proposed_budgets=np.array([3]), num_filler_trees=0)
    runner.ddtree_stats.close_step(ShapeGraphs.first_runs)  # the step starts
    ShapeGraphs.first_runs += 1  # ... meets a new shape
    runner.ddtree_stats.host_seconds["plan"] = 0.02
    runner.ddtree_stats.observe_counts(plan, np.array([1]))
    summary = runner.ddtree_summary()  # no step after it
    assert summary["first_run_steps"] == 1 and summary["first_run_host_ms"] == {"plan": pytest.approx(20.0)}
    assert summary["host_ms_per_verify_step"] == {"plan": 0.0}
    assert runner.ddtree_summary()["first_run_steps"] == 1  # read again: nothing moved twice


def _prefixes(tree):
    """Each node's token prefix from the root (a tuple), in node order."""
    out = [()]
    for i in range(1, len(tree)):
        out.append(out[tree.parents[i]] + (int(tree.tokens[i - 1]),))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_stats_say_what_smaller_trees_would_have_accepted(seed):
    """Per smaller budget c, the accepted drafts the statistics report equal those of the tree of budget c built
    from the same proposal and walked with the same target tokens (matched by prefix, not by node number). Cut
    trees are left out. ``auto``'s estimate counts the same, its own budget included."""
    import ddtree
    from ddtree.vllm.auto_budget import AutoBudget
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.step import TreeStore, accept, plan_verify

    rng = np.random.default_rng(seed)
    depth, width, budget = 6, 5, 40
    ids = np.stack([rng.permutation(50)[:width] for _ in range(3 * depth)]).reshape(3, depth, width).astype(np.int32)
    lp = np.sort(rng.normal(size=(3, depth, width)) * 1.5, axis=-1)[..., ::-1]
    lp = (lp - np.log(np.exp(lp).sum(-1, keepdims=True))).astype(np.float32)
    store = TreeStore(budget=budget)
    lists = store.propose(["a", "b", "c"], lp, ids)
    scheduled = {"a": lists[0], "b": lists[1], "c": lists[2][:7]}  # c cut by the scheduler: not counted
    plan = plan_verify(store, ["a", "b", "c"], np.array([4, 4, 4]), np.array([41, 41, 8]), scheduled)
    # The target's token at each node: often one of its children's (deep paths through siblings), else a miss.
    target = np.full(plan.num_tokens, 999, dtype=np.int64)
    trees = plan.trees
    prefix_token = {}
    for j in range(3):
        tree = trees[j]
        lo = int(trees.node_offsets[j])
        for i, prefix in enumerate(_prefixes(tree)):
            children = [k for k in range(1, len(tree)) if tree.parents[k] == i]
            if children and rng.random() < 0.85:
                target[lo + i] = tree.tokens[rng.choice(children) - 1]
            prefix_token[(j, prefix)] = target[lo + i]
    stats = DDTreeStats(depth, smaller_budgets=(8, 16, 32))
    stats.auto = AutoBudget((8, 16, 32, 40), max_num_seqs=4)  # ddtree_budget "auto" counts the same trees
    stats.observe(plan, accept(plan, target, depth + 1))
    summary = stats.what_if.summary()["budgets"]
    stats.auto.acceptance.close_window()
    auto = stats.auto.acceptance.acceptance_length(min_trees=1)
    for small in (8, 16, 32):
        kept = []
        for j in range(2):  # the whole trees
            tree = ddtree.build_tree(lp[j], ids[j], small)
            path, _ = ddtree.accept(tree, np.array([prefix_token[(j, p)] for p in _prefixes(tree)]))
            kept.append(len(path) - 1)
        assert summary[small]["trees"] == 2
        assert summary[small]["acceptance_length"] == pytest.approx(1.0 + sum(kept) / 2) == auto[small]
    own = accept(plan, target, depth + 1).path_lengths[:2] - 1
    assert summary[8]["acceptance_length_at_own_budget"] == pytest.approx(1.0 + own.sum() / 2) == auto[40]
    assert summary[32]["acceptance_length"] <= summary[32]["acceptance_length_at_own_budget"]


def test_filler_trees_are_not_counted_as_what_smaller_trees_would_accept():
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.step import PLACEHOLDER, TreeStore, accept, plan_verify

    store = TreeStore(budget=20)
    scheduled = {"a": [PLACEHOLDER] * 20}  # asynchronous scheduling: placeholders, the drafter did not propose
    plan = plan_verify(store, ["a"], np.array([4]), np.array([21]), scheduled, unproposed=(4, 5))
    assert plan.num_filler_trees == 1 and plan.filler_mask.tolist() == [True]
    stats = DDTreeStats(4, smaller_budgets=(8,))
    stats.observe(plan, accept(plan, np.zeros(plan.num_tokens, dtype=np.int64), 5))  # token 0: the filler's own
    assert stats.trees == 1 and stats.accepted > 0 and stats.what_if.summary() == {"budgets": {}, "chain": {}}


def test_what_if_counts_a_systematic_sample_of_the_steps():
    from ddtree.vllm.stats import WHAT_IF_EVERY, DDTreeStats
    from ddtree.vllm.step import TreeStore, accept, plan_verify

    stats = DDTreeStats(4, smaller_budgets=(8,))
    rng = np.random.default_rng(0)
    lp = np.sort(rng.normal(size=(1, 4, 5)), axis=-1)[..., ::-1]
    lp = (lp - np.log(np.exp(lp).sum(-1, keepdims=True))).astype(np.float32)
    steps = 2 * WHAT_IF_EVERY + 1
    for _ in range(steps):
        store = TreeStore(budget=20)
        lists = store.propose(["a"], lp, np.tile(np.arange(5, dtype=np.int32), (1, 4, 1)))
        plan = plan_verify(store, ["a"], np.array([4]), np.array([21]), {"a": lists[0]})
        stats.observe(plan, accept(plan, np.zeros(plan.num_tokens, dtype=np.int64), 5))
    summary = stats.what_if.summary()
    assert stats.steps == steps and summary["chain"]["trees"] == 3 and summary["budgets"][8]["trees"] == 3


def test_what_if_samples_device_planned_steps_more_sparsely_since_their_trees_are_built_to_count_them():
    import copy

    from ddtree.vllm.stats import WHAT_IF_EVERY, WHAT_IF_EVERY_DEVICE_PLANNED, DDTreeStats
    from ddtree.vllm.step import TreeStore, accept, plan_verify

    assert WHAT_IF_EVERY_DEVICE_PLANNED > WHAT_IF_EVERY
    rng = np.random.default_rng(1)
    lp = np.sort(rng.normal(size=(1, 4, 5)), axis=-1)[..., ::-1]
    lp = (lp - np.log(np.exp(lp).sum(-1, keepdims=True))).astype(np.float32)
    store = TreeStore(budget=20)
    lists = store.propose(["a"], lp, np.tile(np.arange(5, dtype=np.int32), (1, 4, 1)))
    host_plan = plan_verify(store, ["a"], np.array([4]), np.array([21]), {"a": lists[0]})
    walked = accept(host_plan, np.zeros(host_plan.num_tokens, dtype=np.int64), 5)

    class CountedBuild:  # a device-planned step's trees: built on the host only when something reads them
        builds = 0
        draft_depth = 4

        def build(self):
            CountedBuild.builds += 1
            return host_plan.trees, host_plan.top1_tokens

    stats = DDTreeStats(4, smaller_budgets=(8,))
    steps = 2 * WHAT_IF_EVERY_DEVICE_PLANNED + 1
    for _ in range(steps):
        plan = copy.copy(host_plan)
        plan.trees, plan.top1_tokens, plan.deferred_trees = None, None, CountedBuild()
        stats.observe(plan, walked)
    summary = stats.what_if.summary()
    assert stats.steps == steps and CountedBuild.builds == 3 and summary["chain"]["trees"] == 3


def test_smaller_budgets_are_a_ladder_below_the_largest_with_the_schedules():
    from ddtree.vllm.config import DDTreeConfig, smaller_budgets

    assert smaller_budgets(DDTreeConfig(budget=64, draft_len=15, top_k=None)) == (7, 15, 31, 63)
    assert smaller_budgets(DDTreeConfig(budget=63, draft_len=15, top_k=None)) == (7, 15, 31)
    schedule = ((1, 100), (8, 24))
    assert smaller_budgets(DDTreeConfig(budget=100, draft_len=15, top_k=None, budget_schedule=schedule)) == (
        7,
        15,
        24,
        31,
        63,
    )
    assert smaller_budgets(DDTreeConfig(budget=7, draft_len=7, top_k=None)) == ()


def test_a_device_walked_step_equals_the_host_walk_and_counts_the_same():
    """DDTREE_DEVICE_ACCEPT: the plan uploads the device walk's inputs, the walk gives what the Rust acceptance
    gives, and the statistics count the step once its copy has landed."""
    from ddtree.vllm import context
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.step import accept

    runner, _, output = _mixed_hybrid_step(device_accept=True)
    from ddtree.vllm.counts import PathRing

    runner.max_num_reqs, runner.device = 4, torch.device("cpu")
    runner._ddtree_counts = PathRing(runner.device, 4, width=3 + 2)
    runner.ddtree_stats = DDTreeStats(3)
    try:
        runner._ddtree_prepare(output, np.array([5, 7, 5]), "indices", "metadata", 3)
    finally:
        context.withdraw()
    plan = runner._ddtree_plan
    assert plan.device_trees is not None
    assert runner.ddtree_device_accepts(plan)
    runner._ddtree_device_accept = False  # switched off after planning (an in-process A/B): the host walks
    assert not runner.ddtree_device_accepts(plan)
    runner._ddtree_device_accept = True
    target = _deep_targets(plan)
    host = accept(plan, target, 7)
    gpu = runner.ddtree_accept_on_device(plan, torch.from_numpy(target), 7)
    assert runner._ddtree_accept is None and runner._ddtree_accept_gpu is gpu
    assert np.array_equal(gpu["output_tokens"].numpy(), host.output_tokens)
    assert np.array_equal(gpu["context_order"].numpy(), host.context_order)
    assert np.array_equal(gpu["commit_conv_index"].numpy(), host.commit_conv_index)
    assert runner._ddtree_send_paths(gpu, plan) == []  # (the walk wrote the ring; copied every PATH_RING_SLOTS-th step)
    runner._ddtree_count_device_steps(*runner._ddtree_counts.landed(wait=True))
    expected = DDTreeStats(3)
    expected.observe(plan, host)
    expected.device_accept_steps = 1
    counted = {k: v for k, v in runner.ddtree_stats.summary().items() if k != "host_ms_per_verify_step"}
    assert counted == {k: v for k, v in expected.summary().items() if k != "host_ms_per_verify_step"}
    assert runner.ddtree_stats.accepted > 0
    runner._ddtree_count_device_steps(*runner._ddtree_counts.landed(wait=True))  # nothing counted twice
    assert runner.ddtree_stats.steps == 1 and runner.ddtree_stats.device_accept_steps == 1

    # A step a FULL graph replayed walks through the walk graphs (a stand-in capture on CPU): the first walk of a
    # shape eagerly, the next one by replay, on that step's own target tokens.
    from ddtree.vllm.graphs import WalkGraphs

    runner._ddtree_full_graph, runner._ddtree_step_graphs_on = (12, 2), True
    runner._ddtree_walk_graphs = WalkGraphs(lambda work: work)
    for rounds, target_now in enumerate((target, np.full_like(target, 999), target)):
        walked = runner.ddtree_accept_on_device(plan, torch.from_numpy(target_now), 7)
        want = accept(plan, target_now, 7)
        assert np.array_equal(walked["output_tokens"].numpy(), want.output_tokens)
        assert np.array_equal(walked["context_order"].numpy(), want.context_order)
        assert runner.ddtree_stats.walk_graph_steps == rounds  # the first walk ran eagerly, then each replayed
    runner._ddtree_step_graphs_on = False  # DDTREE_STEP_GRAPHS=0: op by op
    runner.ddtree_accept_on_device(plan, torch.from_numpy(target), 7)
    assert runner.ddtree_stats.walk_graph_steps == 2
    # A step still in flight when the summary is read is counted then.
    runner._ddtree_send_paths(gpu, plan)
    runner.use_async_scheduling = False
    summary = runner.ddtree_summary()
    assert summary["device_accept_steps"] == 2 and summary["verify_steps"] == 2 and not summary["async_scheduling"]


def _deep_targets(plan) -> np.ndarray:
    """Each node's target token: the first child's draft token where it has one (deep acceptance), else a miss."""
    target = np.full(plan.num_tree_tokens, 999, dtype=np.int64)
    trees = plan.trees
    for j in range(len(trees.node_offsets) - 1):
        lo = int(trees.node_offsets[j])
        for i in range(int(trees.node_offsets[j + 1]) - 1, lo, -1):  # later children first: the first one wins
            target[lo + trees.parents[i]] = trees.tokens[trees.token_offsets[j] + i - lo - 1]
    return target


def _device_walked_mixed_step(cut: bool):
    """``_mixed_hybrid_step`` prepared with the device walk's inputs and a stand-in walk graph capture (each replay
    runs the work again), DDTREE_MIXED_WALK_GRAPHS on over a token budget of 64; returns the runner and its plan."""
    from ddtree.vllm import context
    from ddtree.vllm.counts import PathRing
    from ddtree.vllm.graphs import WalkGraphs

    runner, _, output = _mixed_hybrid_step(device_accept=True, cut=cut)
    runner.max_num_reqs, runner.device = 4, torch.device("cpu")
    runner._ddtree_counts = PathRing(runner.device, 4, width=3 + 2)
    try:
        runner._ddtree_prepare(output, _mixed_step_tokens(cut), "indices", "metadata", 3)
    finally:
        context.withdraw()
    runner._ddtree_walk_graphs = WalkGraphs(lambda work: work, runner._ddtree_counts)
    runner._ddtree_mixed_walk_graphs, runner.max_num_tokens = True, 64
    return runner, runner._ddtree_plan


def test_a_mixed_step_of_whole_trees_walks_through_one_walk_graph_whatever_its_prefill():
    """DDTREE_MIXED_WALK_GRAPHS: a step with a prefill beside trees of one size (not a FULL graph's) walks through
    the walk graphs, its first walk eagerly, then by replay, also when the prefill beside the trees is longer (the
    drafter's row order is laid out over the scheduler's token budget, so the step's own token count is not part of
    the graph's shape); the chain rows, the commit's conv rows and the first ``num_tokens`` rows of the order (what
    the drafter reads) equal the host walk's every time."""
    import copy

    from ddtree.vllm.step import accept

    runner, plan = _device_walked_mixed_step(cut=False)
    assert plan.num_tokens == 19 and runner._ddtree_full_graph is None
    longer = copy.copy(plan)  # the same trees after a prefill three tokens longer (its order: identity there)
    longer.num_tokens += 3
    target = _deep_targets(plan)
    for rounds, (step, target_now) in enumerate([(plan, target), (plan, np.full_like(target, 999)), (longer, target)]):
        walked = runner.ddtree_accept_on_device(step, torch.from_numpy(target_now), 7)
        want = accept(step, target_now, 7)
        assert np.array_equal(walked["output_tokens"].numpy(), want.output_tokens)
        assert np.array_equal(walked["commit_conv_index"].numpy(), want.commit_conv_index)
        order = walked["context_order"]
        assert order.shape[0] == 64
        assert np.array_equal(order[: step.num_tokens].numpy(), want.context_order)
        assert runner.ddtree_stats.walk_graph_steps == rounds == runner.ddtree_stats.mixed_walk_graph_steps
        assert runner._ddtree_walk_replayed == (rounds > 0)
    runner._ddtree_mixed_walk_graphs = False  # off: op by op, over the step's own tokens
    walked = runner.ddtree_accept_on_device(plan, torch.from_numpy(target), 7)
    assert walked["context_order"].shape[0] == plan.num_tokens and runner.ddtree_stats.walk_graph_steps == 2


def test_mixed_steps_placed_op_by_op_step_after_step_replay_the_one_graph_their_shape_captured():
    """In an engine every mixed step is prepared anew (new proposals, the placement op by op): the walk's inputs
    must sit where the shape's graph reads them, so the second step on replays the first one's graph (a new tensor
    a step moved every key: four graphs captured, each a device sync, then copies into a fifth)."""
    from ddtree.vllm import context
    from ddtree.vllm.counts import PathRing
    from ddtree.vllm.graphs import WalkGraphs
    from ddtree.vllm.step import accept

    runner, _, output = _mixed_hybrid_step(device_accept=True, cut=False)
    runner.max_num_reqs, runner.device = 4, torch.device("cpu")
    runner._ddtree_counts = PathRing(runner.device, 4, width=3 + 2)
    captures = []

    def capture(work):
        captures.append(work)
        return work

    runner._ddtree_walk_graphs = WalkGraphs(capture, runner._ddtree_counts)
    runner._ddtree_mixed_walk_graphs, runner.max_num_tokens = True, 64
    for step in range(6):
        lists = _tree_lists(runner.drafter.store, ["a", "b"], seed=step)  # the proposals after each engine step
        output.scheduled_spec_decode_tokens = {"a": lists[0], "b": lists[1]}
        try:
            runner._ddtree_prepare(output, _mixed_step_tokens(cut=False), "indices", "metadata", 3)
        finally:
            context.withdraw()
        plan = runner._ddtree_plan
        target = _deep_targets(plan)
        walked = runner.ddtree_accept_on_device(plan, torch.from_numpy(target), 7)
        want = accept(plan, target, 7)
        assert np.array_equal(walked["output_tokens"].numpy(), want.output_tokens)
        assert np.array_equal(walked["context_order"][: plan.num_tokens].numpy(), want.context_order)
        assert runner._ddtree_walk_replayed == (step > 0)
    assert len(captures) == 1 and runner._ddtree_walk_graphs.copied_walks == 0
    assert runner.ddtree_stats.mixed_walk_graph_steps == 5


def test_mixed_walk_graphs_need_the_switch_and_an_engine_with_cuda_graphs(monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    wanted = DDTreeGPUModelRunner._ddtree_mixed_walk_graphs_wanted
    monkeypatch.delenv("DDTREE_MIXED_WALK_GRAPHS", raising=False)
    assert wanted(CUDAGraphMode.FULL_AND_PIECEWISE) and wanted(CUDAGraphMode.FULL)  # on by default
    assert not wanted(CUDAGraphMode.NONE) and not wanted(None)  # enforce_eager: no graphs of ddtree's either
    # PIECEWISE alone: no step is a FULL graph's, so every tree step would walk over the token budget: op by op.
    assert not wanted(CUDAGraphMode.PIECEWISE)
    monkeypatch.setenv("DDTREE_MIXED_WALK_GRAPHS", "0")
    assert not wanted(CUDAGraphMode.FULL_AND_PIECEWISE) and not wanted(CUDAGraphMode.FULL)
    monkeypatch.setenv("DDTREE_MIXED_WALK_GRAPHS", "1")
    assert wanted(CUDAGraphMode.FULL_AND_PIECEWISE) and not wanted(CUDAGraphMode.NONE)


def _mixed_shape_plan(num_nodes, proposed, num_tokens):
    """What ``_ddtree_mixed_walk_shape_allowed`` reads of a plan."""
    return SimpleNamespace(
        num_nodes=np.asarray(num_nodes, dtype=np.int64),
        proposed_budgets=np.asarray(proposed, dtype=np.int64),
        num_tokens=num_tokens,
    )


def test_mixed_walk_graphs_take_whole_trees_beside_a_prefill_in_a_bounded_number_of_shapes():
    """A graph per tree count and size is worth its memory only for steps that repeat: whole trees of one size
    beside a prefill. Trees cut near max_model_len (a new size nearly every step), a step without a prefill, and
    shapes past MAX_MIXED_WALK_SHAPES walk op by op; a shape given graphs keeps them."""
    from ddtree.vllm.runner import MAX_MIXED_WALK_SHAPES, DDTreeGPUModelRunner

    runner = DDTreeGPUModelRunner.__new__(DDTreeGPUModelRunner)
    allowed = runner._ddtree_mixed_walk_shape_allowed
    assert allowed(_mixed_shape_plan([16, 16], [15, 15], 32 + 5))  # two whole trees and a 5-token prefill
    assert not allowed(_mixed_shape_plan([16, 16], [15, 15], 32))  # no prefill beside them
    assert not allowed(_mixed_shape_plan([9, 9], [15, 15], 18 + 5))  # both cut alike near the end
    assert not allowed(_mixed_shape_plan([37], [63], 37 + 1))  # one cut tree
    assert not allowed(_mixed_shape_plan([16, 9], [15, 15], 25 + 5))  # two sizes
    assert not allowed(_mixed_shape_plan([], [], 5))  # a prefill alone
    for count in range(2, MAX_MIXED_WALK_SHAPES + 1):  # (2 trees of 16 taken above)
        assert allowed(_mixed_shape_plan([16] * (count + 1), [15] * (count + 1), 16 * (count + 1) + 3))
    assert not allowed(_mixed_shape_plan([16] * 20, [15] * 20, 16 * 20 + 3))  # a shape past the bound
    assert allowed(_mixed_shape_plan([16, 16], [15, 15], 32 + 300))  # a shape met before, any prefill


def test_the_statistics_ring_is_read_every_few_steps_under_an_auto_budget():
    """auto's probes alternate budgets every few observed steps: its engine's ring keeps AUTO_PATH_RING_SLOTS
    slots (observed steps a few at a time), any other engine PATH_RING_SLOTS."""
    from ddtree.vllm.runner import AUTO_PATH_RING_SLOTS, PATH_RING_SLOTS, DDTreeGPUModelRunner

    assert AUTO_PATH_RING_SLOTS < PATH_RING_SLOTS
    for auto, slots in ((True, AUTO_PATH_RING_SLOTS), (False, PATH_RING_SLOTS)):
        runner = SimpleNamespace(
            device=torch.device("cpu"), max_num_reqs=4, ddtree_cfg=SimpleNamespace(draft_len=3, auto=auto)
        )
        assert DDTreeGPUModelRunner._ddtree_path_ring(runner).slots == slots


def test_a_mixed_step_with_trees_of_two_sizes_walks_op_by_op():
    """A cut tree beside a whole one: every new mix of sizes would be a new graph, so such a step walks op by op,
    over its own tokens, with the switch on."""
    from ddtree.vllm.step import accept

    runner, plan = _device_walked_mixed_step(cut=True)
    target = _deep_targets(plan)
    for _ in range(2):
        walked = runner.ddtree_accept_on_device(plan, torch.from_numpy(target), 7)
        assert np.array_equal(walked["context_order"].numpy(), accept(plan, target, 7).context_order)
    assert runner.ddtree_stats.walk_graph_steps == 0 and runner._ddtree_walk_graphs.replayed == 0


def _proposers_runner(late: bool, req_ids):
    """What ``DDTreeProposer.propose`` reads of the runner: budget 6, depth 3, the batch's ``req_ids``."""
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.stats import DDTreeStats

    return SimpleNamespace(
        ddtree_late_trees=late,
        ddtree_stats=DDTreeStats(3),
        max_num_reqs=4,
        ddtree_cfg=DDTreeConfig(budget=6, draft_len=3, top_k=None),
        ddtree_budget_for=lambda num_requests: 6,
        input_batch=SimpleNamespace(req_ids=list(req_ids)),
    )


def _late_proposer(runner, store, batch_size, draft_len=3, top_k=4, seed=0):
    """The proposer's late path (``_defer``) on a captured top-K, without a drafter model."""
    from ddtree.vllm.proposer import DDTreeProposer

    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(size=(batch_size * draft_len, 30)) * 2.0)
    values, ids = logits.topk(top_k, dim=-1)
    log_probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).float()
    proposer = object.__new__(DDTreeProposer)
    proposer.store, proposer.runner, proposer.device = store, runner, torch.device("cpu")
    proposer.draft_len, proposer.top_k, proposer.budget = draft_len, top_k, store.budget
    proposer.cfg = runner.ddtree_cfg
    proposer._late_host = None
    proposer._capture = torch.cat([log_probs, ids.to(torch.int32).view(torch.float32)], dim=-1)
    return proposer, log_probs.view(batch_size, draft_len, top_k).numpy(), ids.view(batch_size, draft_len, top_k)


def test_the_deferral_queues_no_copy_where_the_top_k_kernel_wrote_the_hosts_rows():
    """Late trees: where the drafter's top-K kernel wrote the host's rows itself (``_packed_on_host``) the deferral
    only records the event (the rows it finds are the proposal); otherwise it copies the packed top-K there."""
    from ddtree.vllm.step import TreeStore

    runner = _proposers_runner(True, ["a", "b"])
    proposer, log_probs, _ = _late_proposer(runner, TreeStore(6), 2)
    views = proposer._late_views_for(2)
    views[0].copy_(proposer._capture * 0 + 0.5)  # what the kernel wrote, told apart from the device's rows
    proposer._packed_on_host = True
    proposer._defer(["a", "b"], 2)
    assert bool((views[0] == 0.5).all()) and proposer._packed_on_host is False
    assert proposer.store.deferred.host is views[1]
    proposer.store.settle()
    proposer._capture = torch.full((6, 8), 1.5)
    proposer._defer(["a", "b"], 2)  # the flag was spent: this one copies
    assert bool((views[0] == 1.5).all())


def test_a_late_proposal_settles_the_last_one_before_its_drafter_pass_writes_the_host_buffer(monkeypatch):
    """The top-K kernel writes the host's rows during the drafter pass, into the pinned buffer the last deferred
    proposal is read from: that proposal is settled (its rows copied out) before the pass is queued; the new
    proposal's rows are the pass's packed top-K, and the deferral queues no copy."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from ddtree.kernels.draft_top_k import pack_top_k
    from ddtree.vllm.step import TreeStore

    runner = _proposers_runner(True, ["a", "b"])
    store = TreeStore(6)
    proposer, _, _ = _late_proposer(runner, store, 2)
    proposer._defer(["a", "b"], 2)  # the last proposal: deferred, its rows in the pinned buffer
    weight = torch.randn(30, 8, generator=torch.Generator().manual_seed(5))
    proposer.model = SimpleNamespace(compute_logits=lambda hidden: hidden @ weight.T)
    proposer.context_order = proposer.flat_positions = None
    proposer._capturing = False
    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(6))
    seen = []

    def drafter_pass(self, *args, **kwargs):
        seen.append(store.deferred is None)  # settled before the pass
        self._sample_draft_tokens(hidden, None)
        seen.append(self._packed_on_host)

    monkeypatch.setattr(DFlashProposer, "propose", drafter_pass)
    metadata = SimpleNamespace(batch_size=lambda: 2)
    zeros = proposer.propose(3, None, None, None, None, None, metadata, None)
    assert seen == [True, True] and zeros.shape == (2, 6) and proposer._late_target is None
    logits = hidden @ weight.T
    assert torch.equal(proposer._late_host[:6], pack_top_k(logits, *logits.topk(4, dim=-1)))
    assert store.deferred.host is proposer._late_views_for(2)[1] and proposer._packed_on_host is False


def test_the_late_trees_buffer_refuses_a_batch_larger_than_it_was_made_for():
    from ddtree.vllm.step import TreeStore

    runner = _proposers_runner(True, ["a", "b"])
    proposer, _, _ = _late_proposer(runner, TreeStore(6), 2)
    proposer._late_views_for(4)
    with pytest.raises(RuntimeError, match=r"5 requests x 3 positions exceeds the late trees' pinned buffer \(12 rows"):
        proposer._late_views_for(5)


def test_late_trees_write_the_tree_tokens_where_vllm_put_placeholders():
    """DDTREE_LATE_TREES: the proposer returns without building; vLLM schedules placeholders (one tree cut); the
    prepared step is the one trees built at proposal give, with the tree tokens written into the input ids."""
    from ddtree.vllm import context
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.step import PLACEHOLDER, TreeStore

    runner, scheduled_early, output = _mixed_hybrid_step()
    runner.max_num_reqs, runner.ddtree_stats = 4, DDTreeStats(3)
    runner.drafter.store = TreeStore(6)
    proposer, log_probs, ids = _late_proposer(runner, runner.drafter.store, 2)
    zeros = proposer._defer(["a", "b"], 2)
    assert zeros.shape == (2, 6) and not zeros.any()
    assert proposer.last_drafts == [[PLACEHOLDER] * 6] * 2 and proposer._capture is None
    assert runner.drafter.store.deferred is not None  # nothing built yet
    lists = TreeStore(6).propose(["a", "b"], log_probs, ids.numpy().astype(np.int64))
    output.scheduled_spec_decode_tokens = {"a": proposer.last_drafts[0], "b": proposer.last_drafts[1][:4]}
    input_ids = torch.full((17,), -1, dtype=torch.int32)
    input_ids[[5, 12]] = torch.tensor([501, 502], dtype=torch.int32)  # the roots: vLLM's sampled tokens
    runner.input_ids = SimpleNamespace(gpu=input_ids)
    try:
        runner._ddtree_prepare(output, np.array([5, 7, 5]), "indices", "metadata", 3)
    finally:
        context.withdraw()
    assert input_ids[5:17].tolist() == [501, *lists[0], 502, *lists[1][:4]]
    assert input_ids[:5].tolist() == [-1] * 5  # the prefill's tokens are vLLM's
    assert runner.ddtree_stats.late_tree_steps == 1
    # The same step with trees built at proposal: the same layout.
    early, _, early_output = _mixed_hybrid_step()
    early.ddtree_stats = DDTreeStats(3)
    early.drafter.store = TreeStore(6)
    early_lists = early.drafter.store.propose(["a", "b"], log_probs, ids.numpy().astype(np.int64))
    early_output.scheduled_spec_decode_tokens = {"a": early_lists[0], "b": early_lists[1][:4]}
    try:
        early._ddtree_prepare(early_output, np.array([5, 7, 5]), "indices", "metadata", 3)
    finally:
        context.withdraw()
    assert torch.equal(early.positions, runner.positions) and early._ddtree_plan.draft_tokens is None
    for field in ("token_index", "logit_rows", "ancestor_bits", "conv_index"):
        assert np.array_equal(getattr(early._ddtree_plan, field), getattr(runner._ddtree_plan, field)), field
    assert early.ddtree_stats.late_tree_steps == 0


def test_bookkeeping_reads_the_early_copy_of_the_chain_rows(monkeypatch):
    """vLLM's bookkeeping gets the host copy the sampler started (its own read would wait for the drafter), once,
    and only for the tensor it was made from."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    from ddtree.vllm.stats import DDTreeStats

    seen = []
    monkeypatch.setattr(GPUModelRunner, "_bookkeeping_sync", lambda self, so, out, *a: seen.append(out))
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.use_async_scheduling, runner.device, runner.max_num_reqs = False, torch.device("cpu"), 4
    runner._ddtree_output_host = runner._ddtree_output_early = None
    runner.ddtree_stats = DDTreeStats(3)
    rows = torch.tensor([[7, 8, -1], [9, -1, -1]], dtype=torch.int32)
    runner.ddtree_output_to_host(rows)
    output = SamplerOutput(sampled_token_ids=rows, logprobs_tensors=None)
    runner._bookkeeping_sync("scheduler output", output, None, None, 6)
    assert seen[-1].sampled_token_ids is not rows and torch.equal(seen[-1].sampled_token_ids, rows)
    assert output.sampled_token_ids is rows and runner.ddtree_stats.early_output_steps == 1
    runner._bookkeeping_sync("scheduler output", output, None, None, 6)  # used once
    other = torch.zeros(2, 3, dtype=torch.int32)
    runner.ddtree_output_to_host(rows)
    runner._bookkeeping_sync("scheduler output", SamplerOutput(sampled_token_ids=other, logprobs_tensors=None))
    assert seen[-2].sampled_token_ids is rows and seen[-1].sampled_token_ids is other
    assert runner.ddtree_stats.early_output_steps == 1
    runner.use_async_scheduling = True  # vLLM's asynchronous path reads the rows its own way
    runner.ddtree_output_to_host(rows)
    assert runner._ddtree_output_early is None


def test_asynchronous_scheduling_publishes_from_counts_and_places_trees_from_the_gpu_starts(monkeypatch):
    """DDTREE_ASYNC_SCHEDULING: _prepare_inputs publishes the step from vLLM's counts (the metadata builders see
    it); _preprocess then waits for the drafter, builds the trees, fills the published views and writes tokens and
    positions, the positions from the starts vLLM corrected on the GPU (the host's are optimistic)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm import context
    from ddtree.vllm.counts import PathRing
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.staging import StepStaging
    from ddtree.vllm.step import TreeStore

    runner, _, output = _mixed_hybrid_step()
    runner.use_async_scheduling, runner.max_num_reqs = True, 4
    runner.ddtree_stats = DDTreeStats(3)
    runner._ddtree_count_staging, runner._ddtree_late_step = StepStaging(torch.device("cpu")), None
    runner._ddtree_counts = PathRing(torch.device("cpu"), 4, width=5)
    runner.drafter.store = TreeStore(6)
    proposer, log_probs, ids = _late_proposer(runner, runner.drafter.store, 2)
    runner.drafter.draft_len, runner.drafter.top_k = 3, 4
    proposer._defer(["a", "b"], 2)
    lists = TreeStore(6).propose(["a", "b"], log_probs, ids.numpy().astype(np.int64))
    # vLLM's asynchronous scheduler: placeholders for both (b cut to 4), optimistic host starts.
    output.scheduled_spec_decode_tokens = {"a": [-1] * 6, "b": [-1] * 4}
    runner.input_batch.num_computed_tokens_cpu = np.array([0, 20 + 64, 30 + 64])
    runner.input_batch.num_reqs = 3
    flat = torch.cat([torch.arange(5), torch.arange(20, 27), torch.arange(30, 35)])  # from the GPU's true starts
    runner.positions = flat.clone()
    runner.input_ids = SimpleNamespace(gpu=torch.zeros(17, dtype=torch.int32))
    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("indices", "metadata"))
    embedded = []
    monkeypatch.setattr(GPUModelRunner, "_preprocess", lambda self, *a: embedded.append(self.input_ids.gpu.clone()))
    try:
        assert runner._prepare_inputs(output, np.array([5, 7, 5])) == ("indices", "metadata")
        step = context.published()  # what vLLM's metadata builders see: counts only, nothing built yet
        assert runner.drafter.store.deferred is not None and runner._ddtree_plan is None
        assert (step.attention.num_reqs, step.attention.num_tokens) == (3, 17)
        assert step.gdn.token_index.tolist() == list(range(5, 17)) and step.gdn.other_index.tolist() == list(range(5))
        assert step.attention.ancestor_bits.data_ptr() == runner._ddtree_buffers.ancestor_bits.data_ptr()
        assert runner._ddtree_whole_tree_tokens == 0
        runner._preprocess("scheduler output", 17)
        assert context.published() is step and runner._ddtree_gdn_step is step.gdn  # filled, not replaced
    finally:
        context.withdraw()
    plan = runner._ddtree_plan
    assert embedded[0][5:17].tolist() == [0, *lists[0], 0, *lists[1][:4]]  # tree tokens in before embedding
    depths = plan.trees.depths
    assert runner.positions[:5].tolist() == list(range(5))
    assert runner.positions[5:12].tolist() == (20 + depths[:7]).tolist()
    assert runner.positions[12:17].tolist() == (30 + depths[7:]).tolist()
    assert torch.equal(runner._ddtree_flat_positions, flat)  # the drafter's positions: vLLM's flat ones
    assert torch.equal(step.attention.ancestor_bits[:12], torch.from_numpy(plan.ancestor_bits))
    assert step.attention.row_start.tolist() == [-1, 0, 7]
    # A later plan that disagrees with what was published is refused, not verified.
    runner._ddtree_early_token_index = np.arange(3, 15)
    runner.drafter.store = TreeStore(6)
    relists = runner.drafter.store.propose(["a", "b"], log_probs, ids.numpy().astype(np.int64))
    output.scheduled_spec_decode_tokens = {"a": relists[0], "b": relists[1][:4]}
    with pytest.raises(RuntimeError, match="differ from the counts"):
        runner._ddtree_prepare(output, np.array([5, 7, 5]), "indices", "metadata", 3)
    context.withdraw()


@pytest.mark.parametrize("late", [True, False])
def test_propose_defers_or_builds_by_the_runners_setting(monkeypatch, late):
    """DDTreeProposer.propose around vLLM's drafter pass (stubbed): late, it returns zeros and placeholders without
    building; otherwise it waits for the top-K and hands vLLM the trees' tokens. Both give the same trees."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from ddtree.vllm.step import PLACEHOLDER, TreeStore

    runner = _proposers_runner(late, ["a", "b", "x"])
    store = TreeStore(6)
    proposer, log_probs, ids = _late_proposer(runner, store, 2)
    capture = proposer._capture
    proposer.builds_drafts, proposer.context_order, proposer.flat_positions = True, None, None

    def drafter_pass(self, *args, **kwargs):  # vLLM's pass: the proposer's top-K capture is what it leaves
        self._capture = capture

    monkeypatch.setattr(DFlashProposer, "propose", drafter_pass)
    metadata = SimpleNamespace(batch_size=lambda: 2)
    out = proposer.propose(6, None, None, None, None, None, metadata, None)
    want = TreeStore(6).propose(["a", "b"], log_probs, ids.numpy().astype(np.int64))
    assert proposer.last_req_ids == ["a", "b"]
    if late:
        assert not out.any() and proposer.last_drafts == [[PLACEHOLDER] * 6] * 2 and store.deferred is not None
        assert "defer" in runner.ddtree_stats.host_seconds and "build" not in runner.ddtree_stats.host_seconds
    else:
        assert proposer.last_drafts == want and out.tolist() == want and store.deferred is None


def test_the_wait_for_the_last_top_k_copy_is_not_counted_as_host_work(monkeypatch):
    """After a device-planned step the next proposal's deferral first waits for the GPU to land the last top-K's
    copy; like every GPU wait of the step, that wait stays out of ddtree's timed host parts ("defer" here)."""
    import time

    from vllm.v1.spec_decode.dflash import DFlashProposer

    from ddtree.vllm.step import DeferredProposal, TreeStore

    class SlowCopy:  # a CUDA event whose copy lands 50 ms after it is waited for
        def synchronize(self):
            time.sleep(0.05)

        def query(self):
            return False

    runner = _proposers_runner(True, ["a", "b"])
    store = TreeStore(6)
    proposer, _, _ = _late_proposer(runner, store, 2)
    capture = proposer._capture
    host = np.array(capture.view(2, 3, 8).numpy())
    store.defer(["a", "b"], DeferredProposal(host, 4, landed=SlowCopy()), 6)
    proposer.builds_drafts, proposer.context_order, proposer.flat_positions = True, None, None
    monkeypatch.setattr(DFlashProposer, "propose", lambda self, *a, **k: setattr(self, "_capture", capture))
    proposer.propose(6, None, None, None, None, None, SimpleNamespace(batch_size=lambda: 2), None)
    assert store.deferred is not None and store.deferred.landed is None  # the new proposal (CPU: no event)
    assert runner.ddtree_stats.host_seconds["defer"] < 0.025


def test_asynchronous_scheduling_takes_schedules_whose_trees_fill_every_budget():
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_device_accept = runner._ddtree_late_trees = True
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=15, top_k=8, budget_schedule=((1, 64), (8, 16)))
    runner._ddtree_check_async(8)  # 8 candidates at 15 depths fill 64 and 16 nodes
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=3, top_k=2, budget_schedule=((1, 8), (4, 64)))
    with pytest.raises(RuntimeError, match=r"top-K 2 at depth 3 cannot fill \[64\]"):
        runner._ddtree_check_async(2)
    # No top-K given (K = the budget) but a 2-token vocabulary resolves it to 2: only the runner can see that.
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=3, top_k=None)
    with pytest.raises(RuntimeError, match=r"top-K 2 at depth 3 cannot fill \[64\]"):
        runner._ddtree_check_async(2)
    runner._ddtree_late_trees = False
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=15, top_k=8)
    with pytest.raises(RuntimeError, match="late trees"):
        runner._ddtree_check_async(8)


def test_a_whole_tree_steps_plan_replays_on_the_next_steps_upload():
    """The plan's device side of a whole-tree step (layout into the fixed buffers, depth positions, the drafter's
    flat positions) is captured once per step shape and replayed: the replay reads the next step's upload at the
    same addresses (a stand-in capture replays by calling the work) and writes what the plan op by op writes."""
    from ddtree.vllm import context
    from ddtree.vllm.graphs import ShapeGraphs
    from ddtree.vllm.step import TreeStore

    def whole_step(runner, seed):
        runner.drafter.store = TreeStore(6)
        lists = _tree_lists(runner.drafter.store, ["a", "b"], seed=seed)
        runner.input_batch = SimpleNamespace(req_ids=["a", "b"], num_computed_tokens_cpu=np.array([20 + seed, 30]))
        runner.num_decode_draft_tokens = SimpleNamespace(np=np.array([6, 6]))
        runner.positions = torch.arange(14) + 100 * seed
        output = SimpleNamespace(
            total_num_scheduled_tokens=14, scheduled_spec_decode_tokens=dict(zip("ab", lists)), scheduled_new_reqs=[]
        )
        try:
            runner._ddtree_prepare(output, np.array([7, 7]), "indices", "metadata", 2)
        finally:
            context.withdraw()
        buffers = runner._ddtree_buffers
        return [runner.positions.clone(), runner._ddtree_flat_positions.clone(), buffers.ancestor_bits[:14].clone()]

    eager, graphed = _mixed_hybrid_step()[0], _mixed_hybrid_step()[0]
    graphed._ddtree_plan_graphs = ShapeGraphs(lambda work: work)
    for seed in (1, 2, 3):
        want, got = whole_step(eager, seed), whole_step(graphed, seed)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), seed
        assert graphed._ddtree_whole_tree_tokens == 7
    assert graphed._ddtree_plan_graphs.replayed == 2 and eager._ddtree_plan_graphs is None


def test_under_async_scheduling_vllm_scatters_the_roots_and_leaves_the_draft_positions_to_the_trees(monkeypatch):
    """vLLM's own ``_prepare_input_ids`` (run as is, on CPU tensors) puts the last step's sampled token at each
    continuing request's root and, for the chain, its drafts after it; a ddtree runner keeps the roots and skips the
    drafts (the tree placement writes them), and hands vLLM's draft tensor back afterwards."""
    from vllm.v1 import utils as vllm_utils
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    monkeypatch.setattr(gpu_model_runner, "PIN_MEMORY", False)  # no GPU here to pin for
    monkeypatch.setattr(vllm_utils, "PIN_MEMORY", False, raising=False)  # (vLLM 0.33's buffers read their own)

    def runner_with(cls):
        runner = object.__new__(cls)
        runner.device, runner.enable_prompt_embeds, runner.prev_num_spec_tokens = torch.device("cpu"), False, 3
        runner._pp_recv_work = None  # (vLLM 0.33's: a pipeline stage's pending receive)
        runner.input_ids = CpuGpuBuffer(16, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
        runner.input_ids.gpu.fill_(-7)  # what the placement would overwrite
        runner.prev_positions = CpuGpuBuffer(4, dtype=torch.int64, device=torch.device("cpu"), pin_memory=False)
        runner.prev_positions.np[:2] = [1, 0]  # the two requests swapped places since the last step
        runner.input_batch = SimpleNamespace(
            req_ids=["a", "b"], prev_sampled_token_ids=torch.tensor([[11], [22]], dtype=torch.int32)
        )
        runner._draft_token_ids = torch.tensor([[101, 102, 103], [201, 202, 203]])
        return runner

    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={"a": [-1] * 3, "b": [-1] * 3}, scheduled_new_reqs=[])
    cu_num_tokens = np.array([4, 8])
    chain = runner_with(GPUModelRunner)
    chain._prepare_input_ids(scheduled, 2, 8, cu_num_tokens)
    assert chain.input_ids.gpu[:8].tolist() == [22, 201, 202, 203, 11, 101, 102, 103]
    tree = runner_with(DDTreeGPUModelRunner)
    drafts = tree._draft_token_ids
    tree._prepare_input_ids(scheduled, 2, 8, cu_num_tokens)
    assert tree.input_ids.gpu[:8].tolist() == [22, -7, -7, -7, 11, -7, -7, -7] and tree._draft_token_ids is drafts
    # Synchronous scheduling (no sampled tokens kept on the device): vLLM's upload of the host's input ids, as is.
    sync = runner_with(DDTreeGPUModelRunner)
    sync.input_batch.prev_sampled_token_ids = None
    sync.input_ids.np[:8] = np.arange(8)
    sync._prepare_input_ids(scheduled, 2, 8, cu_num_tokens)
    assert sync.input_ids.gpu[:8].tolist() == list(range(8))


def test_the_forward_launch_is_timed_apart_from_ddtrees_own_host_work(monkeypatch):
    """vLLM's forward launch goes to ``vllm_host_ms_per_verify_step`` (what the GPU waits through once the trees
    are built), not into ddtree's host parts, whose sum the benches report as ddtree's host work."""
    import time

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    from ddtree.vllm.stats import DDTreeStats

    def launch(self, *args, **kwargs):
        time.sleep(0.02)
        return ("hidden", args, kwargs)

    monkeypatch.setattr(GPUModelRunner, "_model_forward", launch)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_stats = DDTreeStats(3)
    assert runner._model_forward(input_ids="ids", positions="pos") == (
        "hidden",
        (),
        {"input_ids": "ids", "positions": "pos"},
    )
    runner.ddtree_stats.steps = 1
    summary = runner.ddtree_stats.summary()
    assert summary["vllm_host_ms_per_verify_step"]["forward launch"] >= 20.0
    assert "forward launch" not in summary["host_ms_per_verify_step"]


def test_the_summary_reports_the_host_time_inside_ddtrees_graph_launches_per_verify_step():
    """What the runner's step graphs' replays took (``graphs.timed_replays``) is reported by graph, per verify
    step, beside the timed parts it belongs to."""
    from ddtree.vllm.stats import DDTreeStats

    stats = DDTreeStats(3)
    stats.steps = 4
    stats.graph_launch_seconds.update({"walk": 0.002, "commit": 0.006})
    assert stats.summary()["graph_launch_ms_per_verify_step"] == pytest.approx({"commit": 1.5, "walk": 0.5})


def _whole_async_runner(capture, gate=None):
    """A runner under asynchronous scheduling about to verify two whole trees of 7 tokens (``_whole_async_step``),
    with ``capture`` standing in for CUDA-graph capture of the plan's placement and ``gate`` as its launch gate."""
    from ddtree.vllm.counts import PathRing
    from ddtree.vllm.graphs import ShapeGraphs
    from ddtree.vllm.staging import StepStaging

    cpu = torch.device("cpu")
    runner, _, _ = _mixed_hybrid_step()
    runner.use_async_scheduling, runner.max_num_reqs = True, 4
    runner._ddtree_count_staging, runner._ddtree_late_step = StepStaging(cpu), None
    runner._ddtree_counts = PathRing(cpu, 4, width=5)
    runner.num_decode_draft_tokens = SimpleNamespace(np=np.array([6, 6]))
    runner._ddtree_plan_graphs, runner._ddtree_gate = ShapeGraphs(capture), gate
    return runner


def _whole_async_step(runner, seed, forward, landed=False):
    """One step of ``_whole_async_runner``: the drafter's late proposal (its top-K still on its way to the host unless
    ``landed``), vLLM's preparation (placeholders, flat positions from the GPU's starts), the FULL dispatch,
    ``_preprocess`` and the forward (``forward(runner)`` stands in for vLLM's launch)."""
    from ddtree.vllm import context
    from ddtree.vllm.step import TreeStore

    runner.drafter.store = TreeStore(6)
    proposer, _, _ = _late_proposer(runner, runner.drafter.store, 2, seed=seed)
    runner.drafter.draft_len, runner.drafter.top_k = 3, 4
    proposer._defer(["a", "b"], 2)
    runner.drafter.store.deferred.landed = SimpleNamespace(query=lambda: landed, synchronize=lambda: None)
    runner.input_batch = SimpleNamespace(req_ids=["a", "b"], num_reqs=2, num_computed_tokens_cpu=np.array([90, 99]))
    runner.positions = torch.cat([torch.arange(20, 27), torch.arange(30, 37)]) + seed
    runner.input_ids = SimpleNamespace(gpu=torch.zeros(14, dtype=torch.int32))
    output = SimpleNamespace(
        total_num_scheduled_tokens=14,
        scheduled_spec_decode_tokens={"a": [-1] * 6, "b": [-1] * 6},
        scheduled_new_reqs=[],
    )
    try:
        runner._prepare_inputs(output, np.array([7, 7]))
        runner._ddtree_full_graph = (14, 2)  # vLLM's dispatch: a FULL graph of two whole trees
        runner._preprocess("scheduler output", 14)
        runner._model_forward(input_ids="ids")
    finally:
        context.withdraw()
    forward(runner)
    return [runner.positions.clone(), runner.input_ids.gpu.clone(), runner._ddtree_buffers.ancestor_bits[:14].clone()]


def test_a_whole_tree_step_queues_its_forward_before_its_trees_and_releases_it_once_they_are_written(monkeypatch):
    """DDTREE_LAUNCH_AHEAD: from a step shape's second step on, _preprocess queues the gate, the plan's upload and
    its placement and returns without waiting for the drafter; vLLM's forward is launched while the trees are not
    built and the gate holds; then the trees are written into the pinned buffer and the gate released. What the GPU
    runs after the release (the copy and the placement, deferred here until then) gives the step the trees the
    ungated path gives it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.launch_gate import StreamGate

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("indices", "metadata"))
    monkeypatch.setattr(GPUModelRunner, "_preprocess", lambda self, *a: None)
    launches = []
    monkeypatch.setattr(GPUModelRunner, "_model_forward", lambda self, **kw: launches.append(self.launch_state()))

    stream = []  # what the GPU runs behind the gate, run here at its release

    class DeferringGate(StreamGate):
        def release(self, ticket):
            super().release(ticket)
            while stream:
                stream.pop(0)()

    def deferred_capture(recorded):
        recorded()  # a capture runs the Python once (on a GPU it records; here it computes)
        # A replay runs in stream order: after the gate's release while a ticket is held, else at once.
        return lambda: stream.append(recorded) if gate._queued != gate.released else recorded()

    waits = []
    gate = DeferringGate(torch.device("cpu"), wait=lambda stream, address, value, flags: waits.append(value) or 0)
    gated = _whole_async_runner(deferred_capture, gate)
    staging, upload_ahead = gated._ddtree_plan_staging, gated._ddtree_plan_staging.upload_ahead

    def deferred_upload():  # the copy reads the pinned buffer when the GPU runs it, after the release
        views = upload_ahead()
        stream.append(lambda: staging._device_buffer.copy_(staging._host))
        return views

    monkeypatch.setattr(staging, "upload_ahead", deferred_upload)
    ungated = _whole_async_runner(lambda work: work)
    for runner in (gated, ungated):
        runner.launch_state = lambda self=runner: (self.drafter.store.deferred is not None, len(stream), gate.released)
    for seed in (1, 2, 3):
        want = _whole_async_step(ungated, seed, lambda r: None)
        got = _whole_async_step(gated, seed, lambda r: None)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), seed
    # The first step of the shape captured its placement and ran ungated; the next two queued ahead.
    assert waits == [1, 2] and gate.released == 2 and gated.ddtree_stats.early_launch_steps == 2
    gated_launches = launches[1::2]
    assert gated_launches[0][:2] == (False, 0)  # first step: trees built before the launch, nothing queued
    # Later steps: at the forward's launch the drafter's proposal is not turned into trees yet, the copy and the
    # placement wait behind the gate, which is not released.
    assert gated_launches[1:] == [(True, 2, 0), (True, 2, 1)]
    assert ungated.ddtree_stats.early_launch_steps == 0
    # A proposal whose top-K has landed already (the GPU has nothing to hide the build behind): built now, ungated.
    launches.clear()
    want = _whole_async_step(ungated, 4, lambda r: None, landed=True)
    got = _whole_async_step(gated, 4, lambda r: None, landed=True)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert waits == [1, 2] and launches[1][:2] == (False, 0)
    assert gated.ddtree_stats.landed_before_launch_steps == 1 and gated.ddtree_stats.early_launch_steps == 2
    # DDTREE_LAUNCH_AHEAD=always (tests): such a step is queued behind the gate all the same, with the same trees.
    gated._ddtree_gate_landed_steps = True
    launches.clear()
    want = _whole_async_step(ungated, 5, lambda r: None, landed=True)
    got = _whole_async_step(gated, 5, lambda r: None, landed=True)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert waits == [1, 2, 3] and launches[1][:2] == (True, 2)
    assert gated.ddtree_stats.landed_before_launch_steps == 2 and gated.ddtree_stats.early_launch_steps == 3


def test_launch_ahead_mode_names_its_values():
    from ddtree.vllm.config import DDTreeConfigError, launch_ahead_enabled, launch_ahead_mode

    assert launch_ahead_mode({}) == "1" and launch_ahead_enabled({})
    assert launch_ahead_mode({"DDTREE_LAUNCH_AHEAD": " Always "}) == "always"
    assert launch_ahead_enabled({"DDTREE_LAUNCH_AHEAD": "always"})
    assert not launch_ahead_enabled({"DDTREE_LAUNCH_AHEAD": "0"})
    with pytest.raises(DDTreeConfigError, match="DDTREE_LAUNCH_AHEAD must be one of 1 .*always .*got 'yes'"):
        launch_ahead_mode({"DDTREE_LAUNCH_AHEAD": "yes"})


def test_a_step_of_decodes_only_is_published_without_uploading_its_counts(monkeypatch):
    """When every scheduled token is a tree token the tree tokens are the step's tokens in order: the step is
    published with the buffers' fixed step indices (the GDN layers read the leading rows), nothing uploaded from
    the counts; a mixed step still uploads its tree and other tokens (the asynchronous test above)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("indices", "metadata"))
    monkeypatch.setattr(GPUModelRunner, "_preprocess", lambda self, *a: None)
    monkeypatch.setattr(GPUModelRunner, "_model_forward", lambda self, **kw: None)
    runner = _whole_async_runner(lambda work: work)
    _whole_async_step(runner, 1, lambda r: None)
    step = runner._ddtree_gdn_step
    assert runner._ddtree_count_staging.uploads == 0 and step.other_index is None
    assert step.token_index.tolist() == list(range(14))
    assert step.token_index.data_ptr() == runner._ddtree_buffers.step_index.data_ptr()


def test_an_early_launch_whose_forward_fails_or_never_comes_lets_the_gpu_go(monkeypatch):
    """The gate is released whatever happens after it is queued: a forward that raises releases it, and a step
    that never reached its forward is released at the next _preprocess."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.launch_gate import StreamGate

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, so, n: ("indices", "metadata"))
    monkeypatch.setattr(GPUModelRunner, "_preprocess", lambda self, *a: None)
    monkeypatch.setattr(GPUModelRunner, "_model_forward", lambda self, **kw: None)
    gate = StreamGate(torch.device("cpu"), wait=lambda *a: 0)
    runner = _whole_async_runner(lambda work: work, gate)
    _whole_async_step(runner, 1, lambda r: None)  # captures the placement

    def failing_forward(self, **kw):
        raise ValueError("the forward failed")

    monkeypatch.setattr(GPUModelRunner, "_model_forward", failing_forward)
    with pytest.raises(ValueError, match="forward failed"):
        _whole_async_step(runner, 2, lambda r: None)
    assert gate.released == 1 and runner._ddtree_early is None
    monkeypatch.setattr(GPUModelRunner, "_model_forward", lambda self, **kw: None)
    runner._ddtree_early = SimpleNamespace(release=lambda: released.append(True))  # a step without its forward
    released = []
    _whole_async_step(runner, 3, lambda r: None)
    assert released == [True] and gate.released == 2


@pytest.mark.parametrize("seed", range(5))
def test_tree_counters_folded_in_batches_equal_step_by_step_counting(seed):
    """``DDTreeStats`` counts steps FOLD_EVERY at a time; read at any point, every counter is what counting each
    step on its own gives (cut trees, fillers, the budget of each step, acceptance per depth)."""
    from ddtree.vllm.stats import FOLD_EVERY, DDTreeStats

    rng = np.random.default_rng(seed)
    depth = 15
    stats = DDTreeStats(depth)
    want = {"trees": 0, "nodes": 0, "partial_trees": 0, "filler_trees": 0, "accepted": 0}
    per_depth, by_budget = np.zeros(depth + 1, dtype=np.int64), {}
    for step in range(int(rng.integers(1, 3 * FOLD_EVERY))):
        trees = int(rng.integers(0, 6))
        proposed = rng.choice([15, 63, 127], size=trees)
        num_nodes = np.minimum(proposed + 1, rng.integers(1, 129, size=trees))
        fillers = int(rng.integers(0, trees + 1))
        acc = rng.integers(0, depth + 1, size=trees)
        plan = SimpleNamespace(num_nodes=num_nodes, proposed_budgets=proposed, num_filler_trees=fillers)
        shared = acc.copy()
        stats.observe_counts(plan, shared)
        shared[:] = 0  # a reused buffer: the counts were taken at the call
        want["trees"] += trees
        want["nodes"] += int(num_nodes.sum()) - trees
        want["partial_trees"] += int((num_nodes < proposed + 1).sum())
        want["filler_trees"] += fillers
        want["accepted"] += int(acc.sum())
        per_depth += np.array([(acc >= d).sum() for d in range(depth + 1)])
        if trees:
            by_budget[int(proposed.max())] = by_budget.get(int(proposed.max()), 0) + 1
        if rng.random() < 0.05:  # read mid-way: what is pending is counted first
            assert stats.trees == want["trees"] and np.array_equal(stats.accepted_per_depth, per_depth)
    assert {name: getattr(stats, name) for name in want} == want
    assert np.array_equal(stats.accepted_per_depth, per_depth) and stats.steps_by_budget == by_budget
    assert stats.steps == step + 1


@pytest.mark.parametrize("late", [False, True])
def test_the_worker_warms_the_drafters_packed_top_k_after_vllms_warm_up(monkeypatch, late):
    """vLLM's warm-up never reaches the packed top-K (the drafter samples only in a real proposal), so its kernel
    would compile in the first request's step: the worker runs it once after vLLM's warm-up, on logits of the
    drafter's shape and dtype; with late trees the kernel's variant that writes the host's rows too, into the
    pinned buffer's first rows."""
    from vllm.v1.worker.gpu_worker import Worker

    from ddtree.vllm import proposer as proposer_module
    from ddtree.vllm.proposer import DDTreeProposer
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.worker import DDTreeWorker

    calls = []
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", lambda self: calls.append("vllm") or 1.5)
    monkeypatch.setattr(
        proposer_module,
        "pack_top_k",
        lambda logits, values, ids, host_out=None: calls.append(
            (tuple(logits.shape), logits.dtype, tuple(ids.shape))
            + (() if host_out is None else (tuple(host_out.shape), host_out.data_ptr()))
        ),
    )
    drafter = object.__new__(DDTreeProposer)
    drafter.draft_len, drafter.draft_vocab_size, drafter.top_k, drafter.budget = 15, 4096, 64, 63
    drafter.draft_logits_dtype, drafter.device = torch.bfloat16, torch.device("cpu")
    drafter._late_host = None
    drafter.runner = SimpleNamespace(ddtree_late_trees=late, max_num_reqs=4)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.drafter, runner._ddtree_auto = drafter, None
    worker = object.__new__(DDTreeWorker)
    worker.model_runner = runner
    assert worker.compile_or_warm_up_model() == 1.5
    warm = ((15, 4096), torch.bfloat16, (15, 64))
    if late:
        assert drafter._late_host.shape == (4 * 15, 128)
        assert calls == ["vllm", warm + ((15, 128), drafter._late_host.data_ptr())]  # (the variant late trees run)
    else:
        assert calls == ["vllm", warm] and drafter._late_host is None
    runner_without_drafter = object.__new__(DDTreeGPUModelRunner)
    runner_without_drafter._ddtree_auto = None
    worker.model_runner = runner_without_drafter  # no speculative drafter: nothing to warm
    worker.compile_or_warm_up_model()


def test_the_worker_builds_ddtrees_runner_where_vllm_builds_its_own(monkeypatch):
    """Patch 4: vLLM's ``Worker.init_device`` builds ddtree's runner, through vLLM 0.33's factory method (overridden)
    or 0.25's import inside ``init_device`` (the module attribute swapped while it runs)."""
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm.v1.worker.gpu_worker import Worker

    from ddtree.vllm import worker as worker_module
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.worker import DDTreeWorker

    built = []
    monkeypatch.setattr(DDTreeGPUModelRunner, "__init__", lambda self, config, device: built.append((config, device)))
    monkeypatch.setattr(worker_module, "apply_worker_patches", lambda config: None)

    def vllms_init_device(self):  # the part of vLLM's init_device that builds the runner, as this vLLM does it
        factory = getattr(Worker, "_make_model_runner", None)
        if factory is not None:
            self.model_runner = self._make_model_runner()
        else:
            self.model_runner = runner_module.GPUModelRunner(self.vllm_config, self.device)

    monkeypatch.setattr(Worker, "init_device", vllms_init_device)
    worker = object.__new__(DDTreeWorker)
    worker.vllm_config, worker.device = SimpleNamespace(use_v2_model_runner=False), "cuda:0"
    worker.init_device()
    assert isinstance(worker.model_runner, DDTreeGPUModelRunner) and built == [(worker.vllm_config, "cuda:0")]
    assert runner_module.GPUModelRunner is not DDTreeGPUModelRunner  # the swap (0.25) ended with init_device
    worker.vllm_config = SimpleNamespace(use_v2_model_runner=True)
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        worker.init_device()


def test_the_proposers_top_k_through_its_graphs_equals_the_eager_one_and_feeds_the_deferred_copy():
    """DDTREE_TOPK_GRAPHS: a proposal's top-K (the drafter's logits, top-K, packing) through the top-K graphs (a
    stand-in capture on CPU) is what the eager path packs, proposal after proposal, and is what the deferred copy
    reads (``_capture``); vLLM gets each row's top token. Without the graphs the same path runs eagerly."""
    from ddtree.kernels.draft_top_k import pack_top_k
    from ddtree.vllm.graphs import DraftTopKGraphs
    from ddtree.vllm.proposer import DDTreeProposer

    weight = torch.randn(32, 8)
    drafter = object.__new__(DDTreeProposer)
    drafter.model = SimpleNamespace(compute_logits=lambda hidden: hidden @ weight.T)
    drafter.top_k, drafter._capturing, drafter._topk_graphs_on = 4, True, False
    drafter._topk_graphs = DraftTopKGraphs(lambda work: work, vocab=32, itemsize=4)
    for step in range(3):
        hidden = torch.randn(6, 8)
        logits = hidden @ weight.T
        values, ids = logits.topk(4, dim=-1)
        top1, probs = drafter._sample_draft_tokens(hidden, None)
        assert torch.equal(drafter._capture, pack_top_k(logits, values, ids)) and probs is None
        assert torch.equal(top1, ids[:, 0]), step
    assert drafter.topk_graph_steps == 2  # the first proposal ran eagerly, then was captured
    assert drafter._packed_on_host is False  # (no late target: the deferral would copy)
    # Late trees: the graphs of a host target write the host's rows, replay after replay, and say so.
    host = torch.zeros(6, 8)
    drafter._late_target = (host, host.numpy(), None)
    for step in range(2):
        hidden = torch.randn(6, 8)
        logits = hidden @ weight.T
        drafter._sample_draft_tokens(hidden, None)
        assert torch.equal(host, pack_top_k(logits, *logits.topk(4, dim=-1))) and drafter._packed_on_host, step
    assert drafter.topk_graph_steps == 3  # the target's graph: captured once, then replayed
    drafter._late_target = None
    drafter._topk_graphs = None  # switched off: launch by launch, the same values
    hidden = torch.randn(6, 8)
    drafter._sample_draft_tokens(hidden, None)
    logits = hidden @ weight.T
    assert torch.equal(drafter._capture, pack_top_k(logits, *logits.topk(4, dim=-1)))
    assert drafter.topk_graph_steps == 0


def test_the_drafter_refuses_logits_rows_that_are_not_the_proposals():
    from ddtree.vllm.proposer import DDTreeProposer

    drafter = object.__new__(DDTreeProposer)
    drafter.model = SimpleNamespace(compute_logits=lambda hidden: hidden @ torch.ones(8, 32))
    drafter.top_k, drafter._topk_graphs_on = 4, False
    with pytest.raises(RuntimeError, match="the drafter gave 5 rows of logits for a proposal of 6 rows"):
        drafter._top_k_of(torch.randn(5, 8), torch.zeros(6, 8))


def test_spec_decode_metadata_kept_for_repeated_counts_is_vllms_own(monkeypatch):
    """vLLM's spec-decode metadata, kept on the device by its inputs: a repeated step gets vLLM's tensors again
    with the drafts gathered from this step's input ids; other counts are computed afresh. Compared field by field
    with vLLM's own function on the same inputs."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    monkeypatch.setattr("vllm.utils.torch_utils.PIN_MEMORY", False)  # vLLM's uploads, on a host without a GPU

    def runner_with(cls, input_ids):
        runner = object.__new__(cls)
        runner.device = torch.device("cpu")
        runner.arange_np = np.arange(4096, dtype=np.int64)
        runner._arange_scratch = np.zeros(4096, dtype=np.int64)
        runner.input_ids = SimpleNamespace(gpu=input_ids)
        runner._ddtree_spec_metadata = {}
        return runner

    ids = torch.arange(1000, 1400, dtype=torch.int32)
    ours, vllms = runner_with(DDTreeGPUModelRunner, ids), runner_with(GPUModelRunner, ids)
    steps = [
        (np.array([4, 4, 4], np.int32), np.array([5, 10, 15], np.int32)),  # whole trees
        (np.array([4, 4, 4], np.int32), np.array([5, 10, 15], np.int32)),  # repeated
        (np.array([3, 0, 2], np.int32), np.array([4, 104, 107], np.int32)),  # a prefill among trees
        (np.array([4, 4, 4], np.int32), np.array([5, 10, 15], np.int32)),  # repeated again, new input ids
    ]
    for step, (num_draft_tokens, cu_num_tokens) in enumerate(steps):
        ids[:] = torch.arange(1000, 1400, dtype=torch.int32) * (step + 1)
        mine = ours._calc_spec_decode_metadata(num_draft_tokens.copy(), cu_num_tokens.copy())
        want = GPUModelRunner._calc_spec_decode_metadata(vllms, num_draft_tokens.copy(), cu_num_tokens.copy())
        for field in ("draft_token_ids", "cu_num_draft_tokens", "cu_num_sampled_tokens", "target_logits_indices",
                      "bonus_logits_indices", "logits_indices"):  # fmt: skip
            got, expected = getattr(mine, field), getattr(want, field)
            assert got.dtype == expected.dtype and torch.equal(got, expected), (step, field)
        assert mine.num_draft_tokens == want.num_draft_tokens and mine.max_spec_len == want.max_spec_len
    assert len(ours._ddtree_spec_metadata) == 2  # the whole-tree counts kept once, the mixed step's once
    first = ours._calc_spec_decode_metadata(*steps[0])
    first.num_draft_tokens.append(9)  # a caller's list is its own
    assert ours._calc_spec_decode_metadata(*steps[0]).num_draft_tokens == [4, 4, 4]


def test_vllm_spec_decode_rows_must_be_the_tree_rows():
    """vLLM's GDN metadata treats a request with drafts (``num_decode_draft_tokens`` >= 0) as a spec decode, in
    batch order: a step is refused, naming both, when those rows are not the rows that verify trees."""
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.step import VerifyPlan

    class TreeRows(SimpleNamespace):  # a plan's tree rows, with the plan's own test of them
        every_request = VerifyPlan.every_request

    runner = object.__new__(DDTreeGPUModelRunner)

    def check(drafts, tree_rows):
        runner.num_decode_draft_tokens = SimpleNamespace(np=np.array(drafts + [7, 7], dtype=np.int32))
        runner._ddtree_check_spec_rows(TreeRows(batch_index=np.array(tree_rows)), len(drafts))

    check([5, 5, 5], [0, 1, 2])  # the usual step: every request a tree and a spec decode
    check([-1, 5, 5], [1, 2])  # a prefill first
    with pytest.raises(RuntimeError, match=r"spec-decode rows \[0, 1, 2\] differ from the tree rows \[1, 2\]"):
        check([5, 5, 5], [1, 2])
    with pytest.raises(RuntimeError, match=r"spec-decode rows \[1, 2\] differ from the tree rows \[0, 1, 2\]"):
        check([-1, 5, 5], [0, 1, 2])


def test_a_decode_without_drafts_is_a_plain_decode_for_vllms_gdn_builder(monkeypatch):
    """vLLM 0.33 marks a decode that got no drafts a spec decode of 0 drafts (0.25 marks it -1): a ddtree engine's
    spec rows are its tree rows, so such a row is set back to -1 after vLLM's input preparation, before its GDN
    builder reads the counts; rows with drafts and prefills are left as vLLM made them."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    counts = np.array([0, 5, -1, 0, 5], dtype=np.int32)
    assert runner_module.unmark_draftless_spec_rows(counts)
    assert counts.tolist() == [-1, 5, -1, -1, 5]
    assert not runner_module.unmark_draftless_spec_rows(counts)  # nothing to change

    def vllms_prepare(self, scheduler_output, num_scheduled_tokens):  # vLLM 0.33's marks, a draftless decode first
        self.num_decode_draft_tokens.np[:3] = [0, 5, 5]
        return "logits_indices", "spec_decode_metadata", "max_num_sampled_tokens"  # (0.33 returns three)

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", vllms_prepare)
    for unmark, expected in ((True, [-1, 5, 5, 9]), (False, [0, 5, 5, 9])):
        runner = object.__new__(DDTreeGPUModelRunner)
        uploads = []
        runner.num_decode_draft_tokens = SimpleNamespace(
            np=np.array([9, 9, 9, 9], dtype=np.int32), copy_to_gpu=lambda: uploads.append(1)
        )
        runner.input_batch = SimpleNamespace(num_reqs=3)
        runner.use_async_scheduling = True
        runner.ddtree_stats = runner_module.DDTreeStats(depth=3)
        runner._ddtree_unmark_draftless, runner._ddtree_conv_window = unmark, 3
        runner._ddtree_publish_counts = lambda *args: False
        # What vLLM returns, returned as it is (0.25's two values, 0.33's three). Request a draws nothing.
        output = SimpleNamespace(scheduled_spec_decode_tokens={"b": [5] * 4, "c": [6] * 4}, scheduled_new_reqs=[])
        assert runner._prepare_inputs(output, None) == (
            "logits_indices",
            "spec_decode_metadata",
            "max_num_sampled_tokens",
        )
        assert runner.num_decode_draft_tokens.np.tolist() == expected
        assert len(uploads) == unmark  # the GPU copy follows the host's


def test_a_new_request_verifying_a_tree_first_starts_from_zeroed_recurrent_states(monkeypatch):
    """A one-token prompt vLLM padded with placeholders verifies a (filler) tree in its first step, which reads the
    request's state slot: a finished request's states stay there (vLLM zeroes new attention blocks only), so the
    slot's conv and SSM states are zeroed in every GDN layer first. Prefills (no drafts) and requests with computed
    tokens (a prefix hit's state) keep theirs."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = object.__new__(DDTreeGPUModelRunner)
    runner.device = torch.device("cpu")
    layers = {name: SimpleNamespace(kv_cache=(torch.ones(6, 3, 2), torch.ones(6, 2, 4, 4))) for name in ("g0", "g1")}
    runner.compilation_config = SimpleNamespace(static_forward_context=layers)
    runner._ddtree_state_group_layers = [(1, ["g0", "g1"])]
    table = np.array([[4, 0], [2, 0], [5, 0]], dtype=np.int32)  # the state group's block table: rows a, n, h
    runner.input_batch = SimpleNamespace(
        req_id_to_index={"a": 0, "n": 1, "h": 2},
        block_table={1: SimpleNamespace(get_numpy_array=lambda: table)},
        num_reqs=3,
    )
    runner.ddtree_stats = runner_module.DDTreeStats(depth=3)
    new = [
        SimpleNamespace(req_id="n", num_computed_tokens=0),  # a one-token prompt, padded: a tree first
        SimpleNamespace(req_id="h", num_computed_tokens=16),  # a prefix hit: its state is the cached one
        SimpleNamespace(req_id="p", num_computed_tokens=0),  # a prefill: vLLM's has_initial_state zeroes it
    ]
    spec = {"a": [7] * 4, "n": [-1] * 4, "h": [-1] * 4}

    def vllms_prepare(self, scheduler_output, num_scheduled_tokens):
        return "logits_indices", "spec_decode_metadata"

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", vllms_prepare)
    runner._ddtree_conv_window, runner.use_async_scheduling = 3, True
    runner._ddtree_publish_counts = lambda *args: False
    runner._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens=spec, scheduled_new_reqs=new), None)
    for layer in layers.values():
        for state in layer.kv_cache:
            assert not state[2].any() and bool((state[[0, 1, 3, 4, 5]] == 1).all())  # n's slot only
    assert runner.ddtree_stats.fresh_state_trees == 1
    runner._ddtree_clear_fresh_states(new[1:], spec)  # nothing fresh: nothing touched
    assert runner.ddtree_stats.fresh_state_trees == 1 and bool((layers["g0"].kv_cache[0][4] == 1).all())


def test_the_draftless_spec_row_gate_follows_vllms_own_runner():
    """``DRAFTLESS_SPEC_ROWS_FROM``: the installed vLLM's ``_prepare_inputs`` marks draftless decodes as spec rows
    (its ``zero_draft_decode_mask``) exactly where the runner undoes it."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.patches import vllm_below
    from ddtree.vllm.runner import DRAFTLESS_SPEC_ROWS_FROM

    marks = "zero_draft_decode_mask" in inspect.getsource(GPUModelRunner._prepare_inputs)
    assert marks == (not vllm_below(DRAFTLESS_SPEC_ROWS_FROM))


def test_a_repeated_step_shape_hands_the_walk_the_same_trees_object(monkeypatch):
    """The device walk's trees: the same object while the step's tensors are the same (the upload's views, the
    placement graph's outputs), a new one for other tensors; the memory starts afresh past its bound."""
    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.device_accept import NODE_ARRAYS
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_trees_by_tensors = {}
    names = (*NODE_ARRAYS, "depths", "tree_query_starts", "token_index", "ancestor_bits")
    gpu = {name: torch.arange(4) + i for i, name in enumerate(names)}
    offsets = torch.tensor([0, 4])
    trees = runner._ddtree_device_trees(gpu, offsets)
    assert runner._ddtree_device_trees(dict(gpu), offsets) is trees
    assert trees.node_offsets is offsets and trees.node_depths is gpu["depths"]
    assert trees.query_starts is gpu["tree_query_starts"] and trees.ancestor_bits is gpu["ancestor_bits"]
    other = runner._ddtree_device_trees(gpu, offsets.clone())  # an eager placement's new tensor
    assert other is not trees and torch.equal(other.node_offsets, offsets)
    monkeypatch.setattr(runner_module, "MAX_KEPT_SHAPES", 3)
    for _ in range(5):
        runner._ddtree_device_trees(gpu, offsets.clone())
    assert len(runner._ddtree_trees_by_tensors) <= 3


@pytest.mark.parametrize("in_place", [False, True])
def test_the_commit_moves_kv_once_with_the_gdn_commit_in_place_or_beside_it(monkeypatch, in_place):
    """After a FULL step whose walk replayed its graph, the K/V moves run exactly once a step: recorded in the GDN
    commit's graph when it reads the walk's outputs in place (``DDTREE_COMMIT_IN_PLACE``), else by the runner's own
    move."""
    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.graphs import CommitGraphs
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats

    runner = object.__new__(DDTreeGPUModelRunner)
    ran = []
    monkeypatch.setattr(runner_module, "commit_layer", lambda pending, plan: ran.append(("commit", pending)))
    runner._ddtree_move_kv_now = lambda src, dst: ran.append(("move", src.tolist()))
    runner._ddtree_kv_move_graphs = None  # the runner's own move launches directly here
    runner._ddtree_conv_window, runner._ddtree_full_graph = 3, (10, 2)
    runner._ddtree_captured = SimpleNamespace(replayed=lambda graph: {"layer.0": "p0"})
    runner._ddtree_commit_graphs = CommitGraphs(torch.device("cpu"), 4, 3, 3, capture=lambda work: work)
    runner._ddtree_commit_graphs_on, runner.device = True, torch.device("cpu")
    runner._ddtree_commit_in_place, runner._ddtree_walk_replayed, runner._ddtree_accept = in_place, True, None
    runner.ddtree_stats = DDTreeStats(3)
    gpu = {
        "paths": torch.zeros((2, 3), dtype=torch.int32),
        "path_lengths": torch.ones(2, dtype=torch.int32),
        "commit_conv_index": torch.zeros((2, 3), dtype=torch.int64),
        "kv_src": torch.tensor([4, 5]),
        "kv_dst": torch.tensor([1, 2]),
    }
    runner._ddtree_move_kv = lambda src, dst: runner._ddtree_move_kv_now(src, dst)
    offsets = torch.tensor([0, 5, 10], dtype=torch.int32)  # the fixed step buffers' view
    for step in range(2):
        runner._ddtree_gdn_step = SimpleNamespace(node_offsets=offsets)
        done = runner._ddtree_commit_gdn(gpu)
        if not done:
            runner._ddtree_move_kv(gpu["kv_src"], gpu["kv_dst"])
        assert done is in_place
        assert sorted(ran) == [("commit", "p0"), ("move", [4, 5])], step
        ran.clear()
    assert runner.ddtree_stats.commit_in_place_steps == (1 if in_place else 0)  # the second step replayed


def test_the_precapture_commits_first_eager_run_writes_at_slot_0_only(monkeypatch):
    """DDTREE_PRECAPTURE=all commits a filler step right after a FULL graph's capture, before the graph ever
    replayed: the inputs its capture recorded hold whatever its memory held, the state slots included (a copy made
    inside the graph for two trees or more). Its first run is eager and writes, so the slots point at slot 0 (vLLM's
    null block) first, not at slots read from unwritten memory (a review helper's finding)."""
    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.gdn import PendingCommit
    from ddtree.vllm.graphs import CapturedCommits, CommitGraphs, TreeStepBuffers
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats

    cpu, trees, tokens = torch.device("cpu"), 2, 32
    runner = object.__new__(DDTreeGPUModelRunner)
    seen = []
    monkeypatch.setattr(runner_module, "commit_layer", lambda pending, plan: seen.append(pending.slots.tolist()))
    runner._ddtree_conv_window, runner.device = 3, cpu
    runner._ddtree_buffers = TreeStepBuffers(cpu, 4, 4 * 16 + 8, 16, 4)
    garbage = torch.tensor([123456, -7])  # what the graph's memory held: unbounded slots
    state = torch.zeros(2)
    pending = PendingCommit(state, state, garbage, state, state, state, state)
    runner._ddtree_captured = CapturedCommits()
    runner._ddtree_captured.by_graph[(tokens, trees)] = {"layer.0": pending, "layer.1": pending}
    runner._ddtree_commit_graphs = CommitGraphs(cpu, 4, 5, 3, capture=lambda work: work)
    runner._ddtree_commit_graphs_on, runner._ddtree_commit_in_place = True, True
    runner._ddtree_aligned_states = False
    runner._ddtree_full_graph, runner._ddtree_walk_replayed, runner._ddtree_accept = None, False, None
    runner.ddtree_stats = DDTreeStats(4)
    walked = {
        "paths": torch.zeros((trees, 5), dtype=torch.int32),
        "path_lengths": torch.ones(trees, dtype=torch.int32),
        "commit_conv_index": torch.zeros((trees, 3), dtype=torch.int64),
        "kv_src": torch.zeros(0, dtype=torch.int64),
        "kv_dst": torch.zeros(0, dtype=torch.int64),
    }
    runner._ddtree_precapture_commit(walked, trees, tokens)
    assert seen and all(slots == [0, 0] for slots in seen)
    assert runner.ddtree_stats.precaptured_commits == 1 and runner._ddtree_full_graph is None


def test_queueing_an_early_launch_is_timed_as_the_plans_host_work(monkeypatch):
    """A step queued ahead of its trees spends host time queueing the gate, the upload and the placement before
    vLLM's forward: it counts in the plan's timer, like the trees built later for it."""
    import time

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    from ddtree.vllm.stats import DDTreeStats

    monkeypatch.setattr(GPUModelRunner, "_preprocess", lambda self, *a, **k: "vllm's")
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_stats = DDTreeStats(3)
    runner._ddtree_early, prepared = None, []

    def queue_early(late):
        deadline = time.perf_counter() + 0.003
        while time.perf_counter() < deadline:
            pass
        return True

    runner._ddtree_queue_early = queue_early
    runner._ddtree_settle_and_prepare = lambda late, early=None: prepared.append(late)
    runner._ddtree_late_step = ("late",)
    assert runner._preprocess() == "vllm's" and prepared == []  # queued: the trees come after the launch
    assert runner.ddtree_stats.host_seconds["plan"] >= 0.003


@pytest.mark.parametrize("seed", range(3))
def test_steps_counted_together_from_one_ring_read_equal_the_same_steps_counted_one_by_one(seed):
    """``DDTreeStats.observe_device_steps`` (one read of the path ring: many steps, their lengths converted at once)
    counts what ``observe_paths`` step by step counts: trees, depths, budgets, the what-if sample and ``auto``."""
    from ddtree.vllm.auto_budget import AutoBudget
    from ddtree.vllm.stats import FOLD_EVERY, WHAT_IF_EVERY, DDTreeStats
    from ddtree.vllm.step import TreeStore, accept, plan_verify

    rng = np.random.default_rng(seed)
    depth, width, budget = 6, 5, 40
    together, one_by_one = (DDTreeStats(depth, smaller_budgets=(8, 16)) for _ in range(2))
    for stats in (together, one_by_one):
        stats.auto = AutoBudget((8, 16, 40), max_num_seqs=4)
    steps = []
    for step in range(2 * FOLD_EVERY + 3 * WHAT_IF_EVERY + 5):  # several folds and what-if samples, a ragged end
        num_reqs = int(rng.integers(1, 4))
        names = [f"r{i}" for i in range(num_reqs)]
        shape = (num_reqs, depth, width)
        ids = np.stack([rng.permutation(50)[:width] for _ in range(num_reqs * depth)]).reshape(shape).astype(np.int32)
        lp = np.sort(rng.normal(size=shape) * 1.5, axis=-1)[..., ::-1]
        lp = (lp - np.log(np.exp(lp).sum(-1, keepdims=True))).astype(np.float32)
        store = TreeStore(budget=budget)
        lists = store.propose(names, lp, ids)
        scheduled = {name: drafts for name, drafts in zip(names, lists)}
        counts = np.array([len(drafts) + 1 for drafts in lists])
        plan = plan_verify(store, names, np.full(num_reqs, 4), counts, scheduled)
        target = rng.integers(0, 50, size=plan.num_tokens)
        walked = accept(plan, target, depth + 1)
        # The ring's rows: each tree's path length, then its path (int32, as the walk writes them).
        rows = np.concatenate([walked.path_lengths[:, None], walked.paths], axis=1).astype(np.int32)
        one_by_one.observe_paths(plan, rows[:, 1:], rows[:, 0])
        one_by_one.device_accept_steps += 1
        steps.append((plan, rows))
    for start in range(0, len(steps), 16):  # as the ring hands them: 16 steps a read, the last read shorter
        together.observe_device_steps(steps[start : start + 16])
    together.observe_device_steps([])  # (a read that landed nothing)

    def counted(stats):
        summary = stats.summary()
        summary.pop("host_ms_per_verify_step")
        return summary

    assert counted(together) == counted(one_by_one)
    assert together.steps == len(steps) == together.device_accept_steps and together.trees > len(steps)
    assert together.what_if.summary()["budgets"][8]["trees"] > 0
    for stats in (together, one_by_one):
        stats.auto.acceptance.close_window()
    assert together.auto.acceptance.acceptance_length(min_trees=1) == one_by_one.auto.acceptance.acceptance_length(
        min_trees=1
    )
