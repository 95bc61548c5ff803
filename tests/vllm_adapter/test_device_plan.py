"""DDTREE_DEVICE_PLAN: a steady step's trees built and laid out on the device (``ddtree.vllm.device_plan``).

The oracle is the host plan on the same proposals: two runners without an engine (``bench_plan_path``'s), one
planning on the host, one on the "device" (CPU tensors; the Triton kernels under Triton's CPU interpreter, in a
child process), every array the step leaves for the forward, the walk and the statistics compared. The rest runs
here without kernels: which steps are planned on the device, what the store and the plan object hold.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS.parent / "benches"))
import bench_plan_path as bench  # noqa: E402

from ddtree.vllm import device_plan  # noqa: E402
from ddtree.vllm.graphs import ShapeGraphs  # noqa: E402
from ddtree.vllm.step import PLACEHOLDER, TreeStore, take_device_plannable  # noqa: E402


# ---- the oracle: host plan against device plan (kernels under the interpreter) ----


def _step_state(runner, batch: int, size: int) -> dict:
    """What a planned step leaves for the forward (fixed tree buffers, tree tokens in the input ids, positions),
    the device walk (its trees) and the host (the plan's counts and, built on demand, its trees)."""
    total = batch * size
    buffers = runner._ddtree_buffers
    plan = runner._ddtree_plan
    state = {
        "row_start": buffers.row_start[:batch],
        "ancestor_bits": buffers.ancestor_bits[:total],
        "node_offsets": buffers.node_offsets[: batch + 1],
        "input_ids": runner.input_ids.gpu[:total],
        "positions": runner.positions[:total],
        "flat_positions": runner._ddtree_flat_positions,
        "logit_rows_gpu": plan.logit_rows_gpu,
        "batch_index_gpu": plan.batch_index_gpu,
    }
    if buffers.conv_index is not None:
        state["conv_index"] = buffers.conv_index[:total]
    for name, tensor in vars(plan.device_trees).items():
        if isinstance(tensor, torch.Tensor):
            state[f"device_trees.{name}"] = tensor
    for name in ("batch_index", "num_nodes", "token_index", "logit_rows", "query_starts", "proposed_budgets"):
        state[f"plan.{name}"] = getattr(plan, name)
    trees = plan.host_trees()
    for name in ("parents", "depths", "tokens", "node_offsets"):
        state[f"trees.{name}"] = getattr(trees, name)
    state["top1_tokens"] = plan.top1_tokens
    state["num_tokens"] = plan.num_tokens
    state["step_serial"] = plan.step_serial
    state["draft_depth"] = plan.draft_depth
    return {
        name: value.cpu().numpy().copy() if isinstance(value, torch.Tensor) else np.array(value)
        for name, value in state.items()
    }


def device_plan_cases() -> list:
    """``(batch, budget, depth, top_k, conv_window)`` of :func:`check_device_plan_equals_host_plan`."""
    cases = [(1, 15, 4, 8, 3), (3, 31, 6, 16, 0), (2, 63, 15, 63, 3), (4, 127, 15, 64, 3)]
    # Small random shapes too: a budget of 1, a depth of 1 under a wider conv window, top-K rows barely enough.
    rng = np.random.default_rng(7)
    for _ in range(6):
        depth, top_k = int(rng.integers(1, 6)), int(rng.integers(2, 9))
        reachable = sum(top_k**d for d in range(1, depth + 1))
        budget = int(rng.integers(1, min(40, reachable) + 1))
        cases.append((int(rng.integers(1, 5)), budget, depth, top_k, int(rng.integers(0, 5))))
    cases.append((2, 1, 1, 2, 4))
    return cases


def check_device_plan_equals_host_plan(device: str = "cpu", cases=None) -> None:
    """For each shape (``cases``, default :func:`device_plan_cases`), three steps planned both ways from the same
    proposals, then (two requests or more) a subset step and the steady step after it; every array equal, and the
    device side really planned (and never waited for the top-K). On ``cpu`` in a child under TRITON_INTERPRET=1
    (graph stand-ins that run their work at every replay); on ``cuda`` compiled, each side's work in real CUDA
    graphs."""
    from ddtree.vllm.graphs import cuda_graph_capture

    capture = cuda_graph_capture(torch.device(device)) if device == "cuda" else bench.placement_stand_in(True)
    for batch, budget, depth, top_k, window in cases or device_plan_cases():
        host = bench.build_runner(batch, budget, depth, top_k, conv_window=window, device=device)
        host._ddtree_plan_graphs = ShapeGraphs(capture)
        host._ddtree_step_graphs_on = True
        on_device = bench.build_runner(batch, budget, depth, top_k, conv_window=window, device=device)
        bench.prepare_device_plan(on_device, run_kernels=True, capture=capture if device == "cuda" else None)
        rngs = np.random.default_rng(batch), np.random.default_rng(batch)
        with bench.vllm_parts_stubbed():
            for step in range(3):
                for runner, rng in zip((host, on_device), rngs):
                    bench.plan_step(runner, bench.defer_proposal(runner, rng))
                assert on_device.ddtree_stats.device_plan_steps == step + 1
                assert on_device.ddtree_stats.device_plan_resumed_steps == step  # (the first step uploads)
                assert host.ddtree_stats.device_plan_steps == 0
                assert on_device.drafter.store.deferred is not None, "the device plan waited for the top-K"
                expected, got = _step_state(host, batch, budget + 1), _step_state(on_device, batch, budget + 1)
                assert set(expected) == set(got)
                for name in expected:
                    np.testing.assert_array_equal(
                        got[name], expected[name], err_msg=f"{name}: batch {batch} budget {budget} step {step}"
                    )
        if batch >= 2:  # a request ends; vLLM moves the last one into its slot: a subset step, in another order
            on_device._ddtree_device_subsets = True
            with bench.vllm_parts_stubbed():
                for runner, rng in zip((host, on_device), rngs):
                    bench.plan_step(runner, bench.subset_step(runner, bench.defer_proposal(runner, rng)))
            assert on_device.ddtree_stats.device_plan_subset_steps == 1 and on_device.drafter.store.deferred is not None
            assert host.ddtree_stats.device_plan_steps == 0
            # Then a steady step, and two steps in which only the order changes (consecutive subset layouts).
            for what in ("a subset step", "the steady step after it", "a reordered step", "another reordered step"):
                if what != "a subset step":
                    with bench.vllm_parts_stubbed():
                        for runner, rng in zip((host, on_device), rngs):
                            output = bench.defer_proposal(runner, rng)
                            if "reordered" in what:
                                output = bench.subset_step(runner, output, finished=False)
                            bench.plan_step(runner, output)
                expected, got = _step_state(host, batch - 1, budget + 1), _step_state(on_device, batch - 1, budget + 1)
                for name in expected:
                    np.testing.assert_array_equal(
                        got[name], expected[name], err_msg=f"{name}: batch {batch} budget {budget}, {what}"
                    )
            assert on_device.ddtree_stats.device_plan_steps == 7
            assert on_device.ddtree_stats.device_plan_subset_steps == 1 + 2 * (batch >= 3)  # (one request: no order)
    print("device plan equals host plan")


def test_the_device_plan_is_the_host_plan_under_the_interpreter():
    pytest.importorskip("triton")
    sys.path.insert(0, str(TESTS / "kernels"))
    from _triton_interpreter import child_env

    script = (
        "import _triton_interpreter; _triton_interpreter.patch_triton_interpreter_for_numpy2(); "
        "import torch; torch.set_num_threads(1); "
        "import test_device_plan as t; t.check_device_plan_equals_host_plan('cpu')"
    )
    env = child_env(TESTS / "kernels", TESTS / "vllm_adapter", TESTS.parent / "benches", interpret=True)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "device plan equals host plan" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_compiled_device_plan_in_cuda_graphs_is_the_host_plan():
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    check_device_plan_equals_host_plan("cuda")


# ---- which steps are planned on the device (no kernels: the device work is a no-op here) ----


def _device_runner(batch: int = 2, budget: int = 15, depth: int = 4, top_k: int = 8):
    runner = bench.build_runner(batch, budget, depth, top_k)
    bench.prepare_device_plan(runner, run_kernels=False)
    return runner, np.random.default_rng(0)


def _plan(runner, output, num_scheduled=None) -> None:
    from ddtree.vllm import context

    batch = len(runner.req_ids)
    if num_scheduled is None:
        num_scheduled = np.full(batch, runner.ddtree_cfg.budget + 1)
    with bench.vllm_parts_stubbed():
        runner._prepare_inputs(output, num_scheduled)
        runner._preprocess(output, output.total_num_scheduled_tokens)
    context.withdraw()


def _defer(runner, rng):
    with bench.vllm_parts_stubbed():
        return bench.defer_proposal(runner, rng)


def test_a_steady_step_is_planned_on_the_device_without_waiting_for_the_top_k():
    runner, rng = _device_runner()
    for step in range(3):
        _plan(runner, _defer(runner, rng))
        plan = runner._ddtree_plan
        assert runner.ddtree_stats.device_plan_steps == step + 1 and runner.ddtree_stats.late_tree_steps == step + 1
        assert plan.trees is None and plan.deferred_trees is not None  # built on the host only when read
        assert runner.drafter.store.deferred is not None  # the host never waited for the top-K
        assert plan.step_serial == step and plan.draft_depth == 4
        np.testing.assert_array_equal(plan.deepest, [4, 4])  # the drafter's depth bounds every tree
        np.testing.assert_array_equal(plan.num_nodes, [16, 16])
        assert plan.filler_mask is None and plan.num_cut_trees == 0
    assert runner.ddtree_stats.device_plan_declined_steps == {}


def test_the_plans_pieces_are_timed_apart_inside_its_part():
    """The summary's ``host_detail_ms_per_verify_step``: a device-planned step's checks, template, upload, graph and
    plan object, a host-planned step's whole plan and the published counts, each a piece of the plan part (their sum
    within it), and the proposer's copy, store and kept top-K inside its defer part."""
    runner, rng = _device_runner(batch=3)
    _plan(runner, _defer(runner, rng))
    assert not runner.ddtree_stats.detail_seconds  # off unless asked for (each piece costs its timer)
    assert runner.ddtree_host_pieces(True) is False
    _plan(runner, _defer(runner, rng))
    _plan(runner, bench.subset_step(runner, _defer(runner, rng)))  # subsets off here: the host plan
    stats = runner.ddtree_stats
    assert stats.device_plan_steps == 2
    pieces = stats.detail_seconds
    device = {"device checks", "device template", "device upload", "device graph", "device bookkeeping"}
    plan = {name for name in pieces if name.startswith("plan: ")}
    assert {f"plan: {name}" for name in device} | {"plan: host plan", "plan: publish counts"} <= plan
    assert sum(pieces[name] for name in plan) <= stats.host_seconds["plan"]
    assert {"defer: copy", "defer: store", "defer: keep top-K"} <= set(pieces)
    summary = stats.summary()["host_detail_ms_per_verify_step"]
    assert set(summary) == set(pieces) and all(ms > 0 for ms in summary.values())


@pytest.mark.parametrize(
    "why",
    [
        "near max_model_len",
        "trees over 128 nodes",
        "a cut tree",
        "top-K not kept",
        "another request order",
        "a structured request",
    ],
)
def test_other_steps_keep_the_host_plan(why):
    budget = 127 + 128 * (why == "trees over 128 nodes")
    runner, rng = _device_runner(budget=budget, depth=8, top_k=8)
    output = _defer(runner, rng)
    num_scheduled = None
    if why == "near max_model_len":
        runner.max_model_len = int(runner.input_batch.num_computed_tokens_cpu.max()) + 2 * (budget + 1) + 9
    elif why == "a cut tree":
        output.scheduled_spec_decode_tokens["r0"] = [PLACEHOLDER] * (budget - 5)
        output.total_num_scheduled_tokens -= 5
        num_scheduled = np.array([budget + 1 - 5, budget + 1])
    elif why == "top-K not kept":
        runner._ddtree_device_planner.forget()
    elif why == "another request order":
        runner.req_ids.reverse()
    elif why == "a structured request":
        output.has_structured_output_requests = True
    _plan(runner, output, num_scheduled)
    assert runner.ddtree_stats.device_plan_steps == 0
    assert runner._ddtree_plan.trees is not None and runner.drafter.store.deferred is None
    reason = {
        "near max_model_len": "near max_model_len",
        "trees over 128 nodes": "tree size or request count",
        "a cut tree": "not whole trees of one size",
        "top-K not kept": "top-K not kept",
        "another request order": "not the kept proposal's requests",
        "a structured request": "structured outputs",
    }[why]
    assert runner.ddtree_stats.summary()["device_plan_declined_steps"] == {reason: 1}  # (why the host planned it)


def test_just_far_enough_from_max_model_len_is_planned_on_the_device():
    runner, rng = _device_runner()
    far = int(runner.input_batch.num_computed_tokens_cpu.max()) + 2 * 16 + 2 * (4 + 1)
    runner.max_model_len = far
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_steps == 1
    runner.max_model_len = far - 1
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_steps == 1


def test_the_shape_constants_are_written_again_after_a_host_upload_of_the_same_layout():
    """A host-planned step whose trees fill the same layout as a device-planned shape (as many trees and tokens, in
    other sizes: a budget schedule's trees of two budgets) writes its own offsets where that shape's constants go,
    and makes no new layout: the next device-planned step must write the constants again, not upload the host
    step's (its masks, walk and commit would read the wrong trees, silently). Found by a review helper."""
    runner, rng = _device_runner(batch=2)
    staging = runner._ddtree_plan_staging
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_steps == 1
    constants = runner._ddtree_device_planner.templates[(2, 16)][1]
    # The host-planned writer of the same layout: its own values (here: all 7) in every array, and its upload.
    layout = {name: (dtype, shape) for name, dtype, shape in staging._key}  # (the layout the device step made)
    layouts = staging.layouts
    for view in staging.host_arrays(layout).values():
        view[...] = 7
    staging.upload_host()
    assert staging.layouts == layouts  # the same layout: nothing but the uploads says the buffer changed
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_steps == 2 and runner.ddtree_stats.device_plan_resumed_steps == 0
    uploaded = staging.device_views()  # (the kernels are no-ops here: what the upload holds is what the host wrote)
    for name, value in constants.items():
        if name != "step_serial":
            np.testing.assert_array_equal(uploaded[name].numpy(), value, err_msg=name)
    # And a steady step after it resumes: nothing uploaded, the constants still in place.
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_resumed_steps == 1


def test_the_shape_constants_are_written_again_after_another_layout():
    """The upload carries the shape's constants from the staging's host buffer: a host-planned step of another
    shape in between lays that buffer out anew, so the next device-planned step writes them again (the kernels
    are no-ops here: what the upload holds is what the host wrote)."""
    runner, rng = _device_runner(batch=2)
    staging = runner._ddtree_plan_staging
    _plan(runner, _defer(runner, rng))
    np.testing.assert_array_equal(runner._ddtree_plan.batch_index_gpu.numpy(), [0, 1])
    # A step of one request (another shape) on the host: its layout overwrites the buffer.
    runner.req_ids.pop()
    runner.input_batch.num_reqs = 1
    output = _defer(runner, rng)
    runner._ddtree_device_planner.forget()
    _plan(runner, output, np.array([16]))
    assert runner.ddtree_stats.device_plan_steps == 1
    layouts = staging.layouts
    runner.req_ids.append("r1")
    runner.input_batch.num_reqs = 2
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_steps == 2 and staging.layouts == layouts + 1
    gpu = runner._ddtree_plan.batch_index_gpu
    np.testing.assert_array_equal(gpu.numpy(), [0, 1])
    np.testing.assert_array_equal(runner._ddtree_plan.logit_rows_gpu.numpy(), np.arange(32))


def test_a_device_planned_steps_min_tokens_and_penalty_rows_are_the_host_plans():
    """The sampler's per-node constraints read each node's depth (min_tokens) and root path (penalties, bad words):
    on a device-planned step they come from the host's build of the same top-K, as a host plan's would (c4ff208's
    H200 e2e run crashed here: a device-planned step has no host trees until something reads them)."""
    from ddtree.vllm.step import row_output_tokens, stop_token_rows

    host, host_rng = _device_runner(batch=3, budget=15, depth=4)
    host._ddtree_device_planner = None  # the same runner, planning on the host
    on_device, device_rng = _device_runner(batch=3, budget=15, depth=4)
    for step in range(2):
        for runner, rng in ((host, host_rng), (on_device, device_rng)):
            _plan(runner, _defer(runner, rng))
        assert on_device.ddtree_stats.device_plan_steps == step + 1 and host.ddtree_stats.device_plan_steps == 0
        expected, got = host._ddtree_plan, on_device._ddtree_plan
        assert got.trees is None  # nothing has read them yet
        counts = np.full(3, 16)
        starts = np.arange(3) * 16
        pending = [(0, 2, [5, 6]), (2, 30, [7])]  # two depths masked in request 0, every node in request 2
        for want, have in zip(stop_token_rows(expected, starts, pending), stop_token_rows(got, starts, pending)):
            np.testing.assert_array_equal(have, want)
        history = [[1, 2], [3], []]
        assert row_output_tokens(got, history, counts) == row_output_tokens(expected, history, counts)
        assert len(row_output_tokens(got, history, counts)) == 48


# ---- the store and the plan's host trees ----


def _store_with_a_deferred_proposal(num_reqs=2, budget=15, depth=4, top_k=8):
    from ddtree.vllm.step import DeferredProposal

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(num_reqs, depth, 4 * top_k)).astype(np.float32)
    ids = np.argsort(-logits, axis=-1)[..., :top_k].astype(np.int32)
    values = np.take_along_axis(logits, ids, axis=-1)
    log_probs = values - np.log(np.exp(logits).sum(-1, keepdims=True))
    host = np.concatenate([log_probs, ids.view(np.float32)], axis=-1)
    store = TreeStore(budget)
    req_ids = [f"r{i}" for i in range(num_reqs)]
    drafts = store.defer(req_ids, DeferredProposal(host.copy(), top_k), budget)
    return store, req_ids, {r: d for r, d in zip(req_ids, drafts)}, (log_probs, ids)


def test_take_device_plannable_takes_only_the_whole_proposal_of_exactly_these_requests():
    store, req_ids, spec, _ = _store_with_a_deferred_proposal()
    kept = lambda req_ids: True  # noqa: E731
    assert take_device_plannable(store, req_ids[::-1], spec, kept) is None
    assert take_device_plannable(store, req_ids, spec, lambda ids: False) is None
    assert take_device_plannable(store, req_ids, {**spec, "r0": [PLACEHOLDER] * 10}, kept) is None
    assert take_device_plannable(store, req_ids, {**spec, "r0": [5] * 15}, kept) is None
    assert store.whole_proposal_of(req_ids, settled=False) is not None  # nothing taken so far
    whole = take_device_plannable(store, req_ids, spec, kept)
    assert whole is not None and whole.log_probs is None
    assert store.whole_proposal_of(req_ids, settled=False) is None


def test_a_proposal_whose_top_k_cannot_fill_the_budget_is_not_device_plannable():
    # K^L = 2 + 4 = 6 prefixes for a budget of 15: the tree has 6 nodes, the device build makes budget + 1.
    store, req_ids, spec, _ = _store_with_a_deferred_proposal(budget=15, depth=2, top_k=2)
    assert len(spec["r0"]) == 6
    assert take_device_plannable(store, req_ids, spec, lambda ids: True) is None


@pytest.mark.parametrize("settled_first", [False, True])
def test_a_device_planned_steps_host_trees_are_the_host_builds(settled_first):
    import ddtree
    from ddtree.vllm.step import DeferredTrees

    store, req_ids, spec, (log_probs, ids) = _store_with_a_deferred_proposal()
    whole = take_device_plannable(store, req_ids, spec, lambda ids: True)
    if settled_first:
        store.settle()  # (the next proposal's deferral settles it)
        assert whole.log_probs is not None
    trees, top1 = DeferredTrees(store, whole, draft_depth=4).build()  # settles now if it has not
    assert store.deferred is None
    expected = ddtree.build_trees(log_probs, ids, 15)
    for name in ("parents", "depths", "tokens", "node_offsets"):
        np.testing.assert_array_equal(getattr(trees, name), getattr(expected, name))
    np.testing.assert_array_equal(top1, ids[:, :, 0])


def _rows_in(kept):
    return lambda req_ids: None if not set(req_ids) <= set(kept) else np.array([kept.index(r) for r in req_ids])


def test_take_device_subset_takes_some_of_the_kept_proposals_requests_in_any_order():
    from ddtree.vllm.step import take_device_subset

    store, req_ids, spec, _ = _store_with_a_deferred_proposal(num_reqs=4)
    kept = store.deferred.req_ids
    store.discard(["r1"])  # finished: its record is gone, the others' are made
    step = ["r3", "r0", "r2"]
    assert take_device_subset(store, step, spec, None, _rows_in(kept)) is None  # no top-K kept on the device
    assert take_device_subset(store, [*step, "new"], {**spec, "new": [PLACEHOLDER] * 15}, kept, _rows_in(kept)) is None
    assert take_device_subset(store, step, {**spec, "r0": [PLACEHOLDER] * 10}, kept, _rows_in(kept)) is None  # cut
    assert take_device_subset(store, ["r1", "r0"], spec, kept, _rows_in(kept)) is None  # r1 has no record
    assert take_device_subset(store, step, spec, tuple(list(kept)), _rows_in(kept)) is None  # an equal tuple, not it
    assert len(store.records) == 3  # nothing taken so far
    whole, rows = take_device_subset(store, step, spec, kept, _rows_in(kept))
    assert whole.req_ids == tuple(step) and whole.source is kept and rows.tolist() == [3, 0, 2]
    assert whole.log_probs is None and store.records == {}


def test_a_subset_steps_top_k_is_its_requests_rows_and_an_unscheduled_request_keeps_its_record():
    import ddtree
    from ddtree.vllm.step import DeferredTrees, take_device_subset

    store, req_ids, spec, (log_probs, ids) = _store_with_a_deferred_proposal(num_reqs=4)
    kept = store.deferred.req_ids
    store.discard(["r1"])
    whole, rows = take_device_subset(store, ["r2", "r0"], spec, kept, _rows_in(kept))  # r3: not scheduled this step
    trees, top1 = DeferredTrees(store, whole, draft_depth=4).build()  # settles now if it has not
    expected = ddtree.build_trees(np.ascontiguousarray(log_probs[[2, 0]]), np.ascontiguousarray(ids[[2, 0]]), 15)
    for name in ("parents", "depths", "tokens", "node_offsets"):
        np.testing.assert_array_equal(getattr(trees, name), getattr(expected, name))
    np.testing.assert_array_equal(top1, ids[[2, 0], :, 0])
    (record,) = store.records.values()  # r3 keeps its record, with its own row of the proposal
    np.testing.assert_array_equal(record.log_probs, log_probs[3])


def test_a_subset_take_that_cannot_happen_leaves_the_whole_proposal_and_a_second_take_is_refused():
    from ddtree.vllm.step import take_device_subset

    # K^L = 6 prefixes for a budget of 15: trees the device does not build; the host plan keeps its whole path.
    store, req_ids, spec, _ = _store_with_a_deferred_proposal(budget=15, depth=2, top_k=2)
    kept = store.deferred.req_ids
    assert take_device_subset(store, req_ids[::-1], spec, kept, _rows_in(kept)) is None
    assert store.whole_proposal_of(req_ids, settled=False) is not None
    # One subset step per drafter pass: a second take from the same copy would leave the first without its arrays.
    store, req_ids, spec, _ = _store_with_a_deferred_proposal(num_reqs=4)
    kept = store.deferred.req_ids
    assert take_device_subset(store, ["r1", "r0"], spec, kept, _rows_in(kept)) is not None
    assert take_device_subset(store, ["r3", "r2"], spec, kept, _rows_in(kept)) is None
    assert sorted(store.records) == ["r2", "r3"]


def test_a_subset_of_a_settled_proposal_is_left_to_the_host_plan():
    """Once the proposal's copy has settled, a record need not be the kept top-K's (a later proposal built on the
    host, say): the subset is not taken."""
    from ddtree.vllm.step import take_device_subset

    store, req_ids, spec, _ = _store_with_a_deferred_proposal(num_reqs=3)
    kept = store.deferred.req_ids
    store.discard(["r1"])
    store.settle()
    assert take_device_subset(store, ["r2", "r0"], spec, kept, _rows_in(kept)) is None
    assert sorted(store.records) == ["r0", "r2"]


@pytest.mark.parametrize("switched_on", [False, True])
def test_a_step_after_a_request_ends_is_planned_on_the_device_only_with_subsets_on(switched_on):
    runner, rng = _device_runner(batch=3)
    runner._ddtree_device_subsets = switched_on
    _plan(runner, _defer(runner, rng))
    _plan(runner, bench.subset_step(runner, _defer(runner, rng)))
    stats = runner.ddtree_stats
    assert stats.device_plan_steps == 1 + switched_on and stats.device_plan_subset_steps == switched_on
    assert (runner._ddtree_plan.trees is None) == switched_on  # device-planned: built on the host only when read
    np.testing.assert_array_equal(runner._ddtree_plan.num_nodes, [16, 16])
    # The steady steps after it: the first uploads its own layout (a subset step's rows are no later step's), the
    # second resumes.
    for step in range(2):
        _plan(runner, _defer(runner, rng))
        assert stats.device_plan_steps == 2 + switched_on + step and stats.device_plan_resumed_steps == step


def test_fits_far_from_the_end():
    computed = np.array([100, 200])
    assert device_plan.fits_far_from_the_end(computed, 16, 4, 200 + 2 * 16 + 2 * 5)
    assert not device_plan.fits_far_from_the_end(computed, 16, 4, 200 + 2 * 16 + 2 * 5 - 1)
    assert not device_plan.fits_far_from_the_end(np.array([], dtype=np.int64), 16, 4, 10**6)


def test_the_switch_and_what_it_needs():
    from ddtree.vllm.config import DDTreeConfigError, device_plan_lacks, device_plan_mode

    assert device_plan_mode({}) == "auto"
    assert device_plan_mode({"DDTREE_DEVICE_PLAN": " Auto "}) == "auto"
    assert device_plan_mode({"DDTREE_DEVICE_PLAN": "1"}) == "1"
    assert device_plan_mode({"DDTREE_DEVICE_PLAN": "0"}) == "0"
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_DEVICE_PLAN must be one of auto .*got 'yes'"):
        device_plan_mode({"DDTREE_DEVICE_PLAN": "yes"})
    assert device_plan_lacks(True, True, True, True, True) == []
    lacking = device_plan_lacks(False, False, False, False, False)
    for needed in ("CUDA device", "asynchronous scheduling", "late trees", "device walk", "step graphs"):
        assert any(needed in line for line in lacking), (needed, lacking)


def test_a_top_k_that_does_not_fit_the_buffer_is_refused():
    planner = device_plan.DevicePlanner("cpu", max_requests=2, draft_len=4, top_k=8, conv_window=0, words=1)
    with pytest.raises(ValueError, match="does not fit"):
        planner.keep_top_k(torch.zeros(3 * 4, 16), ("a", "b", "c"))
    with pytest.raises(ValueError, match="does not fit"):
        planner.keep_top_k(torch.zeros(4, 10), ("a",))


@pytest.mark.parametrize("precapture", [True, False])
@pytest.mark.parametrize("subsets", [False, True])
def test_precaptured_device_plan_graphs_are_the_ones_a_steady_step_replays(monkeypatch, precapture, subsets):
    """DDTREE_PRECAPTURE with DDTREE_DEVICE_PLAN: the device plan's graph of each FULL size (whose first run would
    compile the Triton kernels while serving) and the walk's graph of its outputs are captured at start-up, and with
    DDTREE_DEVICE_PLAN_SUBSETS the subset layout's too; a steady step of that size, and a reordered one, then run no
    graph for the first time."""
    from ddtree.vllm.graphs import WalkGraphs

    monkeypatch.setattr(ShapeGraphs, "first_runs", 0)
    batch, budget = 3, 8
    runner = bench.build_runner(batch, budget, 3, 4)
    bench.prepare_device_plan(runner, run_kernels=False)
    runner._ddtree_walk_graphs = WalkGraphs(bench.placement_stand_in(False))
    runner._ddtree_late_trees = True
    runner._ddtree_device_subsets = subsets
    if precapture:
        runner._ddtree_precapture_step_graphs(batch, budget + 1)
        # The host plan's placement and walk, the device plan's graph and the walk of its outputs (and the subset
        # layout's graph and walk).
        assert ShapeGraphs.first_runs == 4 + 2 * subsets and runner.ddtree_stats.precaptured_device_plans == 1
        assert runner.ddtree_stats.precaptured_subset_plans == subsets
    rng = np.random.default_rng(0)
    steps = [False, True] if subsets else [False]  # a steady step, then one in another order
    for step, reordered in enumerate(steps):
        before = ShapeGraphs.first_runs
        output = _defer(runner, rng)
        _plan(runner, bench.subset_step(runner, output, finished=False) if reordered else output)
        plan = runner._ddtree_plan
        assert runner.ddtree_stats.device_plan_steps == step + 1
        assert runner.ddtree_stats.device_plan_subset_steps == reordered
        target = torch.zeros(plan.num_tokens, dtype=torch.int64)
        runner._ddtree_walk_graphs.walk(plan.device_trees, target, budget + 1, 4, plan.num_tokens, plan.conv_window)
        assert ShapeGraphs.first_runs - before == (0 if precapture else 2)


def test_subset_graphs_that_fail_at_start_up_leave_those_steps_to_the_host(monkeypatch):
    """The subset layout's precapture failing (a gather a GPU cannot capture, say) turns subset steps off, with a
    warning; start-up goes on, and whole steps keep the device plan."""
    from ddtree.vllm.graphs import WalkGraphs

    monkeypatch.setattr(ShapeGraphs, "first_runs", 0)
    runner = bench.build_runner(3, 8, 3, 4)
    bench.prepare_device_plan(runner, run_kernels=False)
    runner._ddtree_walk_graphs = WalkGraphs(bench.placement_stand_in(False))
    runner._ddtree_late_trees = True
    runner._ddtree_device_subsets = True
    upload_and_place = runner._ddtree_device_upload_and_place

    def failing_subsets(num_reqs, size, total, serial, rows=None):
        if rows is not None:
            raise RuntimeError("no gather here")
        return upload_and_place(num_reqs, size, total, serial, rows)

    runner._ddtree_device_upload_and_place = failing_subsets
    runner._ddtree_precapture_step_graphs(3, 9)
    assert runner._ddtree_device_subsets is False and runner.ddtree_stats.precaptured_subset_plans == 0
    assert runner._ddtree_device_planner is not None and runner.ddtree_stats.precaptured_device_plans == 1
    rng = np.random.default_rng(0)
    _plan(runner, _defer(runner, rng))
    _plan(runner, bench.subset_step(runner, _defer(runner, rng), finished=False))
    assert runner.ddtree_stats.device_plan_steps == 1 and runner.ddtree_stats.device_plan_subset_steps == 0


@pytest.mark.parametrize("setting", [None, "1"])
def test_kernels_that_fail_at_start_up_leave_the_host_plan_under_the_default(monkeypatch, setting):
    """A GPU whose Triton cannot compile or fit the device plan's kernels (their first run, at start-up's
    precapture): the default plans every step on the host from then on and says why (log, summary); ``1`` fails
    start-up naming the error."""
    from types import SimpleNamespace

    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.graphs import WalkGraphs

    warnings = []
    monkeypatch.setattr(
        runner_module,
        "logger",
        SimpleNamespace(info=lambda *a: None, warning=lambda fmt, *args: warnings.append(fmt % args)),
    )
    if setting is None:
        monkeypatch.delenv("DDTREE_DEVICE_PLAN", raising=False)
    else:
        monkeypatch.setenv("DDTREE_DEVICE_PLAN", setting)
    batch, budget = 3, 8
    runner = bench.build_runner(batch, budget, 3, 4)
    bench.prepare_device_plan(runner, run_kernels=False)
    runner._ddtree_walk_graphs = WalkGraphs(bench.placement_stand_in(False))
    runner._ddtree_late_trees = True

    def out_of_resources(*args):
        raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 101376")

    runner._ddtree_device_planner.build_and_lay_out = out_of_resources
    if setting == "1":
        with pytest.raises(RuntimeError, match=r"DDTREE_DEVICE_PLAN=1, but its kernels failed .*shared memory"):
            runner._ddtree_precapture_step_graphs(batch, budget + 1)
        return
    runner._ddtree_precapture_step_graphs(batch, budget + 1)
    assert runner._ddtree_device_planner is None and runner.ddtree_stats.precaptured_device_plans == 0
    assert runner._ddtree_device_plan_state.startswith("off: its kernels failed at start-up on 3 trees of 9 tokens")
    assert len(warnings) == 1 and "shared memory" in warnings[0]
    _plan(runner, _defer(runner, np.random.default_rng(0)))  # the next steady step: the host plan's, whole
    assert runner.ddtree_stats.device_plan_steps == 0 and runner._ddtree_plan.trees is not None


@pytest.mark.parametrize("setting, precaptured, kept", [(None, 0, False), (None, 2, True), ("1", 0, True)])
def test_a_device_plan_that_never_ran_at_start_up_is_dropped_under_the_default(monkeypatch, setting, precaptured, kept):
    """No FULL graph captured (enforce_eager, PIECEWISE only): the device plan's kernels never ran at start-up, so
    the default drops it at the warm-up rather than compile them while serving; ``1`` keeps it."""
    if setting is None:
        monkeypatch.delenv("DDTREE_DEVICE_PLAN", raising=False)
    else:
        monkeypatch.setenv("DDTREE_DEVICE_PLAN", setting)
    lines = _log_lines(monkeypatch)
    runner = bench.build_runner(2, 8, 3, 4)
    bench.prepare_device_plan(runner, run_kernels=False)
    runner._ddtree_device_plan_state = "on"
    runner.ddtree_stats.precaptured_device_plans = precaptured
    warmed = []
    runner.drafter.warm_up = lambda: warmed.append(True)
    runner.ddtree_warm_up()
    assert (runner._ddtree_device_planner is not None) is kept and warmed == [True]
    assert (
        runner._ddtree_device_plan_state == "on"
        if kept
        else "never ran at start-up" in runner._ddtree_device_plan_state
    )
    assert any("never ran at start-up" in line for line in lines) is not kept


def _log_lines(monkeypatch) -> list:
    from types import SimpleNamespace

    from ddtree.vllm import runner as runner_module

    lines = []
    monkeypatch.setattr(runner_module, "logger", SimpleNamespace(info=lambda fmt, *args: lines.append(fmt % args)))
    return lines


def test_the_runner_refuses_the_switch_without_what_it_needs(monkeypatch):
    """Without a prerequisite (here a CUDA device) the default plans on the host and says why; ``1`` refuses."""
    lines = _log_lines(monkeypatch)
    runner = bench.build_runner(1, 8, 3, 4)
    runner._ddtree_late_trees, runner._ddtree_step_graphs_on = True, True
    monkeypatch.delenv("DDTREE_DEVICE_PLAN", raising=False)
    assert runner._ddtree_make_device_planner() is None
    assert any("built on the host (the device plan needs a CUDA device" in line for line in lines), lines
    assert runner._ddtree_device_plan_state.startswith("off: needs a CUDA device")  # (the summary's device_plan)
    monkeypatch.setenv("DDTREE_DEVICE_PLAN", "1")
    with pytest.raises(RuntimeError, match=r"DDTREE_DEVICE_PLAN=1 needs a CUDA device"):
        runner._ddtree_make_device_planner()


@pytest.mark.parametrize(
    "setting, budget, planned",
    [(None, 63, True), ("auto", 127, True), (None, 255, False), ("1", 255, True), ("0", 63, False)],
)
def test_the_default_plans_on_the_device_where_the_engine_allows_it(monkeypatch, setting, budget, planned):
    """With every prerequisite met the default (``auto``) makes the planner, unless no budget's trees fit the
    device's (then the host plans every step and the log says so); ``0`` never makes it."""
    from ddtree.vllm import runner as runner_module

    lines = _log_lines(monkeypatch)
    monkeypatch.setattr(runner_module, "device_plan_lacks", lambda *args: [])
    if setting is None:
        monkeypatch.delenv("DDTREE_DEVICE_PLAN", raising=False)
    else:
        monkeypatch.setenv("DDTREE_DEVICE_PLAN", setting)
    runner = bench.build_runner(1, budget, 8, 8)
    runner._ddtree_late_trees, runner._ddtree_precapture = True, True
    made = runner._ddtree_make_device_planner()
    assert isinstance(made, device_plan.DevicePlanner) if planned else made is None
    assert (runner._ddtree_device_plan_state == "on") is planned, runner._ddtree_device_plan_state
    runner._ddtree_precapture = False  # (its kernels would first run while serving: auto declines, 1 does not)
    assert (runner._ddtree_make_device_planner() is not None) is (planned and setting == "1")
    if not planned and setting != "0":
        assert any("exceed the device plan's 128 nodes" in line for line in lines), lines


def test_the_proposer_packs_the_top_k_where_the_device_plan_reads_it():
    """With the device plan (and the top-K graphs off) the drafter's packed top-K is written straight into the
    planner's buffer, which the deferral then keeps without a copy; with the top-K graphs on it is copied there."""
    from types import SimpleNamespace

    from ddtree.kernels.draft_top_k import pack_top_k
    from ddtree.vllm.proposer import DDTreeProposer

    planner = device_plan.DevicePlanner("cpu", max_requests=4, draft_len=3, top_k=4, conv_window=0, words=1)
    weight = torch.randn(32, 8)
    drafter = object.__new__(DDTreeProposer)
    drafter.model = SimpleNamespace(compute_logits=lambda hidden: hidden @ weight.T)
    drafter.top_k, drafter._capturing, drafter._topk_graphs_on = 4, True, False
    drafter.runner = SimpleNamespace(_ddtree_device_planner=planner)
    hidden = torch.randn(6, 8)
    drafter._sample_draft_tokens(hidden, None)
    logits = hidden @ weight.T
    assert drafter._capture.data_ptr() == planner.top_k_buffer.data_ptr()
    assert torch.equal(planner.top_k_buffer[:6], pack_top_k(logits, *logits.topk(4, dim=-1)))
    req_ids = tuple(["a", "b"])
    planner.keep_top_k(drafter._capture, req_ids)
    assert planner.holds(req_ids) and not planner.holds(tuple(["a", "b"]))  # (by identity, not value)
    drafter._topk_graphs_on = True  # graphs pack into their own memory: the deferral copies
    assert drafter._top_k_of(hidden)["packed"].data_ptr() != planner.top_k_buffer.data_ptr()


@pytest.mark.parametrize("budget, host_planned", [(127, None), (255, "[255]")])
def test_start_up_says_which_budgets_stay_on_the_host(monkeypatch, budget, host_planned):
    from ddtree.vllm import runner as runner_module

    lines = _log_lines(monkeypatch)
    monkeypatch.setattr(runner_module, "device_plan_lacks", lambda *args: [])
    monkeypatch.setenv("DDTREE_DEVICE_PLAN", "1")
    runner = bench.build_runner(1, budget, 8, 8)
    runner._ddtree_late_trees = True
    assert isinstance(runner._ddtree_make_device_planner(), device_plan.DevicePlanner)
    said = [line for line in lines if "planned on the host" in line]
    if host_planned is None:
        assert said == []
    else:
        assert len(said) == 1 and host_planned in said[0] and "128 nodes" in said[0]


def test_steady_steps_of_two_shapes_in_turn_each_upload_their_own_constants():
    """A budget schedule or ``auto`` alternates step shapes: each device-planned step's upload holds its own
    shape's rows and logits rows (the staging laid out anew at each change; the kernels are no-ops here)."""
    runner, rng = _device_runner(batch=3)
    for step, batch in enumerate([3, 2, 3, 2, 3]):
        del runner.req_ids[batch:]
        runner.req_ids.extend(f"r{i}" for i in range(len(runner.req_ids), batch))
        runner.input_batch.num_reqs = batch
        _plan(runner, _defer(runner, rng), np.full(batch, 16))
        assert runner.ddtree_stats.device_plan_steps == step + 1
        np.testing.assert_array_equal(runner._ddtree_plan.batch_index_gpu.numpy(), np.arange(batch))
        np.testing.assert_array_equal(runner._ddtree_plan.logit_rows_gpu.numpy(), np.arange(16 * batch))
        assert runner._ddtree_plan.step_serial == step


def _kernels_stubbed(monkeypatch):
    """The device plan's two kernels as no-ops (no Triton here); the rest of its graph's work (the serial) runs."""
    from ddtree.kernels import tree_build_triton, tree_layout_triton

    monkeypatch.setattr(tree_build_triton, "build_trees_triton", lambda *args, out, **kwargs: out)
    monkeypatch.setattr(tree_layout_triton, "whole_tree_layout_into", lambda *args, **kwargs: None)


def test_a_steady_step_after_another_of_its_shape_uploads_nothing(monkeypatch):
    """The device holds the shape's constants and the next serial after a device-planned step: the next one of the
    same shape uploads nothing, its serial written on the device; a host-planned step in between (an upload, a
    serial the device did not see) sends the next device-planned step back to uploading, once."""
    _kernels_stubbed(monkeypatch)
    runner, rng = bench.build_runner(2, 15, 4, 8), np.random.default_rng(0)
    bench.prepare_device_plan(runner, run_kernels=True)  # (every replay runs the graph's work)
    planner, staging = runner._ddtree_device_planner, runner._ddtree_plan_staging
    uploads = []
    for step, host_planned in enumerate([False, False, False, True, False, False]):
        output = _defer(runner, rng)
        if host_planned:
            planner.forget()
        _plan(runner, output)
        uploads.append(staging.uploads)
        plan = runner._ddtree_plan
        assert plan.step_serial == step
        assert int(plan.device_trees.step_serial[0]) == step  # what the walk writes its paths under
        np.testing.assert_array_equal(plan.batch_index_gpu.numpy(), [0, 1])
    assert np.diff(uploads).tolist() == [0, 0, 1, 1, 0]
    assert runner.ddtree_stats.device_plan_resumed_steps == 3 and runner.ddtree_stats.device_plan_steps == 5


def test_every_ddtree_setting_refuses_a_value_it_does_not_take():
    """``check_environment`` reads each DDTREE_* setting: each refuses a value it does not take, naming itself
    (the sliding-drafter switch read anything but "1" as off before); defaults and known values pass."""
    from ddtree.vllm import config

    names = [getattr(config, n) for n in dir(config) if n.endswith("_ENV")]
    names = [name for name in names if not name.startswith("VLLM_")]  # (vLLM's own variables ddtree reads)
    assert len(names) == 17 and all(name.startswith("DDTREE_") for name in names)
    assert config.check_environment({}) == []
    for name in names:
        with pytest.raises(config.DDTreeConfigError, match=name):
            config.check_environment({name: "maybe"})
        assert config.check_environment({name: "0"}) == []
    assert config.check_environment({"DDTREE_DEVICE_PLAN": "auto", "DDTREE_PRECAPTURE": "all", "OTHER": "x"}) == []
    (warning,) = config.check_environment({"DDTREE_DEVICEPLAN": "1"})
    assert "DDTREE_DEVICEPLAN is not a ddtree setting" in warning and "DDTREE_DEVICE_PLAN?" in warning


def test_a_device_planned_steps_trees_are_those_of_the_staging_views_it_uploaded():
    """The walk's trees of a device-planned step: a repeated step shape's steps share one object (found by the
    staging's views and the placement's offsets, not by reading every tensor), and a step after the staging laid
    out other views gets trees of the views it uploaded, never the last step's."""
    runner, rng = _device_runner(batch=2)
    staging = runner._ddtree_plan_staging

    def trees_read_the_current_views():
        trees, views = runner._ddtree_plan.device_trees, staging.device_views()
        return trees.token_index is views["token_index"] and trees.ancestor_bits is views["ancestor_bits"]

    for _ in range(2):  # (the shape's first step runs its placement eagerly: its outputs are not the graph's)
        _plan(runner, _defer(runner, rng))
    first = runner._ddtree_plan.device_trees
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_resumed_steps == 2
    assert runner._ddtree_plan.device_trees is first and trees_read_the_current_views()
    # A host-planned step of one request lays the staging out anew; then two requests again, device-planned.
    runner.req_ids.pop()
    runner.input_batch.num_reqs = 1
    output = _defer(runner, rng)
    runner._ddtree_device_planner.forget()
    _plan(runner, output, np.array([16]))
    runner.req_ids.append("r1")
    runner.input_batch.num_reqs = 2
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_steps == 4 and trees_read_the_current_views()
    staging._recent_layouts.clear()  # the next layout of this shape is made anew: new views, at other objects
    runner.req_ids.pop()
    runner.input_batch.num_reqs = 1
    output = _defer(runner, rng)
    runner._ddtree_device_planner.forget()
    _plan(runner, output, np.array([16]))
    staging._recent_layouts.clear()
    runner.req_ids.append("r1")
    runner.input_batch.num_reqs = 2
    _plan(runner, _defer(runner, rng))
    assert runner.ddtree_stats.device_plan_steps == 5 and trees_read_the_current_views()
    assert runner._ddtree_plan.device_trees is not first
