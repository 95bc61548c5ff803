"""The vLLM runner's plan path under asynchronous scheduling, on CPU tensors: host ms and tensor ops per step.

    python benches/bench_plan_path.py [--batches 1 8 32] [--budget 64] [--depth 15] [--top-k 64] [--steps 20]
        [--json FILE] [--baseline OTHER_CHECKOUT [--baseline-loaded second] [--path plan|sampler]]

What the GPU host does between vLLM's input preparation and the verification's launch, with the late trees the
one-GPU default builds (``runner._prepare_inputs`` publishing the step from vLLM's counts, then
``runner._preprocess``: the drafter's top-K settled, the trees built by the Rust core, laid out into the pinned
staging buffer, uploaded and placed in the fixed buffers, positions and tree tokens written). The runner is built
without an engine: vLLM's own parts of ``_prepare_inputs`` and ``_preprocess`` are stubbed out, and its tensors are
CPU tensors, so a "device" op here is a CPU op.

Two numbers per batch size, neither a GPU measurement:

* ``host ms``: wall time of the path, the best of 5 rounds' medians. Python and numpy cost what they cost on a GPU
  host (scaled by the CPU); a CPU tensor op costs its CPU work instead of a CUDA launch.
* ``tensor ops``: aten operations per step that Python calls and that run a kernel or a copy on a GPU (views and
  allocations left out, ops inside ops counted once), from the profiler: each is a launch (~5-10 us of host time)
  on a GPU host. Deterministic.

``--baseline``: an A/B in one process against another checkout's ``python/`` package (its ``benches/`` copy of this
file builds its runner), its steps alternated with this checkout's step by step, so that the machine's drift (tens
of percent between runs on a shared machine) falls on both alike; prints the ratio of the medians. Which copy is
loaded first is a flag (``--baseline-loaded``); an A/A run (``--baseline`` this checkout) read 0.99-1.00 in both
orders (``cpu-plan-path-26686ec``).

``--path walk`` (an A/B only): after each plan step, the device walk's call through walk graphs whose replay is a
no-op (the host's side of a replayed walk), with the trees object the step's plan got.

``--path early`` (an A/B only): the early-launch path of a FULL whole-tree step instead (``DDTREE_LAUNCH_AHEAD``,
62-63 of 63 steps at the Qwen3.6-27B shape): the gate, upload and placement queued before the trees, then the trees
built into the queued upload after vLLM's (stubbed) forward launch; the placement a graph replayed as a no-op and
the gate's stream wait a stand-in.

``--path stats`` (an A/B only): after each plan step, the statistics' host work of a device-walked step (the copy
of the walk's path rows sent into the ring, the landed steps counted), compared by the mean step (the ring is read
every few steps).

``--path device`` (an A/B only; ``--baseline`` this checkout, or one before ``DDTREE_DEVICE_PLAN``): the plan path of
this checkout with ``DDTREE_DEVICE_PLAN``'s steps (:func:`prepare_device_plan`: its graph's replay, which on a GPU
runs the tree build, layout and placement, a no-op) against the baseline's host plan with its placement a replayed
graph (a no-op too): the host work each leaves on a steady step.

``--path device-ab`` (an A/B only; ``--baseline`` a checkout with ``DDTREE_DEVICE_PLAN``): the device plan's
steps, as ``--path device`` runs them, on both sides.

``--path sampler`` (an A/B only): the rejection sampler's call for the planned step instead (ddtree's sampler in
place of vLLM's: per-row settings, the chain rows; all greedy, the device walk stubbed with fixed rows, logits of a
64-token vocabulary, so its argmax is small beside the host work).

The trees are whole trees of the budget for every request (a FULL-graph step), a hybrid GDN target (conv window
3), the device walk's node arrays included, the plan's step graphs off (no CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
import time
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import torch

#: aten ops that only make views, shapes or allocations: no kernel on a GPU.
NO_KERNEL = {
    "aten::view",
    "aten::slice",
    "aten::select",
    "aten::as_strided",
    "aten::reshape",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::expand",
    "aten::t",
    "aten::transpose",
    "aten::alias",
    "aten::detach",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::lift_fresh",
    "aten::_reshape_alias",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::unbind",
    "aten::split",
    "aten::narrow",
    "aten::permute",
    "aten::contiguous",
}


@contextlib.contextmanager
def vllm_parts_stubbed():
    """vLLM's own ``_prepare_inputs`` and ``_preprocess`` (which need an engine) replaced while measuring."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    saved = GPUModelRunner._prepare_inputs, GPUModelRunner._preprocess, GPUModelRunner._model_forward
    GPUModelRunner._prepare_inputs = lambda self, scheduler_output, counts: ("logits indices", "spec metadata")
    GPUModelRunner._preprocess = lambda self, *args: None
    GPUModelRunner._model_forward = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        GPUModelRunner._prepare_inputs, GPUModelRunner._preprocess, GPUModelRunner._model_forward = saved


def build_runner(batch: int, budget: int, depth: int, top_k: int, conv_window: int = 3, device: str = "cpu"):
    """A runner with the one-GPU defaults (device walk, late trees, asynchronous scheduling), no engine; a hybrid
    GDN target's conv window ``conv_window`` (0: attention only); its tensors on ``device`` (the benches' CPU, or a
    GPU for the tests that run the device plan's kernels compiled)."""
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.graphs import TreeStepBuffers
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.staging import StepStaging
    from ddtree.vllm.step import TreeStore

    cpu = torch.device(device)  # (named for the bench's usual device)
    tokens = batch * (budget + 1)
    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=budget, draft_len=depth, top_k=top_k)
    runner.drafter = SimpleNamespace(store=TreeStore(budget), draft_len=depth, top_k=top_k)
    runner.req_ids = [f"r{i}" for i in range(batch)]
    runner.input_batch = SimpleNamespace(
        req_ids=runner.req_ids, num_computed_tokens_cpu=np.arange(batch) * 100 + 500, num_reqs=batch
    )
    runner.num_decode_draft_tokens = SimpleNamespace(np=np.full(batch, budget))
    runner._ddtree_conv_window = conv_window
    runner._ddtree_buffers = TreeStepBuffers(
        cpu, max(batch, 4), tokens + 8, budget + 1, conv_window + 1 if conv_window else 0
    )
    runner._ddtree_trees_by_tensors = {}
    runner._ddtree_plan_staging, runner._ddtree_count_staging = StepStaging(cpu), StepStaging(cpu)
    runner._ddtree_gdn_step, runner._ddtree_device_accept = None, True
    runner.use_async_scheduling, runner._ddtree_early_token_index, runner._ddtree_late_step = True, None, None
    runner._ddtree_full_graph, runner._ddtree_step_graphs_on, runner._ddtree_walk_graphs = None, False, None
    runner._ddtree_plan_graphs, runner.device, runner.uses_mrope = None, cpu, False
    runner.ddtree_stats = DDTreeStats(depth)
    runner.positions = torch.arange(tokens, device=cpu)
    runner.max_num_reqs = max(batch, 4)
    runner.max_model_len = 1 << 30
    # The statistics' ring (``_ddtree_landing_counts`` in checkouts before the walk wrote it on the device).
    make_ring = getattr(runner, "_ddtree_path_ring", None) or runner._ddtree_landing_counts
    runner._ddtree_counts = make_ring()
    runner.input_ids = SimpleNamespace(gpu=torch.zeros(tokens, dtype=torch.int32, device=cpu))
    return runner


def defer_proposal(runner, rng) -> SimpleNamespace:
    """The drafter's step: its top-K deferred as the proposer does (not timed); the scheduler's output for the
    next step (placeholders of the budget for every request)."""
    from ddtree.vllm.proposer import DDTreeProposer

    cfg, batch = runner.ddtree_cfg, len(runner.req_ids)
    proposer = object.__new__(DDTreeProposer)
    proposer.store, proposer.runner, proposer.device = runner.drafter.store, runner, runner.device
    proposer.draft_len, proposer.top_k, proposer.budget, proposer.cfg = cfg.draft_len, cfg.top_k, cfg.budget, cfg
    proposer._late_host = None
    logits = torch.from_numpy(rng.normal(size=(batch * cfg.draft_len, 4 * cfg.top_k)).astype(np.float32) * 2.0)
    values, ids = logits.topk(cfg.top_k, dim=-1)
    log_probs = values - torch.logsumexp(logits, dim=-1, keepdim=True)
    proposer._capture = torch.cat([log_probs, ids.to(torch.int32).view(torch.float32)], dim=-1).to(runner.device)
    runner.ddtree_budget_for = lambda num_requests: cfg.budget
    proposer._defer(runner.req_ids, batch)
    placeholders = {req_id: [-1] * cfg.budget for req_id in runner.req_ids}
    return SimpleNamespace(
        total_num_scheduled_tokens=batch * (cfg.budget + 1),
        scheduled_spec_decode_tokens=placeholders,
        scheduled_new_reqs=[],
    )


def plan_step(runner, output) -> None:
    """The timed path: publish from the counts, then settle, build, lay out, upload, place."""
    from ddtree.vllm import context

    batch = len(runner.req_ids)
    runner._prepare_inputs(output, np.full(batch, runner.ddtree_cfg.budget + 1))
    runner._preprocess(output, output.total_num_scheduled_tokens)
    context.withdraw()


def early_step(runner, output) -> None:
    """The early-launch path of a FULL whole-tree step (``DDTREE_LAUNCH_AHEAD``): publish from the counts, vLLM's
    FULL dispatch, the gate, upload and placement queued before the trees (``_preprocess``), then, after vLLM's
    forward launch (stubbed), the trees built into the queued upload and the gate released. Needs
    :func:`prepare_early`'s runner."""
    from ddtree.vllm import context

    batch = len(runner.req_ids)
    runner._prepare_inputs(output, np.full(batch, runner.ddtree_cfg.budget + 1))
    runner._ddtree_full_graph = (output.total_num_scheduled_tokens, batch)  # vLLM's FULL dispatch
    runner._preprocess(output, output.total_num_scheduled_tokens)
    runner._model_forward()
    context.withdraw()


def prepare_early(runner, graphs_module, gate_module) -> None:
    """The runner for :func:`early_step`: a gate whose stream wait is a stand-in, and placement graphs captured by
    running the work once (its outputs stay where that left them, as a capture's do) and replayed as a no-op."""

    def capture(work):
        work()
        return lambda: None

    runner._ddtree_gate = gate_module.StreamGate(torch.device("cpu"), wait=lambda *args: 0)
    runner._ddtree_plan_graphs = graphs_module.ShapeGraphs(capture)
    runner._ddtree_step_graphs_on = True
    runner._ddtree_gate_landed_steps = True  # a CPU proposal has always landed: gate it anyway (as "always")
    runner._ddtree_early = None


def prepare_device_plan(runner, run_kernels: bool, capture=None) -> None:
    """The runner for ``DDTREE_DEVICE_PLAN``'s steps: a device planner on the runner's device, and the plan's
    graphs as stand-ins: with ``run_kernels`` every replay runs the step's work (the Triton kernels: under Triton's
    CPU interpreter, or compiled on a GPU), otherwise a replay is a no-op (the host's side of a replayed graph, as
    :func:`prepare_early`'s placement) and so is the kernels' work; ``capture``: a real one instead (a GPU's
    ``graphs.cuda_graph_capture``). Imports lazily: in an A/B, the side's own ``ddtree``."""
    from ddtree.vllm.device_plan import DevicePlanner
    from ddtree.vllm.graphs import ShapeGraphs

    cfg = runner.ddtree_cfg
    planner = DevicePlanner(
        runner.device,
        runner.max_num_reqs,
        cfg.draft_len,
        cfg.top_k,
        runner._ddtree_conv_window,
        runner._ddtree_buffers.words,
    )
    if not run_kernels:
        planner.build_and_lay_out = lambda *args: None
    runner._ddtree_device_planner = planner
    runner._ddtree_plan_graphs = ShapeGraphs(capture or placement_stand_in(run_kernels))
    runner._ddtree_step_graphs_on = True


def placement_stand_in(replays_run: bool):
    """A capture stand-in for the plan's graphs: a replay runs the work (``replays_run``; the capture itself runs
    nothing, as a CUDA capture's does not), or the work runs once at the capture and a replay does nothing (its
    outputs stay where that run left them, as a graph's do)."""

    def capture(work):
        if replays_run:
            return work
        work()
        return lambda: None

    return capture


def sampler_call(runner, vocab: int = 64):
    """After a :func:`plan_step`: the rejection sampler and its arguments for the planned step (all greedy, no
    constraints; the device walk stubbed with fixed rows, its cost the same on both sides of an A/B and a CPU's
    eager walk, not a graph replay). Imports lazily: in an A/B, the side's own ``ddtree`` is the one in
    ``sys.modules``."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.min_tokens import MinTokensRequests
    from ddtree.vllm.sampler import DDTreeRejectionSampler

    plan = runner._ddtree_plan
    drafts = [[0] * int(b) for b in plan.num_nodes - 1]
    metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    rows = torch.zeros((len(drafts), max(map(len, drafts)) + 1), dtype=torch.int32)
    runner._ddtree_min_tokens = MinTokensRequests()
    runner.ddtree_accept_on_device = lambda plan, tokens, width: {"output_tokens": rows}
    logits = torch.zeros((metadata.logits_indices.shape[0], vocab))
    sampling = SimpleNamespace(
        temperature=None, all_greedy=True, top_k=None, top_p=None, generators={}, no_penalties=True,
        bad_words_token_ids={}, allowed_token_ids_mask=None, max_num_logprobs=None,
    )  # fmt: skip
    return DDTreeRejectionSampler(runner), (metadata, None, logits, sampling)


def walk_call(runner):
    """After a :func:`plan_step`: the device walk's call for the planned step through walk graphs whose replay is
    a no-op stand-in (the host's side of a replayed walk: finding the graph, copying the target's tokens in). Its
    graphs are made once per runner; each step hands the trees object its plan got, as the runner does."""
    from ddtree.vllm.graphs import WalkGraphs

    graphs = getattr(runner, "_bench_walk_graphs", None)
    if graphs is None:
        graphs = runner._bench_walk_graphs = WalkGraphs(lambda work: lambda: None)
    plan = runner._ddtree_plan
    target = torch.zeros(plan.num_tree_tokens, dtype=torch.int64)
    args = (int(plan.num_nodes.max()), _draft_depth(plan) + 1, plan.num_tokens, plan.conv_window)
    return graphs.walk, (plan.device_trees, target, *args)


def _draft_depth(plan) -> int:
    """The plan's drafter depth (``trees.draft_depth`` in checkouts before device-planned steps, whose plans have no
    host trees until read)."""
    depth = getattr(plan, "draft_depth", None)
    return int(plan.trees.draft_depth) if depth is None else int(depth)


def tensor_ops(runner, output) -> int:
    """aten ops of one plan step that would run a kernel or a copy on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        plan_step(runner, output)

    def top_level(event) -> bool:  # an op called by Python, not one inside another op (to -> _to_copy -> copy_)
        parent = event.cpu_parent
        return parent is None or not parent.name.startswith("aten::")

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in NO_KERNEL and top_level(e))


class CacheSweep:
    """What an engine step runs between two visits of ddtree's code, as a stand-in: ~2,000 distinct small Python
    functions (instruction cache, branch predictors, the interpreter's caches) and a 32 MB array read (data caches).

    In vLLM's engine ddtree's host path runs once a step among much other Python, so it runs cold; a loop of the same
    step runs hot. On the development CPU the early path took 2.7x its hot time at batch 1 after such a sweep
    (1.35x at batch 32, where more of it is work on data), not from garbage collection (the same with it off): the
    likely part of the 3-8x between this bench and the H200 host's timers (``gpu-h200-5d593db``). ``--cold`` runs it
    before every timed step (untimed)."""

    def __init__(self, functions: int = 2000, floats: int = 4_000_000):
        self.data = np.random.default_rng(0).random(floats)
        self.functions = []
        for i in range(functions):
            namespace: Dict[str, Any] = {}
            exec(f"def f(x):\n    return [x * {i} for _ in range(3)]", namespace)  # a distinct code object each
            self.functions.append(namespace["f"])

    def __call__(self) -> None:
        self.data.sum()
        for function in self.functions:
            function(1)


def measure(
    batch: int,
    budget: int,
    depth: int,
    top_k: int,
    steps: int,
    rounds: int = 5,
    seed: int = 0,
    sweep=None,
) -> dict:
    """The best of ``rounds`` rounds' median step (a shared machine's noise only adds time), after 5 warm-up steps
    (the staging buffers' first allocations); ``sweep`` (a :class:`CacheSweep`) run before each step, untimed."""
    rng = np.random.default_rng(seed)
    runner = build_runner(batch, budget, depth, top_k)
    medians = []
    with vllm_parts_stubbed():
        for round_ in range(rounds):
            times = []
            for step in range(steps + (5 if round_ == 0 else 0)):
                output = defer_proposal(runner, rng)
                if sweep is not None:
                    sweep()
                start = time.perf_counter()
                plan_step(runner, output)
                times.append(time.perf_counter() - start)
            medians.append(float(np.median(times[-steps:])))
        ops = tensor_ops(runner, defer_proposal(runner, rng))
    return {
        "batch": batch,
        "budget": budget,
        "host_ms": 1e3 * min(medians),
        "tensor_ops": ops,
        "cold": sweep is not None,
    }


def subset_step(runner, output, finished: bool = True):
    """After a proposal for every request: the first request finishes (the store discards it, as the runner's
    ``_update_states`` does) and vLLM moves the last request into its row: the step's requests are the others, the
    last one first (``finished=False``: nothing finishes, the last request moves to the front). Returns the step's
    scheduler output (the runner's request list now the step's)."""
    req_ids = runner.req_ids
    if finished:
        runner.drafter.store.discard([req_ids[0]])
        req_ids[:] = [req_ids[-1], *req_ids[1:-1]]
    else:
        req_ids[:] = [req_ids[-1], *req_ids[:-1]]
    runner.input_batch.num_reqs = len(runner.req_ids)
    drafts = {req_id: output.scheduled_spec_decode_tokens[req_id] for req_id in runner.req_ids}
    size = len(next(iter(drafts.values())))
    return type(output)(
        total_num_scheduled_tokens=len(drafts) * (size + 1), scheduled_spec_decode_tokens=drafts, scheduled_new_reqs=[]
    )


def measure_subset_steps(
    batch: int, budget: int, depth: int, top_k: int, steps: int, rounds: int = 5, seed: int = 0, sweep=None
) -> dict:
    """The step after a request ends (:func:`subset_step`), its plan's host ms two ways in one process, step by step
    in turn: planned on the host (what the device plan leaves such a step to), and on the device with
    ``DDTREE_DEVICE_PLAN_SUBSETS`` (its graph's replay a no-op: the host's side of it). The best of ``rounds``
    rounds' medians each; ``sweep`` before every timed step, untimed."""
    if batch < 2:
        raise ValueError("a subset step needs a batch of 2 or more")
    runners = {}
    for name, subsets in (("host_plan", False), ("device_subset", True)):
        runner = build_runner(batch, budget, depth, top_k)
        prepare_device_plan(runner, run_kernels=False)
        runner._ddtree_device_subsets = subsets
        runners[name] = runner
    rng = np.random.default_rng(seed)
    times: Dict[str, List[float]] = {name: [] for name in runners}
    with vllm_parts_stubbed():
        for _ in range(5 + rounds * steps):
            for name, runner in runners.items():
                everyone = list(runner.req_ids)
                output = subset_step(runner, defer_proposal(runner, rng))
                if sweep is not None:
                    sweep()
                start = time.perf_counter()
                plan_step(runner, output)
                times[name].append(time.perf_counter() - start)
                runner.req_ids[:] = everyone
                runner.input_batch.num_reqs = len(everyone)
    row = {"batch": batch, "budget": budget, "cold": sweep is not None}
    for name, seconds in times.items():
        rounds_ = [seconds[5 + r * steps : 5 + (r + 1) * steps] for r in range(rounds)]
        row[f"{name}_ms"] = 1e3 * min(float(np.median(t)) for t in rounds_)
    row["device_subset_steps"] = runners["device_subset"].ddtree_stats.device_plan_subset_steps
    row["host_plan_device_steps"] = runners["host_plan"].ddtree_stats.device_plan_steps
    return row


def _ours(name: str) -> bool:
    return name == "ddtree" or name.startswith("ddtree.") or name == "bench_plan_path"


def load_package(checkout: str, core=None) -> Dict[str, Any]:
    """Imports ``checkout``'s ``python/ddtree`` and ``benches/bench_plan_path.py`` afresh; returns their modules
    (the Rust extension ``core`` shared: an extension loads once a process)."""
    for name in [name for name in sys.modules if _ours(name)]:
        del sys.modules[name]
    if core is not None:
        sys.modules["ddtree._core"] = core
    paths = [os.path.join(checkout, "benches"), os.path.join(checkout, "python")]
    sys.path[:0] = paths
    try:
        for module in (
            "ddtree",
            "ddtree.vllm.runner",
            "ddtree.vllm.proposer",
            "ddtree.vllm.sampler",
            "ddtree.vllm.launch_gate",
            "bench_plan_path",
        ):
            importlib.import_module(module)
    finally:
        del sys.path[: len(paths)]
    return {name: module for name, module in sys.modules.items() if _ours(name)}


def _timed_step(step_name: str, bench, runner, rng) -> float:
    """One proposal deferred (untimed), then the side's ``step_name`` (``plan_step``, ``early_step``) timed."""
    with bench.vllm_parts_stubbed():
        output = bench.defer_proposal(runner, rng)
        step = getattr(bench, step_name)  # the side's own module's function
        start = time.perf_counter()
        step(runner, output)
        return time.perf_counter() - start


def _timed_plan_step(bench, runner, rng, first: bool) -> float:
    return _timed_step("plan_step", bench, runner, rng)


def _timed_walk(bench, runner, rng, first: bool) -> float:
    with bench.vllm_parts_stubbed():
        bench.plan_step(runner, bench.defer_proposal(runner, rng))
    walk, args = walk_call(runner)
    if first:
        walk(*args)  # (the shape's first walk runs eagerly: not timed)
    start = time.perf_counter()
    walk(*args)
    return time.perf_counter() - start


def _timed_early_step(bench, runner, rng, first: bool) -> float:
    return _timed_step("early_step", bench, runner, rng)


def _timed_stats(bench, runner, rng, first: bool) -> float:
    """After a plan step (untimed): the statistics' host work of a device-walked step, as the runner does it (the
    step noted, or its path rows' copy sent in checkouts before the device ring, then the landed steps counted),
    its ring as each side's runner makes it. Where the walk writes the ring on the device, that write is the
    walk's (untimed here, as in a walk graph's replay)."""
    with bench.vllm_parts_stubbed():
        bench.plan_step(runner, bench.defer_proposal(runner, rng))
    plan = runner._ddtree_plan
    rows = torch.ones((int(plan.num_nodes.shape[0]), _draft_depth(plan) + 2), dtype=torch.int32)
    serial = getattr(plan, "step_serial", None)
    if serial is not None:
        runner._ddtree_counts.write(rows, torch.tensor([serial], dtype=torch.int64))
    start = time.perf_counter()
    sent = runner._ddtree_send_paths({"path_rows": rows}, plan)
    runner._ddtree_count_device_steps(*(sent if isinstance(sent, list) else [sent]))
    runner._ddtree_count_device_steps(*runner._ddtree_counts.landed(wait=False))
    return time.perf_counter() - start


def _timed_sampler_call(bench, runner, rng, first: bool) -> float:
    sampler, args = runner._bench_sampler_call
    start = time.perf_counter()
    sampler(*args)
    return time.perf_counter() - start


#: ``--path``: (what one timed step of a side does, the side's runner prepared for it).
TIMED_PATHS = {
    "plan": _timed_plan_step,
    "early": _timed_early_step,
    "walk": _timed_walk,
    "sampler": _timed_sampler_call,
    "stats": _timed_stats,
    "device": _timed_plan_step,
    "device-ab": _timed_plan_step,
}

#: Paths whose work differs from step to step by design (``stats`` reads its ring every few steps): compared by
#: the mean of their steps (the slowest 2% left out: the machine's hiccups), not the median step.
AMORTIZED_PATHS = {"stats"}


def _prepare_side(path: str, bench, runner, rng, modules, this: bool) -> None:
    graphs_module = modules["ddtree.vllm.graphs"]
    if path == "device" and this or path == "device-ab":
        bench.prepare_device_plan(runner, run_kernels=False)
    elif path == "device":  # the host plan, its placement a replayed graph as on a GPU
        runner._ddtree_plan_graphs = graphs_module.ShapeGraphs(placement_stand_in(False))
        runner._ddtree_step_graphs_on = True
    elif path == "early":
        bench.prepare_early(runner, graphs_module, modules["ddtree.vllm.launch_gate"])
    elif path == "walk":
        # The placement as a graph whose outputs stay where its capture left them (as on a GPU, where the walk's
        # trees are the upload's views and those outputs); its replay a no-op here.
        runner._ddtree_plan_graphs = graphs_module.ShapeGraphs(placement_stand_in(False))
        runner._ddtree_step_graphs_on = True
    elif path == "sampler":
        with bench.vllm_parts_stubbed():
            bench.plan_step(runner, bench.defer_proposal(runner, rng))
        runner._bench_sampler_call = sampler_call(runner)


def compare(
    baseline: str,
    loaded: str,
    batch: int,
    budget: int,
    depth: int,
    top_k: int,
    steps: int,
    path: str = "plan",
    sweep=None,
) -> dict:
    """Median plan step (``path`` "sampler": sampler call; "walk": the walk's call after each plan step) of this
    checkout and of ``baseline``, steps alternated (and which goes first, too); each side's modules are put back
    into ``sys.modules`` before its step (the runner and this bench import lazily; the sampler's and the walk's
    calls are made by this file's :func:`sampler_call` and :func:`walk_call` for both)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    first, second = (baseline, here) if loaded == "first" else (here, baseline)
    modules = {first: load_package(first)}
    modules[second] = load_package(second, modules[first]["ddtree._core"])
    sides = []
    for side, checkout in enumerate((baseline, here)):
        sys.modules.update(modules[checkout])
        bench = modules[checkout]["bench_plan_path"]
        runner, rng = bench.build_runner(batch, budget, depth, top_k), np.random.default_rng(0)
        _prepare_side(path, bench, runner, rng, modules[checkout], this=side == 1)
        sides.append((bench, runner, rng, checkout))
    timed = TIMED_PATHS[path]
    times: List[List[float]] = [[], []]
    warm_up = 50
    for step in range(2 * steps + warm_up):
        for s in (0, 1) if step % 2 == 0 else (1, 0):
            bench, runner, rng, checkout = sides[s]
            sys.modules.update(modules[checkout])
            if sweep is not None:
                sweep()
            times[s].append(timed(bench, runner, rng, step == 0))
    base, new = (_typical(t[warm_up:], amortized=path in AMORTIZED_PATHS) for t in times)
    return {
        "path": path,
        "batch": batch,
        "budget": budget,
        "baseline_loaded": loaded,
        "baseline_ms": 1e3 * base,
        "this_ms": 1e3 * new,
        "ratio": new / base,
        "cold": sweep is not None,
    }


def _typical(seconds: List[float], amortized: bool) -> float:
    """The median step; for an amortized path the mean of the steps without the slowest 2%."""
    if not amortized:
        return float(np.median(seconds))
    kept = np.sort(np.asarray(seconds))[: max(1, int(len(seconds) * 0.98))]
    return float(kept.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="steps per round (5 rounds)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--baseline", help="another checkout: an A/B against it in this process (see above)")
    parser.add_argument("--baseline-loaded", choices=("first", "second"), default="first")
    parser.add_argument(
        "--path",
        choices=tuple(TIMED_PATHS),
        default="plan",
        help="the A/B's timed path (sampler, walk, stats: --baseline only)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="a CacheSweep before every timed step: ddtree's code runs cold, as in vLLM"
    )
    parser.add_argument(
        "--subset",
        action="store_true",
        help="the step after a request ends instead: planned on the host against DDTREE_DEVICE_PLAN_SUBSETS, in turn",
    )
    args = parser.parse_args()
    sweep = CacheSweep() if args.cold else None
    if args.path != "plan" and not args.baseline:
        parser.error(f"--path {args.path} is an A/B: give --baseline")
    torch.set_num_threads(1)
    print(f"{platform.machine()}, python {platform.python_version()}, torch {torch.__version__}", flush=True)
    rows = []
    if args.subset:
        rows += [
            measure_subset_steps(b, args.budget, args.depth, args.top_k, args.steps, sweep=sweep) for b in args.batches
        ]
        for row in rows:
            print(
                f"subset step: budget {row['budget']:4d} batch {row['batch']:3d}: host plan {row['host_plan_ms']:.3f} "
                f"ms, device subset {row['device_subset_ms']:.3f} ms ({row['device_subset_steps']} device-planned)",
                flush=True,
            )
        args.batches = []
    if args.baseline:
        for batch in args.batches:
            row = compare(
                args.baseline,
                args.baseline_loaded,
                batch,
                args.budget,
                args.depth,
                args.top_k,
                10 * args.steps,
                args.path,
                sweep,
            )
            rows.append(row)
            print(
                f"{args.path}: budget {row['budget']:4d} batch {batch:3d}: this {row['this_ms']:.3f} ms, baseline "
                f"{row['baseline_ms']:.3f} ms (loaded {args.baseline_loaded}): {row['ratio']:.3f}x",
                flush=True,
            )
        args.batches = []
    for batch in args.batches:
        row = measure(batch, args.budget, args.depth, args.top_k, args.steps, sweep=sweep)
        rows.append(row)
        print(
            f"budget {row['budget']:4d} batch {batch:3d}: host {row['host_ms']:.3f} ms, "
            f"{row['tensor_ops']} tensor ops per step",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
