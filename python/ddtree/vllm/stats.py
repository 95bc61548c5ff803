"""The runner's own statistics beyond vLLM's spec-decode metrics, and the timers of ddtree's host work.

:class:`DDTreeStats` counts what the verify steps did (trees, cut and filler trees, nodes, acceptance by depth, the
graphs replayed, the device plan's steps, what smaller budgets and the chain would have accepted) and times ddtree's
host work by part (``timed``: plan, accept, commit, defer, stats) and, on demand, by piece (``detail``). The runner's
summary (``llm.collective_rpc("ddtree_summary")``) reads it; :mod:`ddtree.vllm.metrics` turns its counters into
``vllm:spec_decode_ddtree_*`` series.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np
import vllm.envs as envs
from vllm.v1.utils import record_function_or_nullcontext

from ddtree.vllm.host_profile import HostProfile
from ddtree.vllm.step import AcceptPlan, VerifyPlan, cut_trees, prefill_beside_trees
from ddtree.vllm.what_if import WhatIfAcceptance, whole_proposed_trees

if TYPE_CHECKING:
    from ddtree.vllm.auto_budget import AutoBudget
    from ddtree.vllm.graphs import GraphKey

#: The verify steps whose trees also count what smaller budgets and the chain would have accepted: one in this many.
WHAT_IF_EVERY = 4
#: ... of the device-planned steps (``DDTREE_DEVICE_PLAN``), whose trees the host builds only to count them (from
#: the step's top-K, a Rust build of every tree): a sparser sample keeps that build off most steps' host path.
WHAT_IF_EVERY_DEVICE_PLANNED = 16
#: Verify steps whose tree counts ``DDTreeStats`` keeps before one numpy pass counts them (read at any time: a read
#: counts what is pending first).
FOLD_EVERY = 64


def profiler_scopes_on() -> bool:
    """Whether vLLM's named profiler ranges are on in this process (VLLM_CUSTOM_SCOPES_FOR_PROFILING or
    VLLM_NVTX_SCOPES_FOR_PROFILING: vLLM reads them at its first range, before any step)."""
    names = ("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "VLLM_NVTX_SCOPES_FOR_PROFILING")
    return any(bool(getattr(envs, name, False)) for name in names)


class PartTimer:
    """One timed block of :meth:`DDTreeStats.timed` (a class: ``contextlib.contextmanager``'s generator cost ~2 us
    more a block, and a step runs about eight)."""

    __slots__ = ("seconds", "part", "start")

    def __init__(self, seconds: Dict[str, float], part: str):
        self.seconds, self.part = seconds, part

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds[self.part] = self.seconds.get(self.part, 0.0) + time.perf_counter() - self.start


class ScopedPartTimer(PartTimer):
    """A :class:`PartTimer` that is also a profiler range ("ddtree: <part>"), when vLLM's ranges are on. Otherwise
    the range would be a ``nullcontext`` made, entered and left: ~0.7 us a block on a development CPU, five or six
    blocks a step."""

    __slots__ = ("scope",)

    def __enter__(self) -> None:
        self.scope = record_function_or_nullcontext("ddtree: " + self.part)
        self.scope.__enter__()
        super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.scope.__exit__(*exc)


class DetailTimer:
    """One block of :meth:`DDTreeStats.detail`: its host seconds added to ``seconds[name]``, nothing else (no
    profiler range: a part's details run several times a step, ~0.7 us each on a development CPU)."""

    __slots__ = ("seconds", "name", "start")

    def __init__(self, seconds: Dict[str, float], name: str):
        self.seconds, self.name = seconds, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds[self.name] = self.seconds.get(self.name, 0.0) + time.perf_counter() - self.start


class _NoDetail:
    """:meth:`DDTreeStats.detail` while the pieces are not timed: a block that does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


NO_DETAIL = _NoDetail()


class ProfiledPartTimer(ScopedPartTimer):
    """A :class:`PartTimer` whose block also runs under a host profile (:meth:`DDTreeStats.start_host_profile`)."""

    __slots__ = ("profile",)

    def __init__(self, seconds: Dict[str, float], part: str, profile: HostProfile):
        super().__init__(seconds, part)
        self.profile = profile

    def __enter__(self) -> None:
        super().__enter__()
        self.profile.enter(self.part)

    def __exit__(self, *exc) -> None:
        self.profile.exit()
        super().__exit__(*exc)


class DDTreeStats:
    """Counters beyond vLLM's spec-decode metrics (which stay right on their own)."""

    def __init__(self, depth: int, smaller_budgets: Sequence[int] = ()):
        self.steps = 0
        self.full_graph_steps = 0  # verify steps that replayed a FULL CUDA graph
        self.full_graph_steps_by_tree_tokens: Dict[int, int] = {}  # the same, by the graph's tokens per tree
        self.commit_graph_steps = 0  # FULL steps whose GDN commit replayed a commit graph
        self.commit_in_place_steps = 0  # ... of them, steps whose graph read the walk's paths in place
        # Prefix caching with a hybrid target: trees whose path could reach the end of their root's state block (a
        # boundary commit, written where the path did reach it), and the steps with one.
        self.boundary_commit_trees = 0
        self.boundary_commit_steps = 0
        self.fresh_state_trees = 0  # new requests whose first step verified a tree from zeroed states
        self.walk_graph_steps = 0  # steps whose device walk replayed a walk graph (FULL steps, and mixed ones)
        self.mixed_walk_graph_steps = 0  # ... of them, steps with a prefill beside the trees (not a FULL graph's)
        self.walk_copied_steps = 0  # ... walked by a graph that copied its trees in (they were not where it reads)
        self.walk_target_in_place_steps = 0  # ... whose node tokens the sampler wrote where the graph reads them
        self.prefill_beside_trees_steps = 0  # verify steps with other tokens than tree tokens (a prefill's) in them
        self.device_accept_steps = 0  # verify steps whose trees were walked on the device (DDTREE_DEVICE_ACCEPT)
        self.late_tree_steps = 0  # verify steps whose trees were built at verification (DDTREE_LATE_TREES)
        self.early_launch_steps = 0  # of those, steps whose forward was queued before the trees (DDTREE_LAUNCH_AHEAD)
        self.landed_before_launch_steps = 0  # ... and steps that could have been, but the drafter had finished
        self.early_output_steps = 0  # steps whose chain rows reached vLLM's bookkeeping ahead of the drafter
        self.device_plan_steps = 0  # late tree steps whose trees were built and laid out on the device
        self.device_plan_resumed_steps = 0  # ... of them, steps that uploaded nothing (the device held all they read)
        # ... of them, steps of some of the proposal's requests (DDTREE_DEVICE_PLAN_SUBSETS)
        self.device_plan_subset_steps = 0
        # Steps the device plan turned down, by why (the host planned them): which check a workload's host-planned
        # steps fail, where the device plan is on.
        self.device_plan_declined_steps: Dict[str, int] = {}
        self.precaptured_device_plans = 0  # sizes whose device-plan graph DDTREE_PRECAPTURE captured at start-up
        self.precaptured_subset_plans = 0  # ... and whose subset steps' graph too (DDTREE_DEVICE_PLAN_SUBSETS)
        self.sliding_drafter_steps = 0  # drafter passes whose sliding-window layers got their own metadata
        # The tree counters (read through the properties below: ``trees``, ``partial_trees`` (verified with fewer
        # nodes than proposed: max_model_len, token budget), ``filler_trees`` (placeholders without a proposal,
        # asynchronous scheduling), ``nodes``, ``accepted``, ``accepted_per_depth``, ``steps_by_budget``), folded
        # in FOLD_EVERY steps at a time: one step's own numpy was ~10 small-array calls on the engine loop's path.
        self._counters = {"trees": 0, "partial_trees": 0, "filler_trees": 0, "nodes": 0, "accepted": 0}
        self._accepted_per_depth = np.zeros(depth + 1, dtype=np.int64)
        self._steps_by_budget: Dict[int, int] = {}  # verify steps by the budget their trees were proposed with
        self._unfolded: List[Tuple[np.ndarray, np.ndarray, int, np.ndarray]] = []
        # Host (CPU) seconds DDTree adds, by part (build, plan, accept, commit, defer, and stats: the statistics and
        # ``auto``'s bookkeeping after sampling); GPU waits are outside the timed blocks.
        self.host_seconds: Dict[str, float] = {}
        # Host seconds of vLLM's own parts that sit between a step's trees and its verification: the target's
        # forward launch (a FULL step: one CUDA-graph replay). Trees built late make the GPU wait through it.
        self.vllm_host_seconds: Dict[str, float] = {}
        # Host seconds inside the replays of ddtree's own step graphs, by graph (walk, plan, kv moves, commit): part
        # of the timed parts above; a launch waits there when the GPU's queue is full (a GPU-bound step).
        self.graph_launch_seconds: Dict[str, float] = {}
        # Host seconds of named pieces inside the timed parts ("plan: device upload", "defer: copy", ...:
        # :meth:`detail`): what a part is made of, measured without a profiler's overhead (part of the parts, not
        # added to them). Off unless asked for (``detail_on``, the benches' --host-pieces): ~0.7 us a piece on a
        # development CPU, ten pieces a step.
        self.detail_seconds: Dict[str, float] = {}
        self.detail_on = False
        self.profiler_scopes = profiler_scopes_on()  # (the timed parts are profiler ranges too)
        # Steps that ran one of ddtree's step-graph shapes for the first time (``ShapeGraphs.first_runs``: compiles,
        # allocations, a capture that synchronizes the device; tens of ms, once per shape) keep their host seconds
        # here, by part, instead of in the two dicts above, whose per-step figures are then the steady state's. At
        # batch 32 a batch shrinking request by request meets a new shape at most steps of its first run.
        self.first_run_steps = 0
        self.first_run_host_seconds: Dict[str, float] = {}
        self.precaptured_sizes = 0  # FULL sizes whose step graphs were captured at start-up (DDTREE_PRECAPTURE)
        self.precaptured_commits = 0  # ... whose commit's graphs were too (DDTREE_PRECAPTURE=all)
        self._step_mark: Tuple[int, Dict[str, float], Dict[str, float], Dict[str, float]] = (0, {}, {}, {})
        # What smaller budgets and vLLM's DFlash chain would have accepted on the same trees (``what_if``), on every
        # WHAT_IF_EVERY-th verify step, WHAT_IF_EVERY_DEVICE_PLANNED-th of device-planned ones (a systematic sample
        # of the traffic; the sampled steps are kept and counted 16 at a time, in one numpy pass).
        self.what_if = WhatIfAcceptance(smaller_budgets)
        self.auto: Optional[AutoBudget] = None  # ``ddtree_budget: "auto"``: fed every verify step
        self.host_profile: Optional[HostProfile] = None  # ``start_host_profile``'s window (None: off)

    def close_step(self, first_runs: int) -> None:
        """Called as each engine step starts, with ``ShapeGraphs.first_runs``: when the step since the last call ran
        a graph shape for the first time, its host seconds move to ``first_run_host_seconds`` (its launch seconds,
        part of them, are dropped with it) and it counts in ``first_run_steps``."""
        runs, host, launches, details = self._step_mark
        if first_runs != runs:  # (start-up captures too: their pieces are no step's)
            self.detail_seconds.clear()
            self.detail_seconds.update(details)
        # (First runs without any host work since the mark are start-up captures, DDTREE_PRECAPTURE: no step.)
        if first_runs != runs and self.host_seconds != host:
            self.first_run_steps += 1
            for part, seconds in self.host_seconds.items():
                moved = seconds - host.get(part, 0.0)
                self.host_seconds[part] = host.get(part, 0.0)
                self.first_run_host_seconds[part] = self.first_run_host_seconds.get(part, 0.0) + moved
            self.graph_launch_seconds.clear()
            self.graph_launch_seconds.update(launches)
        self._step_mark = (
            first_runs,
            dict(self.host_seconds),
            dict(self.graph_launch_seconds),
            dict(self.detail_seconds),
        )

    def timed(self, part: str) -> "PartTimer":
        """``with stats.timed(part):`` adds the block's host seconds to ``host_seconds[part]``; also a profiler range
        ("ddtree: <part>") when vLLM's custom profiling scopes are on (VLLM_CUSTOM_SCOPES_FOR_PROFILING=1), beside
        vLLM's own "gpu_model_runner: ..." ranges."""
        if self.host_profile is not None:
            return ProfiledPartTimer(self.host_seconds, part, self.host_profile)
        if self.profiler_scopes:
            return ScopedPartTimer(self.host_seconds, part)
        return PartTimer(self.host_seconds, part)

    def detail(self, name: str):
        """``with stats.detail(name):`` adds the block's host seconds to ``detail_seconds[name]``, a piece of the
        timed part around it (``host_detail_ms_per_verify_step`` in the summary; a first-run step's are dropped
        with its launches), while ``detail_on``; otherwise a block that does nothing."""
        return DetailTimer(self.detail_seconds, name) if self.detail_on else NO_DETAIL

    def start_host_profile(self) -> None:
        """Profiles every timed block from now on (:class:`ddtree.vllm.host_profile.HostProfile`: ``cProfile``,
        function by function, and the garbage collections inside the blocks) until :meth:`stop_host_profile`. The
        profiler slows what it profiles: a profiled window's host seconds are not the engine's."""
        if self.host_profile is not None:
            self.host_profile.close()  # (a window left open: ended, its callback removed)
        self.host_profile = HostProfile(self.steps)

    def stop_host_profile(self, limit: int = 40) -> str:
        """The window since :meth:`start_host_profile` as text (``HostProfile.report``); profiling stops."""
        if self.host_profile is None:
            raise RuntimeError("DDTree: no host profile was started (start_host_profile)")
        profile, self.host_profile = self.host_profile, None
        return profile.report(self.steps, limit)

    def device_plan_declined(self, reason: str) -> None:
        """One step the device plan turned down for ``reason`` (planned on the host)."""
        self.device_plan_declined_steps[reason] = self.device_plan_declined_steps.get(reason, 0) + 1

    def count_verify_step(self, plan: VerifyPlan, graph: Optional[GraphKey]) -> None:
        """One verify step, the FULL graph that replayed it (None: none did) and whether other tokens than its trees'
        (a prefill's) were scheduled beside them."""
        self.count_full_graph(graph)
        if graph is None:  # (a FULL graph's step is trees only: no sum on the steady path)
            self.prefill_beside_trees_steps += prefill_beside_trees(plan)

    def count_full_graph(self, graph: Optional[GraphKey]) -> None:
        """One verify step and the FULL graph, (tokens, trees), that replayed it (None: none did)."""
        if graph is not None:
            tokens_per_tree = graph[0] // graph[1]
            self.full_graph_steps += 1
            by_tree = self.full_graph_steps_by_tree_tokens
            by_tree[tokens_per_tree] = by_tree.get(tokens_per_tree, 0) + 1

    def observe(self, plan: VerifyPlan, accept: AcceptPlan) -> None:
        self.observe_paths(plan, accept.paths, accept.path_lengths)

    def observe_paths(self, plan: VerifyPlan, paths: np.ndarray, path_lengths: np.ndarray) -> None:
        """One verify step: each tree's accepted path (``paths`` ``[R, P]``, tree-local nodes from the root,
        ``path_lengths`` ``[R]`` of them)."""
        acc = np.asarray(path_lengths, dtype=np.int64) - 1  # (a new array: kept as it is)
        self._observe_own_counts(plan, acc)
        self._observe_samples(plan, paths, acc)

    def _observe_samples(self, plan: VerifyPlan, paths: np.ndarray, acc: np.ndarray) -> None:
        """The observed step (``self.steps`` counts it already) for the what-if sample and ``auto``."""
        every = WHAT_IF_EVERY if plan.trees is not None else WHAT_IF_EVERY_DEVICE_PLANNED
        if (self.steps - 1) % every == 0:
            self.what_if.observe(plan, paths, acc)
        if self.auto is not None:  # every step: its first choice should not wait for a sample of the traffic
            paths = np.asarray(paths, dtype=np.int64)
            self.auto.observe(plan.num_nodes - 1, whole_proposed_trees(plan), paths[:, 1:], acc)

    def observe_device_steps(self, steps: Sequence[Tuple[VerifyPlan, np.ndarray]]) -> None:
        """Device-walked steps whose path rows landed together (``PathRing``), ``(plan, rows)`` each: ``rows``
        ``[R, 1 + P]``, each tree's path length, then its path. :meth:`observe_paths` of each, the lengths
        converted in one pass (one read of the ring hands 16 steps: per step, the conversion and the call were
        ~5 us of a batch-1 step's host work on a development CPU)."""
        if not steps:
            return
        lengths = np.concatenate([rows[:, 0] for _, rows in steps]).astype(np.int64) - 1
        start = 0
        for plan, rows in steps:
            end = start + rows.shape[0]
            acc = lengths[start:end]  # (a view of an array nothing else holds: kept as it is)
            start = end
            self._observe_own_counts(plan, acc)
            self._observe_samples(plan, rows[:, 1:], acc)
        self.device_accept_steps += len(steps)

    def observe_counts(self, plan: VerifyPlan, acc: np.ndarray) -> None:
        """One verify step whose trees accepted ``acc`` ``[R]`` drafts each (copied: it may be a view of a reused
        buffer); counted at the next fold."""
        self._observe_own_counts(plan, np.array(acc, dtype=np.int64))

    def _observe_own_counts(self, plan: VerifyPlan, acc: np.ndarray) -> None:
        """:meth:`observe_counts` of an int64 ``acc`` that nothing else holds (kept, not copied)."""
        self.steps += 1
        self._unfolded.append((plan.num_nodes, plan.proposed_budgets, plan.num_filler_trees, acc))
        if len(self._unfolded) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Counts the observed steps not counted yet, all in one pass."""
        steps, self._unfolded = self._unfolded, []
        if not steps:
            return
        num_nodes = np.concatenate([step[0] for step in steps])
        proposed = np.concatenate([step[1] for step in steps])
        acc = np.concatenate([step[3] for step in steps])
        counters = self._counters
        counters["trees"] += acc.shape[0]
        counters["nodes"] += int(num_nodes.sum()) - num_nodes.shape[0]
        counters["partial_trees"] += cut_trees(num_nodes, proposed)
        counters["filler_trees"] += sum(step[2] for step in steps)
        counters["accepted"] += int(acc.sum())
        # Each step's budget: the largest its trees were proposed with (a schedule's choice).
        sizes = np.array([step[1].shape[0] for step in steps])
        starts = (np.cumsum(sizes) - sizes)[sizes > 0]
        if starts.shape[0]:
            budgets, counts = np.unique(np.maximum.reduceat(proposed, starts), return_counts=True)
            for budget, count in zip(budgets.tolist(), counts.tolist()):
                self._steps_by_budget[budget] = self._steps_by_budget.get(budget, 0) + count
        # accepted_per_depth[d] = trees whose accepted path reached depth d
        depths = self._accepted_per_depth.shape[0]
        reached = np.bincount(acc, minlength=depths)[::-1].cumsum()[::-1][:depths]
        self._accepted_per_depth[: reached.shape[0]] += reached

    def _folded(self, name: str):
        self._fold()
        return self._counters[name]

    trees = property(lambda self: self._folded("trees"))
    partial_trees = property(lambda self: self._folded("partial_trees"))
    filler_trees = property(lambda self: self._folded("filler_trees"))
    nodes = property(lambda self: self._folded("nodes"))
    accepted = property(lambda self: self._folded("accepted"))

    @property
    def accepted_per_depth(self) -> np.ndarray:
        self._fold()
        return self._accepted_per_depth

    @property
    def steps_by_budget(self) -> Dict[int, int]:
        self._fold()
        return self._steps_by_budget

    def summary(self) -> Dict[str, object]:
        trees = max(self.trees, 1)
        return {
            "verify_steps": self.steps,
            "full_graph_steps": self.full_graph_steps,
            "full_graph_steps_by_tree_tokens": dict(sorted(self.full_graph_steps_by_tree_tokens.items())),
            "commit_graph_steps": self.commit_graph_steps,
            "commit_in_place_steps": self.commit_in_place_steps,
            "boundary_commit_trees": self.boundary_commit_trees,
            "fresh_state_trees": self.fresh_state_trees,
            "boundary_commit_steps": self.boundary_commit_steps,
            "walk_graph_steps": self.walk_graph_steps,
            "mixed_walk_graph_steps": self.mixed_walk_graph_steps,
            "prefill_beside_trees_steps": self.prefill_beside_trees_steps,
            "walk_copied_steps": self.walk_copied_steps,
            "walk_target_in_place_steps": self.walk_target_in_place_steps,
            "device_accept_steps": self.device_accept_steps,
            "late_tree_steps": self.late_tree_steps,
            "early_launch_steps": self.early_launch_steps,
            "landed_before_launch_steps": self.landed_before_launch_steps,
            "early_output_steps": self.early_output_steps,
            "device_plan_steps": self.device_plan_steps,
            "device_plan_resumed_steps": self.device_plan_resumed_steps,
            "device_plan_subset_steps": self.device_plan_subset_steps,
            "device_plan_declined_steps": dict(sorted(self.device_plan_declined_steps.items())),
            "precaptured_subset_plans": self.precaptured_subset_plans,
            "precaptured_device_plans": self.precaptured_device_plans,
            "sliding_drafter_steps": self.sliding_drafter_steps,
            "trees": self.trees,
            "partial_trees": self.partial_trees,
            "filler_trees": self.filler_trees,
            "steps_by_budget": dict(sorted(self.steps_by_budget.items())),
            "mean_draft_nodes": self.nodes / trees,
            "mean_acceptance_length": 1.0 + self.accepted / trees,
            "acceptance_rate_per_depth": (self.accepted_per_depth[1:] / trees).tolist(),
            **{f"acceptance_length_if_{what}": result for what, result in self.what_if.summary().items()},
            **({"auto_budget": self.auto.summary()} if self.auto is not None else {}),
            # ddtree's host parts and their graph launches over the steady steps (no first run of a graph shape);
            # the first runs' host ms in total, apart.
            "steady_verify_steps": self.steady_steps,
            "host_ms_per_verify_step": self._per_verify_step_ms(self.host_seconds, self.steady_steps),
            "vllm_host_ms_per_verify_step": self._per_verify_step_ms(self.vllm_host_seconds, self.steps),
            "graph_launch_ms_per_verify_step": self._per_verify_step_ms(self.graph_launch_seconds, self.steady_steps),
            "host_detail_ms_per_verify_step": self._per_verify_step_ms(self.detail_seconds, self.steady_steps),
            "first_run_steps": self.first_run_steps,
            "precaptured_sizes": self.precaptured_sizes,
            "precaptured_commits": self.precaptured_commits,
            "first_run_host_ms": {part: 1e3 * s for part, s in sorted(self.first_run_host_seconds.items())},
        }

    @property
    def steady_steps(self) -> int:
        """Verify steps that ran no step-graph shape for the first time."""
        return max(self.steps - self.first_run_steps, 0)

    @staticmethod
    def _per_verify_step_ms(seconds_by_part: Dict[str, float], steps: int) -> Dict[str, float]:
        return {part: 1e3 * seconds / max(steps, 1) for part, seconds in sorted(seconds_by_part.items())}
