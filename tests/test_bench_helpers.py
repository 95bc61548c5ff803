"""The GPU benches' CPU-side helpers: bench_qwen36_shape.py keeps the batches an engine finished when that engine
later times out or dies (its child's stdout is lost then; only the rows it wrote to disk survive), and
gpu_profile.py lists where a step waits for the GPU and keeps its timelines compressed."""

import json
import types
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import bench_qwen36_shape as bench  # noqa: E402


def test_rows_written_before_a_timeout_reach_the_results(tmp_path):
    row = {"ms_per_step": 41.06, "verify_steps": 63}
    bench.write_partial(str(tmp_path), "ddtree64", {"engine": "ddtree64", "steps": {"1": row}})
    results = {"dflash": {"engine": "dflash", "steps": {}}}
    bench.keep_partial(str(tmp_path), "ddtree64", results, "timed_out")
    assert results["ddtree64"]["steps"] == {"1": row} and results["ddtree64"]["timed_out"] is True
    saved = json.loads((tmp_path / "bench_qwen36_shape.json").read_text())
    assert set(saved) == {"dflash", "ddtree64"} and saved["ddtree64"]["steps"]["1"] == row


def test_an_engine_that_wrote_nothing_adds_no_row(tmp_path):
    results = {}
    bench.keep_partial(str(tmp_path), "ddtree64", results, "failed")
    assert results == {} and not (tmp_path / "bench_qwen36_shape.json").exists()


def test_without_an_output_folder_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bench.write_partial("", "ddtree64", {"steps": {}})
    assert list(tmp_path.iterdir()) == []


def test_profile_traces_are_kept_compressed(tmp_path):
    import gzip

    import gpu_profile

    raw = tmp_path / "trace.json"
    raw.write_text('{"traceEvents": []}')
    kept = gpu_profile.compress(str(raw))
    assert kept == str(raw) + ".gz" and not raw.exists()
    assert gzip.open(kept).read() == b'{"traceEvents": []}'


def test_step_summary_gives_the_ratio_to_the_chain_of_the_same_run():
    row = {"ms_per_step": 32.09, "ms_per_decode_step": 30.0}
    assert bench.step_summary(row, {"ms_per_step": 21.79, "ms_per_decode_step": 20.0}) == "32.09 (30.0, 1.50x)"
    assert bench.step_summary(row, None) == "32.09 (30.0)"
    assert bench.step_summary({"ms_per_step": 41.06}, None) == "41.06 (None)"  # a record from before decode timing


def test_a_batch_that_ran_in_waves_says_so_and_so_does_a_ratio_to_it():
    chain = {"ms_per_step": 65.45, "ms_per_decode_step": 60.35, "most_running": 4}
    tree = {"ms_per_step": 36.51, "ms_per_decode_step": 30.88, "most_running": 8}
    assert bench.step_summary(tree, chain, 8) == "36.51 (30.88, 0.51x the chain's waves)"
    assert bench.step_summary(chain, chain, "8") == "65.45 (60.35, 1.00x the chain's waves) [in waves: 4 of 8 at once]"
    assert bench.step_summary(chain, None, 4) == "65.45 (60.35)"  # 4 at once at batch 4: no waves
    assert not bench.in_waves({"ms_per_step": 1.0}, 8)  # a record from before the count: not known, not claimed


def test_the_running_peak_is_the_most_requests_the_scheduler_ran_at_once():
    from types import SimpleNamespace

    running = []
    plan = iter([3, 4, 2, 0])

    def schedule():
        running[:] = range(next(plan))
        return "output"

    scheduler = SimpleNamespace(running=running, schedule=schedule)
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)))
    )
    peak = bench.RunningPeak(llm)
    assert peak.peak is None
    assert [scheduler.schedule() for _ in range(3)] == ["output"] * 3 and peak.peak == 4
    peak.reset()
    scheduler.schedule()
    assert peak.peak == 0
    assert bench.RunningPeak(SimpleNamespace(llm_engine=SimpleNamespace())).peak is None  # a client in another process


def test_syncing_ops_are_listed_with_the_python_line_that_made_them():
    torch = pytest.importorskip("torch")
    import gpu_profile
    from torch.profiler import ProfilerActivity, profile

    def wait_for_the_device():
        x = torch.arange(10)
        (x > 3).nonzero()
        return x.sum().item()

    stacks = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, experimental_config=stacks) as prof:
        wait_for_the_device()
    table = gpu_profile.syncs_by_stack(prof)
    assert "aten::nonzero" in table and "aten::item" in table
    assert "wait_for_the_device" in table  # attributed to this test's function, not left anonymous


def test_busy_time_is_the_union_of_overlapping_intervals():
    import gpu_profile

    assert gpu_profile.merged([(0, 10), (5, 15), (20, 25), (21, 22)]) == [[0, 15], [20, 25]]  # 20 us busy
    assert gpu_profile.merged([]) == []


def test_named_ranges_are_tabled_and_other_ops_left_out():
    torch = pytest.importorskip("torch")
    import gpu_profile
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("ddtree: plan"):
                torch.arange(10).sum()
        with record_function("gpu_model_runner: sample"):
            pass
    table = gpu_profile.scopes_table(prof.key_averages())
    assert "ddtree: plan" in table and "calls     3" in table
    assert "gpu_model_runner: sample" in table and "aten::arange" not in table


def test_gpu_idle_time_is_charged_to_the_innermost_host_range():
    import gpu_profile

    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = [
        event("kernel", "gemm", 0, 10),
        event("gpu_user_annotation", "gpu side of a range", 0, 100),  # not GPU work
        event("user_annotation", "gpu_model_runner: preprocess", 5, 60),
        event("user_annotation", "ddtree: plan", 20, 10),
        event("kernel", "tree", 40, 20),
        event("gpu_memcpy", "copy", 90, 10),
    ]
    busy, span, idle = gpu_profile.idle_by_range(trace)
    assert (busy, span) == (40, 100)
    # Gap 10-40: preprocess 10-20 and 30-40, plan 20-30; gap 60-90: preprocess to 65, then outside every range.
    assert idle == {"gpu_model_runner: preprocess": 25, "ddtree: plan": 10, "(no range)": 25}
    summary = gpu_profile.idle_summary(trace, tokens=5, most=2)
    assert summary["gpu_busy_ms_per_token"] == 0.008 and summary["span_ms_per_token"] == 0.02
    assert list(summary["idle_ms_per_token_by_host_range"]) == ["gpu_model_runner: preprocess", "(no range)"]
    table = gpu_profile.idle_table(trace, tokens=5)
    assert "GPU busy 0.04 ms of a 0.10 ms span (40.0%)" in table and "ddtree: plan" in table
    assert gpu_profile.idle_table([], tokens=5).startswith("GPU busy: no GPU work")


def test_host_calls_are_counted_inside_each_ddtree_range_on_its_own_thread():
    """CUDA API calls and torch ops inside ddtree's ranges, per range on average; calls outside every range, on
    another thread or in vLLM's ranges are not counted."""
    import gpu_profile

    def event(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = [
        event("user_annotation", "ddtree: accept", 0, 100),
        event("cpu_op", "aten::copy_", 10, 30),
        event("cuda_runtime", "cudaMemcpyAsync", 15, 20),
        event("cuda_runtime", "cudaGraphLaunch", 50, 40),
        event("cuda_runtime", "cudaGraphLaunch", 60, 5, tid=2),  # another thread
        event("user_annotation", "ddtree: accept", 200, 50),
        event("cuda_runtime", "cudaGraphLaunch", 210, 20),
        event("cuda_runtime", "cudaLaunchKernel", 300, 5),  # outside every range
        event("user_annotation", "gpu_model_runner: forward", 400, 50),
        event("cuda_runtime", "cudaGraphLaunch", 410, 30),  # vLLM's range
        event("kernel", "walk", 20, 30),  # GPU work is not a host call
    ]
    by_range = gpu_profile.calls_by_range(trace)
    assert list(by_range) == ["ddtree: accept"]
    accept = by_range["ddtree: accept"]
    assert accept["ranges"] == 2 and accept["us"] == 75.0
    assert accept["calls"] == {
        "cudaGraphLaunch": [1.0, 30.0],
        "aten::copy_": [0.5, 15.0],
        "cudaMemcpyAsync": [0.5, 10.0],
    }
    assert list(accept["calls"]) == ["cudaGraphLaunch", "aten::copy_", "cudaMemcpyAsync"]  # costliest first
    table = gpu_profile.calls_table(by_range, most=2)
    assert "ddtree: accept (2 ranges): 75.0 us each" in table and "cudaMemcpyAsync" not in table


def test_host_ms_cover_only_the_timed_steps():
    import gpu_profile

    before = {"verify_steps": 10, "host_ms_per_verify_step": {"commit": 60.0, "plan": 0.5}}  # a 600 ms capture
    after = {"verify_steps": 30, "host_ms_per_verify_step": {"commit": 20.2, "plan": 0.5, "build": 0.1}}
    timed = gpu_profile.timed_host_ms(before, after)
    assert timed["commit"] == pytest.approx(0.3) and timed["plan"] == pytest.approx(0.5)
    assert timed["build"] == pytest.approx(0.15)  # a part first timed in this run
    assert gpu_profile.timed_host_ms(after, after) == {}
    before["vllm_host_ms_per_verify_step"] = {"forward launch": 3.0}
    after["vllm_host_ms_per_verify_step"] = {"forward launch": 2.0}
    assert gpu_profile.timed_host_ms(before, after, "vllm_host_ms_per_verify_step") == {
        "forward launch": pytest.approx(1.5)
    }


def test_each_ddtree_row_lists_its_host_parts_with_the_pieces_inside_them_largest_first():
    import bench_vllm_ddtree as pair_bench

    rows = [
        {"engine": "dflash", "batch": 8},
        {
            "engine": "ddtree-63",
            "batch": 8,
            "host_ms_per_verify_step": {"plan": 0.3, "defer": 0.1, "commit": 0.05},
            "host_detail_ms_per_verify_step": {
                "plan: device upload": 0.02,
                "plan: device graph": 0.1,
                "defer: copy": 0.04,
            },
        },
    ]
    assert pair_bench.host_pieces(rows) == [
        "ddtree-63 batch 8: plan 0.300 (device graph 0.100, device upload 0.020); defer 0.100 (copy 0.040); "
        "commit 0.050"
    ]


def test_host_ms_average_the_steady_steps_and_count_first_runs_apart():
    """Summaries with the first-run split: ddtree's parts over the steady steps, vLLM's over all verify steps, and
    the window's first runs with their mean host ms."""
    import gpu_profile

    before = {"verify_steps": 10, "steady_verify_steps": 8, "first_run_steps": 2, "first_run_host_ms": {"plan": 40.0}}
    before.update(host_ms_per_verify_step={"plan": 0.5}, vllm_host_ms_per_verify_step={"forward launch": 0.3})
    before["graph_launch_ms_per_verify_step"] = {"walk": 0.02}
    after = {"verify_steps": 30, "steady_verify_steps": 26, "first_run_steps": 4}
    after["first_run_host_ms"] = {"plan": 70.0, "accept": 10.0}
    after.update(host_ms_per_verify_step={"plan": 26 * 0.4 / 26 + (8 * 0.1) / 26})  # 0.5 over 8, then 0.4 over 18
    after.update(vllm_host_ms_per_verify_step={"forward launch": 0.3}, graph_launch_ms_per_verify_step={"walk": 0.02})
    before["host_detail_ms_per_verify_step"] = {"plan: device upload": 0.2}
    after["host_detail_ms_per_verify_step"] = {"plan: device upload": (8 * 0.2 + 18 * 0.1) / 26}
    fields = gpu_profile.host_ms_fields(before, after)
    assert fields["host_detail_ms_per_verify_step"]["plan: device upload"] == pytest.approx(0.1)  # the window's
    assert fields["host_ms_per_verify_step"]["plan"] == pytest.approx((26 * 0.4 + 0.8 - 8 * 0.5) / 18)
    assert fields["vllm_host_ms_per_verify_step"]["forward launch"] == pytest.approx(0.3)  # over all 20 steps
    assert fields["graph_launch_ms_per_verify_step"]["walk"] == pytest.approx(0.02)
    assert fields["first_runs"] == 2 and fields["host_ms_per_first_run"] == pytest.approx(20.0)
    assert "vllm_host_ms_per_verify_step" not in gpu_profile.host_ms_fields(before, after, vllm_parts=False)
    assert gpu_profile.first_run_steps(after, after) == {"first_runs": 0, "host_ms_per_first_run": None}


def test_gpu_time_is_summed_by_kernel_family_and_compared_with_the_chain():
    import gpu_profile

    def kernel(name, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur}

    mine = [
        kernel("_tree_gdn_fwd_kernel", 3000),
        kernel("nvjet_sm90_tst_384x72_64x3_4x1_v_bz_coopA_TNT", 9000),
        kernel("triton_poi_fused_mul_silu_slice_4", 500),
        kernel("Memcpy HtoD (Pinned -> Device)", 200, cat="gpu_memcpy"),
        kernel("_paged_tree_attention_kernel", 900),
        kernel("void at::native::some_kernel", 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host side: not GPU time
    ]
    chain = [kernel("fused_sigmoid_gating_delta_rule_update_kernel", 2000), kernel("cutlass_gemm_x", 8000)]
    by_family = gpu_profile.gpu_ms_by_family(mine, tokens=2)
    assert by_family == {
        "GEMM": 4.5,
        "ddtree tree GDN": 1.5,
        "ddtree tree attention": 0.45,
        "torch.compile fused": 0.25,
        "copies": 0.1,
        "other": 0.05,
    }
    table = gpu_profile.family_comparison(by_family, gpu_profile.gpu_ms_by_family(chain, tokens=2))
    lines = table.splitlines()
    assert lines[1].split()[:3] == ["ddtree", "tree", "GDN"] and lines[1].endswith("+1.500")  # largest difference
    assert "vLLM GDN" in table and lines[-1].split()[-1] == "+1.850"  # 6.85 against 5.0 ms of GPU work


def test_the_chain_estimate_is_set_beside_the_measured_chain_of_the_same_batch():
    import bench_vllm_ddtree as pair_bench

    table = [
        {"engine": "dflash", "batch": 1, "mean_acceptance_length": 2.15},
        {"engine": "dflash", "batch": 8, "mean_acceptance_length": 2.29},
        {"engine": "ddtree-256-async", "batch": 1, "acceptance_length_if_chain": {"acceptance_length": 2.2}},
        {"engine": "ddtree-256-async", "batch": 32, "acceptance_length_if_chain": {"acceptance_length": 2.6}},
        {"engine": "ddtree-64-async", "batch": 8, "acceptance_length_if_chain": {}},  # nothing counted
    ]
    assert pair_bench.what_if_chain_checks(table) == [("ddtree-256-async", 1, 2.2, 2.15)]


def test_the_pair_bench_sizes_batched_tokens_by_each_engines_largest_budget():
    """A schedule or ``auto`` as ddtree_budget (the bench's child crashed on a schedule's dict before)."""
    import bench_vllm_ddtree as pair_bench

    assert pair_bench.largest_budget(None) == 0
    assert pair_bench.largest_budget({"method": "dflash", "num_speculative_tokens": 15}) == 15
    assert pair_bench.largest_budget({"method": "ddtree", "ddtree_budget": 64}) == 64
    assert pair_bench.largest_budget({"method": "ddtree", "ddtree_budget": {"1": 256, "32": 64}}) == 256
    assert pair_bench.largest_budget({"method": "ddtree", "ddtree_budget": "auto"}) == 64
    assert pair_bench.largest_budget({"method": "ddtree", "ddtree_budget": "auto", "ddtree_max_budget": 256}) == 256


def test_the_host_profile_run_serves_every_group_between_start_and_stop_and_writes_the_text(tmp_path):
    import bench_vllm_ddtree as pair_bench

    calls = []

    class FakeLLM:
        def collective_rpc(self, method):
            calls.append(method)
            return ["profile text"] if method == "ddtree_host_profile_stop" else [None]

        def generate(self, prompts, params, use_tqdm):
            calls.append(("generate", list(prompts), params))

    args = types.SimpleNamespace(name="ddtree-63", out=str(tmp_path))
    name = pair_bench.host_profile_run(FakeLLM(), [["a", "b"], ["c"]], ["pa", "pb", "pc"], 2, args)
    assert name == "host_profile_ddtree-63_b2.txt" and (tmp_path / name).read_text() == "profile text"
    assert calls == [
        "ddtree_host_profile_start",
        ("generate", ["a", "b"], ["pa", "pb"]),  # a seeded run's own params follow its requests
        ("generate", ["c"], ["pc"]),
        "ddtree_host_profile_stop",
    ]


def test_the_subset_step_bench_times_the_host_plan_against_the_device_subset_plan():
    import bench_plan_path

    row = bench_plan_path.measure_subset_steps(3, 15, 4, 8, steps=2, rounds=1)
    assert row["device_subset_steps"] == 5 + 2 and row["host_plan_device_steps"] == 0  # each side took its path
    assert row["host_plan_ms"] > 0 and row["device_subset_ms"] > 0
    with pytest.raises(ValueError, match="a batch of 2 or more"):
        bench_plan_path.measure_subset_steps(1, 15, 4, 8, steps=2)


def test_churn_gives_each_request_its_own_length_and_runs_at_most_b_at_once():
    import bench_vllm_ddtree as pair_bench

    lengths = pair_bench.churn_lengths(64, 128)
    assert lengths == pair_bench.churn_lengths(64, 128)  # the same for every engine and run
    assert all(32 <= n <= 224 for n in lengths) and len(set(lengths)) > 16 and 96 < sum(lengths) / 64 < 160
    args = types.SimpleNamespace(regex=None, temperature=0.0, seeded=False, churn=True, requests=64, max_tokens=128)
    params = pair_bench.timed_params(args)
    assert [p.max_tokens for p in params] == lengths and all(p.seed is None for p in params)
    args.temperature, args.seeded = 1.0, True
    assert [p.seed for p in pair_bench.timed_params(args)] == list(range(64))
    args.churn = False
    assert [p.max_tokens for p in pair_bench.timed_params(args)] == [128] * 64

    scheduler = types.SimpleNamespace(max_num_running_reqs=32)
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(
            engine_core=types.SimpleNamespace(engine_core=types.SimpleNamespace(scheduler=scheduler))
        )
    )
    pair_bench.limit_running_requests(llm, 8)
    assert scheduler.max_num_running_reqs == 8


def test_the_timed_window_counts_are_the_counters_differences_with_the_device_plans_share():
    import bench_vllm_ddtree as pair_bench

    before = {"verify_steps": 100, "device_plan_steps": 40}
    after = {"verify_steps": 300, "device_plan_steps": 190, "device_plan_subset_steps": 30}
    counts = pair_bench.timed_window_counts(
        before, after, ("verify_steps", "device_plan_steps", "device_plan_subset_steps")
    )
    assert counts == {
        "verify_steps": 200,
        "device_plan_steps": 150,
        "device_plan_subset_steps": 30,
        "device_plan_share": 0.75,
    }
    assert "device_plan_share" not in pair_bench.timed_window_counts(
        before, before, ("verify_steps", "device_plan_steps")
    )
    # Why the device plan turned steps down, over the same window (reasons seen only before it are left out).
    before["device_plan_declined_steps"] = {"near max_model_len": 3, "top-K not kept": 1}
    after["device_plan_declined_steps"] = {"near max_model_len": 5, "top-K not kept": 1, "structured outputs": 2}
    counts = pair_bench.timed_window_counts(before, after, ("verify_steps",))
    assert counts["device_plan_declined_steps"] == {"near max_model_len": 2, "structured outputs": 2}


def test_the_plan_path_bench_runs_the_runners_plan_and_restores_vllm():
    """A small step of bench_plan_path: the runner's late-tree plan path runs without an engine, its tensor ops are
    counted, and vLLM's runner methods are back afterwards (the bench stubs them while it measures)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import bench_plan_path

    before = GPUModelRunner._prepare_inputs, GPUModelRunner._preprocess
    row = bench_plan_path.measure(batch=2, budget=8, depth=3, top_k=4, steps=2, rounds=1)
    assert row["batch"] == 2 and row["host_ms"] > 0 and 5 <= row["tensor_ops"] <= 40
    assert (GPUModelRunner._prepare_inputs, GPUModelRunner._preprocess) == before


def test_the_early_path_bench_queues_each_step_before_its_trees_and_releases_the_gate(monkeypatch):
    """bench_plan_path --path early: after the first step (which captures the placement), every step is queued
    early (gate, upload, placement) and its trees written after the stubbed forward launch, the gate released;
    vLLM's runner methods are back afterwards."""
    import bench_plan_path
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm import graphs, launch_gate
    from ddtree.vllm.graphs import ShapeGraphs

    monkeypatch.setattr(ShapeGraphs, "first_runs", ShapeGraphs.first_runs)  # a process-wide count, restored
    before = GPUModelRunner._prepare_inputs, GPUModelRunner._preprocess, GPUModelRunner._model_forward
    runner, rng = bench_plan_path.build_runner(2, 8, 3, 4), np.random.default_rng(0)
    bench_plan_path.prepare_early(runner, graphs, launch_gate)
    with bench_plan_path.vllm_parts_stubbed():
        for _ in range(4):
            bench_plan_path.early_step(runner, bench_plan_path.defer_proposal(runner, rng))
    assert runner.ddtree_stats.early_launch_steps == 3  # the first step captured the placement: prepared at once
    assert runner._ddtree_gate.released == 3 and runner._ddtree_early is None
    assert runner._ddtree_plan is not None and runner._ddtree_plan.num_nodes.tolist() == [9, 9]
    assert (GPUModelRunner._prepare_inputs, GPUModelRunner._preprocess, GPUModelRunner._model_forward) == before


def test_the_stats_path_counts_every_step_through_the_runners_ring_and_is_compared_by_its_mean():
    """bench_plan_path --path stats: each timed call notes one step whose path rows the (untimed) walk wrote into
    the ring the runner makes, and counts what landed; with the ring copied every PATH_RING_SLOTS-th step, all
    steps are counted by then. The comparison of an amortized path is the mean of its steps (the slowest 2% left
    out), not the median step."""
    import bench_plan_path
    import numpy as np

    from ddtree.vllm.runner import PATH_RING_SLOTS

    runner, rng = bench_plan_path.build_runner(2, 8, 3, 4), np.random.default_rng(0)
    slots = runner._ddtree_counts.slots
    assert slots == PATH_RING_SLOTS
    counted = []
    for _ in range(2 * slots):
        assert bench_plan_path._timed_stats(bench_plan_path, runner, rng, False) > 0
        counted.append(runner.ddtree_stats.steps)
    # Read once PATH_RING_SLOTS steps are in flight (on CPU a copy lands at once).
    assert counted == [0] * (slots - 1) + [slots] * slots + [2 * slots]
    assert runner._ddtree_counts.lost_steps == 0  # each step found its own serial in its slot
    steps = [1.0] * 50 + [5.0] * 49 + [100.0]  # a read every other step and one hiccup
    assert bench_plan_path._typical(steps, amortized=False) == 3.0
    assert bench_plan_path._typical(steps, amortized=True) == (50 * 1.0 + 48 * 5.0) / 98


def _precapture_runner(monkeypatch, batch: int, budget: int):
    """The plan-path bench's runner with step graphs on, late trees, and placement and walk graphs whose capture is
    a stand-in (a replay is a no-op: the captured outputs stay where the capture's run left them, as on a GPU);
    first runs counted from zero."""
    import bench_plan_path
    import numpy as np

    from ddtree.vllm.graphs import ShapeGraphs, WalkGraphs

    monkeypatch.setattr(ShapeGraphs, "first_runs", 0)

    def capture(work):
        work()
        return lambda: None

    runner = bench_plan_path.build_runner(batch, budget, 3, 4)
    runner._ddtree_plan_graphs, runner._ddtree_walk_graphs = ShapeGraphs(capture), WalkGraphs(capture)
    runner._ddtree_step_graphs_on, runner._ddtree_late_trees = True, True
    return runner, np.random.default_rng(0)


@pytest.mark.parametrize("precapture", [True, False])
def test_precaptured_step_graphs_are_the_ones_a_real_step_of_that_size_replays(monkeypatch, precapture):
    """DDTREE_PRECAPTURE: the placement and walk graphs captured at start-up on filler trees are found by a real
    late step of whole trees of that size (its plan, placement and device walk run no graph for the first time);
    without it that step captures both. A replay is a no-op here: the captured outputs stay where the capture's run
    left them, as on a GPU."""
    import bench_plan_path

    from ddtree.vllm.graphs import ShapeGraphs

    batch, budget = 3, 8
    runner, rng = _precapture_runner(monkeypatch, batch, budget)
    if precapture:
        runner._ddtree_precapture_step_graphs(batch, budget + 1)
        assert ShapeGraphs.first_runs == 2  # the placement's and the walk's
        assert runner.ddtree_stats.summary()["precaptured_sizes"] == 1
    before = ShapeGraphs.first_runs
    with bench_plan_path.vllm_parts_stubbed():
        bench_plan_path.plan_step(runner, bench_plan_path.defer_proposal(runner, rng))
    plan = runner._ddtree_plan
    assert plan.num_nodes.tolist() == [budget + 1] * batch and plan.device_trees is not None
    target = torch.zeros(plan.num_tokens, dtype=torch.int64)
    runner._ddtree_walk_graphs.walk(plan.device_trees, target, budget + 1, 4, plan.num_tokens, plan.conv_window)
    assert ShapeGraphs.first_runs - before == (0 if precapture else 2)


def test_vllm_graph_memory_profile_precaptures_nothing_and_the_real_capture_after_it_does(monkeypatch):
    """vLLM's CUDA-graph memory profile (with its default ``gpu_memory_utilization``) runs FULL captures under
    inference mode on a profiling KV cache it frees after; the capture that follows runs outside inference mode.
    A precapture inside the profile left inference tensors that the real capture's walk then wrote: start-up
    failed on the H200 (the 27B shape, ``c0abd2f``). The profile now precaptures nothing; the capture does."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.graphs import ShapeGraphs

    batch, budget = 3, 8
    runner, _ = _precapture_runner(monkeypatch, batch, budget)
    runner._ddtree_precapture, runner.uniform_decode_query_len = True, budget + 1
    runner._ddtree_full_graphs = lambda: True
    runner._ddtree_stage_dummy_step = lambda trees, tree_size: (None, None)  # (vLLM's dummy tree step: not here)
    total = batch * (budget + 1)

    def capture_run(self):
        return self._dummy_run(total, CUDAGraphMode.FULL, uniform_decode=True, is_graph_capturing=True)

    @torch.inference_mode()
    def vllm_profile(self):
        capture_run(self)
        return 0

    monkeypatch.setattr(GPUModelRunner, "_dummy_run", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(GPUModelRunner, "profile_cudagraph_memory", vllm_profile)
    assert runner.profile_cudagraph_memory() == 0
    assert runner.ddtree_stats.summary()["precaptured_sizes"] == 0 and ShapeGraphs.first_runs == 0
    assert not runner._ddtree_profiling_graph_memory
    capture_run(runner)  # vLLM's capture_model: outside inference mode
    assert runner.ddtree_stats.summary()["precaptured_sizes"] == 1 and ShapeGraphs.first_runs == 2


def test_precapture_all_commits_a_filler_step_the_way_serving_commits_that_size(monkeypatch):
    """DDTREE_PRECAPTURE=all: after the walk's graph, the precapture runs the commit of a step of that size as
    ``_sample`` does after a replayed walk (the FULL graph's key, the walk graph's own outputs, a GDN step on the
    fixed tree buffers), so the commit graph's key (those addresses) is the one a real step of the size hands
    over; the runner's step state is restored after. Without a GDN commit the K/V moves go the same way."""
    import bench_plan_path

    batch, budget = 3, 8
    runner, rng = _precapture_runner(monkeypatch, batch, budget)
    runner._ddtree_precapture_commits, runner._ddtree_walk_replayed, runner._ddtree_accept = True, False, None
    commits, moves = [], []

    def commit_gdn(gpu):
        step = runner._ddtree_gdn_step
        commits.append(
            (runner._ddtree_full_graph, runner._ddtree_walk_replayed, runner._ddtree_accept, step.node_offsets, gpu)
        )
        return False  # (the K/V moves then go apart, as for a target without GDN layers)

    runner._ddtree_commit_gdn = commit_gdn
    runner._ddtree_move_kv = lambda src, dst: moves.append((src, dst))
    total = batch * (budget + 1)
    # What the FULL graph's capture recorded (its slots read from memory no replay has written yet).
    slots = torch.tensor([9, 99, 999])
    runner._ddtree_captured = types.SimpleNamespace(
        replayed=lambda graph: {"layer.0": types.SimpleNamespace(slots=slots)}
    )
    runner._ddtree_precapture_step_graphs(batch, budget + 1)
    assert slots.tolist() == [0, 0, 0]  # the eager first commit writes at vLLM's null block, nowhere else
    ((graph, replayed, host_walk, node_offsets, walked),) = commits
    assert (graph, replayed, host_walk) == ((total, batch), True, None)
    assert moves == [(walked["kv_src"], walked["kv_dst"])]
    assert (runner._ddtree_full_graph, runner._ddtree_walk_replayed, runner._ddtree_gdn_step) == (None, False, None)
    # A real step of that size: its GDN step's tree offsets and its replayed walk's outputs are the same tensors'
    # addresses, so its commit finds the precaptured graph.
    with bench_plan_path.vllm_parts_stubbed():
        bench_plan_path.plan_step(runner, bench_plan_path.defer_proposal(runner, rng))
    plan = runner._ddtree_plan
    assert runner._ddtree_gdn_step.node_offsets.data_ptr() == node_offsets.data_ptr()
    target = torch.zeros(plan.num_tokens, dtype=torch.int64)
    served = runner._ddtree_walk_graphs.walk(plan.device_trees, target, budget + 1, 4, plan.num_tokens, 3)
    for name in ("paths", "path_lengths", "commit_conv_index", "kv_src", "kv_dst"):
        assert served[name].data_ptr() == walked[name].data_ptr(), name


def test_a_cache_sweep_runs_distinct_code_and_reads_its_data_before_each_cold_step(monkeypatch):
    """--cold: the sweep's functions are distinct code objects (one each, so the sweep touches as much code as it
    says), it is called once before every timed step, outside the timing, and the row says it was cold."""
    import bench_plan_path

    sweep = bench_plan_path.CacheSweep(functions=50, floats=1000)
    assert len({f.__code__ for f in sweep.functions}) == 50 and sweep.data.shape == (1000,)
    assert [f(1) for f in sweep.functions[:3]] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    calls = []
    counted = bench_plan_path.CacheSweep.__call__
    monkeypatch.setattr(bench_plan_path.CacheSweep, "__call__", lambda self: calls.append(counted(self)))
    row = bench_plan_path.measure(batch=2, budget=8, depth=3, top_k=4, steps=2, rounds=1, sweep=sweep)
    assert row["cold"] is True and len(calls) == 2 + 5  # every step, the 5 warm-up steps included
    assert bench_plan_path.measure(batch=2, budget=8, depth=3, top_k=4, steps=2, rounds=1)["cold"] is False


def test_the_sampler_path_bench_calls_the_sampler_of_the_planned_step():
    """bench_plan_path --path sampler: after a plan step, ddtree's rejection sampler called for that step emits one
    chain row per request (the walk's rows: every request verified a tree)."""
    import bench_plan_path
    import numpy as np

    runner = bench_plan_path.build_runner(2, 8, 3, 4)
    with bench_plan_path.vllm_parts_stubbed():
        bench_plan_path.plan_step(runner, bench_plan_path.defer_proposal(runner, np.random.default_rng(0)))
    sampler, args = bench_plan_path.sampler_call(runner)
    rows = sampler(*args).sampled_token_ids
    assert rows.shape == (2, 9) and rows.dtype == torch.int32


def test_the_walk_path_bench_hands_the_walk_one_trees_object_while_the_shape_repeats(monkeypatch):
    """bench_plan_path --path walk: with the placement as a graph (outputs kept), each plan step hands the walk the
    same trees object, and the walk finds its graph without reading the tensors' metadata."""
    import dataclasses

    import bench_plan_path
    import numpy as np

    from ddtree.vllm.graphs import ShapeGraphs

    monkeypatch.setattr(ShapeGraphs, "first_runs", ShapeGraphs.first_runs)  # a process-wide count, restored
    runner = bench_plan_path.build_runner(2, 8, 3, 4)
    runner._ddtree_plan_graphs = ShapeGraphs(lambda work: work() or (lambda: None))
    runner._ddtree_step_graphs_on = True
    rng, trees = np.random.default_rng(0), []
    for _ in range(3):
        with bench_plan_path.vllm_parts_stubbed():
            bench_plan_path.plan_step(runner, bench_plan_path.defer_proposal(runner, rng))
        walk, args = bench_plan_path.walk_call(runner)
        walk(*args)
        trees.append(args[0])
    assert trees[1] is trees[2] and dataclasses.is_dataclass(trees[2])
    assert runner._bench_walk_graphs.replayed >= 1


def test_the_pair_bench_refuses_fewer_requests_than_its_largest_batch(monkeypatch, capsys):
    """Every batch size serves ``--requests`` requests b at a time: fewer than the largest batch would run that
    row with a smaller batch under its name."""
    import sys

    import bench_vllm_ddtree as pair_bench

    monkeypatch.setattr(sys, "argv", ["bench_vllm_ddtree.py", "--batches", "1,8", "--requests", "4"])
    with pytest.raises(SystemExit):
        pair_bench.main()
    assert "--requests 4 cannot fill batch 8" in capsys.readouterr().err


def _engines_run(script, monkeypatch) -> None:
    """Each engine of ``run_engines`` becomes ``script`` with argv ``name gate benches_dir``."""
    import bench_vllm_ddtree as pair

    benches = str(Path(pair.__file__).parent)
    monkeypatch.setattr(
        pair, "child_command", lambda args, name, spec, gate: [sys.executable, str(script), name, gate, benches]
    )


def _fake_engine_args(tmp_path, concurrent: int, timeout: int = 20):
    from types import SimpleNamespace

    return SimpleNamespace(
        out=str(tmp_path),
        concurrent_starts=concurrent,
        timeout=timeout,
        interleave=False,
        batches="1",
        repeats=1,
        profile_batches="",
    )


def test_an_interleaved_engines_profiles_take_one_round_after_its_timed_runs():
    """Profiles run after every timed run, in one turn of their own: a round more, only when a profiled batch size
    is one the engine runs."""
    import bench_vllm_ddtree as pair
    from types import SimpleNamespace

    def rounds(profile_batches: str) -> int:
        return pair.timed_rounds(SimpleNamespace(batches="1,8,32", repeats=2, profile_batches=profile_batches))

    assert rounds("") == 6
    assert rounds("1") == 7
    assert rounds("1,8") == 7
    assert rounds("4") == 6


def test_engines_started_side_by_side_run_one_after_the_other(tmp_path, monkeypatch):
    """With --concurrent-starts the engines start together, but no engine's timed runs overlap another engine's
    runs or start (checked on the intervals the fake engines log), and rows come back in order. Two at a time for
    three engines: the third starts when the first has ended, and the second waits for that start."""
    import bench_vllm_ddtree as pair

    script = tmp_path / "engine.py"
    script.write_text(
        "import json, os, sys, time\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "import bench_vllm_ddtree as pair\n"
        "name, gate, start_s = sys.argv[1], sys.argv[2], float(sys.argv[4])\n"
        "launched = time.time(); time.sleep(start_s); ready = time.time()  # the engine's start\n"
        "pair.wait_for_turn(gate, name)\n"
        "began = time.time(); time.sleep(0.3); ended = time.time()\n"
        "with open(os.path.join(os.path.dirname(gate), 'runs.txt'), 'a') as f:\n"
        "    f.write(f'{name} {launched} {ready} {began} {ended}\\n')\n"
        "print('RESULT-JSON ' + json.dumps([{'batch': 1, 'tokens_per_s': 1.0}]))\n"
    )
    benches = str(Path(pair.__file__).parent)
    starts = {"a": 1.0, "b": 0.1, "c": 0.6}  # b is ready long before a; c starts while b waits
    monkeypatch.setattr(
        pair,
        "child_command",
        lambda args, name, spec, gate: [sys.executable, str(script), name, gate, benches, str(starts[name])],
    )
    table = pair.run_engines(_fake_engine_args(tmp_path, 2), [("a", None), ("b", None), ("c", None)], {})
    assert [row["engine"] for row in table] == ["a", "b", "c"]
    logged = {n: tuple(map(float, times)) for n, *times in (line.split() for line in open(tmp_path / "runs.txt"))}
    assert sorted(logged, key=lambda n: logged[n][2]) == ["a", "b", "c"]  # runs in --engines order
    assert logged["b"][0] < logged["a"][2]  # b started before a ran: the starts overlapped
    for n, (_, _, began, ended) in logged.items():
        for other, (launched, ready, other_began, other_ended) in logged.items():
            if other != n:  # no run overlaps another engine's start or run
                assert ended <= launched or began >= ready, (n, other)
                assert ended <= other_began or began >= other_ended, (n, other)
    assert json.loads((tmp_path / "bench_vllm_ddtree.json").read_text())[-1]["engine"] == "c"


def test_interleaved_engines_take_their_timed_runs_round_by_round(tmp_path, monkeypatch, capsys):
    """--interleave: every engine resident, one run per engine per round in --engines order (a b c a b c ...), no
    two runs overlapping and none before every engine has started. An engine that dies in round 2 keeps the rows
    it wrote, marked partial, and the others finish their rounds."""
    import bench_vllm_ddtree as pair

    script = tmp_path / "engine.py"
    script.write_text(
        "import json, os, sys, time\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "import bench_vllm_ddtree as pair\n"
        "name, gate, out = sys.argv[1], sys.argv[2], os.path.dirname(sys.argv[2])\n"
        "time.sleep({'a': 0.6, 'b': 0.1, 'c': 0.3}[name]); ready = time.time()\n"
        "rows = []\n"
        "for round_ in range(4):  # 2 batch sizes x 2 repeats\n"
        "    pair.wait_for_turn(gate, pair.round_name(name, round_))\n"
        "    if name == 'b' and round_ == 2: sys.exit(5)\n"
        "    began = time.time(); time.sleep(0.1); ended = time.time()\n"
        "    with open(os.path.join(out, 'runs.txt'), 'a') as f:\n"
        "        f.write(f'{name} {round_} {ready} {began} {ended}\\n')\n"
        "    if round_ % 2:\n"
        "        rows.append({'batch': round_, 'tokens_per_s': 1.0})\n"
        "        json.dump(rows, open(pair.partial_rows_path(out, name), 'w'))\n"
        "print('RESULT-JSON ' + json.dumps(rows))\n"
    )
    _engines_run(script, monkeypatch)
    args = _fake_engine_args(tmp_path, 3)
    args.interleave, args.batches, args.repeats = True, "1,8", 2
    table = pair.run_engines(args, [("a", None), ("b", None), ("c", None)], {})
    runs = [line.split() for line in open(tmp_path / "runs.txt")]
    order = [(name, int(r)) for name, r, *_ in sorted(runs, key=lambda run: float(run[3]))]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1), ("a", 2), ("c", 2), ("a", 3), ("c", 3)]
    intervals = sorted((float(began), float(ended)) for *_, began, ended in runs)
    assert all(ended <= next_began for (_, ended), (next_began, _) in zip(intervals, intervals[1:]))
    assert min(began for began, _ in intervals) >= max(float(run[2]) for run in runs)  # after every start
    assert [(row["engine"], row["batch"], row.get("partial", False)) for row in table] == [
        ("a", 1, False),
        ("a", 3, False),
        ("b", 1, True),
        ("c", 1, False),
        ("c", 3, False),
    ]
    assert "b: FAILED rc=5" in capsys.readouterr().out


def test_rounds_need_every_engine_started_at_once(tmp_path):
    from engine_turns import run_in_turns

    jobs = [(name, [sys.executable, "-c", "pass"], str(tmp_path / f"{name}.log")) for name in "abc"]
    with pytest.raises(ValueError, match="3 engines, 2 concurrent starts"):
        list(run_in_turns(jobs, str(tmp_path), 2, 5.0, rounds=4))


def test_an_engine_that_never_gets_ready_times_out_and_the_next_one_runs(tmp_path, monkeypatch, capsys):
    import bench_vllm_ddtree as pair

    script = tmp_path / "engine.py"
    script.write_text(
        "import json, sys, time\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "import bench_vllm_ddtree as pair\n"
        "if sys.argv[1] == 'stuck': time.sleep(60)\n"
        "if sys.argv[1] == 'broken': sys.exit(3)\n"
        "pair.wait_for_turn(sys.argv[2], sys.argv[1])\n"
        "print('RESULT-JSON ' + json.dumps([{'batch': 8}]))\n"
    )
    _engines_run(script, monkeypatch)
    engines = [("stuck", None), ("broken", None), ("fine", None)]
    table = pair.run_engines(_fake_engine_args(tmp_path, 2, timeout=2), engines, {})
    printed = capsys.readouterr().out
    assert [row["engine"] for row in table] == ["fine"]
    assert "stuck: TIMEOUT after 2s" in printed and "broken: FAILED rc=3" in printed


def test_the_launch_gate_bench_says_it_needs_a_gpu_where_there_is_none():
    import os
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benches" / "gpu_launch_gate.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(script), "--nodes", "10"], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr


def test_an_engine_waiting_for_its_turn_exits_when_its_bench_is_gone(tmp_path):
    """A waiting engine whose parent died (killed from outside) must not hold its GPU memory forever."""
    import subprocess

    benches = Path(__file__).resolve().parents[1] / "benches"
    waiter = (
        "import sys; sys.path.insert(0, sys.argv[1]); from engine_turns import wait_for_turn; "
        "wait_for_turn(sys.argv[2], 'orphan')"
    )
    # The shell starts the waiter in the background and exits at once: the waiter's parent is gone.
    script = f"ENGINE_TURNS_PARENT=$$ {sys.executable} -c \"{waiter}\" {benches} {tmp_path} >/dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip())
    import os
    import time

    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the orphaned engine kept waiting")
    assert (tmp_path / "orphan.ready").exists() and not (tmp_path / "orphan.go").exists()


def test_the_launch_gates_spin_kernel_compiles_for_an_h200_without_one():
    """The gate kernel is compiled to PTX for sm_90 on this CPU: volatile loads of the flag and the global timer
    (a loop-carried counter typed int32 would not compile: Triton keeps a loop variable's first type)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import gpu_launch_gate

    signature = {"flag_ptr": "*i32", "value": "i32", "error_ptr": "*i32", "limit_ns": "i64"}
    source = ASTSource(fn=gpu_launch_gate.spin_kernel(), signature=signature, constexprs={})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "ld.volatile" in ptx and "globaltimer" in ptx


def test_the_launch_ahead_switch_sets_the_gate_aside_and_restores_it():
    gate = object()
    runner = types.SimpleNamespace(_ddtree_gate=gate)
    worker = types.SimpleNamespace(model_runner=runner)
    assert bench.set_launch_ahead(worker, False) is True and runner._ddtree_gate is None
    assert bench.set_launch_ahead(worker, False) is False and runner._ddtree_gate is None
    assert bench.set_launch_ahead(worker, True) is False and runner._ddtree_gate is gate
    started_without = types.SimpleNamespace(model_runner=types.SimpleNamespace(_ddtree_gate=None))
    with pytest.raises(RuntimeError, match="DDTREE_LAUNCH_AHEAD"):
        bench.set_launch_ahead(started_without, True)


def test_the_device_plan_switch_sets_the_planner_aside_and_restores_it():
    planner = object()
    runner = types.SimpleNamespace(_ddtree_device_planner=planner)
    worker = types.SimpleNamespace(model_runner=runner)
    setter, setting = bench.AB_SWITCHES["no-device-plan"]
    assert setter(worker, setting) is True and runner._ddtree_device_planner is None
    assert bench.set_device_plan(worker, False) is False and runner._ddtree_device_planner is None
    assert bench.AB_SWITCHES["device-plan"][0](worker, True) is False and runner._ddtree_device_planner is planner
    started_without = types.SimpleNamespace(model_runner=types.SimpleNamespace(_ddtree_device_planner=None))
    with pytest.raises(RuntimeError, match=r"started without it \(DDTREE_DEVICE_PLAN\)"):
        bench.set_device_plan(started_without, True)


def test_round_ratios_pair_each_run_with_the_chains_run_of_its_round():
    """Run r of an engine against run r of the chain, the median over rounds: a chain that was lucky in round 1 and
    an engine lucky in round 2 do not make a ratio of two different rounds."""
    import bench_vllm_ddtree as pair

    table = [
        {"engine": "dflash", "batch": 1, "seconds_by_repeat": [10.0, 14.0, 12.0]},
        {"engine": "ddtree-63", "batch": 1, "seconds_by_repeat": [8.0, 7.0, 10.0]},
        {"engine": "ddtree-127", "batch": 1, "seconds_by_repeat": [8.0]},  # partial: not run for run
        {"engine": "ddtree-63", "batch": 8, "seconds_by_repeat": [1.0, 1.0, 1.0]},  # no chain at this batch size
    ]
    pair.add_round_ratios(table)
    assert table[1]["ratio_to_dflash_by_round"] == 1.25  # median of 1.25, 2.0, 1.2 (best against best: 1.43)
    assert "ratio_to_dflash_by_round" not in table[0]
    assert "ratio_to_dflash_by_round" not in table[2]
    assert "ratio_to_dflash_by_round" not in table[3]


def test_auto_in_the_simulated_pair_traffic_settles_near_the_best_fixed_budget():
    """bench_auto_traffic.py runs the real policy and step timer on a simulated clock: its world's best fixed budget
    is 127 at one request and 31 at 8 and 32, and by the third round auto's tokens per ms are within 5% of it at
    every batch size (a regression check of the policy's pieces together: timer rule, probes, hill climbing)."""
    import bench_auto_traffic

    rows = bench_auto_traffic.simulate(rounds=3, seed=0, fixed=6.0, per_request=0.2, per_token=0.0025)
    *steps, final = rows
    assert {(r["batch"], r["best_fixed_budget"]) for r in steps} == {(1, 127), (8, 31), (32, 31)}
    assert steps[0]["probes"] == 1 and sum(r["probes"] for r in steps) <= 3 * 4
    for row in steps:
        assert 0.7 < row["ratio_to_best_fixed"] < 1.05
        if row["round"] == 2:
            assert row["ratio_to_best_fixed"] > 0.95, row
    assert "budget by batch size" in final["lookup"] and final["octave_budgets"]


def test_the_simulation_with_lazy_graph_captures_leaves_each_shapes_first_step_out_and_still_measures_batch_32():
    """--lazy-graphs: the first step of each (budget, batch size) run is handed to the step timer as untimed (the
    runner leaves out a step that captured a graph), one per shape besides the groups' prefills; the 32-63 octave is
    still measured in this world."""
    import bench_auto_traffic

    untimed = []

    class CountingTimer(bench_auto_traffic.StepTimer):
        def finish(self, key):
            untimed.append(key is None)
            super().finish(key)

    saved = bench_auto_traffic.StepTimer
    bench_auto_traffic.StepTimer = CountingTimer
    try:
        rows = bench_auto_traffic.simulate(4, 0, 6.0, 0.2, 0.0025, lazy_graphs=True)
    finally:
        bench_auto_traffic.StepTimer = saved
    prefills = 4 * (32 + 4 + 1)  # per round: 32 groups of one, 4 of eight, one of 32
    assert rows[-1]["first_run_steps"] > 0 and sum(untimed) == prefills + rows[-1]["first_run_steps"]
    assert "32-63" in rows[-1]["period_ratios"]


def test_thread_cpu_finds_the_busy_thread_of_a_process_tree():
    """A thread that spins shows as the busiest of the process between two snapshots (by its native thread id; a
    thread's name is its process's unless it sets one), and a child process's threads are in the tree."""
    import subprocess
    import threading
    import time

    import thread_cpu

    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    stop, spinning = threading.Event(), []
    try:

        def spin():
            spinning.append(threading.get_native_id())
            while not stop.is_set():
                pass

        busy = threading.Thread(target=spin, name="busy-spinner")
        time.sleep(0.1)  # the child is up
        before = thread_cpu.snapshot()
        busy.start()
        time.sleep(0.5)
        after = thread_cpu.snapshot()  # the spinner still alive: an exited thread leaves no entry
        stop.set()
        busy.join()
        assert any(key[0] == child.pid for key in after)  # the child process is in the tree
        top = thread_cpu.busiest(before, after, most=3)
        name, seconds = next(iter(top.items()))
        assert name.endswith(f"[{spinning[0]}]") and seconds >= 0.2, top
        assert thread_cpu.total(before, after) >= seconds
    finally:
        stop.set()
        child.kill()


def test_the_pair_bench_prints_each_rows_busiest_threads_beside_its_wall_seconds():
    import bench_vllm_ddtree as pair_bench

    rows = [
        {"engine": "dflash", "batch": 8, "seconds_by_repeat": [1.0, 1.5], "thread_cpu_s": {"a [1]": 2.4, "b [2]": 0.1}},
        {"engine": "ddtree-63", "batch": 8, "seconds_by_repeat": [2.0], "thread_cpu_s": {"a [3]": 2.0, "c [4]": 1.9}},
        {"engine": "old-row", "batch": 1, "seconds": 3.0},  # a row of an older bench: nothing to print
    ]
    assert pair_bench.busiest_threads(rows, most=2) == [
        "dflash batch 8 (2.50): a [1] 2.40, b [2] 0.10",
        "ddtree-63 batch 8 (2.00): a [3] 2.00, c [4] 1.90",
    ]


def test_the_pair_bench_samples_with_one_seed_per_request_when_asked():
    pytest.importorskip("vllm")
    import bench_vllm_ddtree

    args = types.SimpleNamespace(temperature=1.0, seeded=True, max_tokens=8, requests=3)
    params = bench_vllm_ddtree.timed_params(args)
    assert [p.seed for p in params] == [0, 1, 2] and all(p.temperature == 1.0 for p in params)
    args.seeded = False
    single = bench_vllm_ddtree.timed_params(args)
    assert single.seed is None and single.temperature == 1.0 and single.max_tokens == 8
    args.seeded, args.temperature = True, 0.0
    with pytest.raises(SystemExit, match="--seeded needs --temperature"):
        bench_vllm_ddtree.timed_params(args)


def test_the_pair_bench_puts_every_request_under_the_regex_when_asked():
    pytest.importorskip("vllm")
    import bench_vllm_ddtree

    args = types.SimpleNamespace(temperature=0.0, seeded=False, max_tokens=8, requests=3, regex="([a-z]+ ){400}")
    assert bench_vllm_ddtree.timed_params(args).structured_outputs.regex == "([a-z]+ ){400}"
    args.regex = None
    assert bench_vllm_ddtree.timed_params(args).structured_outputs is None


def test_the_pair_bench_passes_prefix_caching_the_host_profile_pieces_and_churn_to_every_engine_when_asked():
    import bench_vllm_ddtree

    args = types.SimpleNamespace(
        gpu_memory_utilization=0.5, concurrent_starts=1, target="t", drafter="d", batches="1", max_tokens=8, requests=3,
        temperature=0.0, seeded=False, regex=None, prompt_len=16, max_model_len=64, repeats=1, draft_len=4,
        profile_batches="", profile_tokens=0, out="o", profile_no_stacks=False, interleave=False, prompts=None,
        eager=False, prefix_caching=True, kv_cache_gib=0.0, host_profile=True, churn=True, host_pieces=True,
    )  # fmt: skip
    flags = ("--prefix-caching", "--host-profile", "--churn", "--host-pieces")
    command = bench_vllm_ddtree.child_command(args, "dflash", None, "")
    assert all(flag in command for flag in flags)
    args.prefix_caching = args.host_profile = args.churn = args.host_pieces = False
    command = bench_vllm_ddtree.child_command(args, "dflash", None, "")
    assert not any(flag in command for flag in flags)


def test_the_in_engine_ab_times_each_switch_then_the_engines_own_settings_again(monkeypatch):
    """Switches are turned cumulatively, each row timed with the settings it names; then every switch is restored
    and the engine's own settings are timed once more (the order's effect, beside the first timing)."""
    runner = types.SimpleNamespace(_ddtree_commit_in_place=False)
    worker = types.SimpleNamespace(model_runner=runner)
    steps = {"verify_steps": 0}
    timed_with = []

    class Engine:
        def collective_rpc(self, method, args=()):
            if method == "ddtree_summary":
                return [dict(steps, host_ms_per_verify_step={"commit": 0.1})]
            return [method(worker, *args)]

    def timed_generate(llm, prompts, max_tokens):
        steps["verify_steps"] += max_tokens
        timed_with.append((max_tokens, runner._ddtree_commit_in_place))
        return 1.0, None

    monkeypatch.setattr(bench, "timed_generate", timed_generate)
    rows = bench.ab_timings(Engine(), ["p"], "commit-in-place", prefill_seconds=0.0)
    assert [row["switches"] for row in rows] == [["commit-in-place"], []]
    assert rows[-1]["again"] is True and "again" not in rows[0]
    timed = [on for tokens, on in timed_with if tokens == bench.OUT_TOKENS]
    assert timed == [True, False] and runner._ddtree_commit_in_place is False  # restored before the last row
    assert rows[0]["verify_steps"] == bench.OUT_TOKENS and rows[0]["host_ms_per_verify_step"] == pytest.approx(
        {"commit": 0.1}
    )
    timed_with.clear()
    rows = bench.ab_timings(Engine(), ["p"], "commit-in-place", prefill_seconds=0.0, rounds=2)
    assert [(row["switches"], row["round"]) for row in rows] == [
        (["commit-in-place"], 0),
        ([], 0),
        (["commit-in-place"], 1),
        ([], 1),
    ]
    assert [on for tokens, on in timed_with if tokens == bench.OUT_TOKENS] == [True, False, True, False]
    assert runner._ddtree_commit_in_place is False


def test_commit_in_place_is_a_switch_of_the_in_engine_ab():
    runner = types.SimpleNamespace(_ddtree_commit_in_place=False)
    worker = types.SimpleNamespace(model_runner=runner)
    setter, setting = bench.AB_SWITCHES["commit-in-place"]
    assert setter(worker, setting) is False and runner._ddtree_commit_in_place is True
    assert bench.AB_SWITCHES["no-commit-in-place"][0](worker, False) is True and not runner._ddtree_commit_in_place


def test_the_pair_bench_takes_a_pairs_directory_and_refuses_half_of_one(monkeypatch, capsys, tmp_path):
    """``--model DIR`` sets the target, drafter and prompts from one directory (as the e2e harness takes it); with
    --target too, or a directory without the three, it stops with a message that names the problem."""
    import bench_vllm_ddtree as pair_bench

    def parse(*argv):
        monkeypatch.setattr(sys, "argv", ["bench_vllm_ddtree.py", *argv])
        with pytest.raises(SystemExit):
            pair_bench.main()
        return capsys.readouterr().err

    pair = Path(__file__).parent / "fixtures" / "models"
    assert "name the models: --model tests/fixtures/models" in parse()  # random models only when asked for
    assert "drop --target" in parse("--model", str(pair), "--target", "x")
    assert "not a pair's directory, missing" in parse("--model", str(tmp_path))
    assert str(tmp_path / "prompts.json") in parse("--model", str(tmp_path))

    from types import SimpleNamespace

    args = SimpleNamespace(model=str(pair), target=None, drafter=None, prompts=None)
    pair_bench.pair_models(None, args)
    assert (args.target, args.drafter, args.prompts) == (
        str(pair / "target"),
        str(pair / "drafter"),
        str(pair / "prompts.json"),
    )


def test_rows_say_whether_vllms_profiling_ranges_were_on(monkeypatch):
    """enable_scopes() (the benches call it for --profile-batches, for the whole engine) is what scopes_on() reads:
    the rows' ``profiling_scopes`` says the timed runs paid for the ranges."""
    import gpu_profile

    monkeypatch.delenv("VLLM_CUSTOM_SCOPES_FOR_PROFILING", raising=False)
    assert gpu_profile.scopes_on() is False
    gpu_profile.enable_scopes()
    assert gpu_profile.scopes_on() is True
    monkeypatch.setenv("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "0")
    assert gpu_profile.scopes_on() is False


def test_the_27b_shape_writes_the_released_drafters_layer_kinds_beside_the_all_full_one(tmp_path):
    """``ddtree63to15-sliding-drafter`` runs the released drafter's layer kinds (DDTREE_SLIDING_DRAFTER): its config
    loads with them and a window, so the switch's admission takes it."""
    from transformers import AutoConfig

    from ddtree.vllm.sliding_drafter import layer_mask

    bench.write_models(str(tmp_path))
    full = AutoConfig.from_pretrained(str(tmp_path / "drafter"))
    sliding = AutoConfig.from_pretrained(str(tmp_path / bench.SLIDING_DRAFTER_DIR))
    assert sliding.layer_types == bench.RELEASED_LAYER_TYPES and full.num_hidden_layers == sliding.num_hidden_layers
    assert [layer_mask(sliding, i) for i in range(5)] == [(True, 2048)] * 4 + [(False, None)]
    assert bench.ENGINES["ddtree63to15-sliding-drafter"]["drafter"] == bench.SLIDING_DRAFTER_DIR


def test_the_grammar_mask_bench_times_both_sides_and_writes_each_row(tmp_path, monkeypatch, capsys):
    """``bench_grammar_masks.py`` on a small vocabulary: a row per place and batch, both sides timed, the trees'
    rows more than the chain's (64 a request against 16), the JSON written."""
    pytest.importorskip("vllm")
    pytest.importorskip("xgrammar")
    import bench_grammar_masks

    out = tmp_path / "masks.json"
    argv = ["bench_grammar_masks.py", "--vocab", "512", "--batches", "1", "2", "--repeat", "1", "--places", "string"]
    monkeypatch.setattr(sys, "argv", argv + ["--json", str(out)])
    assert bench_grammar_masks.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["place"], r["batch"]) for r in rows] == [("string", 1), ("string", 2)]
    for row in rows:
        assert row["tree_rows"] == 64 * row["batch"] and row["chain_rows"] == 16 * row["batch"]
        assert row["tree_ms"] > 0 and row["chain_ms"] > 0 and row["tree_one_thread_ms"] > 0
    assert "tree/chain" in capsys.readouterr().out
