"""DDTree's spec-decode metrics in vLLM's front end (patch 9 of :mod:`ddtree.vllm.patches`).

Where vLLM 0.25's numbers come from. The engine-core process's scheduler makes one ``SpecDecodingStats`` per step
(``Scheduler.make_spec_decoding_stats``): for every request that verified drafts, ``observe_draft(num_draft_tokens,
num_accepted_tokens)`` with ``num_draft_tokens`` = the draft tokens it scheduled (for ddtree: the tree's nodes, ``B``
for a whole tree) and ``num_accepted_tokens`` = sampled tokens - 1 (the accepted path's length, at most the drafter's
depth ``L``). It crosses to the front end inside ``SchedulerStats`` in ``EngineCoreOutputs`` (a plain dataclass to
vLLM's msgpack encoder: every field arrives, the per-position lists included). There vLLM's
``PrometheusStatLogger`` (``SpecDecodingProm``) and ``LoggingStatLogger`` (``SpecDecodingLogging``) read it.

How vLLM's counters read for a ddtree engine (unchanged by this module):

* ``vllm:spec_decode_num_drafts``: trees verified;
* ``vllm:spec_decode_num_draft_tokens``: tree nodes verified (``B`` per whole tree);
* ``vllm:spec_decode_num_accepted_tokens``: accepted path tokens, so the mean acceptance length is
  ``1 + accepted / drafts`` (the bonus token included, as vLLM's own log line computes it);
* ``accepted / draft_tokens``, vLLM's "acceptance rate", is per tree node: 86 accepted of 54 trees of 64 nodes
  reads 2.5% for a mean acceptance length of 2.6;
* ``vllm:spec_decode_num_accepted_tokens_per_pos{position=p}``: trees whose accepted path reached depth ``p + 1``
  (right), with ``B`` positions of which those from ``L`` on are always 0.

What is added, computed in the front end from those fields alone (nothing new crosses the process boundary; the
engine core is untouched): ``vllm:spec_decode_ddtree_*`` counters of trees, partial trees, tree nodes and accepted
tokens by depth ``1..L``, and gauges of the budget and depth (:class:`DDTreeSpecDecodingProm`); and a log line
that gives the per-depth rates over ``L`` depths and calls the per-node ratio what it is
(:class:`DDTreeSpecDecodingLogging`). A partial tree is one verified with fewer nodes than the budget (the scheduler
cut it: ``max_model_len``, the step's token budget); it is read from ``num_draft_tokens_per_pos[B - 1]``, the
number of drafts with ``B`` tokens, which vLLM fills but never reads.

Input that does not have the expected shape (lists longer or shorter than ``B``, missing or non-integer values)
is counted as far as it goes and never raises here.

Cost: O(L) a step, not O(B), on the engine loop's path. vLLM's ``observe`` calls ``Counter.inc`` (~1 us) for each
of its ``B`` positions, those from ``L`` on with 0; DDTree's does the same counting (same counters, same errors on
odd input) but skips the zeros, and :func:`tree_counts` reads ``L`` accepted entries and two drafted ones per
budget (``benches/bench_metrics.py``, on a CPU: ~20-35 us a step at any budget; 240-430 us at B = 255 before).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import prometheus_client
from ddtree.vllm.log import get_logger
from vllm.v1.metrics.utils import create_metric_per_engine
from vllm.v1.spec_decode.metrics import SpecDecodingLogging, SpecDecodingProm

logger = get_logger(__name__)

PREFIX = "vllm:spec_decode_ddtree_"
TREES = PREFIX + "num_trees"
PARTIAL_TREES = PREFIX + "num_partial_trees"
TREE_NODES = PREFIX + "num_tree_nodes"
ACCEPTED_PER_DEPTH = PREFIX + "num_accepted_tokens_per_depth"
BUDGET = PREFIX + "budget"
BUDGET_IN_USE = PREFIX + "budget_in_use"
DRAFT_DEPTH = PREFIX + "draft_depth"


@dataclasses.dataclass(frozen=True)
class TreeCounts:
    """One ``SpecDecodingStats`` read as trees."""

    trees: int
    partial_trees: int  # verified with fewer nodes than any budget of the engine (cut by the scheduler)
    nodes: int
    accepted: int
    accepted_per_depth: Tuple[int, ...]  # [L]: [d - 1] = trees whose accepted path reached depth d
    budget_in_use: Optional[int] = None  # the budget most of the step's whole trees had (None: no whole tree)


def budget_tuple(budget: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    """An engine's budgets, ascending: one, or a budget schedule's; the largest sizes vLLM's draft slots."""
    if isinstance(budget, int):
        return (budget,)
    return tuple(sorted({int(b) for b in budget}))


def _count(value: Any) -> int:
    """A non-negative integer count (0 for anything else: None, NaN, text, negatives)."""
    if type(value) is int:  # what arrives: int(value) is value
        return value if value > 0 else 0
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return n if n > 0 else 0


def _items(values: Any) -> List[Any]:
    if values is None or isinstance(values, (str, bytes)):
        return []
    try:
        return list(values)
    except TypeError:
        return []


def _sequence(values: Any) -> Sequence[Any]:
    """``_items(values)`` without copying a list or a tuple (exact types only: a subclass may iterate otherwise)."""
    kind = type(values)
    return values if kind is list or kind is tuple else _items(values)


def _at_least(drafted: Sequence[Any], largest: int, index: int) -> int:
    """Drafts with more than ``index`` tokens: ``[_count(v) for v in drafted[:largest]] + [0]`` at ``index``
    (negative indices as a list's), reading that one entry only."""
    if index < 0:
        index += largest + 1
        if index < 0:
            raise IndexError("list index out of range")
    return _count(drafted[index]) if index < largest else 0


def tree_counts(stats: Any, budget: Union[int, Sequence[int]], depth: int) -> TreeCounts:
    """Reads one step's ``SpecDecodingStats`` of a ddtree engine as trees: ``budget`` is the engine's budget
    ``B`` (or a schedule's budgets, the largest sizing the lists), ``depth`` the drafter's ``L``.

    Reads ``L`` entries of the accepted list and two of the drafted list per budget, not the lists' ``B``."""
    budgets = budget_tuple(budget)
    largest = budgets[-1]
    trees = _count(getattr(stats, "num_drafts", 0))
    accepted = [_count(v) for v in _sequence(getattr(stats, "num_accepted_tokens_per_pos", None))[:depth]]
    accepted += [0] * (depth - len(accepted))
    drafted = _sequence(getattr(stats, "num_draft_tokens_per_pos", None))
    # drafted[p] counts drafts with more than p tokens, so drafts of exactly b tokens are drafted[b - 1] -
    # drafted[b]: whole trees of each budget. A list too short to say counts none as partial.
    whole: Dict[int, int] = {}
    if largest >= 1 and len(drafted) >= largest:
        whole = {b: max(_at_least(drafted, largest, b - 1) - _at_least(drafted, largest, b), 0) for b in budgets}
    partial = max(trees - sum(whole.values()), 0) if whole else 0
    in_use = max(whole, key=lambda b: (whole[b], b)) if any(whole.values()) else None
    return TreeCounts(
        trees=trees,
        partial_trees=partial,
        nodes=_count(getattr(stats, "num_draft_tokens", 0)),
        accepted=_count(getattr(stats, "num_accepted_tokens", 0)),
        accepted_per_depth=tuple(accepted),
        budget_in_use=in_use,
    )


_WARNED: set = set()


def _warn_once(kind: str, detail: str) -> None:
    if kind not in _WARNED:
        _WARNED.add(kind)
        logger.warning("DDTree: spec-decode stats not counted (%s); this warning is shown once", detail)


# ---- Prometheus ---------------------------------------------------------------------------------------------
def _int_sum(values: List[Any]) -> bool:
    """Whether ``values`` are ints (bools included): their sum is an int, in C (~7 ns a value)."""
    try:
        return type(sum(values)) is int
    except Exception:
        return False


#: The ``observe`` that ``_DDTreeProm._observe_vllm_counters`` reproduces: vLLM's own, as defined in its module
#: (None if something wrapped it before this module was imported: then whatever is there runs).
_VLLM_OBSERVE = SpecDecodingProm.__dict__.get("observe")
if getattr(_VLLM_OBSERVE, "__code__", None) is None or _VLLM_OBSERVE.__code__.co_filename != getattr(
    sys.modules.get(SpecDecodingProm.__module__), "__file__", None
):
    _VLLM_OBSERVE = None


class _DDTreeProm:
    """vLLM's ``SpecDecodingProm`` (its counters unchanged) plus DDTree's tree metrics, same labels.

    Mixed into the logger's own spec-decoding class (``SpecDecodingProm``, or Ray's subclass), whose
    ``_counter_cls`` it uses; gauges use the logger's ``_gauge_cls``.
    """

    def __init__(
        self,
        speculative_config: Any,
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
        is_diffusion: bool = False,
        *,
        budget: Union[int, Sequence[int]],
        depth: int,
        gauge_cls: Any = prometheus_client.Gauge,
    ):
        super().__init__(speculative_config, labelnames, per_engine_labelvalues, is_diffusion=is_diffusion)
        self.ddtree_budget, self.ddtree_depth = budget_tuple(budget), depth
        self.ddtree_enabled = bool(self.spec_decoding_enabled and not is_diffusion)
        if not self.ddtree_enabled:
            return

        def counter(name: str, doc: str) -> Dict[int, Any]:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.counter_ddtree_trees = counter(TREES, "Number of draft trees verified (DDTree).")
        self.counter_ddtree_partial_trees = counter(
            PARTIAL_TREES, "Number of draft trees verified with fewer nodes than proposed (DDTree)."
        )
        self.counter_ddtree_tree_nodes = counter(TREE_NODES, "Number of draft tree nodes verified (DDTree).")
        per_depth = self._counter_cls(
            name=ACCEPTED_PER_DEPTH,
            documentation="Draft trees whose accepted path reached each depth (DDTree).",
            labelnames=labelnames + ["depth"],
        )
        self.counter_ddtree_accepted_per_depth = {
            idx: [per_depth.labels(*lv, str(d)) for d in range(1, depth + 1)]
            for idx, lv in per_engine_labelvalues.items()
        }
        largest = self.ddtree_budget[-1]
        for name, doc, value in (
            (BUDGET, "Draft tree budget: nodes verified per whole tree, the largest of a schedule (DDTree).", largest),
            (BUDGET_IN_USE, "The budget of the last step's whole trees (a budget schedule's choice; DDTree).", largest),
            (DRAFT_DEPTH, "Drafter depth: deepest tree node, most tokens accepted per tree (DDTree).", depth),
        ):
            gauge = gauge_cls(name=name, documentation=doc, multiprocess_mode="mostrecent", labelnames=labelnames)
            children = create_metric_per_engine(gauge, per_engine_labelvalues)
            for child in children.values():
                child.set(value)
            if name == BUDGET_IN_USE:
                self.gauge_ddtree_budget_in_use = children

    def observe(self, spec_decoding_stats: Any, engine_idx: int = 0) -> None:
        vllm_observe = super().observe
        if getattr(vllm_observe, "__func__", None) is _VLLM_OBSERVE:
            self._observe_vllm_counters(spec_decoding_stats, engine_idx)
        else:  # a subclass's or a patched observe: run as it is
            vllm_observe(spec_decoding_stats, engine_idx)
        if not self.ddtree_enabled:
            return
        try:
            counts = tree_counts(spec_decoding_stats, self.ddtree_budget, self.ddtree_depth)
            if engine_idx not in self.counter_ddtree_trees:
                _warn_once("engine", f"unknown engine index {engine_idx!r}")
                return
            for counter, n in (
                (self.counter_ddtree_trees, counts.trees),
                (self.counter_ddtree_partial_trees, counts.partial_trees),
                (self.counter_ddtree_tree_nodes, counts.nodes),
            ):
                if n:  # counts are ints >= 0: inc(0) changes nothing
                    counter[engine_idx].inc(n)
            for child, n in zip(self.counter_ddtree_accepted_per_depth[engine_idx], counts.accepted_per_depth):
                if n:
                    child.inc(n)
            if counts.budget_in_use is not None:
                self.gauge_ddtree_budget_in_use[engine_idx].set(counts.budget_in_use)
        except Exception as error:  # metrics never take the front end down
            _warn_once(type(error).__name__, f"{type(error).__name__}: {error}")

    def _observe_vllm_counters(self, stats: Any, engine_idx: int) -> None:
        """vLLM 0.25's ``SpecDecodingProm.observe``, counter for counter and error for error, less its per-position
        ``Counter.inc(0)`` calls (no-ops: prometheus adds 0, Ray's wrapper returns): ``B`` per step, of which
        those from ``L`` on are always 0 for a ddtree engine.

        The fast path takes a list of the counters' length whose values are all ints (their sum is an int: a
        float, ``Decimal``, numpy scalar... anywhere makes it something else, ``None`` or text makes it raise);
        it increments the first ``L`` positions' nonzero values, and the later positions' too when any is nonzero.
        Anything else runs vLLM's loop as vLLM writes it."""
        if not self.spec_decoding_enabled:
            return
        self.counter_spec_decode_num_drafts[engine_idx].inc(stats.num_drafts)
        self.counter_spec_decode_num_draft_tokens[engine_idx].inc(stats.num_draft_tokens)
        self.counter_spec_decode_num_accepted_tokens[engine_idx].inc(stats.num_accepted_tokens)
        counters = self.counter_spec_decode_num_accepted_tokens_per_pos.get(engine_idx, [])
        if not counters:
            return
        values = stats.num_accepted_tokens_per_pos
        if type(values) is list and len(values) == len(counters) and _int_sum(values):
            head = values[: max(self.ddtree_depth, 0)]
            if values.count(0) - head.count(0) != len(values) - len(head):
                head = values  # a nonzero beyond the drafter's depth (not a ddtree step's): counted as vLLM does
            for counter, value in zip(counters, head):
                if value:
                    counter.inc(value)
            return
        for pos, counter in enumerate(counters):
            counter.inc(stats.num_accepted_tokens_per_pos[pos])


@functools.lru_cache(maxsize=None)
def _prom_class(base: type) -> type:
    return type("DDTree" + base.__name__, (_DDTreeProm, base), {"__module__": __name__})


DDTreeSpecDecodingProm = _prom_class(SpecDecodingProm)


def spec_decoding_prom_factory(base: type, gauge_cls: Any, budget: Union[int, Sequence[int]], depth: int):
    """What a ddtree engine's ``PrometheusStatLogger`` builds instead of ``base`` (same call signature)."""
    return functools.partial(_prom_class(base), budget=budget, depth=depth, gauge_cls=gauge_cls)


# ---- log line -----------------------------------------------------------------------------------------------
class DDTreeSpecDecodingLogging(SpecDecodingLogging):
    """vLLM's periodic "SpecDecoding metrics" line, read as trees.

    Same first fields as vLLM's (mean acceptance length, accepted throughput); then trees and partial trees, the
    mean nodes per tree against the budget, per-depth acceptance rates over the drafter's ``L`` depths (vLLM prints
    ``B`` positions), and vLLM's "Avg Draft acceptance rate" under its real meaning, accepted per tree node.
    """

    def __init__(self, budget: Union[int, Sequence[int]], depth: int):
        self.budget, self.depth = budget_tuple(budget), depth
        super().__init__(is_diffusion=False)

    def reset(self) -> None:
        super().reset()
        self.observed = 0
        self.trees = self.partial_trees = self.nodes = self.accepted = 0
        self.accepted_per_depth = np.zeros(self.depth, dtype=np.int64)

    def observe(self, spec_decoding_stats: Any) -> None:
        try:
            counts = tree_counts(spec_decoding_stats, self.budget, self.depth)
        except Exception as error:  # metrics never take the front end down
            _warn_once(type(error).__name__, f"{type(error).__name__}: {error}")
            return
        self.observed += 1
        self.trees += counts.trees
        self.partial_trees += counts.partial_trees
        self.nodes += counts.nodes
        self.accepted += counts.accepted
        self.accepted_per_depth += np.asarray(counts.accepted_per_depth, dtype=np.int64)

    def log(self, log_fn=logger.info) -> None:
        if not self.observed or not self.trees:
            self.reset()
            return
        elapsed = time.monotonic() - self.last_log_time
        throughput = self.accepted / elapsed if elapsed > 0 else 0.0
        rates = ", ".join(f"{r:.3f}" for r in self.accepted_per_depth / self.trees)
        log_fn(
            "SpecDecoding metrics: "
            "Mean acceptance length: %.2f, "
            "Accepted throughput: %.2f tokens/s, "
            "Accepted: %d tokens, "
            "Trees: %d (partial: %d), "
            "Mean tree nodes: %.1f of budget %s, "
            "Per-depth acceptance rate (depth 1-%d): %s, "
            "Accepted per tree node: %.1f%%",
            1 + self.accepted / self.trees,
            throughput,
            self.accepted,
            self.trees,
            self.partial_trees,
            self.nodes / self.trees,
            "/".join(str(b) for b in reversed(self.budget)),
            self.depth,
            rates,
            100.0 * self.accepted / self.nodes if self.nodes else float("nan"),
        )
        self.reset()
